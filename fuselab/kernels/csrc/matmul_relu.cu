// Reference CUDA C++ variant of fuselab's fused matmul + bias + ReLU: Y = relu(A @ B + bias).
//
// Kernels behind the two ops registered from C++ as torch.ops.fuselab.*:
//   matmul_relu_cuda        fp16/bf16 on Hopper (sm_90a build, sm_90 GPU, TMA-compatible layouts):
//                           wgmma fed by TMA, one producer and two consumer warp groups, 128 x 256
//                           tiles, a four-stage mbarrier ring, bias + ReLU on the accumulators;
//                           fp16/bf16 elsewhere, and at short K or on few tiles: mma.sync.m16n8k16
//                           on tensor cores (fp32 accumulators), fragments loaded with ldmatrix, A and B tiles staged
//                           through a STAGES-deep cp.async ring, bias + ReLU applied to the accumulators
//                           and the output tile written back through shared memory in 16-byte rows;
//                           fp32: WMMA on tf32 fragments with the same ring when torch allows tf32
//                           (torch.backends.cuda.matmul.allow_tf32), otherwise a register-tiled SIMT
//                           kernel (exact fp32). FUSELAB_CUDA_KERNEL=auto (default)|mma|wgmma picks the
//                           fp16/bf16 kernel (launch_half).
//   matmul_relu_cuda_naive  the tutorial's kernel (one thread per output, fp32 only), kept for
//                           the benchmark.
// Layouts: A must have a unit stride along K (any other A is copied once: .contiguous()); B may
// be row-major (N contiguous) or column-major (K contiguous, i.e. weight.t()), anything else is
// copied. Rows that are not 16-byte aligned, and tile edges, use guarded scalar loads and stores
// (mma.sync), or send fp16/bf16 to mma.sync instead of wgmma (whose TMA reads need aligned rows).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>  // CUtensorMap; the one driver function used is fetched at run time (no -lcuda)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdlib>
#include <cstring>
#include <mma.h>
#include <torch/library.h>
#include <type_traits>

namespace fuselab {
namespace {

using namespace nvcuda;

// ------------------------------------------------------------------------------------------------
// Small device helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_u32(const void* p) {  // a shared-memory pointer as PTX addresses it
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
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
  const unsigned smem_addr = smem_u32(smem);

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
// fp16/bf16 on Hopper (sm_90a): wgmma fed by TMA, warp-specialized
// ------------------------------------------------------------------------------------------------
// A block computes a 128 x 256 output tile with three warp groups: one thread of the first issues
// the TMA copies of A (128 x 64) and B (64 x 256) into a four-stage ring of 128-byte-swizzled
// shared memory, the other two each run m64n256k16 wgmmas on 64 rows of the tile. Full/empty
// mbarriers hand the ring slots back and forth; a consumer keeps one k-tile of wgmmas in flight and
// frees a slot once the wgmmas that read it have retired. TMA zero-fills reads past M, N and K, so
// tile edges need no guards until the epilogue, which adds the bias, applies ReLU and stores the
// accumulators straight from registers. wgmma and TMA are arch-specific (sm_90a): the device code
// exists only in an sm_90a build, which also defines FUSELAB_WGMMA for the host side.

struct WgTile {
  static constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 2;
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int ROW_BYTES = BK * 2;  // one swizzle row: 64 fp16/bf16 = 128 bytes
  // the ring, 2 * STAGES mbarriers, and slack to align the ring to the 1024-byte swizzle period
  static constexpr size_t SMEM = STAGES * STAGE_BYTES + 2 * STAGES * sizeof(uint64_t) + 1024;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {  // arrive + expect bytes
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Until that phase completes. A phase that never completes (a transaction count that does not match
// what TMA delivers) traps after ~2^35 cycles (~20 s) instead of hanging the GPU.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  const long long start = clock64();
  while (true) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
    if (done) return;
    if (clock64() - start > (1ll << 35)) __trap();
  }
}
// box (c0 along the contiguous dimension, c1 along the other) of `map` -> dst; completes on `bar`
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands (rows of 64 K-elements): the
// stride byte offset is the distance between 8-row groups, 1024; the leading offset is unused.
// N-major B (rows of 64 N-elements, one row per k): leading offset = distance between 64-column
// chunks, stride offset = distance between 8-row (k) groups.
__device__ __forceinline__ uint64_t smem_desc(const void* p, unsigned lead_bytes, unsigned stride_bytes) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lead_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins the accumulators around the asynchronous wgmmas: no read or write of them may be moved
// across a fence, commit or wait.
__device__ __forceinline__ void pin(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FUSELAB_WGMMA_M64N256K16(TYPE)                                                                                  \
  asm volatile(                                                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                     \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                                 \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                          \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                                \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                                \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                                \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                    \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"                  \
      "}, %128, %129, p, 1, 1, 0, %131;\n}\n"                                                                           \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                 \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),         \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),         \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),         \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),         \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),         \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),         \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),         \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),         \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),     \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
      : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TRANS_B))

template <typename T, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __half>)
    FUSELAB_WGMMA_M64N256K16("f16");
  else
    FUSELAB_WGMMA_M64N256K16("bf16");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, bool B_COL_MAJOR>
