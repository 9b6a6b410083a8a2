"""Fused ``relu(linear(x))``: two functions that run fuselab's op where it computes exactly what
PyTorch would and PyTorch's own ops elsewhere, and the layers built on them (drop-ins for
Linear + ReLU and for GPT-2's Conv1D + ReLU).

``why_not_fused`` is the one test of what the op can run; model patching and the graph rewrite
ask it too (``fuselab.nn.fuse``). Both functions are ``torch.fx.wrap``-ped: a symbolic trace
records them as calls instead of tracing into them, so graphs that hold them trace, save and load.
"""
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from fuselab.kernels import eager_path
from fuselab.kernels._runtime import SUPPORTED_DTYPES
from fuselab.kernels.matmul_relu_triton import python_linear_relu, python_matmul_relu


def why_not_fused(a: Optional[torch.Tensor], b: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  *, linear: bool = False) -> Optional[str]:
    """Why ``matmul_relu(a, b, bias)`` would not compute ``relu(a @ b + bias)``; None where it would.

    The op takes one dtype out of float16/bfloat16/float32 on one CPU or CUDA device, dense
    tensors, ``a`` (..., K), ``b`` (K, N) (with ``linear``, an nn.Linear weight (N, K)) and ``bias``
    (N,). Checks what the given tensors tell (None: unknown, or no bias), FakeTensors (a graph's
    meta) too. Called on every eager forward of the fused layers: the common case is kept short.
    """
    first = a if a is not None else b if b is not None else bias
    if first is None:
        return None
    dtype, device = first.dtype, first.device
    if dtype not in SUPPORTED_DTYPES:
        return f"{dtype}: the fused op runs float16, bfloat16 and float32"
    if not (first.is_cuda or first.is_cpu):  # elsewhere (meta, say) PyTorch's own ops give the same result
        return f"on the {device.type} device: the fused op runs on cpu and cuda"
    for t in (a, b, bias):
        if t is not None and (t.dtype != dtype or t.device != device or t.layout != torch.strided):
            return "operands differ in dtype or device, or are not dense"
    if b is None:
        return None
    if b.dim() != 2:
        return f"{'weight' if linear else 'b'} is {b.dim()}-D, not a matrix"
    k, n = (b.shape[1], b.shape[0]) if linear else b.shape
    if a is not None and (a.dim() < 1 or a.shape[-1] != k):
        return f"input of shape {tuple(a.shape)} does not have K={k} columns"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return f"bias of shape {tuple(bias.shape)}: the fused op adds one of shape (N,) = ({n},)"
    return None


def _autocast(*tensors: Optional[torch.Tensor]):
    """The tensors as autocast would pass them to linear/matmul/addmm on the op's devices: floating,
    non-fp64 tensors of the autocast device cast to its dtype. (Elsewhere the op does not run, and
    the fallback's own ops are autocast.)"""
    first = tensors[0]
    device = "cuda" if first.is_cuda else "cpu" if first.is_cpu else None
    if device is None or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                 and t.device.type == device else t for t in tensors)


@torch.fx.wrap
def fused_linear_relu(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.relu(F.linear(input, weight, bias))``, through the fused op wherever it computes that."""
    out = eager_path.call(input, weight, bias, linear=True, autocast=True)  # C++: an eager CUDA call it serves
    if out is not None:
        return out
    input, weight, bias = _autocast(input, weight, bias)  # declined by the C++ path: asked once, not again
    if why_not_fused(input, weight, bias, linear=True) is None:
        return python_linear_relu(input, weight, bias)
    return torch.relu(F.linear(input, weight, bias))


@torch.fx.wrap
def fused_matmul_relu(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.relu(torch.addmm(bias, a, b))`` (``torch.relu(a @ b + bias)``), through the fused op wherever it
    computes that. Under autocast it is addmm's: every operand cast to the autocast dtype, the bias too (``a @ b +
    bias`` with an fp32 bias would add in fp32 and return fp32)."""
    out = eager_path.call(a, b, bias, linear=False, autocast=True)
    if out is not None:
        return out
    a, b, bias = _autocast(a, b, bias)
    if why_not_fused(a, b, bias) is None:
        return python_matmul_relu(a, b, bias)
    return torch.relu(a @ b if bias is None else a @ b + bias)


def refuse_torchscript(module: torch.nn.Module):
    """``__prepare_scriptable__`` of fuselab's layers (``torch.jit.script`` calls it on every submodule): TorchScript
    cannot compile their Python paths, and its own error names an internal of fuselab's."""
    raise RuntimeError(f"torch.jit.script cannot compile fuselab's {type(module).__name__}: use torch.compile, "
                       "torch.export or torch.jit.trace (TorchScript is deprecated)")


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
    it and back). Under autocast, inputs and parameters are cast as ``nn.Linear``'s would be;
    where the op does not run (float64, the meta device) PyTorch's linear and ReLU do.
    """

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "FusedLinearReLU":
        """A FusedLinearReLU that shares ``linear``'s parameters (no copy)."""
        return _sharing_parameters(cls, linear, in_features=linear.in_features, out_features=linear.out_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name: callers may pass it
        return fused_linear_relu(input, self.weight, self.bias)

    __prepare_scriptable__ = refuse_torchscript


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
        return fused_matmul_relu(x, self.weight, self.bias)

    __prepare_scriptable__ = refuse_torchscript
