"""The GEMM both quantized formats share: 8-bit operands, a wide accumulator, one fused epilogue.

    Y = cast(relu?(fp32(A @ B) * a_scale[:, None] * b_scale[None, :] + bias))
    Y = quantize_static(cast(...), out_scale)        (int8 output: the next layer's input, with out_scale)

A (M, K) and B (K, N) are both int8 (accumulated exactly in int32) or both fp8 e4m3 (accumulated in
fp32); the scales, bias, ReLU and the cast to the output dtype run on the accumulator tile while it is
still in registers, and with an ``out_scale`` the cast value is quantized there too, as
``rowwise.quantize_int8_static`` would quantize it (the same bits), so that a layer whose output only a
statically quantized layer reads writes one byte a value and that layer skips its quantization pass.
Without scales the raw accumulators are stored (int32 or fp32), as ``torch._int_mm`` returns them.
Two bodies, as the bf16 GEMM's: a tiled pointer body for any strides, and a persistent TMA body (Hopper; A
row-major, B a weight's transpose, 16-byte aligned rows) whose next tile's loads overlap this tile's epilogue.
``int8_gemm.py`` and ``fp8_gemm.py`` register the two ops and hold their PyTorch paths; this module holds what
they share: the configs, the kernel, the launcher, the input checks and the epilogue as PyTorch computes it.
"""
import math
from typing import Callable, Optional, Tuple

import torch
import triton
import triton.language as tl

from fuselab.kernels import eager_path
from fuselab.kernels._autotune import autotune, bucket
from fuselab.kernels._casts import cast_rne
from fuselab.kernels._gemm_tiles import gemm_config, needs_int64, tile_coords, tile_pointers, tma_layout
from fuselab.kernels._runtime import (
    INTERPRET,
    SUPPORTED_DTYPES,
    ExecutionPath,
    check_same_device,
    execution_path,
    has_tma,
    in_dual_level,
    launch,
    launch_planned,
    max_shared_memory,
    num_sms,
    plan_layout,
    untraced,
)
from fuselab.quant.rowwise import INT8_QMAX, _quantize_static, _torch_static, check_static_scale

# ----------------------------------------------------------------------------------------------
# Autotune configs
# ----------------------------------------------------------------------------------------------


def gemm_configs(interpret: bool = INTERPRET):
    """Configs timed by the autotuner; pruned per problem by ``_prune_configs``. ``interpret=False``: the
    GPU's list, also under the interpreter (tests run each config there)."""
    if interpret:  # timings mean nothing there: two small tiles exercise the tuner cheaply
        return [gemm_config(32, 32, 32, 1, 4, group_m=2), gemm_config(16, 32, 64, 1, 4, group_m=2)]
    # Hopper first: 8-bit operands take BLOCK_K=128 (128-byte rows, the widest shared-memory swizzle),
    # and 128x256 tiles want two warpgroups.
    pointer = [gemm_config(*c) for c in [
        (128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 128, 4, 8), (128, 128, 128, 4, 4),
        (64, 256, 128, 4, 4), (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 256, 64, 4, 8),
        (64, 64, 256, 4, 4), (32, 64, 256, 4, 4), (16, 64, 256, 4, 4)]]  # few rows (decode): deeper K
    # Persistent TMA body: the next tile's loads start while this tile's epilogue runs.
    tma = [gemm_config(*c, tma=True, subtile=sub) for *c, sub in [
        (128, 256, 128, 3, 8, False), (128, 256, 128, 4, 8, True), (256, 128, 128, 3, 8, False),
        (128, 128, 128, 4, 8, False), (128, 128, 128, 5, 4, False), (64, 256, 128, 4, 4, False)]]
    return pointer + tma


# Used when FUSELAB_AUTOTUNE=0: a tile that is good on Hopper for large 8-bit problems.
HEURISTIC_CONFIG = gemm_config(128, 128, 128, 4, 8)


# The tuner offers the TMA body on CUDA (every config passed the GPU tests on the H200 at e46da89);
# False keeps it to the pointer body, should a new GPU or triton version fail tests/test_quant.py.
TMA_ON_CUDA = True


