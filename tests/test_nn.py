"""fuselab.nn: FusedLinearReLU, fuse_linear_relu (Sequential, torch.fx, Hugging Face), fused_backend."""
import copy
import math
import random
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

from fuselab.nn import FusedConv1DReLU, FusedLinearReLU, fuse_linear_relu, fused_backend

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32: fused vs stock differ only by summation order


def compare(model, patched, *inputs, **kwargs):
    """Outputs and every parameter's gradient of the patched model equal the original's."""
    model.zero_grad()
    patched.zero_grad()
    out, out_p = model(*inputs, **kwargs), patched(*inputs, **kwargs)
    out, out_p = getattr(out, "logits", out), getattr(out_p, "logits", out_p)
    torch.testing.assert_close(out_p, out, **TOL)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (out_p * g).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads_p = {n: p.grad for n, p in patched.named_parameters() if p.grad is not None}
    assert grads.keys() == grads_p.keys()
    for n in grads:
        torch.testing.assert_close(grads_p[n], grads[n], **TOL, msg=n)


def test_fused_linear_relu_module_and_state_dict():
    stock = nn.Sequential(nn.Linear(13, 9), nn.ReLU())
    fused = FusedLinearReLU(13, 9)
    fused.load_state_dict({k.removeprefix("0."): v for k, v in stock.state_dict().items()})
    x = torch.randn(4, 13)
    torch.testing.assert_close(fused(x), stock(x), **TOL)
    assert set(fused.state_dict()) == {"weight", "bias"}
    assert "in_features=13, out_features=9" in repr(fused)
    back = nn.Linear(13, 9)
    back.load_state_dict(fused.state_dict())  # and back into a plain Linear
    torch.testing.assert_close(torch.relu(back(x)), fused(x), **TOL)
    shared = FusedLinearReLU.from_linear(stock[0])
    assert shared.weight is stock[0].weight and shared.bias is stock[0].bias
    nobias = FusedLinearReLU(5, 3, bias=False)
    assert nobias.bias is None and nobias(torch.randn(2, 5)).shape == (2, 3)


def test_fused_linear_relu_compiles_fullgraph():
    torch._dynamo.reset()
    layer, stock = FusedLinearReLU(12, 7), nn.Linear(12, 7)
    stock.load_state_dict(layer.state_dict())
    x = torch.randn(5, 12, requires_grad=True)
    x_stock = x.detach().clone().requires_grad_()
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    ref = torch.relu(stock(x_stock))
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for got, want in [(x.grad, x_stock.grad), (layer.weight.grad, stock.weight.grad),
                      (layer.bias.grad, stock.bias.grad)]:
        torch.testing.assert_close(got, want, **TOL)


def test_fused_layers_on_the_meta_device():
    y = FusedLinearReLU(4, 3, device="meta")(torch.empty(2, 5, 4, device="meta"))
    assert y.shape == (2, 5, 3) and y.device.type == "meta"
    with torch.device("meta"):
        assert FusedLinearReLU(4, 3)(torch.empty(2, 4)).shape == (2, 3)
        assert FusedConv1DReLU(nf=3, nx=4)(torch.empty(2, 4)).shape == (2, 3)


def test_fused_linear_relu_runs_what_the_op_cannot_as_torch_does():
    # float64 (also under autocast, which leaves float64 alone), where the op has no kernel.
    layer = FusedLinearReLU(6, 5, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64)
    want = torch.relu(F.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(layer(x), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(layer(x), want)


def test_fused_linear_relu_autocast():
    fused = FusedLinearReLU(16, 8)
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        y = fused(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), torch.relu(F.linear(x, fused.weight, fused.bias)), rtol=2e-2, atol=2e-2)


def test_sequential_mlp_and_dropout_not_fused():
    model = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 12), nn.Dropout(0.1), nn.ReLU(),
                          nn.Linear(12, 5)).eval()
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.fused == ["0"]
    assert set(report.skipped) == {"2", "5"} and "Dropout" in report.skipped["2"]
    assert type(patched[0]) is FusedLinearReLU and type(patched[2]) is nn.Linear
    assert patched.state_dict().keys() == model.state_dict().keys()
    compare(model, patched, torch.randn(7, 10))


def test_torchvision_classifier_heads():
    import torchvision

    for ctor, expected in [(torchvision.models.alexnet, ["classifier.1", "classifier.4"]),
                           (torchvision.models.vgg11, ["classifier.0", "classifier.3"])]:
        model = ctor(weights=None)
        keys = model.state_dict().keys()
        patched, report = fuse_linear_relu(model)
        assert patched is model and report.fused == expected, str(report)
        assert "classifier.6" in report.skipped
        assert patched.state_dict().keys() == keys
        # The head as torchvision builds it, its Linears narrowed (the interpreter takes minutes at 4096
        # wide), after 4 channels pooled to 3x3 instead of the convolutional features.
        model = ctor(weights=None).eval()
        model.features, model.avgpool = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), nn.AdaptiveAvgPool2d(3)
        linears = [i for i, layer in enumerate(model.classifier) if isinstance(layer, nn.Linear)]
        for i, (fan_in, fan_out) in zip(linears, [(36, 24), (24, 16), (16, 10)]):
            model.classifier[i] = nn.Linear(fan_in, fan_out)
        patched, report = fuse_linear_relu(copy.deepcopy(model))
        assert report.fused == expected, str(report)
        compare(model, patched, torch.randn(2, 3, 8, 8))


class FxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        z = self.fc2(h)
        return self.fc3(torch.relu(z) + z)  # fc2's output is used twice: must not be fused


def test_fx_rewrite():
    model = FxNet()
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.method == "torch.fx rewrite" and report.fused == ["fc1"], str(report)
    assert {"fc2", "fc3"} <= set(report.skipped)
    assert isinstance(patched, torch.fx.GraphModule)
    compare(model, patched, torch.randn(5, 8))


class ReluBlock(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin, self.act = nn.Linear(width, width), nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x))


def test_a_sequential_of_blocks_has_each_block_traced_and_stays_a_sequential():
    # Found by a probe: a Sequential root fused nothing (its own pop/append/insert/extend refused the whole-model
    # trace, and the report named those as the model's methods). Each child is traced now, the root kept.
    model = nn.Sequential(ReluBlock(), ReluBlock(), FxNet(), nn.Linear(4, 4))
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert type(patched) is nn.Sequential and len(patched) == 4
    assert report.fused == ["0.lin", "1.lin", "2.fc1"], str(report)
    assert {"2.fc2", "2.fc3", "3"} <= set(report.skipped) and "methods" not in str(report)
    assert isinstance(patched[0], torch.fx.GraphModule) and type(patched[3]) is nn.Linear
    compare(model, patched, torch.randn(5, 8))
    names = []
    _, report = fuse_linear_relu(copy.deepcopy(model), filter_fn=lambda name, layer: names.append(name) or
                                 name != "1.lin")
    assert report.fused == ["0.lin", "2.fc1"] and report.skipped["1.lin"] == "vetoed by filter_fn"
    assert {"0.lin", "1.lin", "2.fc1"} <= set(names)

    def veto(name, layer):
        if name == "2.fc1":
            raise RuntimeError("filter failed")
        return True

    blocks = list(model)
    with pytest.raises(RuntimeError, match="filter failed"):  # raised after block 0 was traced: nothing changed
        fuse_linear_relu(model, filter_fn=veto)
    assert list(model) == blocks


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)  # data-dependent: fx cannot trace it


def test_nested_and_repeated_children_of_sequentials_and_each_childs_reason():
    # Found by a probe: a nested plain Sequential fused nothing (the refused whole-model trace one level down), a
    # block under two keys was fused under one, and one child's "could not run" was every child's reason.
    shared = ReluBlock()
    model = nn.Sequential(nn.Sequential(ReluBlock(), shared), shared, Untraceable(), nn.Sequential(nn.Tanh()))
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.fused == ["0.0.lin", "0.1.lin", "1.lin"], str(report)
    assert type(patched[0]) is nn.Sequential and patched[0][1] is patched[1]  # still one module, fused once
    assert "could not run" in report.skipped["2.fc"], str(report)
    compare(model, patched, torch.randn(5, 8).abs())
    vetoed = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="no"):  # a veto raised in the nested Sequential: nothing changed
        fuse_linear_relu(vetoed, filter_fn=lambda name, layer: (_ for _ in ()).throw(RuntimeError("no"))
                         if name == "0.1.lin" else True)
    assert all(type(m) is not FusedLinearReLU and not isinstance(m, torch.fx.GraphModule) for m in vetoed.modules())


def test_nothing_to_fuse_is_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    patched, report = fuse_linear_relu(model)
    assert patched is model and report.fused == [] and len(report.skipped) == 2
    assert all(type(m) is not FusedLinearReLU for m in model.modules())


def test_filter_fn():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    _, report = fuse_linear_relu(model, filter_fn=lambda name, lin: name != "2")
    assert report.fused == ["0"]


def _tiny_opt(act, layers=2):
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, ffn_dim=24, num_attention_heads=2,
                    max_position_embeddings=32, word_embed_proj_dim=16, activation_function=act,
                    dropout=0.0, attention_dropout=0.0)
    return OPTForCausalLM(cfg).eval()


def test_hf_opt_relu():
    model = _tiny_opt("relu")
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert len(report.fused) == 2 and all(n.endswith("fc1") for n in report.fused), str(report)
    compare(model, patched, torch.randint(0, 64, (2, 7)))


def test_hf_opt_gelu_left_alone():
    model = _tiny_opt("gelu")
    _, report = fuse_linear_relu(model)
    assert report.fused == [] and any("GELU" in why for why in report.skipped.values())


def test_hf_t5_dense_relu_dense():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1,
                   num_heads=2, dense_act_fn="relu", feed_forward_proj="relu", dropout_rate=0.0,
                   decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg).eval()
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert len(report.fused) == 2 and all(n.endswith("DenseReluDense.wi") for n in report.fused), str(report)
    ids = torch.randint(0, 64, (2, 5))
    compare(model, patched, input_ids=ids, decoder_input_ids=ids)


def _hf_model(name, **cfg):
    import transformers

    config = getattr(transformers, f"{name}Config")(**cfg)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


def test_hf_gated_relu_mlps_and_neox():
    # Llama-style gated MLPs (act(gate_proj x) * up_proj x) and GPT-NeoX, configured with ReLU.
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=32, hidden_act="relu")
    for name, extra, suffix in [("Llama", dict(num_key_value_heads=1), "gate_proj"),
                                ("Qwen2", dict(num_key_value_heads=1), "gate_proj"),
                                ("GPTNeoX", dict(rotary_pct=1.0), "dense_h_to_4h")]:
        model = _hf_model(name, **small, **extra)
        patched, report = fuse_linear_relu(copy.deepcopy(model))
        assert len(report.fused) == 2 and all(n.endswith(suffix) for n in report.fused), (name, str(report))
        compare(model, patched, torch.randint(0, 64, (2, 7)))
        gelu = _hf_model(name, **{**small, "hidden_act": "gelu"}, **extra)
        assert fuse_linear_relu(gelu)[1].fused == []


