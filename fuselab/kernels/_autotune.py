"""``triton.autotune`` whose choices persist on disk, keyed so that they cannot go stale.

A user's second process must not retune: the best config for each tuning key is stored in
``<FUSELAB_CACHE_DIR>/autotune/<gpu>/triton-<version>/<kernel>-<fingerprint>.json``. The fingerprint
hashes what a choice was made among: the kernel's source and that of every ``@triton.jit`` function
it calls, the configs, the pruning rule, the library choices (``LibraryChoice``: a library call timed
beside the configs, cuBLAS say, and the rule that times them: ``issue_bound``) and the tuning key's
names. Editing any of them retunes.
Everything is read at first use: the cache directory and GPU name when a tuning key is first seen
(``import fuselab`` reads neither and does not initialize CUDA), ``FUSELAB_AUTOTUNE`` at each
kernel's first launch. ``FUSELAB_AUTOTUNE=0`` times nothing: each launch takes the kernel's heuristic config,
or the first config after it that the kernel's pruning keeps (an fp32 problem needs twice a 16-bit
tile's shared memory). This governs eager launches: under ``torch.compile`` inductor tunes user
kernels over ``configs`` itself. Under the Triton interpreter timings mean nothing, so the tuner's
``do_bench`` is a constant there too.

Before timing anything for a new key, the tuner looks for a choice made in advance: first in the user's
cache above (made on this very machine, at a shape it met), then in the config file shipped for this GPU
(``fuselab/kernels/configs/<gpu>.json``, written by ``python -m fuselab.tune --write-configs``), so that a
key on the shipped grid is never timed on a user's machine. A shipped file records the Triton version
and each kernel's fingerprint; a file for another Triton, or a kernel entry for another version of the
kernel, is ignored with one warning, and the key is tuned as usual. When the tuner does time, it says so
in one line per key on the ``fuselab.autotune`` logger, at WARNING level: Python prints such a record with
no logging set up (the message alone, on stderr), an application's logging config routes or silences it
(``logging.getLogger("fuselab.autotune").setLevel(logging.ERROR)``), and, unlike a warning, it never
becomes an exception under ``-W error`` or pytest's ``filterwarnings = error``.
"""
import hashlib
import inspect
import json
import logging
import re
import time
import types
import warnings
from functools import cached_property
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import triton
from triton.runtime.autotuner import Autotuner

from fuselab import settings
from fuselab._io import locked, write_json_atomic
from fuselab.kernels._runtime import INTERPRET, device_name

# The per-GPU choices that ship in the package; a module attribute so that tests can point it elsewhere.
SHIPPED_CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
CONFIGS_FORMAT = "fuselab-configs/1"
log = logging.getLogger("fuselab.autotune")


def gpu_file_name(name: Optional[str] = None) -> str:
    """A GPU name as a file or directory name (``NVIDIA H200`` -> ``NVIDIA_H200``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name() if name is None else name)


def cache_dir() -> Path:
    """This process's autotune directory: per cache root, GPU name and Triton version."""
    return settings.CACHE_DIR.get() / "autotune" / gpu_file_name() / f"triton-{triton.__version__}"


def shipped_configs_path(gpu: Optional[str] = None, directory: Optional[Path] = None) -> Path:
    """The shipped config file for ``gpu`` (default: this process's GPU, ``device_name()``)."""
    return Path(SHIPPED_CONFIGS_DIR if directory is None else directory) / f"{gpu_file_name(gpu)}.json"


def _constant_bench(fn, quantiles=None, **kwargs):
    return [1.0, 1.0, 1.0]  # all configs tie: the tuner keeps the first one pruning left


def _is_jit_function(obj) -> bool:
    # A JITFunction, or the interpreter's stand-in for one (TRITON_INTERPRET=1).
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(obj, (JITFunction, InterpretedFunction))


def _def_source(fn: types.FunctionType) -> str:
    """A function's source from its ``def`` on: decorators (an autotune list, say) are not its body."""
    source = inspect.getsource(fn)
    start = re.search(r"^\s*def\s", source, re.MULTILINE)
    return source[start.start():] if start else source


