"""GPT-2 (transformers' GPT2LMHeadModel) trained with FSDP2 on real text, on one CPU, one GPU or many.

Data: GPT-2 BPE ids of a folder of text files (default: Debian python3.11-doc's reST sources,
~3.5M tokens; ``experiments.data.gpt2_tokens``), or a saved 1-D tensor of ids (``--corpus
ids.pt``; ``--export-tokens ids.pt`` writes one). Sequences are non-overlapping windows of
``--seq`` + 1 tokens in a seeded order; the last ``--val-fraction`` is held out.

Parallelism (``--shard``): ``auto`` shards with FSDP2 (``fuselab.distributed.fully_shard_model``:
one unit per GPT2Block, bf16 parameters, fp32 gradient reduction) when there are several ranks;
on one rank the model is left whole (no FSDP copy-in/copy-out; bf16 autocast), as ``never``
does on any world size (DDP then). ``--compile`` compiles each block and the loss
(cross-entropy on bf16 logits in fp32, fused by inductor); ``--ac`` checkpoints each block's
activations; ``--activation relu`` runs fuselab's fused Linear+ReLU layers (``fuse_linear_relu``).

Throughput: steps are timed in windows of ``--log-every`` steps, synchronized at each end; the
first ``--timing-skip`` steps (compilation, autotuning, allocator warm-up) and any window with a
checkpoint save are left out. tokens/s is global; MFU is per GPU:

    FLOP per token = 6 N + 12 L d T    (PaLM, appendix B; nanoGPT's estimate_mfu)

N = parameters except the position embedding and the vocabulary's padding rows (the tied token
embedding counted once: it is the LM head's matmul), L layers, d = n_embd, T = sequence length
(attention's QK^T and AV, forward and backward, counted over the full T x T square, as those
references do, although a causal kernel skips about half). The peak is ``--peak-tflops`` per GPU:
989.4 TFLOP/s, the H200 SXM datasheet's dense BF16 tensor-core figure (1,979 with 2:4 sparsity).

    python -m experiments.train_fsdp --tiny --device cpu --steps 20                       # smoke run
    python -m experiments.train_fsdp --steps 300 --compile                                # 1.31B, one GPU
    torchrun --standalone --nproc_per_node=8 -m experiments.train_fsdp --steps 300 --compile
"""
import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import Tuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from experiments import data, harness
from experiments.training import (
    add_run_args,
    check_same_on_every_rank,
    decay_groups,
    finish_run_args,
    open_checkpointer,
    run_distributed,
    run_record,
    run_settings,
    training_run,
    warmup_cosine_schedule,
)
from fuselab import distributed as fd

STUDY = "train_fsdp"
# What defines a run (checked on --resume), --steps too (the cosine decays over it); the world size may change.
SETTINGS = ("n_embd", "n_layer", "n_head", "seq", "activation", "dropout", "vocab_multiple", "tiny", "lr",
            "min_lr_ratio", "warmup", "weight_decay", "clip", "seed", "precision", "corpus", "bpe", "max_tokens",
            "val_fraction", "steps")
H200_BF16_DENSE_TFLOPS = 989.4
GPT2_VOCAB = 50257
log = logging.getLogger("fuselab.train_fsdp")

TINY = dict(n_embd=64, n_layer=2, n_head=2, seq=64, batch=2, max_tokens=200_000)



def fraction(text: str) -> float:
    value = harness.positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


