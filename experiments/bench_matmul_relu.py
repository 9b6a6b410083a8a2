"""Benchmark fuselab's fused matmul-ReLU against every peer, in one process, on the same inputs.

Peers: ``torch.relu(a @ b)`` (cuBLAS + a separate ReLU), ``torch._addmm_activation(bias, a, b)``
(cuBLASLt's fused bias+ReLU epilogue, the strongest fused peer), and inductor's
``max-autotune-no-cudagraphs`` compile of ``relu(a @ b)``; forward+backward against PyTorch
autograd. Times are ``triton.testing.do_bench`` medians (it flushes L2 before each run).
fp32 rows run with ``torch.set_float32_matmul_precision("high")``: tf32 for everyone.

    python experiments/bench_matmul_relu.py                 # the full suite (H200: ~6 min)
    python experiments/bench_matmul_relu.py --quick         # three shapes, bf16
    python experiments/report.py                            # README tables + plot from the JSON
"""
import argparse
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.kernels import matmul_relu  # noqa: E402
from fuselab.kernels.matmul_relu import matmul_relu_kernel  # noqa: E402
from fuselab.report import RESULTS, markdown_table, save_json  # noqa: E402

# name -> (M, N, K); Y is M x N, the reduction is K.
SHAPES = {
    "8192x8192x8192": (8192, 8192, 8192),
    "4096x4096x4096": (4096, 4096, 4096),
    "8192x8192x1024": (8192, 8192, 1024),
    "8192x8192x256": (8192, 8192, 256),
    "16384x4096x512": (16384, 4096, 512),
    "1024x2048x512": (1024, 2048, 512),
    "64x4096x4096": (64, 4096, 4096),
    "gpt2-medium-mlp 4096x4096x1024": (4096, 4096, 1024),  # 4096 tokens, d=1024 -> 4d, ReLU
    "7b-mlp 4096x11008x4096": (4096, 11008, 4096),  # 4096 tokens, d=4096 -> 11008, ReLU
}
QUICK = ["8192x8192x8192", "8192x8192x256", "64x4096x4096"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FWD_BWD_SHAPES = ["8192x8192x1024", "4096x4096x4096"]
CUDA_COLUMNS = ["shape", "dtype", "CUDA C++ naive+bias", "CUDA C++ SIMT+bias (exact fp32)", "CUDA C++ tiled+bias",
                "CUDA C++ wgmma+bias", "fuselab+bias", "cuBLASLt addmm+relu", "torch relu(mm)", "CUDA tiled x naive",
                "CUDA tiled x relu(mm)", "CUDA wgmma x relu(mm)", "CUDA tiled x cuBLASLt", "CUDA wgmma x cuBLASLt"]


def tflops(flops: float, ms: float) -> float:
    return flops / ms * 1e-9


def bench(fn, grad_to_none=None) -> float:
    import triton

    fn()  # autotune / compile outside the timed region
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=50, rep=200, grad_to_none=grad_to_none, return_mode="median")


