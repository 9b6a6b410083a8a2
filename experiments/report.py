"""Regenerate the results docs from results/*.json: docs/results/<study>.md with its plot
(docs/results/<study>.png), the index docs/results/README.md, and README.md's headline table.

    python -m experiments.report               # everything
    python -m experiments.report --no-readme   # the docs only

Everything is rendered from the long-format rows alone (``fuselab-results/1``, see
``experiments/harness.py``); this module imports no experiment script. What a study's page shows is
its ``Spec`` below: a title, prose, and views (which metric, which keys index the lines, which key
makes the columns, which column is the baseline of the ``x <baseline>`` ratio columns). A study
without a spec, and any op and metric no view covers, get the generic rendering: one table per op and
metric, providers as columns and, for times and rates, ratio columns against the op's baseline.
Ratios are computed here, never stored: ``x <baseline>`` above 1 means faster (or more per second)
than the baseline, whichever way the metric runs.

README.md's headline table is written between ``<!-- results:headline -->`` and
``<!-- /results:headline -->``; without those markers this fails and says so.
"""
import argparse
import importlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from experiments.harness import RESULTS, ROOT, Results, geomean, markdown_table
from fuselab._results import NotResults

DOCS = ROOT / "docs" / "results"
README = ROOT / "README.md"
HEADLINE_BEGIN, HEADLINE_END = "<!-- results:headline -->", "<!-- /results:headline -->"
OP_BASELINE = "<op baseline>"  # a View's baseline: the op's provider named in the file's ``baselines``
STANDARD_ENV = ("gpu", "device", "driver", "torch", "triton", "cuda", "python", "commit", "dirty", "date",
                "converted_from")


# ----------------------------------------------------------------------------------------------
# Specs: what each study's page shows
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """Tables of one metric: a line per distinct ``index`` tuple, a column per ``column`` value, a table
    per distinct ``split`` tuple. ``baseline``: OP_BASELINE, a ``column`` value, or None (no ratios)."""
    metric: str
    index: Tuple[str, ...] = ("shape", "dtype", "mode")
    column: str = "provider"
    baseline: Optional[str] = OP_BASELINE
    split: Tuple[str, ...] = ("op",)
    ops: Optional[Tuple[str, ...]] = None
    geomean_by: Optional[Tuple[str, ...]] = None  # a geometric mean per ratio column and group of these keys
    title: str = ""  # "{op}", "{dtype}", ... from the split keys, and "{metric}"
    note: str = ""


@dataclass(frozen=True)
class Plot:
    """Bars of ``metric``'s medians: a cluster per ``group`` tuple, a bar per ``bar`` tuple; with
    ``ratio_to`` (a ``bar`` tuple) each bar is the speed relative to that bar in its cluster."""
    metric: str
    group: Tuple[str, ...]
    bar: Tuple[str, ...]
    where: Dict[str, object] = field(default_factory=dict)
    ratio_to: Optional[Tuple[str, ...]] = None
    ylabel: str = ""
    title: str = ""
    x: Optional[str] = None  # a row field (a training step, say): lines of ``metric`` against it, one per ``bar``


@dataclass(frozen=True)
class Spec:
    title: str
    prose: str
    command: str = ""
    machine: str = "a GPU machine"  # where ``command`` re-measures the page's figures
    views: Tuple[View, ...] = ()
    hide: Tuple[str, ...] = ()  # metrics left out of the generic tables (derivable from another)
    plot: Optional[Plot] = None
    orders: Dict[str, Sequence[str]] = field(default_factory=dict)  # value order per key (else first seen)
    # A study that draws its own summary and figure (module with ``summary(res)`` and ``plot(res, path)``)
    # names its module here; its rows then get no generic tables.
    own_page: Optional[str] = None
    # Lines after the tables stating the issues' targets met or missed (a function of the results).
    targets: Optional[Callable[[Results], List[str]]] = None


MATMUL_PROSE = """\
`relu(a @ b + bias)` on the same inputs for every provider, in one process. Ops: `fwd` (with bias;
baseline **cuBLASLt**, `torch._addmm_activation`, cuBLASLt's fused bias+ReLU epilogue), `fwd-nobias`
(`relu(a @ b)`; baseline `relu(mm)`, cuBLAS then a separate ReLU) and `fwd+bwd` (forward then backward
with bias, 3 GEMMs' FLOPs; baseline torch `autograd` of `relu(addmm)`). Other providers: `fuselab`
(the Triton kernel), `relu(addmm)`, `inductor` (`torch.compile(mode="max-autotune-no-cudagraphs")`,
bf16, three shapes){cuda}.

Modes: `eager` is `triton.testing.do_bench` (one call at a time after an L2 flush, a 256 MB memset on the
GPU that the call's host time overlaps: only host time beyond the memset's shows); `graph` replays the
same calls from a CUDA graph (device time only). Inputs rotate over sets that together exceed L2.
`tf32` rows are fp32 tensors under `torch.set_float32_matmul_precision("high")` (tf32 for every
provider); at torch's default precision fuselab runs cuBLAS and a ReLU instead. `rel err` is the forward
output's error against float64. Cells are medians (p50) of TFLOP/s; `x cuBLASLt` above 1 means faster than cuBLASLt."""

CUDA_PROSE = """, and the CUDA C++ reference (`matmul_relu(..., backend="cuda")`): `CUDA mma`
(mma.sync fed by ldmatrix; in tf32 its WMMA kernel) and `CUDA wgmma` (Hopper's warp-specialized TMA
kernel, fp16/bf16), each pinned through the op's `kernel` argument; `CUDA SIMT (exact fp32)` (tf32 off)
and `CUDA naive` (the tutorial's one-thread-per-output kernel, fp32)"""

COMPILE_ORDERS = {"op": ["resnet50 train", "resnet50 infer", "opt train", "opt infer"],
                  "provider": ["resnet50", "opt", "opt+fuselab", "opt-norelu"],
                  "dtype": ["fp32", "tf32", "bf16"], "mode": ["eager", "default", "reduce-overhead", "max-autotune"]}
MATMUL_ORDERS = {"op": ["fwd", "fwd-nobias", "fwd+bwd"],
                 "dtype": ["bf16", "bf16, B=weight.t()", "fp16", "fp16, B=weight.t()", "tf32", "tf32, B=weight.t()"],
                 "mode": ["eager", "graph"],
                 "provider": ["cuBLASLt", "relu(mm)", "autograd", "fuselab", "relu(addmm)", "inductor", "CUDA mma",
                              "CUDA wgmma", "CUDA SIMT (exact fp32)", "CUDA naive"]}
MATMUL_VIEWS = (
    View("TFLOP/s", index=("shape", "mode"), split=("op", "dtype"), geomean_by=("mode",),
         title="{op}, {dtype}: TFLOP/s"),
    View("rel err", index=("shape", "dtype"), baseline=None, ops=("fwd",), title="{op}: relative error vs float64"),
    View("% bytes floor", index=("shape", "mode"), baseline=None, split=("op", "dtype"),
         title="{op}, {dtype}: % of the bytes floor",
         note="The time to read a and b once (and the bias) and write the output once at the run's measured "
              "copy bandwidth (`copy_gbs` under Runs), as a percentage of the measured time: 100 is the HBM "
              "floor, what a memory-bound shape (decode, small M) can reach. `B=weight.t()` rows take B as "
              "nn.Linear does (a contiguous (N, K) weight, transposed); the others a contiguous (K, N) B."),
)

