"""``triton.autotune`` whose choices persist on disk, keyed so that they cannot go stale.

A user's second process must not retune: the best config for each tuning key is stored in
``<FUSELAB_CACHE_DIR>/autotune/<gpu>/triton-<version>/<kernel>-<fingerprint>.json``. The fingerprint
hashes what a choice was made among: the kernel's source and that of every ``@triton.jit`` function
it calls, the configs, the pruning rule and the tuning key's names. Editing any of them retunes.
Everything is read at first use: the cache directory and GPU name when a tuning key is first seen
(``import fuselab`` reads neither and does not initialize CUDA), ``FUSELAB_AUTOTUNE`` at each
kernel's first launch. ``FUSELAB_AUTOTUNE=0`` times nothing: each launch takes the kernel's heuristic config,
or the first config after it that the kernel's pruning keeps (an fp32 problem needs twice a 16-bit
tile's shared memory). This governs eager launches: under ``torch.compile`` inductor tunes user
kernels over ``configs`` itself. Under the Triton interpreter timings mean nothing, so the tuner's
``do_bench`` is a constant there too.
"""
import hashlib
import inspect
import json
import os
import re
import tempfile
import types
import warnings
from functools import cached_property
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

import triton
from triton.runtime.autotuner import Autotuner

from fuselab import settings
from fuselab.kernels._runtime import INTERPRET, device_name


def cache_dir() -> Path:
    """This process's autotune directory: per cache root, GPU name and Triton version."""
    gpu = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name())
    return settings.CACHE_DIR.get() / "autotune" / gpu / f"triton-{triton.__version__}"


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


def tuning_fingerprint(kernel, configs: List[triton.Config], key: List[str],
                       prune: Optional[Callable]) -> str:
    """A hash of what a tuned choice depends on besides GPU and Triton: see the module docstring."""
    digest = hashlib.sha256()
    for part in jit_sources(kernel):
        digest.update(part.encode())
    digest.update(repr([str(c) for c in configs]).encode())
    digest.update(repr(list(key)).encode())
    if prune is not None:
        try:
            digest.update(inspect.getsource(prune).encode())
        except (OSError, TypeError):  # no source (a builtin, a lambda typed at a prompt): its name
            digest.update(getattr(prune, "__qualname__", repr(prune)).encode())
    return digest.hexdigest()[:16]


_warned_corrupt: Set[Path] = set()


def _read_cache(path: Path) -> Dict[str, str]:
    """The choices stored in ``path``; an unreadable or corrupt file counts as empty and is
    reported once (the next stored choice rewrites it)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
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


class PersistentAutotuner(Autotuner):
    """An Autotuner that reads and writes its choices in a JSON file (see module docstring)."""

    def __init__(self, fn, configs: List[triton.Config], key: List[str], prune: Optional[Callable] = None,
                 heuristic: Optional[triton.Config] = None):
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
        self.tune: Optional[bool] = None  # decided at the first launch (FUSELAB_AUTOTUNE)
        self._tuned_over = (list(configs), list(key), prune)
        self._key_positions = [(name, fn.arg_names.index(name)) for name in key]
        self._arg_set = frozenset(fn.arg_names)
        self._meta: Dict[int, dict] = {}

    @cached_property
    def fingerprint(self) -> str:
        """``tuning_fingerprint`` of this kernel, computed when first needed: the helpers a kernel
        calls may be defined after it in its module."""
        return tuning_fingerprint(self.fn, *self._tuned_over)

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
        if len(self.configs) > 1:
            config = self.cache.get(self._tuning_key(args, kwargs))
            if config is not None:  # tuned already: launch straight away
                self.best_config = config
                meta = self._meta.get(id(config))
                if meta is None:
                    meta = self._meta[id(config)] = config.all_kwargs()
                return self.fn.run(*args, **kwargs, **meta)
        if self.tune is None:
            self._decide_tuning()
        return super().run(*args, **kwargs)  # first call for this key: tune (or read the disk cache)

    def cache_file(self) -> Path:
        """Where this kernel's choices on the current GPU are stored."""
        return cache_dir() / f"{self.base_fn.__name__}-{self.fingerprint}.json"

    def check_disk_cache(self, tuning_key, configs: List[triton.Config], bench_fn: Callable) -> bool:
        if not self.tune:  # an untimed choice must not be stored as a tuned one
            bench_fn()
            return False
        path = self.cache_file()
        entry = repr(tuning_key)
        by_name = {str(c): c for c in configs}
        stored = _read_cache(path).get(entry)
        if isinstance(stored, str) and stored in by_name:
            self.cache[tuning_key] = by_name[stored]
            self.configs_timings = {}
            return True
        bench_fn()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = _read_cache(path)  # re-read: another process may have added keys meanwhile
            db[entry] = str(self.cache[tuning_key])
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(db, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home still works, it just retunes next time
        return False


def autotune(configs: List[triton.Config], key: List[str], prune: Optional[Callable] = None,
             heuristic: Optional[triton.Config] = None):
    """Decorator like ``triton.autotune``; with FUSELAB_AUTOTUNE=0 nothing is timed and ``heuristic``
    (put first) is used wherever ``prune`` keeps it."""

    def decorate(fn):
        return PersistentAutotuner(fn, configs, key, prune, heuristic)

    return decorate


def bucket(n):
    """Round a size up to a power of two so a new batch size reuses the tuned config."""
    if isinstance(n, int):
        return 1 << max(n - 1, 0).bit_length()
    return n  # symbolic under torch.compile: inductor keeps its own tuning per graph
