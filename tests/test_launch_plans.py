"""Launch plans (fuselab.kernels._runtime): repeated eager launches that skip Triton's per-call work.

Plans run on CUDA only, not in the interpreter; on a CPU the plan and its check of Triton's private
launcher are tested with a stand-in for the compiled kernel.
"""
import importlib
import sys
import types
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import triton
from reference import check_forward_backward, randn

from fuselab.kernels import _autotune

runtime = importlib.import_module("fuselab.kernels._runtime")
matmul_relu_module = importlib.import_module("fuselab.kernels.matmul_relu_triton")

ARG_NAMES = ["x_ptr", "y_ptr", "n", "FLAG", "BLOCK"]


class FakeCompiled:
    """Stands in for Triton's CompiledKernel: records what its launcher is called with."""

    function, packed_metadata = "function handle", "packed metadata"

    def __init__(self, error=None):
        self.calls, self.error = [], error

    def launch_metadata(self, grid, stream, *args):
        return ("launch metadata", grid, stream)

    def run(self, *args):
        if self.error is not None:
            raise self.error
        self.calls.append(args)


@pytest.fixture
def fresh_plans(monkeypatch):
    """No plan, the launcher not yet checked, and a stream without a GPU."""
    monkeypatch.setattr(runtime, "_PLANS", {})
    monkeypatch.setattr(runtime, "_plans_on", None)
    monkeypatch.setattr(runtime, "_plan_launched", False)
    monkeypatch.setattr(runtime, "_current_stream", lambda: 7)


def _remember(compiled, key="key"):
    fn = types.SimpleNamespace(arg_names=ARG_NAMES)
    kernel = types.SimpleNamespace(fn=fn, best_config=triton.Config({"BLOCK": 64}, num_warps=4))
    runtime._remember_plan(key, kernel, compiled, lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),),
                           (torch.randn(100), torch.randn(100), 100), {"FLAG": True}, None)


def _plan_warnings(caught):
    return [w for w in caught if "planned kernel launches are off" in str(w.message)]


@pytest.mark.gpu
def test_repeated_calls_relaunch_the_first_calls_kernel(python_eager_path, monkeypatch):
    # From the second eager call of a layout on, _gemm relaunches a plan (launch_planned): on new
    # data, on a view whose 16-byte alignment differs (its own plan), forward and both products.
    # (The Python path's plans; the C++ path launches its own copies of them: test_eager_path.py.)
    kernel = matmul_relu_module.matmul_relu_kernel  # kernels only: cuBLAS, if faster, would take plans of its own
    monkeypatch.setattr(matmul_relu_module, "matmul_relu_kernel", _autotune.PersistentAutotuner(
        kernel.fn, *kernel._tuned_over, kernel.heuristic))
    relaunched = []
    call = runtime._LaunchPlan.__call__
    monkeypatch.setattr(runtime._LaunchPlan, "__call__", lambda self, t: relaunched.append(1) or call(self, t))
    M, K, N = 97, 72, 88
    for offset in (0, 0, 0, 1, 1):  # offset 1: the rows start 2 bytes off a 16-byte boundary
        a = torch.randn(M * K + offset, dtype=torch.bfloat16, device="cuda")[offset:].view(M, K)
        b = randn(K, N, dtype=torch.bfloat16, device="cuda", layout="transposed")
        check_forward_backward(a, b, torch.randn(N, dtype=torch.bfloat16, device="cuda"), torch.bfloat16)
    assert len(relaunched) >= 2 * 3 + 3  # rounds 2, 3 and 5: forward, dA, dB each
    assert runtime._plans_on and runtime._plan_launched, "the installed Triton's launcher was not accepted"


