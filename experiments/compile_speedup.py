"""What torch.compile really buys: eager vs compile modes, fp32 vs bf16 autocast, stock vs fuselab.

Models: torchvision ResNet-50 (channels_last where it applies) and an OPT-style transformers
decoder with a ReLU MLP (random init), each in training (forward+backward+SGD step) and inference.
The decoder also runs patched by ``fuselab.nn.fuse_linear_relu``, and as ``opt-norelu``: the stock
decoder with its ReLU deleted (wrong math, timing only), the most that any fusion of the ReLU into
its GEMM could save. Precisions: ``fp32`` is PyTorch's default (matmuls in full fp32, convolutions
already tf32 through ``cudnn.allow_tf32``), ``tf32`` adds ``set_float32_matmul_precision("high")``,
``bf16`` is autocast. For every configuration:
throughput, time to the first result (compile time), peak memory, speedup against eager of the
same model/precision, the variants' speed against the stock decoder in the same mode, and the graph
breaks Dynamo reports. A configuration that fails (out of memory, a compiler error) is reported.

    python experiments/compile_speedup.py                       # the full study (GPU)
    python experiments/compile_speedup.py --plan 'resnet50:infer:fp32:eager,default' --merge   # a piece of it
    python experiments/compile_speedup.py --tiny --device cpu --modes eager,default   # smoke test

Every row records the commit it was measured at. ``--merge`` keeps the rows of the existing JSON
that this run does not measure, so the study can be run in pieces (a GPU machine lent for minutes).
``--passes N`` times the plan N times, alternating its configurations, and reports the mean: two
configurations a few percent apart are compared under the same machine drift.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.nn import fuse_linear_relu  # noqa: E402
from fuselab.report import RESULTS, environment, markdown_table, save_json  # noqa: E402

MODES = ["eager", "default", "reduce-overhead", "max-autotune"]
MODELS = ["resnet50", "opt", "opt+fuselab", "opt-norelu"]
PRECISIONS = {"fp32": "highest", "tf32": "high", "bf16": "highest"}  # -> torch.set_float32_matmul_precision
COLUMNS = ["model", "task", "precision", "mode", "ms/step", "speedup vs eager", "x stock, same mode", "first call s",
           "peak MiB", "graph breaks"]


def build(name, tiny, device):
    """(model, example batch, items per batch, unit)."""
    if name.startswith("resnet50"):
        import torchvision

        model = torchvision.models.resnet18(weights=None) if tiny else torchvision.models.resnet50(weights=None)
        batch = torch.randn(2 if tiny else 64, 3, 64 if tiny else 224, 64 if tiny else 224, device=device)
        return model.to(device), (batch,), batch.shape[0], "img/s"
    from transformers import OPTConfig, OPTForCausalLM

    size = dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4) if tiny else \
        dict(hidden_size=1024, num_hidden_layers=12, ffn_dim=4096, num_attention_heads=16)
    cfg = OPTConfig(vocab_size=512 if tiny else 50272, max_position_embeddings=2048, activation_function="relu",
                    word_embed_proj_dim=size["hidden_size"], dropout=0.0, attention_dropout=0.0, **size)
    model = OPTForCausalLM(cfg).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (2 if tiny else 8, 32 if tiny else 1024), device=device)
    if name.endswith("+fuselab"):
        model, report = fuse_linear_relu(model)
        assert report.fused, str(report)
    elif name.endswith("-norelu"):
        for layer in model.model.decoder.layers:
            layer.activation_fn = torch.nn.Identity()
    return model, (tokens,), tokens.numel(), "tok/s"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(name, mode, precision, train, args, device):
    torch._dynamo.reset()
    torch.set_float32_matmul_precision(PRECISIONS[precision])
    model, inputs, items, unit = build(name, args.tiny, device)
    if name.startswith("resnet50") and args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs = (inputs[0].to(memory_format=torch.channels_last),)
    # The decoder has no dropout (0.0) and no LayerDrop, so its training math equals eval mode; eval
    # mode skips transformers' per-layer LayerDrop draw (through 5.17 `torch.rand([]) < layerdrop` is
    # evaluated in Python even at 0.0: one graph break per layer). ResNet-50 needs train mode (BatchNorm).
    model.train(train and not name.startswith("opt"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4) if train else None

    def forward(*x):
        out = model(*x)
        return out.logits if hasattr(out, "logits") else out

    fn = forward if mode == "eager" else torch.compile(forward, mode=None if mode == "default" else mode)
    breaks = None
    if mode != "eager":
        breaks = torch._dynamo.explain(forward)(*inputs).graph_break_count
        torch._dynamo.reset()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            if train:
                if device.type == "cuda" and mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                loss = fn(*inputs).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    fn(*inputs)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync(device)
    per_step = (time.perf_counter() - t0) / args.iters
    return {"model": name, "task": "train" if train else "infer", "precision": precision, "mode": mode,
            "ms/step": per_step * 1e3, unit: items / per_step, "first call s": first,
            "peak MiB": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
            "graph breaks": breaks}


def parse_plan(args):
    """[(model, task, precision, mode)]: --plan groups 'models:tasks:precisions:modes' joined by ';'
    (each field comma-separated), or the full grid of --models x --tasks x --precisions x --modes."""
    groups = args.plan.split(";") if args.plan else [":".join([args.models, args.tasks, args.precisions, args.modes])]
    grid = []
    for group in groups:
        fields = group.strip().split(":")
        if len(fields) != 4:
            raise SystemExit(f"--plan group {group!r} must be models:tasks:precisions:modes")
        grid += itertools.product(*(f.split(",") for f in fields))
    for i, (field, known) in enumerate([("models", MODELS), ("tasks", ["train", "infer"]),
                                         ("precisions", list(PRECISIONS)), ("modes", MODES)]):
        bad = {cfg[i] for cfg in grid} - set(known)
        if bad:
            raise SystemExit(f"unknown {field} {sorted(bad)}: choose from {known}")
    return grid


def config_key(row):
    """What identifies a configuration of the study (a row measures one)."""
    return row["model"], row["task"], row["precision"], row["mode"]


def merge_rows(path, rows):
    """The rows saved at ``path`` with this run's configurations replaced or appended."""
    if not path.exists():
        return rows
    saved = json.loads(path.read_text())
    fresh = {config_key(r): r for r in rows}
    kept = [fresh.pop(config_key(r), {"commit": saved["environment"]["git_commit"], **r}) for r in saved["rows"]]
    return kept + list(fresh.values())


