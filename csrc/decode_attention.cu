// Decode attention for the generation engine's per-op step (qgemv::decode_attention; qgemv.h):
// one query token a sequence against its own visible cache slots only.
//
// Why: the engine's per-op step ran torch's SDPA over the whole static cache
// (max_seq_len slots) with an additive mask, so every step read max_seq_len
// K / V rows a sequence whatever its context: at batch 16 on Llama-2-7B
// shapes (H100, 2026-12-06, max_seq_len 776) attention was 2.48 ms of a
// 5.37 ms step, and with the engine's default max_seq_len of 4096 it reads
// up to 5x more.  This kernel reads the rows pad .. slot of each sequence.
//
// Flash-decoding with tensor cores: a block takes one (sequence, kv head)
// and a share ("split") of the visible keys; its 4 warps take 16 keys each
// of every 64-key tile, which the block copies into shared memory through
// cp.async (2 stages; rows past the split's end are zero-filled).  The query
// heads of the kv head's GQA group are the MMA's 16 rows (up to 16 heads;
// rows past the group are zero), so S^T = Q K^T comes out as the A operand
// of O = P V without a shuffle.  Online softmax in fp32 (base-2 exponents of
// the scaled scores); P is rounded to the activation type for the second
// MMA, as flash attention does.  The warps' partial results merge in shared
// memory; with one split the block writes the output, with more it writes
// (unnormalized sums, max, denominator) and a second kernel merges splits.
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "qgemv.h"
#include "qgemv_common.cuh"

