// Weight-only GEMV for M = 1..16 tokens on tensor cores.
//
// Layout (one block = 16 output rows, or 32 with two row tiles (below), W
// warps splitting K):
//
//   The weight tile of 16 rows is the A operand of mma.m16n8k16; the tokens
//   are the B operand (8 tokens per n-tile, one or two n-tiles).  Lane
//   (g = lane/4, t = lane%4) owns rows g and g+8 of the tile and token g of
//   each n-tile, like the seed's "one warp per row" GEMV except that the warp
//   owns 16 rows and the k-reduction across the four lanes of a quad happens
//   inside the MMA instead of in shuffles.
//
//   Each lane reads 16 bytes of weights per row per tile.  The MMA sums over
//   16 "positions" per step and lane t holds positions {2t, 2t+1, 2t+8, 2t+9};
//   which real k a position stands for is ours to choose, so we choose the k
//   that the lane already holds and read the matching activations.
//
//     int8 : a tile is 64 k per row; lane t holds k in [16t, 16t+16).
//            Step j (0..3) uses the lane's word j (k 16t+4j .. +3).
//     int4 : a tile is 128 k per row, four 32-k sub-tiles.  Lane t's 16 bytes
//            hold word j = k in [32j+8t, 32j+8t+8) for j = 0..3 (the packer
//            swizzles words so that this is one contiguous load).  Sub-tile j
//            is two MMA steps over 32 consecutive k, so a quantization group
//            (32, 64 or 128 k) always covers whole steps, and the group scale
//            is applied to the step's fp32 partial sum, not per element.
//
//   Why tensor cores at M = 1: dequantising int4 costs ~1.4 instructions per
//   weight (lop3 + sub per pair, one shift per two pairs); an fp32 FMA per
//   weight on top would use most of the issue slots at 4 TB/s.  The MMA does
//   the multiply-accumulate in fp32 and its cost is flat in M up to 8 (then
//   16) tokens.
//
// Memory pipeline (the part that decides the speed; see BENCHMARKS.md for the
// ncu numbers and the dev/gemv_lab.cu A/B runs that led here):
//   * Weights stream through a per-warp ring of kStages tiles in shared
//     memory filled with cp.async (L1 bypassed, L2 evict-first).  Each lane
//     copies and later reads back only its own 2 x 16 bytes per tile, so no
//     barrier is needed; a warp keeps kStages - 1 tiles in flight
//     at all times without spending registers on them.  The weights are
//     stored in 16-row panels (qgemv/formats.py, to_panels): a warp's
//     cp.async for one half of a tile covers 512 contiguous bytes.
//   * Activations are read from global memory through L1 (the weights bypass
//     L1, so the few KB of x that every block re-reads stay cached there);
//     with an act-order perm, from the block's gathered copy in shared
//     memory (kGather, below).
//     Each lane keeps one pointer per n-tile; a tile's loads are that pointer
//     plus compile-time offsets.
//   * "Clean" tiles, whose k are all < K, run without a single bounds check:
//     tokens past M read token M-1 (their output columns are never stored).
//     The one tile that reaches past K (K % tile_k != 0) is the "edge" tile,
//     run once with checks by one warp.
//   * Group scales and zero points for tile j+1 are loaded while tile j is
//     computed, so their latency is hidden behind one tile of work.
//   * Consecutive tiles of a warp accumulate into two register banks: two
//     independent MMA dependency chains (one row tile; with two, the row
//     tiles give the independent chains and one bank is used).
//
// Split-K across the warps of the block (W = 2, 4 or 8 by shape; see
// choose_warps): warp w takes tiles w, w+W, w+2W, ...; at the end the
// warps meet in shared memory and the first threads write the 16 kRT x M
// outputs.
//
// Persistent grid (M <= 8, int8 and int4 per channel / G = 128 without zero
// points, when the plain grid would exceed one wave): at most as many blocks
// as fit on the GPU at once, each walking several 16-row blocks, with every
// warp's ring streaming on from one block's tiles into the next's.
//
// Row tiles (kRT): with 9..16 tokens a warp may own kRT = 2 row tiles (32
// rows, two consecutive panels) and use each activation fragment for both.
// With one row tile, every block re-reads all of x: 16 tokens x K x 2 bytes
// against 16 rows x K / 2 bytes of int4 weights, i.e. 4 bytes of x (from L2:
// 256 KB of x at K = 8192 does not stay in L1) per byte of weight.  Two row
// tiles halve that traffic (the kRT = 2 rows of instances.h).
#pragma once

#include <atomic>

#include "instances.h"
#include "qgemv_common.cuh"

