"""Triton kernels exposed as ``torch.ops.fuselab.*`` (see each module's docstring)."""
from fuselab.kernels.matmul_relu_triton import linear_relu, matmul_relu

__all__ = ["matmul_relu", "linear_relu"]
