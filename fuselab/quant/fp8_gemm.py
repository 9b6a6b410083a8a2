"""FP8 (e4m3) GEMM with a fused epilogue, ``torch.ops.fuselab.fp8_matmul_epilogue``:

    Y = cast(relu?((A @ B) * a_scale[:, None] * b_scale[None, :] + bias))

A (M, K) and B (K, N) are ``float8_e4m3fn`` with rowwise scales (one per row of A, one per column of
B); every product of two e4m3 values is exact in fp32, and the sums accumulate in fp32 (the kernel
adds each K tile's partial product into an fp32 accumulator: Hopper's fp8 MMA keeps fewer bits
inside one instruction chain). The epilogue is the INT8 op's (``_scaled_gemm``), its limits too.

Where it runs: fuselab's Triton kernel on CUDA GPUs with fp8 tensor cores (compute capability 8.9 or
newer: Ada, Hopper; elsewhere on CUDA the op raises) and in the interpreter; on a CPU, PyTorch's fp32
GEMM of the upcast operands (exact products, fp32 sums: the same math in another summation order)
and the same epilogue, so an fp8 model can be checked without a GPU.
"""
from typing import Optional

import torch

from fuselab.kernels._runtime import ExecutionPath, cuda_capability, execution_path, register_op
from fuselab.quant._scaled_gemm import call, check_fast_accum, check_inputs, scaled_gemm, torch_epilogue
from fuselab.quant.rowwise import FP8_DTYPE

MIN_CAPABILITY = (8, 9)  # fp8 tensor cores (Ada, Hopper)

# ----------------------------------------------------------------------------------------------
# The op: registration and its two bodies
# ----------------------------------------------------------------------------------------------

OP = "fp8_matmul_epilogue"


def _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum=False) -> None:
    check_inputs(OP, FP8_DTYPE, torch.float32, a, b, a_scale, b_scale, bias, relu, out_dtype)
    check_fast_accum(OP, fast_accum)


def check_fp8_device(device: torch.device) -> Optional[str]:
    """Why the fp8 kernel cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return None
    capability = cuda_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"fp8 e4m3 GEMMs need fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}")
    return None


def _check_for_triton(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum=False) -> None:
    _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum)
    why = check_fp8_device(a.device)
    if why is not None:
        raise RuntimeError(f"{OP}: {why}")


def _fake(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
          bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _torch_forward(a, b, a_scale, b_scale, bias, relu: bool, out_dtype: torch.dtype,
                   fast_accum: bool = False) -> torch.Tensor:
    """The op by PyTorch's kernels: an fp32 GEMM of the upcast operands, then the epilogue. (Exact
    products under TF32 as well: an e4m3 value has 4 significant bits, TF32 keeps 11.) fp32 sums whatever
    ``fast_accum`` says."""
    _check_inputs(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum)
    return torch_epilogue(a.to(torch.float32) @ b.to(torch.float32), a_scale, b_scale, bias, relu, out_dtype)


def _forward(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype,
             fast_accum: bool = False) -> torch.Tensor:
    if execution_path(a) is not ExecutionPath.TRITON:
        return _torch_forward(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum)
    _check_for_triton(a, b, a_scale, b_scale, bias, relu, out_dtype, fast_accum)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
    scaled_gemm(a, b, out, a_scale, b_scale, bias, relu, fast_accum=fast_accum)
    return out


register_op(f"fuselab::{OP}", fake=_fake)(_forward)

# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
               bias: Optional[torch.Tensor] = None, relu: bool = False, out_dtype: Optional[torch.dtype] = None,
               *, fast_accum: bool = False, backend: str = "auto") -> torch.Tensor:
    """``cast(relu?((a @ b) * a_scale * b_scale + bias))`` for float8_e4m3fn ``a`` and ``b``, in one kernel.

    Arguments as ``int8_matmul``'s, with fp8 operands; without scales the result is the raw fp32
    accumulators. ``fast_accum=True``: Hopper's tensor cores accumulate over the whole K in their reduced
    precision (``torch._scaled_mm``'s ``use_fast_accum``: faster, less exact; ``check_fast_accum``); False adds
    each K tile's sum into fp32. ``backend="torch"`` is an fp32 GEMM of the upcast operands and a separate
    epilogue. Raises RuntimeError on a CUDA GPU without fp8 tensor cores (below sm_89).
    Inference only: the op has no backward (under forward-mode AD it runs PyTorch's ops, which carry the
    scales' and bias' tangents).
    """
    check_fast_accum("fp8_matmul", fast_accum)  # before call(), which takes None for "not given"
    if out_dtype is None:
        out_dtype = torch.float32
    return call(torch.ops.fuselab.fp8_matmul_epilogue, _torch_forward, _check_for_triton, FP8_DTYPE, a, b, a_scale,
                b_scale, bias, relu, out_dtype, backend, fast_accum=fast_accum)
