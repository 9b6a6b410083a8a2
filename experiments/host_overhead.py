"""Host (CPU) time per call of each layer of the fused op, on a problem too small to hide it.

    python experiments/host_overhead.py

Layers: the registered op without and with autograd, and torch's own relu(mm) for scale. Then a cProfile of the op's hot path.
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.kernels import matmul_relu  # noqa: E402


def per_call_us(fn, n=2000):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    ag = a.clone().requires_grad_(True)
    layers = {
        "torch.relu(a @ b)": lambda: torch.relu(a @ b),
        "torch.ops.fuselab.matmul_relu": lambda: matmul_relu(a, b),
        "same, a.requires_grad": lambda: matmul_relu(ag, b),
    }
    for name, fn in layers.items():
        print(f"{name:40s} {per_call_us(fn):8.1f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        matmul_relu(ag, b)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
