"""What ``quantize_`` turns a Linear into: one frozen dataclass per choice (torchao's convention).

Each config type has a handler in ``quantize.py`` (``register_quantize_module_handler``); a config
holds everything the quantized layers depend on, so the same config gives the same model.
"""
import math
import numbers
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch


class FrozenScales(Mapping):
    """A read-only layer name -> scale mapping that copies, pickles and hashes (a frozen config's field:
    the config is saved beside a checkpoint, and must not change after a model was quantized with it)."""

    def __init__(self, scales: Mapping[str, float]):
        self._scales = dict(scales)

    def __getitem__(self, name: str) -> float:
        return self._scales[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._scales)

    def __len__(self) -> int:
        return len(self._scales)

    def __hash__(self) -> int:
        return hash(frozenset(self._scales.items()))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenScales({self._scales!r})"


# A static scale's range: fp32 normals whose reciprocal (what quantization multiplies by) is a normal fp32 too
SCALE_RANGE = (2.0**-126, 2.0**126)


def positive_scale(what: str, scale) -> float:
    """``scale`` as a float (a Python, NumPy or one-element tensor real number), or ValueError naming it as ``what``:
    it must lie in SCALE_RANGE (beyond it the fp32 reciprocal that static quantization multiplies by is inf, 0 or
    subnormal)."""
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point():
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{what} must be a real number, got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]):
        raise ValueError(f"{what} must be a positive finite number from {SCALE_RANGE[0]:.3g} to {SCALE_RANGE[1]:.3g} "
                         f"(its fp32 reciprocal a normal number), got {float(scale)!r}")
    return float(scale)


@dataclass(frozen=True)
class Int8DynamicActivationInt8WeightConfig:
    """W8A8: int8 weights with one symmetric scale per output channel (absmax / 127); activations
    quantized to int8 at run time with one symmetric scale per token (row), from that row's absmax.

    ``conv2d=True`` also replaces ``nn.Conv2d`` layers (``Int8Conv2d``: the input unfolded into patches,
    one per output position, each quantized as a token, then the same int8 GEMM), for conv nets whose
    weights are mostly convolutions; off by default, as torchao's configs replace Linear layers only.

    ``fuse_norms=True`` also replaces a decoder layer's LayerNorm whose output only quantized linears read
    (transformers' OPT with the norm first: q, k, v and fc1; GPT-2: c_attn and c_fc) with a
    ``QuantizedLayerNorm`` that quantizes its rows once, for all of them (``fuselab.quant.norm_quant``)."""

    conv2d: bool = False
    fuse_norms: bool = False

    def __post_init__(self):
        _check_flags(self, "conv2d", "fuse_norms")


@dataclass(frozen=True)
class Int8StaticActivationInt8WeightConfig:
    """W8A8 with static activations: weights as in the dynamic config; each layer's input quantized
    with one fixed per-tensor scale, ``act_scales[layer name]`` (``Calibration.act_scales()`` from
    ``calibrate``). Inputs beyond the calibrated range are clipped to +-127 steps, and so are
    infinities; a NaN input becomes a finite value (a fixed scale carries no per-row NaN: use the
    dynamic config where NaN must propagate). A layer with no scale here is left alone (the report
    says so).

    Two fusions save the quantization passes between layers, each handing on the int8 values the next layer would
    make itself (``fuse_outputs`` bit for bit; ``fuse_norms``' fp32 layer norm can move a value one step where the
    dtype's last bit decides its rounding, as the dynamic config's). ``fuse_norms=True``: a decoder layer's
    LayerNorm whose output only static int8 linears read (OPT's q, k, v; fc1) quantizes its rows as it makes them,
    a copy with each reader's act_scale (``QuantizedLayerNorm``). ``fuse_outputs=True``: a linear whose output only a
    static int8 linear reads (OPT's fc1, its ReLU fused by ``fuse_linear_relu`` first, read by fc2) quantizes it
    with the reader's act_scale in its GEMM's epilogue and writes one byte a value."""

    act_scales: Mapping[str, float] = field(default_factory=dict)
    fuse_norms: bool = False
    fuse_outputs: bool = False

    def __post_init__(self):
        _check_flags(self, "fuse_norms", "fuse_outputs")
        if not isinstance(self.act_scales, Mapping):
            hint = " (pass its .act_scales())" if hasattr(self.act_scales, "act_scales") else ""
            raise TypeError(f"act_scales must map layer names to scales, got {type(self.act_scales).__name__}{hint}")
        scales = {name: positive_scale(f"act_scales[{name!r}]", scale) for name, scale in self.act_scales.items()}
        object.__setattr__(self, "act_scales", FrozenScales(scales))


@dataclass(frozen=True)
class Float8RowwiseConfig:
    """FP8 e4m3: weights with one scale per output channel (absmax / 448), activations with one
    per token, quantized at run time. The GEMM runs on GPUs with fp8 tensor cores (sm_89+: Ada,
    Hopper); on a CPU it is emulated exactly (fp32 GEMM of the fp8 values). ``fuse_norms``: as the
    dynamic int8 config's, the norms' rows quantized to fp8. ``fast_accum``: the GEMM's tensor cores
    accumulate over the whole K in their own reduced precision (``fp8_matmul``'s; torch._scaled_mm's
    ``use_fast_accum``): faster on Hopper, less exact; False adds each K tile's sum into fp32."""

    fuse_norms: bool = False
    fast_accum: bool = False

    def __post_init__(self):
        _check_flags(self, "fuse_norms", "fast_accum")


def _check_flags(config, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name} must be True or False, got {getattr(config, name)!r}")
