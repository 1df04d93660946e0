// Tiled weight-only GEMM for prefill (M > 16 tokens) on tensor cores.
//
// The GEMV kernels (gemv_mma.cuh) serve at most 16 tokens per weight read;
// past that the dispatch used to run them once per 16-token chunk (reading
// the weight again for every chunk) or to dequantize into a dense weight for
// cuBLAS (writing and re-reading N x K x 2 bytes).  This kernel reads the
// packed weight once per 32 or 64 tokens and dequantizes it in registers.
// Measured on the H200 (BENCHMARKS.md, prefill): 0.58-0.94x the time of
// fp16 cuBLAS at 17-32 tokens; bound by the mma.sync rate from about 64.
//
// Block tile: 128 output rows x 32 or 64 tokens (kNT = 4 or 8 n-tiles,
// whichever pads M less: gemm_tokens), 4 warps.  Warp w owns two 16-row
// panels (kGemmRT row tiles, the A operand of mma.m16n8k16) and all the
// block's tokens (8-token n-tiles, the B operand): up to 64 fp32
// accumulators per lane.  K runs in tiles of 128 (int4) or 64 (int8) k, the GEMV's tile, with
// the same per-lane ownership of k (see gemv_mma.cuh): lane t of a quad holds
// the weight words of k 32j + 8t .. +7 (int4 sub-tile j) or 16t .. +15 (int8),
// so it reads exactly those activations.
//
// Pipeline (kGemmStages deep, one cp.async group per K tile):
//   * the block's tokens x tile_k activations go to shared memory (all threads
//     copy, 16 bytes each; rows padded so that a quarter-warp's 16-byte reads
//     of 2 tokens x 64 contiguous bytes hit distinct banks);
//   * each warp copies its own panels' weight words into a per-lane slot
//     (L1 bypassed, L2 evict-first), as in the GEMV ring.
//   One barrier per K tile makes the activations visible and frees the slot
//   that the next copy overwrites.
//
// Scales: per channel (int8, int4) they multiply the fp32 sums once at the
// end, so the products (q - z) x are exact as in the GEMV.  Group-wise they
// are applied to the dequantized weights before the MMA, w = (q - z) * s
// rounded once to the activation type (fp16: one HMUL2, exact product
// rounded once; bf16: through fp32, rounded once), which is what the
// dequantize + cuBLAS path computes too.  Per-group fp32 partial sums, as
// in the GEMV, would double the accumulator registers.  The group size and zero points are runtime values
// here (one instance for all group formats): the per-tile metadata is a few
// loads against 128 MMAs per warp.
//
// Split-K: when the grid is under one wave of resident blocks, blockIdx.z
// splits the K tiles (up to 8 ways, at least 8 tiles each) and a second
// kernel adds the fp32 partials in split order (deterministic).
//
// Edges: activation rows past M are zero-filled (never stored); panels past
// N read the last panel (never stored); the K tile that reaches past K (K % tile_k
// != 0) is run once after the loop with its activations zero-filled past K
// and its weight words read directly (the stored edge tile is shorter).
#include <algorithm>

#include "instances.h"
#include "qgemv_common.cuh"

namespace qgemv {
namespace {

constexpr int kGemmWarps = 4;
constexpr int kGemmRT = 2;                                  // 16-row panels per warp
constexpr int kGemmPanels = kGemmWarps * kGemmRT;           // panels per block (128 rows)
constexpr int kGemmStages = tuning::kGemmStages;  // see tuning.h

// kNT: 8-token n-tiles per block (4 or 8: 32 or 64 tokens).
template <int kBits, int kNT>
struct GemmTile {
  static constexpr int kTokens = kNT * 8;
  static constexpr int kTileK = kBits == 4 ? 128 : 64;
  // Shared-memory row of one token's tile_k activations, padded: a
  // quarter-warp reads 2 tokens x 64 contiguous bytes (int4) or 2 x 4 x 16
  // bytes 32 apart (int8); a pad of 64 (int4) or 16 (int8) bytes puts the
  // second token on the other banks.
  static constexpr int kXStride = kTileK * 2 + (kBits == 4 ? 64 : 16);
  static constexpr int kXBytes = kTokens * kXStride;
  static constexpr int kWSlot = kGemmRT * 64;  // uint4 per warp: kGemmRT x (r0, r1) x 32 lanes
  static constexpr int kWBytes = kGemmWarps * kWSlot * 16;
  static constexpr int kStageBytes = kXBytes + kWBytes;
  static constexpr int kSmemBytes = kGemmStages * kStageBytes;
};

// Activation copy (16 bytes, L2 only, default eviction: every row block of
// the grid reads the same activations).  src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async_act(void* smem_dst, const void* gmem_src, int src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}

template <typename T, int kBits, bool kGrouped, int kNT>
struct GemmWarp {
  using Tile = GemmTile<kBits, kNT>;
  const GemvParams& p;
  int g, t;
  int rows0[kGemmRT], rows1[kGemmRT];  // this lane's two rows of each panel (clamped into the panel)
  int gshift = 0;                      // log2(group size)
  float acc[kGemmRT][kNT][4];