namespace qgemv {

// One MMA row tile = one weight panel (kPanelRows rows, qgemv_common.cuh).
// The measured constants (ring depth, register caps, warps by shape, ...) are
// in tuning.h with where each came from.
constexpr int kStages = tuning::kGemvStages;   // weight ring depth per warp (tiles); a power of two
constexpr int kMaxWarps = tuning::kGemvMaxWarps;  // warps per block (split-K)

// Two row tiles per warp (kRT = 2) for 9..16 tokens on large N.  Measured on
// the H200 with the kernel lab (BENCHMARKS.md): int4 M = 16 at 28672x8192
// 64.0 -> 48.6 us, 8192x28672 54.5 -> 45.1 us, 8192x8192 20.6 -> 19.6 us;
// but slower at 4096x4096 (128 blocks leave SMs short of warps), and slower
// for int8 (half the activation traffic per weight byte to begin with) and
// G = 32 / 64 (their per-tile metadata spills).  Hence the table
// (instances.h) has kRT = 2 rows for int4 per channel and G = 128 only, used
// from tuning::kWideMinPanels 16-row panels.

// The panel that row tile rt of logical block blk reads.  A row tile past
// the last panel (N not a multiple of 16 kRT) reads the last panel again;
// its outputs are never stored.
template <int kRT>
__device__ __forceinline__ int panel_of(int blk, int rt, int npanels) {
  return kRT == 1 ? blk : min(blk * kRT + rt, npanels - 1);
}

// Group metadata of one tile for this lane's two rows: up to 4 groups (G = 32),
// kept as loaded (fp16 bits, zero points 0..15) and converted where a sub-tile
// uses them.  Converted at load, the first instruction after the loads read
// them: every warp stalled there for the loads' round trip (ncu on the H100,
// int4 g128 + zeros at 16 tokens: 17-27% of the stall samples), although the
// loads run a tile ahead.
struct TileMeta {
  uint32_t s0[4], s1[4];    // scale bits (fp16) of rows r0, r1
  uint32_t z0[4], z1[4];    // zero points of rows r0, r1
};

__device__ __forceinline__ float scale_of(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// kGroup: 0 = one scale per output channel, else the group size (32, 64,
// 128); kZeros: group-wise zero points.  Both are template parameters, not
// runtime values: with a runtime zero-point flag the compiler emitted every
// MMA twice under predicates, and with a runtime group size every sub-tile
// carried predicated scale loads and folds (the g128 loop was 1.9x the
// per-channel one in SASS; see BENCHMARKS.md).  kRT: row tiles per warp.
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kRT>
struct GemvMma {
  static constexpr int kTileK = kBits == 4 ? 128 : 64;
  static constexpr bool kGrouped = kGroup != 0;
  static constexpr bool kHasZeros = kZeros;
  static_assert(kGroup == 0 || (kBits == 4 && (kGroup == 32 || kGroup == 64 || kGroup == 128)),
                "group-wise scales: int4 with G in {32, 64, 128}");
  static_assert(kGrouped || !kZeros, "zero points are group-wise only");
  static_assert(kRT == 1 || kRT == 2 || kRT == 4, "1, 2 or 4 row tiles per warp");
  static constexpr int kSubPerGroup = kGrouped ? kGroup / 32 : 1;  // 32-k sub-tiles per group
  static constexpr int kGroupsPerTile = kGrouped ? kTileK / kGroup : 1;
  // k offset of this lane's 8 (int4: per sub-tile) or 16 (int8) k in a tile,
  // in units of t.
  static constexpr int kLaneK = kBits == 4 ? 8 : 16;
  // Accumulator banks: with one row tile, consecutive tiles alternate between
  // two banks (two independent MMA chains); with more, the row tiles already
  // give independent chains and one bank saves the registers.
  static constexpr int kBanks = kRT == 1 ? 2 : 1;

  const GemvParams& p;
  int g, t;
  // Per row tile: the panel (first row, row count) and this lane's two rows
  // inside it, clamped to the panel (rows past N load row N-1; never stored).
  int pan_row0[kRT], pan_rows[kRT], i0[kRT], i1[kRT];
  float acc[kBanks][kRT][kNT][4];  // MMA C fragments (fp32)
  // Per-lane pointers, computed once: this lane's activations (its token of
  // each n-tile, clamped to M - 1, plus the lane's k offset), and the scale /
  // zero-point rows of each row tile's r0 and r1.
  const T* xl[kNT];
  const __half *srow0[kRT], *srow1[kRT];
  const uint8_t *zrow0[kRT], *zrow1[kRT];
  int ngroups = 1;
  uint32_t sym_z, sym_y;      // symmetric zero point 8 as (magic + 8), (magic/16 + 8)

  // blk: the logical block (kRT panels) this warp works on; blockIdx.x except
  // in the persistent kernel, whose blocks walk several.  x / ldx: the
  // activations the tiles read, p.x and p.ldx, or the block's gathered copy
  // in shared memory (kGather).
  __device__ __forceinline__ GemvMma(const GemvParams& params, int lane, int blk, const T* x, int ldx)
      : p(params) {
    g = lane >> 2;
    t = lane & 3;
    const int npanels = num_panels(p.N);
    if constexpr (kGrouped) ngroups = p.K / kGroup;
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      pan_row0[rt] = panel_of<kRT>(blk, rt, npanels) * kPanelRows;
      pan_rows[rt] = min(kPanelRows, p.N - pan_row0[rt]);
      i0[rt] = min(g, pan_rows[rt] - 1);
      i1[rt] = min(g + 8, pan_rows[rt] - 1);
      const int r0 = pan_row0[rt] + i0[rt], r1 = pan_row0[rt] + i1[rt];
      srow0[rt] = static_cast<const __half*>(p.scales) + r0 * ngroups;
      srow1[rt] = static_cast<const __half*>(p.scales) + r1 * ngroups;
      zrow0[rt] = p.zeros ? p.zeros + r0 * ngroups : nullptr;
      zrow1[rt] = p.zeros ? p.zeros + r1 * ngroups : nullptr;
    }
#pragma unroll
    for (int b = 0; b < kBanks; ++b)
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[b][rt][n][i] = 0.f;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int tok = min(n * 8 + g, p.M - 1);
      xl[n] = x + static_cast<size_t>(tok) * ldx + kLaneK * t;
    }
    sym_z = magic_zero_pair<T>(8);
    sym_y = ActTraits<T>::splat(ActTraits<T>::kMagicValue / 16.f + 8.f);
  }

