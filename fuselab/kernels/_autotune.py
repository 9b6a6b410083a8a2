"""``triton.autotune`` whose choices persist on disk per GPU name and Triton version.

A user's second process must not retune: the best config for each tuning key is stored in
``$FUSELAB_CACHE_DIR`` (default ``~/.cache/fuselab``) ``/autotune/<gpu>/triton-<version>/<kernel>.json``.
``FUSELAB_AUTOTUNE=0`` (read at import) times nothing: each launch takes the kernel's heuristic
config, or the first config after it that the kernel's pruning keeps (an fp32 problem needs twice
a 16-bit tile's shared memory). This governs eager launches: under ``torch.compile`` inductor
tunes user kernels over ``configs`` itself. Under the Triton interpreter timings mean nothing, so
the tuner's ``do_bench`` is a constant there too.
"""
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import triton
from triton.runtime.autotuner import Autotuner

from fuselab.kernels._runtime import INTERPRET, cache_root, device_name

AUTOTUNE = os.environ.get("FUSELAB_AUTOTUNE", "1") != "0"


def cache_dir() -> Path:
    root = cache_root()
    gpu = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name())
    return root / "autotune" / gpu / f"triton-{triton.__version__}"


def _constant_bench(fn, quantiles=None, **kwargs):
    return [1.0, 1.0, 1.0]  # all configs tie: the tuner keeps the first one pruning left


class PersistentAutotuner(Autotuner):
    """An Autotuner that reads and writes its choices in a JSON file (see module docstring)."""

    def __init__(self, fn, configs, key, prune=None, tune=True):
        super().__init__(
            fn,
            fn.arg_names,
            configs,
            key,
            reset_to_zero=None,
            restore_value=None,
            prune_configs_by={"early_config_prune": prune} if prune else None,
            do_bench=_constant_bench if INTERPRET or not tune else None,
        )
        self.tune = tune
        self.cache_results = True  # route every new key through check_disk_cache below
        self.cache_file = cache_dir() / f"{fn.__name__}.json"
        self._key_positions = [(name, fn.arg_names.index(name)) for name in key]
        self._arg_set = frozenset(fn.arg_names)
        self._meta: Dict[int, dict] = {}

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
        return super().run(*args, **kwargs)  # first call for this key: tune (or read the disk cache)

    def _load(self) -> Dict[str, str]:
        try:
            return json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            return {}

    def check_disk_cache(self, tuning_key, configs: List[triton.Config], bench_fn: Callable) -> bool:
        if not self.tune:  # an untimed choice must not be stored as a tuned one
            bench_fn()
            return False
        entry = repr(tuning_key)
        by_name = {str(c): c for c in configs}
        stored = self._load().get(entry)
        if stored in by_name:
            self.cache[tuning_key] = by_name[stored]
            self.configs_timings = {}
            return True
        bench_fn()
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            db = self._load()  # re-read: another process may have added keys meanwhile
            db[entry] = str(self.cache[tuning_key])
            fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(db, f, indent=1, sort_keys=True)
            os.replace(tmp, self.cache_file)
        except OSError:
            pass  # a read-only home still works, it just retunes next time
        return False


def autotune(configs: List[triton.Config], key: List[str], prune: Optional[Callable] = None,
             heuristic: Optional[triton.Config] = None):
    """Decorator like ``triton.autotune``; with FUSELAB_AUTOTUNE=0 nothing is timed and ``heuristic``
    (put first) is used wherever ``prune`` keeps it."""
    tune = AUTOTUNE or heuristic is None
    if not tune:
        configs = [heuristic] + [c for c in configs if c is not heuristic]

    def decorate(fn):
        return PersistentAutotuner(fn, configs, key, prune, tune=tune)

    return decorate


def bucket(n):
    """Round a size up to a power of two so a new batch size reuses the tuned config."""
    if isinstance(n, int):
        return 1 << max(n - 1, 0).bit_length()
    return n  # symbolic under torch.compile: inductor keeps its own tuning per graph
