"""How fuselab ops are registered and launched, in one place.

On CUDA an op is a ``torch.library.triton_op`` whose body launches kernels through
``wrap_triton``, so ``torch.compile`` traces into them. Under ``TRITON_INTERPRET=1`` (CPU
tests) ``wrap_triton`` cannot be traced, so the same body is registered as a plain
``torch.library.custom_op`` with an explicit fake, and the kernels run in the interpreter.
"""
import contextlib
import enum
import functools
import inspect
import warnings
from typing import Callable, Dict, Hashable, Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as forward_ad

from fuselab import settings
from fuselab.kernels import _triton_key

# Fixed for the process: Triton decides interpreted or compiled when fuselab's kernels are defined.
INTERPRET = settings.TRITON_INTERPRET.get()
if not INTERPRET:  # a fresh process's first compile reads Triton's key from disk, not from 500 MB of hashing
    _triton_key.install()


class ExecutionPath(enum.Enum):
    """What computes an op on a tensor (``execution_path``); each value says why."""

    TRITON = "fuselab's Triton kernels (CUDA, or any device under TRITON_INTERPRET=1)"
    TORCH_ON_CPU = "PyTorch's kernels: a CPU (or meta) tensor, and Triton is not interpreting CPU tensors"
    TORCH_EXACT_FP32 = ("PyTorch's kernels: fp32 on CUDA at torch's default matmul precision "
                        "(\"highest\"), where cuBLAS's SGEMM beats Triton's exact-fp32 dot")
    TORCH_FLOAT64 = "PyTorch's kernels: float64, which fuselab's Triton kernels do not compute in (fp32 math)"


def execution_path(t: torch.Tensor, *, exact_fp32_on_cuda_uses_torch: bool = False) -> ExecutionPath:
    """What runs an op on ``t``: fuselab's Triton kernels, or PyTorch's (and why).

    ``exact_fp32_on_cuda_uses_torch``: the op is a matmul, whose exact-fp32 form cuBLAS does better
    than Triton; elementwise ops leave it False."""
    if not (t.is_cuda or (INTERPRET and t.is_cpu)):  # meta tensors: PyTorch's ops compute their shapes
        return ExecutionPath.TORCH_ON_CPU
    if t.dtype == torch.float64:
        return ExecutionPath.TORCH_FLOAT64
    if (exact_fp32_on_cuda_uses_torch and t.is_cuda and t.dtype == torch.float32
            and torch.get_float32_matmul_precision() == "highest"):
        return ExecutionPath.TORCH_EXACT_FP32
    return ExecutionPath.TRITON


def register_op(qualname: str, fake: Callable, mutates_args: Tuple[str, ...] = ()) -> Callable:
    """Decorator: register ``fn`` as the op ``qualname`` (``fuselab::name``), schema from its annotations.
    Under autocast an op computes in its inputs' dtypes, as its fake says, on every path (``_AUTOCAST_KEYS``)."""

    def decorate(fn):
        if INTERPRET:
            op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
            op.register_fake(fake)
        else:
            op = torch.library.triton_op(qualname, mutates_args=mutates_args)(fn)
        for device in ("cpu", "cuda"):
            _autocast_off(op, device)
        return op

    return decorate


# An op computes in its inputs' dtypes, as its fake says: without this exclusion an op body's PyTorch
# fallback (a CPU, exact fp32) was autocast inside and returned bf16 where the Triton path returns fp32.
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA)


def autocast_excluded():
    """A context in which no autocast casts: an op body's PyTorch kernels run in the inputs' dtypes there (the
    registered op enters it for every body; the eager paths that call bodies directly, where they run PyTorch's
    kernels)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)


def _autocast_off(op, device: str) -> None:
    """Under ``device``'s autocast, run ``op`` on its inputs uncast with autocast excluded inside
    (``torch.library.register_autocast`` would cast the inputs to one fixed dtype)."""

    def kernel(_keyset, *args):
        with autocast_excluded():
            return op._opoverload(*args)

    op._lib.impl(op._name, kernel, "Autocast" + torch._C._dispatch_key_for_device(device), with_keyset=True)


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


def in_dual_level() -> bool:
    """Forward-mode AD is on: a dual level of ``torch.autograd.forward_ad`` (``torch.func.jvp`` and
    ``jacfwd`` open one too)."""
    return forward_ad._current_level >= 0


def beyond_custom_ops() -> bool:
    """Forward-mode AD or a ``torch.func`` transform (vmap included: batched gradients) is on. A
    custom op has no forward-mode formula, torch.func differentiates an autograd.Function only with a
    ``setup_context`` (which torch.library's generated autograd lacks, and the eager autograd.Functions
    skip for speed), and Triton cannot read a batched tensor: PyTorch's own ops serve these calls."""
    return in_dual_level() or torch._C._are_functorch_transforms_active()


