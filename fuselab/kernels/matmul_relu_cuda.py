"""The CUDA C++ reference of the fused matmul-ReLU (``csrc/matmul_relu.cu``), built just in time.

``load_extension()`` compiles the source with ninja for the GPU's own architecture (sm_90a on Hopper
and without a GPU, which adds the wgmma kernel; or ``TORCH_CUDA_ARCH_LIST``) into
``$FUSELAB_CACHE_DIR/torch_extensions`` on first use and loads it, which registers
``torch.ops.fuselab.matmul_relu_cuda`` and ``matmul_relu_cuda_naive`` from C++ (TORCH_LIBRARY). This
module then adds their fake implementations and, for ``matmul_relu_cuda``, autograd through the
Triton backward kernels. ``python -m fuselab.kernels.build`` builds ahead of time.
"""
import functools
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch

from fuselab import settings
from fuselab.kernels.matmul_relu_triton import _backward, _forward_fake, _setup_context

SOURCE = Path(__file__).resolve().parent / "csrc" / "matmul_relu.cu"


def _arch_flags():
    # Hopper builds for sm_90a, the arch-specific target that has wgmma and TMA (the fp16/bf16
    # kernel of choice there); FUSELAB_WGMMA tells the host code that the build has it.
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:  # torch.utils.cpp_extension reads it
        return ["-DFUSELAB_WGMMA"] if "9.0a" in arch_list else []
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)  # no GPU: Hopper
    if (major, minor) == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a", "-DFUSELAB_WGMMA"]
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


# Preferred to the nvcc on PATH, which may be a wrapper script outside the toolkit.
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")


def cuda_toolkit() -> Path:
    """The CUDA toolkit to build with: ``$CUDA_HOME`` (or ``$CUDA_PATH``), else /usr/local/cuda,
    else the one around the ``nvcc`` on PATH. RuntimeError, before anything is built, where it
    has no ``bin/nvcc`` (torch would fail later with a ninja log)."""
    needs = "building fuselab's CUDA reference needs nvcc (the Triton kernels need neither)"
    named = next((var for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)), None)
    if named:
        home = Path(os.environ[named])
        where = f"{named}={home}"
    elif (DEFAULT_CUDA_HOME / "bin" / "nvcc").is_file():
        home, where = DEFAULT_CUDA_HOME, str(DEFAULT_CUDA_HOME)
    else:
        on_path = shutil.which("nvcc")
        if on_path is None:
            raise RuntimeError(f"{needs}: there is none on PATH, no {DEFAULT_CUDA_HOME}/bin/nvcc, and "
                               f"CUDA_HOME is not set; set CUDA_HOME to a CUDA toolkit")
        home = Path(on_path).parent.parent
        where = f"nvcc on PATH ({on_path})"
    nvcc = Path(os.environ.get("PYTORCH_NVCC") or home / "bin" / "nvcc")  # torch's own override
    if not nvcc.is_file():
        raise RuntimeError(f"{needs}: {nvcc} does not exist (toolkit from {where}); set CUDA_HOME "
                           f"to a CUDA toolkit")
    return home


def build_extension(tile: Optional[Dict[str, int]] = None, verbose: bool = False) -> None:
    """Compile ``csrc/matmul_relu.cu`` (cached on disk) and load it, which registers its ops.

    ``tile`` overrides the kernel's build-time tile constants, e.g. ``{"BN": 256, "STAGES": 4}``
    (keys BM, BN, BK, WARPS_M, WARPS_N, STAGES), built under its own name: a sweep builds each
    variant in its own process, since every variant registers the same op names.
    RuntimeError says what is missing.
    """
    home = str(cuda_toolkit())
    os.environ["CUDA_HOME"] = home  # torch.utils.cpp_extension reads it at its import
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = home  # read at its import, which may have happened earlier
    tile = tile or {}
    name = "fuselab_cuda" + "".join(f"_{k.lower()}{v}" for k, v in sorted(tile.items()))
    build_dir = settings.CACHE_DIR.get() / "torch_extensions" / f"torch-{torch.__version__}" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    defines = [f"-DFUSELAB_{k}={v}" for k, v in sorted(tile.items())]
    cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                       extra_cuda_cflags=["-O3", *_arch_flags(), *defines], is_python_module=False,
                       verbose=verbose)


@functools.lru_cache(maxsize=None)
def load_extension(verbose: bool = False) -> None:
    """Build (once, cached on disk) and load the default extension, then add the Python parts."""
    build_extension(verbose=verbose)
    _register_python_parts()


def _register_python_parts():
    # The same contract as the Triton op; the fp16/bf16 kernel choice (the op's ``half_kernel``; not
    # ``kernel``, which inductor's FallbackKernel.create takes itself) has no gradient.
    torch.library.register_fake("fuselab::matmul_relu_cuda",
                                lambda a, b, bias, half_kernel="auto": _forward_fake(a, b, bias))
    torch.library.register_fake("fuselab::matmul_relu_cuda_naive", _forward_fake)
    torch.library.register_autograd("fuselab::matmul_relu_cuda", lambda ctx, grad: (*_backward(ctx, grad), None),
                                    setup_context=lambda ctx, inputs, output: _setup_context(ctx, inputs[:3], output))


def matmul_relu_cuda(a, b, bias=None, naive: bool = False, kernel: Optional[str] = None):
    """``relu(a @ b + bias)`` by the CUDA C++ kernels (``naive``: the tutorial's fp32 kernel).

    ``kernel`` picks the fp16/bf16 kernel: ``"auto"`` (wgmma on Hopper where it can run and pays off,
    else mma.sync), ``"mma"`` or ``"wgmma"`` (an error where it cannot run); None reads the setting
    ``FUSELAB_CUDA_KERNEL`` (``fuselab.settings``)."""
    not_cuda = [f"{name} on {t.device}" for name, t in (("a", a), ("b", b), ("bias", bias))
                if t is not None and not t.is_cuda]
    if not_cuda:  # before the build: a CPU tensor must not start minutes of compiling
        raise RuntimeError(f"the CUDA reference needs CUDA tensors, got {', '.join(not_cuda)}")
    # Dynamo cannot trace the build (os.environ, files): a compiled graph relies on an earlier eager
    # call or load_extension() having registered the op.
    if not torch.compiler.is_compiling():
        load_extension()
    if naive:
        return torch.ops.fuselab.matmul_relu_cuda_naive(a, b, bias)
    return torch.ops.fuselab.matmul_relu_cuda(a, b, bias, settings.CUDA_KERNEL.get() if kernel is None else kernel)
