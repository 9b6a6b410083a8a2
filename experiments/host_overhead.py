"""Host (CPU) time per call of the fused op, on problems too small for the GPU to hide it.

Study ``host_overhead`` (long format, ``experiments/harness.py``), bf16, ``nn.Linear`` layout
(``x @ weight.t()``), microseconds per call (metric ``us``):

    ops        fwd, fwd+bwd (gradients reset to None before each call, never accumulated)
    providers  relu(addmm) (torch, the baseline); torch, Python backward (the same through a Python
               ``autograd.Function``: what a Python backward costs by itself); fuselab (the default: the
               C++ eager path, ``fuselab.kernels.eager_path``); fuselab, Python path (the C++ path off:
               a Python autograd.Function and launch plans); fuselab, no launch plans (the Python path,
               every launch binding its arguments through Triton)
    modes      host: the host's time to enqueue one call (batches of calls, no synchronization inside
               a batch); eager: ``do_bench`` time per call, host and device together

and op ``python loop``: the same pure-Python loop timed on the main thread (the baseline) and inside a
backward, which autograd runs on its own device thread (mode ``wall``).

    python -m experiments.host_overhead              # runs/host_overhead.json
    python -m experiments.host_overhead --results    # results/host_overhead.json (the docs' source)
    python -m experiments.host_overhead --profile    # also a cProfile of the eager hot path
"""
import argparse
import contextlib
import cProfile
import pstats
import sys
import time

import torch

from experiments.harness import Providers, Results, Timing, add_output_args, output_path, pivot, require_cuda, time_call
from fuselab.kernels import eager_path, matmul_relu

STUDY = "host_overhead"
CALLS = Providers()  # each takes (x, w_t, bias) and returns the output
LOOP = Providers()


class TorchLinearReLU(torch.autograd.Function):
    """relu(addmm) with a Python backward of torch ops: the cost of a Python backward alone."""

    @staticmethod
    def forward(ctx, x, w_t, bias):
        y = torch.relu(torch.addmm(bias, x, w_t))
        ctx.save_for_backward(x, w_t, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w_t, y = ctx.saved_tensors
        g = torch.ops.aten.threshold_backward(dy, y, 0)
        return g @ w_t.t(), x.t() @ g, g.sum(0)


@contextlib.contextmanager
def without_launch_plans():
    """The Python path, every eager GEMM taking the full launch path: ``launch_planned`` finds
    nothing, in every fuselab module that calls it."""
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("fuselab.kernels") and m is not None and hasattr(m, "launch_planned")]
    saved = [m.launch_planned for m in patched]
    for m in patched:
        m.launch_planned = lambda key, *tensors, cpp_key=None: False
    try:
        with eager_path.disabled():
            yield
    finally:
        for m, fn in zip(patched, saved):
            m.launch_planned = fn


@CALLS.register("relu(addmm)", baseline=True)
def torch_relu_addmm(x, w_t, bias):
    return torch.relu(torch.addmm(bias, x, w_t))


@CALLS.register("torch, Python backward")
def torch_python_backward(x, w_t, bias):
    return TorchLinearReLU.apply(x, w_t, bias)


@CALLS.register("fuselab")
def fuselab(x, w_t, bias):
    return matmul_relu(x, w_t, bias)


@CALLS.register("fuselab, Python path")
def fuselab_python_path(x, w_t, bias):
    return matmul_relu(x, w_t, bias)


@CALLS.register("fuselab, no launch plans")
def fuselab_no_plans(x, w_t, bias):
    return matmul_relu(x, w_t, bias)


SETTINGS = {"fuselab, Python path": eager_path.disabled, "fuselab, no launch plans": without_launch_plans}


def busy_python():
    total = 0
    for i in range(2000):
        total += i
    return total


class BusyBackward(torch.autograd.Function):
    """Runs ``busy_python`` inside the backward and records how long it took there (milliseconds)."""
    samples = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, dy):
        t = time.perf_counter()  # a probe inside the backward: the harness cannot reach in there
        busy_python()
        BusyBackward.samples.append((time.perf_counter() - t) * 1e3)
        return dy


@LOOP.register("main thread", baseline=True)
def on_main_thread() -> Timing:
    return time_call(busy_python, "wall", iters=200)


@LOOP.register("autograd thread")
def on_autograd_thread() -> Timing:
    x = torch.randn(8, device="cuda", requires_grad=True)
    BusyBackward.samples.clear()
    time_call(lambda: BusyBackward.apply(x).sum().backward(), "wall", iters=200)
    return Timing.of(BusyBackward.samples[-200:])


def measure(results: Results, M: int, N: int, K: int, modes) -> None:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w_t = w.t()
    for name, fn in CALLS.select(None).items():
        with SETTINGS.get(name, contextlib.nullcontext)():
            for op, call in (("fwd", lambda: fn(x, w_t, bias)), ("fwd+bwd", lambda: fn(x, w_t, bias).backward(dy))):
                for mode in modes:
                    timing = time_call(call, mode, grad_to_none=[x, w, bias])
                    results.record(op=op, provider=name, shape=f"{M}x{N}x{K}", dtype="bf16", mode=mode, metric="us",
                                   value=timing.converted(1e3))


def parse_shape(text: str):
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"shape must be MxNxK with positive sizes, got {text!r}")
    return dims


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=lambda t: [parse_shape(s) for s in t.split(",")],
                   default=[(256, 4096, 1024), (8192, 4096, 1024)],
                   help="MxNxK, comma-separated (the defaults: OPT's fc1 with 256 and 8192 tokens)")
    p.add_argument("--modes", default="host,eager", help="timing modes: host, eager")
    p.add_argument("--profile", action="store_true", help="print a cProfile of 300 eager fwd+bwd calls")
    add_output_args(p)
    args = p.parse_args(argv)
    require_cuda("host_overhead")  # before any work
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"host", "eager"}:
        p.error(f"unknown modes {sorted(set(modes) - {'host', 'eager'})}: choose from ['host', 'eager']")
    out = output_path(args, STUDY)
    results = Results(STUDY)
    for op in ("fwd", "fwd+bwd"):
        results.set_baseline(op, CALLS)
    results.set_baseline("python loop", LOOP)
    for M, N, K in args.shapes:
        measure(results, M, N, K, modes)
    for name, fn in LOOP.select(None).items():
        results.record(op="python loop", provider=name, shape="2000 additions", dtype="-", mode="wall", metric="us",
                       value=fn().converted(1e3))
    for op in ("fwd", "fwd+bwd", "python loop"):
        print(f"\n{op}, us per call:\n" + pivot(results.select(op=op), ["shape", "mode"],
                                                baseline=results.baselines[op]))
    print(f"saved {results.save(out, merge=args.merge)}")
    if args.profile:
        M, N, K = args.shapes[0]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w_t = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            matmul_relu(x, w_t).backward(dy)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return results


if __name__ == "__main__":
    main()
