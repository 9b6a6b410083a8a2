"""The C++ eager path (fuselab.kernels.eager_path): built here with the C++ compiler alone; its launch
plans keyed by layout, its packing of Triton's arguments, the entry points that try it first, and its
autograd node on CPU tensors (each GEMM then served by the interpreter through the Python fallback). Its
launches run on the GPU (the ``gpu`` tests below): each result must equal the Python path's bit for bit.
"""
import importlib
import types
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from reference import assert_close, dot_bound, randn

from fuselab import settings
from fuselab.kernels import eager_path, linear_relu, matmul_relu
from fuselab.kernels.matmul_relu_triton import python_linear_relu
from fuselab.nn import FusedLinearReLU
from fuselab.nn.linear_relu import fused_linear_relu, fused_matmul_relu

runtime = importlib.import_module("fuselab.kernels._runtime")


@pytest.fixture(scope="module")
def ext():
    return eager_path.build()


@pytest.fixture
def stub(monkeypatch):
    """A stand-in extension that records the calls made to it and answers ``answer``."""
    calls = []
    fake = types.SimpleNamespace(answer=None)

    def matmul_relu_entry(a, weight, bias, linear, autocast):
        calls.append((a, weight, bias, linear, autocast))
        return fake.answer

    fake.matmul_relu, fake.calls = matmul_relu_entry, calls
    monkeypatch.setattr(eager_path, "extension", fake)
    return fake


# ---------------------------------------------------------------------------------------------
# The extension, on a CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_extension_builds_and_declines_what_it_does_not_serve(ext):
    assert ext.GEMM_KIND == eager_path.GEMM_KIND
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    assert ext.matmul_relu(x, w, b, True, True) is None  # a CPU tensor: the Python path's
    assert ext.matmul_relu(x.double(), w.double(), None, True, False) is None
    assert ext.matmul_relu([1.0], w, b, True, False) is None  # not a tensor: the Python path raises


def test_a_build_with_a_matching_stamp_is_imported_without_cpp_extension(tmp_path, env, monkeypatch):
    # cpp_extension.load imports its build machinery and runs ninja: ~0.5 s of each process's first call.
    env.setenv("FUSELAB_CACHE_DIR", str(tmp_path))
    settings.reload()
    from torch.utils import cpp_extension

    built, imported = [], []

    def load(name, build_directory, **kwargs):
        built.append(name)
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"")
        return types.SimpleNamespace(__file__=str(library))

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(eager_path, "_import_extension", lambda library: imported.append(library) or "module")
    eager_path.build()
    assert (built, imported) == (["fuselab_eager_path"], [])
    assert eager_path.build() == "module" and len(built) == 1  # the stamp matches: imported from its file
    library = imported[0]
    assert library.name == "fuselab_eager_path.so"
    library.write_bytes(b"rebuilt by another version")  # into the same folder, leaving the stamp as it was
    eager_path.build()
    assert len(built) == 2 and len(imported) == 1  # not the stamp's file: built again
    library.unlink()
    eager_path.build()
    assert len(built) == 3  # the library is gone: built again
    monkeypatch.setattr(eager_path, "_build_stamp", lambda flags: "another source")
    eager_path.build()
    assert len(built) == 4 and len(imported) == 1  # the source (or flags, torch, Triton) changed: built again
    eager_path.build(verbose=True)
    assert len(built) == 5  # verbose shows the build's output: never served from the stamp

    def unloadable(library):
        raise ImportError("dynamic module does not define module export function")

    monkeypatch.setattr(eager_path, "_import_extension", unloadable)
    eager_path.build()
    assert len(built) == 6  # a library the stamp names but that does not import: built again, not off for good


