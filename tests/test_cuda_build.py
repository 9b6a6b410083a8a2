"""The CUDA reference's checks that run before a build: a missing nvcc and CPU tensors are reported
by fuselab, and no build starts (builds themselves are in test_matmul_relu_cuda.py)."""
import importlib

import pytest
import torch

from fuselab.kernels import matmul_relu

cuda_module = importlib.import_module("fuselab.kernels.matmul_relu_cuda")


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if a build or a load of the extension starts."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("a build started"))
    monkeypatch.setattr(cuda_module, "load_extension", lambda *a, **k: pytest.fail("the extension was loaded"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)  # restored after the test
    for var in ("CUDA_HOME", "CUDA_PATH", "PYTORCH_NVCC"):
        monkeypatch.delenv(var, raising=False)


def _toolkit(root, with_nvcc: bool):
    (root / "bin").mkdir(parents=True)
    if with_nvcc:
        (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (root / "bin" / "nvcc").chmod(0o755)
    return root


def test_cuda_home_without_nvcc(no_build, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(_toolkit(tmp_path / "cuda", with_nvcc=False)))
    with pytest.raises(RuntimeError) as info:
        cuda_module.build_extension()
    message = str(info.value)
    assert "needs nvcc" in message and str(tmp_path / "cuda" / "bin" / "nvcc") in message and "CUDA_HOME=" in message


def test_no_nvcc_anywhere(no_build, monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_module, "DEFAULT_CUDA_HOME", tmp_path / "no-cuda")
    monkeypatch.setenv("PATH", str(_toolkit(tmp_path / "empty", with_nvcc=False) / "bin"))
    with pytest.raises(RuntimeError, match="needs nvcc.*none on PATH"):
        cuda_module.build_extension()


def test_toolkit_is_found(no_build, monkeypatch, tmp_path):
    # $CUDA_HOME first; without it the default location; without that, the nvcc on PATH.
    named, on_path = _toolkit(tmp_path / "named", True), _toolkit(tmp_path / "on-path", True)
    monkeypatch.setattr(cuda_module, "DEFAULT_CUDA_HOME", tmp_path / "no-cuda")
    monkeypatch.setenv("PATH", str(on_path / "bin"))
    assert cuda_module.cuda_toolkit() == on_path
    monkeypatch.setenv("CUDA_PATH", str(named))
    assert cuda_module.cuda_toolkit() == named


def test_cpu_tensors_rejected_before_a_build(no_build):
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got a on cpu, b on cpu, bias on cpu"):
        matmul_relu(torch.randn(3, 4), torch.randn(4, 5), torch.randn(5), backend="cuda")