  // 8 activations of this lane's token of n-tile nt at tile-relative k (the
  // lane offset is in xl).  Checked: zero where the lane's k >= K.
  template <bool kChecked>
  __device__ __forceinline__ uint4 load_x(int nt, int k) const {
    if (kChecked && k + kLaneK * t >= p.K) return make_uint4(0u, 0u, 0u, 0u);
    return *reinterpret_cast<const uint4*>(xl[nt] + k);
  }

  // Scales / zero points for the four sub-tiles of tile `tile` (grouped
  // int4), for every row tile.  Entry i belongs to sub-tile i, so every index
  // is a compile-time constant and the arrays stay in registers; sub-tiles of
  // one group (G = 64, 128) copy the entry before them instead of loading
  // again.  Only the edge tile can point past the last group (its sub-tiles
  // past K are zeros).
  template <bool kChecked>
  __device__ __forceinline__ void load_meta(int tile, TileMeta (&ms)[kRT]) const {
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      TileMeta& m = ms[rt];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (i % kSubPerGroup == 0) {
          int gi = tile * kGroupsPerTile + i / kSubPerGroup;
          if (kChecked) gi = min(gi, ngroups - 1);
          m.s0[i] = __half_as_ushort(srow0[rt][gi]);
          m.s1[i] = __half_as_ushort(srow1[rt][gi]);
          if constexpr (kHasZeros) {
            m.z0[i] = zrow0[rt][gi];
            m.z1[i] = zrow1[rt][gi];
          }
        } else {
          m.s0[i] = m.s0[i - 1];
          m.s1[i] = m.s1[i - 1];
          if constexpr (kHasZeros) {
            m.z0[i] = m.z0[i - 1];
            m.z1[i] = m.z1[i - 1];
          }
        }
      }
    }
  }

  // One int4 sub-tile j of a tile at k_tile: 32 consecutive k; this lane
  // holds k_tile + 32j + 8t .. +7 of each row tile's rows r0 (word w0[rt])
  // and r1 (w1[rt]).  The activation fragments are loaded once and serve
  // every row tile.
  template <int B, bool kChecked>
  __device__ __forceinline__ void int4_subtile(int k_tile, int j, const uint32_t (&w0)[kRT],
                                               const uint32_t (&w1)[kRT], const TileMeta (&ms)[kRT],
                                               float (&part)[kRT][kNT][4]) {
    uint4 xv[kNT];
#pragma unroll
    for (int n = 0; n < kNT; ++n) xv[n] = load_x<kChecked>(n, k_tile + 32 * j);
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      uint32_t z0 = sym_z, z1 = sym_z, y0 = sym_y, y1 = sym_y;
      if constexpr (kHasZeros) {
        z0 = magic_zero_pair<T>(ms[rt].z0[j]);
        z1 = magic_zero_pair<T>(ms[rt].z1[j]);
        // (magic/16 + z) = (magic + z) - 15 magic / 16: one exact subtraction
        // instead of a second register array per group.
        y0 = magic_zero_pair_16<T>(z0);
        y1 = magic_zero_pair_16<T>(z1);
      }
      uint32_t step0[4], step1[4];
      int4_fragments<T>(w0[rt], w1[rt], z0, y0, z1, y1, step0, step1);
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        // Grouped: per-group partial sums, folded with the scale at the group end.
        float(&c)[4] = kGrouped ? part[rt][n] : acc[B % kBanks][rt][n];
        ActTraits<T>::mma(c, step0, xv[n].x, xv[n].y);
        ActTraits<T>::mma(c, step1, xv[n].z, xv[n].w);
      }
    }
    if constexpr (kGrouped) {
      if ((j + 1) % kSubPerGroup != 0) return;  // group continues
      // End of a group: fold the fp32 partial sums in with the group's scales.
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt)
#pragma unroll
        for (int n = 0; n < kNT; ++n) {
          float(&a)[4] = acc[B % kBanks][rt][n];
          const float s0 = scale_of(ms[rt].s0[j]), s1 = scale_of(ms[rt].s1[j]);
          a[0] += part[rt][n][0] * s0;
          a[1] += part[rt][n][1] * s0;
          a[2] += part[rt][n][2] * s1;
          a[3] += part[rt][n][3] * s1;
#pragma unroll
          for (int i = 0; i < 4; ++i) part[rt][n][i] = 0.f;
        }
    }
  }

  // One int8 tile at k_tile: this lane holds k_tile + 16t .. +15 of both rows
  // of every row tile.
  template <int B, bool kChecked>
  __device__ __forceinline__ void int8_tile(int k_tile, const uint4 (&w0)[kRT], const uint4 (&w1)[kRT]) {
    uint32_t xp[kNT][8];
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const uint4 xa = load_x<kChecked>(n, k_tile);
      const uint4 xb = load_x<kChecked>(n, k_tile + 8);
      xp[n][0] = xa.x; xp[n][1] = xa.y; xp[n][2] = xa.z; xp[n][3] = xa.w;
      xp[n][4] = xb.x; xp[n][5] = xb.y; xp[n][6] = xb.z; xp[n][7] = xb.w;
    }
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      uint32_t a[4][4];
      int8_fragments<T>(w0[rt], w1[rt], a);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int n = 0; n < kNT; ++n) ActTraits<T>::mma(acc[B % kBanks][rt][n], a[j], xp[n][2 * j], xp[n][2 * j + 1]);
    }
  }

  // Tile number `tile` with this lane's words of every row tile in w0 (row
  // r0) and w1 (row r1); the sub-tile count c is 4 except in an int4 edge tile.
  template <int B, bool kChecked>
  __device__ __forceinline__ void tile(int tile_idx, const uint4 (&w0)[kRT], const uint4 (&w1)[kRT],
                                       const TileMeta (&m)[kRT], int c = 4) {
    const int k_tile = tile_idx * kTileK;
    if constexpr (kBits == 4) {
      float part[kRT][kNT][4];
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) part[rt][n][i] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (!kChecked || j < c) {
          uint32_t u0[kRT], u1[kRT];
#pragma unroll
          for (int rt = 0; rt < kRT; ++rt) {
            u0[rt] = word_of(w0[rt], j);
            u1[rt] = word_of(w1[rt], j);
          }
          int4_subtile<B, kChecked>(k_tile, j, u0, u1, m, part);
        }
      }
    } else {
      int8_tile<B, kChecked>(k_tile, w0, w1);
    }
  }
};

