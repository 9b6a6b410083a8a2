"""Per-row quantization of activations (fuselab.quant.rowwise): the kernel (interpreter here, CUDA on
the GPU) must give PyTorch's ops' bits exactly, for every dtype, layout and rounding case."""
import pytest
import torch

from fuselab.quant import rowwise
from fuselab.quant.rowwise import FP8_MAX, quantize_fp8_rowwise, quantize_int8_rowwise, quantize_int8_static

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def kernel_on_cuda(monkeypatch):
    """The kernel on CUDA whatever rowwise.KERNEL_ON_CUDA says (the switch that sends CUDA tensors to
    PyTorch's ops where these tests fail)."""
    monkeypatch.setattr(rowwise, "KERNEL_ON_CUDA", True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same(q, ref) -> bool:
    """Bitwise equality (fp8 compared through its bytes: NaN == NaN there)."""
    return q.dtype == ref.dtype and torch.equal(q.view(torch.int8), ref.view(torch.int8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("K", [300, 5000, 8000, 8200], ids=["one-pass", "two-pass", "one-pass-8192", "two-pass-long"])
def test_kernel_gives_pytorchs_bits(device, dtype, fp8, K):
    # 3-D, a zero row, a row with one large value; K within one block (the row read once) and above it
    # (two loop trips, two reads).
    x = torch.randn(2, 5, K, device=device).to(dtype)
    x[0, 1] = 0
    x[1, 2, 7] = 300.0
    q, scale = torch.ops.fuselab.quantize_rows(x, fp8)
    q_ref, scale_ref = rowwise._torch_rowwise(x, fp8)
    assert q.shape == x.shape and scale.shape == (2, 5)
    assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()
    assert _same(q, q_ref), (q.float() - q_ref.float()).abs().max()
    if not fp8:  # a static scale reads the row in blocks of the same width, whatever K
        static = torch.tensor(0.02, device=device)
        assert _same(quantize_int8_static(x, static), rowwise._torch_static(x, static))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("K", [300, 5000, 8000, 8200], ids=["one-pass", "two-pass", "one-pass-8192", "two-pass-long"])
def test_rows_with_nan_or_inf_get_scales_that_are_not_finite(device, dtype, fp8, K):
    # NaN or inf must reach the layer's output (scale x accumulator), never vanish into a finite row.
    x = torch.randn(4, K, device=device).to(dtype)
    x[0, 5], x[1, K - 1], x[2, 7] = float("nan"), float("inf"), float("-inf")
    q, scale = torch.ops.fuselab.quantize_rows(x, fp8)
    q_ref, scale_ref = rowwise._torch_rowwise(x, fp8)
    assert torch.isnan(scale[0]) and torch.isnan(scale_ref[0])
    assert scale[1:3].tolist() == scale_ref[1:3].tolist() == [float("inf")] * 2
    assert torch.equal(scale[3], scale_ref[3]) and _same(q, q_ref)  # the same bits, non-finite rows too
    # their NaN quotients (NaN, +-inf over inf) quantize to 0: +inf became -QMAX (Triton's clamp drops NaN), and a
    # layer's row came out as infinities of the wrong sign (its ReLU then gave 0 where the float layer gives inf)
    assert q[0, 5].float() == q[1, K - 1].float() == q[2, 7].float() == 0 and not q[:3].float().isnan().any()
    if not fp8:  # a finite static scale: NaN to 0, infinities saturate
        static = quantize_int8_static(x[:3], torch.tensor(0.5, device=device))
        assert static[0, 5] == 0 and static[1, K - 1] == 127 and static[2, 7] == -127
        assert _same(static, rowwise._torch_static(x[:3], torch.tensor(0.5, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_halfway_quotients_round_to_even(device):
    # x / scale lands exactly on k + 0.5: int8 rounds to the even neighbour, as torch.round does.
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 125.5, -126.5, 127.0], device=device)
    q, scale = quantize_int8_rowwise(halves[None])
    assert scale.item() == 1.0
    assert q.tolist() == [[0, 2, 2, 0, -2, 126, -126, 127]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_static_scale_multiplies_by_its_reciprocal(device, kernel, monkeypatch):
    # round(x * fp32(1 / scale)), torchao's formula (what a GEMM epilogue affords), not round(x / scale): at
    # x = 0.2405, scale = 0.013 the product is 18.5 (to even: 18), the correctly rounded quotient 18.500002 (19).
    if not kernel:
        monkeypatch.setattr(rowwise, "_runs_triton", lambda x: False)
    scale = torch.tensor(0.013, device=device)
    x = torch.cat([torch.tensor([0.24050001800060272, -0.24050001800060272]), torch.randn(4000) * 2]).to(device)
    q = quantize_int8_static(x[None], scale)[0]
    assert q[:2].tolist() == [18, -18]
    # float64 reference: the fp32 reciprocal, the product of two fp32 exact in float64, then rounded to fp32
    product = (x.double() * (1 / scale.double()).float().double()).float().double()
    assert torch.equal(q.long(), product.round().clamp(-127, 127).long())
    for low in (torch.bfloat16, torch.float16):  # PyTorch's ops: the reciprocal of the scale as fp32 too (an fp16
        # 1e-5 has no fp16 reciprocal: inf would saturate every value)
        small = torch.tensor([1e-5, 0.0037], dtype=low, device=device)[:, None]
        got = quantize_int8_static(torch.tensor([[4e-4], [0.46]], device=device), small)
        want = (torch.tensor([[4e-4], [0.46]]).double() * (1 / small.cpu().double()).float().double()).float().round()
        assert torch.equal(got.cpu().long(), want.long()), (low, got)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rounding_that_carries_into_the_exponent(device):
    # quotients just below a power of two round up to it (the step doubles there), and the largest
    # finite value is never exceeded.
    row = torch.tensor([448.0, 127.2, -127.9, 15.6, 0.0, 2.0**-8, 3 * 2.0**-10, -63.9, -2.0**-12], device=device)
    q, scale = quantize_fp8_rowwise(row[None])
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 128.0, -128.0, 16.0, 0.0, 2.0**-8, 2.0**-8, -64.0, -0.0]]
    assert q.view(torch.int8)[0, -1] == -128  # -0: the sign of a value that rounds to zero is kept
    assert _same(q, rowwise._torch_rowwise(row[None], True)[0])
    assert q.float().abs().max() <= FP8_MAX


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_static_scale(device):
    base = torch.randn(6, 300, device=device, dtype=torch.bfloat16)
    x = base[:, 10:200]  # rows 300 apart, a 10-element offset
    assert _same(quantize_int8_rowwise(x)[0], rowwise._torch_rowwise(x, False)[0])
    xt = torch.randn(64, 6, device=device).t()  # K strided: copied once, quantized the same
    assert _same(quantize_fp8_rowwise(xt)[0], rowwise._torch_rowwise(xt, True)[0])
    scale = torch.tensor(0.013, device=device)  # clips beyond 127 * 0.013
    assert _same(quantize_int8_static(x, scale), rowwise._torch_static(x, scale))
    per_row = torch.rand(6, 1, device=device) + 0.01  # not one scale: PyTorch's ops
    assert _same(quantize_int8_static(x, per_row), rowwise._torch_static(x, per_row))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_empty_and_bad_inputs(device, kernel, monkeypatch):
    if not kernel:  # PyTorch's ops (a CPU without the interpreter) give the same answers, errors too
        monkeypatch.setattr(rowwise, "_runs_triton", lambda x: False)
    q, scale = quantize_int8_rowwise(torch.empty(0, 8, device=device))
    assert q.shape == (0, 8) and scale.shape == (0,)
    for quantize in (quantize_fp8_rowwise, quantize_int8_rowwise):  # rows of no values: the tiny scale
        q, scale = quantize(torch.empty(3, 0, device=device))
        assert q.shape == (3, 0) and scale.shape == (3,) and (scale > 0).all()
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.int32"):
        quantize_int8_rowwise(torch.ones(2, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="0-d"):
        quantize_fp8_rowwise(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="one float32 value"):
        torch.ops.fuselab.quantize_static(torch.ones(2, 3, device=device), torch.ones(2, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(5, 40, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fuselab.quantize_rows, (x, False))
    torch.library.opcheck(torch.ops.fuselab.quantize_static, (x, torch.tensor(0.02, device=device)))
    # test_schema compares outputs with ops PyTorch lacks for fp8 tensors
    torch.library.opcheck(torch.ops.fuselab.quantize_rows, (x, True),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
def test_repeated_calls_relaunch_from_a_plan_with_the_same_bits(monkeypatch):
    # A layer quantizes inputs of one layout over and over: from the second call on, a launch plan
    # (no Triton argument binding) runs the kernel; new data, same bits as PyTorch's ops.
    import importlib

    runtime = importlib.import_module("fuselab.kernels._runtime")
    relaunched, call = [], runtime._LaunchPlan.__call__
    monkeypatch.setattr(runtime._LaunchPlan, "__call__", lambda self, t: relaunched.append(1) or call(self, t))
    for fp8 in (False, True):
        public = quantize_fp8_rowwise if fp8 else quantize_int8_rowwise
        for i in range(3):  # the op (the dispatcher) first, then the public function (no dispatcher)
            x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
            q, scale = torch.ops.fuselab.quantize_rows(x, fp8) if i == 0 else public(x)
            q_ref, scale_ref = rowwise._torch_rowwise(x, fp8)
            assert torch.equal(scale, scale_ref) and _same(q, q_ref)
    assert len(relaunched) >= 4  # calls 2 and 3 of each dtype
