"""A LayerNorm whose output is quantized as it is made: ``torch.ops.fuselab.layer_norm_quantize_rows`` (a scale per
row) and ``layer_norm_quantize_static`` (one given scale).

In a quantized decoder each quantized linear quantizes its own input on every call: q, k and v each read the
norm's output and write int8 rows of it (three passes over the same activations, after the norm's own write
and before its read), fc1 once more. A ``QuantizedLayerNorm`` computes each row's layer norm, rounds it to the
model's dtype (what ``nn.LayerNorm`` returns), and writes that row quantized (int8, or fp8 e4m3, with one fp32
scale) instead: one pass, read once and written in one byte a value, for every linear that reads it.

Its output is a ``QuantizedRows``: a tensor of the norm's shape and dtype holding only the quantized rows, which
fuselab's quantized linears (``Int8Linear``, ``Float8Linear``) take as their quantized input. Any other
use raises a RuntimeError naming it: no float copy is kept, so nothing can go stale or be read in place of the
norm's values. ``quantize_(model, config)`` with ``fuse_norms=True`` makes these where a decoder layer's norm
feeds only quantized linears (transformers' OPT with the norm first, GPT-2); the report lists them. With static
activations (``layer_norm_quantize_static``) each row is written once per reader (up to three: q, k and v),
quantized with that reader's calibrated scale: one read, a one-byte copy each, the values each reader would make.

The layer norm is fp32 math (mean, then the variance of the centered row; IEEE division and square root), so a
row's values can differ from PyTorch's kernel in the last bit of the model's dtype, and a quantized value by one
step where that bit decides its rounding. PyTorch's path (a CPU without the interpreter) is ``F.layer_norm`` then
``quantize_rows``' arithmetic, the unfused layers' exactly. Where the fused form cannot serve a call (gradients
wanted, autocast, a traced or compiled call, forward-mode AD, another dtype for the norm's parameters), the
module returns ``F.layer_norm``'s output and the linears quantize it themselves (torch.jit.trace too).
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from fuselab.kernels._casts import cast_rne
from fuselab.kernels._runtime import (
    INTERPRET,
    call_untraced,
    in_dual_level,
    is_tracing,
    launch,
    launch_planned,
    plan_layout,
    register_op,
    untraced,
)
from fuselab.quant.rowwise import (
    _TINY,
    FP8_DTYPE,
    FP8_MAX,
    INT8_QMAX,
    _check,
    _quantize,
    _quantize_static,
    _row_scale,
    _rows,
    _runs_triton,
    _torch_rowwise,
    _torch_static,
    check_static_scale,
)

MAX_K = 16384  # a row is normalized and quantized in registers, in one block
MAX_STATIC_READERS = 3  # static scales one pass quantizes a row with (q, k and v's): a copy of the row each

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def layer_norm_quantize_rows_kernel(x_ptr, w_ptr, b_ptr, q_ptr, scale_ptr, scale1_ptr, scale2_ptr, K, stride_xm,
                                    stride_qm, stride_qr, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                                    QMAX: tl.constexpr, TINY: tl.constexpr, TO_INT8: tl.constexpr,
                                    STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per row: its layer norm in fp32, rounded to x's dtype, then its scale and quantized values; with
    STATIC scales (1 to 3, at scale_ptr, scale1_ptr, scale2_ptr) the row quantized with each, the r-th at
    q_ptr + r * stride_qr."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    inside = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=inside, other=0.0).to(tl.float32)
    n = tl.sum(inside.to(tl.float32), axis=0)  # K as fp32 (a K of 1 is a constexpr where Triton specializes it)
    mean = tl.math.div_rn(tl.sum(x, axis=0), n)
    centered = tl.where(inside, x - mean, 0.0)
    var = tl.math.div_rn(tl.sum(centered * centered, axis=0), n)
    y = centered * tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y = cast_rne(y, x_ptr.dtype.element_ty).to(tl.float32)  # the norm's output as nn.LayerNorm returns it
    y = tl.where(inside, y, 0.0)
    q_row = q_ptr + row * stride_qm + offs
    if STATIC > 0:
        tl.store(q_row, _quantize_static(y, tl.load(scale_ptr), QMAX), mask=inside)
        if STATIC > 1:
            tl.store(q_row + stride_qr, _quantize_static(y, tl.load(scale1_ptr), QMAX), mask=inside)
        if STATIC > 2:
            tl.store(q_row + 2 * stride_qr, _quantize_static(y, tl.load(scale2_ptr), QMAX), mask=inside)
    else:
        scale = _row_scale(tl.abs(y), scale_ptr, row, QMAX, TINY)
        tl.store(q_row, _quantize(y, scale, QMAX, TO_INT8), mask=inside)


# ----------------------------------------------------------------------------------------------
# Launcher and op
# ----------------------------------------------------------------------------------------------


def _layer_norm_quantize(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                         q: torch.Tensor, scales: List[torch.Tensor], static: bool) -> None:
    """Rows of 2-D ``x`` (unit stride along K) normalized and quantized into ``q`` (M, K), their scales into
    ``scales[0]``; ``static``: into ``q`` (len(scales), M, K) with each of the scales."""
    M, K = x.shape
    if M == 0:
        return
    plan_key = None
    tensors = tuple(t for t in (x, weight, bias, q, *scales) if t is not None)
    if not INTERPRET and untraced(*tensors):  # a layer's repeated eager call skips the rest
        plan_key = ("layer_norm_quantize_rows", x.get_device(), eps, static, len(scales), weight is None,
                    bias is None, *(plan_layout(t) for t in tensors))
        if launch_planned(plan_key, *tensors):
            return
    to_int8 = q.dtype == torch.int8
    scale, scale1, scale2 = (list(scales) + [None, None])[:3]
    launch(layer_norm_quantize_rows_kernel, (M,), x, weight, bias, q, scale, scale1, scale2, K, x.stride(0),
           q.stride(-2), q.stride(0) if static else 0, eps, HAS_W=weight is not None, HAS_B=bias is not None,
           QMAX=float(INT8_QMAX if to_int8 else FP8_MAX), TINY=_TINY, TO_INT8=to_int8,
           STATIC=len(scales) if static else 0, BLOCK_K=max(16, triton.next_power_of_2(K)),
           num_warps=4 if K <= 1024 else 8 if K <= 4096 else 16, plan_key=plan_key)


def _check_norm(op: str, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    _check(x, op)
    K = x.shape[-1]
    if not 0 < K <= MAX_K:
        raise ValueError(f"{op} normalizes rows of 1 to {MAX_K} values, got {K}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != (K,) or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{op}: {name} must be ({K},) {x.dtype} on {x.device} as x, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _fake(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
          fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_norm("layer_norm_quantize_rows", x, weight, bias)
    q = torch.empty(x.shape, dtype=FP8_DTYPE if fp8 else torch.int8, device=x.device)
    return q, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def _run_kernel(x, weight, bias, eps, q, scales: List[torch.Tensor], static: bool) -> None:
    weight, bias = (None if t is None else t.contiguous() for t in (weight, bias))  # the kernel reads unit strides
    if static:  # one-value scales, read as they are
        _layer_norm_quantize(_rows(x), weight, bias, eps, q.view(len(scales), -1, x.shape[-1]), scales, True)
    else:  # the per-row scales, written flat
        _layer_norm_quantize(_rows(x), weight, bias, eps, q.view(-1, x.shape[-1]), [scales[0].view(-1)], False)


def _op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
        fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    q, scale = _fake(x, weight, bias, eps, fp8)
    if not _runs_triton(x):  # PyTorch's ops: the unfused norm and quantization, exactly
        return _torch_rowwise(F.layer_norm(x, (x.shape[-1],), weight, bias, eps), fp8)
    _run_kernel(x, weight, bias, eps, q, [scale], static=False)
    return q, scale


def _static_fake(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                 scales: List[torch.Tensor]) -> torch.Tensor:
    _check_norm("layer_norm_quantize_static", x, weight, bias)
    if not 0 < len(scales) <= MAX_STATIC_READERS:
        raise ValueError(f"layer_norm_quantize_static takes 1 to {MAX_STATIC_READERS} scales, got {len(scales)}")
    for i, scale in enumerate(scales):
        check_static_scale("layer_norm_quantize_static", f"scales[{i}]", scale, x.device)
    return torch.empty((len(scales), *x.shape), dtype=torch.int8, device=x.device)


def _static_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
               scales: List[torch.Tensor]) -> torch.Tensor:
    q = _static_fake(x, weight, bias, eps, scales)
    if not _runs_triton(x):  # PyTorch's ops: the unfused norm and quantization, exactly
        normed = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return torch.stack([_torch_static(normed, scale) for scale in scales])
    _run_kernel(x, weight, bias, eps, q, scales, static=True)
    return q


register_op("fuselab::layer_norm_quantize_rows", fake=_fake)(_op)
register_op("fuselab::layer_norm_quantize_static", fake=_static_fake)(_static_op)


def layer_norm_quantize_rows(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                             eps: float, fp8: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``F.layer_norm(x, (K,), weight, bias, eps)`` quantized per row (``quantize_int8_rowwise``,
    or ``quantize_fp8_rowwise`` with ``fp8``) in one pass; ``weight``/``bias`` (K,) of x's dtype and device, or
    None; K up to MAX_K. Not differentiable."""
    return call_untraced(torch.ops.fuselab.layer_norm_quantize_rows, _op, x.detach(),
                         None if weight is None else weight.detach(), None if bias is None else bias.detach(),
                         float(eps), fp8)


