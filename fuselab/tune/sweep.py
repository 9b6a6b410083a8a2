"""The sweep: every pruned config of every tuning key the grid's problems launch, timed and kept.

``sweep()`` runs in three steps:

1. plan: each problem's ops run on uninitialized tensors with the kernel's launcher swapped for a
   recorder (``kernels.recording``); what is left to time is every (kernel, key, config) not already in
   the results file (``--resume``), each key once however many problems launch it;
2. precompile: the kernels those configs need compile in ``jobs`` worker processes into Triton's disk
   cache (compiling, not timing, is what a fresh sweep mostly waits for); what they miss compiles when
   first timed;
3. time: per problem, on random inputs, each config by ``triton.testing.do_bench`` (CUDA events, L2
   cleared before every call: the harness's ``eager`` mode), and the problem's baseline (cuBLASLt), the
   results file rewritten atomically after each problem. Under the Triton interpreter (``--dry-run``)
   each config runs once under a wall clock (mode ``wall``): it checks the machinery, not the speed.

Rows (study ``tune``): op ``<product> <layout>`` (``fwd linear``, ``grad_b matmul``), provider the
config's short name or the baseline's, shape the problem's ``MxNxK``, metric ``ms``, with extra keys
``kernel``, ``key`` (the tuning key's repr, as in the cache files), ``config`` (``str(config)``),
``product``, ``layout``, ``gemm`` (the launch's own MxNxK) and ``flops``. The best config of each key
(lowest median) is derived from the rows: ``best_choices``, which ``--write-configs`` ships.
"""
import contextlib
import math
import multiprocessing
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import triton

from fuselab._results import Results, environment
from fuselab.kernels import _autotune
from fuselab.tune.grid import Problem
from fuselab.tune.kernels import KERNELS, Launch, device

STUDY = "tune"
QUANTILES = (0.2, 0.5, 0.8)


class SweepError(RuntimeError):
    """A sweep that cannot start or continue; the message says why and what to do."""


def short_name(config: triton.Config) -> str:
    """``128x256x64 s3 w8 tma`` for a GEMM config (its BLOCK_M/N/K, stages, warps, flags), else ``str``."""
    kw = config.kwargs
    if not all(k in kw for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")):
        return str(config)
    flags = [k.lower() for k, v in kw.items() if v is True]
    return " ".join([f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}", f"s{config.num_stages}",
                     f"w{config.num_warps}"] + flags)


def measure(fn: Callable[[], object], mode: str, warmup_ms: float, rep_ms: float,
            config: Optional[triton.Config] = None) -> Tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of ``fn()``: ``eager`` by do_bench, ``wall`` one call, synchronized.
    ``config``: the choice ``fn`` runs, timed by the tuner's rule (``issue_bound``: a library call's host time);
    the baselines (no ``config``) are GPU time alone, the reference a kernel's speed is judged against."""
    if mode == "eager":
        timings = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
        return tuple(_autotune.issue_bound(config, fn, timings))
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, ms, ms


class _Lines:
    """tqdm's interface, printed as a line every 10 s where tqdm is not installed (an optional dependency)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.t0, self.last, self.note = total, desc, 0, time.monotonic(), 0.0, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= 10 or self.n >= self.total:
            self.last = now
            left = (now - self.t0) / self.n * (self.total - self.n) if self.n else float("nan")
            print(f"{self.desc}: {self.n}/{self.total}, ~{left / 60:.1f} min left {self.note}", file=sys.stderr)

    def set_postfix_str(self, note: str) -> None:
        self.note = note

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "cfg"):
    """A progress bar with the time left (tqdm's ``elapsed<remaining``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc)
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, smoothing=0.05)


# ----------------------------------------------------------------------------------------------
# What is done, what is left
# ----------------------------------------------------------------------------------------------


def op_name(launch: Launch, problem: Problem) -> str:
    return f"{launch.product} {problem.layout}"


def done_configs(results: Results, entries: Optional[List[dict]] = None) -> Set[Tuple[str, str, str]]:
    """(kernel, key, config) already timed, or failed, in ``results`` (or among ``entries`` of it)."""
    entries = results.rows + results.failed if entries is None else entries
    return {(r["kernel"], r["key"], r["config"]) for r in entries if "config" in r}


