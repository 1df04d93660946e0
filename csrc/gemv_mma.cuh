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
// ncu numbers that led here):
//   * Weights stream through a per-warp ring of kStages tiles in shared
//     memory filled with cp.async (L1 bypassed, L2 evict-first).  Each lane
//     copies and later reads back only its own 2 x 16 bytes per tile, so no
//     barrier is needed; a warp keeps kStages - 1 tiles (up to 5 KB) in flight
//     at all times without spending registers on them.
//   * Activations are staged once per block in shared memory when all M x K
//     of them fit in kActSmemBytes (always for M = 1 up to K = 16384);
//     otherwise they are read through L1 (__ldg).
//   * Group scales and zero points for tile j+1 are loaded while tile j is
//     computed, so their latency is hidden behind one tile of work.
//   * Consecutive tiles of a warp accumulate into two register banks: two
//     independent MMA dependency chains.
//
// Split-K across the warps of the block: warp w takes tiles w, w+W, w+2W, ...;
// at the end the warps meet in shared memory and the first threads write the
// 16 x M outputs.
#pragma once

#include "qgemv_common.cuh"

namespace qgemv {

constexpr int kRowsPerBlock = 16;
constexpr int kTileBytes = 64;      // bytes of one row per tile (int8: 64 k, int4: 128 k)
constexpr int kStages = 8;          // weight ring depth per warp (tiles); a power of two
constexpr int kMaxWarps = 8;        // warps per block (split-K)
constexpr int kActSmemBytes = 32 * 1024;

// Group metadata of one tile for this lane's two rows: up to 4 groups (G = 32).
struct TileMeta {
  float s0[4], s1[4];       // scales of rows r0, r1
  uint32_t z0[4], z1[4];    // (magic + zero) pairs in the activation type
};

// kMode: 0 = one scale per output channel, 1 = group-wise symmetric,
// 2 = group-wise with zero points.  A template parameter, not a runtime flag:
// with a runtime flag the compiler emitted every MMA twice under predicates.
enum GroupMode : int { kPerChannel = 0, kGroupSym = 1, kGroupAsym = 2 };

template <typename T, int kBits, int kMode, int kNT>
struct GemvMma {
  static constexpr int kTileK = kBits == 4 ? 128 : 64;
  static constexpr bool kGrouped = kMode != kPerChannel;
  static constexpr bool kHasZeros = kMode == kGroupAsym;

  const GemvParams& p;
  int g, t;
  int r0, r1;                 // clamped rows for loads
  float acc[2][kNT][4];       // two banks of MMA C fragments (fp32)
  // Per-lane pointers, computed once: this lane's activation row of each
  // n-tile (staged in shared memory or in global memory), and the scale /
  // zero-point rows of r0 and r1.
  const T* xrow[kNT];
  bool xvalid[kNT];
  const __half *srow0, *srow1;
  const uint8_t *zrow0, *zrow1;
  int gshift = 0;             // log2(group_size), 0 = per channel
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
    set_x(static_cast<const T*>(p.x), p.ldx);
    if (kGrouped) {
      gshift = 31 - __clz(p.group_size);
      ngroups = p.K >> gshift;
    }
    srow0 = static_cast<const __half*>(p.scales) + r0 * ngroups;
    srow1 = static_cast<const __half*>(p.scales) + r1 * ngroups;
    zrow0 = p.zeros ? p.zeros + r0 * ngroups : nullptr;
    zrow1 = p.zeros ? p.zeros + r1 * ngroups : nullptr;
    sym_z = ActTraits<T>::splat(ActTraits<T>::kMagicValue + 8.f);
    sym_y = ActTraits<T>::splat(ActTraits<T>::kMagicValue / 16.f + 8.f);
  }

