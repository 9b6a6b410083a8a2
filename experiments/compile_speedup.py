"""What torch.compile really buys: eager vs compile modes, fp32 vs tf32 vs bf16 autocast, stock vs fuselab.

Models: torchvision ResNet-50 (channels_last unless ``--no-channels-last``) and an OPT-style transformers
decoder with a ReLU MLP (random init), each in training (forward+backward+SGD step) and inference.
The decoder also runs patched by ``fuselab.nn.fuse_linear_relu`` (``opt+fuselab``), and as
``opt-norelu``: the stock decoder with its ReLU deleted (wrong math, timing only), the most that any
fusion of the ReLU into its GEMM could save. Precisions: ``fp32`` is PyTorch's default (matmuls in
full fp32, convolutions already tf32 through ``cudnn.allow_tf32``), ``tf32`` adds
``set_float32_matmul_precision("high")``, ``bf16`` is autocast.

Study ``compile_speedup`` (long format, ``experiments/harness.py``): op ``<family> <task>`` (``opt
train``, ``resnet50 infer``); provider the model (``opt``, the stock decoder, is the baseline of the
opt ops; ``resnet50`` of its own); shape the batch; dtype the precision; mode the compile mode
(``eager``, ``default``, ``reduce-overhead``, ``max-autotune``). Metrics: ``ms/step`` (wall mode:
``--iters`` synchronized steps after ``--warmup``; with ``--passes N`` each quantile is the mean over
the passes, each pass's median kept in ``passes``), ``first call s`` (the first step, compilation
included), ``peak MiB`` (GPU) and ``graph breaks`` (``torch._dynamo.explain``; compiled modes only).
Speedups against eager and against the stock decoder are computed by ``experiments/report.py``.

A configuration that fails (out of memory, a compiler error) is recorded in the results file's
``failed`` list (``Results.fail``) and the others still run; a later run that measures it, or fails
it again, replaces the entry.

    python -m experiments.compile_speedup                      # the full grid (GPU; hours: run it in pieces)
    python -m experiments.compile_speedup --plan 'resnet50:infer:fp32:eager,default' --results
    python -m experiments.compile_speedup --tiny --device cpu --modes eager,default   # smoke test

``--merge`` keeps the rows of the output file that this run does not measure, so the study can be run
in pieces (a GPU machine lent for minutes); each row names the run (commit, dirty flag) that measured
it. ``--passes N`` times the plan N times, alternating its configurations: two configurations a few
percent apart are compared under the same machine drift. ``--budget-min`` stops starting new runs.
"""
import argparse
import itertools
import time
from typing import Dict, List, Tuple

import torch

from experiments.harness import (
    Providers,
    Results,
    Timing,
    add_output_args,
    non_negative_int,
    output_path,
    parse_device,
    peak_memory_mib,
    pivot,
    positive_float,
    positive_int,
    time_call,
    time_first_call,
)
from experiments.models import opt_decoder

STUDY = "compile_speedup"
MODES = ["eager", "default", "reduce-overhead", "max-autotune"]
MODELS = ["resnet50", "opt", "opt+fuselab", "opt-norelu"]
PRECISIONS = {"fp32": "highest", "tf32": "high", "bf16": "highest"}  # -> torch.set_float32_matmul_precision
TASKS = ["train", "infer"]

RESNET, OPT = Providers(), Providers()  # one registry per model family, the stock model its baseline


def batch_shape(name: str, tiny: bool) -> Tuple[int, ...]:
    """The input batch of a model: images (N, C, H, W) or token ids (batch, sequence)."""
    if family(name) == "resnet50":
        return (2, 3, 64, 64) if tiny else (64, 3, 224, 224)
    return (2, 32) if tiny else (8, 1024)