QUANT_PROSE = """\
fuselab's 8-bit GEMMs with the dequantization, bias and ReLU fused into the epilogue, against
PyTorch's, on the same inputs in one process; then an OPT decoder's prefill quantized by
`quantize_`. Ops: `int8 gemm` is `relu(dequant(a_q @ w_q^T) + bias)`, bf16 out, with one fp32
scale per token and one per output channel (baseline **`_int_mm`**: `torch._int_mm` with B
column-major, then the epilogue as separate eager ops; `_int_mm row-major B` the same with B
row-major; `fuselab int8` one Triton kernel; `fuselab bf16` the fused bf16 matmul-ReLU on the
unquantized tensors). `fp8 gemm` is the same in float8_e4m3fn with rowwise scales (baseline
**`_scaled_mm`**: `torch._scaled_mm` with scales (M, 1) and (1, N), the bias and bf16 out, then a
ReLU; `_scaled_mm fast accum` with `use_fast_accum=True`; `fuselab fp8`, each K tile's sum added into fp32 as
`_scaled_mm`'s; `fuselab fp8 fast accum` with `fast_accum=True`, the peer of `_scaled_mm fast accum`;
`fuselab bf16`). Rates are
2·M·N·K per second: `TOP/s` for the int8 op (the bf16 peer's operations are FLOPs), `TFLOP/s` for
fp8. `eager` is `triton.testing.do_bench` (L2 flushed; host time beyond the flush's shows), `graph` replays the
calls from a CUDA graph; inputs rotate over sets larger than L2. `rel err` is each output against
float64 of its own inputs' math (the dequantized math for the 8-bit providers); `rel err vs bf16
math` against float64 of the unquantized bf16 inputs, the quantization error included. The GEMMs'
operands are quantized beforehand: quantizing the activations is timed in the prefill only.

`prefill` is one forward under no_grad of transformers' OPT decoder (random init, bf16, 8 x 1024
tokens; `wall` mode: synchronized, per forward): baseline **`fuselab bf16`** (patched by
`fuse_linear_relu`), `stock bf16`, and the patched model quantized by `quantize_` with
`Int8DynamicActivationInt8WeightConfig` (`int8 dynamic`) or `Float8RowwiseConfig` (`fp8`), every
Linear including lm_head (`int8 fused norms`, `fp8 fused norms`: with `fuse_norms=True`, each layer's
two norms quantize their rows once, for q/k/v and for fc1), or with
`Int8StaticActivationInt8WeightConfig` of scales calibrated on 2 batches of 4 x 256 other random tokens
(`int8 static`; `int8 static fused`: with `fuse_norms` and `fuse_outputs`, the norms and fc1's epilogue
write the int8 inputs of q/k/v, fc1 and fc2); its `rel err` is the first sequence's logits against the
stock model's.
The issue's target is a quantized prefill at least 1.3x faster than `fuselab bf16`. Shapes or
GPUs a provider refuses (cuBLAS's 8-bit GEMMs need M > 16 and K, N multiples of 8 or 16; fp8
needs compute capability 8.9) are listed under "Not measured"; an op with no table below has not
been run yet.

`distill loss` is `DistillationLoss(T=2, alpha=0.5)` forward and backward on bf16 (N, C) student logits,
the providers timed in turns: baseline **`torch`** (the PyTorch form, eager), `torch compiled` (the same
under `torch.compile`, a graph per shape) and `fuselab fused` (`fused=True`: two Triton kernels, a
program per row). At C = 10 the eager times are the host's cost per call, not the GPU's."""

QUANT_PROVIDERS = ["_int_mm", "_int_mm row-major B", "_scaled_mm", "_scaled_mm fast accum", "fuselab int8",
                   "fuselab fp8", "fuselab fp8 fast accum", "fuselab bf16", "stock bf16", "int8 dynamic", "fp8",
                   "torch", "torch compiled", "fuselab fused"]

def _matmul_spec(title: str, cuda_prose: str, command_args: str, plot_suffix: str) -> Spec:
    """The page of ``bench_matmul_relu``'s study, with or without the CUDA C++ reference."""
    return Spec(title=title, prose=MATMUL_PROSE.format(cuda=cuda_prose),
                command=f"python -m experiments.bench_matmul_relu{command_args} --results",
                views=MATMUL_VIEWS, hide=("ms",), orders=MATMUL_ORDERS,
                plot=Plot("TFLOP/s", group=("shape",), bar=("provider", "mode"), where={"op": "fwd", "dtype": "bf16"},
                          ylabel="TFLOP/s (bf16, M x N x K)", title=f"relu(a @ b + bias), bf16{plot_suffix}"))


def _p50(res: Results, shape: str, op: str, provider: str, mode: str, metric: str = "ms") -> Optional[float]:
    found = select(res.rows, op=op, provider=provider, mode=mode, metric=metric, shape=shape)
    return found[0]["p50"] if found and found[0].get("p50") else None


def _verdict(value: Optional[float], met: bool) -> str:
    return "" if value is None else f"{value:.2f} " + ("met" if met else "**missed**")


def _targets_table(header: List[str], lines: List[list]) -> List[str]:
    return ["### The issues' targets", "", markdown_table(header, lines), ""] if lines else []


def _gpus(res: Results, rows: Iterable[dict]) -> str:
    """The GPUs (or devices) whose runs measured ``rows``: a target is stated for one GPU."""
    return ", ".join(dict.fromkeys(str(res.runs.get(r["run"], {}).get("gpu") or r.get("device") or "?")
                                   for r in rows))


# Issue 20's GEMM targets: (op, provider, peer, at least), each ratio of one run and mode
GEMM_TARGETS = [("int8 gemm", "fuselab int8", "_int_mm", 1.05), ("int8 gemm", "fuselab int8", "fuselab bf16", 1.4),
                ("fp8 gemm", "fuselab fp8", "_scaled_mm", 1.0),
                ("fp8 gemm", "fuselab fp8 fast accum", "_scaled_mm fast accum", 1.0)]


def quant_targets(res: Results) -> List[str]:
    """Issue 20: the 8-bit GEMMs against their peers (``GEMM_TARGETS``), then the quantized prefills."""
    columns, cells, measured = [], {}, {}
    for op, provider, peer, least in GEMM_TARGETS:
        column = f"{provider} x {peer} (>= {least:g})"
        columns.append(column)
        metric = "TOP/s" if op == "int8 gemm" else "TFLOP/s"
        for (shape, _, mode), (ratio, rows) in _ratio_rows(res, op, provider, peer, metric).items():
            cells[(shape, mode, column)] = _verdict(ratio, ratio >= least)
            measured.setdefault((shape, mode), []).extend(rows)
    lines = [[shape, mode, *(cells.get((shape, mode, c), "") for c in columns), _gpus(res, rows)]
             for (shape, mode), rows in measured.items()]
    gemms = _targets_table(["shape", "mode", *columns, "GPU"], lines)
    prefill = prefill_targets(res)
    return gemms + prefill[2:] if gemms and prefill else gemms or prefill


def prefill_targets(res: Results) -> List[str]:
    """Issue 20: each quantized prefill at least 1.3x faster than fuselab bf16's (wall time)."""
    rows = select(res.rows, op="prefill", metric="ms")
    quantized = [p for p in dict.fromkeys(r["provider"] for r in rows) if p not in ("fuselab bf16", "stock bf16")]
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        base = _p50(res, shape, "prefill", "fuselab bf16", "wall")
        times = [_p50(res, shape, "prefill", q, "wall") for q in quantized]
        speedups = [base / t if base and t else None for t in times]
        if any(x is not None for x in speedups):
            lines.append([shape, *(_verdict(x, x is not None and x >= 1.3) for x in speedups),
                          _gpus(res, [r for r in rows if r["shape"] == shape])])
    return _targets_table(["prefill", *(f"{q} x fuselab bf16 (>= 1.3)" for q in quantized), "GPU"], lines)


def sparse_targets(res: Results) -> List[str]:
    """Issues 16 and 17 against each stream: SparseAdamW's fwd+bwd+step over SparseAdam's eager one (eager <= 0.5,
    replayed from a CUDA graph <= 0.2; at uniform ids, SparseAdam / SparseAdamW eager >= 3) and the step alone under
    a graph within 2x its bytes floor."""
    lines = []
    graphed = select(res.rows, op="fwd+bwd+step", provider="SparseAdamW", mode="graph")
    for shape in dict.fromkeys(r["shape"] for r in graphed):
        base, eager, graph = (_p50(res, shape, "fwd+bwd+step", p, m)
                              for p, m in (("SparseAdam", "eager"), ("SparseAdamW", "eager"), ("SparseAdamW", "graph")))
        floor = _p50(res, shape, "step", "SparseAdamW", "graph", "x floor")
        if base is None or eager is None:
            continue
        graph_ratio = graph and graph / base
        uniform = _verdict(base / eager, base / eager >= 3) if shape.startswith("uniform") else ""
        lines.append([shape, _verdict(eager / base, eager / base <= 0.5),
                      _verdict(graph_ratio, graph_ratio is not None and graph_ratio <= 0.2),
                      _verdict(floor, floor is not None and floor <= 2), uniform,
                      _gpus(res, select(res.rows, op="fwd+bwd+step", shape=shape))])
    return _targets_table(["stream", "eager / SparseAdam eager (<= 0.5)", "graph / SparseAdam eager (<= 0.2)",
                           "step alone, graph, x floor (<= 2)", "SparseAdam / SparseAdamW eager, uniform (>= 3)",
                           "GPU"], lines)


