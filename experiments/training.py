"""What the training experiments share: their run arguments (device, precision, checkpoints, timing
windows) and process group, the learning-rate schedule and the weight-decay groups."""
import argparse
import math
import uuid
from functools import partial
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Set

import torch
import torch.distributed as dist

from experiments import harness
from fuselab import distributed as fd


def add_run_args(g, *, log_every: int, timing_skip: int, checkpoint_every_help: str) -> None:
    """Device, precision, checkpoints, timed windows and the collective timeout, on ``g`` (a parser
    or an argument group); ``finish_run_args`` completes them after parsing."""
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                   help="default: bf16 on CUDA (autocast, or FSDP2 mixed precision), fp32 on the CPU")
    g.add_argument("--checkpoint-dir", type=Path, default=None)
    g.add_argument("--checkpoint-every", type=harness.non_negative_int, default=0, help=checkpoint_every_help)
    g.add_argument("--keep", type=harness.positive_int, default=3, help="complete checkpoints kept")
    g.add_argument("--async-checkpoint", action="store_true", help="dcp.async_save: write while training goes on")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    g.add_argument("--log-every", type=harness.positive_int, default=log_every, help="steps per timed window")
    g.add_argument("--timing-skip", type=harness.non_negative_int, default=timing_skip,
                   help="first steps of this process left out of the throughput (compilation, warm-up; a "
                        "resumed run compiles again)")
    g.add_argument("--timeout", type=harness.positive_float, default=600.0, help="collective timeout, seconds")


def given_options(p: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Set[str]:
    """The destinations of the options ``argv`` sets (default: the command line's), however they compare with
    their defaults."""
    defaults = {a: a.default for a in p._actions}
    try:
        for action in defaults:
            action.default = argparse.SUPPRESS
        return set(vars(p.parse_known_args(argv)[0]))
    finally:
        for action, default in defaults.items():
            action.default = default


def finish_run_args(p: argparse.ArgumentParser, args: argparse.Namespace, study: str, tiny: Dict[str, object],
                    argv: Optional[Sequence[str]] = None) -> None:
    """With ``--tiny``, the ``tiny`` values for every option ``argv`` does not set (``--tiny --batch 256`` keeps
    256, the default); then the run arguments' checks (``--out`` too) and the precision's default."""
    if args.tiny:
        given = given_options(p, argv)
        for key, value in tiny.items():
            if key not in given:
                setattr(args, key, value)
    if args.resume and args.checkpoint_dir is None:
        p.error("--resume needs --checkpoint-dir")
    if args.checkpoint_dir is not None and args.checkpoint_dir.exists() and not args.checkpoint_dir.is_dir():
        p.error(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a folder")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    harness.output_path(args, study)  # --out's mistakes before the run


def open_checkpointer(args: argparse.Namespace, settings: Dict[str, object], log) -> fd.Checkpointer:
    """``--checkpoint-dir``'s Checkpointer, checked before any training or loading: SystemExit where it holds
    checkpoints and ``--resume`` is not given (the run would save beside another run's), and for a ``--resume``
    that changes one of ``settings`` (see ``run_settings``; keys that are no option, the schedule's length say,
    too), naming it: a resume continues the checkpoint's run (its optimizer and schedule states are that run's),
    so a changed rate, model or length would train a hybrid under the new run's label."""
    ckpt = fd.Checkpointer(args.checkpoint_dir, keep=args.keep, async_save=args.async_checkpoint)
    found = ckpt.checkpoints()
    if args.resume and not found:  # the first launch of a preemptible job, or a mistyped folder: say which
        log.warning("--resume: no checkpoint in %s: training starts at step 0", args.checkpoint_dir)
    if found and not args.resume:
        ckpt.close()
        raise SystemExit(f"--checkpoint-dir {args.checkpoint_dir} holds checkpoints (up to step {found[-1][0]}): pass "
                         "--resume to continue that run, or give another folder")
    saved = (ckpt.train_state() or {}).get("settings") if found else None
    if found and saved is None:
        log.warning("the checkpoint predates saved run settings: they are not checked against this run's")
    changed = [f"{'--' + k.replace('_', '-') if hasattr(args, k) else k} {saved[k]!r} -> {v!r}"
               for k, v in settings.items() if saved is not None and k in saved and saved[k] != v]
    if changed:
        ckpt.close()
        raise SystemExit(f"--resume: this run's settings differ from the checkpoint's run ({'; '.join(changed)}): a "
                         "resume continues that run; pass its settings, or start a new run in another --checkpoint-dir")
    return ckpt


def training_run(state: Optional[Dict[str, object]]) -> str:
    """The id that names a training run across its resumes (saved in its checkpoints' train state, recorded in
    its results: a ``--merge``d resume's curve goes beside its first part's): the checkpoint's, else a new one,
    rank 0's on every rank."""
    if state is not None and state.get("training_run"):
        return str(state["training_run"])
    run = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(run, src=0)
    return run[0]


def run_settings(args: argparse.Namespace, names) -> Dict[str, object]:
    """The settings that define a run (model, optimizer, data, seed), as saved in its checkpoints' train state."""
    return {name: str(v) if isinstance(v := getattr(args, name), Path) else v for name in names}


def run_record(run_id: str, settings: Dict[str, object], state: Optional[Dict[str, object]]) -> Dict[str, object]:
    """What a results file records of the run: its id, its settings and, for a resumed part, where it resumed."""
    resumed = {"resumed_from_step": state["step"], "resumed_from_world_size": state.get("world_size")} if state else {}
    return {"training_run": run_id, "settings": settings, **resumed}


def check_same_on_every_rank(settings: Dict[str, object]) -> None:
    """SystemExit on every rank where the ranks were started with different run ``settings`` (one rank's --seed or
    --lr: FSDP2 kept each rank's own initial shard and the run went on), naming the first that differs."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, settings)
    for key in sorted(set().union(*gathered)):
        values = [g.get(key, "(missing)") for g in gathered]
        other = next((r for r, v in enumerate(values) if v != values[0]), None)
        if other is not None:
            raise SystemExit(f"the ranks were started with different settings: {key} is {values[0]!r} on rank 0 and "
                             f"{values[other]!r} on rank {other}; every rank takes the same arguments")


def run_distributed(train: Callable, args: argparse.Namespace):
    """``train(args, runtime)`` in this process's share of the job (torchrun's, or a single process)."""
    rt = fd.init(args.device, timeout_s=args.timeout)
    rows = train(args, rt)
    fd.shutdown()
    return rows


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


def restart_schedule(sched, base_lr: float, step: int) -> None:
    """Point a ``warmup_cosine_schedule`` restored from a checkpoint at ``base_lr`` and optimizer step
    ``step`` (a resume at another world size: the base rate scales with it, steps count its batches)."""
    groups = sched.optimizer.param_groups
    sched.base_lrs = [base_lr] * len(groups)
    sched.last_epoch = step
    rates = [base_lr * factor(step) for factor in sched.lr_lambdas]
    for group, lr in zip(groups, rates):
        group["initial_lr"], group["lr"] = base_lr, lr
    sched._last_lr = rates


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """Parameter groups: weight decay on matrices and kernels, none on biases and norm weights."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