  __device__ __forceinline__ GemmWarp(const GemvParams& params, int lane, const int (&prow0)[kGemmRT],
                                      const int (&prows)[kGemmRT])
      : p(params) {
    g = lane >> 2;
    t = lane & 3;
#pragma unroll
    for (int rt = 0; rt < kGemmRT; ++rt) {
      rows0[rt] = prow0[rt] + min(g, prows[rt] - 1);
      rows1[rt] = prow0[rt] + min(g + 8, prows[rt] - 1);
    }
    if constexpr (kGrouped) gshift = 31 - __clz(p.group_size);
#pragma unroll
    for (int rt = 0; rt < kGemmRT; ++rt)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][n][i] = 0.f;
  }

  // One K tile: xs is the tile's activations in shared memory, w0 / w1 this
  // lane's words of rows r0 / r1 of each panel; c = int4 sub-tiles present
  // (4 except in the edge tile).
  template <bool kEdge>
  __device__ __forceinline__ void tile(const unsigned char* xs, int tile_idx, const uint4 (&w0)[kGemmRT],
                                       const uint4 (&w1)[kGemmRT], int c) {
    if constexpr (kBits == 4) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (kEdge && j >= c) break;
        uint32_t s0[kGemmRT][4], s1[kGemmRT][4];  // MMA A fragments of steps 0 and 1
#pragma unroll
        for (int rt = 0; rt < kGemmRT; ++rt) {
          const uint32_t u0 = word_of(w0[rt], j), u1 = word_of(w1[rt], j);
          uint32_t z0 = 8, z1 = 8;
          __half sc0 = __float2half(1.f), sc1 = sc0;
          if constexpr (kGrouped) {
            const int ng = p.K >> gshift;
            const int gi = (tile_idx * Tile::kTileK + 32 * j) >> gshift;
            const __half* sc = static_cast<const __half*>(p.scales);
            sc0 = sc[rows0[rt] * ng + gi];
            sc1 = sc[rows1[rt] * ng + gi];
            if (p.zeros != nullptr) {
              z0 = p.zeros[rows0[rt] * ng + gi];
              z1 = p.zeros[rows1[rt] * ng + gi];
            }
          }
          const uint32_t zp0 = magic_zero_pair<T>(z0), zp1 = magic_zero_pair<T>(z1);
          int4_fragments<T, kGrouped>(u0, u1, zp0, magic_zero_pair_16<T>(zp0), zp1, magic_zero_pair_16<T>(zp1),
                                      s0[rt], s1[rt], sc0, sc1);
        }
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          const uint4 xv =
              *reinterpret_cast<const uint4*>(xs + (n * 8 + g) * Tile::kXStride + (32 * j + 8 * t) * 2);
#pragma unroll
          for (int rt = 0; rt < kGemmRT; ++rt) {
            ActTraits<T>::mma(acc[rt][n], s0[rt], xv.x, xv.y);
            ActTraits<T>::mma(acc[rt][n], s1[rt], xv.z, xv.w);
          }
        }
      }
    } else {
      (void)tile_idx;
      (void)c;  // int8 edge words past K are zero, and so are their activations
      uint32_t a[kGemmRT][4][4];  // [panel][step j][fragment]
#pragma unroll
      for (int rt = 0; rt < kGemmRT; ++rt) int8_fragments<T>(w0[rt], w1[rt], a[rt]);
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const unsigned char* xr = xs + (n * 8 + g) * Tile::kXStride + 32 * t;
        const uint4 xa = *reinterpret_cast<const uint4*>(xr);
        const uint4 xb = *reinterpret_cast<const uint4*>(xr + 16);
        const uint32_t xp[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int rt = 0; rt < kGemmRT; ++rt)
#pragma unroll
          for (int j = 0; j < 4; ++j) ActTraits<T>::mma(acc[rt][n], a[rt][j], xp[2 * j], xp[2 * j + 1]);
      }
    }
  }
};

