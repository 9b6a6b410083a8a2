"""The processes tests/test_distributed.py starts (under torchrun, or as one plain process).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py SCENARIO OUT

Scenarios (each writes OUT/<scenario>.json from rank 0 unless it is meant to die):
    train    DDP and FSDP2 parity with one process, shard sizes, fused layers before/after
             sharding, DTensor reaching fuselab's op, misuse (check_edges), checkpoints at steps 1-3 (step 3 async) and
             the uninterrupted losses of steps 4-6; then a save at step 6 that rank 1 dies in
    resume   load the latest checkpoint of OUT/ckpt (on 2 ranks: FSDP; on 1: a plain model) and
             run steps 4-6
    fail     rank 1 raises; rank 0 waits in a collective
    hang     rank 1 hangs outside any collective; rank 0 waits in one until the timeout
"""
import copy
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import fuselab.distributed as fd

TIMEOUT_S = float(os.environ.get("FUSELAB_TEST_TIMEOUT", "20"))
SEQ, VOCAB, GLOBAL_BATCH = 16, 64, 4
STEPS, SAVE_AT = 6, 3


def tiny_gpt2(activation="gelu_new", seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, activation_function=activation, bos_token_id=0,
                     eos_token_id=0, use_cache=False)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def local_rows(x, rank, world):
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per]


def loss_of(model, x):
    return model(input_ids=x, labels=x).loss


# ----------------------------------------------------------------------------------------------


def check_ddp(rt):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = fd.ddp_model(copy.deepcopy(ref))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    same_across_ranks, vs_single = True, 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(local_rows(x, rt.rank, rt.world_size)),
                                                 local_rows(y, rt.rank, rt.world_size))
        loss.backward()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            gathered = [torch.empty_like(p.grad) for _ in range(rt.world_size)]
            dist.all_gather(gathered, p.grad)
            same_across_ranks &= all(torch.equal(gathered[0], t) for t in gathered)
            vs_single = max(vs_single, (p.grad - q.grad).abs().max().item())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"wrapped": type(model).__name__, "grads_identical_across_ranks": same_across_ranks,
            "grad_max_diff_vs_single": vs_single, "param_max_diff_vs_single": params}