@pytest.mark.slow
def test_plans_are_keyed_by_every_layout_detail(ext):
    ext.clear_plans()
    buffer = torch.zeros(64, 40, dtype=torch.bfloat16)
    a, b, c = buffer[:16, :8], torch.zeros(8, 24, dtype=torch.bfloat16), torch.zeros(16, 24, dtype=torch.bfloat16)
    key = [eager_path.GEMM_KIND, -1, 1]
    ext.register_plan(key, [a, b, c, None, None, None], 0, 0, [1, 1, 1], 4, 0, 0, [0, 0, 0, 16, 0, 0], [0, 1, 2])
    assert ext.plan_count() == 1
    assert ext.has_plan(key, [buffer[16:32, :8], b.clone(), c.clone(), None, None, None])  # other data, same layout
    assert not ext.has_plan(key, [a.contiguous(), b, c, None, None, None])  # other strides
    assert not ext.has_plan(key, [buffer[:16, 1:9], b, c, None, None, None])  # 2-byte offset: other alignment
    assert not ext.has_plan(key, [a.float(), b, c, None, None, None])  # other dtype
    assert not ext.has_plan(key, [a, b, c, b[0], None, None])  # a bias where the plan had none
    assert not ext.has_plan([eager_path.GEMM_KIND, -1, 0], [a, b, c, None, None, None])  # no ReLU
    with pytest.raises(RuntimeError, match="bad tensor slot"):
        ext.register_plan(key, [a], 0, 0, [1, 1, 1], 4, 0, 0, [0, 0, 0], [1])
    ext.clear_plans()
    assert ext.plan_count() == 0


@pytest.mark.slow
def test_launch_planned_finds_a_kernel_plan_by_its_key_ints_and_layouts(ext):
    # The quantized GEMM's entry (fuselab.quant._scaled_gemm): the key is built in C++ from the ints and layouts
    ext.clear_plans()
    key = [eager_path.SCALED_GEMM_KIND, -1, 1, 2, 0]  # kind, device, relu, out dtype, fast_accum
    a, b = torch.zeros(16, 32, dtype=torch.int8), torch.zeros(8, 32, dtype=torch.int8).t()
    args = [a, b, torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(16), torch.zeros(8), None, None]
    assert not ext.launch_planned(key, args) and not eager_path.launch_planned(key, args)  # nothing planned yet
    ext.register_library_plan(key, args, eager_path.LIBRARY_CALLS["cublas"])
    assert not ext.launch_planned(key, args)  # a library plan: Python repeats its call
    ext.register_plan(key, args, 0, 0, [1, 1, 1], 4, 0, 0, [0] * 9, [0, 1, 2, 3, 4])
    assert not ext.launch_planned(key, [a, b.contiguous(), *args[2:]])  # another layout
    assert not ext.launch_planned([eager_path.SCALED_GEMM_KIND, -1, 1, 2, 1], args)  # fast_accum: another kernel
    if not torch.cuda.is_available():  # found, then launched: a CPU has no CUDA driver (the GPU tests launch real plans)
        with pytest.raises(RuntimeError, match="CUDA"):
            ext.launch_planned(key, args)
    ext.clear_plans()


