// fuselab's eager host path in C++: the fused linear/matmul + bias + ReLU with its autograd node,
// launching the cubins Triton compiled (launch plans), so that an eager call costs about what an
// aten op costs on the host. Python still compiles, tunes and chooses; it registers each launch it
// made (``register_plan``) and serves every call this file declines (returns None) or cannot plan
// yet (``set_gemm_fallback``). See fuselab/kernels/eager_path.py.
#include <torch/extension.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------------------------------------
// Launch plans: a compiled kernel with every argument fixed but its tensors' addresses
// ---------------------------------------------------------------------------------------------

// The first ints of a GEMM's key (kind, device, relu); matmul_relu_triton._gemm builds the same.
constexpr int64_t kGemmKind = 1;
// A plan that is a library call, not a kernel (eager_path.LIBRARY_CALLS): matmul_relu_triton's CUBLAS,
// c = [relu](a @ b + bias) by aten's addmm/mm (cuBLAS), then an in-place ReLU.
constexpr int kLibraryCublas = 1;

// The first int of a SparseAdamW launch's key (then device, launch index, maximize, the update's constants).
constexpr int64_t kSparseAdamWKind = 2;
// The first int of the quantized GEMM's key (then device, relu, output dtype, fast_accum): _scaled_gemm.py's,
// launched through `scaled_gemm` and `launch_planned` below.
constexpr int64_t kScaledGemmKind = 3;

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    size_t h = key.size();
    for (int64_t v : key) h ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

// What Triton specializes a tensor argument on (Python's plan_layout): dtype, sizes, strides and
// 16-byte alignment; -1 for an absent tensor.
void append_layout(Key& key, const Tensor* t) {
  if (t == nullptr || !t->defined()) {
    key.push_back(-1);
    return;
  }
  key.push_back(static_cast<int64_t>(t->scalar_type()));
  key.push_back(t->dim());
  for (int64_t s : t->sizes()) key.push_back(s);
  for (int64_t s : t->strides()) key.push_back(s);
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16));
}

struct Plan {
  CUfunction function;
  std::array<unsigned, 3> grid;
  int num_warps, shared;  // one CTA per program, no cluster/cooperative/PDL launch (eager_path.py refuses those)
  int64_t scratch_bytes;         // the whole launch's global scratch (TMA descriptors built on the device)
  int device;
  std::vector<uint64_t> params;  // one 8-byte slot per kernel parameter, the two scratch pointers last
  std::vector<int> tensor_params;  // the slot of each tensor argument, in argument order
  std::vector<int> float_params;   // the slot of each fp32 argument passed at each launch, in argument order
  int library = 0;                 // kLibraryCublas: the autotuner chose cuBLAS here, and nothing above is set
};

std::shared_mutex plans_mutex;
std::unordered_map<Key, std::shared_ptr<const Plan>, KeyHash> plans;
constexpr size_t kMaxPlans = 4096;  // dynamic shapes: keep the store bounded

std::shared_ptr<const Plan> find_plan(const Key& key) {
  std::shared_lock<std::shared_mutex> lock(plans_mutex);
  auto it = plans.find(key);
  return it == plans.end() ? nullptr : it->second;
}

using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);

LaunchKernelEx launch_kernel_ex() {
  static LaunchKernelEx fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "fuselab eager path: cannot open libcuda.so.1");
    auto f = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
    TORCH_CHECK(f != nullptr, "fuselab eager path: libcuda.so.1 has no cuLaunchKernelEx");
    return f;
  }();
  return fn;
}