def shape_of(name: str, tiny: bool, channels_last: bool) -> str:
    """The row's ``shape``: the batch, and what else tells two configurations of one model apart."""
    dims = "x".join(map(str, batch_shape(name, tiny)))
    if family(name) == "opt":
        return f"{dims} tokens" + (" (tiny OPT)" if tiny else "")
    return (dims if channels_last else f"{dims} NCHW") + (" (tiny: a ResNet-18 stands in)" if tiny else "")


@RESNET.register("resnet50", baseline=True)
def resnet50(tiny: bool, device):
    import torchvision

    model = torchvision.models.resnet18(weights=None) if tiny else torchvision.models.resnet50(weights=None)
    batch = torch.randn(*batch_shape("resnet50", tiny), device=device)
    return model.to(device), (batch,), batch.shape[0], "img/s"


def _opt(tiny: bool, device, variant: str):
    model, vocab = opt_decoder("tiny" if tiny else "opt-1024x12", variant, device=device)
    tokens = torch.randint(0, vocab, batch_shape("opt", tiny), device=device)
    return model, (tokens,), tokens.numel(), "tok/s"


@OPT.register("opt", baseline=True)
def opt(tiny: bool, device):
    return _opt(tiny, device, "stock")


@OPT.register("opt+fuselab")
def opt_fuselab(tiny: bool, device):
    return _opt(tiny, device, "fuselab")


@OPT.register("opt-norelu")
def opt_norelu(tiny: bool, device):
    return _opt(tiny, device, "norelu")


FAMILIES = {"resnet50": RESNET, "opt": OPT}


def family(name: str) -> str:
    return "resnet50" if name.startswith("resnet50") else "opt"


def build(name, tiny, device):
    """(model, example batch, items per batch, unit)."""
    return FAMILIES[family(name)].fns[name](tiny, device)


def run_one(name, mode, precision, train, args, device) -> dict:
    """One configuration measured once: {timing, first, peak, breaks}."""
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
    first = time_first_call(step)
    timing = time_call(step, "wall", iters=args.iters, warmup_iters=args.warmup)
    return {"timing": timing, "first": first, "peak": peak_memory_mib(device), "breaks": breaks}


Config = Tuple[str, str, str, str]  # (model, task, precision, mode)


def parse_plan(args, parser) -> List[Config]:
    """[(model, task, precision, mode)]: --plan groups 'models:tasks:precisions:modes' joined by ';'
    (each field comma-separated), or the full grid of --models x --tasks x --precisions x --modes."""
    groups = args.plan.split(";") if args.plan else [":".join([args.models, args.tasks, args.precisions, args.modes])]
    grid = []
    for group in groups:
        fields = group.strip().split(":")
        if len(fields) != 4:
            parser.error(f"--plan group {group!r} must be models:tasks:precisions:modes")
        grid += itertools.product(*(f.split(",") for f in fields))
    for i, (field, known) in enumerate([("models", MODELS), ("tasks", TASKS), ("precisions", list(PRECISIONS)),
                                        ("modes", MODES)]):
        bad = {cfg[i] for cfg in grid} - set(known)
        if bad:
            parser.error(f"unknown {field} {sorted(bad)}: choose from {known}")
    return list(dict.fromkeys(grid))


def add_pass(measured: Dict[Config, dict], config: Config, one: dict) -> None:
    """Fold one measurement of ``config`` into ``measured``: first-call time and peak memory stay the
    first pass's (later ones find the compile caches warm), timings are kept per pass."""
    if config not in measured:
        measured[config] = {**one, "timings": [one["timing"]]}
    else:
        measured[config]["timings"].append(one["timing"])


