"""What the training experiments share: the learning-rate schedule and the weight-decay groups."""
import math
from functools import partial

import torch


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The LR factor at optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps, then
    cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine_schedule(opt: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float = 0.0):
    return torch.optim.lr_scheduler.LambdaLR(opt, partial(warmup_cosine, warmup=warmup, total=total,
                                                          min_ratio=min_ratio))


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """Parameter groups: weight decay on matrices and kernels, none on biases and norm weights."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
