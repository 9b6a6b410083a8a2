"""Benchmark fuselab's INT8 and FP8 GEMMs (scales, bias and ReLU fused into the epilogue) against
PyTorch's, and an OPT decoder's prefill quantized by ``fuselab.quant.quantize_`` against bf16, in one
process, on the same inputs.

Ops and providers (the first one named is each op's baseline; the report computes ``x <baseline>``):

    int8 gemm   relu(dequant(a_q @ w_q^T) + bias), bf16 out: int8 activations with one fp32 scale per
                token (row of a), int8 weights with one per output channel (row of w, column of B).
                _int_mm (``torch._int_mm(a_q, w_q.t())``, cuBLAS int8 with B column-major, then the
                epilogue as separate eager torch ops: the unfused peer), _int_mm row-major B (the same
                with B copied row-major: informative), fuselab int8 (``fuselab.quant.int8_matmul``:
                one Triton kernel), fuselab bf16 (``fuselab.kernels.linear_relu`` on the bf16 tensors
                the int8 ones were quantized from: what quantizing saves)
    fp8 gemm    the same with float8_e4m3fn operands and rowwise scales: _scaled_mm
                (``torch._scaled_mm`` with scale_a (M, 1), scale_b (1, N), the bias, bf16 out, then a
                ReLU), _scaled_mm fast accum (``use_fast_accum=True``), fuselab fp8
                (``fuselab.quant.fp8_matmul``: each K tile's sum added into fp32, as _scaled_mm's),
                fuselab fp8 fast accum (``fast_accum=True``: the peer of _scaled_mm fast accum), fuselab
                bf16. GPUs below compute capability 8.9 have no fp8 tensor cores: their fp8 rows are recorded
                as failed, with the reason.
    prefill     an OPT decoder (``experiments/models.py``: transformers' modules, random init, bf16)
                forward under no_grad over 8 x 1024 tokens: fuselab bf16 (patched by
                ``fuse_linear_relu``), stock bf16 (unpatched), int8 dynamic and fp8 (the patched model
                quantized by ``quantize_`` with ``Int8DynamicActivationInt8WeightConfig`` /
                ``Float8RowwiseConfig``: every Linear, lm_head too, fc1's ReLU in the epilogue),
                int8 fused norms and fp8 fused norms (the same with ``fuse_norms=True``: each layer's norms
                quantize their rows once, for q/k/v and for fc1), int8 static (static per-tensor activation
                scales calibrated on 2 batches of 4 x 256 other random tokens) and int8 static fused (the same
                with ``fuse_norms`` and ``fuse_outputs``: the norms and fc1's epilogue write the int8 inputs of
                the layers after them, no quantization pass left but out_proj's). The issue's target: quantized
                at least 1.3x faster than fuselab bf16.
    distill loss
                ``DistillationLoss(T=2, alpha=0.5)`` forward and backward on bf16 (N, C) student logits
                (the teacher's without gradient): torch (the PyTorch form, the baseline), torch compiled (the
                same under ``torch.compile``, a graph per shape) and fuselab fused (``fused=True``: fuselab's
                Triton kernels), at a classifier's C and language models' vocabularies,
                in turns (``harness.time_alternating``); ``rel err`` of each loss and ``grad rel err`` of
                its student gradient against float64.

Metrics: ``ms`` and, for the GEMMs, ``TOP/s`` (int8 gemm: 2*M*N*K integer ops per second; the bf16
peer's are FLOPs) or ``TFLOP/s`` (fp8 gemm); ``rel err``: each GEMM provider's output against float64
of its own inputs' math (the dequantized int8/fp8 math, or the bf16 math), and ``rel err vs bf16
math`` against float64 of the unquantized bf16 inputs (the quantization error included); for
prefill, ``rel err`` of the first sequence's logits against the stock bf16 model's. The GEMM ops
take operands quantized beforehand (weights are, in a model; quantizing the activations is not
timed there); prefill times everything a quantized layer does, the activations' quantization too.

Modes (``experiments/harness.py``): GEMMs in ``eager`` (``triton.testing.do_bench``: one call at a
time, L2 flushed; host time beyond the flush's shows) and ``graph`` (the same calls replayed from a
CUDA graph: device time only), over rotating input sets that together exceed L2; prefill in ``wall``
(a synchronized forward per sample). A provider that cannot run (a shape cuBLAS refuses, out of
memory, no fp8 tensor cores) is recorded as failed, with its error, and the run goes on. fuselab's
kernels autotune on first use (once per GPU, cached): a fresh machine spends minutes compiling.

    python -m experiments.bench_quant --quick                     # 3 shapes + opt-1.3b prefill (runs/)
    python -m experiments.bench_quant --results                   # the full suite -> results/quant_gemm.json
    python -m experiments.bench_quant --ops "int8 gemm,fp8 gemm" --results # the GEMMs only,
    python -m experiments.bench_quant --ops prefill --sizes opt-1.3b,opt-350m --results  # then prefill
    python -m experiments.report                                  # docs/results/quant_gemm.md from results/
    python -m experiments.bench_quant --ops prefill --sizes opt-1.3b --profile    # each prefill's top GPU kernels
"""
import argparse
import copy
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from experiments.harness import (
    Providers,
    Results,
    add_output_args,
    cycle,
    kernel_table,
    output_path,
    pivot,
    positive_float,
    positive_int,
    rel_error,
    require_cuda,
    rotating,
    shape_dims,
    step_diagnosis,
    time_alternating,
    time_call,
    tuned_choice,
)
from experiments.models import OPT_SIZES, opt_decoder
from fuselab.kernels import linear_relu
from fuselab.quant import (
    DistillationLoss,
    Float8RowwiseConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    calibrate,
    fp8_matmul,
    int8_matmul,
    quantize_,
    quantize_fp8_rowwise,
    quantize_int8_rowwise,
)
from fuselab.quant.fp8_gemm import check_fp8_device

