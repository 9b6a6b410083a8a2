"""fuselab.quant: the INT8/FP8 GEMMs against float64 with derived bounds, the CPU (PyTorch) path against
the Triton path, registration (opcheck, compile, export to .pt2 and back in a fresh process),
quantize_ with every config and its report, calibration, state_dict size, DistillationLoss, pt2e.

On a CPU the Triton kernels run in the interpreter (conftest); on a GPU run `pytest -m gpu tests/test_quant.py`.
"""
import copy
import functools
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from reference import DEVICES, assert_close, dot_bound
from torch import nn

from fuselab.kernels._runtime import ExecutionPath
from fuselab.nn import FusedLinearReLU, fuse_linear_relu
from fuselab.quant import (
    DistillationLoss,
    Float8Linear,
    Float8RowwiseConfig,
    Int8Conv2d,
    Int8DynamicActivationInt8WeightConfig,
    Int8Linear,
    Int8StaticActivationInt8WeightConfig,
    calibrate,
    fp8_matmul,
    int8_matmul,
    quantize_,
    quantize_fp8_rowwise,
    quantize_int8_rowwise,
    quantize_pt2e_x86,
)
from fuselab.quant.rowwise import quantize_int8_static

int8_gemm = importlib.import_module("fuselab.quant.int8_gemm")
fp8_gemm = importlib.import_module("fuselab.quant.fp8_gemm")
scaled_gemm = importlib.import_module("fuselab.quant._scaled_gemm")

EPS = 2.0**-24  # fp32 unit roundoff
FP8 = torch.float8_e4m3fn
SHAPES = [(37, 53, 29), (1, 19, 33), (65, 8, 70)]  # (M, K, N): odd, a row of 1, a short K
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Hopper's fp8 MMA keeps about 14 bits while it accumulates (DeepSeek-V3 report, 3.3.2); the kernel adds
# each K tile into fp32, so at most BLOCK_K / 32 <= 8 reduced-precision additions per tile, each within
# 2**-13 of the tile's sum of |products| (GPU only: the interpreter and the CPU path sum in fp32).
FP8_MMA_BOUND = 8 * 2.0**-13
# fast_accum: no fp32 promotion, so K / 32 reduced-precision additions over the whole K (an MMA instruction sums 32)
FP8_FAST_ACCUM_BOUND_PER_K = 2.0**-13 / 32


# ----------------------------------------------------------------------------------------------
# References and bounds
# ----------------------------------------------------------------------------------------------


def _skip_fp8_without_hardware(device, kind="fp8"):
    if kind == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < fp8_gemm.MIN_CAPABILITY:
        pytest.skip("the fp8 kernel needs fp8 tensor cores (sm_89+)")


def _operands(M, K, N, kind, device, b_layout="weight"):
    """Random quantized operands as the layers make them: a (M, K), b (K, N) (a weight's .t() by
    default), rowwise scales. Never zeros (they would hide unwritten outputs)."""
    quantize = quantize_int8_rowwise if kind == "int8" else quantize_fp8_rowwise
    a, a_scale = quantize(torch.randn(M, K, device=device))
    w, b_scale = quantize(torch.randn(N, K, device=device))
    b = w.t() if b_layout == "weight" else w.t().contiguous()
    return a, b, a_scale, b_scale


def epilogue_bound(p_abs, bias_abs):
    """Error of the fp32 epilogue ((acc * a_scale) * b_scale + bias) over the exact value: the int32 ->
    fp32 conversion and two products round at most 3 times relative to |p| = |acc a_scale b_scale|,
    the bias addition once relative to |p| + |bias|; 5 unit roundoffs cover it with second-order slack."""
    return 5 * EPS * (p_abs + bias_abs)