// The launch Triton's own launcher makes for such a kernel (cuLaunchKernelEx, no attributes), on the
// current stream of the plan's device.
void launch(const Plan& plan, const std::vector<const Tensor*>& tensors,
            const std::vector<uint32_t>& floats = {}) {
  std::vector<uint64_t> values = plan.params;
  size_t i = 0;
  for (const Tensor* t : tensors) {
    if (t == nullptr || !t->defined()) continue;
    values[plan.tensor_params[i++]] = reinterpret_cast<uint64_t>(t->data_ptr());
  }
  TORCH_CHECK(i == plan.tensor_params.size(), "fuselab eager path: a plan got ", i, " tensors, expected ",
              plan.tensor_params.size());
  TORCH_CHECK(floats.size() == plan.float_params.size(), "fuselab eager path: a plan got ", floats.size(),
              " floats, expected ", plan.float_params.size());
  for (size_t k = 0; k < floats.size(); ++k) values[plan.float_params[k]] = floats[k];
  c10::cuda::CUDAGuard guard(plan.device);
  Tensor scratch;
  if (plan.scratch_bytes > 0) {
    scratch = at::empty({plan.scratch_bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, plan.device));
    values[values.size() - 2] = reinterpret_cast<uint64_t>(scratch.data_ptr());
  }
  std::vector<void*> pointers(values.size());
  for (size_t k = 0; k < values.size(); ++k) pointers[k] = &values[k];

  CUlaunchConfig config{};
  config.gridDimX = plan.grid[0];
  config.gridDimY = plan.grid[1];
  config.gridDimZ = plan.grid[2];
  config.blockDimX = 32 * plan.num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = plan.shared;
  config.hStream = c10::cuda::getCurrentCUDAStream(plan.device).stream();
  config.attrs = nullptr;
  config.numAttrs = 0;
  CUresult result = launch_kernel_ex()(&config, plan.function, pointers.data(), nullptr);
  TORCH_CHECK(result == CUDA_SUCCESS, "fuselab eager path: cuLaunchKernelEx failed with CUresult ", result);
}

// ---------------------------------------------------------------------------------------------
// The GEMM: c = [relu](a @ b + bias), a planned launch or Python's _gemm (which plans it)
// ---------------------------------------------------------------------------------------------

// fuselab.kernels.matmul_relu_triton._gemm, set by eager_path.py; never destroyed (no Python at exit).
py::object* gemm_fallback = nullptr;

void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor* bias, bool relu) {
  if (bias == nullptr && c.stride(0) == 1 && c.stride(1) != 1) {
    return gemm(b.t(), a.t(), c.t(), nullptr, relu);  // as _gemm does: a column-major C as C^T = B^T A^T
  }
  Key key{kGemmKind, a.get_device(), relu};
  key.reserve(64);
  for (const Tensor* t : {&a, &b, &c, bias}) append_layout(key, t);
  append_layout(key, nullptr);  // y: the eager path writes G once (Hopper), it never masks on load
  append_layout(key, nullptr);  // rowsum
  if (auto plan = find_plan(key)) {
    if (plan->library == kLibraryCublas) {
      Tensor out = c;  // a handle to the same storage: the _out ops write c
      if (bias) {
        at::addmm_out(out, *bias, a, b);
      } else {
        at::mm_out(out, a, b);
      }
      if (relu) out.relu_();
    } else {
      launch(*plan, {&a, &b, &c, bias});
    }
    return;
  }
  py::gil_scoped_acquire gil;  // the backward runs on autograd's thread, without the GIL
  TORCH_CHECK(gemm_fallback != nullptr, "fuselab eager path: no GEMM fallback registered");
  (*gemm_fallback)(a, b, c, py::arg("bias") = bias ? py::cast(*bias) : py::none(), py::arg("relu") = relu);
}

Tensor rows(const Tensor& t) {
  return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
}

std::vector<int64_t> with_last(const Tensor& t, int64_t last) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = last;
  return shape;
}

// weight is an nn.Linear weight (N, K) when `linear`, else the (K, N) right operand.
Tensor right_operand(const Tensor& weight, bool linear) {
  return linear ? weight.t() : weight;
}

struct MatmulReLU : public torch::autograd::Function<MatmulReLU> {
  static Tensor compute(const Tensor& a, const Tensor& weight, const Tensor* bias, bool linear) {
    Tensor b = right_operand(weight, linear);
    Tensor y = at::empty(with_last(a, b.size(1)), a.options());
    gemm(rows(a), b, rows(y), bias, /*relu=*/true);
    return y;
  }

