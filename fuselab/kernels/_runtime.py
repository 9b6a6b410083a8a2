"""How fuselab ops are registered and launched, in one place.

On CUDA an op is a ``torch.library.triton_op`` whose body launches kernels through
``wrap_triton``, so ``torch.compile`` traces into them. Under ``TRITON_INTERPRET=1`` (CPU
tests) ``wrap_triton`` cannot be traced, so the same body is registered as a plain
``torch.library.custom_op`` with an explicit fake, and the kernels run in the interpreter.
"""
import functools
import os
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

# Read once: triton reads the same variable when it is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs Triton kernels (CUDA, or any tensor under the interpreter)."""
    return t.is_cuda or INTERPRET


def register_op(qualname: str, fake: Callable, mutates_args: Tuple[str, ...] = ()) -> Callable:
    """Decorator: register ``fn`` as the op ``qualname`` (``fuselab::name``), schema from its annotations."""

    def decorate(fn):
        if INTERPRET:
            op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
            op.register_fake(fake)
            return op
        return torch.library.triton_op(qualname, mutates_args=mutates_args)(fn)

    return decorate


def is_tracing() -> bool:
    """Whether a graph may be recording this call: Dynamo compiling, or a mode (FakeTensor, proxy,
    functionalization, a TorchFunctionMode) active. Dynamo folds the first test, so it never
    traces the others."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()


def untraced(*tensors: Optional[torch.Tensor]) -> bool:
    """Nothing records or transforms this call: no tracing, no tensor subclass (DTensor, say), no
    vmap/grad wrapper. Then an op's body may run without the custom-op dispatcher."""
    if is_tracing():
        return False
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(t is None or (type(t) in plain and not torch._C._functorch.is_functorch_wrapped_tensor(t))
               for t in tensors)


def cache_root() -> Path:
    """Where fuselab keeps autotune choices and built extensions: ``$FUSELAB_CACHE_DIR`` or ~/.cache/fuselab."""
    return Path(os.environ.get("FUSELAB_CACHE_DIR", Path.home() / ".cache" / "fuselab"))


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch a (possibly autotuned) Triton kernel; while ``is_tracing()``, through ``wrap_triton``
    so that the graph records it.
    In eager mode the kernel is called directly, as ``triton_op`` itself does.

    Triton launches on the current CUDA device, so the launch runs under the device of the first
    tensor argument (tensors on cuda:1 while cuda:0 is current must not be read from cuda:0).
    """
    if INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    if is_tracing():
        from torch.library import wrap_triton  # being traced: record the launch in the graph

        kernel = wrap_triton(kernel)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if device.index is None or device.index == torch.cuda.current_device():
        kernel[grid](*args, **kwargs)
    else:
        with torch.cuda.device(device):
            kernel[grid](*args, **kwargs)


def device_name(device: Optional[torch.device] = None) -> str:
    """Name of the device kernels are tuned for: the GPU's name, or 'triton-interpreter'/'cpu'."""
    if INTERPRET:
        return "triton-interpreter"
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu"


def num_sms(device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return 4
    return _cuda_properties(device.index)[0]


def has_tma(device: torch.device) -> bool:
    """Hopper or newer: tensor-memory-accelerator copies (TMA descriptors)."""
    return device.type == "cuda" and not INTERPRET and _cuda_properties(device.index)[1] >= 9


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: Optional[int]):
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return props.multi_processor_count, props.major


def max_shared_memory(device_index: Optional[int] = None) -> int:
    """Bytes of shared memory one program may use (opt-in limit); a Hopper-sized guess without a GPU."""
    if INTERPRET or not torch.cuda.is_available():
        return 232448
    import triton

    dev = torch.cuda.current_device() if device_index is None else device_index
    return triton.runtime.driver.active.utils.get_device_properties(dev)["max_shared_mem"]


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        desc = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"all tensors must be on one device, got {desc}")


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_same_dtype(**tensors: Optional[torch.Tensor]) -> torch.dtype:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        desc = ", ".join(f"{n} is {t.dtype}" for n, t in named)
        raise TypeError(f"all tensors must have one dtype (nothing is converted silently), got {desc}")
    dtype = named[0][1].dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: expected one of float16, bfloat16, float32")
    return dtype