def _prune_configs(configs, named_args, **kwargs):
    """Drop configs that overflow shared memory, need TMA where the layout (or TMA_ON_CUDA) forbids it,
    or use tiles far larger than the problem."""
    args = {**named_args, **kwargs}
    es = args["a_ptr"].element_size()
    smem = max_shared_memory()
    m, n, k = args["M_BUCKET"], args["N_BUCKET"], args["K_BUCKET"]
    kept = []
    for c in configs:
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        need = c.num_stages * (bm * bk + bk * bn) * es
        if c.kwargs["TMA"]:
            if not (args["TMA_OK"] and TMA_ON_CUDA):
                continue
            need += bm * bn * args["c_ptr"].element_size() // (2 if c.kwargs["EPILOGUE_SUBTILE"] else 1)
        if need > smem:
            continue
        if (bm > 64 and m <= 32) or (bn > 64 and n <= 32) or (bk > 64 and k <= 32):
            continue
        kept.append(c)
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@autotune(configs=gemm_configs(), prune=_prune_configs, heuristic=HEURISTIC_CONFIG,
          key=["M_BUCKET", "N_BUCKET", "K_BUCKET", "A_ROW_MAJOR", "B_ROW_MAJOR", "TMA_OK", "SCALED", "HAS_BIAS",
               "FAST_ACCUM"])
@triton.jit
def scaled_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_a_scale, stride_b_scale, stride_bias,
    M_BUCKET, N_BUCKET, K_BUCKET, A_ROW_MAJOR, B_ROW_MAJOR,  # autotune keys only
    INT8: tl.constexpr, FAST_ACCUM: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, RELU: tl.constexpr,
    OUT_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr, INT64: tl.constexpr, TMA_OK: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
):
    """C = epilogue(A @ B); see the module docstring."""
    if TMA:
        _scaled_gemm_tma_persistent(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, M, N, K,
                                    stride_am, stride_bn, stride_cm, stride_a_scale, stride_b_scale, stride_bias,
                                    INT8, FAST_ACCUM, SCALED, HAS_BIAS, RELU, OUT_DTYPE, QUANT_OUT, INT64, NUM_SMS,
                                    BLOCK_M,
                                    BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE_SUBTILE)
    else:
        _scaled_gemm_tile(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, M, N, K, stride_am,
                          stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_a_scale, stride_b_scale,
                          stride_bias, INT8, FAST_ACCUM, SCALED, HAS_BIAS, RELU, OUT_DTYPE, QUANT_OUT, INT64, BLOCK_M,
                          BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _dot(a, b, acc, INT8: tl.constexpr, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    # One return: triton 3.6 compiles the statements after a return inside a constexpr `if` too.
    if INT8:
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # exact: the checks keep K below int32 overflow
    elif FAST_ACCUM:  # the MMA's own accumulation over the whole K (torch._scaled_mm's use_fast_accum)
        acc = tl.dot(a, b, acc)
    else:
        # Hopper's fp8 MMA keeps fewer bits while it accumulates, and Triton's sm_90 default lets it run
        # over the whole K: promote into fp32 once per K tile instead.
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    return acc


@triton.jit
def _scaled_gemm_tile(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, M, N, K, stride_am,
                      stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_a_scale, stride_b_scale,
                      stride_bias, INT8: tl.constexpr, FAST_ACCUM: tl.constexpr, SCALED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, RELU: tl.constexpr, OUT_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr,
                      INT64: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, offs_k, rm, rn, a_ptrs, b_ptrs = tile_pointers(
        a_ptr, b_ptr, pid_m, pid_n, M, N, stride_am, stride_ak, stride_bk, stride_bn, INT64, BLOCK_M, BLOCK_N, BLOCK_K)
    if INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(a, b, acc, INT8, FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALED:
        out = _epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, rm, rn, stride_a_scale,
                        stride_b_scale, stride_bias, HAS_BIAS, RELU, OUT_DTYPE, QUANT_OUT)
    else:
        out = acc
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _scaled_gemm_tma_persistent(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, M, N, K,
                                stride_am, stride_bn, stride_cm, stride_a_scale, stride_b_scale, stride_bias,
                                INT8: tl.constexpr, FAST_ACCUM: tl.constexpr, SCALED: tl.constexpr,
                                HAS_BIAS: tl.constexpr, RELU: tl.constexpr, OUT_DTYPE: tl.constexpr,
                                QUANT_OUT: tl.constexpr, INT64: tl.constexpr, NUM_SMS: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr):
    # A row-major, B = a weight's transpose (K-major, as Hopper's 8-bit MMA reads both), C row-major:
    # TMA_OK says so (_tma_ok). B is described as the (N, K) weight and transposed in shared memory.
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
    C_BLOCK_N: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, C_BLOCK_N])
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):  # TMA zero-fills past K's edge: the tail adds nothing
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K]).T
            acc = _dot(a, b, acc, INT8, FAST_ACCUM, BLOCK_K)
        if SCALED:
            # In-range indices (the store drops rows and columns past the edge), as the pointer body's.
            rm = (off_m + tl.arange(0, BLOCK_M)) % M
            rn = (off_n + tl.arange(0, BLOCK_N)) % N
            if INT64:  # a scale or the bias may be a column of a huge matrix
                rm = rm.to(tl.int64)
                rn = rn.to(tl.int64)
            out = _epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, rm, rn, stride_a_scale,
                            stride_b_scale, stride_bias, HAS_BIAS, RELU, OUT_DTYPE, QUANT_OUT)
        else:
            out = acc
        c = out.to(c_ptr.dtype.element_ty)
        if EPILOGUE_SUBTILE:  # two half-width stores halve the epilogue's shared memory
            c0, c1 = c.reshape(BLOCK_M, 2, C_BLOCK_N).permute(0, 2, 1).split()
            c_desc.store([off_m, off_n], c0)
            c_desc.store([off_m, off_n + C_BLOCK_N], c1)
        else:
            c_desc.store([off_m, off_n], c)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


