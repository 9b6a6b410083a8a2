// Reference CUDA C++ variant of fuselab's fused matmul + bias + ReLU: Y = relu(A @ B + bias).
//
// Kernels behind the two ops registered from C++ as torch.ops.fuselab.*:
//   matmul_relu_cuda        fp16/bf16: mma.sync.m16n8k16 on tensor cores (fp32 accumulators), fragments
//                           loaded from shared memory with ldmatrix, A and B tiles staged through a
//                           STAGES-deep cp.async ring, bias + ReLU applied to the accumulators and the
//                           output tile written back through shared memory in 16-byte rows;
//                           fp32: WMMA on tf32 fragments with the same ring when torch allows tf32
//                           (torch.backends.cuda.matmul.allow_tf32), otherwise a register-tiled SIMT
//                           kernel (exact fp32).
//   matmul_relu_cuda_naive  the tutorial's kernel (one thread per output, fp32 only), kept for
//                           the benchmark.
// Layouts: A must have a unit stride along K (any other A is copied once: .contiguous()); B may
// be row-major (N contiguous) or column-major (K contiguous, i.e. weight.t()), anything else is
// copied. Rows that are not 16-byte aligned, and tile edges, use guarded scalar loads and stores.
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

// ------------------------------------------------------------------------------------------------
// Tile shapes, shared-memory layout, global -> shared copies
// ------------------------------------------------------------------------------------------------

template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // one warp's tile
  static_assert(STAGES >= 2 && WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "unsupported tile shape");
};

// fp16/bf16 run mma.sync fed by ldmatrix; its tile is fixed at build time and -D overrides exist so
// that variants can be built and timed (experiments/sweep_cuda_tiles.py, csrc/NOTES.md). Default:
// 128x128x64, four warps of 64x64, three stages, the fastest of the seven variants timed on the H200.
#ifndef FUSELAB_BM
#define FUSELAB_BM 128
#endif
#ifndef FUSELAB_BN
#define FUSELAB_BN 128
#endif
#ifndef FUSELAB_BK
#define FUSELAB_BK 64
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
using MmaTile = Tile<FUSELAB_BM, FUSELAB_BN, FUSELAB_BK, FUSELAB_WARPS_M, FUSELAB_WARPS_N, FUSELAB_STAGES>;
// tf32 runs WMMA on 128x128x32 tiles, four warps of 64x64, three stages: the fastest of the seven
// WMMA variants timed on the H200 (NOTES.md).
using Tf32Tile = Tile<128, 128, 32, 2, 2, 3>;

template <typename T, class Cfg>
struct TileLayout {
  static constexpr int VEC = 16 / sizeof(T);      // elements per 16-byte cp.async
  static constexpr int PAD = VEC;                 // rows stay 16-byte aligned; ldmatrix's 8 row reads
                                                  // land in 8 distinct 16-byte bank groups
  static constexpr int A_LD = Cfg::BK + PAD;      // As[BM][A_LD]
  static constexpr int B_ROW_LD = Cfg::BN + PAD;  // Bs[BK][B_ROW_LD] for row-major B
  static constexpr int B_COL_LD = Cfg::BK + PAD;  // Bs[BN][B_COL_LD] for column-major B
  static constexpr int C_LD = Cfg::BN + PAD;      // the epilogue's output tile, Cs[BM][C_LD]
  static constexpr int A_ELEMS = Cfg::BM * A_LD;
  static constexpr int B_ELEMS = (Cfg::BK * B_ROW_LD > Cfg::BN * B_COL_LD) ? Cfg::BK * B_ROW_LD : Cfg::BN * B_COL_LD;
  static constexpr int STAGE = A_ELEMS + B_ELEMS;
  static constexpr size_t RING = Cfg::STAGES * STAGE * sizeof(T);
  static constexpr size_t OUT = Cfg::BM * C_LD * sizeof(T);
  static constexpr size_t SMEM = RING > OUT ? RING : OUT;  // the epilogue reuses the ring
};