__global__ void __launch_bounds__(WgTile::THREADS, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                 const T* __restrict__ bias, T* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using W = WgTile;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* ring = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + W::STAGES * W::STAGE_BYTES);
  uint64_t* empty = full + W::STAGES;
  int m0, n0;
  tile_origin<W>(M, N, m0, n0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < W::STAGES; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], W::CONSUMERS);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
  }
  __syncthreads();
  const int k_tiles = (K + W::BK - 1) / W::BK, group = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (group == 0) {  // producer: one thread issues every copy
    if (tid == 0) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % W::STAGES;
        mbar_wait(&empty[s], ((kt / W::STAGES) & 1) ^ 1);  // the first pass finds every slot free
        unsigned char* a_s = ring + s * W::STAGE_BYTES;
        unsigned char* b_s = a_s + W::A_BYTES;
        // Whole boxes count, their zero-filled parts included. Every box starts inside the matrix:
        // a row-major B skips the 64-column boxes that lie wholly past N (the columns they would
        // feed are never stored).
        const int b_boxes = B_COL_MAJOR ? 1 : min(W::BN / 64, (N - n0 + 63) / 64);
        mbar_expect_tx(&full[s], W::A_BYTES + b_boxes * (W::B_BYTES / (B_COL_MAJOR ? 1 : W::BN / 64)));
        tma_load_2d(a_s, &a_map, &full[s], kt * W::BK, m0);
        if constexpr (B_COL_MAJOR) {  // B^T (N x K, K contiguous): one 256 x 64 box
          tma_load_2d(b_s, &b_map, &full[s], kt * W::BK, n0);
        } else {  // B (K x N, N contiguous): 64 x 64 boxes of 64 columns
          for (int j = 0; j < b_boxes; ++j)
            tma_load_2d(b_s + j * W::BK * W::ROW_BYTES, &b_map, &full[s], n0 + 64 * j, kt * W::BK);
        }
      }
    }
    return;
  }

  // consumers: warp group c owns rows 64c .. 64c + 63 of the tile
  const int c = group - 1;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int s = kt % W::STAGES;
    mbar_wait(&full[s], (kt / W::STAGES) & 1);
    __syncwarp();  // wgmma is .aligned: the warp must be converged after its lanes' separate waits
    const unsigned char* a_s = ring + s * W::STAGE_BYTES + c * 64 * W::ROW_BYTES;
    const unsigned char* b_s = ring + s * W::STAGE_BYTES + W::A_BYTES;
    pin(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < W::BK / 16; ++kk) {  // k-steps of 16: 32 bytes along a K-major row
      const uint64_t da = smem_desc(a_s + kk * 32, 16, 1024);
      const uint64_t db = B_COL_MAJOR ? smem_desc(b_s + kk * 32, 16, 1024)
                                      : smem_desc(b_s + kk * 16 * W::ROW_BYTES, W::BK * W::ROW_BYTES, 1024);
      wgmma_m64n256k16<T, B_COL_MAJOR ? 0 : 1>(acc, da, db);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous k-tile's wgmmas have retired: its slot can be refilled
    pin(acc);
    if (kt > 0 && tid == 0) mbar_arrive(&empty[(kt - 1) % W::STAGES]);
  }
  wgmma_wait<0>();
  pin(acc);

  // Epilogue. Accumulator layout (per warp, as mma.sync's m16n8 C fragment repeated along N): lane
  // holds rows g and g + 8 (g = lane / 4) of its warp's 16 rows, columns 8j + 2t, 8j + 2t + 1
  // (t = lane % 4) in acc[4j .. 4j + 3].
  const int warp = tid / 32, lane = tid % 32;
  const int row = m0 + c * 64 + warp * 16 + lane / 4;
  const bool pairs = N % 2 == 0;  // two outputs per 4-byte store keep the alignment