namespace qgemv {
namespace {

constexpr int kDaThreads = 128;  // 4 warps
constexpr int kDaWarpKeys = 16;  // keys a warp takes from each tile
constexpr int kDaTileKeys = kDaWarpKeys * (kDaThreads / 32);
// K / V tiles in flight: kStages - 1 a block while it sums one (2: 68 KB of shared memory at head_dim 128,
// three blocks an SM on sm_90, one on sm_86; 3: 102 KB, two blocks; 4: 136 KB, one).  The rule
// (decode_attention_stage_rule): 3 where the (sequence, kv head) pairs fill the 3-stage blocks an SM holds at
// once, else 4 (the context split over fewer, deeper blocks).  H100, torch 2.11, 2026-12-06, one layer
// (dev/decode_attn_probe.py --stages 3,4; GB/s of the visible K / V at the chosen split count, 2 / 3 / 4
// stages): Llama-2-7B batch 16 (512 pairs) 2576 / 2636 / 2576, Llama-3-8B batch 16 (128) 1763 / 1871 / 2112,
// batch 1 (32) 894 / 910 / 1041, batch 4 at 2000 positions (32) 1626 / 1697 / 1778; the engine at batch 16
// (ms a step, two rounds, 2 / 3 / 4 stages): Llama-2-7B 5.056 / 5.059, 4.971 / 4.987, 5.063 / 5.068;
// Llama-3-8B 3.882 / 3.884, 3.858 / 3.850, 3.776 / 3.771.  set_decode_attention_stages forces a count (the A/B).
constexpr int kDaMinStages = 2, kDaMaxStages = 4;
std::atomic<int> da_stages{0};  // 0: the rule

template <int D, int kStages, bool kRope>
struct DaLayout {
  // a K or V row in shared memory, padded by 16 bytes: the 8 rows one ldmatrix phase reads start 4 banks apart
  static constexpr int kRow = D * 2 + 16;
  static constexpr int kTile = kDaTileKeys * kRow;
  static constexpr int kStage = 2 * kTile;  // K's tile, then V's
  // rope_decode_attention, after the stages: the group's rotated queries [16][D] and the token's rotated key
  // and value [2][D] (the activation type)
  static constexpr int kRopeAt = kStages * kStage;
  static constexpr int kRopeBytes = kRope ? (16 + 2) * D * 2 : 0;
  static constexpr int kMerge = (4 * 16 * D + 4 * 16 * 2) * 4;  // the warps' sums, maxima and denominators
  static constexpr int kSmem = kRopeAt + kRopeBytes > kMerge ? kRopeAt + kRopeBytes : kMerge;
};

__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// rope_decode_attention's input (kRope): the token's query heads of this kv head's group and its key, each
// normalized by q_norm / k_norm when given (transformers' RMSNorm: fp32 statistics, the normalized value
// rounded to T, times the gain rounded to T), rotated at position pos (x cos + rotate_half(x) sin: two rounded
// fp32 products and their rounded sum, rounded to T, as torch's elementwise ops compute it; the engine's
// compiled glue within a rounding of it), into qs [grp][D], kn [D] and vn [D] (the value as it is).
// A thread takes 8 dims of a row and their rotate_half partners (D / 2 apart) in 16-byte loads, all issued
// before any is used: one round trip to L2 (a second, after the block's first K / V copies are already in
// flight, where a block has more rows than threads take at once); a row's RMSNorm statistics are summed across
// its kG lanes by shuffles.  Every thread of the block; ends with a block barrier.  16-byte aligned rows
// (the wrapper's rule).
template <typename T, int D>
__device__ __forceinline__ void rope_input(const DecodeAttnParams& p, const DecodeAttnRope& ro, int b, int kvh,
                                           int grp, int pos, T* qs, T* kn, T* vn) {
  constexpr int kHalf = D / 2, kChunks = kHalf / 8;                 // 8-dim chunks of a half row: 4, 6 or 8
  constexpr int kG = kChunks <= 4 ? 4 : 8;                          // lanes a row (a power of two)
  const int h0 = kvh * grp, rows = grp + 2;                         // grp queries, the key, the value
  const bool norm = ro.q_norm != nullptr;
  const T* q0 = static_cast<const T*>(p.q) + b * p.q_sb + static_cast<long long>(h0) * p.q_sh;
  const T* kr = static_cast<const T*>(ro.knew) + b * ro.kn_sb + static_cast<long long>(kvh) * ro.kn_sh;
  const T* vr = static_cast<const T*>(ro.vnew) + b * ro.kn_sb + static_cast<long long>(kvh) * ro.kn_sh;
  const uint4* cs = reinterpret_cast<const uint4*>(static_cast<const T*>(ro.cos) + static_cast<long long>(pos) * D);
  const uint4* sn = reinterpret_cast<const uint4*>(static_cast<const T*>(ro.sin) + static_cast<long long>(pos) * D);
  for (int base = 0; base < rows * kG; base += kDaThreads) {  // (uniform trip count: every lane shuffles)
    const int item = base + static_cast<int>(threadIdx.x), r = item / kG, c = item % kG;
    const bool on = r < rows && c < kChunks;
    const T* x = r < grp ? q0 + static_cast<long long>(r) * p.q_sh : r == grp ? kr : vr;
    uint4 lo = {}, hi = {}, clo = {}, chi = {}, slo = {}, shi = {}, glo = {}, ghi = {};
    if (on) {
      lo = *reinterpret_cast<const uint4*>(x + 8 * c);
      hi = *reinterpret_cast<const uint4*>(x + kHalf + 8 * c);
      if (r <= grp) {
        clo = cs[c], chi = cs[kChunks + c], slo = sn[c], shi = sn[kChunks + c];
        if (norm) {
          const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(r < grp ? ro.q_norm : ro.k_norm));
          glo = w[c], ghi = w[kChunks + c];
        }
      }
    }
    const T* xl = reinterpret_cast<const T*>(&lo);
    const T* xh = reinterpret_cast<const T*>(&hi);
    float inv = 0.f;
    if (norm) {  // the row's sum of squares over its kG lanes
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float a = to_float(xl[e]), z = to_float(xh[e]);
        ss = fmaf(a, a, fmaf(z, z, ss));
      }
#pragma unroll
      for (int o = kG / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      inv = rsqrtf(ss / D + ro.norm_eps);
    }
    if (!on) continue;
    if (r == grp + 1) {  // the value: as it is
      *reinterpret_cast<uint4*>(vn + 8 * c) = lo;
      *reinterpret_cast<uint4*>(vn + kHalf + 8 * c) = hi;
      continue;
    }
    const T *gl = reinterpret_cast<const T*>(&glo), *gh = reinterpret_cast<const T*>(&ghi);
    const T *cl = reinterpret_cast<const T*>(&clo), *ch = reinterpret_cast<const T*>(&chi);
    const T *sl = reinterpret_cast<const T*>(&slo), *sh = reinterpret_cast<const T*>(&shi);
    auto normed = [&](T v, T g) {
      if (!norm) return to_float(v);
      return to_float(from_float<T>(to_float(g) * to_float(from_float<T>(to_float(v) * inv))));
    };
    uint4 olo, ohi;
    T* ol = reinterpret_cast<T*>(&olo);
    T* oh = reinterpret_cast<T*>(&ohi);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float a = normed(xl[e], gl[e]), z = normed(xh[e], gh[e]);  // dims 8c + e and D / 2 + 8c + e
      ol[e] = from_float<T>(__fadd_rn(__fmul_rn(a, to_float(cl[e])), __fmul_rn(-z, to_float(sl[e]))));
      oh[e] = from_float<T>(__fadd_rn(__fmul_rn(z, to_float(ch[e])), __fmul_rn(a, to_float(sh[e]))));
    }
    T* out = r < grp ? qs + r * D : kn;
    *reinterpret_cast<uint4*>(out + 8 * c) = olo;
    *reinterpret_cast<uint4*>(out + kHalf + 8 * c) = ohi;
  }
  __syncthreads();
}