// Register cap per instance (what __launch_bounds__(256, 2) gave, 128,
// except the int8 instances; tuning.h says why).
template <int kBits, int kNT, int kRT>
struct MaxRegisters {
  static constexpr int value = kBits == 8 && kRT == 1
                                   ? (kNT == 1 ? tuning::kInt8RegsOneNTile : tuning::kInt8RegsTwoNTiles)
                                   : 65536 / (kMaxWarps * 32 * tuning::kGemvMinBlocksPerSm);
};

// __maxnreg__ needs CUDA 12.4; older toolkits get the plain bound (128
// registers for every instance, the int8 ones included).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define QGEMV_REGISTER_CAP(kBits, kNT, kRT) __maxnreg__((MaxRegisters<kBits, kNT, kRT>::value))
#else
#define QGEMV_REGISTER_CAP(kBits, kNT, kRT) __launch_bounds__(kMaxWarps * 32, tuning::kGemvMinBlocksPerSm)
#endif

// kPersist: a grid of at most (blocks per SM x SMs) blocks, each walking the
// logical blocks blockIdx.x, blockIdx.x + gridDim.x, ...  A warp's weight
// ring keeps streaming across them: while it finishes one panel, the
// first tiles of its next panel are already in flight, so the pipeline
// fills once per warp instead of once per panel (see launch_gemv_mma for
// when it is used).
//
// pdl: the programmatic-launch flags of set_gemv_pdl (qgemv.h).  With
// kPdlPrefetch each block first prefetches into L2 what its warps' first ring
// fill will copy; with kPdlRelease it lets the next launch begin; with
// kPdlLaunch it then waits for the kernel before it.  Nothing is read into
// registers or shared memory before the wait: x may be that kernel's output,
// and so may a weight just written.
//
// kGather: the activations are x[:, p.perm] (act-order).  Each block copies
// x and perm into shared memory with cp.async (one group, committed before
// the weight ring's first tiles, so that it lands first), then gathers x
// there, and its tiles read the gathered copy instead of x.  A gather straight
// from global memory (2-byte loads at random k through L1) cost every block
// M x K scattered L1 accesses: 4096x4096 M = 1 +2.2 us, 28672x4096 M = 4
// 7x the plain GEMV, measured on the H200; from shared memory the random
// reads are bank conflicts of a few ways instead of one L1 wavefront per
// lane.  Shared memory: M x K x 2 elements and K int32 (gemv_gathers).
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kRT, bool kPersist, bool kGather>
__global__ void QGEMV_REGISTER_CAP(kBits, kNT, kRT) gemv_mma_kernel(const GemvParams p, int pdl) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, kNT, kRT>;
  constexpr int kTileK = Lane::kTileK;
  constexpr int kSlot = kRT * 64;  // uint4 per ring slot: kRT row tiles x 2 rows x 32 lanes
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  constexpr bool grouped = Lane::kGrouped;
  const int nblk = kPersist ? (p.N + kRT * kPanelRows - 1) / (kRT * kPanelRows) : 0;
  const int g = lane >> 2, t = lane & 3;

  const uint64_t pol = evict_first_policy();
  const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
  if (pdl & kPdlPrefetch) {
    if (threadIdx.x < kRT) {  // thread rt: the first (kStages - 1) x nwarps clean tiles of row tile rt's panel
      const int row0 = panel_of<kRT>(blockIdx.x, threadIdx.x, num_panels(p.N)) * kPanelRows;
      const int tile_stride = min(kPanelRows, p.N - row0) * kTileBytes;
      const int tiles = min((kStages - 1) * nwarps, p.K / kTileK);
      if (tiles > 0)
        pdl_prefetch_l2(static_cast<const char*>(p.qweight) + static_cast<size_t>(row0) * row_bytes,
                        static_cast<uint32_t>(tiles * tile_stride));
    }
  }
  if (pdl & kPdlRelease) pdl_release();
  if (pdl & kPdlLaunch) pdl_wait();
  // Row tile rt reads one panel: rows [pan_row0, pan_row0 + pan_rows) with
  // each tile's pan_rows x 64 bytes stored together (formats.to_panels), so
  // that the r0 half of a warp's tile is 512 contiguous bytes, and so is the
  // r1 half.  The issue side keeps its own copy of the panel geometry: in the
  // persistent kernel it runs ahead into the next logical block.
  int step_bytes[kRT];   // bytes from one of this warp's tiles to its next
  const char* src0[kRT];
  const char* src1[kRT];
  const int nclean = p.K / kTileK;  // clean tiles: every k < K; the edge tile (if any) is tile nclean
  const bool has_edge = nclean * kTileK < p.Kp;
  auto aim = [&](int blk) {  // this warp's first clean tile of logical block blk
    const int npanels = num_panels(p.N);
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      const int row0 = panel_of<kRT>(blk, rt, npanels) * kPanelRows, rows = min(kPanelRows, p.N - row0);
      const char* panel = static_cast<const char*>(p.qweight) + static_cast<size_t>(row0) * row_bytes;
      const int tile_stride = rows * kTileBytes;
      step_bytes[rt] = nwarps * tile_stride;
      src0[rt] = panel + min(g, rows - 1) * kTileBytes + 16 * t + warp * tile_stride;
      src1[rt] = panel + min(g + 8, rows - 1) * kTileBytes + 16 * t + warp * tile_stride;
    }
  };

  // Shared memory: [weight ring: nwarps x kStages x kSlot x 16 B] [reduction:
  // nwarps x kRT x kNT x 4 x 32 floats] [kGather: x[:, perm] (M x K), x (M x K), perm (K int32)]
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem) + warp * kStages * kSlot + lane;
  float* red = reinterpret_cast<float*>(smem + static_cast<size_t>(nwarps) * kStages * kSlot * sizeof(uint4));
  T* xs = reinterpret_cast<T*>(red + nwarps * kRT * kNT * 4 * kWarpSize);
  T* xraw = xs + p.M * p.K;                                      // (kGather only)
  int32_t* perm_s = reinterpret_cast<int32_t*>(xraw + p.M * p.K);  // (kGather only)
  const int chunks = p.K / 8;                                    // 16-byte pieces of one row of x
  if constexpr (kGather) {
    // x's rows and perm into shared memory, one cp.async group older than every ring slot.
    const T* x = static_cast<const T*>(p.x);
    for (int c = threadIdx.x; c < p.M * chunks; c += blockDim.x) {
      const int m = c / chunks, j = c - m * chunks;
      cp_async_16_shared_data(xraw + m * p.K + 8 * j, x + static_cast<size_t>(m) * p.ldx + 8 * j);
    }
    for (int c = threadIdx.x; c < 2 * chunks; c += blockDim.x) cp_async_16_shared_data(perm_s + 4 * c, p.perm + 4 * c);
    cp_async_commit();
  }

  const int count = warp < nclean ? (nclean - warp + nwarps - 1) / nwarps : 0;  // clean tiles per block
  int issue_blk = blockIdx.x;  // logical block the next issue reads from
  int issued = 0;              // tiles issued of issue_blk
  int issued_all = 0;          // ring slots filled (one cp.async group each)
  aim(issue_blk);
  auto issue = [&]() {
    if constexpr (kPersist) {
      if (issued == count && count > 0) {
        issue_blk += gridDim.x;
        issued = 0;
        if (issue_blk < nblk) aim(issue_blk);
      }
      if (issue_blk >= nblk) issued = count;  // nothing left: empty groups
    }
    if (issued < count) {
      uint4* slot = ring + (issued_all & (kStages - 1)) * kSlot;
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) {
        cp_async_16(slot + rt * 64, src0[rt], pol);
        cp_async_16(slot + rt * 64 + 32, src1[rt], pol);
        src0[rt] += step_bytes[rt];
        src1[rt] += step_bytes[rt];
      }
      ++issued;
    } else if constexpr (!kPersist) {
      ++issued;
    }
    ++issued_all;
    cp_async_commit();  // always commit: keeps the group count uniform
  };
  int consumed = 0;  // ring slots read
  auto read_slot = [&](uint4 (&w0)[kRT], uint4 (&w1)[kRT]) {
    const uint4* slot = ring + (consumed & (kStages - 1)) * kSlot;
    ++consumed;
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      w0[rt] = slot[rt * 64];
      w1[rt] = slot[rt * 64 + 32];
    }
  };
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) issue();

  if constexpr (kGather) {
    // The gather, in shared memory: eight k per step (two 16-byte reads of
    // perm, eight 2-byte reads of each token's row, one 16-byte write).
    cp_async_wait<kStages - 1>();  // this thread's x / perm copies (the ring's kStages - 1 slots may still fly)
    __syncthreads();
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      const int4 pa = *reinterpret_cast<const int4*>(perm_s + 8 * c);
      const int4 pb = *reinterpret_cast<const int4*>(perm_s + 8 * c + 4);
      // Clamped into [0, K): a bad perm gives wrong outputs, never a read outside x.
      const unsigned last = static_cast<unsigned>(p.K - 1);
      const unsigned idx[8] = {min(static_cast<unsigned>(pa.x), last), min(static_cast<unsigned>(pa.y), last),
                               min(static_cast<unsigned>(pa.z), last), min(static_cast<unsigned>(pa.w), last),
                               min(static_cast<unsigned>(pb.x), last), min(static_cast<unsigned>(pb.y), last),
                               min(static_cast<unsigned>(pb.z), last), min(static_cast<unsigned>(pb.w), last)};
      for (int m = 0; m < p.M; ++m) {
        const T* xm = xraw + m * p.K;
        uint4 v;
        T* e = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) e[i] = xm[idx[i]];
        *reinterpret_cast<uint4*>(xs + static_cast<size_t>(m) * p.K + 8 * c) = v;
      }
    }
    __syncthreads();
  }

  for (int blk = blockIdx.x; kPersist ? blk < nblk : blk == static_cast<int>(blockIdx.x);
       blk += kPersist ? gridDim.x : 1) {
  Lane s(p, lane, blk, kGather ? xs : static_cast<const T*>(p.x), kGather ? p.K : p.ldx);
  TileMeta meta_cur[kRT], meta_next[kRT];
  if (grouped && count > 0) s.template load_meta<false>(warp, meta_cur);
  int j = 0;
  int tile_a = warp;
  if constexpr (kRT == 1) {
    // Two tiles per iteration, without guards inside, so that the compiler
    // can interleave the dequantisation and MMA chains of both (bank 0 and 1).
    for (; j + 1 < count; j += 2, tile_a += 2 * nwarps) {
      const int tile_b = tile_a + nwarps;
      uint4 wa0[kRT], wa1[kRT], wb0[kRT], wb1[kRT];
      cp_async_wait<kStages - 2>();
      read_slot(wa0, wa1);
      issue();
      cp_async_wait<kStages - 2>();
      read_slot(wb0, wb1);
      issue();
      TileMeta meta_b[kRT];
      if (grouped) s.template load_meta<false>(tile_b, meta_b);
      // (the next pair's first tile; past the warp's last tile, the last clean tile's again, unused: no branch
      // splits the loop's block, so ptxas can place the loads' readers a tile later)
      if (grouped) s.template load_meta<false>(min(tile_b + nwarps, nclean - 1), meta_next);
      s.template tile<0, false>(tile_a, wa0, wa1, meta_cur);
      s.template tile<1, false>(tile_b, wb0, wb1, meta_b);
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) meta_cur[rt] = meta_next[rt];
    }
    if (j < count) {
      uint4 w0[kRT], w1[kRT];
      cp_async_wait<kStages - 2>();
      read_slot(w0, w1);
      if constexpr (kPersist) issue();  // keep the next block's tiles coming
      s.template tile<0, false>(tile_a, w0, w1, meta_cur);
    }
  } else {
    // One tile per iteration: the row tiles already give independent MMA
    // chains, and two tiles' words would not fit in registers.
    for (; j < count; ++j, tile_a += nwarps) {
      uint4 w0[kRT], w1[kRT];
      cp_async_wait<kStages - 2>();
      read_slot(w0, w1);
      issue();
      if (grouped) s.template load_meta<false>(min(tile_a + nwarps, nclean - 1), meta_next);  // (as above)
      s.template tile<0, false>(tile_a, w0, w1, meta_cur);
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) meta_cur[rt] = meta_next[rt];
    }
  }
  if constexpr (!kPersist) cp_async_wait<0>();  // (the persistent ring holds the next block's tiles)

  // The edge tile, read directly, with bounds checks on the activations.  In
  // each panel it starts after nclean full tiles and holds `seg` bytes per
  // row (64 if it is a full stored tile whose last k are past K).
  if (has_edge && warp == nclean % nwarps) {
    TileMeta m[kRT];
    if (grouped) s.template load_meta<true>(nclean, m);
    const int left = p.Kp - nclean * kTileK;  // k of the tile that are in the packed row
    const int c = min(left / (kBits == 4 ? 32 : 16), 4);  // 16-byte pieces per row
    uint4 w0[kRT], w1[kRT];
#pragma unroll
    for (int rt = 0; rt < kRT; ++rt) {
      const char* panel = static_cast<const char*>(p.qweight) + static_cast<size_t>(s.pan_row0[rt]) * row_bytes;
      const int tile_stride = s.pan_rows[rt] * kTileBytes;
      const char* b0 = panel + nclean * tile_stride + s.i0[rt] * 16 * c;
      const char* b1 = panel + nclean * tile_stride + s.i1[rt] * 16 * c;
      load_edge_words<kBits>(b0, b1, s.t, c, pol, w0[rt], w1[rt]);
    }
    s.template tile<0, true>(nclean, w0, w1, m, c);
  }

  // Split-K reduction across warps: red[warp][value][lane].
  constexpr int kValues = kRT * kNT * 4;
