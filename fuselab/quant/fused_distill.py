"""``DistillationLoss(fused=True)``: the loss in one Triton kernel and both logits' gradients in another,
a program a row each.

The PyTorch form (``fuselab.quant.distill``) makes a row's softmaxes, logs, KL terms and masks as separate
(N, C) tensors, forward and backward; at a language model's vocabulary (C ~ 50,000) those passes over
memory are the loss's cost. Here the forward reads the student's and teacher's logits once and keeps
8 floats a row; the backward reads them again and writes the gradients once.

``loss_rows_kernel``: online (running max m, rescaled sum z) passes over the row in blocks of BLOCK
columns give the log-sum-exps of s / T, t / T and (for the hard term) s, kept as (m, log z) pairs with
z = sum_i e^((x_i - m) / T) (shifted before scaled: x / T overflows at finfo.min for T < 1), and the
teacher-weighted mean of the shifted log-ratios, M = sum_i p_t,i ((t_i - m_t) - (s_i - m_s)) / T, so that

    KL(p_t || p_s) = M - log z_t + log z_s

without storing p_t. M is updated as a mean (each block's terms weighted e^((t - m_t) / T) / z_t, the
earlier columns re-based to the new maxima at their share of the mass), never formed as a sum: terms
near finfo.min / T would overflow one, and no m + log z is formed (at large logits it would round away
the small terms).
``grad_rows_kernel`` then writes, scaled by the loss's incoming gradient in fp32:

    d/ds_j = alpha T / N (p_s,j - p_t,j) + (1 - alpha) / n_labelled (softmax(s)_j - [j = y])
    d/dt_j = alpha T / N p_t,j (log p_t,j - log p_s,j - KL_row)

with p_s, p_t the softmaxes at temperature T, each exp((x / T - m) - log z), and n_labelled the rows
whose target is not -100 (counted on the device: no host sync). A teacher logit of -inf adds nothing
(its p_t is 0), and a row of them only adds nothing to the soft term, as in the PyTorch form; an
unlabelled row adds nothing to the hard term, its gradient 0 even where its student logits are all -inf. With
alpha < 1, a target outside [0, C) other than -100 makes its row's loss and student gradient NaN:
checking it on the host would wait for the GPU (PyTorch's cross-entropy stops the process with a
device-side assert). The math is fp32; float64 logits and CPU
tensors (without the interpreter) take the PyTorch form, and so does a backward that is itself
differentiated, whose derivatives are then PyTorch's.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from fuselab.kernels._casts import cast_rne
from fuselab.kernels._runtime import (
    ExecutionPath,
    backward_by_torch_needed,
    beyond_custom_ops,
    execution_path,
    launch,
    refuse_forward_ad,
    register_op,
    untraced,
)
from fuselab.quant.distill import check_hyperparameters, check_logits, distillation_loss_torch

IGNORE_INDEX = -100  # cross-entropy's: a row without a label adds to the soft term only
_IGNORE = tl.constexpr(IGNORE_INDEX)  # the same, as the kernels may read a global
MAX_BLOCK = 4096  # columns a program holds at once (fp32: 16 registers a thread at 8 warps)
STATS = 8  # floats kept a row: m and log z of s / T, t / T and s; KL; one unused


@triton.jit
def _online_lse(m, z, x, inv_T):
    # (running max of x, running sum of e^((x - max) / T)) after the block x: the old sum rescaled to the new
    # max. Logits are shifted before they are scaled: x / T itself overflows at finfo.min for T < 1.
    m_new = tl.maximum(m, tl.max(x, axis=0))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix: sums stay 0, not NaN
    return m_new, z * tl.exp((m - safe) * inv_T) + tl.sum(tl.exp((x - safe) * inv_T), axis=0), safe


@triton.jit
def _bad_target(y, C):
    # a labelled row whose class index is outside [0, C): NaN, else 0
    return tl.where((y != _IGNORE) & ((y < 0) | (y >= C)), float("nan"), 0.0)


@triton.jit
def loss_rows_kernel(
    s_ptr, t_ptr, target_ptr, labelled_ptr, row_loss_ptr, stats_ptr,
    C, stride_s, stride_t, inv_T, soft_w, one_minus_alpha,
    SOFT: tl.constexpr, HARD: tl.constexpr, BLOCK: tl.constexpr,
):
    # Triton's launcher passes Python floats as fp32, inductor's (a compiled caller) as fp64: one type in both.
    inv_T, soft_w = tl.cast(inv_T, tl.float32), tl.cast(soft_w, tl.float32)
    one_minus_alpha = tl.cast(one_minus_alpha, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    s_row, t_row = s_ptr + row * stride_s, t_ptr + row * stride_t
    cols = tl.arange(0, BLOCK)
    m_s = tl.full((), float("-inf"), tl.float32)  # s, its softmax at T
    z_s = tl.zeros((), tl.float32)
    safe_s = tl.zeros((), tl.float32)
    m_t = tl.full((), float("-inf"), tl.float32)  # t, its softmax at T
    z_t = tl.zeros((), tl.float32)
    safe_t = tl.zeros((), tl.float32)
    mean_t = tl.zeros((), tl.float32)  # sum p_t ((t - m_t) - (s - m_s)) / T over the columns so far
    m_h = tl.full((), float("-inf"), tl.float32)  # s, the hard term's softmax
    z_h = tl.zeros((), tl.float32)
    for c0 in range(0, C, BLOCK):
        live = c0 + cols < C
        s = tl.load(s_row + c0 + cols, mask=live, other=float("-inf")).to(tl.float32)
        if SOFT:
            t = tl.load(t_row + c0 + cols, mask=live, other=float("-inf")).to(tl.float32)
            safe_s_old, safe_t_old, m_t_old, z_t_old = safe_s, safe_t, m_t, z_t
            m_s, z_s, safe_s = _online_lse(m_s, z_s, s, inv_T)
            m_t, z_t, safe_t = _online_lse(m_t, z_t, t, inv_T)
            # A weighted mean, not a sum (terms near finfo.min / T would overflow a sum): the columns so far,
            # their log-ratios re-based to the new maxima, at their share of the teacher's mass, then this
            # block's, each weighted e^((t - m_t) / T) / z_t.
            e_t = tl.exp((t - safe_t) * inv_T)
            ratio = ((t - safe_t) - (s - safe_s)) * inv_T
            share = z_t_old * tl.exp((m_t_old - safe_t) * inv_T) / z_t
            old = (mean_t + ((safe_s - safe_s_old) - (safe_t - safe_t_old)) * inv_T) * share
            mean_t = tl.where(share > 0, old, 0.0) + tl.sum(tl.where(e_t > 0, e_t * (1.0 / z_t) * ratio, 0.0), axis=0)
        if HARD:
            m_h, z_h, _ = _online_lse(m_h, z_h, s, 1.0)
    # tl.max drops NaN, the sums keep it: a teacher row of NaN and -inf is no padding row but a NaN one (torch.amax)
    m_t = tl.where(z_t != z_t, z_t, m_t)
    lz_s, lz_t, lz_h = tl.log(z_s), tl.log(z_t), tl.log(z_h)
    # a row the teacher masks whole (every logit -inf: a padding position) adds nothing, as in the PyTorch form
    kl = tl.where(m_t == float("-inf"), 0.0, mean_t - lz_t + lz_s)
    loss = tl.zeros((), tl.float32)
    if SOFT:
        loss += soft_w * kl
    if HARD:
        y = tl.load(target_ptr + row)
        labelled = y != _IGNORE
        hard_w = one_minus_alpha / tl.maximum(tl.load(labelled_ptr), 1).to(tl.float32)
        s_y = tl.load(s_row + tl.where(labelled & (y >= 0) & (y < C), y, 0)).to(tl.float32)
        loss += tl.where(labelled, hard_w * ((m_h - s_y) + lz_h), 0.0) + _bad_target(y, C)
    tl.store(row_loss_ptr + row, loss)
    out = stats_ptr + row * 8
    tl.store(out + 0, m_s)
    tl.store(out + 1, lz_s)
    tl.store(out + 2, m_t)
    tl.store(out + 3, lz_t)
    tl.store(out + 4, m_h)
    tl.store(out + 5, lz_h)
    tl.store(out + 6, kl)
    tl.store(out + 7, 0.0)  # every output element defined (opcheck compares compiled and eager outputs)


@triton.jit
def grad_rows_kernel(
    s_ptr, t_ptr, target_ptr, labelled_ptr, stats_ptr, grad_ptr, ds_ptr, dt_ptr,
    C, stride_s, stride_t, stride_ds, stride_dt, inv_T, soft_w, one_minus_alpha,
    SOFT: tl.constexpr, HARD: tl.constexpr, WRITE_DS: tl.constexpr, WRITE_DT: tl.constexpr, BLOCK: tl.constexpr,
):
    # Triton's launcher passes Python floats as fp32, inductor's (a compiled caller) as fp64: one type in both.
    inv_T, soft_w = tl.cast(inv_T, tl.float32), tl.cast(soft_w, tl.float32)
    one_minus_alpha = tl.cast(one_minus_alpha, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    s_row, t_row = s_ptr + row * stride_s, t_ptr + row * stride_t
    cols = tl.arange(0, BLOCK)
    stats = stats_ptr + row * 8
    m_s, lz_s, m_t, lz_t = tl.load(stats + 0), tl.load(stats + 1), tl.load(stats + 2), tl.load(stats + 3)
    m_h, lz_h, kl = tl.load(stats + 4), tl.load(stats + 5), tl.load(stats + 6)
    grad = tl.load(grad_ptr).to(tl.float32)  # the loss's incoming gradient: scaled here, in fp32
    soft_g = soft_w * inv_T * grad
    y = tl.load(target_ptr + row)
    labelled = y != _IGNORE
    hard_g = tl.where(labelled, one_minus_alpha / tl.maximum(tl.load(labelled_ptr), 1).to(tl.float32) * grad, 0.0)
    if HARD:
        hard_g += _bad_target(y, C)
    for c0 in range(0, C, BLOCK):
        live = c0 + cols < C
        s = tl.load(s_row + c0 + cols, mask=live, other=0.0).to(tl.float32)
        ds = tl.zeros((BLOCK,), tl.float32)
        if SOFT:
            t = tl.load(t_row + c0 + cols, mask=live, other=float("-inf")).to(tl.float32)
            log_p_t = (t - m_t) * inv_T - lz_t
            log_p_s = (s - m_s) * inv_T - lz_s
            p_t = tl.exp(log_p_t)  # NaN in a row the teacher masks whole: its soft gradient is 0
            ds += tl.where(m_t == float("-inf"), 0.0, soft_g * (tl.exp(log_p_s) - p_t))
            if WRITE_DT:
                # 0 where the teacher puts no mass (its log-ratio is -inf); NaN where p_t is (a NaN or +inf logit)
                dt = tl.where(p_t == 0, 0.0, soft_g * p_t * ((log_p_t - log_p_s) - kl))
                dt = tl.where(m_t == float("-inf"), 0.0, dt)
                tl.store(dt_ptr + row * stride_dt + c0 + cols, cast_rne(dt, dt_ptr.dtype.element_ty), mask=live)
        if HARD:
            onehot = tl.where(c0 + cols == y, 1.0, 0.0)
            # an unlabelled row adds nothing: 0, not 0 times a softmax that is NaN where its logits are all -inf
            ds += tl.where(labelled, hard_g * (tl.exp((s - m_h) - lz_h) - onehot), 0.0)
        if WRITE_DS:
            tl.store(ds_ptr + row * stride_ds + c0 + cols, cast_rne(ds, ds_ptr.dtype.element_ty), mask=live)


def _block(c: int) -> Tuple[int, int]:
    """(columns a program holds at once, its warps)."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(c)))
    return block, 4 if block <= 1024 else 8