SPECS: Dict[str, Spec] = {
    "matmul_relu": _matmul_spec("Fused matmul-ReLU vs cuBLASLt", "", "", ""),
    "matmul_relu_cuda": _matmul_spec("CUDA C++ reference vs Triton and cuBLASLt", CUDA_PROSE, " --cuda --ops fwd",
                                     ", CUDA C++ reference"),
    "cuda_tiles": Spec(
        title="CUDA C++ mma.sync kernel: build-time tile sweep",
        prose="""\
Each tile variant of the CUDA reference's fp16/bf16 mma.sync kernel (pinned: `kernel="mma"`) is built,
loaded and timed in its own process, with cuBLAS `relu(a @ b)`
timed in the same process as the baseline: bf16, 4096^3 with bias, B row-major and B = `weight.t()`.
Cells are `do_bench` medians (eager mode).""",
        command="python -m experiments.sweep_cuda_tiles --results",
        views=(View("TFLOP/s", index=("op",), split=(), title="TFLOP/s per tile variant"),
               View("rel err", index=("op",), baseline=None, split=(), title="relative error vs float64")),
        hide=("ms",)),
    "host_overhead": Spec(
        title="Host time per call",
        prose="""\
Microseconds per call of the fused op and of torch, bf16, `nn.Linear` layout, at OPT's fc1 with 256
tokens (GPU work of a few microseconds: host time) and 8192 tokens (the GPU's share shows). Providers:
`relu(addmm)` (torch, the baseline), `torch, Python backward` (the same through a Python
`autograd.Function`: what a Python backward costs by itself), `fuselab` (the default: the C++ eager
path, one C++ function with a C++ autograd node launching the cubin Triton compiled), `fuselab, Python
path` (the C++ path off: a Python autograd.Function and launch plans, which relaunch the compiled
kernel without Triton's argument binding) and `fuselab, no launch plans` (the Python path without them).
Modes: `host` is the host's time to enqueue one call; `eager` is `do_bench`'s time per call after an
L2 flush, whose GPU time hides as much host time. `python loop` times one pure-Python loop on the
main thread and inside a backward (autograd's device thread), where a Python backward runs.""",
        command="python -m experiments.host_overhead --results",
        views=(View("us", index=("shape", "mode"), split=("op",), title="{op}: microseconds per call"),),
        orders={"op": ["fwd", "fwd+bwd", "python loop"], "mode": ["host", "eager", "loop", "wall"]},
        plot=Plot("us", group=("op", "shape", "mode"), bar=("provider",), where={"op": ("fwd", "fwd+bwd")},
                  ylabel="microseconds per call", title="host time per call, bf16")),
    "compile_speedup": Spec(
        title="torch.compile study: ResNet-50 and an OPT-style decoder",
        prose="""\
What `torch.compile` buys, per model, task (training = forward + backward + SGD step; inference),
precision (`fp32`: PyTorch's default, full-fp32 matmuls; `tf32`: `set_float32_matmul_precision("high")`;
`bf16`: autocast) and mode (`eager`, and compile modes `default`, `reduce-overhead` (CUDA graphs),
`max-autotune`). Models: torchvision ResNet-50 (batch 64, channels_last) and an OPT-style transformers
decoder (12 layers, d=1024, ReLU MLP; 8 x 1024 tokens, random init) stock (`opt`, the baseline),
patched by `fuse_linear_relu` (`opt+fuselab`) and with its ReLU deleted (`opt-norelu`: wrong math,
the most any fusion of the ReLU could save). `ms/step` is the median of 20 synchronized steps after
5 warm-up steps (converted runs: the mean); `first call s` includes compilation; graph breaks as
`torch._dynamo.explain` counts them. The first table's `x eager` columns are the speedup of each
compile mode over eager; the second's `x opt` the variant's speed relative to the stock decoder in
the same mode. The study is run in pieces (`--plan ... --merge`), so its rows come from several runs:
the `run` column names each line's runs, listed at the end.""",
        command="python -m experiments.compile_speedup --plan '<models:tasks:precisions:modes>' --results",
        views=(
            View("ms/step", index=("op", "dtype", "provider"), column="mode", baseline="eager", split=(),
                 title="ms/step by compile mode"),
            View("ms/step", index=("op", "dtype", "mode"), baseline=OP_BASELINE, split=(),
                 ops=("opt train", "opt infer"), title="OPT-style decoder variants vs the stock decoder, same mode"),
            View("first call s", index=("op", "dtype", "provider"), column="mode", baseline=None, split=(),
                 title="first call, seconds (compilation included)"),
            View("peak MiB", index=("op", "dtype", "provider"), column="mode", baseline=None, split=(),
                 title="peak GPU memory, MiB"),
            View("graph breaks", index=("op", "dtype", "provider"), column="mode", baseline=None, split=(),
                 title="graph breaks"),
        ),
        orders=COMPILE_ORDERS,
        plot=Plot("ms/step", group=("op", "dtype", "provider"), bar=("mode",), ratio_to=("eager",),
                  ylabel="speedup vs eager (same model, task, precision)", title="torch.compile")),
    "train_fsdp": Spec(
        title="GPT-2 1.31B training (FSDP2 / one GPU)",
        prose="""\
transformers' GPT2LMHeadModel (d 2048, 24 layers, 16 heads, 1,024 tokens a sequence) trained on GPT-2
BPE ids of the Python docs (Debian python3.11-doc's reST sources) by `experiments/train_fsdp.py`: AdamW
(fused), warm-up then cosine, bf16 (autocast on one rank, FSDP2 bf16 parameters with fp32 reduction
on several), `--compile` per block (`compile-model`: the whole forward and loss as one graph);
`vocab50304`: the token embedding padded from 50,257 rows to a multiple of 64 (aligned LM-head
GEMMs, as nanoGPT and llm.c; the padding is left out of N). Throughput over timed windows after the
first steps; MFU per GPU = tokens/s x (6 N + 12 L d T) / 989.4 TFLOP/s (the H200's dense BF16
peak); see the script's docstring. The curve is the training loss of every logged window; `val loss` is on the held-out
tail of the corpus (`--corpus`: the ids as a tensor, written by `--export-tokens` where the docs
and tiktoken are). The issue's target is >= 45% MFU at batch 8 x 1024 on one H200.""",
        command="python -m experiments.train_fsdp --corpus data/python-docs-gpt2.pt --steps 300 --compile --results",
        views=tuple(View(m, index=("op", "shape", "dtype"), baseline=None, split=(), title=m)
                    for m in ("tokens/s per GPU", "MFU %", "TFLOP/s per GPU", "step ms", "peak MiB", "val loss")),
        hide=("loss", "tokens/s", "peak reserved MiB"),
        plot=Plot("loss", group=("op",), bar=("provider",), x="step", ylabel="training loss",
                  title="GPT-2 1.31B: training loss"),
    ),
    "train_ddp": Spec(
        title="ResNet-18 on Fashion-MNIST (DDP)",
        prose="""\
torchvision's ResNet-18 adapted to 28x28 grayscale (3x3 stride-1 stem, no max-pool) trained by
`experiments/train_ddp.py`: DDP with a `DistributedSampler`, learning rate x world size, SGD with
Nesterov momentum, warm-up then cosine, bf16 autocast and channels-last on CUDA, random flips.
images/s over timed windows (evaluations and the first steps left out); test accuracy after every
epoch (the curve). Shape: ranks x images per rank per step.""",
        command="python -m experiments.train_ddp --epochs 5 --results",
        views=tuple(View(m, index=("op", "shape", "dtype"), baseline=None, split=(), title=m)
                    for m in ("images/s per GPU", "final test accuracy", "peak MiB")),
        hide=("test accuracy", "train loss", "epoch s", "images/s"),
        plot=Plot("test accuracy", group=("op",), bar=("provider", "shape"), x="epoch", ylabel="test accuracy",
                  title="ResNet-18 on Fashion-MNIST: test accuracy per epoch"),
    ),
    "train_mlp": Spec(
        title="Fashion-MNIST MLP, stock vs fuse_linear_relu",
        prose="""\
A 784-512-512-10 MLP trained with AdamW from the same initial weights, stock (`nn.Linear` + `nn.ReLU`,
the baseline) and patched by `fuse_linear_relu`: test accuracy after the same epochs, and the time of
one synchronized training step (wall clock, after training). On a CPU fuselab computes with PyTorch,
so the CPU rows show that patching keeps accuracy, not speed; the MLP trains in fp32 at torch's
default precision, where fuselab runs cuBLAS and a ReLU on a GPU.""",
        command="python -m experiments.train_mlp --results",
        views=(View("test accuracy", index=("op", "shape", "epochs"), baseline=None, split=(), title="test accuracy"),
               View("ms/step", index=("op", "shape", "epochs"), split=(), title="ms per training step")),
    ),
    "quickstart": Spec(
        title="Quickstart check (`make demo`, stage 1)",
        prose="""\
The fused op's forward and three gradients against float64, beside PyTorch's: the largest relative
error of the four. On a CPU the Triton kernels run in the interpreter (mode `interpreter`).""",
        command="python -m experiments.quickstart --skip-mlp --results",
        machine="a GPU machine, or a CPU for the interpreter rows",
        views=(View("max rel err", index=("shape", "dtype", "mode"), baseline=None, split=("op",),
                    title="{op}: largest relative error vs float64"),
               View("TFLOP/s", index=("shape", "dtype", "mode"), split=("op",), title="{op}: TFLOP/s")),
        hide=("ms",)),
    "quant_gemm": Spec(
        title="INT8 and FP8 GEMMs with fused epilogues, and a quantized OPT prefill",
        prose=QUANT_PROSE,
        command="python -m experiments.bench_quant --results",
        views=(
            View("TOP/s", index=("shape", "mode"), ops=("int8 gemm",), geomean_by=("mode",),
                 title="{op}: TOP/s (the bf16 peer's are TFLOP/s)"),
            View("TFLOP/s", index=("shape", "mode"), ops=("fp8 gemm",), geomean_by=("mode",), title="{op}: TFLOP/s"),
            View("ms", index=("shape",), ops=("prefill",), title="{op}: ms per forward"),
            View("ms", index=("shape", "mode"), ops=("distill loss",), title="{op}: ms per forward and backward"),
            View("ms", index=("shape", "mode"), ops=("distill loss",), baseline="torch compiled",
                 title="{op}: against torch.compile of the PyTorch form (the strongest peer)"),
            View("rel err", index=("shape",), baseline=None, title="{op}: relative error (see above for against what)"),
            View("grad rel err", index=("shape",), baseline=None, title="{op}: student gradient's relative error"),
            View("rel err vs bf16 math", index=("shape",), baseline=None,
                 title="{op}: relative error vs float64 of the unquantized bf16 inputs"),
        ),
        hide=("ms",),
        orders={"op": ["int8 gemm", "fp8 gemm", "prefill", "distill loss"], "mode": ["eager", "graph", "wall"],
                "provider": QUANT_PROVIDERS},
        plot=Plot("TOP/s", group=("shape",), bar=("provider", "mode"), where={"op": "int8 gemm"},
                  ylabel="TOP/s (int8; bf16: TFLOP/s)", title="relu(dequant(a_q @ w_q^T) + bias), int8"),
        targets=quant_targets),
    "sparse_embedding": Spec(
        title="SparseAdamW vs torch.optim.SparseAdam and AdamW",
        prose="""\
Sparse embeddings trained with fuselab's `SparseAdamW` against `torch.optim.SparseAdam` (the
baseline), dense fused AdamW and sparse Adagrad on the same ids: MovieLens-100k matrix factorisation
(accuracy, time per step, memory) and, on a GPU (`--throughput`), forward + sparse backward + step
and the step alone over id streams of 65,536 lookups a step: uniform, Zipf s = 1.05 / 1.1 / 1.5, all
ids identical (1,000,000 x 128 fp32 tables), GPT-2 BPE ids of the Python docs through a 50,257 x 768
table, and MovieLens-100k's user and item ids; eager and replayed from a CUDA graph (SparseAdam and
Adagrad cannot be captured: their `coalesce()` waits for the host); SparseAdamW's step against the
bytes it must move (`x floor`). Every optimizer of a stream is built first and all are timed in turns
(`harness.time_alternating`: these hosts drift within seconds; each quantile the median round's, every
round's p50 in the results' `rounds`); `peak MiB` is each optimizer's own table, state and step.
`SparseAdamW (graphs)` is `SparseAdamW(graphs=True)`: its update replays graphs it captured itself, so
its eager step copies the lookups and gradient rows into the graph's buffers first (on the gpt2 stream,
768 columns, its step alone is slower than plain SparseAdamW's). See `experiments/sparse_embedding.py`
for the exact setup.""",
        command="python -m experiments.sparse_embedding --throughput --tokens runs/gpt2_tokens.pt --results",
        targets=sparse_targets),
    "model_eager": Spec(
        title="Patched OPT decoders in eager mode: stock vs fuselab",
        prose="""\
transformers' OPT decoders (random init, bf16, the three sizes' shapes) as users run them, one step at
a time: `infer` is a forward under no_grad, `train` a forward, loss and backward. Providers: `stock`
(the baseline), `fuselab` (patched by `fuse_linear_relu`: the fused layers' eager calls take the C++
path, `fuselab.kernels.eager_path`) and, with `--variants stock,fuselab,fuselab-python`, the same
model with the C++ path off (a Python autograd.Function and launch plans). `ms` is the synchronized
wall time per step, `host ms` the time to enqueue one step without synchronizing; the variants of a
configuration are built together and timed in turns (`harness.time_alternating`, each quantile the
median round's, every round's p50 in the results' `rounds`). `first call s` is the first step
(autotuning included; in a process's first patched configuration also the C++ path's one-time build).
Eager mode is host-bound at 1 x 128 tokens, and these hosts drift by 10-40% in phases of a second or
so: timed one variant after the other, or in rounds of 10 steps (commits b628f61 to 4cee885), a
variant's rounds could fall in one phase and its peer's in another; one such run put opt-1.3b 1x128
infer at 0.60x where turns of 1-2 steps within the same hour gave 1.04x-1.14x. The rows of commit
4cee885 took 20 rounds of 2 steps: each round's value is the slower of its two steps (a quantile of two
samples), `ms` the mean of the middle two rounds' (and `host ms` rounds of 10 enqueued steps); later
runs take 15 rounds of 3 steps, and `host ms` rounds as long. Differences of a few percent at 1 x 128
are within the spread of one variant's own rounds. A training step's GPU time also depends on the
backward GEMMs' kernels.""",
        command="python -m experiments.model_eager --results",
        views=(View("ms", index=("shape", "mode"), split=("op",), title="{op}: ms per step"),
               View("host ms", index=("shape", "mode"), split=("op",), title="{op}: host ms to enqueue a step")),
        orders={"op": ["infer", "train"], "provider": ["stock", "fuselab", "fuselab-python", "norelu"]}),
    "tune_heldout": Spec(
        title="Shipped autotune choices on shapes the sweep did not time",
        prose="""\
`python -m fuselab.tune --check-heldout` on the GPU the configs file was swept on: for each launch (the
forward and both backward products) of shapes outside the sweep's grid (`fuselab.tune.grid.HELDOUT_SHAPES`),
every pruned config and library choice is timed; the shipped choice for the launch's tuning key and the
fastest are then timed again, alternately, three times, and `shipped x exhaustive best` is the ratio of
their medians (1.00: the shipped choice is the best one; below 0.95 misses the issue's 5% target).
`ms` is do_bench's median, eager.""",
        command="python -m fuselab.tune --check-heldout --out results/tune_heldout.json"),
    "tune_first_call": Spec(
        title="A fresh process's first fused call with the shipped configs",
        prose="""\
`python -m fuselab.tune --first-call`: for each benchmark shape, a fresh Python process times its first
call of the op (inputs on the GPU and CUDA initialized before the clock) with an empty Triton cache
(`cold`: the kernel and its launcher compile) and again with the cache the first process filled
(`warm`); `tunings` in the results lists the keys the tuner had to time (none where the shipped file
covers the shape). Both processes share one fuselab cache, so the warm one also finds the Triton
compiler key the cold one kept (`fuselab/kernels/_triton_key.py`; Triton would otherwise hash its
500 MB library again, about half a second). The issue's target, 0.5 s, is met where Triton's cache holds the
kernel; a cold cache compiles it (LLVM and ptxas): one to two seconds. Runs before the C++ eager path was
built once ahead of the cases include its build in the cold case. Rows of dtype int8 and fp8 are the
quantized GEMM's (`--kernel scaled_gemm`), the others the bf16 fused matmul-ReLU's.""",
        command="python -m fuselab.tune --first-call --out results/tune_first_call.json"),
    "distill_quantize": Spec(
        title="Distillation and quantization on Fashion-MNIST",
        prose="""\
A ResNet-50-class teacher trained here on Fashion-MNIST; ResNet-18-class and small-CNN students
distilled from it (`DistillationLoss`) and trained from scratch for the same budget, on the same seeds'
initial weights and batches; then the distilled students quantized: on the GPU by `quantize_` (INT8
dynamic and static, FP8 rowwise: every Linear; `int8 dynamic+conv` also the convolutions, the others keep them
bf16), on the CPU by torchao's pt2e
route (`quantize_pt2e_x86`, static INT8 convolutions and Linears). Accuracy is on the 10,000 test
images; sizes are state_dict bytes; latencies are per batch (CPU: this machine's cores, wall; GPU:
eager and replayed from a CUDA graph). See `experiments/distill_quantize.py` for the recipe.""",
        command="python -m experiments.distill_quantize --device cuda --teacher-epochs 10 --epochs 6 --seeds 0,1,2 "
                "--save-students runs/students --results` (on a GPU machine; where Fashion-MNIST is not installed, "
                "copy its idx files and add `--data <folder>`), then `python -m experiments.distill_quantize "
                "--load-students runs/students --results",
        machine="a CPU",
        own_page="experiments.distill_quantize"),
}


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


