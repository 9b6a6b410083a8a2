"""The experiment scripts run end to end on small inputs (CPU)."""
import json
import sys
from pathlib import Path

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
