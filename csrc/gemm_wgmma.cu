// Hopper (sm_90a) weight-only GEMM for prefill, on wgmma.
//
// The tiled GEMM of gemm_mma.cu issues mma.sync m16n8k16: from about 64
// tokens it is bound by that instruction's rate, while cuBLAS's fp16 GEMM,
// on wgmma, stays memory-bound up to about 128.  This file keeps the same
// weight stream and the same register dequantization, and hands the
// dequantized fragments to wgmma.mma_async as its A operand (registers: rows
// of W), with the activations as the B operand (shared memory: tokens).
// Measured on the H200 (BENCHMARKS.md, prefill): 0.60x fp16 cuBLAS at 64
// tokens, 0.89x at 128 and 1.29x at 512 on 28672 x 8192 int4.
//
// Warps: a warpgroup owns kRT tiles of 64 rows; in each, warp i of the
// warpgroup supplies rows 16i .. 16i + 15 (one weight panel), which is the
// A-register layout of wgmma and the A fragment of mma.m16n8k16.  Tokens:
// kTok = 64 or 128 per block (the wgmma N).  Accumulators: kTok / 2 fp32 per
// thread per row tile, in the C-fragment layout of mma.m16n8k16 repeated
// for each 8 tokens.
//
// K order.  A lane's weight words cover k 32j + 8t .. +7 (int4 sub-tile j)
// or 16t .. +15 (int8), as in the GEMV; the MMA A fragment wants k {2t, 2t+1,
// 2t+8, 2t+9} of each 16.  Any permutation of k works if A and B agree, so
// the activations are permuted instead of the weights: a small kernel
// (permute_x_kernel) writes x once per call into the order the fragments
// imply, already arranged as wgmma's no-swizzle K-major core matrices (8
// tokens x 16 bytes, contiguous) and zero-padded to whole token blocks and
// K tiles.  A stage is then one contiguous copy, with no bounds checks.
// Within every 4W words of a row (W = 4 for int4's 32-k sub-tile, 8 for
// int8's 64-k tile), input word t*W + w goes to core-matrix column w, word
// t: a 4 x W transpose.
//
// Two kernels (block shapes in kShapes, chosen by M):
//   gemm_wgmma_kernel     64 tokens x 256 rows (two warpgroups, kRT = 2),
//                         all warps copy with cp.async and compute, one
//                         block barrier per K tile;
//   gemm_wgmma_ws_kernel  128 tokens x 128 rows, warp-specialized: a
//                         producer warpgroup issues bulk copies (the copy
//                         engine) into a ring of stages, and two consumer
//                         warpgroups meet it through full / empty
//                         mbarriers, never each other.
// In both, at most one wgmma group (two k16 steps) is left in flight while
// the next pair of steps is dequantized; a stage is reused only once every
// group that read it has completed.  Scales, zero points, split-K and the
// edge tile work as in gemm_mma.cu.
#include <algorithm>
#include <atomic>

#include "instances.h"
#include "qgemv_common.cuh"
#include "testing.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QG_WGMMA_DEVICE 1
#endif

namespace qgemv {
namespace {

// gemm_wgmma_kernel: kWgStages shared-memory stages, kWgAhead K tiles in
// flight (the stage of the previous tile may still be read by its last
// wgmma group).
constexpr int kWgWarps = 8;          // two warpgroups
constexpr int kWgStages = 4;
constexpr int kWgAhead = kWgStages - 2;

// The activation side of a stage: one token block x one K tile.
template <int kBits, int kTok>
struct WgLayout {
  static constexpr int kTileK = kBits == 4 ? 128 : 64;
  static constexpr int kWords = kBits == 4 ? 4 : 8;     // W of the transpose
  static constexpr int kUnitK = kWords * 8;              // k per transpose unit
  static constexpr int kXBytes = kTok * kTileK * 2;
};

template <int kBits, int kTok, int kRT>
struct WgTile : WgLayout<kBits, kTok> {
  static constexpr int kWSlot = kRT * 64;                // uint4 per warp: kRT x (r0, r1) x 32 lanes
  static constexpr int kWBytes = kWgWarps * kWSlot * 16;
  static constexpr int kStageBytes = WgLayout<kBits, kTok>::kXBytes + kWBytes;
  static constexpr int kSmemBytes = kWgStages * kStageBytes;
  static constexpr int kPanels = kWgWarps * kRT;         // 16-row panels per block
};

// ---------------------------------------------------------------------------
// wgmma wrappers (sm_90a).  A from registers (4 x b32, the m16n8k16 A
// fragment of this warp's 16 rows), B from shared memory through a
// descriptor, fp32 accumulators; scale-d = 1 (accumulate).
// ---------------------------------------------------------------------------
#ifdef QG_WGMMA_DEVICE
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Shared memory written by cp.async (generic proxy) is read by wgmma (async
// proxy): each writing thread fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// No-swizzle K-major descriptor: core matrices of 8 tokens x 16 bytes
// (128 contiguous bytes); the two core matrices of a k16 step lie kTok * 16
// bytes apart (leading-dimension offset), successive 8-token groups 128
// bytes apart (stride-dimension offset).
template <int kTok>
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr) {
  constexpr uint64_t kLbo = (kTok * 16) >> 4, kSbo = 128 >> 4;
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (kLbo << 16) | (kSbo << 32);
}

// wgmma_rs(d, a, desc, T{}): d += A(a) * B(desc), fp16 or bf16 inputs, for
// 64 or 128 tokens (the size of d).  The operand lists are regular: d[i] is
// %i, a[0..3] follow, then the descriptor and the scale-d flag.
#define QG_WGMMA_RS_N64(TY, CT)    \
  __device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, CT) { \
    asm volatile(                                                                         \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                           \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                        \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                           \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));                    \
  }
