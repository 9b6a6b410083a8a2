"""fuselab.kernels._autotune: choices persist on disk, never go stale, and nothing is read at import.

On a CPU the kernels run in the Triton interpreter (conftest), where the tuner's clock is a
constant: tests that need a winner install a fake clock that also counts the configs timed.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from reference import DEVICES

from fuselab import settings
from fuselab.kernels import _autotune, matmul_relu

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})]


@pytest.fixture
def cache_dir(tmp_path, env):
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    return tmp_path / "cache"


@triton.jit
def _scale_kernel(x_ptr, n, SIZE_KEY, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _timed_tuner(kernel, timed, configs=CONFIGS):
    """A tuner whose fake clock makes the 32-wide config fastest and appends each timed config
    to ``timed``."""
    tuner = _autotune.PersistentAutotuner(kernel, configs, key=["SIZE_KEY"])
    run_config = tuner._bench

    def bench(*args, config, **meta):
        timed.append(config)
        run_config(*args, config=config, **meta)
        return [1.0 if config.kwargs["BLOCK"] == 32 else 2.0] * 3

    tuner._bench = bench
    return tuner


def _launch(tuner, n=100):
    tuner[lambda m: (triton.cdiv(n, m["BLOCK"]),)](torch.randn(n, device=DEVICE), n, _autotune.bucket(n))


def test_autotune_persists_per_gpu_and_triton(cache_dir):
    timed = []
    first = _timed_tuner(_scale_kernel, timed)
    _launch(first, 100)
    assert len(timed) == 3 and first.best_config.kwargs["BLOCK"] == 32
    files = list(cache_dir.rglob("*.json"))
    assert files == [first.cache_file()] == [_autotune.cache_dir() / f"_scale_kernel-{first.fingerprint}.json"]
    assert files[0].parent.name == f"triton-{triton.__version__}" and files[0].parent.parent.name
    assert "BLOCK: 32" in next(iter(json.loads(files[0].read_text()).values()))

    second = _timed_tuner(_scale_kernel, timed)  # a "second process": empty in-memory cache, same disk cache
    _launch(second, 120)  # the same bucket
    assert len(timed) == 3, "the second tuner benchmarked again instead of reading the disk cache"
    assert second.best_config.kwargs["BLOCK"] == 32


# A kernel in its own module file, so that tests can edit it: each variant is imported from its own
# directory under the same module name, as an edited file would be in the next process.
EDITABLE_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _times(x, FACTOR: tl.constexpr):
    return x * FACTOR


@triton.jit
def edited_kernel(x_ptr, n, SIZE_KEY, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, _times(x, 2) + 0, mask=offs < n)
'''


def _import_kernel(directory: Path, source: str):
    directory.mkdir(parents=True)
    path = directory / "edited_kernels.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("edited_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.edited_kernel


def test_editing_a_kernel_retunes(tmp_path, cache_dir):
    variants = {
        "original": EDITABLE_KERNEL,
        "kernel edited": EDITABLE_KERNEL.replace("_times(x, 2) + 0", "_times(x, 2) + 1"),
        "helper edited": EDITABLE_KERNEL.replace("return x * FACTOR", "return FACTOR * x"),
    }
    fingerprints = set()
    for i, (what, source) in enumerate(variants.items()):
        timed = []
        tuner = _timed_tuner(_import_kernel(tmp_path / str(i), source), timed)
        _launch(tuner)
        assert len(timed) == 3, f"{what}: the stored choice of another version was reused"
        fingerprints.add(tuner.fingerprint)
    assert len(fingerprints) == 3

    timed = []  # the original again: its own choice is still on disk
    _launch(_timed_tuner(_import_kernel(tmp_path / "again", EDITABLE_KERNEL), timed))
    assert timed == []

    timed = []  # another config list is another choice
    _launch(_timed_tuner(_import_kernel(tmp_path / "configs", EDITABLE_KERNEL), timed, CONFIGS[:2]))
    assert len(timed) == 2


SECOND_PROCESS = '''
import os, sys
import fuselab  # first: the cache directory below is set after the import
os.environ["FUSELAB_CACHE_DIR"] = sys.argv[1]
sys.path.insert(0, sys.argv[2])
import torch, triton
import edited_kernels
from fuselab.kernels._autotune import PersistentAutotuner
configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
tuner = PersistentAutotuner(edited_kernels.edited_kernel, configs, key=["SIZE_KEY"])
run_config, timed = tuner._bench, []
def bench(*args, config, **meta):
    timed.append(config)
    run_config(*args, config=config, **meta)
    return [1.0 if config.kwargs["BLOCK"] == 32 else 2.0] * 3
tuner._bench = bench
x = torch.randn(100, device="cuda" if torch.cuda.is_available() else "cpu")
tuner[lambda m: (triton.cdiv(100, m["BLOCK"]),)](x, 100, 128)
print(len(timed), tuner.best_config.kwargs["BLOCK"], tuner.cache_file())
'''


def test_second_process_reads_the_disk_cache(tmp_path):
    # Also: FUSELAB_CACHE_DIR set after `import fuselab` is the one used.
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "edited_kernels.py").write_text(EDITABLE_KERNEL)
    cache, at_import = tmp_path / "cache", tmp_path / "at-import"
    env = dict(os.environ, FUSELAB_CACHE_DIR=str(at_import))
    runs = [subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(cache), str(kernels)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    (timed_first, best_first, file_first), (timed_second, best_second, file_second) = (
        run.stdout.split() for run in runs)
    assert (timed_first, timed_second) == ("3", "0"), "the second process did not reuse the first one's choice"
    assert best_first == best_second == "32" and file_first == file_second
    assert Path(file_first).is_relative_to(cache) and Path(file_first).is_file()
    assert not at_import.exists()


@pytest.mark.parametrize("content", ["[]", "null", '"text"', "3", "{not json", b'\xff\xfe{"garbage'])
def test_corrupt_cache_warns_once_and_is_rewritten(cache_dir, content):
    # bytes that are not UTF-8 (a probe's) raised UnicodeDecodeError in every later process
    timed = []
    tuner = _timed_tuner(_scale_kernel, timed)
    path = tuner.cache_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.warns(RuntimeWarning, match="autotune cache") as caught:
        _launch(tuner, 100)
        _launch(tuner, 300)  # a second new key reads the file again: no second warning
    assert len(timed) == 6 and tuner.best_config.kwargs["BLOCK"] == 32
    about_cache = [str(w.message) for w in caught if "autotune cache" in str(w.message)]
    assert len(about_cache) == 1 and str(path) in about_cache[0], about_cache
    stored = json.loads(path.read_text())
    assert isinstance(stored, dict) and len(stored) == 2


def test_stored_entry_that_is_not_a_config_retunes(cache_dir):
    timed = []
    tuner = _timed_tuner(_scale_kernel, timed)
    _launch(tuner, 100)
    path = tuner.cache_file()
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({entry: ["BLOCK: 32"] for entry in stored}))
    _launch(_timed_tuner(_scale_kernel, timed), 100)
    assert len(timed) == 6


@pytest.mark.parametrize("device", DEVICES)
def test_autotune_fast_path_reuses_the_stored_choice(device, monkeypatch):
    # After tuning, a launch finds its choice by the key it was stored under: nothing is chosen again.
    from fuselab.kernels.matmul_relu_triton import matmul_relu_kernel

    a, b = torch.randn(33, 20, device=device), torch.randn(20, 18, device=device)
    first = matmul_relu(a, b)
    keys = list(matmul_relu_kernel.cache)
    monkeypatch.setattr(_autotune.PersistentAutotuner, "_choose",
                        lambda *args, **kwargs: pytest.fail("slow path taken after tuning"))
    torch.testing.assert_close(matmul_relu(a, b), first, rtol=0, atol=0)
    assert list(matmul_relu_kernel.cache) == keys


def test_autotune_switch_off_uses_heuristic_where_it_fits(cache_dir, env):
    # FUSELAB_AUTOTUNE=0: nothing is timed or stored; the heuristic runs unless pruning drops it
    # (an fp32 problem needs twice the shared memory), then the first config that survives. The
    # switch is read at the kernel's first launch, not when it was defined.
    small, heuristic, large = (triton.Config({"BLOCK": b}) for b in (16, 64, 128))

    def prune(configs, named_args, **kwargs):  # pretend 64-wide tiles do not fit odd sizes
        return [c for c in configs if named_args["n"] % 2 == 0 or c.kwargs["BLOCK"] != 64]

    tuner = _autotune.autotune([small, large, heuristic], key=["SIZE_KEY"], prune=prune,
                               heuristic=heuristic)(_scale_kernel)
    env.setenv("FUSELAB_AUTOTUNE", "0")
    settings.reload()
    x = torch.randn(101, device=DEVICE)
    want = x * 2
    tuner[lambda m: (triton.cdiv(100, m["BLOCK"]),)](x, 100, 1)
    assert tuner.best_config is heuristic and tuner.configs[0] is heuristic and len(tuner.configs) == 3
    tuner[lambda m: (triton.cdiv(101, m["BLOCK"]),)](x, 101, 2)
    assert tuner.best_config is small  # the first survivor, in the given order
    torch.testing.assert_close(x, torch.cat([want[:100] * 2, want[100:]]))  # both launches ran
    assert not list(cache_dir.rglob("*.json")), "an untimed choice was stored as a tuned one"


@triton.jit
def _double_kernel(x_ptr, y_ptr, n, SIZE_KEY, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _doubling(calls):
    """A library choice that computes what _double_kernel does, for sizes of 64 and more, counting its calls."""
    def call(args):
        calls.append(args["n"])
        torch.mul(args["x_ptr"][:args["n"]], 2, out=args["y_ptr"][:args["n"]])

    return _autotune.LibraryChoice("torch.mul", call, lambda args: args["SIZE_KEY"] >= 64)  # a key field only


def _library_timed_tuner(calls, library_time):
    tuner = _autotune.PersistentAutotuner(_double_kernel, CONFIGS, key=["SIZE_KEY"], library=[_doubling(calls)])
    tuner._bench = lambda *args, config, **meta: [library_time if isinstance(config, _autotune.LibraryChoice)
                                                  else 2.0] * 3
    return tuner


def _double(tuner, n):
    x, y = torch.randn(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    ret = tuner[lambda m: (triton.cdiv(n, m["BLOCK"]),)](x, y, n, _autotune.bucket(n))
    assert torch.equal(y, x * 2)
    return ret


def test_library_choice_is_timed_beside_the_configs_and_kept_where_faster(cache_dir):
    calls = []
    tuner = _library_timed_tuner(calls, library_time=1.0)
    assert isinstance(_double(tuner, 100), _autotune.LibraryChoice) and str(tuner.best_config) == "torch.mul"
    assert calls == [100]  # the launch was the library call
    assert "torch.mul" in json.loads(tuner.cache_file().read_text()).values()

    fresh = _library_timed_tuner(calls, library_time=1.0)  # a new process: the stored choice, untimed
    fresh._bench = lambda *args, **kwargs: pytest.fail("a stored choice was timed again")
    _double(fresh, 90)
    assert str(fresh.best_config) == "torch.mul" and calls == [100, 90]

    assert not isinstance(_double(tuner, 20), _autotune.LibraryChoice)  # bucket 32: it does not apply, the kernel's
    assert calls == [100, 90]
    slower = _library_timed_tuner(calls, library_time=3.0)  # timed, and slower: the kernel's config
    _double(slower, 300)
    assert not isinstance(slower.best_config, _autotune.LibraryChoice) and calls == [100, 90]


def test_library_choice_is_timed_by_calling_it(cache_dir):
    calls = []
    tuner = _autotune.PersistentAutotuner(_double_kernel, CONFIGS, key=["SIZE_KEY"], library=[_doubling(calls)])
    tuner._do_bench = lambda fn, quantiles: fn() or [1.0] * 3  # runs each candidate once; all tie
    _double(tuner, 100)
    assert calls == [100] and tuner.best_config is CONFIGS[0]  # timed on the launch's arguments; ties: the kernel


def test_a_library_call_is_timed_no_faster_than_the_host_issues_it(cache_dir, monkeypatch):
    # GPU time alone would take the library call (1 ms against the kernel's 2); its host time per call
    # (3 ms here) is what an eager caller waits for, so the kernel's config wins.
    monkeypatch.setattr(_autotune, "INTERPRET", False)  # the rule is off in the interpreter
    calls = []
    slow = _autotune.LibraryChoice("slow host", lambda args: calls.append(time.sleep(0.003)), lambda args: True)
    tuner = _autotune.PersistentAutotuner(_double_kernel, CONFIGS, key=["SIZE_KEY"], library=[slow])

    def gpu_time(fn, quantiles):
        before = len(calls)
        fn()
        return [1.0 if len(calls) > before else 2.0] * 3

    tuner._do_bench = gpu_time
    _double(tuner, 100)
    assert tuner.best_config in CONFIGS and tuner.configs_timings[slow][0] >= 3.0
    timings = _autotune.issue_bound(slow, lambda: time.sleep(0.003), [1.0, 0.5, 1.5])
    assert all(t >= 3.0 for t in timings)
    assert _autotune.issue_bound(CONFIGS[0], pytest.fail, [1.0, 0.5, 1.5]) == [1.0, 0.5, 1.5]  # a config: GPU time


def test_library_choice_is_never_taken_untimed(cache_dir, env):
    # FUSELAB_AUTOTUNE=0 times nothing: every candidate ties, and the kernel's heuristic comes first.
    calls = []
    tuner = _autotune.autotune(CONFIGS, key=["SIZE_KEY"], heuristic=CONFIGS[1], library=[_doubling(calls)])(_double_kernel)
    timed = []
    tuner._do_bench = lambda fn, quantiles: timed.append(fn) or [1.0] * 3  # replaced when the switch is read
    env.setenv("FUSELAB_AUTOTUNE", "0")
    settings.reload()
    _double(tuner, 100)
    assert tuner.best_config is CONFIGS[1] and calls == [] and timed == []


def test_library_choices_are_distinct_keys():
    first, second = _doubling([]), _autotune.LibraryChoice("other", lambda args: None, lambda args: True)
    assert len({first: 1, second: 2, CONFIGS[0]: 3}) == 3 and first != second and first == first


SWITCH = False


def _switched_prune(configs, named_args, **kwargs):
    return configs if SWITCH else configs[:1]


def test_fingerprint_covers_library_choices_and_switches(monkeypatch):
    # A choice stored for one version of the candidates must not serve another: adding a library choice,
    # editing its call, or flipping a module constant that the pruning reads each retunes.
    def fingerprint(prune=None, library=()):
        return _autotune.PersistentAutotuner(_double_kernel, CONFIGS, key=["SIZE_KEY"], prune=prune,
                                             library=library).fingerprint

    doubling = _doubling([])
    assert fingerprint() != fingerprint(library=[doubling])
    edited = _autotune.LibraryChoice("torch.mul", lambda args: None, doubling.applies)  # same name, other call
    assert fingerprint(library=[doubling]) != fingerprint(library=[edited])
    before = fingerprint(prune=_switched_prune)
    monkeypatch.setattr(sys.modules[__name__], "SWITCH", True)
    assert fingerprint(prune=_switched_prune) != before


def test_library_choice_names_are_unique():
    with pytest.raises(ValueError, match="share a name"):
        _autotune.PersistentAutotuner(_double_kernel, CONFIGS, key=["SIZE_KEY"], library=[_doubling([]), _doubling([])])


def test_a_library_call_that_raises_is_not_chosen(cache_dir):
    refusing = _autotune.LibraryChoice("refuses", lambda args: (_ for _ in ()).throw(RuntimeError("no")),
                                       lambda args: True)
    tuner = _autotune.PersistentAutotuner(_double_kernel, CONFIGS, key=["SIZE_KEY"], library=[refusing])
    tuner._do_bench = lambda fn, quantiles: fn() or [1.0] * 3  # runs each candidate once
    _double(tuner, 100)
    assert tuner.best_config in CONFIGS


def test_bucket():
    assert [_autotune.bucket(n) for n in (0, 1, 2, 3, 64, 65, 4096, 4097)] == [1, 1, 2, 4, 64, 128, 4096, 8192]


def test_narrow_row_tiles_are_tuned_for_skinny_problems_only():
    # Decode-sized M times the 16- and 32-row tiles; a taller problem never spends tuning time on them.
    gemm = importlib.import_module("fuselab.kernels.matmul_relu_triton")
    configs = gemm.gemm_configs(interpret=False)  # the GPU's config list (the interpreter's is two tiles)
    a = torch.empty(1, 1, dtype=torch.bfloat16)

    def row_tiles(m, tma_ok=True):
        args = dict(a_ptr=a, M_BUCKET=m, N_BUCKET=16384, MASK_A=False, TMA_OK=tma_ok)
        return {c.kwargs["BLOCK_M"] for c in gemm._prune_configs(configs, args)}

    assert {16, 32} <= row_tiles(16) and max(row_tiles(16)) <= 64
    assert {16, 32} <= row_tiles(64)
    assert min(row_tiles(128)) >= 64 and min(row_tiles(8192, tma_ok=False)) >= 64


def _add_keys(path: str, who: int, count: int, start) -> None:
    from fuselab.kernels._autotune import store_choice

    start.wait()  # all at once, once imported
    for i in range(count):
        store_choice(Path(path), f"{who}-{i}", "config")


def test_processes_storing_choices_at_once_keep_each_others(tmp_path):
    # The re-read before each write merged other processes' keys, but two read-merge-writes at once lost one.
    import multiprocessing

    path = tmp_path / "cache.json"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    procs = [ctx.Process(target=_add_keys, args=(str(path), who, 50, start)) for who in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    assert len(json.loads(path.read_text())) == 200
