"""Fused matmul + bias + ReLU in Triton: ``Y = relu(A @ B + bias)``, forward and backward.

One autotuned GEMM kernel serves all three products, switched by ``tl.constexpr`` flags:

    forward   Y    = relu(A @ B + bias)
    grad A    dA   = G @ B^T                  G = where(Y <= 0, 0, dY), applied while dY is loaded
    grad B    dB^T = G^T @ A,  dbias = G^T @ 1 (row sums of the left operand, in the same pass)

The mask comes from the saved output (no recomputed forward). Without TMA, G is never written
to memory: the mask is applied while dY is loaded, on the left operand. With TMA (Hopper) G is
written once and both products take the faster TMA body, dbias summed by PyTorch
(``_mask_on_load``).
The kernel has two bodies: a tiled pointer body for any strides (and the interpreter), and a
persistent body that moves tiles with TMA descriptors, eligible when every operand has a
unit-stride dimension and 16-byte aligned rows. The autotuner times both and keeps the faster, and
times cuBLAS too wherever it computes the same result (``CUBLAS``: not where the mask is applied on load).

Derivatives the kernels cannot give run PyTorch's ops: a backward that is itself differentiated
(``create_graph=True``), and calls under forward-mode AD or ``torch.func`` (see ``matmul_relu``).
"""
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fuselab.kernels import eager_path
from fuselab.kernels._autotune import LibraryChoice, autotune, bucket
from fuselab.kernels._gemm_tiles import gemm_config, needs_int64, tile_coords, tile_pointers, tma_layout
from fuselab.kernels._runtime import (
    INTERPRET,
    SUPPORTED_DTYPES,
    ExecutionPath,
    autocast_excluded,
    backward_by_torch_needed,
    beyond_custom_ops,
    check_same_device,
    check_same_dtype,
    check_tensors,
    execution_path,
    has_tma,
    in_dual_level,
    launch,
    launch_planned,
    max_shared_memory,
    num_sms,
    plan_layout,
    refuse_forward_ad,
    register_op,
    untraced,
)

# ----------------------------------------------------------------------------------------------
# Autotune configs
# ----------------------------------------------------------------------------------------------


def gemm_configs(interpret: bool = INTERPRET):
    """Configs timed by the autotuner; pruned per problem by ``_prune_configs``. ``interpret=False``: the
    GPU's list, also under the interpreter (tests run each config there)."""
    if interpret:  # timings mean nothing there: two small tiles exercise the tuner cheaply
        return [gemm_config(32, 32, 32, 1, 4, group_m=2), gemm_config(16, 32, 16, 1, 4, group_m=2)]
    # Hopper (sm_90) first: wgmma tiles are 64 rows per warpgroup, so 128x256 wants 8 warps.
    pointer = [gemm_config(*c) for c in [
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4), (64, 256, 64, 4, 4),
        (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
        (64, 64, 128, 4, 4), (64, 32, 128, 5, 4),  # few rows (M=64): more programs, deeper K
        (128, 128, 32, 4, 8), (64, 64, 32, 4, 4),  # BLOCK_K=32: fp32 tiles, twice the bytes
        # Decode and skinny M (<= 64 rows, pruned above): the weight's bytes bound the time, so narrow
        # row tiles with deep K pipelines keep more of it in flight across more programs.
        (16, 64, 128, 5, 4), (16, 128, 128, 4, 4), (32, 64, 128, 5, 4), (32, 128, 64, 5, 4)]]
    # Persistent TMA body: the next tile's loads start while this tile's epilogue stores.
    tma = [gemm_config(*c, tma=True, subtile=s) for *c, s in [
        (128, 256, 64, 3, 8, False), (128, 256, 64, 4, 8, True), (256, 128, 64, 3, 8, False),
        (128, 128, 64, 4, 8, False), (64, 256, 64, 4, 4, False), (128, 128, 32, 4, 8, False)]]
    return pointer + tma


# Used when FUSELAB_AUTOTUNE=0: a tile that is good on Hopper for large 16-bit problems.
HEURISTIC_CONFIG = gemm_config(128, 128, 64, 4, 8)


