"""The one benchmark harness every fuselab experiment uses: timing, providers, results as data.

Timing (``time_call``), in one of four modes, always as p20/p50/p80 milliseconds:

    eager  ``triton.testing.do_bench``: CUDA events, L2 flushed (a 256 MB memset) before every call; the
           call's host time overlaps that memset on the GPU, so only host time beyond it shows
    graph  ``triton.testing.do_bench_cudagraph``: the same call replayed from a CUDA graph (kernel
           time without the host's per-call cost); rotate inputs (``cycle``) to keep L2 cold
    wall   a ``perf_counter`` loop that synchronizes after every call (whole training steps, CPU runs)
    host   a ``perf_counter`` loop that never synchronizes: the host's time to enqueue one call

Providers: a ``Providers`` registry per study, one marked ``baseline`` (tritonbench's
``register_benchmark(baseline=True)``): a new peer is one function.

Results (``fuselab/_results.py``, shared with ``python -m fuselab.tune``): rows in long format, one a measurement::

    {study, op, provider, shape, dtype, mode, metric, p20, p50, p80, run}

where ``run`` names an entry of ``runs``: the environment it was measured in (GPU, driver,
torch, triton, CUDA, commit, a ``dirty`` flag, date). What could not be measured (out of memory, a
compiler error, a call a CUDA graph cannot capture) goes to ``failed`` through ``Results.fail``.
Ratios between providers are computed when reporting (``experiments/report.py``), never stored.
``save`` writes atomically, to ``runs/`` (not committed) unless the script was asked to write the
committed ``results/`` (``--results``).
"""
import argparse
import collections
import itertools
import math
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from fuselab._io import non_negative_float, non_negative_int, positive_float, positive_int  # noqa: F401  (the scripts' argparse types)
from fuselab._results import FAILURE_KEYS, QUANTILES, ROW_KEYS, Results, Timing, environment  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"  # committed: written only when asked (--results)
RUNS = ROOT / "runs"  # everything else (ignored by git)
MODES = ("eager", "graph", "wall", "host")


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def sync(device: Optional[torch.device] = None) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], mode: str = "eager", *, warmup_ms: float = 25, rep_ms: float = 100,
              iters: Optional[int] = None, warmup_iters: int = 3,
              grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> Timing:
    """Time ``fn()`` in ``mode`` (see the module docstring); ``fn`` is called once first, outside
    the timing (autotuning, compilation). ``iters`` sets the sample count of wall/host modes.
    ``grad_to_none``: tensors whose ``.grad`` is reset before each call (a backward then writes its
    gradients instead of accumulating into them), outside the timed region where the mode allows."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode in ("eager", "graph") and not torch.cuda.is_available():
        raise RuntimeError(f"timing mode {mode!r} needs a CUDA device; use 'wall' on a CPU")
    fn()
    sync()
    if mode == "eager":
        import triton

        return Timing(*triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                                quantiles=list(QUANTILES)))
    if mode == "graph":
        import triton

        return Timing(*triton.testing.do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=grad_to_none,
                                                         quantiles=list(QUANTILES)))
    if grad_to_none is not None:
        call = fn

        def fn():
            for t in grad_to_none:
                t.grad = None
            return call()

    for _ in range(warmup_iters):
        fn()
    sync()
    if iters is None:  # enough samples for ~rep_ms of work, at least 10
        t0 = time.perf_counter()
        fn()
        sync()
        iters = max(10, min(10_000, int(rep_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    if mode == "wall":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - t0) * 1e3)
        return Timing.of(samples)
    # host: batches of calls, never waiting for the device inside a batch; iters calls in all (10 batches at most)
    n_batches = min(10, iters)
    batch = max(1, iters // n_batches)
    samples = []
    for _ in range(n_batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / batch)
        sync()
    return Timing.of(samples)


def time_alternating(fns: Dict[str, Callable[[], object]], mode: str, rounds: int,
                     **time_kwargs) -> Dict[str, Tuple[Timing, List[float]]]:
    """``time_call`` of each of ``fns`` in ``rounds`` rounds, taking turns (the order reversed every
    other round): name -> (each quantile's median over the rounds, every round's p50). These hosts
    drift by 10-40% within seconds, so peers timed one after another would compare drifts; timed in
    turns, they share them."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    per_round: Dict[str, List[Timing]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            per_round[name].append(time_call(fns[name], mode, **time_kwargs))
    return {name: (Timing(*(statistics.median(getattr(t, q) for t in ts) for q in ("p20", "p50", "p80"))),
                   [t.p50 for t in ts]) for name, ts in per_round.items()}


