"""INT8 GEMM with a fused epilogue, ``torch.ops.fuselab.int8_matmul_epilogue``:

    Y = cast(relu?(fp32(A @ B) * a_scale[:, None] * b_scale[None, :] + bias))
    Y = quantize_int8_static(cast(...), out_scale)     (with out_scale: int8, the next layer's input)

A (M, K) and B (K, N) are int8, their products accumulated exactly in int32; the scales (one per row
of A, one per column of B: per-token activations, per-output-channel weights), bias and ReLU are
applied in fp32 and the result cast to ``out_dtype``. Without scales the op returns the int32
accumulators, as ``torch._int_mm`` does.

Where it runs (``execution_path``): fuselab's Triton kernel on CUDA (and in the interpreter), and
on a CPU PyTorch's int8 GEMM (``torch._int_mm``) and the same epilogue in PyTorch's fp32 ops. Both
accumulate integers, so both give the same int32 accumulators bit for bit; the epilogues agree to
within fp32 rounding (the cast rounds to nearest even on both, the interpreter's too: ``fuselab.kernels._casts``),
and an int8 output (``out_scale``) is the same bits on both. Finite inputs beyond
~2.7e36 / K can overflow the fp32 product ``acc * a_scale`` to inf before ``b_scale`` applies. The
operands come from ``fuselab.quant.rowwise``: symmetric, scale = absmax/127.
"""
from typing import Optional

import torch

from fuselab.kernels._runtime import ExecutionPath, execution_path, register_op
from fuselab.quant._scaled_gemm import call, check_inputs, result_dtype, scaled_gemm, torch_epilogue

# |a*b| <= 128**2 = 2**14 for any int8 operands: K below 2**17 cannot overflow the int32 accumulators.
MAX_K = 2**17 - 1

# ----------------------------------------------------------------------------------------------
# The op: registration and its two bodies
# ----------------------------------------------------------------------------------------------

OP = "int8_matmul_epilogue"


def _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, out_scale=None) -> None:
    check_inputs(OP, torch.int8, torch.int32, a, b, a_scale, b_scale, bias, relu, out_dtype, max_k=MAX_K,
                 out_scale=out_scale)


def _fake(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
          bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype,
          out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, out_scale)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=result_dtype(out_dtype, out_scale))


def _int32_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in int32, exactly, by PyTorch's kernels."""
    if a.shape[1] == 0:
        return a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.int32)
    # _int_mm reads only dense row- or column-major operands right (an expanded one gives garbage on a CPU)
    a, b = (t if t.is_contiguous() or t.t().is_contiguous() else t.contiguous() for t in (a, b))
    try:
        if a.is_cpu and 1 in a.shape + b.shape:  # _int_mm on a CPU misreads a size-1 dim's (1, 1) strides
            return a.to(torch.int32) @ b.to(torch.int32)  # exact: int32 partial sums, as the kernels'
        return torch._int_mm(a, b)  # any shape on a CPU; on CUDA cuBLAS takes M > 16, K and N multiples of 8
    except RuntimeError:
        if a.is_cpu:
            raise
        # Exact too: every partial sum is an integer below 2**31, well inside float64's 2**53.
        return (a.to(torch.float64) @ b.to(torch.float64)).to(torch.int32)


def _torch_forward(a, b, a_scale, b_scale, bias, relu: bool, out_dtype: torch.dtype, out_scale=None) -> torch.Tensor:
    """The op by PyTorch's kernels: ``torch._int_mm``, then the epilogue as separate fp32 ops."""
    _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, out_scale)
    return torch_epilogue(_int32_accumulate(a, b), a_scale, b_scale, bias, relu, out_dtype, out_scale)


def _forward(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype,
             out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    if execution_path(a) is not ExecutionPath.TRITON:
        return _torch_forward(a, b, a_scale, b_scale, bias, relu, out_dtype, out_scale)
    out = _fake(a, b, a_scale, b_scale, bias, relu, out_dtype, out_scale)
    scaled_gemm(a, b, out, a_scale, b_scale, bias, relu, out_scale, out_dtype)
    return out


register_op(f"fuselab::{OP}", fake=_fake)(_forward)

# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def int8_matmul(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
                bias: Optional[torch.Tensor] = None, relu: bool = False, out_dtype: Optional[torch.dtype] = None,
                *, out_scale: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """``cast(relu?((a @ b) * a_scale * b_scale + bias))`` for int8 ``a`` and ``b``, in one kernel.

    Args:
        a: (..., K) int8, any strides. b: (K, N) int8, any strides (``weight.t()`` of an (N, K) int8
            weight is used as it is: K-contiguous, the layout tensor cores read fastest).
        a_scale: float32, one per row of ``a`` (shaped ``a.shape[:-1]``, or with a trailing 1) or a single one.
        b_scale: float32, one per column of ``b``, (N,) or (1, N) (per output channel), or a single one.
        bias: (N,) float32/float16/bfloat16, or None. relu: ReLU after the bias, before the cast.
        out_dtype: float32, float16 or bfloat16; None: float32. With ``a_scale = b_scale = None``
            (no bias, no relu) the result is the raw int32 accumulators (out_dtype int32 or None).
        out_scale: one float32 value, or None. Given, the result (cast to out_dtype) is returned quantized
            with it as ``quantize_int8_static`` quantizes: int8, the same bits (a statically quantized
            layer that reads this output then skips its own quantization).
        backend: "auto" (the op: Triton on CUDA and in the interpreter, PyTorch on a CPU), "triton"
            (the kernel) or "torch" (``torch._int_mm`` and the epilogue as separate PyTorch ops:
            the unfused peer).
    Returns (..., N). Raises ValueError/TypeError naming the bad shapes, dtypes or devices.
    Inference only: the op has no backward (under forward-mode AD it runs PyTorch's ops, which carry the
    scales' and bias' tangents).
    """
    if out_dtype is None:
        out_dtype = torch.int32 if a_scale is None else torch.float32
    return call(torch.ops.fuselab.int8_matmul_epilogue, _torch_forward, _check_inputs, torch.int8, a, b, a_scale,
                b_scale, bias, relu, out_dtype, backend, out_scale)
