"""fuselab.kernels.matmul_relu_triton (the fused op): values, gradients (higher-order and forward-mode too), registration,
errors. Autotuning and launch plans are tested in test_autotune.py and test_launch_plans.py.

On a CPU the Triton kernels run in the interpreter (conftest); on a GPU run `pytest -m gpu`.
"""
import importlib

import pytest
import torch
from reference import BIAS_LAYOUTS, DEVICES, DTYPES, check_forward_backward, rand_bias, randn

import fuselab
from fuselab.kernels import linear_relu, matmul_relu
from fuselab.kernels._runtime import INTERPRET

matmul_relu_module = importlib.import_module("fuselab.kernels.matmul_relu_triton")

SHAPES = [(37, 53, 29), (1, 19, 33), (65, 8, 70)]  # (M, K, N): odd, a row of 1, a short K


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_contiguous(device, dtype, M, K, N, with_bias):
    a = randn(M, K, dtype=dtype, device=device)
    b = randn(K, N, dtype=dtype, device=device)
    bias = torch.randn(N, dtype=dtype, device=device) if with_bias else None
    check_forward_backward(a, b, bias, dtype)


@pytest.mark.xfail(INTERPRET, strict=True, reason=(
    "the interpreter's bf16 cast truncates; the GEMM's store goes through _casts.cast_rne with its next GPU sweep "
    "(its shipped configs' fingerprint covers its source)"))
@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_output_is_rounded_to_nearest_even(device):
    # 259 = 256 + 2 + 1 is a tie between bf16's 258 and 260: to even, 260 (the interpreter's cast truncated: 258)
    a = torch.ones(2, 259, dtype=torch.bfloat16, device=device)
    b, bias = torch.ones(259, 3, dtype=torch.bfloat16, device=device), torch.zeros(3, dtype=torch.bfloat16, device=device)
    assert matmul_relu(a, b).eq(260).all() and matmul_relu(a, b, bias).eq(260).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("a_layout,b_layout", [("transposed", "contiguous"), ("contiguous", "transposed"),
                                               ("sliced", "sliced"), ("transposed", "transposed")])
