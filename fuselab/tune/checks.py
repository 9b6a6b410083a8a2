"""The two targets a shipped config file is measured against, on its GPU.

``check_heldout``: for shapes the sweep did not time (``grid.HELDOUT_SHAPES`` by default), the shipped
choice against the exhaustive best. Every pruned config of each launch is timed; then the shipped config
and the fastest are timed again, alternately, ``rounds`` times (the fastest of many noisy timings is
flattered by its noise), and the ratio of their medians is reported: 1.00 means the shipped choice is
the best one, the target is <= 1.05 on every shape. Study ``tune_heldout``: providers ``shipped`` and
``exhaustive best`` (the baseline), metric ``ms``; a key with no shipped choice is listed as failed.

``first_call``: a fresh Python process per case (``first_call.py``), with a fuselab cache that holds
only the C++ eager path (built once before the cases, in its own timed process: once per install, not
per shape; op ``C++ eager path build``, metric ``build s``), times its first call of the op (inputs
already on the GPU, CUDA and Triton's driver initialized): twice, with an empty Triton cache (``cold``:
what a new user's first call costs, compiling the kernel and its launcher included) and then with the
Triton cache (and fuselab cache) the first process filled (``warm``). Each reports the keys the tuner
timed: with a shipped file that covers the shape, none. Study ``tune_first_call``, metric ``first call
s``; target <= 0.5 s.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch

from fuselab import settings
from fuselab._results import Results, environment
from fuselab.kernels import _autotune
from fuselab.tune.grid import Problem
from fuselab.tune.kernels import KERNELS, device
from fuselab.tune.sweep import (
    Options,
    SweepError,
    measure,
    plan,
    prepare,
    progress,
    short_name,
    terminated_as_interrupt,
)

HELDOUT_TARGET = 1.05
FIRST_CALL_TARGET_S = 0.5


def _table(header: List[str], lines: List[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*map(str, line)) for line in lines])


def _no_save(results: Results) -> None:
    return None


def check_heldout(problems: List[Problem], options: Options, directory: Optional[Path] = None,
                  rounds: int = 3, save: Callable[[Results], None] = _no_save) -> Results:
    """Shipped choice vs exhaustive best per launch of each problem (module docstring); prints a table.
    ``save(results)`` runs after each problem (an interrupted check keeps what it measured)."""
    dev = device()
    if dev is None:
        raise SweepError("--check-heldout needs a CUDA GPU (or --dry-run, the Triton interpreter: the machinery only)")
    path = _autotune.shipped_configs_path(None, directory)
    results = Results("tune_heldout")
    results.start_run({**environment(options.commit, options.dirty), "configs_file": str(path), "rounds": rounds})
    prepare(plan(problems, Results("tune")), options.jobs)
    bar = progress(len(problems), "held-out", unit="problem")
    lines = []
    try:
        with terminated_as_interrupt():
            for problem in problems:
                entry = KERNELS[problem.kernel]
                checked = set()  # the bwd op launches the forward again
                with entry.context(problem):
                    for launch in entry.launches(problem, dev, torch.randn, execute=True):
                        if (launch.kernel, launch.key) not in checked:
                            checked.add((launch.kernel, launch.key))
                            lines.append(_check_launch(results, problem, launch, path, options, rounds))
                save(results)
                bar.update(1)
    finally:
        bar.close()
    print(_table(["shape", "dtype", "layout", "product", "shipped", "exhaustive best", "shipped/best", "ok"], lines))
    ratios = [line[6] for line in lines if isinstance(line[6], float)]
    met = sum(r <= HELDOUT_TARGET for r in ratios)
    print(f"within {HELDOUT_TARGET:.2f}x of the exhaustive best: {met} of {len(lines)} launches "
          f"({len(lines) - len(ratios)} without a shipped choice)")
    return results


def _check_launch(results, problem, launch, path, options, rounds) -> list:
    op = f"{launch.product} {problem.layout}"
    key = repr(launch.key)
    common = dict(op=op, shape=problem.shape, dtype=problem.dtype, mode=options.mode, kernel=launch.kernel, key=key)
    results.baselines[op] = "exhaustive best"
    times = {}
    for config in launch.configs:
        try:
            times[str(config)] = measure(lambda: launch.run(config), options.mode, options.warmup_ms, options.rep_ms,
                                         config)[1]
        except Exception:  # noqa: BLE001  a config that cannot run is not the best
            times[str(config)] = float("inf")
    by_name = {str(c): c for c in launch.configs}
    best = min(times, key=times.get)
    fingerprint = launch.tuner.fingerprint
    choice = _autotune.shipped_choices(launch.kernel, fingerprint, path).get(key)
    line = [problem.shape, problem.dtype, problem.layout, launch.product]
    if choice not in by_name:  # the search's best is kept: it is what a sweep of this key would ship
        results.fail(**common, provider="shipped", error=f"no shipped choice for this key in {path}")
        results.record(**common, provider="exhaustive best", metric="ms", value=(times[best],) * 3, config=best,
                       rounds=1)
        return line + ["-", short_name(by_name[best]), "-", "no shipped choice"]
    samples = {choice: [], best: []}
    for r in range(rounds if choice != best else 1):  # in turns, neither always first: drifting clocks hit both alike
        for name in (list(samples) if r % 2 == 0 else list(samples)[::-1]):
            samples[name].append(measure(lambda: launch.run(by_name[name]), options.mode, options.warmup_ms,
                                         options.rep_ms, by_name[name])[1])
    for provider, name in (("shipped", choice), ("exhaustive best", best)):
        s = sorted(samples[name])
        results.record(**common, provider=provider, metric="ms", value=(s[0], statistics.median(s), s[-1]),
                       config=name)
    ratio = statistics.median(samples[choice]) / statistics.median(samples[best])
    return line + [short_name(by_name[choice]), short_name(by_name[best]), round(ratio, 3),
                   "yes" if ratio <= HELDOUT_TARGET else "NO"]


def first_call(problems: List[Problem], options: Options, directory: Optional[Path] = None,
               timeout_s: float = 600, save: Callable[[Results], None] = _no_save,
               build_cpp: Optional[bool] = None) -> Results:
    """Each problem's ops, first call in a fresh process, cold then warm Triton cache (module docstring);
    a case past ``timeout_s`` is recorded as failed. ``save(results)`` runs after each case.

    The C++ eager path is built once per install, not per shape: with ``build_cpp`` (default: on a
    GPU, the path on) it is built first, timed as its own row (op ``C++ eager path build``), and every
    case's fresh cache starts with that build."""
    if device() is None:
        raise SweepError("--first-call needs a CUDA GPU (or --dry-run, the Triton interpreter: the machinery only)")
    results = Results("tune_first_call")
    results.start_run({**environment(options.commit, options.dirty),
                       "configs_file": str(_autotune.shipped_configs_path(None, directory))})
    cases = [(p, op) for p in problems for op in p.ops]
    bar = progress(2 * len(cases), "first calls", unit="process")
    lines = []
    with tempfile.TemporaryDirectory(prefix="fuselab-first-call-build-") as built:
        try:
            with terminated_as_interrupt():
                env = {}
                if build_cpp if build_cpp is not None else device() == "cuda" and settings.EAGER_CPP.get():
                    if not _build_cpp_path(results, Path(built), options, timeout_s):
                        env["FUSELAB_EAGER_CPP"] = "0"  # not a build attempt inside every timed first call
                for problem, op in cases:
                    lines.append(_first_call_case(results, problem, op, options, directory, timeout_s, bar,
                                                  Path(built), env))
                    save(results)
        finally:
            bar.close()
    print(_table(["shape", "dtype", "layout", "op", "cold s", "keys tuned", "warm s", "keys tuned"], lines))
    print(f"target: <= {FIRST_CALL_TARGET_S} s and no key tuned (the shipped file covers the shape)")
    return results