def layer_norm_quantize_static(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                               eps: float, scales: List[torch.Tensor]) -> torch.Tensor:
    """``stack([quantize_int8_static(F.layer_norm(x, (K,), weight, bias, eps), s) for s in scales])`` in one pass:
    int8, (len(scales), *x.shape), the row quantized with each float32 scale (1 to MAX_STATIC_READERS calibrated
    per-tensor scales: one per layer that reads it). Other arguments as ``layer_norm_quantize_rows``'."""
    return call_untraced(torch.ops.fuselab.layer_norm_quantize_static, _static_op, x.detach(),
                         None if weight is None else weight.detach(), None if bias is None else bias.detach(),
                         float(eps), list(scales))


# ----------------------------------------------------------------------------------------------
# The quantized activations and the module
# ----------------------------------------------------------------------------------------------


class QuantizedRows(torch.Tensor):
    """A ``QuantizedLayerNorm``'s output (or a quantized linear's, where a static layer reads it): shape and dtype of
    the float values, holding only their rows quantized. Dynamic: ``qdata`` (int8 or float8_e4m3fn, same shape) with
    one fp32 scale per row (``scale``, shape[:-1]). Static: ``qdata`` (len(readers), *shape), the r-th the rows
    quantized with ``readers[r]``'s act_scale for that layer alone (``scale`` None). Fuselab's quantized linears take
    it as their quantized input (``unwrap`` checks the reader); any other op raises (there are no float values to
    give)."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype,
                readers: Tuple[nn.Module, ...] = ()):
        shape = qdata.shape[1:] if readers else qdata.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype,
                 readers: Tuple[nn.Module, ...] = ()):
        self.qdata, self.scale, self.readers = qdata, scale, readers

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops reach __torch_dispatch__: no Python cost

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # RuntimeError: torch turns a TypeError from a binary operator (rows + 1) into its own "unsupported operand"
        raise RuntimeError(f"{func} on quantized rows (a QuantizedLayerNorm's output, quantize_ with fuse_norms=True, "
                           "or a quantized linear's, with fuse_outputs=True): only fuselab's quantized linears read "
                           "them; the model, or a hook, uses that output otherwise: quantize without those options")

    def __repr__(self) -> str:
        scales = f"quantized for {len(self.readers)} static layer(s)" if self.readers else "a scale per row"
        return (f"QuantizedRows(shape={tuple(self.shape)}, {self.qdata.dtype} rows standing for {self.dtype}, "
                f"{scales}, device={self.device})")

    def unwrap(self, fp8: bool, layer: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(qdata, scale)`` for the quantized linear ``layer`` of ``fp8`` (else int8) inputs: a dynamic layer takes
        rows with a scale per row, a static one (with an act_scale) the rows quantized for it with that scale; else
        TypeError naming it (a model wired or copied apart from what quantize_ planned)."""
        name = type(layer).__name__
        if (self.qdata.dtype == FP8_DTYPE) != fp8:
            raise TypeError(f"{name} takes {'fp8' if fp8 else 'int8'} activations, got {self.qdata.dtype} rows")
        own = getattr(layer, "act_scale", None)
        if not self.readers:
            if own is not None:
                raise TypeError(f"a static {name} got rows quantized with a scale per row (a dynamic layer's input)")
            return self.qdata, self.scale
        index = next((i for i, reader in enumerate(self.readers) if reader is layer), None)
        if index is None:
            kind = "a dynamic" if own is None else "another static"
            raise TypeError(f"{kind} {name} got rows quantized for other static layers (their producer was made for "
                            "them: a layer copied or replaced after quantize_?)")
        return self.qdata[index], own


