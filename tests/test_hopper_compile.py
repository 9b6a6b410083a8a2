"""Every Triton kernel of fuselab compiles to an sm_90 cubin, on this machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler refuses (a
non-constexpr global did, once, and the GPU run found it). ``compile_for_hopper.py`` compiles the real
cubins of each kernel's recorded launches, every autotune config of the GEMMs included, in processes
without TRITON_INTERPRET: two at a time, one per core.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "compile_for_hopper.py"
# Two shares of about equal compile time.
SHARES = [["gemm-fwd", "gemm-tma", "gemm-variants", "rowwise", "sparse-adamw"], ["quant"]]


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), FUSELAB_EAGER_CPP="0")
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *share], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for share in SHARES]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for share, proc, out in zip(SHARES, procs, outputs):
        assert proc.returncode == 0 and "compiled" in out, f"{share}:\n{out[-4000:]}"
