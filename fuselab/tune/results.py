"""The sweep's results as data: experiments/harness.py's long format, written by the library itself.

One row per measurement, ``{study, op, provider, shape, dtype, mode, metric, p20, p50, p80, run}``
plus extra keys, ``runs`` holding each run's environment, ``baselines`` each op's baseline provider and
``failed`` what could not be measured: the file ``experiments/report.py`` renders (``fuselab-results/1``).
The library does not import experiments/, so this is the format's writer on fuselab's side; saving is
atomic (a run cut short leaves the previous file whole).
"""
import json
import platform
import subprocess
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import triton

from fuselab._io import write_json_atomic

FORMAT = "fuselab-results/1"
ROW_KEYS = ("study", "op", "provider", "shape", "dtype", "mode", "metric", "p20", "p50", "p80", "run")
REPO = Path(__file__).resolve().parents[2]  # a checkout's root (git reads the commit there when it can)


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(commit: Optional[str] = None, dirty: Optional[bool] = None) -> Dict[str, object]:
    """Where the measurements are made; ``commit`` given (a copy without .git), else read from git."""
    from fuselab.kernels._runtime import device_name

    if commit is None:
        commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    return {"gpu": device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "commit": commit, "dirty": dirty,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


class Results:
    """Rows of one study, with this run's environment; see the module docstring."""

    def __init__(self, study: str, data: Optional[dict] = None):
        data = data or {}
        self.study = study
        self.runs: Dict[str, dict] = data.get("runs", {})
        self.rows: List[dict] = data.get("rows", [])
        self.baselines: Dict[str, str] = data.get("baselines", {})
        self.failed: List[dict] = data.get("failed", [])
        self.run_id: Optional[str] = None

    def start_run(self, env: Dict[str, object]) -> str:
        self.run_id = uuid.uuid4().hex[:8]
        self.runs[self.run_id] = env
        return self.run_id

    def record(self, *, op: str, provider: str, shape: str, dtype: str, mode: str, metric: str,
               value: Sequence[float], **extra) -> dict:
        """One measurement; ``value`` its (p20, p50, p80)."""
        p20, p50, p80 = value
        row = {"study": self.study, "op": op, "provider": provider, "shape": shape, "dtype": dtype, "mode": mode,
               "metric": metric, "p20": p20, "p50": p50, "p80": p80, "run": self.run_id, **extra}
        self.rows.append(row)
        return row

    def fail(self, *, op: str, provider: str, shape: str, dtype: str, mode: str, error, **extra) -> dict:
        """What could not be measured; ``error`` an exception (its first line is kept) or a message."""
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
        entry = {"op": op, "provider": provider, "shape": shape, "dtype": dtype, "mode": mode,
                 "error": str(error), "run": self.run_id, **extra}
        self.failed.append(entry)
        return entry

    def to_json(self) -> dict:
        out = {"study": self.study, "format": FORMAT, "baselines": self.baselines, "runs": self.runs,
               "rows": self.rows}
        if self.failed:
            out["failed"] = self.failed
        return out

    @classmethod
    def load(cls, path: Path) -> "Results":
        try:
            data = json.loads(Path(path).read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a fuselab results file (format {FORMAT})")
        return cls(data["study"], data)

    def save(self, path: Path) -> Path:
        path = Path(path)
        write_json_atomic(path, self.to_json())
        return path