  // bias: an optional, not an undefined Tensor (autograd records every Tensor input's device).
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& weight,
                        const std::optional<Tensor>& bias, bool linear) {
    Tensor y = compute(a, weight, bias ? &*bias : nullptr, linear);
    ctx->save_for_backward({a, weight, y});
    ctx->saved_data["linear"] = linear;
    ctx->saved_data["bias"] = bias.has_value();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &a = saved[0], &weight = saved[1], &y = saved[2];
    bool linear = ctx->saved_data["linear"].toBool();
    bool need_a = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    // without a bias there are two input edges: ask for the third only when it exists
    bool need_bias = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2);
    Tensor b = right_operand(weight, linear);
    Tensor g = at::threshold_backward(grads[0], y, 0);  // torch.relu's own gradient mask
    Tensor g2 = rows(g), a2 = rows(a);
    Tensor grad_a, grad_w, grad_bias;
    if (differentiable_backward_needed(grads[0])) {  // PyTorch's ops: their results have a graph
      if (need_a) grad_a = g.matmul(b.t());
      if (need_w) grad_w = linear ? g2.t().mm(a2) : a2.t().mm(g2);
      if (need_bias) grad_bias = g2.sum(0);
      return {grad_a, grad_w, grad_bias, Tensor()};
    }
    if (need_a) {
      grad_a = at::empty(with_last(g, b.size(0)), g.options());
      gemm(g2, b.t(), rows(grad_a), nullptr, false);
    }
    if (need_w) {
      grad_w = at::empty_like(weight);
      linear ? gemm(g2.t(), a2, grad_w, nullptr, false) : gemm(a2.t(), g2, grad_w, nullptr, false);
    }
    if (need_bias) grad_bias = g2.sum(0, /*keepdim=*/false, at::kFloat).to(g.scalar_type());
    return {grad_a, grad_w, grad_bias, Tensor()};
  }

  // create_graph=True, forward-mode AD or a torch.func transform: as _runtime.backward_by_torch_needed.
  static bool differentiable_backward_needed(const Tensor& grad) {
    return at::GradMode::is_enabled() || functorch_active() || dual_level_open() ||
           grad.key_set().has(c10::DispatchKey::Batched);
  }

  static bool functorch_active() {
    return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
  }

  static bool dual_level_open() {
    return torch::autograd::ForwardADLevel::try_get_by_idx(0) != nullptr;
  }
};

// ---------------------------------------------------------------------------------------------
// Entry: the call this path serves, or None (the Python path serves it, and raises on bad input)
// ---------------------------------------------------------------------------------------------

PyTypeObject* parameter_type = nullptr;

const Tensor* plain_tensor(py::handle obj) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) && type != parameter_type) return nullptr;
  return &THPVariable_Unpack(obj.ptr());
}

// Keys that mean something records or transforms the call: a tensor subclass or mode (Python),
// functionalization, vmap, torch.func's gradient wrappers.
bool transformed(const Tensor& t) {
  static const c10::DispatchKeySet keys({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                         c10::DispatchKey::Functionalize, c10::DispatchKey::Batched,
                                         c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper});
  return t.key_set().has_any(keys);
}

Tensor autocast(const Tensor& t, bool cast, at::ScalarType dtype) {
  return cast && t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble ? t.to(dtype) : t;
}