def cycle(fn: Callable, arg_sets: Sequence[tuple]) -> Callable[[], object]:
    """``fn(*args)`` over ``arg_sets`` in turn: inputs that together exceed L2 keep it cold, also
    inside a captured CUDA graph (each captured call binds the next set)."""
    sets = itertools.cycle(arg_sets)
    return lambda: fn(*next(sets))


def time_first_call(fn: Callable[[], object]) -> float:
    """Seconds from calling ``fn()`` to the device finishing it: a first call's compile and tune time."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def rotating(make: Callable[[], tuple], min_bytes: int = 2**28, max_sets: int = 64) -> List[tuple]:
    """Argument sets from ``make()`` (each a tuple of tensors, fresh random data) until together they
    hold ``min_bytes`` (256 MiB: several times any L2), at most ``max_sets``: ``cycle`` over them
    keeps L2 cold, also under a CUDA graph."""
    sets = [make()]
    size = sum(t.numel() * t.element_size() for t in sets[0] if isinstance(t, torch.Tensor))
    while len(sets) < max_sets and size * len(sets) < min_bytes:
        sets.append(make())
    return sets


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are 0)."""
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    num = (out - ref).norm().item()
    return num / denom if denom else num


def peak_memory_mib(device: Optional[torch.device] = None) -> Optional[float]:
    """Peak allocated CUDA memory since the last ``torch.cuda.reset_peak_memory_stats``; None on a CPU."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def copy_bandwidth_gbs() -> float:
    """Measured device-to-device copy bandwidth (bytes read + written), the bytes floor's ceiling."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = time_call(lambda: dst.copy_(src)).p50
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


class Providers:
    """Named implementations of one operation, one of them the baseline ratios are taken against.

        providers = Providers()

        @providers.register("cuBLASLt", baseline=True)
        def cublaslt(a, b, bias): ...
    """

    def __init__(self):
        self.fns: Dict[str, Callable] = {}
        self.baseline: Optional[str] = None

    def register(self, name: str, *, baseline: bool = False) -> Callable:
        def add(fn):
            if name in self.fns:
                raise ValueError(f"provider {name!r} registered twice")
            if baseline:
                if self.baseline is not None:
                    raise ValueError(f"two baselines: {self.baseline!r} and {name!r}")
                self.baseline = name
            self.fns[name] = fn
            return fn

        return add

    def select(self, names: Optional[Iterable[str]]) -> Dict[str, Callable]:
        """The providers named (all when None); an unknown name is an error that lists the known ones."""
        if names is None:
            return dict(self.fns)
        unknown = [n for n in names if n not in self.fns]
        if unknown:
            raise ValueError(f"unknown provider(s) {unknown}; known: {list(self.fns)}")
        return {n: self.fns[n] for n in names}


