"""The kernels the sweep tunes, and how it finds their launches: run the op, record what it launches.

The sweep never rebuilds a kernel's arguments itself. It runs the op the user calls (the fused GEMM's
forward, its backward through autograd) with the tuned kernel's launcher swapped for a recorder, so
each recorded ``Launch`` has exactly the arguments, the tuning key and the pruned configs that the
runtime's tuner would see on that problem. Each config is then timed by launching the kernel's JIT
function with that config, as Triton's autotuner does.

Tuned kernels (``KERNELS``): the fused GEMM (``matmul_relu``: its forward with and without bias and
both backward products) and the quantized GEMM (``scaled_gemm``: fuselab.quant's int8 and fp8 GEMM with
its epilogue, as the quantized layers call it). SparseAdamW's two kernels are not autotuned: their block
sizes follow from the row size (``fuselab.kernels.sparse_adamw._blocks``), so there is nothing to sweep;
wrapping them in ``autotune`` with a key on the row size's bucket, and an entry here, would add them.
"""
import contextlib
import importlib
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import triton

from fuselab.kernels._autotune import LibraryChoice, bound_args
from fuselab.tune.grid import BENCHMARK_SHAPES, QUANT_BENCHMARK_SHAPES, Problem


@dataclass
class Launch:
    """One launch of a tuned kernel as the op made it: what every config is timed on."""
    kernel: str  # the JIT function's name, as in the autotune cache and the configs file
    tuner: object  # its PersistentAutotuner
    product: str  # which of the op's launches: fwd, grad_a, ...
    args: tuple
    kwargs: dict  # the launch's keyword arguments, grid and warmup included
    key: tuple  # the tuning key, as the runtime's tuner computes it
    configs: List[triton.Config]  # the configs the tuner would time here (pruned)

    @property
    def gemm(self) -> Tuple[int, int, int]:
        """This launch's own M, N, K (a backward product's differ from the op's)."""
        named = dict(zip(self.tuner.arg_names, self.args))
        return named["M"], named["N"], named["K"]

    @property
    def flops(self) -> float:
        m, n, k = self.gemm
        return 2.0 * m * n * k

    def run(self, config: triton.Config) -> None:
        """Launch the kernel with ``config``, past the tuner (as Triton's autotuner times a config)."""
        run_config(self.tuner, self.args, self.kwargs, config)

    def precompile(self, config: triton.Config) -> None:
        """Compile the kernel for ``config`` into Triton's cache, launching nothing."""
        if isinstance(config, LibraryChoice):  # nothing to compile
            return
        kwargs = {k: v for k, v in self.kwargs.items() if k != "warmup"}
        self.tuner.fn.warmup(*self.args, **kwargs, **config.all_kwargs())


def run_config(tuner, args: tuple, kwargs: dict, config: triton.Config) -> None:
    """One launch with ``config`` past the tuner: the kernel, or a library choice's call."""
    if isinstance(config, LibraryChoice):
        config.call(bound_args(tuner.arg_names, args, kwargs))
    else:
        tuner.fn.run(*args, **kwargs, **config.all_kwargs())


def pruned_configs(tuner, args: tuple, kwargs: dict) -> List[triton.Config]:
    """The configs ``tuner`` would time for this launch (its pruning applied, library choices included)."""
    tuner.nargs = dict(zip(tuner.arg_names, args))
    try:
        return list(tuner.prune_configs(kwargs))
    finally:
        tuner.nargs = None


@contextlib.contextmanager
def recording(tuner, label: Callable[[], str], execute: bool) -> Iterator[List[Launch]]:
    """Within the block, launches of ``tuner`` are recorded (with ``label()`` as their product) instead
    of tuned; ``execute``: each also runs with its first pruned config, so that later launches (a
    backward's) read real results. The tuner's instance attribute shadows its class's ``run``."""
    launches: List[Launch] = []

    def record(*args, **kwargs):
        configs = pruned_configs(tuner, args, kwargs)
        launches.append(Launch(tuner.base_fn.__name__, tuner, label(), args, kwargs,
                               tuner._tuning_key(args, kwargs), configs))
        if execute:
            _run_any(tuner, args, kwargs, configs)
        return None  # no compiled kernel: launch() remembers no launch plan for it

    tuner.run = record
    try:
        yield launches
    finally:
        del tuner.run


