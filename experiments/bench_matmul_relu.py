"""Benchmark fuselab's fused matmul-ReLU against its peers, in one process, on the same inputs,
every provider in eager mode and replayed from a CUDA graph.

Ops and providers (the first one named is each op's baseline; the report computes ``x <baseline>``):

    fwd            relu(a @ b + bias): cuBLASLt (``torch._addmm_activation``, cuBLASLt's fused bias+ReLU
                   epilogue), fuselab, relu(addmm) (cuBLAS, then a separate ReLU), inductor
                   (``max-autotune-no-cudagraphs`` compile of relu(addmm); bf16, ``--inductor`` shapes);
                   with ``--cuda`` also the CUDA C++ reference: CUDA mma (mma.sync), CUDA wgmma (Hopper,
                   fp16/bf16), CUDA SIMT (exact fp32) and CUDA naive (the tutorial's kernel, fp32, <= 4096^3)
    fwd-nobias     relu(a @ b): relu(mm), fuselab
    fwd+bwd        relu(a @ b + bias), forward then backward (3 GEMMs' FLOPs): autograd, fuselab

Modes (``experiments/harness.py``): ``eager`` is ``triton.testing.do_bench`` (one call at a time, L2
flushed, the host's per-call cost included); ``graph`` replays the same calls from a CUDA graph (device
time only). Inputs rotate over sets that together exceed L2, so a graph's replays do not find them
cached. ``tf32`` rows are fp32 tensors under ``torch.set_float32_matmul_precision("high")``: tf32
for every provider. Each fwd provider's output is also checked against float64 (metric ``rel err``).

    python -m experiments.bench_matmul_relu --quick                    # 3 shapes, bf16 (runs/)
    python -m experiments.bench_matmul_relu --results                  # the full suite -> results/matmul_relu.json
    python -m experiments.bench_matmul_relu --cuda --ops fwd --results # the CUDA C++ reference -> matmul_relu_cuda
    python -m experiments.report                                       # docs/results/*.md from results/
"""
import argparse
import contextlib
import sys
from typing import Dict, List, Optional, Tuple

import torch

