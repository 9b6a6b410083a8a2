"""Quantized drop-ins for ``nn.Linear``, ``FusedLinearReLU`` and ``nn.Conv2d``, made by ``quantize_``.

Each holds its weight quantized per output channel and quantizes its input on every call (or takes it
quantized: ``QuantizedRows``, a ``QuantizedLayerNorm``'s or an ``Int8Linear``'s whose output is quantized), then
runs one GEMM whose epilogue applies both scales, the bias and (for a FusedLinearReLU) the ReLU. The output has
the input's dtype (autocast's under autocast). Inference only: the tensors are buffers,
and no gradient flows through a quantized layer. State-dict keys: ``weight`` (the quantized
weight), ``weight_scale``, ``bias`` and, for static activations, ``act_scale``.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.nn.modules.utils import _pair

from fuselab.kernels._runtime import SUPPORTED_DTYPES, in_dual_level
from fuselab.nn.linear_relu import FusedLinearReLU, refuse_torchscript
from fuselab.quant._scaled_gemm import check_fast_accum
from fuselab.quant.config import positive_scale
from fuselab.quant.fp8_gemm import fp8_matmul
from fuselab.quant.int8_gemm import MAX_K as INT8_MAX_K
from fuselab.quant.int8_gemm import int8_matmul
from fuselab.quant.norm_quant import QuantizedRows, quantized_rows_wanted, static_scale_of
from fuselab.quant.rowwise import FP8_DTYPE, quantize_fp8_rowwise, quantize_int8_rowwise, quantize_int8_static


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """What the float layer would return for ``x``: autocast's dtype under autocast, else x's."""
    if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):  # meta: shapes only
        return torch.get_autocast_dtype(x.device.type)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"a quantized layer takes float32, float16 or bfloat16 inputs, got {x.dtype}")
    return x.dtype


def _refuse_untracked_derivatives(x: torch.Tensor) -> None:
    if torch.jit.is_tracing() and torch.is_grad_enabled() and x.requires_grad:  # it failed inside torch
        raise RuntimeError("torch.jit.trace of a quantized layer (fuselab.quant) whose input requires grad: trace "
                           "under torch.no_grad() (quantized layers have no backward)")
    # A custom op carries no tangent: where x has one (jvp, jacfwd), the layers after would get zeros
    if in_dual_level() and forward_ad.unpack_dual(x).tangent is not None:  # torch.func.jvp's wrapped tensors too
        raise NotImplementedError("a quantized layer (fuselab.quant) has no forward-mode derivative (rounding has "
                                  "none): torch.func.jvp/jacfwd and torch.autograd.forward_ad through a quantized "
                                  "layer's input would give zero tangents; differentiate the float model")


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(x, boxed):
        # y comes boxed and leaves detached: not a view of an input (in-place ops after the layer stay legal)
        return boxed[0].detach()

    @staticmethod
    def setup_context(ctx, inputs, output):  # a separate setup_context: torch.func transforms take the Function
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a quantized layer (fuselab.quant) has no backward: quantized models are for inference "
                           "(run them under torch.no_grad() or torch.inference_mode(); train the float model)")


class _QuantizedLinear(nn.Module):
    """Buffers and repr shared by the quantized layers."""

    def __init__(self, in_features: int, out_features: int, bias: bool, relu: bool, weight_dtype: torch.dtype,
                 bias_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.relu = in_features, out_features, relu
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=weight_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    @staticmethod
    def _fused_relu(linear: nn.Module, relu: Optional[bool], layer: str) -> bool:
        """``from_float``'s ReLU: a FusedLinearReLU's own (ValueError for ``relu=False``: it would be dropped),
        else ``relu``; TypeError for a layer that is not an nn.Linear, or whose class has its own forward
        (what it computes beyond x @ W^T + b would be lost)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{layer}.from_float takes an nn.Linear (or FusedLinearReLU), got a {type(linear).__name__}"
                            " (quantize_ converts transformers' Conv1D layers)")
        if type(linear).forward not in (nn.Linear.forward, FusedLinearReLU.forward):
            cls = type(linear)
            raise TypeError(f"{layer}.from_float: {cls.__module__}.{cls.__qualname__} has its own forward, which "
                            "the quantized layer would not compute (quantize the plain nn.Linear it is built on)")
        fused = isinstance(linear, FusedLinearReLU)
        if fused and relu is False:
            raise ValueError(f"{layer}.from_float(relu=False) of a FusedLinearReLU would drop its ReLU")
        return fused or bool(relu)

    def __setattr__(self, name: str, value) -> None:
        # transformers' tie_weights() sets an embedding's float Parameter here: the GEMM would take it as the weight
        own = self.__dict__.get("_buffers", {}).get(name) if name in ("weight", "weight_scale") else None
        if own is not None and isinstance(value, torch.Tensor) and value.dtype != own.dtype:
            raise TypeError(f"{type(self).__name__}({self.extra_repr()}): its {name} is a {own.dtype} buffer of the "
                            f"quantization; setting a {value.dtype} tensor there (transformers' tie_weights() or "
                            "resize_token_embeddings() after quantize_?) would replace it. Tie or resize the float "
                            "model, then quantize_ it (a layer whose weight is tied gets its own quantized copy)")
        super().__setattr__(name, value)

    def _load_float(self, linear: nn.Linear, quantize) -> None:
        self.weight, self.weight_scale = quantize(linear.weight.contiguous())  # PyTorch's path keeps a layout
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # load_state_dict would cast: an fp8 (or float) checkpoint's weight silently wrapped into int8.
        for name in ("weight", "weight_scale", "act_scale"):
            own, key = self._buffers.get(name), prefix + name
            if own is not None and key in state_dict and state_dict[key].dtype != own.dtype:
                error_msgs.append(f"{key}: the checkpoint holds {state_dict[key].dtype} where this "
                                  f"{type(self).__name__} holds {own.dtype} (a checkpoint of another quantization "
                                  f"or of the float model: quantize the model it came from the same way)")
        scale, key, kept = state_dict.get(prefix + "act_scale"), prefix + "act_scale", None
        if (self._buffers.get("act_scale") is not None and isinstance(scale, torch.Tensor) and scale.numel() == 1
                and not scale.is_meta):  # a meta checkpoint holds no value to check
            try:  # a checkpoint's static scale, read once at load: a 0 or inf would silently zero or saturate
                positive_scale(key, scale.float())
            except ValueError as e:
                error_msgs.append(str(e))
                kept = self.act_scale.clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if kept is not None:  # load_state_dict raises after copying every key: the refused scale must not stay
            with torch.no_grad():
                self.act_scale.copy_(kept)

    def _check_width(self, x: torch.Tensor) -> None:
        """ValueError naming this layer for an input whose last size is not ``in_features`` (the GEMM's own
        error names its operands: the transposed weight, which the caller never sees)."""
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}(in_features={self.in_features}) got an input of shape "
                             f"{tuple(x.shape)}")

    @staticmethod
    def _inference_only(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y``, whose backward raises where ``x`` wants a gradient (rounding has none: the layers
        before would silently get no gradient). Compiled too: there the guard breaks the graph (fullgraph=True
        refuses it, naming this), as leaving it out dropped those gradients silently."""
        if torch.is_grad_enabled() and x.requires_grad:
            return _NoBackward.apply(x, [y])
        return y

    def _apply(self, fn, recurse=True):
        # .to(dtype)/.half() on a quantized model: quantized weights and fp32 scales keep their dtypes
        # (a round trip through fp16 would round the scales); device moves still apply. The bias follows
        # casts among the dtypes the epilogue takes (not .double()'s).
        kept = {k: v for k, v in self._buffers.items() if v is not None}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != old.dtype and (name != "bias" or new.dtype not in SUPPORTED_DTYPES):
                self._buffers[name] = old.to(new.device)
        return self

    @property
    def fusion_note(self) -> Optional[str]:
        """What ``fuse_linear_relu``'s report says of this layer (a Linear it no longer sees as one)."""
        if self.relu:
            return "quantized (fuselab.quant), its ReLU fused into the GEMM's epilogue"
        return ("quantized (fuselab.quant), no longer a Linear to fuse: fuse_linear_relu before quantize_ fuses a "
                "ReLU after it into the GEMM's epilogue")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, relu={self.relu}"
                + (", output quantized for the next layer" if getattr(self, "_output_reader", ()) else ""))

    __prepare_scriptable__ = refuse_torchscript