def _cublas_applies(args: dict) -> bool:
    """cuBLAS can compute a launch that applies no ReLU mask to A and sums no rows: the forward (a GEMM
    with a bias epilogue, then ReLU in place) and the backward's products where G is written first."""
    return not (args["MASK_A"] or args["ROWSUM_A"])


@torch.no_grad()  # out= ops refuse inputs that require grad while grad mode is on (a direct _gemm call)
def _cublas_gemm(args: dict) -> None:
    a, b, c = args["a_ptr"], args["b_ptr"], args["c_ptr"]
    if args["HAS_BIAS"]:
        torch.addmm(args["bias_ptr"], a, b, out=c)
    else:
        torch.mm(a, b, out=c)
    if args["RELU"]:
        c.relu_()  # torch.relu's NaN rule (cuBLASLt's ReLU epilogue would turn NaN into 0)


# A choice the tuner times beside the kernel's configs, as inductor's max-autotune times aten's mm: where
# cuBLAS (split-K and all) wins, at decode and skinny shapes say, the op runs it; an extra pass over C
# for the ReLU is the cost of that choice, and it is timed, as is the host's time to issue it (issue_bound;
# the choice serves CUDA graphs too, where host time does not count: a small GEMM may then run a kernel a
# few microseconds slower than cuBLAS).
CUBLAS = LibraryChoice("cublas", _cublas_gemm, _cublas_applies)


def _prune_configs(configs, named_args, **kwargs):
    """Drop configs that overflow shared memory, need TMA where the layout forbids it,
    or use tiles far larger than the problem."""
    args = {**named_args, **kwargs}
    es = args["a_ptr"].element_size()
    smem = max_shared_memory()
    m, n = args["M_BUCKET"], args["N_BUCKET"]
    has_tall_tiles = any(c.kwargs["BLOCK_M"] >= 64 for c in configs)  # not so in the interpreter's list
    kept = []
    for c in configs:
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        a_tiles = 2 if args["MASK_A"] else 1  # the mask is a second left tile
        need = c.num_stages * (a_tiles * bm * bk + bk * bn) * es
        if c.kwargs["TMA"]:
            if not args["TMA_OK"]:
                continue
            need += bm * bn * es // (2 if c.kwargs["EPILOGUE_SUBTILE"] else 1)
        if need > smem:
            continue
        if (bm > 64 and m <= 32) or (bn > 64 and n <= 32) or (bm < 64 and m > 64 and has_tall_tiles):
            continue
        kept.append(c)
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

# The interpreter's bf16 tl.dot returns garbage (~1e10): there the pointer body multiplies bf16
# tiles in fp32, exactly as a GPU does (a bf16 product fits in fp32, and both accumulate in fp32).
_INTERPRETED_BF16_DOT_IN_FP32 = tl.constexpr(INTERPRET)


@autotune(configs=gemm_configs(), prune=_prune_configs, heuristic=HEURISTIC_CONFIG, library=[CUBLAS],
          key=["M_BUCKET", "N_BUCKET", "K_BUCKET", "A_ROW_MAJOR", "B_ROW_MAJOR", "TMA_OK",
               "HAS_BIAS", "RELU", "MASK_A", "ROWSUM_A"])
@triton.jit
def matmul_relu_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, y_ptr, rowsum_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_ym, stride_yk, stride_bias,
    M_BUCKET, N_BUCKET, K_BUCKET,  # autotune keys only
    HAS_BIAS: tl.constexpr, RELU: tl.constexpr, MASK_A: tl.constexpr, ROWSUM_A: tl.constexpr,
    A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, TMA_OK: tl.constexpr,
    INT64: tl.constexpr, PRECISION: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
):
    """C = act(maskA(A) @ B + bias); optionally rowsum = maskA(A) @ 1. See the module docstring."""
    if TMA:
        _gemm_tma_persistent(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak,
                             stride_bk, stride_bn, stride_cm, stride_bias, HAS_BIAS, RELU,
                             A_ROW_MAJOR, B_ROW_MAJOR, INT64, PRECISION, NUM_SMS, BLOCK_M, BLOCK_N,
                             BLOCK_K, GROUP_M, EPILOGUE_SUBTILE)
    else:
        pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, y_ptr, rowsum_ptr, M, N, K, stride_am,
                   stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_ym, stride_yk,
                   stride_bias, pid_m, pid_n, HAS_BIAS, RELU, MASK_A, ROWSUM_A, INT64, PRECISION,
                   BLOCK_M, BLOCK_N, BLOCK_K)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _bias_relu(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS: tl.constexpr, RELU: tl.constexpr):
    if HAS_BIAS:  # any stride: a slice, a column, or 0 for an expanded scalar (Triton specializes 1)
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + bias[None, :].to(tl.float32)
    if RELU:
        acc = tl.where(acc < 0, 0.0, acc)  # not maximum(): NaN must propagate, as in torch.relu
    return acc