# ----------------------------------------------------------------------------------------------
# Command lines (the argparse types positive_int, positive_float, non_negative_int, non_negative_float: fuselab._io's)
# ----------------------------------------------------------------------------------------------


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--out`` (a file; default runs/<study>.json) and ``--results`` (write the committed
    results/<study>.json instead; ``--merge`` keeps rows of earlier runs there)."""
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON to write (default: runs/<study>.json, not committed)")
    parser.add_argument("--results", action="store_true",
                        help="merge into the committed results/<study>.json that the docs are generated from")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows already in the output file that this run does not measure again "
                             "(rows measured on another type of device, a GPU's beside a CPU run's, are kept); "
                             "--results always merges")


def output_path(args: argparse.Namespace, study: str, *, smoke: Optional[str] = None) -> Path:
    """Where the results go; SystemExit, before the work, for exclusive flags, an --out that is a folder, a smoke
    run (``smoke``: the flag that makes it one, e.g. "--tiny", the default) bound for results/, and a file of
    another study to merge into. The committed results/ is only ever merged into (``args.merge`` set): a row
    there goes when the same labels are measured again (or fail), never because a run, a partial one (--quick,
    a budget, an interrupt) or one on another device, did not measure it. An --out into results/ is held to the
    same rules."""
    if args.out is not None and args.results:
        raise SystemExit("--out and --results are exclusive")
    if args.out is not None and args.out.is_dir():
        raise SystemExit(f"--out {args.out} is a folder: give the results file's path (e.g. {args.out / study}.json)")
    into_results = args.results or (args.out is not None and in_results(args.out))  # --out results/x.json too
    smoke = smoke or ("--tiny" if getattr(args, "tiny", False) else None)
    if smoke and into_results:  # its rows carry the real runs' labels: they would replace them
        raise SystemExit(f"{smoke} is a smoke run: its numbers do not go into results/ (drop --results, or give an "
                         f"--out outside results/)")
    if into_results:
        args.merge = True
    path = args.out if args.out is not None else (RESULTS if args.results else RUNS) / f"{study}.json"
    if getattr(args, "merge", False) and path.exists():  # a file it cannot merge into: said before the work
        try:
            held = Results.load(path).study
        except ValueError as e:
            raise SystemExit(f"--merge: {e}") from None
        if held != study:
            raise SystemExit(f"--merge: {path} holds study {held!r}, not {study!r}")
    return path


def in_results(path: Path) -> bool:
    """Whether ``path`` is a file of the committed results/ (written there only by merging, smoke runs never)."""
    return path.resolve().parent == RESULTS.resolve()


def shape_dims(name: str) -> Tuple[int, int, int]:
    """(M, N, K) of a GEMM shape name, from its last word ``MxNxK``: ``"decode-16 16x11008x4096"`` is
    (16, 11008, 4096). Y is M x N, the reduction is K. A name that does not end so raises ValueError."""
    dims = name.split()[-1].split("x") if name.split() else []
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"shape {name!r} does not end in MxNxK (three positive integers)")
    M, N, K = (int(d) for d in dims)
    return M, N, K


def require_cuda(what: str) -> None:
    """Exit at once, before any work, when a GPU-only measurement is asked for on a machine without one."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA GPU (none found); run it on a GPU machine")


def parse_device(p: argparse.ArgumentParser, text: str, study: str) -> torch.device:
    """``--device``'s value as a device: a parser error when torch cannot read it or it is neither a CPU
    nor a CUDA device (the studies measure those two), and ``require_cuda``'s exit for a CUDA device on a
    machine without one."""
    try:
        device = torch.device(text)
    except RuntimeError as e:
        p.error(f"--device {text!r}: {e}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {text!r}: {study} runs on 'cpu' or 'cuda' devices, not {device.type!r}")
    if device.type == "cuda":
        require_cuda(f"{study} --device cuda")
    return device


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.2e}" if value and abs(value) < 0.01 else f"{value:.2f}"
    return "" if value is None else str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pivot_rows(rows: List[dict], index: Sequence[str], column: str = "provider", stat: str = "p50",
               baseline: Optional[str] = None, higher_is_better: bool = False):
    """``pivot``'s table as data: (header, lines), lines holding numbers (None: not measured)."""
    keys = list(dict.fromkeys(tuple(r[k] for k in index) for r in rows))
    cols = list(dict.fromkeys(r[column] for r in rows))
    cell = {(tuple(r[k] for k in index), r[column]): r[stat] for r in rows}
    ratio_cols = [c for c in cols if baseline is not None and c != baseline and baseline in cols]
    header = list(index) + cols + [f"{c} x {baseline}" for c in ratio_cols]
    out = []
    for key in keys:
        line = list(key) + [cell.get((key, c)) for c in cols]
        base = cell.get((key, baseline))
        for c in ratio_cols:
            v = cell.get((key, c))
            if v is None or not base or (not v and not higher_is_better):
                line.append(None)
            else:
                line.append(v / base if higher_is_better else base / v)
        out.append(line)
    return header, out


