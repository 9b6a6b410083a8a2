"""Test setup: the Triton interpreter on machines without CUDA, and the gpu marker's skip."""
import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton is imported (by fuselab) so kernels run on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tune into a throwaway directory: tests must not depend on, or pollute, the user's cache.
    os.environ.setdefault("FUSELAB_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "fuselab-test-cache"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    # Fresh random inputs every run, but a failure prints the seed that reproduces it.
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    yield seed