def _run_any(tuner, args: tuple, kwargs: dict, configs: List[triton.Config]) -> None:
    """Launch with the first of ``configs`` that runs (one that does not compile is timed, and fails, later)."""
    for i, config in enumerate(configs):
        try:
            run_config(tuner, args, kwargs, config)
            return
        except Exception:  # noqa: BLE001
            if i == len(configs) - 1:
                raise


def _caller_named(names: Dict[str, str], default: str) -> str:
    """``names[f]`` for the innermost function ``f`` on the stack that ``names`` has, else ``default``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in names:
            return names[frame.f_code.co_name]
        frame = frame.f_back
    return default


def _recorded(tuner, product: str, execute: bool, call: Callable[[], object]) -> List[Launch]:
    """The launches of ``tuner`` that ``call()`` makes, labelled ``product`` (see ``recording``)."""
    with recording(tuner, lambda: product, execute) as launches:
        call()
    return launches


def _launched(launches: List[Launch], op: str, problem: Problem, tuner) -> List[Launch]:
    if not launches:
        raise RuntimeError(f"{op} on {problem} launched no {tuner.base_fn.__name__}: does it run "
                           f"PyTorch's kernels here (see fuselab.kernels._runtime.execution_path)?")
    return launches


class MatmulReLU:
    """The fused GEMM, ``relu(a @ b + bias)``: ops ``fwd`` (with bias), ``fwd-nobias``, ``bwd`` (the
    forward with bias, then autograd's backward: products ``grad_a`` and ``grad_b``)."""
    name = "matmul_relu"
    ops = ("fwd", "fwd-nobias", "bwd")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}  # tf32: fp32 at "high"
    layouts = {"linear": "b = weight.t(), weight (N, K) row-major, as nn.Linear and linear_relu",
               "matmul": "b (K, N) row-major, as experiments/bench_matmul_relu.py"}
    baselines = {"fwd": "cuBLASLt", "fwd-nobias": "cuBLASLt", "grad_a": "cuBLAS", "grad_b": "cuBLAS"}
    benchmark_shapes = BENCHMARK_SHAPES  # experiments/bench_matmul_relu.py's: --first-call's default
    check_defaults = {"first_call": ("matmul", "fwd"), "heldout": ("linear,matmul", "fwd,bwd")}  # (layouts, ops)
    _products = {"_grad_a": "grad_a", "_grad_b": "grad_b"}  # the backward's functions in matmul_relu_triton.py

    def tuner(self):
        # Looked up at each use: tests swap in a fresh tuner.
        return importlib.import_module("fuselab.kernels.matmul_relu_triton").matmul_relu_kernel

    @contextlib.contextmanager
    def context(self, problem: Problem):
        """tf32 problems run fp32 tensors at torch's "high" precision (else fp32 runs cuBLAS, untuned)."""
        before = torch.get_float32_matmul_precision()
        if problem.dtype == "tf32":
            torch.set_float32_matmul_precision("high")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)

    def inputs(self, problem: Problem, device, fill: Callable, requires_grad: bool = False) -> dict:
        """(a, b, bias, dy) for ``problem``; ``fill(*size, dtype=, device=)`` makes each (torch.randn, torch.empty)."""
        M, N, K, dtype = problem.M, problem.N, problem.K, self.dtypes[problem.dtype]

        def make(*size):
            return fill(*size, dtype=dtype, device=device).requires_grad_(requires_grad)

        a = make(M, K)
        leaf = make(N, K) if problem.layout == "linear" else make(K, N)
        b = leaf.t() if problem.layout == "linear" else leaf
        return {"a": a, "b": b, "bias": make(N), "dy": fill(M, N, dtype=dtype, device=device)}

    def call(self, op: str, t: dict) -> None:
        """Run ``op`` once on inputs from ``inputs`` (``bwd``: they need ``requires_grad``)."""
        from fuselab.kernels import matmul_relu

        if op == "fwd-nobias":
            matmul_relu(t["a"], t["b"])
        elif op == "fwd":
            matmul_relu(t["a"], t["b"], t["bias"])
        else:
            matmul_relu(t["a"], t["b"], t["bias"]).backward(t["dy"])

    def launches(self, problem: Problem, device, fill: Callable, execute: bool) -> List[Launch]:
        """The tuned launches of ``problem``'s ops, in order (see ``recording``)."""
        tuner = self.tuner()
        out: List[Launch] = []
        for op in problem.ops:
            t = self.inputs(problem, device, fill, requires_grad=op == "bwd")
            if op != "bwd":
                launches = _recorded(tuner, op, execute, lambda: self.call(op, t))
            else:
                from fuselab.kernels import matmul_relu

                y = []
                launches = _recorded(tuner, "fwd", execute, lambda: y.append(matmul_relu(t["a"], t["b"], t["bias"])))
                with recording(tuner, lambda: _caller_named(self._products, "bwd"), execute) as backward:
                    y[0].backward(t["dy"])
                launches += backward
            out += _launched(launches, op, problem, tuner)
        return out

    def baseline(self, launch: Launch) -> Tuple[str, Callable[[], object]]:
        """The peer a product's ratio is taken against, on the launch's own operands: cuBLASLt's fused
        bias+ReLU epilogue for the forward (a zero bias without one), cuBLAS's GEMM for a backward product
        (without the ReLU mask, where the pointer body applies it on load: a lower bound on cuBLAS's time)."""
        named = dict(zip(launch.tuner.arg_names, launch.args))
        a, b, bias = named["a_ptr"], named["b_ptr"], named["bias_ptr"]
        provider = self.baselines.get(launch.product, "cuBLAS") if a.is_cuda else "torch (CPU)"
        if launch.product.startswith("fwd"):
            if bias is None:
                bias = torch.zeros(b.shape[1], dtype=b.dtype, device=b.device)
            return provider, lambda: torch._addmm_activation(bias, a, b)
        return provider, lambda: torch.mm(a, b)


