"""experiments/distill_quantize.py on a CPU: the --tiny run end to end, its two-phase flow
(--save-students, then --load-students --merge), checkpoints, argument and data errors, and the
28x28 image models. Data: a small synthetic Fashion-MNIST in Debian's idx layout (no download)."""
import gzip
import json
import struct

import pytest
import torch

from experiments import data as datasets
from experiments import distill_quantize as dq
from experiments import harness, report
from experiments.harness import Results
from experiments.models import resnet_28x28, small_cnn


def _idx(path, array: torch.Tensor) -> None:
    """``array`` (uint8) as an idx file (gzip), the format of the Fashion-MNIST files."""
    dims = array.shape
    header = struct.pack(">BBBB", 0, 0, 0x08, len(dims)) + b"".join(struct.pack(">I", d) for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + array.contiguous().numpy().tobytes())


@pytest.fixture(scope="module")
def fake_fmnist(tmp_path_factory):
    """1,200 training and 600 test images, ten classes told apart by a bright bar's row, plus noise."""
    root = tmp_path_factory.mktemp("fashion-mnist")
    gen = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 1200), ("t10k", 600)):
        labels = torch.arange(n) % 10
        images = torch.randint(0, 60, (n, 28, 28), generator=gen)
        for c in range(10):
            images[labels == c, 2 + 2 * c:4 + 2 * c, 4:24] = 230
        _idx(root / f"{prefix}-images-idx3-ubyte.gz", images.to(torch.uint8))
        _idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels.to(torch.uint8))
    return root


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """runs/, results/ and the data cache redirected: a test never writes the repository's files."""
    monkeypatch.setattr(harness, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(datasets, "CACHE", tmp_path / "cache")
    return tmp_path


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        dq.main(argv)
    assert exc.value.code == 2, f"{argv}: exit status {exc.value.code}, not a usage error"
    return capsys.readouterr().err


def test_tiny_run_end_to_end_then_load_students(fake_fmnist, sandbox, monkeypatch):
    """--tiny trains, distills, quantizes (fuselab's quantize_ when torchao is absent) and times on a
    CPU; the saved students then go through the CPU part again in a second run merged into the file."""
    monkeypatch.setattr(dq, "has_torchao", lambda: False)  # CI's path; pt2e is tested below
    out = sandbox / "dq.json"
    common = ["--tiny", "--data", str(fake_fmnist), "--no-compile", "--out", str(out)]
    dq.main(common + ["--teacher-ckpt", str(sandbox / "teacher.pt"), "--save-students", str(sandbox / "st")])
    res = Results.load(out)
    assert res.study == "distill_quantize"
    acc = {(r["provider"], r["shape"]): r for r in res.select(op="accuracy")}
    for prov in ("scratch resnet18", "distilled resnet18", "scratch cnn", "distilled cnn",
                 "distilled resnet18 int8 (cpu, fuselab linear int8 dynamic)",
                 "distilled cnn int8 (cpu, fuselab linear int8 dynamic)"):
        for shape in ("seed 0", "seed 1"):
            assert 0.0 <= acc[(prov, shape)]["p50"] <= 1.0
        summary = acc[(prov, "seeds 0,1")]
        assert summary["p20"] <= summary["mean"] <= summary["p80"] and summary["n"] == 2
    assert ("teacher", "seed 0") in acc
    # the synthetic classes are easy: the teacher and the students learn them (chance is 0.1; the tiny
    # teacher scored 0.49 in one clean-clone run, above 0.5 in the others)
    assert acc[("teacher", "seed 0")]["p50"] > 0.3 and acc[("scratch cnn", "seed 0")]["p50"] > 0.3
    sizes = {r["provider"]: r for r in res.select(op="size", metric="MB")}
    cnn, cnn_q = sizes["distilled cnn"], sizes["distilled cnn int8 (cpu, fuselab linear int8 dynamic)"]
    assert cnn_q["bytes"] < cnn["bytes"] / 2 and cnn_q["fp32"] == "distilled cnn"  # Linear-heavy: int8 shrinks it
    lat = res.select(metric="ms", mode="wall")
    assert {(r["op"], r["provider"], r["shape"]) for r in lat} >= {
        ("cpu latency: resnet18", "distilled resnet18", "batch 1"),
        ("cpu latency: cnn", "distilled cnn", "batch 64"),
        ("cpu latency: cnn", "distilled cnn int8 (cpu, fuselab linear int8 dynamic)", "batch 64"),
        ("cpu latency: teacher", "teacher", "batch 64")}
    assert all(r["threads"] >= 1 and 0 < r["p20"] <= r["p50"] <= r["p80"] for r in lat)
    assert res.baselines["cpu latency: cnn"] == "distilled cnn" and not res.failed
    table = out.with_suffix(".md").read_text()
    assert "| distilled cnn |" in table and "Beats scratch beyond the seeds' spread" in table
    assert out.with_suffix(".png").stat().st_size > 0
    page = report.render_study(res)  # the study's own summary table, as the docs page shows it
    assert "test accuracy" in page and "| distilled cnn |" in page and "CPU ms b64" in page
    saved = sorted(p.name for p in (sandbox / "st").iterdir())
    assert saved == ["distilled-cnn-seed0.0.pt", "distilled-cnn-seed1.0.pt", "distilled-resnet18-seed0.0.pt",
                     "distilled-resnet18-seed1.0.pt"]

    # phase two: the saved students (and the cached teacher), CPU part only, merged into the same file
    rows_before, first_run = len(res.rows), next(iter(res.runs))
    dq.main(common + ["--load-students", str(sandbox / "st"), "--teacher-ckpt", str(sandbox / "teacher.pt"),
                      "--students", "cnn", "--merge"])
    merged = Results.load(out)
    # re-measured in place, both seeds, and their summary recomputed (no stale one beside it)
    assert len(merged.runs) == 2 and len(merged.rows) == rows_before
    again = merged.select(op="accuracy", provider="distilled cnn int8 (cpu, fuselab linear int8 dynamic)")
    assert sorted(r["shape"] for r in again if r["run"] != first_run) == ["seed 0", "seed 1", "seeds 0,1"]
    assert not merged.select(op="accuracy", provider="distilled resnet18 int8 (cpu, fuselab linear int8 dynamic)",
                             shape="seeds 0")  # only the cnn was asked for
    teacher_lat = merged.select(op="cpu latency: teacher", shape="batch 1")
    assert teacher_lat[0]["weights"] == "trained"
    # students of the tiny data scored on the full test set: their "accuracy - fp32" mixed two test sets
    with pytest.raises(SystemExit, match=r"was trained and scored on .*tiny.*: give the --data / --tiny it was"):
        dq.main(["--data", str(fake_fmnist), "--no-compile", "--out", str(sandbox / "other.json"),
                 "--load-students", str(sandbox / "st"), "--students", "cnn"])


@pytest.mark.gpu
def test_tiny_run_on_a_gpu(fake_fmnist, sandbox):
    """The GPU path before a real run: training under autocast in channels_last, fuselab's INT8 (and,
    on sm_89+, FP8) students, latency eager and from a CUDA graph; nothing may fail."""
    out = sandbox / "dq.json"
    dq.main(["--tiny", "--device", "cuda", "--data", str(fake_fmnist), "--out", str(out)])
    res = Results.load(out)
    assert not res.failed, res.failed
    kinds = ["int8 dynamic", "int8 dynamic+conv", "int8 static"] + (
        ["fp8"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    for arch in ("resnet18", "cnn"):
        for prov in [f"distilled {arch}"] + [f"distilled {arch} {k} (gpu)" for k in kinds]:
            assert res.select(op="accuracy", provider=prov, shape="seed 1")
            for mode in ("eager", "graph"):
                assert res.select(op=f"gpu latency: {arch}", provider=prov, shape="batch 64", mode=mode)
    assert res.select(op="gpu latency: teacher", provider="teacher", mode="graph")


def test_pt2e_int8_students_run_at_every_batch_size():
    """The CPU INT8 route (torchao's pt2e through fuselab.quant) on the tiny students: torchvision's
    ResNet blocks, any batch size after calibrating on another, accuracy close to fp32's."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    calib = [torch.randn(32, 1, 28, 28) for _ in range(2)]
    for arch in ("resnet18", "cnn"):
        model = dq.TINY_ARCHS[arch].build().eval()
        q = dq.pt2e_quantize(model, calib)
        for b in (1, 64, 500):
            x = torch.randn(b, 1, 28, 28)
            with torch.no_grad():
                ref, out = model(x), q(x)
            assert out.shape == (b, 10)
            assert harness.rel_error(out, ref) < 0.1, arch
        nbytes, by_dtype = dq.state_bytes(q)
        assert by_dtype.get("int8", 0) > 0 and nbytes < dq.state_bytes(model)[0]


def test_scratch_and_distilled_students_differ_only_in_the_loss():
    """One seed: the same initial weights, batches and flips; with alpha = 0 DistillationLoss is the
    cross-entropy, so the scratch and the distilled student end bit-identical."""
    from fuselab.quant import DistillationLoss

    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (320, 28, 28), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 10, (320,), generator=gen)
    data = dq.Data(images, labels, images[:64], labels[:64], "random")
    states = []
    for distill in (None, DistillationLoss(4.0, 0.0)):
        torch.manual_seed(3)
        model = dq.TINY_ARCHS["cnn"].build()
        dq.train(model, data, epochs=2, batch=64, lr=0.1, seed=3, shift=0, desc="t",
                 teacher_logits=None if distill is None else torch.randn(2, 320, 10), distill=distill)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    flipped, _ = dq.augment(images[:8], torch.Generator().manual_seed(1), shift=2)
    again, _ = dq.augment(images[:8], torch.Generator().manual_seed(1), shift=2)
    assert flipped.shape == (8, 28, 28) and flipped.dtype == torch.uint8 and torch.equal(flipped, again)


def test_checkpoints_round_trip_and_refuse_other_settings(tmp_path, monkeypatch):
    arch = dq.TINY_ARCHS["teacher"]
    torch.manual_seed(0)
    teacher = arch.build().eval()
    path = tmp_path / "t.pt"
    dq.save_teacher(path, teacher, arch, epochs=3, train_size=1024, acc=0.5)
    loaded, meta = dq.load_teacher(path, arch, 3, 1024)
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded(x), teacher(x)) and meta["accuracy"] == 0.5
    assert dq.load_teacher(tmp_path / "none.pt", arch, 3, 1024) is None
    with pytest.raises(SystemExit, match="trained with"):
        dq.load_teacher(path, arch, 4, 1024)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="cannot read it"):
        dq.load_teacher(tmp_path / "bad.pt", arch, 3, 1024)

    monkeypatch.setattr(dq, "SHARD_BYTES", 256 * 1024)  # several files per student, as a full ResNet-18 gets
    student = dq.TINY_ARCHS["resnet18"].build().eval()
    meta = {"name": "resnet18", "provider": "distilled resnet18", "seed": 0, "arch": vars(dq.TINY_ARCHS["resnet18"]),
            "accuracy": 0.1, "data": "x", "epochs": 1}
    paths = dq.save_student(tmp_path / "st", "distilled-resnet18-seed0", student, meta)
    assert len(paths) > 1 and all(p.stat().st_size < dq.SHARD_BYTES + 64 * 1024 for p in paths)
    [(meta2, loaded)] = dq.load_students(tmp_path / "st")
    assert meta2["provider"] == "distilled resnet18"
    with torch.no_grad():
        assert torch.equal(loaded(x), student(x))
    paths[-1].unlink()
    with pytest.raises(SystemExit, match="copy all of them"):
        dq.load_students(tmp_path / "st")


@pytest.mark.parametrize("flag,value", [("--epochs", "0"), ("--teacher-epochs", "-1"), ("--batch", "x"),
                                        ("--seeds", "0,a"), ("--seeds", "1,1"), ("--students", "vgg"),
                                        ("--alpha", "1.5"), ("--temperature", "0"), ("--threads", "0"),
                                        ("--device", "tpu")])
def test_bad_arguments_are_usage_errors(capsys, flag, value):
    err = usage_error(capsys, [flag, value])
    assert flag.lstrip("-").split("-")[0] in err


def test_gpu_parts_refuse_on_a_cpu_only_when_asked(sandbox, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--device", "cuda"], ["--gpu"], ["--fp8"]):
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            dq.main(["--tiny"] + argv)


def test_explicit_data_must_exist_and_be_whole(capsys, sandbox):
    err = usage_error(capsys, ["--tiny", "--data", str(sandbox / "nowhere")])
    assert "no Fashion-MNIST" in err
    corrupt = sandbox / "corrupt"
    corrupt.mkdir()
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (corrupt / name).write_bytes(b"\x1f\x8b not really gzip")
    assert "corrupt" in usage_error(capsys, ["--tiny", "--data", str(corrupt)])
    err = usage_error(capsys, ["--tiny", "--load-students", str(sandbox / "none")])
    assert "no such folder" in err


def test_image_models_are_torchvisions_with_a_28x28_stem():
    import torchvision

    for arch, ref in (("resnet18", torchvision.models.resnet18), ("resnet50", torchvision.models.resnet50)):
        model, tv = resnet_28x28(arch), ref(num_classes=10)
        ours, theirs = model.state_dict(), tv.state_dict()
        assert ours.keys() == theirs.keys()
        assert all(ours[k].shape == theirs[k].shape for k in ours if k != "conv1.weight")
        assert ours["conv1.weight"].shape == (64, 1, 3, 3) and isinstance(model.maxpool, torch.nn.Identity)
    tiny = resnet_28x28("resnet50", width=8, blocks=(1, 1, 1, 1))
    assert tiny(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert small_cnn()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="unknown arch"):
        resnet_28x28("vgg")
    json.dumps(vars(dq.TINY_ARCHS["cnn"]))  # archs go into checkpoints' metadata


def test_merged_runs_get_fresh_summaries_over_every_seed(tmp_path):
    # A later run of seed 0 merged into a three-seed file: seed 0's row is replaced, and the summary is
    # recomputed over seeds 0, 1 and 2 (the earlier one, with the old seed 0, would be stale).
    path = tmp_path / "r.json"
    first = Results(dq.STUDY)
    study = dq.Study(first)
    for seed, acc in ((0, 0.90), (1, 0.92), (2, 0.94)):
        study.accuracy("distilled cnn", seed, acc)
    study.accuracy_summary("distilled cnn", {0: 0.90, 1: 0.92, 2: 0.94})
    study.accuracy("teacher", 0, 0.95)  # never summarized: stays without a summary
    first.save(path)
    second = Results(dq.STUDY)
    dq.Study(second).accuracy("distilled cnn", 0, 0.96)
    dq.Study(second).accuracy_summary("distilled cnn", {0: 0.96})
    second.save(path, merge=True)
    merged = Results.load(path)
    merged.run_id = second.run_id
    dq.Study(merged).refresh_summaries()
    summaries = [r for r in merged.rows if r["shape"].startswith("seeds ")]
    assert [(r["provider"], r["shape"], r["n"]) for r in summaries] == [("distilled cnn", "seeds 0,1,2", 3)]
    assert summaries[0]["mean"] == pytest.approx((0.96 + 0.92 + 0.94) / 3)
    assert summaries[0]["run"] == second.run_id and summaries[0]["seed_runs"] == sorted([first.run_id,
                                                                                         second.run_id])


def test_a_tiny_run_stays_out_of_the_published_results(monkeypatch):
    # Its models keep the real ones' names: merged, a tiny seed would average with an H200 run's.
    monkeypatch.setattr(dq, "load_data", None)  # refused before any work
    with pytest.raises(SystemExit, match="--tiny is a smoke run"):
        dq.main(["--tiny", "--results"])


def test_one_seed_has_no_spread_and_a_merge_keeps_one_recipe(tmp_path, capsys):
    # "beyond the seeds' spread: yes" was printed from one seed each; a --merge pooled seeds of another recipe.
    res = Results(dq.STUDY)
    study = dq.Study(res)
    study.accuracy("distilled cnn", 3, 0.9)
    study.accuracy("scratch cnn", 3, 0.8)
    assert "Beats scratch beyond the seeds' spread: **n/a: one seed has no spread**" in dq.summary(res)
    path = tmp_path / "dq.json"
    other = Results(dq.STUDY)
    other.start_run({"gpu": "CPU", "recipe": "SGD ... DistillationLoss(T=1.0, alpha=0.05); --tiny"})
    other.save(path)
    with pytest.raises(SystemExit):
        dq.main(["--tiny", "--merge", "--out", str(path)])
    assert "its students were trained another way" in capsys.readouterr().err
