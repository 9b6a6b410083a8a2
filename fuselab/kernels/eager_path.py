"""The fused op's eager host path in C++ (``csrc/eager_path.cpp``), built just in time.

An eager ``relu(linear(x))`` through Python (an ``autograd.Function``, argument checks, Triton's
launcher) costs several times the host time of aten's C++ ops, and decoders in eager mode are
host-bound. The C++ path makes the same call as one C++ function: the checks, the output, a C++
autograd node, and a ``cuLaunchKernelEx`` of the cubin Triton compiled for the chosen config (a
launch plan, as AOTInductor launches Triton kernels). Its backward is C++ too.

SparseAdamW's eager step takes the same road (``sparse_adamw_step``): the count, the sort's and the update's
planned launches and the row-id guard, in one C++ call (its plans: ``SPARSE_ADAMW_KIND``), for steps of up to
``sparse_adamw.TRITON_SORT_MAX`` lookups (longer ones sort by torch.sort, in Python). The quantized GEMM
(``fuselab.quant``) takes it too (``scaled_gemm``, its plans: ``SCALED_GEMM_KIND``): a repeated eager call's rows,
scales, output, key and launch are one C++ call; Python's checks and launch plans serve a layout's first call.

Python keeps everything else: Triton compiles and the autotuner chooses; each eager launch that
Python's ``_gemm`` makes is registered here (``register_plan``) under a key of the tensors' layouts
(a GEMM the tuner gave to cuBLAS is registered as that call: ``LIBRARY_CALLS``);
a call whose GEMM has no plan yet goes back to ``_gemm`` (which plans it). ``call`` returns None for
anything the C++ path does not serve exactly (not CUDA fp16/bf16, tensor subclasses, modes,
torch.func, forward-mode AD, tracing): the Python path serves those and raises on bad input.

The extension is built on the first eager CUDA launch (``FUSELAB_EAGER_CPP=0`` turns the path off)
into ``$FUSELAB_CACHE_DIR/torch_extensions`` with the C++ compiler alone: CUDA's headers come with
Triton, the driver is opened at run time. A failed build warns once and leaves the Python path.
"""
import contextlib
import json
import struct
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.autograd.forward_ad as forward_ad

from fuselab import settings
from fuselab._io import write_json_atomic

SOURCE = Path(__file__).resolve().parent / "csrc" / "eager_path.cpp"

# The first int of a GEMM plan's key; eager_path.cpp's kGemmKind (checked when it loads).
GEMM_KIND = 1
# The first int of a SparseAdamW launch's key and its launch indices (sort, segment, crossing); eager_path.cpp's.
SPARSE_ADAMW_KIND = 2
SPARSE_ADAMW_LAUNCHES = (0, 100, 101)
# The first int of the quantized GEMM's key (fuselab.quant._scaled_gemm), launched by ``scaled_gemm`` and
# ``launch_planned``.
SCALED_GEMM_KIND = 3
# The library calls a plan may stand for (``_autotune.LibraryChoice`` names), as eager_path.cpp numbers them.
LIBRARY_CALLS = {"cublas": 1}

# The loaded extension while the path is on, else None: ``call``'s one test on the hot path.
extension = None
_load_state = "not tried"  # "not tried" | "loaded" | "failed" | "off"

# Triton's argument types the plans pass, as the launcher packs them (8-byte slots, little-endian).
_INT_TYPES = ("i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64")


def call(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, linear: bool,
         autocast: bool) -> Optional[torch.Tensor]:
    """``relu(a @ b + bias)`` by the C++ path (``b`` is ``weight.t()`` when ``linear``), or None where
    the Python path must serve the call. ``autocast``: cast as ``nn.Linear`` is under autocast."""
    if torch.compiler.is_compiling() or extension is None or forward_ad._current_level >= 0:
        return None
    return extension.matmul_relu(a, weight, bias, linear, autocast)


def sparse_adamw_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, indices: torch.Tensor,
                      values: torch.Tensor, step: torch.Tensor, floats: Sequence[float], maximize: bool) -> bool:
    """Count the step and apply ``sparse_adamw_update_`` by the C++ path (``floats``: the kernels' float
    arguments, ``sparse_adamw.kernel_floats``); False, with nothing done, where the Python path must serve it."""
    if torch.compiler.is_compiling() or extension is None:
        return False
    return extension.sparse_adamw_step(param, exp_avg, exp_avg_sq, indices, values, step, floats, maximize)


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                bias: Optional[torch.Tensor], relu: bool, operand_dtype: torch.dtype, out_dtype: torch.dtype,
                out_dtype_code: int, out_scale: Optional[torch.Tensor], fast_accum: bool) -> Optional[torch.Tensor]:
    """The quantized GEMM's eager call (``fuselab.quant._scaled_gemm.call``: rows flattened, scales as vectors,
    the output, the planned launch) in one C++ call, or None where the Python path must serve it (and check it):
    no plan for these layouts yet, no scales, operands not of ``operand_dtype`` (the op's: the key does not name the
    op), tensor subclasses, modes, tracing."""
    if torch.compiler.is_compiling() or extension is None:
        return None
    return extension.scaled_gemm(a, b, a_scale, b_scale, bias, relu, operand_dtype, out_dtype, out_dtype_code,
                                 out_scale, fast_accum)


