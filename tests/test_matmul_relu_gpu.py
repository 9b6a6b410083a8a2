"""GPU-only checks of matmul_relu: every config of both kernel bodies, 64-bit offsets,
CUDA graphs, and inductor (dynamic shapes, reduce-overhead). Run with `pytest -m gpu`."""
import pytest
import torch
from reference import assert_close, check_forward_backward, dot_bound, rand_bias, randn

from fuselab.kernels import matmul_relu
from fuselab.kernels.matmul_relu_triton import _gemm, gemm_configs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("b_layout", ["contiguous", "transposed"])
def test_every_config_forward(dtype, b_layout):
    # The autotuner may pick any config on some GPU: each must be right, TMA body included. The bias
    # layouts (strides 1, 3 and 0) take turns, so each meets both bodies without compiling every pair.
    M, N, K = 300, 264, 136  # not multiples of any block; rows 16-byte aligned for TMA
    a = randn(M, K, dtype=dtype, device="cuda")
    b = randn(K, N, dtype=dtype, device="cuda", layout=b_layout)
    biases = [rand_bias(N, dtype, "cuda", layout) for layout in ("contiguous", "column", "broadcast")]
    configs = gemm_configs()
    assert all({c.kwargs["TMA"] for c in configs[k::3]} == {False, True} for k in range(3))
    for i, config in enumerate(configs):
        bias = biases[i % 3]
        ref = torch.relu(a.double() @ b.double() + bias.double())
        bound = dot_bound(dtype, K, a.double().abs(), b.double().abs()) + 2.0**-24 * bias.double().abs()
        c = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")  # poison: every element must be written
        try:
            _gemm(a, b, c, bias=bias, relu=True, config=config)
        except Exception as e:  # out of shared memory for this dtype is allowed, nothing else
            if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
                continue
            raise
        assert_close(c, ref, bound, f"config {config}, bias stride {bias.stride(0)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_config_backward_products(dtype):
    M, N, K = 130, 72, 200
    g = torch.randn(M, N, dtype=dtype, device="cuda")
    y = torch.randn(M, N, dtype=dtype, device="cuda")
    a = torch.randn(M, K, dtype=dtype, device="cuda")
    gm = torch.where(y <= 0, 0, g).double()
    for config in [c for c in gemm_configs() if not c.kwargs["TMA"]]:
        out = torch.full((N, K), float("nan"), dtype=dtype, device="cuda")
        rowsum = torch.full((N,), float("nan"), dtype=dtype, device="cuda")
        try:
            _gemm(g.t(), a, out, y=y.t(), rowsum=rowsum, config=config)
        except Exception as e:
            if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
                continue
            raise
        assert_close(out, gm.t() @ a.double(), dot_bound(dtype, M, gm.abs().t(), a.double().abs()), f"dB^T {config}")
        ones = torch.ones(M, 1, dtype=torch.float64, device="cuda")
        assert_close(rowsum, gm.sum(0), dot_bound(dtype, M, gm.abs().t(), ones).squeeze(1), f"dbias {config}")


def test_int64_offsets():
    # a has more than 2**31 elements: 32-bit offsets would wrap and read the wrong rows.
    M, K, N = 2**21 + 37, 1024, 24
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    y = matmul_relu(a, b)
    tail = slice(M - 300, M)
    ref = torch.relu(a[tail].double() @ b.double())
    assert_close(y[tail], ref, dot_bound(torch.float16, K, a[tail].double().abs(), b.double().abs()), "tail rows")
    del a


def test_deterministic_large():
    a = torch.randn(2048, 1536, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(1536, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    outs = []
    for _ in range(3):
        b.grad = None
        y = matmul_relu(a, b)
        y.backward(torch.ones_like(y))
        outs.append((y.detach().clone(), b.grad.clone()))
    for y, g in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(g, outs[0][1])


def test_cuda_graph_capture_and_replay():
    a = torch.randn(257, 384, dtype=torch.float16, device="cuda")
    b = torch.randn(384, 200, dtype=torch.float16, device="cuda")
    bias = torch.randn(200, dtype=torch.float16, device="cuda")
    matmul_relu(a, b, bias)  # tune before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = matmul_relu(a, b, bias)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.relu(a.double() @ b.double() + bias.double())
    assert_close(y, ref, dot_bound(torch.float16, 384, a.double().abs(), b.double().abs()) + 1e-3, "replay")


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inductor_dynamic_shapes(mode):
    # Every element of Y, dA, dB and dbias against float64 within its derived bound, per row count.
    torch._dynamo.reset()
    compiled = torch.compile(matmul_relu, fullgraph=True, dynamic=True, mode=mode)
    dtype = torch.bfloat16
    for rows in (33, 64, 129):
        torch.compiler.cudagraph_mark_step_begin()  # reduce-overhead reuses its output buffers
        w = torch.randn(80, 96, device="cuda", dtype=dtype)  # nn.Linear's (N, K), used as w.t()
        check_forward_backward(torch.randn(rows, 96, device="cuda", dtype=dtype), w.t(),
                               rand_bias(80, dtype, "cuda", "column" if rows == 64 else "contiguous"), dtype,
                               op=compiled)


def test_inductor_reduce_overhead_inference():
    torch._dynamo.reset()
    lin = torch.nn.Linear(96, 80, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: matmul_relu(x, lin.weight.t(), lin.bias), fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
            out = compiled(x).clone()
            ref = torch.relu(x.double() @ lin.weight.double().t() + lin.bias.double())
            assert_close(out, ref, dot_bound(torch.bfloat16, 96, x.double().abs(), lin.weight.double().abs().t())
                         + 2.0**-24 * lin.bias.double().abs(), "reduce-overhead replay")