  __device__ __forceinline__ void set_x(const T* base, int ld) {
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int tok = n * 8 + g;
      xvalid[n] = tok < p.M;
      xrow[n] = base + static_cast<size_t>(xvalid[n] ? tok : 0) * ld;
    }
  }

  // 8 activations of this lane's token of n-tile nt at k; zero past M or K.
  // A generic load: the row lives in shared memory when the block staged the
  // activations, in global memory otherwise.
  __device__ __forceinline__ uint4 load_x(int nt, int k) const {
    if (!xvalid[nt] || k >= p.K) return make_uint4(0u, 0u, 0u, 0u);
    return *reinterpret_cast<const uint4*>(xrow[nt] + k);
  }

  // Scales / zero points for the four sub-tiles of tile `tile` (grouped
  // int4).  Entry i belongs to sub-tile i, so every index is a compile-time
  // constant and the arrays stay in registers; sub-tiles of one group (G = 64,
  // 128) copy the entry before them instead of loading again.
  __device__ __forceinline__ void load_meta(int tile, TileMeta& m) const {
    const int gsub_mask = (1 << (gshift - 5)) - 1;  // sub-tiles per group - 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i == 0 || (i & gsub_mask) == 0) {
        const int gi = min((tile * kTileK + 32 * i) >> gshift, ngroups - 1);
        m.s0[i] = __half2float(srow0[gi]);
        m.s1[i] = __half2float(srow1[gi]);
        if constexpr (kHasZeros) {
          const float za = zrow0[gi], zb = zrow1[gi];
          m.z0[i] = ActTraits<T>::splat(ActTraits<T>::kMagicValue + za);
          m.z1[i] = ActTraits<T>::splat(ActTraits<T>::kMagicValue + zb);
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

  // One int4 sub-tile j of tile `tile`: 32 consecutive k; this lane holds
  // k_sub + 8t .. +7 of rows r0 (word w0) and r1 (w1).
  template <int B>
  __device__ __forceinline__ void int4_subtile(int k_sub, int j, uint32_t w0, uint32_t w1,
                                               const TileMeta& m, float (&part)[kNT][4]) {
    constexpr bool grouped = kGrouped;
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
      const uint4 xv = load_x(n, k_sub + 8 * t);
      // Grouped: per-group partial sums, folded with the scale at the group end.
      if constexpr (grouped) {
        ActTraits<T>::mma(part[n], step0, xv.x, xv.y);
        ActTraits<T>::mma(part[n], step1, xv.z, xv.w);
      } else {
        ActTraits<T>::mma(acc[B][n], step0, xv.x, xv.y);
        ActTraits<T>::mma(acc[B][n], step1, xv.z, xv.w);
      }
    }
    if constexpr (grouped) {
      if ((((j + 1) << 5) & ((1 << gshift) - 1)) != 0) return;  // group continues
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
  template <int B>
  __device__ __forceinline__ void int8_tile(int k_tile, const uint4& w0, const uint4& w1) {
    const uint32_t u0[4] = {w0.x, w0.y, w0.z, w0.w};
    const uint32_t u1[4] = {w1.x, w1.y, w1.z, w1.w};
    const int k = k_tile + 16 * t;
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const uint4 xa = load_x(n, k);
      const uint4 xb = load_x(n, k + 8);
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

  // A tile with this lane's words in w0 (row r0) and w1 (row r1); the
  // sub-tile count c is 4 except in the int4 tail.
  template <int B>
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
        if (j < c) int4_subtile<B>(k_tile + 32 * j, j, u0[j], u1[j], m, part);
    } else {
      int8_tile<B>(k_tile, w0, w1);
    }
  }
};

template <typename T, int kBits, int kMode, int kNT>
__global__ void __launch_bounds__(kMaxWarps * 32, 2)
    gemv_mma_kernel(const GemvParams p) {
  using Lane = GemvMma<T, kBits, kMode, kNT>;
  constexpr int kTileK = Lane::kTileK;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  constexpr bool grouped = Lane::kGrouped;

  Lane s(p, lane);
  const uint64_t pol = evict_first_policy();
  const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
  const char* wr0 = static_cast<const char*>(p.qweight) + s.r0 * row_bytes + 16 * s.t;
  const char* wr1 = static_cast<const char*>(p.qweight) + s.r1 * row_bytes + 16 * s.t;
  const int nfull = p.Kp / kTileK;
  const int tail_k = p.Kp % kTileK;

  // Shared memory: [weight ring: nwarps x kStages x 2 rows x 32 lanes x 16 B]
  //                [activations: M x ld_xs, if staged] [reduction]
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem) + warp * kStages * 64 + lane;
  unsigned char* after_ring = smem + static_cast<size_t>(nwarps) * kStages * 64 * sizeof(uint4);
  const bool stage_x = p.stage_x != 0;
  const int ld_xs = p.Kp + 8;  // +16 bytes per row: tokens land in different banks
  float* red = reinterpret_cast<float*>(
      after_ring + (stage_x ? static_cast<size_t>(p.M) * ld_xs * sizeof(T) : 0));

  // This warp's full tiles: warp, warp + W, ...
  const int count = warp < nfull ? (nfull - warp + nwarps - 1) / nwarps : 0;
  const int step_bytes = nwarps * kTileBytes;
  const char* src0 = wr0 + warp * kTileBytes;
  const char* src1 = wr1 + warp * kTileBytes;
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
  if (grouped && count > 0) s.load_meta(warp, meta_cur);
  // Two tiles per iteration, without guards inside, so that the compiler can
  // interleave the dequantisation and MMA chains of both (bank 0 and 1).
  int j = 0;
  for (; j + 1 < count; j += 2) {
    cp_async_wait<kStages - 2>();
    const uint4* slot_a = ring + (j & (kStages - 1)) * 64;
    const uint4 wa0 = slot_a[0], wa1 = slot_a[32];
    issue();
    cp_async_wait<kStages - 2>();
    const uint4* slot_b = ring + ((j + 1) & (kStages - 1)) * 64;
    const uint4 wb0 = slot_b[0], wb1 = slot_b[32];
    issue();
    TileMeta meta_b;
    if (grouped) s.load_meta(warp + (j + 1) * nwarps, meta_b);
    if (grouped && j + 2 < count) s.load_meta(warp + (j + 2) * nwarps, meta_next);
    s.template tile<0>(warp + j * nwarps, wa0, wa1, meta_cur);
    s.template tile<1>(warp + (j + 1) * nwarps, wb0, wb1, meta_b);
    meta_cur = meta_next;
  }
  if (j < count) {
    cp_async_wait<kStages - 2>();
    const uint4* slot = ring + (j & (kStages - 1)) * 64;
    s.template tile<0>(warp + j * nwarps, slot[0], slot[32], meta_cur);
  }
  cp_async_wait<0>();

  // The last, partial tile (Kp % kTileK != 0), read directly.
  if (tail_k != 0 && warp == nfull % nwarps) {
    TileMeta m;
    if (grouped) s.load_meta(nfull, m);
    const char* b0 = wr0 - 16 * s.t + nfull * kTileBytes;
    const char* b1 = wr1 - 16 * s.t + nfull * kTileBytes;
    uint4 w0 = make_uint4(0u, 0u, 0u, 0u), w1 = w0;
    if constexpr (kBits == 4) {
      // c sub-tiles of 32 k; lane t's word j sits at word t*c + j.
      const int c = tail_k / 32;
      uint32_t u0[4] = {0u, 0u, 0u, 0u}, u1[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < c) {
          u0[j] = ld_stream_u32(b0 + (s.t * c + j) * 4, pol);
          u1[j] = ld_stream_u32(b1 + (s.t * c + j) * 4, pol);
        }
      }
      w0 = make_uint4(u0[0], u0[1], u0[2], u0[3]);
      w1 = make_uint4(u1[0], u1[1], u1[2], u1[3]);
      s.template tile<0>(nfull, w0, w1, m, c);
    } else {
      // c chunks of 16 k; lanes t >= c hold zeros (and read zero activations).
      if (s.t < tail_k / 16) {
        w0 = ld_stream_v4(b0 + 16 * s.t, pol);
        w1 = ld_stream_v4(b1 + 16 * s.t, pol);
      }
      s.template tile<0>(nfull, w0, w1, m);
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

// Warps per block: kMaxWarps, or fewer when K has fewer tiles.
inline int choose_warps(int Kp, int tile_k) {
  const int k_tiles = (Kp + tile_k - 1) / tile_k;
  return k_tiles < kMaxWarps ? (k_tiles > 0 ? k_tiles : 1) : kMaxWarps;
}

template <typename T, int kBits, int kMode, int kNT>
Status launch_gemv_mma(const GemvParams& p, cudaStream_t stream) {
  constexpr int kTileK = GemvMma<T, kBits, kMode, kNT>::kTileK;
  const int w = p.warps_per_block > 0 ? p.warps_per_block : choose_warps(p.Kp, kTileK);
  if (w > kMaxWarps) return Status::kBadShape;
  const dim3 grid((p.N + kRowsPerBlock - 1) / kRowsPerBlock);
  GemvParams q = p;
  const size_t x_bytes = static_cast<size_t>(p.M) * (p.Kp + 8) * sizeof(T);
  q.stage_x = x_bytes <= static_cast<size_t>(kActSmemBytes) ? 1 : 0;  // 0: activations via L1
  const size_t smem = static_cast<size_t>(w) * kStages * 64 * sizeof(uint4) + (q.stage_x ? x_bytes : 0) +
                      static_cast<size_t>(w) * kNT * 4 * kWarpSize * sizeof(float);
  auto kernel = gemv_mma_kernel<T, kBits, kMode, kNT>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess)
    return Status::kLaunchFailed;
  kernel<<<grid, w * kWarpSize, smem, stream>>>(q);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// Runtime (activation type, zeros, token count) -> template instance.
template <int kBits, int kMode>
Status dispatch_gemv_tokens(const GemvParams& p, cudaStream_t stream) {
  if (p.M < 1 || p.M > kMaxGemvTokens) return Status::kBadShape;
  const bool two = p.M > 8;
  if (p.act == ActType::kHalf) {
    return two ? launch_gemv_mma<__half, kBits, kMode, 2>(p, stream)
               : launch_gemv_mma<__half, kBits, kMode, 1>(p, stream);
  }
  if (p.act == ActType::kBFloat16) {
    return two ? launch_gemv_mma<__nv_bfloat16, kBits, kMode, 2>(p, stream)
               : launch_gemv_mma<__nv_bfloat16, kBits, kMode, 1>(p, stream);
  }
  return Status::kNoKernel;
}

}  // namespace qgemv
