"""fuselab.distributed on the CPU: 2 gloo ranks under torchrun (tests/distributed_worker.py).

Process launches are few and shared (each costs seconds of imports): one ``train`` launch makes
every DDP/FSDP/compile/fused-layer/DTensor/checkpoint measurement, two more resume its checkpoint
on 2 ranks and on 1 plain process, two that fail on purpose run side by side, and the experiment
scripts run once each under torchrun (train_fsdp's resume on one rank runs in this process).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fuselab.distributed as fd
from fuselab.nn import fuse_linear_relu

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
TOL = 1e-5  # fp32 parity with one process


def launch(args, nproc=2, timeout=180, env_extra=None, module=False, background=False, script=WORKER):
    """Run ``script`` (or with ``module``, ``-m``) with ``args`` under torchrun with ``nproc`` ranks (``nproc=None``:
    one plain process); ``background``: return the running Popen (``finish`` it)."""
    env = fd.launch_environment()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
               **(env_extra or {}))
    target = ["-m", *args] if module else [str(script), *args]
    if nproc is None:
        cmd = [sys.executable, *target]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.started = time.perf_counter()
    return proc if background else finish(proc, timeout)


def finish(proc, timeout):
    try:
        proc.stdout, proc.stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.stdout, proc.stderr = proc.communicate()
        proc.stderr += f"\n[test: killed after {timeout} s]"
    proc.seconds = time.perf_counter() - proc.started
    return proc


def output(proc) -> str:
    return f"exit {proc.returncode} after {proc.seconds:.1f} s\n--- stdout\n{proc.stdout[-4000:]}\n" \
           f"--- stderr\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def trained(run_dir):
    """The ``train`` scenario: it ends by killing rank 1 in a checkpoint save, so it exits non-zero."""
    proc = launch(["train", str(run_dir)])
    path = run_dir / "train.json"
    assert path.exists(), output(proc)
    return json.loads(path.read_text()), proc


@pytest.fixture(scope="module")
def resumed(run_dir, trained):
    out = {}
    for nproc, ranks in ((2, 2), (None, 1)):
        proc = launch(["resume", str(run_dir)], nproc=nproc)
        path = run_dir / f"resume_{ranks}.json"
        assert proc.returncode == 0 and path.exists(), output(proc)
        out[ranks] = json.loads(path.read_text())
    return out


# ----------------------------------------------------------------------------------------------
# DDP and FSDP2 parity


def test_ddp_gradients_identical_and_equal_to_one_process(trained):
    ddp = trained[0]["ddp"]
    assert ddp["wrapped"] == "DistributedDataParallel"
    assert ddp["grads_identical_across_ranks"]
    assert ddp["grad_max_diff_vs_single"] < 1e-6
    assert ddp["param_max_diff_vs_single"] < 1e-6


def test_fsdp_matches_one_process(trained):
    fsdp = trained[0]["fsdp"]
    assert fsdp["block_types"] == ["GPT2Block"]
    assert len(fsdp["losses"]) == 4
    for got, want in zip(fsdp["losses"], fsdp["ref_losses"]):
        assert abs(got - want) < TOL
    assert fsdp["param_max_diff"] < TOL


def test_fsdp_rank_holds_half_of_each_parameter(trained):
    for s in trained[0]["fsdp"]["shards"]:
        assert s["sum_over_ranks"] == s["global"], s
        rows_per_rank = -(-s["dim0"] // 2)
        assert s["local"] <= rows_per_rank * (s["global"] // s["dim0"]), s
        assert abs(s["local"] / s["global"] - 0.5) <= 0.5 / s["dim0"] + 1e-9, s


def test_fsdp_composes_with_compile_activation_checkpointing_and_bf16(trained):
    wrapped = trained[0]["wrapped"]
    assert wrapped["compile+ac block"] == "FSDPOptimizedModule"  # compiled block, sharded
    assert wrapped["compile+ac"] == pytest.approx(wrapped["ref"], abs=TOL)
    # bf16 parameters in the forward, fp32 master weights and reductions: close, not equal
    assert wrapped["bf16"] == pytest.approx(wrapped["ref"], rel=1e-3)
    assert wrapped["bf16"] != wrapped["ref"]
    # checkpoint keys are the plain model's (no _orig_mod. / _checkpoint_wrapped_module.)
    assert wrapped["state_dict keys"] == ["transformer.h.0.ln_1.bias", "transformer.h.0.ln_1.weight"]


def test_fused_layers_before_and_after_sharding(trained):
    fused = trained[0]["fused"]
    reference = fused["unfused"]["losses"]
    before = fused["fuse_before_shard"]
    assert "error" not in before, before
    assert before["fc"] == "FusedConv1DReLU"
    assert max(abs(a - b) for a, b in zip(before["losses"], reference)) < TOL
    after = fused["fuse_after_shard"]
    assert "error" not in after, after
    # Never a different result: whatever fuse_linear_relu did to a sharded model, training is unchanged
    assert max(abs(a - b) for a, b in zip(after["losses"], reference)) < TOL
    assert after["fusion"]["fused"], after["fusion"]["report"]  # converted in place: FSDP still gathers into it
    assert after["fc"] == "FusedConv1DReLU"


def test_misuse_is_refused_and_opt_blocks_fuse_after_sharding(trained):
    edges = trained[0]["edges"]
    # train_state is saved once: a per-rank value came back as rank 0's on every rank
    assert "step and train_state differ between ranks in ['position']" in edges["per_rank_train_state"]
    assert "differ between ranks in ['step']" in edges["per_rank_step"]
    assert "differ between ranks in ['flag'] ('flag': rank 0 true, rank 1 1)" in edges["encoded_train_state"]
    assert "rank 1's train_state may not set ['time']" in edges["rank1_reserved"], edges
    assert "async_save differs between ranks ([False, True])" in edges["async_mismatch"], edges
    assert "different settings: seed is 0 on rank 0 and 1 on rank 1" in edges["rank_settings"], edges
    # ranks writing into folders of their own: rank 0 refuses to publish a checkpoint without rank 1's data
    assert "was written but not published" in edges["ranks_apart"], edges
    assert "__1_0.distcp (missing) (every rank must write into the same folder" in edges["ranks_apart"], edges
    # refused on rank 0 only: both ranks raise (rank 1 waiting alone in the collective would hang the run)
    assert "rank 0's train_state['position'] is a builtins.tuple" in edges["rank0_json_train_state"], edges
    # FSDP2 failed deep in its backward (fsdp::chunk_cat on SparseCPU)
    assert "FSDP2 cannot shard sparse-gradient embeddings (0: sparse=True)" in edges["sparse_fsdp"]
    assert "parameters shared between blocks (0.weight, 0.bias)" in edges["shared_fsdp"], edges
    # FSDP2 renames OPTDecoderLayer to FSDPOPTDecoderLayer: the adapter found none of its fc1 layers
    assert edges["opt_fused_after_shard"] == ["model.decoder.layers.0.fc1", "model.decoder.layers.1.fc1"]


def test_dtensor_reaching_fuselab_op_errors_or_is_right(trained):
    cases = trained[0]["dtensor"]
    assert cases["FSDP-sharded fused layer, through FSDP"]["max_abs_err"] < 1e-5  # FSDP all-gathers first
    for name, outcome in cases.items():
        if "error" in outcome:  # an error that names the op and DTensor's reason
            assert "fuselab.matmul_relu" in outcome["error"] and (
                "sharding strategy" in outcome["error"] or "DTensor" in outcome["error"]), (name, outcome)
        else:  # never a wrong result
            assert outcome["max_abs_err"] < 1e-5, (name, outcome)


# ----------------------------------------------------------------------------------------------
# Checkpoints


def test_keep_last_n_and_killed_save(trained, run_dir):
    data, proc = trained
    assert data["checkpoints"] == ["step_00000002", "step_00000003"]  # keep=2 of steps 1, 2, 3 (3 async)
    assert proc.returncode != 0, "the save that rank 1 is killed in should fail the job"
    assert "killed in the middle of a checkpoint save" in proc.stderr
    names = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    assert "step_00000006" not in names and ".tmp-step_00000006" in names, names
    assert fd.Checkpointer(run_dir / "ckpt").latest().name == "step_00000003"  # the partial save is not


def test_resume_on_two_ranks_continues_the_same_run(trained, resumed):
    data, got = trained[0], resumed[2]
    assert got["resumed_step"] == 3 and got["saved_world_size"] == 2  # the killed step-6 save is ignored
    assert got["model_type"].startswith("FSDP")
    assert got["losses"] == pytest.approx(data["losses"][3:], abs=TOL)
    assert got["lr_after"] == pytest.approx(data["lr_after"])
    # per-rank generator states restored: the next draws equal the uninterrupted run's
    assert got["rand_after_checkpoint"] == data["rand_after_checkpoint"]
    assert data["rand_after_checkpoint"][0] != data["rand_after_checkpoint"][1]


def test_resume_on_one_process_reshards(trained, resumed):
    data, got = trained[0], resumed[1]
    assert got["resumed_step"] == 3 and got["world_size"] == 1
    assert got["model_type"] == "GPT2LMHeadModel"  # DTensor shards read into a plain model
    assert got["losses"] == pytest.approx(data["losses"][3:], abs=TOL)
    assert got["lr_after"] == pytest.approx(data["lr_after"])


# ----------------------------------------------------------------------------------------------
# Failures end the job


def test_failing_or_hung_rank_ends_the_job(run_dir):
    # Both launches at once (they mostly wait): rank 1 raises / rank 1 hangs outside any collective
    timeout_s = 5
    procs = {scenario: launch([scenario, str(run_dir)], env_extra={"FUSELAB_TEST_TIMEOUT": str(timeout_s)},
                              background=True) for scenario in ("fail", "hang")}
    for scenario, proc in procs.items():
        proc = finish(proc, timeout=120)
        assert proc.returncode != 0, output(proc)
        # startup (imports, rendezvous) + the collective timeout + torchrun's teardown
        assert proc.seconds < 60, output(proc)
        if scenario == "fail":
            assert "injected failure on rank 1" in proc.stderr, output(proc)
        else:
            assert "rank 0 failed" in proc.stderr and "imed out" in proc.stderr, output(proc)


# ----------------------------------------------------------------------------------------------
# The experiment scripts, end to end


def _needs(path: Path, what: str):
    if not path.exists():
        pytest.skip(f"{what} not installed at {path} (make data)")


def test_train_fsdp_script_checkpoints_and_resumes_on_fewer_ranks(tmp_path, capfd):
    from experiments import data

    _needs(data.PYTHON_DOCS, "the python3.11-doc corpus")
    _needs(data.WHISPER_SDIST, "whisper's sdist (GPT-2 BPE)")
    common = ["experiments.train_fsdp", "--tiny", "--device", "cpu", "--global-batch", "4", "--log-every", "2",
              "--timing-skip", "1", "--val-batches", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--activation", "relu", "--timeout", "300"]
    first = launch(common + ["--steps", "6", "--checkpoint-every", "2", "--out", str(tmp_path / "a.json")],
                   module=True, timeout=300)
    assert first.returncode == 0, output(first)
    saved = json.loads((tmp_path / "a.json").read_text())
    rows = saved["rows"]
    assert {r["provider"] for r in rows} == {"fsdp+vocab50304+fused-relu"}
    # the results record what was run: rows of runs with another --lr had the same labels and nothing else
    [run] = saved["runs"].values()
    assert run["settings"]["lr"] == 3e-4 and run["settings"]["global_batch"] == 4 and "resumed_from_step" not in run
    assert {r["metric"] for r in rows} >= {"tokens/s", "TFLOP/s per GPU", "loss", "val loss"}
    shutil.rmtree(tmp_path / "ckpt" / "step_00000006")  # as if killed after step 4's save
    # resume in this process: a plain process (no torchrun), world size 1, unsharded
    from experiments import train_fsdp

    with pytest.raises(SystemExit, match="--steps 6 -> 8"):  # the schedule decays over --steps: a longer run differs
        train_fsdp.main(common[1:] + ["--steps", "8", "--resume"])
    # the global batch is the run's: --batch x ranks by default, so fewer ranks halved it silently under the same
    # step schedule (a hybrid run; the tokens column counted the new batch)
    with pytest.raises(SystemExit, match="--global-batch 4 -> 2"):
        train_fsdp.main([a for a in common[1:] if a not in ("--global-batch", "4")]
                        + ["--steps", "6", "--resume", "--batch", "2"])
    rows = train_fsdp.main(common[1:] + ["--steps", "6", "--resume", "--merge", "--out", str(tmp_path / "a.json")])
    assert "resumed from" in capfd.readouterr().err
    merged_file = json.loads((tmp_path / "a.json").read_text())
    merged = merged_file["rows"]
    assert {r.get("resumed_from_step") for r in merged_file["runs"].values()} == {None, 4}
    assert [r["step"] for r in rows if r["metric"] == "loss"] == [6]
    # merged, the first run's curve stays beside the resumed one's (one rank: another provider)
    assert sorted((r["provider"], r["step"]) for r in merged if r["metric"] == "loss") == [
        ("fsdp+vocab50304+fused-relu", 2), ("fsdp+vocab50304+fused-relu", 4), ("fsdp+vocab50304+fused-relu", 6),
        ("single+vocab50304+fused-relu", 6)]
    assert {r["provider"] for r in rows} == {"single+vocab50304+fused-relu"}
    with pytest.raises(SystemExit, match="--vocab-multiple"):  # GPT-2's 50,257 rows: not the saved 50,304
        train_fsdp.main(common[1:] + ["--steps", "8", "--resume", "--vocab-multiple", "1"])
    # a resume continues the saved run: other settings are refused, naming them (the rate was silently the
    # checkpoint's, the activation silently changed under the old run's weights)
    with pytest.raises(SystemExit, match="--activation 'relu' -> 'gelu'; --lr 0.0003 -> 0.01"):
        train_fsdp.main([a for a in common[1:] if a not in ("--activation", "relu")]
                        + ["--steps", "8", "--resume", "--lr", "0.01", "--activation", "gelu"])
    with pytest.raises(SystemExit, match="holds checkpoints \\(up to step 6\\): pass --resume"):
        train_fsdp.main(common[1:] + ["--steps", "8"])
    before = (tmp_path / "a.json").read_text()  # a resume with nothing left to train leaves the results alone
    assert train_fsdp.main(common[1:] + ["--steps", "6", "--resume", "--out", str(tmp_path / "a.json")]) == []
    assert (tmp_path / "a.json").read_text() == before
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002", "step_00000004",
                                                                     "step_00000006"]
    # a part killed after its second checkpoint keeps the results so far (they were written at the run's end only)
    saves, save = [], fd.Checkpointer.save

    def save_then_die(self, step, *a, **k):
        if len(saves) == 2:
            raise KeyboardInterrupt("killed")
        saves.append(step)
        return save(self, step, *a, **k)

    fd.Checkpointer.save = save_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            train_fsdp.main([a if a != str(tmp_path / "ckpt") else str(tmp_path / "killed") for a in common[1:]]
                            + ["--steps", "6", "--checkpoint-every", "2", "--out", str(tmp_path / "killed.json")])
    finally:
        fd.Checkpointer.save = save
    kept = json.loads((tmp_path / "killed.json").read_text())["rows"]
    assert [r["step"] for r in kept if r["metric"] == "loss"] == [2, 4]


def test_train_fsdp_validation_counts_each_held_out_window_once(caplog):
    # 100 global batches of a split of 12 windows: each window was counted ~8 times, unevenly, with no warning
    from types import SimpleNamespace

    from experiments import train_fsdp

    windows = train_fsdp.Windows(torch.arange(12 * 8 + 1), seq=8, seed=0)
    seen = []

    def forward_loss(x, y):
        seen.extend(x[:, 0].tolist())
        return torch.tensor(1.0)

    rt = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True)
    args = SimpleNamespace(val_batches=100, batch=5, seq=8)
    loss, count = train_fsdp.evaluate(torch.nn.Linear(1, 1), windows, args, rt, forward_loss, global_batch=4)
    assert (loss, count) == (1.0, 12) and sorted(seen) == list(range(0, 96, 8))
    assert "asks for 400 held-out sequences; the held-out split has 12 windows" in caplog.text


def test_train_ddp_script(tmp_path):
    from experiments import data

    _needs(data.FASHION_MNIST / "train-images-idx3-ubyte.gz", "Fashion-MNIST")
    common = ["--tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ckpt"), "--timeout", "300"]
    # --checkpoint-every saves inside the epoch (it raised at its first save: train_state set "step")
    proc = launch(["experiments.train_ddp", *common, "--steps", "6", "--checkpoint-every", "4",
                   "--out", str(tmp_path / "r.json")], module=True, timeout=300)
    assert proc.returncode == 0, output(proc)
    assert "lr 0.2 (= 0.1 x 2)" in proc.stderr  # scaled by the world size
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    metrics = {r["metric"] for r in rows}
    assert {"images/s", "test accuracy", "final test accuracy"} <= metrics
    assert all(r["shape"] == "2x32" for r in rows)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000004", "step_00000006"]
    shutil.rmtree(tmp_path / "ckpt" / "step_00000006")  # as if killed after step 4's save
    # resumed in this process, world size 1: its steps count batches of 32 (4 steps of 2 x 32 = 8 of 32); the
    # schedule spans the same 384 samples (12 of its steps), and another length is refused
    from experiments import train_ddp

    with pytest.raises(SystemExit, match="schedule '384 samples' -> '448 samples'"):
        train_ddp.main([*common, "--steps", "14", "--resume"])
    rows = train_ddp.main([*common, "--steps", "12", "--resume", "--out", str(tmp_path / "s.json")])
    assert {r["step"] for r in rows if r["metric"] == "test accuracy"} == {12}
    # the resumed epoch's train loss is over its batches after sample 256 only, and says so
    assert [r.get("from_sample") for r in rows if r["metric"] == "train loss"] == [256]
    with pytest.raises(SystemExit, match="--lr 0.1 -> 0.5"):  # it trained on at the checkpoint's rate, logging 0.5
        train_ddp.main([*common, "--steps", "12", "--resume", "--lr", "0.5"])
    with pytest.raises(SystemExit, match="--steps 20 is more than --epochs 1 x 16 steps an epoch"):  # ran 16, silently
        train_ddp.main([*common, "--steps", "20", "--out", str(tmp_path / "t.json")])


def test_train_ddp_refuses_a_full_run_on_the_cpu(capsys):
    # Found by a probe: it started a 5-epoch ResNet-18 run (tqdm's estimate on this CPU: over an hour and a half)
    from experiments import train_ddp

    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--device", "cpu"])
    assert "--tiny for a smoke run" in capsys.readouterr().err
    for shorter in (["--tiny"], ["--limit-train", "512"], ["--steps", "3"]):
        assert train_ddp.parse_args(["--device", "cpu", *shorter]).device == "cpu"


def test_an_out_folder_is_refused_before_the_run(tmp_path, capsys):
    from experiments import train_ddp, train_fsdp

    with pytest.raises(SystemExit):  # found by a probe: ignored where the tokens were cached
        train_fsdp.parse_args(["--tiny", "--device", "cpu", "--bpe", str(tmp_path / "missing.tar.gz")])
    assert "missing.tar.gz: no such file" in capsys.readouterr().err

    for parse in (train_ddp.parse_args, train_fsdp.parse_args):
        with pytest.raises(SystemExit, match=f"--out {tmp_path} is a folder"):
            parse(["--tiny", "--device", "cpu", "--out", str(tmp_path)])


def test_restart_schedule_moves_a_restored_schedule_to_this_world():
    # train_ddp resumed on another world size kept the saved lr (x the old world size) and its step count.
    from experiments.training import restart_schedule, warmup_cosine_schedule

    def schedule(lr, warmup, total, steps=0):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched = warmup_cosine_schedule(opt, warmup, total)
        for _ in range(steps):
            opt.step()
            sched.step()
        return opt, sched

    saved_opt, saved = schedule(0.2, 2, 10, steps=3)  # 2 ranks: lr 0.1 x 2, 10 steps
    opt, sched = schedule(0.1, 4, 20)  # 1 rank: lr 0.1, 20 steps of half the batch
    opt.load_state_dict(saved_opt.state_dict())  # what Checkpointer.load restores
    sched.load_state_dict(saved.state_dict())
    restart_schedule(sched, 0.1, 6)
    ref_opt, ref = schedule(0.1, 4, 20, steps=6)
    for _ in range(3):
        assert sched.get_last_lr() == ref.get_last_lr() and opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        for o, s in ((opt, sched), (ref_opt, ref)):
            o.step()
            s.step()


# ----------------------------------------------------------------------------------------------
# In this process (no launch)


def _tiny_hf(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32,
                                                                    n_positions=8))
    if kind == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                                                  num_attention_heads=2, vocab_size=32,
                                                                  word_embed_proj_dim=16,
                                                                  max_position_embeddings=16))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                                                  num_hidden_layers=2, num_attention_heads=2,
                                                                  num_key_value_heads=2, vocab_size=32))


@pytest.mark.parametrize("kind,block", [("gpt2", "GPT2Block"), ("opt", "OPTDecoderLayer"),
                                        ("llama", "LlamaDecoderLayer")])
def test_find_blocks_transformers(kind, block):
    blocks = fd.find_blocks(_tiny_hf(kind))
    assert len(blocks) == 2 and {type(m).__name__ for _, m in blocks} == {block}


def test_find_blocks_resnet_stages_and_fallbacks():
    torchvision = pytest.importorskip("torchvision")
    names = [n for n, _ in fd.find_blocks(torchvision.models.resnet18())]
    assert names == ["layer1", "layer2", "layer3", "layer4"]
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert [n for n, _ in fd.find_blocks(mlp)] == ["0", "1", "2"]
    assert [n for n, _ in fd.find_blocks(mlp, block_types=["Linear"])] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="block_types"):
        fd.find_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no module of type"):
        fd.find_blocks(mlp, block_types=[torch.nn.Conv2d])


class _FunctionalReluBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_find_blocks_names_a_graph_module_from_the_fx_path():
    # fuse_linear_relu's torch.fx path inlines the blocks: "pass block_types=" could not help
    fused, report = fuse_linear_relu(_FunctionalReluBlocks())
    assert isinstance(fused, torch.fx.GraphModule) and len(report.fused) == 3
    with pytest.raises(ValueError, match="a torch.fx GraphModule .* shard the model itself"):
        fd.find_blocks(fused)


def test_launch_environment_turns_nvlink_multicast_off():
    env = fd.launch_environment({"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "1"  # an explicit choice is kept
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert fd.launch_environment({})["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("given", ["WORLD_SIZE", "RANK"])
def test_init_refuses_half_a_torchrun_environment(given, monkeypatch):
    # WORLD_SIZE=2 without RANK: one plain process whose Runtime said 2 ranks (train_ddp halved its data, doubled lr)
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(given, "2" if given == "WORLD_SIZE" else "0")
    with pytest.raises(RuntimeError, match=f"{given}=. is set but .* is not: start the ranks with torchrun"):
        fd.init("cpu")


@pytest.mark.parametrize("argv,message", [
    (["--n-embd", "100", "--n-head", "16"], "not divisible"),
    (["--resume"], "needs --checkpoint-dir"),
    (["--steps", "0"], "must be >= 1"),
    (["--val-fraction", "1.5"], "must be in"),
    (["--compile-scope", "model"], "with --compile only"),
    (["--vocab-multiple", "0"], "must be >= 1"),
    (["--vocab-multiple", "4096"], "at most 1024"),
    (["--device", "cpu"], "a 1.31B-parameter GPT-2 on the CPU"),  # it started, and ran for minutes a step
    (["--tiny", "--clip", "nan"], "--clip: must be >= 0, got nan"),  # no clipping, silently
    (["--tiny", "--weight-decay", "nan"], "--weight-decay: must be >= 0"),
])
def test_train_fsdp_rejects_bad_arguments(argv, message, capsys):
    from experiments import train_fsdp

    with pytest.raises(SystemExit):
        train_fsdp.parse_args(argv + ["--device", "cpu"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--batch", "-3"], "must be >= 1"),
    (["--resume"], "needs --checkpoint-dir"),
    (["--arch", "vgg"], "invalid choice"),
    (["--lr", "inf"], "--lr: must be finite"),  # it trained to a NaN loss and wrote the results
    (["--warmup-epochs", "nan"], "--warmup-epochs: must be >= 0"),  # a traceback
    (["--weight-decay", "-1"], "--weight-decay: must be >= 0"),
    (["--sync-bn"], "SyncBatchNorm runs on CUDA only"),  # failed after start-up
])
def test_train_ddp_rejects_bad_arguments(argv, message, capsys):
    from experiments import train_ddp

    with pytest.raises(SystemExit):
        train_ddp.parse_args(argv + ["--device", "cpu"])
    assert message in capsys.readouterr().err


CHECKPOINT_MISUSE = """
import sys, torch, torch.nn as nn
from fuselab import distributed as fd
fd.init("cpu")
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
ck = fd.Checkpointer(sys.argv[1])
ck.save(3, model, torch.optim.SGD(model.parameters(), lr=0.1))
for name, other in [("smaller", nn.Sequential(nn.Linear(4, 8))),
                    ("wider", nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)))]:
    try:
        ck.load(other)
        print(name, "loaded")
    except Exception as e:  # a DCP CheckpointException is a BaseException: it must arrive as an Exception
        print(name, type(e).__name__, e)