# Named as MxNxK (harness.shape_dims): a (M, K) @ w (N, K)^T, Y is M x N.
SHAPES = {name: shape_dims(name) for name in [
    "8192x8192x8192",  # the issue's
    "4096x4096x4096",
    "opt-1.3b fc1 16384x8192x2048",  # 16384 tokens, d=2048 -> 8192, ReLU
    "opt-1.3b fc2 16384x2048x8192",
    "8192x8192x1024",
    "decode 16x8192x2048",  # 16 tokens: weight-bound (torch._int_mm needs M > 16)
    "unaligned 3001x4099x1537",  # no size a multiple of 8 (cuBLAS's 8-bit GEMMs refuse)
]}
QUICK = ["8192x8192x8192", "opt-1.3b fc1 16384x8192x2048", "decode 16x8192x2048"]
PREFILL_SIZES = ["opt-1.3b"]
OPS = ("int8 gemm", "fp8 gemm", "prefill", "distill loss")
GEMM_OPS = OPS[:2]
OP_DTYPE = {"int8 gemm": "int8", "fp8 gemm": "fp8 e4m3", "prefill": "bf16", "distill loss": "bf16"}  # rows' dtype
LOSS_SHAPES = {"256x10": (256, 10), "4096x32000": (4096, 32000), "8192x50257": (8192, 50257)}  # N x C
LOSS_ROUNDS = 5  # turns each loss provider is timed in
RATE = {"int8 gemm": "TOP/s", "fp8 gemm": "TFLOP/s"}
BF16_PEERS = {"fuselab bf16"}  # GEMM providers that read the unquantized bf16 tensors
KERNEL_OF = {"fuselab int8": "scaled_gemm_kernel", "fuselab fp8": "scaled_gemm_kernel",
             "fuselab bf16": "matmul_relu_kernel"}  # whose autotuned choice an eager row records
STUDY = "quant_gemm"