template <typename T, int D, int kStages, bool kRope>
__global__ void __launch_bounds__(kDaThreads) decode_attention_kernel(const DecodeAttnParams p,
                                                                      const DecodeAttnRope ro, const int pdl) {
  using L = DaLayout<D, kStages, kRope>;
  constexpr int kSteps = D / 16;  // QK's k-steps; PV's pairs of 8-dim output tiles
  extern __shared__ __align__(128) unsigned char da_smem[];
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int grp = p.heads / p.kv_heads, h0 = kvh * grp;
  const T* kb = static_cast<const T*>(p.k) + b * p.kv_sb + kvh * p.kv_sh;
  const T* vb = static_cast<const T*>(p.v) + b * p.kv_sb + kvh * p.kv_sh;
  // the visible keys pad .. slot (both clamped into the cache), this split's share [lo, hi)
  auto share = [&](int& lo, int& hi, long long& slot, long long& pad, long long raw_slot, long long raw_pad) {
    slot = raw_slot < 0 ? 0 : (raw_slot >= p.max_seq ? p.max_seq - 1 : raw_slot);
    pad = raw_pad < 0 ? 0 : (raw_pad > slot ? slot : raw_pad);
    const int len = static_cast<int>(slot + 1 - pad), per = (len + p.splits - 1) / p.splits;
    lo = static_cast<int>(pad) + split * per, hi = min(static_cast<int>(slot) + 1, lo + per);
  };
  int lo, hi;
  long long slot, pad;
  if (pdl & kPdlLaunch) {  // a programmatic launch (set_gemv_pdl): the kernel before may still run
    if (pdl & kPdlPrefetch) {
      // the first tiles' K / V rows into L2 while it runs: the cache's older rows depend on no kernel of this
      // step, and a prefetch never makes a later read stale (L2 is where writes land); slot and pad are read
      // again after the wait for everything else (read here past L1, so no line of them is held there)
      share(lo, hi, slot, pad, __ldcg(p.slot), __ldcg(p.pad + b));
      if (threadIdx.x < 2 && lo < hi) {
        const int rows = min(hi - lo, (kStages - 1) * kDaTileKeys);
        pdl_prefetch_l2((threadIdx.x == 0 ? kb : vb) + static_cast<long long>(lo) * D,
                        static_cast<uint32_t>(rows) * D * static_cast<uint32_t>(sizeof(T)));
      }
    }
    if (pdl & kPdlRelease) pdl_release();
    pdl_wait();
  }
  share(lo, hi, slot, pad, *p.slot, p.pad[b]);
  // kRope: the token's rotated query / key / value (rope_input), and whether this split holds its slot
  T* qs = reinterpret_cast<T*>(da_smem + L::kRopeAt);
  T* kn = qs + 16 * D;
  T* vn = kn + D;
  const bool holds = kRope && lo <= slot && slot < hi;

  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows (heads) g and g + 8
  float o[2 * kSteps][4];  // output tile n: dims 8n .. 8n + 7 (C layout: rows g / g + 8, dims 2t, 2t + 1)
#pragma unroll
  for (int n = 0; n < 2 * kSteps; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  if (lo < hi) {
    const int tiles = (hi - lo + kDaTileKeys - 1) / kDaTileKeys;
    auto load = [&](int tile) {
      unsigned char* sk = da_smem + (tile % kStages) * L::kStage;
      unsigned char* sv = sk + L::kTile;
      const int k0 = lo + tile * kDaTileKeys;
      constexpr int kPieces = D / 8;  // 16-byte pieces a row
      for (int i = threadIdx.x; i < kDaTileKeys * kPieces; i += kDaThreads) {
        const int r = i / kPieces, c = i % kPieces, key = k0 + r;
        const bool ok = key < hi && !(holds && key == slot);  // kRope: the slot's row is the token's (below)
        const long long off = static_cast<long long>(ok ? key : lo) * D + c * 8;
        cp_async_16_zfill(sk + r * L::kRow + c * 16, kb + off, ok);
        cp_async_16_zfill(sv + r * L::kRow + c * 16, vb + off, ok);
      }
    };
    // the first tiles' copies fly while q is read (q's loads would otherwise hold them back a round trip)
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < tiles) load(s);
      cp_async_commit();
    }
    if constexpr (kRope) {
      rope_input<T, D>(p, ro, b, kvh, grp, static_cast<int>(slot - pad), qs, kn, vn);
      if (holds) {  // the token's key and value into the caches at its slot (for the steps after this one)
        T* kw = static_cast<T*>(p.k) + b * p.kv_sb + kvh * p.kv_sh + slot * D;
        T* vw = static_cast<T*>(p.v) + b * p.kv_sb + kvh * p.kv_sh + slot * D;
        for (int d = threadIdx.x; d < D; d += kDaThreads) kw[d] = kn[d], vw[d] = vn[d];
      }
    }
    // Q as the A operand (rows: the group's heads), k-step j: dims 16j .. 16j + 15
    const unsigned short* qbits = kRope ? reinterpret_cast<const unsigned short*>(qs)
                                        : static_cast<const unsigned short*>(p.q) + b * p.q_sb;
    auto qpair = [&](int r, int d) -> uint32_t {
      if (r >= grp) return 0u;
      const unsigned short* row = qbits + (kRope ? static_cast<long long>(r) * D : (h0 + r) * p.q_sh) + d;
      return static_cast<uint32_t>(row[0]) | (static_cast<uint32_t>(row[1]) << 16);
    };
    uint32_t qa[kSteps][4];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      qa[j][0] = qpair(g, 16 * j + 2 * t);
      qa[j][1] = qpair(g + 8, 16 * j + 2 * t);
      qa[j][2] = qpair(g, 16 * j + 2 * t + 8);
      qa[j][3] = qpair(g + 8, 16 * j + 2 * t + 8);
    }
    for (int tile = 0; tile < tiles; ++tile) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // the tile is in for every thread; every warp is past the stage the next load reuses
      if (tile + kStages - 1 < tiles) load(tile + kStages - 1);
      cp_async_commit();
      if (holds && slot - (lo + tile * kDaTileKeys) < kDaTileKeys) {  // kRope: the slot's row is the token's
        unsigned char* row = da_smem + (tile % kStages) * L::kStage + (slot - lo - tile * kDaTileKeys) * L::kRow;
        for (int d = threadIdx.x; d < D; d += kDaThreads) {
          reinterpret_cast<T*>(row)[d] = kn[d];
          reinterpret_cast<T*>(row + L::kTile)[d] = vn[d];
        }
        __syncthreads();
      }
      const int kw = lo + tile * kDaTileKeys + warp * kDaWarpKeys;  // this warp's first key
      if (kw >= hi) continue;  // (warp-uniform)
      const unsigned char* sk = da_smem + (tile % kStages) * L::kStage + warp * kDaWarpKeys * L::kRow;
      const unsigned char* sv = sk + L::kTile;
      // S^T = Q K^T: s0 keys kw + 0..7, s1 keys kw + 8..15 (C layout: rows g / g + 8, keys 2t, 2t + 1)
      float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
      const unsigned char* ka = sk + ((lane & 7) + ((lane >> 4) << 3)) * L::kRow + ((lane >> 3) & 1) * 16;
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        uint32_t r[4];
        ldsm_x4(r, ka + 32 * j);
        ActTraits<T>::mma(s0, qa[j], r[0], r[1]);
        ActTraits<T>::mma(s1, qa[j], r[2], r[3]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kw + 2 * t + (e & 1);
        s0[e] = key < hi ? s0[e] * p.scale_log2 : -INFINITY;
        s1[e] = key + 8 < hi ? s1[e] * p.scale_log2 : -INFINITY;
      }
      float x0 = fmaxf(fmaxf(s0[0], s0[1]), fmaxf(s1[0], s1[1]));
      float x1 = fmaxf(fmaxf(s0[2], s0[3]), fmaxf(s1[2], s1[3]));
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
      const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
      const float b0 = n0 == -INFINITY ? 0.f : n0, b1 = n1 == -INFINITY ? 0.f : n1;
      const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);  // (m = -inf: 0)
      m0 = n0, m1 = n1;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s0[e] = exp2f(s0[e] - (e < 2 ? b0 : b1));
        s1[e] = exp2f(s1[e] - (e < 2 ? b0 : b1));
      }
      l0 = l0 * c0 + (s0[0] + s0[1]) + (s1[0] + s1[1]);  // this lane's keys; the quad's are summed at the end
      l1 = l1 * c1 + (s0[2] + s0[3]) + (s1[2] + s1[3]);
