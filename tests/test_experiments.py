"""The experiment harness, the scripts' command lines and outputs, and the report, on a CPU."""
import importlib
import json
import re
import shutil
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch

from experiments import (
    bench_matmul_relu,
    bench_quant,
    compile_speedup,
    distill_quantize,
    harness,
    host_overhead,
    model_eager,
    report,
    sparse_embedding,
    sweep_cuda_tiles,
    train_mlp,
)
from experiments import data as datasets
from experiments.harness import Providers, Results, Timing

COMMITTED = sorted(harness.RESULTS.glob("*.json"))


@pytest.fixture
def outdirs(tmp_path, monkeypatch):
    """runs/ and results/ redirected: a test never writes the repository's files."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    monkeypatch.setattr(harness, "RUNS", runs)
    monkeypatch.setattr(harness, "RESULTS", results)
    return runs, results


@pytest.fixture
def no_fashion_mnist(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "FASHION_MNIST", tmp_path / "no-fashion-mnist")
    monkeypatch.setattr(datasets, "CACHE", tmp_path / "cache")


def usage_error(capsys, main, argv):
    """main(argv) must stop with argparse's usage error (exit status 2); its message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, f"{argv}: exit status {exc.value.code}, not a usage error"
    return capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Harness
# ----------------------------------------------------------------------------------------------


def test_timing_quantiles_and_conversions():
    t = Timing.of([float(v) for v in [7, 1, 9, 3, 5, 2, 10, 4, 8, 6]])
    assert (t.p20, t.p50, t.p80) == (3.0, 6.0, 9.0)
    assert Timing.of([2.5]) == Timing(2.5, 2.5, 2.5) == Timing.exact(2.5)
    rate = Timing(1.0, 2.0, 4.0).scaled(8.0)  # work / time: the fastest time is the highest rate
    assert (rate.p20, rate.p50, rate.p80) == (2.0, 4.0, 8.0)
    assert Timing(1.0, 2.0, 4.0).converted(1e3) == Timing(1e3, 2e3, 4e3)