class Int8Linear(_QuantizedLinear):
    """``[relu](x @ W^T + b)`` with W8A8: int8 weights per output channel; the input quantized per
    token at run time, or with the fixed per-tensor ``act_scale`` (static) when it is set, or taken quantized
    (``QuantizedRows``, with their scales). After ``quantize_output(reader)`` the output leaves as ``QuantizedRows``
    quantized in the GEMM's epilogue with the reader's act_scale, where ``quantized_rows_wanted`` allows (else as
    floats: the same values)."""

    _output_reader: tuple = ()  # a tuple: the reader is not a submodule of this layer (a class default: old pickles)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, relu: bool = False,
                 static: bool = False, device=None):
        super().__init__(in_features, out_features, bias, relu, torch.int8, device=device)
        self.register_buffer("act_scale", torch.ones((), dtype=torch.float32, device=device) if static else None)

    @classmethod
    def from_float(cls, linear: nn.Linear, relu: Optional[bool] = None,
                   act_scale: Optional[float] = None) -> "Int8Linear":
        """Quantize ``linear``'s weight, its ReLU fused if it is a FusedLinearReLU or ``relu``; ``act_scale``
        (positive, finite): static activations. ValueError for a bad ``act_scale`` and for ``relu=False`` on a
        FusedLinearReLU; TypeError for a layer that is not an nn.Linear."""
        relu = cls._fused_relu(linear, relu, cls.__name__)
        if act_scale is not None:
            act_scale = positive_scale("act_scale", act_scale)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, relu,
                    static=act_scale is not None, device=linear.weight.device)
        layer._load_float(linear, quantize_int8_rowwise)
        if act_scale is not None:
            layer.act_scale.fill_(act_scale)
        return layer

    def quantize_output(self, reader: "Int8Linear") -> None:
        """Hand the output on as ``QuantizedRows`` quantized with ``reader``'s static act_scale (read at each
        call), for ``reader``, the one layer that reads it, which then skips its quantization pass
        (``quantize_`` with ``fuse_outputs=True`` calls this). TypeError for a reader without an act_scale. A copy of
        this layer alone holds a copy of the reader: any other layer refuses its rows."""
        static_scale_of(reader)
        self._output_reader = (reader,)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name: callers may pass it
        x = input
        _refuse_untracked_derivatives(x)
        self._check_width(x)
        out_dtype = _output_dtype(x)
        if isinstance(x, QuantizedRows):  # quantized by the layer before, with its scales
            xq, x_scale = x.unwrap(fp8=False, layer=self)
        elif self.act_scale is None:
            xq, x_scale = quantize_int8_rowwise(x)
        else:
            xq, x_scale = quantize_int8_static(x, self.act_scale), self.act_scale
        out_scale = static_scale_of(self._output_reader[0]) if self._output_reader else None
        if out_scale is not None and not (quantized_rows_wanted(x) and out_scale.device == x.device):
            out_scale = None
        y = int8_matmul(xq, self.weight.t(), x_scale, self.weight_scale, self.bias, self.relu, out_dtype,
                        out_scale=out_scale)
        if out_scale is None:
            return self._inference_only(y, x)
        return QuantizedRows(y[None], None, out_dtype, self._output_reader)  # quantized for its one reader