CPU_MAX_PARAMS = 200_000_000  # GPT-2 small (124M) trains on a CPU, slowly; the 1.31B default is refused there


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (default: the 1.31B configuration)")
    g.add_argument("--n-embd", type=harness.positive_int, default=2048)
    g.add_argument("--n-layer", type=harness.positive_int, default=24)
    g.add_argument("--n-head", type=harness.positive_int, default=16)
    g.add_argument("--seq", type=harness.positive_int, default=1024, help="tokens per sequence")
    g.add_argument("--activation", choices=("gelu", "relu"), default="gelu",
                   help="gelu: GPT-2's gelu_new; relu: fuselab's fused Linear+ReLU layers (fuse_linear_relu)")
    g.add_argument("--dropout", type=float, default=0.0, help="GPT-2's three dropout rates (default 0)")
    g.add_argument("--vocab-multiple", type=harness.positive_int, default=64,
                   help="pad the token embedding (the LM head) to a multiple of this many rows, as nanoGPT and "
                        "llm.c do, so the head's GEMMs get aligned shapes; the padded ids never occur (1: none)")
    g.add_argument("--tiny", action="store_true",
                   help="a CPU smoke size: n_embd 64, 2 layers, 2 heads, seq 64, batch 2, 200k tokens of text")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=harness.positive_int, default=300, help="optimizer steps in all (the schedule's "
                   "length: a resumed run keeps it)")
    g.add_argument("--batch", type=harness.positive_int, default=8, help="sequences per rank per micro-step")
    g.add_argument("--global-batch", type=harness.positive_int, default=None,
                   help="sequences per optimizer step over all ranks (default: batch x world size; a multiple of "
                        "it gives gradient accumulation)")
    g.add_argument("--lr", type=harness.positive_float, default=3e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay down to lr x this")
    g.add_argument("--warmup", type=harness.non_negative_int, default=30, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=harness.non_negative_float, default=0.1)
    g.add_argument("--clip", type=harness.non_negative_float, default=1.0, help="gradient-norm clip (0: none)")
    g = p.add_argument_group("speed and memory")
    g.add_argument("--shard", choices=("auto", "always", "never"), default="auto",
                   help="FSDP2: auto = when world size > 1; never = whole model (DDP on several ranks)")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="keep each block's gathered parameters from forward to backward (ZeRO-2 style)")
    g.add_argument("--compile", action="store_true", help="torch.compile each block and the loss")
    g.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                   help="with --compile: each block and the loss (default), or the whole forward and loss as one "
                        "graph (the embeddings, final norm and LM head fused too)")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode (e.g. max-autotune-no-cudagraphs)")
    g.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    g.add_argument("--no-tf32", dest="tf32", action="store_false", help="exact fp32 matmuls (default: tf32 allowed)")
    g.add_argument("--peak-tflops", type=harness.positive_float, default=None,
                   help=f"per-GPU peak for MFU (default on CUDA: {H200_BF16_DENSE_TFLOPS}, H200 dense BF16)")
    g = p.add_argument_group("data")
    g.add_argument("--corpus", type=Path, default=data.PYTHON_DOCS,
                   help="a folder of text files (GPT-2 BPE-encoded, cached) or a .pt tensor of token ids")
    g.add_argument("--bpe", type=Path, default=data.WHISPER_SDIST, help="whisper's sdist holding gpt2.tiktoken")
    g.add_argument("--max-tokens", type=harness.positive_int, default=None, help="use only the first N tokens")
    g.add_argument("--val-fraction", type=fraction, default=0.02, help="held-out tail of the corpus")
    g.add_argument("--val-batches", type=harness.non_negative_int, default=4,
                   help="global batches of held-out sequences for the final validation loss (0: none)")
    g.add_argument("--export-tokens", type=Path, default=None,
                   help="write the corpus's token ids (uint16 .pt) to this file and exit")
    add_run_args(p.add_argument_group("run: device, checkpoints, timing"), log_every=10, timing_skip=10,
                 checkpoint_every_help="steps between saves (0: only at the end)")
    harness.add_output_args(p)
    args = p.parse_args(argv)
    finish_run_args(p, args, STUDY, tiny=TINY, argv=argv)
    if args.compile_scope != "blocks" and not args.compile:
        p.error("--compile-scope takes effect with --compile only")
    if args.vocab_multiple > 1024:
        p.error(f"--vocab-multiple must be at most 1024 (GPT-2's 50,257 rows padded), got {args.vocab_multiple}")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.bpe != p.get_default("bpe") and not args.bpe.is_file():  # else unnoticed where the tokens are cached
        p.error(f"--bpe {args.bpe}: no such file (whisper's sdist holding gpt2.tiktoken)")
    if not 0 <= args.min_lr_ratio <= 1:
        p.error(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    params = 12 * args.n_layer * args.n_embd ** 2 + padded_vocab(args) * args.n_embd  # blocks, tied embedding
    if args.device == "cpu" and params > CPU_MAX_PARAMS:
        p.error(f"a {params / 1e9:.2f}B-parameter GPT-2 on the CPU would take minutes a step: add --tiny (or a "
                f"smaller --n-embd/--n-layer, up to {CPU_MAX_PARAMS / 1e6:.0f}M parameters), or run it on a GPU")
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = H200_BF16_DENSE_TFLOPS
    return args


# ----------------------------------------------------------------------------------------------
# Data: a token stream cut into windows, in a seeded order, addressed by position


def load_tokens(args) -> torch.Tensor:
    try:
        if args.corpus.suffix == ".pt" and args.corpus.is_file():
            ids = torch.load(args.corpus).flatten().long()
            return ids[:args.max_tokens] if args.max_tokens else ids
        return data.gpt2_tokens(args.corpus, args.bpe, max_tokens=args.max_tokens)
    except data.DataNotFound as e:
        raise SystemExit(str(e)) from None


class Windows:
    """Sequences ``seq`` + 1 tokens long; sample ``i`` of the infinite stream is window
    ``perm_e[i mod n]`` of epoch ``e = i div n``. A global step takes ``global_batch`` consecutive
    samples, so the position (samples seen) means the same at any world size."""

    def __init__(self, tokens: torch.Tensor, seq: int, seed: int):
        self.tokens, self.seq, self.seed = tokens, seq, seed
        self.n = (len(tokens) - 1) // seq
        if self.n < 1:
            raise SystemExit(f"{len(tokens)} tokens hold no window of {seq + 1}")
        self._perm = (None, None)

    def perm(self, epoch: int) -> torch.Tensor:
        if self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)))
        return self._perm[1]

    def rows(self, start: int, count: int) -> torch.Tensor:
        """(count, seq + 1) int64: samples start .. start + count - 1."""
        out = []
        for i in range(start, start + count):
            w = int(self.perm(i // self.n)[i % self.n])
            out.append(self.tokens[w * self.seq:(w + 1) * self.seq + 1])
        return torch.stack(out)


# ----------------------------------------------------------------------------------------------
# Model, optimizer, schedule


def build_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(vocab_size=padded_vocab(args), n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=args.n_head, activation_function="relu" if args.activation == "relu" else "gelu_new",
                     resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout, use_cache=False,
                     bos_token_id=data.GPT2_EOT, eos_token_id=data.GPT2_EOT)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)  # the same initial weights on every rank (FSDP shards them as they are)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    report = None
    if args.activation == "relu":
        from fuselab.nn import fuse_linear_relu

        model, report = fuse_linear_relu(model)
        if not report.fused:
            raise SystemExit(f"--activation relu: fuse_linear_relu fused nothing:\n{report}")
    return model, report


def count_params(model) -> int:
    """Parameters of the model as built (shared ones once)."""
    return sum(p.numel() for p in model.parameters())


def padded_vocab(args) -> int:
    return -(-GPT2_VOCAB // args.vocab_multiple) * args.vocab_multiple


def flops_per_token(n_params: int, args) -> float:
    # Without the position embedding (a lookup, no matmul) and the padding rows (no useful work).
    n = n_params - args.seq * args.n_embd - (padded_vocab(args) - GPT2_VOCAB) * args.n_embd
    return 6 * n + 12 * args.n_layer * args.n_embd * args.seq


def make_optimizer(model, args, device):
    opt = torch.optim.AdamW(decay_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    return opt, warmup_cosine_schedule(opt, args.warmup, args.steps, args.min_lr_ratio)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 (inductor fuses the upcast when compiled)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def variant_name(args, sharded: bool, world: int) -> str:
    parts = ["fsdp" if sharded else ("ddp" if world > 1 else "single")]
    if sharded and not args.reshard_after_forward:
        parts.append("no-reshard")
    if args.compile:
        parts.append(("compile-model" if args.compile_scope == "model" else "compile")
                     + (f"[{args.compile_mode}]" if args.compile_mode else ""))
    if padded_vocab(args) != GPT2_VOCAB:
        parts.append(f"vocab{padded_vocab(args)}")
    if args.ac:
        parts.append("ac")
    if args.activation == "relu":
        parts.append("fused-relu")
    return "+".join(parts)


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if args.export_tokens is not None:
        ids = load_tokens(args)
        args.export_tokens.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ids.to(torch.uint16), args.export_tokens)
        print(f"wrote {len(ids):,} token ids to {args.export_tokens}")
        return None
    return run_distributed(train, args)


def train(args, rt):
    device, world = rt.device, rt.world_size
    per_step = args.batch * world
    global_batch = args.global_batch or per_step
    if global_batch % per_step:
        raise SystemExit(f"--global-batch {global_batch} is not a multiple of --batch {args.batch} x "
                         f"{world} rank(s) = {per_step}")
    accum = global_batch // per_step
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if args.tf32 else "highest")
        torch.cuda.reset_peak_memory_stats()
    bf16 = args.precision == "bf16"
    sharded = args.shard == "always" or (args.shard == "auto" and world > 1)

    tokens = fd.rank_zero_first(lambda: load_tokens(args))  # tokenized and cached once per node
    n_val = max(args.seq + 1, int(len(tokens) * args.val_fraction))
    if len(tokens) - n_val < (args.seq + 1) * global_batch:
        raise SystemExit(f"{len(tokens):,} tokens are too few for a global batch of {global_batch} x {args.seq}")
    train_windows = Windows(tokens[:-n_val], args.seq, args.seed)
    val_windows = Windows(tokens[-n_val:], args.seq, args.seed)

    model, report = build_model(args, device)
    n_params = count_params(model)
    fpt = flops_per_token(n_params, args)
    if report is not None:
        log.info("%s", report)
    compile_options = {"mode": args.compile_mode} if args.compile_mode else {}
    compile_blocks = args.compile and args.compile_scope == "blocks"
    if sharded:
        fd.fully_shard_model(model, mixed_precision=bf16, activation_checkpointing=args.ac,
                             reshard_after_forward=args.reshard_after_forward, compile_blocks=compile_blocks,
                             compile_options=compile_options)
    else:
        fd.wrap_blocks(model, activation_checkpointing=args.ac, compile_blocks=compile_blocks,
                       compile_options=compile_options)
        model = fd.ddp_model(model)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and not sharded
                else contextlib.nullcontext())
    loss_fn = torch.compile(lm_loss, **compile_options) if compile_blocks else lm_loss
    opt, sched = make_optimizer(model, args, device)

    ckpt, state = None, None
    start, samples_seen = 0, 0
    settings = {**run_settings(args, SETTINGS), "global_batch": global_batch}  # at any world size, the same batch
    check_same_on_every_rank(settings)
    if args.checkpoint_dir is not None:
        ckpt = open_checkpointer(args, settings, log)
        if args.resume:
            try:
                state = ckpt.load(model, opt, sched)
            except RuntimeError as e:
                if "ize mismatch" not in str(e):
                    raise
                raise SystemExit(f"--resume: the checkpoint's model has other shapes than this one ({e}); the "
                                 f"model flags must match the saved run's, --vocab-multiple too (this run pads "
                                 f"the vocabulary to {padded_vocab(args):,} rows; before that flag checkpoints "
                                 f"had GPT-2's 50,257: --vocab-multiple 1)") from None
            if state is not None:
                start, samples_seen = state["step"], state["samples_seen"]
    if start >= args.steps:
        log.info("the checkpoint is at step %d >= --steps %d: nothing to train", start, args.steps)
    run_id = training_run(state)
    run = run_record(run_id, settings, state)  # what the results file records of this run

    variant = variant_name(args, sharded, world)
    shape = f"{world}x{args.batch}x{args.seq}" + (f" accum{accum}" if accum > 1 else "")
    size = f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.1f}M"
    op = f"gpt2-{size} (d{args.n_embd} L{args.n_layer} H{args.n_head})"
    log.info("%s: %s params, %s FLOP/token, global batch %d x %d tokens, %s, %s", op, f"{n_params:,}",
             f"{fpt:.3e}", global_batch, args.seq, variant, args.precision)
    keys = dict(op=op, provider=variant, shape=shape, dtype=args.precision, mode="wall")

    def micro_batch(sample0: int, a: int):
        rows = train_windows.rows(sample0 + (a * world + rt.rank) * args.batch, args.batch)
        rows = rows.pin_memory() if device.type == "cuda" else rows
        rows = rows.to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def forward_loss(x, y):
        with autocast:
            logits = model(input_ids=x).logits
        return loss_fn(logits, y)

    if args.compile and args.compile_scope == "model":
        forward_loss = torch.compile(forward_loss, **compile_options)

    losses, windows, val_loss = [], [], None
    bar = tqdm(total=args.steps, initial=start, desc=STUDY, disable=not rt.is_main, dynamic_ncols=True)
    window_loss = torch.zeros((), device=device)
    window_start, window_steps, window_dirty = None, 0, False
    model.train()
    for step in range(start + 1, args.steps + 1):
        if window_start is None:
            harness.sync(device)
            window_start, window_steps, window_dirty = time.perf_counter(), 0, step - start <= args.timing_skip
        sample0 = samples_seen
        for a in range(accum):
            last = a == accum - 1
            x, y = micro_batch(sample0, a)
            if sharded:
                if accum > 1:  # reduce-scatter once, after the last micro-batch
                    model.set_requires_gradient_sync(last)
                sync_ctx = contextlib.nullcontext()
            else:
                sync_ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
            with sync_ctx:
                loss = forward_loss(x, y) / accum
                loss.backward()
            window_loss += loss.detach()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        samples_seen += global_batch
        window_steps += 1
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = fd.all_reduce(window_loss.item() / window_steps)  # .item() synchronizes
            seconds = time.perf_counter() - window_start
            rate = window_steps * global_batch * args.seq / seconds
            losses.append((step, mean_loss))
            if not window_dirty:
                windows.append(rate)
            postfix = {"loss": f"{mean_loss:.3f}", "tok/s": f"{rate:,.0f}"}
            if args.peak_tflops:
                postfix["MFU"] = f"{100 * rate / world * fpt / (args.peak_tflops * 1e12):.1f}%"
            bar.set_postfix(postfix)
            window_loss.zero_()
            window_start = None
        if ckpt is not None and ((args.checkpoint_every and step % args.checkpoint_every == 0) or step == args.steps):
            ckpt.save(step, model, opt, sched, {"samples_seen": samples_seen, "global_batch": global_batch,
                                                "seq": args.seq, "tokens_seen": samples_seen * args.seq,
                                                "settings": settings, "training_run": run_id})
            window_dirty = True  # a window that spans a save is not timed
            if rt.is_main:  # the results so far beside each checkpoint: a part that is killed keeps them
                report_results(args, rt, windows, losses, None, None, None, keys, n_params, fpt, global_batch,
                               run, partial=True)
    bar.close()
    if ckpt is not None:
        ckpt.close()

    if args.val_batches and start < args.steps:
        val_loss = evaluate(model, val_windows, args, rt, forward_loss, global_batch)  # (loss, sequences)
    peak_mib = fd.all_reduce(harness.peak_memory_mib(device) or 0.0, "max") if device.type == "cuda" else None
    reserved_mib = (fd.all_reduce(torch.cuda.max_memory_reserved() / 2**20, "max")
                    if device.type == "cuda" else None)
    if not rt.is_main:
        return None
    if start >= args.steps:  # a resume of a finished run measured nothing: the results of the run it resumed stay
        log.warning("nothing was trained: %s left as it was", harness.output_path(args, STUDY))
        return []
    return report_results(args, rt, windows, losses, val_loss, peak_mib, reserved_mib, keys, n_params, fpt,
                          global_batch, run)


