// Weight-only GEMV for M = 1..16 tokens on tensor cores.
//
// Layout (one block = 16 output rows, W warps splitting K):
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
// ncu numbers and the eval/gemv_lab.cu A/B runs that led here):
//   * Weights stream through a per-warp ring of kStages tiles in shared
//     memory filled with cp.async (L1 bypassed, L2 evict-first).  Each lane
//     copies and later reads back only its own 2 x 16 bytes per tile, so no
//     barrier is needed; a warp keeps kStages - 1 tiles in flight
//     at all times without spending registers on them.  The weights are
//     stored in 16-row panels (qgemv/formats.py, to_panels): a warp's
//     cp.async for one half of a tile covers 512 contiguous bytes.
//   * Activations are read from global memory through L1 (the weights bypass
//     L1, so the few KB of x that every block re-reads stay cached there).
//     Each lane keeps one pointer per n-tile; a tile's loads are that pointer
//     plus compile-time offsets.
//   * "Clean" tiles, whose k are all < K, run without a single bounds check:
//     tokens past M read token M-1 (their output columns are never stored).
//     The one tile that reaches past K (K % tile_k != 0) is the "edge" tile,
//     run once with checks by one warp.
//   * Group scales and zero points for tile j+1 are loaded while tile j is
//     computed, so their latency is hidden behind one tile of work.
//   * Consecutive tiles of a warp accumulate into two register banks: two
//     independent MMA dependency chains.
//
// Split-K across the warps of the block (W = 2, 4 or 8 by shape; see
// choose_warps): warp w takes tiles w, w+W, w+2W, ...; at the end the
// warps meet in shared memory and the first threads write the 16 x M outputs.
#pragma once

#include "qgemv_common.cuh"

namespace qgemv {

constexpr int kRowsPerBlock = 16;
constexpr int kTileBytes = 64;      // bytes of one row per tile (int8: 64 k, int4: 128 k)
// QGEMV_STAGES and QGEMV_MIN_BLOCKS_PER_SM exist for eval/gemv_lab.cu A/B
// builds; the defaults are the measured best (BENCHMARKS.md, optimisation log).
#ifndef QGEMV_STAGES
#define QGEMV_STAGES 4
#endif
constexpr int kStages = QGEMV_STAGES;  // weight ring depth per warp (tiles); a power of two
constexpr int kMaxWarps = 8;        // warps per block (split-K)

// Group metadata of one tile for this lane's two rows: up to 4 groups (G = 32).
struct TileMeta {
  float s0[4], s1[4];       // scales of rows r0, r1
  uint32_t z0[4], z1[4];    // (magic + zero) pairs in the activation type
};

// kGroup: 0 = one scale per output channel, else the group size (32, 64,
// 128); kZeros: group-wise zero points.  Both are template parameters, not
// runtime values: with a runtime zero-point flag the compiler emitted every
// MMA twice under predicates, and with a runtime group size every sub-tile
// carried predicated scale loads and folds (the g128 loop was 1.9x the
// per-channel one in SASS; see BENCHMARKS.md).
template <typename T, int kBits, int kGroup, bool kZeros, int kNT>
struct GemvMma {
  static constexpr int kTileK = kBits == 4 ? 128 : 64;
  static constexpr bool kGrouped = kGroup != 0;
  static constexpr bool kHasZeros = kZeros;
  static_assert(kGroup == 0 || (kBits == 4 && (kGroup == 32 || kGroup == 64 || kGroup == 128)),
                "group-wise scales: int4 with G in {32, 64, 128}");
  static_assert(kGrouped || !kZeros, "zero points are group-wise only");
  static constexpr int kSubPerGroup = kGrouped ? kGroup / 32 : 1;  // 32-k sub-tiles per group
  static constexpr int kGroupsPerTile = kGrouped ? kTileK / kGroup : 1;
  // k offset of this lane's 8 (int4: per sub-tile) or 16 (int8) k in a tile,
  // in units of t.
  static constexpr int kLaneK = kBits == 4 ? 8 : 16;

  const GemvParams& p;
  int g, t;
  int r0, r1;                 // clamped rows for loads
  float acc[2][kNT][4];       // two banks of MMA C fragments (fp32)
  // Per-lane pointers, computed once: this lane's activations (its token of
  // each n-tile, clamped to M - 1, plus the lane's k offset), and the scale /
  // zero-point rows of r0 and r1.
  const T* xl[kNT];
  const __half *srow0, *srow1;
  const uint8_t *zrow0, *zrow1;
  int ngroups = 1;
  uint32_t sym_z, sym_y;      // symmetric zero point 8 as (magic + 8), (magic/16 + 8)