def reference(a, b, a_scale, b_scale, bias, relu, fast_accum=False):
    """The dequantized math in float64, and the error bound of the kernel's fp32 computation of it (with
    ``fast_accum``, of Hopper's reduced-precision accumulation over the whole K)."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    scales = a_scale.double()[:, None] * b_scale.double()[None, :]
    p = (a64 @ b64) * scales
    bias64 = bias.double() if bias is not None else torch.zeros((), dtype=torch.float64, device=a.device)
    ref = p + bias64
    bound = epilogue_bound(p.abs(), bias64.abs())
    if a.dtype == FP8:  # fp32 sums of exact products (int8 sums are exact)
        products = a64.abs() @ b64.abs()
        bound = bound + dot_bound(torch.float32, a.shape[1], a64.abs(), b64.abs()) * scales
        if a.is_cuda:
            mma = FP8_FAST_ACCUM_BOUND_PER_K * a.shape[1] if fast_accum else FP8_MMA_BOUND
            bound = bound + mma * products * scales
    return (torch.relu(ref) if relu else ref), bound


def quantization_bound(x, w, layer, kind):
    """|y_quantized - y_float| elementwise, derived: with x ~ x^ = s_x q_x and w ~ w^ = s_w q_w,
    |xw - x^w^| <= |x||w - w^| + |x - x^||w^| summed over K; each rounding error is bounded per kind
    (int8: half a step, plus 2**-16 steps for the fp32 quotient, or the product by the fp32 reciprocal, and the clamp; e4m3: 2**-4 relative
    for normals, 2**-10 steps below them, plus the quotient's rounding). The GEMM and epilogue
    rounding is added on top."""
    x64, w64 = x.double(), w.double()
    quantize = quantize_int8_rowwise if kind == "int8" else quantize_fp8_rowwise
    if kind == "int8" and getattr(layer, "act_scale", None) is not None:
        s_x = layer.act_scale.double().expand(x.shape[0])
        x_hat = quantize_int8_static(x, layer.act_scale).double() * layer.act_scale.double()
    else:
        q, s_x = quantize(x)
        s_x = s_x.double()
        x_hat = q.double() * s_x[:, None]
    s_w = layer.weight_scale.double()
    w_hat = layer.weight.double() * s_w[:, None]
    if kind == "int8":
        e_x = (0.5 + 2.0**-16) * s_x[:, None].expand_as(x64)
        e_w = (0.5 + 2.0**-16) * s_w[:, None].expand_as(w64)
    else:
        e_x = (2.0**-4 + 2.0**-22) * x64.abs() + 2.0**-10 * s_x[:, None]
        e_w = (2.0**-4 + 2.0**-22) * w64.abs() + 2.0**-10 * s_w[:, None]
    bias_abs = layer.bias.double().abs() if layer.bias is not None else 0.0
    gemm = x_hat.abs() @ w_hat.abs().t()
    rounding = epilogue_bound(gemm, bias_abs)
    if kind == "fp8":
        rounding = rounding + dot_bound(torch.float32, x.shape[1], x_hat.abs(), w_hat.abs().t())
        if x.is_cuda:
            rounding = rounding + FP8_MMA_BOUND * gemm
    return x64.abs() @ e_w.t() + e_x @ w_hat.abs().t() + rounding


def check_layer(layer, float_weight, float_bias, x, kind, relu, call=None):
    """A quantized layer's output (``call(x)``, default ``layer(x)``) against the float layer's math in
    float64, within quantization_bound."""
    with torch.no_grad():
        y = (layer if call is None else call)(x)  # a compiled module has no truth value
    ref = x.double() @ float_weight.double().t() + (float_bias.double() if float_bias is not None else 0.0)
    if relu:
        ref = torch.relu(ref)
    assert_close(y, ref, quantization_bound(x, float_weight, layer, kind), f"{type(layer).__name__} output")


# ----------------------------------------------------------------------------------------------
# The GEMMs against float64
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("bias,relu", [(True, True), (False, False), (True, False)], ids=["bias-relu", "plain", "bias"])
def test_gemm_matches_float64(device, kind, M, K, N, bias, relu):
    _skip_fp8_without_hardware(device, kind)
    a, b, a_scale, b_scale = _operands(M, K, N, kind, device)
    bias_t = torch.randn(N, device=device) if bias else None
    matmul = int8_matmul if kind == "int8" else fp8_matmul
    out = matmul(a, b, a_scale, b_scale, bias_t, relu, torch.float32, backend="triton")
    ref, bound = reference(a, b, a_scale, b_scale, bias_t, relu)
    assert_close(out, ref, bound, f"{kind} triton")


def test_tma_body_is_offered_only_where_layouts_and_its_switch_allow(monkeypatch):
    from fuselab.quant import _scaled_gemm

    configs = _scaled_gemm.gemm_configs(interpret=False)
    args = dict(a_ptr=torch.empty(1, dtype=torch.int8), c_ptr=torch.empty(1, dtype=torch.bfloat16),
                M_BUCKET=8192, N_BUCKET=8192, K_BUCKET=8192)

    def offered(tma_ok):
        return any(c.kwargs["TMA"] for c in _scaled_gemm._prune_configs(configs, dict(args, TMA_OK=tma_ok)))

    monkeypatch.setattr(_scaled_gemm, "TMA_ON_CUDA", False)  # the switch off: pointer bodies only
    assert not offered(True) and not offered(False)
    monkeypatch.setattr(_scaled_gemm, "TMA_ON_CUDA", True)
    assert offered(True) and not offered(False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_every_gpu_config(device, kind, monkeypatch):
    # Each config the GPU's tuner may pick (the interpreter runs them on a CPU, TMA bodies included),
    # with the full epilogue; the bias layouts (strides 1, 3 and 0) take turns.
    import triton

    from fuselab.quant import _scaled_gemm
    from fuselab.quant._scaled_gemm import gemm_configs, scaled_gemm

    _skip_fp8_without_hardware(device, kind)
    if device == "cpu":
        monkeypatch.setattr(_scaled_gemm, "has_tma", lambda device: True)  # the TMA body's layouts qualify
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    M, K, N = 300, 272, 144  # not multiples of any block; 16-byte aligned rows for TMA (int8 output rows too)
    a, b, a_scale, b_scale = _operands(M, K, N, kind, device)
    assert {c.kwargs["TMA"] for c in gemm_configs(interpret=False)} == {False, True}
    biases = [torch.randn(N, device=device), torch.randn(N, 3, device=device)[:, 1],
              torch.randn((), device=device).expand(N)]
    out_scale = torch.tensor(0.02, device=device)  # the outputs span about +-4: some clip at 127 steps
    ran_tma = 0
    for i, config in enumerate(gemm_configs(interpret=False)):
        bias = biases[i % 3]
        # bf16 out, as the layers write it (the TMA configs' shared memory is sized for it)
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)  # poison: all must be written
        try:
            scaled_gemm(a, b, out, a_scale, b_scale, bias, True, config=config)
        except Exception as e:  # out of shared memory for a pointer tile on some GPU is allowed, nothing else
            if ("OutOfResources" in type(e).__name__ or "out of resource" in str(e)) and not config.kwargs["TMA"]:
                continue
            raise
        ran_tma += config.kwargs["TMA"]
        ref, bound = reference(a, b, a_scale, b_scale, bias, True)
        assert_close(out, ref, bound, f"{kind} config {config}, bias stride {bias.stride(0)}")
        if kind == "int8":  # the epilogue's quantized output (int8 tiles stored): the float output's bits, quantized
            relu = i % 2 == 0  # negative values through the int8 store too
            q = torch.full((M, N), -128, dtype=torch.int8, device=device)  # poison: the epilogue never makes -128
            scaled_gemm(a, b, q, a_scale, b_scale, bias, relu, out_scale, torch.bfloat16, config=config)
            want = int8_matmul(a, b, a_scale, b_scale, bias, relu, torch.bfloat16, backend="torch")
            assert torch.equal(q, quantize_int8_static(want, out_scale)), f"quantized output, config {config}"
    assert ran_tma == sum(c.kwargs["TMA"] for c in gemm_configs(interpret=False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_output_dtypes_and_bias_dtypes(device, kind, out_dtype):
    _skip_fp8_without_hardware(device, kind)
    # The cast happens last: the output rounding (assert_close) is out_dtype's; a bf16 bias is read as is.
    a, b, a_scale, b_scale = _operands(23, 40, 45, kind, device)
    bias = torch.randn(45, device=device, dtype=torch.bfloat16)
    matmul = int8_matmul if kind == "int8" else fp8_matmul
    out = matmul(a, b, a_scale, b_scale, bias, True, out_dtype, backend="triton")
    assert out.dtype == out_dtype
    ref, bound = reference(a, b, a_scale, b_scale, bias, True)
    assert_close(out, ref, bound, f"{kind} -> {out_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("bias_layout", ["contiguous", "strided", "expanded"])
def test_a_quantized_output_is_the_float_outputs_static_quantization(device, out_dtype, bias_layout):
    # out_scale: the epilogue's result, cast to out_dtype, quantized as quantize_int8_static quantizes it: the same
    # bits on every path, ties, clipping past 127 steps, NaN (to 0) and negative values (no ReLU) included
    a, b, a_scale, b_scale = _operands(37, 53, 29, "int8", device)
    a_scale[3] = float("nan")  # a NaN row: quantized to 0, as the unfused path makes it
    bias = {"contiguous": torch.randn(29, device=device), "strided": torch.randn(29, 3, device=device)[:, 1],
            "expanded": torch.randn((), device=device).expand(29)}[bias_layout].to(out_dtype)
    for relu in (False, True):
        y = int8_matmul(a, b, a_scale, b_scale, bias, relu, out_dtype)
        for scale in (0.01, float(y.nan_to_num().abs().max()) / 127):  # clipping; the whole range
            out_scale = torch.tensor(scale, device=device)
            want = quantize_int8_static(y, out_scale)
            for backend in ("auto", "torch"):
                q = int8_matmul(a, b, a_scale, b_scale, bias, relu, out_dtype, out_scale=out_scale, backend=backend)
                assert q.dtype == torch.int8 and torch.equal(q, want), (backend, relu, scale)
    assert (quantize_int8_static(y, torch.tensor(0.01, device=device)).abs() == 127).any()  # 0.01 clipped some
    assert (want[3] == 0).all() and (want < 0).sum() == 0 and (y < 0).sum() == 0  # the last one had a ReLU
    batched = int8_matmul(a.view(1, 37, 53), b, a_scale.view(1, 37), b_scale, bias, True, out_dtype,
                          out_scale=out_scale)
    assert batched.shape == (1, 37, 29) and torch.equal(batched[0], q)
    for backend in ("auto", "torch"):  # one value in more dimensions: still (M, N) on every path
        assert torch.equal(int8_matmul(a, b, a_scale, b_scale, bias, True, out_dtype, out_scale=out_scale.view(1, 1, 1),
                                       backend=backend), q)
    # static quantization multiplies by the scale's fp32 reciprocal: 0.375 * fp32(1 / 0.03) = 12.500001 (13), where
    # the correctly rounded quotient 0.375 / 0.03 = 12.5 rounds to even (12)
    a, b = torch.ones(2, 16, dtype=torch.int8, device=device), torch.zeros(16, 3, dtype=torch.int8, device=device)
    b[0] = 1
    half_step = torch.full((2,), 0.375, device=device)
    for backend in ("auto", "torch"):
        q = int8_matmul(a, b, half_step, torch.ones(3, device=device), None, False, out_dtype,
                        out_scale=torch.tensor(0.03, device=device), backend=backend)
        assert (q == 13).all(), (backend, q)


def test_a_quantized_output_checks_its_scale():
    a, b = torch.ones(4, 8, dtype=torch.int8), torch.ones(8, 5, dtype=torch.int8)
    with pytest.raises(ValueError, match="out_scale quantizes the scaled result: give a_scale and b_scale"):
        int8_matmul(a, b, None, None, out_scale=torch.tensor(1.0))
    for bad in (torch.ones(2), torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, device="meta")):
        with pytest.raises(ValueError, match="out_scale must be one float32 value on cpu"):
            int8_matmul(a, b, torch.ones(4), torch.ones(5), out_scale=bad)
    op = torch.ops.fuselab.int8_matmul_epilogue
    a, b, a_scale, b_scale = _operands(11, 24, 9, "int8", "cpu")
    torch.library.opcheck(op, (a, b, a_scale, b_scale, torch.randn(9), True, torch.bfloat16, torch.tensor(0.05)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_layouts_batches_and_strided_scales(device, kind):
    _skip_fp8_without_hardware(device, kind)
    # a batched (2, 3, K) and transposed in memory, b row-major, a per-tensor a_scale (stride 0),
    # a strided b_scale and a strided bias: each read at its strides.
    K, N = 37, 41
    quantize = quantize_int8_rowwise if kind == "int8" else quantize_fp8_rowwise
    a, _ = quantize(torch.randn(6, K, device=device))
    a = a.t().contiguous().t().reshape(2, 3, K)  # column-major in memory
    assert a.stride()[-1] != 1
    a_scale = torch.rand((), device=device) + 0.5
    w, _ = quantize(torch.randn(N, K, device=device))
    b = w.t().contiguous()
    b_scale = (torch.rand(2 * N, device=device) + 0.5)[::2]
    bias = torch.randn(3 * N, device=device)[::3]
    matmul = int8_matmul if kind == "int8" else fp8_matmul
    out = matmul(a, b, a_scale, b_scale, bias, False, torch.float32, backend="triton")
    assert out.shape == (2, 3, N)
    ref, bound = reference(a.reshape(6, K), b, a_scale.expand(6), b_scale, bias, False)
    assert_close(out.reshape(6, N), ref, bound, f"{kind} strided")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_empty_sizes(device, kind):
    _skip_fp8_without_hardware(device, kind)
    for M, K, N in [(0, 5, 4), (3, 0, 4), (3, 5, 0)]:
        a, b, a_scale, b_scale = _operands(M, max(K, 1), N, kind, device)
        a, b = a[:, :K], b[:K]  # K = 0 as views of real tensors
        bias = torch.randn(N, device=device)
        matmul = int8_matmul if kind == "int8" else fp8_matmul
        out = matmul(a, b, a_scale, b_scale, bias, False, torch.float32, backend="triton")
        assert out.shape == (M, N)
        torch.testing.assert_close(out, bias.expand(M, N), rtol=0, atol=0)  # K = 0: the bias alone


def test_int8_accumulators_cannot_overflow():
    # The largest products (-128 * -128) over the largest K the op takes still fit int32.
    K = int8_gemm.MAX_K
    a = torch.full((1, K), -128, dtype=torch.int8)
    b = torch.full((K, 1), -128, dtype=torch.int8)
    assert K * 128 * 128 < 2**31
    assert int8_matmul(a, b, None, None, backend="torch").item() == K * 128 * 128
    with pytest.raises(ValueError, match="K=131072 is above 131071: the torch.int32 accumulators could overflow"):
        int8_matmul(torch.zeros(1, K + 1, dtype=torch.int8), torch.zeros(K + 1, 1, dtype=torch.int8), None, None)


# ----------------------------------------------------------------------------------------------
# The CPU path (PyTorch's kernels) against the Triton path
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_int8_paths_give_the_same_accumulators(device, M, K, N):
    # Integers: torch._int_mm and the Triton kernel must agree bit for bit, and with int64 math.
    a, b, a_scale, b_scale = _operands(M, K, N, "int8", device)
    triton_acc = int8_matmul(a, b, None, None, backend="triton")
    torch_acc = int8_matmul(a, b, None, None, backend="torch")
    assert triton_acc.dtype == torch_acc.dtype == torch.int32
    assert torch.equal(triton_acc, torch_acc)
    assert torch.equal(triton_acc.cpu().long(), a.cpu().long() @ b.cpu().long())  # CUDA has no int64 matmul
    # The epilogues: each within fp32 rounding of the float64 value.
    bias = torch.randn(N, device=device)
    ref, bound = reference(a, b, a_scale, b_scale, bias, True)
    for backend in ("triton", "torch"):
        assert_close(int8_matmul(a, b, a_scale, b_scale, bias, True, torch.float32, backend=backend), ref, bound,
                     f"int8 {backend}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_paths_agree(device, fast_accum):
    _skip_fp8_without_hardware(device)
    a, b, a_scale, b_scale = _operands(33, 70, 20, "fp8", device)
    bias = torch.randn(20, device=device)
    ref, bound = reference(a, b, a_scale, b_scale, bias, False, fast_accum)
    for backend in ("triton", "torch"):
        out = fp8_matmul(a, b, a_scale, b_scale, bias, False, torch.float32, fast_accum=fast_accum, backend=backend)
        assert_close(out, ref, bound, f"fp8 {backend} fast_accum={fast_accum}")


def test_fast_accum_is_checked():
    a, b, a_scale, b_scale = _operands(4, 16, 8, "fp8", "cpu")
    for backend, value in (("auto", 1), ("torch", 1), ("auto", None), ("torch", None)):
        with pytest.raises(TypeError, match=f"fast_accum must be a bool, got {value}"):
            fp8_matmul(a, b, a_scale, b_scale, fast_accum=value, backend=backend)
    with pytest.raises(TypeError, match="fast_accum must be True or False"):
        Float8RowwiseConfig(fast_accum="yes")
    with pytest.raises(TypeError, match="fast_accum must be a bool"):
        Float8Linear(16, 8, fast_accum=None)
    a8, b8, s8, t8 = _operands(4, 16, 8, "int8", "cpu")
    with pytest.raises(ValueError, match="fast_accum applies to fp8 operands"):
        scaled_gemm.scaled_gemm(a8, b8, torch.empty(4, 8), s8, t8, None, False, fast_accum=True)


def test_fast_accum_reaches_the_kernel_launch(monkeypatch):
    # Float8RowwiseConfig(fast_accum=True) -> Float8Linear -> fp8_matmul -> the kernel's FAST_ACCUM constexpr (the
    # interpreter sums in fp32 either way: the flag can only be seen on its way; the Hopper compile test checks the
    # compiled dot's promotion for each value)
    seen = []
    real = scaled_gemm.launch
    monkeypatch.setattr(scaled_gemm, "launch", lambda *args, **kw: (seen.append(kw["FAST_ACCUM"]), real(*args, **kw)))
    for fast in (False, True):
        model = _mlp()
        report = quantize_(model, Float8RowwiseConfig(fast_accum=fast))
        layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert len(report.replaced) == len(layers) == 3 and all(m.fast_accum is fast for m in layers)
        assert ("fast_accum=True" in repr(model)) is fast
        seen.clear()
        with torch.no_grad():
            model(torch.randn(5, 24))
        assert seen == [fast] * 3


def _force_pytorch_path(monkeypatch):
    """Make the ops take their PyTorch bodies, as on a CPU without the interpreter."""
    for module in (int8_gemm, fp8_gemm, scaled_gemm):
        monkeypatch.setattr(module, "execution_path", lambda t, **kw: ExecutionPath.TORCH_ON_CPU)

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton kernel ran")

    for module in (int8_gemm, fp8_gemm, scaled_gemm):
        monkeypatch.setattr(module, "scaled_gemm", no_triton)


@pytest.mark.parametrize("config", ["int8-dynamic", "int8-static", "fp8"])
def test_quantized_model_on_the_cpu_path(config, monkeypatch):
    # The same quantized model through PyTorch's kernels and through Triton: outputs within fp32 rounding.
    model, x = _mlp(), torch.randn(9, 24)
    report = quantize_(model, _config(config, model, x))
    assert len(report.replaced) == 3
    with torch.no_grad():
        by_triton = model(x)
        _force_pytorch_path(monkeypatch)
        by_torch = model(x)
    torch.testing.assert_close(by_torch, by_triton, rtol=2**-20, atol=2**-20 * by_triton.abs().max().item())


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------

# (what is wrong, changes to the arguments, exception, a fragment of its message)
BAD_INPUTS = [
    ("float operands", dict(a=torch.randn(4, 8)), TypeError, "a and b must both be torch.int8"),
    ("K mismatch", dict(b=torch.zeros(9, 5, dtype=torch.int8)), ValueError, "K mismatch"),
    # a weight passed untransposed: its K, not its scales' count, is what is named (a probe's)
    ("b untransposed", dict(b=torch.zeros(5, 8, dtype=torch.int8)), ValueError, "K mismatch"),
    ("3-D b", dict(b=torch.zeros(1, 8, 5, dtype=torch.int8)), ValueError, "b (K, N)"),
    ("one scale", dict(b_scale=None), ValueError, "give both a_scale and b_scale"),
    ("fp16 scale", dict(a_scale=torch.ones(4, dtype=torch.float16)), TypeError, "a_scale must be float32"),
    ("short scale", dict(a_scale=torch.ones(3)), ValueError, "a_scale must hold one scale per row of a (4)"),
    ("long b_scale", dict(b_scale=torch.ones(6)), ValueError, "b_scale must hold one scale per column of b (5)"),
    ("a_scale as a row", dict(a_scale=torch.ones(1, 4)), ValueError, "a_scale must hold one scale per row of a"),
    ("bias shape", dict(bias=torch.ones(4)), ValueError, "bias must have shape (N,) = (5,)"),
    ("int bias", dict(bias=torch.ones(5, dtype=torch.int32)), TypeError, "bias must be float32, float16 or bfloat16"),
    ("int8 out", dict(out_dtype=torch.int8), TypeError, "out_dtype must be float32, float16 or bfloat16"),
    ("out dtype a string", dict(out_dtype="bf16"), TypeError, "out_dtype must be a torch.dtype"),  # a probe's
    ("relu unscaled", dict(a_scale=None, b_scale=None, relu=True, out_dtype=torch.int32), ValueError,
     "bias and relu need a_scale and b_scale"),
    ("float raw", dict(a_scale=None, b_scale=None, out_dtype=torch.float32), TypeError,
     "raw torch.int32 accumulators"),
    ("devices", dict(b=torch.zeros(8, 5, dtype=torch.int8, device="meta")), ValueError,
     "all tensors must be on one device"),
    ("backend", dict(backend="cublas"), ValueError, "backend must be 'auto', 'triton' or 'torch'"),
    ("triton on meta", dict(a=torch.ones(4, 8, dtype=torch.int8, device="meta"), backend="triton"), ValueError,
     "backend='triton' runs on CUDA tensors"),
]


@pytest.mark.parametrize("what,changes,error,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_naming_the_problem(what, changes, error, message):
    args = dict(a=torch.ones(4, 8, dtype=torch.int8), b=torch.ones(8, 5, dtype=torch.int8), a_scale=torch.ones(4),
                b_scale=torch.ones(5), bias=torch.ones(5), relu=False, out_dtype=torch.float32, backend="auto")
    args.update(changes)
    if args["a_scale"] is None and "bias" not in changes:
        args["bias"] = None
    with pytest.raises(error, match=_escaped(message)):
        int8_matmul(**args)


def test_scales_in_torch_scaled_mms_shapes_are_taken():
    # a_scale (M, 1) and b_scale (1, N), as torch._scaled_mm takes them: b's was refused
    a, b = torch.randint(-9, 9, (4, 8), dtype=torch.int8), torch.randint(-9, 9, (8, 5), dtype=torch.int8)
    a_scale, b_scale = torch.rand(4) + 0.5, torch.rand(5) + 0.5
    want = int8_matmul(a, b, a_scale, b_scale, out_dtype=torch.float32)
    got = int8_matmul(a, b, a_scale[:, None], b_scale[None, :], out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_inputs_raise_in_the_op_and_its_fake():
    # The registered op (and its fake, which export and compile call) check the same way.
    a, b = torch.ones(4, 8, dtype=torch.int8), torch.ones(8, 5, dtype=torch.int8)
    with pytest.raises(ValueError, match=_escaped("a_scale must have shape (4,), one scale per row of a")):
        torch.ops.fuselab.int8_matmul_epilogue(a, b, torch.ones(3), torch.ones(5), None, False, torch.float32)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (a.float(), b, torch.ones(4), torch.ones(5))]
    with mode, pytest.raises(TypeError, match="a and b must both be torch.int8"):
        torch.ops.fuselab.int8_matmul_epilogue(*fakes, None, False, torch.float32)
    with pytest.raises(TypeError, match="a and b must both be torch.float8_e4m3fn"):
        fp8_matmul(a, b, torch.ones(4), torch.ones(5))


def test_fp8_refused_on_gpus_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(fp8_gemm, "cuda_capability", lambda device: (8, 0))  # as an A100's
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    why = fp8_gemm.check_fp8_device(torch.device("cuda", 0))
    assert "compute capability 8.9 or newer" in why and "sm_80" in why and "A100" in why
    assert fp8_gemm.check_fp8_device(torch.device("cpu")) is None
    model = _mlp()
    monkeypatch.setattr(fp8_gemm, "check_fp8_device", lambda device: why)  # as if the layers were on that GPU
    quantize_module = importlib.import_module("fuselab.quant.quantize")
    monkeypatch.setattr(quantize_module, "check_fp8_device", lambda device: why)
    report = quantize_(model, Float8RowwiseConfig())
    assert not report.replaced and all("sm_80" in reason for reason in report.skipped.values())


def _escaped(text):
    import re

    return re.escape(text)


# ----------------------------------------------------------------------------------------------
# Registration: opcheck, compile, export
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_opcheck(device, kind):
    _skip_fp8_without_hardware(device, kind)
    a, b, a_scale, b_scale = _operands(11, 24, 9, kind, device)
    op = torch.ops.fuselab.int8_matmul_epilogue if kind == "int8" else torch.ops.fuselab.fp8_matmul_epilogue
    bias = torch.randn(9, device=device, dtype=torch.bfloat16)
    # test_schema compares inputs before and after with ops PyTorch lacks for fp8 tensors
    kw = {} if kind == "int8" else {"test_utils": ("test_autograd_registration", "test_faketensor",
                                                   "test_aot_dispatch_dynamic")}
    torch.library.opcheck(op, (a, b, a_scale, b_scale, bias, True, torch.bfloat16), **kw)
    torch.library.opcheck(op, (a.t().contiguous().t(), b.contiguous(), a_scale, b_scale, None, False,
                               torch.float32), **kw)
    raw = torch.int32 if kind == "int8" else torch.float32
    torch.library.opcheck(op, (a, b, None, None, None, False, raw), **kw)
    if kind == "fp8":  # the fp8 op's accumulation flag
        torch.library.opcheck(op, (a, b, a_scale, b_scale, bias, True, torch.bfloat16, True), **kw)


def _mlp(d_in=24, hidden=40, d_out=10):
    """Linear-ReLU-Linear-ReLU-Linear with the ReLUs fused (FusedLinearReLU), as a user would build it."""
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, d_out))
    model, report = fuse_linear_relu(model)
    assert len(report.fused) == 2
    return model


def _config(name, model, x):
    if name == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    if name == "fp8":
        return Float8RowwiseConfig()
    calib = calibrate(model, [x], 1, progress=False)
    return Int8StaticActivationInt8WeightConfig(calib.act_scales())


def test_compile_fullgraph():
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(6, 24)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("fuselab.int8_matmul_epilogue" in op for op in ops)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


def test_quantized_output_and_static_norm_compile_and_export():
    # the ops' new arguments as graph nodes: int8_matmul's out_scale, the static layer norm
    from fuselab.quant.norm_quant import layer_norm_quantize_static

    a, b, a_scale, b_scale = _operands(11, 24, 9, "int8", "cpu")
    x, w, bias, s = torch.randn(5, 24), torch.rand(24) + 0.5, torch.randn(24), torch.tensor(0.03)

    def fn(a, x, s):
        return int8_matmul(a, b, a_scale, b_scale, None, True, torch.bfloat16, out_scale=s), \
            layer_norm_quantize_static(x, w, bias, 1e-5, [s, s * 2])

    eager = fn(a, x, s)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(a, x, s)

    class Both(torch.nn.Module):
        def forward(self, a, x, s):
            return fn(a, x, s)

    program = torch.export.export(Both(), (a, x, s))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"fuselab.int8_matmul_epilogue.default", "fuselab.layer_norm_quantize_static.default"} <= ops, ops
    for got in (compiled, program.module()(a, x, s)):
        assert all(torch.equal(g, e) for g, e in zip(got, eager))


_LOAD_IN_FRESH_PROCESS = textwrap.dedent("""
    import sys, torch
    import fuselab.quant  # registers the ops the graphs call
    for name in sys.argv[2:]:
        ep = torch.export.load(f"{sys.argv[1]}/{name}.pt2")
        x = torch.load(f"{sys.argv[1]}/{name}.x.pt")
        torch.save(ep.module()(x), f"{sys.argv[1]}/{name}.out.pt")
""")


def test_export_save_and_load_in_a_fresh_process(tmp_path):
    # Each quantized model exported with fuselab's ops as graph nodes, saved as .pt2, loaded by a new
    # process. That process runs without the interpreter: its CPU path (PyTorch's kernels) must give
    # what this process's Triton path gave, to within fp32 rounding.
    names, outputs = ["int8-dynamic", "int8-static", "fp8"], {}
    for name in names:
        model, x = _mlp(), torch.randn(7, 24)
        quantize_(model, _config(name, model, x))
        ep = torch.export.export(model, (x,))
        op = torch.ops.fuselab.fp8_matmul_epilogue if name == "fp8" else torch.ops.fuselab.int8_matmul_epilogue
        assert sum(n.target is op.default for n in ep.graph.nodes) == 3
        torch.export.save(ep, tmp_path / f"{name}.pt2")
        torch.save(x, tmp_path / f"{name}.x.pt")
        with torch.no_grad():
            outputs[name] = model(x)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _LOAD_IN_FRESH_PROCESS, str(tmp_path), *names], env=env,
                            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in names:
        loaded = torch.load(tmp_path / f"{name}.out.pt")
        expected = outputs[name]
        torch.testing.assert_close(loaded, expected, rtol=2**-20, atol=2**-20 * expected.abs().max().item())


_RUN_AOTI_PACKAGE = textwrap.dedent("""
    import sys, torch  # no fuselab: the package holds the compiled Triton kernels it calls
    for name in sys.argv[2:]:
        runner = torch._inductor.aoti_load_package(f"{sys.argv[1]}/{name}.aoti.pt2")
        x = torch.load(f"{sys.argv[1]}/{name}.x.pt")
        with torch.no_grad():
            torch.save(runner(x).cpu(), f"{sys.argv[1]}/{name}.aoti.out.pt")
    assert "fuselab" not in sys.modules, "loading or running the package imported fuselab"
""")


def _run_aoti_package(directory, name) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", _RUN_AOTI_PACKAGE, str(directory), name],
                          env=env, cwd=directory, capture_output=True, text=True, timeout=300)


def _crashed_loading(result: subprocess.CompletedProcess) -> bool:
    """Killed by a signal inside ``aoti_load_package`` (faulthandler's traceback says where)."""
    return result.returncode < 0 and "in aoti_load_package" in result.stderr


@functools.lru_cache(maxsize=None)
def _plain_aoti_package_run(directory) -> Optional[subprocess.CompletedProcess]:
    """A torch.nn model without fuselab ops packaged and run in a fresh process, once a session (None:
    packaging it failed, which says nothing about the loader)."""
    try:
        model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 10)).cuda().to(torch.bfloat16)
        x = torch.randn(7, 24, device="cuda", dtype=torch.bfloat16)
        torch._inductor.aoti_compile_and_package(torch.export.export(model, (x,)),
                                                 package_path=str(directory / "plain.aoti.pt2"))
        torch.save(x, directory / "plain.x.pt")
    except Exception:
        return None
    return _run_aoti_package(directory, "plain")


