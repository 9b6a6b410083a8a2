"""Fused lazy AdamW update of the rows a sparse (COO) gradient touches: a sort, then two Triton kernels.

The gradient arrives uncoalesced: ``nn.Embedding(sparse=True)`` emits one (id, gradient row) pair per
lookup, so a row looked up L times appears L times, anywhere in the list. One step:

1. A stable sort of the ids makes each row's lookups one contiguous *segment* of the sorted
   positions, in lookup order. Its keys are (id + 1) * 2**32 + lookup position: all distinct, so
   no two ever tie and equal ids keep lookup order. ``rank_blocks_kernel`` sorts blocks of
   SORT_BLOCK keys (a key's place is the number of smaller keys in its block); each pass of
   ``merge_kernel`` makes FAN sorted runs one (a key's place is the sum over the runs of the number
   of smaller keys in each, found by binary search); the last launch writes the sorted ids and the
   permutation (int32): four launches for 65,536 lookups. torch.sort (cub's radix sort) makes a
   dozen launches, ~100 us of host time, more than the rest of an eager step; it sorts steps of more
   than TRITON_SORT_MAX lookups, where it takes less GPU time.
2. ``segment_kernel``: the sorted positions are cut into chunks of CHUNK. One program per chunk and
   block of columns gathers its chunk's gradient rows through the sort's permutation and sums each
   segment's piece of the chunk with a segmented scan (log2(CHUNK) shift-and-add steps; the scan is
   most of the kernel's instructions, so a chunk that is one piece is summed by a reduction instead,
   one whose lanes are each a piece of their own is not summed, and a chunk where no segment ends
   skips the AdamW arithmetic). A segment
   that starts and ends in the chunk is complete: the program applies AdamW to its row at once. A
   segment that crosses a chunk boundary leaves the sums of its pieces in a scratch buffer: its
   *tail* (the piece that ends its first chunk) and one *head* (the piece that starts the chunk) for
   every later chunk it reaches.
3. ``crossing_kernel``: for each crossing segment, the program of the chunk where it starts adds its
   tail and the heads of the following chunks, in chunk order, HEADS at a time, then updates the row.

Each row is updated by exactly one program; the summation tree (the scan or reduction inside a chunk,
then the chunk partials in order) depends only on the ids, so the sums are bitwise the same whatever order
the programs run in. Nothing reads a size back to the host (the grids depend on the number of
lookups and the row size only) and the step count is read on the device, so a whole training step
can be captured in a CUDA graph.

Cost model, for n lookups of U distinct rows of D columns (any distribution of ids, including all n
lookups on one row):

- the sort: n SORT_BLOCK key comparisons, then ceil(log_FAN(n / SORT_BLOCK)) passes over 8 bytes
  a lookup, each key binary-searching FAN runs (loads from L2); 8 bytes a lookup written last;
- ``segment_kernel``: every gradient row and id read once (n D), at most 2 partial rows written per
  chunk (2 n D / CHUNK);
- ``crossing_kernel``: every head read at most once (n D / CHUNK in all); its one sequential part is a
  crossing row's own loop over its heads, L / (CHUNK HEADS) tile loads for a row looked up L times:
  a few iterations even when one row holds every lookup;
- between them, p, m and v of every touched row read and written once (6 U D);
- parallelism: n / CHUNK programs (times the column blocks) in each kernel, whatever the repeats;
- scratch: the sort's keys (16 n bytes), the sorted ids and permutation (8 n bytes) and the partial rows
  (2 / CHUNK of an fp32 gradient).

Math is fp32 for fp32/bf16/fp16 parameters (rows are loaded, updated and stored in their dtype), with
IEEE-rounded division and square roots as torch's AdamW. The bias corrections 1 - beta**t are computed
in float64 on the device: beta arrives as two fp32 halves (hi + lo: beta to 2**-48) and beta**t comes
from repeated squaring over the bits of t (2 log2(t) roundings of 2**-53), so 1 - beta**t keeps ~1e-9
relative accuracy even where it is small (beta2 = 0.99999, t = 1: 1e-5) before its one rounding to
fp32; 1 - beta itself is passed from the host, not formed from an fp32 beta. A row id outside [0, rows)
(``torch.sparse_coo_tensor`` does not check its indices by default) stops the step (``check_row_ids``:
IndexError on a CPU, a device-side assert on eager CUDA steps), and the kernels never write outside the
parameter whatever its ids. float64 parameters take the PyTorch path (``sparse_adamw_torch``:
``coalesce()``, which waits for the host).
"""
import struct
from typing import Optional