def _weights(n: int, temperature: float, alpha: float) -> tuple:
    """The kernels' float arguments: 1 / T, the soft term's weight alpha T^2 / N (per row), 1 - alpha."""
    return 1.0 / temperature, alpha * temperature * temperature / n, 1.0 - alpha


def _check(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
           alpha: float) -> None:
    """What the kernels read exactly: ``check_logits``'s inputs, fp16/bf16/fp32 logits with unit
    column stride, all on one device; ``check_hyperparameters``'s T and alpha."""
    check_hyperparameters(temperature, alpha)
    check_logits(student, teacher, target)
    if student.device != teacher.device or target.device != student.device:
        raise ValueError(f"logits and target must be on one device, got {student.device}, {teacher.device} "
                         f"and {target.device}")
    for name, x in (("student", student), ("teacher", teacher)):
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"the fused loss takes fp16/bf16/fp32 {name} logits, got {x.dtype}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"the fused loss needs {name} logits with unit column stride, got strides {x.stride()}")


def _check_runs_triton(student: torch.Tensor) -> None:
    path = execution_path(student)
    if path is not ExecutionPath.TRITON:
        raise ValueError(f"fuselab's distillation loss ops run on its Triton kernels only, not here: {path.value}")


_INSTEAD = "fuselab.quant.DistillationLoss(fused=True) or fused_distill.fused_distillation_loss"