#pragma unroll
      for (int n = 0; n < 2 * kSteps; ++n) o[n][0] *= c0, o[n][1] *= c0, o[n][2] *= c1, o[n][3] *= c1;
      // O += P V: P (rows: heads, k: the 16 keys) is S^T's two C tiles as one A operand
      const uint32_t pa[4] = {pack2<T>(s0[0], s0[1]), pack2<T>(s0[2], s0[3]), pack2<T>(s1[0], s1[1]),
                              pack2<T>(s1[2], s1[3])};
      const unsigned char* va = sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * L::kRow + (lane >> 4) * 16;
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        uint32_t r[4];
        ldsm_x4_trans(r, va + 32 * j);
        ActTraits<T>::mma(o[2 * j], pa, r[0], r[1]);
        ActTraits<T>::mma(o[2 * j + 1], pa, r[2], r[3]);
      }
    }
    cp_async_wait<0>();
  }
  __syncthreads();  // every warp is past the stages: the merge reuses them
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  float* so = reinterpret_cast<float*>(da_smem);  // [warp][row 16][D]
  float* sml = so + 4 * 16 * D;                   // [warp][row 16][max, denominator]
#pragma unroll
  for (int n = 0; n < 2 * kSteps; ++n) {
    float* r0 = so + (warp * 16 + g) * D + 8 * n + 2 * t;
    r0[0] = o[n][0], r0[1] = o[n][1];
    r0[8 * D] = o[n][2], r0[8 * D + 1] = o[n][3];
  }
  if (t == 0) {
    sml[(warp * 16 + g) * 2] = m0, sml[(warp * 16 + g) * 2 + 1] = l0;
    sml[(warp * 16 + g + 8) * 2] = m1, sml[(warp * 16 + g + 8) * 2 + 1] = l1;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < grp * D; i += kDaThreads) {
    const int r = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sml[(w * 16 + r) * 2]);
    const float base = mx == -INFINITY ? 0.f : mx;
    float acc = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = exp2f(sml[(w * 16 + r) * 2] - base);
      acc += f * so[(w * 16 + r) * D + d];
      den += f * sml[(w * 16 + r) * 2 + 1];
    }
    const long long bh = static_cast<long long>(b) * p.heads + h0 + r;
    if (p.splits == 1) {
      static_cast<T*>(p.out)[bh * D + d] = from_float<T>(acc / den);
    } else {
      p.part_o[(bh * p.splits + split) * D + d] = acc;
      if (d == 0) p.part_ml[(bh * p.splits + split) * 2] = mx, p.part_ml[(bh * p.splits + split) * 2 + 1] = den;
    }
  }
}

