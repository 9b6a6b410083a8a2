"""Knowledge distillation's loss (Hinton et al., 2015): soft teacher targets plus the hard labels.

    loss = alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, y)

KL summed over classes and averaged over the batch; CE averaged over the rows that have a label.
The T^2 factor keeps the soft term's gradient on the scale of the hard term's as T changes (the
soft gradients shrink as 1/T^2).
"""
import math
import numbers
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn


def scalar(name: str, value):
    """``value`` as a Python float where it is one number (a numpy scalar, a one-element tensor: a config
    file's or a schedule's), else unchanged for the caller's checks; TypeError for a bool and for a tensor
    that requires grad (a learned temperature: float() would drop its gradient)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise TypeError(f"{name} must be a number, not a tensor that requires grad (a learned {name} is not supported)")
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                           and not value.is_complex()):
        return float(value)
    return value


class DistillationLoss(nn.Module):
    """``forward(student_logits, teacher_logits, target)``: the loss above, a scalar.

    ``student_logits`` and ``teacher_logits`` are (N, C) floating tensors of one shape, ``target``
    (N,) class indices in [0, C) (-100, cross-entropy's ignore_index, drops a row from the hard term
    only: the soft term has no target; a batch with no label at all has a hard term of 0, not NaN).
    A teacher logit of -inf (a masked class) adds nothing to the soft term, nor does a row of them only (a
    padding position; it still counts in the mean over N rows); a mask of finfo.min is a logit like any
    other (a row of them only is a uniform softmax, at any T; but at T < 1 a student logit there where the
    teacher puts any mass makes that class's log-ratio, |finfo.min| / T, overflow: the loss is inf, the
    teacher's gradient inf or NaN, the student's finite). With alpha > 0, a NaN or +inf teacher logit makes the
    loss NaN and both gradients of its row NaN (the other rows' are unchanged), on both paths. The math runs in fp32
    (float64 inputs stay float64), with autocast off, whatever the logits' dtype. Gradients flow to
    both logits; compute the teacher's under ``torch.no_grad()`` to train the student alone.

    Args:
        temperature: T > 0 (finite); T = 1 is plain softmax matching.
        alpha: weight of the soft term, in [0, 1]; 0 is plain cross-entropy.
        fused: compute the loss and both gradients with Triton kernels (``fuselab.quant.fused_distill``)
            on CUDA fp16/bf16/fp32 logits; elsewhere, and for a backward that is itself differentiated,
            the PyTorch form. Its results match this one's to fp32 rounding at the logits' magnitude, but for
            a target outside [0, C) other than -100: its row's loss and gradient are NaN there (checking on the
            host would wait for the GPU), where cross-entropy here raises (a device-side assert on CUDA), and
            for a row whose logits span more than fp32's largest value (finfo.min beside 1e38): the kernels
            shift each logit by its row's largest before scaling by 1/T, so at T > 1 such a row's loss is inf
            where this form, scaling first, can still hold it.
    """

    def __init__(self, temperature: float = 4.0, alpha: float = 0.9, fused: bool = False):
        super().__init__()
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be True or False, got {fused!r}")
        self.temperature, self.alpha = check_hyperparameters(temperature, alpha)
        self.fused = fused

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, alpha={self.alpha}" + (", fused=True" if self.fused else "")

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        if self.fused:  # it checks the logits on each of its paths
            from fuselab.quant.fused_distill import fused_distillation_loss  # it imports this module

            return fused_distillation_loss(student_logits, teacher_logits, target, self.temperature, self.alpha)
        check_logits(student_logits, teacher_logits, target)
        return distillation_loss_torch(student_logits, teacher_logits, target, self.temperature, self.alpha)


def check_hyperparameters(temperature, alpha) -> Tuple[float, float]:
    """(temperature, alpha) as floats (see ``scalar``), or ValueError unless T is positive and finite and alpha
    in [0, 1]: the checks of ``DistillationLoss`` and of the functional fused loss."""
    temperature, alpha = scalar("temperature", temperature), scalar("alpha", alpha)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return float(temperature), float(alpha)


def distillation_loss_torch(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor,
                            temperature: float, alpha: float) -> torch.Tensor:
    """``DistillationLoss``'s PyTorch form (its arguments unchecked): differentiable to every order."""
    T = temperature
    with torch.autocast(student_logits.device.type, enabled=False):
        s, t = _at_least_fp32(student_logits), _at_least_fp32(teacher_logits)
        # a row the teacher masks whole (a padding position) adds nothing: its softmax would be 0 / 0, NaN; so
        # is the student's there if masked whole too, and a NaN softmax's backward is NaN even times a zero
        t_max = t.amax(dim=-1, keepdim=True)
        dead = t_max == float("-inf")  # one reduction, no (N, C) mask
        s_soft = s
        if T < 1:  # x / T overflows at the dtype's extreme logits (a mask of finfo.min): shifted first
            s_soft, t = s - s.amax(dim=-1, keepdim=True).detach(), t - t_max.detach()
        t = torch.where(dead, 0.0, t)
        log_p_s = F.log_softmax(torch.where(dead, 0.0, s_soft) / T, dim=-1)
        log_p_t = F.log_softmax(t / T, dim=-1)
        # KL(p_t || p_s) = sum p_t (log p_t - log p_s), summed over classes, mean over rows; a class the
        # teacher masks (logit -inf, p_t = 0) adds 0 (kl_div's 0 * -inf would be NaN, in its gradient too).
        # A NaN p_t (a NaN or +inf teacher logit) is kept: its row's gradients are NaN, as its loss is.
        p_t = log_p_t.exp()
        kept = (p_t != 0) & ~dead
        kl = p_t * torch.where(kept, log_p_t - log_p_s, 0.0)
        soft = kl.sum() / s.shape[0] * (T * T)
        if alpha == 1.0:  # no hard term at all: 0 * a NaN cross-entropy would be NaN
            return soft
        # The mean over labelled rows, 0 when there are none (cross_entropy's mean would be 0 / 0)
        labelled = (target != -100).sum().clamp(min=1)
        # an unlabelled row adds nothing, its gradient 0 too where its student logits are all -inf
        unlabelled = (target == -100).unsqueeze(-1)
        hard = F.cross_entropy(torch.where(unlabelled, 0.0, s), target, reduction="sum") / labelled
        return hard if alpha == 0.0 else alpha * soft + (1.0 - alpha) * hard


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def check_logits(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor) -> None:
    """``DistillationLoss``'s inputs: (N, C) floating logits of one shape, N >= 1, C >= 1; (N,) int64 targets."""
    if student.dim() != 2 or student.shape != teacher.shape:
        raise ValueError(f"student and teacher logits must both be (N, C) of one shape, got "
                         f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    if not (student.is_floating_point() and teacher.is_floating_point()):
        raise TypeError(f"logits must be floating point, got {student.dtype} and {teacher.dtype}")
    if target.shape != student.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"target must be (N,) = ({student.shape[0]},) int64 class indices, got "
                         f"{tuple(target.shape)} {target.dtype}")
    if student.shape[0] == 0:
        raise ValueError("the batch is empty: a batch mean of no rows is undefined")
    if student.shape[1] == 0:
        raise ValueError(f"the logits have no class (shape {tuple(student.shape)}): a softmax needs at least one")