// Split-K (blockIdx.z): split z runs K tiles [z * tiles_per_split, ...) and,
// when there is more than one split, writes fp32 partial sums to
// partial[z][M][N] (reduced in a fixed order by reduce_splits_kernel, so the
// result does not depend on scheduling).  The edge tile belongs to the last
// split.
template <typename T, int kBits, bool kGrouped, int kNT>
__global__ void __launch_bounds__(kGemmWarps * 32, tuning::kGemmMinBlocks)
    gemm_mma_kernel(const GemvParams p, float* __restrict__ partial, int tiles_per_split) {
  using Tile = GemmTile<kBits, kNT>;
  constexpr int kTileK = Tile::kTileK;
  constexpr int kTokens = Tile::kTokens;
  constexpr int kChunks = kTileK / 8;  // 16-byte activation chunks per token row of a tile
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * kTokens;
  const int npanels = num_panels(p.N);
  const uint64_t pol = evict_first_policy();
  const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
  const int nclean = p.K / kTileK;
  const int tile0 = blockIdx.z * tiles_per_split;
  const int tile1 = min(nclean, tile0 + tiles_per_split);
  const bool last_split = blockIdx.z + 1 == gridDim.z;

  // This warp's panels (clamped to the last one; see `live` for the stores).
  int prow0[kGemmRT], prows[kGemmRT], tstride[kGemmRT];
  bool live[kGemmRT];
  const char* src0[kGemmRT];
  const char* src1[kGemmRT];
#pragma unroll
  for (int rt = 0; rt < kGemmRT; ++rt) {
    const int pan = (blockIdx.y * kGemmWarps + warp) * kGemmRT + rt;
    live[rt] = pan < npanels;
    prow0[rt] = min(pan, npanels - 1) * kPanelRows;
    prows[rt] = min(kPanelRows, p.N - prow0[rt]);
    tstride[rt] = prows[rt] * kTileBytes;
    const char* panel = static_cast<const char*>(p.qweight) + static_cast<size_t>(prow0[rt]) * row_bytes;
    src0[rt] = panel + min(g, prows[rt] - 1) * kTileBytes + 16 * t;
    src1[rt] = panel + min(g + 8, prows[rt] - 1) * kTileBytes + 16 * t;
  }
  const T* x = static_cast<const T*>(p.x);

  // Activation rows past M are zero-filled, not copied from a clamped row:
  // dozens of copies of one row per tile contended for the same L2 lines
  // (first H200 run: M = 17 took longer than M = 64).
  auto copy_x = [&](unsigned char* xs, int k0, int c) {
    const int row = c / kChunks, ch = c % kChunks;
    const int tok = m0 + row;
    const bool in = tok < p.M && k0 + ch * 8 < p.K;  // K % 8 == 0: a chunk is wholly in or out
    cp_async_act(xs + row * Tile::kXStride + ch * 16,
                 in ? x + static_cast<size_t>(tok) * p.ldx + k0 + ch * 8 : x, in ? 16 : 0);
  };
  auto issue = [&](int tile) {
    if (tile < tile1) {
      unsigned char* st = smem + (tile % kGemmStages) * Tile::kStageBytes;
#pragma unroll
      for (int i = 0; i < kTokens * kChunks / (kGemmWarps * 32); ++i)
        copy_x(st, tile * kTileK, i * kGemmWarps * 32 + threadIdx.x);
      uint4* ws = reinterpret_cast<uint4*>(st + Tile::kXBytes) + warp * Tile::kWSlot + lane;
#pragma unroll
      for (int rt = 0; rt < kGemmRT; ++rt) {
        cp_async_16(ws + rt * 64, src0[rt] + static_cast<size_t>(tile) * tstride[rt], pol);
        cp_async_16(ws + rt * 64 + 32, src1[rt] + static_cast<size_t>(tile) * tstride[rt], pol);
      }
    }
    cp_async_commit();  // always: keeps the group count uniform
  };

  GemmWarp<T, kBits, kGrouped, kNT> s(p, lane, prow0, prows);
#pragma unroll
  for (int i = 0; i < kGemmStages - 1; ++i) issue(tile0 + i);
  for (int tile = tile0; tile < tile1; ++tile) {
    cp_async_wait<kGemmStages - 2>();
    __syncthreads();  // tile's activations visible; slot (tile - 1) free for the copy below
    issue(tile + kGemmStages - 1);
    const unsigned char* st = smem + (tile % kGemmStages) * Tile::kStageBytes;
    const uint4* ws = reinterpret_cast<const uint4*>(st + Tile::kXBytes) + warp * Tile::kWSlot + lane;
    uint4 w0[kGemmRT], w1[kGemmRT];
#pragma unroll
    for (int rt = 0; rt < kGemmRT; ++rt) {
      w0[rt] = ws[rt * 64];
      w1[rt] = ws[rt * 64 + 32];
    }
    s.template tile<false>(st + 0, tile, w0, w1, 4);
  }

  // The edge tile: activations past K are zero-filled, weight words read
  // directly (in the stored edge tile each row holds 16c bytes; int4 lane t's
  // word j sits at word t*c + j, int8 lanes t < c hold 16 bytes at 16t).
  if (last_split && nclean * kTileK < p.Kp) {
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring
    const int k0 = nclean * kTileK;
    for (int c = threadIdx.x; c < kTokens * kChunks; c += kGemmWarps * 32) copy_x(smem, k0, c);
    cp_async_commit();
    const int left = p.Kp - k0;
    const int c = min(left / (kBits == 4 ? 32 : 16), 4);
    uint4 w0[kGemmRT], w1[kGemmRT];
#pragma unroll
    for (int rt = 0; rt < kGemmRT; ++rt) {
      const char* panel = static_cast<const char*>(p.qweight) + static_cast<size_t>(prow0[rt]) * row_bytes;
      const char* b0 = panel + nclean * tstride[rt] + min(g, prows[rt] - 1) * 16 * c;
      const char* b1 = panel + nclean * tstride[rt] + min(g + 8, prows[rt] - 1) * 16 * c;
      load_edge_words<kBits>(b0, b1, t, c, pol, w0[rt], w1[rt]);
    }
    cp_async_wait<0>();
    __syncthreads();
    s.template tile<true>(smem, nclean, w0, w1, c);
  }
  cp_async_wait<0>();

  float* part = partial ? partial + static_cast<size_t>(blockIdx.z) * p.M * p.N : nullptr;
  store_fragments<T, kGrouped, kGemmRT, kNT>(p, part, m0, g, t, prow0, prows, live,
                                            [&](int rt, int n, int i) { return s.acc[rt][n][i]; });
}

