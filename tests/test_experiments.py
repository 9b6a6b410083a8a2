"""The experiment scripts run end to end on small inputs (CPU)."""
import json
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))


def test_train_mlp_digits_fallback(tmp_path, capsys):
    import train_mlp

    rows = train_mlp.main(["--data", str(tmp_path / "missing"), "--epochs", "3", "--batch", "32", "--hidden", "32",
                           "--device", "cpu", "--out", str(tmp_path)])
    assert "scikit-learn's digits" in capsys.readouterr().out
    stock, fused = (r["test accuracy"] for r in rows)
    assert stock > 0.7 and abs(stock - fused) < 0.05
    saved = json.loads((tmp_path / "mlp_cpu.json").read_text())
    assert saved["environment"]["git_commit"] and len(saved["rows"]) == 2


def test_bench_refuses_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    import bench_matmul_relu

    sys.argv = ["bench_matmul_relu.py", "--quick"]
    with pytest.raises(SystemExit, match="GPU"):
        bench_matmul_relu.main()
    import sweep_cuda_tiles

    sys.argv = ["sweep_cuda_tiles.py"]
    with pytest.raises(SystemExit, match="GPU"):
        sweep_cuda_tiles.main()


def test_report_renders_every_committed_result():
    # The README tables come from results/*.json: each committed file must render.
    import report

    sections = {"matmul_relu_bench": report.matmul_relu_section, "matmul_relu_bench_cuda": report.cuda_section,
                "compile_speedup_cuda": report.compile_section, "sparse_embedding_cuda": report.sparse_section,
                "mlp_cuda": report.mlp_section}
    for name, render in sections.items():
        data = report.load(name)
        assert data is not None, f"results/{name}.json is missing"
        text = render(data)
        assert data["environment"]["git_commit"] in text and "|---|" in text
    sweep = report.load("cuda_tiles_sweep")  # rendered inside the CUDA section
    assert sweep is not None
    assert sweep["environment"]["git_commit"] in report.cuda_section(report.load("matmul_relu_bench_cuda"), sweep)


@pytest.mark.slow
def test_compile_speedup_smoke(tmp_path):
    # The study's machinery end to end on a tiny patched decoder: inductor compiles it with no graph break.
    import compile_speedup

    rows = compile_speedup.main(["--tiny", "--device", "cpu", "--plan", "opt+fuselab:train:fp32:eager,default",
                                 "--warmup", "0", "--iters", "1", "--out", str(tmp_path)])
    compiled = next(r for r in rows if r["mode"] == "default")
    assert compiled["graph breaks"] == 0 and compiled["ms/step"] > 0
    assert (tmp_path / "compile_speedup_cpu.json").exists()
    assert compiled["speedup vs eager"] > 0
    with pytest.raises(SystemExit, match="unknown modes"):
        compile_speedup.main(["--plan", "opt:train:fp32:turbo"])
    with pytest.raises(SystemExit, match="unknown models"):
        compile_speedup.main(["--plan", "gpt:train:fp32:eager"])
    with pytest.raises(SystemExit, match="unknown precisions"):
        compile_speedup.main(["--plan", "opt:train:fp8:eager"])


def test_compile_speedup_relu_bound_and_tf32(tmp_path):
    # opt-norelu is the stock decoder without its ReLU (the bound on what fusing it can save); tf32
    # sets the matmul precision for its own configuration, and main() restores it.
    import compile_speedup
    import torch

    model, *_ = compile_speedup.build("opt-norelu", True, torch.device("cpu"))
    assert all(type(layer.activation_fn) is torch.nn.Identity for layer in model.model.decoder.layers)
    stock, *_ = compile_speedup.build("opt", True, torch.device("cpu"))
    assert all(type(layer.activation_fn) is torch.nn.ReLU for layer in stock.model.decoder.layers)
    before = torch.get_float32_matmul_precision()
    seen = []
    with mock.patch.object(compile_speedup, "add_pass",
                           lambda measured, row: seen.append(torch.get_float32_matmul_precision())):
        compile_speedup.main(["--tiny", "--device", "cpu", "--plan", "opt-norelu:infer:tf32,fp32:eager",
                              "--warmup", "0", "--iters", "1", "--out", str(tmp_path)])
    assert seen == ["high", "highest"] and torch.get_float32_matmul_precision() == before