def exact_fp32(fn, *args, **kwargs):
    """``fn`` with tf32 off: the CUDA reference then takes its exact SIMT fp32 kernel."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn(*args, **kwargs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


# The CUDA reference's fp16/bf16 kernel each column pins (FUSELAB_CUDA_KERNEL, read per call). Set
# around the whole timing, not per call: patching os.environ inside the timed call costs ~0.1 ms.
CUDA_PINNED = {"CUDA C++ tiled+bias": "mma", "CUDA C++ wgmma+bias": "wgmma"}


def measure_forward(name, dtype_name, inductor: bool, cuda: bool = False):
    import triton

    M, N, K = SHAPES[name]
    dtype = DTYPES[dtype_name]
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    flops = 2.0 * M * N * K
    ref = torch.relu(a.double() @ b.double() + bias.double())
    out = matmul_relu(a, b, bias)
    rel_err = ((out.double() - ref).norm() / ref.norm()).item()
    providers = {
        "fuselab": lambda: matmul_relu(a, b),
        "fuselab+bias": lambda: matmul_relu(a, b, bias),
        "torch relu(mm)": lambda: torch.relu(a @ b),
        "cuBLASLt addmm+relu": lambda: torch._addmm_activation(bias, a, b),
    }
    if cuda:  # the CUDA C++ reference (issue 3): its mma.sync (tf32 in fp32) kernel, Hopper's wgmma kernel
        # (fp16/bf16 on sm_90), and the tutorial's naive kernel in fp32
        providers["CUDA C++ tiled+bias"] = lambda: matmul_relu(a, b, bias, backend="cuda")
        if dtype != torch.float32 and torch.cuda.get_device_capability() == (9, 0):
            providers["CUDA C++ wgmma+bias"] = providers["CUDA C++ tiled+bias"]
        if dtype == torch.float32:
            providers["CUDA C++ SIMT+bias (exact fp32)"] = lambda: exact_fp32(matmul_relu, a, b, bias, backend="cuda")
            if M * N * K <= 4096**3:
                providers["CUDA C++ naive+bias"] = lambda: torch.ops.fuselab.matmul_relu_cuda_naive(a, b, bias)
    if inductor:
        compiled = torch.compile(lambda x, y: torch.relu(x @ y), mode="max-autotune-no-cudagraphs")
        providers["inductor max-autotune"] = lambda: compiled(a, b)
    row = {"shape": name, "M": M, "N": N, "K": K, "dtype": dtype_name, "rel_err_vs_fp64": rel_err}
    for prov, fn in providers.items():
        with mock.patch.dict(os.environ, {"FUSELAB_CUDA_KERNEL": CUDA_PINNED[prov]} if prov in CUDA_PINNED else {}):
            row[prov] = tflops(flops, bench(fn))
        if prov == "fuselab":
            row["fuselab_config"] = str(matmul_relu_kernel.best_config)
            # The same launch replayed from a CUDA graph: kernel time without Python's host cost.
            row["fuselab (CUDA graph)"] = tflops(flops, triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
    row["x relu(mm)"] = row["fuselab"] / row["torch relu(mm)"]
    row["x cuBLASLt"] = row["fuselab+bias"] / row["cuBLASLt addmm+relu"]
    if inductor:
        row["x inductor"] = row["fuselab"] / row["inductor max-autotune"]
    if cuda:
        row["CUDA tiled x cuBLASLt"] = row["CUDA C++ tiled+bias"] / row["cuBLASLt addmm+relu"]
        row["CUDA tiled x relu(mm)"] = row["CUDA C++ tiled+bias"] / row["torch relu(mm)"]
        if "CUDA C++ wgmma+bias" in row:
            row["CUDA wgmma x relu(mm)"] = row["CUDA C++ wgmma+bias"] / row["torch relu(mm)"]
            row["CUDA wgmma x cuBLASLt"] = row["CUDA C++ wgmma+bias"] / row["cuBLASLt addmm+relu"]
        if "CUDA C++ naive+bias" in row:
            row["CUDA tiled x naive"] = row["CUDA C++ tiled+bias"] / row["CUDA C++ naive+bias"]
    return row


def measure_forward_backward(name, dtype_name):
    M, N, K = SHAPES[name]
    dtype = DTYPES[dtype_name]
    a = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(K, N, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    flops = 3 * 2.0 * M * N * K
    row = {"shape": name, "M": M, "N": N, "K": K, "dtype": dtype_name}
    for prov, f in {"fuselab": lambda: matmul_relu(a, b, bias),
                    "torch autograd": lambda: torch.relu(torch.addmm(bias, a, b))}.items():
        row[prov] = tflops(flops, bench(lambda: f().backward(dy), grad_to_none=[a, b, bias]))
    row["x torch"] = row["fuselab"] / row["torch autograd"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three shapes, bf16 only")
    p.add_argument("--shapes", default="all", help="shape names (comma-separated, or 'all')")
    p.add_argument("--dtypes", default="bf16,fp16,fp32")
    p.add_argument("--fp32-shapes", default="all", help="shapes (comma-separated, or 'all') timed in fp32")
    p.add_argument("--inductor", default="8192x8192x8192,8192x8192x256,64x4096x4096",
                   help="shapes (comma-separated, or 'all'/'none') that also time inductor max-autotune, bf16 only "
                        "(each costs a ~30 s compile)")
    p.add_argument("--cuda", action="store_true", help="also time the CUDA C++ reference (built on first use)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_matmul_relu.py times CUDA kernels: run it on a GPU machine.")
    from tqdm import tqdm

    torch.set_float32_matmul_precision("high")
    shapes = QUICK if args.quick else list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        sys.exit(f"unknown shapes {sorted(unknown)}: choose from {list(SHAPES)}")
    dtypes = ["bf16"] if args.quick else args.dtypes.split(",")
    inductor = set(SHAPES) if args.inductor == "all" else set(args.inductor.split(",")) - {"none"}
    fp32_shapes = set(shapes) if args.fp32_shapes == "all" else set(args.fp32_shapes.split(","))
    jobs = [(s, d) for d in dtypes for s in shapes if d != "fp32" or s in fp32_shapes]
    fwd = [measure_forward(s, d, d == "bf16" and s in inductor, args.cuda) for s, d in tqdm(jobs, desc="forward")]
    fb_jobs = [(s, d) for d in dtypes for s in (FWD_BWD_SHAPES[:1] if args.quick else FWD_BWD_SHAPES)
               if s in shapes and (s in fp32_shapes or d != "fp32")]
    fb = [measure_forward_backward(s, d) for s, d in tqdm(fb_jobs, desc="fwd+bwd")]
    # --cuda runs are saved apart: they add the CUDA reference's columns, usually over fewer shapes.
    path = save_json("matmul_relu_bench" + ("_cuda" if args.cuda else ""), fwd, {"forward_backward": fb}, out_dir=args.out)
    cols = ["shape", "dtype", "fuselab", "fuselab (CUDA graph)", "torch relu(mm)", "x relu(mm)", "fuselab+bias", "cuBLASLt addmm+relu",
            "x cuBLASLt", "inductor max-autotune", "x inductor"]
    if args.cuda:
        cols = CUDA_COLUMNS
    print(markdown_table(cols, [[r.get(c, "") for c in cols] for r in fwd]))
    cols = ["shape", "dtype", "fuselab", "torch autograd", "x torch"]
    print(markdown_table(cols, [[r[c] for c in cols] for r in fb]))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