#define QG_WGMMA_RS_N128(TY, CT)    \
  __device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, CT) { \
    asm volatile(                                                                         \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                           \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                        \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                           \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));                    \
  }
QG_WGMMA_RS_N64("f16", __half)
QG_WGMMA_RS_N64("bf16", __nv_bfloat16)
QG_WGMMA_RS_N128("f16", __half)
QG_WGMMA_RS_N128("bf16", __nv_bfloat16)
#undef QG_WGMMA_RS_N64
#undef QG_WGMMA_RS_N128

// mbarriers and bulk copies (the warp-specialized kernel).
#include "mbarrier.cuh"
#endif  // QG_WGMMA_DEVICE

// x [M, K] (row stride ldx) -> xp: [token block][K tile][core column c8]
// [token / 8][token % 8][8 elements], zero past M and past K.  One thread per
// (token, transpose unit); consecutive threads take consecutive tokens, so a
// warp's 16-byte stores of one core column are contiguous.
template <typename T, int kBits, int kTok>
__global__ void permute_x_kernel(const T* __restrict__ x, int M, int Mpad, int K, int ldx, int ktiles,
                                 uint4* __restrict__ xp) {
  using Tile = WgLayout<kBits, kTok>;
  constexpr int W = Tile::kWords;
  constexpr int kUnitsPerTile = Tile::kTileK / Tile::kUnitK;
  const long units = static_cast<long>(ktiles) * kUnitsPerTile;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < units * Mpad;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const int m = static_cast<int>(idx % Mpad);
    const long u = idx / Mpad;
    uint32_t in[4 * W];
#pragma unroll
    for (int v = 0; v < W; ++v) {
      const long k = u * Tile::kUnitK + 8 * v;
      uint4 q = make_uint4(0u, 0u, 0u, 0u);
      if (m < M && k < K) q = __ldg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * ldx + k));
      in[4 * v] = q.x;
      in[4 * v + 1] = q.y;
      in[4 * v + 2] = q.z;
      in[4 * v + 3] = q.w;
    }
    const int kt = static_cast<int>(u / kUnitsPerTile), ut = static_cast<int>(u % kUnitsPerTile);
    const int mb = m / kTok, mr = m % kTok;
    unsigned char* base = reinterpret_cast<unsigned char*>(xp) +
                          (static_cast<size_t>(mb) * ktiles + kt) * Tile::kXBytes + mr * 16;  // row mr % 8 of group mr / 8
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const int c8 = ut * W + w;
      *reinterpret_cast<uint4*>(base + static_cast<size_t>(c8) * kTok * 16) =
          make_uint4(in[w], in[W + w], in[2 * W + w], in[3 * W + w]);
    }
  }
}

#ifdef QG_WGMMA_DEVICE
// The consumer side shared by both kernels: one warp's rows of kRT 64-row
// tiles, its accumulators, and the K-tile step.
template <typename T, int kBits, bool kGrouped, int kTok, int kRT>
struct WgMath {
  static constexpr int kTileK = WgLayout<kBits, kTok>::kTileK;
  static constexpr int kPairs = kTileK / 32;  // pairs of k16 steps per K tile, one wgmma group each
  float acc[kRT][kTok / 2];
  int rows0[kRT], rows1[kRT];  // this lane's rows g and g + 8 of each row tile (clamped into the panel)
  int gshift = 0, ng = 1;

  // Group scales and zero points of one K tile, loaded a tile ahead so that
  // their latency overlaps the previous tile (in the sweep this changed
  // nothing measurable).
  // Packed to save registers: pair j's scale in half j % 2 of s0[rt][j / 2],
  // its zero point in byte j of z0[rt] (rows g; s1, z1: rows g + 8).
  struct Scales {
    __half2 s0[kRT][(kPairs + 1) / 2], s1[kRT][(kPairs + 1) / 2];
    uint32_t z0[kRT], z1[kRT];
    __device__ __forceinline__ static __half pick(const __half2& h, int j) { return j % 2 ? h.y : h.x; }
  };