def launch_planned(key_ints: Sequence[int], tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Launch the kernel plan registered (``register_plan``) under ``key_ints`` and the layouts of ``tensors``
    (the kernel's tensor arguments in order, Nones included) on ``tensors``, in one C++ call; False, with
    nothing launched, where the path is not loaded or holds no such plan (the caller's Python path then runs).
    Eager only, as ``_runtime.launch_planned``: the caller has checked that nothing traces the call."""
    return extension is not None and extension.launch_planned(list(key_ints), list(tensors))


def may_plan() -> bool:
    """Whether launches should be registered here: the path is loaded, or not tried yet."""
    return _load_state in ("loaded", "not tried")


def enable(on: bool = True) -> None:
    """Turn the C++ path on (building it if needed) or off for this process (benchmarks compare both)."""
    global extension, _load_state
    if not on:
        extension, _load_state = None, "off"
        return
    _load_state = "not tried"
    _load()


@contextlib.contextmanager
def disabled():
    """The Python path for the calls made inside (benchmarks compare the two paths)."""
    global extension, _load_state
    saved = extension, _load_state
    enable(False)
    try:
        yield
    finally:
        extension, _load_state = saved


def register_plan(key_ints: Sequence[int], key_tensors: Sequence[Optional[torch.Tensor]], plan) -> bool:
    """Register a launch Python just made (``_runtime._LaunchPlan``) for the C++ path, under
    ``key_ints`` plus the layouts of ``key_tensors`` (the kernel's tensor arguments, Nones included).
    True where the C++ store, full, dropped every earlier plan to take this one."""
    ext = _load()
    if ext is None:
        return False
    choice = getattr(plan, "choice", None)  # a library call's plan (``_runtime._LibraryPlan``)
    if choice is not None:
        if choice.name in LIBRARY_CALLS:  # else C++ leaves the call to Python, which repeats it
            return ext.register_library_plan(list(key_ints), list(key_tensors), LIBRARY_CALLS[choice.name])
        return False
    params = _kernel_params(plan)
    if params is None:
        return False
    values, tensor_slots, float_slots = params
    compiled = plan.compiled
    num_warps, _, shared = compiled.packed_metadata  # one CTA per program: _kernel_params checked
    scratch = compiled.metadata.global_scratch_size * plan.grid[0] * plan.grid[1] * plan.grid[2]
    return ext.register_plan(list(key_ints), list(key_tensors), plan.device, compiled.function, list(plan.grid),
                             num_warps, shared, scratch, values, tensor_slots, float_slots)


def _kernel_params(plan):
    """The kernel's parameters as Triton's launcher passes them (its non-constexpr arguments in
    order, then the global and profile scratch pointers), each packed into an 8-byte slot with 0 at
    each tensor's slot and each fp32 slot passed at each launch (a plan's ``float_slots``), and those
    slots; None where the kernel takes something this path does not pass, or is launched
    in a way it does not launch (clusters, cooperative or programmatic-dependent launches, profiling)."""
    compiled = plan.compiled
    metadata = compiled.metadata
    if (getattr(metadata, "profile_scratch_size", 0) or getattr(metadata, "num_ctas", 1) != 1
            or getattr(metadata, "launch_cooperative_grid", False) or getattr(metadata, "launch_pdl", False)):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict) or len(signature) != len(plan.values):
        return None
    float_slots_of = set(getattr(plan, "float_slots", ()))
    tensor_slots_of = set(plan.slots) - float_slots_of
    values, tensor_slots, float_slots = [], [], []
    for i, (ty, value) in enumerate(zip(signature.values(), plan.values)):
        if ty == "constexpr":
            continue
        if i in tensor_slots_of and isinstance(ty, str) and ty.startswith("*"):
            tensor_slots.append(len(values))
            values.append(0)
        elif i in float_slots_of and ty in ("fp32", "f32"):
            float_slots.append(len(values))
            values.append(0)
        elif ty in _INT_TYPES and isinstance(value, (bool, int)):
            values.append(int(value) & 0xFFFFFFFFFFFFFFFF)
        elif ty in ("fp32", "f32") and isinstance(value, (int, float)):
            values.append(struct.unpack("<I", struct.pack("<f", value))[0])
        elif ty == "fp64" and isinstance(value, (int, float)):
            values.append(struct.unpack("<Q", struct.pack("<d", value))[0])
        else:
            return None
    if len(tensor_slots) + len(float_slots) != len(plan.slots):
        return None
    return values + [0, 0], tensor_slots, float_slots


def _load():
    """The extension, built and loaded on first use; None when off or when it cannot be built."""
    global extension, _load_state
    if _load_state == "loaded":
        return extension
    if _load_state != "not tried":
        return None
    if not settings.EAGER_CPP.get():
        _load_state = "off"
        return None
    try:
        ext = build()
    except Exception as e:  # a missing compiler or a failed build: the Python path still serves every call
        _load_state = "failed"
        warnings.warn(f"fuselab: the C++ eager path could not be built, eager calls take the Python path "
                      f"(more host time per call): {e}", RuntimeWarning, stacklevel=3)
        return None
    built = (ext.GEMM_KIND, ext.LIBRARY_CALLS, ext.SPARSE_ADAMW_KIND, tuple(ext.SPARSE_ADAMW_LAUNCHES),
             ext.SCALED_GEMM_KIND)
    expected = (GEMM_KIND, LIBRARY_CALLS, SPARSE_ADAMW_KIND, SPARSE_ADAMW_LAUNCHES, SCALED_GEMM_KIND)
    if built != expected:
        raise RuntimeError(f"fuselab: {SOURCE.name} was built with (GEMM_KIND, library calls, SPARSE_ADAMW_KIND, "
                           f"its launches, SCALED_GEMM_KIND) {built}, expected {expected}")
    from fuselab.kernels import sparse_adamw
    from fuselab.kernels.matmul_relu_triton import _gemm

    ext.set_gemm_fallback(_gemm)
    ext.set_sparse_constants(*sparse_adamw.cpp_constants())
    extension, _load_state = ext, "loaded"
    return ext


def build(verbose: bool = False):
    """Compile ``csrc/eager_path.cpp`` (cached on disk) and import it; RuntimeError if it fails.

    A build whose stamp (``_build_stamp``) matches is imported directly: ``cpp_extension.load`` would
    import its build machinery and run ninja first, half a second of every process's first fused call."""
    import triton

    cuda_headers = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    flags = dict(extra_include_paths=[str(cuda_headers)], extra_cflags=["-O2"], extra_ldflags=["-lc10_cuda"])
    name = "fuselab_eager_path"
    build_dir = settings.CACHE_DIR.get() / "torch_extensions" / f"torch-{torch.__version__}" / name
    stamp_file, stamp = build_dir / "fuselab-build.json", _build_stamp(flags)
    built = _read_stamp(stamp_file, stamp)
    if built is not None and not verbose:
        try:
            return _import_extension(built)
        except ImportError:  # a library that is not the stamp's after all: build it again
            stamp_file.unlink(missing_ok=True)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():
        print(f"fuselab: building the C++ eager path into {build_dir} (once per torch version, about a minute)",
              file=sys.stderr, flush=True)
    ext = cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir), with_cuda=False,
                             verbose=verbose, **flags)
    library = Path(ext.__file__)
    write_json_atomic(stamp_file, {"stamp": stamp, "library": library.name, "file": _file_identity(library)})
    return ext


def _file_identity(path: Path) -> list:
    """Size and modification time: a library rebuilt by anything else (another fuselab version building
    into the same folder) no longer matches the stamp written after its own build."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _build_stamp(flags: dict) -> str:
    """What the built library depends on: the source, the flags, torch, Triton (its CUDA headers), Python."""
    import hashlib

    import triton

    parts = [SOURCE.read_bytes(), repr(sorted(flags.items())).encode(), torch.__version__.encode(),
             triton.__version__.encode(), sys.version.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def _read_stamp(stamp_file: Path, stamp: str) -> Optional[Path]:
    """The library a build with this ``stamp`` left, or None (no build, another stamp, a missing file)."""
    try:
        record = json.loads(stamp_file.read_text())
        library = stamp_file.parent / record["library"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        same_file = record.get("file") == _file_identity(library)
    except OSError:
        return None
    return library if record.get("stamp") == stamp and same_file else None


def _import_extension(library: Path):
    """Import a built extension module from its file (as ``cpp_extension`` does once it has built it),
    under its file's name (``cpp_extension`` names a second build in one process ``<name>_v1``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
