"""Build the CUDA C++ reference ahead of time: ``python -m fuselab.kernels.build``."""
import argparse
import sys

from fuselab.kernels.matmul_relu_cuda import load_extension

if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m fuselab.kernels.build", description=(
        "Build the CUDA C++ reference (torch.ops.fuselab.matmul_relu_cuda) with nvcc now, rather than on its "
        "first use; the build is cached.")).parse_args()
    try:
        load_extension(verbose=True)
    except RuntimeError as e:  # a missing toolkit or a failed build: the reason, not a traceback
        sys.exit(f"fuselab.kernels.build: {e}")
    print("built and registered torch.ops.fuselab.matmul_relu_cuda and matmul_relu_cuda_naive")
