"""Float64 references and error bounds shared by the kernel tests."""
import pytest
import torch

from fuselab.kernels._runtime import INTERPRET

# Unit roundoff of each storage dtype (half an ulp at 1.0).
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
TF32_UNIT = 2.0**-11

DEVICES = [pytest.param("cpu")] if INTERPRET else [pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dot_bound(dtype: torch.dtype, k: int, a_abs: torch.Tensor, b_abs: torch.Tensor) -> torch.Tensor:
    """Elementwise error bound of a K-long fp32-accumulated dot product over (|a| @ |b|).

    Inputs are exact in their dtype; fp32 inputs are rounded to tf32 unless precision is
    "highest"; accumulation in fp32 adds at most K unit roundoffs (a worst case, not an average).
    """
    rounding = 0.0
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        rounding = 2 * TF32_UNIT
    return (rounding + (k + 2) * 2.0**-24) * (a_abs @ b_abs)


def assert_close(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|out - ref| <= output rounding + bound, elementwise; NaN where and only where ref is NaN."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out64 = out.double()
    assert torch.equal(out64.isnan(), ref.isnan()), f"{what}: NaN pattern differs"
    ok = ~ref.isnan()
    err = (out64 - ref).abs()[ok]
    # Output rounding: relative for normal numbers, absolute (the subnormal spacing) below them.
    rounding = 2 * UNIT[out.dtype] * (ref.abs() + torch.finfo(out.dtype).smallest_normal)
    allowed = (rounding + bound)[ok]
    worst = (err / allowed).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.2f}x the allowed bound (max abs err {err.max():.3e})"


def randn(*shape, dtype, device, layout="contiguous"):
    """A random tensor of ``shape`` in one of several memory layouts (values identical)."""
    if layout == "contiguous":
        return torch.randn(*shape, dtype=dtype, device=device)
    if layout == "transposed":  # a .t() view: column-major
        return torch.randn(*reversed(shape), dtype=dtype, device=device).t()
    if layout == "sliced":  # every other column of a wider tensor: row stride != columns
        return torch.randn(shape[0], 2 * shape[1], dtype=dtype, device=device)[:, ::2]
    raise ValueError(layout)


# Biases of every layout matmul_relu promises: contiguous, strided, a column, an expanded scalar.
BIAS_LAYOUTS = ["contiguous", "strided", "column", "broadcast"]


def rand_bias(n, dtype, device, layout="contiguous"):
    """A random (n,) bias laid out as ``layout`` (one of BIAS_LAYOUTS)."""
    if layout == "contiguous":
        return torch.randn(n, dtype=dtype, device=device)
    if layout == "strided":  # every other element
        return torch.randn(2 * n, dtype=dtype, device=device)[::2]
    if layout == "column":  # a column of a row-major matrix: stride = its row length
        return torch.randn(n, 3, dtype=dtype, device=device)[:, 0]
    if layout == "broadcast":  # one value expanded: stride 0
        return torch.randn((), dtype=dtype, device=device).expand(n)
    raise ValueError(layout)


def check_forward_backward(a, b, bias, dtype, op=None):
    """``op(a, b, bias)`` (default: fuselab's matmul_relu) and its gradients against float64.

    The gradient reference masks with the op's own output, as documented: the op saves Y and
    never recomputes it, so an output that rounds to 0 gets a zero gradient in both.
    """
    from fuselab.kernels import matmul_relu

    op = op or matmul_relu
    for t in (a, b, bias):
        if t is not None:
            t.requires_grad_(True)
    y = op(a, b, bias)
    K = b.shape[0]
    a64, b64 = a.detach().double(), b.detach().double()
    bias64 = bias.detach().double() if bias is not None else torch.zeros((), dtype=torch.float64, device=a.device)
    assert_close(y, torch.relu(a64 @ b64 + bias64),
                 dot_bound(dtype, K, a64.abs(), b64.abs()) + 2.0**-24 * bias64.abs(), "Y")

    dy = torch.randn_like(y)
    y.backward(dy)
    g = torch.where(y.detach() <= 0, 0, dy).double()
    g2, a2 = g.reshape(-1, g.shape[-1]), a64.reshape(-1, K)
    N, M = b.shape[1], g2.shape[0]
    assert_close(a.grad, g @ b64.t(), dot_bound(dtype, N, g.abs(), b64.abs().t()), "dA")
    assert_close(b.grad, a2.t() @ g2, dot_bound(dtype, M, a2.abs().t(), g2.abs()), "dB")
    if bias is not None:
        ones = torch.ones(M, 1, dtype=torch.float64, device=g.device)
        assert_close(bias.grad, g2.sum(0), dot_bound(dtype, M, g2.abs().t(), ones).squeeze(1), "dbias")
    return y