// The splits of one (sequence, head) into its output: their sums rescaled to the largest maximum.
template <typename T, int D>
__global__ void __launch_bounds__(D) decode_attention_merge(const DecodeAttnParams p) {
  const long long bh = blockIdx.x;
  const float* ml = p.part_ml + bh * p.splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < p.splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  const float base = mx == -INFINITY ? 0.f : mx;
  const int d = threadIdx.x;
  float acc = 0.f, den = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float f = exp2f(ml[2 * s] - base);
    acc += f * p.part_o[(bh * p.splits + s) * D + d];
    den += f * ml[2 * s + 1];
  }
  static_cast<T*>(p.out)[bh * D + d] = from_float<T>(acc / den);
}

template <typename T, int D, int kStages, bool kRope>
Status launch(const DecodeAttnParams& p, const DecodeAttnRope& ro, cudaStream_t stream) {
  using L = DaLayout<D, kStages, kRope>;
  auto kernel = decode_attention_kernel<T, D, kStages, kRope>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmem) != cudaSuccess)
    return Status::kLaunchFailed;
  const dim3 grid(p.splits, p.kv_heads, p.batch);
  const int pdl = gemv_pdl_flags();  // the GEMVs' programmatic-launch setting (set_gemv_pdl) applies here too
  if (pdl != 0 && sm90_code(kernel)) {
    if (pdl_launch(kernel, grid, dim3(kDaThreads), L::kSmem, stream, p, ro, pdl) != cudaSuccess)
      return Status::kLaunchFailed;
  } else {
    kernel<<<grid, kDaThreads, L::kSmem, stream>>>(p, ro, 0);
  }
  if (cudaGetLastError() != cudaSuccess) return Status::kLaunchFailed;
  if (p.splits > 1) {
    decode_attention_merge<T, D><<<p.batch * p.heads, D, 0, stream>>>(p);
    if (cudaGetLastError() != cudaSuccess) return Status::kLaunchFailed;
  }
  return Status::kOk;
}