#pragma unroll
  for (int j = 0; j < W::BN / 8; ++j) {
    const int col = n0 + 8 * j + 2 * (lane % 4);
    if (col >= N) continue;
    const bool two = col + 1 < N;
    const float b0 = bias ? to_float(bias[col]) : 0.f, b1 = (bias && two) ? to_float(bias[col + 1]) : 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      if (r >= M) continue;
      const float y0 = relu_keep_nan(acc[4 * j + 2 * h] + b0), y1 = relu_keep_nan(acc[4 * j + 2 * h + 1] + b1);
      T* dst = C + static_cast<int64_t>(r) * N + col;
      if (pairs && two) {
        *reinterpret_cast<unsigned*>(dst) = pack2<T>(y0, y1);
      } else {
        dst[0] = from_float<T>(y0);
        if (two) dst[1] = from_float<T>(y1);
      }
    }
  }
#else
  __trap();  // not an sm_90a build: the host never launches this
#endif
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

// Which fp16/bf16 kernel runs, the op's `half_kernel` argument: auto (wgmma where it can run and pays
// off, else mma.sync), mma, or wgmma (an error where it cannot run). Python passes the setting
// FUSELAB_CUDA_KERNEL (read once, fuselab/settings.py); tests and benchmarks pin a kernel this way.
enum class HalfKernel { Auto, Mma, Wgmma };
int device_attribute(cudaDeviceAttr attr) {  // of the current device
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}
HalfKernel parse_kernel(c10::string_view kernel) {
  if (kernel == "auto") return HalfKernel::Auto;
  if (kernel == "mma") return HalfKernel::Mma;
  TORCH_CHECK(kernel == "wgmma", "matmul_relu_cuda: kernel must be auto, mma or wgmma, got '", kernel, "'");
  return HalfKernel::Wgmma;
}

// Why the wgmma kernel cannot run on these operands (nullptr: it can). TMA reads rows whose start
// and stride are 16-byte aligned, with unit stride along the row.
const char* wgmma_unsupported(const at::Tensor& a, const at::Tensor& b, bool b_col) {
#if defined(FUSELAB_WGMMA)
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) != 9 || device_attribute(cudaDevAttrComputeCapabilityMinor) != 0)
    return "it needs an sm_90 GPU (Hopper)";
  const int64_t K = a.size(1), N = b.size(1);
  if (a.stride(1) != 1 || !aligned16(a, a.stride(0)) || a.stride(0) < K) return "A's rows are not 16-byte aligned";
  const int64_t ldb = b_col ? b.stride(1) : b.stride(0);
  if (b.stride(b_col ? 0 : 1) != 1 || !aligned16(b, ldb) || ldb < (b_col ? K : N))
    return "B's rows are not 16-byte aligned";
  return nullptr;
#else
  return "the extension was not built for sm_90a";
#endif
}

#if defined(FUSELAB_WGMMA)
PFN_cuTensorMapEncodeTiled_v12000 encode_tensor_map() {
  static const auto fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && p != nullptr,
                "matmul_relu_cuda: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// TMA map of a row-major (rows x cols) view with row stride ld elements, read in boxes of
// box_rows x 64 elements (one 128-byte swizzle row each); reads outside the matrix return zeros.
CUtensorMap tensor_map(const at::Tensor& t, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * t.element_size())};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)}, unit[2] = {1, 1};
  const auto dtype = t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_tensor_map()(&map, dtype, 2, t.data_ptr(), dims, strides, box, unit,
                                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "matmul_relu_cuda: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r),
              ") for a ", rows, " x ", cols, " view with row stride ", ld);
  return map;
}

