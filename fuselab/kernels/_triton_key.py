"""Triton's compiler key, kept on disk between processes.

Before its first compile in a process, even one its cache answers, Triton hashes its own files
(``triton.runtime.cache.triton_key``): about half a second, most of it reading a 500 MB
``libtriton.so``. A fresh process's first fuselab call would pay it with every kernel already compiled.

The key is a function of those files' contents, so fuselab keeps it in
``$FUSELAB_CACHE_DIR/triton-key/<install>.json`` beside a stamp of every file in the Triton
package, symbolic links followed as Triton's own walk follows them (a development install links its
backends in): path, size, modification and change times, inode. While the stamp holds, the kept key
is used; any change to the package (an upgrade, a rebuild, a file copied in, even with its old
modification time: its change time is new) computes the key again with Triton's own function and
rewrites the file. A missing, corrupt or unwritable file, or any error at all here, costs that
computation and nothing else: Triton's own function answers. ``FUSELAB_KEEP_TRITON_KEY=0`` leaves the
key to Triton (read at the first compile; a value that is not a flag raises, naming the variable).
"""
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator

from fuselab import settings
from fuselab._io import write_json_atomic


def package_files(package_dir: str) -> Iterator[str]:
    """Every file under ``package_dir`` (caches excluded), symbolic links to folders followed once each."""
    seen = set()
    for root, dirs, files in os.walk(package_dir, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back up the tree: walked already
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        yield from (os.path.join(root, name) for name in sorted(files))


def package_stamp(package_dir: str) -> str:
    """A hash of every file of ``package_files``: relative path, size, mtime, ctime and inode (stat follows links)."""
    digest = hashlib.sha256()
    for path in package_files(package_dir):
        try:
            st = os.stat(path)
        except FileNotFoundError:  # a dangling link: nothing Triton reads, but its own presence is stamped
            st = os.lstat(path)
        digest.update(f"{os.path.relpath(path, package_dir)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
                      f"\0{st.st_ino}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def kept_key(compute: Callable[[], str], package_dir: str, version: str, path: Path) -> str:
    """``compute()``, or the key ``path`` holds for the same package stamp and version (then
    ``compute`` is not called); a new key is written to ``path`` when it can be."""
    stamp = package_stamp(package_dir)
    try:
        kept = json.loads(path.read_text())
        if kept["stamp"] == stamp and kept["version"] == version and isinstance(kept["key"], str):
            return kept["key"]
    except Exception:  # missing, unreadable or not what this module writes: compute it
        pass
    key = compute()
    try:
        write_json_atomic(path, {"version": version, "stamp": stamp, "key": key})
    except Exception:
        pass
    return key


def install() -> None:
    """Make Triton's compiler read its key through ``kept_key`` in this process (once; idempotent), unless
    ``FUSELAB_KEEP_TRITON_KEY=0`` when it is first read (then Triton's own function answers)."""
    import triton
    import triton.runtime.cache as cache

    compute = cache.triton_key
    if hasattr(compute, "triton_own"):
        return
    package_dir = os.path.dirname(os.path.abspath(triton.__file__))
    install_id = hashlib.sha256(os.fsencode(package_dir)).hexdigest()[:16]  # one file per Triton install

    @functools.lru_cache(maxsize=None)
    def triton_key() -> str:
        if not settings.KEEP_TRITON_KEY.get():  # a bad value raises, naming the variable, as every knob does
            return compute()
        try:
            path = settings.CACHE_DIR.get() / "triton-key" / f"{install_id}.json"
            return kept_key(compute, package_dir, triton.__version__, path)
        except Exception:  # every Triton compile in the process reads this: never fail where Triton would not
            return compute()

    triton_key.triton_own = compute
    cache.triton_key = triton_key  # get_cache_key reads this module global at each compile