try:
    ck.save(5, model, None, None, {"step": 999})
except ValueError as e:
    print("reserved", e)
# Saving before the first step: get_state_dict stepped the optimizer (AdamW's count started at 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
fresh = fd.Checkpointer(sys.argv[1] + "-fresh", keep=None)
fresh.save(0, model, opt)
again = torch.optim.AdamW(model.parameters(), lr=0.1)
fresh.load(model, again)  # a checkpoint without optimizer state: "starts fresh" must be true
print("unstepped", len(opt.state), len(again.state))
# A rollback: resumed from step 200 after 300 was saved; the next save is the line that continues
roll = fd.Checkpointer(sys.argv[1] + "-roll", keep=None)
for step in (100, 200, 300):
    roll.save(step, model)
roll.keep = 2
roll.load(model, path=roll.dir / "step_00000200")
kept = roll.save(250, model)
print("rollback", kept.exists(), roll.latest().name, " ".join(sorted(p.name for p in roll.dir.iterdir())))
roll.save(300, model)
roll.load(model, path=roll.dir / "step_00000250")
roll.save(260, model)  # a second rollback past a step abandoned before: both kept
print("rollback2", " ".join(sorted(p.name for p in roll.dir.iterdir() if p.name.startswith("abandoned"))))
# Two warm starts from another folder in one process: what this Checkpointer wrote between them stays its own
warm2 = fd.Checkpointer(sys.argv[1] + "-warm2")
warm2.load(model, path=fresh.dir / "step_00000000")
warm2.save(3, model)
warm2.load(model, path=fresh.dir / "step_00000000")
print("warmtwice", warm2.save(4, model).name)
# Resumed from 10 of 10, 20, 30, saving 25: the old line's 20 is set aside too (it stayed, counted and resumable)
gap = fd.Checkpointer(sys.argv[1] + "-gap", keep=None)
for step in (10, 20, 30):
    gap.save(step, model)