def _loss_fake(student, teacher, target, temperature, alpha):
    _check(student, teacher, target, temperature, alpha)
    return student.new_empty((), dtype=torch.float32), student.new_empty((student.shape[0], STATS), dtype=torch.float32)


def _loss(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
          alpha: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the loss, 8 fp32 statistics a row that ``distillation_loss_grad`` reads)."""
    refuse_forward_ad("distillation_loss", _INSTEAD)
    _check(student, teacher, target, temperature, alpha)
    _check_runs_triton(student)
    n, c = student.shape
    target = target.contiguous()  # the kernels read it at unit stride
    row_loss = torch.empty(n, dtype=torch.float32, device=student.device)
    stats = torch.empty((n, STATS), dtype=torch.float32, device=student.device)
    labelled = (target != IGNORE_INDEX).sum()  # stays on the device
    block, warps = _block(c)
    launch(loss_rows_kernel, (n,), student, teacher, target, labelled, row_loss, stats, c, student.stride(0),
           teacher.stride(0), *_weights(n, temperature, alpha), SOFT=alpha > 0.0, HARD=alpha < 1.0, BLOCK=block,
           num_warps=warps)
    return row_loss.sum(), stats


def _grad_fake(student, teacher, target, stats, grad, temperature, alpha, need_ds, need_dt):
    _check(student, teacher, target, temperature, alpha)
    return (torch.empty_like(student) if need_ds else student.new_empty(0),
            torch.empty_like(teacher) if need_dt else teacher.new_empty(0))


def _grad(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, stats: torch.Tensor,
          grad: torch.Tensor, temperature: float, alpha: float, need_ds: bool,
          need_dt: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d student, d loss / d teacher) times ``grad`` (0-dim), each an empty tensor where not needed."""
    refuse_forward_ad("distillation_loss_grad", _INSTEAD)
    _check(student, teacher, target, temperature, alpha)
    _check_runs_triton(student)
    n, c = student.shape
    if stats.shape != (n, STATS) or stats.dtype != torch.float32 or grad.numel() != 1:
        raise ValueError(f"stats must be distillation_loss's ({n}, {STATS}) fp32 and grad one value, got "
                         f"{tuple(stats.shape)} {stats.dtype} and {tuple(grad.shape)}")
    target, stats = target.contiguous(), stats.contiguous()
    ds = torch.empty_like(student, memory_format=torch.contiguous_format) if need_ds else student.new_empty(0)
    dt = torch.empty_like(teacher, memory_format=torch.contiguous_format) if need_dt else teacher.new_empty(0)
    if need_ds or need_dt:
        labelled = (target != IGNORE_INDEX).sum()
        block, warps = _block(c)
        launch(grad_rows_kernel, (n,), student, teacher, target, labelled, stats, grad, ds, dt, c,
               student.stride(0), teacher.stride(0), ds.stride(0) if need_ds else 0, dt.stride(0) if need_dt else 0,
               *_weights(n, temperature, alpha), SOFT=alpha > 0.0, HARD=alpha < 1.0, WRITE_DS=need_ds,
               WRITE_DT=need_dt, BLOCK=block, num_warps=warps)
    return ds, dt


