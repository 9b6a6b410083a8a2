"""``python -m fuselab.tune``: see the package docstring (``python -m fuselab.tune --help``)."""
import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import fuselab.tune
from fuselab._io import non_negative_int, positive_float, positive_int
from fuselab.kernels import _autotune
from fuselab.kernels._runtime import INTERPRET
from fuselab.tune import grid
from fuselab.tune.kernels import KERNELS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fuselab.tune", description=fuselab.tune.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    action = p.add_mutually_exclusive_group()
    action.add_argument("--check-heldout", action="store_true",
                        help="time the shipped choice against the exhaustive best on shapes the grid lacks")
    action.add_argument("--first-call", action="store_true",
                        help="time a fresh process's first call per shape (cold and warm Triton cache)")
    action.add_argument("--plot", type=Path, metavar="RESULTS", help="plot a sweep's results file, then exit")
    p.add_argument("--grid", default=None,
                   help=f"the sweep's grid: {', '.join(grid.GRIDS)} or a JSON file (default: default; tiny with "
                        f"--dry-run)")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default: runs/<study>-<gpu>.json under the current directory)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue --out: skip what it already holds")
    again.add_argument("--overwrite", action="store_true", help="start --out over (a check: replace it)")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume: time again what failed (else a resume skips it, as it does what was timed)")
    p.add_argument("--budget-min", type=positive_float, default=None,
                   help="stop starting new timings after this many minutes (saved; --resume continues)")
    p.add_argument("--write-configs", action="store_true",
                   help="write the best config per tuning key into the configs file for this GPU")
    p.add_argument("--configs-dir", type=Path, default=None,
                   help=f"the configs files' folder (default: the package's, {_autotune.SHIPPED_CONFIGS_DIR})")
    p.add_argument("--dry-run", action="store_true",
                   help="run in the Triton interpreter on the CPU (timings mean nothing): checks the machinery")
    p.add_argument("--jobs", type=non_negative_int, default=None,
                   help="processes compiling kernels ahead of timing (default: half the CPUs, at most 8; "
                        "0: compile in this process)")
    p.add_argument("--warmup-ms", type=positive_float, default=5, help="do_bench warmup per config (ms)")
    p.add_argument("--rep-ms", type=positive_float, default=25, help="do_bench timed calls per config (ms)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="--check-heldout: alternate re-timings of the shipped and the best config")
    p.add_argument("--commit", default=None, help="the commit measured, where git cannot tell (a copy without .git)")
    p.add_argument("--dirty", action="store_true", help="with --commit: the working tree had changes")
    checks = p.add_argument_group("the checks' problems (--check-heldout, --first-call)")
    checks.add_argument("--kernel", default="matmul_relu", choices=list(KERNELS),
                        help="the tuned kernel checked (default: matmul_relu)")
    checks.add_argument("--shapes", default=None,
                        help="MxNxK,... (default: grid.HELDOUT_SHAPES, or the benchmark's for --first-call)")
    checks.add_argument("--dtypes", default=None,
                        help=f"the kernel's: {', '.join(f'{k}: {list(e.dtypes)}' for k, e in KERNELS.items())} "
                             "(default: its first)")
    checks.add_argument("--layouts", default=None,
                        help=f"the kernel's: {', '.join(f'{k}: {list(e.layouts)}' for k, e in KERNELS.items())} "
                             "(default: its check_defaults)")
    checks.add_argument("--ops", default=None,
                        help=f"the kernel's: {', '.join(f'{k}: {list(e.ops)}' for k, e in KERNELS.items())} "
                             "(default: its check_defaults)")
    p.add_argument("--plot-dir", type=Path, default=None, help="--plot's folder (default: beside the results)")
    return p


def _check_problems(p: argparse.ArgumentParser, args) -> List[grid.Problem]:
    first, entry = args.first_call, KERNELS[args.kernel]
    defaults = grid.TINY_SHAPES if INTERPRET else entry.benchmark_shapes if first else grid.HELDOUT_SHAPES
    shapes = grid.parse_shapes(args.shapes) if args.shapes else defaults
    layouts, ops = entry.check_defaults["first_call" if first else "heldout"]
    block = {"kernel": args.kernel, "shapes": [list(s) for s in shapes],
             "dtypes": (args.dtypes or next(iter(entry.dtypes))).split(","),
             "layouts": (args.layouts or layouts).split(","), "ops": (args.ops or ops).split(",")}
    return grid.problems([block], KERNELS)


def _validate(p: argparse.ArgumentParser, args) -> None:
    check = args.check_heldout or args.first_call
    if args.plot is not None:
        return
    if not check and args.kernel != "matmul_relu":
        p.error("--kernel chooses the checks' kernel; the sweep's come from --grid")
    if check and args.grid is not None:
        p.error("--grid is the sweep's; the checks take --shapes, --dtypes, --layouts and --ops")
    if not check and any(v is not None for v in (args.shapes, args.dtypes, args.layouts, args.ops)):
        p.error("--shapes, --dtypes, --layouts and --ops choose the checks' problems; the sweep's come from --grid")
    if check and (args.write_configs or args.budget_min is not None or args.resume):
        p.error("--write-configs, --budget-min and --resume are the sweep's")
    if args.retry_failed and not args.resume:
        p.error("--retry-failed goes with --resume (a new sweep times everything)")
    if args.dirty and args.commit is None:
        p.error("--dirty describes --commit: give both")
    if (args.dry_run or INTERPRET) and args.write_configs and args.configs_dir is None:  # interpreter runs read it
        p.error("--write-configs in the interpreter (--dry-run, TRITON_INTERPRET=1) would write its wall-clock choices "
                "into the package: give --configs-dir")
    # where the sweep writes, checked before any timing, not after a sweep of many minutes
    if args.write_configs:
        where = args.configs_dir if args.configs_dir is not None else _autotune.SHIPPED_CONFIGS_DIR
        folder = _unwritable_folder(where)
        if folder is not None:
            p.error(f"--write-configs: cannot write the configs file under {where} ({folder} is not a writable folder)")
    if args.out is not None:
        if args.out.is_dir():
            p.error(f"--out {args.out} is a folder: give the results file's path")
        folder = _unwritable_folder(args.out.parent)
        if folder is not None:
            p.error(f"--out {args.out}: cannot write under {folder}")


def _unwritable_folder(where: Path) -> Optional[Path]:
    """None where files can be made at ``where`` (its missing folders created), else its nearest existing ancestor,
    which is not a writable folder."""
    folder = next((d for d in [where, *where.parents] if d.exists()), Path("."))
    return None if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK) else folder