def test_hf_gpt2_conv1d():
    # GPT-2's MLP uses transformers' Conv1D (x @ weight + bias): fused as FusedConv1DReLU, same state_dict.
    from transformers import GPT2Config, GPT2LMHeadModel

    from fuselab.nn import FusedConv1DReLU

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, activation_function="relu",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert len(report.fused) == 2 and all(n.endswith("mlp.c_fc") for n in report.fused), str(report)
    assert isinstance(patched.transformer.h[0].mlp.c_fc, FusedConv1DReLU)
    assert patched.state_dict().keys() == model.state_dict().keys()
    compare(model, patched, torch.randint(0, 64, (2, 7)))
    gelu = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    assert fuse_linear_relu(gelu)[1].fused == []
    layer = FusedConv1DReLU(nf=9, nx=5)
    torch.nn.init.normal_(layer.bias)  # zeros at init, like Conv1D's
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(layer(x), torch.relu(x @ layer.weight + layer.bias), **TOL)
    assert repr(layer) == "FusedConv1DReLU(nf=9, nx=5)" and layer.weight.shape == (5, 9)


def test_hf_bart_and_gated_t5():
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, activation_function="relu",
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)).eval()
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
        feed_forward_proj="gated-relu", dropout_rate=0.0, decoder_start_token_id=0)).eval()
    ids = torch.randint(3, 64, (2, 6))
    for model, suffix in [(bart, "fc1"), (t5, "DenseReluDense.wi_0")]:
        patched, report = fuse_linear_relu(copy.deepcopy(model))
        assert len(report.fused) == 2 and all(n.endswith(suffix) for n in report.fused), str(report)
        compare(model, patched, input_ids=ids, decoder_input_ids=ids)


def test_hf_adapter_checks_the_block_it_patches():
    # A block with an adapter's class name whose forward uses the Linear's output twice (a reshaped
    # block in some other transformers release) is left alone, with the reason.
    class LlamaMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.act_fn = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            g = self.gate_proj(x)
            return self.act_fn(g) + g

    model = nn.Sequential(LlamaMLP())
    x = torch.randn(3, 8)
    before = model(x)
    patched, report = fuse_linear_relu(model)
    assert report.fused == [] and "no longer computes act_fn(gate_proj(x))" in report.skipped["0.gate_proj"]
    torch.testing.assert_close(patched(x), before)


class MatmulNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 10)
        self.w = nn.Parameter(torch.randn(10, 7))
        self.bias = nn.Parameter(torch.randn(7))

    def forward(self, x):
        h = F.relu(self.fc(x))
        return torch.relu(torch.addmm(self.bias, h, self.w)) + torch.relu(h @ self.w)


def test_fused_backend_rewrites_captured_graphs():
    torch._dynamo.reset()
    model = MatmulNet()
    seen = []

    def spy(gm, example_inputs):
        compiled = fused_backend("aot_eager")(gm, example_inputs)  # rewrites gm in place first
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return compiled

    x = torch.randn(4, 6)
    out = torch.compile(model, backend=spy, fullgraph=True)(x)
    torch.testing.assert_close(out, model(x), **TOL)
    ops = seen[0]
    assert any("linear_relu" in op for op in ops) and any("matmul_relu" in op for op in ops), ops
    assert not any(op.startswith("<built-in method relu") or op.startswith("<function relu") for op in ops), ops


class FrozenFeatures(nn.Module):
    """A product made under no_grad (or autocast), its ReLU outside that region."""

    def __init__(self, autocast: bool):
        super().__init__()
        self.fc, self.head, self.autocast = nn.Linear(8, 16), nn.Linear(16, 4), autocast

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else torch.no_grad():
            h = self.fc(x)
        return F.relu(h) if self.autocast else self.head(F.relu(h))  # autocast: bf16 out of the region


@pytest.mark.parametrize("autocast", [False, True], ids=["no_grad", "autocast"])
def test_fused_backend_keeps_a_product_in_its_grad_or_autocast_region(autocast):
    # the fused call went where the ReLU was: a no_grad feature layer got gradients (an optimizer would train a
    # frozen layer), an autocast product ran in fp32
    grads = []
    for backend in ("aot_eager", fused_backend("aot_eager")):
        torch.manual_seed(0)
        model = FrozenFeatures(autocast)
        torch._dynamo.reset()
        out = torch.compile(model, backend=backend)(torch.randn(4, 8))
        out.sum().backward()
        grads.append((out.detach(), model.fc.weight.grad))
    (plain, plain_grad), (fused, fused_grad) = grads
    assert fused.dtype == plain.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=0, atol=1e-6 if not autocast else 2e-2)
    assert (plain_grad is None) == (fused_grad is None) == (not autocast)


class Residual(nn.Sequential):
    def forward(self, x):
        h = self[0](x)
        return self[1](h) + h


def test_sequentials_that_compute_something_else_left_alone():
    model = nn.Sequential(Residual(nn.Linear(6, 6), nn.ReLU()),
                          nn.Sequential(OrderedDict(fc=nn.Linear(6, 5), act=nn.ReLU())))
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.fused == ["1.fc"], str(report)  # named as the module is, not by its index
    assert "own forward" in report.skipped["0.0"]
    compare(model, patched, torch.randn(3, 6))