def _global_names(code: types.CodeType) -> Set[str]:
    """Names a function's code loads as globals or attributes (``helpers.tile``), nested code too."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def jit_sources(kernel) -> List[str]:
    """The source of the ``@triton.jit`` function ``kernel`` and of every ``@triton.jit`` function
    it calls, transitively, found as globals or module attributes; with the values of the
    ``tl.constexpr`` globals they read. In a fixed order, for hashing."""
    from triton.language import constexpr

    while not _is_jit_function(kernel):  # an Autotuner or heuristics wrapper around it
        kernel = kernel.fn
    sources: Dict[str, str] = {}
    todo = [kernel]
    while todo:
        jit_fn = todo.pop()
        fn = jit_fn.fn  # the undecorated Python function
        name = f"{fn.__module__}.{fn.__qualname__}"
        if name in sources:
            continue
        sources[name] = _def_source(fn)
        scope = dict(fn.__globals__, **inspect.getclosurevars(fn).nonlocals)
        names = _global_names(fn.__code__)
        modules = [v for v in scope.values() if isinstance(v, types.ModuleType)]
        for n in sorted(names):
            value = scope.get(n)
            if value is None:  # an attribute name: look it up on the modules the function sees
                value = next((getattr(m, n) for m in modules if _is_jit_function(getattr(m, n, None))), None)
            if _is_jit_function(value):
                todo.append(value)
            elif isinstance(value, constexpr):
                sources[f"{name}:{n}"] = repr(value)
    return [f"{name}\n{sources[name]}" for name in sorted(sources)]


def _python_source(fn: Callable) -> str:
    """A Python function's source and the values of the plain constants (bool, int, float, str) it reads
    from its module: a switch such as ``TMA_ON_CUDA = False`` changes what it does without changing its
    source."""
    fn = inspect.unwrap(fn)  # a decorated function (torch.no_grad()) as written, not the decorator's wrapper
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):  # no source (a builtin, a lambda typed at a prompt): its name
        return getattr(fn, "__qualname__", repr(fn))
    scope = getattr(fn, "__globals__", {})
    code = getattr(fn, "__code__", None)
    constants = sorted((n, repr(scope[n])) for n in (_global_names(code) if code else ())
                       if type(scope.get(n)) in (bool, int, float, str))
    return source + repr(constants)


def tuning_fingerprint(kernel, configs: List[triton.Config], key: List[str], prune: Optional[Callable],
                       library: Sequence["LibraryChoice"] = ()) -> str:
    """A hash of what a tuned choice depends on besides GPU and Triton: see the module docstring."""
    digest = hashlib.sha256()
    for part in jit_sources(kernel):
        digest.update(part.encode())
    digest.update(repr([str(c) for c in configs]).encode())
    digest.update(repr(list(key)).encode())
    rule = [issue_bound] if library else []
    for fn in ([prune] if prune is not None else []) + [f for c in library for f in (c.call, c.applies)] + rule:
        digest.update(_python_source(fn).encode())
    digest.update(repr([str(c) for c in library]).encode())
    return digest.hexdigest()[:16]


def bound_args(arg_names: Sequence[str], args: tuple, kwargs: dict) -> dict:
    """A launch's arguments by name: the positional ones zipped with the kernel's names, then the keywords."""
    return {**dict(zip(arg_names, args)), **kwargs}


_warned_corrupt: Set[Path] = set()


def _read_cache(path: Path) -> Dict[str, str]:
    """The choices stored in ``path``; an unreadable or corrupt file counts as empty and is
    reported once (the next stored choice rewrites it)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # ValueError: bytes that are not UTF-8
        problem = f"cannot be read: {e}"
    else:
        try:
            db = json.loads(text)
        except ValueError as e:
            problem = f"is not JSON: {e}"
        else:
            if isinstance(db, dict):
                return db
            problem = f"holds {text.strip()[:40]!r}, not a JSON object"
    if path not in _warned_corrupt:
        _warned_corrupt.add(path)
        warnings.warn(f"fuselab: the autotune cache {path} {problem}; ignoring it (tuning again, "
                      f"then rewriting it)", RuntimeWarning, stacklevel=2)
    return {}