def test_launch_plan_fixes_all_but_the_tensors():
    # What launch_planned relaunches: Triton's argument order (positional, keywords, the tuned
    # config), the grid evaluated once, and no reference to the first call's tensors.
    fn = types.SimpleNamespace(arg_names=ARG_NAMES)
    kernel = types.SimpleNamespace(fn=fn, best_config=triton.Config({"BLOCK": 64}, num_warps=4))
    x, y = torch.randn(100), torch.randn(100)
    plan = runtime._LaunchPlan(kernel, object(), lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),),
                               (x, y, 100), {"FLAG": True}, None)
    assert plan.values == [None, None, 100, True, 64] and plan.slots == [0, 1]
    assert plan.grid == (2, 1, 1)
    x_ref = weakref.ref(x)
    del x
    assert x_ref() is None


def test_plan_key_separates_what_triton_specializes_on():
    a = torch.randn(40, 33)
    b, bias = torch.randn(33, 24), torch.randn(24)
    c = torch.empty(40, 24)
    key = matmul_relu_module._plan_key
    same = key(a, b, c, bias, None, None, True)
    assert key(torch.randn(40, 33), b, c, bias, None, None, True) == same  # new data, same layout
    assert key(torch.randn(40 * 33 + 1)[1:].view(40, 33), b, c, bias, None, None, True) != same  # 4 bytes off
    assert key(a, b.t().contiguous().t(), c, bias, None, None, True) != same  # column-major b
    assert key(a, b, c, None, None, None, True) != same
    assert key(a, b, c, bias, None, None, False) != same


def test_installed_triton_launches_as_plans_do():
    # The check compares with the installed Triton's JITFunction.run: it must pass here (and on the GPU).
    assert runtime._launcher_mismatch(FakeCompiled()) is None


def test_planned_launch_passes_what_triton_passes(fresh_plans):
    compiled = FakeCompiled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _remember(compiled)
        x, y = torch.randn(100), torch.randn(100)
        assert runtime.launch_planned("key", x, y)
    hooks = triton.knobs.runtime
    (args,) = compiled.calls
    assert args[:7] == (2, 1, 1, 7, "function handle", "packed metadata", ("launch metadata", (2, 1, 1), 7))
    assert args[7:9] == (hooks.launch_enter_hook, hooks.launch_exit_hook)
    assert args[9] is x and args[10] is y and args[11:] == (100, True, 64)
    assert not runtime.launch_planned("another key", x, y)  # nothing planned there: the caller launches


def test_a_plan_of_a_plain_jit_kernel_takes_new_floats_too(fresh_plans):
    # SparseAdamW's kernels: plain JITFunctions (arg_names on the kernel itself), and float
    # hyperparameters that a scheduler changes every step, passed again with the tensors (plan_floats).
    compiled = FakeCompiled()
    kernel = types.SimpleNamespace(arg_names=["x_ptr", "lr", "n", "eps", "BLOCK"], fn=lambda: None)
    runtime._remember_plan("sparse", kernel, compiled, (3,), (torch.randn(8), 0.1, 8, 1e-8), {"BLOCK": 16}, None,
                           floats=True)
    x = torch.randn(8)
    assert runtime.launch_planned("sparse", x, 0.05, 1e-6)
    (args,) = compiled.calls
    assert args[9] is x and args[10:] == (0.05, 8, 1e-6, 16)
    with pytest.raises(TypeError, match="must be a float"):  # an int would need another compiled kernel
        runtime.launch_planned("sparse", x, 1, 1e-6)
    runtime._remember_plan("fixed", kernel, compiled, (3,), (torch.randn(8), 0.1, 8, 1e-8), {"BLOCK": 16}, None)
    assert runtime.launch_planned("fixed", x)  # without plan_floats the floats stay the first call's
    assert compiled.calls[-1][10:] == (0.1, 8, 1e-8, 16)