_loss_op = register_op("fuselab::distillation_loss", fake=_loss_fake)(_loss)
register_op("fuselab::distillation_loss_grad", fake=_grad_fake)(_grad)


def _setup_context(ctx, inputs, output):
    student, teacher, target, temperature, alpha = inputs
    ctx.save_for_backward(student, teacher, target, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.temperature, ctx.alpha = temperature, alpha


def _backward_using(grad_fn):
    """The loss's backward with ``grad_fn`` computing the gradients: the registered op, or ``_grad`` itself."""

    def backward(ctx, grad, _grad_stats):
        student, teacher, target, stats = ctx.saved_tensors
        # alpha = 0: the loss is the hard term alone, which the teacher's logits do not enter (no gradient)
        need_ds, need_dt = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.alpha > 0
        none = (None,) * 3
        if not (need_ds or need_dt):
            return (None, None, *none)
        if backward_by_torch_needed(grad):  # create_graph=True, tangents or batched: PyTorch's form serves
            wrt = [x for x, need in ((student, need_ds), (teacher, need_dt)) if need]
            create_graph = torch.is_grad_enabled()
            with torch.enable_grad():  # a batched backward runs without grad mode: the form needs its graph
                loss = distillation_loss_torch(student, teacher, target, ctx.temperature, ctx.alpha)
                got = iter(torch.autograd.grad(loss, wrt, grad, create_graph=create_graph))
            return (next(got) if need_ds else None, next(got) if need_dt else None, *none)
        ds, dt = grad_fn(student, teacher, target, stats, grad, ctx.temperature, ctx.alpha, need_ds, need_dt)
        return (ds if need_ds else None, dt if need_dt else None, *none)

    return backward


_loss_op.register_autograd(_backward_using(torch.ops.fuselab.distillation_loss_grad), setup_context=_setup_context)


class _EagerDistillationLoss(torch.autograd.Function):
    """The registered op's own bodies, called without the dispatcher: in eager mode the custom-op dispatch
    and its generated autograd cost more host time than the kernels take on the GPU. Traced calls keep
    the op (``torch.compile``, ``torch.export``); both share one backward."""

    @staticmethod
    def forward(ctx, student, teacher, target, temperature, alpha):
        out = _loss(student, teacher, target, temperature, alpha)
        _setup_context(ctx, (student, teacher, target, temperature, alpha), out)
        return out

    backward = staticmethod(_backward_using(_grad))


def fused_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float,
                            alpha: float) -> torch.Tensor:
    """The loss by the kernels where they compute it exactly (``execution_path``), else by the PyTorch form;
    differentiable in both logits. Under forward-mode AD and ``torch.func`` transforms the PyTorch form
    computes it (a custom op has no tangent rule), so tangents and transformed results are PyTorch's."""
    temperature, alpha = check_hyperparameters(temperature, alpha)
    if alpha == 0.0:  # no soft term: the teacher takes no part in the loss's graph (the PyTorch form's too)
        teacher = teacher.detach()
    if (execution_path(student) is not ExecutionPath.TRITON or execution_path(teacher) is not ExecutionPath.TRITON
            or (not torch.compiler.is_compiling() and beyond_custom_ops())):
        check_logits(student, teacher, target)  # the kernels' path checks them in the op (_check)
        return distillation_loss_torch(student, teacher, target, temperature, alpha)
    # columns made contiguous where they are not; any other shape goes on to the op's check as it is
    student, teacher = (x if x.dim() != 2 or x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()
                        for x in (student, teacher))
    if untraced(student, teacher, target):
        return _EagerDistillationLoss.apply(student, teacher, target, float(temperature), float(alpha))[0]
    return torch.ops.fuselab.distillation_loss(student, teacher, target, temperature, alpha)[0]
