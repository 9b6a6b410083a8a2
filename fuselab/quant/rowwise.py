"""Symmetric per-row quantization in one pass: ``torch.ops.fuselab.quantize_rows``.

    q = cast(clamp(x / scale, -QMAX, QMAX)),   scale = max(absmax(row), tiny) / QMAX   (dynamic)
    q = round(clamp(x * (1 / scale), -127, 127)),   one given fp32 scale                 (static, int8)

int8 rounds half to even (as ``torch.round``), fp8 e4m3 is cast round-to-nearest-even after the
clamp (e4m3fn has no infinity: a quotient past 448 would become NaN). A quantized layer quantizes its
input on every call; by PyTorch's ops that is seven passes over the activations and two fp32
temporaries, which cost more than the INT8 GEMM saves at prefill sizes. The kernel reads each row
once where it fits one block (K <= 4096 or 7168 < K <= 8192; else twice, the second read from L2) and
writes the 1-byte values and the scale once.

Where it runs: the Triton kernel on CUDA and in the interpreter; PyTorch's ops elsewhere, with the
same arithmetic, so both give the same bits: a dynamic scale's fp32 quotients correctly rounded, then rounded or
cast; a static scale's reciprocal rounded to fp32 once (a scale of another dtype too) and each value multiplied by
it (torchao's formula), where a value within about an ulp of a half step can round to the other neighbour than the
correctly rounded division would. The division is free in a memory-bound pass, but not where a GEMM's epilogue
quantizes its output.

A row holding NaN gets a NaN scale, one holding inf an inf scale, and a NaN quotient (NaN, or inf over an
inf scale) quantizes to 0: such a row's values are all +-0 (its finite values over that scale are +-0 too),
so a quantized layer's output row is NaN (scale x accumulator), never finite or an infinity of either sign
(the float layer's row is not finite either). A static scale is finite: NaN inputs quantize to 0 there,
infinities to +-QMAX. The layers and configs take static scales whose fp32 reciprocal is a normal number
(``config.positive_scale``); the ops take any one fp32 value, unchecked (reading it would wait for the GPU).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from fuselab.kernels._runtime import (
    INTERPRET,
    ExecutionPath,
    call_untraced,
    execution_path,
    launch,
    launch_planned,
    plan_layout,
    register_op,
    untraced,
)

INT8_QMAX = 127  # symmetric: -128 is never produced, so |q| <= 127 and the scale is absmax / 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row gets a tiny positive scale, not 0 (0/0)

# Adding and subtracting 1.5 * 2**23 rounds an fp32 of magnitude below 2**22 to an integer, half to
# even (fp32 addition rounds so); the interpreter has no libdevice.rint.
_ROUND_MAGIC = tl.constexpr(12582912.0)  # a global a kernel reads must be a constexpr (the interpreter allows any)

# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, QMAX: tl.constexpr, TINY: tl.constexpr,
                         TO_INT8: tl.constexpr, STATIC: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per row: its scale (unless STATIC: read from scale_ptr), then its quantized values.
    ONE_PASS (dynamic, K <= BLOCK_K): the row is read once and kept in registers for both."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_PASS:
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = _row_scale(tl.abs(x), scale_ptr, row, QMAX, TINY)
        tl.store(q_row + offs, _quantize(x, scale, QMAX, TO_INT8), mask=offs < K)
    else:
        if STATIC:  # int8
            scale = tl.load(scale_ptr)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                offs = k + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            scale = _row_scale(amax, scale_ptr, row, QMAX, TINY)
        for k in range(0, K, BLOCK_K):
            offs = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            if STATIC:
                q = _quantize_static(x, scale, QMAX)
            else:
                q = _quantize(x, scale, QMAX, TO_INT8)
            tl.store(q_row + offs, q, mask=offs < K)


@triton.jit
def _row_scale(amax, scale_ptr, row, QMAX: tl.constexpr, TINY: tl.constexpr):
    # max(absmax, tiny) / QMAX from the lanes' running |x| maxima, stored at scale_ptr[row].
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), TINY), QMAX)
    # A NaN makes the scale NaN, as torch.amax does (tl.max's reduction drops NaN; a sum keeps it):
    # the layer's output row is then NaN, as the float layer's, never a finite value.
    scale += tl.sum(tl.where(amax != amax, amax, 0.0), axis=0)
    tl.store(scale_ptr + row, scale)
    return scale


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr, TO_INT8: tl.constexpr):
    # x / scale (correctly rounded), clamped and rounded to int8 or e4m3: a dynamic scale.
    return _to_grid(tl.math.div_rn(x, scale), QMAX, TO_INT8)


@triton.jit
def _quantize_static(x, scale, QMAX: tl.constexpr):
    # x times the scale's reciprocal (rounded once), clamped and rounded to int8: a division a value doubled the
    # time of an int8 GEMM whose epilogue quantizes its output (H100, docs/notes/profiles.md).
    return _to_grid(x * tl.math.div_rn(1.0, scale), QMAX, True)


@triton.jit
def _to_grid(v, QMAX: tl.constexpr, TO_INT8: tl.constexpr):
    # clamp, then round: the same as round, then clamp. A NaN quotient (NaN, or inf over an inf scale) becomes 0,
    # as in _nan_quotients_to_zero, not the clamp's -QMAX (Triton's min and max drop NaN operands).
    v = tl.where(v != v, 0.0, tl.minimum(tl.maximum(v, -QMAX), QMAX))
    if TO_INT8:
        q = ((v + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int8)
    else:  # e4m3's rounding done exactly in fp32, so that the cast need not round (the
        # interpreter's cast rounds wrongly where rounding carries into the exponent)
        bits = v.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals: -6's step
        step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        inverse = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
        r = ((tl.abs(v) * inverse + _ROUND_MAGIC) - _ROUND_MAGIC) * step  # exact: powers of two, < 16 steps
        # The sign bit put back (-0 included, as the cast keeps it): a compiled `-r` is `0 - r`, so +0.
        signed = r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)
        q = signed.to(tl.float32, bitcast=True).to(tl.float8e4nv)
    return q


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _quantize_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, static: bool) -> None:
    """Quantize the rows of 2-D ``x`` (unit stride along K) into ``q``; ``scale`` is read (``static``)
    or written (one per row)."""
    M, K = x.shape
    if M == 0:
        return
    plan_key = None
    if not INTERPRET and untraced(x, q, scale):  # a layer's repeated eager call skips the rest
        plan_key = ("quantize_rows", x.get_device(), static, plan_layout(x), plan_layout(q), plan_layout(scale))
        if launch_planned(plan_key, x, q, scale):
            return
    # Rows up to 4096 read once at 4 warps, and up to 8192 at 8 where at most 1/8 of the block is masked (the
    # fastest of the H200 sweep at K 768-11008; at 5120 a 8192 block was slower than two passes of 4096).
    block_k = triton.next_power_of_2(max(K, 16))
    block_k = block_k if block_k <= 4096 or (block_k == 8192 and K > 7168) else 4096
    to_int8 = q.dtype == torch.int8
    launch(quantize_rows_kernel, (M,), x, q, scale, K, x.stride(0), q.stride(0),
           QMAX=float(INT8_QMAX if to_int8 else FP8_MAX), TINY=_TINY, TO_INT8=to_int8, STATIC=static,
           ONE_PASS=K <= block_k and not static, BLOCK_K=block_k, num_warps=4 if K <= 4096 else 8,
           plan_key=plan_key)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (rows, K) with unit stride along K (a copy only where the layout needs one)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _check(x: torch.Tensor, op: str) -> None:
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have shape (..., K), got a 0-d tensor")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, got {x.dtype}")


# CUDA tensors take the kernel (its GPU tests passed on the H200 at e46da89); False sends them to
# PyTorch's ops, the same bits, should a new GPU or triton version fail tests/test_rowwise.py.
KERNEL_ON_CUDA = True


def _runs_triton(x: torch.Tensor) -> bool:
    return execution_path(x) is ExecutionPath.TRITON and (KERNEL_ON_CUDA or not x.is_cuda)


def _torch_rowwise(x: torch.Tensor, fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` by PyTorch's ops."""
    qmax = FP8_MAX if fp8 else INT8_QMAX
    amax = x.abs().amax(dim=-1).to(torch.float32).clamp_(min=_TINY)
    # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal (1 ulp off).
    scale = amax.div_(amax.new_full((), qmax))
    quotient = _nan_quotients_to_zero(x.to(torch.float32) / scale[..., None])  # rounded and clamped in place
    if fp8:  # clamped first: a quotient that rounds past 448 would become NaN (e4m3fn has no infinity)
        return quotient.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    return quotient.round_().clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8), scale


