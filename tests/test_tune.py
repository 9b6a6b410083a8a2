"""fuselab.tune (the sweep, its configs files, the checks, the plots) and the runtime's use of shipped configs.

Everything runs in the Triton interpreter (conftest), where ``--dry-run`` sweeps the tiny grid in seconds.
Shipped config files are written into temporary folders (``--configs-dir`` / ``SHIPPED_CONFIGS_DIR``),
never into the package.
"""
import dataclasses
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuselab import settings
from fuselab._results import ROW_KEYS, Results
from fuselab.kernels import _autotune
from fuselab.kernels._autotune import bucket
from fuselab.tune import grid, sweep
from fuselab.tune.__main__ import main
from fuselab.tune.kernels import KERNELS

MR = importlib.import_module("fuselab.kernels.matmul_relu_triton")
SG = importlib.import_module("fuselab.quant._scaled_gemm")
ENTRY = KERNELS["matmul_relu"]
TINY = grid.load("tiny", KERNELS)
TINY_GEMM = [p for p in TINY if p.kernel == "matmul_relu"]


def _dry_run(tmp_path, *extra):
    out, configs = tmp_path / "tune.json", tmp_path / "configs"
    assert main(["--dry-run", "--out", str(out), "--write-configs", "--configs-dir", str(configs), *extra]) == 0
    return out, configs


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One dry-run of the tiny grid: (results file, configs folder); tests copy before changing them."""
    return _dry_run(tmp_path_factory.mktemp("swept"))


@pytest.fixture
def fresh_tuner(monkeypatch):
    """A new tuner for the fused GEMM (an empty in-memory cache, as in a new process), used by its op."""
    kernel = MR.matmul_relu_kernel
    configs, key, prune = kernel._tuned_over
    tuner = _autotune.PersistentAutotuner(kernel.fn, configs, key, prune, kernel.heuristic, kernel.library)
    monkeypatch.setattr(MR, "matmul_relu_kernel", tuner)
    return tuner


@pytest.fixture
def empty_cache(tmp_path, env):
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "user-cache"))
    settings.reload()
    return tmp_path / "user-cache"


def _count_timings(tuner):
    timed = []
    run_config = tuner._bench

    def bench(*args, config, **meta):
        timed.append(config)
        return run_config(*args, config=config, **meta)

    tuner._bench = bench
    return timed


def _run_tiny_ops():
    for problem in TINY_GEMM:  # the fused GEMM's: the tests below watch its tuner
        for op in problem.ops:
            ENTRY.call(op, ENTRY.inputs(problem, "cpu", torch.randn, requires_grad=op == "bwd"))


def _tuning_records(caplog):
    return [r for r in caplog.records if r.name == "fuselab.autotune" and "tuning" in r.getMessage()]


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


def test_dry_run_writes_results_and_configs(swept, tmp_path):
    out, configs = swept
    results = Results.load(out)
    assert results.study == "tune"
    rows = results.rows
    timed = [r for r in rows if "config" in r and r["kernel"] == "matmul_relu_kernel"]
    keys = {r["key"] for r in timed}
    # the tiny grid: fwd, grad_a and grad_b of one problem, fwd of the other; both interpreter configs each,
    # and cuBLAS for the forwards (the interpreter's backward masks G on load, where cuBLAS cannot serve)
    assert len(keys) == 4 and len(timed) == 8 + 2 and sum(r["config"] == "cublas" for r in timed) == 2
    assert {r["product"] for r in timed} == {"fwd", "grad_a", "grad_b"}
    # and the quantized GEMM's forward in int8 and fp8: its two interpreter configs each, no library choice
    quant = [r for r in rows if "config" in r and r["kernel"] == "scaled_gemm_kernel"]
    assert len({r["key"] for r in quant}) == 2 and len(quant) == 4
    assert {r["product"] for r in quant} == {"int8 fwd", "fp8 fwd"}
    assert all(set(ROW_KEYS) <= set(r) and r["metric"] == "ms" and r["mode"] == "wall" for r in rows)
    assert len(rows) - len(timed) - len(quant) == 6 and all(results.baselines[r["op"]] == r["provider"]
                                                            for r in rows if "config" not in r)
    (run,) = results.runs.values()
    assert run["gpu"] == "triton-interpreter" and run["fingerprints"] == {
        "matmul_relu_kernel": MR.matmul_relu_kernel.fingerprint, "scaled_gemm_kernel": SG.scaled_gemm_kernel.fingerprint}

    shipped = json.loads((configs / "triton-interpreter.json").read_text())
    assert shipped["format"] == _autotune.CONFIGS_FORMAT and shipped["gpu"] == "triton-interpreter"
    for kernel, module, kernel_keys in (("matmul_relu_kernel", MR, keys),
                                        ("scaled_gemm_kernel", SG, {r["key"] for r in quant})):
        entry = shipped["kernels"][kernel]
        tuner = getattr(module, kernel)
        assert entry["fingerprint"] == tuner.fingerprint
        best = sweep.best_choices(results)[kernel]
        assert entry["configs"] == {key: row["config"] for key, row in best.items()} and set(entry["configs"]) == kernel_keys
        assert set(entry["configs"].values()) <= {str(c) for c in tuner.configs} | {"cublas"}
    # the file credits the run that timed its choices (a later resume that timed nothing adds a run, not credit)
    (run_id,) = results.runs
    results.start_run({**run, "commit": "not-this-one"})
    about = json.loads(sweep.write_configs(results, tmp_path).read_text())["about"]
    assert list(about["runs"]) == [run_id] and about["runs"][run_id]["commit"] == run["commit"]


def test_quantized_output_op_is_swept_with_its_baseline_and_int8_only(tmp_path, capsys):
    # scaled_gemm's fwd-quantout (a static fused fc1): a tuning key of its own, timed against the unfused PyTorch form
    blocks = [{"kernel": "scaled_gemm", "shapes": [[64, 48, 32]], "dtypes": ["int8"], "layouts": ["linear"],
               "ops": ["fwd-quantout"]}]
    (tmp_path / "grid.json").write_text(json.dumps(blocks))
    out = tmp_path / "tune.json"
    assert main(["--dry-run", "--grid", str(tmp_path / "grid.json"), "--out", str(out)]) == 0
    rows = Results.load(out).rows
    timed = [r for r in rows if "config" in r]
    assert {r["product"] for r in timed} == {"int8 fwd-quantout"} and len(timed) == 2
    assert "'torch.int8', 'torch.int8', 'torch.int8'" in timed[0]["key"]  # a, b and the int8 output
    assert [r["provider"] for r in rows if "config" not in r] == ["torch (CPU)"]
    blocks[0]["dtypes"] = ["int8", "fp8"]
    with pytest.raises(grid.GridError, match="op fwd-quantout runs for dtypes \\['int8'\\] only"):
        grid.problems(blocks, KERNELS)


def test_resume_continues_an_interrupted_sweep(tmp_path, monkeypatch, capsys):
    out = tmp_path / "tune.json"
    measured = []
    real_measure, real_problem = sweep.measure, sweep._time_problem

    def counting(fn, *args):
        measured.append(fn)
        return real_measure(fn, *args)

    def interrupted(problem, *args):
        if problem != TINY[0]:
            raise KeyboardInterrupt  # as a timeout's SIGTERM would, during the second problem
        return real_problem(problem, *args)

    monkeypatch.setattr(sweep, "measure", counting)
    monkeypatch.setattr(sweep, "_time_problem", interrupted)
    assert main(["--dry-run", "--out", str(out)]) == 130
    first = Results.load(out)  # saved after the first problem, whole
    assert {r["shape"] for r in first.rows} == {TINY[0].shape} and len(measured) == 7 + 3

    monkeypatch.setattr(sweep, "_time_problem", real_problem)
    measured.clear()
    assert main(["--dry-run", "--out", str(out)]) == 1
    assert "--resume" in capsys.readouterr().err  # an existing file is neither extended nor lost silently
    assert main(["--dry-run", "--out", str(out), "--resume"]) == 0
    # the second problem's configs and baseline, then the quantized GEMM's (int8, fp8: two configs and one each)
    assert len(measured) == 3 + 1 + 2 * 3, "only the problems after the first were left"
    assert "the sweep is complete" in capsys.readouterr().out

    measured.clear()
    assert main(["--dry-run", "--out", str(out), "--resume"]) == 0
    assert measured == []

    data = json.loads(out.read_text())  # drop one key's timings: a resume times exactly those again
    key = next(r["key"] for r in data["rows"] if r.get("product") == "grad_b")
    data["rows"] = [r for r in data["rows"] if not (r.get("key") == key and "config" in r)]
    out.write_text(json.dumps(data))
    assert main(["--dry-run", "--out", str(out), "--resume"]) == 0
    assert len(measured) == 2
    assert len(Results.load(out).runs) == 4


def test_resume_retries_failures_only_when_asked(tmp_path, monkeypatch, capsys):
    out = tmp_path / "tune.json"
    real_measure = sweep.measure
    failing = {"first": True}

    def once_failing(fn, mode, warmup_ms, rep_ms, config=None):
        if config is not None and failing.pop("first", False):
            raise RuntimeError("out of memory (another process held the GPU)")
        return real_measure(fn, mode, warmup_ms, rep_ms, config)

    monkeypatch.setattr(sweep, "measure", once_failing)
    assert main(["--dry-run", "--out", str(out)]) == 0
    (failed,) = Results.load(out).failed
    assert "out of memory" in failed["error"]
    measured = []
    monkeypatch.setattr(sweep, "measure", lambda *a: measured.append(a) or real_measure(*a))
    assert main(["--dry-run", "--out", str(out), "--resume"]) == 0
    assert measured == [] and len(Results.load(out).failed) == 1  # a resume skips a failure, as a timing
    # a budget spent before the retry keeps the failure recorded (it was cleared first: lost, never retried)
    monkeypatch.setattr(sweep, "_over_budget", lambda options, start: options.budget_s is not None)
    assert main(["--dry-run", "--out", str(out), "--resume", "--retry-failed", "--budget-min", "1"]) == 0
    assert measured == [] and len(Results.load(out).failed) == 1
    monkeypatch.undo()
    monkeypatch.setattr(sweep, "measure", lambda *a: measured.append(a) or real_measure(*a))
    assert main(["--dry-run", "--out", str(out), "--resume", "--retry-failed"]) == 0
    assert len(measured) == 1 and Results.load(out).failed == []
    assert any(r.get("config") == failed["config"] for r in Results.load(out).rows)


def test_budget_stops_and_resume_finishes(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(["--dry-run", "--out", str(out), "--budget-min", "0.0001"]) == 0  # spent while planning
    assert "20 timings left: run again with --resume" in capsys.readouterr().out
    assert Results.load(out).rows == []
    assert main(["--dry-run", "--out", str(out), "--resume"]) == 0
    assert "the sweep is complete" in capsys.readouterr().out and len(Results.load(out).rows) == 20


def test_precompile_in_a_worker_process(capsys):
    # On a GPU the worker compiles into Triton's cache; in the interpreter "warmup" runs the kernel once,
    # which exercises the same path: planning, grouping by kind, pickling to a spawned process.
    planned = sweep.plan(TINY[1:], Results("tune"))  # the fused GEMM's second problem, then int8 and fp8
    assert sum(len(names) for item in planned for _, names in item.kinds.values()) == 3 + 2 * 2  # cuBLAS: nothing
    sweep.precompile(planned, jobs=1)
    assert "did not compile" not in capsys.readouterr().err


def test_precompile_compiles_each_config_with_a_problem_that_lists_it():
    # Pruning is per shape: on the H200, BLOCK_M=16 configs of a kind exist for its small-M problems only,
    # and compiling them with the kind's first problem failed ("not among ... configs").
    large, small = TINY[0], dataclasses.replace(TINY[0], M=16)
    kind = ("matmul_relu_kernel", (), (), ())
    planned = [sweep.Planned(large, kinds={kind: ("fwd", {"big tile"})}),
               sweep.Planned(small, kinds={kind: ("fwd", {"big tile", "small tile"})})]
    tasks = sweep.precompile_tasks(planned)
    assert sorted(tasks, key=lambda t: t[0].M) == [(small, "fwd", ["small tile"]), (large, "fwd", ["big tile"])]


def test_resume_refuses_results_of_another_kernel_version(tmp_path, swept, capsys):
    out = tmp_path / "tune.json"
    data = json.loads(swept[0].read_text())
    for run in data["runs"].values():
        run["fingerprints"]["matmul_relu_kernel"] = "0" * 16
    out.write_text(json.dumps(data))
    assert main(["--dry-run", "--out", str(out), "--resume"]) == 1
    assert "another version of matmul_relu_kernel" in capsys.readouterr().err
    # another timing window: its rows would be compared with these as one sweep's
    out.write_text(swept[0].read_text())
    assert main(["--dry-run", "--out", str(out), "--resume", "--rep-ms", "7"]) == 1
    assert "swept with other settings (rep_ms" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# The runtime and shipped files
# ----------------------------------------------------------------------------------------------


def _ship_second_configs(swept, tmp_path, **changes):
    """The dry-run's configs file, copied to ``tmp_path/configs``, every key choosing the configs' second
    (the constant-clock tuner would keep the first), and ``changes`` applied to the file."""
    configs = tmp_path / "configs"
    shutil.copytree(swept[1], configs)
    path = configs / "triton-interpreter.json"
    data = json.loads(path.read_text())
    entry = data["kernels"]["matmul_relu_kernel"]
    second = str(MR.matmul_relu_kernel.configs[1])
    entry["configs"] = {key: second for key in entry["configs"]}
    entry.update(changes.pop("entry", {}))
    data.update(changes)
    path.write_text(json.dumps(data))
    return configs, second


def test_shipped_configs_are_used_without_timing(swept, tmp_path, monkeypatch, fresh_tuner, empty_cache, caplog):
    configs, second = _ship_second_configs(swept, tmp_path)
    monkeypatch.setattr(_autotune, "SHIPPED_CONFIGS_DIR", configs)
    fresh_tuner._bench = lambda *args, **kwargs: pytest.fail("a shipped key was timed")
    with caplog.at_level(logging.INFO, logger="fuselab.autotune"):
        _run_tiny_ops()
    assert len(fresh_tuner.cache) == 4 and {str(c) for c in fresh_tuner.cache.values()} == {second}
    assert _tuning_records(caplog) == []
    assert not empty_cache.exists(), "nothing was timed, so nothing is stored in the user's cache"


def test_a_key_missing_from_the_shipped_file_is_tuned(swept, tmp_path, monkeypatch, fresh_tuner, empty_cache):
    configs, _ = _ship_second_configs(swept, tmp_path)
    monkeypatch.setattr(_autotune, "SHIPPED_CONFIGS_DIR", configs)
    timed = _count_timings(fresh_tuner)
    problem = grid.Problem("matmul_relu", 200, 48, 32, "bf16", "linear", ("fwd",))  # M~256: not in the tiny grid
    ENTRY.call("fwd", ENTRY.inputs(problem, "cpu", torch.randn))
    assert len(timed) == 3 and list(empty_cache.rglob("*.json"))  # two configs and cuBLAS


@pytest.mark.parametrize("stale", ["fingerprint", "triton"])
def test_stale_shipped_file_is_ignored_with_one_warning(swept, tmp_path, monkeypatch, fresh_tuner, empty_cache,
                                                        stale):
    change = {"entry": {"fingerprint": "0" * 16}} if stale == "fingerprint" else {"triton": "0.0.1"}
    configs, second = _ship_second_configs(swept, tmp_path, **change)
    monkeypatch.setattr(_autotune, "SHIPPED_CONFIGS_DIR", configs)
    timed = _count_timings(fresh_tuner)
    with pytest.warns(RuntimeWarning) as caught:
        _run_tiny_ops()
    messages = [str(w.message) for w in caught if "fuselab: ignoring" in str(w.message)]
    assert len(messages) == 1, messages
    assert str(configs / "triton-interpreter.json") in messages[0]
    assert ("another version of the kernel" if stale == "fingerprint" else "triton 0.0.1") in messages[0]
    assert len(timed) == 10 and second not in {str(c) for c in fresh_tuner.cache.values()}


def test_tuning_says_so_once_per_key(tmp_path, monkeypatch, fresh_tuner, empty_cache, caplog):
    monkeypatch.setattr(_autotune, "SHIPPED_CONFIGS_DIR", tmp_path / "no-configs")
    problems = [grid.Problem("matmul_relu", m, 48, 32, "bf16", "matmul", ("fwd",)) for m in (64, 50, 100)]
    with caplog.at_level(logging.WARNING, logger="fuselab.autotune"):
        for problem in problems + problems:  # 64 and 50 share a bucket: two keys, each announced once
            ENTRY.call("fwd", ENTRY.inputs(problem, "cpu", torch.randn))
    messages = [r.getMessage() for r in _tuning_records(caplog)]
    assert len(messages) == 2 and all(r.levelno == logging.WARNING for r in _tuning_records(caplog))
    for m, message in zip((64, 128), messages):
        assert re.fullmatch(rf"fuselab: tuning matmul_relu_kernel bf16 M~{m} N~64 K~32 A_ROW_MAJOR B_ROW_MAJOR "
                            r"HAS_BIAS RELU: 3 configs, in the Triton interpreter, whose timings mean nothing \(cached in .+\)",
                            message), message
        assert str(_autotune.cache_dir()) in message and "\n" not in message

    caplog.clear()  # a new process: the user's cache answers, nothing is said
    configs, key, prune = fresh_tuner._tuned_over
    monkeypatch.setattr(MR, "matmul_relu_kernel", _autotune.PersistentAutotuner(
        fresh_tuner.fn, configs, key, prune, fresh_tuner.heuristic, fresh_tuner.library))
    with caplog.at_level(logging.WARNING, logger="fuselab.autotune"):
        ENTRY.call("fwd", ENTRY.inputs(problems[0], "cpu", torch.randn))
    assert _tuning_records(caplog) == []


def test_describe_key():
    names = ["M_BUCKET", "N_BUCKET", "TMA_OK", "HAS_BIAS", "SPLIT"]
    key = (8192, 1024, True, False, 3, "torch.bfloat16", "torch.bfloat16")
    assert _autotune.describe_key(names, key) == "bf16 M~8192 N~1024 TMA_OK SPLIT=3"


def test_writing_configs_merges_same_version_and_drops_others(tmp_path):
    path = tmp_path / "GPU.json"
    _autotune.write_shipped_configs(path, "GPU", {"k": ("fp1", {"(1,)": "a", "(2,)": "b"})})
    _autotune.write_shipped_configs(path, "GPU", {"k": ("fp1", {"(2,)": "c"})})
    assert _autotune.shipped_choices("k", "fp1", path) == {"(1,)": "a", "(2,)": "c"}
    _autotune.write_shipped_configs(path, "GPU", {"k": ("fp2", {"(3,)": "d"})})
    assert _autotune.shipped_choices("k", "fp2", path) == {"(3,)": "d"}


def test_a_merged_configs_file_names_every_run_that_timed_its_choices(tmp_path):
    # A probe's: after a second sweep was merged in, `about` named that sweep's run only.
    path = tmp_path / "GPU.json"
    _autotune.write_shipped_configs(path, "GPU", {"k": ("fp1", {"(1,)": "a"})}, {"sweep": "a.json", "runs": {"A": {}}})
    _autotune.write_shipped_configs(path, "GPU", {"k": ("fp1", {"(2,)": "b"})}, {"sweep": "b.json", "runs": {"B": {}}})
    assert sorted(json.loads(path.read_text())["about"]["runs"]) == ["A", "B"]


def test_a_sweep_cut_by_its_budget_writes_no_configs(tmp_path, monkeypatch, capsys):
    # A probe's: --budget-min with --write-configs shipped keys timed on part of their configs (a shipped key is
    # never tuned on a user's machine).
    cut = sweep.Outcome(tmp_path / "tune.json", Results("tune"), timed=2, left=18)
    monkeypatch.setattr(sweep, "sweep", lambda *a, **k: cut)
    configs = tmp_path / "configs"
    argv = ["--out", str(tmp_path / "tune.json"), "--write-configs", "--configs-dir", str(configs), "--grid", "tiny"]
    assert main(argv) == 1
    assert "18 timings are left" in capsys.readouterr().err and not configs.exists()


@pytest.mark.skipif(not _autotune.INTERPRET, reason="a GPU process would start a real sweep")
def test_write_configs_in_the_interpreter_needs_a_folder_of_its_own(capsys):
    # A probe's: TRITON_INTERPRET=1 without --dry-run wrote the interpreter's wall-clock choices into the package
    with pytest.raises(SystemExit) as exit_:
        main(["--write-configs", "--grid", "tiny"])
    assert exit_.value.code == 2 and "give --configs-dir" in capsys.readouterr().err


def test_write_configs_is_refused_before_timing_where_it_cannot_write(tmp_path, capsys):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["--write-configs", "--configs-dir", str(blocker / "configs"), "--grid", "tiny"])
    assert exit_.value.code == 2 and "cannot write the configs file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Grids, checks, plots, the command line
# ----------------------------------------------------------------------------------------------


def _buckets(shape):
    return tuple(bucket(v) for v in shape)


def test_default_grid_covers_the_benchmark_and_the_heldout_buckets():
    problems = grid.load("default", KERNELS)
    assert len(problems) == len(set(problems))
    covered = {(p.shape, p.dtype, p.layout, op) for p in problems for op in p.ops}
    for m, n, k in grid.BENCHMARK_SHAPES:
        for dtype in ("bf16", "fp16"):
            assert {(f"{m}x{n}x{k}", dtype, "matmul", op) for op in ("fwd", "fwd-nobias")} <= covered
    swept = {(m, n, k) for b in grid.GRIDS.values() for block in b for m, n, k in grid._sizes(block, "")}
    core = {_buckets((p.M, p.N, p.K)) for p in problems if {"fwd", "bwd"} <= set(p.ops) and p.dtype == "bf16"}
    for shape in grid.HELDOUT_SHAPES:
        assert shape not in swept and _buckets(shape) in core and all(v % 16 == 0 for v in shape)
    # the benchmarks' shapes are written twice (the library does not import experiments/): kept equal here
    from experiments import bench_matmul_relu, bench_quant

    assert [bench_matmul_relu.SHAPES[n] for n in bench_matmul_relu.DEFAULT] == grid.BENCHMARK_SHAPES
    assert list(bench_quant.SHAPES.values()) == grid.QUANT_BENCHMARK_SHAPES
    for m, n, k in grid.QUANT_BENCHMARK_SHAPES:
        assert {(f"{m}x{n}x{k}", dtype, "linear", "fwd") for dtype in ("int8", "fp8")} <= covered


def test_check_heldout_dry_run(swept, tmp_path, capsys):
    out = tmp_path / "heldout.json"
    args = ["--check-heldout", "--dry-run", "--shapes", "50x40x30", "--layouts", "linear", "--ops", "fwd,bwd",
            "--rounds", "1", "--configs-dir", str(swept[1]), "--out", str(out)]
    assert main(args) == 0
    results = Results.load(out)
    assert not results.failed, results.failed  # 50x40x30 falls in the tiny grid's buckets: all shipped
    assert {(r["op"], r["provider"]) for r in results.rows} == {
        (f"{p} linear", who) for p in ("fwd", "grad_a", "grad_b") for who in ("shipped", "exhaustive best")}
    assert "shipped/best" in capsys.readouterr().out
    # the file is there now (a sweep's, say): a check refuses it, or replaces it with --overwrite
    before = out.read_text()
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and "exists: --overwrite replaces it" in capsys.readouterr().err
    assert out.read_text() == before
    assert main(args + ["--overwrite"]) == 0
    # no shipped choice (an empty configs folder): the exhaustive search's best is kept beside the failure
    empty = tmp_path / "no-configs"
    empty.mkdir()
    assert main([a if a != str(swept[1]) else str(empty) for a in args] + ["--overwrite"]) == 0
    results = Results.load(out)
    assert {f["provider"] for f in results.failed} == {"shipped"}
    assert {r["provider"] for r in results.rows} == {"exhaustive best"} and all(r["config"] for r in results.rows)


def test_first_call_dry_run(swept, tmp_path, capsys):
    # Two fresh processes (cold, then warm Triton cache) in the interpreter: the shipped file answers the key.
    configs, second = _ship_second_configs(swept, tmp_path)
    out = tmp_path / "first.json"
    assert main(["--first-call", "--dry-run", "--shapes", "64x48x32", "--layouts", "linear",
                 "--configs-dir", str(configs), "--out", str(out)]) == 0
    results = Results.load(out)
    assert not results.failed, results.failed
    assert [r["provider"] for r in results.rows] == ["cold Triton cache", "warm Triton cache"]
    assert all(r["tunings"] == [] and r["configs"] == [second] and r["p50"] > 0 for r in results.rows)
    assert "keys tuned" in capsys.readouterr().out


def test_first_call_of_the_quantized_gemm_dry_run(swept, tmp_path, capsys):
    # The sweep ships the int8/fp8 GEMM's choices too: a fresh process's first call tunes nothing.
    out = tmp_path / "first.json"
    assert main(["--first-call", "--dry-run", "--kernel", "scaled_gemm", "--dtypes", "int8,fp8", "--shapes", "64x48x32",
                 "--configs-dir", str(swept[1]), "--out", str(out)]) == 0
    results = Results.load(out)
    assert not results.failed, results.failed
    assert [(r["dtype"], r["provider"]) for r in results.rows] == [
        (d, p) for d in ("int8", "fp8") for p in ("cold Triton cache", "warm Triton cache")]
    assert all(r["tunings"] == [] for r in results.rows)


def test_plots_from_the_sweep(swept, tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["--plot", str(swept[0]), "--plot-dir", str(tmp_path / "plots")]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    ops = ("fwd_linear", "fwd_matmul", "grad_a_linear", "grad_b_linear", "int8_fwd_linear", "fp8_fwd_linear")
    assert names == sorted(f"{op}-{kind}.png" for op in ops for kind in ("tflops", "ratio", "tiles"))


def test_plots_leave_a_dtype_without_some_k_blank(swept, tmp_path):
    # The real H200 grid times fp8 at K values bf16 never sees: a (dtype, K) panel with no cell is blank.
    pytest.importorskip("matplotlib")
    data = json.loads(swept[0].read_text())
    extra = [dict(r, dtype="fp16", shape=r["shape"].rsplit("x", 1)[0] + "x48", key=r["key"] + "-fp16")
             for r in data["rows"] if r["op"] == "fwd matmul"]
    data["rows"] += extra
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(data))
    assert main(["--plot", str(path), "--plot-dir", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "fwd_matmul-tflops.png").stat().st_size > 0


@pytest.mark.parametrize("argv,words", [
    (["--grid", "nope"], "not a built-in grid"),
    (["--budget-min", "0"], "must be > 0"),
    (["--budget-min", "soon"], "expected a positive number"),
    (["--jobs", "-1"], "must be >= 0"),
    (["--resume", "--overwrite"], "not allowed with"),
    (["--retry-failed"], "--retry-failed goes with --resume"),
    (["--check-heldout", "--first-call"], "not allowed with"),
    (["--check-heldout", "--shapes", "12x34"], "MxNxK"),
    (["--check-heldout", "--dtypes", "fp64"], "unknown dtypes ['fp64']"),
    (["--check-heldout", "--grid", "small"], "--grid is the sweep's"),
    (["--check-heldout", "--write-configs"], "the sweep's"),
    (["--shapes", "64x64x64"], "choose the checks' problems"),
    (["--first-call", "--budget-min", "3"], "the sweep's"),
    (["--dirty"], "give both"),
    (["--kernel", "scaled_gemm"], "--kernel chooses the checks' kernel"),
    (["--check-heldout", "--kernel", "scaled_gemm", "--dtypes", "bf16"], "unknown dtypes ['bf16']"),
    (["--plot", "missing.json"], "no such file"),
    (["--dry-run", "--write-configs"], "give --configs-dir"),
    (["--resume", "--out", "missing-sweep.json"], "nothing to continue"),
])
def test_bad_arguments_exit_with_a_clear_message(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("content,words", [
    ('[{"shapes": [[1, 2]], "dtypes": ["bf16"], "layouts": ["linear"], "ops": ["fwd"]}]', "must be [M, N, K]"),
    ('[{"M": [64], "N": [64], "dtypes": ["bf16"], "layouts": ["linear"], "ops": ["fwd"]}]', "no shapes and no K"),
    ('[{"shapes": [[8, 8, 8]], "dtypes": ["bf16"], "layouts": ["diagonal"], "ops": ["fwd"]}]', "unknown layouts"),
    ('[{"shapes": [[8, 8, 8]], "dtypes": ["bf16"], "layouts": ["linear"], "ops": ["fwd"], "x": 1}]', "unknown keys"),
    ('{"not": "a list"}', "non-empty list of blocks"),
    ("[{", "is not JSON"),
    ('[{"kernel": ["x"], "shapes": [[8, 8, 8]], "dtypes": ["bf16"], "layouts": ["linear"], "ops": ["fwd"]}]',
     "unknown kernel ['x']"),
])
def test_bad_grid_files_are_named(tmp_path, capsys, content, words):
    path = tmp_path / "grid.json"
    path.write_text(content)
    with pytest.raises(SystemExit):
        main(["--dry-run", "--grid", str(path), "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert words in err and str(path) in err


# ----------------------------------------------------------------------------------------------
# Found by a skeptical-user probe: lost results, full-size shapes in the interpreter, late errors
# ----------------------------------------------------------------------------------------------


def test_first_call_records_a_timed_out_case_and_saves_each_case(tmp_path):
    from fuselab.tune import checks

    problems = grid.problems([{"shapes": [[64, 48, 32], [20, 40, 24]], "dtypes": ["bf16"], "layouts": ["matmul"],
                               "ops": ["fwd"]}], KERNELS)
    saved = []
    results = checks.first_call(problems, sweep.Options(mode="wall"), None, timeout_s=0.01,
                                save=lambda r: saved.append(len(r.failed)))
    assert saved == [2, 4]  # after each case, each process timed out (it raised TimeoutExpired, losing all)
    assert {f["error"] for f in results.failed} == {"timed out after 0.01 s"}


class _FakeBuild:
    """Stands in for the build's Popen: makes the library in its cache, or fails."""
    fails = False

    def __init__(self, argv, env, **kwargs):
        self.cache, self.returncode, self.pid = Path(env["FUSELAB_CACHE_DIR"]), None, -1

    def communicate(self, timeout=None):
        if self.fails:
            self.returncode = 1
            return "", "error: no C++ compiler"
        (self.cache / "torch_extensions").mkdir(parents=True)
        (self.cache / "torch_extensions" / "built.so").write_text("")
        self.returncode = 0
        return "", ""

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("build_fails", [False, True])
def test_first_call_builds_the_cpp_path_once_and_each_case_starts_with_it(tmp_path, monkeypatch, build_fails):
    # The cold case measured the C++ eager path's one-time build (~25 s on the H200), not the shape's compile;
    # a build that fails is said, and the cases run with the path off (not rebuilding it inside each timing).
    from fuselab.tune import checks

    calls, seen, real_run = [], set(), subprocess.run

    def run(argv, env=None, **kwargs):
        if env is None:  # not the check's processes (git, for the run's environment)
            return real_run(argv, **kwargs)
        cache = Path(env["FUSELAB_CACHE_DIR"])
        assert (cache / "torch_extensions" / "built.so").is_file() != build_fails  # every case starts with it
        assert (env.get("FUSELAB_EAGER_CPP") == "0") == build_fails
        if cache not in seen:  # a case's cold process: nothing an earlier case tuned
            assert not (cache / "autotune").exists()
            seen.add(cache)
        (cache / "autotune").mkdir(exist_ok=True)
        calls.append("case")
        return subprocess.CompletedProcess(argv, 0, json.dumps({"seconds": 0.1, "tunings": [], "configs": []}), "")

    monkeypatch.setattr(_FakeBuild, "fails", build_fails)
    real_popen = subprocess.Popen  # subprocess.run (git, for the run's environment) opens one too
    monkeypatch.setattr(checks.subprocess, "Popen", lambda argv, env=None, **kw: _FakeBuild(argv, env) if env
                        else real_popen(argv, **kw))
    monkeypatch.setattr(checks.subprocess, "run", run)
    problems = grid.problems([{"shapes": [[64, 48, 32], [20, 40, 24]], "dtypes": ["bf16"], "layouts": ["matmul"],
                               "ops": ["fwd"]}], KERNELS)
    results = checks.first_call(problems, sweep.Options(mode="wall"), None, build_cpp=True)
    assert calls == ["case"] * 4
    if build_fails:
        assert [f["op"] for f in results.failed] == [checks.CPP_BUILD]
        assert "no C++ compiler" in results.failed[0]["error"]
        assert [r["op"] for r in results.rows] == ["fwd"] * 4
    else:
        assert [r["op"] for r in results.rows] == [checks.CPP_BUILD] + ["fwd"] * 4
        assert results.rows[0]["metric"] == "build s"