def _run_in_interpreter(argv: List[str]) -> int:
    """--dry-run: this command again in a process with TRITON_INTERPRET=1 (read when Triton loads).
    Ctrl-C reaches both processes (one process group): this one waits for the other to save and
    exit; a SIGTERM sent to this one alone is passed on, so no orphan keeps writing the results."""
    children, pending = [], []  # the handler is in place before the child exists: no SIGTERM slips past it

    def forward(signum, frame):
        if children:
            children[0].send_signal(signum)
        else:  # the child is starting: passed on once it exists
            pending.append(signum)

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, forward)}
    try:
        child = subprocess.Popen([sys.executable, "-m", "fuselab.tune", *argv],
                                 env=dict(os.environ, TRITON_INTERPRET="1"))
        children.append(child)
        for signum in pending:  # arrived while the child was starting
            child.send_signal(signum)
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def _interrupted(out: Path) -> int:
    saved = f"what was measured is saved in {out}" if out.exists() else f"nothing was saved yet ({out})"
    print(f"\ninterrupted: {saved}", file=sys.stderr)
    return 130


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    _validate(p, args)
    if args.plot is not None:
        from fuselab.tune.plot import plot_sweep

        if not args.plot.is_file():
            p.error(f"--plot {args.plot}: no such file")
        try:
            paths = plot_sweep(args.plot, args.plot_dir or args.plot.with_name(args.plot.stem + "-plots"))
        except ValueError as e:
            p.error(f"--plot {args.plot}: {e}")
        for path in paths:
            print(path)
        return 0
    if args.dry_run and not INTERPRET:  # the interpreter is chosen before Triton loads: a new process
        return _run_in_interpreter(argv)
    grid_name = args.grid or ("tiny" if args.dry_run else "default")
    try:
        problems = _check_problems(p, args) if args.check_heldout or args.first_call else grid.load(grid_name, KERNELS)
    except grid.GridError as e:
        p.error(str(e))
    from fuselab.tune import checks
    from fuselab.tune.sweep import Options, SweepError, summary, sweep, write_configs

    jobs = args.jobs if args.jobs is not None else min(8, (os.cpu_count() or 2) // 2)
    options = Options(mode="wall" if INTERPRET else "eager", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                      budget_s=args.budget_min * 60 if args.budget_min else None, jobs=0 if INTERPRET else jobs,
                      commit=args.commit, dirty=args.dirty if args.commit else None, grid=grid_name,
                      retry_failed=args.retry_failed)
    study = "tune_heldout" if args.check_heldout else "tune_first_call" if args.first_call else "tune"
    out = args.out or Path("runs") / f"{study}-{_autotune.gpu_file_name()}.json"
    if args.resume and not out.exists():
        p.error(f"--resume continues {out}, which is not there: nothing to continue")
    if (args.check_heldout or args.first_call) and out.exists() and not args.overwrite:  # a sweep's file, say
        p.error(f"{out} exists: --overwrite replaces it (a check does not continue a file)")
    try:
        if args.check_heldout or args.first_call:
            run = checks.check_heldout if args.check_heldout else checks.first_call
            kwargs = {"rounds": args.rounds} if args.check_heldout else {}
            try:
                results = run(problems, options, args.configs_dir, save=lambda r: r.save(out), **kwargs)
            except KeyboardInterrupt:
                return _interrupted(out)
            print(f"saved {results.save(out)}")
            return 0
        try:
            outcome = sweep(problems, out, options, resume=args.resume, overwrite=args.overwrite)
        except KeyboardInterrupt:
            code = _interrupted(out)
            print("--resume continues the sweep", file=sys.stderr)
            return code
        print(summary(outcome.results))
        state = f"{outcome.left} timings left: run again with --resume" if outcome.left else "the sweep is complete"
        print(f"{outcome.timed} configs timed; {state} ({out})")
        if args.write_configs and outcome.left:  # a key cut by the budget would ship a choice of part of its configs
            print(f"error: not writing configs: {outcome.left} timings are left (--budget-min): run again with "
                  f"--resume --write-configs", file=sys.stderr)
            return 1
        if args.write_configs:
            print(f"wrote {write_configs(outcome.results, args.configs_dir, source=out.name)}")
        return 0
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
