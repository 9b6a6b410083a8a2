"""A torchvision ResNet on Fashion-MNIST with DDP, on one CPU, one GPU or many.

The ResNet takes 28x28 grayscale: a 3x3 stride-1 one-channel stem and no max-pool (the ImageNet
stem would shrink 28x28 to 7x7 before the first stage), 10 classes, zero-initialized last BN of
each residual branch. Data: Fashion-MNIST's idx files (``--data``; Debian's
``dataset-fashion-mnist`` puts them in /usr/share/datasets/fashion-mnist), held on the device as
uint8 and normalized per batch, random horizontal flips.

Each rank draws its share of every epoch from ``DistributedSampler`` (``set_epoch`` per epoch):
a global step takes ``batch x world`` consecutive samples of the epoch's permutation, so a
checkpoint's data position (samples seen in the epoch) resumes at any world size. The learning
rate is ``--lr`` x world size (the linear scaling rule for a global batch that grows with the
ranks), reached by linear warm-up, then cosine decay. SGD with Nesterov momentum; bf16 autocast
on CUDA (channels-last). Test accuracy after every epoch (each rank a strided share of the test
set, counts summed over ranks); images/s over timed windows of ``--log-every`` steps (the first
``--timing-skip`` steps and windows that span an evaluation or a checkpoint left out).

    python -m experiments.train_ddp --tiny --device cpu                         # smoke run
    python -m experiments.train_ddp --epochs 5                                  # one GPU
    torchrun --standalone --nproc_per_node=8 -m experiments.train_ddp --epochs 5
"""
import argparse
import contextlib
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from experiments import data, harness
from experiments.training import (
    add_run_args,
    check_same_on_every_rank,
    decay_groups,
    finish_run_args,
    open_checkpointer,
    restart_schedule,
    run_distributed,
    run_record,
    run_settings,
    training_run,
    warmup_cosine_schedule,
)
from fuselab import distributed as fd

STUDY = "train_ddp"
# What defines a run (checked on --resume), with the schedule's length in samples; the world size may change.
SETTINGS = ("arch", "tiny", "batch", "lr", "warmup_epochs", "momentum", "weight_decay", "augment", "sync_bn",
            "limit_train", "seed", "precision")
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training set, pixels in [0, 1]
ARCHS = ("resnet18", "resnet34", "resnet50")
log = logging.getLogger("fuselab.train_ddp")



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="resnet18")
    p.add_argument("--tiny", action="store_true", help="CPU smoke size: a one-block-per-stage ResNet with a "
                   "stride-2 stem, 512 training and 256 test images, batch 32, one epoch")
    p.add_argument("--data", type=Path, default=data.FASHION_MNIST,
                   help="folder of Fashion-MNIST's four *-ubyte.gz files (or a torchvision FashionMNIST root)")
    p.add_argument("--epochs", type=harness.positive_int, default=5)
    p.add_argument("--steps", type=harness.positive_int, default=None,
                   help="stop after this many optimizer steps in all, within --epochs (default: --epochs full epochs)")
    p.add_argument("--batch", type=harness.positive_int, default=256, help="images per rank per step")
    p.add_argument("--lr", type=harness.positive_float, default=0.1, help="learning rate of one rank; x world size")
    p.add_argument("--warmup-epochs", type=harness.non_negative_float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=harness.non_negative_float, default=5e-4)
    p.add_argument("--no-augment", dest="augment", action="store_false", help="no random horizontal flips")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (SyncBatchNorm)")
    p.add_argument("--limit-train", type=harness.positive_int, default=None, help="use the first N training images")
    p.add_argument("--limit-test", type=harness.positive_int, default=None, help="use the first N test images")
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model (DDPOptimizer)")
    add_run_args(p, log_every=20, timing_skip=20,
                 checkpoint_every_help="steps between saves (0: at each epoch's end only)")
    harness.add_output_args(p)
    args = p.parse_args(argv)
    finish_run_args(p, args, STUDY,
                    tiny=dict(limit_train=512, limit_test=256, batch=32, epochs=1, log_every=4, timing_skip=2),
                    argv=argv)
    if not 0 <= args.momentum < 1:
        p.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.sync_bn and args.device == "cpu":
        p.error("--sync-bn: torch's SyncBatchNorm runs on CUDA only")
    if args.device == "cpu" and not args.tiny and args.limit_train is None and args.steps is None:
        p.error(f"{args.arch} over all 60,000 images for {args.epochs} epochs on the CPU runs for an hour or more: "
                "--tiny for a smoke run, --limit-train or --steps for a shorter one, or run it on a GPU")
    return args