def done_baselines(results: Results, entries: Optional[List[dict]] = None) -> Set[Tuple[str, str, str]]:
    """(op, shape, dtype) whose baseline was timed (or failed) in ``results`` (or among ``entries`` of it)."""
    entries = results.rows + results.failed if entries is None else entries
    return {(r["op"], r["shape"], r["dtype"]) for r in entries
            if "config" not in r and results.baselines.get(r["op"]) == r["provider"]}


@dataclass
class Retry:
    """``--retry-failed``: the failures a resume times again. Each stays recorded until timed anew (a budget stop
    or an interrupt keeps the rest for a later resume)."""
    configs: Set[Tuple[str, str, str]] = field(default_factory=set)
    baselines: Set[Tuple[str, str, str]] = field(default_factory=set)

    @classmethod
    def of(cls, results: Results) -> "Retry":
        return cls(done_configs(results, results.failed), done_baselines(results, results.failed))

    def take(self, results: Results, config: Optional[Tuple[str, str, str]] = None,
             baseline: Optional[Tuple[str, str, str]] = None) -> None:
        """Before timing ``config`` or ``baseline`` again: its old failure entry goes."""
        if config in self.configs:
            self.configs.discard(config)
            results.failed = [f for f in results.failed if (f.get("kernel"), f.get("key"), f.get("config")) != config]
        if baseline in self.baselines:
            self.baselines.discard(baseline)
            results.failed = [f for f in results.failed
                              if "config" in f or (f["op"], f["shape"], f["dtype"]) != baseline]


@dataclass
class Planned:
    """What is left to measure for one problem, found by recording its launches."""
    problem: Problem
    configs: int = 0  # configs to time
    baselines: int = 0
    kinds: Dict[tuple, Tuple[str, Set[str]]] = field(default_factory=dict)  # kind -> (product, config names)


def _kind(launch: Launch) -> tuple:
    """What Triton compiles a kernel for besides the config: the key without its sizes, the constexpr
    flags, and each integer argument's divisibility by 16 (Triton specializes on it)."""
    names = launch.tuner.keys
    flags = tuple(v for n, v in zip(names, launch.key) if not n.endswith("_BUCKET")) + launch.key[len(names):]
    ints = tuple((a % 16 == 0, a == 1) for a in launch.args if isinstance(a, int) and not isinstance(a, bool))
    const = tuple(sorted((k, v) for k, v in launch.kwargs.items()
                         if k not in ("grid", "warmup") and isinstance(v, (bool, int, str))))
    return launch.kernel, flags, ints, const


def plan(problems: List[Problem], results: Results, retry: Optional[Retry] = None) -> List[Planned]:
    """Each problem's work left, in order; a (kernel, key) goes to the first problem that launches it."""
    retry = retry or Retry()
    taken = done_configs(results) - retry.configs
    baselines = done_baselines(results) - retry.baselines
    out = []
    for problem in problems:
        entry = KERNELS[problem.kernel]
        item = Planned(problem)
        with entry.context(problem):
            launches = entry.launches(problem, device(), torch.empty, execute=False)
        for launch in launches:
            key = repr(launch.key)
            todo = [c for c in launch.configs if (launch.kernel, key, str(c)) not in taken]
            taken |= {(launch.kernel, key, str(c)) for c in todo}
            item.configs += len(todo)
            if todo:
                product, names = item.kinds.setdefault(_kind(launch), (launch.product, set()))
                names |= {str(c) for c in todo}
            base = (op_name(launch, problem), problem.shape, problem.dtype)
            if base not in baselines:
                baselines.add(base)
                item.baselines += 1
        out.append(item)
    return out


# ----------------------------------------------------------------------------------------------
# Precompiling in worker processes
# ----------------------------------------------------------------------------------------------


def _precompile_task(problem: Problem, product: str, names: List[str]) -> Tuple[int, List[str]]:
    """In a worker: compile ``names`` (config strings) for ``problem``'s ``product`` launch."""
    entry = KERNELS[problem.kernel]
    with entry.context(problem):
        launches = entry.launches(problem, device(), torch.empty, execute=False)
    launch = next(launch for launch in launches if launch.product == product)
    by_name = {str(c): c for c in launch.configs}  # the launch's candidates: its pruned configs, library choices
    errors = []
    for name in names:
        config = by_name.get(name)
        try:
            if config is None:
                raise KeyError(f"not among {launch.kernel}'s configs")
            launch.precompile(config)
        except Exception as e:  # noqa: BLE001  timed (and recorded as failed) later in the main process
            first = (str(e).splitlines() or [""])[0][:200]
            errors.append(f"{short_name(config) if config else name}: {type(e).__name__}: {first}")
    return len(names), errors


