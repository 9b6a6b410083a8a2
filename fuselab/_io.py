"""Small pieces fuselab's command lines, caches and result files share (and the experiments reuse)."""
import argparse
import contextlib
import json
import os
import tempfile
from pathlib import Path


def write_json_atomic(path: Path, data, **dump_kwargs) -> Path:
    """``data`` as JSON at ``path``, written under a temporary name and renamed when whole: a crash
    or a concurrent writer never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp's 0600 would make a shipped or shared file unreadable to others
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, **dump_kwargs)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock (``flock``) on ``path``'s ``.lock`` file for the block: processes that read, merge and
    rewrite one file in turn do not lose each other's additions. Where no lock can be had (another user's lock
    file, a filesystem without flock) the block runs unlocked, as before locks: a lost addition is retimed."""
    import fcntl  # POSIX only: imported where it is used

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write
    except OSError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks here
                os.close(fd)
                fd = None
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def _file_mode(path: Path) -> int:
    """The mode a rewrite of ``path`` keeps: its own, or for a new file what open() would give (0666 less the umask)."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0o022)  # read it back: there is no other way to ask
        os.umask(umask)
        return 0o666 & ~umask


def _number(text: str, kind, lowest, inclusive: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (value >= lowest if inclusive else value > lowest):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lowest}, got {text}")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else a usage error that names the value."""
    return _number(text, int, 1, True, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0, else a usage error that names the value."""
    return _number(text, int, 0, True, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0, else a usage error that names the value."""
    return _number(text, float, 0, False, "a positive number")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0, else a usage error that names the value."""
    return _number(text, float, 0, True, "a number >= 0")