// Tokens per block: 32 when that pads M less than 64 does (M <= 32, 65..96,
// ...), else 64 (fewer weight reads).  The MMA work grows with the padded M.
inline int gemm_tokens(int M) {
  const int pad32 = (M + 31) / 32 * 32, pad64 = (M + 63) / 64 * 64;
  return pad32 < pad64 ? 32 : 64;
}

// Resident blocks per SM of one instance, asked once per instance and device
// (the shared-memory attribute is set first: the occupancy query honours it).
template <typename T, int kBits, bool kGrouped, int kNT>
int resident_blocks() {
  constexpr int smem = GemmTile<kBits, kNT>::kSmemBytes;
  auto kernel = gemm_mma_kernel<T, kBits, kGrouped, kNT>;
  static std::atomic<int> cache[kMaxDevices] = {};
  return per_device(cache, [&] {
    int n = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kGemmWarps * 32, smem) != cudaSuccess)
      n = 1;
    return n > 0 ? n : 1;
  });
}

// K splits for p: enough to fill the resident slots once (plan_splits).
template <typename T, int kBits, bool kGrouped, int kNT>
int splits_for(const GemvParams& p) {
  const int slots = std::max(resident_blocks<T, kBits, kGrouped, kNT>(), 1) * std::max(device_sm_count(), 1);
  const long blocks = static_cast<long>((p.M + kNT * 8 - 1) / (kNT * 8)) *
                      ((num_panels(p.N) + kGemmPanels - 1) / kGemmPanels);
  return plan_splits(slots, blocks, p.K / GemmTile<kBits, kNT>::kTileK, /*round_up=*/true);
}