@pytest.mark.slow
@pytest.mark.parametrize("quantized_output", [False, True])
def test_the_quantized_gemm_call_finds_the_plan_python_registered(ext, quantized_output):
    # eager_path.scaled_gemm builds in C++ what _scaled_gemm.call and scaled_gemm build in Python before a launch:
    # a's rows flattened, the scales as vectors, the output; the plan Python registered under that key is found
    if torch.cuda.is_available():
        pytest.skip("a found plan is launched: CPU hosts only (the GPU tests launch real plans)")
    sg = importlib.import_module("fuselab.quant._scaled_gemm")
    ext.clear_plans()
    a, b = torch.zeros(2, 8, 32, dtype=torch.int8), torch.zeros(24, 32, dtype=torch.int8).t()
    a_scale, b_scale = torch.ones(2, 8, 1), torch.ones(1, 24)  # per row with a trailing 1; per column as (1, N)
    bias = torch.zeros(24, dtype=torch.bfloat16)
    out_scale = torch.tensor(0.5) if quantized_output else None
    code = sg._OUT_DTYPE_CODES[torch.bfloat16]
    c = torch.empty(16, 24, dtype=torch.int8 if quantized_output else torch.bfloat16)
    tensors = [a.reshape(16, 32), b, c, sg._as_vector(a_scale, (2, 8), "a_scale"),
               sg._as_vector(b_scale, (24,), "b_scale"), bias, out_scale]
    key = [eager_path.SCALED_GEMM_KIND, -1, 1, code, 0]  # kind, device (a CPU's), relu, out dtype, fast_accum
    present = [t for t in tensors if t is not None]
    ext.register_plan(key, tensors, 0, 0, [1, 1, 1], 4, 0, 0, [0] * 10, list(range(len(present))))

    def call(a=a, a_scale=a_scale, b_scale=b_scale, bias=bias, relu=True, out_dtype=torch.bfloat16, fast=False,
             operands=torch.int8):
        return ext.scaled_gemm(a, b, a_scale, b_scale, bias, relu, operands, out_dtype,
                               sg._OUT_DTYPE_CODES[out_dtype], out_scale, fast, cuda_only=False)

    launch_failed = (RuntimeError, torch.AcceleratorError)  # torch raises the latter for a first CUDA call
    with pytest.raises(launch_failed, match="CUDA"):  # found, then launched: a CPU has no CUDA driver
        call()
    with pytest.raises(launch_failed, match="CUDA"):  # the same rows given 2-D, the scales as (M,) and (N,)
        call(a=a.reshape(16, 32), a_scale=a_scale.reshape(16), b_scale=b_scale.reshape(24))
    assert call(a_scale=a_scale.reshape(8, 2)) is None  # a shape _as_vector refuses: Python names it
    with pytest.raises(launch_failed, match="CUDA"):  # (N, 1): Python takes that shape too
        call(b_scale=b_scale.t())
    assert call(b_scale=b_scale.reshape(2, 12)) is None  # refused by Python, which names it
    assert call(a_scale=torch.ones(1)) is None  # one scale for all rows: a stride-0 vector, another layout
    assert call(relu=False) is None and call(fast=True) is None and call(bias=None) is None  # other keys
    assert call(out_dtype=torch.float16) is None
    assert call(a=a.to(torch.float8_e4m3fn)) is None  # b is int8: the dtypes differ
    # The key names the operands' dtypes, not the op: fp8_matmul given int8 operands must reach Python (a TypeError)
    assert call(operands=torch.float8_e4m3fn) is None
    assert call(bias=bias.float()) is None  # a bias dtype not planned
    assert ext.scaled_gemm(a, b, None, None, None, False, torch.int8, torch.int32, sg._OUT_DTYPE_CODES[torch.int32],
                           None, False, cuda_only=False) is None  # unscaled: the raw accumulators stay Python's
    assert ext.scaled_gemm(a, b, a_scale, b_scale, bias, True, torch.int8, torch.bfloat16, code, out_scale,
                           False) is None  # a CPU tensor
    assert ext.scaled_gemm(a, b, a_scale, b_scale, bias, True, torch.int8, "bf16", code, out_scale, False,
                           cuda_only=False) is None
    ext.clear_plans()


@pytest.mark.slow
def test_a_full_store_is_emptied_and_python_hands_its_plans_over_again(ext, monkeypatch):
    # The C++ store is bounded: the registration that empties it says so, and Python then forgets which of its
    # plans it had handed over (else those layouts would never reach the C++ path again).
    ext.clear_plans()
    a = torch.zeros(4, 4, dtype=torch.bfloat16)

    def register(i):
        return ext.register_plan([eager_path.GEMM_KIND, -1, i], [a], 0, 0, [1, 1, 1], 4, 0, 0, [0, 0, 0], [0])

    assert not any(register(i) for i in range(4096)) and ext.plan_count() == 4096
    assert register(4096) and ext.plan_count() == 1
    ext.clear_plans()
    runtime = importlib.import_module("fuselab.kernels._runtime")
    handed, fresh = types.SimpleNamespace(in_cpp=True), types.SimpleNamespace(in_cpp=False)
    monkeypatch.setattr(runtime, "_PLANS", {"old": handed, "new": fresh})
    monkeypatch.setattr(eager_path, "register_plan", lambda *args: True)
    runtime._hand_to_cpp(fresh, ((), ()))
    assert fresh.in_cpp and not handed.in_cpp


