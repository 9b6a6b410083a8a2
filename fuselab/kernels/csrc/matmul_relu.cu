// Reference CUDA C++ variant of fuselab's fused matmul + bias + ReLU: Y = relu(A @ B + bias).
//
// Three kernels, registered from C++ as torch.ops.fuselab.*:
//   matmul_relu_cuda        fp16/bf16: tensor cores through WMMA (fp32 accumulators), A and B tiles
//                           staged through shared memory with cp.async, double-buffered;
//                           fp32: the same kernel on tf32 fragments when torch allows tf32
//                           (torch.get_float32_matmul_precision() != "highest"), otherwise a
//                           register-tiled SIMT kernel (exact fp32).
//   matmul_relu_cuda_naive  the tutorial's kernel (one thread per output, fp32 only), kept for
//                           the benchmark.
// Layouts: A must have a unit stride along K (any other A is copied once: .contiguous()); B may
// be row-major (N contiguous) or column-major (K contiguous, i.e. weight.t()), anything else is
// copied. Rows that are not 16-byte aligned, and tile edges, use guarded scalar loads.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

namespace fuselab {
namespace {

using namespace nvcuda;

// ------------------------------------------------------------------------------------------------
// Small device helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.f ? 0.f : x; }  // NaN < 0 is false

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

// WMMA fragment element type and K step per storage type.
template <typename T> struct Wmma;
template <> struct Wmma<__half> { using frag = __half; static constexpr int k = 16; };
template <> struct Wmma<__nv_bfloat16> { using frag = __nv_bfloat16; static constexpr int k = 16; };
template <> struct Wmma<float> { using frag = wmma::precision::tf32; static constexpr int k = 8; };

// ------------------------------------------------------------------------------------------------
// Tensor-core kernel: BM x BN block tile, BK deep, STAGES-deep cp.async ring, WARPS_M x WARPS_N warps
// ------------------------------------------------------------------------------------------------

// The tile shape is fixed at build time; -D overrides exist so that variants can be built and timed
// (csrc/NOTES.md lists what was measured).
#ifndef FUSELAB_BM
#define FUSELAB_BM 128
#endif
#ifndef FUSELAB_BN
#define FUSELAB_BN 128
#endif
#ifndef FUSELAB_BK
#define FUSELAB_BK 32
#endif
#ifndef FUSELAB_WARPS_M
#define FUSELAB_WARPS_M 2
#endif
#ifndef FUSELAB_WARPS_N
#define FUSELAB_WARPS_N 2
#endif
#ifndef FUSELAB_STAGES
#define FUSELAB_STAGES 3
#endif
constexpr int BM = FUSELAB_BM, BN = FUSELAB_BN, BK = FUSELAB_BK, STAGES = FUSELAB_STAGES;
constexpr int WARPS_M = FUSELAB_WARPS_M, WARPS_N = FUSELAB_WARPS_N, THREADS = 32 * WARPS_M * WARPS_N;
constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // one warp's tile
static_assert(STAGES >= 2 && WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "unsupported tile shape");

template <typename T>
struct TileLayout {
  static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte cp.async
  static constexpr int PAD = VEC;             // keeps rows 16-byte aligned, breaks bank conflicts
  static constexpr int A_LD = BK + PAD;       // As[BM][A_LD]
  static constexpr int B_ROW_LD = BN + PAD;   // Bs[BK][B_ROW_LD] for row-major B
  static constexpr int B_COL_LD = BK + PAD;   // Bs[BN][B_COL_LD] for column-major B
  static constexpr int A_ELEMS = BM * A_LD;
  static constexpr int B_ELEMS = (BK * B_ROW_LD > BN * B_COL_LD) ? BK * B_ROW_LD : BN * B_COL_LD;
  static constexpr int STAGE = A_ELEMS + B_ELEMS;
  static constexpr size_t SMEM = STAGES * STAGE * sizeof(T);
};

// Copy a rows x cols tile (cols contiguous in global memory, ld = row stride) into shared memory
// (row stride sld), 16 bytes at a time where the chunk is inside the matrix and aligned.
template <typename T>
__device__ __forceinline__ void load_tile(T* smem, int sld, const T* g, int64_t ld, int rows, int cols,
                                          int row0, int col0, int max_row, int max_col, bool aligned) {
  constexpr int VEC = TileLayout<T>::VEC;
  const int chunks_per_row = cols / VEC;
  for (int c = threadIdx.x; c < rows * chunks_per_row; c += THREADS) {
    const int r = c / chunks_per_row, cc = (c % chunks_per_row) * VEC;
    const int gr = row0 + r, gc = col0 + cc;
    T* dst = smem + r * sld + cc;
    if (aligned && gr < max_row && gc + VEC <= max_col) {
      cp_async_16(dst, g + gr * ld + gc);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        dst[v] = (gr < max_row && gc + v < max_col) ? g[gr * ld + gc + v] : from_float<T>(0.f);
    }
  }
}

template <typename T, bool B_COL_MAJOR>
__global__ void __launch_bounds__(THREADS) wmma_kernel(const T* __restrict__ A, const T* __restrict__ B,
                                                       const T* __restrict__ bias, T* __restrict__ C, int M,
                                                       int N, int K, int64_t lda, int64_t ldb, bool a_aligned,
                                                       bool b_aligned) {
  using L = TileLayout<T>;
  using FragT = typename Wmma<T>::frag;
  constexpr int WK = Wmma<T>::k;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // wmma pointers need 32-byte alignment
  T* smem = reinterpret_cast<T*>(smem_raw);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

  wmma::fragment<wmma::accumulator, 16, 16, WK, float> acc[WM / 16][WN / 16];
#pragma unroll
  for (int i = 0; i < WM / 16; ++i)
#pragma unroll
    for (int j = 0; j < WN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  auto load_stage = [&](int stage, int k0) {
    T* As = smem + stage * L::STAGE;
    T* Bs = As + L::A_ELEMS;
    load_tile<T>(As, L::A_LD, A, lda, BM, BK, m0, k0, M, K, a_aligned);
    if (B_COL_MAJOR)  // B^T is row-major (N, K): copy BN rows of BK
      load_tile<T>(Bs, L::B_COL_LD, B, ldb, BN, BK, n0, k0, N, K, b_aligned);
    else
      load_tile<T>(Bs, L::B_ROW_LD, B, ldb, BK, BN, k0, n0, K, N, b_aligned);
  };

  // STAGES-deep ring: tiles kt+1 .. kt+STAGES-1 are in flight while tile kt computes. One commit
  // group per iteration (empty past the end) keeps wait_group's count uniform.
  const int k_tiles = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * BK);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();  // tile kt has landed (this thread's copies) ...
    __syncthreads();              // ... everyone's, and everyone is done reading slot (kt - 1)
    if (kt + STAGES - 1 < k_tiles) load_stage((kt + STAGES - 1) % STAGES, (kt + STAGES - 1) * BK);
    cp_async_commit();
    const T* As = smem + (kt % STAGES) * L::STAGE;
    const T* Bs = As + L::A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < BK; kk += WK) {
      wmma::fragment<wmma::matrix_a, 16, 16, WK, FragT, wmma::row_major> a_frag[WM / 16];
#pragma unroll
      for (int i = 0; i < WM / 16; ++i) {
        wmma::load_matrix_sync(a_frag[i], As + (warp_m * WM + i * 16) * L::A_LD + kk, L::A_LD);
        if constexpr (std::is_same_v<T, float>)
          for (int t = 0; t < a_frag[i].num_elements; ++t) a_frag[i].x[t] = wmma::__float_to_tf32(a_frag[i].x[t]);
      }
#pragma unroll
      for (int j = 0; j < WN / 16; ++j) {
        using BLayout = std::conditional_t<B_COL_MAJOR, wmma::col_major, wmma::row_major>;
        wmma::fragment<wmma::matrix_b, 16, 16, WK, FragT, BLayout> b_frag;
        if constexpr (B_COL_MAJOR)
          wmma::load_matrix_sync(b_frag, Bs + (warp_n * WN + j * 16) * L::B_COL_LD + kk, L::B_COL_LD);
        else
          wmma::load_matrix_sync(b_frag, Bs + kk * L::B_ROW_LD + warp_n * WN + j * 16, L::B_ROW_LD);
        if constexpr (std::is_same_v<T, float>)
          for (int t = 0; t < b_frag.num_elements; ++t) b_frag.x[t] = wmma::__float_to_tf32(b_frag.x[t]);
#pragma unroll
        for (int i = 0; i < WM / 16; ++i) wmma::mma_sync(acc[i][j], a_frag[i], b_frag, acc[i][j]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the epilogue reuses the ring's shared memory

  // Epilogue: each warp stages one 16x16 fp32 fragment at a time in shared memory, then adds
  // the bias, applies ReLU and writes the rows it owns (guarded at the edges).
  float* stage = reinterpret_cast<float*>(smem_raw) + warp * 16 * 16;
#pragma unroll
  for (int i = 0; i < WM / 16; ++i) {
#pragma unroll
    for (int j = 0; j < WN / 16; ++j) {
      wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int row0 = m0 + warp_m * WM + i * 16, col0 = n0 + warp_n * WN + j * 16;
      for (int e = lane; e < 256; e += 32) {
        const int r = row0 + e / 16, c = col0 + e % 16;
        if (r < M && c < N) {
          float v = stage[e] + (bias != nullptr ? to_float(bias[c]) : 0.f);
          C[static_cast<int64_t>(r) * N + c] = from_float<T>(relu_keep_nan(v));
        }
      }
      __syncwarp();
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Exact fp32: register-tiled SIMT kernel, 128x128 block tile, BK = 8, 8x8 outputs per thread
// ------------------------------------------------------------------------------------------------

constexpr int S_BM = 128, S_BN = 128, S_BK = 8, S_TM = 8, S_TN = 8;

__global__ void __launch_bounds__(256) simt_fp32_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                                       const float* __restrict__ bias, float* __restrict__ C,
                                                       int M, int N, int K, int64_t sam, int64_t sak, int64_t sbk,
                                                       int64_t sbn) {
  __shared__ float As[S_BK][S_BM];  // A tile stored transposed: a thread's 8 rows are contiguous
  __shared__ float Bs[S_BK][S_BN];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int m0 = blockIdx.y * S_BM, n0 = blockIdx.x * S_BN;
  float acc[S_TM][S_TN] = {};
  for (int k0 = 0; k0 < K; k0 += S_BK) {
    for (int e = tid; e < S_BM * S_BK; e += 256) {  // 4 elements of each tile per thread
      const int r = e / S_BK, k = e % S_BK;
      As[k][r] = (m0 + r < M && k0 + k < K) ? A[(m0 + r) * sam + (k0 + k) * sak] : 0.f;
      const int kb = e / S_BN, c = e % S_BN;
      Bs[kb][c] = (k0 + kb < K && n0 + c < N) ? B[(k0 + kb) * sbk + (n0 + c) * sbn] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < S_BK; ++k) {
      float a[S_TM], b[S_TN];
#pragma unroll
      for (int i = 0; i < S_TM; ++i) a[i] = As[k][ty * S_TM + i];
#pragma unroll
      for (int j = 0; j < S_TN; ++j) b[j] = Bs[k][tx * S_TN + j];
#pragma unroll
      for (int i = 0; i < S_TM; ++i)
#pragma unroll
        for (int j = 0; j < S_TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < S_TM; ++i) {
    const int r = m0 + ty * S_TM + i;
#pragma unroll
    for (int j = 0; j < S_TN; ++j) {
      const int c = n0 + tx * S_TN + j;
      if (r < M && c < N) C[static_cast<int64_t>(r) * N + c] = relu_keep_nan(acc[i][j] + (bias ? bias[c] : 0.f));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The tutorial's kernel: one thread per output, fp32 (benchmark only)
// ------------------------------------------------------------------------------------------------

__global__ void naive_fp32_kernel(const float* A, const float* B, const float* bias, float* C, int M, int N, int K,
                                  int64_t sam, int64_t sak, int64_t sbk, int64_t sbn) {
  const int row = blockIdx.y * blockDim.y + threadIdx.y, col = blockIdx.x * blockDim.x + threadIdx.x;
  if (row < M && col < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[row * sam + k * sak] * B[k * sbk + col * sbn];
    C[static_cast<int64_t>(row) * N + col] = relu_keep_nan(acc + (bias ? bias[col] : 0.f));
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: checks, layout, dispatch
// ------------------------------------------------------------------------------------------------

void check_inputs(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && (!bias || bias->is_cuda()),
              "matmul_relu_cuda: all tensors must be CUDA tensors, got a on ", a.device(), ", b on ", b.device());
  TORCH_CHECK(a.device() == b.device() && (!bias || bias->device() == a.device()),
              "matmul_relu_cuda: all tensors must be on one device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (!bias || bias->scalar_type() == a.scalar_type()),
              "matmul_relu_cuda: all tensors must have one dtype, got a ", a.scalar_type(), " and b ", b.scalar_type());
  TORCH_CHECK(a.dim() >= 1 && b.dim() == 2, "matmul_relu_cuda: a must be (..., K) and b (K, N), got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(a.size(-1) == b.size(0), "matmul_relu_cuda: K mismatch, a ", a.sizes(), " b ", b.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == b.size(1)), "matmul_relu_cuda: bias must be (N,)");
}

bool aligned16(const at::Tensor& t, int64_t ld) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (ld * t.element_size()) % 16 == 0;
}

template <typename T, typename ScalarT>
void launch_wmma(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, at::Tensor& out, bool b_col) {
  const int M = a.size(0), K = a.size(1), N = b.size(1);
  const int64_t lda = a.stride(0), ldb = b_col ? b.stride(1) : b.stride(0);
  const T* ap = reinterpret_cast<const T*>(a.data_ptr<ScalarT>());
  const T* bp = reinterpret_cast<const T*>(b.data_ptr<ScalarT>());
  const T* biasp = bias ? reinterpret_cast<const T*>(bias->data_ptr<ScalarT>()) : nullptr;
  T* cp = reinterpret_cast<T*>(out.data_ptr<ScalarT>());
  const dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  const size_t smem = TileLayout<T>::SMEM;
  auto kernel = b_col ? wmma_kernel<T, true> : wmma_kernel<T, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, THREADS, smem, c10::cuda::getCurrentCUDAStream()>>>(ap, bp, biasp, cp, M, N, K, lda, ldb,
                                                                       aligned16(a, lda), aligned16(b, ldb));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (..., K) -> (rows, K); also when K or a leading size is 0 (reshape(-1, 0) is ambiguous).
at::Tensor as_rows(const at::Tensor& a, int64_t k) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < a.dim(); ++i) rows *= a.size(i);
  return a.reshape({rows, k});
}

std::vector<int64_t> out_shape(const at::Tensor& a, int64_t n) {
  auto shape = a.sizes().vec();
  shape.back() = n;
  return shape;
}

at::Tensor matmul_relu_cuda(const at::Tensor& a_in, const at::Tensor& b_in, const std::optional<at::Tensor>& bias) {
  check_inputs(a_in, b_in, bias);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const int64_t K = b_in.size(0), N = b_in.size(1);
  at::Tensor a = as_rows(a_in, K);
  const int64_t M = a.size(0);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out.view(out_shape(a_in, N));
  TORCH_CHECK((M + BM - 1) / BM <= 65535, "matmul_relu_cuda: at most ", 65535 * BM, " rows, got ", M);
  if (K == 0) {  // relu(bias), or zeros
    bias ? out.copy_(bias->expand({M, N})).relu_() : out.zero_();
    return out.view(out_shape(a_in, N));
  }
  if (a.stride(1) != 1 && K > 1) a = a.contiguous();  // the kernels read A along K
  at::Tensor b = b_in;
  bool b_col = b.stride(0) == 1 && N > 1;             // weight.t(): K contiguous
  if (!b_col && b.stride(1) != 1 && N > 1) b = b.contiguous();
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  const at::Tensor* biasp = bias ? &bias_c : nullptr;
  switch (a.scalar_type()) {
    case at::kHalf: launch_wmma<__half, at::Half>(a, b, biasp, out, b_col); break;
    case at::kBFloat16: launch_wmma<__nv_bfloat16, at::BFloat16>(a, b, biasp, out, b_col); break;
    case at::kFloat:
      if (at::globalContext().allowTF32CuBLAS()) {
        launch_wmma<float, float>(a, b, biasp, out, b_col);
      } else {
        const dim3 grid((N + S_BN - 1) / S_BN, (M + S_BM - 1) / S_BM);
        simt_fp32_kernel<<<grid, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
            a.data_ptr<float>(), b.data_ptr<float>(), bias ? bias_c.data_ptr<float>() : nullptr,
            out.data_ptr<float>(), M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      break;
    default: TORCH_CHECK(false, "matmul_relu_cuda: unsupported dtype ", a.scalar_type(), " (float16, bfloat16, float32)");
  }
  return out.view(out_shape(a_in, N));
}

at::Tensor matmul_relu_cuda_naive(const at::Tensor& a_in, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  check_inputs(a_in, b, bias);
  TORCH_CHECK(a_in.scalar_type() == at::kFloat, "matmul_relu_cuda_naive: float32 only, got ", a_in.scalar_type());
  const c10::cuda::CUDAGuard guard(a_in.device());
  const int64_t K = b.size(0), N = b.size(1);
  at::Tensor a = as_rows(a_in, K);
  const int64_t M = a.size(0);
  at::Tensor out = at::empty({M, N}, a.options());
  TORCH_CHECK((M + 15) / 16 <= 65535, "matmul_relu_cuda_naive: at most ", 65535 * 16, " rows, got ", M);
  if (M > 0 && N > 0) {
    const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
    const dim3 block(16, 16), grid((N + 15) / 16, (M + 15) / 16);
    naive_fp32_kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<float>(), b.data_ptr<float>(), bias ? bias_c.data_ptr<float>() : nullptr, out.data_ptr<float>(),
        M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out.view(out_shape(a_in, N));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fuselab, m) {
  m.set_python_module("fuselab.kernels.matmul_relu_cuda");  // where the fake and autograd live
  m.def("matmul_relu_cuda(Tensor a, Tensor b, Tensor? bias) -> Tensor");
  m.def("matmul_relu_cuda_naive(Tensor a, Tensor b, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuselab, CUDA, m) {
  m.impl("matmul_relu_cuda", &matmul_relu_cuda);
  m.impl("matmul_relu_cuda_naive", &matmul_relu_cuda_naive);
}

}  // namespace fuselab