_INT8_QMAX = tl.constexpr(float(INT8_QMAX))


@triton.jit
def _epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, out_scale_ptr, rm, rn, stride_a_scale, stride_b_scale,
              stride_bias, HAS_BIAS: tl.constexpr, RELU: tl.constexpr, OUT_DTYPE: tl.constexpr,
              QUANT_OUT: tl.constexpr):
    # In the order torch_epilogue computes it: ((acc * a_scale) * b_scale) + bias, all fp32, then the cast.
    a_scale = tl.load(a_scale_ptr + rm * stride_a_scale)  # rm, rn: in-range indices, no mask needed
    b_scale = tl.load(b_scale_ptr + rn * stride_b_scale)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:  # any stride, 0 too (an expanded scalar)
        out = out + tl.load(bias_ptr + rn * stride_bias).to(tl.float32)[None, :]
    if RELU:
        out = tl.where(out < 0, 0.0, out)  # not maximum(): NaN must propagate, as in torch.relu
    out = cast_rne(out, OUT_DTYPE)  # the float layer's output, as its dtype holds it
    if QUANT_OUT:  # as quantize_static quantizes that output: the same bits
        out = _quantize_static(out.to(tl.float32), tl.load(out_scale_ptr), _INT8_QMAX)
    return out


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _plan_key(tensors, relu, out_dtype, fast_accum) -> tuple:
    """Everything a launch of ``scaled_gemm`` specializes on but the data: see ``launch_planned``."""
    return ("scaled_gemm", tensors[0].get_device(), relu, out_dtype, fast_accum, *(plan_layout(t) for t in tensors))