def test_only_a_crash_inside_the_aoti_loader_counts_as_the_loaders():
    trace = 'Fatal Python error: Segmentation fault\n  File "/torch/_inductor/__init__.py", line 267 in aoti_load_package\n'
    in_run = 'Fatal Python error: Segmentation fault\n  File "<string>", line 7 in <module>\n'
    assert _crashed_loading(subprocess.CompletedProcess([], -11, "", trace))
    assert not _crashed_loading(subprocess.CompletedProcess([], -11, "", in_run))  # the package's kernels ran
    assert not _crashed_loading(subprocess.CompletedProcess([], 1, "", trace))  # an exception, not a signal


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int8-dynamic", "fp8"])
def test_aoti_package_runs_in_a_process_without_fuselab(tmp_path, tmp_path_factory, name):
    # The CUDA model's deployment: torch.export, then an AOTInductor package (compiled kernels and their
    # C++ launcher, fuselab's Triton kernels included); a process that never imports fuselab runs it.
    if name == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    model, x = _mlp(), torch.randn(7, 24)
    model, x = model.cuda().to(torch.bfloat16), x.cuda().to(torch.bfloat16)
    quantize_(model, _config(name, model, x))
    ep = torch.export.export(model, (x,))
    torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / f"{name}.aoti.pt2"))
    torch.save(x, tmp_path / f"{name}.x.pt")
    with torch.no_grad():
        expected = model(x).float().cpu()
    result = _run_aoti_package(tmp_path, name)
    if _crashed_loading(result):  # the loader itself, or this package? A package with no fuselab op tells
        directory = tmp_path_factory.getbasetemp() / "plain_aoti"
        directory.mkdir(exist_ok=True)
        plain = _plain_aoti_package_run(directory)
        if plain is not None and _crashed_loading(plain):
            pytest.skip(f"torch {torch.__version__}'s aoti_load_package is killed by signal {-result.returncode} on "
                        f"this machine, and by signal {-plain.returncode} loading a plain torch.nn model's package "
                        f"(no fuselab op): {plain.stderr.split('Extension modules')[0][-400:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(tmp_path / f"{name}.aoti.out.pt").float()
    # the same kernels may differ in their tiles only: a few bf16 roundings
    torch.testing.assert_close(loaded, expected, rtol=2**-6, atol=2**-6 * expected.abs().max().item())


# ----------------------------------------------------------------------------------------------
# quantize_: every config, FusedLinearReLU, the report, sizes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_captured_graph_quantizes_its_input_on_every_replay():
    # A quantized model captured after an eager warm-up on the capture's stream, its input unchanged in
    # between: the graph records the input's quantization, so a replay on new data quantizes that data.
    model, x = _mlp().cuda().to(torch.bfloat16), torch.randn(8, 24, device="cuda", dtype=torch.bfloat16)
    quantize_(model, _config("int8-dynamic", model, x))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            model(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = model(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, model(x))


@pytest.mark.parametrize("config", ["int8-dynamic", "int8-static", "fp8"])
def test_every_config_on_an_mlp(config):
    model, x = _mlp(), torch.randn(9, 24)
    floats = [(m.weight.detach().clone(), m.bias.detach().clone(), type(m) is FusedLinearReLU)
              for m in model if isinstance(m, nn.Linear)]
    report = quantize_(model, _config(config, model, x))
    assert list(report.replaced) == ["0", "2", "4"] and not report.skipped
    layer_type = Float8Linear if config == "fp8" else Int8Linear
    kind = "fp8" if config == "fp8" else "int8"
    layers = [m for m in model if isinstance(m, layer_type)]
    assert [layer.relu for layer in layers] == [True, True, False]  # the FusedLinearReLU layers keep their ReLU
    assert "ReLU fused into the epilogue" in report.replaced["0"] and "ReLU" not in report.replaced["4"]
    assert (getattr(layers[0], "act_scale", None) is not None) == (config == "int8-static")
    h = x
    for layer, (weight, bias, relu) in zip(layers, floats):  # each layer on its float input
        check_layer(layer, weight, bias, h, kind, relu)
        h = torch.relu(F.linear(h, weight, bias)) if relu else F.linear(h, weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("relu", [False, True], ids=["linear", "linear-relu"])
def test_a_row_holding_inf_or_nan_comes_out_nan(device, kind, relu):
    # The float layer's row is not finite there; the quantized layer's was infinities of the wrong sign (and, with its
    # ReLU fused, 0 where the float layer gives inf): +inf quantized to -QMAX. Now the row is NaN, never finite.
    torch.manual_seed(0)
    lin = nn.Linear(16, 5).to(device)
    layer = (Float8Linear if kind == "fp8" else Int8Linear).from_float(lin, relu=relu)
    x = torch.randn(4, 16, device=device)
    x[0, 3], x[1, 0], x[2, 7] = float("inf"), float("-inf"), float("nan")
    out = layer(x)
    assert out[:3].isnan().all(), out[:3]
    assert out[3].isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_relu_is_fused_into_the_epilogue(device, monkeypatch):
    # A FusedLinearReLU becomes one GEMM launch with RELU on, no separate ReLU op.
    model = nn.Sequential(FusedLinearReLU(16, 12)).to(device)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    launches = []
    original = scaled_gemm.scaled_gemm
    monkeypatch.setattr(scaled_gemm, "scaled_gemm",
                        lambda *args, **kw: launches.append(args[6]) or original(*args, **kw))  # relu
    with torch.no_grad():
        out = model(torch.randn(5, 16, device=device))
    assert launches == [True] and (out >= 0).all() and (out == 0).any()


def test_report_says_what_was_replaced_and_why_the_rest_was_not():
    class Sub(nn.Linear):
        pass

    hooked = nn.Linear(8, 8)
    hooked.register_forward_hook(lambda m, i, o: o)
    shared = nn.Linear(8, 8)
    masked = nn.Linear(8, 8)  # what the model's forward reads besides the weight (a parent's out_mask, say)
    masked.register_buffer("out_mask", torch.ones(8))
    masked.gain = nn.Parameter(torch.ones(8))
    model = nn.ModuleDict({
        "plain": nn.Linear(8, 8), "fused": FusedLinearReLU(8, 8), "sub": Sub(8, 8), "hooked": hooked,
        "float64": nn.Linear(8, 8).double(), "vetoed": nn.Linear(8, 8), "shared": shared,
        "block": nn.ModuleDict({"again": shared}), "attn": nn.MultiheadAttention(8, 2), "masked": masked,
    })
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda layer, name: name != "vetoed")
    assert set(report.replaced) == {"plain", "fused", "shared"}
    assert report.replaced["fused"] == "Int8Linear (ReLU fused into the epilogue)"
    assert model["block"]["again"] is model["shared"]  # a shared layer: one quantized layer in both places
    assert "not exactly nn.Linear or FusedLinearReLU" in report.skipped["sub"]
    assert "hooks" in report.skipped["hooked"]
    assert "torch.float64" in report.skipped["float64"]
    assert report.skipped["vetoed"] == "vetoed by filter_fn"
    assert "NonDynamicallyQuantizableLinear" in report.skipped["attn.out_proj"]
    # it was replaced, its buffer and parameter gone from the model and its state_dict, silently
    assert report.skipped["masked"] == "holds gain, out_mask besides its weight and bias, which the new layer would drop"
    assert type(model["sub"]) is Sub and type(model["attn"].out_proj) is not Int8Linear and model["masked"] is masked
    text = str(report)
    assert "quantized 3 layer(s) with Int8DynamicActivationInt8WeightConfig; left 6 alone" in text
    assert "skipped  'vetoed': vetoed by filter_fn" in text
    # a filter in fuse_linear_relu's order, (name, layer), vetoes every layer: said (a probe found it silent)
    with pytest.warns(UserWarning, match=r"filter_fn vetoed all 2 layers .* filter_fn\(module, fqn\)"):
        quantize_(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), Int8DynamicActivationInt8WeightConfig(),
                  filter_fn=lambda name, layer: isinstance(layer, nn.Linear))


def test_static_config_leaves_uncalibrated_layers_alone_and_reports_errors():
    model = _mlp()
    x = torch.randn(16, 24)
    calib = calibrate(model, [x], 1, progress=False)
    scales = calib.act_scales()
    del scales["4"]
    report = quantize_(model, Int8StaticActivationInt8WeightConfig(scales), calibration=calib)
    assert set(report.replaced) == {"0", "2"}
    assert "no calibrated activation scale" in report.skipped["4"]
    assert set(report.errors) == {"0", "2"}
    assert all(0 < e < 0.05 for e in report.errors.values()), report.errors  # int8 of Gaussian data: ~1%
    assert "relative error" in str(report) and not report.unused_scales


def test_static_scales_named_after_no_layer_are_refused_or_reported():
    # Scales calibrated on a parent model name its layers "model.0", ...: quantizing the child matched none
    # and left every layer alone, the report guessing "not called while calibrating".
    model = _mlp()
    scales = {f"model.{name}": s for name, s in calibrate(model, [torch.randn(4, 24)], 1, progress=False)
              .act_scales().items()}
    with pytest.raises(ValueError, match="none of the config's 3 act_scales names a layer of this model"):
        quantize_(model, Int8StaticActivationInt8WeightConfig(scales))
    assert all(type(m) is not Int8Linear for m in model.modules())  # nothing changed
    report = quantize_(model, Int8StaticActivationInt8WeightConfig({**scales, "0": 0.01}))
    assert list(report.replaced) == ["0"] and report.unused_scales == sorted(scales)
    assert "unused act_scales (no layer of these names): ['model.0'" in str(report)


def test_unknown_config_and_bad_scales_raise():
    with pytest.raises(TypeError, match="no quantize_ handler for str; known configs: Float8RowwiseConfig"):
        quantize_(_mlp(), "int8")
    for bad in (0.0, 1e-50, 1e-39, 1e38):  # the fp32 reciprocal static quantization multiplies by: inf, subnormal, 0
        with pytest.raises(ValueError, match=_escaped("act_scales['fc'] must be a positive finite number from "
                                                      "1.18e-38 to 8.51e+37 (its fp32 reciprocal a normal number), "
                                                      f"got {bad!r}")):
            Int8StaticActivationInt8WeightConfig({"fc": bad})
    with pytest.raises(Exception):  # frozen: a model's config cannot change under it
        Int8StaticActivationInt8WeightConfig({"fc": 1.0}).act_scales["fc"] = 2.0


def test_a_quantized_layer_names_itself_for_an_input_of_another_width():
    # The GEMM's own error named its operands ("b has shape (13, 7)": the transposed weight).
    for layer in (Int8Linear.from_float(nn.Linear(13, 7)), Float8Linear.from_float(nn.Linear(13, 7))):
        with pytest.raises(ValueError, match=_escaped(f"{type(layer).__name__}(in_features=13) got an input of "
                                                      "shape (3, 12)")):
            layer(torch.randn(3, 12))


@pytest.mark.parametrize("config", ["int8-dynamic", "int8-static"])
def test_int8_state_dict_is_3_9x_smaller(config):
    # Linear-dominated: 2 x (512 x 512) weights. fp32: 4 bytes a weight; int8: 1, plus a 4-byte scale
    # and a 4-byte bias per output channel (and a 4-byte static scale per layer).
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    x = torch.randn(2, 512)
    cfg = (Int8DynamicActivationInt8WeightConfig() if config == "int8-dynamic"
           else Int8StaticActivationInt8WeightConfig(calibrate(model, [x], 1, progress=False).act_scales()))
    quantize_(model, cfg)
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert before == 2 * (512 * 512 + 512) * 4
    assert after == 2 * (512 * 512 + 512 * 4 + 512 * 4) + (8 if config == "int8-static" else 0)
    assert before / after >= 3.9


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=2, dilation=2, groups=4), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1, padding_mode="reflect"), nn.Conv2d(32, 32, 3, padding="same"),
                         nn.Conv2d(32, 32, 1, padding="valid"), nn.Identity(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [dict(kernel_size=3, padding=1), dict(kernel_size=(3, 1), stride=(2, 1)),
                                   dict(kernel_size=3, padding=2, dilation=2, bias=False), dict(kernel_size=1)],
                         ids=["3x3-pad", "3x1-stride", "dilated-nobias", "1x1"])
