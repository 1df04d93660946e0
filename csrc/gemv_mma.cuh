// Weight-only GEMV for M = 1..16 tokens on tensor cores.
//
// Layout (one block = 16 output rows, W warps splitting K):
//
//   The weight tile of 16 rows is the A operand of mma.m16n8k16; the tokens
//   are the B operand (8 tokens per n-tile, one or two n-tiles).  Lane
//   (g = lane/4, t = lane%4) owns rows g and g+8 of the tile and token g of
//   each n-tile, exactly like the seed's "one warp per row" GEMV except that
//   the warp owns 16 rows and the k-reduction across the four lanes of a quad
//   happens inside the MMA instead of in shuffles.
//
//   Each lane reads 16 bytes of weights per row per tile with one 128-bit
//   load.  The MMA sums over 16 "positions" per step and lane t holds
//   positions {2t, 2t+1, 2t+8, 2t+9}; which real k a position stands for is
//   ours to choose, so we choose the k that the lane already has in its
//   registers and load the matching activations.  No shared memory, no
//   shuffles of weights.
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
//   weight on top of that would use most of the issue slots at 4 TB/s.  The
//   MMA does the multiply-accumulate in fp32 for free and its cost is flat in
//   M up to 8 (then 16) tokens.
//
// Split-K across the warps of the block: warp w takes tiles w, w+W, w+2W, ...
// with 4 tiles of weight loads in flight per lane, then the warps meet in
// shared memory and the first threads write the 16 x M outputs.
#pragma once

#include "qgemv_common.cuh"

namespace qgemv {

constexpr int kRowsPerBlock = 16;
constexpr int kTileBytes = 64;  // bytes of one row per tile (int8: 64 k, int4: 128 k)
constexpr int kLoadsInFlight = 4;

template <typename T, int kBits, bool kHasZeros, int kNT>
struct GemvMma {
  static constexpr int kTileK = kBits == 4 ? 128 : 64;

  // Per-lane state.
  const GemvParams& p;
  const T* x;
  int g, t;
  int r0, r1;               // clamped rows for loads
  float acc[kNT][4];        // fp32 accumulators (MMA C fragments)
  float part[kNT][4];       // per-group partial sums (grouped int4 only)

  __device__ __forceinline__ GemvMma(const GemvParams& params, int lane) : p(params) {
    x = static_cast<const T*>(p.x);
    g = lane >> 2;
    t = lane & 3;
    const int row0 = blockIdx.x * kRowsPerBlock + g;
    r0 = min(row0, p.N - 1);
    r1 = min(row0 + 8, p.N - 1);
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[n][i] = part[n][i] = 0.f;
  }

  // 8 activations of this lane's token(s) at k, zero past M or K.
  __device__ __forceinline__ uint4 load_x(int nt, int k) const {
    const int tok = nt * 8 + g;
    if (tok < p.M && k < p.K) return ld_act_v4(x + static_cast<size_t>(tok) * p.ldx + k);
    return make_uint4(0u, 0u, 0u, 0u);
  }