// The (head_dim, stage count, rope) instance: F<D, kStages, kRope>::run(args...).
template <template <int, int, bool> class F, typename... Args>
auto da_dispatch(int head_dim, int stages, bool rope, Args&&... args) {
  auto by_d = [&](auto s, auto r) {
    constexpr int kS = decltype(s)::value;
    constexpr bool kR = decltype(r)::value;
    return head_dim <= 64 ? F<64, kS, kR>::run(args...) : head_dim <= 96 ? F<96, kS, kR>::run(args...)
                                                                         : F<128, kS, kR>::run(args...);
  };
  auto by_s = [&](auto r) {
    return stages == 3 ? by_d(std::integral_constant<int, 3>{}, r)
           : stages == 4 ? by_d(std::integral_constant<int, 4>{}, r)
                         : by_d(std::integral_constant<int, 2>{}, r);
  };
  return rope ? by_s(std::true_type{}) : by_s(std::false_type{});
}

template <typename T>
struct Launch {
  template <int D, int kStages, bool kRope>
  struct At {
    static Status run(const DecodeAttnParams& p, const DecodeAttnRope& ro, cudaStream_t stream) {
      return launch<T, D, kStages, kRope>(p, ro, stream);
    }
  };
};

}  // namespace

bool decode_attention_supported(int head_dim, int heads, int kv_heads) {
  return (head_dim == 64 || head_dim == 96 || head_dim == 128) && kv_heads > 0 && heads % kv_heads == 0 &&
         heads / kv_heads <= kDecodeAttnMaxGroup;
}

namespace {

// Blocks of an instance an SM holds at once (asked once per device and instance).
template <int D, int kStages, bool kRope>
struct Resident {
  static int run() {
    static std::atomic<int> cache[kMaxDevices] = {};
    return per_device(cache, [] {
      int n = 0;
      auto kernel = decode_attention_kernel<__half, D, kStages, kRope>;
      constexpr int smem = DaLayout<D, kStages, kRope>::kSmem;
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kDaThreads, smem) != cudaSuccess)
        n = 1;
      return n > 0 ? n : 1;
    });
  }
};

template <int D, int kStages, bool kRope>
struct SmemOf {
  static int run() { return DaLayout<D, kStages, kRope>::kSmem; }
};

// The stage count to run: the one asked for, or fewer where its shared memory exceeds what a block may
// have on this device (sm_86 / sm_89: 99 KB, so 2 stages at head_dim 128; sm_80: 163 KB; sm_90: 227 KB).
int da_fit_stages(int head_dim, bool rope, int stages) {
  static std::atomic<int> optin[kMaxDevices] = {};
  const int most = per_device(optin, [] {
    int dev = 0, n = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
                   cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess
               ? n
               : 48 * 1024;
  });
  while (stages > kDaMinStages && da_dispatch<SmemOf>(head_dim, stages, rope) > most) --stages;
  return stages;
}

}  // namespace