# The epilogue's float result as the kernel casts it (OUT_DTYPE); int32: the raw accumulators
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.int32: tl.int32}
_OUT_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_TL_DTYPES)}  # out_dtype in the C++ path's key


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_scale: Optional[torch.Tensor],
                b_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor], relu: bool,
                out_scale: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None, *,
                fast_accum: bool = False, config: Optional[triton.Config] = None) -> None:
    """Write ``c`` (M, N) = the epilogue of ``a`` (M, K) @ ``b`` (K, N), all 2-D with any strides;
    scales and bias 1-D with any stride (0 too). With ``out_scale`` (one fp32 value), ``c`` is int8: the
    epilogue's result cast to ``out_dtype``, then quantized with that scale. ``fast_accum`` (fp8 only): the
    tensor cores' reduced-precision accumulation over the whole K (``check_fast_accum``). Inputs as
    ``check_inputs`` accepts them. ``config`` bypasses the autotuner (tests and benchmarks of single configs)."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    if fast_accum and a.dtype == torch.int8:
        raise ValueError("scaled_gemm: fast_accum applies to fp8 operands (int8 products are summed exactly)")
    if out_scale is not None and out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"scaled_gemm: out_scale quantizes the result cast to out_dtype (float32, float16 or "
                         f"bfloat16), got out_dtype={out_dtype}")
    out_dtype = c.dtype if out_scale is None else out_dtype
    tensors = (a, b, c, a_scale, b_scale, bias, out_scale)
    present = [t for t in tensors if t is not None]
    plan_key = cpp_key = None
    if config is None and not INTERPRET and untraced(*present):  # a repeated eager call skips the rest
        if eager_path.may_plan():  # the C++ path builds the key and launches in one call, once planned
            cpp_key = ((eager_path.SCALED_GEMM_KIND, a.get_device(), int(relu), _OUT_DTYPE_CODES[out_dtype],
                        int(fast_accum)), tensors)
            if eager_path.launch_planned(*cpp_key):
                return
        plan_key = _plan_key(tensors, relu, out_dtype, fast_accum)
        if launch_planned(plan_key, *present, cpp_key=cpp_key):
            return

    tma_ok = _tma_ok(a, b, c) and K > 0
    sms = num_sms(a.device)

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(sms, tiles) if meta["TMA"] else tiles,)

    kernel, meta = scaled_gemm_kernel, {}
    if config is not None:
        if config.kwargs["TMA"] and not tma_ok:
            raise ValueError(f"config {config} needs TMA-compatible layouts")
        kernel, meta = scaled_gemm_kernel.fn, config.all_kwargs()
    scale_strides = (a_scale.stride(0), b_scale.stride(0)) if a_scale is not None else (0, 0)
    launch(kernel, grid, a, b, c, a_scale, b_scale, bias, out_scale, M, N, K,
           a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
           *scale_strides, bias.stride(0) if bias is not None else 0,
           bucket(M), bucket(N), bucket(K), int(a.stride(1) == 1), int(b.stride(1) == 1),
           INT8=a.dtype == torch.int8, FAST_ACCUM=fast_accum, SCALED=a_scale is not None, HAS_BIAS=bias is not None,
           RELU=relu, OUT_DTYPE=_TL_DTYPES[out_dtype], QUANT_OUT=out_scale is not None,
           INT64=needs_int64(a, b, c, a_scale, b_scale, bias), TMA_OK=tma_ok, NUM_SMS=sms, plan_key=plan_key,
           cpp_key=cpp_key, **meta)


def _tma_ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """The TMA body's layouts: a row-major, b column-major (a weight's transpose: both operands K-major,
    as Hopper's 8-bit MMA reads them), c row-major; every row and base 16-byte aligned; on Hopper."""
    return has_tma(a.device) and tma_layout(a) is True and tma_layout(b) is False and tma_layout(c) is True


# ----------------------------------------------------------------------------------------------
# What both ops share around the kernel: input checks, the epilogue in PyTorch
# ----------------------------------------------------------------------------------------------


def check_fast_accum(op: str, fast_accum) -> None:
    """TypeError unless ``fast_accum`` is a bool. True: the fp8 MMA accumulates over the whole K in its own
    reduced precision (Hopper keeps about 14 bits: faster, less exact); False: each K tile's sum is added into
    fp32. Only Hopper's tensor cores differ: the interpreter and PyTorch's path sum in fp32 either way."""
    if not isinstance(fast_accum, bool):
        raise TypeError(f"{op}: fast_accum must be a bool, got {fast_accum!r}")


