"""Benchmark results: environment metadata, JSON files under results/, README tables."""
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def environment() -> Dict[str, str]:
    """What a result row must carry: GPU, versions, git commit."""
    import triton

    commit = os.environ.get("FUSELAB_GIT_COMMIT")  # for copies without .git (a remote GPU machine)
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "git_commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def save_json(name: str, rows: List[dict], extra: dict = None, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **(extra or {}), "rows": rows}, indent=1))
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.2e}" if v and abs(v) < 0.01 else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def update_readme_section(name: str, text: str, readme: Path = ROOT / "README.md") -> None:
    """Replace what stands between ``<!-- results:name -->`` and ``<!-- /results:name -->``."""
    begin, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    content = readme.read_text()
    if begin not in content or end not in content:
        raise KeyError(f"README.md has no {begin} ... {end} section")
    head, rest = content.split(begin, 1)
    readme.write_text(head + begin + "\n" + text.strip() + "\n" + end + rest.split(end, 1)[1])