  __device__ __forceinline__ WgMath(const GemvParams& p, int g, const int (&prow0)[kRT], const int (&prows)[kRT]) {
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      rows0[rt] = prow0[rt] + min(g, prows[rt] - 1);
      rows1[rt] = prow0[rt] + min(g + 8, prows[rt] - 1);
#pragma unroll
      for (int i = 0; i < kTok / 2; ++i) acc[rt][i] = 0.f;
    }
    if constexpr (kGrouped) {
      gshift = 31 - __clz(p.group_size);
      ng = p.K >> gshift;
    }
  }

  // Past K (the edge tile) group indices are clamped; those weights meet
  // zero activations.
  __device__ __forceinline__ Scales scales(const GemvParams& p, int tile) const {
    Scales sc{};
    if constexpr (kGrouped) {
      const __half* s = static_cast<const __half*>(p.scales);
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) {
        sc.z0[rt] = sc.z1[rt] = 0x08080808u;
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          const int gi = min((tile * kTileK + 32 * j) >> gshift, ng - 1);
          const __half a = s[rows0[rt] * ng + gi], b = s[rows1[rt] * ng + gi];
          if (j % 2) {
            sc.s0[rt][j / 2].y = a;
            sc.s1[rt][j / 2].y = b;
          } else {
            sc.s0[rt][j / 2].x = a;
            sc.s1[rt][j / 2].x = b;
          }
          if (p.zeros != nullptr) {
            const uint32_t keep = ~(0xffu << (8 * j));
            sc.z0[rt] = (sc.z0[rt] & keep) | (static_cast<uint32_t>(p.zeros[rows0[rt] * ng + gi]) << (8 * j));
            sc.z1[rt] = (sc.z1[rt] & keep) | (static_cast<uint32_t>(p.zeros[rows1[rt] * ng + gi]) << (8 * j));
          }
        }
      }
    }
    return sc;
  }

  // One K tile.  xs: the tile's activations (core-matrix layout); w0 / w1:
  // this lane's weight words of rows r0 / r1 of each row tile.  after_first
  // runs once the first group is issued and every earlier group has
  // completed (the previous tile's stage is no longer read).
  template <typename F>
  __device__ __forceinline__ void tile(const unsigned char* xs, const uint4 (&w0)[kRT], const uint4 (&w1)[kRT],
                                       const Scales& sc, F&& after_first) {
    const uint32_t xaddr = smem_u32(xs);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      uint32_t a[2][kRT][4];
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) {
        if constexpr (kBits == 4) {
          const uint32_t u0 = word_of(w0[rt], j), u1 = word_of(w1[rt], j);
          const uint32_t zp0 = magic_zero_pair<T>(kGrouped ? (sc.z0[rt] >> (8 * j)) & 0xffu : 8u);
          const uint32_t zp1 = magic_zero_pair<T>(kGrouped ? (sc.z1[rt] >> (8 * j)) & 0xffu : 8u);
          if constexpr (kGrouped)
            int4_fragments<T, true>(u0, u1, zp0, magic_zero_pair_16<T>(zp0), zp1, magic_zero_pair_16<T>(zp1),
                                    a[0][rt], a[1][rt], Scales::pick(sc.s0[rt][j / 2], j),
                                    Scales::pick(sc.s1[rt][j / 2], j));
          else
            int4_fragments<T>(u0, u1, zp0, magic_zero_pair_16<T>(zp0), zp1, magic_zero_pair_16<T>(zp1), a[0][rt],
                              a[1][rt]);
        } else {
          const uint32_t u0[4] = {w0[rt].x, w0[rt].y, w0[rt].z, w0[rt].w};
          const uint32_t u1[4] = {w1[rt].x, w1[rt].y, w1[rt].z, w1[rt].w};
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            uint32_t d0[2], d1[2];
            dequant_int8_word<T>(u0[2 * j + s], d0);
            dequant_int8_word<T>(u1[2 * j + s], d1);
            a[s][rt][0] = d0[0]; a[s][rt][1] = d1[0]; a[s][rt][2] = d0[1]; a[s][rt][3] = d1[1];
          }
        }
      }
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int rt = 0; rt < kRT; ++rt)
          wgmma_rs(acc[rt], a[s][rt], wgmma_desc<kTok>(xaddr + (2 * j + s) * kTok * 32), T{});
      wgmma_commit();
      wgmma_wait<1>();
      if (j == 0) after_first();
    }
  }

  // partial: fp32 [splits, M, N] (this block writes split blockIdx.z), or
  // nullptr to store y (see store_fragments).
  template <typename Panels>
  __device__ __forceinline__ void store(const GemvParams& p, float* partial, int g, int t, const Panels& pn) const {
    float* part = partial ? partial + static_cast<size_t>(blockIdx.z) * p.M * p.N : nullptr;
    store_fragments<T, kGrouped, kRT, kTok / 8>(p, part, blockIdx.x * kTok, g, t, pn.prow0, pn.prows, pn.live,
                                                [&](int rt, int n, int i) { return acc[rt][4 * n + i]; });
  }
};