  // One int4 sub-tile: 32 consecutive k starting at k_sub (a multiple of 32);
  // this lane contributes k_sub + 8t .. +7 of rows r0 (word w0) and r1 (w1).
  __device__ __forceinline__ void int4_subtile(int k_sub, uint32_t w0, uint32_t w1) {
    const bool grouped = p.group_size > 0;
    const int ngroups = grouped ? p.K / p.group_size : 1;
    const int gidx = grouped ? min(k_sub / p.group_size, ngroups - 1) : 0;
    uint32_t z0 = ActTraits<T>::kMagic | 0x00080008u;  // symmetric: magic + 8
    uint32_t z1 = z0;
    if constexpr (kHasZeros) {
      z0 = ActTraits<T>::splat(ActTraits<T>::kMagicValue + p.zeros[r0 * ngroups + gidx]);
      z1 = ActTraits<T>::splat(ActTraits<T>::kMagicValue + p.zeros[r1 * ngroups + gidx]);
    }
    uint32_t a0[4], a1[4];
    dequant_int4_word<T>(w0, z0, a0);
    dequant_int4_word<T>(w1, z1, a1);
    const uint32_t step0[4] = {a0[0], a1[0], a0[1], a1[1]};
    const uint32_t step1[4] = {a0[2], a1[2], a0[3], a1[3]};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const uint4 xv = load_x(n, k_sub + 8 * t);
      // Two explicit branches (not a pointer select) keep both arrays in registers.
      if (grouped) {
        ActTraits<T>::mma(part[n], step0, xv.x, xv.y);
        ActTraits<T>::mma(part[n], step1, xv.z, xv.w);
      } else {
        ActTraits<T>::mma(acc[n], step0, xv.x, xv.y);
        ActTraits<T>::mma(acc[n], step1, xv.z, xv.w);
      }
    }
    if (grouped && ((k_sub + 32) % p.group_size) == 0) {
      // End of a group: fold the partial sums in with this group's scales.
      const __half* s = static_cast<const __half*>(p.scales);
      const float s0 = __half2float(s[r0 * ngroups + gidx]);
      const float s1 = __half2float(s[r1 * ngroups + gidx]);
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        acc[n][0] += part[n][0] * s0;
        acc[n][1] += part[n][1] * s0;
        acc[n][2] += part[n][2] * s1;
        acc[n][3] += part[n][3] * s1;
#pragma unroll
        for (int i = 0; i < 4; ++i) part[n][i] = 0.f;
      }
    }
  }

  // One int8 tile at k_tile: this lane holds k_tile + 16t .. +15 of both rows.
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
        ActTraits<T>::mma(acc[n], a, xp[2 * j], xp[2 * j + 1]);
      }
    }
  }

  __device__ __forceinline__ void full_tile(int tile, const uint4& w0, const uint4& w1) {
    const int k_tile = tile * kTileK;
    if constexpr (kBits == 4) {
      int4_subtile(k_tile + 0, w0.x, w1.x);
      int4_subtile(k_tile + 32, w0.y, w1.y);
      int4_subtile(k_tile + 64, w0.z, w1.z);
      int4_subtile(k_tile + 96, w0.w, w1.w);
    } else {
      int8_tile(k_tile, w0, w1);
    }
  }

  // The last, partial tile (Kp % kTileK != 0).
  __device__ __forceinline__ void tail_tile(int tile, int tail_k, const char* wr0, const char* wr1,
                                            uint64_t pol) {
    const int k_tile = tile * kTileK;
    const char* b0 = wr0 + tile * kTileBytes;
    const char* b1 = wr1 + tile * kTileBytes;
    if constexpr (kBits == 4) {
      // c sub-tiles of 32 k; lane t's word j sits at word t*c + j.
      const int c = tail_k / 32;
      for (int j = 0; j < c; ++j) {
        const int off = (t * c + j) * 4;
        int4_subtile(k_tile + 32 * j, ld_stream_u32(b0 + off, pol), ld_stream_u32(b1 + off, pol));
      }
    } else {
      // c chunks of 16 k; lanes t >= c have nothing (their activations are 0 too).
      const int c = tail_k / 16;
      uint4 w0 = make_uint4(0u, 0u, 0u, 0u), w1 = w0;
      if (t < c) {
        w0 = ld_stream_v4(b0 + 16 * t, pol);
        w1 = ld_stream_v4(b1 + 16 * t, pol);
      }
      int8_tile(k_tile, w0, w1);
    }
  }
};