@pytest.mark.slow
def test_a_library_plan_runs_cublas_through_aten(ext, monkeypatch):
    # A GEMM the tuner gave to cuBLAS is registered as that call; C++ runs addmm/mm and the ReLU on the
    # same key (a column-major C first turned around, as _gemm does). On CPU tensors here: aten's CPU ops.
    ext.clear_plans()
    monkeypatch.setattr(eager_path, "_load", lambda: ext)
    a, b, bias = (torch.randn(*s, dtype=torch.bfloat16) for s in ((6, 5), (5, 4), (4,)))
    a[2, 1] = float("nan")
    c = torch.full((6, 4), float("nan"), dtype=torch.bfloat16)
    plan = runtime._LibraryPlan(importlib.import_module("fuselab.kernels.matmul_relu_triton").CUBLAS,
                                types.SimpleNamespace(arg_names=["a_ptr", "b_ptr", "c_ptr"]), (a, b, c), {})
    fused = [eager_path.GEMM_KIND, -1, 1]
    eager_path.register_plan(fused, [a, b, c, bias, None, None], plan)
    assert ext.has_plan(fused, [a, b, c, bias, None, None]) and ext.plan_count() == 1
    ext.gemm(a, b, c, bias, True)
    torch.testing.assert_close(c, torch.relu(torch.addmm(bias, a, b)), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(c[2]).all()  # torch.relu's NaN rule
    plain = [eager_path.GEMM_KIND, -1, 0]
    ct = torch.empty(4, 6, dtype=torch.bfloat16).t()  # column-major: C^T = B^T A^T, a key of its own
    eager_path.register_plan(plain, [b.t(), a.t(), ct.t(), None, None, None], plan)
    ext.gemm(a, b, ct, None, False)
    torch.testing.assert_close(ct, torch.mm(a, b), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="unknown library call"):
        ext.register_library_plan(plain, [a, b, c, None, None, None], 7)
    ext.clear_plans()


_INTERPRETER_ONLY = pytest.mark.skipif(not runtime.INTERPRET, reason="the CPU GEMMs run in the Triton interpreter")


@pytest.mark.slow
@_INTERPRETER_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["linear-3d", "matmul-nobias", "linear-strided-bias"])
def test_cpp_autograd_node_on_a_cpu(ext, dtype, layout):
    # The C++ forward and backward (the autograd node: saved tensors, which gradients are asked for,
    # weight.t() for a Linear, threshold_backward, the bias sum) on CPU tensors, each GEMM served by the
    # Python fallback (the interpreter's kernel): values and gradients against float64.
    from reference import check_forward_backward

    ext.set_gemm_fallback(importlib.import_module("fuselab.kernels.matmul_relu_triton")._gemm)
    linear = layout.startswith("linear")
    x = randn(2, 5, 24, dtype=dtype, device="cpu") if "3d" in layout else randn(9, 24, dtype=dtype, device="cpu")
    w = randn(16, 24, dtype=dtype, device="cpu")
    bias = None if "nobias" in layout else randn(16, dtype=dtype, device="cpu")
    if "strided" in layout:
        bias = randn(32, dtype=dtype, device="cpu")[::2]

    def op(a, b, bias):  # check_forward_backward passes b as (K, N): a Linear's weight is its transpose
        y = ext.matmul_relu(a, b.t() if linear else b, bias, linear, False, False)
        assert y is not None and "MatmulReLU" in y.grad_fn.name()
        return y

    b = w.t() if linear else w.t().detach().clone()  # (K, N)
    check_forward_backward(x, b, bias, dtype, op=op)
    assert ext.matmul_relu(x, b.t() if linear else b, bias, linear, False, False) is not None  # fits on a CPU...
    assert ext.matmul_relu(x, b.t() if linear else b, bias, linear, False) is None  # ...but the default is CUDA only


@pytest.mark.slow
@_INTERPRETER_ONLY
def test_cpp_autograd_node_double_backward_and_partial_grads_on_a_cpu(ext):
    # Only x requires grad; create_graph=True makes the node's backward PyTorch's differentiable ops (with
    # torch.relu's mask), whose result is checked, then differentiated again (the fallback GEMMs run there).
    ext.set_gemm_fallback(importlib.import_module("fuselab.kernels.matmul_relu_triton")._gemm)
    x = randn(7, 12, dtype=torch.float16, device="cpu").requires_grad_(True)
    w, b = randn(10, 12, dtype=torch.float16, device="cpu"), randn(10, dtype=torch.float16, device="cpu")
    dy = randn(7, 10, dtype=torch.float16, device="cpu")  # not a function of y: the mask must matter
    y = ext.matmul_relu(x, w, b, True, False, False)
    ref = torch.relu(torch.nn.functional.linear(x.detach().double(), w.double(), b.double()))
    torch.testing.assert_close(y.double(), ref, rtol=2**-9, atol=2**-9)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    mask = (y.detach() > 0).double()
    torch.testing.assert_close(gx.double(), (dy.double() * mask) @ w.double(), rtol=2**-8, atol=2**-8)
    assert gx.requires_grad and x.grad is None
    (ggx,) = torch.autograd.grad((gx.float() ** 2).sum(), x)  # gx does not depend on x but through the mask
    assert torch.equal(ggx, torch.zeros_like(x))