def _relu_mlp(pairs, width=6):
    return nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(width, width), nn.ReLU())])


class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_layers_with_hooks_pruning_or_parametrizations_left_alone():
    model = _relu_mlp(6)
    calls = []
    model[0].register_forward_hook(lambda m, i, o: calls.append("forward"))
    model[3].register_forward_pre_hook(lambda m, i: calls.append("relu pre"))  # on a ReLU
    model[4].register_full_backward_hook(lambda m, gi, go: calls.append("backward"))
    prune.l1_unstructured(model[6], "weight", amount=0.5)
    parametrize.register_parametrization(model[8], "weight", Double())
    layers = list(model)
    x, g = torch.randn(3, 6), torch.randn(3, 6)
    want = model(x)
    (want * g).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    calls.clear()
    patched, report = fuse_linear_relu(model)
    assert report.fused == ["10"], str(report)
    for name, word in [("0", "hooks"), ("2", "ReLU has hooks"), ("4", "hooks"), ("6", "prune"), ("8", "parametriz")]:
        assert word in report.skipped[name], (name, str(report))
        assert patched[int(name)] is layers[int(name)] and patched[int(name) + 1] is layers[int(name) + 1]
    model.zero_grad()
    got = patched(x)
    (got * g).sum().backward()
    assert calls == ["forward", "relu pre", "backward"]
    torch.testing.assert_close(got, want, **TOL)
    for got_grad, want_grad in zip([p.grad for p in model.parameters()], want_grads):
        torch.testing.assert_close(got_grad, want_grad, **TOL)


def test_hf_block_with_hooks_or_parametrization_left_alone():
    model = _tiny_opt("relu", layers=3)
    calls = []
    fc1s = [layer.fc1 for layer in model.model.decoder.layers]
    fc1s[0].register_forward_hook(lambda m, i, o: calls.append("fc1"))
    model.model.decoder.layers[1].activation_fn.register_forward_hook(lambda m, i, o: calls.append("act"))
    parametrize.register_parametrization(fc1s[2], "weight", Double())
    patched, report = fuse_linear_relu(model)
    assert report.fused == [], str(report)
    assert "hooks" in report.skipped["model.decoder.layers.0.fc1"]
    assert "ReLU has hooks" in report.skipped["model.decoder.layers.1.fc1"]
    assert "parametriz" in report.skipped["model.decoder.layers.2.fc1"]
    patched(torch.randint(0, 64, (2, 5)))
    assert calls == ["fc1", "act"]


def test_filter_fn_that_raises_changes_nothing():
    model = _relu_mlp(2, width=4)
    layers = list(model)

    def veto(name, layer):
        if name == "2":
            raise RuntimeError("filter failed")
        return True

    with pytest.raises(RuntimeError, match="filter failed"):
        fuse_linear_relu(model, filter_fn=veto)
    assert list(model) == layers
    _, report = fuse_linear_relu(model, filter_fn=lambda name, layer: name != "2")
    assert report.fused == ["0"] and report.skipped["2"] == "vetoed by filter_fn", str(report)


def test_the_report_quotes_layer_names():
    # A Sequential's children are named by index: unquoted, "fused    0" read like a count.
    _, report = fuse_linear_relu(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    assert str(report).splitlines()[1:] == ["  fused    '0'", "  skipped  '2': followed by nothing, not ReLU"]


def test_unsupported_dtype_left_alone():
    for model, name, x in [(_relu_mlp(1).double(), "0", torch.randn(2, 6)),
                           (FxNet().double(), "fc1", torch.randn(2, 8))]:
        patched, report = fuse_linear_relu(model)
        assert patched is model and report.fused == [] and "float64" in report.skipped[name], str(report)
        model(x.double())


class InplaceReLUs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x):
        h = F.relu(self.fc1(x), inplace=True)
        h = torch.relu_(self.fc2(h))
        h = self.fc3(h).relu_()
        return F.relu(input=self.fc4(h))


def test_inplace_relus_keep_their_meaning():
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 4))
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.fused == ["0"], str(report)
    compare(model, patched, torch.randn(3, 5))
    model = InplaceReLUs()
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.fused == ["fc1", "fc2", "fc3", "fc4"], str(report)
    compare(model, patched, torch.randn(3, 6))


class FunctionalNet(nn.Module):
    """Linear + ReLU written out: keyword arguments, a bias of every shape addmm broadcasts."""

    def __init__(self, m=4, k=6, n=5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(n, k)), nn.Parameter(torch.randn(n))
        self.w = nn.Parameter(torch.randn(k, n))
        self.row_bias, self.full_bias = nn.Parameter(torch.randn(1, n)), nn.Parameter(torch.randn(m, n))

    def forward(self, x):
        return (F.relu(F.linear(x, weight=self.weight, bias=self.bias))
                + torch.relu(F.linear(input=x, weight=self.weight, bias=self.bias))
                + torch.relu(torch.addmm(self.row_bias, x, self.w))
                + torch.relu(torch.addmm(self.full_bias, x, self.w))
                + torch.relu(torch.addmm(self.bias, x, self.w)))


class MatmulReLU(nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)


def _compiled_with_fuselab(model):
    """``model`` whose forward runs through ``fused_backend``; and the ops of each graph it compiled."""
    torch._dynamo.reset()
    graphs = []

    def spy(gm, example_inputs):
        compiled = fused_backend("aot_eager")(gm, example_inputs)  # rewrites gm in place first
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compiled

    model.forward = torch.compile(model.forward, backend=spy, fullgraph=True)
    return model, graphs