def build_model(arch: str, tiny: bool) -> nn.Module:
    from torchvision.models import resnet
    from torchvision.models.resnet import BasicBlock, ResNet

    if tiny:
        model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, zero_init_residual=True)
        model.conv1 = nn.Conv2d(1, 64, 3, stride=2, padding=1, bias=False)
    else:
        model = getattr(resnet, arch)(num_classes=10, zero_init_residual=True)
        model.conv1 = nn.Conv2d(1, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def load_data(args, device):
    try:
        (x, y), (xt, yt) = data.fashion_mnist(args.data)
    except data.DataNotFound as e:
        raise SystemExit(str(e)) from None
    x, y = x[:args.limit_train], y[:args.limit_train]
    xt, yt = xt[:args.limit_test], yt[:args.limit_test]
    return [(a.unsqueeze(1).to(device), b.to(device)) for a, b in ((x, y), (xt, yt))]


def prepare(images: torch.Tensor, augment: bool, channels_last: bool) -> torch.Tensor:
    """uint8 (B, 1, 28, 28) -> normalized float, flipped left-right at random when ``augment``."""
    x = images.float().div_(255).sub_(MEAN).div_(STD)
    if augment:
        flip = torch.rand(x.shape[0], device=x.device) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def make_optimizer(model, args, world, steps_per_epoch, total_steps):
    opt = torch.optim.SGD(decay_groups(model, args.weight_decay), lr=args.lr * world, momentum=args.momentum,
                          nesterov=args.momentum > 0)
    return opt, warmup_cosine_schedule(opt, int(args.warmup_epochs * steps_per_epoch), total_steps)


@torch.no_grad()
def evaluate(module, test, rt, autocast, channels_last) -> float:
    """Accuracy on the test set: rank r scores images r, r + W, ...; counts summed over ranks."""
    xt, yt = test
    module.eval()
    correct = torch.zeros((), device=rt.device, dtype=torch.float64)
    idx = torch.arange(rt.rank, len(xt), rt.world_size, device=xt.device)
    for chunk in idx.split(1024):
        with autocast:
            logits = module(prepare(xt[chunk], False, channels_last))
        correct += (logits.argmax(1) == yt[chunk]).sum()
    module.train()
    if dist.is_initialized() and rt.world_size > 1:
        dist.all_reduce(correct)
    return correct.item() / len(xt)


def sync_buffers(module) -> None:
    """BatchNorm running statistics from rank 0 (each rank's last forward updated its own copy)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for b in module.buffers():
            dist.broadcast(b, 0)


def main(argv=None):
    return run_distributed(train, parse_args(argv))


def train(args, rt):
    device, world = rt.device, rt.world_size
    cuda = device.type == "cuda"
    channels_last = cuda
    train_set, test_set = fd.rank_zero_first(lambda: load_data(args, device))  # one extraction per node
    n_train = len(train_set[0])
    sampler = torch.utils.data.DistributedSampler(range(n_train), num_replicas=world, rank=rt.rank, shuffle=True,
                                                  seed=args.seed, drop_last=True)
    steps_per_epoch = len(sampler) // args.batch
    if steps_per_epoch < 1:
        raise SystemExit(f"{n_train} training images are too few for {world} rank(s) x batch {args.batch}")
    if args.steps and args.steps > args.epochs * steps_per_epoch:  # else the run ended early, said only in a log line
        raise SystemExit(f"--steps {args.steps} is more than --epochs {args.epochs} x {steps_per_epoch} steps an epoch "
                         f"({world} rank(s) x batch {args.batch}): give more --epochs, or fewer --steps")
    total_steps = min(args.steps or math.inf, args.epochs * steps_per_epoch)

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = build_model(args.arch, args.tiny)
    if args.sync_bn and world > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    module = model
    model = fd.ddp_model(model)
    forward = torch.compile(model) if args.compile else model
    opt, sched = make_optimizer(module, args, world, steps_per_epoch, total_steps)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    torch.manual_seed(args.seed + 1 + rt.rank)  # per-rank augmentation draws

    ckpt, epoch, skip, step, state = None, 0, 0, 0, None
    # the cosine decays over the run's length: a resume that changed it (--epochs, --steps) would be a hybrid; in
    # whole epochs (their steps depend on the world size) or, stopped by --steps, in samples
    length = (f"{args.epochs} epochs" if total_steps == args.epochs * steps_per_epoch
              else f"{total_steps * args.batch * world} samples")
    settings = {**run_settings(args, SETTINGS), "schedule": length}
    check_same_on_every_rank(settings)
    if args.checkpoint_dir is not None:
        ckpt = open_checkpointer(args, settings, log)
        if args.resume:
            state = ckpt.load(model, opt, sched)
            if state is not None:
                epoch, skip, step = state["epoch"], state["samples_in_epoch"], state["step"]
                if state["world_size"] != world:  # this world's lr (x world size) and its steps per epoch
                    if skip % (args.batch * world):
                        raise SystemExit(f"--resume: the checkpoint is {skip} samples into epoch {epoch + 1}, not a "
                                         f"whole number of this run's global batches ({world} rank(s) x --batch "
                                         f"{args.batch}): samples would be skipped; resume on a world size that "
                                         "divides it")
                    step = epoch * steps_per_epoch + skip // (args.batch * world)
                    restart_schedule(sched, args.lr * world, step)

    first_step = step
    run_id = training_run(state)
    keys = dict(op=f"{args.arch}{'-tiny' if args.tiny else ''} fashion-mnist",
                provider="ddp" + ("+compile" if args.compile else "") + ("+syncbn" if args.sync_bn else ""),
                shape=f"{world}x{args.batch}", dtype=args.precision, mode="wall")
    log.info("%s: %s, %d rank(s) x batch %d, lr %.3g (= %.3g x %d), %d steps/epoch, %d steps", keys["op"],
             keys["provider"], world, args.batch, args.lr * world, args.lr, world, steps_per_epoch, total_steps)
    results = harness.Results(STUDY, device=args.device)
    results.annotate(**run_record(run_id, settings, state))
    windows, accuracies = [], []
    bar = tqdm(total=total_steps, initial=step, desc=STUDY, disable=not rt.is_main, dynamic_ncols=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    while step < total_steps and epoch < args.epochs:
        sampler.set_epoch(epoch)
        mine = torch.tensor(list(sampler), device=device)[skip // world:]  # skip: global samples already seen
        batches = [b for b in mine.split(args.batch) if len(b) == args.batch]
        epoch_loss, epoch_t0 = torch.zeros((), device=device), time.perf_counter()
        window_loss, window_t0, window_steps, window_clean = torch.zeros((), device=device), None, 0, True
        done = 0  # batches of this epoch trained
        for idx in batches:
            if step >= total_steps:
                break
            if window_t0 is None:
                harness.sync(device)
                window_t0, window_steps, window_clean = time.perf_counter(), 0, step - first_step >= args.timing_skip
            x, y = prepare(train_set[0][idx], args.augment, channels_last), train_set[1][idx]
            with autocast:
                loss = F.cross_entropy(forward(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            done += 1
            window_steps += 1
            window_loss += loss.detach()
            epoch_loss += loss.detach()
            bar.update(1)
            end_of_epoch = done == len(batches) or step >= total_steps
            if step % args.log_every == 0 or end_of_epoch:
                mean = fd.all_reduce(window_loss.item() / window_steps)  # .item() synchronizes
                rate = window_steps * args.batch * world / (time.perf_counter() - window_t0)
                if window_clean:
                    windows.append(rate)
                bar.set_postfix(loss=f"{mean:.3f}", img_s=f"{rate:,.0f}", epoch=epoch + 1)
                window_loss.zero_()
                window_t0 = None
            if ckpt is not None and args.checkpoint_every and step % args.checkpoint_every == 0 and not end_of_epoch:
                sync_buffers(module)
                seen = skip + done * args.batch * world
                ckpt.save(step, model, opt, sched, {"epoch": epoch, "samples_in_epoch": seen, "settings": settings,
                                                    "training_run": run_id})
                window_clean = False
        epoch_s = time.perf_counter() - epoch_t0
        sync_buffers(module)
        acc = evaluate(module, test_set, rt, autocast, channels_last)
        train_loss = fd.all_reduce(epoch_loss.item() / done) if done else None  # a resume at the epoch's end: none
        accuracies.append((epoch + 1, acc))
        log.info("epoch %d: train loss %s, test accuracy %.4f, %.1f s", epoch + 1,
                 "(no batch after the resume)" if train_loss is None else f"{train_loss:.4f}", acc, epoch_s)
        results.record(metric="test accuracy", value=acc, epoch=epoch + 1, step=step, **keys)
        part = {"from_sample": skip} if skip else {}  # a resumed epoch's loss is over its batches after the resume
        if train_loss is not None:
            results.record(metric="train loss", value=train_loss, epoch=epoch + 1, step=step, **part, **keys)
        results.record(metric="epoch s", value=epoch_s, epoch=epoch + 1, **keys)
        if done == len(batches):
            epoch, skip = epoch + 1, 0
        else:  # stopped by --steps inside the epoch
            skip += done * args.batch * world
        if ckpt is not None:
            ckpt.save(step, model, opt, sched, {"epoch": epoch, "samples_in_epoch": skip, "settings": settings,
                                                "training_run": run_id})
            if rt.is_main:  # the epochs so far beside each checkpoint: a part that is killed keeps them
                results.save(harness.output_path(args, STUDY), merge=args.merge)
    bar.close()
    if ckpt is not None:
        ckpt.close()
    peak = fd.all_reduce(harness.peak_memory_mib(device) or 0.0, "max") if cuda else None
    if not rt.is_main:
        return None
    path = harness.output_path(args, STUDY)
    if step == first_step:  # a resume of a finished run measured nothing: the results of the run it resumed stay
        log.warning("nothing was trained: %s left as it was", path)
        return results.rows
    summary = {}
    if windows:
        ips = harness.Timing.of(windows)
        results.record(metric="images/s", value=ips, windows=len(windows), world_size=world, **keys)
        per_gpu = harness.Timing(*(v / world for v in (ips.p20, ips.p50, ips.p80)))
        results.record(metric="images/s per GPU", value=per_gpu, world_size=world, **keys)
        summary.update({"images/s": ips.p50, "images/s per GPU": ips.p50 / world})
    else:
        log.warning("no timed window (all within --timing-skip %d): no throughput", args.timing_skip)
    if accuracies:
        results.record(metric="final test accuracy", value=accuracies[-1][1], after_epoch=accuracies[-1][0], **keys)
        summary["final test accuracy"] = accuracies[-1][1]
    if peak is not None:
        results.record(metric="peak MiB", value=peak, **keys)
        summary["peak MiB"] = peak
    print(harness.markdown_table(["op", "provider", "shape", *summary],
                                 [[keys["op"], keys["provider"], keys["shape"], *summary.values()]]))
    print(f"saved {results.save(path, merge=args.merge)}")
    return results.rows


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