def _plan(signature, values, slots, float_slots=(), **metadata):
    compiled = types.SimpleNamespace(src=types.SimpleNamespace(signature=signature),
                                     metadata=types.SimpleNamespace(**metadata))
    return types.SimpleNamespace(compiled=compiled, values=values, slots=slots, float_slots=list(float_slots))


def test_kernel_params_are_packed_as_tritons_launcher_passes_them():
    signature = {"x_ptr": "*bf16", "bias_ptr": "constexpr", "M": "i32", "stride": "constexpr",
                 "big": "i64", "lr": "fp32", "eps": "fp64", "BLOCK": "constexpr", "y_ptr": "*fp32"}
    values = [None, None, -3, 1, 2**40, 0.5, 0.25, 64, None]
    params, slots, float_slots = eager_path._kernel_params(_plan(signature, values, [0, 8]))
    # constexprs (None pointers and ints specialized to 1 too) take no slot; two scratch pointers end it
    assert params == [0, 2**64 - 3, 2**40, 0x3F000000, 0x3FD0000000000000, 0, 0, 0]
    assert slots == [0, 5] and float_slots == []
    assert params[1] & 0xFFFFFFFF == 2**32 - 3  # the low 4 bytes are the i32 the kernel reads
    # a plan that passes its fp32 arguments at each launch (SparseAdamW's hyperparameters): 0 in their slots
    params, slots, float_slots = eager_path._kernel_params(_plan(signature, values, [0, 5, 8], float_slots=[5]))
    assert params == [0, 2**64 - 3, 2**40, 0, 0x3FD0000000000000, 0, 0, 0]
    assert slots == [0, 5] and float_slots == [3]
    fp64 = {**signature, "lr": "fp64"}  # only fp32 slots are passed per launch
    assert eager_path._kernel_params(_plan(fp64, values, [0, 5, 8], float_slots=[5])) is None


def test_kernel_params_refuse_what_the_path_cannot_pass():
    signature = {"x_ptr": "*bf16", "h": "fp16"}
    assert eager_path._kernel_params(_plan(signature, [None, 1.0], [0])) is None  # a 16-bit float argument
    assert eager_path._kernel_params(_plan({"x_ptr": "*bf16"}, [None], [0], profile_scratch_size=64)) is None
    assert eager_path._kernel_params(_plan({"x_ptr": "*bf16"}, [None], [0], num_ctas=2)) is None
    assert eager_path._kernel_params(_plan({"x_ptr": "*bf16"}, [None], [0], launch_pdl=True)) is None
    assert eager_path._kernel_params(_plan({"x_ptr": "*bf16"}, [None, 3], [0])) is None  # signature/arguments differ


def test_switched_off_by_its_setting(env, monkeypatch):
    env.setenv("FUSELAB_EAGER_CPP", "0")
    settings.reload()
    monkeypatch.setattr(eager_path, "_load_state", "not tried")
    monkeypatch.setattr(eager_path, "build", lambda: pytest.fail("a build started"))
    assert eager_path._load() is None and not eager_path.may_plan()


def test_failed_build_warns_once_and_leaves_the_python_path(monkeypatch):
    monkeypatch.setattr(eager_path, "_load_state", "not tried")
    monkeypatch.setattr(eager_path, "build", lambda: (_ for _ in ()).throw(RuntimeError("no g++")))
    with pytest.warns(RuntimeWarning, match="could not be built.*no g\\+\\+"):
        assert eager_path._load() is None
    assert eager_path._load() is None and eager_path.extension is None and not eager_path.may_plan()