def test_compile_speedup_reports_a_failed_configuration(tmp_path):
    # One configuration failing (OOM, a compiler error) is reported; the others still run.
    import compile_speedup

    run_one = compile_speedup.run_one

    def flaky(model, mode, *rest):
        if mode == "default":
            raise RuntimeError("out of memory")
        return run_one(model, mode, *rest)

    with mock.patch.object(compile_speedup, "run_one", flaky):
        rows = compile_speedup.main(["--tiny", "--device", "cpu", "--plan", "opt:infer:fp32:default,eager",
                                     "--warmup", "0", "--iters", "1", "--out", str(tmp_path)])
    assert [r["mode"] for r in rows] == ["eager"]
    saved = json.loads((tmp_path / "compile_speedup_cpu.json").read_text())
    assert [(f["mode"], f["error"]) for f in saved["failed"]] == [("default", "RuntimeError: out of memory")]
    with mock.patch.object(compile_speedup, "run_one", run_one):  # re-run with --merge: the failure is gone
        compile_speedup.main(["--tiny", "--device", "cpu", "--plan", "opt:infer:fp32:default", "--merge",
                              "--warmup", "0", "--iters", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "compile_speedup_cpu.json").read_text())
    assert saved["failed"] == [] and [r["mode"] for r in saved["rows"]] == ["eager", "default"]


def test_compile_speedup_ratios_and_order():
    import compile_speedup

    def row(model, mode, ms, task="train"):
        return {"model": model, "task": task, "precision": "bf16", "mode": mode, "ms/step": ms}

    rows = compile_speedup.add_speedups([row("opt+fuselab", "default", 30.0), row("opt", "default", 33.0),
                                         row("opt", "eager", 40.0), row("opt+fuselab", "eager", 44.0),
                                         row("resnet50", "eager", 20.0, "infer")])
    by = {(r["model"], r["mode"]): r for r in rows}
    assert by["opt+fuselab", "default"]["speedup vs eager"] == pytest.approx(44 / 30)
    assert by["opt+fuselab", "default"]["x stock, same mode"] == pytest.approx(33 / 30)
    assert by["opt+fuselab", "eager"]["x stock, same mode"] == pytest.approx(40 / 44)
    assert by["opt", "eager"]["x stock, same mode"] is None and by["resnet50", "eager"]["x stock, same mode"] is None
    assert [(r["model"], r["mode"]) for r in compile_speedup.study_order(rows)] == [
        ("resnet50", "eager"), ("opt", "eager"), ("opt", "default"), ("opt+fuselab", "eager"),
        ("opt+fuselab", "default")]


def test_compile_speedup_merge_runs_in_pieces(tmp_path):
    # --merge keeps the configurations a run skips and replaces the ones it measures; rows carry commits.
    import compile_speedup

    def run(plan, *extra):
        compile_speedup.main(["--tiny", "--device", "cpu", "--plan", plan, "--warmup", "0", "--iters", "1",
                              "--out", str(tmp_path), *extra])
        return json.loads((tmp_path / "compile_speedup_cpu.json").read_text())["rows"]

    first = run("opt:infer:fp32:eager")
    assert [r["model"] for r in first] == ["opt"] and first[0]["commit"]
    both = run("resnet50:infer:fp32:eager", "--merge")
    assert [(r["model"], r["ms/step"]) for r in both][0] == ("opt", first[0]["ms/step"])
    assert [r["model"] for r in both] == ["opt", "resnet50"]
    again = run("opt:infer:fp32:eager", "--merge")
    assert [r["model"] for r in again] == ["opt", "resnet50"] and again[1] == both[1]
    assert again[0]["ms/step"] != first[0]["ms/step"]  # re-measured, not kept
    alone = run("resnet50:infer:fp32:eager")  # without --merge a run stands alone
    assert [r["model"] for r in alone] == ["resnet50"]


def test_compile_speedup_passes_alternate_and_average(tmp_path):
    import compile_speedup

    rows = compile_speedup.main(["--tiny", "--device", "cpu", "--plan", "opt,resnet50:infer:fp32:eager",
                                 "--passes", "3", "--warmup", "0", "--iters", "1", "--out", str(tmp_path)])
    assert [r["model"] for r in rows] == ["opt", "resnet50"]
    for r in rows:
        passes = r["ms/step passes"]
        assert len(passes) == 3 and r["ms/step"] == pytest.approx(sum(passes) / 3)
        unit = "tok/s" if r["model"] == "opt" else "img/s"
        items = 2 * 32 if r["model"] == "opt" else 2  # the tiny batch
        assert r[unit] == pytest.approx(items / (r["ms/step"] / 1e3))
