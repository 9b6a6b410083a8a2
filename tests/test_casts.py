"""The cast the kernels store through (fuselab.kernels._casts.cast_rne): fp32 to each output dtype, rounded
to nearest even as torch rounds (the interpreter's own bf16 cast truncates, and mangles subnormals)."""
import pytest
import torch
import triton
import triton.language as tl
from reference import DEVICES

from fuselab.kernels._casts import cast_rne


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, cast_rne(tl.load(x_ptr + offs, mask=offs < n), y_ptr.dtype.element_ty), mask=offs < n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cast_rounds_to_nearest_even_as_torch_does(device, dtype):
    one = 1 + 2.0 ** -8  # a bf16 tie: to even (1.0); one more bit above it rounds up
    special = [one, one + 2.0 ** -10, -(one + 2.0 ** -10), 1 + 3 * 2.0 ** -8, 3.0e38, 3.3961e38, float("inf"),
               -float("inf"), 1e-40, -2.7e-40, 1e-45, -0.0, 0.0, 65519.0, 65520.0, 2.0 ** -25]
    x = torch.cat([torch.tensor(special), torch.randn(1000) * 10.0 ** torch.randint(-40, 38, (1000,))])
    x = x.to(device)
    y = torch.empty(len(x), dtype=dtype, device=device)
    _cast_kernel[(1,)](x, y, len(x), BLOCK=triton.next_power_of_2(len(x)))
    torch.testing.assert_close(y, x.to(dtype), rtol=0, atol=0)  # bitwise, signed zeros and infinities too
    nan = torch.full((16,), float("nan"), device=device)
    _cast_kernel[(1,)](nan, y, 16, BLOCK=16)
    assert y[:16].isnan().all()