  __device__ __forceinline__ GemvMma(const GemvParams& params, int lane) : p(params) {
    g = lane >> 2;
    t = lane & 3;
    const int row0 = blockIdx.x * kRowsPerBlock + g;
    r0 = min(row0, p.N - 1);
    r1 = min(row0 + 8, p.N - 1);
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[b][n][i] = 0.f;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int tok = min(n * 8 + g, p.M - 1);
      xl[n] = static_cast<const T*>(p.x) + static_cast<size_t>(tok) * p.ldx + kLaneK * t;
    }
    if constexpr (kGrouped) ngroups = p.K / kGroup;
    srow0 = static_cast<const __half*>(p.scales) + r0 * ngroups;
    srow1 = static_cast<const __half*>(p.scales) + r1 * ngroups;
    zrow0 = p.zeros ? p.zeros + r0 * ngroups : nullptr;
    zrow1 = p.zeros ? p.zeros + r1 * ngroups : nullptr;
    sym_z = zero_pair(8);
    sym_y = ActTraits<T>::splat(ActTraits<T>::kMagicValue / 16.f + 8.f);
  }

  // The pair (magic + z, magic + z) in T for an integer zero point z < 16:
  // the magic's mantissa LSB is worth 1, so this is an OR, not a conversion.
  __device__ __forceinline__ static uint32_t zero_pair(uint32_t z) {
    return (z | (ActTraits<T>::kMagic & 0xffffu)) * 0x00010001u;
  }

  // 8 activations of this lane's token of n-tile nt at tile-relative k (the
  // lane offset is in xl).  Checked: zero where the lane's k >= K.
  template <bool kChecked>
  __device__ __forceinline__ uint4 load_x(int nt, int k) const {
    if (kChecked && k + kLaneK * t >= p.K) return make_uint4(0u, 0u, 0u, 0u);
    return *reinterpret_cast<const uint4*>(xl[nt] + k);
  }