def merge_failed(path, failed, grid):
    """The saved failures of configurations this run did not try, then this run's failures."""
    saved = json.loads(path.read_text()).get("failed", []) if path.exists() else []
    tried = set(grid)
    return [f for f in saved if config_key(f) not in tried] + failed


def add_pass(measured, row):
    """Fold one timing of a configuration into ``measured``: ms/step (and throughput) become the mean
    over passes, each pass kept in ``ms/step passes``; first-call time and peak memory stay those of
    the first pass (later ones find the compile caches warm)."""
    key = config_key(row)
    if key not in measured:
        measured[key] = {**row, "ms/step passes": [row["ms/step"]]}
        return
    kept = measured[key]
    kept["ms/step passes"].append(row["ms/step"])
    mean = sum(kept["ms/step passes"]) / len(kept["ms/step passes"])
    unit = next(u for u in ("tok/s", "img/s") if u in kept)
    kept[unit] *= kept["ms/step"] / mean
    kept["ms/step"] = mean


def add_speedups(rows):
    """Each row's speedup against eager mode of its model, and a variant's (opt+fuselab, opt-norelu)
    against the stock model in the same mode."""
    eager = {(r["model"], r["task"], r["precision"]): r["ms/step"] for r in rows if r["mode"] == "eager"}
    stock = {(r["task"], r["precision"], r["mode"]): r["ms/step"] for r in rows if r["model"] == "opt"}
    for r in rows:
        base = eager.get((r["model"], r["task"], r["precision"]))
        r["speedup vs eager"] = base / r["ms/step"] if base else None
        variant = r["model"] in ("opt+fuselab", "opt-norelu")
        same_mode = stock.get((r["task"], r["precision"], r["mode"])) if variant else None
        r["x stock, same mode"] = same_mode / r["ms/step"] if same_mode else None
    return rows


def study_order(rows):
    """Rows sorted by model, task, precision and mode, in the order the study lists them."""
    order = {name: i for i, name in enumerate(MODELS + ["train", "infer"] + list(PRECISIONS) + MODES)}
    return sorted(rows, key=lambda r: [order.get(k, len(order)) for k in config_key(r)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,opt,opt+fuselab", help=f"of {MODELS}")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--precisions", default="fp32,bf16", help=f"of {list(PRECISIONS)}")
    p.add_argument("--tasks", default="train,infer")
    p.add_argument("--plan", help="instead of the full grid: 'models:tasks:precisions:modes;...', e.g. "
                                  "'opt,opt+fuselab:train:bf16:eager,default;resnet50:infer:fp32:eager'")
    p.add_argument("--budget-min", type=float, default=None, help="stop starting new configurations after this")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--passes", type=int, default=1, help="time the plan this many times, alternating its "
                   "configurations (machine drift hits all of them alike); rows report the mean")
    p.add_argument("--merge", action="store_true", help="keep the saved rows of configurations this run skips")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    from tqdm import tqdm

    grid, measured, start = parse_plan(args), {}, time.perf_counter()
    path = args.out / f"compile_speedup_{device.type}.json"
    commit = environment()["git_commit"]
    runs = [(p, cfg) for p in range(args.passes) for cfg in grid]  # passes alternate the configurations
    failed = []
    matmul_precision = torch.get_float32_matmul_precision()  # run_one sets it per configuration
    for done, (_, (model, task, prec, mode)) in enumerate(tqdm(runs)):
        if args.budget_min is not None and time.perf_counter() - start > 60 * args.budget_min:
            print(f"budget of {args.budget_min} min spent: skipped {len(runs) - done} of {len(runs)} runs")
            break
        try:
            add_pass(measured, {**run_one(model, mode, prec, task == "train", args, device), "commit": commit})
        except Exception as e:  # noqa: BLE001  a configuration that fails (OOM, a compiler error) is reported
            failed.append({"model": model, "task": task, "precision": prec, "mode": mode, "commit": commit,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"FAILED {model}:{task}:{prec}:{mode}: {failed[-1]['error']}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows = list(measured.values())
        # Saved after every configuration, so a run cut short keeps what it measured.
        save_json(path.stem, add_speedups(merge_rows(path, rows) if args.merge else rows),
                  {"tiny": args.tiny, "failed": merge_failed(path, failed, grid) if args.merge else failed},
                  out_dir=args.out)
    torch.set_float32_matmul_precision(matmul_precision)
    rows = list(measured.values())
    print(markdown_table(COLUMNS, [[r.get(k) if r.get(k) is not None else "" for k in COLUMNS] for r in rows]))
    print(f"saved {path}")
    return rows


if __name__ == "__main__":
    main()