COUNT_METRICS = ("graph breaks",)  # printed as integers


def num(v, metric: str = "") -> str:
    """A cell: about three significant digits, thousands separated, tiny values in e-notation."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if math.isnan(v):
        return "nan"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 100 or metric in COUNT_METRICS:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a >= 0.01:
        return f"{v:.3f}"
    return f"{v:.2e}"


def higher_is_better(metric: str) -> bool:
    return metric.endswith("/s") or "accuracy" in metric


def ratio_metric(metric: str) -> bool:
    """Whether ``x baseline`` ratios mean anything for the metric: times and rates."""
    return metric in ("ms", "us", "s", "ms/step", "us/step") or metric.endswith("/s")


def ordered(values, order: Sequence[str] = ()):
    """Distinct values: those in ``order`` first, in its order, then the rest as first seen."""
    seen = list(dict.fromkeys(values))
    rank = {v: i for i, v in enumerate(order)}
    return sorted(seen, key=lambda v: (0, rank[v]) if v in rank else (1, seen.index(v)))


def sort_keys(keys: List[tuple], names: Sequence[str], orders: Dict[str, Sequence[str]]) -> List[tuple]:
    ranks = []
    for i, name in enumerate(names):
        values = ordered([k[i] for k in keys], orders.get(name, ()))
        ranks.append({v: j for j, v in enumerate(values)})
    return sorted(dict.fromkeys(keys), key=lambda k: [ranks[i][v] for i, v in enumerate(k)])


@dataclass
class Table:
    header: List[str]
    lines: List[list]
    ratios: Dict[str, Dict[tuple, float]]  # ratio column -> {index key: ratio}
    keys: List[tuple]


def build_table(rows: List[dict], index: Sequence[str], column: str, baseline: Optional[str],
                orders: Dict[str, Sequence[str]], with_runs: bool, stat: str = "p50") -> Table:
    """The pivot of ``rows``: a line per ``index`` tuple, a column per ``column`` value (the baseline's
    first), ``x <baseline>`` columns after them, and a ``run`` column when the lines come from several runs."""
    metric = rows[0]["metric"]
    keys = sort_keys([tuple(r[k] for k in index) for r in rows], index, orders)
    cols = ordered([r[column] for r in rows], orders.get(column, ()))
    if baseline in cols:
        cols.remove(baseline)
        cols.insert(0, baseline)
    by_cell: Dict[tuple, dict] = {}
    for r in rows:  # one row a cell: a second (another shape the index leaves out, a duplicate) is ambiguous
        place = (tuple(r[k] for k in index), r[column])
        if place in by_cell:
            raise ValueError(f"two {metric} rows for {dict(zip(index, place[0]))}, {column} {place[1]!r} (runs "
                             f"{by_cell[place]['run']} and {r['run']}): the table would show one of them")
        by_cell[place] = r
    cell = {place: r[stat] for place, r in by_cell.items()}
    runs = {}
    for r in rows:
        runs.setdefault(tuple(r[k] for k in index), []).append(r["run"])
    hib = higher_is_better(metric)
    ratio_cols = [c for c in cols if baseline in cols and c != baseline]
    ratios: Dict[str, Dict[tuple, float]] = {f"{c} x {baseline}": {} for c in ratio_cols}
    lines = []
    for key in keys:
        line = list(key) + [num(cell.get((key, c)), metric) for c in cols]
        base = cell.get((key, baseline))
        for c in ratio_cols:
            v = cell.get((key, c))
            # a ratio only within one run: across runs it divides other commits', GPUs' or drift phases' figures
            other_run = v is not None and base and by_cell[(key, c)]["run"] != by_cell[(key, baseline)]["run"]
            if v is None or not base or (not v and not hib) or other_run:
                line.append("")
                continue
            ratio = v / base if hib else base / v
            ratios[f"{c} x {baseline}"][key] = ratio
            line.append(f"{ratio:.3f}")  # 0.9451 is not "0.95" against a 0.95 target
        if with_runs:
            line.append(", ".join(f"`{r}`" for r in dict.fromkeys(runs[key])))
        lines.append(line)
    header = list(index) + [str(c) for c in cols] + list(ratios) + (["run"] if with_runs else [])
    return Table(header, lines, ratios, keys)


def select(rows: List[dict], **where) -> List[dict]:
    def match(r):
        return all(r.get(k) in v if isinstance(v, (tuple, list, set)) else r.get(k) == v for k, v in where.items())

    return [r for r in rows if match(r)]


def render_view(res: Results, spec: Spec, view: View) -> Tuple[List[str], set]:
    """Markdown blocks of one view, and the (op, metric) pairs it covered."""
    rows = select(res.rows, metric=view.metric)
    if view.ops is not None:
        rows = select(rows, op=view.ops)
    if not rows:
        return [], set()
    out, covered = [], set()
    splits = sort_keys([tuple(r[k] for k in view.split) for r in rows], view.split, spec.orders)
    for part in splits:
        sub = [r for r in rows if tuple(r[k] for k in view.split) == part]
        ops = list(dict.fromkeys(r["op"] for r in sub))
        baseline = view.baseline
        if baseline == OP_BASELINE:
            named = {res.baselines.get(op) for op in ops}
            baseline = named.pop() if len(named) == 1 else None
        if not ratio_metric(view.metric) and view.baseline == OP_BASELINE:
            baseline = None
        if view.baseline not in (OP_BASELINE, None) and not any(r[view.column] == baseline for r in sub):
            continue  # a view against a named peer that was not measured: nothing to show
        covered |= {(op, view.metric) for op in ops}
        # which run made each row: where the table mixes runs, or the file mixes GPUs
        with_runs = (len({r["run"] for r in sub}) > 1
                     or len({str(res.runs.get(r["run"], {}).get("gpu")) for r in res.rows}) > 1)
        index = view.index
        cells = {}
        for r in sub:
            cells.setdefault((*(r[k] for k in view.index), r[view.column]), set()).add(res.device_of(r))
        if any(len(devices) > 1 for devices in cells.values()):  # a CPU run merged beside a GPU run's labels
            sub, index = [{**r, "device": res.device_of(r)} for r in sub], ("device", *view.index)
        table = build_table(sub, index, view.column, baseline, spec.orders, with_runs)
        names = dict(zip(view.split, part), metric=view.metric)
        title = (view.title or ", ".join(str(v) for v in part) + (": " if part else "") + "{metric}").format(**names)
        out += [f"### {title}", ""]
        if view.note:
            out += [view.note, ""]
        out += [markdown_table(table.header, table.lines), ""]
        out += geomean_lines(table, view, index)
    return out, covered


def geomean_lines(table: Table, view: View, index: Sequence[str]) -> List[str]:
    """Geometric means of the ratio columns per ``view.geomean_by`` group (and per device, where ``index`` has one)."""
    if not view.geomean_by or not table.ratios or len(table.keys) < 2:
        return []
    by = (("device",) if "device" in index and "device" not in view.geomean_by else ()) + tuple(view.geomean_by)
    pos = [list(index).index(k) for k in by]
    out = []
    for col, by_key in table.ratios.items():
        groups: Dict[tuple, List[float]] = {}
        for key, ratio in by_key.items():
            groups.setdefault(tuple(key[i] for i in pos), []).append(ratio)
        for group, ratios in groups.items():
            if len(ratios) < 2:
                continue
            label = ", ".join(map(str, group))
            out.append(f"- {col}, {label}: geometric mean **{geomean(ratios):.2f}** over {len(ratios)} lines")
    return out + [""] if out else []


def default_views(res: Results, skip: set, hide: Sequence[str]) -> List[View]:
    """A view per (op, metric) not yet shown: index the keys that vary, providers as columns."""
    views = []
    pairs = list(dict.fromkeys((r["op"], r["metric"]) for r in res.rows))
    for op, metric in pairs:
        if (op, metric) in skip or metric in hide:
            continue
        rows = select(res.rows, op=op, metric=metric)
        index = tuple(k for k in ("shape", "dtype", "mode") if len({r[k] for r in rows}) > 1) or ("shape",)
        views.append(View(metric, index=index, ops=(op,), title=f"{op}: {metric}"))
    return views


def environment_lines(res: Results) -> List[str]:
    used = list(dict.fromkeys([r["run"] for r in res.rows] + [f["run"] for f in res.failed]))
    out = []
    for run in used:
        e = res.runs.get(run, {})
        dirty = {True: "dirty", False: "clean", None: "dirty: unknown"}.get(e.get("dirty"), f"dirty: {e.get('dirty')}")
        parts = [e.get("gpu", "?")]
        if e.get("driver"):
            parts.append(f"driver {e['driver']}")
        parts += [f"torch {e.get('torch')}", f"triton {e.get('triton')}", f"CUDA {e.get('cuda')}",
                  f"Python {e.get('python')}"]
        date = e.get("date") or "date not recorded"
        line = f"- `{run}`: {', '.join(parts)}; commit `{e.get('commit')}` ({dirty}); {date}"
        if e.get("converted_from"):
            line += f"; converted from `{e['converted_from']}`"
        extra = {k: v for k, v in e.items() if k not in STANDARD_ENV and v not in (None, "", False)}
        for k, v in extra.items():
            text = "; ".join(" ".join(part.split()) for part in str(v).strip().splitlines())
            line += f"; {k}: {text}"
        out.append(line)
    return out


def has_plot(res: Results, spec: Spec) -> bool:
    return spec.plot is not None and bool(select(res.rows, metric=spec.plot.metric, **spec.plot.where))


def render_study(res: Results, spec: Optional[Spec] = None) -> str:
    """The markdown page of one study (its plot, when it has one, is ``<study>.png`` beside it)."""
    spec = spec or SPECS.get(res.study) or Spec(title=res.study, prose="")
    out = [f"# {spec.title}", "",
           f"_Generated by `python -m experiments.report` from `results/{res.study}.json` (study `{res.study}`); "
           "do not edit by hand._", ""]
    if spec.prose:
        out += [spec.prose, ""]
    if spec.command:
        out += [f"Re-measure: `{spec.command}` (on {spec.machine}), then `python -m experiments.report`.", ""]
    if spec.own_page is not None:
        study = importlib.import_module(spec.own_page)
        out += [f"![{spec.title}]({res.study}.png)", "", study.summary(res), ""]
        out += ["### Runs", "", "Each row of the results names the run that measured it:", ""]
        return "\n".join(out + environment_lines(res)).rstrip() + "\n"
    if has_plot(res, spec):
        out += [f"![{spec.title}]({res.study}.png)", ""]
    covered: set = set()
    for view in spec.views:
        blocks, seen = render_view(res, spec, view)
        out += blocks
        covered |= seen
    for view in default_views(res, covered, spec.hide):
        out += render_view(res, spec, view)[0]
    out += library_choice_lines(res)
    if spec.targets is not None:
        out += spec.targets(res)
    if res.failed:
        out += ["### Not measured", "", "Configurations that failed (the error's first line):", "",
                markdown_table(["op", "provider", "shape", "dtype", "mode", "error", "run"],
                               [[f.get(k, "") for k in ("op", "provider", "shape", "dtype", "mode")]
                                + [f"`{f.get('error', '')}`", f"`{f.get('run')}`"] for f in res.failed]), ""]
    out += ["### Runs", "", "Each row of the results names the run that measured it:", ""]
    out += environment_lines(res)
    return "\n".join(out).rstrip() + "\n"


def library_choice_lines(res: Results) -> List[str]:
    """Where a tuned provider ran a library call instead of its kernel (a row's ``config`` is the name
    of a ``LibraryChoice``; a Triton config's reads ``BLOCK_M: .., num_warps: ..``): its ratios there are
    that library's, and the page says so."""
    rows = [r for r in res.rows if r.get("config") and "num_warps" not in r["config"]]
    if not rows:
        return []
    lines = sorted({(r["op"], r["provider"], r["shape"], r["dtype"], r["config"], f"`{r.get('run')}`") for r in rows})
    return ["### Where the tuner chose a library call", "",
            "At these shapes every Triton config was slower than the library call (`cublas`: `torch.addmm`, then "
            "an in-place ReLU), so the op ran that call and its row measures it:", "",
            markdown_table(["op", "provider", "shape", "dtype", "choice", "run"], [list(x) for x in lines]), ""]


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def _plot_curves(rows: List[dict], p: Plot, path: Path, plt) -> Path:
    """Lines of ``p.metric`` against the row field ``p.x``, one per ``p.group`` + ``p.bar`` tuple and, where
    they vary, shape, dtype and mode too: rows of two runs that differ there are never one line."""
    keys = p.group + p.bar + tuple(k for k in ("op", "provider", "shape", "dtype", "mode")
                                   if k not in p.group + p.bar and len({r[k] for r in rows}) > 1)
    lines: Dict[tuple, List[Tuple[float, float]]] = {}
    for r in rows:
        if r.get(p.x) is not None:
            lines.setdefault(tuple(r[k] for k in keys), []).append((r[p.x], r["p50"]))
    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    for label, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker=".", label=" / ".join(str(v) for v in label))
    ax.set_xlabel(p.x)
    ax.set_ylabel(p.ylabel or p.metric)
    ax.set_title(p.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def tick_label(group: tuple) -> str:
    """A cluster's label, a line per key; a value that begins another ("resnet50", "resnet50 train") is
    left out, and spaces break lines."""
    parts = [str(v) for v in group]
    kept = [p for i, p in enumerate(parts) if not any(q.startswith(p + " ") for j, q in enumerate(parts) if j != i)]
    return "\n".join(p.replace(" ", "\n") if len(p) > 16 else p for p in kept)


def main_device(res: Results) -> Results:
    """What a plot or a headline figure shows of a file holding several devices' runs: the GPU's rows
    (the tables show every device's)."""
    devices = res.devices()
    return res if len(devices) < 2 else res.on_device("cuda" if "cuda" in devices else devices[0])


def plot_study(res: Results, spec: Spec, path: Path) -> Optional[Path]:
    """The study's bar chart (``spec.plot``) as a PNG; None when there is nothing to plot."""
    if spec.own_page is not None:
        return importlib.import_module(spec.own_page).plot(res, path)
    if not has_plot(res, spec):
        return None
    p = spec.plot
    res = main_device(res)
    rows = select(res.rows, metric=p.metric, **p.where)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if p.x is not None:
        return _plot_curves(rows, p, path, plt)
    value = {(tuple(r[k] for k in p.group), tuple(r[k] for k in p.bar)): r for r in rows}
    groups = sort_keys([g for g, _ in value], p.group, spec.orders)
    bars = sort_keys([b for _, b in value], p.bar, spec.orders)
    hib = higher_is_better(p.metric)
    if p.ratio_to is not None:
        bars = [b for b in bars if b != p.ratio_to]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(groups) + 2), 4.8))
    width = 0.8 / max(1, len(bars))
    for i, bar in enumerate(bars):
        xs, ys, lo, hi = [], [], [], []
        for g, group in enumerate(groups):
            r = value.get((group, bar))
            if r is None:
                continue
            if p.ratio_to is not None:
                base = value.get((group, p.ratio_to))
                if base is None or not r["p50"]:
                    continue
                y = r["p50"] / base["p50"] if hib else base["p50"] / r["p50"]
                lo.append(0.0)
                hi.append(0.0)
            else:
                y = r["p50"]
                lo.append(max(0.0, y - min(r["p20"], r["p80"])))
                hi.append(max(0.0, max(r["p20"], r["p80"]) - y))
            xs.append(g + i * width)
            ys.append(y)
        if xs:
            ax.bar(xs, ys, width, label=" ".join(map(str, bar)), color=f"C{i % 10}",
                   yerr=None if p.ratio_to is not None else [lo, hi], capsize=2)
    if p.ratio_to is not None:
        ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([tick_label(group) for group in groups], fontsize=7)
    ax.set_ylabel(p.ylabel or p.metric)
    gpus = sorted({str(res.runs.get(r["run"], {}).get("gpu")) for r in rows})
    ax.set_title(f"{p.title or spec.title} on {', '.join(gpus)} (no bar: not measured)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Headline figures (README)
# ----------------------------------------------------------------------------------------------


def _date(res: Results, rows: List[dict]) -> str:
    return max((res.runs.get(r["run"], {}).get("date") or "" for r in rows), default="")


def _commits(res: Results, rows: List[dict]) -> str:
    return ", ".join(dict.fromkeys(str(res.runs.get(r["run"], {}).get("commit"))[:7] for r in rows))


def _ratio_rows(res: Results, op: str, provider: str, baseline: str, metric: str, **where) -> Dict[tuple, tuple]:
    """{(shape, dtype, mode): (ratio, rows)} where both ``provider`` and ``baseline`` were measured by one run (a
    ratio across runs would divide figures of other commits, machines or drift phases)."""
    rows = select(res.rows, op=op, metric=metric, **where)
    cells = {(r["shape"], r["dtype"], r["mode"], r["provider"]): r for r in rows}
    hib = higher_is_better(metric)
    out = {}
    for (shape, dtype, mode, prov), r in cells.items():
        base = cells.get((shape, dtype, mode, baseline))
        if prov != provider or base is None or not r["p50"] or not base["p50"]:
            continue
        if r["run"] != base["run"]:
            continue
        ratio = r["p50"] / base["p50"] if hib else base["p50"] / r["p50"]
        out[(shape, dtype, mode)] = (ratio, [r, base])
    return out


def _latest(candidates: List[Tuple[Results, List[dict], str]]):
    """The candidate (results, rows, text) measured last."""
    candidates = [c for c in candidates if c[1]]
    return max(candidates, key=lambda c: _date(c[0], c[1])) if candidates else None


def _where(res: Results, rows: List[dict]) -> str:
    gpus = ", ".join(dict.fromkeys(str(res.runs.get(r["run"], {}).get("gpu")) for r in rows))
    return f"[{res.study}](docs/results/{res.study}.md): {gpus}, commit {_commits(res, rows)}"


def r_dtype(found: Dict[tuple, tuple], shape: str, mode: str) -> str:
    return next(k[1] for k in found if k[0] == shape and k[2] == mode)


GRAPHED = "SparseAdamW (graphs)"  # experiments/sparse_embedding.py's provider name for graphs=True


def sparse_headline(res: Results) -> Optional[List[str]]:
    """SparseAdamW against SparseAdam, the whole training step on uniform ids (else the file's first stream), per mode,
    and SparseAdamW(graphs=True)'s eager step where measured; SparseAdam cannot be replayed from a CUDA graph (its
    coalesce() waits for the host), so a mode it lacks is compared with its eager time, and says so."""
    ops = [op for op, base in res.baselines.items() if base == "SparseAdam"]
    for op in sorted(ops, key=lambda o: (o != "fwd+bwd+step", o != "step")):
        for metric in ("ms", "ms/step"):
            rows = select(res.rows, op=op, metric=metric, provider=("SparseAdamW", "SparseAdam", GRAPHED))
            if not {"SparseAdamW", "SparseAdam"} <= {r["provider"] for r in rows}:
                continue
            shapes = [r["shape"] for r in rows]  # uniform ids (the stream), else the first measured
            shape = next((s for s in shapes if s.startswith("uniform")), shapes[0])
            cells = {(r["provider"], r["mode"]): r for r in rows if r["shape"] == shape}
            parts, used = [], []
            for mode in ordered([m for p, m in cells if p == "SparseAdamW"], ("eager", "graph", "wall")):
                mine = cells[("SparseAdamW", mode)]
                base = cells.get(("SparseAdam", mode)) or cells.get(("SparseAdam", "eager"))
                if base is None or not mine["p50"]:
                    continue
                vs = "" if base["mode"] == mode else f" (vs SparseAdam {base['mode']}: not measured in {mode} mode)"
                parts.append(f"{base['p50'] / mine['p50']:.2f}x {mode}{vs}")
                used += [mine, base]
                graphed = cells.get((GRAPHED, mode)) if mode == "eager" else None
                if graphed is not None and graphed["p50"]:  # the optimizer's own graphs, in an eager step
                    parts.append(f"{base['p50'] / graphed['p50']:.2f}x eager with graphs=True")
                    used.append(graphed)
            if parts:
                return [f"SparseAdamW vs torch.optim.SparseAdam, {op}, {shape}", "; ".join(parts), _where(res, used)]
    return None


def _size_of_shape(key: tuple) -> tuple:
    """Sort key of a row key whose first field is a shape: ``AxBx...`` by its product, other names after."""
    try:
        return (0, math.prod(int(x) for x in key[0].split("x")), key[0])
    except ValueError:
        return (1, 0, key[0])


def headline_rows(studies: Dict[str, Results]) -> List[List[str]]:
    """[figure, value, where] lines of the README's headline table, from whatever results exist."""
    studies = {name: main_device(res) for name, res in studies.items()}
    out = []

    def gemm(op, provider, baseline, label, dtype="bf16"):
        cands = []
        for name in ("matmul_relu", "matmul_relu_cuda"):
            res = studies.get(name)
            if res is None:
                continue
            by_mode, used = {}, []
            for (shape, dt, mode), (ratio, rows) in _ratio_rows(res, op, provider, baseline, "TFLOP/s",
                                                                 dtype=dtype).items():
                by_mode.setdefault(mode, []).append(ratio)
                used += rows
            text = "; ".join(f"{geomean(v):.2f}x {mode} ({len(v)} shapes)"
                             for mode, v in sorted(by_mode.items(), key=lambda kv: ["eager", "graph"].index(kv[0])
                                                   if kv[0] in ("eager", "graph") else 9))
            cands.append((res, used, text))
        best = _latest(cands)
        if best:
            out.append([label, best[2], _where(best[0], best[1])])

    gemm("fwd", "fuselab", "cuBLASLt", "Fused GEMM+bias+ReLU vs cuBLASLt's fused epilogue, bf16 (geometric mean)")
    gemm("fwd+bwd", "fuselab", "autograd", "Forward+backward vs PyTorch autograd, bf16 (geometric mean)")
    cuda = studies.get("matmul_relu_cuda")
    if cuda is not None:
        found = _ratio_rows(cuda, "fwd", "CUDA wgmma", "cuBLASLt", "TFLOP/s", dtype="bf16")
        if found:
            rows = [r for _, rs in found.values() for r in rs]
            out.append(["CUDA C++ reference (wgmma) vs cuBLASLt, bf16 (geometric mean)",
                        f"{geomean([v for v, _ in found.values()]):.2f}x ({len(found)} shapes)", _where(cuda, rows)])
    comp = studies.get("compile_speedup")
    if comp is not None:
        found = _ratio_rows(comp, "opt train", "opt+fuselab", "opt", "ms/step", dtype="bf16")
        modes = [m for m in COMPILE_ORDERS["mode"] if any(k[2] == m for k in found)]
        if found:
            text = "; ".join(f"{found[k][0]:.2f}x {k[2]}" for m in modes for k in found if k[2] == m)
            rows = [r for _, rs in found.values() for r in rs]
            out.append(["OPT-style decoder training, bf16: patched by fuse_linear_relu vs stock", text,
                        _where(comp, rows)])
        parts, rows = [], []
        for op, provider in (("resnet50 train", "resnet50"), ("opt train", "opt")):
            rs = select(comp.rows, op=op, provider=provider, dtype="bf16", metric="ms/step")
            eager = {(r["shape"], r["run"]): r for r in rs if r["mode"] == "eager"}  # pairs within one run
            best = [(eager[(r["shape"], r["run"])]["p50"] / r["p50"], r) for r in rs
                    if r["mode"] != "eager" and (r["shape"], r["run"]) in eager]
            if best:
                speed, r = max(best, key=lambda b: b[0])
                parts.append(f"{provider} {speed:.2f}x ({r['mode']})")
                rows += [r, eager[(r["shape"], r["run"])]]
        if parts:
            out.append(["torch.compile vs eager, bf16 training, best mode", "; ".join(parts), _where(comp, rows)])
    host = studies.get("host_overhead")
    if host is not None:
        parts, rows, shapes = [], [], set()
        for op in ("fwd", "fwd+bwd"):
            found = _ratio_rows(host, op, "fuselab", "relu(addmm)", "us")
            if not found:
                continue
            shape = min({k[0] for k in found}, key=lambda s: int(s.split("x")[0]) if s.split("x")[0].isdigit() else 0)
            modes = [k[2] for k in found if k[0] == shape]
            mode = next((m for m in ("host", "loop", "eager", "wall") if m in modes), modes[0])
            _, (r, base) = found[(shape, r_dtype(found, shape, mode), mode)]
            parts.append(f"{op} {r['p50']:.0f} vs {base['p50']:.0f} us ({mode} mode)")
            rows += [r, base]
            shapes.add(shape)
        if parts:
            out.append([f"Host time per eager call at {', '.join(sorted(shapes))}: fuselab vs torch relu(addmm)",
                        "; ".join(parts), _where(host, rows)])
    models = studies.get("model_eager")
    if models is not None:
        for op in ("infer", "train"):
            found = _ratio_rows(models, op, "fuselab", "stock", "ms", mode="eager")
            if found:
                ratios = {k[0]: v[0] for k, v in found.items()}
                lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
                out.append([f"OPT decoders {op}, eager, bf16: patched (C++ path) vs stock, {len(ratios)} size x tokens",
                            f"{ratios[lo]:.2f}x ({lo}) to {ratios[hi]:.2f}x ({hi})",
                            _where(models, [r for v in found.values() for r in v[1]])])
    sparse = studies.get("sparse_embedding")
    if sparse is not None:
        line = sparse_headline(sparse)
        if line:
            out.append(line)
    fsdp = studies.get("train_fsdp")
    if fsdp is not None and select(fsdp.rows, metric="MFU %"):
        best = max(select(fsdp.rows, metric="MFU %"), key=lambda r: r["p50"])
        tokens = select(fsdp.rows, metric="tokens/s per GPU", op=best["op"], provider=best["provider"],
                        shape=best["shape"], dtype=best["dtype"], mode=best["mode"])
        world = int(best.get("world_size") or 1)  # the best MFU may come from an FSDP run on several GPUs
        per_gpu = "" if world == 1 else " per GPU"
        text = f"{best['p50']:.1f}% MFU" + (f", {tokens[0]['p50']:,.0f} tokens/s{per_gpu}" if tokens else "")
        gpus = "one GPU" if world == 1 else f"{world} GPUs"
        out.append([f"{best['op']} training on {gpus} ({best['provider']}, batch {best['shape']})", text,
                    _where(fsdp, [best])])
    quant = studies.get("quant_gemm")
    if quant is not None:
        for op, provider, peer, metric in (("int8 gemm", "fuselab int8", "_int_mm", "TOP/s"),
                                           ("fp8 gemm", "fuselab fp8", "_scaled_mm", "TFLOP/s"),
                                           ("fp8 gemm", "fuselab fp8 fast accum", "_scaled_mm fast accum", "TFLOP/s")):
            found = _ratio_rows(quant, op, provider, peer, metric, mode="graph")
            if found:
                rows = [r for _, rs in found.values() for r in rs]
                ratios = [v for v, _ in found.values()]
                out.append([f"{provider} GEMM with fused epilogue vs {peer} and the rest of the "
                            "epilogue as torch ops (CUDA graph)",
                            f"{geomean(ratios):.2f}x geometric mean, {min(ratios):.2f}x-{max(ratios):.2f}x "
                            f"({len(found)} shapes)", _where(quant, rows)])
        found = _ratio_rows(quant, "distill loss", "fuselab fused", "torch compiled", "ms", mode="graph")
        if found:
            text = ", ".join(f"{found[k][0]:.2f}x at {k[0]}" for k in sorted(found, key=_size_of_shape))
            out.append(["DistillationLoss(fused=True) vs torch.compile of the PyTorch form, bf16 fwd+bwd, N x C "
                        "(CUDA graph)", text, _where(quant, [r for v in found.values() for r in v[1]])])
    first = studies.get("tune_first_call")
    if first is not None:
        rows = select(first.rows, metric="first call s")
        parts = []
        for provider in ("warm Triton cache", "cold Triton cache"):
            secs = [r["p50"] for r in rows if r["provider"] == provider]
            if secs:
                parts.append(f"{min(secs):.2f}-{max(secs):.2f} s {provider}")
        if parts:
            cases = len({(r["shape"], r["dtype"], r["op"]) for r in rows})
            out.append([f"A fresh process's first fused call with the shipped configs ({cases} shape x dtype cases)",
                        "; ".join(parts), _where(first, rows)])
    mlp = studies.get("train_mlp")
    if mlp is not None:
        for op in ("train on cuda", "train on cpu"):
            rs = select(mlp.rows, op=op, metric="test accuracy")
            if rs:
                shape = rs[-1]["shape"]  # one dataset's rows (a digits fallback's are another shape)
                rs = [r for r in rs if r["shape"] == shape]
                acc = {r["provider"]: r for r in rs}
                text = ", ".join(f"{p} {r['p50']:.3f}" for p, r in acc.items())
                epochs = rs[0].get("epochs")
                out.append([f"MLP test accuracy ({shape.split(',')[0]}, {epochs} epochs, {op})", text,
                            _where(mlp, rs)])
                break
    return out


def headline(studies: Dict[str, Results]) -> str:
    rows = headline_rows(studies)
    if not rows:
        return "_No results yet: run the experiments with `--results`, then `python -m experiments.report`._"
    note = ("_Generated by `python -m experiments.report` from `results/*.json`; every figure is the most recent "
            "measurement, `x` above 1 is faster than the peer. Per-study tables, plots and environments: "
            "[docs/results](docs/results/README.md)._")
    return markdown_table(["figure", "value", "measured"], rows) + "\n\n" + note


def update_readme(readme: Path, text: str) -> None:
    """Replace what stands between the headline markers; a clear error when they are missing."""
    content = readme.read_text()
    if content.count(HEADLINE_BEGIN) != 1 or content.count(HEADLINE_END) != 1 \
            or content.index(HEADLINE_BEGIN) > content.index(HEADLINE_END):
        raise SystemExit(f"{readme} needs exactly one `{HEADLINE_BEGIN}` followed by one `{HEADLINE_END}` where the "
                         "headline table goes; add them (or pass --no-readme to regenerate the docs only)")
    head, rest = content.split(HEADLINE_BEGIN, 1)
    new = head + HEADLINE_BEGIN + "\n" + text.strip() + "\n" + HEADLINE_END + rest.split(HEADLINE_END, 1)[1]
    if new != content:
        readme.write_text(new)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def load_all(results_dir: Path = RESULTS) -> Dict[str, Results]:
    """Every results/*.json in the long format, by study; a JSON file of another format is reported and skipped, a
    damaged results file (not JSON, a row without its keys or run) raises ValueError naming it."""
    studies = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            res = Results.load(path)
        except NotResults as e:
            print(f"skipped {path}: {e}", file=sys.stderr)
            continue
        if res.study in studies:
            raise SystemExit(f"two files hold study {res.study!r}: rename one to results/{res.study}.json")
        studies[res.study] = res
    return studies


def index_page(studies: Dict[str, Results]) -> str:
    lines = []
    for name, res in sorted(studies.items()):
        spec = SPECS.get(name)
        runs = {r["run"] for r in res.rows}
        dates = sorted(d for d in (res.runs.get(r, {}).get("date") for r in runs) if d)
        converted = sum(1 for r in runs if res.runs.get(r, {}).get("converted_from"))
        lines.append([f"[{spec.title if spec else name}]({name}.md)", f"`{name}`", str(len(res.rows)),
                      f"{len(runs)}" + (f" ({converted} converted)" if converted else ""),
                      dates[-1][:10] if dates else "?"])
    return "\n".join([
        "# Results", "",
        "_Generated by `python -m experiments.report`; do not edit by hand._", "",
        "Every experiment writes its measurements in one long format (`fuselab-results/1`, "
        "`experiments/harness.py`): one row per measurement `{study, op, provider, shape, dtype, mode, metric, "
        "p20, p50, p80, run}`, each `run` naming the environment it was measured in (GPU, driver, torch, "
        "triton, CUDA, commit and a `dirty` flag, date). Each op names a baseline provider; the `x <baseline>` "
        "ratios in these pages are computed from the medians when the pages are generated, never stored.", "",
        "The committed files are `results/<study>.json`; a script writes them only with `--results` (by "
        "default it writes `runs/<study>.json`, which git ignores), atomically, and only merges into them: a "
        "row goes when its labels are measured again (or fail), never because a later run did not measure it "
        "(smoke runs such as `--tiny` are refused there, and an `--out` into `results/` is held to the same "
        "rules). Runs marked `converted from` were measured "
        "before the harness existed and converted from the old files (their commit, date and GPU kept; their "
        "times were medians or means, so p20 = p50 = p80 there, and their stored ratios were dropped).", "",
        markdown_table(["study", "name", "rows", "runs", "latest"], lines), ""])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--docs", type=Path, default=DOCS, help="where <study>.md, <study>.png and README.md go")
    p.add_argument("--readme", type=Path, default=README, help="the README whose headline section is filled")
    p.add_argument("--no-readme", action="store_true", help="leave the README alone")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if not args.no_readme and not args.readme.is_file():
        p.error(f"--readme {args.readme}: no such file (--no-readme leaves the README alone)")
    try:  # every file whole before any page is rewritten
        studies = load_all(args.results_dir)
    except ValueError as e:
        raise SystemExit(f"experiments.report: {e}; nothing was written") from None
    if not studies:
        raise SystemExit(f"no results in {args.results_dir}")
    args.docs.mkdir(parents=True, exist_ok=True)
    written = []
    for name, res in studies.items():
        spec = SPECS.get(name) or Spec(title=name, prose="")
        png = None if args.no_plots else plot_study(res, spec, args.docs / f"{name}.png")
        page = args.docs / f"{name}.md"
        page.write_text(render_study(res, spec))
        written += [page] + ([png] if png else [])
    index = args.docs / "README.md"
    index.write_text(index_page(studies))
    written.append(index)
    for path in written:
        print(f"wrote {path}")
    if not args.no_readme:
        update_readme(args.readme, headline(studies))
        print(f"updated {args.readme} (headline section)")
    return written


if __name__ == "__main__":
    main()