def test_layouts(device, dtype, a_layout, b_layout):
    M, K, N = 45, 38, 27
    a = randn(M, K, dtype=dtype, device=device, layout=a_layout)
    b = randn(K, N, dtype=dtype, device=device, layout=b_layout)
    assert a_layout == "contiguous" or not a.is_contiguous()
    check_forward_backward(a, b, torch.randn(N, dtype=dtype, device=device), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_on_load", [True, False], ids=["mask-on-load", "grad-written"])
@pytest.mark.parametrize("a_layout,b_layout", [("transposed", "sliced"), ("sliced", "transposed")])
def test_both_backward_paths(device, mask_on_load, a_layout, b_layout, monkeypatch):
    # The backward masks dY on load (no TMA) or writes G once (TMA): both must be right anywhere.
    monkeypatch.setattr(matmul_relu_module, "_mask_on_load", lambda grad: mask_on_load)
    dtype = torch.float32
    a = randn(37, 29, dtype=dtype, device=device, layout=a_layout)
    b = randn(29, 22, dtype=dtype, device=device, layout=b_layout)
    check_forward_backward(a, b, torch.randn(22, dtype=dtype, device=device), dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the GPU's configs (CPU only)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)  # bf16 dot is garbage there
@pytest.mark.parametrize("b_layout", ["contiguous", "transposed"])
def test_every_gpu_config_in_the_interpreter(dtype, b_layout, monkeypatch):
    # Each config the GPU's tuner may pick, TMA bodies included (the interpreter runs tensor descriptors),
    # on a CPU: a wrong tile, mask or epilogue fails here before any GPU run. test_matmul_relu_gpu.py
    # runs them compiled.
    import triton
    from reference import assert_close, dot_bound

    monkeypatch.setattr(matmul_relu_module, "has_tma", lambda device: True)  # the TMA body's layouts qualify
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    M, N, K = 300, 264, 136  # not multiples of any block; rows 16-byte aligned for TMA
    a, b = randn(M, K, dtype=dtype, device="cpu"), randn(K, N, dtype=dtype, device="cpu", layout=b_layout)
    biases = [rand_bias(N, dtype, "cpu", layout) for layout in ("contiguous", "column", "broadcast")]
    configs = matmul_relu_module.gemm_configs(interpret=False)
    assert {c.kwargs["TMA"] for c in configs} == {False, True} and len(configs) > 10
    for i, config in enumerate(configs):
        bias = biases[i % 3]
        c = torch.full((M, N), float("nan"), dtype=dtype)  # poison: every element must be written
        matmul_relu_module._gemm(a, b, c, bias=bias, relu=True, config=config)
        ref = torch.relu(a.double() @ b.double() + bias.double())
        bound = dot_bound(dtype, K, a.double().abs(), b.double().abs()) + 2.0**-24 * bias.double().abs()
        assert_close(c, ref, bound, f"forward, config {config}, bias stride {bias.stride(0)}")
    g, y = randn(M, N, dtype=dtype, device="cpu"), randn(M, N, dtype=dtype, device="cpu")
    gm = torch.where(y <= 0, 0, g).double()
    for config in configs:  # the backward's products: masked on load with row sums (pointer body), or bare
        out = torch.full((N, K), float("nan"), dtype=dtype)
        if config.kwargs["TMA"]:
            matmul_relu_module._gemm(gm.t().to(dtype), a, out, config=config)
        else:
            rowsum = torch.full((N,), float("nan"), dtype=torch.float32)
            matmul_relu_module._gemm(g.t(), a, out, y=y.t(), rowsum=rowsum, config=config)
            ones = torch.ones(M, 1, dtype=torch.float64)
            assert_close(rowsum, gm.sum(0), dot_bound(dtype, M, gm.abs().t(), ones).squeeze(1), f"dbias {config}")
        assert_close(out, gm.t() @ a.double(), dot_bound(dtype, M, gm.abs().t(), a.double().abs()), f"dB^T {config}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b_layout,bias_layout", [("contiguous", "contiguous"), ("transposed", "strided"),
                                                  ("transposed", "broadcast"), ("contiguous", None)])
def test_where_the_tuner_chose_cublas(python_eager_path, device, dtype, b_layout, bias_layout, cublas_preferred, monkeypatch):
    # Where the tuner finds cuBLAS faster, the forward is addmm (mm) and an in-place ReLU, and the
    # backward's products (G written first, as on Hopper) are mm: the op's results and NaN rule stay.
    monkeypatch.setattr(matmul_relu_module, "_mask_on_load", lambda grad: False)
    a = randn(37, 29, dtype=dtype, device=device)
    b = randn(29, 22, dtype=dtype, device=device, layout=b_layout)
    bias = rand_bias(22, dtype, device, bias_layout) if bias_layout else None
    check_forward_backward(a, b, bias, dtype)
    if device == "cuda" and dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        assert not cublas_preferred.cache  # exact fp32 on a GPU is cuBLAS's SGEMM, never tuned
    else:
        assert {str(c) for c in cublas_preferred.cache.values()} == {"cublas"} and len(cublas_preferred.cache) == 3
    a = a.detach().clone()
    a[3, 4] = float("nan")
    y = matmul_relu(a, b.detach(), None if bias is None else bias.detach())
    assert torch.isnan(y[3]).all() and not torch.isnan(y[:3]).any()  # torch.relu's rule, not max(x, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_cublas_takes_inputs_that_require_grad(device, cublas_preferred):
    # A direct _gemm call (the sweep's, a user's) with leaves that require grad while grad mode is on:
    # the out= ops would refuse them; the call runs without recording a graph, as the kernel does.
    a, b = randn(20, 12, dtype=torch.float32, device=device), randn(12, 9, dtype=torch.float32, device=device)
    bias = torch.randn(9, device=device)
    a.requires_grad_(True)
    c = torch.empty(20, 9, device=device)
    matmul_relu_module._gemm(a, b, c, bias=bias, relu=True)
    assert str(cublas_preferred.best_config) == "cublas" and c.grad_fn is None
    assert torch.equal(c, torch.relu(torch.addmm(bias, a.detach(), b)))


@pytest.mark.parametrize("device", DEVICES)
def test_cublas_is_not_offered_where_the_mask_is_applied_on_load(python_eager_path, device, cublas_preferred, monkeypatch):
    monkeypatch.setattr(matmul_relu_module, "_mask_on_load", lambda grad: True)
    a, b = randn(37, 29, dtype=torch.float32, device=device), randn(29, 22, dtype=torch.float32, device=device)
    check_forward_backward(a, b, torch.randn(22, device=device), torch.float32)
    names = cublas_preferred.keys
    for key, config in cublas_preferred.cache.items():
        flags = dict(zip(names, key))
        assert (str(config) == "cublas") == (not flags["MASK_A"]), (flags, config)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_and_linear(device, dtype):
    x = torch.randn(2, 3, 21, dtype=dtype, device=device)
    w = torch.randn(17, 21, dtype=dtype, device=device)  # nn.Linear layout (N, K)
    bias = torch.randn(17, dtype=dtype, device=device)
    y = check_forward_backward(x, w.t(), bias, dtype)
    assert y.shape == (2, 3, 17)
    torch.testing.assert_close(linear_relu(x.detach(), w, bias), y.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_layout", BIAS_LAYOUTS)
def test_bias_layouts(device, dtype, bias_layout):
    # A bias of any strides is read at its strides (a slice, a column, an expanded scalar: stride 0);
    # N spans two column tiles, so a tile that indexes the bias from 0 is caught too.
    M, K, N = 19, 23, 45
    bias = rand_bias(N, dtype, device, bias_layout)
    assert bias_layout == "contiguous" or not bias.is_contiguous()
    check_forward_backward(randn(M, K, dtype=dtype, device=device),
                           randn(K, N, dtype=dtype, device=device, layout="transposed"), bias, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_layout", BIAS_LAYOUTS)
def test_bias_layouts_pytorch_kernels(device, bias_layout, monkeypatch):
    # The same where PyTorch's kernels run (plain CPU; exact fp32 on a GPU), through the registered op.
    monkeypatch.setattr(matmul_relu_module, "_runs_triton", lambda t: False)
    bias = rand_bias(29, torch.float32, device, bias_layout)
    check_forward_backward(torch.randn(2, 7, 17, device=device), torch.randn(17, 29, device=device), bias,
                           torch.float32, op=torch.ops.fuselab.matmul_relu)


@pytest.mark.parametrize("a_layout,b_layout", [("contiguous", "transposed"), ("transposed", "sliced")])
@pytest.mark.parametrize("mask_on_load", [True, False], ids=["mask-on-load", "grad-written"])
def test_pytorch_kernel_bodies(a_layout, b_layout, mask_on_load, monkeypatch):
    # The op's bodies when PyTorch's GEMMs run (plain CPU; exact fp32 on a GPU): values, gradients,
    # batched input, and outputs laid out as the fake implementations say (opcheck).
    monkeypatch.setattr(matmul_relu_module, "_runs_triton", lambda t: False)
    assert not matmul_relu_module._mask_on_load(torch.ones(1))  # G once, not masked again per product
    monkeypatch.setattr(matmul_relu_module, "_mask_on_load", lambda grad: mask_on_load)
    dtype = torch.float32
    b = randn(23, 19, dtype=dtype, device="cpu", layout=b_layout)
    check_forward_backward(randn(31, 23, dtype=dtype, device="cpu", layout=a_layout), b,
                           torch.randn(19), dtype)
    check_forward_backward(torch.randn(2, 5, 23), b.detach(), None, dtype)
    a = randn(31, 23, dtype=dtype, device="cpu", layout=a_layout)
    torch.library.opcheck(torch.ops.fuselab.matmul_relu, (a.requires_grad_(True), b, torch.randn(19)))
    y = matmul_relu(a, b).detach()
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.fuselab.matmul_relu_grad_a, (dy, y, b.detach()))
    torch.library.opcheck(torch.ops.fuselab.matmul_relu_grad_b, (dy, y, a.detach(), b.detach()))


@pytest.mark.parametrize("torch_kernels", [True, False], ids=["pytorch-kernels", "triton"])
def test_autocast_leaves_the_op_in_its_inputs_dtype(torch_kernels, monkeypatch):
    # The op computes in its inputs' dtype, as its fake says: under CPU autocast the PyTorch-kernel body
    # returned bf16 (its addmm was autocast), the Triton one fp32.
    if torch_kernels:
        monkeypatch.setattr(matmul_relu_module, "_runs_triton", lambda t: False)
    a, w, bias = torch.randn(2, 5, 23, requires_grad=True), torch.randn(19, 23), torch.randn(19)
    ref = torch.relu(torch.nn.functional.linear(a.detach().double(), w.double(), bias.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_relu(a, w, bias)
        direct = torch.ops.fuselab.matmul_relu(a.detach(), w.t(), bias)
        y.backward(torch.ones_like(y))
    assert y.dtype == direct.dtype == a.grad.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 math: bf16's error is ~1e-2
    torch.testing.assert_close(direct, y.detach())


@pytest.mark.parametrize("torch_kernels", [True, False], ids=["pytorch-kernels", "triton"])
def test_an_output_takes_in_place_ops(torch_kernels, monkeypatch):
    # The PyTorch-kernel body returned a view of its result: any in-place op on the output (a ReLU(inplace)
    # after a fused layer) failed with autograd's "a view created inside a custom Function".
    if torch_kernels:
        monkeypatch.setattr(matmul_relu_module, "_runs_triton", lambda t: False)
    a, w = torch.randn(2, 5, 23, requires_grad=True), torch.randn(19, 23, requires_grad=True)
    y = linear_relu(a, w)
    y.mul_(2)
    torch.testing.assert_close(y, 2 * torch.relu(a @ w.t()))
    dy = torch.randn(2, 5, 19)
    ga, = torch.autograd.grad(linear_relu(a, w), a, dy)
    ga.add_(1)  # a gradient from the backward body, modified in place (a hook's clip, say)


@pytest.mark.gpu
def test_exact_fp32_runs_cublas():
    # At torch's default fp32 precision the op runs cuBLAS's SGEMM and a ReLU (faster than Triton's
    # exact-fp32 dot): the output is torch's own, bit for bit (Triton's sums in another order).
    assert torch.get_float32_matmul_precision() == "highest"
    a = randn(300, 259, dtype=torch.float32, device="cuda", layout="transposed").requires_grad_(True)
    w = torch.randn(133, 259, device="cuda", requires_grad=True)
    bias = torch.randn(133, device="cuda", requires_grad=True)
    dy = torch.randn(300, 133, device="cuda")
    results = []
    for fn in (linear_relu, lambda x, w, bias: torch.relu(torch.nn.functional.linear(x, w, bias))):
        y = fn(a, w, bias)
        results.append((y.detach(), *torch.autograd.grad(y, (a, w, bias), dy)))
    assert torch.equal(results[0][0], results[1][0])
    for ours, torchs in zip(results[0][1:], results[1][1:]):  # cuBLAS may pick another algorithm per layout
        torch.testing.assert_close(ours, torchs)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates(device):
    a = torch.randn(9, 12, device=device)
    b = torch.randn(12, 7, device=device)
    a[4, 5] = float("nan")  # row 4 of a @ b is NaN, and relu keeps it NaN
    y = matmul_relu(a, b)
    others = torch.arange(9, device=device) != 4
    assert y[4].isnan().all() and not y[others].isnan().any()
    torch.testing.assert_close(y[others], torch.relu(a[others] @ b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sizes(device):
    bias = torch.randn(5, device=device)
    k0 = matmul_relu(torch.randn(4, 0, device=device), torch.randn(0, 5, device=device), bias)
    torch.testing.assert_close(k0, torch.relu(bias).expand(4, 5), rtol=0, atol=0)
    assert matmul_relu(torch.randn(0, 6, device=device), torch.randn(6, 5, device=device)).shape == (0, 5)
    assert matmul_relu(torch.randn(2, 0, 6, device=device), torch.randn(6, 5, device=device)).shape == (2, 0, 5)
    assert matmul_relu(torch.randn(3, 6, device=device), torch.randn(6, 0, device=device)).shape == (3, 0)
    a = torch.randn(3, 0, device=device, requires_grad=True)
    b = torch.randn(0, 4, device=device, requires_grad=True)
    bias = torch.randn(4, device=device, requires_grad=True)
    dy = torch.randn(3, 4, device=device)
    matmul_relu(a, b, bias).backward(dy)
    torch.testing.assert_close(bias.grad, torch.where(bias.detach() <= 0, 0, dy).sum(0))


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_at_zero_matches_torch(device):
    # A column that is exactly 0 before the ReLU: torch's gradient is 0 there, and so is ours.
    a = torch.randn(8, 10, device=device, requires_grad=True)
    b = torch.randn(10, 6, device=device)
    b[:, 2] = 0
    b.requires_grad_(True)
    dy = torch.randn(8, 6, device=device)
    matmul_relu(a, b).backward(dy)
    a_ref, b_ref = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    torch.relu(a_ref @ b_ref).backward(dy)
    assert (b.grad[:, 2] == 0).all() and (b_ref.grad[:, 2] == 0).all()
    torch.testing.assert_close(a.grad, a_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    a = torch.randn(70, 33, device=device, dtype=torch.float16)
    b = torch.randn(33, 40, device=device, dtype=torch.float16)
    assert torch.equal(matmul_relu(a, b), matmul_relu(a, b))


# ----------------------------------------------------------------------------------------------
# Higher-order and forward-mode gradients: PyTorch's, through every entry point
# ----------------------------------------------------------------------------------------------


def torch_matmul_relu(a, b, bias=None):
    return torch.relu(a @ b if bias is None else a @ b + bias)


# The eager Function (Triton bodies), the registered op (as traced or subclassed calls reach it),
# and the op's PyTorch-kernel bodies (plain CPU; exact fp32 on a GPU).
PATHS = ["eager", "op", "pytorch-kernels"]


@pytest.fixture
def fuselab_op(request, monkeypatch):
    """``matmul_relu`` as the path named by the test's ``path`` parameter runs it."""
    if request.getfixturevalue("device") == "cuda":  # fp32 at "highest" runs cuBLAS: Triton needs "high"
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        request.addfinalizer(lambda: torch.set_float32_matmul_precision(previous))
    path = request.getfixturevalue("path")
    if path == "pytorch-kernels":
        monkeypatch.setattr(matmul_relu_module, "_runs_triton", lambda t: False)
    if path == "op":
        return lambda a, b, bias=None: torch.ops.fuselab.matmul_relu(a, b, bias)
    return matmul_relu


def assert_matches_torch(ours, ref, what, device):
    """Elementwise, relative to the reference's largest entry (tf32 on a GPU, fp32 on a CPU). A
    dropped term is an error of the order of that entry."""
    assert len(ours) == len(ref), what
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert o is not None and o.shape == r.shape, f"{what}[{i}]: {o} vs shape {tuple(r.shape)}"
        finite = r[~r.isnan()].abs()
        scale = (finite.max().item() if finite.numel() else 0.0) or 1.0
        tol = 1e-2 if device == "cuda" else 1e-4
        torch.testing.assert_close(o, r, rtol=tol, atol=tol * scale, equal_nan=True, msg=lambda m: f"{what}[{i}]: {m}")


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def away_from_the_kink(a, b, bias, margin=0.05):
    """``(a, b, bias)`` redrawn until no pre-activation is within ``margin`` of 0: on a GPU the fused
    forward (tf32) and torch's may round a pre-activation near 0 to opposite sides, and the two ReLU
    masks then differ by a whole term, a true difference of the inputs, not of the gradients."""
    for _ in range(1000):
        if (a.double() @ b.double() + bias.double()).abs().min() > margin:
            return a, b, bias
        a, b, bias = torch.randn_like(a), torch.randn_like(b), torch.randn_like(bias)
    raise AssertionError("could not draw inputs away from the ReLU's kink")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_torch(device, path, fuselab_op):
    # create_graph=True: the gradients have a graph, and its gradients are torch.relu's. The loss's
    # dY = w + 2Y is nonzero where Y = 0 (the mask matters) and depends on Y (so does its derivative).
    inputs = away_from_the_kink(torch.randn(13, 11, device=device), torch.randn(11, 9, device=device),
                                torch.randn(9, device=device))
    w = torch.randn(13, 9, device=device)
    vs = [torch.randn_like(t) for t in inputs]

    def first_and_second(fn):
        a, b, bias = leaves(*inputs)
        y = fn(a, b, bias)
        grads = torch.autograd.grad((y * w + y * y).sum(), (a, b, bias), create_graph=True)
        assert all(g.requires_grad for g in grads), "first-order gradients without a graph"
        probe = sum((g * v).sum() for g, v in zip(grads, vs))
        return [g.detach() for g in grads] + list(torch.autograd.grad(probe, (a, b, bias)))

    assert_matches_torch(first_and_second(fuselab_op), first_and_second(torch_matmul_relu), "grads", device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_hessian_matches_torch(device, path, fuselab_op):
    a, b, bias = away_from_the_kink(torch.randn(5, 6, device=device), torch.randn(6, 4, device=device),
                                    torch.randn(4, device=device))
    ours = torch.autograd.functional.hessian(lambda a: fuselab_op(a, b, bias).pow(2).sum(), a)
    ref = torch.autograd.functional.hessian(lambda a: torch_matmul_relu(a, b, bias).pow(2).sum(), a)
    assert ref.abs().max() > 0
    assert_matches_torch([ours], [ref], "hessian", device)
    # Vectorized: the backward runs on batched gradients (torch's legacy vmap), Triton cannot read them.
    vec = torch.autograd.functional.hessian(lambda b: fuselab_op(a, b, bias).pow(2).sum(), b, vectorize=True)
    ref = torch.autograd.functional.hessian(lambda b: torch_matmul_relu(a, b, bias).pow(2).sum(), b)
    assert_matches_torch([vec], [ref], "vectorized hessian", device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_gradient_penalty_step(device, path, fuselab_op):
    # WGAN-GP: the penalty on |d critic / d x| trains the first layer through its double backward.
    x, w1_t, b1 = away_from_the_kink(torch.randn(16, 10, device=device), torch.randn(10, 12, device=device),
                                     torch.randn(12, device=device))
    params = [w1_t.t(), b1, torch.randn(12, 1, device=device)]

    def penalty_grads(fn):
        w1, b1, w2 = leaves(*params)
        xs = x.clone().requires_grad_(True)
        out = fn(xs, w1.t(), b1) @ w2
        (gx,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
        penalty = ((gx.norm(dim=1) - 1) ** 2).mean()
        return torch.autograd.grad(penalty, (w1, b1, w2), materialize_grads=True)

    ours, ref = penalty_grads(fuselab_op), penalty_grads(torch_matmul_relu)
    assert ref[0].abs().max() > 0
    assert_matches_torch(ours, ref, "penalty grads", device)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_transforms_match_torch(device):
    # torch.func's grad, hessian (forward over reverse), per-sample gradients and vmap.
    a, b, bias = torch.randn(6, 5, device=device), torch.randn(5, 7, device=device), torch.randn(7, device=device)
    results = []
    for fn in (matmul_relu, torch_matmul_relu):
        def loss(a, b, bias):
            return fn(a, b, bias).pow(2).sum()

        results.append([
            *torch.func.grad(loss, argnums=(0, 1, 2))(a, b, bias),
            torch.func.hessian(loss)(a, b, bias),
            *torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None, None))(a[:, None], b, bias),
            torch.func.vmap(fn, in_dims=(0, None, None))(a.view(2, 3, 5), b, bias),
        ])
    assert results[1][3].abs().max() > 0
    assert_matches_torch(*results, "torch.func", device)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_matches_torch(device):
    # Tangents as torch computes them, NaN included: torch.func.jvp, jacfwd and forward_ad's duals.
    import torch.autograd.forward_ad as fwAD

    a, b, bias = torch.randn(9, 6, device=device), torch.randn(6, 5, device=device), torch.randn(5, device=device)
    a[2, 3] = float("nan")  # row 2 of Y and of its tangent are NaN
    tangents = [torch.randn_like(t) for t in (a, b, bias)]
    results = []
    for fn in (matmul_relu, torch_matmul_relu):
        y, jvp = torch.func.jvp(fn, (a, b, bias), tuple(tangents))
        jac = torch.func.jacfwd(fn, argnums=1)(a[3:], b, bias)
        with fwAD.dual_level():
            dual = fn(*(fwAD.make_dual(t, dt) for t, dt in zip((a, b, bias), tangents)))
            dual_tangent = fwAD.unpack_dual(dual).tangent
        results.append([y, jvp, jac, dual_tangent])
    assert results[1][1][~results[1][1].isnan()].abs().max() > 0
    assert_matches_torch(*results, "forward mode", device)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_refused_where_no_rule(device):
    # A custom op can have no forward-mode formula: called directly it raises, never a zero tangent.
    import torch.autograd.forward_ad as fwAD

    a, b = torch.randn(4, 3, device=device), torch.randn(3, 2, device=device)
    with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        torch.func.jvp(lambda a: torch.ops.fuselab.matmul_relu(a, b, None), (a,), (torch.ones_like(a),))
    with fwAD.dual_level():
        dual = fwAD.make_dual(a, torch.ones_like(a))
        with pytest.raises(NotImplementedError, match="fuselab.matmul_relu has no forward-mode derivative"):
            torch.ops.fuselab.matmul_relu(dual, b, None)
        with pytest.raises(NotImplementedError, match=r"backend='cuda'\) has no forward-mode derivative"):
            matmul_relu(dual, b, backend="cuda")
        with pytest.raises(NotImplementedError, match="matmul_relu_grad_a has no forward-mode derivative"):
            torch.ops.fuselab.matmul_relu_grad_a(dual, None, b.t().contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_first_order_backward_keeps_the_kernels(python_eager_path, device, monkeypatch):
    # Only a differentiated backward leaves the Triton products; an ordinary one launches them
    # (the Python path's; the C++ path's backward: test_eager_path.py).
    launches = []
    gemm = matmul_relu_module._gemm
    monkeypatch.setattr(matmul_relu_module, "_gemm", lambda *args, **kw: launches.append(1) or gemm(*args, **kw))
    a = torch.randn(10, 8, device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(8, 6, device=device, dtype=torch.float16, requires_grad=True)
    for create_graph, backward_launches in [(False, 2), (True, 0)]:
        y = matmul_relu(a, b)
        launches.clear()
        torch.autograd.grad(y, (a, b), torch.randn_like(y), create_graph=create_graph)
        assert len(launches) == backward_launches, f"create_graph={create_graph}"


# ----------------------------------------------------------------------------------------------
# Registration: opcheck, compile, export
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_opcheck(device, layout):
    a = randn(11, 14, dtype=torch.float32, device=device, layout=layout).requires_grad_(True)
    b = randn(14, 9, dtype=torch.float32, device=device, layout=layout).requires_grad_(True)
    bias = rand_bias(9, torch.float32, device, "column" if layout == "transposed" else "contiguous")
    bias.requires_grad_(True)
    torch.library.opcheck(torch.ops.fuselab.matmul_relu, (a, b, bias))
    torch.library.opcheck(torch.ops.fuselab.matmul_relu, (a, b, None))
    y = matmul_relu(a, b, bias).detach()
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.fuselab.matmul_relu_grad_a, (dy, y, b.detach()))
    torch.library.opcheck(torch.ops.fuselab.matmul_relu_grad_b, (dy, y, a.detach(), b.detach()))


class TwoLayer(torch.nn.Module):
    def __init__(self, k=13, h=24, n=7):
        super().__init__()
        self.fc1 = torch.nn.Linear(k, h)
        self.fc2 = torch.nn.Linear(h, n)

    def forward(self, x):
        return self.fc2(linear_relu(x, self.fc1.weight, self.fc1.bias))


def _graph_ops(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_backward(device):
    torch._dynamo.reset()
    model = TwoLayer().to(device)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        if device == "cuda":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(5, 13, device=device)
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert any("fuselab.matmul_relu" in op for op in _graph_ops(graphs[0]))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0


@pytest.mark.parametrize("device", DEVICES)
def test_export(device):
    model = TwoLayer().to(device)
    x = torch.randn(6, 13, device=device)
    ep = torch.export.export(model, (x,))
    assert any(n.target is torch.ops.fuselab.matmul_relu.default for n in ep.graph.nodes)
    x2 = torch.randn(6, 13, device=device)
    torch.testing.assert_close(ep.module()(x2), model(x2))


@pytest.mark.parametrize("device", DEVICES)
def test_eager_fast_path_equals_the_op(device):
    # Eager calls skip the dispatcher (_EagerMatmulReLU); the registered op must give the same bits.
    a = torch.randn(21, 30, device=device, requires_grad=True)
    b = torch.randn(30, 17, device=device, requires_grad=True)
    bias = torch.randn(17, device=device, requires_grad=True)
    dy = torch.randn(21, 17, device=device)
    results = []
    for fn in (matmul_relu, torch.ops.fuselab.matmul_relu):
        y = fn(a, b, bias)
        grads = torch.autograd.grad(y, (a, b, bias), dy)
        results.append((y.detach(), *grads))
    for fast, op in zip(*results):
        assert torch.equal(fast, op)


def test_tma_layout_check_runs_on_fake_tensors():
    # _gemm decides the TMA body while torch.compile/export trace it with fake tensors, which have
    # no data pointer: the check must use strides and storage offsets only. (Reading a fake tensor's
    # data pointer raises while tracing, and only warns here: the warning is made an error.)
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fuselab.kernels._gemm_tiles import tma_layout as check

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        base = torch.empty(64 * 40 + 8, dtype=torch.bfloat16)
        assert check(base[:64 * 40].view(64, 40)) is True
        assert check(base[:64 * 40].view(40, 64).t()) is False
        assert check(base[1:64 * 40 + 1].view(64, 40)) is None  # 2 bytes off a 16-byte boundary
        assert check(base[:40].expand(64, 40)) is None  # a broadcast row: no descriptor can describe it


def test_plan_key_separates_bias_layouts():
    # A launch plan fixes the bias's stride, an argument of the kernel: each bias layout has its own.
    # (The rest of what the key separates is tested in test_launch_plans.py.)
    a, b, c = torch.randn(40, 33), torch.randn(33, 24), torch.empty(40, 24)
    key = matmul_relu_module._plan_key
    same = key(a, b, c, torch.randn(24), None, None, True)
    assert key(a, b, c, torch.randn(24), None, None, True) == same
    assert key(a, b, c, torch.randn(48)[::2], None, None, True) != same
    assert key(a, b, c, torch.randn(24, 3)[:, 0], None, None, True) != same
    assert key(a, b, c, torch.randn(()).expand(24), None, None, True) != same


def test_traced_calls_use_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a fake tensor must reach the fake implementation, not a kernel
        y = matmul_relu(torch.randn(5, 7), torch.randn(7, 3))
    assert y.shape == (5, 3)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: matmul_relu(a, b))(torch.randn(4, 6), torch.randn(6, 2))
    assert any(n.target is torch.ops.fuselab.matmul_relu.default for n in gm.graph.nodes)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,exc,words", [
    (lambda: (torch.randn(4, 5), torch.randn(6, 3)), ValueError, ["K mismatch", "(4, 5)", "(6, 3)"]),
    (lambda: (torch.randn(4, 5), torch.randn(5)), ValueError, ["b must be 2-D", "(5,)"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3), torch.randn(4)), ValueError, ["bias", "(3,)", "(4,)"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3), torch.randn(1, 3)), ValueError, ["bias", "(1, 3)"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3, dtype=torch.float16)), TypeError, ["a is torch.float32", "b is torch.float16"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3), torch.randn(3, dtype=torch.float64)), TypeError, ["bias is torch.float64"]),
    (lambda: (torch.randn(4, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)), TypeError, ["unsupported dtype torch.float64"]),
    (lambda: (torch.randint(0, 3, (4, 5)), torch.randint(0, 3, (5, 3))), TypeError, ["unsupported dtype torch.int64"]),
    (lambda: (torch.randn(()), torch.randn(5, 3)), ValueError, ["0-d"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3, device="meta")), ValueError, ["one device", "a on cpu", "b on meta"]),
    (lambda: (torch.randn(4, 5).to_sparse(), torch.randn(5, 3)), TypeError, ["a is a torch.sparse_coo tensor"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3), torch.randn(3).to_sparse()), TypeError, ["bias is a torch.sparse_coo"]),
    (lambda: (torch.randn(4, 5).numpy(), torch.randn(5, 3)), TypeError, ["a must be a torch.Tensor", "numpy.ndarray"]),
    (lambda: (torch.randn(4, 5), torch.randn(5, 3), [0.0] * 3), TypeError, ["bias must be a torch.Tensor", "list"]),
], ids=["k-mismatch", "b-rank", "bias-size", "bias-rank", "mixed-dtype", "bias-dtype", "float64", "int", "scalar",
        "mixed-device", "sparse-a", "sparse-bias", "numpy-a", "list-bias"])
def test_bad_input(args, exc, words):
    with pytest.raises(exc) as info:
        matmul_relu(*args())
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_linear_relu_bad_weight():
    with pytest.raises(ValueError, match=r"weight must be 2-D .*\(5,\)"):
        linear_relu(torch.randn(3, 5), torch.randn(5))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got numpy.ndarray"):
        linear_relu(torch.randn(3, 5).numpy(), torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"x has shape \(3, 12\) \(K=12\) but weight has shape \(12, 16\)"):
        linear_relu(torch.randn(3, 12), torch.randn(12, 16))  # a (K, N) weight: named as passed, not transposed


def test_package_api():
    assert fuselab.matmul_relu is matmul_relu