def check_inputs(op: str, operand_dtype: torch.dtype, accumulator_dtype: torch.dtype, a: torch.Tensor,
                 b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype,
                 max_k: Optional[int] = None, out_scale: Optional[torch.Tensor] = None) -> None:
    """Raise ValueError/TypeError naming what is wrong with the arguments of ``op``."""
    check_same_device(a=a, b=b, a_scale=a_scale, b_scale=b_scale, bias=bias)
    if out_scale is not None:
        check_static_scale(op, "out_scale", out_scale, a.device)
        if a_scale is None:
            raise ValueError(f"{op}: out_scale quantizes the scaled result: give a_scale and b_scale too")
    if a.dtype != operand_dtype or b.dtype != operand_dtype:
        raise TypeError(f"{op}: a and b must both be {operand_dtype} (quantize them first), "
                        f"got a {a.dtype} and b {b.dtype}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: a (M, K) and b (K, N) must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    (M, K), N = a.shape, b.shape[1]
    check_k(op, a, b)
    if max_k is not None and K > max_k:
        raise ValueError(f"{op}: K={K} is above {max_k}: the {accumulator_dtype} accumulators could overflow")
    if (a_scale is None) != (b_scale is None):
        raise ValueError(f"{op}: give both a_scale and b_scale, or neither (the raw accumulators)")
    if a_scale is None:
        if bias is not None or relu:
            raise ValueError(f"{op}: bias and relu need a_scale and b_scale (they act on the scaled result)")
        if out_dtype != accumulator_dtype:
            raise TypeError(f"{op}: without scales the output is the raw {accumulator_dtype} accumulators, "
                            f"got out_dtype={out_dtype}")
        return
    for name, scale, n in (("a_scale", a_scale, M), ("b_scale", b_scale, N)):
        if scale.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32, got {scale.dtype}")
        if scale.dim() != 1 or scale.shape[0] != n:
            raise ValueError(f"{op}: {name} must have shape ({n},), one scale per "
                             f"{'row of a' if name == 'a_scale' else 'column of b'}, got {tuple(scale.shape)}")
    if bias is not None:
        if bias.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: bias must be float32, float16 or bfloat16, got {bias.dtype}")
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"{op}: bias must have shape (N,) = ({N},), got {tuple(bias.shape)}")
    if out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, float16 or bfloat16 with scales, got {out_dtype}")