class GemmInputs(NamedTuple):
    """One input set of a GEMM op: the bf16 tensors and their quantized forms (int8 or fp8)."""
    x: torch.Tensor  # (M, K) bf16 activations
    w: torch.Tensor  # (N, K) bf16 weight, nn.Linear's layout
    bias: torch.Tensor  # (N,) bf16
    a_q: torch.Tensor  # (M, K) quantized x, row-major
    b_q: torch.Tensor  # (K, N) quantized w, transposed: column-major (w_q.t(), no copy)
    a_scale: torch.Tensor  # (M,) fp32, one per token
    w_scale: torch.Tensor  # (N,) fp32, one per output channel
    a_scale_2d: torch.Tensor  # (M, 1) view of a_scale (torch._scaled_mm's rowwise layout)
    w_scale_2d: torch.Tensor  # (1, N) view of w_scale
    b_q_row_major: Optional[torch.Tensor]  # (K, N) row-major copy of b_q, when a provider reads it


INT8, FP8, PREFILL, DISTILL = Providers(), Providers(), Providers(), Providers()
PROVIDERS = {"int8 gemm": INT8, "fp8 gemm": FP8, "prefill": PREFILL, "distill loss": DISTILL}
DISTILL.register("torch", baseline=True)(DistillationLoss(2.0, 0.5))
DISTILL.register("fuselab fused")(DistillationLoss(2.0, 0.5, fused=True))
DISTILL.register("torch compiled")(torch.compile(DistillationLoss(2.0, 0.5), dynamic=False))  # one graph a shape


def dequant_bias_relu(acc: torch.Tensor, inp: GemmInputs) -> torch.Tensor:
    """The epilogue as separate eager ops: fp32 accumulators * row scale * column scale + bias, ReLU, bf16."""
    y = acc.to(torch.float32) * inp.a_scale_2d * inp.w_scale_2d + inp.bias
    return torch.relu_(y).to(torch.bfloat16)


@INT8.register("_int_mm", baseline=True)
def int_mm(inp: GemmInputs) -> torch.Tensor:
    return dequant_bias_relu(torch._int_mm(inp.a_q, inp.b_q), inp)


@INT8.register("_int_mm row-major B")
def int_mm_row_major(inp: GemmInputs) -> torch.Tensor:
    return dequant_bias_relu(torch._int_mm(inp.a_q, inp.b_q_row_major), inp)


@INT8.register("fuselab int8")
def fuselab_int8(inp: GemmInputs) -> torch.Tensor:
    return int8_matmul(inp.a_q, inp.b_q, inp.a_scale, inp.w_scale, inp.bias, relu=True, out_dtype=torch.bfloat16)


@INT8.register("fuselab bf16")
def fuselab_bf16(inp: GemmInputs) -> torch.Tensor:
    return linear_relu(inp.x, inp.w, inp.bias)


@FP8.register("_scaled_mm", baseline=True)
def scaled_mm(inp: GemmInputs) -> torch.Tensor:
    return torch._scaled_mm(inp.a_q, inp.b_q, scale_a=inp.a_scale_2d, scale_b=inp.w_scale_2d, bias=inp.bias,
                            out_dtype=torch.bfloat16).relu_()


@FP8.register("_scaled_mm fast accum")
def scaled_mm_fast_accum(inp: GemmInputs) -> torch.Tensor:
    return torch._scaled_mm(inp.a_q, inp.b_q, scale_a=inp.a_scale_2d, scale_b=inp.w_scale_2d, bias=inp.bias,
                            out_dtype=torch.bfloat16, use_fast_accum=True).relu_()


@FP8.register("fuselab fp8")
def fuselab_fp8(inp: GemmInputs) -> torch.Tensor:
    return fp8_matmul(inp.a_q, inp.b_q, inp.a_scale, inp.w_scale, inp.bias, relu=True, out_dtype=torch.bfloat16)