def backward_by_torch_needed(grad: torch.Tensor) -> bool:
    """The backward's result is differentiated (``create_graph=True``), carries tangents, or is
    batched (``vmap``; ``is_grads_batched`` and vectorized jacobians use torch's legacy vmap), all
    of which only PyTorch's ops serve; else fuselab's kernels run."""
    return (torch.is_grad_enabled() or beyond_custom_ops()
            or torch._C._functorch.is_legacy_batchedtensor(grad))


def refuse_forward_ad(op: str, instead: str) -> None:
    """Custom ops have no forward-mode formula: under a dual level their outputs would carry no
    tangent (zeros under ``torch.func.jvp``). ``instead`` names the functions that never reach the op there."""
    if forward_ad._current_level >= 0:  # in_dual_level(), inlined: every eager call passes here
        raise NotImplementedError(
            f"torch.ops.fuselab.{op} has no forward-mode derivative (torch.autograd.forward_ad, "
            f"torch.func.jvp/jacfwd): a custom op cannot have one. Call {instead} instead, which compute "
            "forward-mode AD with PyTorch's own ops.")


def call_untraced(op, body: Callable, *args, mutated: Tuple[torch.Tensor, ...] = ()):
    """``op(*args)``, or the op's eager ``body(*args)`` without the custom-op dispatcher where nothing
    traces the call (``untraced``): the dispatcher's host cost is most of a small op's. ``mutated``:
    the tensors the op writes in place, whose version counters the body bumps as the op would (autograd
    then refuses a backward through a value saved before the write)."""
    if not untraced(*(a for a in args if isinstance(a, torch.Tensor))):
        return op(*args)
    out = body(*args)
    if mutated:
        torch.autograd.graph.increment_version(mutated)
    return out


