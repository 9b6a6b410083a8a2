"""Fused lazy AdamW update for the rows a sparse (COO) gradient touches, in one Triton kernel.

The gradient arrives uncoalesced (``nn.Embedding(sparse=True)`` emits one row per lookup).
Instead of ``grad.coalesce()`` (which sorts, then writes the summed rows out) each row's
lookups are linked into a list: a row-sized int32 scratch holds each touched row's head and
``atomic_xchg`` pushes every lookup onto its row's list (a gather, a scatter, no sort: sorting
65,536 keys took as long as the update itself on an H200). The program whose lookup ended up at
the head owns the row: it sums the row's gradients in registers in increasing lookup order (so
the result is bitwise deterministic whatever order the list was linked in), reads m, v, p once
and writes them once; every other program exits at once. The scratch is 4 bytes a row, under
1/(3 dim) of the optimizer state. The step count is read from device memory and nothing syncs
with the host, so the whole training step can be captured in a CUDA graph. Math is fp32
(fp16/bf16/fp32 parameters); float64 parameters take the PyTorch path.
"""
import math

import torch
import triton
import triton.language as tl

from fuselab.kernels._runtime import launch, register_op, untraced, uses_triton

LINK_BLOCK = 1024


@triton.jit
def link_lookups_kernel(heads_ptr, next_ptr, indices_ptr, nnz, BLOCK: tl.constexpr):
    # heads[row] was reset to -1 for every touched row; afterwards heads[row] -> next -> ... -> -1
    # visits each lookup of the row once.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < nnz
    rows = tl.load(indices_ptr + offs, mask=live, other=0)
    prev = tl.atomic_xchg(heads_ptr + rows, offs, mask=live)
    tl.store(next_ptr + offs, prev, mask=live)


