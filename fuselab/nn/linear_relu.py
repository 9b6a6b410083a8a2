"""FusedLinearReLU: ``relu(linear(x))`` in one fused kernel, a drop-in for Linear + ReLU."""
import torch

from fuselab.kernels import linear_relu


class FusedLinearReLU(torch.nn.Linear):
    """``nn.Linear`` followed by ReLU, computed by ``torch.ops.fuselab.matmul_relu``.

    Same parameters and state_dict keys as ``nn.Linear`` (a Linear+ReLU checkpoint loads into
    it and back). Under autocast, inputs and parameters are cast to the autocast dtype, as
    ``nn.Linear`` would be.
    """

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "FusedLinearReLU":
        """A FusedLinearReLU that shares ``linear``'s parameters (no copy)."""
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.out_features = linear.in_features, linear.out_features
        fused.weight, fused.bias = linear.weight, linear.bias
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return linear_relu(x, weight, bias)
