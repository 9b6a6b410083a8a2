"""What ``quantize_`` turns a Linear into: one frozen dataclass per choice (torchao's convention).

Each config type has a handler in ``quantize.py`` (``register_quantize_module_handler``); a config
holds everything the quantized layers depend on, so the same config gives the same model.
"""
import math
import types
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig:
    """W8A8: int8 weights with one symmetric scale per output channel (absmax / 127); activations
    quantized to int8 at run time with one symmetric scale per token (row), from that row's absmax.

    ``conv2d=True`` also replaces ``nn.Conv2d`` layers (``Int8Conv2d``: the input unfolded into patches,
    one per output position, each quantized as a token, then the same int8 GEMM), for conv nets whose
    weights are mostly convolutions; off by default, as torchao's configs replace Linear layers only."""

    conv2d: bool = False


@dataclass(frozen=True)
class Int8StaticActivationInt8WeightConfig:
    """W8A8 with static activations: weights as in the dynamic config; each layer's input quantized
    with one fixed per-tensor scale, ``act_scales[layer name]`` (``Calibration.act_scales()`` from
    ``calibrate``). Inputs beyond the calibrated range are clipped to +-127 steps. A layer with no
    scale here is left alone (the report says so)."""

    act_scales: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        scales = dict(self.act_scales)
        for name, scale in scales.items():
            if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
                raise ValueError(f"act_scales[{name!r}] must be a positive finite number, got {scale!r}")
        # Read-only: a frozen config must not change after a model was quantized with it.
        object.__setattr__(self, "act_scales", types.MappingProxyType(scales))


@dataclass(frozen=True)
class Float8RowwiseConfig:
    """FP8 e4m3: weights with one scale per output channel (absmax / 448), activations with one
    per token, quantized at run time. The GEMM runs on GPUs with fp8 tensor cores (sm_89+: Ada,
    Hopper); on a CPU it is emulated exactly (fp32 GEMM of the fp8 values)."""
