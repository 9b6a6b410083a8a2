"""Test setup: the Triton interpreter on machines without CUDA, the gpu marker's skip, and seeds.

Every test runs on fresh random inputs (torch's generators seeded per test). A failing test's report
has a "random seed" section; ``FUSELAB_TEST_SEED=<seed> pytest ...`` reruns with that seed.
"""
import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton is imported (by fuselab) so kernels run on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tune into a throwaway directory: tests must not depend on, or pollute, the user's cache.
    os.environ.setdefault("FUSELAB_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "fuselab-test-cache"))

import pytest  # noqa: E402

SEED_ENV = "FUSELAB_TEST_SEED"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs every run; the seed is kept on the test item for the report below.
    fixed = os.environ.get(SEED_ENV)
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    request.node.fuselab_seed = seed
    request.node.user_properties.append(("seed", seed))  # junit-xml and report logs carry it too
    torch.manual_seed(seed)  # every device's generator
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "fuselab_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"{seed}; rerun on the same inputs: "
                                               f"{SEED_ENV}={seed} pytest '{item.nodeid}'"))


@pytest.fixture
def env(monkeypatch):
    """The environment, restored after the test together with the settings read from it (a test
    that changes a variable calls ``fuselab.settings.reload()``)."""
    from fuselab import settings

    yield monkeypatch
    monkeypatch.undo()
    settings.reload()


@pytest.fixture
def python_eager_path(monkeypatch):
    """The Python eager path for this test: the C++ path neither serves a call nor loads (setting only
    its ``extension`` to None let the first launch's plan load it again, and it served the rest)."""
    from fuselab.kernels import eager_path

    monkeypatch.setattr(eager_path, "extension", None)
    monkeypatch.setattr(eager_path, "_load_state", "off")


@pytest.fixture
def cublas_preferred(tmp_path, env, monkeypatch):
    """A fresh tuner for the fused GEMM (its own cache) whose clock makes cuBLAS (``CUBLAS``)
    fastest wherever it may run; its plans start empty."""
    import importlib

    from fuselab import settings
    from fuselab.kernels import _autotune, eager_path

    module = importlib.import_module("fuselab.kernels.matmul_relu_triton")
    runtime = importlib.import_module("fuselab.kernels._runtime")
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    kernel = module.matmul_relu_kernel
    tuner = _autotune.PersistentAutotuner(kernel.fn, *kernel._tuned_over, kernel.heuristic, kernel.library)
    tuner._bench = lambda *args, config, **meta: [1.0 if config is module.CUBLAS else 2.0] * 3
    monkeypatch.setattr(module, "matmul_relu_kernel", tuner)
    monkeypatch.setattr(runtime, "_PLANS", {})
    if eager_path.extension is not None:
        eager_path.extension.clear_plans()
    return tuner