// Row tile rt of warpgroup wg = panels block_panel0 + (wg * kRT + rt) * 4
// + 0..3; warp wi of the warpgroup supplies panel + wi (clamped to the last
// panel; live says whether it exists).  base: the panel's first byte, whose
// K tile t (prows rows x 64 bytes) starts at base + t * tstride.
template <int kBits, int kRT>
struct WgPanels {
  int prow0[kRT], prows[kRT], tstride[kRT];
  bool live[kRT];
  const char* base[kRT];
  __device__ __forceinline__ WgPanels(const GemvParams& p, int block_panel0, int wg, int wi) {
    const int npanels = num_panels(p.N);
    const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      const int pan = block_panel0 + (wg * kRT + rt) * 4 + wi;
      live[rt] = pan < npanels;
      prow0[rt] = min(pan, npanels - 1) * kPanelRows;
      prows[rt] = min(kPanelRows, p.N - prow0[rt]);
      tstride[rt] = prows[rt] * kTileBytes;
      base[rt] = static_cast<const char*>(p.qweight) + static_cast<size_t>(prow0[rt]) * row_bytes;
    }
  }
};

// This lane's words of a stored edge tile in shared memory (rows at b0 and
// b1; layout as in gather_edge_words).
template <int kBits>
__device__ __forceinline__ void edge_words_smem(const unsigned char* b0, const unsigned char* b1, int t, int c,
                                                uint4& w0, uint4& w1) {
  gather_edge_words<kBits>(
      b0, b1, t, c, [](const unsigned char* a) { return *reinterpret_cast<const uint32_t*>(a); },
      [](const unsigned char* a) { return *reinterpret_cast<const uint4*>(a); }, w0, w1);
}

// Copy one token block's K tile of xp (kXBytes contiguous) into shared
// memory with 16-byte cp.async, threads 0 .. kThreads - 1.
template <int kXBytes, int kThreads>
__device__ __forceinline__ void copy_x_tile(unsigned char* dst, const unsigned char* src, int tid) {
#pragma unroll
  for (int i = 0; i < kXBytes / 16 / kThreads; ++i) {
    const int c = (i * kThreads + tid) * 16;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst + c)), "l"(src + c));
  }
}

// This lane's weight words of the edge tile (K % tile_k != 0), read
// directly: in the stored edge tile each row holds 16c bytes.
template <int kBits, int kRT>
__device__ __forceinline__ void edge_words(const GemvParams& p, const WgPanels<kBits, kRT>& pn, int nclean, int g,
                                          int t, uint64_t pol, uint4 (&w0)[kRT], uint4 (&w1)[kRT]) {
  constexpr int kTileK = kBits == 4 ? 128 : 64;
  const int c = min((p.Kp - nclean * kTileK) / (kBits == 4 ? 32 : 16), 4);
#pragma unroll
  for (int rt = 0; rt < kRT; ++rt) {
    const char* b0 = pn.base[rt] + nclean * pn.tstride[rt] + min(g, pn.prows[rt] - 1) * 16 * c;
    const char* b1 = pn.base[rt] + nclean * pn.tstride[rt] + min(g + 8, pn.prows[rt] - 1) * 16 * c;
    load_edge_words<kBits>(b0, b1, t, c, pol, w0[rt], w1[rt]);
  }
}
#endif  // QG_WGMMA_DEVICE

// Split-K (blockIdx.z) as in gemm_mma.cu: with more than one split, fp32
// partials go to partial[z][M][N] and reduce_splits adds them in order.
// The edge tile belongs to the last split.
//
// Kernel 1: all 8 warps copy (cp.async) and compute; one block barrier per
// K tile.
template <typename T, int kBits, bool kGrouped, int kTok, int kRT>
__global__ void __launch_bounds__(kWgWarps * 32, 1)
    gemm_wgmma_kernel(const GemvParams p, const uint4* __restrict__ xp, float* __restrict__ partial,
                      int tiles_per_split, int ktiles) {
#ifdef QG_WGMMA_DEVICE
  using Tile = WgTile<kBits, kTok, kRT>;
  constexpr int kTileK = Tile::kTileK;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint64_t pol = evict_first_policy();
  const int nclean = p.K / kTileK;
  const int tile0 = blockIdx.z * tiles_per_split;
  const int tile1 = min(nclean, tile0 + tiles_per_split);
  const WgPanels<kBits, kRT> pn(p, blockIdx.y * Tile::kPanels, warp >> 2, warp & 3);
  const unsigned char* xblk =
      reinterpret_cast<const unsigned char*>(xp) + static_cast<size_t>(blockIdx.x) * ktiles * Tile::kXBytes;
  const char* src0[kRT];
  const char* src1[kRT];
#pragma unroll
  for (int rt = 0; rt < kRT; ++rt) {
    src0[rt] = pn.base[rt] + min(g, pn.prows[rt] - 1) * kTileBytes + 16 * t;
    src1[rt] = pn.base[rt] + min(g + 8, pn.prows[rt] - 1) * kTileBytes + 16 * t;
  }

  auto issue = [&](int tile) {
    if (tile < tile1) {
      unsigned char* st = smem + (tile % kWgStages) * Tile::kStageBytes;
      copy_x_tile<Tile::kXBytes, kWgWarps * 32>(st, xblk + static_cast<size_t>(tile) * Tile::kXBytes, threadIdx.x);
      uint4* ws = reinterpret_cast<uint4*>(st + Tile::kXBytes) + warp * Tile::kWSlot + lane;
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) {
        cp_async_16(ws + rt * 64, src0[rt] + static_cast<size_t>(tile) * pn.tstride[rt], pol);
        cp_async_16(ws + rt * 64 + 32, src1[rt] + static_cast<size_t>(tile) * pn.tstride[rt], pol);
      }
    }
    cp_async_commit();  // always: keeps the group count uniform
  };

  WgMath<T, kBits, kGrouped, kTok, kRT> math(p, g, pn.prow0, pn.prows);
  auto none = [] {};
