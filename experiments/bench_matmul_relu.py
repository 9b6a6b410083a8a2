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
flushed; host time beyond the flush's shows); ``graph`` replays the same calls from a CUDA graph (device
time only). Every provider is timed in every mode of ``--modes`` (both by default), in the same run.
Inputs rotate over sets that together exceed L2, so a graph's replays do not find them
cached. ``tf32`` rows are fp32 tensors under ``torch.set_float32_matmul_precision("high")``: tf32
for every provider. Each fwd provider's output is also checked against float64 (metric ``rel err``).

Shapes are named ``[label ]MxNxK`` (nn.Linear terms: M tokens, N out_features, K in_features); a name's
last word gives its sizes, and ``--shapes`` also takes any ``MxNxK``. Named sets: ``default`` (the
suite's shapes), ``coverage`` (model shapes, short K, tall-skinny, rows not 16-byte
aligned, decode M = 1/16/64, and its fwd+bwd shapes), ``all``. fwd+bwd runs at the chosen shapes that
are in FWD_BWD_SHAPES, tf32 at those in ``--tf32-shapes``.

B layouts (``--b-layouts``): ``row-major`` is a contiguous (K, N) B (rows labelled by dtype alone, as
before); ``weight`` is nn.Linear's B = weight.t() of a contiguous (N, K) weight (dtype label
``<dtype>, B=weight.t()``). fwd and fwd-nobias also record ``% bytes floor``: the time to move a and b
once, the bias once and write the output once at the copy bandwidth measured at the start of the run
(``harness.copy_bandwidth_gbs``, in the run's environment as ``copy_gbs``), as a percentage of the
measured time; 100% is the HBM floor (decode shapes are memory-bound).

    python -m experiments.bench_matmul_relu --quick                    # 3 shapes, bf16, fwd+bwd at one (runs/)
    python -m experiments.bench_matmul_relu --list --shapes coverage    # the jobs and their providers (no GPU)
    python -m experiments.bench_matmul_relu --results                  # the default suite -> results/matmul_relu.json
    python -m experiments.bench_matmul_relu --cuda --ops fwd --results # the CUDA C++ reference -> matmul_relu_cuda
    python -m experiments.report                                       # docs/results/*.md from results/

The coverage measurements, one command each (estimated 3-7 minutes each on an H200), merged into results/:

    B="python -m experiments.bench_matmul_relu --shapes coverage --results"
    $B --dtypes bf16 --b-layouts weight --ops fwd                      # nn.Linear layout
    $B --dtypes tf32 --b-layouts row-major,weight --ops fwd,fwd+bwd    # tf32, both B layouts
    $B --dtypes bf16,fp16 --b-layouts weight --ops fwd+bwd             # forward+backward at its shapes
    $B --dtypes fp16 --b-layouts weight --ops fwd
"""
import argparse
import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from experiments.harness import (
    Providers,
    Results,
    add_output_args,
    copy_bandwidth_gbs,
    cycle,
    output_path,
    pivot,
    positive_int,
    rel_error,
    require_cuda,
    rotating,
    shape_dims,
    time_call,
    tuned_choice,
)
from fuselab.kernels import matmul_relu

# Named shapes; results rows carry the names, so a name, once measured, is never changed.
SHAPES = {name: shape_dims(name) for name in [
    "8192x8192x8192", "4096x4096x4096", "8192x8192x1024", "8192x8192x256", "16384x4096x512", "1024x2048x512",
    "64x4096x4096",
    "gpt2-medium-mlp 4096x4096x1024",  # 4096 tokens, d=1024 -> 4d, ReLU
    "7b-mlp 4096x11008x4096",  # 4096 tokens, d=4096 -> 11008, ReLU
    # the coverage set: model, skinny, unaligned and decode shapes
    "llama-ffn 8192x14336x4096",  # Llama's FFN up projection, 8192 tokens
    "opt-1.3b-fc1 16384x8192x2048",
    "tall-skinny 65536x1024x256",
    "unaligned 3001x4099x1537",  # no row of a, b or y is 16-byte aligned: no TMA
    "unaligned-k 4096x4096x4095",  # a's rows (and weight's) not 16-byte aligned
    "unaligned-n 4096x4095x4096",  # row-major b's rows and y's not 16-byte aligned
    "512x1024x1024",
    "decode-1 1x11008x4096", "decode-16 16x11008x4096", "decode-64 64x11008x4096",  # one token .. 64 per step
    "8192x4096x1024", "2048x3072x768",  # fwd+bwd at mid sizes
]}
DEFAULT = ["8192x8192x8192", "4096x4096x4096", "8192x8192x1024", "8192x8192x256", "16384x4096x512", "1024x2048x512",
           "64x4096x4096", "gpt2-medium-mlp 4096x4096x1024", "7b-mlp 4096x11008x4096"]
COVERAGE = [  # model shapes, short K, tall-skinny, unaligned rows, decode M = 1/16/64, tf32, fwd+bwd
    "8192x8192x8192", "llama-ffn 8192x14336x4096", "opt-1.3b-fc1 16384x8192x2048", "8192x8192x1024",
    "8192x8192x256", "tall-skinny 65536x1024x256", "unaligned 3001x4099x1537", "512x1024x1024", "1024x2048x512",
    "64x4096x4096", "decode-16 16x11008x4096",
    "decode-1 1x11008x4096", "decode-64 64x11008x4096", "unaligned-k 4096x4096x4095", "unaligned-n 4096x4095x4096",
    "4096x4096x4096", "7b-mlp 4096x11008x4096", "8192x4096x1024", "2048x3072x768"]
SHAPE_SETS = {"default": DEFAULT, "coverage": COVERAGE, "all": list(SHAPES)}
QUICK = ["8192x8192x8192", "8192x8192x256", "64x4096x4096"]
FP32_SHAPES = ["4096x4096x4096", "8192x8192x1024", "1024x2048x512"]
# fwd+bwd runs at the chosen shapes in this list (--quick: at its first)
FWD_BWD_SHAPES = ["8192x8192x1024", "4096x4096x4096", "7b-mlp 4096x11008x4096", "8192x4096x1024", "2048x3072x768"]
INDUCTOR_SHAPES = ["8192x8192x8192", "8192x8192x256", "64x4096x4096"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
# B's layout: row-major is a contiguous (K, N) tensor; weight is nn.Linear's weight.t(), a contiguous (N, K)
# tensor read column-major. Rows name the layout in their dtype label (row-major: the dtype alone, as always).
B_LAYOUTS = {"row-major": "", "weight": ", B=weight.t()"}
OPS = ("fwd", "fwd-nobias", "fwd+bwd")
FLOOR_OPS = ("fwd", "fwd-nobias")  # ops with a % bytes floor row (fwd+bwd's shapes are compute-bound)
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
    M, N, K = shape_dims(shape)
    if name.startswith("CUDA"):
        if not args.cuda:
            return False
        if name == "CUDA wgmma":
            return dtype != "tf32" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        if name == "CUDA SIMT (exact fp32)":
            return dtype == "tf32"
        if name == "CUDA naive":
            return dtype == "tf32" and M * N * K <= 4096**3
        return True
    if name == "inductor":
        return dtype == "bf16" and shape in args.inductor
    return True


def dtype_label(dtype: str, layout: str) -> str:
    """The rows' dtype key: the dtype, and B's layout unless row-major (``"tf32, B=weight.t()"``)."""
    return dtype + B_LAYOUTS[layout]


def make_inputs(op: str, shape: str, dtype: torch.dtype, layout: str = "row-major", device="cuda"):
    M, N, K = shape_dims(shape)
    grad = op == "fwd+bwd"
    a = torch.randn(M, K, device=device, dtype=dtype, requires_grad=grad)
    if layout == "weight":  # the gradient goes to the weight, a leaf; b is its transposed view
        b = torch.randn(N, K, device=device, dtype=dtype, requires_grad=grad).t()
    else:
        b = torch.randn(K, N, device=device, dtype=dtype, requires_grad=grad)
    if op == "fwd-nobias":
        return a, b
    bias = torch.randn(N, device=device, dtype=dtype, requires_grad=grad)
    if op == "fwd":
        return a, b, bias
    return a, b, bias, torch.randn(M, N, device=device, dtype=dtype)


def grad_leaves(sets) -> Optional[List[torch.Tensor]]:
    """The leaf tensors whose ``.grad`` a timed backward writes (a weight for its ``.t()`` view)."""
    leaves = [t if t._base is None else t._base for s in sets for t in s if t.requires_grad]
    return leaves or None


def floor_bytes(op: str, M: int, N: int, K: int, element_size: int) -> int:
    """Bytes the op must move at least: a (M x K) and b (K x N) read once, the bias (N) read once
    (fwd), the output (M x N) written once."""
    return (M * K + K * N + (N if op == "fwd" else 0) + M * N) * element_size


def floor_ms(op: str, shape: str, dtype: str, bandwidth_gbs: float) -> float:
    """The time to move ``floor_bytes`` at ``bandwidth_gbs`` (GB/s, bytes read + written), in ms."""
    nbytes = floor_bytes(op, *shape_dims(shape), torch.finfo(DTYPES[dtype]).bits // 8)
    return nbytes / (bandwidth_gbs * 1e9) * 1e3


def measure(results: Results, op: str, shape: str, dtype_name: str, args, layout: str = "row-major",
            bandwidth_gbs: Optional[float] = None, device="cuda") -> None:
    """Every wanted provider of ``op`` at one shape, dtype and B layout, in every mode of ``args.modes``;
    with ``bandwidth_gbs``, fwd and fwd-nobias also record ``% bytes floor``."""
    M, N, K = shape_dims(shape)
    dtype = DTYPES[dtype_name]
    flops = (6.0 if op == "fwd+bwd" else 2.0) * M * N * K
    floor = floor_ms(op, shape, dtype_name, bandwidth_gbs) if bandwidth_gbs and op in FLOOR_OPS else None
    providers = {n: fn for n, fn in PROVIDERS[op].select(args.providers.get(op)).items()
                 if wanted(op, n, shape, dtype_name, args)}
    if "inductor" in providers:
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no stale guards
        _compiled[op] = torch.compile(relu_addmm, mode="max-autotune-no-cudagraphs", dynamic=False)
    sets = rotating(lambda: make_inputs(op, shape, dtype, layout, device))
    leaves = grad_leaves(sets)
    if op == "fwd":
        a, b, bias = sets[0]
        ref = torch.relu(torch.addmm(bias.double(), a.double(), b.double()))
    label = dtype_label(dtype_name, layout)
    for name, fn in providers.items():
        keys = dict(op=op, provider=name, shape=shape, dtype=label)
        with SETTINGS.get(name, contextlib.nullcontext)():
            for mode in args.modes:
                try:
                    timing = time_call(cycle(fn, sets), mode, rep_ms=args.rep_ms, grad_to_none=leaves)
                except Exception as e:  # noqa: BLE001  out of memory, a graph that does not capture: reported
                    results.fail(**keys, mode=mode, error=e)
                    print(f"FAILED {op} {name} {shape} {label} {mode}: {results.failed[-1]['error']}")
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                # the tuner's choice, where the op is one launch (fwd+bwd's last would name one product only)
                one_launch = name == "fuselab" and mode == "eager" and op != "fwd+bwd"
                first = sets[0]
                extra = {"config": tuned_choice(lambda: fn(*first), "matmul_relu_kernel")} if one_launch else {}
                results.record_time(**keys, mode=mode, value=timing, flops=flops, **extra)
                if floor is not None:
                    results.record(**keys, mode=mode, metric="% bytes floor", value=timing.scaled(100 * floor))
            if op == "fwd":
                try:
                    results.record(**keys, mode="eager", metric="rel err", value=rel_error(fn(a, b, bias), ref))
                except Exception as e:  # noqa: BLE001
                    results.fail(**keys, mode="eager", error=e)
    del sets


def csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def resolve_shapes(text: str) -> List[str]:
    """Shape names from a comma-separated list of set names (``SHAPE_SETS``, ``none``), shape names, their
    labels (``decode-1``) and ``MxNxK`` sizes (a named shape's sizes give its name). Raises ValueError
    naming what is unknown."""
    by_dims = {dims: name for name, dims in SHAPES.items()}
    by_label = {name.split()[0]: name for name in SHAPES if len(name.split()) > 1}
    names, unknown = [], []
    for token in csv(text):
        if token in SHAPE_SETS:
            names += SHAPE_SETS[token]
        elif token == "none":
            continue
        elif token in SHAPES or token in by_label:
            names.append(by_label.get(token, token))
        else:
            try:
                dims = shape_dims(token)
            except ValueError:
                unknown.append(token)
                continue
            names.append(by_dims.get(dims, "x".join(map(str, dims))))
    if unknown:
        raise ValueError(f"unknown shapes {unknown}: give MxNxK (three positive integers), a set {list(SHAPE_SETS)} "
                         f"or a name {list(SHAPES)}")
    return list(dict.fromkeys(names))


Job = Tuple[str, str, str, str]  # (op, shape, dtype, B layout)


def plan(args) -> List[Job]:
    """The jobs of a run, in order: every op, dtype, B layout and shape chosen, fwd+bwd where its shapes
    allow, tf32 where ``--tf32-shapes`` does."""
    jobs = []
    for op in args.ops:
        shapes = args.shapes
        if op == "fwd+bwd":
            shapes = FWD_BWD_SHAPES[:1] if args.quick else [s for s in shapes if s in FWD_BWD_SHAPES]
        jobs += [(op, s, dtype, layout) for dtype in args.dtypes for layout in args.b_layouts for s in shapes
                 if dtype != "tf32" or s in args.tf32_shapes]
    return jobs


def cells(job: Job, args) -> List[str]:
    """The providers a job times (each in every mode of ``args.modes``)."""
    op, shape, dtype, _ = job
    return [n for n in PROVIDERS[op].select(args.providers.get(op)) if wanted(op, n, shape, dtype, args)]


def print_plan(jobs: List[Job], args) -> None:
    for job in jobs:
        op, shape, dtype, layout = job
        print(f"{op:10s} {dtype_label(dtype, layout):20s} {shape:32s} {', '.join(cells(job, args))}")
    timed = sum(len(cells(job, args)) for job in jobs) * len(args.modes)
    compiles = sum(1 for job in jobs if "inductor" in cells(job, args))
    print(f"{len(jobs)} jobs, {timed} timed cells (provider x mode), {compiles} inductor compiles")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three shapes, bf16 only, fwd+bwd at one shape")
    p.add_argument("--shapes", default="default",
                   help=f"comma-separated MxNxK sizes, names, labels (decode-1) or sets {list(SHAPE_SETS)} "
                        "(default: default): "
                        f"{list(SHAPES)}")
    p.add_argument("--dtypes", default="bf16,fp16,tf32", help=f"of {list(DTYPES)}")
    p.add_argument("--b-layouts", default="row-major",
                   help=f"B's layouts, each timed for every dtype: {list(B_LAYOUTS)} (row-major: a contiguous "
                        "(K, N) B; weight: nn.Linear's weight.t(), labelled ', B=weight.t()' after the dtype)")
    p.add_argument("--tf32-shapes", default=",".join(FP32_SHAPES),
                   help="of the chosen shapes, those also timed in tf32 (sizes, names or sets)")
    p.add_argument("--ops", default=",".join(OPS), help=f"of {list(OPS)}")
    p.add_argument("--providers", default=None,
                   help="restrict the providers, e.g. 'fuselab,cuBLASLt' (applies to every op that has them)")
    p.add_argument("--modes", default="eager,graph", help="timing modes: eager, graph")
    p.add_argument("--inductor", default=",".join(INDUCTOR_SHAPES),
                   help="shapes ('all', 'none', sizes or names) that also time inductor max-autotune, bf16 fwd "
                        "only (each costs a ~30 s compile per B layout)")
    p.add_argument("--cuda", action="store_true",
                   help=f"add the CUDA C++ reference (built on first use) and write study {CUDA_STUDY!r}")
    p.add_argument("--rep-ms", type=positive_int, default=100, help="milliseconds of timed calls per measurement")
    p.add_argument("--list", action="store_true", help="print the jobs and their providers, measure nothing")
    add_output_args(p)
    args = p.parse_args(argv)

    def pick(text, known, what):
        names = list(known) if text == "all" else [] if text == "none" else csv(text)
        unknown = [n for n in names if n not in known]
        if unknown:
            p.error(f"unknown {what} {unknown}: choose from {list(known)}")
        return names

    def shape_list(text, what):
        try:
            return resolve_shapes(text)
        except ValueError as e:
            p.error(f"{what}: {e}")

    def subset(text, what):  # of the chosen shapes; 'all' includes sizes given on the command line
        return set(shape_list(text, what)) | (set(args.shapes) if "all" in csv(text) else set())

    args.shapes = QUICK if args.quick else shape_list(args.shapes, "--shapes")
    args.dtypes = ["bf16"] if args.quick else pick(args.dtypes, DTYPES, "dtypes")
    args.b_layouts = pick(args.b_layouts, B_LAYOUTS, "B layouts")
    args.tf32_shapes = subset(args.tf32_shapes, "--tf32-shapes")
    args.ops = pick(args.ops, OPS, "ops")
    args.modes = pick(args.modes, ("eager", "graph"), "modes")
    args.inductor = subset(args.inductor, "--inductor")
    chosen = csv(args.providers) if args.providers else None
    known = {n for reg in PROVIDERS.values() for n in reg.fns}
    if chosen and set(chosen) - known:
        p.error(f"unknown providers {sorted(set(chosen) - known)}: choose from {sorted(known)}")
    args.providers = {op: [n for n in reg.fns if n in chosen] if chosen else None for op, reg in PROVIDERS.items()}
    jobs = plan(args)
    if args.list:
        print_plan(jobs, args)
        return jobs
    require_cuda("bench_matmul_relu")  # before any work
    study = CUDA_STUDY if args.cuda else STUDY
    out = output_path(args, study)
    from tqdm import tqdm

    torch.set_float32_matmul_precision("high")
    results = Results(study)
    for op in args.ops:
        results.set_baseline(op, PROVIDERS[op])
    bandwidth = copy_bandwidth_gbs()  # once per run: the bytes floor's bandwidth
    results.annotate(copy_gbs=round(bandwidth, 1))
    for op, shape, dtype, layout in tqdm(jobs, desc=study):
        measure(results, op, shape, dtype, args, layout, bandwidth)
        results.save(out, merge=args.merge)  # after every job: a run cut short keeps what it measured
    for op in args.ops:
        for metric, baseline in (("TFLOP/s", results.baselines[op]), ("% bytes floor", None)):
            rows = results.select(op=op, metric=metric)
            if rows:
                print(f"\n{op}, {metric}:\n" + pivot(rows, ["shape", "dtype", "mode"], baseline=baseline,
                                                     higher_is_better=True))
    print(f"copy bandwidth {bandwidth:,.0f} GB/s (the bytes floor's)")
    print(f"saved {results.save(out, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