def _scratch_allocator(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Global scratch for kernels that build TMA descriptors on the device (a few hundred bytes)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def launch(kernel, grid, *args, plan_key: Optional[Hashable] = None, plan_floats: bool = False,
           cpp_key: Optional[tuple] = None, **kwargs) -> None:
    """Launch a (possibly autotuned) Triton kernel; while ``is_tracing()``, through ``wrap_triton``
    so that the graph records it.
    In eager mode the kernel is called directly, as ``triton_op`` itself does, and with a
    ``plan_key`` the launch is remembered for ``launch_planned`` (see there; ``plan_floats``: its
    float arguments are passed again at each planned launch, like its tensors); with a ``cpp_key``
    (key ints, the kernel's tensor arguments) also for the C++ eager path (``eager_path``).

    Triton launches on the current CUDA device, so the launch runs under the device of the first
    tensor argument (tensors on cuda:1 while cuda:0 is current must not be read from cuda:0).
    """
    if INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    tracing = is_tracing()
    if tracing:
        from torch.library import wrap_triton  # being traced: record the launch in the graph

        kernel = wrap_triton(kernel)
    import triton

    triton.set_allocator(_scratch_allocator)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with _on_device(device.index):
        compiled = kernel[grid](*args, **kwargs)
    if plan_key is not None and not tracing and compiled is not None:
        _remember_plan(plan_key, kernel, compiled, grid, args, kwargs, device.index, cpp_key, plan_floats)


def _is_library_choice(compiled) -> bool:
    """An autotuned launch that a library call served (``_autotune.LibraryChoice``), not a kernel."""
    from fuselab.kernels._autotune import LibraryChoice

    return isinstance(compiled, LibraryChoice)


def plan_layout(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What Triton specializes a tensor argument on, for a ``plan_key`` (see ``launch_planned``):
    dtype, shape, strides and 16-byte alignment; None for an absent tensor."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % 16)


def forget_plans() -> None:
    """Drop every launch plan, Python's and the C++ eager path's: each op's next call goes through its
    autotuner again (where a benchmark reads the config chosen for that call's key)."""
    _PLANS.clear()
    from fuselab.kernels import eager_path

    if eager_path.extension is not None:
        eager_path.extension.clear_plans()


def launch_planned(plan_key: Hashable, *tensors: torch.Tensor, cpp_key: Optional[tuple] = None) -> bool:
    """Relaunch the kernel that ``launch(..., plan_key=plan_key)`` ran, on new tensors; False
    (nothing launched) if there is no such launch yet, or planned launches are off (see
    ``_launcher_mismatch``). Eager only: call it when not ``is_tracing()``.

    Eager training calls the same GEMMs over and over, and Triton's per-call work (binding and
    specializing ~30 arguments, the autotuner's key) plus ours cost more host time than a
    mid-sized GEMM takes on a GPU. A plan keeps the compiled kernel, its grid and every non-tensor
    argument. The caller's contract: ``plan_key`` determines every non-tensor argument and each
    tensor argument's dtype, shape, strides and 16-byte alignment (what Triton specializes on);
    ``tensors`` are the launch's tensor arguments in order, Nones left out (a plan made with
    ``plan_floats``: its tensor and float arguments, in order). A ``cpp_key`` (see
    ``launch``) hands a plan made before the C++ eager path was loaded to it.
    """
    plan = _PLANS.get(plan_key)
    if plan is None:
        return False
    if cpp_key is not None and not plan.in_cpp:
        _hand_to_cpp(plan, cpp_key)
    return plan(tensors)


# A plan calls the compiled kernel's launcher as JITFunction.run does, a private Triton interface.
# It is checked against the installed Triton once (``_launcher_mismatch``); these versions ran the
# GPU tests through it (pyproject.toml's [tool.fuselab] repeats them).
LAUNCH_PLANS_TESTED_ON_TRITON = ("3.6",)

# The launcher call in JITFunction.run, whitespace removed, that ``_LaunchPlan.__call__`` repeats.
_NORMAL_LAUNCH_CALL = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,"
                       "launch_metadata,knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
                       "*bound_args.values())")
_LAUNCHER_ATTRIBUTES = ("run", "function", "packed_metadata", "launch_metadata")

_PLANS: Dict[Hashable, Union["_LaunchPlan", "_LibraryPlan"]] = {}
_MAX_PLANS = 4096
_plans_on: Optional[bool] = None  # None until the first plan checks the launcher
_plan_launched = False  # whether a planned launch has gone through the launcher yet


def _remember_plan(plan_key: Hashable, kernel, compiled, grid, args, kwargs, device: Optional[int],
                   cpp_key: Optional[tuple] = None, floats: bool = False) -> None:
    """Keep the launch just made (``compiled``, from ``kernel[grid](*args, **kwargs)``: a compiled
    kernel or the ``LibraryChoice`` that served it) for ``launch_planned`` (and with ``cpp_key`` for the
    C++ eager path); the first kernel checks Triton's launcher and may turn planned kernel launches off."""
    global _plans_on
    library = _is_library_choice(compiled)  # no launcher to check: its plan repeats the library call
    if _plans_on is None and not library:
        why = _launcher_mismatch(compiled)
        _plans_on = why is None
        if why is not None:
            _warn_plans_off(why)
    if not (_plans_on or library):
        return
    if len(_PLANS) >= _MAX_PLANS:  # dynamic shapes: keep the cache bounded
        _PLANS.clear()
    plan = _PLANS[plan_key] = (_LibraryPlan(compiled, kernel, args, kwargs) if library else
                               _LaunchPlan(kernel, compiled, grid, args, kwargs, device, floats))
    if cpp_key is not None:
        _hand_to_cpp(plan, cpp_key)


def _hand_to_cpp(plan: Union["_LaunchPlan", "_LibraryPlan"], cpp_key: tuple) -> None:
    """Register ``plan`` with the C++ eager path (once: it may decline, it is not asked again); where that
    emptied the C++ store (it is bounded), every other plan is handed over again at its next launch."""
    from fuselab.kernels import eager_path

    if eager_path.register_plan(*cpp_key, plan):
        for other in _PLANS.values():
            other.in_cpp = False
    plan.in_cpp = True


def _launcher_mismatch(compiled) -> Optional[str]:
    """Why Triton's launcher is not the one ``_LaunchPlan`` calls (None: it is): a compiled kernel
    without the attributes, or a ``JITFunction.run`` that calls the launcher differently."""
    import triton
    from triton.runtime.jit import JITFunction

    runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    missing = [name for name in _LAUNCHER_ATTRIBUTES if not hasattr(compiled, name)]
    missing += [name for name in ("launch_enter_hook", "launch_exit_hook") if not hasattr(runtime_knobs, name)]
    if missing:
        return f"the compiled kernel or triton.knobs.runtime has no {', '.join(missing)}"
    try:
        source = inspect.getsource(JITFunction.run)
    except (OSError, TypeError) as e:
        return f"the source of JITFunction.run cannot be read ({e})"
    if _NORMAL_LAUNCH_CALL not in "".join(source.split()):
        return "JITFunction.run calls the compiled kernel's launcher differently"
    return None


def _warn_plans_off(why: str) -> None:
    import triton

    from fuselab.kernels import eager_path

    eager_path.enable(False)  # its plans pass arguments as this launcher would: off with it

    tested = ", ".join(LAUNCH_PLANS_TESTED_ON_TRITON)
    warnings.warn(f"fuselab: planned kernel launches are off with triton {triton.__version__} ({why}); "
                  f"every launch takes Triton's normal path, which costs more host time. Launch plans "
                  f"were tested on triton {tested}.", RuntimeWarning, stacklevel=3)


def _current_stream() -> int:
    from triton.runtime import driver

    return driver.active.get_current_stream(driver.active.get_current_device())


class _LaunchPlan:
    """One compiled kernel with its grid and arguments fixed but for the tensors (``launch_planned``)."""

    def __init__(self, kernel, compiled, grid, args, kwargs, device: Optional[int], floats: bool = False):
        names = getattr(kernel, "arg_names", None) or kernel.fn.arg_names  # a JITFunction's, or its Autotuner's
        config = getattr(kernel, "best_config", None)
        bound = dict(zip(names, args), **kwargs, **(config.all_kwargs() if config else {}))
        self.values = [bound[name] for name in names]  # the order Triton's launcher takes
        # Triton does not specialize on a float's value: a float slot takes any float (never an int)
        self.slots = [i for i, v in enumerate(self.values)
                      if isinstance(v, torch.Tensor) or (floats and isinstance(v, float))]
        grid = tuple(grid(bound) if callable(grid) else grid)
        self.grid = grid + (1,) * (3 - len(grid))
        for i in self.slots:  # hold no tensor of the first call
            self.values[i] = None
        self.float_slots = [i for i in self.slots if isinstance(bound[names[i]], float)]
        self.compiled, self.device = compiled, device
        self.in_cpp = False  # registered with the C++ eager path (eager_path.register_plan)

    def __call__(self, tensors) -> bool:
        """Launch on ``tensors``; False (nothing launched, planned launches turned off) if this first
        planned launch finds that Triton's launcher takes other arguments."""
        global _plans_on, _plan_launched
        import triton

        values = list(self.values)
        for i, t in zip(self.slots, tensors):
            values[i] = t
        for i in self.float_slots:  # an int would launch a kernel compiled for a float: Triton's own error
            if not isinstance(values[i], float):
                raise TypeError(f"planned launch: argument {i} must be a float, got {values[i]!r}")
        with _on_device(self.device):
            triton.set_allocator(_scratch_allocator)  # per thread: the backward runs on autograd's
            stream = _current_stream()
            k, grid, hooks = self.compiled, self.grid, triton.knobs.runtime
            try:
                k.run(*grid, stream, k.function, k.packed_metadata, k.launch_metadata(grid, stream, *values),
                      hooks.launch_enter_hook, hooks.launch_exit_hook, *values)
            except TypeError as e:
                if _plan_launched:  # the launcher took these arguments before: a real error
                    raise
                _plans_on = False  # it checks its arguments before it launches anything
                _PLANS.clear()
                _warn_plans_off(f"its launcher rejected a planned launch's arguments: {e}")
                return False
        _plan_launched = True
        return True


class _LibraryPlan:
    """A planned launch that a ``LibraryChoice`` serves: its call, with every argument fixed but the tensors."""

    def __init__(self, choice, kernel, args, kwargs):
        from fuselab.kernels._autotune import bound_args

        named = bound_args(getattr(kernel, "fn", kernel).arg_names, args, kwargs)
        self.choice = choice
        self.tensor_names = [k for k, v in named.items() if isinstance(v, torch.Tensor)]  # in argument order
        self.fixed = {k: v for k, v in named.items() if not isinstance(v, torch.Tensor)}  # no tensor of the first call
        self.in_cpp = False

    def __call__(self, tensors) -> bool:
        self.choice.call(dict(self.fixed, **dict(zip(self.tensor_names, tensors))))
        return True


def _on_device(index: Optional[int]):
    """``torch.cuda.device(index)`` where it differs from the current device, else nothing."""
    if index is None or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


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
    return device.type == "cuda" and not INTERPRET and cuda_capability(device) >= (9, 0)


def cuda_capability(device: torch.device) -> Tuple[int, int]:
    """A CUDA device's compute capability, asked once per GPU (a query costs microseconds a call)."""
    return _cuda_properties(device.index)[1:]


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: Optional[int]):
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return props.multi_processor_count, props.major, props.minor


def max_shared_memory(device_index: Optional[int] = None) -> int:
    """Bytes of shared memory one program may use (opt-in limit); a Hopper-sized guess without a GPU."""
    if INTERPRET or not torch.cuda.is_available():
        return 232448
    import triton

    dev = torch.cuda.current_device() if device_index is None else device_index
    return triton.runtime.driver.active.utils.get_device_properties(dev)["max_shared_mem"]


def check_tensors(**tensors: Optional[torch.Tensor]) -> None:
    """TypeError naming an argument that is not a tensor (a NumPy array met ``.is_cuda`` deep inside)."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__qualname__}")


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
