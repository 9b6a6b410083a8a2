"""Quantized drop-ins for ``nn.Linear`` and ``FusedLinearReLU``, made by ``quantize_``.

Each holds its weight quantized per output channel and quantizes its input on every call, then runs
one GEMM whose epilogue applies both scales, the bias and (for a FusedLinearReLU) the ReLU. The
output has the input's dtype (autocast's under autocast). Inference only: the tensors are buffers,
and no gradient flows through a quantized layer. State-dict keys: ``weight`` (the quantized
weight), ``weight_scale``, ``bias`` and, for static activations, ``act_scale``.
"""
from typing import Optional

import torch
from torch import nn

from fuselab.kernels._runtime import SUPPORTED_DTYPES
from fuselab.quant.fp8_gemm import fp8_matmul
from fuselab.quant.int8_gemm import int8_matmul
from fuselab.quant.rowwise import FP8_DTYPE, quantize_fp8_rowwise, quantize_int8_rowwise, quantize_int8_static


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """What the float layer would return for ``x``: autocast's dtype under autocast, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"a quantized layer takes float32, float16 or bfloat16 inputs, got {x.dtype}")
    return x.dtype


class _QuantizedLinear(nn.Module):
    """Buffers and repr shared by the quantized layers."""

    def __init__(self, in_features: int, out_features: int, bias: bool, relu: bool, weight_dtype: torch.dtype,
                 bias_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.relu = in_features, out_features, relu
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=weight_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    def _load_float(self, linear: nn.Linear, quantize) -> None:
        self.weight, self.weight_scale = quantize(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def _apply(self, fn, recurse=True):
        # .to(dtype)/.half() on a quantized model: quantized weights and fp32 scales keep their dtypes
        # (a round trip through fp16 would round the scales); device moves still apply. The bias follows.
        kept = {k: v for k, v in self._buffers.items() if v is not None and k != "bias"}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            if self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(self._buffers[name].device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, relu={self.relu}")


class Int8Linear(_QuantizedLinear):
    """``[relu](x @ W^T + b)`` with W8A8: int8 weights per output channel; the input quantized per
    token at run time, or with the fixed per-tensor ``act_scale`` (static) when it is set."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, relu: bool = False,
                 static: bool = False, device=None):
        super().__init__(in_features, out_features, bias, relu, torch.int8, device=device)
        self.register_buffer("act_scale", torch.ones((), device=device) if static else None)

    @classmethod
    def from_float(cls, linear: nn.Linear, relu: bool = False, act_scale: Optional[float] = None) -> "Int8Linear":
        """Quantize ``linear``'s weight (its ReLU fused if ``relu``); ``act_scale``: static activations."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, relu,
                    static=act_scale is not None, device=linear.weight.device)
        layer._load_float(linear, quantize_int8_rowwise)
        if act_scale is not None:
            layer.act_scale.fill_(act_scale)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = _output_dtype(x)
        if self.act_scale is None:
            xq, x_scale = quantize_int8_rowwise(x)
        else:
            xq, x_scale = quantize_int8_static(x, self.act_scale), self.act_scale
        return int8_matmul(xq, self.weight.t(), x_scale, self.weight_scale, self.bias, self.relu, out_dtype)


class Float8Linear(_QuantizedLinear):
    """``[relu](x @ W^T + b)`` in fp8 e4m3: rowwise-scaled weights, the input quantized per token."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, relu: bool = False, device=None):
        super().__init__(in_features, out_features, bias, relu, FP8_DTYPE, device=device)

    @classmethod
    def from_float(cls, linear: nn.Linear, relu: bool = False) -> "Float8Linear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, relu,
                    device=linear.weight.device)
        layer._load_float(linear, quantize_fp8_rowwise)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = _output_dtype(x)
        xq, x_scale = quantize_fp8_rowwise(x)
        return fp8_matmul(xq, self.weight.t(), x_scale, self.weight_scale, self.bias, self.relu, out_dtype)