def test_graph_rewrites_keep_what_the_model_computes():
    model = FunctionalNet()
    patched, report = fuse_linear_relu(copy.deepcopy(model))
    assert report.method == "torch.fx rewrite" and len(report.fused) == 2, str(report)  # the two F.linear
    x = torch.randn(4, 6)
    compare(model, patched, x)
    compiled, graphs = _compiled_with_fuselab(copy.deepcopy(model))
    compare(model, compiled, x)
    fused = [op for op in graphs[0] if "fused_" in op]
    assert len(fused) == 3 and sum("addmm" in op for op in graphs[0]) == 2, graphs  # (1, N) and (M, N) biases stay
    for dtype in (torch.float64, torch.int64):  # the op has no kernel for these: left alone
        x, w = torch.randint(-3, 4, (4, 6)).to(dtype), torch.randint(-3, 4, (6, 5)).to(dtype)
        compiled, graphs = _compiled_with_fuselab(MatmulReLU())
        torch.testing.assert_close(compiled(x, w), torch.relu(x @ w))
        assert not any("fused_" in op for op in graphs[0]), graphs


def test_fx_rewrite_saves_loads_and_patches_again(tmp_path):
    for model in [FxNet(), FunctionalNet()]:
        patched, report = fuse_linear_relu(copy.deepcopy(model))
        assert report.method == "torch.fx rewrite", str(report)
        torch.save(patched, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        again, report = fuse_linear_relu(loaded)
        assert again is loaded and report.fused == [], str(report)
        compare(model, again, torch.randn(4, 8 if isinstance(model, FxNet) else 6))


def test_an_fx_result_patched_again_gives_the_graphs_reasons():
    # The fx path refused its own result: a GraphModule's meta and shape_env, and the fused layers' in_features,
    # were read as the user's Python state ("could not run: the model keeps Python attributes (meta, ...)")
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.b(F.relu(self.a(x)))

    patched, report = fuse_linear_relu(Head())
    assert report.method == "torch.fx rewrite" and report.fused == ["a"], str(report)
    _, report = fuse_linear_relu(patched)
    assert report.skipped == {"a": "already fused", "b": "not followed by ReLU, or its output is used elsewhere "
                                                        "(fx graph)"}, str(report)


class TrainModeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, self.training))


class NoGradNet(TrainModeNet):
    def forward(self, x):
        with torch.no_grad():
            h = F.relu(self.fc1(x))
        return self.fc2(h)


class AutocastOffNet(TrainModeNet):
    def forward(self, x):
        with torch.autocast("cpu", enabled=False):  # fp32 here even when the caller runs autocast
            h = F.relu(self.fc1(x.float()))
        return self.fc2(h)


def test_fx_path_leaves_alone_what_a_graph_would_change():
    hooked = FxNet()
    hooked.fc1.register_forward_pre_hook(lambda m, args: (2 * args[0],))
    for model, why in [(TrainModeNet(), "train/eval"), (NoGradNet(), "grad mode"), (AutocastOffNet(), "autocast"),
                       (hooked, "hooks")]:
        patched, report = fuse_linear_relu(model)
        assert report.fused == [] and patched is model and why in report.skipped["fc1"], str(report)
    with torch.no_grad():  # patched where the block's no_grad changes nothing, run where it does
        assert fuse_linear_relu(NoGradNet())[1].fused == []


@pytest.mark.gpu
def test_patched_models_on_a_gpu():
    # On CUDA the op runs Triton for fp16 (autocast) and cuBLAS + ReLU for fp32 at torch's default precision.
    for model, x in [(_relu_mlp(2, width=64), torch.randn(8, 64)), (InplaceReLUs(), torch.randn(2, 5, 6)),
                     (FunctionalNet(), torch.randn(4, 6))]:
        model, x = model.cuda(), x.cuda()
        patched, report = fuse_linear_relu(copy.deepcopy(model))
        assert report.fused, str(report)
        compare(model, patched, x)
        with torch.autocast("cuda", dtype=torch.float16):
            got, want = patched(x), model(x)
        assert got.dtype == want.dtype == torch.float16
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        compiled, graphs = _compiled_with_fuselab(copy.deepcopy(model))
        compare(model, compiled, x)
        assert any("fused_" in op for op in graphs[0]), graphs
    model = _relu_mlp(1).cuda().double()
    assert fuse_linear_relu(model)[1].fused == []


def test_fx_path_leaves_alone_what_a_graph_module_would_drop_or_freeze():
    # A GraphModule keeps neither the model's own hooks nor its methods, and bakes Python attributes in.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return F.relu(self.a(x))

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = Block(), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.block(x))

    class Scaled(Hooked):
        def __init__(self):
            super().__init__()
            self.scale = 1.0

        def forward(self, x):
            return self.head(self.block(x)) * self.scale

    class WithMethod(Hooked):
        def extra(self):
            return 1

    hooked = Hooked()
    hooked.register_forward_hook(lambda module, inputs, out: out + 100)
    for model, words in ((hooked, "hooks"), (Scaled(), "scale"), (WithMethod(), "extra")):
        x = torch.randn(4, 8)
        ref = model(x)
        patched, report = fuse_linear_relu(model)
        assert patched is model and not report.fused, report
        assert words in report.skipped["block.a"], report
        torch.testing.assert_close(patched(x), ref)