@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.float16, True), (torch.bfloat16, False)],
                         ids=["fp32", "fp16-channels-last", "bf16"])
def test_int8_conv2d_against_the_float_conv(device, shape, dtype, channels_last):
    # Int8Conv2d's output against F.conv2d in float64, within the quantization bound of its GEMM on the
    # unfolded input (each output position is one token: im2col); the float conv's dtype and memory format.
    conv = nn.Conv2d(6, 10, **shape).to(device, dtype)
    x = torch.randn(2, 6, 9, 8, device=device, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    layer = Int8Conv2d.from_float(conv)
    with torch.no_grad():
        y = layer(x)
    ref = F.conv2d(x.double(), conv.weight.double(), None if conv.bias is None else conv.bias.double(), conv.stride,
                   conv.padding, conv.dilation)
    assert y.shape == ref.shape and y.dtype == dtype
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    rows = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride).transpose(1, 2)
    rows = rows.reshape(-1, rows.shape[-1])
    bound = quantization_bound(rows, conv.weight.reshape(10, -1), layer, "int8")
    assert_close(y.permute(0, 2, 3, 1).reshape(-1, 10), ref.permute(0, 2, 3, 1).reshape(-1, 10), bound, "Int8Conv2d")
    with pytest.raises(ValueError, match=r"\(N, 6, H, W\)"):
        layer(x[:, :5])
    with torch.no_grad():  # unbatched (C, H, W), as nn.Conv2d takes it
        assert torch.equal(layer(x[1]), y[1])