def store_choice(path: Path, entry: str, choice: str) -> None:
    """Add ``entry: choice`` to the cache file ``path``, re-read under a lock: other processes may be adding keys."""
    with locked(path):
        db = _read_cache(path)
        db[entry] = choice
        write_json_atomic(path, db, sort_keys=True)


_shipped_files: Dict[Tuple[Path, int, int], dict] = {}  # (path, mtime, size) -> its parsed content
_warned_shipped: Set[Tuple[Path, str]] = set()


def _warn_shipped_once(path: Path, what: str, message: str) -> None:
    if (path, what) not in _warned_shipped:
        _warned_shipped.add((path, what))
        warnings.warn(f"fuselab: ignoring {message}; the kernel is tuned on first use instead. Rerun "
                      f"`python -m fuselab.tune --write-configs` on this GPU to refresh the file.",
                      RuntimeWarning, stacklevel=4)


def _read_shipped(path: Path) -> dict:
    """The parsed config file at ``path`` ({} if absent; a broken one is reported once, as {}),
    read once per process and version of the file."""
    try:
        stat = path.stat()
    except OSError:
        return {}
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _shipped_files:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != CONFIGS_FORMAT:
                raise ValueError(f"not a {CONFIGS_FORMAT} file")
        except (OSError, ValueError) as e:
            _warn_shipped_once(path, "corrupt", f"the shipped config file {path}: {e}")
            data = {}
        _shipped_files[key] = data
    return _shipped_files[key]


def shipped_choices(kernel_name: str, fingerprint: str, path: Optional[Path] = None) -> Dict[str, str]:
    """The choices shipped for ``kernel_name`` on this GPU: ``{repr(tuning key): str(config)}``.

    Empty without a file, and (with one warning per file) for a file made with another Triton or an
    entry made for another version of the kernel: its choices were timed among other configs or code."""
    path = shipped_configs_path() if path is None else path
    data = _read_shipped(path)
    entry = data.get("kernels", {}).get(kernel_name)
    if not isinstance(entry, dict):
        return {}
    if data.get("triton") != triton.__version__:
        _warn_shipped_once(path, "triton", f"the shipped config file {path}: it was tuned with triton "
                                           f"{data.get('triton')}, this is triton {triton.__version__}")
        return {}
    if entry.get("fingerprint") != fingerprint:
        _warn_shipped_once(path, kernel_name, f"the configs for {kernel_name} in {path}: they were tuned for "
                                              f"another version of the kernel (fingerprint "
                                              f"{entry.get('fingerprint')}, now {fingerprint})")
        return {}
    configs = entry.get("configs")
    return {k: v for k, v in configs.items() if isinstance(v, str)} if isinstance(configs, dict) else {}


def write_shipped_configs(path: Path, gpu: str, kernels: Dict[str, Tuple[str, Dict[str, str]]],
                          about: Optional[dict] = None) -> Path:
    """Write (atomically) the config file ``path`` for ``gpu``: ``kernels`` maps a kernel's name to
    (fingerprint, {repr(tuning key): str(config)}). Choices already in the file for the same Triton and
    kernel fingerprint are kept unless replaced; any other entry of that kernel is dropped; the runs ``about``
    names join those of the kept choices. Two writers at once wait for each other (the file is re-read under a lock)."""
    with locked(path):
        return _write_shipped_configs(path, gpu, kernels, about or {})