CPP_BUILD = "C++ eager path build"


def _build_cpp_path(results: Results, cache: Path, options: Options, timeout_s: float) -> bool:
    """Build the C++ eager path into ``cache`` in its own process, timed: a row of op ``CPP_BUILD``;
    False (recorded as failed, said in one line) if it did not build."""
    common = dict(op=CPP_BUILD, provider="once per install", shape="-", dtype="-", mode=options.mode)
    t0 = time.perf_counter()
    # its own process group: a timeout or an interrupt stops the compiler it started too
    proc = subprocess.Popen([sys.executable, "-c", "from fuselab.kernels import eager_path; eager_path.build()"],
                            env=dict(os.environ, FUSELAB_CACHE_DIR=str(cache)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
        error = None if proc.returncode == 0 else \
            f"exit status {proc.returncode}: {(err.strip().splitlines() or ['no output'])[-1]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:g} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.perf_counter() - t0
    if error is not None:
        results.fail(**common, error=error)
        print(f"{CPP_BUILD}: failed ({error}); the cases run with the C++ eager path off")
        return False
    results.record(**common, metric="build s", value=(seconds,) * 3)
    print(f"{CPP_BUILD}: {seconds:.1f} s (once per install; every case below starts with it)")
    return True


def _first_call_case(results: Results, problem: Problem, op: str, options: Options, directory: Optional[Path],
                     timeout_s: float, bar, built: Path, extra_env: dict) -> list:
    """One case's two processes (cold, then warm Triton cache), recorded; its table line. Its fuselab
    cache starts with what ``built`` holds (the C++ eager path), and nothing else."""
    line = [problem.shape, problem.dtype, problem.layout, op]
    with tempfile.TemporaryDirectory(prefix="fuselab-first-call-") as tmp:
        shutil.copytree(built, Path(tmp) / "fuselab")
        env = dict(os.environ, FUSELAB_CACHE_DIR=str(Path(tmp) / "fuselab"), TRITON_CACHE_DIR=str(Path(tmp) / "triton"),
                   **extra_env)
        spec = {"kernel": problem.kernel, "M": problem.M, "N": problem.N, "K": problem.K, "dtype": problem.dtype,
                "layout": problem.layout, "op": op, "configs_dir": str(directory) if directory else None}
        for provider in ("cold Triton cache", "warm Triton cache"):
            common = dict(op=op, provider=provider, shape=problem.shape, dtype=problem.dtype, mode=options.mode)
            try:
                run = subprocess.run([sys.executable, "-m", "fuselab.tune.first_call", json.dumps(spec)], env=env,
                                     capture_output=True, text=True, timeout=timeout_s)
                out = json.loads(run.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                results.fail(**common, error=f"timed out after {timeout_s:g} s")
                line += ["timed out", "-"]
                continue
            except (ValueError, IndexError):
                tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
                results.fail(**common, error=f"exit status {run.returncode}: {tail}")
                line += ["failed", "-"]
                continue
            finally:
                bar.update(1)
            results.record(**common, metric="first call s", value=(out["seconds"],) * 3, layout=problem.layout,
                           tunings=out["tunings"], configs=out["configs"])
            line += [f"{out['seconds']:.3f}", len(out["tunings"])]
    return line