def torch_epilogue(acc: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype,
                   out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's epilogue by PyTorch's ops, in the kernel's order of fp32 operations."""
    if a_scale is None:
        return acc
    out = acc.to(torch.float32) * a_scale[:, None] * b_scale[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)
    if relu:
        out = torch.relu(out)
    out = out.to(out_dtype)
    return out if out_scale is None else _torch_static(out, out_scale)


def result_dtype(out_dtype: torch.dtype, out_scale: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype the ops return: ``out_dtype``, or int8 where ``out_scale`` quantizes the result."""
    return out_dtype if out_scale is None else torch.int8


def check_k(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError where a (..., K) and b (K, N) disagree on K (checked before the scales: a weight passed
    untransposed is then named as what it is)."""
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{op}: K mismatch: a has shape {tuple(a.shape)} (K={a.shape[-1]}) "
                         f"but b has shape {tuple(b.shape)} (K={b.shape[0]})")


def _as_vector(scale: Optional[torch.Tensor], shape: Tuple[int, ...], what: str) -> Optional[torch.Tensor]:
    """A scale given per row of (..., K) operands (``shape`` = their leading dims), or one for all of
    them, as the ops' (n,); b's also as ``torch._scaled_mm``'s (1, n). Shapes must match, not only sizes:
    a transposed scale is an error."""
    if scale is None:
        return None
    n = math.prod(shape)
    if scale.numel() == 1:
        return scale.reshape(1).expand(n)  # stride 0: one scale read by every row, no copy
    if tuple(scale.shape) not in (tuple(shape), (n,), (*shape, 1), *([(1, n)] if what == "b_scale" else [])):
        also = f" shaped {tuple(shape)}" if len(shape) > 1 else ""
        raise ValueError(f"{what} must hold one scale per {'row of a' if what == 'a_scale' else 'column of b'} "
                         f"({n}){also} or a single scale, got shape {tuple(scale.shape)}")
    return scale.reshape(n)


def call(op, torch_forward: Callable, check_for_triton: Callable, operand_dtype: torch.dtype, a: torch.Tensor,
         b: torch.Tensor, a_scale: Optional[torch.Tensor], b_scale: Optional[torch.Tensor],
         bias: Optional[torch.Tensor], relu: bool, out_dtype: torch.dtype, backend: str,
         out_scale: Optional[torch.Tensor] = None, fast_accum: Optional[bool] = None) -> torch.Tensor:
    """The public functions' body: a layout an eager call planned before is one C++ call (``eager_path.scaled_gemm``:
    the host cost of a repeated call in a model); else (..., K) rows flattened, scales as vectors, then the backend:
    "auto" the op (its eager body without the dispatcher when nothing traces the call), "triton"
    the kernel, "torch" the op's PyTorch body. ``operand_dtype``: the op's (int8 or fp8 e4m3). ``out_scale`` (the
    int8 op's) and ``fast_accum`` (the fp8 op's) go to the op only where given. Under forward-mode AD "auto" is
    "torch": a custom op has no forward-mode formula, PyTorch's ops carry the scales' and bias' tangents."""
    if backend == "auto" and in_dual_level():
        backend = "torch"
    if (backend == "auto" and type(relu) is bool and isinstance(out_dtype, torch.dtype)
            and out_dtype in _OUT_DTYPE_CODES and (fast_accum is None or type(fast_accum) is bool)):
        out = eager_path.scaled_gemm(a, b, a_scale, b_scale, bias, relu, operand_dtype, out_dtype,
                                     _OUT_DTYPE_CODES[out_dtype], out_scale, bool(fast_accum))
        if out is not None:
            return out
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not isinstance(out_dtype, torch.dtype):  # else the dispatcher's "Expected a value of type 'int'"
        raise TypeError(f"out_dtype must be a torch.dtype (torch.bfloat16, say), got {out_dtype!r}")
    if a.dim() < 1 or b.dim() != 2:
        raise ValueError(f"a must have shape (..., K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    check_k(op.__name__, a, b)
    a2 = a if a.dim() == 2 else a.reshape(math.prod(a.shape[:-1]), a.shape[-1])  # not -1: K may be 0
    a_scale = _as_vector(a_scale, tuple(a.shape[:-1]), "a_scale")
    b_scale = _as_vector(b_scale, (b.shape[1],), "b_scale")
    args = ((a2, b, a_scale, b_scale, bias, relu, out_dtype) + (() if out_scale is None else (out_scale,))
            + (() if fast_accum is None else (fast_accum,)))
    runs_triton = execution_path(a) is ExecutionPath.TRITON
    if backend == "triton" and not runs_triton:
        raise ValueError(f"backend='triton' runs on CUDA tensors (or any under TRITON_INTERPRET=1), "
                         f"got {a.device.type} tensors: use backend='auto' or 'torch'")
    if backend == "torch":
        out = torch_forward(*args)
    elif backend == "triton" or (runs_triton and untraced(*args[:5], out_scale)):
        check_for_triton(*args)
        out = a2.new_empty((a2.shape[0], b.shape[1]), dtype=result_dtype(out_dtype, out_scale))
        scaled_gemm(a2, b, out, a_scale, b_scale, bias, relu, out_scale, out_dtype, fast_accum=bool(fast_accum))
    else:
        out = op(*args)
    return out if a.dim() == 2 else out.view(*a.shape[:-1], b.shape[1])
