"""Compile fuselab's Triton kernels to sm_90 cubins on a machine without a GPU (run without TRITON_INTERPRET).

The interpreter accepts what the compiler refuses (a non-constexpr global did, once): this compiles the
real thing. Each kernel's launches are recorded as the ops make them, on CPU tensors, through the sweep's
recorder (``fuselab.tune.kernels.recording``: the tuner's ``run`` is swapped, nothing launches), and each
recorded launch is compiled with the configs named on the command line's groups. Prints one line per
compiled (kernel, config), then ``compiled N``; exits non-zero on the first failure, naming it.

    python tests/compile_for_hopper.py gemm-fwd gemm-tma ...   (groups: see GROUPS)
"""
import sys
import types

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuselab.tune.kernels import recording

TARGET = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
                  torch.int32: "*i32", torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}


def signature_of(fn, named: dict):
    """(signature, constexprs) for ``triton.compile`` from a launch's named arguments, as the launcher
    would specialize them (None pointers, integers equal to 1 and every tl.constexpr parameter become
    constexprs; the 16-divisibility hints are left out)."""
    signature, constexprs = {}, {}
    for p in fn.params:
        value = named[p.name]
        if p.is_constexpr or value is None or (type(value) is int and value == 1):  # Triton specializes 1 too
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = _POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{p.name}: cannot type {value!r}")
    return signature, constexprs


def compile_launch(launch, config, **overrides) -> None:
    fn = launch.tuner.fn
    named = {**dict(zip(fn.arg_names, launch.args)), **launch.kwargs, **config.kwargs, **overrides}
    signature, constexprs = signature_of(fn, named)
    out = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                         options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    assert "cubin" in out.asm, sorted(out.asm)
    if named.get("INT8") is False:  # an fp8 scaled_gemm: the accumulation its launch asked for reached the MMA
        # fast_accum: Triton's sm_90 default (no fp32 promotion within K); else one promotion per K tile
        want = 2**30 if named["FAST_ACCUM"] else named["BLOCK_K"]
        assert f"maxNumImpreciseAcc = {want}" in out.asm["ttgir"], f"FAST_ACCUM={named['FAST_ACCUM']}"


def record(tuner, call):
    with recording(tuner, lambda: "launch", execute=False) as launches:
        call()
    return launches


class PlainLaunch:
    """A launch of an untuned kernel (``_runtime.launch(kernel, grid, *args, num_warps=.., **constexprs)``),
    shaped like a recorded ``Launch`` with its launch options as the config."""

    def __init__(self, kernel, args, kwargs):
        self.tuner = types.SimpleNamespace(fn=kernel)
        self.args = args
        self.kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        self.config = triton.Config({}, num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))


def record_plain(module, call):
    """The launches ``call()`` makes through ``module.launch`` (swapped for a recorder: nothing runs)."""
    launches = []
    real = module.launch
    module.launch = lambda kernel, grid, *args, **kwargs: launches.append(PlainLaunch(kernel, args, kwargs))
    try:
        call()
    finally:
        module.launch = real
    return launches


def gemm_launches(dtype, *, bias=True, relu=True, mask=False, rowsum=False):
    from fuselab.kernels import matmul_relu_triton as MR

    M, N, K = 256, 256, 128
    a, b, c = torch.empty(M, K, dtype=dtype), torch.empty(K, N, dtype=dtype), torch.empty(M, N, dtype=dtype)
    y = torch.empty(M, K, dtype=dtype) if mask else None
    return record(MR.matmul_relu_kernel, lambda: MR._gemm(
        a, b, c, bias=torch.empty(N, dtype=dtype) if bias else None, y=y,
        rowsum=torch.empty(M, dtype=torch.float32) if rowsum else None, relu=relu))


def scaled_gemm_launches(dtype, quantized_output: bool = False, fast_accum: bool = False):
    from fuselab.quant import _scaled_gemm as SG

    M, N, K = 256, 256, 256
    a, b = torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=dtype).t()
    scales = torch.empty(M, dtype=torch.float32), torch.empty(N, dtype=torch.float32)
    c = torch.empty(M, N, dtype=torch.int8 if quantized_output else torch.bfloat16)
    out = (torch.empty((), dtype=torch.float32), torch.bfloat16) if quantized_output else ()
    return record(SG.scaled_gemm_kernel, lambda: SG.scaled_gemm(a, b, c, *scales, torch.empty(N, dtype=torch.bfloat16),
                                                                True, *out, fast_accum=fast_accum))


def _gemm_configs(tma: bool):
    from fuselab.kernels import matmul_relu_triton as MR

    return [c for c in MR.matmul_relu_kernel.configs if c.kwargs["TMA"] == tma]


def group_gemm_fwd():
    """Every pointer-body config of the forward (bf16, bias, ReLU)."""
    (launch,) = gemm_launches(torch.bfloat16)
    for config in _gemm_configs(tma=False):
        yield "matmul_relu fwd bf16", launch, config, {}


def group_gemm_tma():
    """Every TMA-body config of the forward (bf16, bias, ReLU) and of a backward product (fp16)."""
    (fwd,) = gemm_launches(torch.bfloat16)
    (grad,) = gemm_launches(torch.float16, bias=False, relu=False)
    for config in _gemm_configs(tma=True):
        yield "matmul_relu fwd bf16 tma", fwd, config, {"TMA_OK": True}
        yield "matmul_relu grad fp16 tma", grad, config, {"TMA_OK": True}


