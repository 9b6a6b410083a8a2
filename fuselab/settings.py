"""Every environment variable fuselab reads, with its default, in one place.

Each knob is read from the environment at its first use and kept for the rest of the process: not at
``import fuselab`` (a variable set after the import counts) and not on every call (no launch pays for
``os.environ``). ``reload()`` forgets the values read so far; a test that changes a variable calls it
after the change and again after restoring it. Anything a user sets per model or per call is an
argument instead, not an environment variable.

The knobs are the ``Knob`` constants below; ``KNOBS`` lists them all. Building the CUDA reference also
follows torch's own build variables as ``torch.utils.cpp_extension`` does (``CUDA_HOME``/``CUDA_PATH``,
``PYTORCH_NVCC``, ``TORCH_CUDA_ARCH_LIST``): they are torch's knobs, read when a build starts.
"""
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generic, Tuple, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable: its name, its default and how its text becomes a value."""

    env: str
    default: str
    parse: Callable[[str, str], T]  # (variable name, its text) -> value; ValueError naming the variable
    doc: str
    reloadable: bool = True

    def get(self) -> T:
        """The value, read from the environment at the first call and kept (see ``reload``)."""
        try:
            return _values[self.env]
        except KeyError:
            text = os.environ.get(self.env) or self.default  # set but empty means the default
            value = _values[self.env] = self.parse(self.env, text)
            return value


_values: Dict[str, Any] = {}


def _flag(env: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"{env} must be one of {'/'.join(_TRUE + _FALSE)}, got {text!r}")


def _directory(env: str, text: str) -> Path:
    return Path(text).expanduser()


def _cuda_kernel(env: str, text: str) -> str:
    if text not in ("auto", "mma", "wgmma"):
        raise ValueError(f"{env} must be auto, mma or wgmma, got {text!r}")
    return text


def _triton_interpret(env: str, text: str) -> bool:
    import triton  # Triton's own reading, so that fuselab and Triton cannot disagree on "true" or "on"

    return bool(triton.knobs.runtime.interpret)


AUTOTUNE: Knob[bool] = Knob(
    "FUSELAB_AUTOTUNE", "1", _flag,
    "0: no config is timed; an autotuned kernel takes its heuristic config (read at its first launch)")
CACHE_DIR: Knob[Path] = Knob(
    "FUSELAB_CACHE_DIR", "~/.cache/fuselab", _directory,
    "where autotune choices (autotune/), built extensions (torch_extensions/) and Triton's compiler key "
    "(triton-key/) live")
CUDA_KERNEL: Knob[str] = Knob(
    "FUSELAB_CUDA_KERNEL", "auto", _cuda_kernel,
    "the CUDA reference's fp16/bf16 kernel: auto (the faster one that can run), mma or wgmma")
EAGER_CPP: Knob[bool] = Knob(
    "FUSELAB_EAGER_CPP", "1", _flag,
    "0: eager calls of the fused layers take the Python path; 1: the C++ path, built on the first eager "
    "CUDA call (about a minute, once per torch version)")
KEEP_TRITON_KEY: Knob[bool] = Knob(
    "FUSELAB_KEEP_TRITON_KEY", "1", _flag,
    "1: Triton's compiler key, which Triton hashes from its own files in every process (about half a second "
    "before its first compile), is kept on disk (fuselab/kernels/_triton_key.py); 0: Triton computes it as "
    "usual; read at the process's first Triton compile")
TRITON_INTERPRET: Knob[bool] = Knob(
    "TRITON_INTERPRET", "0", _triton_interpret,
    "1: Triton runs kernels on the CPU; fixed when fuselab defines its kernels (at import)",
    reloadable=False)

KNOBS: Tuple[Knob, ...] = (AUTOTUNE, CACHE_DIR, CUDA_KERNEL, EAGER_CPP, KEEP_TRITON_KEY, TRITON_INTERPRET)


def reload() -> None:
    """Forget the values read so far, so that each knob's next use reads the environment again.

    ``TRITON_INTERPRET`` is kept: kernels already defined stay interpreted or compiled."""
    for knob in KNOBS:
        if knob.reloadable:
            _values.pop(knob.env, None)