def record(results: Results, measured: Dict[Config, dict]) -> None:
    """``results.rows`` rebuilt from every configuration measured so far (passes averaged)."""
    results.rows = []
    for (model, task, precision, mode), m in measured.items():
        keys = dict(op=f"{family(model)} {task}", provider=model, shape=m["shape"], dtype=precision, mode=mode)
        ts = m["timings"]
        mean = Timing(*(sum(getattr(t, q) for t in ts) / len(ts) for q in ("p20", "p50", "p80")))
        results.record(metric="ms/step", value=mean, passes=[t.p50 for t in ts], **keys)
        results.record(metric="first call s", value=m["first"], **keys)
        if m["peak"] is not None:
            results.record(metric="peak MiB", value=m["peak"], **keys)
        if m["breaks"] is not None:
            results.record(metric="graph breaks", value=m["breaks"], **keys)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,opt,opt+fuselab", help=f"of {MODELS}")
    p.add_argument("--modes", default=None, help=f"of {MODES} (default: all; with --tiny eager,default: the "
                                                 "others compile for minutes on a CPU)")
    p.add_argument("--precisions", default="fp32,bf16", help=f"of {list(PRECISIONS)}")
    p.add_argument("--tasks", default="train,infer")
    p.add_argument("--plan", help="instead of the full grid: 'models:tasks:precisions:modes;...', e.g. "
                                  "'opt,opt+fuselab:train:bf16:eager,default;resnet50:infer:fp32:eager'")
    p.add_argument("--budget-min", type=positive_float, default=None,
                   help="stop starting new configurations after this many minutes")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu with --tiny; the "
                                                    "full-size grid on a CPU (hours) needs --device cpu")
    p.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps after the first")
    p.add_argument("--iters", type=positive_int, default=20, help="timed steps")
    p.add_argument("--passes", type=positive_int, default=1, help="time the plan this many times, alternating "
                   "its configurations (machine drift hits all of them alike); rows report the mean")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = "eager,default" if args.tiny else ",".join(MODES)
    grid = parse_plan(args, p)  # usage errors first
    if args.device is None:
        if not (args.tiny or torch.cuda.is_available()):
            raise SystemExit("compile_speedup's full-size models need a CUDA GPU (none found): --tiny runs the "
                             "smoke test on the CPU; --device cpu runs the full grid here anyway (hours)")
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(p, args.device, STUDY)
    out = output_path(args, STUDY)
    results = Results(STUDY, device=device)
    results.annotate(tiny=args.tiny)
    for model, task, *_ in grid:
        results.set_baseline(f"{family(model)} {task}", FAMILIES[family(model)])
    measured: Dict[Config, dict] = {}
    failed = set()
    runs = [cfg for _ in range(args.passes) for cfg in grid]  # passes alternate the configurations
    start = time.perf_counter()
    matmul_precision = torch.get_float32_matmul_precision()  # run_one sets it per configuration
    try:
        for done, config in enumerate(runs):
            model, task, precision, mode = config
            if args.budget_min is not None and time.perf_counter() - start > 60 * args.budget_min:
                print(f"budget of {args.budget_min} min spent: skipped {len(runs) - done} of {len(runs)} runs")
                break
            if config in failed:
                continue
            print(f"[{done + 1}/{len(runs)}] {model}:{task}:{precision}:{mode}", flush=True)
            shape = shape_of(model, args.tiny, args.channels_last)
            try:
                one = run_one(model, mode, precision, task == "train", args, device)
                add_pass(measured, config, {**one, "shape": shape})
            except Exception as e:  # noqa: BLE001  a configuration that fails (OOM, a compiler error) is reported
                failed.add(config)
                entry = results.fail(op=f"{family(model)} {task}", provider=model, shape=shape, dtype=precision,
                                     mode=mode, error=e)
                print(f"FAILED {model}:{task}:{precision}:{mode}: {entry['error']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            record(results, measured)
            results.save(out, merge=args.merge)  # after every configuration: a run cut short keeps what it measured
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
    rows = results.select(metric="ms/step")
    if rows:
        print("\nms/step per compile mode (x eager: eager's time over the mode's, above 1 is faster):")
        print(pivot(rows, ["op", "dtype", "provider"], column="mode", baseline="eager"))
    print(f"saved {results.save(out, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