def pivot(rows: List[dict], index: Sequence[str], column: str = "provider", stat: str = "p50",
          baseline: Optional[str] = None, higher_is_better: bool = False) -> str:
    """A markdown table: one line per distinct ``index`` tuple, one column per ``column`` value,
    cells the ``stat``; with a ``baseline`` column value, an ``x <baseline>`` column per other value
    (speed relative to the baseline: above 1 is better, whichever way the metric runs)."""
    return markdown_table(*pivot_rows(rows, index, column, stat, baseline, higher_is_better))


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def profile_steps(step: Callable[[], object], steps: int = 3):
    """A ``torch.profiler`` profile (CPU, and CUDA where there is one) of ``steps`` calls of ``step``,
    after one unprofiled call (first-call work left out)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    return prof


def kernel_table(step: Callable[[], object], steps: int = 3, top: int = 15) -> str:
    """Where the time of a call of ``step`` goes, as a markdown table: its ``top`` GPU kernels by device
    time (on a machine without a GPU, its operators by self CPU time), calls and microseconds per call."""
    from torch.autograd import DeviceType

    prof = profile_steps(step, steps)
    totals: Dict[str, List[float]] = {}
    if torch.cuda.is_available():
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == DeviceType.CUDA:
                total = totals.setdefault(e.name(), [0, 0.0])
                total[0] += 1
                total[1] += e.duration_ns() / 1e3
    else:
        totals = {e.key: [e.count, e.self_cpu_time_total] for e in prof.key_averages()}
    whole = sum(us for _, us in totals.values()) or 1.0
    lines = [[name[:90], f"{calls / steps:g}", f"{us / steps:,.1f}", f"{100 * us / whole:.1f}"]
             for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]]
    what = "kernel" if torch.cuda.is_available() else "operator (self CPU time)"
    return markdown_table([what, "calls per call", "us per call", "% of the total"], lines)


def gpu_timeline(step, steps: int = 3):
    """(busy ms per step, idle ms per step, {kernel name: [gaps before it, total gap us]}) from a
    profiler trace of ``steps`` steps: idle is the GPU span minus the union of its intervals."""
    from torch.autograd import DeviceType

    prof = profile_steps(step, steps)
    events = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                    for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA)
    if not events:
        return 0.0, 0.0, {}
    busy, gaps = 0, collections.defaultdict(lambda: [0, 0.0])
    cur_start, cur_end = events[0][:2]
    for start, end, name in events[1:]:
        if start > cur_end:  # a gap: the GPU had nothing to run until this launch
            busy += cur_end - cur_start
            if start - cur_end > 20_000:
                gaps[name][0] += 1
                gaps[name][1] += (start - cur_end) / 1e3
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - events[0][0]
    return busy / 1e6 / steps, (span - busy) / 1e6 / steps, dict(gaps)


def timeline_summary(busy: float, idle: float, gaps: dict, top: int = 4) -> str:
    """``gpu_timeline``'s figures as a line: busy and idle ms a step, the launches the GPU waited longest for."""
    longest = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]
    return (f"GPU busy {busy:.3f} ms, idle {idle:.3f} ms a step; longest waits before: "
            + ("; ".join(f"{name[:60]} x{count} {us:.0f} us" for name, (count, us) in longest) or "none"))


def synchronizing_calls(step, stacks: bool = False):
    """(count, [stack summaries]) of the calls in one step that made the host wait for the GPU (none
    without a GPU)."""
    step()
    sync()
    if not torch.cuda.is_available():
        return 0, []
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            found.append("".join(traceback.format_stack(limit=12)[:-1]) if stacks else str(message))

    saved = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = saved
    sync()
    return len(found), found


def step_diagnosis(step: Callable[[], object], steps: int = 20) -> str:
    """Why an eager call of ``step`` takes what it takes, as a line: the GPU's busy and idle time in a profiled
    call, the calls that wait for the GPU, and the allocator's cudaMalloc calls a call (each can stall the host)."""
    busy, idle, gaps = gpu_timeline(step, steps=5)
    syncs, _ = synchronizing_calls(step)

    def device_allocs() -> int:
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0

    before = device_allocs()
    for _ in range(steps):
        step()
    sync()
    allocs = (device_allocs() - before) / steps
    return f"{timeline_summary(busy, idle, gaps)}; {syncs} synchronizing calls a step; {allocs:g} cudaMalloc a step"


def tuned_choice(call: Callable[[], object], kernel_name: str) -> Optional[str]:
    """The autotuner's choice for the launch that ``call`` makes of fuselab's Triton kernel
    ``kernel_name`` (None if none is found). ``call`` runs once with every launch plan forgotten, so it
    goes through the tuner: a planned launch skips it and would leave ``best_config`` at whichever
    key was tuned last."""
    from triton.runtime.autotuner import Autotuner

    from fuselab.kernels import _runtime

    kernels = list({id(k): k for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("fuselab.")
                    for k in [getattr(m, kernel_name, None)] if isinstance(k, Autotuner)}.values())
    for kernel in kernels:  # a call that never reaches the tuner (an empty input, a fallback) names none
        kernel.best_config = None
    _runtime.forget_plans()
    call()
    best = [k.best_config for k in kernels if k.best_config is not None]
    return str(best[0]) if best else None