@pytest.mark.parametrize("args,kwargs,words", [((4, 4, 3), dict(groups=2), "grouped"),
                                               ((4, 4, 3), dict(padding=1, padding_mode="reflect"), "'reflect'"),
                                               ((4, 4, 3), dict(padding="same"), "'same'"),
                                               ((4, 0, 3), {}, "no input or no output channels"),
                                               ((3000, 4, 7), {}, "K limit")])
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_int8_conv2d_refuses_what_it_cannot_compute(args, kwargs, words):
    conv = nn.Conv2d(*args, **kwargs)
    with pytest.raises(ValueError, match=words):
        Int8Conv2d.from_float(conv)
    model = nn.Sequential(nn.Conv2d(4, 4, 1), conv)
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig(conv2d=True))
    assert list(report.replaced) == ["0"] and words.strip("'") in report.skipped["1"] and type(model[1]) is nn.Conv2d


def test_quantize_conv_net_with_conv2d():
    # conv2d=True replaces the plain convolutions (the grouped, reflect- and 'same'-padded ones are left,
    # with the reason); the output stays close to the float model's and each replaced layer's weights
    # shrink 4x; the default config replaces the Linear and names every convolution it leaves.
    model, x = _conv_net(), torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    untouched = _conv_net()
    report = quantize_(untouched, Int8DynamicActivationInt8WeightConfig())
    assert list(report.replaced) == ["13"] and all("conv2d=True" in report.skipped[k] for k in ("0", "3", "5"))
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig(conv2d=True))
    assert list(report.replaced) == ["0", "3", "9", "13"] and report.replaced["0"] == "Int8Conv2d"
    assert "grouped convolution (groups=4)" in report.skipped["5"] and "'reflect'" in report.skipped["7"]
    assert "'same'" in report.skipped["8"]
    with torch.no_grad():
        out = model(x)
    assert (out - ref).norm() / ref.norm() < 0.05
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # each replaced layer: 1 byte a weight instead of 4, plus a 4-byte scale per output channel
    weights = {name: m.weight for name, m in _conv_net().named_modules() if name in report.replaced}
    assert before - after == sum(3 * w.numel() - 4 * w.shape[0] for w in weights.values())


def test_state_dict_round_trip():
    model = _mlp()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    fresh = nn.Sequential(Int8Linear(24, 40, relu=True), nn.Identity(), Int8Linear(40, 40, relu=True),
                          nn.Identity(), Int8Linear(40, 10))
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_output_dtype_follows_input_and_autocast():
    model = _mlp()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert model(x).dtype == torch.float32
        assert model(x.to(torch.bfloat16)).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16
        with pytest.raises(TypeError, match="float32, float16 or bfloat16 inputs, got torch.float64"):
            model(x.double())


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------


def test_calibrate_records_ranges_and_samples():
    model = _mlp()
    model.train()
    model[1].eval()  # a module the user froze: its own mode comes back, not the model's
    batches = [(torch.randn(6, 24), torch.zeros(6)) for _ in range(3)]
    calib = calibrate(model, batches + [None], 3, sample_rows=10, progress=True)
    assert [m.training for m in model.modules()] == [True, True, False, True, True, True]  # each mode restored
    assert calib.n_batches == 3
    assert calib.absmax["0"] == max(x.abs().max().item() for x, _ in batches)
    assert calib.samples["0"].shape == (10, 24) and torch.equal(calib.samples["0"][:6], batches[0][0])
    assert calib.samples["2"].shape == (10, 40)
    assert calib.act_scales()["0"] == calib.absmax["0"] / 127
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_calibrate_without_tqdm_and_bad_arguments(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm is optional: absent, there is no progress bar
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    model = _mlp()
    calib = calibrate(model, [torch.randn(2, 24)], 1)
    assert set(calib.absmax) == {"0", "2", "4"}
    with pytest.raises(ValueError, match="the loader ran out after 1 batches; n_batches=2"):
        calibrate(model, [torch.randn(2, 24)], 2)
    with pytest.raises(ValueError, match="n_batches must be a positive int, got 0"):
        calibrate(model, [], 0)


# ----------------------------------------------------------------------------------------------
# DistillationLoss
# ----------------------------------------------------------------------------------------------


def _hand_written_loss(s, t, y, T, alpha):
    """The formula, written out in float64: alpha T^2 mean_n sum_c p_t (log p_t - log p_s) + (1 - alpha) CE."""
    s, t = s.double(), t.double()

    def log_softmax(z):
        z = z - z.max(dim=1, keepdim=True).values
        return z - z.exp().sum(dim=1, keepdim=True).log()

    log_p_s, log_p_t = log_softmax(s / T), log_softmax(t / T)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=1).mean()
    ce = -log_softmax(s)[torch.arange(len(y)), y].mean()
    return alpha * T * T * kl + (1 - alpha) * ce


@pytest.mark.parametrize("T,alpha", [(4.0, 0.9), (1.0, 0.5), (2.5, 0.0), (7.0, 1.0)])
def test_distillation_loss_matches_the_formula(T, alpha):
    s, t = torch.randn(8, 10) * 3, torch.randn(8, 10) * 3
    y = torch.randint(0, 10, (8,))
    loss = DistillationLoss(T, alpha)
    ref = _hand_written_loss(s, t, y, T, alpha)
    torch.testing.assert_close(loss(s.double(), t.double(), y), ref, rtol=1e-12, atol=1e-12)
    # fp32 math: each log-softmax term is within a few ulps of its value; sums of 10 classes and 8 rows.
    torch.testing.assert_close(loss(s, t, y).double(), ref, rtol=64 * EPS * T * T, atol=64 * EPS * T * T)


def test_distillation_loss_gradients():
    s = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (4,))
    assert torch.autograd.gradcheck(lambda s, t: DistillationLoss(3.0, 0.7)(s, t, y), (s, t))


def test_distillation_loss_fp32_under_autocast():
    s, t = torch.randn(6, 7).to(torch.bfloat16), torch.randn(6, 7).to(torch.bfloat16)
    y = torch.randint(0, 7, (6,))
    loss = DistillationLoss(2.0, 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = loss(s, t, y)
    assert under.dtype == torch.float32
    assert torch.equal(under, loss(s.float(), t.float(), y))


@pytest.mark.parametrize("args,message", [
    ((0.0, 0.5), "temperature must be a positive finite number, got 0.0"),
    ((float("inf"), 0.5), "temperature must be a positive finite number, got inf"),
    ((2.0, 1.5), "alpha must be a number in [0, 1], got 1.5"),
    ((2.0, -0.1), "alpha must be a number in [0, 1], got -0.1"),
])
def test_distillation_loss_bad_arguments(args, message):
    with pytest.raises(ValueError, match=_escaped(message)):
        DistillationLoss(*args)


def test_distillation_loss_bad_inputs():
    loss = DistillationLoss()
    s, y = torch.randn(4, 3), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=_escaped("must both be (N, C) of one shape, got (4, 3) and (4, 5)")):
        loss(s, torch.randn(4, 5), y)
    with pytest.raises(ValueError, match=_escaped("target must be (N,) = (4,) int64 class indices")):
        loss(s, s, y.float())
    with pytest.raises(ValueError, match="the batch is empty"):
        loss(s[:0], s[:0], y[:0])


# ----------------------------------------------------------------------------------------------
# The pt2e route for conv nets
# ----------------------------------------------------------------------------------------------


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv1(x)))
        h = torch.relu(self.conv2(h)) + h  # a residual add: eager torch.ao quantization fails here
        return self.fc(h.mean((2, 3)))