#pragma unroll
  for (int rt = 0; rt < kRT; ++rt)
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = s.acc[0][rt][n][i];
        if constexpr (Lane::kBanks == 2) v += s.acc[Lane::kBanks - 1][rt][n][i];
        red[(warp * kValues + (rt * kNT + n) * 4 + i) * kWarpSize + lane] = v;
      }
  __syncthreads();

  const __half* scales = static_cast<const __half*>(p.scales);
  T* y = static_cast<T*>(p.y);
  for (int v = threadIdx.x; v < kValues * kWarpSize; v += blockDim.x) {
    const int ln = v % kWarpSize, q = v / kWarpSize;
    const int rt = q / (kNT * 4), n = (q / 4) % kNT, i = q % 4;
    float sum = 0.f;
    for (int w2 = 0; w2 < nwarps; ++w2) sum += red[(w2 * kValues + q) * kWarpSize + ln];
    // C fragment: i = 0,1 -> row g, tokens 2t, 2t+1; i = 2,3 -> row g+8.
    const int row = (blk * kRT + rt) * kPanelRows + (ln >> 2) + (i >= 2 ? 8 : 0);
    const int tok = n * 8 + 2 * (ln & 3) + (i & 1);
    if (row < p.N && tok < p.M) {
      if constexpr (!grouped) sum *= __half2float(scales[row]);
      ActTraits<T>::store(y + static_cast<size_t>(tok) * p.ldy + row, sum);
    }
  }
  if constexpr (kPersist) __syncthreads();  // red is rewritten by the next logical block
  }
  cp_async_wait<0>();
}

