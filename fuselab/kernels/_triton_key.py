"""Triton's compiler key, kept on disk between processes.

Before its first compile in a process, even one its cache answers, Triton hashes its own files
(``triton.runtime.cache.triton_key``): about half a second, most of it reading a 500 MB
``libtriton.so``. A fresh process's first fuselab call would pay it with every kernel already compiled.

The key is a function of those files' contents, so fuselab keeps it in
``$FUSELAB_CACHE_DIR/triton-key/<install>.json`` beside a stamp of every file in the Triton
package (relative path, size, modification time), as Python's ``.pyc`` files are checked against
their sources. While the stamp holds, the kept key is used; any change to the package (an upgrade, a
rebuild) computes the key again with Triton's own function and rewrites the file. A missing,
corrupt or unwritable file costs that computation and nothing else.
"""
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from fuselab import settings


def package_stamp(package_dir: str) -> str:
    """A hash of every file under ``package_dir`` (caches excluded): relative path, size, mtime."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(root, name)
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, package_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def kept_key(compute: Callable[[], str], package_dir: str, version: str, path: Path) -> str:
    """``compute()``, or the key ``path`` holds for the same package stamp and version (then
    ``compute`` is not called); a new key is written to ``path`` when it can be."""
    stamp = package_stamp(package_dir)
    try:
        kept = json.loads(path.read_text())
        if kept["stamp"] == stamp and kept["version"] == version and isinstance(kept["key"], str):
            return kept["key"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    key = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: readers never see half
        tmp.write_text(json.dumps({"version": version, "stamp": stamp, "key": key}))
        os.replace(tmp, path)
    except OSError:
        pass
    return key


def install() -> None:
    """Make Triton's compiler read its key through ``kept_key`` in this process (once; idempotent)."""
    import triton
    import triton.runtime.cache as cache

    compute = cache.triton_key
    if hasattr(compute, "triton_own"):
        return
    package_dir = os.path.dirname(os.path.abspath(triton.__file__))
    install_id = hashlib.sha256(package_dir.encode()).hexdigest()[:16]  # one file per Triton install

    @functools.lru_cache(maxsize=None)
    def triton_key() -> str:
        try:
            path = settings.CACHE_DIR.get() / "triton-key" / f"{install_id}.json"
            return kept_key(compute, package_dir, triton.__version__, path)
        except OSError:  # the package itself cannot be walked: Triton's own hash
            return compute()

    triton_key.triton_own = compute
    cache.triton_key = triton_key  # get_cache_key reads this module global at each compile
