"""The CUDA C++ reference (fuselab/kernels/csrc): builds here without a GPU; checked on a GPU.

The build takes ~2 minutes on 2 cores the first time (cached afterwards): marked slow.
"""
import pytest
import torch
from reference import BIAS_LAYOUTS, assert_close, check_forward_backward, dot_bound, rand_bias, randn

from fuselab.kernels import matmul_relu
from fuselab.kernels.matmul_relu_cuda import matmul_relu_cuda

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def extension():
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    from fuselab.kernels.matmul_relu_cuda import load_extension

    load_extension()


def test_builds_and_registers(extension):
    schemas = {name: str(getattr(torch.ops.fuselab, name).default._schema)
               for name in ("matmul_relu_cuda", "matmul_relu_cuda_naive")}
    assert schemas == {
        "matmul_relu_cuda": 'fuselab::matmul_relu_cuda(Tensor a, Tensor b, Tensor? bias, str half_kernel="auto") -> Tensor',
        "matmul_relu_cuda_naive": "fuselab::matmul_relu_cuda_naive(Tensor a, Tensor b, Tensor? bias) -> Tensor"}
    a, b = torch.randn(3, 4, device="meta"), torch.randn(4, 5, device="meta")
    assert torch.ops.fuselab.matmul_relu_cuda(a, b, None).shape == (3, 5)  # the fake implementation
    assert torch.ops.fuselab.matmul_relu_cuda(a, b, None, "mma").shape == (3, 5)


