"""Host (CPU) time per call of the fused op, on problems too small for the GPU to hide it.

    python experiments/host_overhead.py            # table + results/host_overhead_cuda.json
    python experiments/host_overhead.py --profile  # also a cProfile of the eager hot path

Rows (microseconds per call, wall time over many calls, bf16, nn.Linear layout ``x @ weight.t()``):
torch's ``relu(addmm)`` forward and forward+backward; the same through a Python
``autograd.Function`` (what a Python backward costs by itself); fuselab's forward and
forward+backward, with launch plans (the default) and without (every launch binds its arguments
through Triton). Then whether Python runs slower inside a backward, which autograd runs on its own
device thread: the same pure-Python loop timed there and on the main thread.
"""
import argparse
import cProfile
import importlib
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.kernels import matmul_relu  # noqa: E402
from fuselab.report import RESULTS, markdown_table, save_json  # noqa: E402


def per_call_us(fn, n=500):
    for _ in range(20):  # warm-up: autotuning, compilation, the first plan
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


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


def busy_python():
    total = 0
    for i in range(2000):
        total += i
    return total


class BusyBackward(torch.autograd.Function):
    """Runs ``busy_python`` inside the backward and records how long it took there."""
    seconds = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, dy):
        t = time.perf_counter()
        busy_python()
        BusyBackward.seconds.append(time.perf_counter() - t)
        return dy


class WithoutPlans:
    """Every eager GEMM takes the full launch path (launch_planned finds nothing)."""

    def __enter__(self):
        self.module = importlib.import_module("fuselab.kernels.matmul_relu")
        self.saved = self.module.launch_planned
        self.module.launch_planned = lambda key, *tensors: False

    def __exit__(self, *exc):
        self.module.launch_planned = self.saved


def measure(M, K, N):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w_t = w.t()
    calls = {
        "torch relu(addmm)": lambda: torch.relu(torch.addmm(bias, x, w_t)),
        "torch, Python backward": lambda: TorchLinearReLU.apply(x, w_t, bias),
        "fuselab": lambda: matmul_relu(x, w_t, bias),
    }
    rows = []
    for name, fn in calls.items():
        rows.append({"shape": f"{M}x{N}x{K}", "path": name, "fwd us": per_call_us(fn),
                     "fwd+bwd us": per_call_us(lambda: fn().backward(dy))})
    with WithoutPlans():
        rows.append({"shape": f"{M}x{N}x{K}", "path": "fuselab, no launch plans",
                     "fwd us": per_call_us(calls["fuselab"]),
                     "fwd+bwd us": per_call_us(lambda: calls["fuselab"]().backward(dy))})
    return rows


def engine_thread_slowdown():
    x = torch.randn(8, device="cuda", requires_grad=True)
    BusyBackward.seconds.clear()
    per_call_us(lambda: BusyBackward.apply(x).sum().backward(), n=200)
    inside = sum(BusyBackward.seconds[-200:]) / 200 * 1e6
    t = time.perf_counter()
    for _ in range(200):
        busy_python()
    main = (time.perf_counter() - t) / 200 * 1e6
    return {"python loop, main thread us": main, "same loop inside a backward us": inside,
            "slowdown": inside / main}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="256x4096x1024,8192x4096x1024",
                   help="MxNxK, comma-separated (the defaults: OPT's fc1 with 256 and 8192 tokens)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of 300 eager fwd+bwd calls")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_overhead.py times CUDA launches: run it on a GPU machine.")
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = map(int, shape.split("x"))
        rows += measure(M, K, N)
    engine = engine_thread_slowdown()
    cols = ["shape", "path", "fwd us", "fwd+bwd us"]
    print(markdown_table(cols, [[r[c] for c in cols] for r in rows]))
    print(markdown_table(list(engine), [list(engine.values())]))
    path = save_json("host_overhead_cuda", rows, {"engine_thread": engine}, out_dir=args.out)
    print(f"saved {path}")
    if args.profile:
        M, N, K = map(int, args.shapes.split(",")[0].split("x"))
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w_t = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            matmul_relu(x, w_t).backward(dy)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