#pragma unroll
  for (int i = 0; i < kWgAhead; ++i) issue(tile0 + i);
  auto sc = math.scales(p, tile0);
  for (int tile = tile0; tile < tile1; ++tile) {
    cp_async_wait<kWgAhead - 1>();
    fence_proxy_async();
    __syncthreads();  // tile visible; the stage of tile - 2 is no longer read by any wgmma
    issue(tile + kWgAhead);
    const auto next = math.scales(p, min(tile + 1, tile1 - 1));
    const unsigned char* st = smem + (tile % kWgStages) * Tile::kStageBytes;
    const uint4* ws = reinterpret_cast<const uint4*>(st + Tile::kXBytes) + warp * Tile::kWSlot + lane;
    uint4 w0[kRT], w1[kRT];
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      w0[rt] = ws[rt * 64];
      w1[rt] = ws[rt * 64 + 32];
    }
    math.tile(st, w0, w1, sc, none);
    sc = next;
  }

  if (blockIdx.z + 1 == gridDim.z && nclean * kTileK < p.Kp) {
    wgmma_wait<0>();
    cp_async_wait<0>();
    __syncthreads();  // no stage is read any more
    copy_x_tile<Tile::kXBytes, kWgWarps * 32>(smem, xblk + static_cast<size_t>(nclean) * Tile::kXBytes,
                                              threadIdx.x);
    cp_async_commit();
    uint4 w0[kRT], w1[kRT];
    edge_words<kBits, kRT>(p, pn, nclean, g, t, pol, w0, w1);
    const auto esc = math.scales(p, nclean);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    math.tile(smem, w0, w1, esc, none);
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
  math.store(p, partial, g, t, pn);
#else
  (void)p; (void)xp; (void)partial; (void)tiles_per_split; (void)ktiles;
  __trap();  // built without sm_90a: the host never launches this (Instance::supported)
#endif
}

// Kernel 2, warp-specialized: warps 0-7 (two warpgroups) compute; warpgroup
// 2 produces, its lanes issuing the bulk copies (the copy engine) of each
// stage, one copy per lane:
// the token block's K tile of xp (contiguous) and each panel's K tile
// (prows x 64 contiguous bytes).  Stages cycle through full / empty
// mbarriers, so the two consumer warpgroups never wait for each other.
// Registers move from the producer warpgroup to the consumers (setmaxnreg):
// 56 + 2 x 224 per thread of a warpgroup fit the 64K register file.
constexpr int kWsConsumerWarps = 8;
constexpr int kWsProducerRegs = 56, kWsConsumerRegs = 224;

// A stage holds kTilesPerStage consecutive K tiles: one token block's tiles
// are adjacent in xp, and so are one panel's, so a stage still takes one bulk
// copy per panel plus one for the activations.  The copy engine accepts on
// the order of one small copy per 60-100 cycles per SM; with one K tile per
// stage the int8 tiles (half an int4 tile's tensor work) and the 64-token
// int4 blocks were bound by that.  Two tiles per stage where one tile's
// stage is at most 32 KB; stages: as many as fit in 220 KB, at most 6.
template <int kBits, int kTok, int kRT>
struct WsTile : WgLayout<kBits, kTok> {
  static constexpr int kPanels = kWsConsumerWarps * kRT;
  static constexpr int kPanelBytes = kPanelRows * kTileBytes;  // one panel's K tile
  static constexpr int kTilesPerStage = WgLayout<kBits, kTok>::kXBytes + kPanels * kPanelBytes <= 32768 ? 2 : 1;
  static constexpr int kXStageBytes = kTilesPerStage * WgLayout<kBits, kTok>::kXBytes;
  static constexpr int kStageBytes = kXStageBytes + kTilesPerStage * kPanels * kPanelBytes;
  static constexpr int kStages = std::min(6, 220 * 1024 / kStageBytes);
  static constexpr int kBarOffset = kStages * kStageBytes;
  static constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8;
};