def group_gemm_variants():
    """One pointer config of each other launch kind: tf32, no bias, the masked and row-summed backward."""
    config = _gemm_configs(tma=False)[2]
    for what, kwargs, dtype in (("tf32 fwd", {}, torch.float32), ("no bias", {"bias": False}, torch.bfloat16),
                                ("masked grad", {"bias": False, "relu": False, "mask": True}, torch.bfloat16),
                                ("masked grad + rowsum", {"bias": False, "relu": False, "mask": True, "rowsum": True},
                                 torch.float16)):
        (launch,) = gemm_launches(dtype, **kwargs)
        yield f"matmul_relu {what}", launch, config, {}


def group_quant():
    """Every config of the 8-bit GEMM, int8 and fp8, with its full epilogue (int8's also quantizing its output); fp8
    with fast accumulation in each body (its one change is the dot's promotion: a config of each body covers it)."""
    from fuselab.quant import _scaled_gemm as SG

    for dtype, quantized_output in ((torch.int8, False), (torch.float8_e4m3fn, False), (torch.int8, True)):
        (launch,) = scaled_gemm_launches(dtype, quantized_output)
        for config in SG.scaled_gemm_kernel.configs:
            yield f"scaled_gemm {dtype}{' int8 output' if quantized_output else ''}", launch, config, {}
    (launch,) = scaled_gemm_launches(torch.float8_e4m3fn, fast_accum=True)
    for tma in (False, True):
        config = next(c for c in SG.scaled_gemm_kernel.configs if c.kwargs["TMA"] == tma)
        yield "scaled_gemm fp8 fast_accum", launch, config, {}


def group_rowwise():
    """The activation quantization: int8 and fp8 rows, int8 with a static scale, short and long rows (read once or
    in two passes); the layer norm that quantizes its rows."""
    from fuselab.quant import rowwise

    for fp8, static, K in ((False, False, 2048), (False, True, 2048), (True, False, 2048), (False, False, 8192),
                           (False, False, 11008)):
        x = torch.empty(64, K, dtype=torch.bfloat16)
        q = torch.empty(64, K, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
        for launch in record_plain(rowwise, lambda: rowwise._quantize_rows(x, q, torch.empty(64), static)):
            yield f"quantize_rows fp8={fp8} static={static} K={K}", launch, launch.config, {}
    from fuselab.quant import norm_quant  # the layer norm that quantizes its rows: affine or not, each width class

    for fp8, static, affine, K in ((False, False, True, 2048), (True, False, True, 2048), (False, True, True, 2048),
                                   (False, False, False, 768), (False, False, True, 9216),
                                   (False, False, True, 1)):  # K = 1: Triton makes it a constexpr
        x, w = torch.empty(64, K, dtype=torch.bfloat16), torch.empty(K, dtype=torch.bfloat16) if affine else None
        readers = 3 if static else 1  # static: a row copy for each of q, k and v
        q = torch.empty(*([readers] if static else []), 64, K, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
        scales = [torch.empty(()) for _ in range(readers)] if static else [torch.empty(64)]
        for launch in record_plain(norm_quant, lambda: norm_quant._layer_norm_quantize(x, w, w, 1e-5, q, scales,
                                                                                         static)):
            yield f"layer_norm_quantize_rows fp8={fp8} static={static} affine={affine} K={K}", launch, launch.config, {}


def group_sparse_adamw():
    """SparseAdamW's kernels, for each parameter dtype and a narrow and a wide row; the sort's one-block launch
    and (9,000 lookups) its merge passes."""
    from fuselab.kernels import sparse_adamw as SA

    for dtype, dim, nnz in ((torch.float32, 128, 300), (torch.bfloat16, 64, 9000), (torch.float16, 4096, 300)):
        rows = [torch.empty(1000, dim, dtype=dtype) for _ in range(3)]
        ids, values = torch.zeros(nnz, dtype=torch.int64), torch.empty(nnz, dim, dtype=dtype)

        def step():
            SA.sparse_adamw_triton(*rows, ids, values, 1e-3, 0.9, 0.999, 1e-8, 0.01, torch.ones(()), False)

        for launch in record_plain(SA, step):
            yield f"{launch.tuner.fn.__name__} {dtype} dim={dim}", launch, launch.config, {}


def group_distill():
    """The distillation loss's two kernels: soft and hard terms alone and together, 16- and 32-bit logits, a
    vocabulary's row and short ones."""
    from fuselab.quant import fused_distill as FD

    real = FD._check_runs_triton
    FD._check_runs_triton = lambda student: None  # recorded, never run: CPU tensors stand in for CUDA ones
    try:
        for dtype, c, alpha in ((torch.bfloat16, 50304, 0.5), (torch.float32, 10, 1.0), (torch.float16, 37, 0.0)):
            s, t = torch.empty(8, c, dtype=dtype), torch.empty(8, c, dtype=dtype)
            y = torch.zeros(8, dtype=torch.int64)

            def both():
                _, stats = FD._loss(s, t, y, 2.0, alpha)
                FD._grad(s, t, y, stats, torch.ones(()), 2.0, alpha, True, True)

            for launch in record_plain(FD, both):
                yield f"{launch.tuner.fn.__name__} {dtype} C={c} alpha={alpha}", launch, launch.config, {}
    finally:
        FD._check_runs_triton = real


GROUPS = {"gemm-fwd": group_gemm_fwd, "gemm-tma": group_gemm_tma, "gemm-variants": group_gemm_variants,
          "quant": group_quant, "rowwise": group_rowwise, "sparse-adamw": group_sparse_adamw,
          "distill": group_distill}


def main(names) -> int:
    count = 0
    for name in names:
        for what, launch, config, overrides in GROUPS[name]():
            try:
                compile_launch(launch, config, **overrides)
            except Exception as e:  # noqa: BLE001  the first failure ends the run, named
                print(f"FAILED {what} [{config}]: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                return 1
            count += 1
            print(f"ok {what} [{config}]", flush=True)
    print(f"compiled {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