  // Scales / zero points for the four sub-tiles of tile `tile` (grouped
  // int4).  Entry i belongs to sub-tile i, so every index is a compile-time
  // constant and the arrays stay in registers; sub-tiles of one group (G = 64,
  // 128) copy the entry before them instead of loading again.  Only the edge
  // tile can point past the last group (its sub-tiles past K are zeros).
  template <bool kChecked>
  __device__ __forceinline__ void load_meta(int tile, TileMeta& m) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i % kSubPerGroup == 0) {
        int gi = tile * kGroupsPerTile + i / kSubPerGroup;
        if (kChecked) gi = min(gi, ngroups - 1);
        m.s0[i] = __half2float(srow0[gi]);
        m.s1[i] = __half2float(srow1[gi]);
        if constexpr (kHasZeros) {
          m.z0[i] = zero_pair(zrow0[gi]);
          m.z1[i] = zero_pair(zrow1[gi]);
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

  // One int4 sub-tile j of a tile at k_tile: 32 consecutive k; this lane
  // holds k_tile + 32j + 8t .. +7 of rows r0 (word w0) and r1 (w1).
  template <int B, bool kChecked>
  __device__ __forceinline__ void int4_subtile(int k_tile, int j, uint32_t w0, uint32_t w1,
                                               const TileMeta& m, float (&part)[kNT][4]) {
    uint32_t z0 = sym_z, z1 = sym_z, y0 = sym_y, y1 = sym_y;
    if constexpr (kHasZeros) {
      z0 = m.z0[j];
      z1 = m.z1[j];
      // (magic/16 + z) = (magic + z) - 15 magic / 16: one exact subtraction
      // instead of a second register array per group.
      const uint32_t shift = ActTraits<T>::splat_const_15_16();
      y0 = ActTraits<T>::sub2(z0, shift);
      y1 = ActTraits<T>::sub2(z1, shift);
    }
    uint32_t a0[4], a1[4];
    dequant_int4_word<T>(w0, z0, y0, a0);
    dequant_int4_word<T>(w1, z1, y1, a1);
    const uint32_t step0[4] = {a0[0], a1[0], a0[1], a1[1]};
    const uint32_t step1[4] = {a0[2], a1[2], a0[3], a1[3]};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const uint4 xv = load_x<kChecked>(n, k_tile + 32 * j);
      // Grouped: per-group partial sums, folded with the scale at the group end.
      float(&c)[4] = kGrouped ? part[n] : acc[B][n];
      ActTraits<T>::mma(c, step0, xv.x, xv.y);
      ActTraits<T>::mma(c, step1, xv.z, xv.w);
    }
    if constexpr (kGrouped) {
      if ((j + 1) % kSubPerGroup != 0) return;  // group continues
      // End of a group: fold the fp32 partial sums in with the group's scales.
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        acc[B][n][0] += part[n][0] * m.s0[j];
        acc[B][n][1] += part[n][1] * m.s0[j];
        acc[B][n][2] += part[n][2] * m.s1[j];
        acc[B][n][3] += part[n][3] * m.s1[j];
#pragma unroll
        for (int i = 0; i < 4; ++i) part[n][i] = 0.f;
      }
    }
  }

  // One int8 tile at k_tile: this lane holds k_tile + 16t .. +15 of both rows.
  template <int B, bool kChecked>
  __device__ __forceinline__ void int8_tile(int k_tile, const uint4& w0, const uint4& w1) {
    const uint32_t u0[4] = {w0.x, w0.y, w0.z, w0.w};
    const uint32_t u1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const uint4 xa = load_x<kChecked>(n, k_tile);
      const uint4 xb = load_x<kChecked>(n, k_tile + 8);
      const uint32_t xp[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a0[2], a1[2];
        dequant_int8_word<T>(u0[j], a0);
        dequant_int8_word<T>(u1[j], a1);
        const uint32_t a[4] = {a0[0], a1[0], a0[1], a1[1]};
        ActTraits<T>::mma(acc[B][n], a, xp[2 * j], xp[2 * j + 1]);
      }
    }
  }

  // Tile number `tile` with this lane's words in w0 (row r0) and w1 (row r1);
  // the sub-tile count c is 4 except in an int4 edge tile.
  template <int B, bool kChecked>
  __device__ __forceinline__ void tile(int tile_idx, const uint4& w0, const uint4& w1, const TileMeta& m,
                                       int c = 4) {
    const int k_tile = tile_idx * kTileK;
    if constexpr (kBits == 4) {
      float part[kNT][4];
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[n][i] = 0.f;
      const uint32_t u0[4] = {w0.x, w0.y, w0.z, w0.w};
      const uint32_t u1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (!kChecked || j < c) int4_subtile<B, kChecked>(k_tile, j, u0[j], u1[j], m, part);
    } else {
      int8_tile<B, kChecked>(k_tile, w0, w1);
    }
  }
};

#ifndef QGEMV_MIN_BLOCKS_PER_SM
#define QGEMV_MIN_BLOCKS_PER_SM 2
#endif