template <typename T, int kBits, bool kGrouped, int kTok, int kRT>
__global__ void __launch_bounds__((kWsConsumerWarps + 4) * 32, 1)
    gemm_wgmma_ws_kernel(const GemvParams p, const uint4* __restrict__ xp, float* __restrict__ partial,
                         int tiles_per_split, int ktiles) {
#ifdef QG_WGMMA_DEVICE
  using Tile = WsTile<kBits, kTok, kRT>;
  constexpr int kStages = Tile::kStages;
  constexpr int kTileK = Tile::kTileK;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Tile::kBarOffset);
  uint64_t* empty = full + kStages;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int nclean = p.K / kTileK;
  const int tile0 = blockIdx.z * tiles_per_split;
  const int tile1 = min(nclean, tile0 + tiles_per_split);
  // The edge tile (K % tile_k != 0) belongs to the last split; its stored
  // rows hold 16 * edge_c bytes (edge_c int4 sub-tiles or int8 16-byte words).
  const bool edge = blockIdx.z + 1 == gridDim.z && nclean * kTileK < p.Kp;
  const int edge_c = min((p.Kp - nclean * kTileK) / (kBits == 4 ? 32 : 16), 4);
  const unsigned char* xblk =
      reinterpret_cast<const unsigned char*>(xp) + static_cast<size_t>(blockIdx.x) * ktiles * Tile::kXBytes;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kWsConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp >= kWsConsumerWarps) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kWsProducerRegs));
    // One lane per copy: lane q < kPanels copies panel q's K tile, lane 31
    // the activations (one thread issuing them all in turn was the
    // bottleneck: a bulk copy takes on the order of 100 cycles to issue).
    static_assert(Tile::kPanels < 32, "one producer lane per panel");
    if (warp == kWsConsumerWarps) {
      const uint64_t pol = evict_first_policy();
      const int npanels = num_panels(p.N);
      const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
      const int pan = min(static_cast<int>(blockIdx.y) * Tile::kPanels + min(lane, Tile::kPanels - 1), npanels - 1);
      const int prows = min(kPanelRows, p.N - pan * kPanelRows);
      const char* wsrc = static_cast<const char*>(p.qweight) + static_cast<size_t>(pan) * kPanelRows * row_bytes;
      // The edge tile (last split, K % tile_k != 0) goes through the ring as
      // one more stage: each panel's stored edge tile is prows rows of 16c
      // contiguous bytes.
      const int nstages = (tile1 - tile0 + Tile::kTilesPerStage - 1) / Tile::kTilesPerStage + (edge ? 1 : 0);
#pragma unroll 1
      for (int tile = tile0, i = 0; i < nstages; ++i) {
        const int s = i % kStages;
        const bool is_edge = tile >= tile1;
        const int nt = is_edge ? 1 : min(Tile::kTilesPerStage, tile1 - tile);
        if (i >= kStages) mbar_wait(&empty[s], (i / kStages - 1) & 1);
        unsigned char* st = smem + s * Tile::kStageBytes;
        const uint32_t wbytes = is_edge ? prows * 16 * edge_c : nt * prows * kTileBytes;
        uint32_t all = lane < Tile::kPanels ? wbytes : 0;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) all += __shfl_xor_sync(0xffffffffu, all, off);
        if (lane == 0) mbar_expect_tx(&full[s], all + nt * Tile::kXBytes);
        __syncwarp();
        if (lane == 31)
          bulk_copy(st, xblk + static_cast<size_t>(tile) * Tile::kXBytes, nt * Tile::kXBytes, &full[s]);
        else if (lane < Tile::kPanels)
          bulk_copy(st + Tile::kXStageBytes + lane * Tile::kTilesPerStage * Tile::kPanelBytes,
                    wsrc + static_cast<size_t>(tile) * prows * kTileBytes, wbytes, &full[s], pol);
        tile += nt;
      }
    }
  } else {  // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kWsConsumerRegs));
    const int wg = warp >> 2, wi = warp & 3;
    const WgPanels<kBits, kRT> pn(p, blockIdx.y * Tile::kPanels, wg, wi);
    WgMath<T, kBits, kGrouped, kTok, kRT> math(p, g, pn.prow0, pn.prows);
    // Offsets of this lane's 16 bytes of rows g and g + 8 in a stage's first
    // K tile of each panel (tile u of the stage: + u * tstride).
    int off0[kRT], off1[kRT];
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      const int q = (wg * kRT + rt) * 4 + wi;
      const int w = Tile::kXStageBytes + q * Tile::kTilesPerStage * Tile::kPanelBytes + 16 * t;
      off0[rt] = w + min(g, pn.prows[rt] - 1) * kTileBytes;
      off1[rt] = w + min(g + 8, pn.prows[rt] - 1) * kTileBytes;
    }
    // Offsets of rows g and g + 8 in each panel's stored edge tile.
    int eoff0[kRT], eoff1[kRT];
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      const int q = (wg * kRT + rt) * 4 + wi;
      const int w = Tile::kXStageBytes + q * Tile::kTilesPerStage * Tile::kPanelBytes;
      eoff0[rt] = w + min(g, pn.prows[rt] - 1) * 16 * edge_c;
      eoff1[rt] = w + min(g + 8, pn.prows[rt] - 1) * 16 * edge_c;
    }
    const int nstages = (tile1 - tile0 + Tile::kTilesPerStage - 1) / Tile::kTilesPerStage + (edge ? 1 : 0);
    const int last_tile = edge ? nclean : tile1 - 1;
    auto sc = math.scales(p, tile0);
    for (int tile = tile0, i = 0; i < nstages; ++i) {
      const int s = i % kStages;
      const bool is_edge = tile >= tile1;
      const int nt = is_edge ? 1 : min(Tile::kTilesPerStage, tile1 - tile);
      mbar_wait(&full[s], (i / kStages) & 1);
      const unsigned char* st = smem + s * Tile::kStageBytes;
#pragma unroll
      for (int u = 0; u < Tile::kTilesPerStage; ++u) {
        if (u >= nt) break;
        const auto next = math.scales(p, min(tile + u + 1, last_tile));
        uint4 w0[kRT], w1[kRT];
#pragma unroll
        for (int rt = 0; rt < kRT; ++rt) {
          if (is_edge) {
            edge_words_smem<kBits>(st + eoff0[rt], st + eoff1[rt], t, edge_c, w0[rt], w1[rt]);
          } else {
            w0[rt] = *reinterpret_cast<const uint4*>(st + off0[rt] + u * pn.tstride[rt]);
            w1[rt] = *reinterpret_cast<const uint4*>(st + off1[rt] + u * pn.tstride[rt]);
          }
        }
        // Once the first group of a stage is issued, every group of the
        // previous stage has completed: it goes back to the producer.
        math.tile(st + u * Tile::kXBytes, w0, w1, sc, [&] {
          if (u == 0 && i > 0 && lane == 0) mbar_arrive(&empty[(i - 1) % kStages]);
        });
        sc = next;
      }
      tile += nt;
    }
    wgmma_wait<0>();
    math.store(p, partial, g, t, pn);
  }
