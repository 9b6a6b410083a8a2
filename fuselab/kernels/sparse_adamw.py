"""Fused lazy AdamW update for the rows a sparse (COO) gradient touches, in one Triton kernel.

The gradient arrives uncoalesced (``nn.Embedding(sparse=True)`` emits one row per lookup).
Instead of ``grad.coalesce()`` (which writes the summed rows out) the row indices are sorted
(stably, so the summation order is fixed) and the program at the start of each run of equal
indices sums that run's gradient rows in registers, then reads m, v, p once and writes them
once. Programs in the middle of a run exit at once. No atomics: bitwise deterministic.
Math is fp32 (fp16/bf16/fp32 parameters); float64 parameters take the PyTorch path.
"""
import torch
import triton
import triton.language as tl

from fuselab.kernels._runtime import launch, register_op, uses_triton


@triton.jit
def sparse_adamw_kernel(
    param_ptr, exp_avg_ptr, exp_avg_sq_ptr, rows_ptr, order_ptr, values_ptr,
    nnz, dim, stride_p, stride_m, stride_v, stride_g,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
    MAXIMIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    prev = tl.load(rows_ptr + i - 1, mask=i > 0, other=-1)
    if prev != row:  # this program starts a run of equal row indices (int64, as torch's)
        for d0 in range(0, dim, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            in_row = offs < dim
            g = tl.zeros((BLOCK_D,), dtype=tl.float32)
            j = i
            while tl.load(rows_ptr + j, mask=j < nnz, other=-1) == row:  # duplicates, in sorted order
                src = tl.load(order_ptr + j).to(tl.int64)
                g += tl.load(values_ptr + src * stride_g + offs, mask=in_row, other=0.0).to(tl.float32)
                j += 1
            if MAXIMIZE:
                g = -g
            p_ptrs = param_ptr + row * stride_p + offs
            m_ptrs = exp_avg_ptr + row * stride_m + offs
            v_ptrs = exp_avg_sq_ptr + row * stride_v + offs
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


def _compute_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32  # fp32 math for 16-bit


def sparse_adamw_triton(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps,
                        weight_decay, bias_correction1, bias_correction2_sqrt, maximize) -> None:
    nnz, dim = values.shape
    rows, order = torch.sort(indices, stable=True)
    block_d = min(triton.next_power_of_2(dim), 1024)
    launch(sparse_adamw_kernel, (nnz,), param, exp_avg, exp_avg_sq, rows, order, values, nnz, dim,
           param.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0), values.stride(0), lr, beta1, beta2,
           eps, weight_decay, bias_correction1, bias_correction2_sqrt, MAXIMIZE=maximize,
           BLOCK_D=block_d, num_warps=4 if block_d <= 512 else 8)


def sparse_adamw_torch(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps,
                       weight_decay, bias_correction1, bias_correction2_sqrt, maximize) -> None:
    """The same update in PyTorch: sum duplicates (coalesce), then update the gathered rows."""
    dtype = _compute_dtype(param)
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


def _update_fake(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, weight_decay,
                 step, maximize):
    return None


@register_op("fuselab::sparse_adamw_update_", fake=_update_fake,
             mutates_args=("param", "exp_avg", "exp_avg_sq"))
def sparse_adamw_update_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         indices: torch.Tensor, values: torch.Tensor, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: float,
                         maximize: bool) -> None:
    """AdamW on the rows ``indices`` (1-D, duplicates allowed and summed) of 2-D ``param``.

    ``values`` is (nnz, dim); ``step`` is the step count after this step (>= 1). The update
    rule is written out in ``fuselab.optim.SparseAdamW``.
    """
    if values.shape[0] == 0 or values.shape[1] == 0:
        return
    # Triton passes float scalars as fp32, so float64 parameters keep PyTorch's float64 math.
    fused = uses_triton(param) and param.dtype != torch.float64
    update = sparse_adamw_triton if fused else sparse_adamw_torch
    update(param, exp_avg, exp_avg_sq, indices, values, lr, beta1, beta2, eps, weight_decay,
           1 - beta1**step, (1 - beta2**step) ** 0.5, maximize)