# ---------------------------------------------------------------------------------------------
# Entry points: the C++ path first, the Python path where it declines
# ---------------------------------------------------------------------------------------------


def test_entry_points_try_the_cpp_path_first(stub):
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    stub.answer = sentinel = torch.full((3, 5), 7.0)
    layer = FusedLinearReLU(8, 5)
    assert fused_linear_relu(x, w, b) is sentinel and layer(x) is sentinel
    assert fused_matmul_relu(x, w.t(), b) is sentinel
    assert linear_relu(x, w, b) is sentinel and matmul_relu(x, w.t(), b) is sentinel
    flags = [(linear, autocast) for *_, linear, autocast in stub.calls]
    # the layers cast as nn.Linear does under autocast; the kernels' API never casts
    assert flags == [(True, True), (True, True), (False, True), (True, False), (False, False)]


def test_a_declined_call_takes_the_python_path(stub):
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    stub.answer = None
    # the Python path's own result (under the Triton interpreter a CPU call runs the kernel: not torch's bits)
    assert torch.equal(fused_linear_relu(x, w, b), python_linear_relu(x, w, b))
    assert stub.calls  # asked first


def test_cpp_path_is_not_asked_under_forward_ad_or_while_compiling(stub, monkeypatch):
    stub.matmul_relu = lambda *args: pytest.fail("the C++ path was asked")
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    with fwAD.dual_level():
        out = fused_linear_relu(fwAD.make_dual(x, torch.ones_like(x)), w)
        assert fwAD.unpack_dual(out).tangent is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert eager_path.call(x, w, None, linear=True, autocast=True) is None


def test_disabled_restores_the_state_it_found(monkeypatch, stub):
    with eager_path.disabled():
        assert eager_path.extension is None and eager_path.call(torch.ones(1, 1), torch.ones(1, 1), None,
                                                                linear=True, autocast=False) is None
    assert eager_path.extension is stub


# ---------------------------------------------------------------------------------------------
# On the GPU: the C++ path's results equal the Python path's, bit for bit
# ---------------------------------------------------------------------------------------------


def _run(fn, inputs, grad):
    for t in inputs:
        if t is not None:
            t.grad = None
    y = fn()
    y.backward(grad)
    return y.detach().clone(), [None if t is None else t.grad.clone() for t in inputs]


def _node_name(y) -> str:
    return y.grad_fn.name() if y.grad_fn is not None else "none"


