"""Build the CUDA C++ reference ahead of time: ``python -m fuselab.kernels.build``."""
from fuselab.kernels.matmul_relu_cuda import load_extension

if __name__ == "__main__":
    load_extension(verbose=True)
    print("built and registered torch.ops.fuselab.matmul_relu_cuda and matmul_relu_cuda_naive")
