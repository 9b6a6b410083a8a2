"""fuselab.nn: FusedLinearReLU, fuse_linear_relu (Sequential, torch.fx, Hugging Face), fused_backend."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

from fuselab.nn import FusedLinearReLU, fuse_linear_relu, fused_backend

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32: fused vs stock differ only by summation order


def compare(model, patched, *inputs, **kwargs):
    """Outputs and every parameter's gradient of the patched model equal the original's."""
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
    layer = FusedLinearReLU(12, 7)
    x = torch.randn(5, 12, requires_grad=True)
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, layer(x))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


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


def test_nothing_to_fuse_is_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    patched, report = fuse_linear_relu(model)
    assert patched is model and report.fused == [] and len(report.skipped) == 2
    assert all(type(m) is not FusedLinearReLU for m in model.modules())


def test_filter_fn():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    _, report = fuse_linear_relu(model, filter_fn=lambda name, lin: name != "2")
    assert report.fused == ["0"]


def _tiny_opt(act):
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=24, num_attention_heads=2,
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