template <typename T, int kBits, int kGroup, bool kZeros, int kNT>
__global__ void __launch_bounds__(kMaxWarps * 32, QGEMV_MIN_BLOCKS_PER_SM)
    gemv_mma_kernel(const GemvParams p) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, kNT>;
  constexpr int kTileK = Lane::kTileK;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  constexpr bool grouped = Lane::kGrouped;

  Lane s(p, lane);
  const uint64_t pol = evict_first_policy();
  const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
  // This block's panel: rows [16 bx, 16 bx + r) with each tile's 16 x 64
  // bytes stored together (formats.to_panels), so that the r0 half of a
  // warp's tile is 512 contiguous bytes, and so is the r1 half.
  const int panel_rows = min(kRowsPerBlock, p.N - static_cast<int>(blockIdx.x) * kRowsPerBlock);
  const char* panel = static_cast<const char*>(p.qweight) + blockIdx.x * kRowsPerBlock * row_bytes;
  const int i0 = s.r0 - blockIdx.x * kRowsPerBlock, i1 = s.r1 - blockIdx.x * kRowsPerBlock;
  const int tile_stride = panel_rows * kTileBytes;  // bytes from one tile of a row to the next
  const char* wr0 = panel + i0 * kTileBytes + 16 * s.t;
  const char* wr1 = panel + i1 * kTileBytes + 16 * s.t;
  // Clean tiles: every k < K.  The edge tile (if any) is tile nclean.
  const int nclean = p.K / kTileK;
  const bool has_edge = nclean * kTileK < p.Kp;

  // Shared memory: [weight ring: nwarps x kStages x 2 rows x 32 lanes x 16 B] [reduction]
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem) + warp * kStages * 64 + lane;
  float* red = reinterpret_cast<float*>(smem + static_cast<size_t>(nwarps) * kStages * 64 * sizeof(uint4));

  // This warp's clean tiles: warp, warp + W, ...
  const int count = warp < nclean ? (nclean - warp + nwarps - 1) / nwarps : 0;
  const int step_bytes = nwarps * tile_stride;
  const char* src0 = wr0 + warp * tile_stride;
  const char* src1 = wr1 + warp * tile_stride;
  int issued = 0;
  auto issue = [&]() {
    if (issued < count) {
      uint4* slot = ring + (issued & (kStages - 1)) * 64;
      cp_async_16(slot, src0, pol);
      cp_async_16(slot + 32, src1, pol);
      src0 += step_bytes;
      src1 += step_bytes;
    }
    ++issued;
    cp_async_commit();  // always commit: keeps the group count uniform
  };
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) issue();

  TileMeta meta_cur, meta_next;
  if (grouped && count > 0) s.template load_meta<false>(warp, meta_cur);
  // Two tiles per iteration, without guards inside, so that the compiler can
  // interleave the dequantisation and MMA chains of both (bank 0 and 1).
  int j = 0;
  int tile_a = warp;
  for (; j + 1 < count; j += 2, tile_a += 2 * nwarps) {
    const int tile_b = tile_a + nwarps;
    cp_async_wait<kStages - 2>();
    const uint4* slot_a = ring + (j & (kStages - 1)) * 64;
    const uint4 wa0 = slot_a[0], wa1 = slot_a[32];
    issue();
    cp_async_wait<kStages - 2>();
    const uint4* slot_b = ring + ((j + 1) & (kStages - 1)) * 64;
    const uint4 wb0 = slot_b[0], wb1 = slot_b[32];
    issue();
    TileMeta meta_b;
    if (grouped) s.template load_meta<false>(tile_b, meta_b);
    if (grouped && j + 2 < count) s.template load_meta<false>(tile_b + nwarps, meta_next);
    s.template tile<0, false>(tile_a, wa0, wa1, meta_cur);
    s.template tile<1, false>(tile_b, wb0, wb1, meta_b);
    meta_cur = meta_next;
  }
  if (j < count) {
    cp_async_wait<kStages - 2>();
    const uint4* slot = ring + (j & (kStages - 1)) * 64;
    s.template tile<0, false>(tile_a, slot[0], slot[32], meta_cur);
  }
  cp_async_wait<0>();

  // The edge tile, read directly, with bounds checks on the activations.  In
  // the panel it starts after nclean full tiles and holds `seg` bytes per row
  // (64 if it is a full stored tile whose last k are past K).
  if (has_edge && warp == nclean % nwarps) {
    TileMeta m;
    if (grouped) s.template load_meta<true>(nclean, m);
    const int left = p.Kp - nclean * kTileK;  // k of the tile that are in the packed row
    const int c = min(left / (kBits == 4 ? 32 : 16), 4);  // 16-byte pieces per row
    const char* b0 = panel + nclean * tile_stride + i0 * 16 * c;
    const char* b1 = panel + nclean * tile_stride + i1 * 16 * c;
    uint4 w0 = make_uint4(0u, 0u, 0u, 0u), w1 = w0;
    if constexpr (kBits == 4) {
      // c sub-tiles of 32 k; lane t's word j sits at word t*c + j.
      uint32_t u0[4] = {0u, 0u, 0u, 0u}, u1[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (i < c) {
          u0[i] = ld_stream_u32(b0 + (s.t * c + i) * 4, pol);
          u1[i] = ld_stream_u32(b1 + (s.t * c + i) * 4, pol);
        }
      }
      w0 = make_uint4(u0[0], u0[1], u0[2], u0[3]);
      w1 = make_uint4(u1[0], u1[1], u1[2], u1[3]);
      s.template tile<0, true>(nclean, w0, w1, m, c);
    } else {
      // c chunks of 16 k; lanes t >= c hold zeros (and read zero activations,
      // since their k >= K).
      if (s.t < c) {
        w0 = ld_stream_v4(b0 + 16 * s.t, pol);
        w1 = ld_stream_v4(b1 + 16 * s.t, pol);
      }
      s.template tile<0, true>(nclean, w0, w1, m);
    }
  }

  // Split-K reduction across warps: red[warp][value][lane].
  constexpr int kValues = kNT * 4;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      red[(warp * kValues + n * 4 + i) * kWarpSize + lane] = s.acc[0][n][i] + s.acc[1][n][i];
  __syncthreads();

  const __half* scales = static_cast<const __half*>(p.scales);
  T* y = static_cast<T*>(p.y);
  for (int v = threadIdx.x; v < kValues * kWarpSize; v += blockDim.x) {
    const int ln = v % kWarpSize, q = v / kWarpSize;
    const int n = q / 4, i = q % 4;
    float sum = 0.f;
    for (int w2 = 0; w2 < nwarps; ++w2) sum += red[(w2 * kValues + q) * kWarpSize + ln];
    // C fragment: i = 0,1 -> row g, tokens 2t, 2t+1; i = 2,3 -> row g+8.
    const int row = blockIdx.x * kRowsPerBlock + (ln >> 2) + (i >= 2 ? 8 : 0);
    const int tok = n * 8 + 2 * (ln & 3) + (i & 1);
    if (row < p.N && tok < p.M) {
      if constexpr (!grouped) sum *= __half2float(scales[row]);
      ActTraits<T>::store(y + static_cast<size_t>(tok) * p.ldy + row, sum);
    }
  }
}