@triton.jit
def _gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, y_ptr, rowsum_ptr, M, N, K, stride_am, stride_ak,
               stride_bk, stride_bn, stride_cm, stride_cn, stride_ym, stride_yk, stride_bias, pid_m,
               pid_n, HAS_BIAS: tl.constexpr, RELU: tl.constexpr, MASK_A: tl.constexpr,
               ROWSUM_A: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, offs_k, rm, rn, a_ptrs, b_ptrs = tile_pointers(
        a_ptr, b_ptr, pid_m, pid_n, M, N, stride_am, stride_ak, stride_bk, stride_bn, INT64, BLOCK_M, BLOCK_N, BLOCK_K)
    if MASK_A:
        y_ptrs = y_ptr + rm[:, None] * stride_ym + offs_k[None, :] * stride_yk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rowsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if MASK_A:
            # ReLU's gradient as torch computes it: zero where y <= 0 (also at exactly 0),
            # passed through where y > 0 or y is NaN.
            y = tl.load(y_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            a = tl.where(y <= 0, tl.zeros_like(a), a)
            y_ptrs += BLOCK_K * stride_yk
        if _INTERPRETED_BF16_DOT_IN_FP32:
            if a.dtype == tl.bfloat16:  # exact: a product of two bf16 values fits in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
        if ROWSUM_A:
            rowsum += tl.sum(a.to(tl.float32), axis=1)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if ROWSUM_A:  # one column of programs writes it: deterministic, no atomics
        tl.store(rowsum_ptr + offs_m, rowsum.to(rowsum_ptr.dtype.element_ty),
                 mask=(offs_m < M) & (pid_n == 0))
    acc = _bias_relu(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS, RELU)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _gemm_tma_persistent(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                         stride_bn, stride_cm, stride_bias, HAS_BIAS: tl.constexpr,
                         RELU: tl.constexpr, A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                         INT64: tl.constexpr, PRECISION: tl.constexpr, NUM_SMS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr):
    # A column-major operand is described as its transpose and transposed back in shared memory.
    if A_ROW_MAJOR:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [K, M], [stride_ak, 1], [BLOCK_K, BLOCK_M])
    if B_ROW_MAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
    C_BLOCK_N: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, C_BLOCK_N])
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_ROW_MAJOR:
                a = a_desc.load([off_m, off_k])
            else:
                a = a_desc.load([off_k, off_m]).T
            if B_ROW_MAJOR:
                b = b_desc.load([off_k, off_n])
            else:
                b = b_desc.load([off_n, off_k]).T
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if INT64:  # the bias, read through offsets here, may be a column of a huge matrix
            offs_n = offs_n.to(tl.int64)
        acc = _bias_relu(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS, RELU)
        c = acc.to(c_ptr.dtype.element_ty)
        if EPILOGUE_SUBTILE:  # two half-width stores halve the epilogue's shared memory
            c0, c1 = c.reshape(BLOCK_M, 2, C_BLOCK_N).permute(0, 2, 1).split()
            c_desc.store([off_m, off_n], c0)
            c_desc.store([off_m, off_n + C_BLOCK_N], c1)
        else:
            c_desc.store([off_m, off_n], c)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _plan_key(a, b, c, bias, y, rowsum, relu) -> tuple:
    """Everything a launch of ``_gemm`` specializes on but the data: see ``launch_planned``."""
    return (a.get_device(), relu, torch.get_float32_matmul_precision(),
            *(plan_layout(t) for t in (a, b, c, bias, y, rowsum)))


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
          y: Optional[torch.Tensor] = None, rowsum: Optional[torch.Tensor] = None,
          relu: bool = False, config: Optional[triton.Config] = None) -> None:
    """``c = [relu](where(y <= 0, 0, a) @ b + bias)`` and ``rowsum = that left operand @ 1``.

    ``y`` is the forward's output (shaped like ``a``): where it is <= 0 the ReLU's gradient masks
    ``a`` to 0 as it is loaded. All 2-D with any strides; ``c`` and ``rowsum`` are written.
    ``bias`` is 1-D with any stride (0 too). ``config`` bypasses the autotuner (tests and benchmarks
    of single configs).
    """
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:  # nothing to multiply; a row sum over an empty C may still be due
        if rowsum is not None:
            rowsum.copy_(_relu_grad(a, y).sum(1, dtype=torch.float32))
        return
    if bias is None and y is None and rowsum is None and c.stride(0) == 1 and c.stride(1) != 1:
        # A column-major C (e.g. the gradient of weight.t()) is computed as C^T = B^T A^T, row-major:
        # the TMA body stores row-major tiles only.
        return _gemm(b.t(), a.t(), c.t(), relu=relu, config=config)
    tensors = [t for t in (a, b, c, bias, y, rowsum) if t is not None]
    plan_key = cpp_key = None
    if config is None and not INTERPRET and untraced(*tensors):  # a repeated eager call skips the rest
        plan_key = _plan_key(a, b, c, bias, y, rowsum, relu)
        if a.dtype != torch.float32 and eager_path.may_plan():  # the C++ path serves fp16/bf16 only
            cpp_key = ((eager_path.GEMM_KIND, a.get_device(), int(relu)), (a, b, c, bias, y, rowsum))
        if launch_planned(plan_key, *tensors, cpp_key=cpp_key):
            return
    tma_ok = False
    if has_tma(a.device) and y is None and rowsum is None and K > 0:
        tma_ok = (tma_layout(a) is not None and tma_layout(b) is not None
                  and tma_layout(c) is True)
    precision = "tf32"
    if a.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        precision = "ieee"
    sms = num_sms(a.device)

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(sms, tiles) if meta["TMA"] else tiles,)

    kernel, meta = matmul_relu_kernel, {}
    if config is not None:  # a fixed config bypasses the tuner, and with it torch.compile support
        if config.kwargs["TMA"] and not tma_ok:
            raise ValueError(f"config {config} needs TMA-compatible layouts")
        kernel, meta = matmul_relu_kernel.fn, config.all_kwargs()
    y_strides = y.stride() if y is not None else (0, 0)
    launch(kernel, grid, a, b, c, bias, y, rowsum, M, N, K,
           a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
           y_strides[0], y_strides[1], bias.stride(0) if bias is not None else 0,
           bucket(M), bucket(N), bucket(K),
           HAS_BIAS=bias is not None, RELU=relu, MASK_A=y is not None,
           ROWSUM_A=rowsum is not None, A_ROW_MAJOR=a.stride(1) == 1,
           B_ROW_MAJOR=b.stride(1) == 1, TMA_OK=tma_ok, INT64=needs_int64(a, b, c, y, bias),
           PRECISION=precision, NUM_SMS=sms, plan_key=plan_key, cpp_key=cpp_key, **meta)