// Warps per block (the split-K factor), measured on the H200 with
// dev/gemv_lab.cu --warps 8,4,2 (BENCHMARKS.md).
// One row tile per warp (11 shapes x 7 formats):
//   * short rows (K <= 4096) and at least 640 panels: 2 warps, each with a
//     longer run of tiles (int4 12288x4096: 16.7 -> 13.8 us against 8 warps);
//   * short rows and 288..639 panels: 4 warps (measured in decode's chain of
//     linears, tuning.h);
//   * long rows (K >= 8192) and at least 512 panels: 4 warps;
//   * otherwise (few panels) 8 warps, so that split-K fills the GPU.
//   Within 8% of the best of {2, 4, 8} on every measured shape and format.
// Two row tiles per warp (M = 16, 7 shapes x 3 formats): what matters is the
// number of warps in flight, about 1500-2000 in all: 2 warps from 768 blocks,
// 4 from 320, else 8 (best or within 3% of the best on every measured pair).
// Never more warps than tiles.
inline int choose_warps(int N, int K, int Kp, int tile_k, int row_tiles) {
  const int k_tiles = (Kp + tile_k - 1) / tile_k;
  const int panels = num_panels(N);
  int w = kMaxWarps;
  if (row_tiles == 1) {
    if (K <= tuning::kShortRowK && panels >= tuning::kShortRowMinPanels) {
      w = 2;
    } else if (K <= tuning::kShortRowK && panels >= tuning::kShortRowMidPanels) {
      w = 4;
    } else if (K >= tuning::kLongRowK && panels >= tuning::kLongRowMinPanels) {
      w = 4;
    }
  } else {
    const int blocks = (panels + row_tiles - 1) / row_tiles;
    w = blocks >= tuning::kWideTwoWarpBlocks ? 2 : blocks >= tuning::kWideFourWarpBlocks ? 4 : 8;
  }
  return k_tiles < w ? (k_tiles > 0 ? k_tiles : 1) : w;
}