int decode_attention_split_rule(long long pairs, long long slots, int max_seq) {
  // One split wherever the (sequence, kv head) pairs alone fill the GPU's resident blocks: H100, torch 2.11,
  // 2026-12-06, dev/decode_attn_probe.py, batch 16 x 32 kv heads (512 pairs, 396 slots), context 640:
  // 64.9 / 67.3 / 70.9 / 67.5 us with 1 / 2 / 3 / 5 splits (a split's merge costs more than the last
  // wave's tail).  Fewer pairs: the count whose grid best fills whole waves (w / ceil(w) for w = blocks /
  // slots, the fewest among equals); Llama-3-8B's batch 16 (128 pairs) takes 3 (the engine: 4039 / 4028
  // tok/s against SDPA's 4038 / 4032; 5 splits, 1.6 waves, gave 3978 against 4014).  A split keeps at
  // least two 64-key tiles of the whole cache; at most kDecodeAttnMaxSplits.
  if (pairs < 1 || slots < 1 || pairs >= slots) return 1;
  long long most = (static_cast<long long>(max_seq) + 2 * kDaTileKeys - 1) / (2 * kDaTileKeys);
  most = most < 1 ? 1 : (most > kDecodeAttnMaxSplits ? kDecodeAttnMaxSplits : most);
  int best = 1;
  double best_fill = 0.0;
  for (long long s = 1; s <= most; ++s) {
    const double w = static_cast<double>(pairs * s) / static_cast<double>(slots);
    const double fill = w / std::ceil(w);
    if (fill > best_fill + 1e-9) best_fill = fill, best = static_cast<int>(s);
  }
  return best;
}

int decode_attention_stage_rule(long long pairs, long long slots3) { return pairs >= slots3 ? 3 : 4; }

namespace {

// The stage count a call of `pairs` (sequence, kv head) pairs runs: the forced one, else the rule's, each cut
// to what the device holds.
int da_stages_for(long long pairs, int head_dim, bool rope) {
  int stages = da_stages.load();
  if (stages == 0) {
    const long long slots3 = static_cast<long long>(da_dispatch<Resident>(head_dim, 3, rope)) *
                             (device_sm_count() > 0 ? device_sm_count() : 132);
    stages = decode_attention_stage_rule(pairs, slots3);
  }
  return da_fit_stages(head_dim, rope, stages);
}

}  // namespace

int decode_attention_splits(int batch, int kv_heads, int max_seq, int head_dim, bool rope) {
  const long long pairs = static_cast<long long>(batch) * kv_heads;
  const int per_sm = da_dispatch<Resident>(head_dim, da_stages_for(pairs, head_dim, rope), rope);
  const long long slots = static_cast<long long>(per_sm) * (device_sm_count() > 0 ? device_sm_count() : 132);
  return decode_attention_split_rule(pairs, slots, max_seq);
}

Status decode_attention(ActType act, const DecodeAttnParams& p, const DecodeAttnRope* rope, cudaStream_t stream) {
  if (p.batch < 1 || p.max_seq < 1 || p.splits < 1 || p.splits > kDecodeAttnMaxSplits ||
      !decode_attention_supported(p.head_dim, p.heads, p.kv_heads) || p.batch > 65535 || p.kv_heads > 65535)
    return Status::kBadShape;
  if (p.splits > 1 && (p.part_o == nullptr || p.part_ml == nullptr)) return Status::kBadShape;
  if (rope != nullptr && (rope->knew == nullptr || rope->vnew == nullptr || rope->cos == nullptr ||
                          rope->sin == nullptr || (rope->q_norm == nullptr) != (rope->k_norm == nullptr)))
    return Status::kBadShape;
  const DecodeAttnRope none{};
  const int stages = da_stages_for(static_cast<long long>(p.batch) * p.kv_heads, p.head_dim, rope != nullptr);
  switch (act) {
    case ActType::kHalf:
      return da_dispatch<Launch<__half>::At>(p.head_dim, stages, rope != nullptr, p, rope ? *rope : none, stream);
    case ActType::kBFloat16:
      return da_dispatch<Launch<__nv_bfloat16>::At>(p.head_dim, stages, rope != nullptr, p, rope ? *rope : none,
                                                    stream);
    case ActType::kFloat32:
      break;
  }
  return Status::kNoKernel;
}

bool set_decode_attention_stages(int stages) {
  if (stages != 0 && (stages < kDaMinStages || stages > kDaMaxStages)) return false;
  da_stages.store(stages);
  return true;
}
int decode_attention_stages() { return da_stages.load(); }

}  // namespace qgemv
