"""A LayerNorm whose rows come out quantized (fuselab.quant.norm_quant) and ``quantize_``'s ``fuse_norms``: the
kernel against a float64 layer norm within its rounding, PyTorch's path bit for bit the unfused layers', the rows
refused everywhere but in a quantized linear, and decoders that compute what their unfused quantized form does."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fuselab.nn import fuse_linear_relu
from fuselab.quant import (
    Float8Linear,
    Float8RowwiseConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Linear,
    Int8StaticActivationInt8WeightConfig,
    calibrate,
    norm_quant,
    quantize_,
)
from fuselab.quant.norm_quant import (
    MAX_K,
    QuantizedLayerNorm,
    QuantizedRows,
    layer_norm_quantize_rows,
    layer_norm_quantize_static,
)
from fuselab.quant.rowwise import FP8_MAX, _torch_rowwise, _torch_static

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(K, dtype, device, rows=6):
    x = (torch.randn(2, rows // 2, K, device=device) * 2 + 3).to(dtype)  # an offset: the mean matters
    w = (torch.rand(K, device=device) + 0.5).to(dtype)
    b = torch.randn(K, device=device).to(dtype) * 0.1
    return x, w, b


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at |v| (float64; normal numbers)."""
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=1e-30))))


def _bound(y64: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fp8: bool) -> torch.Tensor:
    """|q * scale - y64| allowed: the fp32 layer norm (sums of K terms: ~1e-5 here), its rounding to ``dtype``
    (half an ulp), then the quantization's own rounding (half a step: 1 for int8, e4m3's ulp for fp8)."""
    s = scale.double()[..., None]
    if fp8:
        v = (y64 / s).abs()
        step = torch.exp2(torch.floor(torch.log2(v.clamp(min=1e-30))).clamp(min=-6) - 3) * s
    else:
        step = s
    return 0.5 * step * (1 + 1e-6) + 0.51 * _ulp(y64, dtype) + 1e-5 * (y64.abs() + 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("K,affine", [(1, True), (48, True), (1000, True), (3000, False), (MAX_K, True)],
                         ids=["1", "48", "1000", "3000-plain", "max"])
def test_kernel_against_a_float64_layer_norm(device, dtype, fp8, K, affine):
    x, w, b = _rows(K, dtype, device)
    w, b = (w, b) if affine else (None, None)
    q, scale = layer_norm_quantize_rows(x, w, b, 1e-5, fp8)
    assert q.shape == x.shape and q.dtype == (torch.float8_e4m3fn if fp8 else torch.int8) and scale.shape == (2, 3)
    y64 = F.layer_norm(x.double(), (K,), None if w is None else w.double(), None if b is None else b.double(), 1e-5)
    qmax = FP8_MAX if fp8 else 127
    amax = y64.abs().amax(-1)
    assert ((scale.double() - amax / qmax).abs() <= (0.51 * _ulp(amax, dtype) + 1e-5 * amax) / qmax).all()
    err = (q.double() * scale.double()[..., None] - y64).abs()
    assert (err <= _bound(y64, scale, dtype, fp8)).all(), (err / _bound(y64, scale, dtype, fp8)).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_kernel_gives_the_unfused_bits_but_where_the_norms_last_bit_decides(dtype, fp8):
    # against F.layer_norm then quantize_rows (the unfused layers): the fp32 norm may differ from PyTorch's in
    # the last bit of the dtype, so a value may move one step where that bit decided its rounding; rarely
    x, w, b = _rows(768, dtype, "cpu", rows=64)
    q, scale = layer_norm_quantize_rows(x, w, b, 1e-5, fp8)
    q_ref, scale_ref = _torch_rowwise(F.layer_norm(x, (768,), w, b, 1e-5), fp8)
    same = q.view(torch.int8) == q_ref.view(torch.int8)
    assert same.float().mean() > 0.99, same.float().mean()
    if not fp8:
        assert (q.int() - q_ref.int()).abs().max() <= 1
    assert torch.allclose(scale, scale_ref, rtol=max(2 * torch.finfo(dtype).eps, 1e-5), atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_weight_and_bias_are_read_through_their_strides(device):
    # columns of one stacked tensor (a state dict loaded with assign=True): the kernel read them as unit stride
    x, w, b = _rows(64, torch.float32, device)
    stacked = torch.stack([w, b, w * 2], dim=1)  # (64, 3): each column has stride 3
    got = layer_norm_quantize_rows(x, stacked[:, 0], stacked[:, 1], 1e-5)
    want = layer_norm_quantize_rows(x, w, b, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_static_kernel_quantizes_with_each_scale(device, dtype):
    # static scales: the unfused norm then quantize_int8_static with each (one row copy a reader), but where the
    # norm's last bit decides a step (as the dynamic kernel); values past 127 steps clip; the scales are read only
    x, w, b = _rows(768, dtype, device, rows=64)
    normed = F.layer_norm(x, (768,), w, b, 1e-5)
    for values in ([0.02], [0.02, 0.005], [0.03, 0.005, 0.02]):  # the norm's values span about +-4: 0.005 clips
        scales = [torch.tensor(v, device=device) for v in values]
        q = layer_norm_quantize_static(x, w, b, 1e-5, scales)
        assert q.dtype == torch.int8 and q.shape == (len(values), *x.shape)
        assert [s.item() for s in scales] == [torch.tensor(v).item() for v in values]
        for got, s in zip(q, scales):
            want = _torch_static(normed, s)
            assert (got == want).float().mean() > 0.99 and (got.int() - want.int()).abs().max() <= 1
    assert (q[1].abs() == 127).float().mean() > 0.01 and (q[0].abs() == 127).float().mean() < 0.01
    # each reader's copy multiplies by its scale's fp32 reciprocal (quantize_int8_static's formula): a zero weight
    # leaves the bias, 0.375, and 0.375 * fp32(1 / 0.03) = 12.500001 is 13 (the quotient 12.5 would round to 12)
    half_step = layer_norm_quantize_static(x, torch.zeros_like(w), torch.full_like(b, 0.375), 1e-5,
                                           [torch.tensor(v, device=device) for v in (0.02, 0.005, 0.03)])
    assert (half_step[2] == 13).all() and (half_step[1] == 75).all()


def test_static_op_checks_its_scale_and_pytorchs_path_is_the_unfused_layers(monkeypatch):
    x, w, b = _rows(300, torch.bfloat16, "cpu")
    s = [torch.tensor(0.03), torch.tensor(0.01).view(1, 1)]  # one value in any shape
    for bad in (torch.ones(2), torch.tensor(1.0, dtype=torch.float64)):
        with pytest.raises(ValueError, match="layer_norm_quantize_static: scales.1. must be one float32 value on cpu"):
            layer_norm_quantize_static(x, w, b, 1e-5, [s[0], bad])
    for count in (0, 4):
        with pytest.raises(ValueError, match=f"takes 1 to 3 scales, got {count}"):
            layer_norm_quantize_static(x, w, b, 1e-5, s[:1] * count)
    with pytest.raises(ValueError, match="weight must be \\(300,\\) torch.bfloat16"):
        layer_norm_quantize_static(x, w[:10], b, 1e-5, s)
    torch.library.opcheck(torch.ops.fuselab.layer_norm_quantize_static, (x, w, b, 1e-5, s),
                          test_utils=("test_schema", "test_faketensor"))
    monkeypatch.setattr(norm_quant, "_runs_triton", lambda x: False)
    normed = F.layer_norm(x, (300,), w, b, 1e-5)
    assert torch.equal(layer_norm_quantize_static(x, w, b, 1e-5, s),
                       torch.stack([_torch_static(normed, t) for t in s]))


def test_pytorchs_path_is_the_unfused_layers_bit_for_bit(monkeypatch):
    monkeypatch.setattr(norm_quant, "_runs_triton", lambda x: False)
    for fp8 in (False, True):
        x, w, b = _rows(300, torch.bfloat16, "cpu")
        q, scale = layer_norm_quantize_rows(x, w, b, 1e-5, fp8)
        q_ref, scale_ref = _torch_rowwise(F.layer_norm(x, (300,), w, b, 1e-5), fp8)
        assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8)) and torch.equal(scale, scale_ref)


def test_rows_of_nan_get_a_nan_scale_and_the_op_checks_its_inputs():
    x, w, b = _rows(64, torch.float32, "cpu")
    x[0, 1, 3] = float("nan")
    _, scale = layer_norm_quantize_rows(x, w, b, 1e-5)
    assert torch.isnan(scale[0, 1]) and torch.isfinite(scale[1]).all()
    with pytest.raises(ValueError, match="rows of 1 to 16384 values, got 0"):
        layer_norm_quantize_rows(torch.ones(2, 0), None, None, 1e-5)
    with pytest.raises(ValueError, match="weight must be \\(64,\\) torch.float32"):
        layer_norm_quantize_rows(x, w[:10], b, 1e-5)
    with pytest.raises(ValueError, match="bias must be \\(64,\\) torch.float32"):
        layer_norm_quantize_rows(x, w, b.half(), 1e-5)
    torch.library.opcheck(torch.ops.fuselab.layer_norm_quantize_rows, (x.nan_to_num(), w, b, 1e-5, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_quantized_rows_are_refused_by_everything_but_a_quantized_linear():
    norm = nn.LayerNorm(16)
    with torch.no_grad():
        rows = QuantizedLayerNorm(norm)(torch.randn(3, 5, 16))
    assert isinstance(rows, QuantizedRows) and rows.shape == (3, 5, 16) and rows.dtype == torch.float32
    assert rows.size(-1) == 16 and rows.dim() == 3 and "int8 rows standing for torch.float32" in repr(rows)
    for use in (lambda r: r + 1, lambda r: r.view(15, 16), lambda r: torch.relu(r), lambda r: r.half(),
                lambda r: F.linear(r, torch.ones(4, 16)), lambda r: r.sum(), lambda r: nn.Linear(16, 4)(r)):
        with pytest.raises(RuntimeError, match="on quantized rows .* quantize without those options"):
            use(rows)
    with pytest.raises(TypeError, match="Float8Linear takes fp8 activations, got torch.int8 rows"):
        Float8Linear.from_float(nn.Linear(16, 4))(rows)  # an int8 norm's rows: named, not read as fp8 bytes


def _opt(pre_ln=True, layers=2):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=2,
                                    vocab_size=100, word_embed_proj_dim=32, max_position_embeddings=64,
                                    do_layer_norm_before=pre_ln, activation_function="relu")).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)).eval()


