"""``DistillationLoss(fused=True)``: the loss and both logits' gradients in one Triton kernel, a program a row.

The PyTorch form (``fuselab.quant.distill``) makes a row's softmaxes, logs, KL terms and masks as separate
(N, C) tensors, forward and backward; at a language model's vocabulary (C ~ 50,000) those passes over
memory are the loss's cost. Here each row's program reads the student's and teacher's logits twice and
writes the gradients once:

1. online (running max, rescaled sum) passes over the row in blocks of BLOCK columns: the log-sum-exps
   of s / T, t / T and (for the hard term) s, and sum_i e^(t_i/T - m) (t_i - s_i) / T, which gives
   KL(p_t || p_s) = sum_i p_t,i (t_i - s_i) / T - lse(t / T) + lse(s / T) without storing p_t;
2. the row's loss term, then the gradients (the loss is their sum over rows, so ``backward`` scales
   them by the incoming gradient):

       d/ds_j = alpha T / N (p_s,j - p_t,j) + (1 - alpha) / n_labelled (softmax(s)_j - [j = y])
       d/dt_j = alpha T / N p_t,j (log p_t,j - log p_s,j - KL_row)

with p_s, p_t the softmaxes at temperature T, n_labelled the rows whose target is not -100 (read on the
device: no host sync). A teacher logit of -inf adds nothing (its p_t is 0), as in the PyTorch form. A
target outside [0, C) (other than -100) makes its row's loss and student gradient NaN: checking it on
the host would wait for the GPU (PyTorch's cross-entropy stops the process with a device-side assert). The
math is fp32; float64 logits, CPU tensors without the interpreter, and a backward that is itself
differentiated take the PyTorch form, whose ops have derivatives of every order.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from fuselab.kernels._runtime import ExecutionPath, execution_path, launch, register_op

IGNORE_INDEX = -100  # cross-entropy's: a row without a label adds to the soft term only
MAX_BLOCK = 4096  # columns a program holds at once (fp32: 32 registers a thread at 4 warps)


@triton.jit
def _online_lse(m, z, x):
    # (running max, running sum of e^(x - max)) after the block x: the old sum rescaled to the new max
    m_new = tl.maximum(m, tl.max(x, axis=0))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix: sums stay 0, not NaN
    return m_new, z * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0), safe


@triton.jit
def distill_rows_kernel(
    s_ptr, t_ptr, target_ptr, labelled_ptr, row_loss_ptr, ds_ptr, dt_ptr,
    C, stride_s, stride_t, stride_ds, stride_dt, inv_T, soft_w, one_minus_alpha,
    SOFT: tl.constexpr, HARD: tl.constexpr, WRITE_DS: tl.constexpr, WRITE_DT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row, t_row = s_ptr + row * stride_s, t_ptr + row * stride_t
    cols = tl.arange(0, BLOCK)
    m_s = tl.full((), float("-inf"), tl.float32)  # s / T
    z_s = tl.zeros((), tl.float32)
    m_t = tl.full((), float("-inf"), tl.float32)  # t / T
    z_t = tl.zeros((), tl.float32)
    a_t = tl.zeros((), tl.float32)  # sum e^(t/T - m_t) (t - s) / T
    m_h = tl.full((), float("-inf"), tl.float32)  # s, the hard term's softmax
    z_h = tl.zeros((), tl.float32)
    for c0 in range(0, C, BLOCK):
        live = c0 + cols < C
        s = tl.load(s_row + c0 + cols, mask=live, other=float("-inf")).to(tl.float32)
        if SOFT:
            t = tl.load(t_row + c0 + cols, mask=live, other=float("-inf")).to(tl.float32)
            m_old = m_t
            m_s, z_s, _ = _online_lse(m_s, z_s, s * inv_T)
            m_t, z_t, safe_t = _online_lse(m_t, z_t, t * inv_T)
            e_t = tl.exp(t * inv_T - safe_t)
            a_t = a_t * tl.exp(m_old - safe_t) + tl.sum(tl.where(e_t > 0, e_t * (t - s) * inv_T, 0.0), axis=0)
        if HARD:
            m_h, z_h, _ = _online_lse(m_h, z_h, s)
    lse_s, lse_t = m_s + tl.log(z_s), m_t + tl.log(z_t)
    kl = a_t / z_t - lse_t + lse_s
    y = tl.load(target_ptr + row)
    labelled = y != IGNORE_INDEX
    nan_if_bad = tl.where(labelled & ((y < 0) | (y >= C)), float("nan"), 0.0)  # a class index out of range
    hard_w = one_minus_alpha / tl.maximum(tl.load(labelled_ptr), 1).to(tl.float32)
    loss = tl.zeros((), tl.float32)
    if SOFT:
        loss += soft_w * kl
    if HARD:
        s_y = tl.load(s_row + tl.where(labelled & (y >= 0) & (y < C), y, 0)).to(tl.float32)
        loss += tl.where(labelled, hard_w * (m_h + tl.log(z_h) - s_y), 0.0)
    tl.store(row_loss_ptr + row, loss + nan_if_bad)
    if WRITE_DS or WRITE_DT:
        for c0 in range(0, C, BLOCK):
            live = c0 + cols < C
            s = tl.load(s_row + c0 + cols, mask=live, other=0.0).to(tl.float32)
            ds = tl.zeros((BLOCK,), tl.float32)
            if SOFT:
                t = tl.load(t_row + c0 + cols, mask=live, other=float("-inf")).to(tl.float32)
                p_t = tl.exp(t * inv_T - lse_t)
                p_s = tl.exp(s * inv_T - lse_s)
                ds += soft_w * inv_T * (p_s - p_t)
                if WRITE_DT:
                    log_ratio = (t - s) * inv_T - lse_t + lse_s
                    dt = tl.where(p_t > 0, soft_w * inv_T * p_t * (log_ratio - kl), 0.0)
                    tl.store(dt_ptr + row * stride_dt + c0 + cols, dt.to(dt_ptr.dtype.element_ty), mask=live)
            if HARD:
                onehot = tl.where((c0 + cols == y) & labelled, 1.0, 0.0)
                ds += tl.where(labelled, hard_w * (tl.exp(s - m_h - tl.log(z_h)) - onehot), 0.0)
            if WRITE_DS:
                tl.store(ds_ptr + row * stride_ds + c0 + cols, (ds + nan_if_bad).to(ds_ptr.dtype.element_ty), mask=live)


def _fused_fake(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
                alpha: float, need_ds: bool, need_dt: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_fused(student, teacher, target)
    return (student.new_empty((), dtype=torch.float32), torch.empty_like(student) if need_ds else student.new_empty(0),
            torch.empty_like(teacher) if need_dt else teacher.new_empty(0))


def _fused(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float, alpha: float,
           need_ds: bool, need_dt: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d loss / d student or an empty tensor, d loss / d teacher or an empty tensor)."""
    _check_fused(student, teacher, target)
    path = execution_path(student)
    if path is not ExecutionPath.TRITON:
        raise ValueError(f"fuselab::distillation_loss runs on fuselab's Triton kernels only, not here: {path.value}")
    n, c = student.shape
    target = target.contiguous()  # the kernel reads it at unit stride
    row_loss = torch.empty(n, dtype=torch.float32, device=student.device)
    ds = torch.empty_like(student, memory_format=torch.contiguous_format) if need_ds else student.new_empty(0)
    dt = torch.empty_like(teacher, memory_format=torch.contiguous_format) if need_dt else teacher.new_empty(0)
    labelled = (target != IGNORE_INDEX).sum()  # stays on the device
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(c)))
    launch(distill_rows_kernel, (n,), student, teacher, target, labelled, row_loss, ds, dt, c, student.stride(0),
           teacher.stride(0), ds.stride(0) if need_ds else 0, dt.stride(0) if need_dt else 0, 1.0 / temperature,
           alpha * temperature * temperature / n, 1.0 - alpha, SOFT=alpha > 0.0, HARD=alpha < 1.0, WRITE_DS=need_ds,
           WRITE_DT=need_dt, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return row_loss.sum(), ds, dt


def _check_fused(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor) -> None:
    """What the kernel reads exactly: (N, C) logits of one shape with unit column stride, N >= 1, C >= 1,
    fp16/bf16/fp32; (N,) int64 targets; one device."""
    if student.dim() != 2 or student.shape != teacher.shape or 0 in student.shape:
        raise ValueError(f"the fused loss takes (N, C) logits of one shape, N and C >= 1, got "
                         f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    if target.shape != student.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"target must be (N,) int64 class indices, got {tuple(target.shape)} {target.dtype}")
    if student.device != teacher.device or target.device != student.device:
        raise ValueError(f"logits and target must be on one device, got {student.device}, {teacher.device} "
                         f"and {target.device}")
    for name, x in (("student", student), ("teacher", teacher)):
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"the fused loss takes fp16/bf16/fp32 {name} logits, got {x.dtype}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"the fused loss needs {name} logits with unit column stride, got strides {x.stride()}")


register_op("fuselab::distillation_loss", fake=_fused_fake)(_fused)


def fused_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
                            alpha: float, torch_form) -> torch.Tensor:
    """The loss by the kernel where it computes it exactly (``execution_path``), else by ``torch_form(student,
    teacher, target)``; differentiable in both logits (``_FusedLoss``)."""
    if execution_path(student) is not ExecutionPath.TRITON or execution_path(teacher) is not ExecutionPath.TRITON:
        return torch_form(student, teacher, target)
    student, teacher = (x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous() for x in (student, teacher))
    return _FusedLoss.apply(student, teacher, target, temperature, alpha, torch_form)