def test_dry_run_checks_default_to_the_tiny_shapes():
    from fuselab.tune.__main__ import _check_problems, parser

    for flag in ("--check-heldout", "--first-call"):
        args = parser().parse_args([flag, "--dry-run"])
        assert {(p.M, p.N, p.K) for p in _check_problems(None, args)} == set(grid.TINY_SHAPES)


@pytest.mark.parametrize("where,words", [("folder", "is a folder"), ("under a file", "cannot write under")])
def test_a_bad_out_is_refused_before_any_timing(tmp_path, capsys, where, words):
    (tmp_path / "file").write_text("")
    out = tmp_path if where == "folder" else tmp_path / "file" / "x.json"
    for argv in (["--dry-run"], ["--check-heldout", "--dry-run"]):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--out", str(out)])
        assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_plot_refuses_what_is_not_a_sweep(swept, tmp_path, capsys):
    for name, content in (("heldout.json", json.dumps({"study": "tune_heldout", "rows": []})),
                          ("grid.json", "[]"), ("broken.json", "{")):
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(SystemExit):
            main(["--plot", str(path)])
        err = capsys.readouterr().err
        assert "plots a sweep's results" in err or "not JSON" in err, err
        assert not (tmp_path / f"{path.stem}-plots").exists()


def test_results_and_configs_files_are_readable_by_others(tmp_path):
    from fuselab._io import write_json_atomic

    path = write_json_atomic(tmp_path / "new.json", {})
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # mkstemp's 0600 made shipped files private
    path.chmod(0o640)
    write_json_atomic(path, {"again": 1})
    assert path.stat().st_mode & 0o777 == 0o640  # a rewrite keeps the file's mode