def test_pt2e_names_torchao_when_it_is_missing(monkeypatch):
    for name in ("torchao", "torchao.quantization", "torchao.quantization.pt2e",
                 "torchao.quantization.pt2e.quantize_pt2e", "torchao.quantization.pt2e.quantizer",
                 "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"quantize_pt2e_x86 needs torchao.*pip install torchao"):
        quantize_pt2e_x86(_SmallCNN().eval(), (torch.randn(2, 1, 8, 8),), [], 1)


def test_pt2e_leaves_each_modules_mode_as_it_was(monkeypatch):
    # The root's mode was restored for all: a frozen BatchNorm in a training model came back training
    from fuselab.quant import pt2e

    class Quantizer:
        def set_global(self, config):
            pass

    modes = []
    monkeypatch.setattr(pt2e, "_torchao_pt2e", lambda: (
        lambda graph, quantizer: graph, lambda prepared: modes.append([m.training for m in model.modules()]),
        Quantizer, lambda: None))
    model = _SmallCNN().train()
    model.bn.eval()
    want = [m.training for m in model.modules()]
    quantize_pt2e_x86(model, (torch.randn(2, 1, 8, 8),), [torch.randn(2, 1, 8, 8)], 1, progress=False)
    assert [m.training for m in model.modules()] == want == [True, True, False, True, True] and modes


def test_pt2e_static_int8_conv_net():
    pytest.importorskip("torchao.quantization.pt2e", reason="torchao is optional (pip install torchao)")
    model = _SmallCNN().eval()
    batches = [torch.randn(4, 1, 10, 10) for _ in range(3)]
    converted = quantize_pt2e_x86(model, (batches[0],), batches, 3, progress=False)
    targets = {str(n.target) for n in converted.graph.nodes}
    assert any("quantize_per_tensor" in t for t in targets) and any("dequantize_per_channel" in t for t in targets)
    with torch.no_grad():
        ref, out = model(batches[0]), converted(batches[0])
    assert (out - ref).norm() / ref.norm() < 0.05  # 8-bit static quantization: errors of a few 1e-3
    with pytest.raises(ValueError, match="the loader ran out after 1 batches"):
        quantize_pt2e_x86(model, (batches[0],), batches[:1], 2, progress=False)


# ----------------------------------------------------------------------------------------------
# GPU: the Triton paths at realistic shapes
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(4096, 4096, 4096), (8192, 1024, 3072), (16, 4096, 11008), (1000, 1000, 1000)])
def test_int8_gpu_realistic(M, K, N):
    a, b, a_scale, b_scale = _operands(M, K, N, "int8", "cuda")
    # cuBLAS's torch._int_mm where it takes the shape (else float64, exact too): the same integers
    assert torch.equal(int8_matmul(a, b, None, None), int8_matmul(a, b, None, None, backend="torch"))
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    out = int8_matmul(a, b, a_scale, b_scale, bias, True, torch.bfloat16)
    ref, bound = reference(a, b, a_scale, b_scale, bias, True)
    assert_close(out, ref, bound, "int8 on the GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(4096, 4096, 4096), (8192, 1024, 3072), (16, 4096, 11008), (1000, 1000, 1000)])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_gpu_realistic(M, K, N, fast_accum):
    _skip_fp8_without_hardware("cuda")
    a, b, a_scale, b_scale = _operands(M, K, N, "fp8", "cuda")
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    out = fp8_matmul(a, b, a_scale, b_scale, bias, True, torch.bfloat16, fast_accum=fast_accum)
    ref, bound = reference(a, b, a_scale, b_scale, bias, True, fast_accum)
    assert_close(out, ref, bound, f"fp8 on the GPU, fast_accum={fast_accum}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["int8", "int8 static, int8 output", "fp8", "fp8 fast_accum"])
def test_repeated_eager_calls_launch_through_the_cpp_path(case, monkeypatch):
    # A layout's second call is one C++ call (eager_path.scaled_gemm: output, key and launch); its result must be
    # the Python path's bit for bit, and Python's own launcher must not run; 3-D rows too
    from fuselab.kernels import eager_path

    kind = case.split()[0]
    _skip_fp8_without_hardware("cuda", kind)
    if eager_path._load() is None:
        pytest.fail("the C++ eager path did not load on this GPU machine")
    a, b, a_scale, b_scale = _operands(300, 256, 192, kind, "cuda")
    bias = torch.randn(192, device="cuda", dtype=torch.bfloat16)
    if kind == "int8":
        static = "static" in case
        scale = torch.tensor(0.02, device="cuda") if static else a_scale
        extra = {"out_scale": torch.tensor(0.05, device="cuda")} if "output" in case else {}
        call = functools.partial(int8_matmul, a, b, scale, b_scale, bias, True, torch.bfloat16, **extra)
    else:
        call = functools.partial(fp8_matmul, a, b, a_scale, b_scale, bias, True, torch.bfloat16,
                                 fast_accum="fast_accum" in case)
    scale_3d = call.args[2].reshape(3, 100, 1) if call.args[2].numel() > 1 else call.args[2]
    rows = functools.partial(call.func, a.reshape(3, 100, 256), b, scale_3d, *call.args[3:], **call.keywords)
    with eager_path.disabled():
        expected, expected_rows = call(), rows()
    runtime_launches, python_calls = [], []
    real, real_python = scaled_gemm.launch_planned, scaled_gemm.scaled_gemm
    monkeypatch.setattr(scaled_gemm, "launch_planned", lambda *a, **k: runtime_launches.append(1) or real(*a, **k))
    monkeypatch.setattr(scaled_gemm, "scaled_gemm", lambda *a, **k: python_calls.append(1) or real_python(*a, **k))
    first, second = call(), call()
    assert len(runtime_launches) == 1  # the first call planned in Python (and handed the plan to C++) only
    assert len(python_calls) == 1  # the second was one C++ call (eager_path.scaled_gemm): output, key, launch
    assert torch.equal(first, expected) and torch.equal(second, expected)
    first, second = rows(), rows()  # the same rows as (3, 100, K), scales per (batch, row): the same plan
    assert len(python_calls) == 1 and torch.equal(first, expected_rows) and torch.equal(second, expected_rows)


def test_the_quantized_gemm_tries_the_cpp_call_first_and_only_where_it_may(monkeypatch):
    # eager_path.scaled_gemm answers a planned layout in one C++ call; its answer is returned as it is, None
    # leaves the call to Python, and arguments the C++ call cannot take as Python would never reach it
    from fuselab.kernels import eager_path

    asked = []
    answer = {"out": None}

    def cpp(*args):
        asked.append(args)
        return answer["out"]

    monkeypatch.setattr(eager_path, "scaled_gemm", cpp)
    a, b, a_scale, b_scale = _operands(6, 32, 8, "int8", "cpu")
    expected = int8_matmul(a, b, a_scale, b_scale, None, True, torch.float32, backend="torch")
    assert torch.equal(int8_matmul(a, b, a_scale, b_scale, None, True, torch.float32), expected)  # None: Python's
    assert len(asked) == 1 and asked[0][5:11] == (True, torch.int8, torch.float32,
                                                  scaled_gemm._OUT_DTYPE_CODES[torch.float32], None, False)
    answer["out"] = sentinel = torch.full((6, 8), 7.0)
    assert int8_matmul(a, b, a_scale, b_scale, None, True, torch.float32) is sentinel
    int8_matmul(a, b, a_scale, b_scale, None, True, torch.float32, backend="torch")
    int8_matmul(a, b, a_scale, b_scale, None, 1, torch.float32)  # relu not a bool: Python's path
    with pytest.raises(TypeError, match="out_dtype"):
        int8_matmul(a, b, a_scale, b_scale, None, True, "bf16")
    with pytest.raises(TypeError, match="fast_accum"):
        fp8_matmul(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), a_scale, b_scale, fast_accum=None)
    assert len(asked) == 2
    answer["out"] = None
    with pytest.raises(TypeError, match="must both be"):  # the op's operand dtype goes with the call: C++ declines it
        fp8_matmul(a, b, a_scale, b_scale, None, True, torch.float32)
    assert asked[-1][6] == torch.float8_e4m3fn


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["int8-dynamic", "int8-static", "fp8"])
def test_quantized_model_gpu_compiled(config):
    _skip_fp8_without_hardware("cuda", "fp8" if config == "fp8" else "int8")
    torch._dynamo.reset()
    model = _mlp(256, 512, 128).cuda().to(torch.bfloat16)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    floats = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in model if isinstance(m, nn.Linear)]
    report = quantize_(model, _config(config, model, x))
    assert len(report.replaced) == 3
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    # Inductor may round an activation's x / scale to the other neighbouring 8-bit value at a tie, which
    # later layers amplify: the model outputs agree in norm; the derived per-element bound is checked on
    # the first layer, compiled, below.
    assert (compiled.float() - eager.float()).norm() <= 2**-5 * eager.float().norm()
    layer = next(m for m in model if isinstance(m, (Int8Linear, Float8Linear)))
    check_layer(layer, *floats[0], x, "fp8" if config == "fp8" else "int8", relu=True,
                call=torch.compile(layer, fullgraph=True))


# ----------------------------------------------------------------------------------------------
# Found by a skeptical-user probe: each of these gave a wrong number without an error
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_shape,b_shape", [((3, 1), (1, 5)), ((1, 7), (7, 5)), ((4, 6), (6, 1)), ((1, 1), (1, 1))])
def test_int8_size_one_dims_on_the_cpu_path(a_shape, b_shape):
    # torch._int_mm on a CPU misreads the (1, 1) strides a size-1 dim gets (nn.Linear(1, N) always has one).
    a = torch.randint(-127, 128, a_shape, dtype=torch.int8)
    b = torch.randint(-127, 128, tuple(reversed(b_shape)), dtype=torch.int8).t()
    out = int8_matmul(a, b, None, None, backend="torch")
    assert torch.equal(out, a.to(torch.int32) @ b.to(torch.int32))


@pytest.mark.parametrize("layout", ["a expanded", "b expanded", "a row-padded", "b column-padded", "both transposed"])
def test_int8_any_operand_strides_on_the_torch_path(layout):
    # torch._int_mm on a CPU returned garbage for an expanded (stride 0) operand.
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, 8), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (8, 3), dtype=torch.int8, generator=gen)
    if layout == "a expanded":
        a = a[:1].expand(5, 8)
    elif layout == "b expanded":
        b = b[:, :1].expand(8, 3)
    elif layout == "a row-padded":
        a = torch.cat([a, a], 1)[:, :8]
    elif layout == "b column-padded":
        b = torch.cat([b, b]).t().contiguous().t()[:8]
    else:
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    for backend in ("torch", "auto"):
        out = int8_matmul(a, b, None, None, backend=backend)
        assert torch.equal(out, a.to(torch.int32) @ b.to(torch.int32)), (layout, backend)


@pytest.mark.parametrize("config", ["int8-dynamic", "int8-static", "fp8"])
def test_gpt2_conv1d_projections_are_quantized(config):
    # GPT-2's attention and MLP projections are transformers' Conv1D (x @ W + b, W stored (in, out)): once
    # left out and not even reported, so 8 of 9 GEMMs stayed float while the report said "left 0 alone".
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                  activation_function="relu")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model, fused = fuse_linear_relu(model)
    assert "transformer.h.0.mlp.c_fc" in fused.fused  # a FusedConv1DReLU: its ReLU goes into the epilogue
    ids = torch.randint(0, 64, (2, 8))
    calib = calibrate(model, [{"input_ids": ids}], 1, progress=False)
    floats = {name: (m.weight.detach().t().clone(), m.bias.detach().clone())
              for name, m in model.named_modules() if "attn.c_" in name or "mlp.c_" in name}
    report = quantize_(model, _config(config, model, None) if config != "int8-static"
                       else Int8StaticActivationInt8WeightConfig(calib.act_scales()), calibration=calib)
    assert set(floats) | {"lm_head"} <= set(report.replaced), str(report)
    assert "ReLU fused into the epilogue" in report.replaced["transformer.h.0.mlp.c_fc"]
    kind = "fp8" if config == "fp8" else "int8"
    for name, (weight, bias) in floats.items():  # each on its calibration input, against float64
        layer = model.get_submodule(name)
        check_layer(layer, weight, bias, calib.samples[name], kind, name.endswith("c_fc"))
    assert all(e < 0.08 for e in report.errors.values()), report.errors
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_quantized_layers_are_reported_not_silently_passed_over():
    model = _mlp()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    report = quantize_(model, Float8RowwiseConfig())  # a second config: nothing may look converted to fp8
    assert not report.replaced
    assert report.skipped == {n: "already quantized (Int8Linear)" for n in ("0", "2", "4")}
    with pytest.raises(ValueError, match="no nn.Linear, Conv1D or nn.Conv2d layer to observe; its 3 quantized layer"):
        calibrate(model, [torch.randn(2, 24)], 1, progress=False)


def test_transformer_encoder_layer_keeps_its_float_weights():
    # nn.TransformerEncoderLayer's inference fast path reads linear1/linear2's weights itself: an int8
    # weight there raised a dtype error under no_grad.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = layer(x)
    report = quantize_(layer, Int8DynamicActivationInt8WeightConfig())
    assert not report.replaced
    assert "TransformerEncoderLayer.forward reads self.linear1.weight itself" in report.skipped["linear1"]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


class _CastsToItsOutputLayersDtype(nn.Module):
    """As transformers' T5DenseActDense: its forward casts activations to ``self.wo.weight.dtype`` (an fp8
    weight there cast them to fp8 before the layer)."""

    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)).to(self.wo.weight.dtype))


def test_a_parent_that_reads_its_childs_weight_keeps_that_child_float():
    model = _CastsToItsOutputLayersDtype()
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig())
    assert list(report.replaced) == ["wi"] and isinstance(model.wi, Int8Linear)
    assert "_CastsToItsOutputLayersDtype.forward reads self.wo.weight itself" in report.skipped["wo"]
    assert type(model.wo) is nn.Linear
    with torch.no_grad():
        assert model(torch.randn(3, 8)).dtype == torch.float32


class _TiesAGrandchildsWeight(nn.Module):
    """A tied output projection read two levels down, and a ModuleList child's weight read by index: a quantized
    layer there handed its int8 values to F.linear as float weights (relative error ~500, reported replaced)."""

    def __init__(self):
        super().__init__()
        self.block = _CastsToItsOutputLayersDtype()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        h = self.layers[1](self.layers[0](self.block(x)))
        return F.linear(h, self.block.wi.weight[:8]) + self.layers[0].bias + self._tail(h)

    def _tail(self, h):
        last = self.layers[1]  # under a local name
        return h @ last.weight.t()


def test_a_module_above_the_parent_that_reads_a_layers_weight_keeps_that_layer_float():
    torch.manual_seed(0)
    model, x = _TiesAGrandchildsWeight(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig())
    assert "_TiesAGrandchildsWeight.forward reads self.block.wi.weight itself" in report.skipped["block.wi"]
    assert "_TiesAGrandchildsWeight.forward reads self.layers.0.bias itself" in report.skipped["layers.0"]
    assert "reads self.wo.weight itself" in report.skipped["block.wo"]  # the parent's own read, as before
    assert "_TiesAGrandchildsWeight._tail reads self.layers.1.weight itself" in report.skipped["layers.1"]
    assert not report.replaced and type(model.block.wi) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0.05, atol=0.05)


class _ReusesALocalName(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.enc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        m = self.norm
        x = x * m.weight
        m = self.enc  # the name now another module: which one `m.weight` means is not pinned down by the source
        return m(x)


def test_a_local_name_reused_for_other_modules_is_not_taken_for_a_weight_read():
    model = _ReusesALocalName()
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig())
    assert list(report.replaced) == ["enc"], str(report)  # it was left float, "reads self.enc.weight itself"


def test_setting_a_float_weight_on_a_quantized_layer_is_refused():
    # transformers' tie_weights() after quantize_ set the embedding's float weight on the quantized LM head: the
    # next forward raised an int8 GEMM dtype error naming neither the layer nor the cause.
    for layer in (Int8Linear.from_float(nn.Linear(8, 4)), Float8Linear.from_float(nn.Linear(8, 4))):
        dtype = layer.weight.dtype
        with pytest.raises(TypeError, match=_escaped(f"its weight is a {dtype} buffer of the quantization; setting a "
                                                     "torch.float32 tensor there (transformers' tie_weights()")):
            layer.weight = nn.Parameter(torch.randn(4, 8))
        with pytest.raises(TypeError, match="its weight_scale is a torch.float32 buffer"):
            layer.weight_scale = torch.ones(4, dtype=torch.float64)
        assert layer.weight.dtype == dtype and "weight" in layer._buffers  # as it was
        layer.weight = torch.zeros(4, 8, dtype=dtype)  # the quantization's own dtype: allowed
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(TypeError, match=r"Int8Linear\(in_features=32, out_features=64.*tie_weights\(\)"):
        model.tie_weights()
    assert model.lm_head.weight.dtype == torch.int8


