"""Measurements as data: fuselab's long-format results file (``fuselab-results/1``).

One row per measurement, ``{study, op, provider, shape, dtype, mode, metric, p20, p50, p80, run}``
plus extra keys; ``runs`` holds each run's environment (GPU, driver, versions, commit, a ``dirty``
flag, date), ``baselines`` each op's baseline provider, ``failed`` what could not be measured.
Ratios between providers are computed when reporting, never stored. Written by the experiments
(through ``experiments/harness.py``) and by ``python -m fuselab.tune``; rendered by
``experiments/report.py``.
"""
import json
import math
import os
import platform
import subprocess
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from fuselab._io import write_json_atomic

FORMAT = "fuselab-results/1"
QUANTILES = (0.2, 0.5, 0.8)
REPO = Path(__file__).resolve().parent.parent  # a checkout's root, where git reads the commit


@dataclass(frozen=True)
class Timing:
    """Quantiles of one measurement's samples (milliseconds for times)."""
    p20: float
    p50: float
    p80: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Timing":
        s = sorted(samples)
        pick = [s[min(len(s) - 1, int(q * len(s)))] for q in QUANTILES]
        return cls(*pick)

    @classmethod
    def exact(cls, value: float) -> "Timing":
        """A measurement with no spread (a count, an accuracy, a peak)."""
        return cls(value, value, value)

    def converted(self, factor: float) -> "Timing":
        """The same quantiles in another unit (``factor`` 1e3: milliseconds -> microseconds)."""
        return Timing(self.p20 * factor, self.p50 * factor, self.p80 * factor)

    def scaled(self, work: float) -> "Timing":
        """``work / time`` (a rate), quantiles swapped so that p20 stays the lower value."""
        return Timing(work / self.p80, work / self.p50, work / self.p20)


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(commit: Optional[str] = None, dirty: Optional[bool] = None,
                device: Optional[str] = None) -> Dict[str, object]:
    """Where a measurement was made. A copy without .git (a lent GPU machine) passes the commit as
    ``commit``/``dirty``, or in FUSELAB_GIT_COMMIT and FUSELAB_GIT_DIRTY. ``device``: the type of
    device the run measures on ("cpu" for a ``--device cpu`` run on a GPU host); default: the GPU if
    there is one (the interpreter's runs are "cpu")."""
    import triton

    commit = commit or os.environ.get("FUSELAB_GIT_COMMIT") or _git("rev-parse", "--short=12", "HEAD") or "unknown"
    commit = commit[:12]  # a full sha given by hand, shortened as git's own
    dirty_env = os.environ.get("FUSELAB_GIT_DIRTY")
    if dirty is not None:
        pass
    elif dirty_env is not None:
        dirty = dirty_env not in ("0", "", "false")
    else:
        # untracked files too (a new configs file the tuner reads, say); not the measurements and the pages made
        # from them, which an earlier run of the same session may have just written
        status = _git("status", "--porcelain", "--", ".", ":(exclude)results", ":(exclude)docs/results")
        dirty = bool(status) if status is not None else None
    from fuselab.kernels._runtime import INTERPRET, device_name

    cuda = torch.cuda.is_available()
    measured = device or ("cuda" if cuda and not INTERPRET else "cpu")
    # the name the tuner keys its choices by (device_name: the interpreter's under TRITON_INTERPRET=1,
    # kernels then ran there, even on a GPU machine; else the GPU's); a CPU run on a GPU host names the CPU
    name = (device_name() if (measured == "cuda" and cuda) or INTERPRET
            else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    driver = None
    if cuda:
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = None
    return {
        "gpu": name,
        "device": measured,
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


ROW_KEYS = ("study", "op", "provider", "shape", "dtype", "mode", "metric", "p20", "p50", "p80")
FAILURE_KEYS = ("op", "provider", "shape", "dtype", "mode")  # what a failure is keyed by (no metric)
CURVE_KEYS = ("step", "epoch")  # extra keys that place a row on a training run's curve
# what a run's device cannot change: a merge lets a run on another device replace these rows
DEVICE_FREE_METRICS = frozenset({"MB", "rows touched", "max lookups of one row"})


def measured_device(env: dict) -> str:
    """The type of device a run measured on ("cuda", "cpu"); runs recorded before the ``device`` entry
    existed are read from their ``gpu`` entry (a CPU's, the interpreter's or a GPU's name)."""
    if env.get("device"):
        return str(env["device"])
    name = str(env.get("gpu", ""))
    return "cpu" if name.lower().startswith("cpu") or name == "triton-interpreter" else "cuda"


class NotResults(ValueError):
    """A JSON file of another format than fuselab's results (not a damaged results file)."""


def _row_problem(row, runs: dict) -> Optional[str]:
    """What makes ``row`` unreadable as a measurement of one of ``runs`` (None: nothing)."""
    if not isinstance(row, dict):
        return f"is not an object: {row!r:.80}"
    missing = [k for k in (*ROW_KEYS, "run") if k not in row]
    if missing:
        return f"lacks {missing}"
    if row["run"] not in runs:
        return f"names run {row['run']!r}, which the file does not describe"
    bad = [k for k in ("p20", "p50", "p80") if isinstance(row[k], bool) or not isinstance(row[k], (int, float))
           or not math.isfinite(row[k])]
    if bad:
        return f"has non-numeric or non-finite {bad}"
    if not row["p20"] <= row["p50"] <= row["p80"]:
        return f"has quantiles out of order (p20 {row['p20']}, p50 {row['p50']}, p80 {row['p80']})"
    if not isinstance(runs[row["run"]], dict):
        return f"names run {row['run']!r}, whose description is not an object"
    return None


class Results:
    """Long-format measurements of one study, with the environment of each run that made them.

    ``failed`` lists what could not be measured (an out-of-memory, a compiler error, a CUDA graph
    that would not capture): ``{op, provider, shape, dtype, mode, error, run}``, written beside the
    rows, rendered under the study's tables."""

    def __init__(self, study: str, runs: Optional[Dict[str, dict]] = None, rows: Optional[List[dict]] = None,
                 baselines: Optional[Dict[str, str]] = None, failed: Optional[List[dict]] = None,
                 device: Optional[object] = None):
        """``device``: what this process's run measures on (a torch.device or its type; default: see
        ``environment``); a merge keeps rows measured on another device beside this run's."""
        self.study = study
        self.device = None if device is None else torch.device(device).type
        self.runs: Dict[str, dict] = runs or {}
        self.rows: List[dict] = rows or []
        self.baselines: Dict[str, str] = baselines or {}  # op -> the provider ratios are taken against
        self.failed: List[dict] = failed or []
        self.run_id = None

    def set_baseline(self, op: str, providers_or_name) -> None:
        """Name ``op``'s baseline provider (a name, or a ``Providers`` registry's baseline)."""
        name = getattr(providers_or_name, "baseline", providers_or_name)
        if not isinstance(name, str):
            raise ValueError(f"no baseline provider for {op!r}")
        self.baselines[op] = name

    def start_run(self, env: Optional[Dict[str, object]] = None) -> str:
        """Begin this process's run with ``env`` (default: ``environment()``); rows record its id."""
        self.run_id = uuid.uuid4().hex[:8]
        self.runs[self.run_id] = environment(device=self.device) if env is None else env
        return self.run_id

    def _current_run(self) -> str:
        return self.run_id if self.run_id is not None else self.start_run()

    def annotate(self, **info) -> None:
        """Add keys to this run's environment entry (a data path, a flag the whole run shares)."""
        self.runs[self._current_run()].update(info)

    def fail(self, *, op: str, provider: str, shape: str, dtype: str, mode: str, error, **extra) -> dict:
        """Record that a measurement could not be made; ``error`` an exception or a message."""
        if isinstance(error, BaseException):  # the first line of the message: enough to recognise it
            first = (str(error).strip().splitlines() or [""])[0]
            error = f"{type(error).__name__}: {first[:300]}"
        entry = {"op": op, "provider": provider, "shape": str(shape), "dtype": dtype, "mode": mode,
                 "error": str(error), "run": self._current_run(), **extra}
        self.failed.append(entry)
        return entry

    def record(self, *, op: str, provider: str, shape: str, dtype: str, mode: str, metric: str,
               value, **extra) -> dict:
        """One measurement: ``value`` is a Timing, a (p20, p50, p80) triple or a number (no spread).
        ``extra`` keys (a model name, a step count) are kept beside the standard ones."""
        if isinstance(value, Timing):
            timing = value
        elif isinstance(value, (tuple, list)):
            timing = Timing(*value)
        else:
            timing = Timing.exact(float(value))
        clash = set(extra) & set(ROW_KEYS + ("run",))
        if clash:
            raise ValueError(f"extra keys {sorted(clash)} shadow standard row keys")
        row = {"study": self.study, "op": op, "provider": provider, "shape": str(shape), "dtype": dtype,
               "mode": mode, "metric": metric, **asdict(timing), "run": self._current_run(), **extra}
        self.rows.append(row)
        return row

    def record_time(self, *, flops: Optional[float] = None, nbytes: Optional[float] = None, **keys) -> None:
        """A ``time_call`` Timing as an ``ms`` row, plus TFLOP/s and GB/s rows when the work is given."""
        timing = keys.pop("value")
        self.record(metric="ms", value=timing, **keys)
        if flops:
            self.record(metric="TFLOP/s", value=timing.scaled(flops * 1e-9), **keys)
        if nbytes:
            self.record(metric="GB/s", value=timing.scaled(nbytes * 1e-6), **keys)

    def select(self, **where) -> List[dict]:
        """Rows whose keys equal every ``where`` value (a tuple/list/set value: any of them)."""
        def match(row):
            for k, v in where.items():
                if isinstance(v, (tuple, list, set, frozenset)):
                    if row.get(k) not in v:
                        return False
                elif row.get(k) != v:
                    return False
            return True

        return [r for r in self.rows if match(r)]

    def value(self, stat: str = "p50", **where) -> Optional[float]:
        """The single row matching ``where``'s ``stat``; None if none matches, an error if several do."""
        rows = self.select(**where)
        if len(rows) > 1:
            raise ValueError(f"{len(rows)} rows match {where}")
        return rows[0][stat] if rows else None

    def device_of(self, row: dict) -> str:
        """The type of device that measured ``row`` (or a failure entry)."""
        return measured_device(self.runs.get(row["run"], {}))

    def devices(self) -> List[str]:
        return list(dict.fromkeys(self.device_of(r) for r in self.rows))

    def on_device(self, device: str) -> "Results":
        """The rows (and failures) measured on ``device``, with their runs: one device's figures."""
        rows = [r for r in self.rows if self.device_of(r) == device]
        failed = [f for f in self.failed if self.device_of(f) == device]
        return Results(self.study, self.runs, rows, self.baselines, failed)

    def _labels(self, row: dict) -> tuple:
        """What a merge matches rows by: the labels, and the measuring device unless the metric cannot depend on it."""
        device = None if row["metric"] in DEVICE_FREE_METRICS else self.device_of(row)
        return (*(row.get(k) for k in ROW_KEYS[1:7]), device)

    def _training_run(self, row: dict) -> Optional[str]:
        """The training run (kept across its resumes: ``annotate(training_run=...)``) whose curve ``row`` is a point
        of; None for a row of no curve (no step or epoch) or a run that names none."""
        if all(row.get(k) is None for k in CURVE_KEYS):
            return None
        return self.runs.get(row["run"], {}).get("training_run")

    def _replaced_by(self, new: "Results"):
        """Whether a row of this file is replaced by ``new``'s rows in a merge: the same labels, unless both are
        points of one training run's curve (a resumed run's part beside the first part's) at other steps."""
        labels = {new._labels(r) for r in new.rows}
        points = {(new._labels(r), new._training_run(r), *(r.get(k) for k in CURVE_KEYS)) for r in new.rows}
        runs = {new._training_run(r) for r in new.rows} - {None}

        def replaced(row: dict) -> bool:
            if self._labels(row) not in labels:
                return False
            run = self._training_run(row)
            if run is None or run not in runs:  # another run's curve, or no curve: the new rows stand alone
                return True
            return (self._labels(row), run, *(row.get(k) for k in CURVE_KEYS)) in points

        return replaced

    def _failure_identity(self, entry: dict) -> tuple:
        return (*(entry.get(k) for k in FAILURE_KEYS), self.device_of(entry))

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
            raise NotResults(f"{path} is not a fuselab results file (format fuselab-results/1)")
        missing = [k for k in ("study", "runs", "rows") if k not in data]
        if missing or not isinstance(data["rows"], list) or not isinstance(data["runs"], dict):
            raise ValueError(f"{path}: a fuselab results file needs a study, a dict of runs and a list of rows")
        for i, row in enumerate(data["rows"]):
            problem = _row_problem(row, data["runs"])
            if problem is not None:
                raise ValueError(f"{path}: row {i} {problem}")
        baselines, failed = data.get("baselines") or {}, data.get("failed") or []
        if not isinstance(data["study"], str) or not isinstance(baselines, dict) or not all(
                isinstance(v, str) for v in baselines.values()):
            raise ValueError(f"{path}: the study must be a name and the baselines a mapping of op -> provider")
        for i, entry in enumerate(failed if isinstance(failed, list) else [None]):
            if not (isinstance(entry, dict) and entry.get("run") in data["runs"]
                    and all(k in entry for k in (*FAILURE_KEYS, "error"))):
                raise ValueError(f"{path}: failure {i} is not a failure of one of the file's runs: {entry!r:.80}")
        return cls(data["study"], data["runs"], data["rows"], data.get("baselines"), data.get("failed"))

    def save(self, path: Path, merge: bool = False) -> Path:
        """Write atomically (a crash leaves the old file whole); ``merge`` keeps the rows already
        there, replacing those this run measured again (same op, provider, shape, dtype, mode and metric, on
        the same type of device: a CPU run's rows go beside a GPU run's of the same labels; a resumed training
        run's curve goes beside its first part's, ``_replaced_by``)."""
        path = Path(path)
        out = self
        if merge and path.exists():
            old = Results.load(path)
            if old.study != self.study:
                raise ValueError(f"{path} holds study {old.study!r}, not {self.study!r}: not merged")
            replaced = old._replaced_by(self)
            # a configuration that fails now: its old rows go too (else the page showed the old figure beside the
            # failure, and ratios against this run's baseline)
            failing = {self._failure_identity(f) for f in self.failed}
            kept = [r for r in old.rows if not replaced(r) and old._failure_identity(r) not in failing]
            # an earlier failure stays listed until this run measures or fails that configuration again
            tried = {self._failure_identity(r) for r in self.rows + self.failed}
            kept_failed = [f for f in old.failed if old._failure_identity(f) not in tried]
            runs = {k: v for k, v in old.runs.items() if any(r["run"] == k for r in kept + kept_failed)}
            out = Results(self.study, {**runs, **self.runs}, kept + self.rows, {**old.baselines, **self.baselines},
                          kept_failed + self.failed)
        write_json_atomic(path, out.to_json())
        return path