@FP8.register("fuselab fp8 fast accum")
def fuselab_fp8_fast_accum(inp: GemmInputs) -> torch.Tensor:
    return fp8_matmul(inp.a_q, inp.b_q, inp.a_scale, inp.w_scale, inp.bias, relu=True, out_dtype=torch.bfloat16,
                      fast_accum=True)


FP8.register("fuselab bf16")(fuselab_bf16)


def make_inputs(op: str, shape: str, device, row_major_b: bool) -> GemmInputs:
    """Fresh random bf16 tensors and their symmetric quantization (fuselab.quant's helpers, as
    ``quantize_``'s layers quantize)."""
    M, N, K = SHAPES[shape]
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    quantize = quantize_int8_rowwise if op == "int8 gemm" else quantize_fp8_rowwise
    a_q, a_scale = quantize(x)
    w_q, w_scale = quantize(w)
    b_q = w_q.t()
    return GemmInputs(x, w, bias, a_q, b_q, a_scale, w_scale, a_scale[:, None], w_scale[None, :],
                      b_q.contiguous() if row_major_b else None)


def references(inp: GemmInputs) -> Dict[bool, torch.Tensor]:
    """float64 references, by whether the provider reads the bf16 tensors: the dequantized math
    (False) and the unquantized bf16 math (True)."""
    deq = (inp.a_q.double() @ inp.b_q.double()) * inp.a_scale.double()[:, None] * inp.w_scale.double()[None, :]
    return {False: torch.relu(deq + inp.bias.double()),
            True: torch.relu(inp.x.double() @ inp.w.double().t() + inp.bias.double())}


def fp8_unsupported(device) -> Optional[str]:
    """Why fp8 GEMMs cannot run on ``device`` (None: they can)."""
    return check_fp8_device(torch.device(device))


def _report_failure(results: Results, keys: dict, modes, error) -> None:
    for mode in modes:  # the prefill's keys carry their mode already
        results.fail(**dict(keys, mode=mode), error=error)
    print(f"FAILED {keys['op']} | {keys['provider']} | {keys['shape']}: {results.failed[-1]['error']}")


def measure_gemm(results: Results, op: str, shape: str, args, device="cuda") -> None:
    """Every selected provider of ``op`` at ``shape``: one checked call (rel err; autotuning), then
    timing in each of ``args.modes``; a provider that fails is recorded and the rest go on."""
    M, N, K = SHAPES[shape]
    providers = PROVIDERS[op].select(args.providers.get(op))
    keys = dict(op=op, shape=shape, dtype=OP_DTYPE[op])
    if op == "fp8 gemm" and fp8_unsupported(device):
        for name in [n for n in providers if n not in BF16_PEERS]:
            _report_failure(results, dict(keys, provider=name), args.modes, fp8_unsupported(device))
            del providers[name]
    if not providers:
        return
    try:
        sets = rotating(lambda: make_inputs(op, shape, device, "_int_mm row-major B" in providers), min_bytes=2**29)
    except Exception as e:  # noqa: BLE001  out of memory: every provider of this shape is reported
        for name in providers:
            _report_failure(results, dict(keys, provider=name), args.modes, e)
        return
    # Phase 1: each provider once on the first set, checked against float64; the working ones are timed.
    working: Dict[str, Callable] = {}
    try:
        refs = references(sets[0])
    except Exception as e:  # noqa: BLE001  float64 copies out of memory: timings only
        print(f"no float64 reference at {op} {shape}: {type(e).__name__}: {str(e)[:200]}")
        refs = {}
    for name, fn in providers.items():
        try:
            out = fn(sets[0])
        except Exception as e:  # noqa: BLE001  a shape cuBLAS refuses, a compiler error, out of memory
            _report_failure(results, dict(keys, provider=name), args.modes, e)
            _empty_cache(device)
            continue
        working[name] = fn
        if refs:
            bf16 = name in BF16_PEERS
            results.record(**keys, provider=name, mode="eager", metric="rel err", value=rel_error(out, refs[bf16]))
            results.record(**keys, provider=name, mode="eager", metric="rel err vs bf16 math",
                           value=rel_error(out, refs[True]))
        del out
    del refs
    _empty_cache(device)
    # Phase 2: timing, every working provider in every mode, over the rotating sets.
    calls = [(s,) for s in sets]
    for name, fn in working.items():
        for mode in args.modes:
            try:
                timing = time_call(cycle(fn, calls), mode, rep_ms=args.rep_ms)
            except Exception as e:  # noqa: BLE001  out of memory, a call a CUDA graph cannot capture
                _report_failure(results, dict(keys, provider=name), [mode], e)
                _empty_cache(device)
                continue
            extra = ({"config": tuned_choice(lambda s=sets[0]: fn(s), KERNEL_OF[name])}
                     if name in KERNEL_OF and mode == "eager" else {})
            results.record(**keys, provider=name, mode=mode, metric="ms", value=timing, **extra)
            results.record(**keys, provider=name, mode=mode, metric=RATE[op], value=timing.scaled(2e-9 * M * N * K))
    del sets, calls
    _empty_cache(device)