class ScaledGemm:
    """fuselab.quant's GEMM, ``cast(acc * a_scale * b_scale + bias)`` over int8 x int8 -> int32 or fp8 x fp8
    -> fp32 accumulators, as the quantized layers call it (b = weight.t(), one scale per row of a and per
    column of b, bf16 out): ops ``fwd`` (with bias; the ReLU flag is not in the tuning key), ``fwd-nobias`` and
    ``fwd-quantout`` (int8: with bias and ReLU, the output quantized with a static scale, as a statically quantized
    OPT's fc1 writes fc2's input), ``fwd-fastaccum`` (fp8: with bias, ``fast_accum=True``). Products are named by
    dtype (``int8 fwd``), apart from the fused GEMM's in one file."""
    name = "scaled_gemm"
    ops = ("fwd", "fwd-nobias", "fwd-quantout", "fwd-fastaccum")
    op_dtypes = {"fwd-quantout": ("int8",), "fwd-fastaccum": ("fp8",)}  # an int8 output; fp8's accumulation
    dtypes = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
    layouts = {"linear": "b = weight.t(), the (N, K) quantized weight row-major, as the quantized layers"}
    benchmark_shapes = QUANT_BENCHMARK_SHAPES  # experiments/bench_quant.py's
    check_defaults = {"first_call": ("linear", "fwd"), "heldout": ("linear", "fwd")}

    def tuner(self):
        return importlib.import_module("fuselab.quant._scaled_gemm").scaled_gemm_kernel

    def context(self, problem: Problem):
        return contextlib.nullcontext()

    def inputs(self, problem: Problem, device, fill: Callable, requires_grad: bool = False) -> dict:
        """(a, b, a_scale, b_scale, bias) for ``problem``: 8-bit values from ``fill``'s (torch.randn, torch.empty)."""
        M, N, K, dtype = problem.M, problem.N, problem.K, self.dtypes[problem.dtype]

        def quantized(*size):
            x = fill(*size, dtype=torch.float32, device=device)
            return (x.clamp(-1, 1) * 127).round().to(dtype) if dtype == torch.int8 else x.clamp(-448, 448).to(dtype)

        def scale(n):
            return fill(n, dtype=torch.float32, device=device).abs().add(1e-3)

        return {"a": quantized(M, K), "b": quantized(N, K).t(), "a_scale": scale(M), "b_scale": scale(N),
                "bias": fill(N, dtype=torch.bfloat16, device=device), "out_scale": scale(1).reshape(())}

    def call(self, op: str, t: dict) -> None:
        from fuselab.quant import fp8_matmul, int8_matmul

        if op == "fwd-quantout":  # int8 only: the grid refuses others
            int8_matmul(t["a"], t["b"], t["a_scale"], t["b_scale"], t["bias"], True, torch.bfloat16,
                        out_scale=t["out_scale"], backend="triton")
            return
        fp8 = {} if t["a"].dtype == torch.int8 else {"fast_accum": op == "fwd-fastaccum"}  # fwd-fastaccum: fp8 only
        matmul = fp8_matmul if fp8 else int8_matmul
        matmul(t["a"], t["b"], t["a_scale"], t["b_scale"], None if op == "fwd-nobias" else t["bias"], False,
               torch.bfloat16, backend="triton", **fp8)

    def launches(self, problem: Problem, device, fill: Callable, execute: bool) -> List[Launch]:
        tuner, out = self.tuner(), []
        for op in problem.ops:
            t = self.inputs(problem, device, fill)
            out += _launched(_recorded(tuner, f"{problem.dtype} {op}", execute, lambda: self.call(op, t)), op, problem,
                             tuner)
        return out

    def baseline(self, launch: Launch) -> Tuple[str, Callable[[], object]]:
        """PyTorch's 8-bit GEMM on the launch's operands, with the epilogue it lacks as torch ops (int8:
        ``torch._int_mm``; fp8: ``torch._scaled_mm``, whose rowwise scales and bias are its own, with fast accumulation
        where the launch has it); on a CPU the op's PyTorch body."""
        from fuselab.quant import fp8_matmul, int8_matmul
        from fuselab.quant._scaled_gemm import torch_epilogue

        named = dict(zip(launch.tuner.arg_names, launch.args))
        a, b, c = named["a_ptr"], named["b_ptr"], named["c_ptr"]
        a_scale, b_scale, bias = named["a_scale_ptr"], named["b_scale_ptr"], named["bias_ptr"]
        out_scale = named.get("out_scale_ptr")
        out_dtype = c.dtype if out_scale is None else torch.bfloat16  # fwd-quantout's layer dtype
        int8 = a.dtype == torch.int8
        if not a.is_cuda:
            matmul = int8_matmul if int8 else fp8_matmul
            return "torch (CPU)", lambda: matmul(a, b, a_scale, b_scale, bias, out_scale is not None, out_dtype,
                                                 backend="torch", **({"out_scale": out_scale} if int8 else {}))
        if int8:
            return "_int_mm + epilogue", lambda: torch_epilogue(torch._int_mm(a, b), a_scale, b_scale, bias,
                                                                out_scale is not None, out_dtype, out_scale)
        fast = bool(launch.kwargs.get("FAST_ACCUM"))
        return ("_scaled_mm fast accum" if fast else "_scaled_mm"), lambda: torch._scaled_mm(
            a, b, scale_a=a_scale[:, None], scale_b=b_scale[None, :], bias=bias, out_dtype=c.dtype, use_fast_accum=fast)


KERNELS = {"matmul_relu": MatmulReLU(), "scaled_gemm": ScaledGemm()}


def device() -> Optional[str]:
    """Where the sweep's tensors live: the CPU under the Triton interpreter, else the GPU (None: neither)."""
    from fuselab.kernels._runtime import INTERPRET

    if INTERPRET:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None
