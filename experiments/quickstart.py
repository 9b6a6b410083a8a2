"""fuselab's main job (`make demo`), in stages:

1. the fused matmul-ReLU against PyTorch and float64: on a CPU the Triton kernels run once
   through the interpreter on a small case (timings need a GPU); on a GPU the op is also timed
   against ``torch.relu(a @ b)`` and cuBLASLt's fused epilogue;
2. an MLP on Fashion-MNIST trained stock and patched with ``fuse_linear_relu``
   (``experiments/train_mlp.py``; on a CPU without the interpreter, where fuselab uses PyTorch).
Prints a summary table per stage and writes JSON under ``results/``.
"""
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.kernels import matmul_relu  # noqa: E402
from fuselab.report import markdown_table, save_json  # noqa: E402


def check(device: str, dtype: torch.dtype, M: int, N: int, K: int) -> dict:
    """Forward and gradients of fuselab vs PyTorch, both against a float64 reference."""
    a = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(K, N, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(N, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    ref_in = [t.detach().double().requires_grad_(True) for t in (a, b, bias)]
    ref = torch.relu(ref_in[0] @ ref_in[1] + ref_in[2])
    ref.backward(dy.double())

    def rel_err(outs, grads):
        return max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(outs, [ref.detach()] + [t.grad for t in ref_in]))

    y = matmul_relu(a, b, bias)
    y.backward(dy)
    fuselab_err = rel_err([y.detach(), a.grad, b.grad, bias.grad], None)
    for t in (a, b, bias):
        t.grad = None
    y_t = torch.relu(a @ b + bias)
    y_t.backward(dy)
    torch_err = rel_err([y_t.detach(), a.grad, b.grad, bias.grad], None)
    return {"device": device, "dtype": str(dtype).replace("torch.", ""), "shape (MxNxK)": f"{M}x{N}x{K}",
            "fuselab rel. err": fuselab_err, "torch rel. err": torch_err}


def time_gpu(dtype: torch.dtype, M: int, N: int, K: int) -> dict:
    import triton

    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    row = {}
    for name, fn in {"fuselab TFLOP/s": lambda: matmul_relu(a, b, bias),
                     "relu(addmm) TFLOP/s": lambda: torch.relu(torch.addmm(bias, a, b)),
                     "cuBLASLt epilogue TFLOP/s": lambda: torch._addmm_activation(bias, a, b)}.items():
        fn()
        row[name] = 2.0 * M * N * K / triton.testing.do_bench(fn, return_mode="median") * 1e-9
    return row


def main():
    on_gpu = torch.cuda.is_available()
    rows = []
    if on_gpu:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            row = check("cuda", dtype, 1031, 777, 515)
            if dtype != torch.float32:
                row.update(time_gpu(dtype, 8192, 8192, 1024))
            rows.append(row)
    else:
        print("No CUDA device: running the Triton kernels once in the interpreter (slow; timings need a GPU).")
        for dtype in (torch.float32, torch.float16):  # the interpreter's bf16 dot is unreliable
            rows.append(check("cpu", dtype, 67, 45, 83))
    header = list(dict.fromkeys(k for r in rows for k in r))
    print(markdown_table(header, [[r.get(k, "") for k in header] for r in rows]))
    bad = [r for r in rows if r["fuselab rel. err"] > max(4 * r["torch rel. err"], 1e-6)]
    path = save_json("quickstart", rows)
    print(f"saved {path}")
    if bad:
        sys.exit(f"fuselab's error exceeds 4x PyTorch's on: {bad}")
    if not on_gpu:
        print("Timings need a GPU: run `make demo` (or experiments/bench_matmul_relu.py) on a CUDA machine.")
    print("\nStage 2: an MLP trained stock and with fuse_linear_relu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real speed on a CPU
    script = Path(__file__).resolve().parent / "train_mlp.py"
    subprocess.run([sys.executable, str(script), "--epochs", "3" if on_gpu else "2"], env=env, check=True)


if __name__ == "__main__":
    main()