// Warps per block (the split-K factor), measured on the H200 with
// eval/gemv_lab.cu --warps 8,4,2 over 11 shapes x 7 formats (BENCHMARKS.md):
//   * short rows (K <= 4096) and at least 640 blocks: 2 warps, each with a
//     longer run of tiles (int4 12288x4096: 16.7 -> 13.8 us against 8 warps);
//   * long rows (K >= 8192) and at least 512 blocks: 4 warps;
//   * otherwise (few blocks) 8 warps, so that split-K fills the GPU.
// Within 8% of the best of {2, 4, 8} on every measured shape and format.
// Never more warps than tiles.
inline int choose_warps(int N, int K, int Kp, int tile_k) {
  const int k_tiles = (Kp + tile_k - 1) / tile_k;
  const int blocks = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  int w = kMaxWarps;
  if (K <= 4096 && blocks >= 640) {
    w = 2;
  } else if (K >= 8192 && blocks >= 512) {
    w = 4;
  }
  return k_tiles < w ? (k_tiles > 0 ? k_tiles : 1) : w;
}

template <typename T, int kBits, int kGroup, bool kZeros, int kNT>
Status launch_gemv_mma(const GemvParams& p, cudaStream_t stream) {
  constexpr int kTileK = GemvMma<T, kBits, kGroup, kZeros, kNT>::kTileK;
  const int w = p.warps_per_block > 0 ? p.warps_per_block : choose_warps(p.N, p.K, p.Kp, kTileK);
  if (w > kMaxWarps) return Status::kBadShape;
  const dim3 grid((p.N + kRowsPerBlock - 1) / kRowsPerBlock);
  const size_t smem = static_cast<size_t>(w) * kStages * 64 * sizeof(uint4) +
                      static_cast<size_t>(w) * kNT * 4 * kWarpSize * sizeof(float);
  auto kernel = gemv_mma_kernel<T, kBits, kGroup, kZeros, kNT>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess)
    return Status::kLaunchFailed;
  kernel<<<grid, w * kWarpSize, smem, stream>>>(p);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// Runtime (activation type, token count) -> template instance.
template <int kBits, int kGroup, bool kZeros>
Status dispatch_gemv_tokens(const GemvParams& p, cudaStream_t stream) {
  if (p.M < 1 || p.M > kMaxGemvTokens) return Status::kBadShape;
  const bool two = p.M > 8;
  if (p.act == ActType::kHalf) {
    return two ? launch_gemv_mma<__half, kBits, kGroup, kZeros, 2>(p, stream)
               : launch_gemv_mma<__half, kBits, kGroup, kZeros, 1>(p, stream);
  }
  if (p.act == ActType::kBFloat16) {
    return two ? launch_gemv_mma<__nv_bfloat16, kBits, kGroup, kZeros, 2>(p, stream)
               : launch_gemv_mma<__nv_bfloat16, kBits, kGroup, kZeros, 1>(p, stream);
  }
  return Status::kNoKernel;
}

}  // namespace qgemv