def test_time_call_on_a_cpu():
    calls = []
    for mode in ("wall", "host"):
        t = harness.time_call(lambda: calls.append(1), mode, iters=20, warmup_iters=2)
        assert 0 <= t.p20 <= t.p50 <= t.p80
    assert len(calls) >= 2 * (1 + 2 + 20)
    calls.clear()  # host mode takes iters calls too when iters < 10 (a turn of a few steps stays a few steps)
    harness.time_call(lambda: calls.append(1), "host", iters=3, warmup_iters=0)
    assert len(calls) == 1 + 3
    with pytest.raises(ValueError, match="mode must be one of"):
        harness.time_call(lambda: None, "turbo")
    if not torch.cuda.is_available():
        for mode in ("eager", "graph"):
            with pytest.raises(RuntimeError, match="needs a CUDA device"):
                harness.time_call(lambda: None, mode)
    # grad_to_none: each timed backward writes its gradient instead of accumulating into the last one
    x = torch.ones(3, requires_grad=True)
    harness.time_call(lambda: (2 * x).sum().backward(), "wall", iters=5, grad_to_none=[x])
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_time_alternating_takes_turns_and_reports_the_median_round(monkeypatch):
    order, clock = [], iter([5.0, 1.0, 2.0, 9.0, 3.0, 4.0])  # a's and b's rounds: a 5 9 3, b 1 2 4

    def fake_time_call(fn, mode, **kw):
        fn()
        t = next(clock)
        return Timing(t - 1, t, t + 1)

    monkeypatch.setattr(harness, "time_call", fake_time_call)
    got = harness.time_alternating({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, "wall", 3)
    assert order == ["a", "b", "b", "a", "a", "b"]  # every other round reversed: neither always goes first
    assert got["a"] == (Timing(4.0, 5.0, 6.0), [5.0, 9.0, 3.0]) and got["b"] == (Timing(1.0, 2.0, 3.0), [1.0, 2.0, 4.0])
    clock = iter([4.0, 2.0])  # one round: its own timing; an even count: the median averages the middle two
    assert harness.time_alternating({"a": lambda: None}, "wall", 1)["a"] == (Timing(3.0, 4.0, 5.0), [4.0])
    clock = iter([1.0, 2.0, 3.0, 5.0])
    assert harness.time_alternating({"a": lambda: None, "b": lambda: None}, "wall", 2)["a"][0].p50 == 3.0
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        harness.time_alternating({"a": lambda: None}, "wall", 0)


def test_rotating_inputs_exceed_the_budget_and_cycle():
    sets = harness.rotating(lambda: (torch.empty(256),), min_bytes=4096)  # 1 KiB a set
    assert len(sets) == 4 and len({s[0].data_ptr() for s in sets}) == 4
    assert len(harness.rotating(lambda: (torch.empty(256),), min_bytes=2**30, max_sets=3)) == 3
    seen = []
    call = harness.cycle(lambda t: seen.append(t.data_ptr()), sets)
    for _ in range(8):
        call()
    assert seen == [s[0].data_ptr() for s in sets] * 2
    assert harness.rel_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0
    assert harness.rel_error(torch.tensor([3.0, 4.0]), torch.zeros(2)) == 5.0


def test_providers_baseline_rules():
    p = Providers()
    p.register("base", baseline=True)(lambda: 1)
    p.register("other")(lambda: 2)
    assert p.baseline == "base" and list(p.select(None)) == ["base", "other"]
    with pytest.raises(ValueError, match="two baselines"):
        p.register("second", baseline=True)(lambda: 3)
    with pytest.raises(ValueError, match="registered twice"):
        p.register("other")(lambda: 4)
    with pytest.raises(ValueError, match=r"unknown provider\(s\) \['nope'\]"):
        p.select(["nope"])
    res = Results("s")
    res.set_baseline("op", p)
    assert res.baselines == {"op": "base"}
    with pytest.raises(ValueError, match="no baseline"):
        res.set_baseline("op", Providers())
    # every script's registries name exactly one baseline, the peer its ratios are taken against
    assert (bench_matmul_relu.FWD.baseline, bench_matmul_relu.NO_BIAS.baseline, bench_matmul_relu.FWD_BWD.baseline) \
        == ("cuBLASLt", "relu(mm)", "autograd")
    assert compile_speedup.OPT.baseline == "opt" and host_overhead.CALLS.baseline == "relu(addmm)"
    assert train_mlp.PROVIDERS.baseline == "stock" and sweep_cuda_tiles.PROVIDERS.baseline == "cuBLAS relu(mm)"


def _row(res, provider, value, metric="ms", mode="eager", **keys):
    res.record(op=keys.pop("op", "fwd"), provider=provider, shape=keys.pop("shape", "8x8x8"), dtype="bf16",
               mode=mode, metric=metric, value=value, **keys)


def test_results_save_merge_load_round_trip(tmp_path):
    path = tmp_path / "s.json"
    first = Results("s")
    first.set_baseline("fwd", "base")
    _row(first, "base", Timing(1.0, 2.0, 3.0))
    _row(first, "new", 1.0)
    _row(first, "new", 5.0, shape="16x16x16")
    first.fail(op="fwd", provider="new", shape="32x32x32", dtype="bf16", mode="graph", error=RuntimeError("oom\nmore"))
    first.save(path)
    loaded = Results.load(path)
    assert loaded.to_json() == json.loads(path.read_text()) == first.to_json()
    assert loaded.failed[0]["error"] == "RuntimeError: oom" and loaded.rows[0]["p20"] == 1.0
    assert set(loaded.runs) == {first.run_id} and loaded.runs[first.run_id]["commit"]

    second = Results("s")  # re-measures one row and the failed configuration; merges
    _row(second, "new", 0.5)
    _row(second, "new", 9.0, shape="32x32x32", mode="graph")
    second.save(path, merge=True)
    merged = Results.load(path)
    values = {(r["provider"], r["shape"], r["mode"]): (r["p50"], r["run"]) for r in merged.rows}
    assert values == {("base", "8x8x8", "eager"): (2.0, first.run_id),
                      ("new", "16x16x16", "eager"): (5.0, first.run_id),
                      ("new", "8x8x8", "eager"): (0.5, second.run_id),
                      ("new", "32x32x32", "graph"): (9.0, second.run_id)}
    assert merged.failed == [] and merged.baselines == {"fwd": "base"}
    assert set(merged.runs) == {first.run_id, second.run_id}
    third = Results("s")  # a configuration that worked and fails now: its old figure goes, the failure stays
    third.fail(op="fwd", provider="new", shape="16x16x16", dtype="bf16", mode="eager", error="does not compile")
    third.save(path, merge=True)
    after = Results.load(path)
    assert ("new", "16x16x16") not in {(r["provider"], r["shape"]) for r in after.rows}
    assert [f["error"] for f in after.failed] == ["does not compile"] and len(after.rows) == 3

    alone = Results("s")  # without merge a run stands alone, and runs no row uses are dropped
    _row(alone, "base", 1.0)
    alone.save(path)
    reloaded = Results.load(path)
    assert [r["run"] for r in reloaded.rows] == [alone.run_id] and list(reloaded.runs) == [alone.run_id]
    with pytest.raises(ValueError, match="holds study 's'"):
        Results("other").save(path, merge=True)
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a fuselab results file"):
        Results.load(path)
    # malformed files the report rendered ("fwd nan vs 26 us") or crashed on halfway through its pages
    good = alone.to_json()
    for bad, words in (({"p50": float("nan")}, "non-finite"), ({"p20": 5.0}, "out of order")):
        path.write_text(json.dumps({**good, "rows": [dict(good["rows"][0], **bad)]}))
        with pytest.raises(ValueError, match=words):
            Results.load(path)
    path.write_text(json.dumps({**good, "failed": [{"op": "fwd", "error": "x", "run": "nobody"}]}))
    with pytest.raises(ValueError, match="failure 0 is not a failure of one of the file's runs"):
        Results.load(path)
    path.write_text(json.dumps({**good, "baselines": ["fwd"]}))
    with pytest.raises(ValueError, match="baselines a mapping"):
        Results.load(path)


def test_a_cpu_run_merged_into_a_gpu_file_goes_beside_its_rows(tmp_path):
    # A `--device cpu --merge` run replaced the GPU rows of the same labels, and its run named the GPU host:
    # the page then showed CPU times as the H200's. Rows now merge per measuring device (sizes excepted).
    path = tmp_path / "s.json"
    gpu = Results("sparse_embedding")
    gpu.start_run({**harness.environment(), "gpu": "NVIDIA H200", "device": "cuda"})
    gpu.set_baseline("movielens MF", "SparseAdam")
    for provider, ms in (("SparseAdam", 2.0), ("SparseAdamW", 1.0)):
        _row(gpu, provider, ms, metric="ms/step", op="movielens MF", mode="wall")
    _row(gpu, "bytes floor", 7.0, metric="MB", op="step", mode="floor")
    gpu.save(path)
    legacy = json.loads(path.read_text())  # a file written before runs recorded their device
    del legacy["runs"][gpu.run_id]["device"]
    path.write_text(json.dumps(legacy))
    cpu = Results("sparse_embedding", device=torch.device("cpu"))
    for provider, ms in (("SparseAdam", 40.0), ("SparseAdamW", 10.0)):
        _row(cpu, provider, ms, metric="ms/step", op="movielens MF", mode="wall")
    _row(cpu, "bytes floor", 7.5, metric="MB", op="step", mode="floor")
    cpu.save(path, merge=True)
    merged = Results.load(path)
    assert merged.runs[cpu.run_id]["device"] == "cpu" and merged.device_of(merged.select(provider="SparseAdam")[0]) == "cuda"
    times = sorted((merged.device_of(r), r["provider"], r["p50"]) for r in merged.select(metric="ms/step"))
    assert times == [("cpu", "SparseAdam", 40.0), ("cpu", "SparseAdamW", 10.0),
                     ("cuda", "SparseAdam", 2.0), ("cuda", "SparseAdamW", 1.0)]
    assert [r["p50"] for r in merged.select(metric="MB")] == [7.5]  # what no device changes: replaced
    page = report.render_study(merged, report.Spec("Demo", ""))
    assert "| device | shape | SparseAdam | SparseAdamW | SparseAdamW x SparseAdam | run |" in page
    assert "| cuda | 8x8x8 | 2.00 | 1.00 | 2.000 |" in page and "| cpu | 8x8x8 | 40.0 | 10.0 | 4.000 |" in page
    assert report.main_device(merged).devices() == ["cuda"]
    line = report.sparse_headline(report.main_device(merged))
    assert line[1] == "2.00x wall" and "NVIDIA H200" in line[2]
    again = Results("sparse_embedding", device="cpu")  # the same device again: replaced as before
    _row(again, "SparseAdamW", 20.0, metric="ms/step", op="movielens MF", mode="wall")
    again.save(path, merge=True)
    assert sorted(r["p50"] for r in Results.load(path).select(provider="SparseAdamW")) == [1.0, 20.0]


def test_a_resumed_runs_curve_merges_beside_its_first_part(tmp_path):
    # --merge matched rows without their step: a resumed training run's loss rows replaced the first part's curve.
    # Matched by step alone, a fresh run's shorter curve would splice into another run's: only one training run's
    # parts go beside each other.
    path = tmp_path / "t.json"

    def run(steps, training_run):
        res = Results("train_fsdp")
        res.annotate(training_run=training_run)
        for step in steps:
            _row(res, "fsdp", float(step), metric="loss", mode="wall", step=step)
        _row(res, "fsdp", float(len(steps)), metric="tokens/s", mode="wall")
        return res

    run((2, 4, 6), "first").save(path)
    resumed = run((6, 8), "first")
    resumed.save(path, merge=True)
    rows = Results.load(path).rows
    assert sorted((r["step"], r["run"] == resumed.run_id) for r in rows if r["metric"] == "loss") == [
        (2, False), (4, False), (6, True), (8, True)]  # the step saved again: the resumed run's
    assert [r["p50"] for r in rows if r["metric"] == "tokens/s"] == [2.0]
    fresh = run((2,), "another")  # a new run of the same labels replaces the whole curve
    fresh.save(path, merge=True)
    assert [(r["step"], r["run"]) for r in Results.load(path).rows if r["metric"] == "loss"] == [(2, fresh.run_id)]


def test_save_is_atomic(tmp_path):
    path = tmp_path / "s.json"
    res = Results("s")
    _row(res, "base", 1.0)
    res.save(path)
    before = path.read_text()

    def broken_dump(obj, f, **kw):
        f.write('{"half": ')
        raise KeyboardInterrupt

    _row(res, "new", 2.0)
    with mock.patch("fuselab._io.json.dump", broken_dump), pytest.raises(KeyboardInterrupt):
        res.save(path)
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_pivot_ratios():
    res = Results("s")
    _row(res, "base", 2.0)
    _row(res, "new", 1.0)
    _row(res, "new", 4.0, shape="16x16x16")
    header, lines = harness.pivot_rows(res.rows, ["shape"], baseline="base")
    assert header == ["shape", "base", "new", "new x base"]
    assert lines == [["8x8x8", 2.0, 1.0, 2.0], ["16x16x16", None, 4.0, None]]  # ms: baseline / provider
    rates = Results("s")
    _row(rates, "base", 100.0, metric="TFLOP/s")
    _row(rates, "new", 150.0, metric="TFLOP/s")
    assert harness.pivot_rows(rates.rows, ["shape"], baseline="base", higher_is_better=True)[1] == [
        ["8x8x8", 100.0, 150.0, 1.5]]
    assert "| 8x8x8 | 100.00 | 150.00 | 1.50 |" in harness.pivot(rates.rows, ["shape"], baseline="base",
                                                                   higher_is_better=True)
    assert harness.geomean([1.0, 4.0]) == pytest.approx(2.0)


def test_output_goes_to_runs_unless_asked(outdirs):
    runs, results = outdirs
    import argparse

    p = argparse.ArgumentParser()
    harness.add_output_args(p)
    assert harness.output_path(p.parse_args([]), "s") == runs / "s.json"
    assert harness.output_path(p.parse_args(["--results"]), "s") == results / "s.json"
    assert harness.output_path(p.parse_args(["--out", "x.json"]), "s") == Path("x.json")
    with pytest.raises(SystemExit, match="exclusive"):
        harness.output_path(p.parse_args(["--out", "x.json", "--results"]), "s")


def test_results_are_only_merged_into_and_smoke_runs_stay_out(outdirs):
    # Found by a probe: `train_fsdp --tiny --device cpu --results` replaced the committed H200 rows by a CPU smoke
    # run's (the README's MFU headline went with them); partial runs (--quick, a budget, an interrupt) dropped
    # the rest of a study. results/ is only merged into now, and smoke runs are refused there.
    import argparse

    _, results = outdirs
    p = argparse.ArgumentParser()
    harness.add_output_args(p)
    p.add_argument("--tiny", action="store_true")
    with pytest.raises(SystemExit, match="--tiny is a smoke run"):
        harness.output_path(p.parse_args(["--tiny", "--results", "--merge"]), "s")
    with pytest.raises(SystemExit, match="--sizes tiny is a smoke run"):
        harness.output_path(p.parse_args(["--results"]), "s", smoke="--sizes tiny")
    assert harness.output_path(p.parse_args(["--tiny"]), "s").name == "s.json"  # runs/: fine
    gpu = Results("s", device="cuda")  # a GPU run's rows, and one this CPU run measures again
    _row(gpu, "base", 1.0)
    _row(gpu, "other", 2.0)
    gpu.save(results / "s.json")
    args = p.parse_args(["--results"])
    path = harness.output_path(args, "s")
    assert path == results / "s.json" and args.merge
    cpu = Results("s", device="cpu")
    _row(cpu, "base", 3.0)
    cpu.save(path, merge=args.merge)
    assert sorted((r["provider"], r["p50"]) for r in Results.load(path).rows) == [("base", 1.0), ("base", 3.0),
                                                                                  ("other", 2.0)]
    with pytest.raises(SystemExit, match="holds study 's', not 't'"):
        harness.output_path(p.parse_args(["--out", str(path), "--merge"]), "t")
    # --out into results/ is held to the same rules (a probe's: `train_ddp --tiny --out results/train_ddp.json`
    # replaced the committed H200 rows, and the docs published the smoke run)
    with pytest.raises(SystemExit, match="--tiny is a smoke run"):
        harness.output_path(p.parse_args(["--tiny", "--out", str(results / "s.json")]), "s")
    args = p.parse_args(["--out", str(results / "s.json")])
    assert harness.output_path(args, "s") == results / "s.json" and args.merge


# ----------------------------------------------------------------------------------------------
# Command lines (issue 14, item 10)
# ----------------------------------------------------------------------------------------------

BAD_ARGS = [
    (train_mlp, "--epochs", "0"), (train_mlp, "--epochs", "-3"), (train_mlp, "--batch", "0"),
    (train_mlp, "--hidden", "0"), (train_mlp, "--hidden", "-1"), (train_mlp, "--epochs", "two"),
    (train_mlp, "--lr", "0"), (train_mlp, "--timed-steps", "0"),
    (compile_speedup, "--iters", "0"), (compile_speedup, "--passes", "0"), (compile_speedup, "--warmup", "-1"),
    (compile_speedup, "--budget-min", "0"), (bench_matmul_relu, "--rep-ms", "0"),
    (host_overhead, "--shapes", "0x8x8"), (host_overhead, "--shapes", "8x8"),
    (bench_quant, "--rep-ms", "0"), (bench_quant, "--budget-min", "0"), (bench_quant, "--tokens", "8x0"),
    (model_eager, "--iters", "4"), (model_eager, "--warmup", "-1"),
]


@pytest.mark.parametrize("module, flag, value", BAD_ARGS, ids=[f"{m.__name__.split('.')[-1]} {f} {v}"
                                                               for m, f, v in BAD_ARGS])
def test_bad_sizes_are_usage_errors(capsys, outdirs, module, flag, value):
    err = usage_error(capsys, module.main, [flag, value])
    assert flag in err and value in err
    assert not outdirs[0].exists() and not outdirs[1].exists()


def test_unknown_names_are_usage_errors(capsys):
    for plan, field in (("opt:train:fp32:turbo", "unknown modes"), ("gpt:train:fp32:eager", "unknown models"),
                        ("opt:train:fp8:eager", "unknown precisions"), ("opt:train", "must be models:tasks")):
        assert field in usage_error(capsys, compile_speedup.main, ["--plan", plan])


@pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")
def test_gpu_only_modes_refuse_a_cpu_at_once(outdirs):
    # Each exits with a message before any work: nothing measured, nothing built, nothing written.
    with mock.patch.object(bench_matmul_relu, "measure", side_effect=AssertionError("measured")), \
            mock.patch.object(host_overhead, "measure", side_effect=AssertionError("measured")), \
            mock.patch.object(sweep_cuda_tiles.subprocess, "Popen", side_effect=AssertionError("built")), \
            mock.patch.object(train_mlp, "load", side_effect=AssertionError("loaded")), \
            mock.patch.object(compile_speedup, "run_one", side_effect=AssertionError("ran")):
        for main, argv in ((bench_matmul_relu.main, ["--quick"]), (bench_matmul_relu.main, ["--cuda"]),
                           (host_overhead.main, []), (sweep_cuda_tiles.main, []),
                           (train_mlp.main, ["--device", "cuda"]),
                           (compile_speedup.main, ["--device", "cuda", "--plan", "opt:infer:fp32:eager"]),
                           (compile_speedup.main, [])):  # the full grid, device unsaid: it ran on the CPU for hours
            with pytest.raises(SystemExit, match="need(s)? a CUDA GPU") as exc:
                main(argv)
            assert exc.value.code != 0
    assert not outdirs[0].exists() and not outdirs[1].exists()


def test_an_unreadable_device_is_a_usage_error(capsys, outdirs):
    # One parse for every experiment's --device (harness.parse_device): torch's reason, before any work.
    for main in (train_mlp.main, compile_speedup.main, sparse_embedding.main, distill_quantize.main):
        err = usage_error(capsys, main, ["--device", "gpu0"])
        assert "'gpu0'" in err and "device" in err
        err = usage_error(capsys, main, ["--device", "meta"])  # torch reads it; the studies cannot run there
        assert "'meta'" in err and "cpu" in err and "cuda" in err
    assert not outdirs[0].exists() and not outdirs[1].exists()


def test_a_wrong_bpe_path_is_refused_even_with_the_ids_cached(tmp_path, monkeypatch):
    # A bad --sdist was ignored once the corpus's ids were cached ("saved 3,553,633 GPT-2 ids")
    monkeypatch.setattr(datasets, "CACHE", tmp_path / "cache")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world")
    key = f"{corpus.resolve()}|*.txt|1|{(corpus / 'a.txt').stat().st_size}"
    cached = datasets.cache_dir() / f"gpt2-{abs(datasets.hash_text(key)):016x}.pt"
    cached.parent.mkdir(parents=True)
    torch.save(torch.tensor([1, 2, 50256]), cached)
    assert datasets.gpt2_tokens(corpus).tolist() == [1, 2, 50256]  # the default file: the cache serves
    with pytest.raises(datasets.DataNotFound, match="no GPT-2 BPE file at .*nonexistent"):
        datasets.gpt2_tokens(corpus, sdist=tmp_path / "nonexistent")
    # a file that is there but is not the sdist (another wheel, a corrupt download): named, not a tarfile traceback
    (tmp_path / "other.tar.gz").write_bytes(b"not a tar file")
    with pytest.raises(datasets.DataNotFound, match="is not whisper's sdist holding whisper/assets/gpt2.tiktoken"):
        datasets.gpt2_tokens(corpus, sdist=tmp_path / "other.tar.gz")


def test_explicit_data_must_exist_and_be_whole(capsys, tmp_path, outdirs, monkeypatch):
    monkeypatch.setattr(datasets, "CACHE", tmp_path / "cache")
    missing = tmp_path / "missing"
    err = usage_error(capsys, train_mlp.main, ["--data", str(missing), "--epochs", "1"])
    assert f"--data {missing}" in err and "no Fashion-MNIST" in err
    partial = tmp_path / "partial"  # one of Debian's four files: named, nothing unpacked
    partial.mkdir()
    (partial / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip")
    err = usage_error(capsys, train_mlp.main, ["--data", str(partial), "--epochs", "1"])
    assert f"Fashion-MNIST at {partial} is incomplete: no train-labels-idx1-ubyte.gz, t10k-images" in err
    assert not (tmp_path / "cache").exists()
    corrupt = tmp_path / "corrupt"  # Debian's layout, files that are not gzip
    corrupt.mkdir()
    for name in datasets.FASHION_MNIST_FILES:
        (corrupt / name).write_bytes(b"not gzip")
    for _ in range(2):  # the failed unpacking leaves nothing a second attempt would trust
        err = usage_error(capsys, train_mlp.main, ["--data", str(corrupt), "--epochs", "1"])
        assert "corrupt" in err and str(corrupt) in err
    raw = tmp_path / "tv" / "FashionMNIST" / "raw"  # a torchvision root whose files are garbage
    raw.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (raw / name).write_bytes(b"\x00" * 64)
    assert "corrupt" in usage_error(capsys, train_mlp.main, ["--data", str(tmp_path / "tv"), "--epochs", "1"])
    from test_distill_quantize import _idx

    mixed = tmp_path / "mixed"  # found by a probe: 10k labels beside 60k images was an IndexError mid-training
    mixed.mkdir()
    for prefix, images, labels in (("train", 20, 10), ("t10k", 10, 10)):
        _idx(mixed / f"{prefix}-images-idx3-ubyte.gz", torch.zeros(images, 28, 28, dtype=torch.uint8))
        _idx(mixed / f"{prefix}-labels-idx1-ubyte.gz", torch.zeros(labels, dtype=torch.uint8))
    err = usage_error(capsys, train_mlp.main, ["--data", str(mixed), "--epochs", "1"])
    assert "corrupt" in err and "train split has 20 images and 10 labels" in err
    assert not outdirs[0].exists()


def test_train_mlp_falls_back_to_digits_only_without_data(capsys, outdirs, no_fashion_mnist):
    res = train_mlp.main(["--epochs", "4", "--batch", "128", "--lr", "1e-2", "--hidden", "32", "--timed-steps", "3",
                          "--device", "cpu"])
    assert "Using scikit-learn's 8x8 digits instead" in capsys.readouterr().out
    saved = Results.load(outdirs[0] / "train_mlp.json")  # runs/, not the committed results/
    assert not outdirs[1].exists() and saved.to_json() == res.to_json()
    acc = {r["provider"]: r["p50"] for r in saved.select(metric="test accuracy")}
    assert acc["stock"] > 0.7 and abs(acc["stock"] - acc["fuse_linear_relu"]) < 0.05
    assert {r["shape"] for r in saved.rows} == {"sklearn digits, 64-32-32-10, batch 128"}
    assert len(saved.select(metric="ms/step")) == 2 and saved.baselines == {"train on cpu": "stock"}


def test_quickstart_checks_against_float64(capsys, outdirs):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the quickstart also times and trains: see make demo")
    from experiments import quickstart

    quickstart.main(["--skip-mlp"])
    saved = Results.load(outdirs[0] / "quickstart.json")
    err = {(r["dtype"], r["provider"]): r["p50"] for r in saved.select(metric="max rel err")}
    assert set(err) == {(d, p) for d in ("fp32", "fp16", "bf16") for p in ("torch", "fuselab")}
    assert err["fp32", "fuselab"] < 1e-5
    assert all(err[d, "fuselab"] < 4 * err[d, "torch"] for d in ("fp16", "bf16"))
    quickstart.main(["--skip-mlp"])  # seeded: the same figures again (the pass bar moved from draw to draw)
    again = Results.load(outdirs[0] / "quickstart.json").select(metric="max rel err")
    assert {(r["dtype"], r["provider"]): r["p50"] for r in again} == err


def test_quickstart_checks_stage_twos_data_first(capsys, outdirs, tmp_path):
    from experiments import quickstart

    err = usage_error(capsys, quickstart.main, ["--data", str(tmp_path / "missing")])
    assert "no Fashion-MNIST" in err and "Stage 1" not in capsys.readouterr().out
    assert not outdirs[0].exists()  # stage 1 neither ran nor saved


# ----------------------------------------------------------------------------------------------
# The compile study
# ----------------------------------------------------------------------------------------------


def run_compile(tmp_path, plan, *extra):
    return compile_speedup.main(["--tiny", "--device", "cpu", "--plan", plan, "--warmup", "0", "--iters", "1",
                                 "--out", str(tmp_path / "cs.json"), *extra])


def test_model_eager_times_stock_and_patched_decoders(tmp_path, monkeypatch, capsys):
    # Every configuration is timed (wall and host) before any diagnosis, with the stock decoder as the baseline.
    # The fused op's PyTorch bodies: this checks the study's machinery, not the kernel (the interpreter is slow).
    monkeypatch.setattr(importlib.import_module("fuselab.kernels.matmul_relu_triton"), "_runs_triton", lambda t: False)
    timed, time_call = [], model_eager.harness.time_call

    def recording(fn, mode, **kwargs):
        if mode == "wall":
            timed.append(fn)
        return time_call(fn, mode, **kwargs)

    monkeypatch.setattr(model_eager.harness, "time_call", recording)
    res = model_eager.main(["--sizes", "tiny", "--tokens", "1x8", "--device", "cpu", "--iters", "1", "--warmup", "0",
                            "--rounds", "3", "--out", str(tmp_path / "me.json")])
    # per task, the two variants' rounds alternate: a b, b a, a b (drift hits both alike)
    for task in range(2):
        a, b = timed[6 * task:6 * task + 2]
        assert a is not b and timed[6 * task:6 * task + 6] == [a, b, b, a, a, b]
    assert res.baselines == {"infer": "stock", "train": "stock"}
    assert {r["dtype"] for r in res.rows} == {"fp32"}  # the CPU's models run in fp32 (they were labelled bf16)
    for task in ("infer", "train"):
        for variant in ("stock", "fuselab"):
            row = res.select(op=task, provider=variant, metric="ms")
            assert len(row) == 1 and len(row[0]["rounds"]) == 3 and row[0]["p50"] == sorted(row[0]["rounds"])[1]
            host = res.select(op=task, provider=variant, metric="host ms")
            assert len(host) == 1 and len(host[0]["rounds"]) == 3 and host[0]["p50"] > 0
    assert Results.load(tmp_path / "me.json").to_json() == res.to_json()
    # the real sizes on a CPU: refused (they ran the whole OPT grid for many minutes)
    assert "--sizes tiny for a smoke run" in usage_error(capsys, model_eager.main, ["--device", "cpu"])


@pytest.mark.slow
def test_compile_speedup_smoke(tmp_path):
    # The study's machinery end to end on a tiny patched decoder: inductor compiles it with no graph break.
    res = run_compile(tmp_path, "opt+fuselab:train:fp32:eager,default")
    assert res.value(op="opt train", provider="opt+fuselab", mode="default", metric="graph breaks") == 0
    assert res.value(op="opt train", provider="opt+fuselab", mode="eager", metric="graph breaks") is None
    assert {r["mode"] for r in res.select(metric="ms/step")} == {"eager", "default"}
    assert Results.load(tmp_path / "cs.json").to_json() == res.to_json()


def test_compile_speedup_relu_bound_and_tf32(tmp_path):
    # opt-norelu is the stock decoder without its ReLU (the bound on what fusing it can save); tf32
    # sets the matmul precision for its own configuration, and main() restores it.
    model, *_ = compile_speedup.build("opt-norelu", True, torch.device("cpu"))
    assert all(type(layer.activation_fn) is torch.nn.Identity for layer in model.model.decoder.layers)
    stock, *_ = compile_speedup.build("opt", True, torch.device("cpu"))
    assert all(type(layer.activation_fn) is torch.nn.ReLU for layer in stock.model.decoder.layers)
    before = torch.get_float32_matmul_precision()
    seen = []
    with mock.patch.object(compile_speedup, "add_pass",
                           lambda measured, config, one: seen.append(torch.get_float32_matmul_precision())):
        run_compile(tmp_path, "opt-norelu:infer:tf32,fp32:eager")
    assert seen == ["high", "highest"] and torch.get_float32_matmul_precision() == before


def test_compile_speedup_records_a_failed_configuration(tmp_path):
    # One configuration failing (OOM, a compiler error) is recorded in `failed`; the others still run.
    run_one = compile_speedup.run_one

    def flaky(model, mode, *rest):
        if mode == "default":
            raise RuntimeError("out of memory\ntraceback...")
        return run_one(model, mode, *rest)

    with mock.patch.object(compile_speedup, "run_one", flaky):
        res = run_compile(tmp_path, "opt:infer:fp32:default,eager")
    assert {r["mode"] for r in res.rows} == {"eager"}
    saved = Results.load(tmp_path / "cs.json")
    assert [(f["op"], f["provider"], f["mode"], f["error"]) for f in saved.failed] == [
        ("opt infer", "opt", "default", "RuntimeError: out of memory")]
    assert "RuntimeError: out of memory" in report.render_study(saved)
    run_compile(tmp_path, "opt:infer:fp32:default", "--merge")  # measured now: the failure is gone
    saved = Results.load(tmp_path / "cs.json")
    assert saved.failed == [] and [r["mode"] for r in saved.select(metric="ms/step")] == ["eager", "default"]


def test_compile_speedup_merge_runs_in_pieces(tmp_path):
    # --merge keeps the configurations a run skips and replaces the ones it measures; rows name their run.
    def ms(res):
        return [(r["provider"], r["p50"], r["run"]) for r in res.select(metric="ms/step")]

    first = ms(run_compile(tmp_path, "opt:infer:fp32:eager"))
    run_compile(tmp_path, "resnet50:infer:fp32:eager", "--merge")
    both = ms(Results.load(tmp_path / "cs.json"))
    assert [p for p, *_ in both] == ["opt", "resnet50"] and both[0] == first[0]
    run_compile(tmp_path, "opt:infer:fp32:eager", "--merge")
    again = Results.load(tmp_path / "cs.json")
    assert [p for p, *_ in ms(again)] == ["resnet50", "opt"] and ms(again)[0] == both[1]
    assert ms(again)[1][2] != first[0][2] and len(again.runs) == 2  # re-measured by the third run
    assert [p for p, *_ in ms(run_compile(tmp_path, "resnet50:infer:fp32:eager"))] == ["resnet50"]
    assert len(Results.load(tmp_path / "cs.json").runs) == 1  # without --merge a run stands alone


def test_compile_speedup_passes_alternate_and_average(tmp_path):
    order = []
    run_one = compile_speedup.run_one
    with mock.patch.object(compile_speedup, "run_one", lambda name, *a: order.append(name) or run_one(name, *a)):
        res = run_compile(tmp_path, "opt,resnet50:infer:fp32:eager", "--passes", "3")
    assert order == ["opt", "resnet50"] * 3
    for r in res.select(metric="ms/step"):
        assert len(r["passes"]) == 3 and r["p50"] == pytest.approx(sum(r["passes"]) / 3)
    # --tiny's models say what they are (its resnet50 rows are a ResNet-18's)
    assert {r["shape"] for r in res.rows} == {"2x32 tokens (tiny OPT)", "2x3x64x64 (tiny: a ResNet-18 stands in)"}


# ----------------------------------------------------------------------------------------------
# The matmul-ReLU benchmark
# ----------------------------------------------------------------------------------------------


def test_bench_matmul_relu_shape_names_give_their_sizes():
    dims = bench_matmul_relu.shape_dims
    assert dims("decode-1 1x11008x4096") == (1, 11008, 4096)  # M = 1: one token
    assert dims("decode-16 16x11008x4096") == (16, 11008, 4096)
    assert dims("unaligned 3001x4099x1537") == (3001, 4099, 1537)
    assert dims("unaligned-k 4096x4096x4095") == (4096, 4096, 4095)
    assert dims("unaligned-n 4096x4095x4096") == (4096, 4095, 4096)
    assert dims("gpt2-medium-mlp 4096x4096x1024") == (4096, 4096, 1024) and dims("64x4096x4096") == (64, 4096, 4096)
    for bad in ("", "decode", "4096x4096", "0x8x8", "8x8x-8", "8x8x8x8", "8x8x8 decode"):
        with pytest.raises(ValueError, match="MxNxK"):
            dims(bad)
    shapes = bench_matmul_relu.SHAPES
    assert all(shapes[name] == dims(name) for name in shapes)
    assert len(set(shapes.values())) == len(shapes), "two names for one shape: their rows would not merge"
    # the names results/matmul_relu.json rows use stay
    for name in ("8192x8192x8192", "4096x4096x4096", "8192x8192x1024", "8192x8192x256", "16384x4096x512",
                 "1024x2048x512", "64x4096x4096", "gpt2-medium-mlp 4096x4096x1024", "7b-mlp 4096x11008x4096"):
        assert name in shapes and name in bench_matmul_relu.DEFAULT
    # sizes name the shape they belong to; other sizes are their own shape; a typo is named
    resolve = bench_matmul_relu.resolve_shapes
    assert resolve("16x11008x4096,4096x11008x4096, 5x6x7") == [
        "decode-16 16x11008x4096", "7b-mlp 4096x11008x4096", "5x6x7"]
    assert resolve("decode-1,llama-ffn,64x4096x4096") == [
        "decode-1 1x11008x4096", "llama-ffn 8192x14336x4096", "64x4096x4096"]  # a label names its shape
    assert resolve("none") == [] and resolve("all") == list(shapes)
    with pytest.raises(ValueError, match=r"unknown shapes \['decode-2'\]"):
        resolve("decode-1,decode-2")
    labels = [name.split()[0] for name in shapes]
    assert len(set(labels)) == len(labels)


def test_bench_matmul_relu_bytes_floor():
    # bf16 decode, 1 x 11008 x 4096: a 4096, b 4096 * 11008, bias 11008, y 11008 elements, 2 bytes each
    assert bench_matmul_relu.floor_bytes("fwd", 1, 11008, 4096, 2) == 2 * (4096 + 45_088_768 + 11008 + 11008)
    assert bench_matmul_relu.floor_bytes("fwd", 2, 3, 4, 4) == (8 + 12 + 3 + 6) * 4 == 116
    assert bench_matmul_relu.floor_bytes("fwd-nobias", 2, 3, 4, 4) == (8 + 12 + 6) * 4
    # 1000 x 1000 x 1000 tf32 without bias: 3e6 elements of 4 bytes, 12 MB at 3000 GB/s move in 4 us
    assert bench_matmul_relu.floor_ms("fwd-nobias", "1000x1000x1000", "tf32", 3000.0) == pytest.approx(0.004)
    assert bench_matmul_relu.floor_ms("fwd", "2x3x4", "bf16", 1.0) == pytest.approx(58 / 1e9 * 1e3)


def test_bench_matmul_relu_coverage_plan(capsys):
    # --list needs no GPU: the jobs of `--shapes coverage` are the coverage shapes, every peer in both modes
    jobs = bench_matmul_relu.main(["--list", "--shapes", "coverage"])
    out = capsys.readouterr().out
    issue = {(8192, 8192, 8192), (8192, 14336, 4096), (16384, 8192, 2048), (8192, 8192, 1024), (8192, 8192, 256),
             (65536, 1024, 256), (3001, 4099, 1537), (512, 1024, 1024), (1024, 2048, 512), (64, 4096, 4096),
             (16, 11008, 4096)}  # its table
    asked = {(1, 11008, 4096), (64, 11008, 4096), (4096, 4096, 4095), (4096, 4095, 4096)}  # decode M, unaligned K, N
    fwd_bwd = {(8192, 8192, 1024), (4096, 11008, 4096), (8192, 4096, 1024), (2048, 3072, 768)}
    dims = bench_matmul_relu.shape_dims
    fwd = [s for op, s, d, _ in jobs if op == "fwd" and d == "bf16"]
    assert issue | asked <= {dims(s) for s in fwd} and len(fwd) == len(set(fwd))
    assert {dims(s) for op, s, d, _ in jobs if op == "fwd+bwd" and d == "bf16"} == fwd_bwd | {(4096, 4096, 4096)}
    assert {dims(s) for op, s, d, _ in jobs if d == "tf32" and op == "fwd"} == {
        (4096, 4096, 4096), (8192, 8192, 1024), (1024, 2048, 512)}
    assert {layout for *_, layout in jobs} == {"row-major"}
    assert "decode-1 1x11008x4096" in out and "cuBLASLt, fuselab, relu(addmm), inductor" in out
    assert f"{len(jobs)} jobs" in out
    # tf32 in both B layouts; the default run and --quick stay as they were (fwd+bwd at one shape in --quick)
    jobs = bench_matmul_relu.main(["--list", "--shapes", "coverage", "--dtypes", "tf32", "--ops", "fwd,fwd+bwd",
                                   "--b-layouts", "row-major,weight"])
    assert sorted({(op, layout) for op, _, _, layout in jobs}) == [
        ("fwd", "row-major"), ("fwd", "weight"), ("fwd+bwd", "row-major"), ("fwd+bwd", "weight")]
    assert len(jobs) == 2 * (3 + 2)
    default = bench_matmul_relu.main(["--list"])
    assert [s for op, s, d, _ in default if op == "fwd" and d == "bf16"] == bench_matmul_relu.DEFAULT
    assert len(default) == 50
    assert bench_matmul_relu.main(["--list", "--shapes", "decode-1,5x6x7", "--dtypes", "tf32", "--tf32-shapes", "all",
                                   "--ops", "fwd"]) == [("fwd", "decode-1 1x11008x4096", "tf32", "row-major"),
                                                        ("fwd", "5x6x7", "tf32", "row-major")]
    assert bench_matmul_relu.main(["--list", "--quick"]) == [
        *[("fwd", s, "bf16", "row-major") for s in bench_matmul_relu.QUICK],
        *[("fwd-nobias", s, "bf16", "row-major") for s in bench_matmul_relu.QUICK],
        ("fwd+bwd", "8192x8192x1024", "bf16", "row-major")]


@pytest.mark.parametrize("flag, value, field", [
    ("--shapes", "decode-2", "unknown shapes"), ("--shapes", "8x8", "unknown shapes"),
    ("--tf32-shapes", "4096", "unknown shapes"), ("--b-layouts", "column-major", "unknown B layouts"),
    ("--dtypes", "fp8", "unknown dtypes")])
def test_bench_matmul_relu_unknown_names_are_usage_errors(capsys, outdirs, flag, value, field):
    err = usage_error(capsys, bench_matmul_relu.main, [flag, value])
    assert field in err and value in err
    assert not outdirs[0].exists() and not outdirs[1].exists()


def test_bench_matmul_relu_measures_every_peer_in_both_modes_on_a_cpu(monkeypatch):
    # The measurement code on a CPU at a tiny odd shape, timing stubbed: every provider in eager and graph
    # mode, the B layout in the dtype label, % bytes floor for the forward ops, the weight's gradient reset.
    import types

    timed, reset = [], []

    def one_call(fn, mode, grad_to_none=None, **kwargs):
        fn()
        timed.append(mode)
        reset.append(grad_to_none)
        return Timing(1.0, 2.0, 4.0)

    monkeypatch.setattr(bench_matmul_relu, "time_call", one_call)
    args = types.SimpleNamespace(modes=["eager", "graph"], rep_ms=1, providers={}, cuda=False, inductor=set())
    res = Results(bench_matmul_relu.STUDY)
    for op in bench_matmul_relu.OPS:
        res.set_baseline(op, bench_matmul_relu.PROVIDERS[op])
        bench_matmul_relu.measure(res, op, "3x5x7", "tf32", args, "weight", bandwidth_gbs=1.0, device="cpu")
    label = "tf32, B=weight.t()"
    for op, peers in (("fwd", {"cuBLASLt", "fuselab", "relu(addmm)"}), ("fwd-nobias", {"relu(mm)", "fuselab"}),
                      ("fwd+bwd", {"autograd", "fuselab"})):
        rows = res.select(op=op, metric="TFLOP/s")
        assert {(r["provider"], r["mode"]) for r in rows} == {(p, m) for p in peers for m in ("eager", "graph")}
        assert {r["dtype"] for r in rows} == {label}
    floor = bench_matmul_relu.floor_ms("fwd", "3x5x7", "tf32", 1.0)  # (21 + 35 + 5 + 15) * 4 bytes at 1 GB/s
    assert floor == pytest.approx(304e-6)
    pct = res.select(op="fwd", provider="fuselab", mode="graph", metric="% bytes floor")[0]
    assert (pct["p20"], pct["p50"], pct["p80"]) == pytest.approx((100 * floor / 4, 100 * floor / 2, 100 * floor))
    assert not res.select(op="fwd+bwd", metric="% bytes floor") and len(res.select(op="fwd-nobias",
                                                                                   metric="% bytes floor")) == 4
    for provider in ("cuBLASLt", "fuselab", "relu(addmm)"):
        assert res.value(op="fwd", provider=provider, metric="rel err") < 1e-2
    assert not res.failed and len(timed) == 2 * (3 + 2 + 2)
    leaves = reset[-1]  # fwd+bwd: a, the weight (not its transposed view) and the bias
    assert [tuple(t.shape) for t in leaves[:3]] == [(3, 7), (5, 7), (5,)] and all(t.is_leaf for t in leaves)
    page = report.render_study(res)
    assert "### fwd, tf32, B=weight.t(): % of the bytes floor" in page and "fuselab x cuBLASLt" in page


# ----------------------------------------------------------------------------------------------
# The quantized GEMM benchmark
# ----------------------------------------------------------------------------------------------


def test_kernel_table_names_where_a_call_spends_its_time():
    x = torch.randn(256, 256)
    table = harness.kernel_table(lambda: torch.relu(x @ x).sum(), steps=2)
    header, rule, *lines = table.splitlines()
    assert header.startswith("| operator (self CPU time) | calls per call |") and lines
    assert any("aten::mm" in line for line in lines), table
    assert all(float(line.split("|")[4]) <= 100 for line in lines)  # % of the total


def test_bench_quant_help_names_every_op_and_provider(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_quant.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--shapes" in out and "--providers" in out
    for name in [*bench_quant.OPS, *(n for reg in bench_quant.PROVIDERS.values() for n in reg.fns)]:
        assert name in out, f"--help does not mention {name!r}"
    assert (bench_quant.INT8.baseline, bench_quant.FP8.baseline, bench_quant.PREFILL.baseline) \
        == ("_int_mm", "_scaled_mm", "fuselab bf16")


@pytest.mark.parametrize("flag, value, field", [
    ("--shapes", "9x9x9", "unknown shapes"), ("--ops", "int4 gemm", "unknown ops"),
    ("--providers", "cuBLAS int8", "unknown providers"), ("--modes", "wall", "unknown modes"),
    ("--sizes", "opt-175b", "unknown sizes"), ("--tokens", "8x", "BATCHxSEQ")])
def test_bench_quant_unknown_names_are_usage_errors(capsys, outdirs, flag, value, field):
    # Checked before the CUDA check: a typo is named on any machine.
    err = usage_error(capsys, bench_quant.main, [flag, value])
    assert field in err and value in err
    assert not outdirs[0].exists() and not outdirs[1].exists()
    # a provider of an op not asked for is unknown too
    assert "unknown providers" in usage_error(capsys, bench_quant.main, ["--ops", "prefill", "--providers", "_int_mm"])


def test_bench_quant_distill_loss_machinery_on_a_cpu(monkeypatch):
    # Both losses checked against float64 and timed in turns (timings faked: they need a GPU).
    import argparse

    monkeypatch.setattr(bench_quant, "LOSS_SHAPES", {"6x40": (6, 40)})
    calls = []

    def fake_time_call(fn, mode, **kw):
        assert kw["grad_to_none"][0].requires_grad  # the student's gradient is reset before each call
        fn()
        calls.append(mode)
        return Timing(1.0, 2.0, 3.0)

    monkeypatch.setattr(harness, "time_call", fake_time_call)
    res = Results(bench_quant.STUDY)
    providers = ["torch", "fuselab fused"]  # "torch compiled" would spend the test compiling for the CPU
    args = argparse.Namespace(providers={"distill loss": providers}, modes=["eager", "graph"], rep_ms=10)
    bench_quant.measure_distill(res, "6x40", args, device="cpu")
    assert calls.count("eager") == calls.count("graph") == 2 * bench_quant.LOSS_ROUNDS
    for name in providers:
        assert res.value(op="distill loss", provider=name, shape="6x40", mode="eager", metric="rel err") < 1e-5
        assert res.value(op="distill loss", provider=name, shape="6x40", mode="eager", metric="grad rel err") < 1e-2
        assert res.value(op="distill loss", provider=name, shape="6x40", mode="graph", metric="ms") == 2.0
    assert not res.failed


def test_bench_quant_distill_loss_records_a_failing_provider_and_times_the_rest(monkeypatch):
    import argparse

    monkeypatch.setattr(bench_quant, "LOSS_SHAPES", {"6x40": (6, 40)})
    def time_call(fn, mode, **kw):
        alive.extend(r() is not None for r in broken_backward.losses)  # into the timing (a capture, on a GPU)
        if mode == "graph":
            raise RuntimeError("operation not permitted when stream is capturing")
        fn()
        return Timing(1.0, 2.0, 3.0)

    alive = []
    monkeypatch.setattr(harness, "time_call", time_call)

    def broken(s, t, y):
        raise RuntimeError("inductor could not compile this")

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("the backward failed")

    def broken_backward(s, t, y):  # its loss's graph must not outlive the check (it would reach a capture)
        loss = FailingBackward.apply(bench_quant.DISTILL.fns["torch"](s, t, y))
        broken_backward.losses.append(weakref.ref(loss))
        return loss

    broken_backward.losses = []
    monkeypatch.setitem(bench_quant.DISTILL.fns, "broken", broken)
    monkeypatch.setitem(bench_quant.DISTILL.fns, "broken backward", broken_backward)
    res = Results(bench_quant.STUDY)
    for chosen in (["broken", "torch", "broken backward"], []):  # [] : --providers named none of this op's
        args = argparse.Namespace(providers={"distill loss": chosen}, modes=["eager", "graph"], rep_ms=10)
        bench_quant.measure_distill(res, "6x40", args, device="cpu")
    assert [(f["provider"], f["mode"]) for f in res.failed] == [  # a mode that fails is that mode's failure
        ("broken", "eager"), ("broken", "graph"), ("broken backward", "eager"), ("broken backward", "graph"),
        ("torch", "graph")]
    assert "could not compile" in res.failed[0]["error"] and "capturing" in res.failed[-1]["error"]
    assert res.value(op="distill loss", provider="torch", shape="6x40", mode="eager", metric="ms") == 2.0
    assert broken_backward.losses and alive and not any(alive)


@pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")
def test_bench_quant_refuses_a_cpu_at_once(outdirs):
    with mock.patch.object(bench_quant, "measure_gemm", side_effect=AssertionError("measured")), \
            mock.patch.object(bench_quant, "measure_prefill", side_effect=AssertionError("measured")):
        for argv in ([], ["--quick"], ["--ops", "prefill"]):
            with pytest.raises(SystemExit, match="bench_quant needs a CUDA GPU") as exc:
                bench_quant.main(argv)
            assert exc.value.code != 0
    assert not outdirs[0].exists() and not outdirs[1].exists()


def test_bench_quant_measures_and_records_failures_on_a_cpu(monkeypatch):
    # The measurement code on a CPU with tiny shapes (fuselab's kernels in the interpreter), timing stubbed:
    # every provider is checked against float64 and recorded; one that cannot run is a failure, not a gap.
    import types

    from experiments.harness import Timing

    def one_call(fn, mode, **kwargs):
        fn()
        return Timing(1.0, 2.0, 3.0)

    monkeypatch.setattr(bench_quant, "time_call", one_call)
    monkeypatch.setitem(bench_quant.SHAPES, "odd 17x19x23", (17, 19, 23))
    monkeypatch.setattr(bench_quant, "fp8_unsupported", lambda device: "no fp8 tensor cores here")
    args = types.SimpleNamespace(modes=["eager", "graph"], rep_ms=1, providers={}, profile=False)
    res = Results(bench_quant.STUDY)
    for op in bench_quant.OPS:
        res.set_baseline(op, bench_quant.PROVIDERS[op])
    for op in bench_quant.GEMM_OPS:
        bench_quant.measure_gemm(res, op, "odd 17x19x23", args, device="cpu")
    int8 = {r["provider"] for r in res.select(op="int8 gemm", metric="TOP/s")}
    assert int8 == set(bench_quant.INT8.fns) and len(res.select(op="int8 gemm", metric="TOP/s")) == 8
    assert res.value(op="int8 gemm", provider="fuselab int8", mode="graph", metric="TOP/s") == 2 * 17 * 19 * 23 * 1e-9 / 2
    for name in bench_quant.INT8.fns:
        assert res.value(op="int8 gemm", provider=name, metric="rel err") < 1e-2
        assert res.value(op="int8 gemm", provider=name, metric="rel err vs bf16 math") < 5e-2
    failed = {(f["provider"], f["mode"]): f["error"] for f in res.failed}
    assert failed == {(n, m): "no fp8 tensor cores here"
                      for n in ("_scaled_mm", "_scaled_mm fast accum", "fuselab fp8", "fuselab fp8 fast accum")
                      for m in ("eager", "graph")}
    assert {r["provider"] for r in res.select(op="fp8 gemm")} == {"fuselab bf16"}
    monkeypatch.setattr(bench_quant, "fp8_unsupported", lambda device: None)
    monkeypatch.setitem(bench_quant.FP8.fns, "_scaled_mm", lambda inp: 1 / 0)  # a provider that raises
    again = Results(bench_quant.STUDY)  # a run of its own: one run's rows hold a shape once
    bench_quant.measure_gemm(again, "fp8 gemm", "odd 17x19x23", args, device="cpu")
    assert again.failed[-1]["provider"] == "_scaled_mm" and "ZeroDivisionError" in again.failed[-1]["error"]
    assert again.value(op="fp8 gemm", provider="fuselab fp8", mode="eager", metric="rel err") < 1e-2

    args.providers = {"prefill": ["fuselab bf16", "int8 dynamic", "int8 fused norms", "int8 static",
                                  "int8 static fused"]}
    events = []  # --profile: every provider timed before any is profiled (a profiler session slows later launches)
    monkeypatch.setattr(bench_quant, "time_call", lambda fn, mode, **kw: events.append("time") or one_call(fn, mode))
    monkeypatch.setattr(bench_quant, "kernel_table", lambda fn, steps: events.append("profile") or "table")
    monkeypatch.setattr(bench_quant, "step_diagnosis", lambda fn, steps: "GPU busy, idle")
    args.profile = True
    bench_quant.measure_prefill(res, "tiny", (1, 8), args, device="cpu")
    assert events == ["time"] * 5 + ["profile"] * 5, events
    assert not [f for f in res.failed if f["op"] == "prefill"], res.failed
    rows = res.select(op="prefill", metric="ms")
    assert {r["provider"] for r in rows} == set(args.providers["prefill"])
    assert {r["mode"] for r in rows} == {"wall"}
    assert res.value(op="prefill", provider="int8 dynamic", metric="ms", stat="p50") == 2.0
    assert rows[1]["quantized_layers"] == 2 * 6 + 1  # q, k, v, out, fc1, fc2 per layer, and lm_head
    assert rows[2]["quantized_layers"] == 2 * 6 + 1 and rows[2]["fused_norms"] == 2 * 2  # and each layer's norms
    assert res.value(op="prefill", provider="int8 fused norms", metric="rel err") < 0.1
    assert res.value(op="prefill", provider="int8 dynamic", metric="rel err") < 0.1
    static, fused = ({r["provider"]: r for r in rows}[name] for name in ("int8 static", "int8 static fused"))
    assert "fused_norms" not in static and fused["fused_norms"] == 2 * 2 and fused["quantized_outputs"] == 2
    # the fusions hand on the int8 values the static layers would make themselves: the same logits
    assert res.value(op="prefill", provider="int8 static fused", metric="rel err") == \
        res.value(op="prefill", provider="int8 static", metric="rel err") < 0.1
    page = report.render_study(res)
    assert "### int8 gemm: TOP/s" in page and "| _int_mm | _int_mm row-major B | fuselab int8 | fuselab bf16 |" in page
    assert "int8 dynamic x fuselab bf16" in page and "### Not measured" in page


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_results_load_and_render(path):
    res = Results.load(path)  # fuselab-results/1, or this fails
    assert res.study == path.stem, f"{path.name} holds study {res.study!r}: name it results/{res.study}.json"
    assert res.rows, f"{path.name} has no rows"
    for row in res.rows:
        assert set(harness.ROW_KEYS) | {"run"} <= set(row) and row["study"] == res.study
        assert row["run"] in res.runs and row["p20"] is not None
    for op, baseline in res.baselines.items():
        assert not res.select(op=op) or res.select(op=op, provider=baseline), f"{op}: baseline {baseline} not measured"
    page = report.render_study(res)
    assert "|---|" in page and f"results/{res.study}.json" in page
    for run in {r["run"] for r in res.rows}:
        assert f"`{run}`" in page and f"commit `{res.runs[run]['commit']}`" in page


def test_committed_docs_are_current(tmp_path):
    # docs/results/*.md are generated: after a results file changes, `python -m experiments.report` reruns.
    report.main(["--docs", str(tmp_path), "--no-readme", "--no-plots"])
    for page in tmp_path.glob("*.md"):
        committed = harness.ROOT / "docs" / "results" / page.name
        assert committed.exists() and committed.read_text() == page.read_text(), \
            f"docs/results/{page.name} is stale: run `python -m experiments.report`"


def test_report_states_the_issues_targets_met_or_missed():
    # The pages showed the ratios but said nowhere that a target was missed
    res = Results("sparse_embedding")
    shape = "uniform, 1,000,000 x 128"
    for op, provider, mode, metric, value in (
            ("fwd+bwd+step", "SparseAdam", "eager", "ms", 1.2), ("fwd+bwd+step", "SparseAdamW", "eager", "ms", 0.6),
            ("fwd+bwd+step", "SparseAdamW", "graph", "ms", 0.2), ("step", "SparseAdamW", "graph", "x floor", 2.5)):
        res.record(op=op, provider=provider, shape=shape, dtype="fp32", mode=mode, metric=metric, value=value)
    page = report.render_study(res)
    assert f"| {shape} | 0.50 met | 0.17 met | 2.50 **missed** | 2.00 **missed** |" in page, page
    quant = Results("quant_gemm")
    quant.set_baseline("prefill", "fuselab bf16")
    for provider, ms in (("fuselab bf16", 40.0), ("int8 fused norms", 30.0), ("fp8", 39.0)):
        quant.record(op="prefill", provider=provider, shape="opt-1.3b 8x1024", dtype="bf16", mode="wall", metric="ms",
                     value=ms)
    for op, metric, values in (("int8 gemm", "TOP/s", {"_int_mm": 500.0, "fuselab int8": 1000.0, "fuselab bf16": 800.0}),
                               ("fp8 gemm", "TFLOP/s", {"_scaled_mm": 1000.0, "fuselab fp8": 990.0,
                                                        "_scaled_mm fast accum": 1200.0,
                                                        "fuselab fp8 fast accum": 1260.0})):
        for provider, value in values.items():
            quant.record(op=op, provider=provider, shape="s", dtype="x", mode="graph", metric=metric, value=value)
    page = report.render_study(quant)
    # the measured quantized providers' columns only
    assert "| prefill | int8 fused norms x fuselab bf16 (>= 1.3) | fp8 x fuselab bf16 (>= 1.3) |" in page, page
    assert "| opt-1.3b 8x1024 | 1.33 met | 1.03 **missed** |" in page, page
    assert "| s | graph | 2.00 met | 1.25 **missed** | 0.99 **missed** | 1.05 met |" in page, page
    assert page.count("(>= 1.3) | GPU |") == 1 and page.count("(>= 1) | GPU |") == 1, page  # each target's GPU


def test_report_ratios_come_from_rows():
    res = Results("demo")
    res.set_baseline("fwd", "cuBLASLt")
    for shape, base, mine in (("a", 100.0, 150.0), ("b", 200.0, 100.0)):
        for mode in ("eager", "graph"):
            _row(res, "cuBLASLt", base, metric="TFLOP/s", mode=mode, shape=shape)
            _row(res, "fuselab", mine, metric="TFLOP/s", mode=mode, shape=shape)
            _row(res, "cuBLASLt", 1e3 / base, metric="ms", mode=mode, shape=shape)
            _row(res, "fuselab", 1e3 / mine, metric="ms", mode=mode, shape=shape)
    spec = report.Spec("Demo", "prose", views=(report.View("TFLOP/s", index=("shape", "mode"),
                                                           geomean_by=("mode",)),), hide=("ms",))
    page = report.render_study(res, spec)
    assert "| shape | mode | cuBLASLt | fuselab | fuselab x cuBLASLt |" in page
    assert "| a | eager | 100 | 150 | 1.500 |" in page and "| b | graph | 200 | 100 | 0.500 |" in page
    assert "fuselab x cuBLASLt, eager: geometric mean **0.87** over 2 lines" in page  # sqrt(1.5 * 0.5)
    assert "### fwd: ms" not in page  # a hidden metric
    generic = report.render_study(res, report.Spec("Demo", ""))  # no view: a table per op and metric
    assert "### fwd: ms" in generic and "| a | eager | 10.0 | 6.67 | 1.500 |" in generic
    # a compile-study view: modes as columns, eager the baseline
    comp = Results("compile_speedup")
    for mode, ms in (("eager", 40.0), ("default", 32.0)):
        comp.record(op="opt train", provider="opt", shape="8x1024 tokens", dtype="bf16", mode=mode, metric="ms/step",
                    value=ms)
    assert "| opt train | bf16 | opt | 40.0 | 32.0 | 1.250 |" in report.render_study(comp)
    # a ratio only within one run (a resnet50 headline divided two commits' figures); two rows in one cell refused
    other = Results("compile_speedup")
    other.record(op="opt train", provider="opt", shape="8x1024 tokens", dtype="bf16", mode="reduce-overhead",
                 metric="ms/step", value=20.0)
    comp.rows += other.rows
    comp.runs.update(other.runs)
    page = report.render_study(comp)
    assert "| opt train | bf16 | opt | 40.0 | 32.0 | 20.0 | 1.250 |  |" in page, page
    comp.rows.append(dict(comp.rows[0], shape="tiny"))  # a shape the compile view's index leaves out
    with pytest.raises(ValueError, match="two ms/step rows for .* the table would show one of them"):
        report.render_study(comp)


def test_report_views_against_a_named_peer_and_the_loss_headline():
    # A view against a named peer shows only where that peer was measured; the headline's loss ratios
    # (x above 1: faster than torch.compile) are ordered by size.
    res = Results("quant_gemm")
    res.set_baseline("distill loss", "torch")
    for shape, (torch_ms, fused_ms, compiled_ms) in (("4096x32000", (8.0, 0.5, 1.0)), ("256x10", (0.07, 0.02, 0.01))):
        for name, ms in (("torch", torch_ms), ("fuselab fused", fused_ms), ("torch compiled", compiled_ms)):
            res.record(op="distill loss", provider=name, shape=shape, dtype="bf16", mode="graph", metric="ms", value=ms)
    view = report.View("ms", index=("shape", "mode"), ops=("distill loss",), baseline="torch compiled",
                       title="against compiled")
    spec = report.Spec("Demo", "", views=(view,))
    assert "### against compiled" in report.render_study(res, spec)
    without = Results("quant_gemm")
    without.rows = [r for r in res.rows if r["provider"] != "torch compiled"]
    page = report.render_study(without, spec)
    assert "against compiled" not in page and "### distill loss: ms" in page  # the generic table instead
    line = next(r for r in report.headline_rows({"quant_gemm": res}) if r[0].startswith("DistillationLoss"))
    assert line[1] == "0.50x at 256x10, 2.00x at 4096x32000"
    assert [report._size_of_shape((s,))[0] for s in ("8x8", "-", "opt-1.3b 8x1024")] == [0, 1, 1]


def test_report_names_the_shapes_where_the_tuner_chose_a_library_call():
    res = Results("demo")
    for shape, config in (("16x11008x4096", "cublas"), ("8192x8192x8192", "BLOCK_M: 128, BLOCK_N: 256, num_warps: 8")):
        _row(res, "fuselab", 1.0, metric="TFLOP/s", mode="eager", shape=shape, config=config)
    page = report.render_study(res, report.Spec("Demo", ""))
    section = page.split("### Where the tuner chose a library call")[1].split("###")[0]
    assert "| fwd | fuselab | 16x11008x4096 | bf16 | cublas |" in section and "8192x8192x8192" not in section
    assert "library call" not in report.render_study(Results("empty"), report.Spec("Demo", ""))


def test_report_training_runs_stay_apart(tmp_path):
    # Two train_fsdp runs of one model: the headline names the GPUs of the best MFU's run, and the loss
    # curves of one provider at two batch shapes are two lines, not one zigzag.
    res = Results("train_fsdp")
    for provider, shape, world, mfu in (("single+compile", "1x8x1024", 1, 40.0), ("fsdp+compile", "2x8x1024", 2, 42.0),
                                        ("fsdp+compile", "2x16x1024", 2, 41.0)):
        keys = dict(op="gpt2-1.31B", provider=provider, shape=shape, dtype="bf16", mode="wall")
        res.record(metric="MFU %", value=mfu, world_size=world, **keys)
        res.record(metric="tokens/s per GPU", value=1000.0 * mfu, world_size=world, **keys)
        for step in (10, 20):
            res.record(metric="loss", value=mfu / step, step=step, **keys)
    line = [r for r in report.headline_rows({"train_fsdp": res}) if "MFU" in r[1]][0]
    assert line[0] == "gpt2-1.31B training on 2 GPUs (fsdp+compile, batch 2x8x1024)"
    assert line[1] == "42.0% MFU, 42,000 tokens/s per GPU"
    drawn = []

    class Axes:
        def plot(self, xs, ys, label, **kwargs):
            drawn.append((label, list(xs)))

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    class Figure(Axes):
        pass

    plt = mock.Mock()
    plt.subplots.return_value = (Figure(), Axes())
    report._plot_curves(res.select(metric="loss"), report.SPECS["train_fsdp"].plot, tmp_path / "p.png", plt)
    assert sorted(drawn) == [("gpt2-1.31B / fsdp+compile / 2x16x1024", [10, 20]),
                             ("gpt2-1.31B / fsdp+compile / 2x8x1024", [10, 20]),
                             ("gpt2-1.31B / single+compile / 1x8x1024", [10, 20])]


def test_report_writes_docs_plots_and_headline(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("host_overhead", "train_mlp", "matmul_relu_cuda", "train_fsdp"):
        shutil.copy(harness.RESULTS / f"{name}.json", results)
    (results / "old.json").write_text(json.dumps({"environment": {}, "rows": []}))  # not the long format: skipped
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nintro\n\n<!-- results:headline -->\nstale\n<!-- /results:headline -->\n\nrest\n")
    docs = tmp_path / "docs"
    report.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(readme)])
    assert "skipped" in capsys.readouterr().err
    assert sorted(p.name for p in docs.iterdir()) == [
        "README.md", "host_overhead.md", "host_overhead.png", "matmul_relu_cuda.md", "matmul_relu_cuda.png",
        "train_fsdp.md", "train_fsdp.png", "train_mlp.md"]  # train_fsdp's plot: the loss curve
    text = readme.read_text()
    head = text.split("<!-- results:headline -->")[1].split("<!-- /results:headline -->")[0]
    assert "stale" not in head and text.startswith("# x\n\nintro\n") and text.endswith("\n\nrest\n")
    assert "| figure | value | measured |" in head and "vs cuBLASLt" in head and "MLP test accuracy" in head
    assert "% MFU" in head
    report.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(readme), "--no-plots"])
    assert readme.read_text() == text  # regenerating changes nothing
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="<!-- results:headline -->"):
        report.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(readme), "--no-plots"])
    assert readme.read_text() == "# no markers\n"
    # a damaged results file is named, and nothing is rewritten (a truncated one was skipped, its headline row gone)
    before = {p.name: p.read_bytes() for p in docs.iterdir()}
    good = json.loads((results / "train_mlp.json").read_text())
    for damage, words in (("truncated", "is not JSON"), ("no run", "row 0 lacks ['run']"),
                          ("null p50", "row 0 has non-numeric or non-finite ['p50']"), ("unknown run", "which the file does not describe")):
        data = json.loads(json.dumps(good))
        if damage == "no run":
            del data["rows"][0]["run"]
        elif damage == "null p50":
            data["rows"][0]["p50"] = None
        elif damage == "unknown run":
            data["runs"] = {}
        text = json.dumps(data)[:200] if damage == "truncated" else json.dumps(data)
        (results / "train_mlp.json").write_text(text)
        with pytest.raises(SystemExit, match=f"train_mlp.json.*{re.escape(words)}.*nothing was written"):
            report.main(["--results-dir", str(results), "--docs", str(docs), "--no-readme", "--no-plots"])
        assert {p.name: p.read_bytes() for p in docs.iterdir()} == before
    with pytest.raises(SystemExit):
        report.main(["--results-dir", str(results), "--docs", str(docs), "--readme", str(tmp_path / "missing.md")])
    assert "--readme" in capsys.readouterr().err


