"""Sweep the CUDA C++ reference's build-time tile shape: build every variant, then time each.

The tile belongs to the fp16/bf16 mma.sync kernel (pinned with the op's kernel="mma"; tf32 keeps
its fixed WMMA tile, Hopper's wgmma kernel its own). Variants build in parallel (one nvcc each),
then each is loaded and timed in its own process (every variant registers the same op names).

Study ``cuda_tiles`` (long format, ``experiments/harness.py``): op the variant (``tile BMxBNxBK, warps
WMxWN, S stages``); providers ``mma, row-major B`` and ``mma, weight.t()`` (the variant with B row-major
and with B = weight.t()) and ``cuBLAS relu(mm)``, timed in the variant's own process (the baseline);
shape 4096x4096x4096 with bias, bf16, eager mode; metrics ``TFLOP/s``, ``ms`` and ``rel err``.

    python -m experiments.sweep_cuda_tiles --results   # GPU machine with nvcc; ~3 min on an H200
"""
import argparse
import json
import subprocess
import sys

import torch

from experiments.harness import (
    ROOT,
    Providers,
    Results,
    Timing,
    add_output_args,
    output_path,
    pivot,
    rel_error,
    require_cuda,
    time_call,
)

STUDY = "cuda_tiles"
SIZE = 4096
# BM, BN, BK, WARPS_M, WARPS_N, STAGES; the first is the built-in default.
VARIANTS = [(128, 128, 64, 2, 2, 3), (128, 256, 32, 2, 4, 3), (128, 256, 32, 2, 4, 4), (128, 256, 64, 2, 4, 3),
            (256, 128, 32, 4, 2, 3), (128, 128, 32, 2, 2, 3), (128, 128, 32, 2, 2, 4)]
KEYS = ("BM", "BN", "BK", "WARPS_M", "WARPS_N", "STAGES")
PROVIDERS = Providers()  # each takes (a, b, bias); the layout of b is in the name


@PROVIDERS.register("cuBLAS relu(mm)", baseline=True)
def cublas(a, b, bias):
    return torch.relu(a @ b)


@PROVIDERS.register("mma, row-major B")
def mma_row_major(a, b, bias):
    return torch.ops.fuselab.matmul_relu_cuda(a, b, bias, "mma")  # the swept kernel, not Hopper's wgmma


@PROVIDERS.register("mma, weight.t()")
def mma_weight_t(a, b, bias):
    return torch.ops.fuselab.matmul_relu_cuda(a, b, bias, "mma")


def variant_name(values) -> str:
    bm, bn, bk, wm, wn, stages = values
    return f"tile {bm}x{bn}x{bk}, warps {wm}x{wn}, {stages} stages"


def time_variant(values):
    """[(provider, metric, p20, p50, p80)] of one variant, in this process."""
    from fuselab.kernels.matmul_relu_cuda import build_extension

    build_extension(dict(zip(KEYS, values)))
    dtype, flops = torch.bfloat16, 2.0 * SIZE**3
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=dtype)
    bias = torch.randn(SIZE, device="cuda", dtype=dtype)
    row_major = torch.randn(SIZE, SIZE, device="cuda", dtype=dtype)
    weight_t = torch.randn(SIZE, SIZE, device="cuda", dtype=dtype).t()
    layouts = {"cuBLAS relu(mm)": row_major, "mma, row-major B": row_major, "mma, weight.t()": weight_t}
    out = []
    for name, fn in PROVIDERS.select(None).items():
        b = layouts[name]
        t = time_call(lambda: fn(a, b, bias))
        rate = t.scaled(flops * 1e-9)
        out += [(name, "ms", t.p20, t.p50, t.p80), (name, "TFLOP/s", rate.p20, rate.p50, rate.p80)]
        if name != "cuBLAS relu(mm)":
            err = rel_error(fn(a, b, bias), torch.relu(torch.addmm(bias.double(), a.double(), b.double())))
            out.append((name, "rel err", err, err, err))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", help=argparse.SUPPRESS)  # internal: build one variant
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: time one variant, print its rows as JSON
    add_output_args(p)
    args = p.parse_args(argv)
    if args.build:
        from fuselab.kernels.matmul_relu_cuda import build_extension

        build_extension(dict(zip(KEYS, map(int, args.build.split(",")))))
        return None
    require_cuda("sweep_cuda_tiles")  # before any build
    if args.one:
        print(json.dumps(time_variant([int(v) for v in args.one.split(",")])))
        return None
    out = output_path(args, STUDY)
    from tqdm import tqdm

    specs = [",".join(map(str, v)) for v in VARIANTS]
    me = [sys.executable, "-m", "experiments.sweep_cuda_tiles"]
    builds = [subprocess.Popen([*me, "--build", s], cwd=ROOT) for s in specs]
    for spec, proc in zip(specs, tqdm(builds, desc="build")):
        if proc.wait() != 0:
            sys.exit(f"building variant {spec} failed")
    results = Results(STUDY)
    for values, spec in zip(VARIANTS, tqdm(specs, desc="time")):
        op = variant_name(values)
        results.set_baseline(op, PROVIDERS)
        done = subprocess.run([*me, "--one", spec], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            results.fail(op=op, provider="*", shape=f"{SIZE}x{SIZE}x{SIZE}", dtype="bf16", mode="eager",
                         error=(done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1])
            continue
        for name, metric, *q in json.loads(done.stdout.strip().splitlines()[-1]):
            results.record(op=op, provider=name, shape=f"{SIZE}x{SIZE}x{SIZE}", dtype="bf16", mode="eager",
                           metric=metric, value=Timing(*q), BM=values[0], BN=values[1], BK=values[2],
                           warps=f"{values[3]}x{values[4]}", stages=values[5])
    print(pivot(results.select(metric="TFLOP/s"), ["op"], baseline="cuBLAS relu(mm)", higher_is_better=True))
    print(f"saved {results.save(out, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