def measure_distill(results: Results, shape: str, args, device="cuda") -> None:
    """The loss providers at ``shape``, forward and backward: each checked once against float64, then
    timed in turns in each of ``args.modes``. A provider that fails its check (a compile, say) is recorded
    and left out; a mode whose timing fails, or out of memory, is recorded as failed for what it had left."""
    n, c = LOSS_SHAPES[shape]
    providers = DISTILL.select(args.providers.get("distill loss"))
    if not providers:  # --providers named none of this op's
        return
    keys = dict(op="distill loss", shape=shape, dtype="bf16")
    gen = torch.Generator(device=device).manual_seed(0)
    modes_left = list(args.modes)
    try:
        s = (3 * torch.randn(n, c, device=device, generator=gen)).to(torch.bfloat16).requires_grad_()
        t = (3 * torch.randn(n, c, device=device, generator=gen)).to(torch.bfloat16)
        y = torch.randint(0, c, (n,), device=device, generator=gen)
        s64 = s.detach().double().requires_grad_()
        ref = DistillationLoss(2.0, 0.5)(s64, t.double(), y)
        (ref_grad,) = torch.autograd.grad(ref, [s64])
        for name, loss_fn in list(providers.items()):
            s.grad = None
            try:  # the first call compiles: a provider that fails is recorded and left out, the others run
                loss = loss_fn(s, t, y)
                loss.backward()
                errors = {"rel err": rel_error(loss.detach(), ref), "grad rel err": rel_error(s.grad, ref_grad)}
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                _report_failure(results, dict(keys, provider=name), args.modes, e)
                del providers[name]
                continue
            finally:  # a loss's graph would keep s's AccumulateGrad from the default stream into a captured backward
                loss = None
            for metric, value in errors.items():
                results.record(**keys, provider=name, mode="eager", metric=metric, value=value)
        del s64, ref_grad
        if not providers:
            return
        s.grad = None
        fns = {name: (lambda loss_fn=loss_fn: loss_fn(s, t, y).backward()) for name, loss_fn in providers.items()}
        for mode in args.modes:
            try:
                timings = time_alternating(fns, mode, LOSS_ROUNDS, rep_ms=args.rep_ms / LOSS_ROUNDS, grad_to_none=[s])
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a capture that fails, say: this mode is recorded as failed, the next runs
                for name in providers:
                    _report_failure(results, dict(keys, provider=name), [mode], e)
                modes_left.remove(mode)
                continue
            for name, (timing, rounds) in timings.items():
                results.record(**keys, provider=name, mode=mode, metric="ms", value=timing, rounds=rounds)
            modes_left.remove(mode)
    except torch.OutOfMemoryError as e:
        for name in providers:
            _report_failure(results, dict(keys, provider=name), modes_left, e)
    _empty_cache(device)