def quantized_rows_wanted(x: torch.Tensor, params=()) -> bool:
    """Whether a layer may hand quantized rows of its output on for input ``x`` (and its float ``params``): not where
    gradients are wanted, a trace or compile records the call (jit.trace too: it would record the rows' sizes as
    constants where a model reads them), under forward-mode AD or autocast, or off cpu and cuda."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return False  # the float output: quantized layers after it then refuse a backward themselves
    return not (is_tracing() or torch.jit.is_tracing() or in_dual_level() or x.device.type not in ("cpu", "cuda")
                or torch.is_autocast_enabled(x.device.type))


def why_not_fused_norm(norm: nn.Module) -> Optional[str]:
    """Why ``QuantizedLayerNorm`` cannot compute ``norm`` (None: it can)."""
    if type(norm) is not nn.LayerNorm:
        return f"a {type(norm).__name__}, not exactly an nn.LayerNorm"
    if len(norm.normalized_shape) != 1 or not 0 < norm.normalized_shape[0] <= MAX_K:
        return f"normalizes {tuple(norm.normalized_shape)}: the fused kernel takes the last dimension, 1 to {MAX_K}"
    return None


def static_scale_of(reader: nn.Module) -> torch.Tensor:
    """The static ``act_scale`` of ``reader``, a layer whose input a producer quantizes for it (read at each call:
    the reader's buffer is the one scale, which its state dict, ``.to()`` and a load keep); TypeError for a layer
    without one."""
    scale = getattr(reader, "act_scale", None)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"a static quantized input is made for a static Int8Linear (one with an act_scale), got "
                        f"{type(reader).__name__}")
    return scale


class QuantizedLayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension whose output is its rows quantized (int8, or fp8 with ``fp8``), each
    with its own scale, or, given static ``readers`` (1 to MAX_STATIC_READERS Int8Linears with an act_scale), with
    each reader's act_scale (read at each call) for that reader, for quantized linears to read (see the module's
    docstring); its ``weight`` and ``bias`` are the float norm's (the same state-dict keys). Inference only: where
    the fused form cannot serve a call it returns the float norm's output."""

    _static_readers: Tuple[nn.Module, ...] = ()  # a tuple: not submodules of the norm (a class default: old pickles)

    def __init__(self, norm: nn.LayerNorm, fp8: bool = False, readers: Tuple[nn.Module, ...] = ()):
        super().__init__()
        why = why_not_fused_norm(norm)
        if why is not None:
            raise ValueError(f"QuantizedLayerNorm of {norm}: {why}")
        for reader in readers:
            static_scale_of(reader)
        if fp8 and readers:
            raise ValueError("QuantizedLayerNorm: static readers' scale quantizes to int8, not fp8")
        if len(readers) > MAX_STATIC_READERS:
            raise ValueError(f"QuantizedLayerNorm: at most {MAX_STATIC_READERS} static readers, got {len(readers)}")
        self.normalized_shape, self.eps, self.fp8 = tuple(norm.normalized_shape), norm.eps, fp8
        self.weight, self.bias = norm.weight, norm.bias
        self._static_readers = tuple(readers)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.LayerNorm's argument name
        x = input
        if self._fused_applies(x):
            if not self._static_readers:
                return QuantizedRows(*layer_norm_quantize_rows(x, self.weight, self.bias, self.eps, self.fp8),
                                     x.dtype)
            scales = [static_scale_of(r) for r in self._static_readers]
            return QuantizedRows(layer_norm_quantize_static(x, self.weight, self.bias, self.eps, scales), None,
                                 x.dtype, self._static_readers)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def _fused_applies(self, x: torch.Tensor) -> bool:
        params = [p for p in (self.weight, self.bias) if p is not None]
        return (quantized_rows_wanted(x, params) and x.dim() > 0 and x.shape[-1] == self.normalized_shape[0]
                and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and all(p.dtype == x.dtype and p.device == x.device for p in params)
                and all(static_scale_of(r).device == x.device for r in self._static_readers))

    def extra_repr(self) -> str:
        rows = "fp8" if self.fp8 else "int8, each static reader's scale" if self._static_readers else "int8"
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}, rows={rows}"