def test_tuned_choice_names_the_config_of_the_calls_own_key(tmp_path, env, monkeypatch):
    # Benchmarks record the tuner's choice for the timed call: after another shape was tuned, the
    # config of this call's key (not the last tuned one); None for a call that launches nothing.
    from experiments.harness import tuned_choice
    from fuselab import settings
    from fuselab.kernels import matmul_relu
    from fuselab.kernels import matmul_relu_triton as module

    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path))
    settings.reload()
    tuner = module.matmul_relu_kernel
    monkeypatch.setattr(tuner, "cache", {})
    small = (torch.randn(40, 24), torch.randn(24, 16), torch.randn(16))
    large = (torch.randn(130, 72), torch.randn(72, 48), torch.randn(48))
    matmul_relu(*small)
    (key_small,) = tuner.cache
    matmul_relu(*large)
    configs = list(tuner.configs)
    tuner.cache.update({k: configs[0] if k == key_small else configs[-1] for k in tuner.cache})
    assert str(configs[0]) != str(configs[-1])
    assert tuned_choice(lambda: matmul_relu(*large), "matmul_relu_kernel") == str(configs[-1])
    assert tuned_choice(lambda: matmul_relu(*small), "matmul_relu_kernel") == str(configs[0])
    assert tuned_choice(lambda: matmul_relu(small[0][:0], *small[1:]), "matmul_relu_kernel") is None