// cuda_only=false: CPU tensors too, each GEMM then served by the Python fallback (the Triton interpreter in
// the CPU tests, which check this node's forward and backward there).
py::object matmul_relu(py::handle a_obj, py::handle w_obj, py::handle bias_obj, bool linear, bool autocast_like_linear,
                       bool cuda_only) {
  const Tensor* a_ptr = plain_tensor(a_obj);
  const Tensor* w_ptr = plain_tensor(w_obj);
  const Tensor* bias_ptr = bias_obj.is_none() ? nullptr : plain_tensor(bias_obj);
  if (a_ptr == nullptr || w_ptr == nullptr || (!bias_obj.is_none() && bias_ptr == nullptr)) return py::none();
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled() ||
      MatmulReLU::functorch_active() || MatmulReLU::dual_level_open()) {
    return py::none();
  }
  bool cast = autocast_like_linear && at::autocast::is_autocast_enabled(at::kCUDA);
  at::ScalarType autocast_dtype = cast ? at::autocast::get_autocast_dtype(at::kCUDA) : at::kFloat;
  Tensor a = autocast(*a_ptr, cast && a_ptr->is_cuda(), autocast_dtype);
  Tensor w = autocast(*w_ptr, cast && w_ptr->is_cuda(), autocast_dtype);
  Tensor bias = bias_ptr ? autocast(*bias_ptr, cast && bias_ptr->is_cuda(), autocast_dtype) : Tensor();
  auto dtype = a.scalar_type();
  if ((cuda_only && !a.is_cuda()) || (dtype != at::kBFloat16 && dtype != at::kHalf)) return py::none();
  for (const Tensor* t : {&a, &w, &bias}) {
    if (!t->defined()) continue;
    if (t->scalar_type() != dtype || t->device() != a.device() || t->layout() != at::kStrided || transformed(*t)) {
      return py::none();
    }
  }
  if (a.dim() < 1 || w.dim() != 2) return py::none();
  int64_t k = linear ? w.size(1) : w.size(0), n = linear ? w.size(0) : w.size(1);
  if (a.size(-1) != k || (bias.defined() && (bias.dim() != 1 || bias.size(0) != n))) return py::none();
  if (a.numel() == 0 || n == 0) return py::none();
  bool grad = at::GradMode::is_enabled() &&
              (a.requires_grad() || w.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!grad) return py::cast(MatmulReLU::compute(a, w, bias.defined() ? &bias : nullptr, linear));
  return py::cast(MatmulReLU::apply(a, w, bias.defined() ? std::optional<Tensor>(bias) : std::nullopt, linear));
}

// ---------------------------------------------------------------------------------------------
// The quantized GEMM's eager call (fuselab.quant._scaled_gemm.call): rows, scales, output, planned launch
// ---------------------------------------------------------------------------------------------

// The kernel plan stored under `key` and the layouts of `arguments` (a kernel's tensor arguments in order, nullptr
// for an absent one), launched on them; false, with nothing launched, where there is none (a library plan included:
// Python repeats its call).
bool launch_by_layout(Key key, const std::vector<const Tensor*>& arguments) {
  for (const Tensor* t : arguments) append_layout(key, t);
  auto plan = find_plan(key);
  if (plan == nullptr || plan->library != 0) return false;
  launch(*plan, arguments);
  return true;
}

// A scale as _scaled_gemm._as_vector makes it for `n` rows or columns (`shape`: a's leading dims, or (N,)):
// one value for all (stride 0), or one each given as `shape`, (n,), (*shape, 1) or, for b, (1, n); undefined
// for any other shape (Python names it).
Tensor scale_vector(const Tensor& scale, c10::IntArrayRef shape, int64_t n, bool column) {
  if (scale.numel() == 1) return scale.reshape({1}).expand({n});
  c10::IntArrayRef sizes = scale.sizes();
  bool one_each = sizes.equals(shape) || (sizes.size() == 1 && sizes[0] == n) ||
                  (sizes.size() == shape.size() + 1 && sizes.back() == 1 && sizes.slice(0, shape.size()).equals(shape)) ||
                  (column && sizes.size() == 2 && sizes[0] == 1 && sizes[1] == n);
  return one_each ? scale.reshape({n}) : Tensor();
}