def test_a_static_config_without_scales_and_bad_scales_are_refused_by_name():
    model = _mlp()
    with pytest.raises(ValueError, match=r"has no act_scales, so every layer would stay float.*nothing was changed"):
        quantize_(model, Int8StaticActivationInt8WeightConfig())
    empty = calibrate(model, [torch.zeros(0, 24)], 1, progress=False)  # an empty batch: no range seen
    with pytest.raises(ValueError, match="has no act_scales"):
        quantize_(model, Int8StaticActivationInt8WeightConfig(empty.act_scales()))
    assert all(type(m) is not Int8Linear for m in model.modules())
    calib = calibrate(model, [torch.randn(16, 24)], 1, progress=False)
    with pytest.raises(TypeError, match=_escaped("got Calibration (pass its .act_scales())")):
        Int8StaticActivationInt8WeightConfig(calib)
    for qmax, error in ((0, "positive finite"), (-127, "positive finite"), (float("nan"), "positive finite"),
                        (255, "steps end at 127")):
        with pytest.raises(ValueError, match=_escaped("act_scales(qmax") + ".*" + error):
            calib.act_scales(qmax)
    assert calib.act_scales(100)["0"] == calib.absmax["0"] / 100  # headroom above the calibrated range
    # absmax passed where scales belong: scales 127x too large, outputs far off; the report's errors show it
    with pytest.warns(UserWarning, match=r"quantize_: \d quantized layer\(s\) miss their float layer's outputs"):
        quantize_(model, Int8StaticActivationInt8WeightConfig(calib.absmax), calibration=calib)


def test_a_parametrized_layer_is_left_alone_for_its_parametrization():
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), nn.Linear(8, 8))
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig())
    assert report.skipped["0"].startswith("its weight is parametrized") and list(report.replaced) == ["1"]


def test_fuse_linear_relu_after_quantize_says_what_it_met():
    # It reported "fused 0 Linear+ReLU (none); left 0 Linear alone" of a quantized Linear-ReLU pair.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Conv2d(1, 1, 1))
    quantize_(model, Int8DynamicActivationInt8WeightConfig(conv2d=True))
    _, report = fuse_linear_relu(model)
    assert not report.fused and set(report.skipped) == {"0", "2"}
    assert "fuse_linear_relu before quantize_ fuses a ReLU after it" in report.skipped["0"]
    model = _mlp()  # fused, then quantized: the ReLU is in the epilogue
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    _, report = fuse_linear_relu(model)
    assert "its ReLU fused into the GEMM's epilogue" in report.skipped["0"]


def test_int8_layer_past_the_k_limit_is_left_alone():
    model = nn.Sequential(nn.Linear(int8_gemm.MAX_K + 1, 1))
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig())
    assert "above the int8 GEMM's K limit" in report.skipped["0"] and not report.replaced
    assert type(model[0]) is nn.Linear


def test_static_config_copies_pickles_hashes_and_takes_numpy_and_tensor_scales(tmp_path):
    import copy
    import pickle

    import numpy as np

    cfg = Int8StaticActivationInt8WeightConfig({"a": 0.5, "b": np.float32(0.25), "c": torch.tensor(2.0)})
    assert dict(cfg.act_scales) == {"a": 0.5, "b": 0.25, "c": 2.0}
    assert all(type(v) is float for v in cfg.act_scales.values())
    for other in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other == cfg and hash(other) == hash(cfg)
    torch.save({"config": cfg}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=False)["config"] == cfg
    model = _mlp()
    report = quantize_(model, Int8StaticActivationInt8WeightConfig(
        calibrate(model, [torch.randn(4, 24)], 1, progress=False).act_scales()))
    copy.deepcopy(report)
    with pytest.raises(TypeError, match="act_scales must map layer names"):
        Int8StaticActivationInt8WeightConfig([("a", 1.0)])
    with pytest.raises(ValueError, match=_escaped("act_scales['a'] must be a real number, got str")):
        Int8StaticActivationInt8WeightConfig({"a": "0.5"})


def test_config_and_calibration_arguments_are_checked():
    with pytest.raises(TypeError, match=_escaped("a config instance, e.g. Int8DynamicActivationInt8WeightConfig()")):
        quantize_(_mlp(), Int8DynamicActivationInt8WeightConfig)
    with pytest.raises(TypeError, match="calibration must be what calibrate"):
        quantize_(_mlp(), Int8DynamicActivationInt8WeightConfig(), calibration={"0": torch.ones(1, 24)})
    with pytest.raises(TypeError, match="conv2d must be True or False, got 'no'"):
        Int8DynamicActivationInt8WeightConfig(conv2d="no")
    with pytest.raises(ValueError, match="n_batches must be a positive int, got True"):
        calibrate(_mlp(), [torch.randn(2, 24)], True, progress=False)


def test_a_layer_calibrated_on_zeros_is_left_alone():
    # Its scale was the smallest float: every later nonzero input became ~0, and the report said error 0.00.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(-1.0)  # the ReLU makes the second layer's calibration input all zeros
    calib = calibrate(model, [torch.randn(4, 8)], 1, progress=False)
    assert calib.absmax["2"] == 0 and "2" not in calib.act_scales()
    report = quantize_(model, Int8StaticActivationInt8WeightConfig(calib.act_scales()), calibration=calib)
    assert list(report.replaced) == ["0"] and "saw only zeros" in report.skipped["2"]


def test_distillation_batch_without_labels_has_a_zero_hard_term():
    s = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 5, dtype=torch.float64)
    loss = DistillationLoss(2.0, 0.5)(s, t, torch.full((4,), -100))  # was NaN (cross-entropy's 0 / 0)
    soft = DistillationLoss(2.0, 1.0)(s, t, torch.full((4,), -100))
    torch.testing.assert_close(loss, 0.5 * soft)
    target = torch.tensor([1, -100, 3, 0])  # some labelled rows: cross-entropy's mean over those rows
    torch.testing.assert_close(DistillationLoss(2.0, 0.0)(s, t, target), F.cross_entropy(s, target))


def test_distillation_with_masked_teacher_classes_and_alpha_one():
    s = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 5, dtype=torch.float64)
    t[:, 4] = float("-inf")  # a masked class: p_t = 0 adds nothing
    T = 2.0
    p_t = torch.softmax(t[:, :4] / T, -1)
    log_p_s = torch.log_softmax(s / T, -1)[:, :4]
    ref = (p_t * (p_t.log() - log_p_s)).sum() / 4 * T * T
    loss = DistillationLoss(T, 1.0)(s, t, torch.full((4,), -100))  # alpha 1: no hard term, not 0 * NaN
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert torch.isfinite(s.grad).all()


def test_calibration_refuses_nan_and_scales_must_match_their_rows():
    model = nn.Sequential(nn.Linear(8, 4))
    batches = [torch.randn(16, 8) for _ in range(2)]
    batches[1][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        calibrate(model, batches, 2, progress=False)
    a = torch.randint(-127, 128, (2, 3, 8), dtype=torch.int8)
    b = torch.randint(-127, 128, (8, 4), dtype=torch.int8)
    with pytest.raises(ValueError, match="a_scale"):
        int8_matmul(a, b, torch.rand(3, 2), torch.rand(4))  # (T, B) for a (B, T, K) input: transposed
    int8_matmul(a, b, torch.rand(2, 3), torch.rand(4))


def test_dtype_casts_keep_quantized_weights_and_scales():
    q = nn.Sequential(nn.Linear(8, 4))
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    q = q.to(torch.bfloat16)
    assert q[0].weight.dtype == torch.int8 and q[0].weight_scale.dtype == torch.float32
    assert q(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# Misuse a researcher hits: other checkpoints, other dtypes, gradients, tied weights, odd scalars
# ----------------------------------------------------------------------------------------------


def _quantized_copies(model):
    copies = {}
    for name, config in (("int8", Int8DynamicActivationInt8WeightConfig()), ("fp8", Float8RowwiseConfig())):
        copies[name] = copy.deepcopy(model)
        quantize_(copies[name], config)
    return copies


def test_a_checkpoint_of_another_format_is_refused_on_load():
    # load_state_dict casts: an fp8 checkpoint would wrap into int8 weights (and back), a float one truncate.
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    q = _quantized_copies(model)
    for into, source in (("int8", "fp8"), ("fp8", "int8")):
        with pytest.raises(RuntimeError, match=r"0\.weight: the checkpoint holds .* where this"):
            q[into].load_state_dict(q[source].state_dict())
    with pytest.raises(RuntimeError, match="torch.float32 where this Int8Linear holds torch.int8"):
        q["int8"].load_state_dict(model.state_dict(), strict=False)
    again = _quantized_copies(model)["int8"]  # the same format loads
    again.load_state_dict(q["int8"].state_dict())
    assert torch.equal(again[0].weight, q["int8"][0].weight)


def test_a_calibration_taken_in_fp32_serves_the_model_cast_to_bf16_and_a_foreign_one_changes_nothing():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    calib = calibrate(model, [torch.randn(4, 16)], 1, progress=False)
    cast = copy.deepcopy(model).to(torch.bfloat16)
    report = quantize_(cast, Int8StaticActivationInt8WeightConfig(calib.act_scales()), calibration=calib)
    assert set(report.errors) == {"0", "2"} and all(0 < e < 0.1 for e in report.errors.values())
    other = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4))
    foreign = calibrate(other, [torch.randn(4, 12)], 1, progress=False)
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match="calibration sample of '0'.*nothing was changed"):
        quantize_(model, Int8DynamicActivationInt8WeightConfig(), calibration=foreign)
    assert all(type(a) is type(b) for a, b in zip(model, before))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_backward_through_a_quantized_layer_raises_instead_of_dropping_gradients(kind):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    quantize_(model, Int8DynamicActivationInt8WeightConfig() if kind == "int8" else Float8RowwiseConfig(),
              filter_fn=lambda layer, name: name == "2")
    out = model(torch.randn(3, 16))  # the forward runs with grad enabled
    out += 1  # in place after the layer: legal (its output is no view)
    with pytest.raises(RuntimeError, match="quantized layer .* has no backward"):
        out.sum().backward()
    with torch.no_grad():
        assert torch.equal(model(torch.ones(3, 16)), model(torch.ones(3, 16)))


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.mid = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pre(x)
        return h + self.mid(h)  # the output has a gradient through the residual whatever the quantized layer does


