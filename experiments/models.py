"""Models the studies time: transformers' own OPT decoder at published sizes, random init.

``opt_decoder(size, variant)``: ``variant`` is ``stock``, ``fuselab`` (patched by
``fuse_linear_relu``) or ``norelu`` (the ReLU deleted: wrong math, timing only, the most that any
fusion of the ReLU into its GEMM could save).
"""
from typing import Tuple

import torch

# hidden, ffn, layers, heads (OPT-350m projects its 512-wide embeddings to 1024; the decoder is what is timed)
OPT_SIZES = {
    "tiny": (64, 256, 2, 4),
    "opt-125m": (768, 3072, 12, 12),
    "opt-350m": (1024, 4096, 24, 16),
    "opt-1.3b": (2048, 8192, 24, 32),
    "opt-1024x12": (1024, 4096, 12, 16),  # the compile study's decoder: OPT-350m's width, half its depth
}
VARIANTS = ("stock", "fuselab", "norelu")


def opt_decoder(size: str, variant: str = "stock", device="cuda", dtype=None) -> Tuple[torch.nn.Module, int]:
    """(OPTForCausalLM, vocab size): no dropout, so training math equals eval mode's."""
    from transformers import OPTConfig, OPTForCausalLM

    from fuselab.nn import fuse_linear_relu

    if size not in OPT_SIZES:
        raise ValueError(f"unknown OPT size {size!r}; known: {list(OPT_SIZES)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    hidden, ffn, layers, heads = OPT_SIZES[size]
    cfg = OPTConfig(vocab_size=512 if size == "tiny" else 50272, max_position_embeddings=2048,
                    activation_function="relu", hidden_size=hidden, ffn_dim=ffn, num_hidden_layers=layers,
                    num_attention_heads=heads, word_embed_proj_dim=hidden, dropout=0.0, attention_dropout=0.0,
                    layerdrop=0.0)
    model = OPTForCausalLM(cfg).to(device=device, dtype=dtype)
    if variant == "fuselab":
        model, report = fuse_linear_relu(model)
        if not report.fused:
            raise RuntimeError(f"fuse_linear_relu fused nothing in {size}:\n{report}")
    elif variant == "norelu":
        for layer in model.model.decoder.layers:
            layer.activation_fn = torch.nn.Identity()
    return model, cfg.vocab_size
