"""fuselab.kernels.matmul_relu: values, gradients, registration, errors, autotuning.

On a CPU the Triton kernels run in the interpreter (conftest); on a GPU run `pytest -m gpu`.
"""
import importlib
import json

import pytest
import torch
import triton
import triton.language as tl

import fuselab
from fuselab.kernels import _autotune, linear_relu, matmul_relu
from reference import DEVICES, DTYPES, check_forward_backward, randn

matmul_relu_module = importlib.import_module("fuselab.kernels.matmul_relu")  # the package re-exports the function

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_and_linear(device, dtype):
    x = torch.randn(2, 3, 21, dtype=dtype, device=device)
    w = torch.randn(17, 21, dtype=dtype, device=device)  # nn.Linear layout (N, K)
    bias = torch.randn(17, dtype=dtype, device=device)
    y = check_forward_backward(x, w.t(), bias, dtype)
    assert y.shape == (2, 3, 17)
    torch.testing.assert_close(linear_relu(x.detach(), w, bias), y.detach(), rtol=0, atol=0)


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
# Registration: opcheck, compile, export
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_opcheck(device, layout):
    a = randn(11, 14, dtype=torch.float32, device=device, layout=layout).requires_grad_(True)
    b = randn(14, 9, dtype=torch.float32, device=device, layout=layout).requires_grad_(True)
    bias = torch.randn(9, device=device, requires_grad=True)
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


@pytest.mark.gpu
def test_repeated_calls_relaunch_the_first_calls_kernel(monkeypatch):
    # From the second eager call of a layout on, _gemm relaunches a plan (launch_planned): on new
    # data, on a view whose 16-byte alignment differs (its own plan), forward and both products.
    runtime = importlib.import_module("fuselab.kernels._runtime")
    relaunched = []
    call = runtime._LaunchPlan.__call__
    monkeypatch.setattr(runtime._LaunchPlan, "__call__", lambda self, t: relaunched.append(1) or call(self, t))
    M, K, N = 97, 72, 88
    for offset in (0, 0, 0, 1, 1):  # offset 1: the rows start 2 bytes off a 16-byte boundary
        a = torch.randn(M * K + offset, dtype=torch.bfloat16, device="cuda")[offset:].view(M, K)
        b = randn(K, N, dtype=torch.bfloat16, device="cuda", layout="transposed")
        check_forward_backward(a, b, torch.randn(N, dtype=torch.bfloat16, device="cuda"), torch.bfloat16)
    assert len(relaunched) >= 2 * 3 + 3  # rounds 2, 3 and 5: forward, dA, dB each


def test_launch_plan_fixes_all_but_the_tensors():
    # What launch_planned relaunches: Triton's argument order (positional, keywords, the tuned
    # config), the grid evaluated once, and no reference to the first call's tensors.
    import types
    import weakref

    runtime = importlib.import_module("fuselab.kernels._runtime")
    fn = types.SimpleNamespace(arg_names=["x_ptr", "y_ptr", "n", "FLAG", "BLOCK"])
    kernel = types.SimpleNamespace(fn=fn, best_config=triton.Config({"BLOCK": 64}, num_warps=4))
    x, y = torch.randn(100), torch.randn(100)
    plan = runtime._LaunchPlan(kernel, object(), lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),),
                               (x, y, 100), {"FLAG": True}, None)
    assert plan.values == [None, None, 100, True, 64] and plan.slots == [0, 1]
    assert plan.grid == (2, 1, 1)
    x_ref = weakref.ref(x)
    del x
    assert x_ref() is None


def test_tma_layout_check_runs_on_fake_tensors():
    # _gemm decides the TMA body while torch.compile/export trace it with fake tensors, which have
    # no data pointer: the check must use strides and storage offsets only. (Reading a fake tensor's
    # data pointer raises while tracing, and only warns here: the warning is made an error.)
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    check = matmul_relu_module._tma_row_major
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        base = torch.empty(64 * 40 + 8, dtype=torch.bfloat16)
        assert check(base[:64 * 40].view(64, 40)) is True
        assert check(base[:64 * 40].view(40, 64).t()) is False
        assert check(base[1:64 * 40 + 1].view(64, 40)) is None  # 2 bytes off a 16-byte boundary


def test_plan_key_separates_what_triton_specializes_on():
    a = torch.randn(40, 33)
    b, bias = torch.randn(33, 24), torch.randn(24)
    c = torch.empty(40, 24)
    key = matmul_relu_module._plan_key
    same = key(a, b, c, bias, None, None, True)
    assert key(torch.randn(40, 33), b, c, bias, None, None, True) == same  # new data, same layout
    assert key(torch.randn(40 * 33 + 1)[1:].view(40, 33), b, c, bias, None, None, True) != same  # 4 bytes off
    assert key(a, b.t().contiguous().t(), c, bias, None, None, True) != same  # column-major b
    assert key(a, b, c, None, None, None, True) != same
    assert key(a, b, c, bias, None, None, False) != same


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
], ids=["k-mismatch", "b-rank", "bias-size", "bias-rank", "mixed-dtype", "bias-dtype", "float64", "int", "scalar", "mixed-device"])
def test_bad_input(args, exc, words):
    with pytest.raises(exc) as info:
        matmul_relu(*args())
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_linear_relu_bad_weight():
    with pytest.raises(ValueError, match=r"weight must be 2-D .*\(5,\)"):
        linear_relu(torch.randn(3, 5), torch.randn(5))