from experiments.harness import (
    Providers,
    Results,
    add_output_args,
    cycle,
    output_path,
    pivot,
    positive_int,
    rel_error,
    require_cuda,
    rotating,
    time_call,
)
from fuselab.kernels import matmul_relu

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
FP32_SHAPES = ["4096x4096x4096", "8192x8192x1024", "1024x2048x512"]
FWD_BWD_SHAPES = ["8192x8192x1024", "4096x4096x4096"]
INDUCTOR_SHAPES = ["8192x8192x8192", "8192x8192x256", "64x4096x4096"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
OPS = ("fwd", "fwd-nobias", "fwd+bwd")
STUDY, CUDA_STUDY = "matmul_relu", "matmul_relu_cuda"

FWD, NO_BIAS, FWD_BWD = Providers(), Providers(), Providers()
PROVIDERS = {"fwd": FWD, "fwd-nobias": NO_BIAS, "fwd+bwd": FWD_BWD}
_compiled: Dict[str, object] = {}  # op -> this job's inductor compile


@FWD.register("cuBLASLt", baseline=True)
def cublaslt(a, b, bias):
    return torch._addmm_activation(bias, a, b)


@FWD.register("fuselab")
def fuselab_fwd(a, b, bias):
    return matmul_relu(a, b, bias)


@FWD.register("relu(addmm)")
def relu_addmm(a, b, bias):
    return torch.relu(torch.addmm(bias, a, b))


@FWD.register("inductor")
def inductor_fwd(a, b, bias):
    return _compiled["fwd"](a, b, bias)


@FWD.register("CUDA mma")
def cuda_mma(a, b, bias):
    return torch.ops.fuselab.matmul_relu_cuda(a, b, bias, "mma")


@FWD.register("CUDA wgmma")
def cuda_wgmma(a, b, bias):
    return torch.ops.fuselab.matmul_relu_cuda(a, b, bias, "wgmma")


@FWD.register("CUDA SIMT (exact fp32)")
def cuda_simt(a, b, bias):
    return matmul_relu(a, b, bias, backend="cuda")


@FWD.register("CUDA naive")
def cuda_naive(a, b, bias):
    return torch.ops.fuselab.matmul_relu_cuda_naive(a, b, bias)


@NO_BIAS.register("relu(mm)", baseline=True)
def relu_mm(a, b):
    return torch.relu(a @ b)


@NO_BIAS.register("fuselab")
def fuselab_no_bias(a, b):
    return matmul_relu(a, b)


@FWD_BWD.register("autograd", baseline=True)
def autograd_fwd_bwd(a, b, bias, dy):
    torch.relu(torch.addmm(bias, a, b)).backward(dy)


@FWD_BWD.register("fuselab")
def fuselab_fwd_bwd(a, b, bias, dy):
    matmul_relu(a, b, bias).backward(dy)


@contextlib.contextmanager
def exact_fp32():
    """tf32 off: the CUDA reference then takes its exact SIMT fp32 kernel."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


SETTINGS = {"CUDA SIMT (exact fp32)": exact_fp32}


def wanted(op: str, name: str, shape: str, dtype: str, args) -> bool:
    """Whether ``name`` runs for this op, shape and dtype under the command line's choices."""
    M, N, K = SHAPES[shape]
    if name.startswith("CUDA"):
        if not args.cuda:
            return False
        if name == "CUDA wgmma":
            return dtype != "tf32" and torch.cuda.get_device_capability() == (9, 0)
        if name == "CUDA SIMT (exact fp32)":
            return dtype == "tf32"
        if name == "CUDA naive":
            return dtype == "tf32" and M * N * K <= 4096**3
        return True
    if name == "inductor":
        return dtype == "bf16" and shape in args.inductor
    return True


def make_inputs(op: str, shape: str, dtype: torch.dtype):
    M, N, K = SHAPES[shape]
    grad = op == "fwd+bwd"
    a = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=grad)
    b = torch.randn(K, N, device="cuda", dtype=dtype, requires_grad=grad)
    if op == "fwd-nobias":
        return a, b
    bias = torch.randn(N, device="cuda", dtype=dtype, requires_grad=grad)
    if op == "fwd":
        return a, b, bias
    return a, b, bias, torch.randn(M, N, device="cuda", dtype=dtype)


def fuselab_config() -> Optional[str]:
    """The autotuner's last choice for the Triton kernel (None where the kernel module moved)."""
    for module in list(sys.modules.values()):
        kernel = getattr(module, "matmul_relu_kernel", None) if module and module.__name__.startswith(
            "fuselab.kernels") else None
        if kernel is not None and getattr(kernel, "best_config", None) is not None:
            return str(kernel.best_config)
    return None


def measure(results: Results, op: str, shape: str, dtype_name: str, args) -> None:
    M, N, K = SHAPES[shape]
    dtype = DTYPES[dtype_name]
    flops = (6.0 if op == "fwd+bwd" else 2.0) * M * N * K
    providers = {n: fn for n, fn in PROVIDERS[op].select(args.providers.get(op)).items()
                 if wanted(op, n, shape, dtype_name, args)}
    if "inductor" in providers:
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no stale guards
        _compiled[op] = torch.compile(relu_addmm, mode="max-autotune-no-cudagraphs", dynamic=False)
    sets = rotating(lambda: make_inputs(op, shape, dtype))
    leaves = [t for s in sets for t in s if t.requires_grad] or None
    if op == "fwd":
        a, b, bias = sets[0]
        ref = torch.relu(torch.addmm(bias.double(), a.double(), b.double()))
    for name, fn in providers.items():
        keys = dict(op=op, provider=name, shape=shape, dtype=dtype_name)
        with SETTINGS.get(name, contextlib.nullcontext)():
            for mode in args.modes:
                try:
                    timing = time_call(cycle(fn, sets), mode, rep_ms=args.rep_ms, grad_to_none=leaves)
                except Exception as e:  # noqa: BLE001  out of memory, a graph that does not capture: reported
                    results.fail(**keys, mode=mode, error=e)
                    print(f"FAILED {op} {name} {shape} {dtype_name} {mode}: {results.failed[-1]['error']}")
                    torch.cuda.empty_cache()
                    continue
                extra = {"config": fuselab_config()} if name == "fuselab" and mode == "eager" else {}
                results.record_time(**keys, mode=mode, value=timing, flops=flops, **extra)
            if op == "fwd":
                try:
                    results.record(**keys, mode="eager", metric="rel err", value=rel_error(fn(a, b, bias), ref))
                except Exception as e:  # noqa: BLE001
                    results.fail(**keys, mode="eager", error=e)
    del sets


def csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three shapes, bf16 only, fwd+bwd at one shape")
    p.add_argument("--shapes", default="all", help=f"comma-separated names or 'all': {list(SHAPES)}")
    p.add_argument("--dtypes", default="bf16,fp16,tf32", help=f"of {list(DTYPES)}")
    p.add_argument("--tf32-shapes", default=",".join(FP32_SHAPES), help="shapes timed in tf32 ('all' or names)")
    p.add_argument("--ops", default=",".join(OPS), help=f"of {list(OPS)}")
    p.add_argument("--providers", default=None,
                   help="restrict the providers, e.g. 'fuselab,cuBLASLt' (applies to every op that has them)")
    p.add_argument("--modes", default="eager,graph", help="timing modes: eager, graph")
    p.add_argument("--inductor", default=",".join(INDUCTOR_SHAPES),
                   help="shapes ('all', 'none' or names) that also time inductor max-autotune, bf16 fwd only "
                        "(each costs a ~30 s compile)")
    p.add_argument("--cuda", action="store_true",
                   help=f"add the CUDA C++ reference (built on first use) and write study {CUDA_STUDY!r}")
    p.add_argument("--rep-ms", type=positive_int, default=100, help="milliseconds of timed calls per measurement")
    add_output_args(p)
    args = p.parse_args(argv)
    require_cuda("bench_matmul_relu")  # before any work

    def pick(text, known, what):
        names = list(known) if text == "all" else [] if text == "none" else csv(text)
        unknown = [n for n in names if n not in known]
        if unknown:
            p.error(f"unknown {what} {unknown}: choose from {list(known)}")
        return names

    shapes = QUICK if args.quick else pick(args.shapes, SHAPES, "shapes")
    dtypes = ["bf16"] if args.quick else pick(args.dtypes, DTYPES, "dtypes")
    tf32_shapes = set(pick(args.tf32_shapes, SHAPES, "tf32 shapes"))
    ops = pick(args.ops, OPS, "ops")
    args.modes = pick(args.modes, ("eager", "graph"), "modes")
    args.inductor = set(pick(args.inductor, SHAPES, "inductor shapes"))
    chosen = csv(args.providers) if args.providers else None
    known = {n for reg in PROVIDERS.values() for n in reg.fns}
    if chosen and set(chosen) - known:
        p.error(f"unknown providers {sorted(set(chosen) - known)}: choose from {sorted(known)}")
    args.providers = {op: [n for n in reg.fns if n in chosen] if chosen else None for op, reg in PROVIDERS.items()}
    study = CUDA_STUDY if args.cuda else STUDY
    out = output_path(args, study)
    from tqdm import tqdm

    torch.set_float32_matmul_precision("high")
    results = Results(study)
    for op in ops:
        results.set_baseline(op, PROVIDERS[op])
    fb_shapes = FWD_BWD_SHAPES[:1] if args.quick else FWD_BWD_SHAPES
    jobs: List[Tuple[str, str, str]] = [
        (op, s, d) for op in ops for d in dtypes for s in shapes
        if (d != "tf32" or s in tf32_shapes) and (op != "fwd+bwd" or s in fb_shapes)]
    for op, shape, dtype in tqdm(jobs, desc=study):
        measure(results, op, shape, dtype, args)
        results.save(out, merge=args.merge)  # after every job: a run cut short keeps what it measured
    for op in ops:
        rows = results.select(op=op, metric="TFLOP/s")
        if rows:
            print(f"\n{op}, TFLOP/s:\n" + pivot(rows, ["shape", "dtype", "mode"], baseline=results.baselines[op],
                                                 higher_is_better=True))
    print(f"saved {results.save(out, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