# ----------------------------------------------------------------------------------------------
# Prefill: whole models, each provider a way of preparing the stock decoder
# ----------------------------------------------------------------------------------------------


@PREFILL.register("fuselab bf16", baseline=True)
def patched_model(stock: torch.nn.Module) -> Tuple[torch.nn.Module, dict]:
    from fuselab.nn import fuse_linear_relu

    model, report = fuse_linear_relu(copy.deepcopy(stock))
    if not report.fused:
        raise RuntimeError(f"fuse_linear_relu fused nothing:\n{report}")
    return model, {"fused_layers": len(report.fused)}


@PREFILL.register("stock bf16")
def stock_model(stock: torch.nn.Module) -> Tuple[torch.nn.Module, dict]:
    return stock, {}


def quantized_model(stock: torch.nn.Module, config) -> Tuple[torch.nn.Module, dict]:
    """The patched model quantized in place; an error if nothing was quantized (the bf16 model
    would otherwise be timed under the quantized provider's name)."""
    model, info = patched_model(stock)
    report = quantize_(model, config)
    if not report.replaced:
        raise RuntimeError(f"quantize_ replaced no layer:\n{report}")
    return model, dict(info, quantized_layers=len(report.replaced), skipped_layers=len(report.skipped),
                       **({"fused_norms": len(report.norms)} if report.norms else {}),
                       **({"quantized_outputs": len(report.outputs)} if report.outputs else {}))


@PREFILL.register("int8 dynamic")
def int8_model(stock: torch.nn.Module) -> Tuple[torch.nn.Module, dict]:
    return quantized_model(stock, Int8DynamicActivationInt8WeightConfig())


@PREFILL.register("int8 fused norms")
def int8_fused_norms_model(stock: torch.nn.Module) -> Tuple[torch.nn.Module, dict]:
    return quantized_model(stock, Int8DynamicActivationInt8WeightConfig(fuse_norms=True))


CALIBRATION_TOKENS = (4, 256)  # a static provider's calibration batch (batch, sequence), 2 of them


@PREFILL.register("int8 static")
def int8_static_model(stock: torch.nn.Module, fuse: bool = False) -> Tuple[torch.nn.Module, dict]:
    patched, _ = patched_model(stock)
    generator = torch.Generator().manual_seed(1)  # other tokens than the timed ones
    device = next(stock.parameters()).device
    batches = [torch.randint(0, stock.config.vocab_size, CALIBRATION_TOKENS, generator=generator).to(device)
               for _ in range(2)]
    scales = calibrate(patched, batches, len(batches), progress=False).act_scales()
    del patched
    return quantized_model(stock, Int8StaticActivationInt8WeightConfig(scales, fuse_norms=fuse, fuse_outputs=fuse))


@PREFILL.register("int8 static fused")
def int8_static_fused_model(stock: torch.nn.Module) -> Tuple[torch.nn.Module, dict]:
    return int8_static_model(stock, fuse=True)


@PREFILL.register("fp8")
def fp8_model(stock: torch.nn.Module, fuse_norms: bool = False) -> Tuple[torch.nn.Module, dict]:
    why = fp8_unsupported(next(stock.parameters()).device)
    if why is not None:
        raise RuntimeError(why)
    return quantized_model(stock, Float8RowwiseConfig(fuse_norms=fuse_norms))


@PREFILL.register("fp8 fused norms")
def fp8_fused_norms_model(stock: torch.nn.Module) -> Tuple[torch.nn.Module, dict]:
    return fp8_model(stock, fuse_norms=True)