def precompile_tasks(planned: List[Planned]) -> List[Tuple[Problem, str, List[str]]]:
    """(problem, product, config names): each config of a kind of launch compiled once, with a problem
    whose launch lists it (pruning is per shape: a kind's small-M configs exist for small M only)."""
    owner: Dict[tuple, Dict[str, Tuple[Problem, str]]] = {}
    for item in planned:
        for kind, (product, names) in item.kinds.items():
            for name in names:
                owner.setdefault(kind, {}).setdefault(name, (item.problem, product))
    tasks: Dict[tuple, Tuple[Problem, str, List[str]]] = {}
    for kind, names in owner.items():
        for name, (problem, product) in names.items():
            tasks.setdefault((kind, problem), (problem, product, []))[2].append(name)
    return [(problem, product, sorted(names)) for problem, product, names in tasks.values()]


def precompile(planned: List[Planned], jobs: int) -> None:
    """Compile what ``planned`` will time (``precompile_tasks``) in ``jobs`` processes."""
    tasks = precompile_tasks(planned)
    total = sum(len(names) for _, _, names in tasks)
    if jobs < 1 or total == 0:
        return
    bar = progress(total, f"compiling ({jobs} processes)")
    errors: List[str] = []
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_precompile_task, p, product, names) for p, product, names in tasks]
            for future in as_completed(futures):
                try:
                    n, errs = future.result()
                except Exception as e:  # noqa: BLE001  a worker that died: its kernels compile when timed
                    n, errs = 0, [f"{type(e).__name__}: {e}"]
                bar.update(n)
                errors += errs
    except Exception as e:  # noqa: BLE001  no pool at all: everything compiles when timed
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        bar.close()
    if errors:
        print(f"precompile: {len(errors)} configs did not compile ahead (they are tried when timed), "
              f"first: {errors[0]}", file=sys.stderr)


def prepare(planned: List[Planned], jobs: int) -> None:
    """On a GPU: scratch memory for the TMA descriptors kernels build on the device, then ``precompile``."""
    if device() == "cuda":
        from fuselab.kernels._runtime import _scratch_allocator

        triton.set_allocator(_scratch_allocator)
        precompile(planned, jobs)


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


@dataclass
class Options:
    mode: str = "eager"  # eager (do_bench, GPU) or wall (--dry-run, interpreter)
    warmup_ms: float = 5
    rep_ms: float = 25
    budget_s: Optional[float] = None
    jobs: int = 0
    commit: Optional[str] = None
    dirty: Optional[bool] = None
    grid: str = ""
    quiet: bool = False
    retry_failed: bool = False  # a resume times again what failed before (a timeout, another process's memory)


@dataclass
class Outcome:
    path: Path
    results: Results
    timed: int  # configs timed by this call
    left: int  # configs and baselines left for a --resume (0: the sweep is complete)


def fingerprints() -> Dict[str, str]:
    """Each tuned kernel's fingerprint, by its name (the JIT function's, as in rows and configs files)."""
    return {entry.tuner().base_fn.__name__: entry.tuner().fingerprint for entry in KERNELS.values()}


def _check_resumable(results: Results, env: dict, prints: Dict[str, str], path: Path) -> None:
    if results.study != STUDY:
        raise SweepError(f"{path} holds study {results.study!r}, not a sweep ({STUDY!r}): choose another --out")
    for run in results.runs.values():
        if (run.get("gpu"), run.get("triton")) != (env["gpu"], env["triton"]):
            raise SweepError(f"{path} was measured on {run.get('gpu')} with triton {run.get('triton')}, this is "
                             f"{env['gpu']} with triton {env['triton']}: resume it there, or start a new --out")
        for name, fp in run.get("fingerprints", {}).items():
            if prints.get(name, fp) != fp:
                raise SweepError(f"{path} timed another version of {name} (fingerprint {fp}, now {prints[name]}): "
                                 f"its choices do not apply; start over with --overwrite or another --out")
        changed = [f"{k} {run[k]!r} -> {env[k]!r}" for k in ("grid", "mode", "warmup_ms", "rep_ms")
                   if k in run and run[k] != env[k]]
        if changed:  # rows timed two ways would be compared as one sweep's
            raise SweepError(f"{path} was swept with other settings ({'; '.join(changed)}): resume with its "
                             "settings, or start over with --overwrite or another --out")


