"""One first call, in the fresh process ``checks.first_call`` starts: ``python -m fuselab.tune.first_call SPEC``.

SPEC is JSON: kernel, M, N, K, dtype, layout, op and configs_dir (the shipped files' folder, or null for
the package's). Prints one JSON line: the seconds from the call to the GPU finishing it (inputs made and
CUDA initialized before), the tuning messages the call logged, and the configs its tuner chose.
"""
import json
import logging
import sys
import time
from pathlib import Path


def main(argv=None) -> None:
    spec = json.loads((argv or sys.argv[1:])[0])
    import torch

    from fuselab.kernels import _autotune
    from fuselab.tune.grid import Problem
    from fuselab.tune.kernels import KERNELS, device

    if spec.get("configs_dir"):
        _autotune.SHIPPED_CONFIGS_DIR = Path(spec["configs_dir"])
    tunings = []

    class Count(logging.Handler):
        def emit(self, record):
            tunings.append(record.getMessage())

    logging.getLogger("fuselab.autotune").addHandler(Count())
    entry = KERNELS[spec["kernel"]]
    problem = Problem(spec["kernel"], spec["M"], spec["N"], spec["K"], spec["dtype"], spec["layout"], (spec["op"],))
    dev = device()  # the GPU; the CPU under the Triton interpreter (--dry-run: the machinery only)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    if dev == "cuda":  # Triton's driver helpers are built once per Triton cache, not per kernel: before the clock
        from triton.runtime import driver

        getattr(driver.active, "utils", None)

    with entry.context(problem):
        inputs = entry.inputs(problem, dev, torch.randn, requires_grad=spec["op"] == "bwd")
        sync()
        t0 = time.perf_counter()
        entry.call(spec["op"], inputs)
        sync()
        seconds = time.perf_counter() - t0
    tuner = entry.tuner()
    configs = sorted({str(c) for c in tuner.cache.values()})
    print(json.dumps({"seconds": seconds, "tunings": tunings, "configs": configs}))


if __name__ == "__main__":
    main()