def check_fsdp(rt):
    from torch.distributed.tensor import DTensor

    ref = tiny_gpt2()
    model = fd.fully_shard_model(copy.deepcopy(ref), mixed_precision=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for step in range(4):
        x = global_batch(step)
        loss = loss_of(model, local_rows(x, rt.rank, rt.world_size))
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(fd.all_reduce(loss.item()))
        ref_loss = loss_of(ref, x)
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    param_diff, shards = 0.0, []
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        param_diff = max(param_diff, (p.full_tensor() - ref_params[name]).abs().max().item())
        local = torch.tensor([p.to_local().numel()])
        total = local.clone()
        dist.all_reduce(total)
        shards.append({"name": name, "local": int(local), "global": p.numel(), "sum_over_ranks": int(total),
                       "dim0": p.shape[0]})
    return {"losses": losses, "ref_losses": ref_losses, "param_max_diff": param_diff, "shards": shards,
            "block_types": sorted({fd.parallelize._type_name(b) for _, b in fd.find_blocks(ref)})}


def check_wrapped(rt):
    """FSDP2 composed with per-block compile (aot_eager: no C++ toolchain needed) and activation
    checkpointing, and FSDP2's bf16 mixed precision: losses against one unsharded fp32 process."""
    ref = tiny_gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    variants = {
        "compile+ac": dict(mixed_precision=False, compile_blocks=True, activation_checkpointing=True,
                           compile_options={"backend": "aot_eager", "fullgraph": True}),
        "bf16": dict(mixed_precision=True),
    }
    models = {}
    for name, kw in variants.items():
        model = fd.fully_shard_model(copy.deepcopy(ref), **kw)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    out = {name: [] for name in variants}
    out["ref"] = []
    for step in range(3):
        x = global_batch(step)
        for name, (model, opt) in models.items():
            loss = loss_of(model, local_rows(x, rt.rank, rt.world_size))
            loss.backward()
            opt.step(), opt.zero_grad()
            out[name].append(fd.all_reduce(loss.item()))
        loss = loss_of(ref, x)
        loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        out["ref"].append(loss.item())
    model = models["compile+ac"][0]
    out["compile+ac block"] = type(model.transformer.h[0]).__name__
    out["state_dict keys"] = sorted(k for k in fd.checkpoint.get_state_dict(model, [])[0] if ".h.0.ln_1" in k)
    return out


def check_fused(rt):
    from fuselab.nn import fuse_linear_relu

    out = {}
    for variant in ("unfused", "fuse_before_shard", "fuse_after_shard"):
        try:
            model = tiny_gpt2("relu")
            if variant == "fuse_before_shard":
                model, report = fuse_linear_relu(model)
                assert len(report.fused) == 2, str(report)
            fd.fully_shard_model(model, mixed_precision=False)
            fused = None
            if variant == "fuse_after_shard":
                model, report = fuse_linear_relu(model)
                fused = {"fused": report.fused, "report": str(report)}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                loss = loss_of(model, local_rows(global_batch(step), rt.rank, rt.world_size))
                loss.backward()
                opt.step(), opt.zero_grad()
                losses.append(fd.all_reduce(loss.item()))
            out[variant] = {"losses": losses, "fc": type(model.transformer.h[0].mlp.c_fc).__name__, "fusion": fused}
        except Exception as e:  # noqa: BLE001  reported to the test
            out[variant] = {"error": f"{type(e).__name__}: {e}"}
    return out


def check_edges(rt, out_dir):
    """What a skeptical user found: a per-rank train_state, a sparse embedding under FSDP2, OPT's blocks
    after fully_shard renamed them."""
    from transformers import OPTConfig, OPTForCausalLM

    from fuselab.nn import fuse_linear_relu

    out = {}
    model = torch.nn.Linear(4, 2)
    try:
        fd.Checkpointer(out_dir / "edges", keep=None).save(1, model, None, None, {"position": rt.rank})
        out["per_rank_train_state"] = "saved"
    except ValueError as e:
        out["per_rank_train_state"] = str(e)
    try:  # refused on rank 0 only (a tuple there): every rank raises, none waits in the collective alone
        fd.Checkpointer(out_dir / "edges-json", keep=None).save(1, model, None, None,
                                                                  {"position": (1, 2) if rt.rank == 0 else [1, 2]})
        out["rank0_json_train_state"] = "saved"
    except TypeError as e:
        out["rank0_json_train_state"] = str(e)
    try:  # equal in Python, written differently: named, not "differ in []"
        fd.Checkpointer(out_dir / "edges-encoded", keep=None).save(1, model, None, None,
                                                                     {"flag": True if rt.rank == 0 else 1})
        out["encoded_train_state"] = "saved"
    except ValueError as e:
        out["encoded_train_state"] = str(e)
    try:  # a reserved key on rank 1 only: every rank raises (rank 0 waited alone in the collective before)
        fd.Checkpointer(out_dir / "edges-reserved", keep=None).save(1, model, None, None,
                                                                      {"time": 1} if rt.rank == 1 else {})
        out["rank1_reserved"] = "saved"
    except ValueError as e:
        out["rank1_reserved"] = str(e)
    try:  # async on rank 1 only: the ranks would wait in different collectives
        fd.Checkpointer(out_dir / "edges-async", keep=None).save(1, model, async_save=rt.rank == 1)
        out["async_mismatch"] = "saved"
    except ValueError as e:
        out["async_mismatch"] = str(e)
    try:  # each rank its own folder (nodes without a shared filesystem): rank 0 had published a checkpoint missing
        # rank 1's file, and the run carried on (its resume then found only damaged checkpoints)
        fd.Checkpointer(out_dir / f"edges-apart-{rt.rank}", keep=None).save(1, model)
        out["ranks_apart"] = "saved"
    except RuntimeError as e:
        out["ranks_apart"] = f"{e}: {e.__cause__}" if e.__cause__ is not None else str(e)
    from experiments.training import check_same_on_every_rank

    try:  # one rank's --seed: FSDP2 kept each rank's own initial shard, and the run went on
        check_same_on_every_rank({"lr": 0.1, "seed": rt.rank})
        out["rank_settings"] = "agreed"
    except SystemExit as e:
        out["rank_settings"] = str(e)
    try:
        fd.Checkpointer(out_dir / "edges-step", keep=None).save(10 + rt.rank, model)
        out["per_rank_step"] = "saved"
    except ValueError as e:
        out["per_rank_step"] = str(e)
    try:
        fd.fully_shard_model(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True)), mixed_precision=False)
        out["sparse_fsdp"] = "sharded"
    except ValueError as e:
        out["sparse_fsdp"] = str(e)
    shared, block = torch.nn.Linear(4, 4), type("Block", (torch.nn.Sequential,), {})
    try:  # one module in two blocks: FSDP2 failed with "value was None"
        fd.fully_shard_model(torch.nn.Sequential(block(shared), block(shared)), block_types=[block],
                             mixed_precision=False)
        out["shared_fsdp"] = "sharded"
    except ValueError as e:
        out["shared_fsdp"] = str(e)
    torch.manual_seed(0)
    opt_model = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                         num_attention_heads=2, max_position_embeddings=SEQ, word_embed_proj_dim=16,
                                         activation_function="relu"))
    fd.fully_shard_model(opt_model, mixed_precision=False)
    opt_model, report = fuse_linear_relu(opt_model)
    out["opt_fused_after_shard"] = sorted(report.fused)
    return out


