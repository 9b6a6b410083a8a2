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


# ----------------------------------------------------------------------------------------------
# Image classifiers for 28x28 grayscale (Fashion-MNIST): the distillation study's teacher and students
# ----------------------------------------------------------------------------------------------

RESNETS = {"resnet18": ("BasicBlock", (2, 2, 2, 2)), "resnet50": ("Bottleneck", (3, 4, 6, 3))}


def resnet_28x28(arch: str = "resnet18", width: int = 64, blocks=None, num_classes: int = 10,
                 in_channels: int = 1) -> torch.nn.Module:
    """torchvision's ResNet (``arch`` ``resnet18`` or ``resnet50``) for 28x28 grayscale images:
    ``in_channels`` input channels, a 3x3 stride-1 stem and no max-pool (the four stages then run at
    28, 14, 7 and 4 pixels). ``width`` 64 and ``blocks`` None give torchvision's stages, blocks and
    initialisation unchanged; a smaller ``width`` (the stem's channels; every stage scales with it)
    or fewer ``blocks`` per stage make the tiny models of smoke tests."""
    from torch import nn
    from torchvision.models import resnet as tv

    if arch not in RESNETS:
        raise ValueError(f"unknown arch {arch!r}; known: {list(RESNETS)}")
    if width < 1 or width % 8:
        raise ValueError(f"width must be a positive multiple of 8, got {width}")
    block_name, default_blocks = RESNETS[arch]
    block = getattr(tv, block_name)
    blocks = list(default_blocks if blocks is None else blocks)

    class ResNet28(tv.ResNet):
        def __init__(self):
            self._width = width  # read by _make_layer during ResNet.__init__
            super().__init__(block, blocks, num_classes=num_classes)

        def _make_layer(self, block, planes, n, stride=1, dilate=False):
            if planes == 64:  # the first stage takes the stem's channels
                self.inplanes = self._width
            return super()._make_layer(block, planes * self._width // 64, n, stride, dilate)

    model = ResNet28()
    model.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.bn1 = nn.BatchNorm2d(width)
    model.maxpool = nn.Identity()
    if width != 64:
        model.fc = nn.Linear(8 * width * block.expansion, num_classes)
    return model


def small_cnn(width: int = 32, hidden: int = 128, num_classes: int = 10, in_channels: int = 1) -> torch.nn.Module:
    """Two conv-BN-ReLU-max-pool stages (``width``, ``2 * width`` channels; 28 -> 14 -> 7 pixels),
    then Linear -> ReLU -> Linear: a small student whose parameters are mostly in its first Linear."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