# ----------------------------------------------------------------------------------------------
# Op registration: forward, the two backward products, autograd
# ----------------------------------------------------------------------------------------------


def _check_inputs(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    dtype, device, strided = a.dtype, a.device, torch.strided
    same = (b.dtype == dtype and b.device == device and a.layout == strided and b.layout == strided
            and (bias is None or (bias.dtype == dtype and bias.device == device and bias.layout == strided)))
    if not (same and dtype in SUPPORTED_DTYPES):  # the slow, message-building checks only on failure
        for name, t in (("a", a), ("b", b), ("bias", bias)):
            if t is not None and t.layout != strided:
                raise TypeError(f"{name} is a {t.layout} tensor: matmul_relu takes dense (strided) tensors; "
                                f"call .to_dense() first")
        check_same_device(a=a, b=b, bias=bias)
        check_same_dtype(a=a, b=b, bias=bias)
    if a.dim() < 1:
        raise ValueError("a must have shape (..., K), got a 0-d tensor")
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D with shape (K, N), got shape {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"K mismatch: a has shape {tuple(a.shape)} (K={a.shape[-1]}) "
                         f"but b has shape {tuple(b.shape)} (K={b.shape[0]})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise ValueError(f"bias must have shape (N,) = ({b.shape[1]},), got {tuple(bias.shape)}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., C) -> (rows, C), a view where the strides allow (also when a size is 0)."""
    if t.dim() == 2:
        return t
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _relu_grad(grad: torch.Tensor, y: Optional[torch.Tensor]) -> torch.Tensor:
    """ReLU's gradient from its output, as torch.relu's backward: 0 where y <= 0 (y None: grad)."""
    return grad if y is None else torch.ops.aten.threshold_backward(grad, y, 0)


def _runs_triton(t: torch.Tensor) -> bool:
    """Whether the op's GEMMs on ``t`` run Triton (``ExecutionPath.TRITON``), or PyTorch's own
    kernels and a separate ReLU: on a plain CPU, and for exact fp32 on a GPU (``"highest"``, torch's
    default precision), where Triton's exact-fp32 dot has no tensor-core form and loses to cuBLAS."""
    return execution_path(t, exact_fp32_on_cuda_uses_torch=True) is ExecutionPath.TRITON


def _mask_on_load(grad: torch.Tensor) -> bool:
    """Whether the backward GEMMs apply the ReLU mask while loading dY, or G is written once first.

    Masking on load saves a pass over dY but needs the pointer body. Where the TMA body runs
    (Hopper), writing G once and running both products through it is faster: on the H200, fwd+bwd
    at 4096^3 bf16 went from 0.49x to 1.01x the rate of PyTorch autograd. Where PyTorch's kernels
    run (``_runs_triton``), G is written once too: each product would otherwise mask dY again."""
    return _runs_triton(grad) and not has_tma(grad.device)


def _torch_forward(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``relu(addmm(bias, a, b))`` by PyTorch's own ops, with the op's input checks."""
    _check_inputs(a, b, bias)
    a2 = _rows(a)
    return torch.relu(a2 @ b if bias is None else torch.addmm(bias, a2, b)).view(*a.shape[:-1], b.shape[1])


def _forward_fake(a, b, bias):
    _check_inputs(a, b, bias)
    return a.new_empty(*a.shape[:-1], b.shape[1])


def _unviewed(t: torch.Tensor) -> torch.Tensor:
    """An op body's result as a tensor of its own, not a view: autograd refuses any in-place op on an
    output that is a view made inside the op (``y.add_(1)`` failed where relu(linear) ran)."""
    return t.detach() if t._is_view() else t


def _forward(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    refuse_forward_ad("matmul_relu", "fuselab.kernels.matmul_relu or linear_relu")
    if not _runs_triton(a):
        with autocast_excluded():  # this body's own (the eager Function calls it without the dispatcher)
            return _unviewed(_torch_forward(a, b, bias))
    y = _forward_fake(a, b, bias)
    _gemm(_rows(a), b, _rows(y), bias=bias, relu=True)
    return y


def _grad_a_fake(grad, y, b):
    return grad.new_empty(*grad.shape[:-1], b.shape[0])


def _grad_a(grad: torch.Tensor, y: Optional[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """dA = G @ b^T with G = where(y <= 0, 0, grad) (``y`` None: ``grad`` is G), shaped like A."""
    refuse_forward_ad("matmul_relu_grad_a", "fuselab.kernels.matmul_relu or linear_relu")
    g2 = _rows(grad)
    y2 = None if y is None else _rows(y)
    if not _runs_triton(grad):
        with autocast_excluded():
            return _unviewed((_relu_grad(g2, y2) @ b.t()).view(*grad.shape[:-1], b.shape[0]))
    out = _grad_a_fake(grad, y, b)
    _gemm(g2, b.t(), _rows(out), y=y2)
    return out


def _grad_b_fake(grad, y, a, b):
    return torch.empty_like(b), grad.new_empty(b.shape[1])


def _grad_b(grad: torch.Tensor, y: Optional[torch.Tensor], a: torch.Tensor,
            b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dB, dbias) = (a^T @ G, G^T @ 1) with G as in ``_grad_a``; dB laid out like b."""
    refuse_forward_ad("matmul_relu_grad_b", "fuselab.kernels.matmul_relu or linear_relu")
    grad_b, grad_bias = _grad_b_fake(grad, y, a, b)
    g2, a2 = _rows(grad), _rows(a)
    y2 = None if y is None else _rows(y)
    if _runs_triton(grad) and y2 is not None:  # as dB^T = G^T @ A: the masked operand is the left one
        _gemm(g2.t(), a2, grad_b.t(), y=y2.t(), rowsum=grad_bias)
        return grad_b, grad_bias
    g = _relu_grad(g2, y2)
    if _runs_triton(grad):
        _gemm(a2.t(), g, grad_b)
    else:
        with autocast_excluded():
            grad_b.copy_(a2.t() @ g)
    grad_bias.copy_(g.sum(0, dtype=torch.float32))
    return grad_b, grad_bias


def _setup_context(ctx, inputs, output):
    a, b, bias = inputs
    ctx.save_for_backward(a, b, output)
    ctx.has_bias = bias is not None


def _backward_by_torch(grad, a, b, y, need_a: bool, need_b: bool, need_bias: bool):
    """The backward from PyTorch's differentiable ops, with torch.relu's own mask: its results have
    a graph, so their derivatives (double backward, Hessians, gradient penalties) are PyTorch's."""
    g = _relu_grad(grad, y)
    g2 = _rows(g)
    return (g @ b.t() if need_a else None, _rows(a).t() @ g2 if need_b else None,
            g2.sum(0) if need_bias else None)


def _backward_using(grad_a_fn, grad_b_fn):
    def backward(ctx, grad):
        a, b, y = ctx.saved_tensors
        need_a, need_b, need_bias = ctx.needs_input_grad[:3]  # ops with extra non-tensor arguments share it
        if backward_by_torch_needed(grad):
            return _backward_by_torch(grad, a, b, y, need_a, need_b, need_bias and ctx.has_bias)
        grad_a = grad_b = grad_bias = None
        if not _mask_on_load(grad):  # G written once, shared by both products
            grad, y = _relu_grad(grad, y), None
        if need_a:
            grad_a = grad_a_fn(grad, y, b)
        if need_b or (need_bias and ctx.has_bias):
            grad_b, grad_bias = grad_b_fn(grad, y, a, b)
        return grad_a, grad_b if need_b else None, grad_bias if ctx.has_bias and need_bias else None

    return backward


_matmul_relu_op = register_op("fuselab::matmul_relu", fake=_forward_fake)(_forward)
register_op("fuselab::matmul_relu_grad_a", fake=_grad_a_fake)(_grad_a)
register_op("fuselab::matmul_relu_grad_b", fake=_grad_b_fake)(_grad_b)
_backward = _backward_using(torch.ops.fuselab.matmul_relu_grad_a, torch.ops.fuselab.matmul_relu_grad_b)
_matmul_relu_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerMatmulReLU(torch.autograd.Function):
    """The registered op's own bodies, called without the dispatcher.

    In eager mode the custom-op dispatch and its autograd wrapper cost more host time than a
    small GEMM takes on the GPU; when nothing traces or transforms the call (``untraced``) the
    same kernels run through this Function instead. Traced calls keep the op, so
    ``torch.compile`` and ``torch.export`` see ``torch.ops.fuselab.matmul_relu``. Both share one
    backward: Triton's products, or with ``create_graph=True`` PyTorch's (``_backward_by_torch``).
    """

    @staticmethod
    def forward(ctx, a, b, bias):  # ctx-style: a separate setup_context makes apply() inspect signatures
        y = _forward(a, b, bias)
        _setup_context(ctx, (a, b, bias), y)
        return y

    backward = staticmethod(_backward_using(_grad_a, _grad_b))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def matmul_relu(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                backend: str = "triton") -> torch.Tensor:
    """``relu(a @ b + bias)`` in one fused kernel, differentiable in ``a``, ``b`` and ``bias``.

    Args:
        a: (..., K), any leading batch dims and any strides (batch dims that cannot be flattened
            without a copy are copied once).
        b: (K, N), any strides: ``weight.t()`` is used as it is, with no copy.
        bias: (N,) or None.
    All three share one device and one dtype out of float16, bfloat16 and float32; the result
    has that dtype, accumulated in fp32 (fp32 inputs use tf32 unless
    ``torch.get_float32_matmul_precision() == "highest"``, the default, where a GPU runs cuBLAS's
    SGEMM and a ReLU instead: see ``_runs_triton``). Where the eager tuner found cuBLAS faster than every
    Triton config (``CUBLAS``), the accumulation is cuBLAS's, as in ``nn.Linear``: with torch's default
    ``allow_bf16/fp16_reduced_precision_reduction``, split-K partial sums may be added in 16 bits. NaN propagates, the
    gradient at an output of exactly 0 is 0. Raises ValueError/TypeError naming the bad shapes,
    dtypes or devices. ``backend="cuda"`` runs the CUDA C++ reference instead (built on first use).

    Higher-order and forward-mode gradients: a first-order backward runs fuselab's kernels; a
    backward that is itself differentiated (``create_graph=True``: double backward, Hessians and
    Hessian-vector products, gradient penalties) is built from PyTorch's differentiable ops with
    ``torch.relu``'s own mask, on this function and on ``torch.ops.fuselab.matmul_relu`` alike, so
    every higher derivative is PyTorch's. Under forward-mode AD (``torch.autograd.forward_ad``,
    ``torch.func.jvp``, ``jacfwd``) and ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``,
    ``hessian``, ``vmap``) this function computes ``relu(addmm(bias, a, b))`` with PyTorch's ops, so
    tangents (NaN included) and transformed results are PyTorch's. A custom op can have neither a
    forward-mode formula nor torch.func's autograd: ``torch.ops.fuselab.matmul_relu`` and its
    backward ops called directly raise NotImplementedError under forward-mode AD (never a zero
    tangent) and torch's own error under ``torch.func.grad``; ``backend="cuda"`` refuses
    forward-mode AD.
    """
    if backend == "cuda":
        if in_dual_level():
            raise NotImplementedError("matmul_relu(backend='cuda') has no forward-mode derivative "
                                      "(torch.autograd.forward_ad, torch.func.jvp/jacfwd): use backend='triton'")
        from fuselab.kernels.matmul_relu_cuda import matmul_relu_cuda

        return matmul_relu_cuda(a, b, bias)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'cuda', got {backend!r}")
    out = eager_path.call(a, b, bias, linear=False, autocast=False)  # C++: an eager CUDA call it can serve
    return out if out is not None else python_matmul_relu(a, b, bias)


def python_matmul_relu(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``matmul_relu`` for the calls the C++ eager path declined (or never sees: tracing, fp32, CPU)."""
    check_tensors(a=a, b=b, bias=bias)
    return _matmul_relu_of_tensors(a, b, bias)


def _matmul_relu_of_tensors(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if execution_path(a) is ExecutionPath.TRITON and untraced(a, b, bias) and not beyond_custom_ops():
        return _EagerMatmulReLU.apply(a, b, bias)
    if not torch.compiler.is_compiling() and beyond_custom_ops():
        return _torch_forward(a, b, bias)  # PyTorch's ops: every transform and tangent rule is theirs
    return torch.ops.fuselab.matmul_relu(a, b, bias)


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``relu(F.linear(x, weight, bias))``: ``weight`` is (N, K) as in ``nn.Linear``."""
    out = eager_path.call(x, weight, bias, linear=True, autocast=False)
    return out if out is not None else python_linear_relu(x, weight, bias)


def python_linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear_relu`` for the calls the C++ eager path declined."""
    check_tensors(x=x, weight=weight, bias=bias)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D with shape (N, K), got shape {tuple(weight.shape)}")
    if x.dim() >= 1 and x.shape[-1] != weight.shape[1]:  # in its own names: matmul_relu's b is weight.t()
        raise ValueError(f"K mismatch: x has shape {tuple(x.shape)} (K={x.shape[-1]}) but weight has shape "
                         f"{tuple(weight.shape)} (N, K={weight.shape[1]})")
    return _matmul_relu_of_tensors(x, weight.t(), bias)