def open_results(path: Path, resume: bool, overwrite: bool, env: dict) -> Results:
    """The sweep's results: continued (``resume``), replaced (``overwrite``) or new; never silently lost."""
    if path.exists() and not (resume or overwrite):
        raise SweepError(f"{path} exists: --resume continues it, --overwrite starts over")
    if path.exists() and resume:
        try:
            results = Results.load(path)
        except ValueError as e:
            raise SweepError(f"cannot resume: {e}") from None
        _check_resumable(results, env, env["fingerprints"], path)
        return results
    return Results(STUDY)


def sweep(problems: List[Problem], path: Path, options: Options, *, resume: bool = False,
          overwrite: bool = False) -> Outcome:
    """Time what is left of ``problems`` into the results file ``path`` (see the module docstring)."""
    start = time.monotonic()
    dev = device()
    if dev is None:
        raise SweepError("the sweep needs a CUDA GPU (or --dry-run, the Triton interpreter on a CPU)")
    env = {**environment(options.commit, options.dirty), "fingerprints": fingerprints(), "mode": options.mode,
           "grid": options.grid, "warmup_ms": options.warmup_ms, "rep_ms": options.rep_ms}
    results = open_results(path, resume, overwrite, env)
    retry = Retry.of(results) if options.retry_failed else Retry()
    if (retry.configs or retry.baselines) and not options.quiet:
        print(f"timing {len(retry.configs) + len(retry.baselines)} failed configs and baselines again", file=sys.stderr)
    results.start_run(env)
    planned = [p for p in plan(problems, results, retry) if p.configs or p.baselines]
    total = sum(p.configs + p.baselines for p in planned)
    if not options.quiet:
        print(f"{len(problems)} problems, {len(planned)} with work left: {sum(p.configs for p in planned)} configs "
              f"and {sum(p.baselines for p in planned)} baselines to time -> {path}", file=sys.stderr)
    prepare(planned, options.jobs)
    timed = 0
    bar = progress(total, "tuning")
    try:
        with terminated_as_interrupt():
            for item in planned:
                if _over_budget(options, start):
                    break
                bar.set_postfix_str(str(item.problem))
                timed += _time_problem(item.problem, results, options, bar, start, retry)
                results.save(path)
    finally:
        bar.close()
        results.save(path)
    left = sum(p.configs + p.baselines for p in plan(problems, results, retry)) if _over_budget(options, start) else 0
    return Outcome(path, results, timed, left)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def terminated_as_interrupt():
    """A SIGTERM (a timeout's, a scheduler's) raises KeyboardInterrupt inside, as Ctrl-C does: the
    caller saves what was measured either way."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _over_budget(options: Options, start: float) -> bool:
    return options.budget_s is not None and time.monotonic() - start > options.budget_s


def _time_problem(problem: Problem, results: Results, options: Options, bar, start: float, retry: Retry) -> int:
    """Time what is left of ``problem``; the number of configs timed (stops early past the budget)."""
    entry = KERNELS[problem.kernel]
    done, baselines = done_configs(results) - retry.configs, done_baselines(results) - retry.baselines
    timed = 0
    with entry.context(problem):
        launches = entry.launches(problem, device(), torch.randn, execute=True)
        for launch in launches:
            key = repr(launch.key)
            op = op_name(launch, problem)
            m, n, k = launch.gemm
            extra = dict(kernel=launch.kernel, key=key, product=launch.product, layout=problem.layout,
                         gemm=f"{m}x{n}x{k}", flops=launch.flops)
            common = dict(op=op, shape=problem.shape, dtype=problem.dtype, mode=options.mode)
            for config in launch.configs:
                if (launch.kernel, key, str(config)) in done:
                    continue
                if _over_budget(options, start):
                    return timed
                keys = dict(common, provider=short_name(config), **extra, config=str(config))
                retry.take(results, config=(launch.kernel, key, str(config)))
                try:
                    value = measure(lambda: launch.run(config), options.mode, options.warmup_ms, options.rep_ms,
                                    config)
                except Exception as e:  # noqa: BLE001  out of resources, a compiler error: recorded, skipped
                    results.fail(**keys, error=e)
                else:
                    results.record(**keys, metric="ms", value=value)
                done.add((launch.kernel, key, str(config)))
                timed += 1
                bar.update(1)
            if (op, problem.shape, problem.dtype) not in baselines:
                provider, fn = entry.baseline(launch)
                results.baselines[op] = provider
                retry.take(results, baseline=(op, problem.shape, problem.dtype))
                try:
                    value = measure(fn, options.mode, options.warmup_ms, options.rep_ms)
                except Exception as e:  # noqa: BLE001
                    results.fail(**common, provider=provider, error=e, **extra)
                else:
                    results.record(**common, provider=provider, metric="ms", value=value, **extra)
                baselines.add((op, problem.shape, problem.dtype))
                bar.update(1)
    return timed


# ----------------------------------------------------------------------------------------------
# Best choices, the shipped file, a summary
# ----------------------------------------------------------------------------------------------


def best_choices(results: Results) -> Dict[str, Dict[str, dict]]:
    """kernel -> tuning key (repr) -> the row of its fastest config (lowest median ms)."""
    best: Dict[str, Dict[str, dict]] = {}
    for row in results.rows:
        if "config" not in row or row["metric"] != "ms" or not math.isfinite(row["p50"]):
            continue
        keys = best.setdefault(row["kernel"], {})
        if row["key"] not in keys or row["p50"] < keys[row["key"]]["p50"]:
            keys[row["key"]] = row
    return best


def write_configs(results: Results, directory: Optional[Path] = None, source: str = "") -> Path:
    """Ship the best config of every key in ``results`` for this GPU (``_autotune.write_shipped_configs``)."""
    env = environment()
    for run in results.runs.values():
        if run.get("gpu") != env["gpu"]:
            raise SweepError(f"the results were measured on {run.get('gpu')}, this is {env['gpu']}: "
                             f"write the configs file on that GPU")
    prints = fingerprints()
    chosen, best = {}, best_choices(results)
    for kernel, keys in best.items():
        timed_on = {run.get("fingerprints", {}).get(kernel) for run in results.runs.values()} - {None}
        if timed_on and timed_on != {prints[kernel]}:
            raise SweepError(f"the results timed another version of {kernel}: sweep again before writing configs")
        chosen[kernel] = (prints[kernel], {key: row["config"] for key, row in keys.items()})
    if not chosen:
        raise SweepError("no timed config in the results: nothing to write")
    # The runs that timed the chosen configs (a --resume that timed nothing adds a run that chose none)
    timed_by = sorted({row["run"] for keys in best.values() for row in keys.values()})
    about = {"sweep": source, "runs": {run: {k: results.runs.get(run, {}).get(k) for k in
                                             ("commit", "dirty", "date", "grid", "torch")} for run in timed_by}}
    path = _autotune.shipped_configs_path(env["gpu"], directory)
    return _autotune.write_shipped_configs(path, env["gpu"], chosen, about)


def summary(results: Results) -> str:
    """Per op: the best config's speed relative to the op's baseline over its problems (geomean, range)."""
    best = {(kernel, key): row for kernel, keys in best_choices(results).items() for key, row in keys.items()}
    ratios: Dict[str, List[float]] = {}
    for r in results.rows:  # a baseline row names its problem's key; the key's best config may be another shape's
        choice = best.get((r.get("kernel"), r.get("key")))
        if "config" not in r and choice is not None and choice["shape"] == r["shape"] and r["p50"] > 0:
            ratios.setdefault(r["op"], []).append(r["p50"] / choice["p50"])
    lines = [f"{len(best)} tuning keys timed; the best config's speed relative to the baseline (above 1: faster):"]
    width = max(map(len, ratios), default=0)
    for op, values in sorted(ratios.items()):
        geo = math.exp(sum(math.log(v) for v in values) / len(values))
        lines.append(f"  {op:<{width}} x{geo:.2f} {results.baselines[op]} (geomean of {len(values)} problems; "
                     f"{min(values):.2f} to {max(values):.2f})")
    return "\n".join(lines)