def measure_prefill(results: Results, size: str, tokens: Tuple[int, int], args, device="cuda") -> None:
    """Each selected way of preparing the OPT decoder ``size``, timed over one forward of ``tokens``
    (batch, sequence) under no_grad; the first sequence's logits compared with the stock model's."""
    batch, seq = tokens
    keys = dict(op="prefill", shape=f"{size} {batch}x{seq}", dtype=OP_DTYPE["prefill"], mode="wall")
    providers = PREFILL.select(args.providers.get("prefill"))
    if not providers:
        return
    try:
        torch.manual_seed(0)
        stock, vocab = opt_decoder(size, "stock", device=device, dtype=torch.bfloat16)
        stock.eval()
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        with torch.no_grad():
            ref = stock(ids).logits[0].float()
    except Exception as e:  # noqa: BLE001  out of memory
        for name in providers:
            _report_failure(results, dict(keys, provider=name), ["wall"], e)
        return

    def prepared(prepare, stock):
        model, info = prepare(stock)
        model.eval()

        def step(model=model):
            with torch.no_grad():
                return model(ids).logits
        return step, info

    timed = []
    for name, prepare in providers.items():
        step = out = None
        try:
            step, info = prepared(prepare, stock)
            out = step()  # the first call: autotuning at the timed shape
            err = rel_error(out[0], ref)
            out = None
            timing = time_call(step, "wall", rep_ms=args.rep_ms)
            results.record(**keys, provider=name, metric="ms", value=timing, **info)
            results.record(**keys, provider=name, metric="rel err", value=err)
            timed.append(name)
        except Exception as e:  # noqa: BLE001  out of memory, no fp8 tensor cores, a layer that would not quantize
            _report_failure(results, dict(keys, provider=name), ["wall"], e)
        finally:
            del step, out  # the stock model stays: the next provider is prepared from it
            _empty_cache(device)
    # Profiled after every provider was timed: launches after a profiler session in the process run slower
    # (docs/notes/host_path.md), and a profiler error loses no timing
    for name in timed if args.profile else []:
        step = None
        try:
            step, _ = prepared(providers[name], stock)
            table = kernel_table(step, steps=2)
            # the wall time against the GPU's: idle time means the host (or a wait for the GPU) set the pace
            table = f"{step_diagnosis(step, steps=3)}\n{table}"
        except Exception as e:  # noqa: BLE001
            table = f"(no profile: {type(e).__name__}: {e})"
        finally:
            del step
            _empty_cache(device)
        print(f"\n{keys['shape']}, {name}: where a forward's GPU time goes\n{table}")
    del stock, ref
    _empty_cache(device)


def _empty_cache(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_tokens(text: str) -> Tuple[int, int]:
    try:
        batch, seq = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens must be BATCHxSEQ, e.g. 8x1024, got {text!r}") from None
    if batch < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"tokens must be positive, got {text!r}")
    return batch, seq