def test_compiled_kernel_without_the_launcher_attributes_turns_plans_off(fresh_plans):
    def without_packed_metadata():
        return types.SimpleNamespace(run=FakeCompiled().run, function="function handle",
                                     launch_metadata=FakeCompiled().launch_metadata)

    with pytest.warns(RuntimeWarning) as caught:
        _remember(without_packed_metadata())
        _remember(without_packed_metadata(), key="other")
    (warning,) = _plan_warnings(caught)  # once
    assert "packed_metadata" in str(warning.message) and "3.6" in str(warning.message)
    assert runtime._PLANS == {} and not runtime.launch_planned("key", torch.randn(100), torch.randn(100))


def test_changed_normal_launch_turns_plans_off(fresh_plans, monkeypatch):
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):  # a Triton whose launcher takes one more argument
        kernel = launch_metadata = bound_args = grid_0 = grid_1 = grid_2 = stream = knobs = None
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, None, *bound_args.values())

    monkeypatch.setattr(JITFunction, "run", run)
    with pytest.warns(RuntimeWarning) as caught:
        _remember(FakeCompiled())
    (warning,) = _plan_warnings(caught)
    assert "JITFunction.run" in str(warning.message)
    assert runtime._PLANS == {}


def test_launcher_that_rejects_the_first_planned_launch_turns_plans_off(fresh_plans):
    compiled = FakeCompiled(error=TypeError("function takes exactly 14 arguments (13 given)"))
    _remember(compiled)
    with pytest.warns(RuntimeWarning) as caught:
        assert not runtime.launch_planned("key", torch.randn(100), torch.randn(100))  # the caller launches
    (warning,) = _plan_warnings(caught)
    assert "14 arguments" in str(warning.message)
    assert runtime._PLANS == {} and runtime._plans_on is False
    _remember(FakeCompiled())  # no plan is made any more
    assert runtime._PLANS == {}


def test_errors_after_the_first_planned_launch_propagate(fresh_plans):
    compiled = FakeCompiled()
    _remember(compiled)
    assert runtime.launch_planned("key", torch.randn(100), torch.randn(100))
    compiled.error = TypeError("a real error")
    with pytest.raises(TypeError, match="a real error"):
        runtime.launch_planned("key", torch.randn(100), torch.randn(100))


def test_tested_triton_versions_are_declared_in_pyproject():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11's")
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    declared = pyproject["tool"]["fuselab"]["launch-plans-tested-on-triton"]
    assert tuple(declared) == runtime.LAUNCH_PLANS_TESTED_ON_TRITON


@pytest.mark.parametrize("plans_on", [None, False], ids=["first-plan", "kernel-plans-off"])
def test_a_library_choice_is_planned_as_its_call(fresh_plans, monkeypatch, plans_on):
    # A GEMM the tuner gave to cuBLAS (CUBLAS) is planned as that call, bias and ReLU included, also where
    # planned kernel launches are off; no Triton launcher is involved, so a first plan that is a library
    # call leaves the launcher's check for the first kernel. Only the tensors change between calls.
    monkeypatch.setattr(runtime, "_plans_on", plans_on)
    kernel = matmul_relu_module.matmul_relu_kernel
    a, b, c, bias = torch.randn(9, 7), torch.randn(7, 5), torch.empty(9, 5), torch.randn(5)
    flags = dict(HAS_BIAS=True, RELU=True, MASK_A=False, ROWSUM_A=False)
    args = (a, b, c, bias, None, None, 9, 5, 7)
    runtime._remember_plan("key", kernel, matmul_relu_module.CUBLAS, None, args, flags, None)
    assert runtime._plans_on is plans_on
    a2, b2, c2, bias2 = torch.randn(9, 7), torch.randn(7, 5), torch.full((9, 5), float("nan")), torch.randn(5)
    assert runtime.launch_planned("key", a2, b2, c2, bias2)
    assert torch.equal(c2, torch.relu(torch.addmm(bias2, a2, b2)))
    (plan,) = runtime._PLANS.values()
    assert plan.tensor_names == ["a_ptr", "b_ptr", "c_ptr", "bias_ptr"]
    assert not any(isinstance(v, torch.Tensor) for v in plan.fixed.values())  # no tensor of the first call