// A plan exists only for layouts the Python path accepted (dtypes, shapes and strides are in the key), so
// what is checked here is what the key leaves out: tensor kinds, modes, devices, scale shapes. None where
// Python must serve the call: an unscaled GEMM, an empty one, a layout not planned yet, anything unusual.
py::object scaled_gemm(py::handle a_obj, py::handle b_obj, py::handle a_scale_obj, py::handle b_scale_obj,
                       py::handle bias_obj, bool relu, py::handle operand_dtype_obj, py::handle out_dtype_obj,
                       int64_t out_dtype_code, py::handle out_scale_obj, bool fast_accum, bool cuda_only) {
  const Tensor* a_ptr = plain_tensor(a_obj);
  const Tensor* b_ptr = plain_tensor(b_obj);
  const Tensor* a_scale_ptr = plain_tensor(a_scale_obj);
  const Tensor* b_scale_ptr = plain_tensor(b_scale_obj);
  const Tensor* bias = bias_obj.is_none() ? nullptr : plain_tensor(bias_obj);
  const Tensor* out_scale = out_scale_obj.is_none() ? nullptr : plain_tensor(out_scale_obj);
  if (!a_ptr || !b_ptr || !a_scale_ptr || !b_scale_ptr || (!bias_obj.is_none() && !bias) ||
      (!out_scale_obj.is_none() && !out_scale) || !THPDtype_Check(out_dtype_obj.ptr()) ||
      !THPDtype_Check(operand_dtype_obj.ptr())) {
    return py::none();
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled()) {
    return py::none();
  }
  const Tensor &a = *a_ptr, &b = *b_ptr;
  // The op's operand dtype: the key names the operands' dtypes, not which op was called (the other op refuses them)
  at::ScalarType operands = reinterpret_cast<THPDtype*>(operand_dtype_obj.ptr())->scalar_type;
  if (a.scalar_type() != operands || b.scalar_type() != operands || a.is_nested() || b.is_nested()) return py::none();
  if ((cuda_only && !a.is_cuda()) || a.dim() < 1 || b.dim() != 2 || b.size(0) != a.size(-1)) return py::none();
  for (const Tensor* t : {&a, &b, a_scale_ptr, b_scale_ptr, bias, out_scale}) {
    if (t && (t->device() != a.device() || t->layout() != at::kStrided || transformed(*t))) return py::none();
  }
  int64_t k = a.size(-1), n = b.size(1), m = k > 0 ? a.numel() / k : 0;
  if (m == 0 || n == 0 || k == 0) return py::none();
  c10::IntArrayRef rows_shape = a.sizes().slice(0, a.dim() - 1);
  Tensor a_scale = scale_vector(*a_scale_ptr, rows_shape, m, false);
  std::array<int64_t, 1> columns{n};
  Tensor b_scale = scale_vector(*b_scale_ptr, columns, n, true);
  if (!a_scale.defined() || !b_scale.defined()) return py::none();
  Tensor a2 = a.dim() == 2 ? a : a.reshape({m, k});
  at::ScalarType result = out_scale ? at::kChar : reinterpret_cast<THPDtype*>(out_dtype_obj.ptr())->scalar_type;
  Tensor c = at::empty({m, n}, a.options().dtype(result));
  if (!launch_by_layout({kScaledGemmKind, a.get_device(), relu, out_dtype_code, fast_accum},
                        {&a2, &b, &c, &a_scale, &b_scale, bias, out_scale})) {
    return py::none();
  }
  return py::cast(a.dim() == 2 ? c : c.view(with_last(a, n)));
}

// ---------------------------------------------------------------------------------------------
// SparseAdamW's eager step: count it, sort the ids, update (kernels/sparse_adamw.py's order)
// ---------------------------------------------------------------------------------------------

// kernels/sparse_adamw.py's constants, set when the extension loads; part of every key, so that plans
// made under other constants are never mixed with these.
struct SparseConstants {
  int64_t chunk = 0, sort_block = 0, sort_sub = 0, fan = 0, merge_tile = 0, triton_sort_max = 0;
};
SparseConstants sparse_constants;

// Launch indices in a step's keys: the sort's first launch, its merge passes after it, then the update's two.
constexpr int64_t kSortLaunch = 0, kSegmentLaunch = 100, kCrossingLaunch = 101;