class Float8Linear(_QuantizedLinear):
    """``[relu](x @ W^T + b)`` in fp8 e4m3: rowwise-scaled weights, the input quantized per token;
    ``fast_accum`` as ``fp8_matmul``'s."""

    fast_accum: bool = False  # a class default: old pickles

    def __init__(self, in_features: int, out_features: int, bias: bool = True, relu: bool = False, device=None,
                 fast_accum: bool = False):
        super().__init__(in_features, out_features, bias, relu, FP8_DTYPE, device=device)
        check_fast_accum(type(self).__name__, fast_accum)
        self.fast_accum = fast_accum

    @classmethod
    def from_float(cls, linear: nn.Linear, relu: Optional[bool] = None, fast_accum: bool = False) -> "Float8Linear":
        """Quantize ``linear``'s weight, its ReLU fused if it is a FusedLinearReLU or ``relu`` (see Int8Linear's)."""
        relu = cls._fused_relu(linear, relu, cls.__name__)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, relu,
                    device=linear.weight.device, fast_accum=fast_accum)
        layer._load_float(linear, quantize_fp8_rowwise)
        return layer

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fast_accum=True" if self.fast_accum else "")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name: callers may pass it
        x = input
        _refuse_untracked_derivatives(x)
        self._check_width(x)
        out_dtype = _output_dtype(x)
        if isinstance(x, QuantizedRows):  # a QuantizedLayerNorm's rows, quantized there
            xq, x_scale = x.unwrap(fp8=True, layer=self)
        else:
            xq, x_scale = quantize_fp8_rowwise(x)
        y = fp8_matmul(xq, self.weight.t(), x_scale, self.weight_scale, self.bias, self.relu, out_dtype,
                       fast_accum=self.fast_accum)
        return self._inference_only(y, x)


