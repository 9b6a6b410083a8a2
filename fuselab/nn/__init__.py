"""fuselab.nn: modules and model patching that use fuselab's kernels."""
from fuselab.nn.fuse import FusionReport, fuse_linear_relu, fuse_relu_matmul, fused_backend
from fuselab.nn.linear_relu import FusedConv1DReLU, FusedLinearReLU, fused_linear_relu, fused_matmul_relu

__all__ = ["FusedConv1DReLU", "FusedLinearReLU", "FusionReport", "fuse_linear_relu", "fuse_relu_matmul",
           "fused_backend", "fused_linear_relu", "fused_matmul_relu"]