# ----------------------------------------------------------------------------------------------
# Autotuning: persistence and the no-tuning switch
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scale_kernel(x_ptr, n, SIZE_KEY, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def test_autotune_persists_per_gpu_and_triton(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSELAB_CACHE_DIR", str(tmp_path))
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})]
    calls = []

    def make():
        tuner = _autotune.PersistentAutotuner(_scale_kernel, configs, key=["SIZE_KEY"])
        orig_bench = tuner._bench

        def bench(*args, config, **meta):  # a fake clock: the 32-wide config is "fastest"
            calls.append(config)  # counting calls shows who benchmarked
            orig_bench(*args, config=config, **meta)
            return [1.0 if config.kwargs["BLOCK"] == 32 else 2.0] * 3

        tuner._bench = bench
        return tuner

    first = make()
    x = torch.randn(100, device="cuda" if torch.cuda.is_available() else "cpu")
    first[lambda m: (triton.cdiv(100, m["BLOCK"]),)](x, 100, _autotune.bucket(100))
    assert len(calls) == 3 and first.best_config.kwargs["BLOCK"] == 32
    files = list(tmp_path.rglob("_scale_kernel.json"))
    assert files == [_autotune.cache_dir() / "_scale_kernel.json"]  # .../autotune/<gpu name>/triton-<version>/
    assert files[0].parent.name == f"triton-{triton.__version__}" and files[0].parent.parent.name
    assert "BLOCK: 32" in next(iter(json.loads(files[0].read_text()).values()))

    second = make()  # a "second process": empty in-memory cache, same disk cache
    second[lambda m: (triton.cdiv(100, m["BLOCK"]),)](x, 100, _autotune.bucket(120))  # same bucket
    assert len(calls) == 3, "the second tuner benchmarked again instead of reading the disk cache"
    assert second.best_config.kwargs["BLOCK"] == 32


@pytest.mark.parametrize("device", DEVICES)
def test_autotune_fast_path_matches_triton_key(device, monkeypatch):
    # After tuning, launches skip Autotuner.run: its key must be exactly the one Autotuner.run stores.
    from fuselab.kernels.matmul_relu import matmul_relu_kernel
    from triton.runtime.autotuner import Autotuner

    a, b = torch.randn(33, 20, device=device), torch.randn(20, 18, device=device)
    first = matmul_relu(a, b)
    keys = list(matmul_relu_kernel.cache)
    monkeypatch.setattr(Autotuner, "run", lambda *args, **kwargs: pytest.fail("slow path taken after tuning"))
    torch.testing.assert_close(matmul_relu(a, b), first, rtol=0, atol=0)
    assert list(matmul_relu_kernel.cache) == keys


def test_autotune_switch_off_uses_heuristic_where_it_fits(tmp_path, monkeypatch):
    # FUSELAB_AUTOTUNE=0: nothing is timed or stored; the heuristic runs unless pruning drops it
    # (an fp32 problem needs twice the shared memory), then the first config that survives.
    monkeypatch.setattr(_autotune, "AUTOTUNE", False)
    monkeypatch.setenv("FUSELAB_CACHE_DIR", str(tmp_path))
    small, heuristic, large = (triton.Config({"BLOCK": b}) for b in (16, 64, 128))

    def prune(configs, named_args, **kwargs):  # pretend 64-wide tiles do not fit odd sizes
        return [c for c in configs if named_args["n"] % 2 == 0 or c.kwargs["BLOCK"] != 64]

    tuner = _autotune.autotune([small, large, heuristic], key=["SIZE_KEY"], prune=prune,
                               heuristic=heuristic)(_scale_kernel)
    assert tuner.configs[0] is heuristic and len(tuner.configs) == 3
    x = torch.randn(101, device="cuda" if torch.cuda.is_available() else "cpu")
    want = x * 2
    tuner[lambda m: (triton.cdiv(100, m["BLOCK"]),)](x, 100, 1)
    assert tuner.best_config is heuristic
    tuner[lambda m: (triton.cdiv(101, m["BLOCK"]),)](x, 101, 2)
    assert tuner.best_config is small  # the first survivor, in the given order
    torch.testing.assert_close(x, torch.cat([want[:100] * 2, want[100:]]))  # both launches ran
    assert not list(tmp_path.rglob("*.json")), "an untimed choice was stored as a tuned one"


def test_bucket():
    assert [_autotune.bucket(n) for n in (0, 1, 2, 3, 64, 65, 4096, 4097)] == [1, 1, 2, 4, 64, 128, 4096, 8192]


def test_package_api():
    assert fuselab.matmul_relu is matmul_relu
