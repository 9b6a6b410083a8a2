"""What every fuselab GEMM kernel shares: its configs' form, the grouped tile order, the 64-bit offset
check, the TMA layouts."""
from typing import Optional

import torch
import triton
import triton.language as tl


def gemm_config(bm: int, bn: int, bk: int, stages: int, warps: int, group_m: int = 8, tma: bool = False,
                subtile: bool = False) -> triton.Config:
    """An autotune config of a fuselab GEMM: tile sizes, grouped order, body (pointer or persistent TMA),
    split epilogue store, warps and pipeline stages."""
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "TMA": tma, "EPILOGUE_SUBTILE": subtile}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


@triton.jit
def tile_coords(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row-blocks sweep the columns together, so B tiles stay in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (tile_id // width) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % width) % group_size
    pid_n = (tile_id % width) // group_size
    return pid_m, pid_n


def needs_int64(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a program's element offsets into any of ``tensors`` can pass 2**31 (a block of slack
    past each edge): the kernel then computes them in 64 bits."""
    return any(sum((s + 256) * abs(st) for s, st in zip(t.shape, t.stride())) >= 2**31
               for t in tensors if t is not None)


@triton.jit
def tile_pointers(a_ptr, b_ptr, pid_m, pid_n, M, N, stride_am, stride_ak, stride_bk, stride_bn,
                  INT64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offs_m, offs_n, offs_k, rm, rn, a_ptrs, b_ptrs) of a pointer-body tile's first K step."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if INT64:  # offsets past 2**31 elements
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    # Rows/columns past the edge re-read valid ones (no load mask); the store drops them.
    rm = offs_m % M
    rn = offs_n % N
    a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + rn[None, :] * stride_bn
    return offs_m, offs_n, offs_k, rm, rn, a_ptrs, b_ptrs


def tma_layout(t: torch.Tensor) -> Optional[bool]:
    """True/False if ``t`` (2-D) is row-/column-major with 16-byte aligned rows and base (a TMA
    descriptor can describe it), else None (a broadcast or overlapping stride included)."""
    es = t.element_size()
    if t.storage_offset() * es % 16:  # not data_ptr(): this also runs on fake tensors while tracing
        return None
    s0, s1 = t.stride()
    if s1 == 1 and s0 * es % 16 == 0 and s0 >= t.shape[1]:
        return True
    if s0 == 1 and s1 * es % 16 == 0 and s1 >= t.shape[0]:
        return False
    return None