@triton.jit
def sparse_adamw_kernel(
    param_ptr, exp_avg_ptr, exp_avg_sq_ptr, indices_ptr, heads_ptr, next_ptr, values_ptr, step_ptr,
    nnz, dim, stride_p, stride_m, stride_v, stride_g,
    lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    MAXIMIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(indices_ptr + i).to(tl.int64)
    if tl.load(heads_ptr + row) == i:  # this program owns the row
        # Bias corrections from the step count on the device: 1 - beta**t = 1 - 2**(t*log2(beta)).
        t = tl.load(step_ptr).to(tl.float32)
        bias_correction1 = 1 - tl.exp2(t * log2_beta1)
        bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(t * log2_beta2))
        lookups = 0  # the length of the row's list
        j = i
        while j >= 0:
            lookups += 1
            j = tl.load(next_ptr + j)
        for d0 in range(0, dim, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            in_row = offs < dim
            p_ptrs = param_ptr + row * stride_p + offs
            m_ptrs = exp_avg_ptr + row * stride_m + offs
            v_ptrs = exp_avg_sq_ptr + row * stride_v + offs
            p = tl.load(p_ptrs, mask=in_row).to(tl.float32)
            m = tl.load(m_ptrs, mask=in_row).to(tl.float32)
            v = tl.load(v_ptrs, mask=in_row).to(tl.float32)
            # Sum the lookups in increasing order: pick the smallest lookup past the last one added.
            g = tl.zeros((BLOCK_D,), dtype=tl.float32)
            added = -1
            for _ in range(lookups):
                pick = nnz
                j = i
                while j >= 0:
                    pick = tl.where((j > added) & (j < pick), j, pick)
                    j = tl.load(next_ptr + j)
                g += tl.load(values_ptr + pick.to(tl.int64) * stride_g + offs, mask=in_row, other=0.0).to(tl.float32)
                added = pick
            if MAXIMIZE:
                g = -g
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            p = p * (1 - lr * weight_decay)
            p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
            tl.store(p_ptrs, p.to(param_ptr.dtype.element_ty), mask=in_row)
            tl.store(m_ptrs, m.to(exp_avg_ptr.dtype.element_ty), mask=in_row)
            tl.store(v_ptrs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=in_row)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf  # beta = 0: 2**(-inf * t) = 0 for t >= 1


def sparse_adamw_triton(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps,
                        weight_decay, step, maximize) -> None:
    nnz, dim = values.shape
    if nnz >= 2**31:
        raise ValueError(f"at most 2**31 - 1 lookups a step, got {nnz}")
    if any(t.stride(1) != 1 for t in (param, exp_avg, exp_avg_sq)) and dim > 1:
        raise ValueError("the fused update needs parameter and state rows with unit column stride")
    # The kernels read ids and gradient rows with unit strides; index_fill_ wants int64 ids.
    indices = indices.to(torch.int64).contiguous()
    if dim > 1 and values.stride(1) != 1:
        values = values.contiguous()
    heads = torch.empty(param.shape[0], dtype=torch.int32, device=param.device)
    heads.index_fill_(0, indices, -1)  # only touched rows are ever read
    nxt = torch.empty(nnz, dtype=torch.int32, device=param.device)
    launch(link_lookups_kernel, (triton.cdiv(nnz, LINK_BLOCK),), heads, nxt, indices, nnz, BLOCK=LINK_BLOCK)
    block_d = min(triton.next_power_of_2(dim), 1024)
    launch(sparse_adamw_kernel, (nnz,), param, exp_avg, exp_avg_sq, indices, heads, nxt, values, step, nnz, dim,
           param.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0), values.stride(0), lr, beta1, beta2,
           _log2(beta1), _log2(beta2), eps, weight_decay, MAXIMIZE=maximize, BLOCK_D=block_d,
           num_warps=min(max(block_d // 128, 1), 8))  # 4 columns a thread: 16-byte accesses


def sparse_adamw_torch(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps,
                       weight_decay, step, maximize) -> None:
    """The same update in PyTorch: sum duplicates (coalesce), then update the gathered rows."""
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32  # fp32 math for 16-bit
    t = float(step)  # exact bias corrections in float64, as torch.optim.AdamW computes them
    bias_correction1, bias_correction2_sqrt = 1 - beta1**t, (1 - beta2**t) ** 0.5
    grad = torch.sparse_coo_tensor(indices[None], values, (param.shape[0], values.shape[1]),
                                   check_invariants=False).coalesce()
    rows, g = grad.indices()[0], grad.values().to(dtype)
    g = -g if maximize else g
    m = exp_avg[rows].to(dtype).mul_(beta1).add_(g, alpha=1 - beta1)
    v = exp_avg_sq[rows].to(dtype).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p = param[rows].to(dtype).mul_(1 - lr * weight_decay)
    p.addcdiv_(m, v.sqrt().div_(bias_correction2_sqrt).add_(eps), value=-lr / bias_correction1)
    param.index_copy_(0, rows, p.to(param.dtype))
    exp_avg.index_copy_(0, rows, m.to(exp_avg.dtype))
    exp_avg_sq.index_copy_(0, rows, v.to(exp_avg_sq.dtype))


def _update_fake(param, exp_avg, exp_avg_sq, indices, values, step, lr, beta1, beta2, eps, weight_decay,
                 maximize):
    return None


def _update(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, indices: torch.Tensor,
            values: torch.Tensor, step: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float, maximize: bool) -> None:
    if values.shape[0] == 0 or values.shape[1] == 0:
        return
    # Triton passes float scalars as fp32, so float64 parameters keep PyTorch's float64 math.
    fused = uses_triton(param) and param.dtype != torch.float64
    update = sparse_adamw_triton if fused else sparse_adamw_torch
    update(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, weight_decay, step, maximize)


register_op("fuselab::sparse_adamw_update_", fake=_update_fake,
            mutates_args=("param", "exp_avg", "exp_avg_sq"))(_update)


def sparse_adamw_update_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         indices: torch.Tensor, values: torch.Tensor, step: torch.Tensor, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool) -> None:
    """AdamW on the rows ``indices`` (1-D, duplicates allowed and summed) of 2-D ``param``.

    ``values`` is (nnz, dim); ``step`` is a 0-dim tensor holding the step count after this step
    (>= 1), on the parameter's device for the fused kernel. The update rule is written out in
    ``fuselab.optim.SparseAdamW``. Eager calls skip the custom-op dispatcher (its host cost is
    most of a small step's); traced calls record ``torch.ops.fuselab.sparse_adamw_update_``.
    """
    plain = untraced(param, exp_avg, exp_avg_sq, indices, values, step)
    op = _update if plain else torch.ops.fuselab.sparse_adamw_update_
    op(param, exp_avg, exp_avg_sq, indices, values, step, lr, beta1, beta2, eps, weight_decay, maximize)