import torch
import triton
import triton.language as tl

from fuselab.kernels import eager_path
from fuselab.kernels._casts import cast_rne
from fuselab.kernels._runtime import (
    ExecutionPath,
    call_untraced,
    execution_path,
    is_tracing,
    launch,
    launch_planned,
    register_op,
)

CHUNK = 64  # sorted positions one segment_kernel program sums (a power of two)
# Eager steps relaunch both kernels through launch plans (no Triton argument binding: host time per step);
# tests/test_sparse_adamw.py's GPU test of them passed on the H200 (triton 3.6). False: Triton's own launches.
PLANNED_LAUNCHES = True
LOG2_CHUNK = CHUNK.bit_length() - 1
TILE = 4096  # elements of a program's (positions, columns) tile: 32 fp32 registers a thread at 4 warps
# The sort's settings, the fastest of a sweep on the H100 (docs/notes/kernel_trials.md). Past TRITON_SORT_MAX
# lookups torch.sort (cub's radix sort) takes less GPU time and its host time matters less.
SORT_BLOCK = 256  # keys rank_blocks_kernel sorts a program (n SORT_BLOCK comparisons in all)
SORT_SUB = 32  # keys each of its loop's steps compares every key with
FAN = 8  # sorted runs a merge pass makes one (FAN binary searches a key)
MERGE_TILE = 256  # keys a merge_kernel program places (divides SORT_BLOCK, the unit of the padded length)
TRITON_SORT_MAX = 65536


@triton.jit
def _f32(x):
    return tl.cast(x, tl.float32)


@triton.jit
def _one_minus_pow(beta_hi, beta_lo, t):
    # 1 - beta**t in float64 for an integer t >= 0, beta = hi + lo: squaring over t's bits.
    base = tl.cast(beta_hi, tl.float64) + tl.cast(beta_lo, tl.float64)
    power = base * 0.0 + 1.0
    e = t
    while e > 0:
        power = tl.where(e % 2 == 1, power * base, power)
        base = base * base
        e = e // 2
    return 1.0 - power