def check_dtensor(rt):
    """What fuselab.matmul_relu does with DTensor inputs: a correct result or an error, per layout."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import fuselab

    mesh = rt.mesh()
    torch.manual_seed(0)
    a, b, bias = torch.randn(8, 16), torch.randn(16, 12), torch.randn(12)
    ref = torch.relu(a @ b + bias)
    cases = {
        "all replicated": (Replicate(), Replicate(), Replicate()),
        "rows of a sharded": (Shard(0), Replicate(), Replicate()),
        "columns of b sharded": (Replicate(), Shard(1), Shard(0)),
        "K sharded (partial sums)": (Shard(1), Shard(0), Replicate()),
    }
    out = {}
    for name, (pa, pb, pc) in cases.items():
        args = [distribute_tensor(t, mesh, [p]) for t, p in ((a, pa), (b, pb), (bias, pc))]
        out[name] = _outcome(lambda: fuselab.matmul_relu(*args), ref)
    # a plain activation meeting a DTensor weight (a fused layer's sharded parameter)
    w = distribute_tensor(b, mesh, [Shard(0)])
    out["plain a, sharded DTensor b"] = _outcome(lambda: fuselab.matmul_relu(a, w, bias), ref)
    # the same through FSDP: a fused layer called outside its FSDP unit's all-gather
    from fuselab.nn import FusedLinearReLU

    layer = torch.nn.Sequential(FusedLinearReLU(16, 12))
    with torch.no_grad():
        layer[0].weight.copy_(b.t()), layer[0].bias.copy_(bias)
    fd.fully_shard_model(layer, block_types=[FusedLinearReLU], mixed_precision=False)
    assert isinstance(layer[0].weight, DTensor), "FSDP did not shard the fused layer"
    # FSDPModule.__call__ all-gathers first; forward() alone meets the sharded DTensor weight
    out["FSDP-sharded fused layer, forward outside FSDP"] = _outcome(lambda: FusedLinearReLU.forward(layer[0], a), ref)
    out["FSDP-sharded fused layer, through FSDP"] = _outcome(lambda: layer(a), ref)
    return out


def _outcome(fn, ref):
    from torch.distributed.tensor import DTensor

    try:
        y = fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    full = y.full_tensor() if isinstance(y, DTensor) else y
    return {"max_abs_err": (full - ref).abs().max().item(), "dtensor": isinstance(y, DTensor)}


# ----------------------------------------------------------------------------------------------
# Checkpointing: steps 1..STEPS of a tiny GPT-2 with AdamW + LR schedule, data by position


def make_training(rt, sharded):
    model = tiny_gpt2(seed=1)
    if sharded:
        fd.fully_shard_model(model, mixed_precision=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)
    return model, opt, sched


def train_step(rt, model, opt, sched, position):
    """One step on the global batch at ``position`` (rows of a fixed token stream)."""
    g = torch.Generator().manual_seed(7)
    stream = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    rows = torch.arange(position, position + GLOBAL_BATCH) % stream.shape[0]
    x = stream[rows]
    if rt.world_size > 1:
        x = local_rows(x, rt.rank, rt.world_size)
    loss = loss_of(model, x)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(), opt.zero_grad(), sched.step()
    return fd.all_reduce(loss.item()), position + GLOBAL_BATCH


def run_training(rt, ckpt_dir, out):
    model, opt, sched = make_training(rt, sharded=True)
    torch.manual_seed(123 + rt.rank)  # per-rank generator states, which the checkpoints must restore
    position, losses = 0, []
    ckpt = fd.Checkpointer(ckpt_dir, keep=2)
    for step in range(1, STEPS + 1):
        loss, position = train_step(rt, model, opt, sched, position)
        losses.append(loss)
        if step <= SAVE_AT:  # the last one written in the background
            ckpt.save(step, model, opt, sched, {"position": position}, async_save=step == SAVE_AT)
        if step == SAVE_AT:
            ckpt.wait()
            out["rand_after_checkpoint"] = _gather_floats(torch.rand(2).tolist())
    out["losses"] = losses
    out["lr_after"] = sched.get_last_lr()
    out["checkpoints"] = [p.name for _, p in ckpt.checkpoints()]
    return model, opt, sched, ckpt


def _gather_floats(values):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def scenario_train(rt, out_dir):
    out = {"world_size": rt.world_size}
    t0 = time.perf_counter()
    for name, fn in (("ddp", check_ddp), ("fsdp", check_fsdp), ("wrapped", check_wrapped), ("fused", check_fused),
                     ("dtensor", check_dtensor), ("edges", lambda rt: check_edges(rt, out_dir))):
        t = time.perf_counter()
        out[name] = fn(rt)
        out.setdefault("seconds", {})[name] = time.perf_counter() - t
    t = time.perf_counter()
    model, opt, sched, ckpt = run_training(rt, out_dir / "ckpt", out)
    out["seconds"]["checkpoint"] = time.perf_counter() - t
    out["seconds"]["total"] = time.perf_counter() - t0
    if rt.is_main:
        (out_dir / "train.json").write_text(json.dumps(out, indent=1))
    fd.barrier()
    # A save that rank 1 does not survive: it dies once its own shards are on disk, before DCP's
    # metadata is written (the other rank waits in DCP's final gather until torchrun stops it).
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = original(self, plan, planner)
        if rt.rank == 1:
            fut.wait()
            sys.stderr.write("rank 1: killed in the middle of a checkpoint save\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return fut

    FileSystemWriter.write_data = write_then_die
    ckpt.save(STEPS, model, opt, sched, {"position": -1})
    sys.stderr.write("the killed save completed: the test's kill did not happen\n")


def scenario_resume(rt, out_dir):
    torch.manual_seed(999)  # anything: the checkpoint's states replace it (same world size)
    model, opt, sched = make_training(rt, sharded=rt.world_size > 1)
    ckpt = fd.Checkpointer(out_dir / "ckpt", keep=2)
    info = ckpt.load(model, opt, sched)
    out = {"world_size": rt.world_size, "resumed_step": info["step"], "saved_world_size": info["world_size"],
           "rand_after_checkpoint": _gather_floats(torch.rand(2).tolist()), "losses": []}
    position = info["position"]
    for _ in range(info["step"] + 1, STEPS + 1):
        loss, position = train_step(rt, model, opt, sched, position)
        out["losses"].append(loss)
    out["lr_after"] = sched.get_last_lr()
    out["model_type"] = type(model).__name__
    if rt.is_main:
        (out_dir / f"resume_{rt.world_size}.json").write_text(json.dumps(out, indent=1))


def scenario_fail(rt, out_dir):
    if rt.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def scenario_hang(rt, out_dir):
    if rt.rank == 1:
        time.sleep(600)  # alive but stuck outside any collective
    dist.all_reduce(torch.ones(1))


def main():
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    rt = fd.init("cpu", timeout_s=TIMEOUT_S)
    try:
        globals()[f"scenario_{scenario}"](rt, out_dir)
    except Exception:
        sys.stderr.write(f"rank {rt.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)  # no teardown: a peer may be gone
    fd.shutdown()


if __name__ == "__main__":
    main()