class _FusedLoss(torch.autograd.Function):
    """The kernel's gradients, computed with the loss, scaled by the incoming gradient; a backward that is
    itself differentiated (``create_graph=True``) differentiates the PyTorch form instead."""

    @staticmethod
    def forward(ctx, student, teacher, target, temperature, alpha, torch_form):
        # alpha = 0: the loss is the hard term alone, which the teacher's logits do not enter (no gradient)
        ctx.need_ds, ctx.need_dt = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and alpha > 0
        loss, ds, dt = torch.ops.fuselab.distillation_loss(student, teacher, target, temperature, alpha, ctx.need_ds,
                                                           ctx.need_dt)
        ctx.save_for_backward(student, teacher, target, ds, dt)
        ctx.torch_form = torch_form
        return loss

    @staticmethod
    def backward(ctx, grad):
        student, teacher, target, ds, dt = ctx.saved_tensors
        need_ds, need_dt = ctx.need_ds, ctx.need_dt
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no graph of their own
            wrt = [x for x, need in ((student, need_ds), (teacher, need_dt)) if need]
            got = iter(torch.autograd.grad(ctx.torch_form(student, teacher, target), wrt, grad, create_graph=True))
            return (next(got) if need_ds else None, next(got) if need_dt else None, None, None, None, None)
        return (ds * grad.to(ds.dtype) if need_ds else None, dt * grad.to(dt.dtype) if need_dt else None,
                None, None, None, None)
