"""Triton's compiler key kept on disk (fuselab.kernels._triton_key): reused only while every file of the
package is unchanged, recomputed otherwise, never an error."""
import json
import os

import pytest

from fuselab.kernels import _triton_key


class Compute:
    """A stand-in for Triton's ``triton_key``: counts its calls, returns a new key each time."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return f"key-{self.calls}"


@pytest.fixture
def package(tmp_path):
    root = tmp_path / "triton"
    (root / "_C").mkdir(parents=True)
    (root / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    (root / "compiler.py").write_text("x = 1\n")
    (root / "__pycache__").mkdir()
    return root


def test_the_kept_key_serves_while_the_package_is_unchanged(package, tmp_path):
    compute, path = Compute(), tmp_path / "keys" / "k.json"
    assert _triton_key.kept_key(compute, str(package), "3.6.0", path) == "key-1"
    assert json.loads(path.read_text())["key"] == "key-1"
    (package / "__pycache__" / "compiler.cpython-311.pyc").write_bytes(b"cache")  # caches are not the package
    assert _triton_key.kept_key(compute, str(package), "3.6.0", path) == "key-1"
    assert compute.calls == 1


@pytest.mark.parametrize("change", ["content", "mtime", "copied in with its old times", "new file", "removed file",
                                    "version"])
def test_any_change_to_the_package_computes_the_key_again(package, tmp_path, change):
    compute, path = Compute(), tmp_path / "k.json"
    _triton_key.kept_key(compute, str(package), "3.6.0", path)
    lib, version = package / "_C" / "libtriton.so", "3.6.0"
    if change == "content":
        lib.write_bytes(b"\1" * 65)
    elif change == "mtime":  # same size, rebuilt: only the time tells
        st = lib.stat()
        os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    elif change == "copied in with its old times":  # cp -p / rsync -a of an equal-length edit: ctime tells
        st = lib.stat()
        replacement = package / "replacement"
        replacement.write_bytes(b"\2" * 64)
        os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(replacement, lib)
    elif change == "new file":
        (package / "_C" / "libproton.so").write_bytes(b"p")
    elif change == "removed file":
        (package / "compiler.py").unlink()
    else:
        version = "3.6.1"
    assert _triton_key.kept_key(compute, str(package), version, path) == "key-2"
    assert _triton_key.kept_key(compute, str(package), version, path) == "key-2"  # and kept again
    assert compute.calls == 2


def test_files_behind_a_linked_folder_are_stamped(package, tmp_path):
    # A development install links its backends into the package; Triton's walk follows the link.
    outside = tmp_path / "third_party" / "nvidia"
    outside.mkdir(parents=True)
    (outside / "compiler.py").write_text("a = 1\n")
    (package / "backends").mkdir()
    (package / "backends" / "nvidia").symlink_to(outside, target_is_directory=True)
    (package / "backends" / "loop").symlink_to(package, target_is_directory=True)  # walked once, not forever
    compute, path = Compute(), tmp_path / "k.json"
    _triton_key.kept_key(compute, str(package), "3.6.0", path)
    (outside / "compiler.py").write_text("a = 22\n")
    assert _triton_key.kept_key(compute, str(package), "3.6.0", path) == "key-2"


@pytest.mark.parametrize("text", ["not json", "[" * 100_000, "[1, 2]", '{"stamp": 1}', '{"stamp": "s", "version": "v", "key": 3}'])
def test_a_corrupt_file_is_computed_over(package, tmp_path, text):
    compute, path = Compute(), tmp_path / "k.json"
    path.write_text(text)
    assert _triton_key.kept_key(compute, str(package), "3.6.0", path) == "key-1"
    assert json.loads(path.read_text())["key"] == "key-1"


def test_the_kept_file_is_whole_and_as_readable_as_any_new_file(package, tmp_path):
    (package / "dangling").symlink_to(tmp_path / "nowhere")  # stamped as a link, not an error
    path = tmp_path / "keys" / "k.json"
    _triton_key.kept_key(Compute(), str(package), "3.6.0", path)
    plain = tmp_path / "keys" / "plain"
    plain.write_text("")
    assert sorted(p.name for p in path.parent.iterdir()) == ["k.json", "plain"]  # no temporary file left
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_an_unwritable_cache_still_gives_the_key(package, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    compute = Compute()
    for _ in range(2):
        assert _triton_key.kept_key(compute, str(package), "3.6.0", blocker / "k.json") == f"key-{compute.calls}"
    assert compute.calls == 2


def test_installed_triton_compiles_with_its_own_key(env, tmp_path, monkeypatch):
    import triton.runtime.cache as cache

    from fuselab import settings

    original = getattr(cache.triton_key, "triton_own", cache.triton_key)  # installed at import (compiled Triton)
    monkeypatch.setattr(cache, "triton_key", original)
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    _triton_key.install()
    installed = cache.triton_key
    assert installed.triton_own is original
    _triton_key.install()
    assert cache.triton_key is installed  # once
    assert installed() == original()
    kept = list((tmp_path / "cache" / "triton-key").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["key"] == original()


def test_every_file_triton_hashes_is_stamped(monkeypatch):
    # The stamp must cover what Triton's own key reads, or a change there would leave the kept key stale.
    import builtins

    import triton
    import triton.runtime.cache as cache

    own = getattr(cache.triton_key, "triton_own", cache.triton_key)
    opened, real_open = [], builtins.open

    def recording_open(file, *args, **kwargs):
        opened.append(os.path.abspath(os.fspath(file)))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    own.__wrapped__()  # the uncached computation
    monkeypatch.undo()
    package_dir = os.path.dirname(os.path.abspath(triton.__file__))
    stamped = {os.path.abspath(p) for p in _triton_key.package_files(package_dir)}
    assert len(opened) > 3 and not [p for p in opened if p not in stamped]


def test_an_error_in_keeping_the_key_falls_back_to_tritons_own(env, tmp_path, monkeypatch):
    import triton.runtime.cache as cache

    from fuselab import settings

    own = getattr(cache.triton_key, "triton_own", cache.triton_key)
    monkeypatch.setattr(cache, "triton_key", own)
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()

    def broken(*args):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(_triton_key, "kept_key", broken)
    _triton_key.install()
    assert cache.triton_key() == own()


@pytest.mark.parametrize("keep", ["0", "1", "maybe"])
def test_fuselab_keeps_the_key_unless_told_not_to(env, tmp_path, monkeypatch, keep):
    import triton.runtime.cache as cache

    from fuselab import settings

    own = getattr(cache.triton_key, "triton_own", cache.triton_key)
    monkeypatch.setattr(cache, "triton_key", own)
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "cache"))
    env.setenv("FUSELAB_KEEP_TRITON_KEY", "1")
    settings.reload()
    _triton_key.install()
    env.setenv("FUSELAB_KEEP_TRITON_KEY", keep)  # after the install: read at the first compile
    settings.reload()
    if keep == "maybe":
        with pytest.raises(ValueError, match="FUSELAB_KEEP_TRITON_KEY"):
            cache.triton_key()
        return
    assert cache.triton_key() == own()
    assert (tmp_path / "cache" / "triton-key").exists() == (keep == "1")
