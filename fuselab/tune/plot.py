"""Plots of a sweep's results file: ``python -m fuselab.tune --plot runs/tune-NVIDIA_H200.json``.

Per op (``fwd linear``, ``grad_a matmul``, ...), three figures, each a grid of heatmaps over the
problem's (M, N), one panel per (dtype, K):

    <op>-tflops.png   TFLOP/s of the best config
    <op>-ratio.png    the best config's speed relative to the op's baseline (cuBLASLt for the forward,
                      cuBLAS for a backward product): above 1 is faster
    <op>-tiles.png    the best config (BLOCK_M x BLOCK_N x BLOCK_K, stages, warps, TMA), colored by tile area

A cell whose tuning key was timed on another shape of its bucket shows that shape's choice in the tile
figure and is left blank in the other two. matplotlib is imported here only (an optional dependency).
"""
import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def _best(rows: List[dict]) -> Dict[str, dict]:
    best: Dict[str, dict] = {}
    for r in rows:
        if "config" in r and r["metric"] == "ms" and math.isfinite(r["p50"]) and r["p50"] > 0:
            if r["key"] not in best or r["p50"] < best[r["key"]]["p50"]:
                best[r["key"]] = r
    return best


def cells(data: dict, op: str) -> List[dict]:
    """One cell per (shape, dtype) of ``op``: M, N, K, dtype, TFLOP/s, ratio to the baseline, best config."""
    rows = data["rows"]
    best = _best(rows)
    base = data.get("baselines", {}).get(op)
    out = []
    for r in rows:
        if r["op"] != op or "config" in r or r["provider"] != base:
            continue
        m, n, k = (int(v) for v in r["shape"].split("x"))
        choice = best.get(r["key"])
        own = choice is not None and choice["shape"] == r["shape"] and choice["dtype"] == r["dtype"]
        out.append({"M": m, "N": n, "K": k, "dtype": r["dtype"],
                    "tflops": choice["flops"] / choice["p50"] * 1e-9 if own else float("nan"),
                    "ratio": r["p50"] / choice["p50"] if own else float("nan"),
                    "config": choice["provider"] if choice else "",
                    "area": math.log2(_area(choice["config"])) if choice else float("nan")})
    return out


def _area(config: str) -> int:
    fields = dict(re.findall(r"(BLOCK_[MN]): (\d+)", config))
    return int(fields.get("BLOCK_M", 1)) * int(fields.get("BLOCK_N", 1))


def _heatmaps(plt, cs: List[dict], value: str, text, title: str, path: Path, cmap: str, norm=None,
              colorbar: str = "") -> Path:
    dtypes = sorted({c["dtype"] for c in cs})
    ks = sorted({c["K"] for c in cs})
    fig, axes = plt.subplots(len(dtypes), len(ks), figsize=(3.6 * len(ks) + 1, 3.2 * len(dtypes) + 0.8),
                             squeeze=False, constrained_layout=True)
    finite = [c[value] for c in cs if math.isfinite(c[value])]
    vmin, vmax = (min(finite), max(finite)) if finite else (0, 1)
    image = None
    for i, dtype in enumerate(dtypes):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            panel = [c for c in cs if c["dtype"] == dtype and c["K"] == k]
            if not panel:  # the grid times this K in other dtypes only
                ax.axis("off")
                continue
            ms, ns = sorted({c["M"] for c in panel}), sorted({c["N"] for c in panel})
            grid = [[float("nan")] * len(ns) for _ in ms]
            for c in panel:
                grid[ms.index(c["M"])][ns.index(c["N"])] = c[value]
                ax.text(ns.index(c["N"]), ms.index(c["M"]), text(c), ha="center", va="center", fontsize=7)
            kw = {"norm": norm} if norm is not None else {"vmin": vmin, "vmax": vmax}
            image = ax.imshow(grid, cmap=cmap, origin="lower", aspect="auto", **kw)
            ax.set_xticks(range(len(ns)), [str(n) for n in ns], fontsize=7)
            ax.set_yticks(range(len(ms)), [str(m) for m in ms], fontsize=7)
            ax.set_xlabel("N")
            ax.set_ylabel("M")
            ax.set_title(f"{dtype}, K={k}", fontsize=9)
    if image is not None and colorbar:
        fig.colorbar(image, ax=axes, shrink=0.8, label=colorbar)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(results_path: Path, out_dir: Path, ops: Optional[Sequence[str]] = None) -> List[Path]:
    """Write the module docstring's figures for ``ops`` (default: every op in the file) into ``out_dir``;
    ValueError if ``results_path`` is not a sweep's results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    try:
        data = json.loads(Path(results_path).read_text())
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    study = data.get("study") if isinstance(data, dict) else None
    if study != "tune" or not isinstance(data.get("rows"), list):
        what = f"study {study!r}" if study else "not a results file"
        raise ValueError(f"plots a sweep's results (study 'tune'), this is {what}")
    gpu = next(iter(data.get("runs", {}).values()), {}).get("gpu", "")
    ops = list(ops) if ops else sorted({r["op"] for r in data["rows"] if r["op"] in data.get("baselines", {})})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for op in ops:
        cs = cells(data, op)
        if not cs:
            continue
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", op)
        base = data["baselines"][op]
        written.append(_heatmaps(plt, cs, "tflops", lambda c: "" if math.isnan(c["tflops"]) else f"{c['tflops']:.0f}",
                                 f"{op}: TFLOP/s of the best config ({gpu})", out_dir / f"{stem}-tflops.png",
                                 "viridis", colorbar="TFLOP/s"))
        ratios = [c["ratio"] for c in cs if math.isfinite(c["ratio"])]
        spread = max([abs(math.log(r)) for r in ratios if r > 0] + [0.05])
        norm = TwoSlopeNorm(vcenter=1.0, vmin=math.exp(-spread), vmax=math.exp(spread))
        written.append(_heatmaps(plt, cs, "ratio", lambda c: "" if math.isnan(c["ratio"]) else f"{c['ratio']:.2f}",
                                 f"{op}: best config's speed / {base}'s ({gpu})", out_dir / f"{stem}-ratio.png",
                                 "RdBu", norm=norm, colorbar=f"x {base} (above 1: faster)"))
        written.append(_heatmaps(plt, cs, "area", lambda c: c["config"].replace(" ", "\n", 1),
                                 f"{op}: best config ({gpu})", out_dir / f"{stem}-tiles.png", "Pastel1",
                                 colorbar="log2(BLOCK_M x BLOCK_N)"))
    return written