template <typename T, int kBits, bool kGrouped, int kNT>
Status launch_gemm(const GemvParams& p, float* workspace, int splits, cudaStream_t stream) {
  constexpr int smem = GemmTile<kBits, kNT>::kSmemBytes;
  auto kernel = gemm_mma_kernel<T, kBits, kGrouped, kNT>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return Status::kLaunchFailed;
  const int row_blocks = (num_panels(p.N) + kGemmPanels - 1) / kGemmPanels;
  if (row_blocks > 65535) return Status::kBadShape;
  int per = 0;
  splits = split_tiles(p.K / GemmTile<kBits, kNT>::kTileK, splits, workspace != nullptr, &per);
  const dim3 grid((p.M + kNT * 8 - 1) / (kNT * 8), row_blocks, splits);
  kernel<<<grid, kGemmWarps * 32, smem, stream>>>(p, splits > 1 ? workspace : nullptr, per);
  if (cudaGetLastError() != cudaSuccess) return Status::kLaunchFailed;
  return splits > 1 ? reduce_splits(p, workspace, splits, stream) : Status::kOk;
}

// One instance: splits_out != nullptr only reports the splits it wants;
// otherwise it launches with `splits` (one without a workspace).
template <typename T, int kBits, bool kGrouped, int kNT>
Status run_instance(const GemvParams& p, float* workspace, int splits, int* splits_out, cudaStream_t stream) {
  if (splits_out != nullptr) {
    *splits_out = splits_for<T, kBits, kGrouped, kNT>(p);
    return Status::kOk;
  }
  return launch_gemm<T, kBits, kGrouped, kNT>(p, workspace, splits, stream);
}

// The one tiled-GEMM dispatch: (activation type, format, tokens per block)
// -> a row of QGEMV_GEMM_INSTANCES (instances.h).
Status run_gemm(const GemvParams& p, int bits, float* workspace, int splits, int* splits_out, cudaStream_t stream) {
  const bool grouped = p.group_size != 0;
  const int nt = gemm_tokens(p.M) == 64 ? 8 : 4;
#define QGEMV_ROW(B, GR, NT)                                                                             \
  if (bits == B && grouped == GR && nt == NT) {                                                          \
    if (p.act == ActType::kHalf) return run_instance<__half, B, GR, NT>(p, workspace, splits, splits_out, stream); \
    if (p.act == ActType::kBFloat16)                                                                     \
      return run_instance<__nv_bfloat16, B, GR, NT>(p, workspace, splits, splits_out, stream);           \
    return Status::kNoKernel;                                                                            \
  }
  QGEMV_GEMM_INSTANCES(QGEMV_ROW)
#undef QGEMV_ROW
  return Status::kNoKernel;
}

}  // namespace

Status check_int4_gemm(const GemvParams& p) {
  if (p.M < 1 || p.Kp % 32 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  if (p.group_size == 0) return p.zeros != nullptr ? Status::kNoKernel : Status::kOk;
  if (p.group_size != 32 && p.group_size != 64 && p.group_size != 128) return Status::kBadGroupSize;
  return p.K % p.group_size == 0 ? Status::kOk : Status::kBadShape;
}

Status check_int8_gemm(const GemvParams& p) {
  if (p.M < 1 || p.Kp % 16 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  return p.group_size != 0 || p.zeros != nullptr ? Status::kNoKernel : Status::kOk;
}

int gemm_splits(const GemvParams& p, int bits) {
  int splits = 1;
  const Status st = bits == 4 ? check_int4_gemm(p) : bits == 8 ? check_int8_gemm(p) : Status::kNoKernel;
  if (st == Status::kOk) run_gemm(p, bits, nullptr, 1, &splits, nullptr);
  return splits;
}

Status gemm_int4(const GemvParams& p, float* workspace, int splits, cudaStream_t stream) {
  const Status st = check_int4_gemm(p);
  return st != Status::kOk ? st : run_gemm(p, 4, workspace, splits, nullptr, stream);
}

Status gemm_int8(const GemvParams& p, float* workspace, int splits, cudaStream_t stream) {
  const Status st = check_int8_gemm(p);
  return st != Status::kOk ? st : run_gemm(p, 8, workspace, splits, nullptr, stream);
}

}  // namespace qgemv