#else
  (void)p; (void)xp; (void)partial; (void)tiles_per_split; (void)ktiles;
  __trap();  // built without sm_90a: the host never launches this (Instance::supported)
#endif
}

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------

// Block shapes (kTok tokens x kRT row tiles of 64 per warpgroup, kernel),
// selected by wgmma_shape(); g_shape forces one (testing::set_wgmma_shape).
// Measured on the H200 (BENCHMARKS.md, prefill; 3 weight shapes x int8 /
// int4 / int4 g128, 17..2048 tokens) against 128 x 128, 128 x 256 (both
// kernels) and 64 x 256 warp-specialized: 64 x 256 on kernel 1 is the best
// or within 4-12% of it at 48-64 tokens; 128 x 128 warp-specialized at
// 96-512 tokens (within 1-7% of the best, geometric mean per format).
struct Shape {
  int tok, rt, ws;  // ws: the warp-specialized kernel
};
constexpr Shape kShapes[] = {{64, 2, 0}, {128, 1, 1}};
std::atomic<int> g_shape{-1};

Shape wgmma_shape(int M) {
  const int forced = g_shape.load();
  if (forced >= 0) return kShapes[forced];
  return M <= 64 ? kShapes[0] : kShapes[1];
}

// The kernel of a shape (if constexpr: only that one is instantiated).
template <typename T, int kBits, bool kGrouped, int kTok, int kRT, int kWs>
constexpr auto shape_kernel() {
  if constexpr (kWs == 1)
    return gemm_wgmma_ws_kernel<T, kBits, kGrouped, kTok, kRT>;
  else
    return gemm_wgmma_kernel<T, kBits, kGrouped, kTok, kRT>;
}

template <typename T, int kBits, bool kGrouped, int kTok, int kRT, int kWs>
struct Instance {
  using Tile = std::conditional_t<kWs == 1, WsTile<kBits, kTok, kRT>, WgTile<kBits, kTok, kRT>>;
  static constexpr int kThreads = kWs == 1 ? (kWsConsumerWarps + 4) * 32 : kWgWarps * 32;
  static constexpr auto kernel = shape_kernel<T, kBits, kGrouped, kTok, kRT, kWs>();