# ----------------------------------------------------------------------------------------------
# Found by a skeptical-user probe: patches that changed what a model computes, silently
# ----------------------------------------------------------------------------------------------


def _bert_intermediate(cls=None):
    bert = pytest.importorskip("transformers.models.bert.modeling_bert")
    cls = cls or bert.BertIntermediate
    return cls(bert.BertConfig(hidden_size=8, intermediate_size=16, hidden_act="relu"))


def test_a_subclass_with_its_own_forward_is_not_patched_as_its_parent():
    bert = pytest.importorskip("transformers.models.bert.modeling_bert")

    class ResidualIntermediate(bert.BertIntermediate):  # the Linear's output is used beside the ReLU's
        def forward(self, h):
            pre = self.dense(h)
            return self.intermediate_act_fn(pre) + 0.1 * pre

    torch.manual_seed(0)
    model = nn.Sequential(_bert_intermediate(ResidualIntermediate))
    x, ref = torch.randn(3, 8), copy.deepcopy(model)
    model, report = fuse_linear_relu(model)
    assert report.fused == [] and type(model[0].dense) is nn.Linear
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("container", ["sequential", "hf-block"])
def test_a_forward_replaced_on_the_instance_keeps_its_layers(container):
    import types

    torch.manual_seed(0)
    if container == "sequential":
        block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        block.forward = types.MethodType(lambda self, x: self[1](self[0](x)) + self[0](x), block)
    else:
        block = _bert_intermediate()
        block.forward = types.MethodType(lambda self, h: self.intermediate_act_fn(self.dense(h)) - self.dense(h),
                                         block)
    model = nn.Sequential(block)
    x, ref = torch.randn(3, block[0].in_features if container == "sequential" else 8), copy.deepcopy(model)
    model, report = fuse_linear_relu(model)
    assert report.fused == [], str(report)
    assert "forward" in " ".join(report.skipped.values())
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


def test_a_linear_with_extra_state_is_left_alone_and_modes_are_kept():
    extra = nn.Linear(8, 16)
    extra.register_buffer("scale", torch.ones(1))
    model = nn.Sequential(extra, nn.ReLU(), nn.Linear(16, 16), nn.ReLU()).eval()
    keys = list(model.state_dict())
    model, report = fuse_linear_relu(model)
    assert report.fused == ["2"] and "holds scale besides its weight and bias" in report.skipped["0"]
    assert list(model.state_dict()) == keys  # the buffer would have vanished with the swap
    assert not any(m.training for m in model.modules())  # the fused layer and its Identity: eval, as the model


class _UnusedState(nn.Module):
    """A forward that fx can rewrite, beside state it never reads (an auxiliary head, an EMA buffer)."""

    def __init__(self, unused: bool = True):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        if unused:
            self.aux = nn.Linear(4, 2)
            self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        return self.out(F.relu(self.fc(x)))


def test_the_fx_path_refuses_a_model_whose_unused_state_or_state_dict_hooks_it_would_drop():
    model = _UnusedState()
    patched, report = fuse_linear_relu(model)
    assert patched is model and not report.fused
    assert "does not use aux.bias, aux.weight, ema" in report.skipped["fc"]
    hooked = _UnusedState(unused=False)
    hooked.register_state_dict_post_hook(lambda module, sd, prefix, meta: sd.update({prefix + "version": 2}))
    patched, report = fuse_linear_relu(hooked)
    assert patched is hooked and "hooks (state_dict_hooks)" in report.skipped["fc"]
    patched, report = fuse_linear_relu(_UnusedState(unused=False))  # the same forward, nothing to drop: fused
    assert report.fused == ["fc"] and set(patched.state_dict()) == {"fc.weight", "fc.bias", "out.weight", "out.bias"}


SCALE = torch.tensor(1.0)  # read by _ReadsGlobal's forward (a number would be a constant, kept as traced)


class _UpdatesEma(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = F.relu(self.fc(x))
        self.ema.mul_(0.9).add_(0.1 * h.mean(0))  # in place on the buffer: the graph records it
        return h + self.ema


class _Counts(_UpdatesEma):
    def forward(self, x):
        self.ema += 1  # a new tensor assigned to the buffer: no graph records that
        return F.relu(self.fc(x)) * self.ema


class _OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = F.relu(self.fc(x))
        if mask is None:  # traced with a proxy for mask: this branch never entered the graph
            h = h * 2
        return h


class _IgnoresArgument(_OptionalMask):
    def forward(self, x, mask):
        h = F.relu(self.fc(x))
        return h * 2 if mask is None else h


class _ReadsGlobal(_OptionalMask):
    def forward(self, x):
        return F.relu(self.fc(x)) * SCALE


class _ReadsLeafAttribute(_OptionalMask):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return F.relu(self.fc(x)) * (1 - self.drop.p)


class _CallsAndReadsLeaf(_ReadsLeafAttribute):
    def forward(self, x):
        return self.drop(F.relu(self.fc(x))) * (1 - self.drop.p)


RATE = 0.5  # a number a training loop could rebind: a graph would keep 0.5


class _ReadsGlobalNumber(_OptionalMask):
    def forward(self, x):
        return F.relu(self.fc(x)) * RATE


class _MakesATensor(_OptionalMask):
    def forward(self, x):
        return F.relu(self.fc(x)) * torch.tensor(0.5)  # a frozen constant, and a state-dict entry of the graph's


class _MasksWhenGiven(_OptionalMask):
    def forward(self, x, mask=None):
        h = F.relu(self.fc(x))
        if mask is not None:  # traced with a proxy: the masked path, which a call without a mask cannot take
            h = h.masked_fill(mask, 0.0)
        return h


class _BranchesOnABuffer(_UpdatesEma):
    def forward(self, x):
        if self.ema.abs().sum() > 0:  # a decision on the buffer's value, frozen if it were traced as a value
            x = x / self.ema
        return F.relu(self.fc(x))


class _Checkpointed(_OptionalMask):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda h: F.relu(self.fc(h)), x, use_reentrant=False)


