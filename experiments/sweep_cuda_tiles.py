"""Sweep the CUDA C++ reference's build-time tile shape: build every variant, then time each.

The tile belongs to the fp16/bf16 mma.sync kernel (pinned with FUSELAB_CUDA_KERNEL=mma; tf32 keeps
its fixed WMMA tile, Hopper's wgmma kernel its own). Variants build in parallel (one nvcc each),
then each is loaded and timed in its own process (every variant registers the same op names).
Forward with bias at 4096^3 in bf16, B row-major and B = weight.t(), against cuBLAS ``relu(a @ b)``
in the same process.

    python experiments/sweep_cuda_tiles.py            # GPU machine with nvcc; ~3 min on an H200
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.kernels.matmul_relu_cuda import build_extension  # noqa: E402
from fuselab.report import RESULTS, markdown_table, save_json  # noqa: E402

# BM, BN, BK, WARPS_M, WARPS_N, STAGES; the first is the built-in default.
VARIANTS = [(128, 128, 64, 2, 2, 3), (128, 256, 32, 2, 4, 3), (128, 256, 32, 2, 4, 4), (128, 256, 64, 2, 4, 3),
            (256, 128, 32, 4, 2, 3), (128, 128, 32, 2, 2, 3), (128, 128, 32, 2, 2, 4)]
KEYS = ("BM", "BN", "BK", "WARPS_M", "WARPS_N", "STAGES")
COLUMNS = ["tile", "warps", "stages", "bf16 row-major B", "bf16 weight.t()", "cuBLAS bf16", "best x cuBLAS",
           "max rel err"]


def time_variant(values, size=4096):
    import triton

    build_extension(dict(zip(KEYS, values)))
    op = torch.ops.fuselab.matmul_relu_cuda
    bm, bn, bk, wm, wn, stages = values
    row = {"tile": f"{bm}x{bn}x{bk}", "warps": f"{wm}x{wn}", "stages": stages, "max rel err": 0.0}
    flops = 2.0 * size**3
    dtype = torch.bfloat16
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    bias = torch.randn(size, device="cuda", dtype=dtype)
    for layout, b in (("row-major B", torch.randn(size, size, device="cuda", dtype=dtype)),
                      ("weight.t()", torch.randn(size, size, device="cuda", dtype=dtype).t())):
        ref = torch.relu(a.double() @ b.double() + bias.double())
        err = ((op(a, b, bias).double() - ref).norm() / ref.norm()).item()
        row["max rel err"] = max(row["max rel err"], err)
        row[f"bf16 {layout}"] = flops / triton.testing.do_bench(lambda: op(a, b, bias), return_mode="median") * 1e-9
    row["cuBLAS bf16"] = flops / triton.testing.do_bench(lambda: torch.relu(a @ b), return_mode="median") * 1e-9
    row["best x cuBLAS"] = max(row["bf16 row-major B"], row["bf16 weight.t()"]) / row["cuBLAS bf16"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", help=argparse.SUPPRESS)  # internal: build one variant
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: time one variant, print its row as JSON
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.build:
        build_extension(dict(zip(KEYS, map(int, args.build.split(",")))))
        return
    if args.one:
        os.environ["FUSELAB_CUDA_KERNEL"] = "mma"  # the swept kernel, not Hopper's wgmma one
        print(json.dumps(time_variant([int(v) for v in args.one.split(",")])))
        return
    if not torch.cuda.is_available():
        sys.exit("sweep_cuda_tiles.py times CUDA kernels: run it on a GPU machine with nvcc.")
    from tqdm import tqdm

    specs = [",".join(map(str, v)) for v in VARIANTS]
    builds = [subprocess.Popen([sys.executable, __file__, "--build", s]) for s in specs]
    for spec, proc in zip(specs, tqdm(builds, desc="build")):
        if proc.wait() != 0:
            sys.exit(f"building variant {spec} failed")
    rows = []
    for spec in tqdm(specs, desc="time"):
        out = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(markdown_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows]))
    print(f"saved {save_json('cuda_tiles_sweep', rows, {'size': 4096}, out_dir=args.out)}")


if __name__ == "__main__":
    main()