template <typename T, typename ScalarT>
void launch_wgmma(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, at::Tensor& out, bool b_col) {
  using W = WgTile;
  const int M = a.size(0), K = a.size(1), N = b.size(1);
  const CUtensorMap a_map = tensor_map(a, M, K, a.stride(0), W::BM);
  const CUtensorMap b_map = b_col ? tensor_map(b, N, K, b.stride(1), W::BN) : tensor_map(b, K, N, b.stride(0), W::BK);
  const int64_t blocks = ((M + W::BM - 1) / W::BM) * static_cast<int64_t>((N + W::BN - 1) / W::BN);
  TORCH_CHECK(blocks <= INT32_MAX, "matmul_relu_cuda: output too large (", M, " x ", N, ")");
  auto kernel = b_col ? wgmma_kernel<T, true> : wgmma_kernel<T, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, W::SMEM));
  kernel<<<blocks, W::THREADS, W::SMEM, c10::cuda::getCurrentCUDAStream()>>>(
      a_map, b_map, bias ? reinterpret_cast<const T*>(bias->data_ptr<ScalarT>()) : nullptr,
      reinterpret_cast<T*>(out.data_ptr<ScalarT>()), M, N, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

// Where auto prefers mma.sync although wgmma can run: each wgmma tile pays a four-stage pipeline fill
// and a register epilogue, which a short K loop does not amortize, and its 128 x 256 tiles leave
// SMs idle on small outputs. The crossover is the H200 benchmark's (experiments/bench_matmul_relu.py
// --cuda): mma.sync wins at K = 256 (8192 x 8192) and at 1024 x 2048 x 512 (64 tiles for 132 SMs);
// wgmma wins at K >= 512 with the GPU filled, and at K >= 2048 even on 16 tiles (64 x 4096 x 4096).
bool wgmma_pays_off(int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = ((M + WgTile::BM - 1) / WgTile::BM) * ((N + WgTile::BN - 1) / WgTile::BN);
  return K >= 512 && (2 * tiles >= device_attribute(cudaDevAttrMultiProcessorCount) || K >= 2048);
}

// fp16/bf16: the wgmma kernel where it is asked for (or pays off, under auto) and can run, else mma.sync.
template <typename T, typename ScalarT>
void launch_half(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, at::Tensor& out, bool b_col,
                 HalfKernel want) {
  const char* why_not = want == HalfKernel::Mma ? "mma.sync was asked for"
                        : want == HalfKernel::Auto && !wgmma_pays_off(a.size(0), b.size(1), a.size(1))
                            ? "mma.sync is faster at this shape"
                            : wgmma_unsupported(a, b, b_col);
#if defined(FUSELAB_WGMMA)
  if (why_not == nullptr) return launch_wgmma<T, ScalarT>(a, b, bias, out, b_col);
#endif
  TORCH_CHECK(want != HalfKernel::Wgmma, "matmul_relu_cuda: kernel=wgmma, but ", why_not);
  launch_tiled<T, ScalarT, MmaTile, true>(a, b, bias, out, b_col);
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

at::Tensor matmul_relu_cuda(const at::Tensor& a_in, const at::Tensor& b_in, const std::optional<at::Tensor>& bias,
                            c10::string_view half_kernel) {
  check_inputs(a_in, b_in, bias);
  const HalfKernel want = parse_kernel(half_kernel);  // before any work: a bad name fails on every dtype
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
  // The kernels read bias[col]: a strided, column or expanded (stride 0) bias is copied (N elements).
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  const at::Tensor* biasp = bias ? &bias_c : nullptr;
  switch (a.scalar_type()) {
    case at::kHalf: launch_half<__half, at::Half>(a, b, biasp, out, b_col, want); break;
    case at::kBFloat16: launch_half<__nv_bfloat16, at::BFloat16>(a, b, biasp, out, b_col, want); break;
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
  m.def("matmul_relu_cuda(Tensor a, Tensor b, Tensor? bias, str half_kernel=\"auto\") -> Tensor");
  m.def("matmul_relu_cuda_naive(Tensor a, Tensor b, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(fuselab, CUDA, m) {
  m.impl("matmul_relu_cuda", &matmul_relu_cuda);
  m.impl("matmul_relu_cuda_naive", &matmul_relu_cuda_naive);
}

}  // namespace fuselab