// Block -> output tile, in groups of 8 tile rows so that blocks running together share A and B
// panels in L2.
template <class Cfg>
__device__ __forceinline__ void tile_origin(int M, int N, int& m0, int& n0) {
  constexpr int GROUP = 8;
  const int grid_m = (M + Cfg::BM - 1) / Cfg::BM, grid_n = (N + Cfg::BN - 1) / Cfg::BN;
  const int pid = blockIdx.x, per_group = GROUP * grid_n;
  const int first_m = (pid / per_group) * GROUP, rows = min(grid_m - first_m, GROUP);
  m0 = (first_m + (pid % per_group) % rows) * Cfg::BM;
  n0 = ((pid % per_group) / rows) * Cfg::BN;
}

// Copy a ROWS x COLS tile (cols contiguous in global memory, ld = row stride) into shared memory
// (row stride sld). `interior`: the whole tile is inside the matrix and 16-byte aligned, so every
// chunk is one unguarded cp.async; otherwise each chunk is checked, scalar where it must be.
template <typename T, int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, int sld, const T* g, int64_t ld, int row0, int col0, int max_row,
                                          int max_col, bool interior, bool aligned) {
  constexpr int VEC = 16 / sizeof(T), CPR = COLS / VEC, CHUNKS = ROWS * CPR;
  if (interior) {
    const T* origin = g + row0 * ld + col0;
#pragma unroll
    for (int it = 0; it < (CHUNKS + THREADS - 1) / THREADS; ++it) {
      const int c = threadIdx.x + it * THREADS;
      if (CHUNKS % THREADS == 0 || c < CHUNKS)
        cp_async_16(smem + (c / CPR) * sld + (c % CPR) * VEC, origin + (c / CPR) * ld + (c % CPR) * VEC);
    }
    return;
  }
  for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
    const int r = c / CPR, cc = (c % CPR) * VEC;
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

// Loads k-tile `kt` of A (BM x BK) and B (BK x BN, or BN x BK when column-major) into ring slot `slot`.
template <typename T, bool B_COL_MAJOR, class Cfg>
__device__ __forceinline__ void load_stage(T* smem, int slot, int kt, const T* A, const T* B, int M, int N, int K,
                                           int64_t lda, int64_t ldb, int m0, int n0, bool a_aligned, bool b_aligned) {
  using L = TileLayout<T, Cfg>;
  T* As = smem + slot * L::STAGE;
  T* Bs = As + L::A_ELEMS;
  const int k0 = kt * Cfg::BK;
  const bool k_inside = k0 + Cfg::BK <= K;
  load_tile<T, Cfg::BM, Cfg::BK, Cfg::THREADS>(As, L::A_LD, A, lda, m0, k0, M, K,
                                               a_aligned && k_inside && m0 + Cfg::BM <= M, a_aligned);
  const bool b_inside = b_aligned && k_inside && n0 + Cfg::BN <= N;
  if constexpr (B_COL_MAJOR)  // B^T is row-major (N, K): copy BN rows of BK
    load_tile<T, Cfg::BN, Cfg::BK, Cfg::THREADS>(Bs, L::B_COL_LD, B, ldb, n0, k0, N, K, b_inside, b_aligned);
  else
    load_tile<T, Cfg::BK, Cfg::BN, Cfg::THREADS>(Bs, L::B_ROW_LD, B, ldb, k0, n0, K, N, b_inside, b_aligned);
}

// ------------------------------------------------------------------------------------------------
// fp16/bf16: mma.sync.m16n8k16 (fp32 accumulators), fragments loaded with ldmatrix
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <typename T> __device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned* b);
template <> __device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const unsigned (&a)[4], const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename T> __device__ __forceinline__ unsigned pack2(float x, float y);
template <> __device__ __forceinline__ unsigned pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<unsigned*>(&h);
}