def _nan_quotients_to_zero(quotient: torch.Tensor) -> torch.Tensor:
    """NaN quotients (NaN inputs, inf over an inf scale) as 0, as the kernel's ``_quantize`` makes them (casting NaN
    to int8 is undefined; the clamp's NaN would pass to fp8 as NaN). Infinities become +-finfo.max, which the clamp
    that follows makes +-QMAX as it would have: one in-place pass."""
    return quotient.nan_to_num_(0.0)


def _torch_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quantize_static`` by PyTorch's ops (``scale`` may be any shape that broadcasts; one value of any shape
    keeps x's: a (1, 1) scale must not broadcast x to more dimensions)."""
    scale = scale.reshape(()) if scale.numel() == 1 else scale
    quotient = _nan_quotients_to_zero(x.to(torch.float32) * scale.to(torch.float32).reciprocal())  # as _quantize_static
    return quotient.round_().clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)


def _rows_fake(x: torch.Tensor, fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    _check(x, "quantize_rows")
    q = torch.empty(x.shape, dtype=FP8_DTYPE if fp8 else torch.int8, device=x.device)
    return q, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


def _rows_op(x: torch.Tensor, fp8: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    if x.dim() and x.shape[-1] == 0:  # nothing to scale: PyTorch's amax of an empty row raises, the tiny scale is due
        q, scale = _rows_fake(x, fp8)
        return q, scale.fill_(_TINY / (FP8_MAX if fp8 else INT8_QMAX))
    if not _runs_triton(x):
        _check(x, "quantize_rows")
        return _torch_rowwise(x, fp8)
    q, scale = _rows_fake(x, fp8)
    _quantize_rows(_rows(x), q.view(-1, x.shape[-1]), scale.view(-1), static=False)
    return q, scale


def check_static_scale(op: str, name: str, scale: torch.Tensor, device: torch.device) -> None:
    """ValueError unless ``scale`` is one float32 value on ``device`` (a static per-tensor scale)."""
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(f"{op}: {name} must be one float32 value on {device}, got "
                         f"{scale.dtype} of shape {tuple(scale.shape)} on {scale.device}")


def _static_fake(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check(x, "quantize_static")
    check_static_scale("quantize_static", "scale", scale, x.device)
    return torch.empty(x.shape, dtype=torch.int8, device=x.device)


def _static_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = _static_fake(x, scale)
    if not _runs_triton(x):
        return _torch_static(x, scale)
    if x.numel():
        _quantize_rows(_rows(x), q.view(-1, x.shape[-1]), scale, static=True)
    return q


register_op("fuselab::quantize_rows", fake=_rows_fake)(_rows_op)
register_op("fuselab::quantize_static", fake=_static_fake)(_static_op)

# ----------------------------------------------------------------------------------------------
# Public API (PyTorch's ops where the kernel does not run: the same arithmetic)
# ----------------------------------------------------------------------------------------------


def quantize_int8_rowwise(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` (..., K) as int8 with one symmetric fp32 scale per row, shaped x.shape[:-1];
    ``x ~ q * scale[..., None]``, ``scale = absmax(row) / 127``. Not differentiable (rounding)."""
    return call_untraced(torch.ops.fuselab.quantize_rows, _rows_op, x.detach(), False)


def quantize_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(x * (1 / scale))`` clamped to [-127, 127], as int8 (the reciprocal rounded to fp32 once, as
    torchao's quantize_affine); ``scale`` broadcasts against ``x`` (a calibrated per-tensor scale clips values
    beyond the calibrated range)."""
    if scale.numel() == 1 and scale.dtype == torch.float32 and scale.device == x.device:
        return call_untraced(torch.ops.fuselab.quantize_static, _static_op, x.detach(), scale)
    return _torch_static(x.detach(), scale)  # a scale per row (or of another dtype): PyTorch's ops


def quantize_fp8_rowwise(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` (..., K) as float8_e4m3fn with one fp32 scale per row, shaped
    x.shape[:-1]; ``x ~ q * scale[..., None]``, ``scale = absmax(row) / 448`` (e4m3's largest value).
    Not differentiable."""
    return call_untraced(torch.ops.fuselab.quantize_rows, _rows_op, x.detach(), True)