@pytest.mark.parametrize("config", [Int8DynamicActivationInt8WeightConfig, Float8RowwiseConfig], ids=["int8", "fp8"])
@pytest.mark.parametrize("arch", ["opt", "gpt2"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_a_decoder_with_fused_norms_computes_its_unfused_quantized_form(config, arch, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(norm_quant, "_runs_triton", lambda x: False)
    model = fuse_linear_relu(_opt())[0] if arch == "opt" else _gpt2()
    unfused, fused = copy.deepcopy(model), copy.deepcopy(model)
    quantize_(unfused, config())
    report = quantize_(fused, config(fuse_norms=True))
    norms = {"opt": ["self_attn_layer_norm", "final_layer_norm"], "gpt2": ["ln_1", "ln_2"]}[arch]
    prefix = {"opt": "model.decoder.layers", "gpt2": "transformer.h"}[arch]
    names = [f"{prefix}.{i}.{n}" for i in range(2) for n in norms]
    assert all(report.norms[n].startswith("QuantizedLayerNorm") for n in names), str(report)
    assert not any(n in report.replaced for n in names) and f"fused {len(names)} norm(s), left 0" in str(report)
    assert all(isinstance(fused.get_submodule(n), QuantizedLayerNorm) for n in names)
    assert fused.state_dict().keys() == unfused.state_dict().keys()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        out, ref = fused(ids).logits, unfused(ids).logits
    if kernel:  # the fused norm's last bit may move a value one step: a few 1e-3 of the logits at most
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max(), (out - ref).abs().max()
    else:
        assert torch.equal(out, ref)
    # gradients on (parameters requiring grad, no no_grad): the float norm serves, the same values
    assert torch.allclose(fused(ids).logits, out, rtol=0, atol=1e-2 * ref.abs().max().item())
    # a second quantize_ leaves them, saying so
    again = quantize_(fused, config(fuse_norms=True))
    assert "already a QuantizedLayerNorm" in again.norms_skipped[names[0]]


def test_norms_that_others_read_or_that_readers_do_not_match_stay_float():
    post = _opt(pre_ln=False, layers=1)
    report = quantize_(post, Int8DynamicActivationInt8WeightConfig(fuse_norms=True))
    assert "adds this norm's output to the residual too" in report.norms_skipped[
        "model.decoder.layers.0.final_layer_norm"]
    assert type(post.model.decoder.layers[0].final_layer_norm) is nn.LayerNorm
    model = _opt(layers=1)
    report = quantize_(model, Int8DynamicActivationInt8WeightConfig(fuse_norms=True),
                       filter_fn=lambda layer, name: not name.endswith("k_proj"))
    why = report.norms_skipped["model.decoder.layers.0.self_attn_layer_norm"]
    assert "self_attn.k_proj not a dynamic Int8Linear" in why
    assert isinstance(model.model.decoder.layers[0].final_layer_norm, QuantizedLayerNorm)  # fc1 is one
    plain = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    report = quantize_(plain, Int8DynamicActivationInt8WeightConfig(fuse_norms=True))
    assert "no decoder layer it knows" in report.notes[0] and type(plain[0]) is nn.LayerNorm
    assert "fuse_norms: no decoder layer it knows" in str(report) and "fuse_norms" not in report.skipped
    # a filter_fn for linears that the norms break: raised before anything changed (linears were swapped first)
    model = _opt(layers=1)
    with pytest.raises(AttributeError, match="out_features"):
        quantize_(model, Int8DynamicActivationInt8WeightConfig(fuse_norms=True),
                  filter_fn=lambda layer, name: layer.out_features >= 16)
    assert not any(isinstance(m, (QuantizedLayerNorm, Int8Linear)) for m in model.modules())
    with pytest.raises(TypeError, match="fuse_norms must be True or False"):
        Int8DynamicActivationInt8WeightConfig(fuse_norms="yes")


def test_fused_norms_compile_and_trace_as_the_unfused_layers():
    # traced, the norm is the float one and each linear quantizes its input: the graph holds fuselab's ops only
    model = fuse_linear_relu(_opt(layers=1))[0]
    quantize_(model, Int8DynamicActivationInt8WeightConfig(fuse_norms=True))
    ids = torch.randint(0, 100, (1, 8))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    assert torch.allclose(compiled, eager, rtol=0, atol=1e-2 * eager.abs().max().item())
    assert math.isfinite(compiled.abs().max().item())
    # torch.jit.trace: the float norm too (traced rows baked OPT's (batch, seq) into the graph as constants)
    norm = model.model.decoder.layers[0].self_attn_layer_norm
    with torch.no_grad():
        traced = torch.jit.trace(norm, torch.randn(2, 7, 32), check_trace=False)  # eager: QuantizedRows
        x = torch.randn(3, 4, 32)
        assert torch.equal(traced(x), F.layer_norm(x, (32,), norm.weight, norm.bias, norm.eps))


def _static_config(model, **fusions):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return Int8StaticActivationInt8WeightConfig(calibrate(model, [ids], 1, progress=False).act_scales(), **fusions)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_a_static_decoder_with_fused_norms_and_outputs_computes_its_unfused_quantized_form(kernel, monkeypatch):
    # the norms quantize with each reader's static scale, fc1's epilogue with fc2's: the int8 values the
    # unfused static layers make themselves, so the logits agree (bit for bit on PyTorch's path)
    if not kernel:
        monkeypatch.setattr(norm_quant, "_runs_triton", lambda x: False)
    model = fuse_linear_relu(_opt())[0]
    unfused, fused = copy.deepcopy(model), copy.deepcopy(model)
    quantize_(unfused, _static_config(model))
    report = quantize_(fused, _static_config(model, fuse_norms=True, fuse_outputs=True))
    layers = [f"model.decoder.layers.{i}" for i in range(2)]
    assert "fused 4 norm(s), left 0; 2 output(s) quantized in the epilogue, left 0" in str(report), str(report)
    assert all("with their static scale" in report.norms[f"{n}.final_layer_norm"] for n in layers)
    assert all(f"act_scale of {n}.fc2, which reads it" in report.outputs[f"{n}.fc1"] for n in layers)
    fc1, fc2 = fused.model.decoder.layers[0].fc1, fused.model.decoder.layers[0].fc2
    assert fc1._output_reader == (fc2,) and "output quantized for the next layer" in repr(fc1)
    norm = fused.model.decoder.layers[0].self_attn_layer_norm
    attn = fused.model.decoder.layers[0].self_attn
    assert norm._static_readers == (attn.q_proj, attn.k_proj, attn.v_proj) and "static reader's scale" in repr(norm)
    # the scales live in the readers only: the same state-dict keys as the unfused model, loadable both ways
    assert fused.state_dict().keys() == unfused.state_dict().keys()
    seen = {}
    fc2.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        out, ref = fused(ids).logits, unfused(ids).logits
    assert isinstance(seen["x"], QuantizedRows) and seen["x"].readers == (fc2,)
    assert "quantized for 1 static layer(s)" in repr(seen["x"])
    if kernel:  # the fused norm's last bit may move a value one step
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max(), (out - ref).abs().max()
    else:
        assert torch.equal(out, ref)
    # where quantized rows cannot serve (gradients on, a compiled call), the float outputs: the same values
    assert torch.allclose(fused(ids).logits, out, rtol=0, atol=1e-2 * ref.abs().max().item())
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)(ids).logits
    assert torch.allclose(compiled, out, rtol=0, atol=1e-2 * ref.abs().max().item())
    # the unfused model's scales loaded into the fused one (doubled first): the fused layers follow them
    with torch.no_grad():
        for m in unfused.modules():
            if isinstance(m, Int8Linear) and m.act_scale is not None:
                m.act_scale *= 2
        fused.load_state_dict(unfused.state_dict())
        out, ref = fused(ids).logits, unfused(ids).logits
    assert torch.equal(out, ref) if not kernel else (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    # scales changed after quantize_ (in both), however written: each reader's rows follow its own scale
    with torch.no_grad():
        for m in (fused, unfused):
            attn = m.model.decoder.layers[0].self_attn
            attn.k_proj.act_scale *= 3
            attn.v_proj.act_scale.data.mul_(0.5)  # no version bump
            attn.q_proj.act_scale = attn.q_proj.act_scale * 2  # a new tensor
        out, ref = fused(ids).logits, unfused(ids).logits
        assert torch.equal(out, ref) if not kernel else (out - ref).abs().max() <= 1e-2 * ref.abs().max()
        out, ref = (copy.deepcopy(m)(ids).logits for m in (fused, unfused))
    assert torch.equal(out, ref) if not kernel else (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    # a dtype cast rounds the float weights but keeps the fp32 scales (the readers' buffers): as the unfused model
    with torch.no_grad():
        out, ref = (copy.deepcopy(m).half().float()(ids).logits for m in (fused, unfused))
    assert torch.equal(out, ref) if not kernel else (out - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_static_fusions_left_where_they_would_not_compute_the_same():
    model = fuse_linear_relu(_opt(layers=1))[0]
    config = _static_config(model, fuse_norms=True, fuse_outputs=True)
    scales = dict(config.act_scales)
    scales["model.decoder.layers.0.self_attn.k_proj"] *= 2  # q, k, v of different scales: a row copy each
    report = quantize_(copy.deepcopy(model), Int8StaticActivationInt8WeightConfig(scales, fuse_norms=True,
                                                                                  fuse_outputs=True))
    assert {"model.decoder.layers.0.self_attn_layer_norm", "model.decoder.layers.0.final_layer_norm"} <= set(
        report.norms)
    # fc2 left float: fc1 hands on floats; the ReLU not fused (no fuse_linear_relu first): named
    report = quantize_(copy.deepcopy(model), config, filter_fn=lambda layer, name: not name.endswith("fc2"))
    assert "not a static Int8Linear" in report.outputs_skipped["model.decoder.layers.0.fc1"]
    plain = _opt(layers=1)
    report = quantize_(plain, _static_config(plain, fuse_outputs=True))
    assert "activation_fn is a ReLU, not the nn.Identity" in report.outputs_skipped["model.decoder.layers.0.fc1"]
    assert plain.model.decoder.layers[0].fc1._output_reader == ()
    with pytest.raises(TypeError, match="fuse_outputs must be True or False"):
        Int8StaticActivationInt8WeightConfig(scales, fuse_outputs=1)
    # a forward hook between a norm and its readers, or on fc1's activation: it would see quantized rows
    hooked = copy.deepcopy(model)
    hooked.model.decoder.layers[0].self_attn.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    hooked.model.decoder.layers[0].activation_fn.register_forward_hook(lambda m, args, out: None)
    report = quantize_(hooked, config)
    assert "self_attn has forward hooks" in report.norms_skipped["model.decoder.layers.0.self_attn_layer_norm"]
    assert "activation_fn has forward hooks" in report.outputs_skipped["model.decoder.layers.0.fc1"]
    unfused = copy.deepcopy(model)
    quantize_(unfused, _static_config(model))
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():  # the hooked parts unfused, the rest fused: the unfused model's logits
        out, ref = hooked(ids).logits, unfused(ids).logits
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    # rows handed on to anything but a quantized linear: named, not read as floats
    layer = Int8Linear.from_float(nn.Linear(16, 8))
    with pytest.raises(TypeError, match="made for a static Int8Linear"):
        layer.quantize_output(Int8Linear.from_float(nn.Linear(8, 4)))  # dynamic: no scale to quantize with
    layer.quantize_output(Int8Linear.from_float(nn.Linear(8, 4), act_scale=0.1))
    with torch.no_grad():
        rows = layer(torch.randn(3, 16))
    assert isinstance(rows, QuantizedRows) and rows.shape == (3, 8)
    with pytest.raises(RuntimeError, match="on quantized rows"):
        rows + 1
    x = torch.randn(3, 16, requires_grad=True)  # a gradient wanted: floats, whose backward then raises
    assert type(layer(x)) is torch.Tensor
    with pytest.raises(TypeError, match="made for a static Int8Linear"):
        QuantizedLayerNorm(nn.LayerNorm(16), readers=(nn.Linear(16, 4),))
    # rows quantized for one static layer, read by another (a copy of the producer alone): refused, naming it
    other = Int8Linear.from_float(nn.Linear(8, 4), act_scale=0.1)
    with torch.no_grad(), pytest.raises(TypeError, match="another static Int8Linear got rows quantized for other"):
        other(copy.deepcopy(layer)(torch.randn(3, 16)))
    with torch.no_grad(), pytest.raises(TypeError, match="a dynamic Int8Linear got rows quantized for other static"):
        Int8Linear.from_float(nn.Linear(8, 4))(layer(torch.randn(3, 16)))
    with torch.no_grad(), pytest.raises(TypeError, match="a static Int8Linear got rows quantized with a scale per row"):
        other(QuantizedLayerNorm(nn.LayerNorm(8))(torch.randn(3, 8)))