@triton.jit
def _adamw(p_ptrs, m_ptrs, v_ptrs, g, mask, step_ptr, lr, beta1_hi, beta1_lo, one_minus_beta1, beta2_hi, beta2_lo,
           one_minus_beta2, eps, decay, MAXIMIZE: tl.constexpr):
    # The SparseAdamW rule on the rows behind the pointers, g their summed gradient (fp32).
    # Triton's launcher passes Python floats as fp32, torch.compile's as fp64: round them alike.
    lr, beta1_hi, beta1_lo = _f32(lr), _f32(beta1_hi), _f32(beta1_lo)
    beta2_hi, beta2_lo, eps, decay = _f32(beta2_hi), _f32(beta2_lo), _f32(eps), _f32(decay)
    one_minus_beta1, one_minus_beta2 = _f32(one_minus_beta1), _f32(one_minus_beta2)
    t = tl.load(step_ptr).to(tl.int64)
    step_size = (tl.cast(lr, tl.float64) / _one_minus_pow(beta1_hi, beta1_lo, t)).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt_rn(_one_minus_pow(beta2_hi, beta2_lo, t).to(tl.float32))
    if MAXIMIZE:
        g = -g
    p = tl.load(p_ptrs, mask=mask).to(tl.float32)
    m = tl.load(m_ptrs, mask=mask).to(tl.float32)
    v = tl.load(v_ptrs, mask=mask).to(tl.float32)
    m = beta1_hi * m + one_minus_beta1 * g
    v = beta2_hi * v + one_minus_beta2 * g * g
    p = p * decay
    # IEEE-rounded sqrt and division, as torch's own AdamW (tl.sqrt would flush subnormal v to zero).
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptrs, cast_rne(p, p_ptrs.dtype.element_ty), mask=mask)
    tl.store(m_ptrs, cast_rne(m, m_ptrs.dtype.element_ty), mask=mask)
    tl.store(v_ptrs, cast_rne(v, v_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def segment_kernel(
    ids_ptr, order_ptr, values_ptr, partial_ptr, param_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, guard_ptr,
    nnz, n_chunks, dim, n_rows, stride_g, stride_p, stride_m, stride_v,
    lr, beta1_hi, beta1_lo, one_minus_beta1, beta2_hi, beta2_lo, one_minus_beta2, eps, decay,
    MAXIMIZE: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    c = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    pos = c * CHUNK + lane
    live = pos < nnz
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = cols < dim
    # Valid ids are >= 0, so -1 past either end starts or ends a segment there.
    ids = tl.load(ids_ptr + pos, mask=live, other=-1)
    seg_start = ids != tl.load(ids_ptr + pos - 1, mask=live & (pos > 0), other=-1)
    seg_end = ids != tl.load(ids_ptr + pos + 1, mask=pos + 1 < nnz, other=-1)
    piece = tl.cumsum((seg_start | (lane == 0)).to(tl.int32), axis=0)  # 1, 2, ...: the segments' pieces here
    src = tl.load(order_ptr + pos, mask=live, other=0).to(tl.int64)
    g = tl.load(values_ptr + src[:, None] * stride_g + cols[None, :], mask=live[:, None] & in_row[None, :],
                other=0.0).to(tl.float32)
    pieces = tl.max(piece, axis=0)
    if pieces == 1:  # one piece (inside a row's long segment): its sum at every lane
        g = tl.broadcast_to(tl.sum(g, axis=0)[None, :], (CHUNK, BLOCK_D))
    elif pieces < CHUNK:  # pieces == CHUNK: every lane its own piece, nothing to add
        # Segmented inclusive scan: after step k each lane holds the sum of the last 2**(k+1) lanes of its piece.
        for k in tl.static_range(LOG2_CHUNK):
            from_lane = tl.maximum(lane - (1 << k), 0)
            same = (lane >= (1 << k)) & (tl.gather(piece, from_lane, 0) == piece)
            shifted = tl.gather(g, tl.broadcast_to(from_lane[:, None], (CHUNK, BLOCK_D)), 0)
            g = tl.where(same[:, None], g + shifted, g)
    # The chunk's first piece belongs to a segment that began in an earlier chunk ("joined").
    first = tl.load(ids_ptr + c * CHUNK)
    joined = (first == tl.load(ids_ptr + c * CHUNK - 1, mask=c > 0, other=-1)) & (piece == 1)
    head = joined & (seg_end | (lane == CHUNK - 1)) & live
    tail = ~joined & ~seg_end & (lane == CHUNK - 1) & live
    slot = (tl.where(tail, n_chunks, 0) + c).to(tl.int64)  # heads in partial[0], tails in partial[1]
    tl.store(partial_ptr + slot[:, None] * dim + cols[None, :], g,
             mask=(head | tail)[:, None] & in_row[None, :])
    # segments that start and end in this chunk, of rows of the parameter (check_row_ids stops the others' step;
    # guard_ptr, its result, is an argument so that a compiler keeps it)
    done = ~joined & seg_end & live & (ids >= 0) & (ids < n_rows)
    rows = ids.to(tl.int64)[:, None]
    if tl.max(done.to(tl.int32), axis=0) == 1:  # no row ends here: no update to compute
        _adamw(param_ptr + rows * stride_p + cols[None, :], exp_avg_ptr + rows * stride_m + cols[None, :],
               exp_avg_sq_ptr + rows * stride_v + cols[None, :], g, done[:, None] & in_row[None, :], step_ptr,
               lr, beta1_hi, beta1_lo, one_minus_beta1, beta2_hi, beta2_lo, one_minus_beta2, eps, decay, MAXIMIZE)


@triton.jit
def crossing_kernel(
    ids_ptr, partial_ptr, param_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr,
    n_chunks, dim, n_rows, stride_p, stride_m, stride_v,
    lr, beta1_hi, beta1_lo, one_minus_beta1, beta2_hi, beta2_lo, one_minus_beta2, eps, decay,
    MAXIMIZE: tl.constexpr, CHUNK: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    c = tl.program_id(0)  # chunks 0 .. n_chunks - 2: each has a successor
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = cols < dim
    last = c * CHUNK + CHUNK - 1
    row = tl.load(ids_ptr + last)
    first = tl.load(ids_ptr + c * CHUNK)
    joined = (first == row) & (first == tl.load(ids_ptr + c * CHUNK - 1, mask=c > 0, other=-1))
    crosses = (row == tl.load(ids_ptr + last + 1)) & ~joined & (row >= 0) & (row < n_rows)
    if crosses:  # this chunk starts a segment (of a row of the parameter) that crosses its end
        g = tl.load(partial_ptr + (n_chunks + c).to(tl.int64) * dim + cols, mask=in_row, other=0.0)
        k0 = c + 1
        more = k0 < n_chunks
        while more:  # the heads of the chunks the segment reaches, in order; a prefix of each tile matches
            ks = k0 + tl.arange(0, HEADS)
            reach = (tl.load(ids_ptr + ks.to(tl.int64) * CHUNK, mask=ks < n_chunks, other=-1) == row) & (ks < n_chunks)
            g += tl.sum(tl.load(partial_ptr + ks.to(tl.int64)[:, None] * dim + cols[None, :],
                                mask=reach[:, None] & in_row[None, :], other=0.0), axis=0)
            more = tl.min(reach.to(tl.int32), axis=0) == 1
            k0 += HEADS
        r = row.to(tl.int64)
        _adamw(param_ptr + r * stride_p + cols, exp_avg_ptr + r * stride_m + cols,
               exp_avg_sq_ptr + r * stride_v + cols, g, in_row, step_ptr, lr, beta1_hi, beta1_lo,
               one_minus_beta1, beta2_hi, beta2_lo, one_minus_beta2, eps, decay, MAXIMIZE)


@triton.jit
def _sort_keys(indices_ptr, pos, nnz, n_rows):
    # (id + 1) * 2**32 + position; ids clamped to [-1, rows] (check_row_ids stops such a step; the update skips
    # those rows); positions past nnz (a block's padding) sort after every id, each at its own position.
    live = pos < nnz
    ids = tl.load(indices_ptr + pos, mask=live, other=0).to(tl.int64)
    ids = tl.where(live, tl.minimum(tl.maximum(ids, -1), n_rows), n_rows + 1)
    return ((ids + 1) << 32) | pos


@triton.jit
def _store_sorted(key, place, keys_ptr, ids_ptr, order_ptr, nnz, FINAL: tl.constexpr):
    if FINAL:  # the sorted ids and the permutation; the padding's places (>= nnz) are not stored
        real = place < nnz
        tl.store(ids_ptr + place, ((key >> 32) - 1).to(tl.int32), mask=real)
        tl.store(order_ptr + place, (key & 0xFFFFFFFF).to(tl.int32), mask=real)
    else:
        tl.store(keys_ptr + place, key)


@triton.jit
def rank_blocks_kernel(indices_ptr, keys_ptr, ids_ptr, order_ptr, nnz, n_rows,
                       BLOCK: tl.constexpr, SUB: tl.constexpr, FINAL: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    key = _sort_keys(indices_ptr, start + tl.arange(0, BLOCK), nnz, n_rows)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(0, BLOCK, SUB):  # keys are distinct: a key's rank is the number of smaller keys
        other = _sort_keys(indices_ptr, start + j + tl.arange(0, SUB), nnz, n_rows)
        rank += tl.sum((other[None, :] < key[:, None]).to(tl.int32), axis=1)
    _store_sorted(key, start + rank, keys_ptr, ids_ptr, order_ptr, nnz, FINAL)


@triton.jit
def merge_kernel(src_ptr, keys_ptr, ids_ptr, order_ptr, nnz, n_padded, run,
                 FAN: tl.constexpr, TILE: tl.constexpr, FINAL: tl.constexpr):
    # FAN consecutive sorted runs of ``run`` keys (the last ones may be short or absent) become one.
    i = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    key = tl.load(src_ptr + i)
    group = i // (run * FAN) * (run * FAN)
    starts = group[:, None] + tl.arange(0, FAN)[None, :].to(tl.int64) * run
    # Per run, the number of keys smaller than ``key``: binary search (lower bound) over run = 2**k slots,
    # slots past the array reading as larger than any key. In its own run that is the key's index.
    count = tl.zeros([TILE, FAN], dtype=tl.int64)
    half = run // 2
    while half > 0:
        at = starts + count + half - 1
        probe = tl.load(src_ptr + at, mask=at < n_padded, other=0x7FFFFFFFFFFFFFFF)
        count = tl.where(probe < key[:, None], count + half, count)
        half = half // 2
    at = starts + count
    probe = tl.load(src_ptr + at, mask=at < n_padded, other=0x7FFFFFFFFFFFFFFF)
    count += (probe < key[:, None]).to(tl.int64)
    _store_sorted(key, group + tl.sum(count, axis=1), keys_ptr, ids_ptr, order_ptr, nnz, FINAL)


def kernel_floats(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> tuple:
    """The update kernels' float arguments: lr, beta1 and beta2 as fp32 halves with 1 - beta each, eps, 1 - lr wd."""
    beta1_hi, beta1_lo = _halves(float(beta1))
    beta2_hi, beta2_lo = _halves(float(beta2))
    return (float(lr), beta1_hi, beta1_lo, 1.0 - beta1, beta2_hi, beta2_lo, 1.0 - beta2, float(eps),
            1.0 - lr * weight_decay)


def cpp_constants() -> tuple:
    """What the C++ eager path (``eager_path.sparse_adamw_step``) repeats of this module's launches."""
    return CHUNK, SORT_BLOCK, SORT_SUB, FAN, MERGE_TILE, TRITON_SORT_MAX


def _cpp_key(launch_index: int, key_tensors: Optional[tuple], maximize: bool) -> Optional[tuple]:
    """A launch's key for the C++ eager path (eager_path.cpp's sparse_adamw_step builds the same), or None."""
    if key_tensors is None:
        return None
    ints = (eager_path.SPARSE_ADAMW_KIND, key_tensors[0].get_device(), launch_index, int(maximize), *cpp_constants())
    return ints, key_tensors


def _halves(x: float):
    """``x`` as hi + lo, both representable in fp32 (Triton passes float scalars as fp32)."""
    hi = struct.unpack("f", struct.pack("f", x))[0]
    return hi, x - hi


def _blocks(dim: int):
    """(segment_kernel's column block, its warps, crossing_kernel's column block, its HEADS)."""
    width = max(16, triton.next_power_of_2(dim))
    block_d = min(width, TILE // CHUNK)
    # A crossing row's loop over its heads is its one sequential part: its columns go to ~8 programs.
    block_d2 = min(max(16, width // 8), 256)
    return block_d, max(1, CHUNK * block_d // 1024), block_d2, TILE // block_d2


def sort_ids(indices: torch.Tensor, n_rows: int, layout: Optional[tuple], cpp: Optional[tuple] = None):
    """``indices`` (1-D, < 2**31 - 2 * CHUNK of them) clamped to [-1, n_rows] (n_rows < 2**31 - 2) and
    stably sorted: (sorted ids, int32; the lookup position of each, int32). ``layout``: as ``_launch``'s;
    ``cpp``: (the update's key tensors, maximize) where its launches are handed to the C++ eager path."""
    if n_rows >= 2**31 - 2:  # the padding's keys, (n_rows + 2) * 2**32 + position, must fit in int64
        raise ValueError(f"sort_ids sorts ids of fewer than 2**31 - 2 rows, got {n_rows} (torch.sort serves those)")
    if not (SORT_SUB <= SORT_BLOCK and MERGE_TILE <= SORT_BLOCK and FAN >= 2):  # powers of two: Triton checks
        raise ValueError(f"sort settings need SORT_SUB, MERGE_TILE <= SORT_BLOCK and FAN >= 2, got SORT_BLOCK "
                         f"{SORT_BLOCK}, SORT_SUB {SORT_SUB}, MERGE_TILE {MERGE_TILE}, FAN {FAN}")
    nnz = indices.shape[0]
    block = min(SORT_BLOCK, max(SORT_SUB, triton.next_power_of_2(nnz)))  # a small step sorts a small block
    n_padded = triton.cdiv(nnz, block) * block
    device = indices.device
    ids = torch.empty(nnz, dtype=torch.int32, device=device)
    order = torch.empty(nnz, dtype=torch.int32, device=device)
    keys = [torch.empty(n_padded if n_padded > block else 0, dtype=torch.int64, device=device)
            for _ in range(2 if n_padded > block * FAN else 1)]
    final = n_padded == block
    key_tensors, maximize = cpp if cpp is not None else (None, False)
    _launch(rank_blocks_kernel, (n_padded // block,), layout, (indices, keys[0], ids, order), (nnz, n_rows), (),
            dict(BLOCK=block, SUB=SORT_SUB, FINAL=final, num_warps=8), _cpp_key(0, key_tensors, maximize))
    run, k = block, 0
    while not final:
        final = run * FAN >= n_padded
        src, dst = keys[k % len(keys)], keys[(k + 1) % len(keys)]  # one buffer where this pass is the last
        _launch(merge_kernel, (n_padded // MERGE_TILE,), layout and (*layout, run), (src, dst, ids, order),
                (nnz, n_padded, run), (), dict(FAN=FAN, TILE=MERGE_TILE, FINAL=final, num_warps=4),
                _cpp_key(k + 1, key_tensors, maximize))
        run, k = run * FAN, k + 1
    return ids, order


def sparse_adamw_triton(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps,
                        weight_decay, step, maximize) -> None:
    nnz, dim = values.shape
    if nnz > 2**31 - 2 * CHUNK:
        raise ValueError(f"at most 2**31 - {2 * CHUNK} lookups a step, got {nnz}")
    if any(t.stride(1) != 1 for t in (param, exp_avg, exp_avg_sq)) and dim > 1:
        raise ValueError("the fused update needs parameter and state rows with unit column stride")
    if dim > 1 and values.stride(1) != 1:
        values = values.contiguous()
    triton_sort = param.shape[0] < 2**31 - 2 and nnz <= TRITON_SORT_MAX
    if triton_sort:
        indices = indices.contiguous()
    tensors = (param, exp_avg, exp_avg_sq, indices, values, step)
    sort_layout = layout = cpp = None
    if PLANNED_LAUNCHES and not is_tracing():
        # What the kernels specialize on but the data (see launch_planned): the grids and every integer argument
        # follow from these sizes, strides and the blocks; dtypes, devices and 16-byte alignments of the inputs.
        # Every plan of a step takes the whole layout: a plan is handed to the C++ path under one key.
        layout = (nnz, dim, param.shape[0], values.stride(0), param.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0),
                  maximize, *((t.dtype, t.get_device(), t.data_ptr() % 16) for t in tensors))
        sort_layout = ("sort", *layout)
        if param.is_cuda and triton_sort and eager_path.may_plan():  # the steps the C++ path serves
            cpp = tensors, maximize
    if triton_sort:
        ids, order = sort_ids(indices, param.shape[0], sort_layout, cpp)
    else:  # torch's, stable: each row's lookups in lookup order (4-byte keys halve its radix passes)
        keys = indices.clamp(-1, param.shape[0]).to(torch.int32) if param.shape[0] < 2**31 else indices
        ids, order = torch.sort(keys, stable=True)
    guard = check_row_ids(indices, ids, param)
    n_chunks = triton.cdiv(nnz, CHUNK)
    partial = torch.empty((2, n_chunks, dim), dtype=torch.float32, device=param.device)
    block_d, warps, block_d2, heads = _blocks(dim)
    hyper = kernel_floats(lr, beta1, beta2, eps, weight_decay)
    strides = (param.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0))
    if layout is not None:  # the sort's outputs and the buffers: their dtypes and alignments too
        layout = (*layout, *((t.dtype, t.data_ptr() % 16) for t in (ids, order, partial, guard) if t is not None))
    tensors = (ids, order, values, partial, param, exp_avg, exp_avg_sq, step, guard)
    key_tensors = cpp[0] if cpp is not None else None
    _launch(segment_kernel, (n_chunks, triton.cdiv(dim, block_d)), layout, tensors,
            (nnz, n_chunks, dim, param.shape[0], values.stride(0), *strides), hyper,
            dict(MAXIMIZE=maximize, CHUNK=CHUNK, LOG2_CHUNK=LOG2_CHUNK, BLOCK_D=block_d, num_warps=warps),
            _cpp_key(eager_path.SPARSE_ADAMW_LAUNCHES[1], key_tensors, maximize))
    if n_chunks > 1:
        _launch(crossing_kernel, (n_chunks - 1, triton.cdiv(dim, block_d2)), layout,
                (ids, partial, param, exp_avg, exp_avg_sq, step), (n_chunks, dim, param.shape[0], *strides), hyper,
                dict(MAXIMIZE=maximize, CHUNK=CHUNK, HEADS=heads, BLOCK_D=block_d2, num_warps=4),
                _cpp_key(eager_path.SPARSE_ADAMW_LAUNCHES[2], key_tensors, maximize))


def check_row_ids(indices: torch.Tensor, sorted_ids: Optional[torch.Tensor],
                  param: torch.Tensor) -> Optional[torch.Tensor]:
    """Stop a step whose row ids (``indices``; ``sorted_ids``: them clamped to [-1, rows] and sorted) are not all
    in [0, rows): IndexError where the host may wait (a CPU; ``sorted_ids`` None); on CUDA, without a host sync,
    a device-side assert (the same as nn.Embedding's for an id out of range), raised by ``index_select`` on
    the sorted ends before the update's kernels run: its result is returned, for the kernels to take as an
    argument (a compiler drops an unused result). The kernels skip such rows too: they never write outside."""
    if sorted_ids is None or not indices.is_cuda:
        low, high = (int(x) for x in indices.aminmax())
        if low < 0 or high >= param.shape[0]:
            raise IndexError(f"a sparse gradient's row ids must lie in [0, {param.shape[0]}) (the parameter's rows), "
                             f"got ids from {low} to {high}")
        return None
    return param.index_select(0, sorted_ids[:: max(sorted_ids.numel() - 1, 1)])


def _launch(kernel, grid, layout: Optional[tuple], tensors: tuple, ints: tuple, floats: tuple, meta: dict,
            cpp_key: Optional[tuple] = None) -> None:
    """``kernel[grid](*tensors, *ints, *floats, **meta)`` (its arguments in that order); with a ``layout``
    (an eager call) through a launch plan: the layout fixes the rest, the floats are passed again (a
    scheduler's new lr each step makes no new plan); with a ``cpp_key`` (``_cpp_key``) the plan is the C++
    eager path's too."""
    plan_key = None
    if layout is not None:
        plan_key = (kernel.fn.__name__, layout)
        if launch_planned(plan_key, *(t for t in tensors if t is not None), *floats, cpp_key=cpp_key):
            return
    launch(kernel, grid, *tensors, *ints, *floats, plan_key=plan_key, plan_floats=True, cpp_key=cpp_key, **meta)


def sparse_adamw_torch(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps,
                       weight_decay, step, maximize) -> None:
    """The same update in PyTorch: sum duplicates (coalesce), then update the gathered rows."""
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32  # fp32 math for 16-bit
    check_row_ids(indices, None, param)  # this path waits for the host anyway; indexing would wrap -1 around
    t = float(step)  # exact bias corrections in float64, as torch.optim.AdamW computes them
    bias_correction1, bias_correction2_sqrt = 1 - beta1**t, (1 - beta2**t) ** 0.5
    # Duplicates summed in the math dtype: coalesce() adds in the values' dtype (bf16 sums lose digits).
    grad = torch.sparse_coo_tensor(indices[None], values.to(dtype), (param.shape[0], values.shape[1]),
                                   check_invariants=False).coalesce()
    rows, g = grad.indices()[0], grad.values()
    g = -g if maximize else g
    m = exp_avg[rows].to(dtype).mul_(beta1).add_(g, alpha=1 - beta1)
    v = exp_avg_sq[rows].to(dtype).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p = param[rows].to(dtype).mul_(1 - lr * weight_decay)
    p.addcdiv_(m, v.sqrt().div_(bias_correction2_sqrt).add_(eps), value=-lr / bias_correction1)
    param.index_copy_(0, rows, p.to(param.dtype))
    exp_avg.index_copy_(0, rows, m.to(exp_avg.dtype))
    exp_avg_sq.index_copy_(0, rows, v.to(exp_avg_sq.dtype))


def _check_update(param, exp_avg, exp_avg_sq, indices, values) -> None:
    """The op's contract (``sparse_adamw_update_``), checked eagerly and while traced: ValueError naming what
    does not fit. A length mismatch would drop lookups or read past the ids."""
    if param.dim() != 2 or exp_avg.shape != param.shape or exp_avg_sq.shape != param.shape:
        raise ValueError(f"sparse AdamW update: param, exp_avg and exp_avg_sq must be 2-D of one shape, got "
                         f"{tuple(param.shape)}, {tuple(exp_avg.shape)}, {tuple(exp_avg_sq.shape)}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse AdamW update: indices must be a 1-D int32 or int64 tensor of row ids, got "
                         f"shape {tuple(indices.shape)} of {indices.dtype}")
    if values.dim() != 2 or values.shape[0] != indices.shape[0] or values.shape[1] != param.shape[1]:
        raise ValueError(f"sparse AdamW update: values must be (len(indices), param.shape[1]) = "
                         f"({indices.shape[0]}, {param.shape[1]}), got {tuple(values.shape)}")


def _update_fake(param, exp_avg, exp_avg_sq, indices, values, step, lr, beta1, beta2, eps, weight_decay,
                 maximize):
    _check_update(param, exp_avg, exp_avg_sq, indices, values)


def _update(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, indices: torch.Tensor,
            values: torch.Tensor, step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float, maximize: bool) -> None:
    _check_update(param, exp_avg, exp_avg_sq, indices, values)
    if values.shape[0] == 0 or values.shape[1] == 0:
        return
    # float64 parameters keep PyTorch's float64 math (ExecutionPath.TORCH_FLOAT64)
    fused = execution_path(param) is ExecutionPath.TRITON
    update = sparse_adamw_triton if fused else sparse_adamw_torch
    update(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, weight_decay, step, maximize)


register_op("fuselab::sparse_adamw_update_", fake=_update_fake,
            mutates_args=("param", "exp_avg", "exp_avg_sq"))(_update)


def sparse_adamw_update_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         indices: torch.Tensor, values: torch.Tensor, step: torch.Tensor, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool) -> None:
    """AdamW on the rows ``indices`` (1-D, valid row ids, duplicates allowed and summed) of 2-D ``param``.

    ``values`` is (nnz, dim); ``step`` is a 0-dim tensor holding the step count after this step
    (>= 1), on the parameter's device for the fused kernel. The update rule is written out in
    ``fuselab.optim.SparseAdamW``. Eager calls skip the custom-op dispatcher (its host cost is
    most of a small step's); traced calls record ``torch.ops.fuselab.sparse_adamw_update_``.
    """
    call_untraced(torch.ops.fuselab.sparse_adamw_update_, _update, param, exp_avg, exp_avg_sq, indices, values, step,
                  lr, beta1, beta2, eps, weight_decay, maximize, mutated=(param, exp_avg, exp_avg_sq))


def sparse_adamw_step_cpp(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, indices: torch.Tensor,
                          values: torch.Tensor, step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, maximize: bool) -> bool:
    """``step += 1`` then ``sparse_adamw_update_`` by the C++ eager path, whose host time per step is a
    fraction of Python's; False, with nothing done, where the update must take ``sparse_adamw_update_``
    (no C++ path, planned launches off, a layout it does not serve, more than TRITON_SORT_MAX lookups,
    launches not planned yet)."""
    if not PLANNED_LAUNCHES or eager_path.extension is None:
        return False
    return eager_path.sparse_adamw_step(param, exp_avg, exp_avg_sq, indices, values, step,
                                        kernel_floats(lr, beta1, beta2, eps, weight_decay), maximize)

