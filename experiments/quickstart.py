"""fuselab's main job (`make demo`), in stages:

1. the fused matmul-ReLU against PyTorch, both against float64 (forward and the three gradients): on a
   CPU the Triton kernels run once through the interpreter on a small case (timings need a GPU); on a
   GPU the forward is also timed against ``torch.relu(torch.addmm(...))`` and cuBLASLt's fused epilogue
   (``torch._addmm_activation``, the baseline);
2. an MLP on Fashion-MNIST trained stock and patched with ``fuse_linear_relu``
   (``python -m experiments.train_mlp``; on a CPU without the interpreter, where fuselab uses PyTorch).

Study ``quickstart``: op ``fwd+bwd vs fp64`` (providers torch, the baseline, and fuselab; metric ``max
rel err`` over the output and the three gradients; mode ``interpreter`` on a CPU, ``eager`` on a GPU)
and, on a GPU, op ``fwd`` (metric TFLOP/s). Prints a table per stage; writes runs/quickstart.json
(``--results``: results/, for this study and the MLP's).
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the demo's point there is the kernels' code: an exported 0 would skip it
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by fuselab)

from experiments import data as datasets  # noqa: E402
from experiments.bench_matmul_relu import FWD  # noqa: E402
from experiments.harness import ROOT, Providers, Results, add_output_args, output_path, pivot, rel_error, time_call  # noqa: E402
from fuselab.kernels import matmul_relu  # noqa: E402

STUDY = "quickstart"
CHECK = Providers()
TIMED = FWD.select(["cuBLASLt", "fuselab", "relu(addmm)"])  # the benchmark's, baseline cuBLASLt
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@CHECK.register("torch", baseline=True)
def torch_relu_linear(a, b, bias):
    return torch.relu(a @ b + bias)


@CHECK.register("fuselab")
def fuselab_check(a, b, bias):
    return matmul_relu(a, b, bias)


def check(results: Results, device: str, dtype: torch.dtype, M: int, N: int, K: int, mode: str) -> None:
    """Forward and gradients of every CHECK provider against a float64 reference: the largest relative
    error of the four. Seeded: near-zero pre-activations that PyTorch's rounding flips through the ReLU move its
    error several-fold from one draw to the next, and with it the pass bar (4x PyTorch's)."""
    torch.manual_seed(0)
    a = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(K, N, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(N, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    ref_in = [t.detach().double().requires_grad_(True) for t in (a, b, bias)]
    ref = torch.relu(ref_in[0] @ ref_in[1] + ref_in[2])
    ref.backward(dy.double())
    refs = [ref.detach()] + [t.grad for t in ref_in]
    for name, fn in CHECK.select(None).items():
        for t in (a, b, bias):
            t.grad = None
        y = fn(a, b, bias)
        y.backward(dy)
        err = max(rel_error(o, r) for o, r in zip([y.detach(), a.grad, b.grad, bias.grad], refs))
        results.record(op="fwd+bwd vs fp64", provider=name, shape=f"{M}x{N}x{K}", dtype=DTYPE_NAMES[dtype],
                       mode=mode, metric="max rel err", value=err)


def time_gpu(results: Results, dtype: torch.dtype, M: int, N: int, K: int) -> None:
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    for name, fn in TIMED.items():
        results.record_time(op="fwd", provider=name, shape=f"{M}x{N}x{K}", dtype=DTYPE_NAMES[dtype], mode="eager",
                            value=time_call(lambda: fn(a, b, bias)), flops=2.0 * M * N * K)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-mlp", action="store_true", help="stage 1 only")
    p.add_argument("--data", help="stage 2's Fashion-MNIST folder (train_mlp's --data; default: its default)")
    add_output_args(p)
    args = p.parse_args(argv)
    out = output_path(args, STUDY)
    if args.data and not args.skip_mlp:  # stage 2's data, checked before stage 1 runs and saves
        try:
            datasets.fashion_mnist(Path(args.data))
        except datasets.DataNotFound as e:
            p.error(f"--data {args.data}: {e}")
    on_gpu = torch.cuda.is_available()
    results = Results(STUDY)
    results.set_baseline("fwd+bwd vs fp64", CHECK)
    if on_gpu:
        results.set_baseline("fwd", FWD)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            check(results, "cuda", dtype, 1031, 777, 515, "eager")
            if dtype != torch.float32:
                time_gpu(results, dtype, 8192, 8192, 1024)
    else:
        print("No CUDA device: running the Triton kernels once in the interpreter (slow; timings need a GPU).")
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            check(results, "cpu", dtype, 67, 45, 83, "interpreter")
    errors = results.select(metric="max rel err")
    print("\nStage 1: relu(a @ b + bias), forward and the three gradients, against float64: the largest "
          "relative error of the four (pass: fuselab's within 4x PyTorch's)")
    print(pivot(errors, ["shape", "dtype", "mode"], baseline=None))
    if on_gpu:
        print(pivot(results.select(metric="TFLOP/s"), ["shape", "dtype", "mode"], baseline="cuBLASLt",
                    higher_is_better=True))
    print(f"saved {results.save(out, merge=args.merge)}")
    err = {(r["dtype"], r["provider"]): r["p50"] for r in errors}
    bad = [d for d, prov in err if prov == "fuselab" and err[d, "fuselab"] > max(4 * err[d, "torch"], 1e-6)]
    if bad:
        sys.exit(f"fuselab's error exceeds 4x PyTorch's in {bad}")
    print("pass: fuselab's error is within 4x PyTorch's in every dtype")
    if not on_gpu:
        print("Timings need a GPU: run `make demo` (or `make bench`) on a CUDA machine.")
    if args.skip_mlp:
        return results
    print("\nStage 2: an MLP trained stock and with fuse_linear_relu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real speed on a CPU
    cmd = [sys.executable, "-m", "experiments.train_mlp", "--epochs", "3" if on_gpu else "2"]
    cmd += ["--data", args.data] if args.data else []
    if args.out is not None:  # beside stage 1's file, not the repository's runs/
        cmd += ["--out", str(args.out.with_name(f"{args.out.stem}.train_mlp.json"))]
    cmd += ["--results"] if args.results else ["--merge"] if args.merge else []
    status = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    if status:
        sys.exit(f"stage 2 (python -m experiments.train_mlp) failed with exit status {status}")
    print("\nThe published runs to compare with: docs/results/quickstart.md and docs/results/train_mlp.md; "
          "the README's tour says what else to run.")
    return results


if __name__ == "__main__":
    main()