def test_a_commit_given_in_full_is_recorded_as_gits_short_form(monkeypatch):
    # The device machine has no .git: its runs pass the sha, often in full; the docs cite runs by the short form.
    from fuselab._results import environment

    monkeypatch.setenv("FUSELAB_GIT_COMMIT", "0c9581116085a13fdaf4c2436653737117666a77")
    monkeypatch.setenv("FUSELAB_GIT_DIRTY", "0")
    env = environment()
    assert env["commit"] == "0c9581116085" and env["dirty"] is False


def test_a_run_is_dirty_for_code_changes_not_for_results_just_written(tmp_path, monkeypatch):
    # A probe's: quickstart --results wrote results/quickstart.json, then its MLP stage's run was recorded dirty.
    import subprocess

    from fuselab import _results

    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    monkeypatch.setattr(_results, "REPO", tmp_path)
    monkeypatch.delenv("FUSELAB_GIT_DIRTY", raising=False)
    for written in ("results/s.json", "docs/results/s.md"):
        (tmp_path / written).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / written).write_text("{}")
    assert _results.environment()["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert _results.environment()["dirty"] is True


def test_sparse_profile_pass_diagnoses_each_sparse_optimizer(capsys):
    # sparse_embedding --profile, after all the timing: a line per sparse optimizer, SparseAdamW's kernel
    # table (on a CPU no GPU time, syncs or cudaMalloc: the figures are GPU-tested below).
    from experiments.sparse_embedding import DENSE, OPTIMIZERS, profile_stream

    profile_stream("uniform", 100, 8, torch.randint(0, 100, (2, 64)))
    out = capsys.readouterr().out
    for provider in set(OPTIMIZERS.fns) - DENSE:
        assert f"uniform, 100 x 8, {provider}: GPU busy 0.000 ms, idle 0.000 ms a step" in out
    assert "0 synchronizing calls a step; 0 cudaMalloc a step" in out and "where a fwd+bwd+step's" in out


@pytest.mark.gpu
def test_step_diagnosis_counts_what_a_step_does_on_the_gpu():
    from experiments.harness import step_diagnosis

    x = torch.randn(4096, 4096, device="cuda")

    def step():
        (x @ x).sum().item()  # GPU work, then a wait for it

    line = step_diagnosis(step, steps=3)
    syncs = re.search(r"(\d+) synchronizing calls a step", line)
    # .item() waits at least once (torch's sync debug mode reports its copy and its wait)
    assert syncs and int(syncs.group(1)) >= 1 and "GPU busy 0.000 ms" not in line, line


def test_a_merge_into_another_studys_file_is_refused_before_the_run(tmp_path):
    # It failed only at the end (the run's measurements lost).
    other = tmp_path / "other.json"
    shutil.copy(harness.RESULTS / "compile_speedup.json", other)
    with pytest.raises(SystemExit, match="holds study 'compile_speedup', not 'train_mlp'"):
        train_mlp.main(["--epochs", "1", "--merge", "--out", str(other)])
