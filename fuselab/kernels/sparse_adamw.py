"""Fused lazy AdamW update for the rows a sparse (COO) gradient touches, in one Triton kernel.

The gradient arrives uncoalesced (``nn.Embedding(sparse=True)`` emits one row per lookup).
Instead of ``grad.coalesce()`` (which writes the summed rows out) the row indices are sorted
(stably, so the summation order is fixed) and the program at the start of each run of equal
indices sums that run's gradient rows in registers, then reads m, v, p once and writes them
once. Programs in the middle of a run exit at once. No atomics: bitwise deterministic.
The step count is read from device memory and nothing syncs with the host, so the whole
training step can be captured in a CUDA graph. Math is fp32 (fp16/bf16/fp32 parameters);
float64 parameters take the PyTorch path.
"""
import math

import torch
import triton
import triton.language as tl

from fuselab.kernels._runtime import launch, register_op, untraced, uses_triton


@triton.jit
def sparse_adamw_kernel(
    param_ptr, exp_avg_ptr, exp_avg_sq_ptr, rows_ptr, order_ptr, values_ptr, step_ptr,
    nnz, dim, stride_p, stride_m, stride_v, stride_g,
    lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    MAXIMIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    prev = tl.load(rows_ptr + i - 1, mask=i > 0, other=-1)
    if prev != row:  # this program starts a run of equal row indices
        # Bias corrections from the step count on the device: 1 - beta**t = 1 - 2**(t*log2(beta)).
        t = tl.load(step_ptr).to(tl.float32)
        bias_correction1 = 1 - tl.exp2(t * log2_beta1)
        bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(t * log2_beta2))
        first = tl.load(order_ptr + i).to(tl.int64)
        row64 = row.to(tl.int64)
        for d0 in range(0, dim, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            in_row = offs < dim
            g = tl.load(values_ptr + first * stride_g + offs, mask=in_row, other=0.0).to(tl.float32)
            j = i + 1
            while tl.load(rows_ptr + j, mask=j < nnz, other=-1) == row:  # duplicates, in sorted order
                src = tl.load(order_ptr + j).to(tl.int64)
                g += tl.load(values_ptr + src * stride_g + offs, mask=in_row, other=0.0).to(tl.float32)
                j += 1
            if MAXIMIZE:
                g = -g
            p_ptrs = param_ptr + row64 * stride_p + offs
            m_ptrs = exp_avg_ptr + row64 * stride_m + offs
            v_ptrs = exp_avg_sq_ptr + row64 * stride_v + offs
            p = tl.load(p_ptrs, mask=in_row).to(tl.float32)
            m = tl.load(m_ptrs, mask=in_row).to(tl.float32)
            v = tl.load(v_ptrs, mask=in_row).to(tl.float32)
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
    # 32-bit keys halve the radix-sort passes; the sort dominates the kernel for small batches.
    keys = indices.to(torch.int32) if param.shape[0] < 2**31 else indices
    rows, order = torch.sort(keys, stable=True)
    block_d = min(triton.next_power_of_2(dim), 1024)
    launch(sparse_adamw_kernel, (nnz,), param, exp_avg, exp_avg_sq, rows, order, values, step, nnz, dim,
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