def summary(results: Results) -> str:
    """Markdown tables of what was measured, and the issue's prefill target."""
    out = []
    for op in GEMM_OPS:
        rows = results.select(op=op, metric=RATE[op])
        if rows:
            out.append(f"\n{op}, {RATE[op]} (p50):\n" + pivot(rows, ["shape", "mode"], baseline=results.baselines[op],
                                                              higher_is_better=True))
        for metric, what in (("rel err", "float64 of the same math"), ("rel err vs bf16 math", "float64 of the "
                                                                                   "unquantized bf16 inputs")):
            rows = results.select(op=op, metric=metric)
            if rows:
                out.append(f"\n{op}, rel err vs {what}:\n" + pivot(rows, ["shape"]))
    rows = results.select(op="prefill", metric="ms")
    if rows:
        base = results.baselines["prefill"]
        out.append("\nprefill, ms per forward (p50, wall):\n" + pivot(rows, ["shape"], baseline=base))
        out.append("\nprefill, logits' rel err vs stock bf16:\n" + pivot(results.select(op="prefill", metric="rel err"),
                                                                          ["shape"]))
        cells = {(r["shape"], r["provider"]): r["p50"] for r in rows}
        for (shape, name), ms in cells.items():
            if name.startswith(("int8", "fp8")) and (shape, base) in cells:
                speedup = cells[(shape, base)] / ms
                verdict = "met" if speedup >= 1.3 else "MISSED"
                out.append(f"issue target, {shape}: {name} {speedup:.2f}x {base} (>= 1.3x): {verdict}")
    if results.failed:
        out.append(f"\n{len(results.failed)} configurations failed (listed above and in the results file)")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"GEMM shapes {QUICK} only, prefill at opt-1.3b")
    p.add_argument("--shapes", default="all", help=f"GEMM shapes, comma-separated names or 'all': {list(SHAPES)}")
    p.add_argument("--ops", default=",".join(OPS), help=f"of {list(OPS)} (quote names with spaces)")
    p.add_argument("--providers", default=None,
                   help="restrict the providers, e.g. '_int_mm,fuselab int8' (applies to every op that has them)")
    p.add_argument("--modes", default="eager,graph", help="GEMM timing modes: eager, graph (prefill: wall)")
    p.add_argument("--sizes", default=",".join(PREFILL_SIZES),
                   help=f"prefill model sizes, comma-separated: of {[s for s in OPT_SIZES if s != 'tiny']}")
    p.add_argument("--tokens", type=parse_tokens, default=(8, 1024), help="prefill BATCHxSEQ (default 8x1024)")
    p.add_argument("--rep-ms", type=positive_int, default=100, help="milliseconds of timed calls per measurement")
    p.add_argument("--profile", action="store_true",
                   help="prefill: also print each provider's top GPU kernels per forward (torch.profiler), its "
                        "GPU busy and idle time, synchronizing calls and cudaMalloc calls")
    p.add_argument("--budget-min", type=positive_float, default=None,
                   help="start no new shape or model after this many minutes (what ran is saved)")
    add_output_args(p)
    args = p.parse_args(argv)

    def pick(text, known, what):
        names = list(known) if text == "all" else csv(text)
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            p.error(f"unknown {what} {unknown or [text]}: choose from {list(known)}")
        return names

    ops = pick(args.ops, OPS, "ops")
    shapes = QUICK if args.quick else pick(args.shapes, SHAPES, "shapes")
    sizes = PREFILL_SIZES if args.quick else pick(args.sizes, [s for s in OPT_SIZES if s != "tiny"], "sizes")
    args.modes = pick(args.modes, ("eager", "graph"), "modes")
    chosen = csv(args.providers) if args.providers else None
    known = {n for op in ops for n in PROVIDERS[op].fns}
    if chosen and set(chosen) - known:
        p.error(f"unknown providers {sorted(set(chosen) - known)} for ops {ops}: choose from {sorted(known)}")
    args.providers = {op: [n for n in reg.fns if n in chosen] if chosen else None for op, reg in PROVIDERS.items()}
    require_cuda("bench_quant")  # before any work
    out = output_path(args, STUDY)
    from tqdm import tqdm

    results = Results(STUDY)
    for op in ops:
        results.set_baseline(op, PROVIDERS[op])
    results.annotate(gpu_capability=".".join(map(str, torch.cuda.get_device_capability())))
    jobs = [(op, s) for op in ops if op in GEMM_OPS for s in shapes]
    jobs += [("prefill", s) for s in sizes if "prefill" in ops]
    jobs += [("distill loss", s) for s in LOSS_SHAPES if "distill loss" in ops]
    start = time.perf_counter()
    for i, (op, what) in enumerate(tqdm(jobs, desc=STUDY)):
        if args.budget_min is not None and time.perf_counter() - start > 60 * args.budget_min:
            print(f"budget of {args.budget_min} min spent: {len(jobs) - i} of {len(jobs)} jobs not started")
            break
        if op == "prefill":
            measure_prefill(results, what, args.tokens, args)
        elif op == "distill loss":
            measure_distill(results, what, args)
        else:
            measure_gemm(results, op, what, args)
        results.save(out, merge=args.merge)  # after every job: a run cut short keeps what it measured
    print(summary(results))
    print(f"saved {results.save(out, merge=args.merge)} ({time.perf_counter() - start:.0f} s)")
    return results


if __name__ == "__main__":
    main()
