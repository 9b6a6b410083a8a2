"""fuselab: Triton kernels for PyTorch research, registered with torch.library."""
from fuselab import kernels
from fuselab.kernels import linear_relu, matmul_relu

__all__ = ["kernels", "matmul_relu", "linear_relu"]
__version__ = "0.1.0"
