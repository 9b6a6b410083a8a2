"""fuselab.nn: modules and model patching that use fuselab's kernels."""
from fuselab.nn.fuse import FusionReport, fuse_linear_relu, fuse_relu_matmul, fused_backend
from fuselab.nn.linear_relu import FusedLinearReLU

__all__ = ["FusedLinearReLU", "FusionReport", "fuse_linear_relu", "fuse_relu_matmul", "fused_backend"]
