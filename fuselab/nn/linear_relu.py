"""Fused ``relu(linear(x))`` layers: drop-ins for Linear + ReLU and for GPT-2's Conv1D + ReLU."""
import torch

from fuselab.kernels import linear_relu, matmul_relu


def _autocast(x, weight, bias):
    """Inputs and parameters in the autocast dtype where autocast is on, as its matmuls would be."""
    if not torch.is_autocast_enabled(x.device.type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(x.device.type)
    return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


def _sharing_parameters(cls, layer, **sizes):
    """A ``cls`` around ``layer``'s own weight and bias (no copy, no initialization), with ``sizes``."""
    fused = cls.__new__(cls)
    torch.nn.Module.__init__(fused)
    for name, value in sizes.items():
        setattr(fused, name, value)
    fused.weight, fused.bias = layer.weight, layer.bias
    return fused


class FusedLinearReLU(torch.nn.Linear):
    """``nn.Linear`` followed by ReLU, computed by ``torch.ops.fuselab.matmul_relu``.

    Same parameters and state_dict keys as ``nn.Linear`` (a Linear+ReLU checkpoint loads into
    it and back). Under autocast, inputs and parameters are cast to the autocast dtype, as
    ``nn.Linear`` would be.
    """

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "FusedLinearReLU":
        """A FusedLinearReLU that shares ``linear``'s parameters (no copy)."""
        return _sharing_parameters(cls, linear, in_features=linear.in_features, out_features=linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_relu(*_autocast(x, self.weight, self.bias))


class FusedConv1DReLU(torch.nn.Module):
    """transformers' ``Conv1D`` (GPT-2: ``x @ weight + bias``, weight shaped (nx, nf)) followed by
    ReLU, fused; the same parameters and state_dict keys. ``from_conv1d`` shares a Conv1D's."""

    def __init__(self, nf: int, nx: int, device=None, dtype=None):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype).normal_(std=0.02))
        self.bias = torch.nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))

    @classmethod
    def from_conv1d(cls, conv: torch.nn.Module) -> "FusedConv1DReLU":
        return _sharing_parameters(cls, conv, nf=conv.nf, nx=conv.nx)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_relu(*_autocast(x, self.weight, self.bias))