@torch.no_grad()
def evaluate(model, windows: Windows, args, rt, forward_loss, global_batch: int) -> Tuple[float, int]:
    """Mean loss over the first ``--val-batches`` x global batch held-out sequences, in eval mode (no dropout): for
    one global batch, the same sequences at any world size and micro-batch; each rank a contiguous share, in
    micro-batches of ``--batch``. At most every held-out window once (more would count some twice, unevenly)."""
    count = min(args.val_batches * global_batch, windows.n)
    if count < args.val_batches * global_batch and rt.is_main:
        log.warning("--val-batches %d x global batch %d asks for %d held-out sequences; the held-out split has %d "
                    "windows of %d tokens: the validation loss is over those, each once (raise --val-fraction for "
                    "more)", args.val_batches, global_batch, args.val_batches * global_batch, windows.n, args.seq + 1)
    share = range(rt.rank * count // rt.world_size, (rt.rank + 1) * count // rt.world_size)
    total = 0.0
    model.eval()
    try:
        for start in range(share.start, share.stop, args.batch):
            rows = windows.rows(start, min(args.batch, share.stop - start)).to(rt.device)
            total += forward_loss(rows[:, :-1], rows[:, 1:]).item() * len(rows)  # the loss is a mean over rows
    finally:
        model.train()
    return fd.all_reduce(total, "sum") / count, count


def report_results(args, rt, windows, losses, val_loss, peak_mib, reserved_mib, keys, n_params, fpt, global_batch,
                   run: dict, partial: bool = False):
    """Save (and, unless ``partial``: at a checkpoint, print) the results of this part of the run."""
    results = harness.Results(STUDY, device=args.device)
    results.annotate(**run)
    extra = dict(world_size=rt.world_size, params=n_params, flops_per_token=fpt, global_batch=global_batch,
                 seq=args.seq, vocab=padded_vocab(args),
                 flop_formula="6*N + 12*L*d*T per token (N without the position embedding and vocabulary padding)")
    rows = {}
    if not windows:
        if not partial:
            log.warning("no timed window (all within --timing-skip %d or spanning checkpoints): no throughput",
                        args.timing_skip)
    else:
        tps = harness.Timing.of(windows)
        per_gpu = harness.Timing(*(v / rt.world_size for v in (tps.p20, tps.p50, tps.p80)))
        results.record(metric="tokens/s", value=tps, windows=len(windows), **keys, **extra)
        results.record(metric="tokens/s per GPU", value=per_gpu, **keys, **extra)
        tflops = harness.Timing(*(v * fpt / 1e12 for v in (per_gpu.p20, per_gpu.p50, per_gpu.p80)))
        results.record(metric="TFLOP/s per GPU", value=tflops, **keys, **extra)
        rows.update({"tokens/s": tps.p50, "tokens/s per GPU": per_gpu.p50, "TFLOP/s per GPU": tflops.p50})
        if args.peak_tflops:
            mfu = harness.Timing(*(100 * v / args.peak_tflops for v in (tflops.p20, tflops.p50, tflops.p80)))
            results.record(metric="MFU %", value=mfu, peak_tflops=args.peak_tflops, **keys, **extra)
            rows["MFU %"] = mfu.p50
        results.record(metric="step ms", value=harness.Timing(*(global_batch * args.seq / v * 1e3
                                                                for v in (tps.p80, tps.p50, tps.p20))),
                       **keys, **extra)
    for step, loss in losses:
        results.record(metric="loss", value=loss, step=step, tokens=step * global_batch * args.seq, **keys)
    if losses:
        rows["final loss"] = losses[-1][1]
    if val_loss is not None:
        results.record(metric="val loss", value=val_loss[0], sequences=val_loss[1], **keys)
        rows["val loss"] = val_loss[0]
    if peak_mib is not None:
        results.record(metric="peak MiB", value=peak_mib, **keys, **extra)
        results.record(metric="peak reserved MiB", value=reserved_mib, **keys, **extra)
        rows["peak MiB"] = peak_mib
    path = harness.output_path(args, STUDY)
    if partial:
        results.save(path, merge=args.merge)
        return results.rows
    print(harness.markdown_table(["op", "provider", "shape", *rows],
                                 [[keys["op"], keys["provider"], keys["shape"], *rows.values()]]))
    print(f"FLOP/token = 6N + 12 L d T = {fpt:.4e} (N: {n_params:,} parameters less the position embedding "
          "and vocabulary padding); "
          + (f"MFU against {args.peak_tflops} TFLOP/s per GPU" if args.peak_tflops else "no MFU (no peak given)"))
    print(f"saved {results.save(path, merge=args.merge)}")
    return results.rows


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