gap.load(model, path=gap.dir / "step_00000010")
gap.save(25, model)
gap.save(40, model)  # this line's own 25 stays
print("gap", " ".join(sorted(p.name for p in gap.dir.iterdir())))
# Resumed from 40, saving 40 again (a loop that saves at its first step): replaced, no abandoned copy each restart
again40 = fd.Checkpointer(sys.argv[1] + "-gap", keep=None)
again40.load(model)
again40.save(40, model)
print("resave", " ".join(sorted(p.name for p in gap.dir.iterdir())))
# A relative folder stays where it was made (a later os.chdir moved the next save elsewhere)
import os
home = os.getcwd()
os.chdir(sys.argv[1] + "-gap")
rel = fd.Checkpointer("rel", keep=None)
os.chdir(home)
rel.save(1, model)
print("chdir", (gap.dir / "rel" / "step_00000001").is_dir())
# A step folder that is a link into another folder is resumed from as this folder's (it was a warm start: refused)
linked = fd.Checkpointer(sys.argv[1] + "-linked", keep=None)
(linked.dir / "step_00000040").symlink_to(gap.dir / "step_00000040")
linked.load(model, path=linked.dir / "step_00000040")
print("linked", linked.save(41, model).name)
# An empty info.json (written last, before the rename): not whole, the checkpoint before it is resumed from
(gap.dir / "step_00000040" / "info.json").write_text("")
print("info", again40.latest().name)
# The .metadata of a kept checkpoint is parsed once, not at every save's pruning
from torch.distributed.checkpoint import FileSystemReader
reads, read = [], FileSystemReader.read_metadata
FileSystemReader.read_metadata = lambda self: reads.append(1) or read(self)
cached = fd.Checkpointer(sys.argv[1] + "-cached", keep=2)
for step in range(1, 6):
    cached.save(step, model)
