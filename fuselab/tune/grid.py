"""The sweep's grid: problems (kernel, M x N x K, dtype, layout, ops) from a built-in grid or a JSON file.

A grid is a list of blocks; each block is a cartesian product::

    {"kernel": "matmul_relu",                  # optional, the default
     "shapes": [[8192, 8192, 1024], ...],      # or "M": [...], "N": [...], "K": [...] (their product)
     "dtypes": ["bf16", "fp16"], "layouts": ["linear", "matmul"], "ops": ["fwd", "bwd"]}

A JSON grid file holds such a list. Shapes are timed as given (the tuning key rounds each size up to a
power of two, ``bucket``): one shape per tuning key is timed, the first in grid order, so a grid lists
the exact shapes that matter before the generic powers of two. Problems run grouped by (kernel, dtype,
layout), which share compiled kernels, in grid order within a group.
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

# experiments/bench_matmul_relu.py's shapes (M, N, K): the first-call target is measured on these.
BENCHMARK_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 1024), (8192, 8192, 256),
                    (16384, 4096, 512), (1024, 2048, 512), (64, 4096, 4096), (4096, 4096, 1024),
                    (4096, 11008, 4096)]
# experiments/bench_quant.py's GEMM shapes (M, N, K)
QUANT_BENCHMARK_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 2048), (16384, 2048, 8192),
                          (8192, 8192, 1024), (16, 8192, 2048), (3001, 4099, 1537)]
CORE = {"M": [1024, 4096, 8192, 16384], "N": [1024, 4096, 16384], "K": [1024, 4096]}
TINY_SHAPES = [(64, 48, 32), (20, 40, 24)]  # the interpreter's (--dry-run): seconds on a CPU

GRIDS: Dict[str, List[dict]] = {
    "default": [
        # the benchmark as it runs (b row-major): forward with and without bias, fwd+bwd on two shapes
        {"shapes": BENCHMARK_SHAPES, "dtypes": ["bf16", "fp16"], "layouts": ["matmul"], "ops": ["fwd", "fwd-nobias"]},
        {"shapes": [(4096, 4096, 4096), (8192, 8192, 1024), (1024, 2048, 512)], "dtypes": ["tf32"],
         "layouts": ["matmul"], "ops": ["fwd", "fwd-nobias"]},
        {"shapes": [(8192, 8192, 1024), (4096, 4096, 4096)], "dtypes": ["bf16", "fp16", "tf32"],
         "layouts": ["matmul"], "ops": ["bwd"]},
        # make demo (experiments/quickstart.py): its gradient check's odd sizes (no TMA: rows not 16-byte aligned)
        {"shapes": [(1031, 777, 515)], "dtypes": ["bf16", "fp16"], "layouts": ["matmul"], "ops": ["bwd"]},
        # the core: tokens x hidden sizes, nn.Linear's layout and the plain one, forward and backward
        {**CORE, "dtypes": ["bf16", "fp16"], "layouts": ["linear", "matmul"], "ops": ["fwd", "bwd"]},
        # the OPT decoders fuse_linear_relu patches (experiments/model_eager.py, bench_quant's bf16 prefill):
        # each size's fc1 (hidden -> 4 x hidden) at 128 tokens and at 8,192, forward and backward
        {"shapes": [(t, 4 * h, h) for h in (768, 1024, 2048) for t in (128, 8192)], "dtypes": ["bf16"],
         "layouts": ["linear"], "ops": ["fwd", "bwd"]},
        # the quantized GEMM: experiments/bench_quant.py's GEMM shapes, then an OPT-1.3b prefill of 8 x 1024
        # tokens as quantize_ leaves it (q/k/v/out, fc1, fc2 with bias; the lm_head without)
        {"kernel": "scaled_gemm", "shapes": QUANT_BENCHMARK_SHAPES + [(8192, 2048, 2048), (8192, 8192, 2048),
                                                                      (8192, 2048, 8192)],
         "dtypes": ["int8", "fp8"], "layouts": ["linear"], "ops": ["fwd"]},
        {"kernel": "scaled_gemm", "shapes": [(8192, 50272, 2048)], "dtypes": ["int8", "fp8"], "layouts": ["linear"],
         "ops": ["fwd-nobias"]},
        # the static fused prefill's fc1 (fuse_outputs: fc2's int8 input written in the epilogue)
        {"kernel": "scaled_gemm", "shapes": [(8192, 8192, 2048)], "dtypes": ["int8"], "layouts": ["linear"],
         "ops": ["fwd-quantout"]},
        # fp8 with fast accumulation (fp8_matmul(fast_accum=True)) at the benchmark's shapes
        {"kernel": "scaled_gemm", "shapes": QUANT_BENCHMARK_SHAPES, "dtypes": ["fp8"], "layouts": ["linear"],
         "ops": ["fwd-fastaccum"]},
    ],
    # a quick look on a GPU (a minute or two)
    "small": [{"shapes": [(4096, 4096, 1024), (8192, 8192, 1024)], "dtypes": ["bf16"], "layouts": ["linear"],
               "ops": ["fwd", "bwd"]}],
    # --dry-run: the Triton interpreter on a CPU, seconds
    "tiny": [{"shapes": TINY_SHAPES[:1], "dtypes": ["bf16"], "layouts": ["linear"], "ops": ["fwd", "bwd"]},
             {"shapes": TINY_SHAPES[1:], "dtypes": ["bf16"], "layouts": ["matmul"], "ops": ["fwd"]},
             {"kernel": "scaled_gemm", "shapes": TINY_SHAPES[:1], "dtypes": ["int8", "fp8"], "layouts": ["linear"],
              "ops": ["fwd"]}],
}

# Shapes for --check-heldout: in none of the grids, but in the default grid's buckets (multiples of 16, so
# they share its compiled kernels): what the shipped file is for, shapes it was not timed on.
HELDOUT_SHAPES = [(3072, 3072, 768), (6144, 12288, 3072), (14336, 768, 3584), (5120, 2816, 960),
                  (768, 11008, 3072), (12288, 3072, 2560)]


@dataclass(frozen=True)
class Problem:
    """One operation on one shape: what the sweep runs to find the launches it times."""
    kernel: str
    M: int
    N: int
    K: int
    dtype: str
    layout: str
    ops: Tuple[str, ...]

    @property
    def shape(self) -> str:
        return f"{self.M}x{self.N}x{self.K}"

    def __str__(self) -> str:
        return f"{self.kernel} {self.shape} {self.dtype} {self.layout} {'+'.join(self.ops)}"


class GridError(ValueError):
    """A grid that cannot be run; the message names the block and the value."""


BLOCK_KEYS = {"kernel", "shapes", "M", "N", "K", "dtypes", "layouts", "ops"}


def _sizes(block: dict, where: str) -> List[Tuple[int, int, int]]:
    if "shapes" in block:
        if any(k in block for k in "MNK"):
            raise GridError(f"{where}: give either shapes or M/N/K, not both")
        shapes = block["shapes"]
        if not isinstance(shapes, list) or not shapes:
            raise GridError(f"{where}: shapes must be a non-empty list of [M, N, K]")
        out = []
        for s in shapes:
            if not (isinstance(s, (list, tuple)) and len(s) == 3):
                raise GridError(f"{where}: a shape must be [M, N, K], got {s!r}")
            out.append(tuple(s))
    else:
        missing = [k for k in "MNK" if k not in block]
        if missing:
            raise GridError(f"{where}: no shapes and no {'/'.join(missing)}")
        for k in "MNK":
            if not isinstance(block[k], list) or not block[k]:
                raise GridError(f"{where}: {k} must be a non-empty list of sizes, got {block[k]!r}")
        out = [(m, n, k) for m in block["M"] for n in block["N"] for k in block["K"]]
    for shape in out:
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape):
            raise GridError(f"{where}: sizes must be integers >= 1, got {list(shape)}")
    return out


def _names(block: dict, key: str, known: Sequence[str], where: str) -> List[str]:
    values = block.get(key)
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise GridError(f"{where}: {key} must be a non-empty list of names out of {list(known)}, got {values!r}")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise GridError(f"{where}: unknown {key} {unknown}; known: {list(known)}")
    return values


def problems(blocks, kernels) -> List[Problem]:
    """The problems of a grid (a list of blocks), validated against ``kernels`` (name -> entry with
    ``dtypes``, ``layouts`` and ``ops``), duplicates dropped, grouped as the module docstring says."""
    if not isinstance(blocks, list) or not blocks:
        raise GridError("a grid is a non-empty list of blocks")
    out: List[Problem] = []
    for i, block in enumerate(blocks):
        where = f"grid block {i}"
        if not isinstance(block, dict):
            raise GridError(f"{where}: a block is an object with shapes, dtypes, layouts and ops, got {block!r}")
        extra = set(block) - BLOCK_KEYS
        if extra:
            raise GridError(f"{where}: unknown keys {sorted(extra)}; known: {sorted(BLOCK_KEYS)}")
        name = block.get("kernel", "matmul_relu")
        if not isinstance(name, str) or name not in kernels:
            raise GridError(f"{where}: unknown kernel {name!r}; known: {list(kernels)}")
        entry = kernels[name]
        shapes = _sizes(block, where)
        dtypes = _names(block, "dtypes", list(entry.dtypes), where)
        layouts = _names(block, "layouts", list(entry.layouts), where)
        ops = tuple(_names(block, "ops", list(entry.ops), where))
        for op in ops:  # an op of some dtypes only (scaled_gemm's fwd-quantout: int8)
            allowed = getattr(entry, "op_dtypes", {}).get(op)
            if allowed is not None and set(dtypes) - set(allowed):
                raise GridError(f"{where}: op {op} runs for dtypes {list(allowed)} only, got {dtypes}")
        out += [Problem(name, m, n, k, d, lay, ops) for d in dtypes for lay in layouts for m, n, k in shapes]
    out = list(dict.fromkeys(out))
    groups = list(dict.fromkeys((p.kernel, p.dtype, p.layout) for p in out))
    return sorted(out, key=lambda p: groups.index((p.kernel, p.dtype, p.layout)))  # stable: grid order within


def load(name_or_path: str, kernels) -> List[Problem]:
    """``default``, ``small``, ``tiny`` or a JSON grid file's problems; GridError says what is wrong."""
    if name_or_path in GRIDS:
        return problems(GRIDS[name_or_path], kernels)
    path = Path(name_or_path)
    if not path.is_file():
        raise GridError(f"--grid {name_or_path!r}: not a built-in grid ({', '.join(GRIDS)}) and no such file")
    try:
        blocks = json.loads(path.read_text())
    except ValueError as e:
        raise GridError(f"grid file {path} is not JSON: {e}") from None
    try:
        return problems(blocks, kernels)
    except GridError as e:
        raise GridError(f"grid file {path}: {e}") from None


def parse_shapes(text: str) -> List[Tuple[int, int, int]]:
    """``"4096x4096x1024,64x4096x4096"`` -> [(4096, 4096, 1024), (64, 4096, 4096)]; GridError if malformed."""
    shapes = []
    for part in (p.strip() for p in text.split(",")):
        dims = part.lower().split("x")
        try:
            shape = tuple(int(d) for d in dims)
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) < 1:
            raise GridError(f"a shape is MxNxK with three sizes >= 1 (e.g. 4096x4096x1024), got {part!r}")
        shapes.append(shape)
    return shapes