def _write_shipped_configs(path: Path, gpu: str, kernels: Dict[str, Tuple[str, Dict[str, str]]], about: dict) -> Path:
    old = _read_shipped(path) if path.exists() else {}
    same_triton = old.get("triton") == triton.__version__
    merged: Dict[str, dict] = {}
    for name, (fingerprint, configs) in kernels.items():
        previous = old.get("kernels", {}).get(name, {}) if same_triton else {}
        kept = previous.get("configs", {}) if previous.get("fingerprint") == fingerprint else {}
        merged[name] = {"fingerprint": fingerprint, "configs": dict(sorted({**kept, **configs}.items()))}
    if same_triton:  # kernels this sweep did not cover keep their entries, and the runs that timed them stay named
        merged = {**{k: v for k, v in old.get("kernels", {}).items() if k not in merged}, **merged}
        old_runs = old.get("about", {}).get("runs")
        if isinstance(old_runs, dict) and isinstance(about.get("runs"), dict):
            about = {**about, "runs": {**old_runs, **about["runs"]}}
    data = {"format": CONFIGS_FORMAT, "gpu": gpu, "triton": triton.__version__, "about": about,
            "kernels": dict(sorted(merged.items()))}
    write_json_atomic(path, data)
    return path


_SHORT_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def describe_key(names: Sequence[str], tuning_key: tuple) -> str:
    """A tuning key in words: the first tensor's dtype, ``M~8192`` for each ``M_BUCKET``, the flags
    that are set, then any other value (``describe_key(["M_BUCKET", "TMA_OK"], (8192, True, "torch.bfloat16"))``
    is ``bf16 M~8192 TMA_OK``)."""
    values, dtypes = tuning_key[:len(names)], [str(v) for v in tuning_key[len(names):]]
    words = [_SHORT_DTYPES.get(dtypes[0], dtypes[0].replace("torch.", ""))] if dtypes else []
    for name, value in zip(names, values):
        if name.endswith("_BUCKET"):
            words.append(f"{name[:-len('_BUCKET')]}~{value}")
        elif value is True:
            words.append(name)
        elif value is not False:
            words.append(f"{name}={value}")
    return " ".join(words)


_UNWRITABLE: set = set()  # cache files a write failed on (warned about once)


class LibraryChoice(triton.Config):
    """A tuning choice that computes a launch's result by a library call (cuBLAS through ``torch.addmm``,
    say) instead of the kernel: timed beside the kernel's configs where ``applies(args)`` holds for the
    launch's named arguments, chosen only where it is faster, stored by ``name`` like a config. A choice
    is made once per tuning key, so ``applies`` must read only what the key holds (its flags, dtypes).
    A call that raises while it is timed is not chosen (as a config that does not compile).

    Eager launches only: inductor tunes a traced kernel over its Triton ``configs`` alone."""

    def __init__(self, name: str, call: Callable[[dict], None], applies: Callable[[dict], bool]):
        super().__init__({})
        self.name, self.call, self.applies = name, call, applies

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__
    # triton.Config compares by its kwargs, which a library choice has none of: two would be one dict key
    __eq__, __hash__ = object.__eq__, object.__hash__


def issue_bound(config: triton.Config, run: Callable[[], object], timings: Sequence[float]) -> List[float]:
    """``timings`` (ms, GPU time) of ``run`` with ``config``, each raised to the host's time to issue one
    call when ``config`` is a ``LibraryChoice``: an eager call cannot finish before the host has issued it.
    A library call (torch's dispatcher, cuBLAS's setup, a separate ReLU) costs the host several times a
    planned kernel launch (``eager_path``), which stays under its kernel's GPU time; at small problems
    that host time, not the GPU's, is what a model waits for. The tuner, the sweep and its checks all time
    library choices through this one rule."""
    if not isinstance(config, LibraryChoice) or INTERPRET:
        return list(timings)
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    calls, best = 10, float("inf")
    for _ in range(3):  # the least of three batches: the host's own noise only ever adds time
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - start) * 1e3 / calls)
    sync()
    return [max(t, best) for t in timings]


