"""DistillationLoss(fused=True): the Triton kernel (the interpreter on a CPU) against the float64 PyTorch
form, with a first-order bound of its fp32 arithmetic; inputs it takes and refuses; registration."""
import pytest
import torch
from reference import DEVICES, UNIT, assert_close

from fuselab.quant import DistillationLoss, fused_distill

U32 = UNIT[torch.float32]


def logits(n, c, device, dtype=torch.float32, masked=True):
    s, t = torch.randn(n, c, device=device) * 3, torch.randn(n, c, device=device) * 3
    if masked:
        t[0, : c // 2] = float("-inf")  # classes the teacher masks (at 37 columns, a whole first block of 16)
    return s.to(dtype), t.to(dtype)


def reference(s, t, y, T, alpha):
    """The float64 PyTorch form: loss, d/ds, d/dt (None where the loss does not depend on t)."""
    s64, t64 = s.double().requires_grad_(), t.double().requires_grad_()
    loss = DistillationLoss(T, alpha)(s64, t64, y)
    gs, gt = torch.autograd.grad(loss, [s64, t64], allow_unused=True)
    return loss.detach(), gs, gt


def bounds(s, t, y, T, alpha):
    """First-order fp32 error bounds of the loss and both gradients: a row's log-sum-exps add C
    exponentials (a relative error of C + 8 roundings each, an absolute error of the exponent
    then), each exponent as large as max |x| / T; a probability p carries p times that error."""
    n, c = s.shape
    s64, t64 = s.double(), t.double()
    finite_t = torch.where(t64.isinf(), 0.0, t64)
    big = 1 + (s64.abs().amax(1) + finite_t.abs().amax(1)) * (1 + 1 / T)
    row = 4 * (c + 8) * U32 * big  # per row: error of any log-sum-exp, log-probability or KL term
    w_soft, w_hard = alpha * T * T / n, (1 - alpha) / max(int((y != -100).sum()), 1)
    p_s, p_t = torch.softmax(s64 / T, 1), torch.softmax(t64 / T, 1)
    p_h = torch.softmax(s64, 1)
    kl = (torch.where(p_t > 0, p_t * (torch.log(p_t) - torch.log_softmax(s64 / T, 1)), 0.0)).sum(1, keepdim=True)
    log_ratio = torch.where(p_t > 0, torch.log(p_t) - torch.log_softmax(s64 / T, 1), 0.0)
    loss = ((w_soft + w_hard) * row).sum()
    ds = (w_soft / T * (p_s + p_t) + w_hard * (p_h + 1e-300)) * row[:, None] * 2
    dt = w_soft / T * p_t * ((log_ratio - kl).abs() + 2) * row[:, None] * 2
    return loss, ds, dt


def check(s, t, y, T, alpha, what, scale=1.0, wrt="st"):
    """The fused loss and the gradients ``wrt`` asks for (s, t or both), the loss's own gradient ``scale``."""
    s1, t1 = s.detach().clone().requires_grad_("s" in wrt), t.detach().clone().requires_grad_("t" in wrt)
    loss = DistillationLoss(T, alpha, fused=True)(s1, t1, y)
    loss.backward(torch.tensor(scale, device=s.device))
    ref, gs, gt = reference(s, t, y, T, alpha)
    b_loss, b_ds, b_dt = bounds(s, t, y, T, alpha)
    assert_close(loss.detach(), ref, b_loss, f"{what} loss")
    if "s" in wrt:  # scaled in fp32, then stored in the logits' dtype (one rounding)
        assert_close(s1.grad, gs * scale, scale * b_ds, f"{what} d/ds")
    else:
        assert s1.grad is None
    if gt is None or "t" not in wrt:
        assert t1.grad is None, f"{what}: no teacher gradient asked for, or alpha = 0 (the teacher is not in the loss)"
    else:
        assert_close(t1.grad, gt * scale, scale * b_dt, f"{what} d/dt")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("c", [1, 10, 37])
@pytest.mark.parametrize("T", [0.5, 2.0])
def test_fused_loss_matches_reference(device, alpha, c, T, monkeypatch):
    monkeypatch.setattr(fused_distill, "MAX_BLOCK", 16)  # 37 columns: three blocks of the online passes
    torch.manual_seed(c)
    s, t = logits(5, c, device, masked=c > 1)
    y = torch.randint(0, c, (5,), device=device)
    y[1] = -100  # a row without a label: the soft term only
    check(s, t, y, T, alpha, f"alpha {alpha}, C {c}, T {T}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_loss_16_bit_logits(device, dtype):
    torch.manual_seed(0)
    s, t = logits(4, 50, device, dtype)
    check(s, t, torch.randint(0, 50, (4,), device=device), 4.0, 0.9, str(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_loss_layouts_and_edges(device):
    torch.manual_seed(1)
    wide_s, wide_t = logits(6, 40, device, masked=False)
    wide_t[0, 5:12] = float("-inf")
    y = torch.randint(0, 20, (12,), device=device)[::2]  # a strided target
    check(wide_s[:, :20], wide_t[:, :20], y, 1.5, 0.5, "row stride 40, 20 columns")
    s, t = logits(20, 6, device)
    check(s.t(), t.t(), torch.randint(0, 20, (6,), device=device), 1.5, 0.5, "column stride 6 (copied)")
    check(s[:3], t[:3], torch.full((3,), -100, device=device), 3.0, 0.5, "no label at all")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale, wrt", [(3.0, "s"), (65536.0, "st"), (1 / 3, "t")])
def test_the_incoming_gradient_scales_in_fp32(device, scale, wrt):
    # GradScaler's 65536 in fp16: scaled before the one rounding to the logits' dtype, not after
    torch.manual_seed(4)
    s, t = logits(4, 30, device, torch.float16)
    check(s, t, torch.randint(0, 30, (4,), device=device), 2.0, 0.5, f"scale {scale}, wrt {wrt}", scale, wrt)


@pytest.mark.parametrize("device", DEVICES)
def test_a_target_out_of_range_makes_the_loss_nan(device):
    s, t = logits(3, 8, device)
    y = torch.tensor([1, 8, -100], device=device)
    assert DistillationLoss(2.0, 0.5, fused=True)(s, t, y).isnan()
    # alpha = 1: the loss never reads the target
    torch.testing.assert_close(DistillationLoss(2.0, 1.0, fused=True)(s, t, y), DistillationLoss(2.0, 1.0)(s, t, y))


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_is_the_pytorch_forms(device):
    torch.manual_seed(2)
    s, t = logits(4, 9, device)
    y = torch.randint(0, 9, (4,), device=device)
    grads = []
    for fused in (True, False):
        s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
        (gs,) = torch.autograd.grad(DistillationLoss(2.0, 0.5, fused=fused)(s1, t1, y), [s1], create_graph=True)
        grads.append(torch.autograd.grad(gs.square().sum(), [s1, t1]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_are_refused(device):
    op = torch.ops.fuselab.distillation_loss
    s, t, y = (torch.randn(3, 5, device=device), torch.randn(3, 5, device=device),
               torch.zeros(3, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        op(s.double(), t.double(), y, 2.0, 0.5)
    with pytest.raises(ValueError, match="unit column stride"):
        op(torch.randn(5, 3, device=device).t(), t, y, 2.0, 0.5)
    with pytest.raises(ValueError, match="int64"):
        op(s, t, y.int(), 2.0, 0.5)
    with pytest.raises(ValueError, match="one shape"):
        op(s, t[:, :4], y, 2.0, 0.5)
    _, stats = op(s, t, y, 2.0, 0.5)
    with pytest.raises(ValueError, match="stats must be"):
        torch.ops.fuselab.distillation_loss_grad(s, t, y, stats[:, :4], torch.ones((), device=device), 2.0, 0.5, True,
                                                 True)
    with pytest.raises(TypeError, match="fused must be True or False"):
        DistillationLoss(fused=1)
    with pytest.raises(TypeError, match="temperature must be a number, not a tensor that requires grad"):
        fused_distill.fused_distillation_loss(s, t, y, torch.tensor(2.0, requires_grad=True), 0.5)
    # float64 logits take the PyTorch form, exactly
    s64, t64 = s.double(), t.double()
    assert torch.equal(DistillationLoss(2.0, 0.5, fused=True)(s64, t64, y), DistillationLoss(2.0, 0.5)(s64, t64, y))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_compile_and_export(device):
    torch.manual_seed(3)
    s, t = logits(4, 12, device)
    y = torch.randint(0, 12, (4,), device=device)
    op = torch.ops.fuselab.distillation_loss
    torch.library.opcheck(op, (s.requires_grad_(), t.requires_grad_(), y, 2.0, 0.5))  # its autograd too
    torch.library.opcheck(op, (s.detach(), t.detach(), y, 2.0, 1.0))
    stats = op(s, t, y, 2.0, 0.5)[1]
    torch.library.opcheck(torch.ops.fuselab.distillation_loss_grad,
                          (s.detach(), t.detach(), y, stats, torch.tensor(2.0, device=device), 2.0, 0.5, True, False))
    s, t = s.detach(), t.detach()
    loss_fn = DistillationLoss(2.0, 0.5, fused=True)
    eager = loss_fn(s, t, y)
    torch._dynamo.reset()
    # (on a GPU inductor traces into the op: its sum over rows may add in another order)
    torch.testing.assert_close(torch.compile(loss_fn, fullgraph=True)(s, t, y), eager, rtol=4 * 2**-24, atol=0)
    ep = torch.export.export(loss_fn, (s, t, y))
    assert any(n.target is torch.ops.fuselab.distillation_loss.default for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(s, t, y), eager, rtol=4 * 2**-24, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_skip_the_dispatcher_with_the_ops_results(device, monkeypatch):
    # An untraced call runs the op's bodies through an autograd.Function: bit for bit the op's results.
    torch.manual_seed(4)
    s, t = logits(5, 23, device)
    y = torch.randint(0, 23, (5,), device=device)
    applied = []
    real_apply = fused_distill._EagerDistillationLoss.apply
    monkeypatch.setattr(fused_distill._EagerDistillationLoss, "apply",
                        lambda *args: applied.append(1) or real_apply(*args))
    results = []
    for call in (lambda a, b: DistillationLoss(2.0, 0.5, fused=True)(a, b, y),
                 lambda a, b: torch.ops.fuselab.distillation_loss(a, b, y, 2.0, 0.5)[0]):
        s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
        loss = call(s1, t1)
        loss.backward(torch.tensor(0.75, device=device))
        results.append((loss.detach(), s1.grad, t1.grad))
    assert applied == [1]  # the loss went through the Function, the op call did not
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_ad_and_torch_func_are_the_pytorch_forms(device):
    # A custom op has no tangent rule: the fused loss computes these with PyTorch's form, never a zero tangent.
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(5)
    s, t = logits(3, 11, device, masked=False)
    y = torch.randint(0, 11, (3,), device=device)
    tangent = torch.randn_like(s)
    jvps = []
    for fused in (True, False):
        with fwAD.dual_level():
            jvps.append(fwAD.unpack_dual(DistillationLoss(2.0, 0.5, fused=fused)(fwAD.make_dual(s, tangent), t, y)).tangent)
    assert jvps[0] is not None and torch.equal(jvps[0], jvps[1])
    grads = [torch.func.grad(lambda x, fused=fused: DistillationLoss(2.0, 0.5, fused=fused)(x, t, y))(s)
             for fused in (True, False)]
    assert torch.equal(grads[0], grads[1])
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="distillation_loss has no forward-mode"):
        torch.ops.fuselab.distillation_loss(fwAD.make_dual(s, tangent), t, y, 2.0, 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_backwards_are_the_pytorch_forms(device):
    # is_grads_batched and vectorized jacobians hand the backward a batched gradient the kernels cannot read.
    torch.manual_seed(6)
    s, t = logits(4, 12, device, masked=False)
    y = torch.randint(0, 12, (4,), device=device)
    v = torch.tensor([1.0, 2.0, -1.0], device=device)
    got = []
    for fused in (True, False):
        s1 = s.clone().requires_grad_()
        got.append(torch.autograd.grad(DistillationLoss(2.0, 0.5, fused=fused)(s1, t, y), s1, v, is_grads_batched=True)[0])
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-7)
    assert got[0].shape == (3, 4, 12)


@pytest.mark.parametrize("device", DEVICES)
def test_the_functional_loss_checks_like_the_module_on_every_path(device):
    # float64 logits take the PyTorch form, fp32 ones the kernels (in the interpreter on a CPU): both refuse what
    # DistillationLoss refuses, and the op itself refuses a bad temperature or alpha.
    y = torch.zeros(4, dtype=torch.long, device=device)
    for dtype in (torch.float64, torch.float32):
        s, t = torch.randn(4, 5, device=device, dtype=dtype), torch.randn(4, 5, device=device, dtype=dtype)
        for T, alpha, words in ((-2.0, 0.5, "temperature must be a positive finite"),
                                (0.0, 0.5, "temperature must be a positive finite"),
                                (2.0, 2.0, "alpha must be a number in \\[0, 1\\]")):
            with pytest.raises(ValueError, match=words):
                fused_distill.fused_distillation_loss(s, t, y, T, alpha)
        with pytest.raises(ValueError, match="one shape"):
            fused_distill.fused_distillation_loss(s, t[:1], y, 2.0, 0.5)
        with pytest.raises(ValueError, match="one shape"):  # a 1-D student: its strides were read before the check
            fused_distill.fused_distillation_loss(s[0], t, y, 2.0, 0.5)
        for fused in (False, True):
            with pytest.raises(ValueError, match="no class"):  # the PyTorch form met torch's IndexError
                DistillationLoss(2.0, 0.5, fused=fused)(s[:, :0], t[:, :0], y)
    s, t = torch.randn(4, 5, device=device), torch.randn(4, 5, device=device)
    with pytest.raises(ValueError, match="temperature must be a positive finite"):
        torch.ops.fuselab.distillation_loss(s, t, y, -1.0, 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["pytorch", "fused"])
def test_a_row_the_teacher_masks_whole_adds_nothing(device, fused):
    # A padding position masked by -inf teacher logits in every class: the loss was NaN on both paths, and the
    # fused path's student gradient NaN too. The row adds nothing to the soft term (and still counts in N).
    torch.manual_seed(0)
    s, t = logits(4, 10, device, masked=False)
    t[2] = float("-inf")
    y = torch.randint(0, 10, (4,), device=device)
    y[2] = -100
    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    loss = DistillationLoss(2.0, 1.0, fused=fused)(s1, t1, y)
    loss.backward()
    alive = torch.tensor([0, 1, 3], device=device)
    want = DistillationLoss(2.0, 1.0)(s[alive].double(), t[alive].double(), y[alive]) * 3 / 4
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    assert s1.grad.isfinite().all() and not s1.grad[2].any() and not t1.grad[2].any()
    mixed = DistillationLoss(2.0, 0.5, fused=fused)(s, t, y)  # with the hard term: the other rows' labels
    torch.testing.assert_close(mixed.double(), DistillationLoss(2.0, 0.5)(s.double(), t.double(), y))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["pytorch", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [0.5, 2.0])
@pytest.mark.parametrize("max_block", [4096, 16], ids=["one-block", "three-blocks"])
def test_logits_of_finfo_min_are_numbers(device, fused, dtype, T, max_block, monkeypatch):
    # A mask of finfo.min instead of -inf (as attention masks are written): a softmax of equal logits is
    # uniform, of logits far below the row's largest 0. The fused kernel's loss was -inf or inf where the
    # teacher's or student's row was all finfo.min (sums of terms near finfo.min overflowed), both forms'
    # NaN at T < 1 (x / T overflowed to -inf before the softmax subtracted the row's largest logit).
    monkeypatch.setattr(fused_distill, "MAX_BLOCK", max_block)  # 40 columns: one block, or three of the online passes
    torch.manual_seed(0)
    s, t = logits(5, 40, device, dtype, masked=False)
    low = torch.finfo(dtype).min
    t[0], s[1], t[2, :30], s[3, 10:] = low, low, low, low  # whole rows and parts
    t[4], s[4] = low, low
    if T < 1:  # else row 3's KL, about |finfo.min| / T where the teacher has mass, is more than fp32 holds
        t[3, 10:] = float("-inf")
    y = torch.randint(0, 40, (5,), device=device)
    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    loss = DistillationLoss(T, 0.7, fused=fused)(s1, t1, y)
    loss.backward()
    ref, gs, gt = reference(s, t, y, T, 0.7)  # float64: no value above overflows
    # at T = 2 row 3's KL is large (the teacher's mass where the student sits at finfo.min) but finite
    assert loss.isfinite() and s1.grad.isfinite().all() and t1.grad.isfinite().all()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    unit = max(UNIT[dtype], 1e-5)  # the gradients are stored in the logits' dtype
    torch.testing.assert_close(s1.grad.double(), gs, rtol=unit, atol=unit * gs.abs().max().item())
    torch.testing.assert_close(t1.grad.double(), gt, rtol=unit, atol=unit * gt.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused, alpha", [(False, 0.0), (False, 0.5), (False, 1.0), (True, 0.0), (True, 0.5), (True, 1.0)],
                         ids=["pytorch-hard", "pytorch", "pytorch-soft", "fused-hard", "fused", "fused-soft"])
def test_a_padding_row_masked_in_both_logits_has_no_gradient(device, fused, alpha):
    # Student and teacher logits -inf in every class, label -100: the loss was finite and the row's student
    # gradient NaN (a NaN softmax's backward, times zero).
    torch.manual_seed(0)
    s, t = logits(4, 10, device, masked=False)
    s[2], t[2] = float("-inf"), float("-inf")
    y = torch.randint(0, 10, (4,), device=device)
    y[2] = -100
    s1 = s.clone().requires_grad_()
    loss = DistillationLoss(2.0, alpha, fused=fused)(s1, t, y)
    loss.backward()
    alive = torch.tensor([0, 1, 3], device=device)
    s_alive = s[alive].double().requires_grad_()
    want = DistillationLoss(2.0, alpha)(s_alive, t[alive].double(), y[alive])
    soft = alpha * DistillationLoss(2.0, 1.0)(s[alive].double(), t[alive].double(), y[alive])
    torch.testing.assert_close(loss.double(), want - soft / 4, rtol=1e-5, atol=1e-6)  # the soft mean is over 4 rows
    assert not s1.grad[2].any() and s1.grad.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["pytorch", "fused"])
def test_at_alpha_0_the_teacher_is_not_in_the_graph(device, fused):
    # Only the teacher requiring grad: the PyTorch form's loss had no graph, the fused one's had (a zero gradient)
    s, t = logits(4, 10, device)
    y = torch.randint(0, 10, (4,), device=device)
    loss = DistillationLoss(2.0, 0.0, fused=fused)(s, t.requires_grad_(), y)
    assert not loss.requires_grad
    s.requires_grad_()
    DistillationLoss(2.0, 0.0, fused=fused)(s, t, y).backward()
    assert t.grad is None and s.grad.isfinite().all()


def test_fused_loss_with_student_and_teacher_of_different_row_strides():
    # FD5: the loss kernel must read the teacher through its own row stride. Not .clone() of a slice:
    # clone() of a non-dense slice is contiguous (check() in test_fused_distill.py does that).
    torch.manual_seed(0)
    s_base, t_base = torch.randn(4, 20) * 3, torch.randn(4, 48) * 3
    y = torch.randint(0, 20, (4,))
    for alpha in (0.5, 1.0):
        grads = []
        for fused in (True, False):
            sb, tb = s_base.clone().requires_grad_(), t_base.clone().requires_grad_()
            s, t = sb, tb[:, 5:25]  # row strides 20 and 48, the teacher at an offset
            assert fused is False or t.stride() == (48, 1)
            loss = DistillationLoss(2.0, alpha, fused=fused)(s, t, y)
            loss.backward()
            grads.append((loss.detach(), sb.grad, tb.grad))
        for f, r in zip(*grads):
            torch.testing.assert_close(f, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["nan", "inf", "nan among -inf"])
def test_a_teacher_logit_of_nan_or_inf_makes_its_rows_gradients_nan(bad):
    # Both forms: the loss NaN and that row's gradients NaN, the other rows' finite. The kernel gave the teacher's
    # row a gradient of 0 (a NaN p_t failed its p_t > 0 test), the PyTorch form the student's row a finite one;
    # a NaN in a row otherwise masked (-inf) made the kernel's row a padding row (tl.max drops NaN): a finite loss.
    torch.manual_seed(0)
    s0, t0 = torch.randn(3, 8), torch.randn(3, 8)
    if bad == "nan among -inf":
        t0[1] = float("-inf")
    t0[1, 3] = float("inf") if bad == "inf" else float("nan")
    y = torch.tensor([1, 2, -100])
    for fused in (False, True):
        s, t = s0.clone().requires_grad_(), t0.clone().requires_grad_()
        loss = DistillationLoss(2.0, 0.5, fused=fused)(s, t, y)
        loss.backward()
        assert loss.isnan(), fused
        for grad in (s.grad, t.grad):
            assert grad[1].isnan().all() and grad[[0, 2]].isfinite().all(), (fused, grad)


def test_a_target_out_of_range_makes_its_rows_student_gradient_nan():
    # FD10: the grad kernel's _bad_target term: the docstring promises the row's student gradient is NaN too.
    torch.manual_seed(0)
    s, t = torch.randn(3, 8).requires_grad_(), torch.randn(3, 8)
    y = torch.tensor([1, 8, -100])
    DistillationLoss(2.0, 0.5, fused=True)(s, t, y).backward()
    assert s.grad[1].isnan().all()
    assert s.grad[[0, 2]].isfinite().all()