FileSystemReader.read_metadata = read
print("reads", len(reads))
try:
    ck.save(-1, model)
except ValueError as e:
    print("negative", e)
# Another run's checkpoints in the folder: a Checkpointer that has not loaded one does not save beside them
try:
    fd.Checkpointer(sys.argv[1] + "-roll").save(5, model)
except ValueError as e:
    print("foreign", e)
try:  # the same step as another run's (a notebook cell run again, say): it was replaced without a word
    fd.Checkpointer(sys.argv[1]).save(3, model)
except ValueError as e:
    print("samestep", e)
# A rollback to a step whose later checkpoint was damaged since (no .metadata): set aside, not a crash on rename
damaged = fd.Checkpointer(sys.argv[1] + "-damaged", keep=None)
for step in (1, 2, 3, 4):
    damaged.save(step, model)
for step in (3, 4):
    (damaged.dir / f"step_0000000{step}" / ".metadata").unlink()
damaged.load(model)
damaged.save(3, model)
print("damaged", " ".join(sorted(p.name for p in damaged.dir.iterdir())))
# keep prunes a damaged folder older than the checkpoints it keeps (it piled up before)
pruned = fd.Checkpointer(sys.argv[1] + "-pruned", keep=None)
for step in (1, 2, 3):
    pruned.save(step, model)