template <typename T, bool B_COL_MAJOR, class Cfg>
__global__ void __launch_bounds__(Cfg::THREADS) mma_kernel(const T* __restrict__ A, const T* __restrict__ B,
                                                           const T* __restrict__ bias, T* __restrict__ C, int M, int N,
                                                           int K, int64_t lda, int64_t ldb, bool a_aligned,
                                                           bool b_aligned, bool c_aligned) {
  using L = TileLayout<T, Cfg>;
  constexpr int MI = Cfg::WM / 16, NI = Cfg::WN / 8;  // m16 and n8 fragments per warp
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const unsigned smem_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / Cfg::WARPS_N, warp_n = warp % Cfg::WARPS_N;
  int m0, n0;
  tile_origin<Cfg>(M, N, m0, n0);

  // Byte offsets of this lane's ldmatrix row inside a ring slot. A (16x16 per x4): lanes 0-15 give
  // rows 0-15 at k 0, lanes 16-31 the same rows at k 8 -> a0..a3 of mma's A fragment. B (16 k x 16 n
  // per x4): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) -> b0, b1 of
  // two n8 fragments; a row-major B is read transposed.
  const int a_off = ((warp_m * Cfg::WM + lane % 16) * L::A_LD + (lane / 16) * 8) * sizeof(T);
  const int b_n = warp_n * Cfg::WN + (lane / 16) * 8, b_k = ((lane / 8) % 2) * 8;
  const int b_off = (L::A_ELEMS + (B_COL_MAJOR ? (b_n + lane % 8) * L::B_COL_LD + b_k
                                               : (b_k + lane % 8) * L::B_ROW_LD + b_n)) * sizeof(T);

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // STAGES-deep ring: tiles kt+1 .. kt+STAGES-1 are in flight while tile kt computes. One commit
  // group per iteration (empty past the end) keeps wait_group's count uniform.
  const int k_tiles = (K + Cfg::BK - 1) / Cfg::BK;
#pragma unroll
  for (int s = 0; s < Cfg::STAGES - 1; ++s) {
    if (s < k_tiles) load_stage<T, B_COL_MAJOR, Cfg>(smem, s, s, A, B, M, N, K, lda, ldb, m0, n0, a_aligned, b_aligned);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<Cfg::STAGES - 2>();  // tile kt has landed (this thread's copies) ...
    __syncthreads();                   // ... everyone's, and everyone is done reading slot (kt - 1)
    const int next = kt + Cfg::STAGES - 1;
    if (next < k_tiles)
      load_stage<T, B_COL_MAJOR, Cfg>(smem, next % Cfg::STAGES, next, A, B, M, N, K, lda, ldb, m0, n0, a_aligned,
                                      b_aligned);
    cp_async_commit();
    const unsigned slot = smem_addr + (kt % Cfg::STAGES) * L::STAGE * sizeof(T);
#pragma unroll
    for (int kk = 0; kk < Cfg::BK; kk += 16) {
      unsigned af[MI][4], bf[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) ldmatrix_x4(af[i], slot + a_off + (i * 16 * L::A_LD + kk) * sizeof(T));
#pragma unroll
      for (int j = 0; j < NI; j += 2) {
        unsigned r[4];
        if constexpr (B_COL_MAJOR)
          ldmatrix_x4(r, slot + b_off + (j * 8 * L::B_COL_LD + kk) * sizeof(T));
        else
          ldmatrix_x4_trans(r, slot + b_off + (kk * L::B_ROW_LD + j * 8) * sizeof(T));
        bf[j][0] = r[0], bf[j][1] = r[1], bf[j + 1][0] = r[2], bf[j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_16816<T>(acc[i][j], af[i], bf[j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the epilogue reuses the ring's shared memory

  // Epilogue: bias + ReLU on the accumulators (lane holds rows g, g+8 and columns 2t, 2t+1 of each
  // 16x8 fragment, g = lane / 4, t = lane % 4), staged as T in shared memory, then written out by
  // the whole block in 16-byte rows (guarded at the edges).
  T* Cs = smem;
#pragma unroll
  for (int j = 0; j < NI; ++j) {
    const int col = warp_n * Cfg::WN + j * 8 + (lane % 4) * 2;
    const float b0 = (bias != nullptr && n0 + col < N) ? to_float(bias[n0 + col]) : 0.f;
    const float b1 = (bias != nullptr && n0 + col + 1 < N) ? to_float(bias[n0 + col + 1]) : 0.f;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const int row = warp_m * Cfg::WM + i * 16 + lane / 4;
      *reinterpret_cast<unsigned*>(Cs + row * L::C_LD + col) =
          pack2<T>(relu_keep_nan(acc[i][j][0] + b0), relu_keep_nan(acc[i][j][1] + b1));
      *reinterpret_cast<unsigned*>(Cs + (row + 8) * L::C_LD + col) =
          pack2<T>(relu_keep_nan(acc[i][j][2] + b0), relu_keep_nan(acc[i][j][3] + b1));
    }
  }
  __syncthreads();
  constexpr int VEC = L::VEC, CPR = Cfg::BN / VEC;
  for (int c = threadIdx.x; c < Cfg::BM * CPR; c += Cfg::THREADS) {
    const int r = c / CPR, cc = (c % CPR) * VEC, gr = m0 + r, gc = n0 + cc;
    if (gr >= M) continue;
    T* dst = C + static_cast<int64_t>(gr) * N + gc;
    if (c_aligned && gc + VEC <= N) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(Cs + r * L::C_LD + cc);
    } else {
      for (int v = 0; v < VEC && gc + v < N; ++v) dst[v] = Cs[r * L::C_LD + cc + v];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// fp32 on tensor cores (tf32): WMMA fragments
// ------------------------------------------------------------------------------------------------

template <bool B_COL_MAJOR, class Cfg>
__global__ void __launch_bounds__(Cfg::THREADS) wmma_tf32_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                                                 const float* __restrict__ bias, float* __restrict__ C,
                                                                 int M, int N, int K, int64_t lda, int64_t ldb,
                                                                 bool a_aligned, bool b_aligned, bool) {
  using L = TileLayout<float, Cfg>;
  constexpr int WK = 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // wmma pointers need 32-byte alignment
  float* smem = reinterpret_cast<float*>(smem_raw);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / Cfg::WARPS_N, warp_n = warp % Cfg::WARPS_N;
  int m0, n0;
  tile_origin<Cfg>(M, N, m0, n0);

  wmma::fragment<wmma::accumulator, 16, 16, WK, float> acc[Cfg::WM / 16][Cfg::WN / 16];
#pragma unroll
  for (int i = 0; i < Cfg::WM / 16; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::WN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  const int k_tiles = (K + Cfg::BK - 1) / Cfg::BK;  // the same ring as mma_kernel
#pragma unroll
  for (int s = 0; s < Cfg::STAGES - 1; ++s) {
    if (s < k_tiles) load_stage<float, B_COL_MAJOR, Cfg>(smem, s, s, A, B, M, N, K, lda, ldb, m0, n0, a_aligned, b_aligned);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<Cfg::STAGES - 2>();
    __syncthreads();
    const int next = kt + Cfg::STAGES - 1;
    if (next < k_tiles)
      load_stage<float, B_COL_MAJOR, Cfg>(smem, next % Cfg::STAGES, next, A, B, M, N, K, lda, ldb, m0, n0,
                                          a_aligned, b_aligned);
    cp_async_commit();
    const float* As = smem + (kt % Cfg::STAGES) * L::STAGE;
    const float* Bs = As + L::A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < Cfg::BK; kk += WK) {
      wmma::fragment<wmma::matrix_a, 16, 16, WK, wmma::precision::tf32, wmma::row_major> a_frag[Cfg::WM / 16];
#pragma unroll
      for (int i = 0; i < Cfg::WM / 16; ++i) {
        wmma::load_matrix_sync(a_frag[i], As + (warp_m * Cfg::WM + i * 16) * L::A_LD + kk, L::A_LD);
        for (int t = 0; t < a_frag[i].num_elements; ++t) a_frag[i].x[t] = wmma::__float_to_tf32(a_frag[i].x[t]);
      }
#pragma unroll
      for (int j = 0; j < Cfg::WN / 16; ++j) {
        using BLayout = std::conditional_t<B_COL_MAJOR, wmma::col_major, wmma::row_major>;
        wmma::fragment<wmma::matrix_b, 16, 16, WK, wmma::precision::tf32, BLayout> b_frag;
        if constexpr (B_COL_MAJOR)
          wmma::load_matrix_sync(b_frag, Bs + (warp_n * Cfg::WN + j * 16) * L::B_COL_LD + kk, L::B_COL_LD);
        else
          wmma::load_matrix_sync(b_frag, Bs + kk * L::B_ROW_LD + warp_n * Cfg::WN + j * 16, L::B_ROW_LD);
        for (int t = 0; t < b_frag.num_elements; ++t) b_frag.x[t] = wmma::__float_to_tf32(b_frag.x[t]);
#pragma unroll
        for (int i = 0; i < Cfg::WM / 16; ++i) wmma::mma_sync(acc[i][j], a_frag[i], b_frag, acc[i][j]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the epilogue reuses the ring's shared memory

  // Epilogue: each warp stages one 16x16 fragment at a time in shared memory, then adds the bias,
  // applies ReLU and writes the rows it owns (guarded at the edges).
  float* stage = smem + warp * 16 * 16;
#pragma unroll
  for (int i = 0; i < Cfg::WM / 16; ++i) {
#pragma unroll
    for (int j = 0; j < Cfg::WN / 16; ++j) {
      wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int row0 = m0 + warp_m * Cfg::WM + i * 16, col0 = n0 + warp_n * Cfg::WN + j * 16;
      for (int e = lane; e < 256; e += 32) {
        const int r = row0 + e / 16, c = col0 + e % 16;
        if (r < M && c < N) C[static_cast<int64_t>(r) * N + c] = relu_keep_nan(stage[e] + (bias ? bias[c] : 0.f));
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

// One launcher for both tensor-core kernels: Kernel<B_COL_MAJOR> on Cfg tiles, one block per tile.
template <typename T, typename ScalarT, class Cfg, bool USE_MMA>
void launch_tiled(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, at::Tensor& out, bool b_col) {
  const int M = a.size(0), K = a.size(1), N = b.size(1);
  const int64_t lda = a.stride(0), ldb = b_col ? b.stride(1) : b.stride(0);
  const T* ap = reinterpret_cast<const T*>(a.data_ptr<ScalarT>());
  const T* bp = reinterpret_cast<const T*>(b.data_ptr<ScalarT>());
  const T* biasp = bias ? reinterpret_cast<const T*>(bias->data_ptr<ScalarT>()) : nullptr;
  T* cp = reinterpret_cast<T*>(out.data_ptr<ScalarT>());
  const int64_t blocks = ((M + Cfg::BM - 1) / Cfg::BM) * static_cast<int64_t>((N + Cfg::BN - 1) / Cfg::BN);
  TORCH_CHECK(blocks <= INT32_MAX, "matmul_relu_cuda: output too large (", M, " x ", N, ")");
  const size_t smem = TileLayout<T, Cfg>::SMEM;
  using KernelPtr = void (*)(const T*, const T*, const T*, T*, int, int, int, int64_t, int64_t, bool, bool, bool);
  KernelPtr kernel;
  if constexpr (USE_MMA)
    kernel = b_col ? mma_kernel<T, true, Cfg> : mma_kernel<T, false, Cfg>;
  else
    kernel = b_col ? wmma_tf32_kernel<true, Cfg> : wmma_tf32_kernel<false, Cfg>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<blocks, Cfg::THREADS, smem, c10::cuda::getCurrentCUDAStream()>>>(
      ap, bp, biasp, cp, M, N, K, lda, ldb, aligned16(a, lda), aligned16(b, ldb), aligned16(out, N));
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
    case at::kHalf: launch_tiled<__half, at::Half, MmaTile, true>(a, b, biasp, out, b_col); break;
    case at::kBFloat16: launch_tiled<__nv_bfloat16, at::BFloat16, MmaTile, true>(a, b, biasp, out, b_col); break;
    case at::kFloat:
      if (at::globalContext().allowTF32CuBLAS()) {
        launch_tiled<float, float, Tf32Tile, false>(a, b, biasp, out, b_col);
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