class _ReadsLeafByName(_ReadsLeafAttribute):
    def forward(self, x):
        return F.relu(self.fc(x)) * (1 - getattr(self, "drop").p)


class _TestsTheInputsType(_OptionalMask):
    def forward(self, x):
        h = F.relu(self.fc(x))
        return h * 2 if isinstance(x, torch.Tensor) else h  # a Proxy while tracing: the other branch frozen


class _KeepsAPrivateTemperature(_OptionalMask):
    def __init__(self):
        super().__init__()
        self._temperature = 1.0  # changed later (a schedule): a graph kept 1.0

    def forward(self, x):
        return F.relu(self.fc(x)) / self._temperature


class _DropsWithPythonsRandom(_OptionalMask):
    def forward(self, x):
        h = F.relu(self.fc(x))
        # LayerDrop's draw (a probability of 1 here, so that every trace takes one branch): frozen at the traced draw
        return h if random.random() < 1.0 else h[:, :2]


@pytest.mark.parametrize("cls,words", [
    (_TestsTheInputsType, "tests isinstance(x, ...)"), (_KeepsAPrivateTemperature, "Python attributes (_temperature)"),
    (_DropsWithPythonsRandom, "reads random from outside"),
    (_Counts, "assigns to ema"), (_OptionalMask, "argument mask does not reach the graph"),
    (_IgnoresArgument, "argument mask does not reach the graph"), (_ReadsGlobal, "reads SCALE from outside"),
    (_ReadsLeafAttribute, "reads drop.p"), (_CallsAndReadsLeaf, "reads drop.p"),
    (_ReadsLeafByName, "reads module drop without calling it"), (_ReadsGlobalNumber, "reads RATE from outside"),
    (_MakesATensor, "makes or reads a tensor outside the model"), (_MasksWhenGiven, "defaults to None"),
    (_BranchesOnABuffer, "not traceable"), (_Checkpointed, "saved-tensor hooks"),
])
def test_the_fx_path_refuses_what_a_graph_would_freeze_and_leaves_the_model_as_it_was(cls, words):
    # Each of these was patched (or its buffer changed while tracing) and then computed something else: the
    # patched step count stood still (its tracing had run the forward thrice), `mask=None` lost its branch, a
    # global and a module's attribute changed later were ignored.
    torch.manual_seed(0)
    model = cls()
    state = copy.deepcopy(model.state_dict())
    patched, report = fuse_linear_relu(model)
    assert patched is model and not report.fused and words in report.skipped["fc"], str(report)
    for key, value in model.state_dict().items():  # nothing ran on the model's buffers while tracing
        assert type(value) is torch.Tensor and torch.equal(value, state[key]), key


device = torch.device("cpu")  # a global named like the attribute a forward reads (x.device): no global read


class _ReadsConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.heads = nn.Linear(8, 8), nn.ModuleDict({"a": nn.Linear(8, 2)})
        self.register_buffer("table", torch.zeros(16, 8))

    def forward(self, x, scale=1.0):  # a number's default, which the graph reads as a value
        h = F.relu(self.fc(x)) * scale + math.pi
        h = (h + self.table[: x.shape[0]]).to(x.device)  # a buffer sliced by the input's size: in the graph
        return sum(head(h) for _, head in self.heads.items()) * self.fc.out_features


def test_what_a_graph_keeps_faithfully_is_still_fused():
    # The checks above must not refuse what the graph keeps: a numeric constant, an attribute named like a
    # global, a defaulted argument the graph reads, a module list's items, a Linear's shape, a buffer's shape.
    torch.manual_seed(0)
    model, x = _ReadsConstants(), torch.randn(4, 8)
    stock = copy.deepcopy(model)
    patched, report = fuse_linear_relu(model)
    assert report.fused == ["fc"], str(report)
    torch.testing.assert_close(patched(x), stock(x))
    torch.testing.assert_close(patched(x, 2.0), stock(x, 2.0))


def test_an_in_place_buffer_update_is_traced_and_runs_every_call():
    torch.manual_seed(0)
    model, x = _UpdatesEma(), torch.randn(4, 8)
    stock = copy.deepcopy(model)
    patched, report = fuse_linear_relu(model)
    assert report.fused == ["fc"] and not model.ema.any(), str(report)  # tracing did not update it
    for _ in range(3):
        torch.testing.assert_close(patched(x), stock(x))
    torch.testing.assert_close(patched.ema, stock.ema)


class _KeepsFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU())

    def forward(self, x):
        features = []
        for layer in self.body:  # each layer's output, the Linear's before its ReLU too
            x = layer(x)
            features.append(x)
        return features[0].sum(-1) + features[-1].sum(-1)


class _ReusesTheReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return self.seq(x) + self.seq[1](x - 1)


class _CallsItsSequential(_ReusesTheReLU):
    def __init__(self):
        super().__init__()
        self.seq[0].bias.data.zero_()  # __init__ ran before any patch: its uses do not count

    def forward(self, x):
        return self.seq(x) * 2

    def freeze(self):  # whole-module uses: the same for a fused layer
        self.seq.requires_grad_(False)
        return len(self.seq), sum(p.numel() for p in self.seq.parameters())

    @staticmethod
    def describe(seq):
        return [type(m).__name__ for m in seq]


