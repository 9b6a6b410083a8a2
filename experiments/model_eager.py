"""Patched models as users run them: eager (and compiled) steps of transformers' OPT decoder,
stock against patched by ``fuse_linear_relu``, with where the GPU waits.

For each size x tokens x task (``infer``: forward under no_grad; ``train``: forward, loss,
backward) x variant x mode (eager, or a torch.compile mode), bf16 parameters, rows of:

    ms            wall time per step, synchronized (harness ``wall`` mode)
    host ms       time to enqueue one step, never synchronized (eager only; ``host`` mode)
    GPU busy ms   union of the GPU's kernel/copy intervals per step (profiler trace, ``--trace``;
                  profiled steps run slower, so these are measured after all the timing)
    GPU idle ms   the step's GPU span minus its busy time: time the GPU waited for the host
    syncs/step    calls that synchronized the host with the GPU (``torch.cuda.set_sync_debug_mode``)

The variants of a configuration are built together and timed (``ms``, ``host ms``) in turns
(``harness.time_alternating``): ``--rounds`` short rounds of ``--iters`` steps each, each quantile the
median round's. Rounds are short because the host's drift has phases of a second or so: rounds of ten
steps can land a variant's rounds in one phase and its peer's in another.

``--trace`` also prints, per variant, the kernels that most often start after a GPU gap of
more than 20 us (the launch the GPU waited for) and ``--syncs`` the Python stack of every
synchronizing call of one step.

    python -m experiments.model_eager                                  # the default grid (GPU)
    python -m experiments.model_eager --sizes opt-350m --tokens 8x1024 --tasks infer --trace --syncs
    python -m experiments.model_eager --sizes tiny --tokens 1x32 --device cpu --modes eager   # smoke test
"""
import argparse
import contextlib
import time

import torch
from tqdm import tqdm

from experiments import harness
from experiments.models import OPT_SIZES, opt_decoder
from fuselab.kernels import eager_path

STUDY = "model_eager"
DTYPE_LABEL = {True: "bf16", False: "fp32"}  # by whether the models run on CUDA (_configuration's dtype)
MODES = ("eager", "default", "reduce-overhead")


def make_step(model, tokens, task: str, mode: str):
    """One step of ``task`` on ``model`` (compiled first unless ``mode`` is eager)."""
    forward = model if mode == "eager" else torch.compile(model, mode=None if mode == "default" else mode)
    graphs = mode == "reduce-overhead"

    if task == "infer":
        def step():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return forward(tokens).logits
    else:
        def step():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = forward(tokens, labels=tokens).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss
    return step


def run(args) -> harness.Results:
    """Times every configuration first, then (``--trace``/``--syncs``) diagnoses them: a profiler
    session slows every later launch in its process, so nothing is timed after one.

    The variants of one size x tokens x task x mode are built together and timed in alternating
    rounds: these hosts drift by 10-40% over seconds, and a model's eager step at 1 x 128 tokens is
    host-bound, so variants timed one after another compare drifts, not variants."""
    results = harness.Results(STUDY, device=args.device)
    device = args.device
    cuda = device.type == "cuda"
    groups = [(s, t, task, mode) for s in args.sizes for t in args.tokens for task in args.tasks for mode in args.modes]
    timed, start = set(), time.perf_counter()
    for size, (batch, seq), task, mode in tqdm(groups, desc=STUDY):
        if args.budget_min and time.perf_counter() - start > 60 * args.budget_min:
            print(f"budget of {args.budget_min} min spent: the rest of the plan is not measured")
            break
        common = dict(op=task, shape=f"{size} {batch}x{seq}", dtype=DTYPE_LABEL[cuda], mode=mode)
        results.set_baseline(task, "stock")
        torch._dynamo.reset()
        with contextlib.ExitStack() as stack:
            steps = {}
            for variant in args.variants:
                try:
                    steps[variant], first_s = stack.enter_context(
                        _configuration(size, (batch, seq), task, mode, variant, device))
                except torch.OutOfMemoryError as e:
                    results.record(metric="failed", value=1, error=f"out of memory: {str(e)[:200]}", provider=variant,
                                   **common)
                    continue
                results.record(metric="first call s", value=first_s, provider=variant, **common)
            plan = [("ms", "wall")] + ([("host ms", "host")] if mode == "eager" else [])
            try:
                timings = {metric: harness.time_alternating(steps, timing_mode, args.rounds, iters=args.iters,
                                                            warmup_iters=args.warmup)
                           for metric, timing_mode in plan}
            except torch.OutOfMemoryError as e:  # all variants are resident together: none is timed alone
                for variant in steps:
                    results.record(metric="failed", value=1, provider=variant, **common,
                                   error=f"out of memory while timing {', '.join(steps)} together: {str(e)[:200]}")
                continue
            for metric, by_variant in timings.items():
                for variant, (timing, rounds) in by_variant.items():
                    results.record(metric=metric, value=timing, rounds=rounds, provider=variant, **common)
                    timed.add((size, (batch, seq), task, mode, variant))
    if cuda and (args.trace or args.syncs):
        for size, (batch, seq), task, mode in groups:
            for variant in args.variants:
                if (size, (batch, seq), task, mode, variant) not in timed:  # cut by the budget, or out of memory
                    continue
                keys = dict(op=task, provider=variant, shape=f"{size} {batch}x{seq}", dtype=DTYPE_LABEL[cuda],
                            mode=mode)
                torch._dynamo.reset()
                with _configuration(size, (batch, seq), task, mode, variant, device) as (step, _):
                    if args.trace:
                        busy, idle, gaps = harness.gpu_timeline(step)
                        results.record(metric="GPU busy ms (profiled)", value=busy, **keys)
                        results.record(metric="GPU idle ms (profiled)", value=idle, **keys)
                        print(f"{keys['shape']} {task} {mode} {variant}: {harness.timeline_summary(busy, idle, gaps)}")
                    if mode == "eager":
                        count, found = harness.synchronizing_calls(step, stacks=args.syncs)
                        results.record(metric="syncs/step", value=count, **keys)
                        for i, stack in enumerate(found if args.syncs else []):
                            print(f"--- {keys['shape']} {task} {variant}: synchronizing call {i + 1} of {count}\n"
                                  f"{stack}")
    return results