std::shared_ptr<const Plan> sparse_plan(Key key, int64_t launch_index) {
  key[2] = launch_index;
  return find_plan(key);
}

// The step sparse_adamw.sparse_adamw_triton runs, by planned launches; false (nothing done, the step not
// counted) for what that path must serve: inputs it reshapes or declines, or a launch not planned yet.
bool sparse_adamw_step(py::handle p_obj, py::handle m_obj, py::handle v_obj, py::handle indices_obj,
                       py::handle values_obj, py::handle step_obj, const std::vector<double>& hyper, bool maximize) {
  const Tensor* ptrs[] = {plain_tensor(p_obj), plain_tensor(m_obj), plain_tensor(v_obj), plain_tensor(indices_obj),
                          plain_tensor(values_obj), plain_tensor(step_obj)};
  for (const Tensor* t : ptrs) {
    if (t == nullptr || !t->is_cuda() || t->layout() != at::kStrided || transformed(*t)) return false;
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled() ||
      MatmulReLU::functorch_active() || sparse_constants.chunk == 0) {
    return false;
  }
  const Tensor &param = *ptrs[0], &exp_avg = *ptrs[1], &exp_avg_sq = *ptrs[2], &indices = *ptrs[3],
               &values = *ptrs[4], &step = *ptrs[5];
  auto dtype = param.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  for (const Tensor* t : ptrs) {
    if (t->device() != param.device()) return false;
  }
  if (param.dim() != 2 || exp_avg.sizes() != param.sizes() || exp_avg_sq.sizes() != param.sizes() ||
      indices.dim() != 1 || !indices.is_contiguous() || values.dim() != 2 || step.dim() != 0) {
    return false;
  }
  const int64_t nnz = values.size(0), dim = values.size(1), n_rows = param.size(0);
  const SparseConstants& c = sparse_constants;
  if (nnz == 0 || dim == 0 || dim != param.size(1) || indices.size(0) != nnz || nnz > (int64_t(1) << 31) - 2 * c.chunk ||
      n_rows >= (int64_t(1) << 31) - 2 || hyper.size() != 9) {
    return false;
  }
  // Past triton_sort_max lookups sparse_adamw_triton sorts by torch.sort: its host time is small beside such
  // a step's GPU time, and that path serves it.
  if (nnz > c.triton_sort_max) return false;
  for (const Tensor* t : {&param, &exp_avg, &exp_avg_sq, &values}) {
    if (dim > 1 && t->stride(1) != 1) return false;
  }
  Key key{kSparseAdamWKind, param.get_device(), 0, maximize, c.chunk, c.sort_block, c.sort_sub, c.fan,
          c.merge_tile, c.triton_sort_max};
  for (const Tensor* t : ptrs) append_layout(key, t);
  // The sort: one rank_blocks_kernel launch, then a merge pass per FAN-fold of the run (sort_ids).
  int64_t block = c.sort_sub;
  while (block < nnz && block < c.sort_block) block *= 2;
  const int64_t n_padded = (nnz + block - 1) / block * block;
  std::vector<std::shared_ptr<const Plan>> sort_plans{sparse_plan(key, kSortLaunch)};
  for (int64_t run = block; run < n_padded; run *= c.fan) {
    sort_plans.push_back(sparse_plan(key, kSortLaunch + static_cast<int64_t>(sort_plans.size())));
  }
  const int64_t n_chunks = (nnz + c.chunk - 1) / c.chunk;
  auto segment = sparse_plan(key, kSegmentLaunch);
  auto crossing = n_chunks > 1 ? sparse_plan(key, kCrossingLaunch) : nullptr;
  for (const auto& plan : sort_plans) {
    if (!plan) return false;
  }
  if (!segment || (n_chunks > 1 && !crossing)) return false;

  std::vector<uint32_t> floats(hyper.size());
  for (size_t k = 0; k < hyper.size(); ++k) {
    float f = static_cast<float>(hyper[k]);  // as Triton's launcher passes a Python float to an fp32 argument
    std::memcpy(&floats[k], &f, sizeof(f));
  }
  c10::cuda::CUDAGuard guard_device(param.get_device());
  Tensor step_count = step;  // a handle: the count lives in the optimizer's state
  step_count.add_(1);
  try {
    auto i32 = indices.options().dtype(at::kInt);
    Tensor ids = at::empty({nnz}, i32), order = at::empty({nnz}, i32);
    auto i64 = indices.options().dtype(at::kLong);
    int n_keys = n_padded > block * c.fan ? 2 : 1;
    std::array<Tensor, 2> keys;
    for (int k = 0; k < n_keys; ++k) keys[k] = at::empty({n_padded > block ? n_padded : 0}, i64);
    launch(*sort_plans[0], {&indices, &keys[0], &ids, &order});
    for (size_t pass = 1; pass < sort_plans.size(); ++pass) {
      const Tensor &src = keys[(pass - 1) % n_keys], &dst = keys[pass % n_keys];
      launch(*sort_plans[pass], {&src, &dst, &ids, &order});
    }
    // check_row_ids: nn.Embedding's device-side assert for an id out of range, on the sorted ends
    Tensor row_guard = param.index_select(0, ids.slice(0, 0, nnz, std::max<int64_t>(nnz - 1, 1)));
    Tensor partial = at::empty({2, n_chunks, dim}, values.options().dtype(at::kFloat));
    launch(*segment, {&ids, &order, &values, &partial, &param, &exp_avg, &exp_avg_sq, &step, &row_guard}, floats);
    if (crossing) launch(*crossing, {&ids, &partial, &param, &exp_avg, &exp_avg_sq, &step}, floats);
  } catch (...) {
    step_count.sub_(1);  // as the Python path: an update that raises leaves the count as it was
    throw;
  }
  for (const Tensor* t : {&param, &exp_avg, &exp_avg_sq}) {  // as the op's in-place writes would
    if (!t->is_inference()) torch::autograd::impl::bump_version(*t);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// What Python calls
// ---------------------------------------------------------------------------------------------

// Both return whether the store, full, was emptied to take this plan (Python then hands its plans over again).
bool register_plan(std::vector<int64_t> key_ints, std::vector<std::optional<Tensor>> key_tensors, int device,
                   uint64_t function, std::vector<int64_t> grid, int num_warps, int shared,
                   int64_t scratch_bytes, std::vector<uint64_t> params,
                   std::vector<int> tensor_params, std::vector<int> float_params) {
  TORCH_CHECK(grid.size() == 3 && params.size() >= 2, "fuselab eager path: a plan needs a 3-D grid and its scratch slots");
  for (int slot : tensor_params) TORCH_CHECK(slot >= 0 && slot < static_cast<int>(params.size()) - 2, "bad tensor slot");
  for (int slot : float_params) TORCH_CHECK(slot >= 0 && slot < static_cast<int>(params.size()) - 2, "bad float slot");
  Key key = std::move(key_ints);
  for (auto& t : key_tensors) append_layout(key, t ? &*t : nullptr);
  auto plan = std::make_shared<Plan>(Plan{reinterpret_cast<CUfunction>(function),
                                          {static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
                                           static_cast<unsigned>(grid[2])},
                                          num_warps, shared, scratch_bytes, device,
                                          std::move(params), std::move(tensor_params), std::move(float_params)});
  std::unique_lock<std::shared_mutex> lock(plans_mutex);
  bool cleared = plans.size() >= kMaxPlans;
  if (cleared) plans.clear();
  plans[std::move(key)] = std::move(plan);
  return cleared;
}

bool register_library_plan(std::vector<int64_t> key_ints, std::vector<std::optional<Tensor>> key_tensors,
                           int library) {
  TORCH_CHECK(library == kLibraryCublas, "fuselab eager path: unknown library call ", library);
  Key key = std::move(key_ints);
  for (auto& t : key_tensors) append_layout(key, t ? &*t : nullptr);
  auto plan = std::make_shared<Plan>();
  plan->library = library;
  std::unique_lock<std::shared_mutex> lock(plans_mutex);
  bool cleared = plans.size() >= kMaxPlans;
  if (cleared) plans.clear();
  plans[std::move(key)] = std::move(plan);
  return cleared;
}

// launch_by_layout from Python (the quantized GEMM's calls that eager_path.scaled_gemm does not serve).
bool launch_planned(std::vector<int64_t> key_ints, std::vector<std::optional<Tensor>> tensors) {
  std::vector<const Tensor*> arguments;
  arguments.reserve(tensors.size());
  for (auto& t : tensors) arguments.push_back(t ? &*t : nullptr);
  return launch_by_layout(std::move(key_ints), arguments);
}

bool has_plan(std::vector<int64_t> key_ints, std::vector<std::optional<Tensor>> key_tensors) {
  Key key = std::move(key_ints);
  for (auto& t : key_tensors) append_layout(key, t ? &*t : nullptr);
  return find_plan(key) != nullptr;
}

void clear_plans() {
  std::unique_lock<std::shared_mutex> lock(plans_mutex);
  plans.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  parameter_type = reinterpret_cast<PyTypeObject*>(py::module::import("torch.nn").attr("Parameter").ptr());
  m.attr("GEMM_KIND") = kGemmKind;
  m.attr("SPARSE_ADAMW_KIND") = kSparseAdamWKind;
  m.attr("SCALED_GEMM_KIND") = kScaledGemmKind;
  m.attr("SPARSE_ADAMW_LAUNCHES") = py::make_tuple(kSortLaunch, kSegmentLaunch, kCrossingLaunch);
  m.def("sparse_adamw_step", &sparse_adamw_step);
  m.def("set_sparse_constants", [](int64_t chunk, int64_t sort_block, int64_t sort_sub, int64_t fan,
                                   int64_t merge_tile, int64_t triton_sort_max) {
    sparse_constants = SparseConstants{chunk, sort_block, sort_sub, fan, merge_tile, triton_sort_max};
  });
  m.def("matmul_relu", &matmul_relu, py::arg("a"), py::arg("weight"), py::arg("bias"), py::arg("linear"),
        py::arg("autocast"), py::arg("cuda_only") = true);
  m.attr("LIBRARY_CALLS") = py::dict(py::arg("cublas") = kLibraryCublas);
  m.def("register_plan", &register_plan, py::arg("key_ints"), py::arg("key_tensors"), py::arg("device"),
        py::arg("function"), py::arg("grid"), py::arg("num_warps"), py::arg("shared"), py::arg("scratch_bytes"),
        py::arg("params"), py::arg("tensor_params"), py::arg("float_params") = std::vector<int>{});
  m.def("register_library_plan", &register_library_plan);
  m.def("has_plan", &has_plan);
  m.def("launch_planned", &launch_planned);
  m.def("scaled_gemm", &scaled_gemm, py::arg("a"), py::arg("b"), py::arg("a_scale"), py::arg("b_scale"),
        py::arg("bias"), py::arg("relu"), py::arg("operand_dtype"), py::arg("out_dtype"), py::arg("out_dtype_code"),
        py::arg("out_scale"), py::arg("fast_accum"), py::arg("cuda_only") = true);
  m.def("gemm", [](const Tensor& a, const Tensor& b, const Tensor& c, std::optional<Tensor> bias, bool relu) {
    gemm(a, b, c, bias ? &*bias : nullptr, relu);  // a planned GEMM as the autograd node runs it (tests)
  });
  m.def("clear_plans", &clear_plans);
  m.def("set_gemm_fallback", [](py::object fn) {
    if (gemm_fallback == nullptr) gemm_fallback = new py::object();
    *gemm_fallback = std::move(fn);
  });
  m.def("plan_count", [] {
    std::shared_lock<std::shared_mutex> lock(plans_mutex);
    return plans.size();
  });
}