// The persistent kernel (the rows of instances.h marked persistent: one
// n-tile, one row tile, M <= 8; int8 and int4 per channel / G = 128 without
// zero points), once the grid exceeds tuning::kPersistMinWaves waves of
// resident blocks.  Measured on the H200 (the kernel lab, BENCHMARKS.md):
// int4 57344x8192 M = 8 81.1 -> 74.7 us, 22016x4096 M = 1 22.3 -> 20.5 us,
// 28672x8192 unchanged (ncu: its SMs are active for 81% of the kernel,
// against 92% at 8192x28672; capping the registers to fit 5 blocks per SM
// instead of 4 was slower); with zero points it lost 3-7%, so those keep the
// plain grid.

// A programmatic launch is safe only for machine code that waits (pdl_wait):
// code built for sm_90 or later (sm90_code).  An sm_80 build running on a
// Hopper GPU would read x before the kernel that writes it has finished.

template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kRT, bool kGather>
Status launch_gemv_mma(const GemvParams& p, cudaStream_t stream) {
  constexpr int kTileK = GemvMma<T, kBits, kGroup, kZeros, kNT, kRT>::kTileK;
  const int w = p.warps_per_block > 0 ? p.warps_per_block : choose_warps(p.N, p.K, p.Kp, kTileK, kRT);
  if (w > kMaxWarps) return Status::kBadShape;
  const int nblk = (p.N + kRT * kPanelRows - 1) / (kRT * kPanelRows);
  const size_t smem = static_cast<size_t>(w) * kStages * kRT * 64 * sizeof(uint4) +
                      static_cast<size_t>(w) * kRT * kNT * 4 * kWarpSize * sizeof(float) +
                      (kGather ? gemv_gather_smem_bytes(p.M, p.K) : 0);
  auto kernel = gemv_mma_kernel<T, kBits, kGroup, kZeros, kNT, kRT, false, kGather>;
  int grid = nblk;
  // (The gathering kernels are never persistent: they run on at most kGatherMaxPanels panels.)
  if constexpr (gemv_row(kBits, kGroup, kZeros, kNT, kRT) == 2 && !kGather) {
    // Resident blocks per SM for this instance and warp count, asked once per device.
    static std::atomic<int> resident[kMaxWarps + 1][kMaxDevices] = {};
    const int sms = device_sm_count();
    if (sms == 0) return Status::kLaunchFailed;
    auto pkernel = gemv_mma_kernel<T, kBits, kGroup, kZeros, kNT, kRT, true, false>;
    const int per_sm = per_device(resident[w], [&] {
      int n = 0;
      if (smem > 48 * 1024 &&
          cudaFuncSetAttribute(pkernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
              cudaSuccess)
        return -1;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, pkernel, w * kWarpSize, smem) != cudaSuccess)
        return -1;
      return n > 0 ? n : 1;
    });
    if (per_sm <= 0) return Status::kLaunchFailed;
    const int slots = per_sm * sms;
    if (nblk >= tuning::kPersistMinWaves * slots) {
      kernel = pkernel;
      grid = slots;
    }
  }
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess)
    return Status::kLaunchFailed;
  const int pdl = gemv_pdl_flags();
  if (pdl != 0 && sm90_code(kernel)) {
    if (pdl_launch(kernel, dim3(grid), dim3(w * kWarpSize), smem, stream, p, pdl) != cudaSuccess)
      return Status::kLaunchFailed;
  } else {
    kernel<<<grid, w * kWarpSize, smem, stream>>>(p, 0);
  }
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// The one GEMV dispatch: (activation type, format, token count, N) -> a row
// of QGEMV_GEMV_INSTANCES.  One n-tile up to 8 tokens, two up to 16; two row
// tiles per warp for 9..16 tokens where the table has them and N has
// tuning::kWideMinPanels panels.  (Two row tiles for 2..8 tokens too were
// measured and not kept: BENCHMARKS.md history, 2026-12-01.)  kBits selects
// the rows compiled in this translation unit (gemv_int4.cu, gemv_int8.cu).
template <int kBits>
Status dispatch_gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.M < 1 || p.M > kMaxGemvTokens) return Status::kBadShape;
  if (p.perm != nullptr && !gemv_gathers(p.M, p.N, p.K)) return Status::kBadShape;  // the caller gathers x
  const bool zeros = p.zeros != nullptr;
  const int nt = p.M <= 8 ? 1 : 2;
  const int rt = nt == 2 && num_panels(p.N) >= tuning::kWideMinPanels &&
                         gemv_row(kBits, p.group_size, zeros, 2, 2) != 0
                     ? 2
                     : 1;
#define QGEMV_ROW(B, G, Z, NT, RT, P)                                                                \
  if constexpr (B == kBits) {                                                                        \
    if (p.group_size == G && zeros == Z && nt == NT && rt == RT) {                                   \
      if constexpr (NT == 1) {                                                                       \
        if (p.perm != nullptr) {                                                                     \
          if (p.act == ActType::kHalf) return launch_gemv_mma<__half, B, G, Z, NT, RT, true>(p, stream); \
          if (p.act == ActType::kBFloat16)                                                           \
            return launch_gemv_mma<__nv_bfloat16, B, G, Z, NT, RT, true>(p, stream);                 \
          return Status::kNoKernel;                                                                  \
        }                                                                                            \
      }                                                                                              \
      if (p.act == ActType::kHalf) return launch_gemv_mma<__half, B, G, Z, NT, RT, false>(p, stream); \
      if (p.act == ActType::kBFloat16) return launch_gemv_mma<__nv_bfloat16, B, G, Z, NT, RT, false>(p, stream); \
      return Status::kNoKernel;                                                                      \
    }                                                                                                \
  }
  QGEMV_GEMV_INSTANCES(QGEMV_ROW)
#undef QGEMV_ROW
  return Status::kNoKernel;
}

}  // namespace qgemv