(pruned.dir / "step_00000001" / ".metadata").unlink()
pruned.keep = 2
pruned.save(4, model)
print("pruned", " ".join(sorted(p.name for p in pruned.dir.iterdir())))
# A rollback that saves the step it abandons (resumed from 1, saves 2 again): the old line's 2 is set aside
again = fd.Checkpointer(sys.argv[1] + "-again", keep=None)
for step in (1, 2, 3):
    again.save(step, model)
again.load(model, path=again.dir / "step_00000001")
again.save(2, model)
print("rollback3", " ".join(sorted(p.name for p in again.dir.iterdir())))
# Back to an abandoned line: saving its step sets this line's checkpoint of that step aside (it was replaced)
again.load(model, path=again.dir / "abandoned-step_00000002")
again.save(2, model)
print("abandonedload", " ".join(sorted(p.name for p in again.dir.iterdir())))
# Another optimizer class or grouping: DCP loaded the state by parameter name into it, silently
def stepped(opt):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt
grouped = fd.Checkpointer(sys.argv[1] + "-groups")
weights = [p for p in model.parameters() if p.dim() == 2]
biases = [p for p in model.parameters() if p.dim() == 1]
grouped.save(1, model, stepped(torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 5e-3}], lr=1e-2)))
for name, opt in (("regrouped", torch.optim.Adam(model.parameters(), lr=1e-2)),
                  ("reclassed", torch.optim.AdamW([{"params": weights}, {"params": biases}], lr=1e-2))):
    try:
        grouped.load(model, opt)
        print(name, "loaded")
    except ValueError as e:
        print(name, e)