@pytest.fixture
def loaded():
    ext = eager_path._load()
    if ext is None:
        pytest.fail("the C++ eager path did not load on this GPU machine")
    return ext


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["linear", "matmul", "linear-3d-nobias", "matmul-strided-bias"])
def test_cpp_path_equals_python_path(loaded, dtype, layout):
    M, N, K = 300, 264, 136
    x = randn(2, M // 2, K, dtype=dtype, device="cuda") if "3d" in layout else randn(M, K, dtype=dtype, device="cuda")
    w = randn(N, K, dtype=dtype, device="cuda") if layout.startswith("linear") else randn(K, N, dtype=dtype, device="cuda")
    bias = None if "nobias" in layout else randn(N, dtype=dtype, device="cuda")
    if "strided" in layout:
        bias = randn(2 * N, dtype=dtype, device="cuda")[::2]
    for t in (x, w, bias):
        if t is not None:
            t.requires_grad_(True)
    fn = (lambda: linear_relu(x, w, bias)) if layout.startswith("linear") else (lambda: matmul_relu(x, w, bias))
    grad = randn(*x.shape[:-1], N, dtype=dtype, device="cuda")
    first = _run(fn, (x, w, bias), grad)  # plans every GEMM (Python), then the C++ path launches them
    y_cpp, grads_cpp = _run(fn, (x, w, bias), grad)
    assert "MatmulReLU" in _node_name(fn()) and "Eager" not in _node_name(fn()), _node_name(fn())
    with eager_path.disabled():
        assert "Eager" in _node_name(fn())
        y_py, grads_py = _run(fn, (x, w, bias), grad)
    assert torch.equal(y_cpp, y_py) and torch.equal(first[0], y_py)
    for g_cpp, g_py in zip(grads_cpp, grads_py):
        assert (g_cpp is None and g_py is None) or torch.equal(g_cpp, g_py)
    b = w.t() if layout.startswith("linear") else w
    ref = torch.relu(x.double() @ b.double() + (0 if bias is None else bias.double()))
    assert_close(y_cpp, ref, dot_bound(dtype, K, x.double().abs(), b.double().abs()) + 2.0**-8 * ref.abs(), "forward")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpp_path_runs_the_products_the_tuner_gave_to_cublas(loaded, cublas_preferred, dtype):
    # Every GEMM planned as a cuBLAS call (library plans): C++ runs aten's addmm/mm and the in-place
    # ReLU on them, with the Python path's results bit for bit.
    M, N, K = 300, 264, 136
    x, w, bias = (randn(*s, dtype=dtype, device="cuda").requires_grad_(True) for s in ((M, K), (N, K), (N,)))
    grad = randn(M, N, dtype=dtype, device="cuda")
    fn = lambda: linear_relu(x, w, bias)  # noqa: E731
    _run(fn, (x, w, bias), grad)  # plans the forward and both products, as cuBLAS calls
    assert [str(c) for c in cublas_preferred.cache.values()] == ["cublas"] * 3
    y_cpp, grads_cpp = _run(fn, (x, w, bias), grad)
    with eager_path.disabled():
        y_py, grads_py = _run(fn, (x, w, bias), grad)
    assert torch.equal(y_cpp, y_py) and all(torch.equal(a, b) for a, b in zip(grads_cpp, grads_py))
    assert torch.equal(y_cpp, torch.relu(torch.addmm(bias, x, w.t())))
    g = torch.where(y_py <= 0, 0, grad).double()
    assert_close(grads_cpp[0], g @ w.double(), dot_bound(dtype, N, g.abs(), w.double().abs()), "dX")
    assert_close(grads_cpp[1], g.t() @ x.double(), dot_bound(dtype, M, g.abs().t(), x.double().abs()), "dW")


@pytest.mark.gpu
def test_cpp_path_no_grad_autocast_and_double_backward(loaded):
    layer = FusedLinearReLU(136, 264).cuda()  # fp32 parameters: autocast casts them, as nn.Linear's
    x = randn(40, 136, dtype=torch.float32, device="cuda").requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
        with eager_path.disabled():
            y_py = layer(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_py) and "MatmulReLU" in _node_name(y)
    layer = layer.to(torch.bfloat16)
    with torch.no_grad():
        assert layer(x.bfloat16()).grad_fn is None
    # create_graph: the backward is PyTorch's differentiable ops, so its own gradient is PyTorch's
    xb = x.detach().bfloat16().requires_grad_(True)
    (gx,) = torch.autograd.grad(layer(xb).sum(), xb, create_graph=True)
    (gx_ref,) = torch.autograd.grad(torch.relu(torch.nn.functional.linear(xb, layer.weight, layer.bias)).sum(), xb,
                                    create_graph=True)
    assert gx.requires_grad
    assert_close(gx, gx_ref.double(), 2.0**-7 * gx_ref.double().abs() + 1e-2, "double backward's first gradient")


@pytest.mark.gpu
def test_cpp_path_replays_in_a_cuda_graph(loaded):
    layer = FusedLinearReLU(256, 512).cuda().to(torch.bfloat16)
    x = randn(64, 256, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    for _ in range(2):  # plans made before the capture
        layer(x).sum().backward()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    x.data.copy_(randn(64, 256, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    with eager_path.disabled():
        expected = layer(x)
    assert torch.equal(y, expected)


@pytest.mark.gpu
def test_cpp_path_declines_fp32_subclasses_and_modes(loaded):
    x, w = randn(8, 16, dtype=torch.float32, device="cuda"), randn(4, 16, dtype=torch.float32, device="cuda")
    assert loaded.matmul_relu(x, w, None, True, False) is None  # fp32: the Python path chooses cuBLAS or tf32

    class Sub(torch.Tensor):
        pass

    xs = x.bfloat16()
    assert loaded.matmul_relu(xs.as_subclass(Sub), w.bfloat16(), None, True, False) is None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert loaded.matmul_relu(xs, w.bfloat16(), None, True, False) is None
    assert loaded.matmul_relu(xs, w.bfloat16(), None, True, False) is not None