def test_cpu_tensors_rejected(extension):
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        matmul_relu(torch.randn(3, 4), torch.randn(4, 5), backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        matmul_relu(torch.randn(3, 4), torch.randn(4, 5), backend="rocm")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("a_layout,b_layout", [("contiguous", "contiguous"), ("contiguous", "transposed"),
                                               ("transposed", "sliced")])
def test_forward_backward(extension, dtype, precision, a_layout, b_layout):
    if dtype != torch.float32 and precision == "high":
        pytest.skip("precision only matters for fp32")
    torch.backends.cuda.matmul.allow_tf32 = precision == "high"
    try:
        M, K, N = 300, 259, 133
        a = randn(M, K, dtype=dtype, device="cuda", layout=a_layout)
        b = randn(K, N, dtype=dtype, device="cuda", layout=b_layout)
        bias = torch.randn(N, dtype=dtype, device="cuda")
        y = check_forward_backward(a, b, bias, dtype, op=lambda a, b, bias: matmul_relu(a, b, bias, backend="cuda"))
        y_triton = matmul_relu(a.detach(), b.detach(), bias.detach())
        assert_close(y, y_triton.double(), 2 * dot_bound(dtype, K, a.double().abs(), b.double().abs()).detach(),
                     "vs Triton")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias_layout", BIAS_LAYOUTS)
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_bias_layouts(extension, dtype, bias_layout, kernel):
    # Every kernel reads the bias at its strides (a slice, a column, an expanded scalar), K = 0 too.
    if kernel == "wgmma" and (dtype == torch.float32 or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the wgmma kernel runs fp16/bf16 on an sm_90 GPU")
    M, K, N = 300, 520, 264  # K >= 512 and 16-byte aligned rows: wgmma can run
    bias = rand_bias(N, dtype, "cuda", bias_layout)
    check_forward_backward(randn(M, K, dtype=dtype, device="cuda"), randn(K, N, dtype=dtype, device="cuda"), bias,
                           dtype, op=lambda a, b, bias: matmul_relu_cuda(a, b, bias, kernel=kernel))
    k0 = matmul_relu_cuda(torch.randn(4, 0, dtype=dtype, device="cuda"), torch.randn(0, N, dtype=dtype, device="cuda"),
                          bias.detach(), kernel=kernel)
    assert torch.equal(k0, torch.relu(bias.detach()).expand(4, N))
    if dtype == torch.float32:  # the tutorial's kernel, fp32 only: a @ I is exact, so is its output
        a = torch.randn(M, K, device="cuda")
        naive = torch.ops.fuselab.matmul_relu_cuda_naive(a, torch.eye(K, N, device="cuda"), bias.detach())
        assert torch.equal(naive, torch.relu(a[:, :N] + bias.detach()))


@pytest.mark.gpu
def test_naive_and_registration(extension):
    a = torch.randn(70, 45, device="cuda")
    b = torch.randn(45, 33, device="cuda")
    naive = torch.ops.fuselab.matmul_relu_cuda_naive(a, b, None)
    assert_close(naive, torch.relu(a.double() @ b.double()), dot_bound(torch.float32, 45, a.double().abs(),
                                                                         b.double().abs()), "naive")
    x = torch.randn(11, 14, device="cuda", requires_grad=True)
    w = torch.randn(14, 9, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.fuselab.matmul_relu_cuda, (x, w, None))
    compiled = torch.compile(lambda x: matmul_relu(x, w, backend="cuda").sum(), fullgraph=True)
    compiled(x).backward()
    assert x.grad is not None and w.grad is not None

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(w.detach().clone())

        def forward(self, x):
            return matmul_relu(x, self.w, backend="cuda")

    layer = Layer()
    ep = torch.export.export(layer, (x.detach(),))
    assert any(n.target is torch.ops.fuselab.matmul_relu_cuda.default for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x.detach()), layer(x.detach()))


@pytest.mark.gpu
def test_empty_and_k0(extension):
    bias = torch.randn(5, device="cuda")
    k0 = matmul_relu(torch.randn(4, 0, device="cuda"), torch.randn(0, 5, device="cuda"), bias, backend="cuda")
    torch.testing.assert_close(k0, torch.relu(bias).expand(4, 5), rtol=0, atol=0)
    empty = matmul_relu(torch.randn(2, 0, 6, device="cuda"), torch.randn(6, 5, device="cuda"), backend="cuda")
    assert empty.shape == (2, 0, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("M,K,N", [(300, 200, 520), (77, 1032, 40), (1031, 72, 264)])
def test_wgmma_kernel(extension, dtype, b_layout, M, K, N):
    """The Hopper kernel pinned (an error, not a fallback, if it cannot run): ragged tiles in M, N
    and K (TMA's zero fill), both B layouts, with and without bias; the mma.sync kernel agrees."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    a = randn(M, K, dtype=dtype, device="cuda")
    b = randn(K, N, dtype=dtype, device="cuda", layout=b_layout)
    bias = torch.randn(N, dtype=dtype, device="cuda")
    a64, b64 = a.double(), b.double()
    bound = dot_bound(dtype, K, a64.abs(), b64.abs())
    outs = {}
    for kernel in ("wgmma", "mma"):
        y = torch.ops.fuselab.matmul_relu_cuda(a, b, bias, kernel)
        assert_close(y, torch.relu(a64 @ b64 + bias.double()), bound + 2.0**-24 * bias.double().abs(), kernel)
        y0 = torch.ops.fuselab.matmul_relu_cuda(a, b, None, kernel)
        assert_close(y0, torch.relu(a64 @ b64), bound, f"{kernel} without bias")
        outs[kernel] = y.double()
    assert_close(outs["wgmma"].to(dtype), outs["mma"], 2 * bound + 2.0**-23 * bias.double().abs(), "wgmma vs mma")


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(4100, 640, 600), (64, 2112, 296), (4100, 256, 600), (1000, 520, 696)])
def test_default_kernel(extension, M, K, N):
    """The default (auto) at shapes where it takes wgmma (long K, a filled GPU; K >= 2048 on few tiles)
    and mma.sync (short K; few tiles): right against float64, and in agreement with both kernels
    pinned. (On the H200 the two kernels' outputs were bit-identical; the choice is about speed.)"""
    a = randn(M, K, dtype=torch.bfloat16, device="cuda")
    b = randn(K, N, dtype=torch.bfloat16, device="cuda")
    bias = torch.randn(N, dtype=torch.bfloat16, device="cuda")
    ref = torch.relu(a.double() @ b.double() + bias.double())
    bound = dot_bound(torch.bfloat16, K, a.double().abs(), b.double().abs()) + 2.0**-24 * bias.double().abs()
    y = torch.ops.fuselab.matmul_relu_cuda(a, b, bias)  # the schema's default: auto
    assert_close(y, ref, bound, "default kernel")
    kernels = ("wgmma", "mma") if torch.cuda.get_device_capability() == (9, 0) else ("mma",)
    for kernel in kernels:
        assert_close(torch.ops.fuselab.matmul_relu_cuda(a, b, bias, kernel), y.double(), 2 * bound,
                     f"default vs {kernel}")


@pytest.mark.gpu
def test_wgmma_pin_explains_itself(extension):
    a = torch.randn(64, 259, dtype=torch.bfloat16, device="cuda")  # 518-byte rows: no TMA
    b = torch.randn(259, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="kernel=wgmma, but"):
        matmul_relu_cuda(a, b, None, kernel="wgmma")
    with pytest.raises(RuntimeError, match="must be auto, mma or wgmma"):
        torch.ops.fuselab.matmul_relu_cuda(a, b, None, "fastest")