@contextlib.contextmanager
def _configuration(size, tokens, task, mode, variant, device):
    """(step, seconds of its first call) for one configuration; memory given back afterwards.
    ``fuselab-python`` steps run with the C++ eager path off, each call."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    python_path = variant == "fuselab-python"
    model, vocab = opt_decoder(size, "fuselab" if python_path else variant, device=device,
                               dtype=torch.bfloat16 if cuda else None)  # DTYPE_LABEL
    model.eval()  # no dropout in these configs; eval skips transformers' LayerDrop draw
    step = make_step(model, torch.randint(0, vocab, tokens, device=device), task, mode)
    if python_path:
        step = _on_python_path(step)
    t0 = time.perf_counter()
    step()
    harness.sync()
    try:
        yield step, time.perf_counter() - t0
    finally:
        del model, step
        if cuda:
            torch.cuda.empty_cache()


def _on_python_path(step):
    def python_path_step():
        with eager_path.disabled():
            return step()
    return python_path_step


def report(results: harness.Results) -> str:
    out = []
    for metric in ("ms", "host ms", "GPU busy ms (profiled)", "GPU idle ms (profiled)", "syncs/step"):
        rows = results.select(metric=metric)
        if rows:
            out += [f"\n{metric} (p50 per step; `x stock`: the stock model's time over the variant's)",
                    harness.pivot(rows, ["shape", "op", "mode"], baseline="stock")]
    return "\n".join(out)


def parse_tokens(text: str):
    try:
        pairs = [tuple(int(v) for v in t.split("x")) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens must be BATCHxSEQ[,BATCHxSEQ...], got {text!r}") from None
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"tokens must be positive BATCHxSEQ pairs, got {text!r}")
    return pairs


def choice_list(known):
    def parse(text):
        items = text.split(",")
        bad = [i for i in items if i not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(known)}")
        return items
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=choice_list(OPT_SIZES), default=["opt-125m", "opt-350m", "opt-1.3b"])
    p.add_argument("--tokens", type=parse_tokens, default=[(1, 128), (8, 1024)], help="BATCHxSEQ, comma-separated")
    p.add_argument("--tasks", type=choice_list(("infer", "train")), default=["infer", "train"])
    p.add_argument("--modes", type=choice_list(MODES), default=["eager"])
    p.add_argument("--variants", type=choice_list(("stock", "fuselab", "fuselab-python", "norelu")),
                   default=["stock", "fuselab"], help="fuselab-python: patched, the C++ eager path off")
    p.add_argument("--iters", type=harness.positive_int, default=3,
                   help="timed steps a round (an odd count: a round's p50 is one of its steps)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before a round's")
    p.add_argument("--rounds", type=harness.positive_int, default=15,
                   help="rounds of --iters steps of each variant, alternating (each quantile: its median round)")
    p.add_argument("--trace", action="store_true", help="GPU busy/idle time per step from a profiler trace")
    p.add_argument("--syncs", action="store_true", help="print the stack of every synchronizing call of a step")
    p.add_argument("--budget-min", type=harness.positive_float, default=None,
                   help="stop starting new configurations after this")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    harness.add_output_args(p)
    args = p.parse_args(argv)
    if args.iters % 2 == 0:
        p.error(f"--iters must be odd (a round's p50 is one of its steps), got {args.iters}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    args.device = harness.parse_device(p, args.device, STUDY)
    if args.device.type != "cuda" and (args.trace or args.syncs):
        p.error("--trace and --syncs profile CUDA steps (GPU idle time, synchronizing calls): nothing to do on the CPU")
    # an OPT grid on a CPU runs for many minutes and measures nothing fuselab does there
    if args.device.type == "cpu" and args.sizes != ["tiny"]:
        p.error(f"--sizes {','.join(args.sizes)} on the CPU: the patched models run PyTorch's ops there; use "
                "--sizes tiny for a smoke run of the machinery, or run on a GPU")
    path = harness.output_path(args, STUDY, smoke="--sizes tiny" if "tiny" in args.sizes else None)
    results = run(args)
    print(report(results))
    print(f"saved {results.save(path, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