class _ReachesByName(_ReusesTheReLU):
    def forward(self, x):
        return self.seq(x) + getattr(self, "seq")[0](x)


class _ReachesBySubmoduleName(_ReusesTheReLU):
    def forward(self, x):
        return self.seq(x) + self.get_submodule("seq.0")(x) + self._modules["seq"][0](x)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return self.mlp(x)


class _ReachesThroughItsChild(nn.Module):
    """A module above the Sequential's parent reads its pre-activation features."""

    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x) + self.block.mlp[0](x)


class _ReachesThroughAnAlias(_ReachesThroughItsChild):
    def forward(self, x):
        block = self.block  # the block under a local name, then into its Sequential
        return block(x) + block.mlp[0](x)


class _ReachesByAComputedName(_ReusesTheReLU):
    which = "seq"

    def forward(self, x):
        return self.seq(x) + getattr(self, self.which)[0](x)


class _CallsByAComputedName(_ReusesTheReLU):
    which = "seq"

    def forward(self, x):  # a module chosen by name and called whole: nothing reaches inside
        return getattr(self, self.which)(x) * 2

    def submodule(self, name):
        return getattr(self, name)


class _ReachesFromAClosure(_ReusesTheReLU):
    def __init__(self):
        super().__init__()
        self.pre = lambda x: self.seq[0](x)  # made in __init__, called after any patch

    def forward(self, x):
        return self.seq(x) + self.pre(x)


class _ReachesThroughASecondName(_ReusesTheReLU):
    def __init__(self):
        super().__init__()
        self.trunk = self.seq  # one Sequential under two names: the check read the first only

    def forward(self, x):
        return self.seq(x) + self.trunk[0](x)


@pytest.mark.parametrize("cls", [_KeepsFeatures, _ReusesTheReLU, _CallsItsSequential, _ReachesByName,
                                 _ReachesBySubmoduleName, _ReachesThroughItsChild, _ReachesThroughAnAlias,
                                 _ReachesByAComputedName, _ReachesFromAClosure, _ReachesThroughASecondName,
                                 _CallsByAComputedName])
def test_a_parent_that_reaches_into_its_sequential_keeps_its_layers(cls):
    # Module patching fused the Sequential's pair while the parent iterated it (its features[0] got the ReLU)
    # or called its ReLU, by then an Identity. Such a parent's Sequential is left alone (the fx path may
    # still fuse it faithfully); a parent that only calls it is patched as before.
    torch.manual_seed(0)
    model, x = cls(), torch.randn(5, 8)
    stock = copy.deepcopy(model)
    patched, report = fuse_linear_relu(model)
    torch.testing.assert_close(patched(x), stock(x))  # fp32 rounding apart (a wrong patch: differences of ~1)
    if cls is _KeepsFeatures:  # the fx path fuses the last pair, whose Linear's output nothing else reads
        assert report.fused == ["body.2"] and "forward uses self.body other than by calling it" in report.skipped[
            "body.0"], str(report)
    elif cls in (_ReachesByName, _ReachesBySubmoduleName):  # fx: the Linear's output is used elsewhere, nothing fused
        assert not report.fused and "other than by calling it" in report.skipped["seq.0"], str(report)
    elif cls is _ReachesThroughItsChild:  # a grandparent's use: it was fused, the output changed by ~1
        assert not report.fused and "_ReachesThroughItsChild.forward uses self.block.mlp other than" in \
            report.skipped["block.mlp.0"], str(report)
    elif cls in (_ReachesThroughAnAlias, _ReachesByAComputedName, _ReachesFromAClosure, _ReachesThroughASecondName):
        assert not report.fused, str(report)  # each was fused, its output off by ~1 to ~6 (found by a probe)
    else:
        assert report.fused == ["seq.0"], str(report)
        assert report.method == ("torch.fx rewrite" if cls is _ReusesTheReLU else "module patching")


def test_a_second_patch_of_a_block_says_already_fused():
    opt = pytest.importorskip("transformers.models.opt.modeling_opt")
    config = opt.OPTConfig(hidden_size=8, ffn_dim=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=16,
                           max_position_embeddings=16, word_embed_proj_dim=8)
    model, _ = fuse_linear_relu(opt.OPTForCausalLM(config))
    _, again = fuse_linear_relu(model)
    assert not again.fused and again.skipped["model.decoder.layers.0.fc1"] == "already fused", str(again)


def test_fuse_linear_relu_of_something_not_a_module_says_so():
    with pytest.raises(TypeError, match="fuse_linear_relu patches an nn.Module, got Tensor"):
        fuse_linear_relu(torch.randn(2, 2))  # was: 'Tensor' object has no attribute 'named_modules'


def test_torchscript_is_refused_by_name():
    # torch.jit.script cannot compile the fused layers' Python paths: say so, not an internal name of fuselab's
    from fuselab.quant import Int8DynamicActivationInt8WeightConfig, quantize_

    fused, _ = fuse_linear_relu(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    quantized = nn.Sequential(nn.Linear(4, 4))
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    for model, name in ((fused, "FusedLinearReLU"), (quantized, "Int8Linear")):
        with pytest.raises(RuntimeError, match=f"torch.jit.script cannot compile fuselab's {name}: use torch.compile"):
            torch.jit.script(model)