  // This build holds sm_90a code for the kernel and the current device is
  // cc 9.0 (sm_90a machine code runs there only; elsewhere the kernel is the
  // sm_80 stub that traps).  Also raises the kernel's shared-memory limit on
  // that device.  Asked once per (instance, device): a process may drive an
  // H100 and an A100.
  static bool supported() {
    constexpr int kMaxDevices = 64;
    static std::atomic<int> state[kMaxDevices];  // 0 unknown, 1 yes, 2 no
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    if (dev < 0 || dev >= kMaxDevices) return false;
    int s = state[dev].load();
    if (s == 0) {
      cudaFuncAttributes attr{};
      int major = 0, minor = 0;
      const bool ok =
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
          minor == 0 && cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion == 90 &&
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes) ==
              cudaSuccess;
      if (!ok) cudaGetLastError();  // clear a failed query
      s = ok ? 1 : 2;
      state[dev].store(s);
    }
    return s == 1;
  }

  static int resident_blocks() {  // per instance and device
    static std::atomic<int> cache[kMaxDevices] = {};
    return per_device(cache, [] {
      int n = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, Tile::kSmemBytes) != cudaSuccess)
        n = 1;
      return n > 0 ? n : 1;
    });
  }

  static int ktiles(const GemvParams& p) { return (p.Kp + Tile::kTileK - 1) / Tile::kTileK; }
  static int mpad(const GemvParams& p) { return (p.M + kTok - 1) / kTok * kTok; }

  static WgmmaPlan plan(const GemvParams& p) {
    WgmmaPlan pl{};
    pl.ok = supported();
    if (!pl.ok) return pl;
    pl.xperm_bytes = static_cast<size_t>(mpad(p)) * ktiles(p) * Tile::kTileK * 2;
    const int slots = std::max(resident_blocks(), 1) * std::max(device_sm_count(), 1);
    const long blocks = static_cast<long>(mpad(p) / kTok) * ((num_panels(p.N) + Tile::kPanels - 1) / Tile::kPanels);
    // One block per SM: splits that overshoot one wave would leave most of
    // a second wave idle, so round down (floor of slots / blocks).
    pl.splits = plan_splits(slots, blocks, p.K / Tile::kTileK, /*round_up=*/false);
    return pl;
  }

  static Status launch(const GemvParams& p, void* xperm, float* partial, int splits, cudaStream_t stream) {
    if (!supported()) return Status::kNoKernel;
    const int row_blocks = (num_panels(p.N) + Tile::kPanels - 1) / Tile::kPanels;
    if (row_blocks > 65535) return Status::kBadShape;
    const int kt = ktiles(p), mp = mpad(p);
    {
      constexpr int kUnitsPerTile = Tile::kTileK / Tile::kUnitK;
      const long work = static_cast<long>(kt) * kUnitsPerTile * mp;
      const int blocks = static_cast<int>(std::min<long>((work + 255) / 256, 8L * device_sm_count() + 8));
      permute_x_kernel<T, kBits, kTok><<<blocks, 256, 0, stream>>>(
          static_cast<const T*>(p.x), p.M, mp, p.K, p.ldx, kt, static_cast<uint4*>(xperm));
      if (cudaGetLastError() != cudaSuccess) return Status::kLaunchFailed;
    }
    int per = 0;
    splits = split_tiles(p.K / Tile::kTileK, splits, partial != nullptr, &per);
    const dim3 grid(mp / kTok, row_blocks, splits);
    kernel<<<grid, kThreads, Tile::kSmemBytes, stream>>>(p, static_cast<const uint4*>(xperm),
                                                               splits > 1 ? partial : nullptr, per, kt);
    if (cudaGetLastError() != cudaSuccess) return Status::kLaunchFailed;
    return splits > 1 ? reduce_splits(p, partial, splits, stream) : Status::kOk;
  }
};

// The one wgmma dispatch: (activation type, format, block shape) -> a row of
// QGEMV_WGMMA_INSTANCES (instances.h); plan_out != nullptr only plans.
Status run_wgmma(const GemvParams& p, int bits, void* xperm, float* partial, int splits, WgmmaPlan* plan_out,
                 cudaStream_t stream) {
  const bool grouped = p.group_size != 0;
  const Shape s = wgmma_shape(p.M);
#define QGEMV_RUN(T, B, GR, TOK, RT, WS)                 \
  {                                                      \
    using I = Instance<T, B, GR, TOK, RT, WS>;           \
    if (plan_out != nullptr) {                           \
      *plan_out = I::plan(p);                            \
      return Status::kOk;                                \
    }                                                    \
    return I::launch(p, xperm, partial, splits, stream); \
  }
#define QGEMV_ROW(B, GR, TOK, RT, WS)                                                \
  if (bits == B && grouped == GR && s.tok == TOK && s.rt == RT && s.ws == WS) {      \
    if (p.act == ActType::kHalf) QGEMV_RUN(__half, B, GR, TOK, RT, WS)               \
    if (p.act == ActType::kBFloat16) QGEMV_RUN(__nv_bfloat16, B, GR, TOK, RT, WS)    \
    return Status::kNoKernel;                                                        \
  }
  QGEMV_WGMMA_INSTANCES(QGEMV_ROW)
#undef QGEMV_ROW
#undef QGEMV_RUN
  return Status::kNoKernel;
}

}  // namespace

bool wgmma_supported() { return Instance<__half, 4, false, 64, 2, 0>::supported(); }

namespace testing {
void set_wgmma_shape(int shape) { g_shape.store(shape); }
int wgmma_shape_count() { return static_cast<int>(sizeof(kShapes) / sizeof(kShapes[0])); }
}  // namespace testing

WgmmaPlan wgmma_plan(const GemvParams& p, int bits) {
  WgmmaPlan pl{};
  const Status st = bits == 4 ? check_int4_gemm(p) : bits == 8 ? check_int8_gemm(p) : Status::kNoKernel;
  if (st == Status::kOk) run_wgmma(p, bits, nullptr, nullptr, 1, &pl, nullptr);
  return pl;
}

Status wgmma_int4(const GemvParams& p, void* xperm, float* partial, int splits, cudaStream_t stream) {
  const Status st = check_int4_gemm(p);
  return st != Status::kOk ? st : run_wgmma(p, 4, xperm, partial, splits, nullptr, stream);
}

Status wgmma_int8(const GemvParams& p, void* xperm, float* partial, int splits, cudaStream_t stream) {
  const Status st = check_int8_gemm(p);
  return st != Status::kOk ? st : run_wgmma(p, 8, xperm, partial, splits, nullptr, stream);
}

}  // namespace qgemv