grouped.load(model, torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 5e-3}], lr=1e-2))
print("samegroups loaded")
# Other state-making settings: amsgrad's state dropped on load while its setting came back (a KeyError at the step)
amsgrad = fd.Checkpointer(sys.argv[1] + "-amsgrad")
amsgrad.save(1, model, stepped(torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)))
try:
    amsgrad.load(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    print("amsgrad loaded")
except ValueError as e:
    print("amsgrad", e)
# Another LR scheduler class: its state failed to load (KeyError 'lr_lambdas') after the model was overwritten
scheduled = fd.Checkpointer(sys.argv[1] + "-scheduler")
sched_opt = stepped(torch.optim.SGD(model.parameters(), lr=0.1))
scheduled.save(1, model, sched_opt, torch.optim.lr_scheduler.StepLR(sched_opt, 5))
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
changed = [p.detach().clone() for p in model.parameters()]
try:
    scheduled.load(model, sched_opt, torch.optim.lr_scheduler.LambdaLR(sched_opt, lambda s: 1.0))
    print("rescheduled loaded")
except ValueError as e:
    print("rescheduled", e, all(torch.equal(a, b) for a, b in zip(changed, model.parameters())))
# An optimizer built before fully_shard_model holds the replaced parameters: it trained nothing, saved silently
try:
    fd.Checkpointer(sys.argv[1] + "-early").save(1, model, torch.optim.SGD(nn.Linear(4, 8).parameters(), lr=0.1))
except ValueError as e:
    print("early", e)
# SGD without momentum keeps no per-parameter state: its scheduled lr was not saved, a resume went on at lr 1.0
stateless = fd.Checkpointer(sys.argv[1] + "-stateless")
sgd = torch.optim.SGD(model.parameters(), lr=1.0)
decay = torch.optim.lr_scheduler.ExponentialLR(sgd, 0.5)
for _ in range(3):
    stepped(sgd)
    decay.step()
stateless.save(3, model, sgd, decay)
after_save = torch.rand(2)
sgd2 = torch.optim.SGD(model.parameters(), lr=1.0)
fd.Checkpointer(sys.argv[1] + "-stateless").load(model, sgd2, torch.optim.lr_scheduler.ExponentialLR(sgd2, 0.5))
print("stateless", sgd2.param_groups[0]["lr"], torch.equal(torch.rand(2), after_save))  # a resume: generators too
# An evaluation of that checkpoint through another Checkpointer rewound this process's generators
evaluated = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
torch.manual_seed(7)
expected = torch.rand(2)
torch.manual_seed(7)
fd.Checkpointer(sys.argv[1] + "-eval").load(evaluated, path=stateless.dir / "step_00000003")
print("evalrng", torch.equal(torch.rand(2), expected))
refused = []
for keep in (2.5, "3", True):  # 2.5 never pruned; "3" raised a bare TypeError
    try:
        fd.Checkpointer(sys.argv[1] + "-keep", keep=keep)
    except ValueError as e:
        refused.append(str(e))
print("keep", " | ".join(refused))
try:
    stateless.load(model, path=stateless.dir / "step_00000099")
except FileNotFoundError as e:
    print("nonexistent", e)
# A parameter without a gradient before the save (a head used later) has no optimizer state: the resume loads
heads = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
head_opt = torch.optim.AdamW(heads.parameters(), lr=0.1)
heads["a"](torch.ones(2, 4)).sum().backward()
head_opt.step()
unused = fd.Checkpointer(sys.argv[1] + "-unused")
unused.save(1, heads, head_opt)
head_opt2 = torch.optim.AdamW(heads.parameters(), lr=0.1)
unused.load(heads, head_opt2)
print("unused", len(head_opt2.state), heads["b"].weight in head_opt2.state)
# A data file cut short (a full disk, a partial copy): named; load() resumes from the whole one before it
unused.save(2, heads, head_opt2)
shard = unused.dir / "step_00000002" / "__0_0.distcp"
shard.write_bytes(shard.read_bytes()[:100])
try:
    unused.load(heads, head_opt2, path=unused.dir / "step_00000002")
except RuntimeError as e:
    print("shard", e)
print("fallback", unused.latest().name, unused.load(heads, head_opt2)["step"])
unused.keep = 2  # the damaged 2 (after the step resumed from) is set aside, not counted: 1 and 3 are kept
unused.save(3, heads, head_opt2)
print("wholekeep", " ".join(sorted(p.name for p in unused.dir.iterdir())))
(unused.dir / "step_00000003" / ".metadata").write_bytes(b"garbage")
try:
    unused.load(heads, head_opt2, path=unused.dir / "step_00000003")
except RuntimeError as e:
    print("metadata", e)
for folder in unused.dir.glob("step_*"):
    (folder / ".metadata").unlink()
try:  # only damaged checkpoints: refused (starting from scratch would silently restart the run)
    unused.load(heads, head_opt2)
except RuntimeError as e:
    print("alldamaged", e)
(unused.dir / "step_\u00b2").mkdir()  # a name whose digit Python's int() reads but is not ASCII: not a step
print("superscript", unused.latest())
# A warm start from another folder's checkpoint does not make this folder's checkpoints this run's
warm = fd.Checkpointer(sys.argv[1] + "-roll")
warm.load(model, path=fresh.dir / "step_00000000")
try:
    warm.save(5, model)
except ValueError as e:
    print("warmstart", e)
failing = fd.Checkpointer(sys.argv[1] + "-async", async_save=True)
def disk_full(*args):
    raise OSError(28, "No space left on device")
failing._commit = disk_full  # the rename after the background write fails
failing.save(1, model)
try:
    failing.wait()
    print("async published")
except RuntimeError as e:
    print("async", e, "|", repr(e.__cause__))
fd.shutdown()
"""


DIVERGED_BUFFERS = """
import sys, torch, torch.nn as nn
from fuselab import distributed as fd
rt = fd.init("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
fd.fully_shard_model(model, block_types=(nn.BatchNorm1d,), mixed_precision=False)
model(torch.randn(16, 4) + rt.rank).sum().backward()  # each rank's own batch statistics: FSDP syncs no buffer
fd.Checkpointer(sys.argv[1]).save(1, model)
fd.shutdown()
"""


def test_a_checkpoint_names_buffers_that_differ_between_ranks(tmp_path):
    # Under FSDP2 each rank's BatchNorm statistics differ; the checkpoint kept one rank's, silently.
    script = tmp_path / "diverged.py"
    script.write_text(DIVERGED_BUFFERS)
    proc = launch([str(tmp_path / "ck")], script=script, timeout=180)
    assert proc.returncode == 0, output(proc)
    assert "buffers differ between ranks (1.running_mean" in proc.stderr, output(proc)


def test_checkpoint_refuses_another_model_and_reserved_keys(tmp_path):
    # A smaller model would silently take part of the checkpoint (DCP loads the keys asked for).
    script = tmp_path / "misuse.py"
    script.write_text(CHECKPOINT_MISUSE)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck")], cwd=ROOT,
                            env={**fd.launch_environment(), "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.started = time.perf_counter()
    proc = finish(proc, 120)
    assert proc.returncode == 0, output(proc)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("smaller", "wider", "reserved", "unstepped", "rollback", "rollback2", "negative", "async", "foreign",
                  "unused", "metadata", "samestep", "rollback3", "regrouped", "reclassed", "samegroups", "rescheduled", "damaged",
                  "pruned", "shard", "fallback", "wholekeep", "alldamaged", "superscript", "warmstart", "gap",
                  "resave", "chdir", "linked", "info", "reads", "warmtwice",
                  "abandonedload", "stateless", "evalrng", "keep", "nonexistent", "amsgrad", "early"))
    assert lines["smaller"].startswith("ValueError") and "model.2.weight" in lines["smaller"], lines
    assert lines["wider"].startswith("RuntimeError") and "Size mismatch" in lines["wider"], lines
    assert "step" in lines["reserved"], lines
    assert lines["unstepped"] == "0 0", lines
    assert lines["rollback"] == "True step_00000250 abandoned-step_00000300 step_00000200 step_00000250", lines
    assert lines["gap"] == "abandoned-step_00000020 abandoned-step_00000030 step_00000010 step_00000025 step_00000040", lines
    assert lines["resave"] == "abandoned-step_00000020 abandoned-step_00000030 step_00000010 step_00000025 step_00000040"
    assert lines["chdir"] == "True" and lines["linked"] == "step_00000041" and lines["info"] == "step_00000025", lines
    assert lines["abandonedload"] == ("abandoned-1-step_00000002 abandoned-step_00000002 abandoned-step_00000003 "
                                      "step_00000001 step_00000002"), lines
    assert lines["warmtwice"] == "step_00000004", lines
    assert lines["reads"] == "5", lines  # each new checkpoint's .metadata once
    assert lines["rollback2"] == "abandoned-1-step_00000300 abandoned-step_00000300", lines
    assert "step must be an int >= 0, got -1" in lines["negative"], lines
    assert "was written but not published" in lines["async"] and "No space left" in lines["async"], lines
    assert "that this Checkpointer neither loaded nor wrote" in lines["foreign"], lines
    assert "holds checkpoints of step(s) 3 that this Checkpointer neither loaded" in lines["samestep"], lines
    assert lines["rollback3"] == "abandoned-step_00000002 abandoned-step_00000003 step_00000001 step_00000002", lines
    assert "2 parameter group(s) of 2, 2 parameters, this one 1 of 4" in lines["regrouped"], lines
    assert "optimizer is torch.optim.adam.Adam, this one torch.optim.adamw.AdamW" in lines["reclassed"], lines
    assert lines["samegroups"] == "loaded", lines
    assert ("the LR scheduler is torch.optim.lr_scheduler.StepLR, this one torch.optim.lr_scheduler.LambdaLR"
            in lines["rescheduled"] and lines["rescheduled"].endswith("True")), lines  # the model left as it was
    assert lines["damaged"] == ("abandoned-step_00000003 abandoned-step_00000004 step_00000001 step_00000002 "
                                "step_00000003"), lines
    assert lines["pruned"] == "step_00000003 step_00000004", lines
    assert "-unused/step_00000002 is damaged: __0_0.distcp (100 bytes, " in lines["shard"], lines
    assert lines["fallback"] == "step_00000001 1", lines
    assert lines["wholekeep"] == "abandoned-step_00000002 step_00000001 step_00000003", lines
    assert "holds no checkpoint to resume from, only damaged ones" in lines["alldamaged"], lines
    assert lines["superscript"] == "None", lines
    assert "that this Checkpointer neither loaded nor wrote" in lines["warmstart"], lines
    assert lines["unused"] == "2 False", lines  # a.weight and a.bias have state; b starts fresh, as without the resume
    assert "could not read" in lines["metadata"] and "-unused/step_00000003/.metadata" in lines["metadata"], lines
    assert "holds optimizer state (max_exp_avg_sq) that this optimizer does not keep" in lines["amsgrad"], lines
    assert "the optimizer holds 2 tensor(s) that are not parameters of the model: built before" in lines["early"]
    assert lines["stateless"] == "0.125 True", lines  # the scheduled lr and the generators resumed
    assert lines["evalrng"] == "True", lines  # another folder's checkpoint: the generators left as they were
    assert lines["keep"] == " | ".join(f"keep must be an int >= 1 (or None: keep all), got {keep!r}"
                                      for keep in (2.5, "3", True)), lines
    assert "step_00000099 does not exist" in lines["nonexistent"], lines


def _self_containing():
    loop = [1]
    loop.append(loop)
    return {"loop": loop}


@pytest.mark.parametrize("train_state, named", [
    ({1: "a"}, "train_state has the key 1 (int): JSON gives keys back as strings"),
    ({"pos": (3, 4)}, "train_state['pos'] is a builtins.tuple"),
    ({"ids": [1, torch.tensor(2)]}, "train_state['ids'][1] is a torch.Tensor"),
    ({"seen": np.int64(3)}, "train_state['seen'] is a numpy.int64: JSON would not give it back as it is (a NumPy or tensor scalar: .item() it)"),
    (_self_containing(), "train_state['loop'][1] contains itself"),
    ({"n": 10**5000}, "train_state cannot be written as JSON (ValueError"),
], ids=["int-key", "tuple", "tensor", "numpy-int", "self-containing", "huge-int"])
def test_a_train_state_json_would_not_give_back_is_refused(tmp_path, train_state, named):
    # Read back from JSON: an int key came back a string, a tuple a list, silently.
    with pytest.raises(TypeError, match=re.escape(named)):
        fd.Checkpointer(tmp_path).save(1, torch.nn.Linear(2, 2), train_state=train_state)
    assert not any(tmp_path.iterdir())


def test_a_train_state_of_numbers_json_gives_back_is_saved(tmp_path):
    # NumPy's float64 is a float (np.mean's result): it comes back equal, as do nan and a nested dict.
    state = {"loss": np.float64(0.25), "nan": float("nan"), "flags": {"ok": True, "n": [1, 2.5, None, "a"]}}
    ckpt = fd.Checkpointer(tmp_path)
    ckpt.save(1, torch.nn.Linear(2, 2), train_state=state)
    back = ckpt.train_state()
    assert back["loss"] == 0.25 and back["flags"] == state["flags"] and back["nan"] != back["nan"]