def why_not_int8_conv2d(conv: nn.Conv2d) -> Optional[str]:
    """Why ``Int8Conv2d`` cannot compute ``conv`` exactly as it is defined (None: it can)."""
    if conv.groups != 1:
        return f"a grouped convolution (groups={conv.groups}): Int8Conv2d computes groups=1 only"
    if conv.padding_mode != "zeros" or conv.padding == "same":
        return (f"padding {conv.padding!r} with mode {conv.padding_mode!r}: Int8Conv2d pads with zeros by "
                "explicit amounts")
    if conv.in_channels == 0 or conv.out_channels == 0:
        return "has no input or no output channels"
    k = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    if k > INT8_MAX_K:
        return f"C*kh*kw = {k} is above the int8 GEMM's K limit {INT8_MAX_K} (its int32 sums could overflow)"
    return None


class Int8Conv2d(_QuantizedLinear):
    """``nn.Conv2d`` (groups 1, padding_mode "zeros") with W8A8: the input unfolded into one row of C*kh*kw
    values per output position (im2col: the activations take kh*kw times their memory), each row
    quantized per token at run time, then the int8 GEMM with its epilogue against the weight
    (O, C*kh*kw), quantized per output channel. The output is in the input's memory format (channels-
    last, as the GEMM writes it, for a channels-last input; else a contiguous copy)."""

    fusion_note = None  # a convolution: nothing fuse_linear_relu fuses

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 bias: bool = True, device=None):
        kernel_size, stride, padding, dilation = (_pair(v) for v in (kernel_size, stride, padding, dilation))
        super().__init__(in_channels * kernel_size[0] * kernel_size[1], out_channels, bias, False, torch.int8,
                         device=device)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation

    @classmethod
    def from_float(cls, conv: nn.Conv2d) -> "Int8Conv2d":
        """Quantize ``conv``'s weight; ValueError if Int8Conv2d cannot compute it (``why_not_int8_conv2d``)."""
        why = why_not_int8_conv2d(conv)
        if why is not None:
            raise ValueError(f"Int8Conv2d.from_float: {why}")
        padding = (0, 0) if conv.padding == "valid" else conv.padding
        layer = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, padding, conv.dilation,
                    conv.bias is not None, device=conv.weight.device)
        layer.weight, layer.weight_scale = quantize_int8_rowwise(conv.weight.reshape(conv.out_channels, -1))
        layer.bias = None if conv.bias is None else conv.bias.detach().clone()
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Conv2d's argument name: callers may pass it
        x = input
        _refuse_untracked_derivatives(x)
        if x.dim() == 3 and x.shape[0] == self.in_channels:  # unbatched, as nn.Conv2d takes it
            return self(x.unsqueeze(0)).squeeze(0)
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"Int8Conv2d takes (N, {self.in_channels}, H, W) or ({self.in_channels}, H, W) inputs, "
                             f"got {tuple(x.shape)}")
        out_dtype = _output_dtype(x)
        n, _, h, w = x.shape
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        ho, wo = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        patches = F.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)  # (N, C*kh*kw, H'*W')
        rows = patches.transpose(1, 2).reshape(n * ho * wo, self.in_features)
        xq, x_scale = quantize_int8_rowwise(rows)
        y = int8_matmul(xq, self.weight.t(), x_scale, self.weight_scale, self.bias, False, out_dtype)
        y = y.view(n, ho, wo, self.out_channels).permute(0, 3, 1, 2)
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        y = y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return self._inference_only(y, x)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}")


QUANTIZED_LAYERS = (Int8Linear, Float8Linear, Int8Conv2d)  # what quantize_ makes