template <typename T, int kBits, bool kHasZeros, int kNT>
__global__ void __launch_bounds__(512)
    gemv_mma_kernel(const GemvParams p) {
  using Lane = GemvMma<T, kBits, kHasZeros, kNT>;
  constexpr int kTileK = Lane::kTileK;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;

  Lane s(p, lane);
  const uint64_t pol = evict_first_policy();
  const size_t row_bytes = kBits == 4 ? p.Kp / 2 : p.Kp;
  const char* wr0 = static_cast<const char*>(p.qweight) + s.r0 * row_bytes;
  const char* wr1 = static_cast<const char*>(p.qweight) + s.r1 * row_bytes;
  const int nfull = p.Kp / kTileK;
  const int tail_k = p.Kp % kTileK;

  for (int base = warp; base < nfull; base += kLoadsInFlight * nwarps) {
    uint4 w[kLoadsInFlight][2];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int tile = base + u * nwarps;
      if (tile < nfull) {
        const int off = tile * kTileBytes + 16 * s.t;
        w[u][0] = ld_stream_v4(wr0 + off, pol);
        w[u][1] = ld_stream_v4(wr1 + off, pol);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int tile = base + u * nwarps;
      if (tile < nfull) s.full_tile(tile, w[u][0], w[u][1]);
    }
  }
  if (tail_k != 0 && warp == nfull % nwarps) s.tail_tile(nfull, tail_k, wr0, wr1, pol);

  // Split-K reduction across warps: red[warp][value][lane].
  extern __shared__ float red[];
  constexpr int kValues = kNT * 4;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[(warp * kValues + n * 4 + i) * kWarpSize + lane] = s.acc[n][i];
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
      if (p.group_size == 0) sum *= __half2float(scales[row]);
      ActTraits<T>::store(y + static_cast<size_t>(tok) * p.ldy + row, sum);
    }
  }
}

// Number of warps that split K inside a block: enough blocks x warps to keep
// ~16 warps resident per SM, never more warps than there are K tiles.
inline int choose_warps(int N, int Kp, int tile_k, int num_sms) {
  const int row_tiles = (N + kRowsPerBlock - 1) / kRowsPerBlock;
  const int k_tiles = (Kp + tile_k - 1) / tile_k;
  const int target = num_sms * 16;
  int w = (target + row_tiles - 1) / row_tiles;
  w = w < 16 ? w : 16;
  w = w < k_tiles ? w : k_tiles;
  return w > 0 ? w : 1;
}

template <typename T, int kBits, bool kHasZeros, int kNT>
Status launch_gemv_mma(const GemvParams& p, int num_sms, cudaStream_t stream) {
  constexpr int kTileK = GemvMma<T, kBits, kHasZeros, kNT>::kTileK;
  const int w = p.warps_per_block > 0 ? p.warps_per_block : choose_warps(p.N, p.Kp, kTileK, num_sms);
  if (w > 16) return Status::kBadShape;
  const dim3 grid((p.N + kRowsPerBlock - 1) / kRowsPerBlock);
  const size_t smem = static_cast<size_t>(w) * kNT * 4 * kWarpSize * sizeof(float);
  gemv_mma_kernel<T, kBits, kHasZeros, kNT><<<grid, w * kWarpSize, smem, stream>>>(p);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// Runtime (activation type, zeros, token count) -> template instance.
template <int kBits, bool kHasZeros>
Status dispatch_gemv_tokens(const GemvParams& p, int num_sms, cudaStream_t stream) {
  if (p.M < 1 || p.M > kMaxGemvTokens) return Status::kBadShape;
  const bool two = p.M > 8;
  if (p.act == ActType::kHalf) {
    return two ? launch_gemv_mma<__half, kBits, kHasZeros, 2>(p, num_sms, stream)
               : launch_gemv_mma<__half, kBits, kHasZeros, 1>(p, num_sms, stream);
  }
  if (p.act == ActType::kBFloat16) {
    return two ? launch_gemv_mma<__nv_bfloat16, kBits, kHasZeros, 2>(p, num_sms, stream)
               : launch_gemv_mma<__nv_bfloat16, kBits, kHasZeros, 1>(p, num_sms, stream);
  }
  return Status::kNoKernel;
}

}  // namespace qgemv