class PersistentAutotuner(Autotuner):
    """An Autotuner that reads and writes its choices in a JSON file (see module docstring)."""

    def __init__(self, fn, configs: List[triton.Config], key: List[str], prune: Optional[Callable] = None,
                 heuristic: Optional[triton.Config] = None, library: Sequence[LibraryChoice] = ()):
        super().__init__(
            fn,
            fn.arg_names,
            configs,
            key,
            reset_to_zero=None,
            restore_value=None,
            prune_configs_by={"early_config_prune": prune} if prune else None,
            do_bench=_constant_bench if INTERPRET else None,
        )
        self.cache_results = True  # route every new key through check_disk_cache below
        self.heuristic = heuristic
        self.library = list(library)
        names = [str(c) for c in list(configs) + self.library]
        if len(set(names)) != len(names):  # choices are stored by name
            raise ValueError(f"{fn.__name__}: two tuning choices share a name: {sorted(names)}")
        self.tune: Optional[bool] = None  # decided at the first launch (FUSELAB_AUTOTUNE)
        self._tuned_over = (list(configs), list(key), prune)
        self._key_positions = [(name, fn.arg_names.index(name)) for name in key]
        self._arg_set = frozenset(fn.arg_names)
        self._meta: Dict[int, dict] = {}
        self._shipped: Dict[str, Dict[str, str]] = {}  # GPU name -> its shipped choices

    @cached_property
    def fingerprint(self) -> str:
        """``tuning_fingerprint`` of this kernel, computed when first needed: the helpers a kernel
        calls may be defined after it in its module."""
        return tuning_fingerprint(self.fn, *self._tuned_over, self.library)

    def shipped(self) -> Dict[str, str]:
        """The current GPU's shipped choices for this kernel (``shipped_choices``), read once per GPU name."""
        gpu = device_name()
        if gpu not in self._shipped:
            self._shipped[gpu] = shipped_choices(self.base_fn.__name__, self.fingerprint)
        return self._shipped[gpu]

    def _decide_tuning(self) -> None:
        """Read FUSELAB_AUTOTUNE: without tuning, the heuristic goes first and nothing is timed."""
        self.tune = self.heuristic is None or settings.AUTOTUNE.get()
        if not self.tune:
            self.configs = [self.heuristic] + [c for c in self.configs if c is not self.heuristic]
            self._do_bench = _constant_bench
            self.__dict__.pop("do_bench", None)  # Autotuner caches the benchmarker it first used

    def _tuning_key(self, args, kwargs) -> tuple:
        """The key ``Autotuner.run`` computes (tuning keys, then every tensor's dtype), computed
        without building its three dicts: it sits on every launch's host path."""
        vals = [args[pos] if pos < len(args) else kwargs[name]
                for name, pos in self._key_positions if pos < len(args) or name in kwargs]
        vals += [str(a.dtype) for a in args if hasattr(a, "dtype")]
        vals += [str(v.dtype) for k, v in kwargs.items() if k in self._arg_set and hasattr(v, "dtype")]
        return tuple(vals)

    def run(self, *args, **kwargs):
        """Launch with the key's chosen config (choosing it first: ``_choose``); returns the compiled
        kernel launched, or the ``LibraryChoice`` that computed the result instead."""
        key = self._tuning_key(args, kwargs)
        config = self.cache.get(key)
        if config is None:  # first call for this key: tune (or read a stored choice)
            config = self._choose(key, args, kwargs)
        self.best_config = config
        if isinstance(config, LibraryChoice):
            config.call(bound_args(self.arg_names, args, kwargs))
            return config
        meta = self._meta.get(id(config))
        if meta is None:
            meta = self._meta[id(config)] = config.all_kwargs()
        return self.fn.run(*args, **kwargs, **meta)

    def prune_configs(self, kwargs: Dict) -> List[triton.Config]:
        """The kernel's configs that pruning keeps, then the library choices that apply here (set
        ``self.nargs`` first, as Triton's ``Autotuner.run`` does)."""
        named = {**self.nargs, **kwargs}
        return list(super().prune_configs(kwargs)) + [c for c in self.library if c.applies(named)]

    def _choose(self, key: tuple, args: tuple, kwargs: dict) -> triton.Config:
        """Time the candidates of ``key`` (``prune_configs``), or take a stored choice
        (``check_disk_cache``), and cache the fastest."""
        if self.tune is None:
            self._decide_tuning()
        self.nargs = dict(zip(self.arg_names, args))
        try:
            candidates = self.prune_configs(kwargs)
            if len(candidates) == 1:
                self.cache[key] = candidates[0]
                return candidates[0]

            def benchmark():
                timings = {c: self._bench(*args, config=c, **kwargs) for c in candidates}
                self.cache[key] = min(timings, key=timings.get)  # the first of equals: the kernel's
                self.configs_timings = timings

            self.check_disk_cache(key, candidates, benchmark)
            return self.cache[key]
        finally:
            self.nargs = None

    def _bench(self, *args, config, **meta):
        if isinstance(config, LibraryChoice):
            named = bound_args(self.arg_names, args, meta)
            try:
                timings = self.do_bench(lambda: config.call(named), quantiles=(0.5, 0.2, 0.8))
                return issue_bound(config, lambda: config.call(named), timings) if self.tune else timings
            except RuntimeError as e:  # the library refuses these operands: the kernel's configs remain
                log.info("fuselab: %s: %s refused this launch (%s)", self.base_fn.__name__, config, e)
                return [float("inf")] * 3
        return super()._bench(*args, config=config, **meta)

    def warmup(self, *args, **kwargs):
        """Triton's ahead-of-time compile of the pruned configs: library choices compile nothing."""
        library, self.library = self.library, []
        try:
            return super().warmup(*args, **kwargs)
        finally:
            self.library = library

    def cache_file(self) -> Path:
        """Where this kernel's choices on the current GPU are stored."""
        return cache_dir() / f"{self.base_fn.__name__}-{self.fingerprint}.json"

    def check_disk_cache(self, tuning_key, configs: List[triton.Config], bench_fn: Callable) -> bool:
        if not self.tune:  # an untimed choice must not be stored as a tuned one
            bench_fn()
            return False
        entry = repr(tuning_key)
        by_name = {str(c): c for c in configs}
        path = self.cache_file()
        # The user's own choice first (timed on this machine, at a shape it ran), then the sweep's for this GPU.
        for stored in (_read_cache(path).get(entry), self.shipped().get(entry)):
            if isinstance(stored, str) and stored in by_name:
                self.cache[tuning_key] = by_name[stored]
                self.configs_timings = {}
                return True
        where = "in the Triton interpreter, whose timings mean nothing" if INTERPRET else "once per GPU"
        log.warning("fuselab: tuning %s %s: %d configs, %s (cached in %s)", self.base_fn.__name__,
                    describe_key(self.keys, tuning_key), len(configs), where, path.parent)
        bench_fn()
        try:
            store_choice(path, entry, str(self.cache[tuning_key]))
        except OSError as e:  # a read-only or misplaced cache still works; it retunes next time, and says so once
            if path not in _UNWRITABLE:
                _UNWRITABLE.add(path)
                log.warning("fuselab: cannot write the autotune cache %s (%s): every new process will tune again; "
                            "set FUSELAB_CACHE_DIR to a writable folder", path, e)
        return False


def autotune(configs: List[triton.Config], key: List[str], prune: Optional[Callable] = None,
             heuristic: Optional[triton.Config] = None, library: Sequence[LibraryChoice] = ()):
    """Decorator like ``triton.autotune``; with FUSELAB_AUTOTUNE=0 nothing is timed and ``heuristic``
    (put first) is used wherever ``prune`` keeps it. ``library``: choices timed beside the configs
    (``LibraryChoice``)."""

    def decorate(fn):
        return PersistentAutotuner(fn, configs, key, prune, heuristic, library)

    return decorate


def bucket(n):
    """Round a size up to a power of two so a new batch size reuses the tuned config."""
    if isinstance(n, int):
        return 1 << max(n - 1, 0).bit_length()
    return n  # symbolic under torch.compile: inductor keeps its own tuning per graph
