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
SHARES = [["gemm-fwd", "gemm-tma", "gemm-variants", "rowwise", "sparse-adamw", "distill"], ["quant"]]


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), FUSELAB_EAGER_CPP="0")
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *share], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for share in SHARES]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for share, proc, out in zip(SHARES, procs, outputs):
        assert proc.returncode == 0 and "compiled" in out, f"{share}:\n{out[-4000:]}"


def _returns_inside_if(source: str):
    """(function, line) of each ``return`` nested in an ``if`` of a ``@triton.jit`` function."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
            found += [(fn.name, r.lineno) for branch in ast.walk(fn) if isinstance(branch, ast.If)
                      for r in ast.walk(branch) if isinstance(r, ast.Return)]
    return found


def test_no_jit_function_returns_from_inside_an_if():
    # The GPU's triton (3.6) compiles the statements after such a return too (an int8 dot then met
    # the fp8 branch's accumulator type); this machine's triton, and its interpreter, do not.
    broken = "@triton.jit\ndef f(x, A: tl.constexpr):\n    if A:\n        return x\n    return -x\n"
    assert _returns_inside_if(broken) == [("f", 4)]
    offenders = [(str(path.relative_to(ROOT)), *hit) for path in sorted((ROOT / "fuselab").rglob("*.py"))
                 for hit in _returns_inside_if(path.read_text())]
    assert not offenders, offenders