def test_a_compiled_backward_through_a_quantized_layer_raises_too():
    # Compiled, the guard was left out: the backward ran and `pre` got the residual's gradient only, silently.
    torch._dynamo.reset()
    model = _Residual()
    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda layer, name: name == "mid")
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="quantized layer .* has no backward"):
        torch.compile(model, backend="aot_eager")(x).sum().backward()
    torch._dynamo.reset()  # else the graph-broken compile above is reused
    with pytest.raises(Exception, match="quantized layer .* has no backward"):  # fullgraph: refused at the forward
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    with torch.no_grad():  # inference compiles whole
        torch.testing.assert_close(torch.compile(model, backend="aot_eager", fullgraph=True)(x), model(x),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("config", [Int8DynamicActivationInt8WeightConfig(), Float8RowwiseConfig()], ids=["int8", "fp8"])
def test_forward_mode_ad_through_a_quantized_layer_raises(config):
    # A custom op carries no tangent: jvp through a frozen model's quantized layer gave a zero tangent
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).requires_grad_(False)
    quantize_(model, config, filter_fn=lambda layer, name: name == "2")
    x, v = torch.randn(3, 8), torch.randn(3, 8)
    with pytest.raises(NotImplementedError, match="quantized layer .* has no forward-mode derivative"):
        torch.func.jvp(model, (x,), (v,))
    with torch.autograd.forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        model(torch.autograd.forward_ad.make_dual(x, v))
    # an input without a tangent (a frozen quantized teacher on fixed inputs): its zero tangent is right
    w, tw = torch.randn(3, 4), torch.randn(3, 4)
    out, tangent = torch.func.jvp(lambda w: (model(x) * w).sum(), (w,), (tw,))
    torch.testing.assert_close(tangent, (model(x) * tw).sum())
    with torch.autograd.forward_ad.dual_level():
        model(x)
    conv = nn.Sequential(nn.Conv2d(2, 4, 3))
    quantize_(conv, Int8DynamicActivationInt8WeightConfig(conv2d=True))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(conv, (torch.randn(1, 2, 5, 5),), (torch.randn(1, 2, 5, 5),))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_forward_mode_ad_through_the_op_carries_the_scales_and_bias_tangents(kind):
    # The op's direct Triton path (the interpreter here, CUDA on a GPU) returned no tangent for a dual scale or
    # bias: silently zero. Under a dual level the op computes by PyTorch's ops, whose tangents are exact.
    matmul = int8_matmul if kind == "int8" else fp8_matmul
    a, b, a_scale, b_scale = _operands(6, 32, 8, kind, "cpu")
    bias = torch.randn(8)
    tangents = (torch.randn_like(a_scale), torch.randn_like(b_scale), torch.randn_like(bias))

    def f(a_scale, b_scale, bias):
        return matmul(a, b, a_scale, b_scale, bias, True, torch.float32)

    out, tangent = torch.func.jvp(f, (a_scale, b_scale, bias), tangents)
    expected, expected_tangent = torch.func.jvp(
        lambda *s: matmul(a, b, *s, True, torch.float32, backend="torch"), (a_scale, b_scale, bias), tangents)
    torch.testing.assert_close(tangent, expected_tangent)
    assert tangent.abs().sum() > 0
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(a_scale, tangents[0])
        tangent = torch.autograd.forward_ad.unpack_dual(f(dual, b_scale, bias)).tangent
    assert tangent is not None and tangent.abs().sum() > 0


def test_reverse_mode_transforms_and_jit_trace_say_a_quantized_layer_has_no_backward():
    # torch.func.grad/jacrev raised torch's "must override the setup_context staticmethod"; torch.jit.trace
    # with a grad-requiring input failed inside torch ("unordered_map::at")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda layer, name: name == "1")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="quantized layer .* has no backward"):
        torch.func.grad(lambda x: model(x).sum())(x)
    with pytest.raises(RuntimeError, match="quantized layer .* has no backward"):
        torch.func.jacrev(model)(x)
    with pytest.raises(RuntimeError, match="trace under torch.no_grad"):
        torch.jit.trace(model, x)


def test_quantized_layers_take_their_float_layers_argument_names():
    # nn.Linear.forward(input), nn.Conv2d.forward(input): a caller's fc(input=h) broke after quantize_
    x = torch.randn(3, 8)
    for layer in (Int8Linear.from_float(nn.Linear(8, 4)), Float8Linear.from_float(nn.Linear(8, 4))):
        torch.testing.assert_close(layer(input=x), layer(x), rtol=0, atol=0)
    conv, img = Int8Conv2d.from_float(nn.Conv2d(2, 4, 3)), torch.randn(1, 2, 5, 5)
    torch.testing.assert_close(conv(input=img), conv(img), rtol=0, atol=0)


def test_from_float_refuses_a_linear_subclass_with_its_own_forward():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(nn.Linear):  # no forward of its own: nn.Linear's computation
        pass

    for cls in (Int8Linear, Float8Linear):
        with pytest.raises(TypeError, match="Doubled has its own forward"):
            cls.from_float(Doubled(8, 4))
        cls.from_float(Plain(8, 4))
        cls.from_float(FusedLinearReLU(8, 4))


def test_a_tied_weight_is_reported_as_untied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    report = quantize_(Tied(), Int8DynamicActivationInt8WeightConfig())
    assert "shared with embed: the quantized layer holds its own copy" in report.replaced["head"]
    aliased = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    aliased.head = aliased[0]  # one layer under two names: replaced at both, nothing shared
    report = quantize_(aliased, Int8DynamicActivationInt8WeightConfig())
    assert report.replaced == {"0": "Int8Linear"} and aliased.head is aliased[0]


def test_a_static_layer_built_under_a_16_bit_default_dtype_loads_an_fp32_checkpoint():
    saved = Int8Linear(4, 3, static=True).state_dict()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as transformers' from_pretrained(torch_dtype=...) does
    try:
        layer = Int8Linear(4, 3, static=True)
    finally:
        torch.set_default_dtype(default)
    layer.load_state_dict(saved)
    assert layer.act_scale.dtype == torch.float32


def test_distillation_loss_takes_numpy_and_tensor_scalars_but_not_a_learned_temperature():
    numpy = pytest.importorskip("numpy")
    loss = DistillationLoss(numpy.float32(2.0), torch.tensor(0.5))
    assert (loss.temperature, loss.alpha) == (2.0, 0.5) and type(loss.temperature) is float
    with pytest.raises(TypeError, match="requires grad"):
        DistillationLoss(torch.tensor(2.0, requires_grad=True))


def test_calibrate_refuses_inf_and_reads_a_keyword_input():
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="holds inf"):
        calibrate(model, [torch.tensor([[1.0, float("inf"), 0.0, 0.0]])], 1, progress=False)

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(input=x)

    calib = calibrate(Keyword(), [torch.full((2, 4), 3.0)], 1, progress=False)
    assert calib.absmax["fc"] == 3.0
    # (inputs, labels) with the inputs a mapping, as transformers' collators make them: keyword arguments
    calib = calibrate(Keyword(), [({"x": torch.full((2, 4), 5.0)}, torch.zeros(2))], 1, progress=False)
    assert calib.absmax["fc"] == 5.0

    class TwoInputs(Keyword):
        def forward(self, x, y=None):
            return self.fc(input=y)

    with pytest.raises(ValueError, match="without a tensor input .* a model of several inputs takes them from a "
                                         "mapping"):
        calibrate(TwoInputs(), [(torch.ones(2, 4), torch.ones(2, 4))], 1, progress=False)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_from_float_keeps_a_fused_relu_and_checks_its_arguments(kind):
    # from_float of a FusedLinearReLU fuses its ReLU (relu=False would drop it: refused); a static scale must be
    # positive and finite; a layer that is not a Linear is named.
    cls = Int8Linear if kind == "int8" else Float8Linear
    torch.manual_seed(0)
    fused, x = FusedLinearReLU.from_linear(nn.Linear(8, 4)), torch.randn(16, 8)
    with torch.no_grad():
        assert cls.from_float(fused).relu and cls.from_float(fused)(x).min() >= 0
        assert not cls.from_float(nn.Linear(8, 4)).relu
    with pytest.raises(ValueError, match="relu=False.*would drop its ReLU"):
        cls.from_float(fused, relu=False)
    with pytest.raises(TypeError, match="takes an nn.Linear.*got a Conv2d"):
        cls.from_float(nn.Conv2d(3, 4, 3))
    if kind == "int8":
        for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-40, 1e39):
            with pytest.raises(ValueError, match="act_scale must be a positive finite number"):
                Int8Linear.from_float(nn.Linear(8, 4), act_scale=bad)
        static = Int8Linear.from_float(nn.Linear(8, 4), act_scale=0.05)
        for bad in (0.0, float("inf"), -0.05):  # a checkpoint's scale, checked at load (the layer would zero or saturate)
            state = {**static.state_dict(), "act_scale": torch.tensor(bad)}
            with pytest.raises(RuntimeError, match="act_scale must be a positive finite number"):
                static.load_state_dict(state)
        assert static.act_scale.item() == pytest.approx(0.05)
        meta = {k: v.to("meta") for k, v in static.state_dict().items()}  # no value to check: loaded as it is
        Int8Linear.from_float(nn.Linear(8, 4), act_scale=0.05).load_state_dict(meta, assign=True)


def test_a_layer_held_under_two_names_is_calibrated_and_quantized_under_one():
    # calibrate and quantize_ name a layer alike (named_modules' first name): the static config finds its scale.
    class TwoNames(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.proj = self.body[0]  # a second name, nearer the root

        def forward(self, x):
            return self.body(x)

    model = TwoNames()
    calib = calibrate(model, [torch.randn(4, 8)], 1, progress=False)
    assert list(calib.absmax) == ["body.0"]
    report = quantize_(model, Int8StaticActivationInt8WeightConfig(calib.act_scales()), calibration=calib)
    assert list(report.replaced) == ["body.0"] and "body.0" in report.errors and not report.skipped
    assert isinstance(model.proj, Int8Linear) and model.proj is model.body[0]


def test_calibrate_takes_a_batch_encoding_and_records_conv_inputs_for_their_errors():
    from transformers import BatchEncoding

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, input_ids):
            return self.fc(input_ids)

    calib = calibrate(Keywords(), [BatchEncoding({"input_ids": torch.full((2, 4), 2.0)})], 1, progress=False)
    assert calib.absmax["fc"] == 2.0
    # every Int8Conv2d quantize_ makes gets its error on the images its convolution saw
    model, x = _conv_net(), torch.randn(4, 3, 16, 16)
    calib = calibrate(model, [x], 1, sample_rows=300, progress=False)
    assert calib.samples["0"].shape == (2, 3, 16, 16) and "0" not in calib.absmax  # 300 positions: 2 images
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig(conv2d=True), calibration=calib)
    assert set(report.errors) == set(report.replaced) and all(0 < e < 0.05 for e in report.errors.values())


def test_a_quantized_model_infers_shapes_on_meta_and_keeps_a_bias_it_can_use():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    meta = copy.deepcopy(model).to("meta")
    assert meta(torch.randn(2, 5, 8, device="meta")).shape == (2, 5, 4)
    model.double()  # the bias stays in a dtype the epilogue takes
    assert model[0].bias.dtype == torch.float32 and model(torch.randn(3, 8)).dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# What a mutation audit found no test for (a deliberately broken epilogue passed every test)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_scaled_gemm_relu_propagates_nan(kind):
    # SG2: a NaN in the epilogue (here a NaN row scale) must stay NaN through the fused ReLU, as torch.relu.
    M, K, N = 3, 16, 5
    if kind == "int8":
        a = torch.randint(-127, 128, (M, K), dtype=torch.int8)
        b = torch.randint(-127, 128, (K, N), dtype=torch.int8)
        mm = int8_matmul
    else:
        a, b = torch.randn(M, K).to(torch.float8_e4m3fn), torch.randn(K, N).to(torch.float8_e4m3fn)
        mm = fp8_matmul
    a_scale = torch.rand(M) + 0.1
    a_scale[1] = float("nan")
    b_scale = torch.rand(N) + 0.1
    out = mm(a, b, a_scale, b_scale, None, True, torch.float32, backend="triton")
    ref = mm(a, b, a_scale, b_scale, None, True, torch.float32, backend="torch")
    assert out[1].isnan().all() and ref[1].isnan().all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_scaled_gemm_epilogue_has_torchs_bits(kind):
    # SG4: the kernel's epilogue runs torch_epilogue's fp32 operations in its order: the same bits.
    M, K, N = 33, 40, 20
    if kind == "int8":
        (a, a_scale), (w, b_scale) = quantize_int8_rowwise(torch.randn(M, K)), quantize_int8_rowwise(torch.randn(N, K))
        mm = int8_matmul
    else:  # small integers: fp32 sums of their products are exact in any order, as int8's are
        a, w = (torch.randint(-8, 9, shape).float().to(torch.float8_e4m3fn) for shape in ((M, K), (N, K)))
        a_scale, b_scale = torch.rand(M) + 0.5, torch.rand(N) + 0.5
        mm = fp8_matmul
    bias = torch.randn(N)
    out = mm(a, w.t(), a_scale, b_scale, bias, True, torch.float32, backend="triton")
    ref = mm(a, w.t(), a_scale, b_scale, bias, True, torch.float32, backend="torch")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_int8_raw_accumulators_past_2_to_24_are_exact_in_the_kernel():
    # SG5: |acc| > 2**24 (not exact in fp32) through the Triton kernel, not only the torch path.
    K = 1100
    a = torch.full((2, K), 127, dtype=torch.int8)
    b = torch.full((K, 3), 127, dtype=torch.int8)
    b[0, :] = 2  # 1099 * 16129 + 254: odd, above 2**24
    acc = int8_matmul(a, b, None, None, backend="triton")
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ b.long())