def test_sigterm_to_the_dry_run_launcher_ends_its_interpreter_process(tmp_path):
    # --dry-run without TRITON_INTERPRET re-runs itself in a child process; a SIGTERM to the parent alone
    # left the child sweeping (and writing the results) on its own.
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSELAB_CACHE_DIR"] = str(tmp_path / "cache")
    parent = subprocess.Popen([sys.executable, "-m", "fuselab.tune", "--dry-run", "--out", str(tmp_path / "r.json")],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")

    def interpreter_child():  # not another short-lived child (a library's ldconfig, say): the test sent too early
        for pid in children.read_text().split():
            try:  # its environment once it runs (a fork not yet exec'd still holds the parent's)
                if b"TRITON_INTERPRET=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return int(pid)
            except OSError:  # gone meanwhile
                pass
        return None

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and interpreter_child() is None:
        time.sleep(0.05)
    child = interpreter_child()
    assert child is not None, "the dry run started no interpreter process within 60 s"
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=120) in (130, 143)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_shipped_configs_belong_to_the_current_kernels():
    # A kernel (or its configs, pruning, library choices, their timing rule) edited after the sweep makes the
    # GPU's shipped choices stale: they are ignored and users tune again. Fingerprints as a GPU process
    # computes them (not under the interpreter, whose configs differ).
    code = ("import json, importlib; print(json.dumps({k.base_fn.__name__: k.fingerprint for k in ("
            "importlib.import_module('fuselab.kernels.matmul_relu_triton').matmul_relu_kernel, "
            "importlib.import_module('fuselab.quant._scaled_gemm').scaled_gemm_kernel)}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    current = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                        check=True).stdout)
    for path in sorted(_autotune.SHIPPED_CONFIGS_DIR.glob("*.json")):
        for kernel, entry in json.loads(path.read_text())["kernels"].items():
            assert entry["fingerprint"] == current[kernel], (
                f"{path.name}: {kernel} was swept as {entry['fingerprint']}, the kernel is now {current[kernel]}: "
                "sweep again on that GPU (python -m fuselab.tune --write-configs)")
