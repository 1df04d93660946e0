// Shared device helpers for the qgemv kernels.
//
// Everything here is header-only and pointer-level: no torch types, so the
// kernels can be read (and disassembled) without the torch headers in mind.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "qgemv.h"
#include "tuning.h"

namespace qgemv {

constexpr int kWarpSize = 32;

// Packed-weight panels (format version 2, qgemv/formats.py to_panels): rows
// are stored 16 at a time, and inside a panel the 64 bytes each row holds of
// one k-tile (int8: 64 k, int4: 128 k) sit together, tile after tile.
constexpr int kPanelRows = 16;
constexpr int kTileBytes = 64;

__host__ __device__ constexpr int num_panels(int n) { return (n + kPanelRows - 1) / kPanelRows; }

// ---------------------------------------------------------------------------
// Loads.
//
// Weights are read exactly once per launch, so they must not displace the
// activations (which every block re-reads) from L1 or L2: the weight loads
// carry L1::no_allocate and an L2 evict-first policy.  Activations use the
// ordinary read-only path so that they stay cached across blocks of an SM.
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint4 ld_stream_v4(const void* ptr, uint64_t policy) {
  uint4 r;
  asm volatile(
      "ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(ptr), "l"(policy));
  return r;
}

__device__ __forceinline__ uint32_t ld_stream_u32(const void* ptr, uint64_t policy) {
  uint32_t r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;"
               : "=r"(r)
               : "l"(ptr), "l"(policy));
  return r;
}

__device__ __forceinline__ float4 ld_stream_f4(const float* ptr, uint64_t policy) {
  float4 r;
  asm volatile(
      "ld.global.nc.L1::no_allocate.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
      : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
      : "l"(ptr), "l"(policy));
  return r;
}

__device__ __forceinline__ float ld_stream_f1(const float* ptr, uint64_t policy) {
  float r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.f32 %0, [%1], %2;"
               : "=f"(r)
               : "l"(ptr), "l"(policy));
  return r;
}

// Asynchronous 16-byte global -> shared copy that skips L1, with the
// evict-first policy (weights only).  Completion is tracked per thread with
// commit/wait groups; a thread that waits sees its own copies.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, uint64_t policy) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem_src),
               "l"(policy));
}
// The same with the default L2 policy: data that every block reads (activations).
__device__ __forceinline__ void cp_async_16_shared_data(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

// Programmatic dependent launch (compute capability 9.0+; see set_gemv_pdl in
// qgemv.h).  pdl_prefetch_l2 asks the copy engine to bring `bytes` (a
// multiple of 16, 16-byte aligned) into L2 without touching shared memory or
// registers; pdl_release lets the next kernel in the stream launch once
// every block of this one has called it; pdl_wait returns once the kernel
// before has completed and its writes are visible.  Without a programmatic
// launch the last two return at once; below sm_90 all three are empty (the
// host never asks for the launch there, see sm90_code).
__device__ __forceinline__ void pdl_prefetch_l2(const void* ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Read-only, cached load of 8 activations (16 bytes).
__device__ __forceinline__ uint4 ld_act_v4(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

template <int kWidth = kWarpSize>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Scalar conversions between fp32 and an element type (__half, __nv_bfloat16
// or float), rounding to nearest even.
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

// ---------------------------------------------------------------------------
// Activation-type traits.  T is __half or __nv_bfloat16; the MMA takes two
// elements per 32-bit register, so everything below moves uint32_t pairs.
// ---------------------------------------------------------------------------
template <typename T>
struct ActTraits;

template <>
struct ActTraits<__half> {
  // 0x6400 is 1024.0 in fp16; its mantissa LSB is worth exactly 1, so OR-ing a
  // 4-bit or 8-bit integer u into the low mantissa bits yields 1024 + u.
  static constexpr uint32_t kMagic = 0x64006400u;
  static constexpr float kMagicValue = 1024.f;
  static constexpr uint32_t kSixteenth = 0x2C002C00u;  // fp16 pair (1/16, 1/16)
  // fp16 pair (960, 960) = 15/16 of the magic 1024
  __device__ __forceinline__ static constexpr uint32_t splat_const_15_16() { return 0x63806380u; }
  __device__ __forceinline__ static uint32_t splat(float v) {
    __half2 h = __float2half2_rn(v);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  // a * b - c
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    __half2 r = __hfma2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b),
                        __hneg2(*reinterpret_cast<__half2*>(&c)));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ __forceinline__ static uint32_t sub2(uint32_t a, uint32_t b) {
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ __forceinline__ static void store(__half* p, float v) { *p = __float2half_rn(v); }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct ActTraits<__nv_bfloat16> {
  // 0x4300 is 128.0 in bf16 (7 mantissa bits): OR-ing a 4-bit integer into
  // the mantissa gives 128 + u exactly.  8-bit integers do not fit, so the
  // int8 path goes through fp32 instead (see dequant_int8_word).
  static constexpr uint32_t kMagic = 0x43004300u;
  static constexpr float kMagicValue = 128.f;
  // 15/16 of the magic 128 = 120 (only the fp16 dequant path uses it).
  __device__ __forceinline__ static constexpr uint32_t splat_const_15_16() { return 0x42F042F0u; }
  __device__ __forceinline__ static uint32_t splat(float v) {
    __nv_bfloat162 h = __float2bfloat162_rn(v);
    return *reinterpret_cast<uint32_t*>(&h);
  }

  __device__ __forceinline__ static uint32_t sub2(uint32_t a, uint32_t b) {
    __nv_bfloat162 r =
        __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float v) {
    *p = __float2bfloat16_rn(v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <int kImmLut>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kImmLut));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// The pair (magic + z, magic + z) in T for an integer zero point z < 16:
// the magic's mantissa LSB is worth 1, so this is an OR, not a conversion.
template <typename T>
__device__ __forceinline__ uint32_t magic_zero_pair(uint32_t z) {
  return (z | (ActTraits<T>::kMagic & 0xffffu)) * 0x00010001u;
}

// Word j (0..3, a compile-time constant after unrolling) of a 16-byte load.
__device__ __forceinline__ uint32_t word_of(const uint4& w, int j) {
  return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
}

// One packed int4 word -> four pairs (k0,k1) (k2,k3) (k4,k5) (k6,k7) of
// (q - zero) in T, exact, in 9 instructions.  The word's nibbles hold logical
// elements in the order [0,2,4,6,1,3,5,7] from the low bits up (see
// qgemv/formats.py), so:
//   w        & 0x000f000f -> (e0, e1)       | magic -> magic + q
//   w        & 0x00f000f0 -> (16e2, 16e3)   | magic -> magic + 16 q
//   (w >> 8) & 0x000f000f -> (e4, e5)
//   (w >> 8) & 0x00f000f0 -> (16e6, 16e7)
// The first kind needs one subtraction of (magic + zero); the second one FMA
// by 1/16 minus (magic/16 + zero).  All values are small integers: exact.
// `zero2` is the pair (magic + zero) in T, `zero2_16` is (magic/16 + zero).
template <typename T>
__device__ __forceinline__ void dequant_int4_word(uint32_t w, uint32_t zero2, uint32_t zero2_16,
                                                  uint32_t (&out)[4]) {
  constexpr uint32_t kMagic = ActTraits<T>::kMagic;
  constexpr int kAndOr = (0xf0 & 0xcc) | 0xaa;  // (a & b) | c
  const uint32_t w8 = w >> 8;
  if constexpr (std::is_same_v<T, __half>) {
    out[0] = ActTraits<T>::sub2(lop3<kAndOr>(w, 0x000f000fu, kMagic), zero2);
    out[1] = ActTraits<T>::fma2(lop3<kAndOr>(w, 0x00f000f0u, kMagic), ActTraits<T>::kSixteenth, zero2_16);
    out[2] = ActTraits<T>::sub2(lop3<kAndOr>(w8, 0x000f000fu, kMagic), zero2);
    out[3] = ActTraits<T>::fma2(lop3<kAndOr>(w8, 0x00f000f0u, kMagic), ActTraits<T>::kSixteenth, zero2_16);
  } else {
    // bf16 has 7 mantissa bits: 16 q for q >= 8 would carry into the
    // exponent, so every pair is shifted down to the low nibble instead.
    (void)zero2_16;
    out[0] = ActTraits<T>::sub2(lop3<kAndOr>(w, 0x000f000fu, kMagic), zero2);
    out[1] = ActTraits<T>::sub2(lop3<kAndOr>(w >> 4, 0x000f000fu, kMagic), zero2);
    out[2] = ActTraits<T>::sub2(lop3<kAndOr>(w8, 0x000f000fu, kMagic), zero2);
    out[3] = ActTraits<T>::sub2(lop3<kAndOr>(w >> 12, 0x000f000fu, kMagic), zero2);
  }
}

// One int8 word (4 consecutive k, little-endian bytes) -> pairs (k0,k1) (k2,k3).
template <typename T>
__device__ __forceinline__ void dequant_int8_word(uint32_t w, uint32_t (&out)[2]);

template <>
__device__ __forceinline__ void dequant_int8_word<__half>(uint32_t w, uint32_t (&out)[2]) {
  // Flip the sign bit: u = q + 128 in [0, 255].  Then (0x64 << 8 | u) is the
  // fp16 value 1024 + u, and subtracting 1152 leaves q exactly.
  const uint32_t u = w ^ 0x80808080u;
  const uint32_t bias = 0x64806480u;  // fp16 pair (1152, 1152)
  out[0] = ActTraits<__half>::sub2(prmt(u, 0x64646464u, 0x4140u), bias);
  out[1] = ActTraits<__half>::sub2(prmt(u, 0x64646464u, 0x4342u), bias);
}

template <>
__device__ __forceinline__ void dequant_int8_word<__nv_bfloat16>(uint32_t w, uint32_t (&out)[2]) {
  // bf16 has too few mantissa bits for the 8-bit trick, so build fp32
  // 2^23 + u with a byte permute, subtract, and pack pairs (exact: |q| <= 128).
  const uint32_t u = w ^ 0x80808080u;
  float f[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[i] = __uint_as_float(prmt(u, 0x4B000000u, 0x7440u + i)) - 8388736.f;  // 2^23 + 128
  }
  __nv_bfloat162 lo = __floats2bfloat162_rn(f[0], f[1]);
  __nv_bfloat162 hi = __floats2bfloat162_rn(f[2], f[3]);
  out[0] = *reinterpret_cast<uint32_t*>(&lo);
  out[1] = *reinterpret_cast<uint32_t*>(&hi);
}

// A lane's int8 words of rows r0 (w0) and r1 (w1) in one 64-k tile -> the
// MMA A fragments of the tile's four k16 steps: step j takes word j (k 16t +
// 4j .. +3) of both rows, pairs (k0, k1) and (k2, k3).
template <typename T>
__device__ __forceinline__ void int8_fragments(const uint4& w0, const uint4& w1, uint32_t (&a)[4][4]) {
  const uint32_t u0[4] = {w0.x, w0.y, w0.z, w0.w};
  const uint32_t u1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t d0[2], d1[2];
    dequant_int8_word<T>(u0[j], d0);
    dequant_int8_word<T>(u1[j], d1);
    a[j][0] = d0[0];
    a[j][1] = d1[0];
    a[j][2] = d0[1];
    a[j][3] = d1[1];
  }
}

// This lane's words of the edge tile (the K tile that reaches past K) of rows
// starting at b0 and b1, where each row of the stored edge tile holds 16c
// bytes: int4 lane t's word j sits at word t*c + j (j < c), int8 lanes t < c
// hold the 16 bytes at 16t.  Missing words are zero.  ld32 / ld128 read one
// 4- / 16-byte word at a byte pointer (global with a cache hint, or shared).
template <int kBits, class Ptr, class Ld32, class Ld128>
__device__ __forceinline__ void gather_edge_words(Ptr b0, Ptr b1, int t, int c, Ld32 ld32, Ld128 ld128, uint4& w0,
                                                  uint4& w1) {
  w0 = make_uint4(0u, 0u, 0u, 0u);
  w1 = w0;
  if constexpr (kBits == 4) {
    uint32_t u0[4] = {0u, 0u, 0u, 0u}, u1[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i < c) {
        u0[i] = ld32(b0 + (t * c + i) * 4);
        u1[i] = ld32(b1 + (t * c + i) * 4);
      }
    }
    w0 = make_uint4(u0[0], u0[1], u0[2], u0[3]);
    w1 = make_uint4(u1[0], u1[1], u1[2], u1[3]);
  } else if (t < c) {
    w0 = ld128(b0 + 16 * t);
    w1 = ld128(b1 + 16 * t);
  }
}

// The edge-tile words from global memory, streamed with cache policy pol.
template <int kBits>
__device__ __forceinline__ void load_edge_words(const char* b0, const char* b1, int t, int c, uint64_t pol,
                                                uint4& w0, uint4& w1) {
  gather_edge_words<kBits>(
      b0, b1, t, c, [pol](const char* a) { return ld_stream_u32(a, pol); },
      [pol](const char* a) { return ld_stream_v4(a, pol); }, w0, w1);
}

// Scale four pairs of exact small integers (q - z) by s, rounded once to T
// (the group scale of the tiled GEMMs, applied to dequantized weights).
__device__ __forceinline__ void scale_pairs(uint32_t (&a)[4], __half s, __half) {
  const __half2 s2 = __half2half2(s);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 v = __hmul2(*reinterpret_cast<__half2*>(&a[i]), s2);
    a[i] = *reinterpret_cast<uint32_t*>(&v);
  }
}
__device__ __forceinline__ void scale_pairs(uint32_t (&a)[4], __half s, __nv_bfloat16) {
  const float sf = __half2float(s);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(a[i] << 16), hi = __uint_as_float(a[i] & 0xffff0000u);
    __nv_bfloat162 v = __floats2bfloat162_rn(lo * sf, hi * sf);
    a[i] = *reinterpret_cast<uint32_t*>(&v);
  }
}

// (magic/16 + z) pair from the (magic + z) pair: one exact subtraction.
template <typename T>
__device__ __forceinline__ uint32_t magic_zero_pair_16(uint32_t zero2) {
  return ActTraits<T>::sub2(zero2, ActTraits<T>::splat_const_15_16());
}

// A lane's int4 words of rows r0 (u0) and r1 (u1), 8 k each, -> the MMA A
// fragments of two k16 steps, in mma.m16n8k16's order (row r0, row r1,
// row r0, row r1): step0 takes the pairs (k0,k1) (k2,k3), step1 (k4,k5)
// (k6,k7).  z / y: each row's (magic + zero) and (magic/16 + zero) pairs
// (dequant_int4_word).  With kScaled the pairs of row r0 / r1 are multiplied
// by s0 / s1 first (the tiled GEMMs fold the group scale here; the GEMV
// folds it into its fp32 sums instead).  Every kernel family builds its int4
// fragments here.
template <typename T, bool kScaled = false>
__device__ __forceinline__ void int4_fragments(uint32_t u0, uint32_t u1, uint32_t z0, uint32_t y0, uint32_t z1,
                                               uint32_t y1, uint32_t (&step0)[4], uint32_t (&step1)[4],
                                               __half s0 = __half(), __half s1 = __half()) {
  uint32_t a0[4], a1[4];
  dequant_int4_word<T>(u0, z0, y0, a0);
  dequant_int4_word<T>(u1, z1, y1, a1);
  if constexpr (kScaled) {
    scale_pairs(a0, s0, T{});
    scale_pairs(a1, s1, T{});
  }
  step0[0] = a0[0]; step0[1] = a1[0]; step0[2] = a0[1]; step0[3] = a1[1];
  step1[0] = a0[2]; step1[1] = a1[2]; step1[2] = a0[3]; step1[3] = a1[3];
}

// Epilogue of the tiled GEMMs: one warp's accumulators for kRT 16-row panels
// x kNT 8-token tiles, in the C-fragment layout of mma.m16n8k16 (acc(rt, n,
// i): i = 0, 1 -> row g, tokens 8n + 2t, +1; i = 2, 3 -> row g + 8).  Rows
// past the panel and tokens past M are skipped, panels with live false
// entirely.  Per-channel scales multiply the fp32 sums here (grouped scales
// were applied to the weights).  part: fp32 [M, N] partial sums of a K
// split, or nullptr to store y in T.
template <typename T, bool kGrouped, int kRT, int kNT, typename Acc>
__device__ __forceinline__ void store_fragments(const GemvParams& p, float* part, int m0, int g, int t,
                                                const int (&prow0)[kRT], const int (&prows)[kRT],
                                                const bool (&live)[kRT], Acc&& acc) {
  const __half* scales = static_cast<const __half*>(p.scales);
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int rt = 0; rt < kRT; ++rt) {
    if (!live[rt]) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = g + 8 * half;
      if (i >= prows[rt]) continue;
      const int row = prow0[rt] + i;
      const float sc = kGrouped ? 1.f : __half2float(scales[row]);
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = m0 + n * 8 + 2 * t + e;
          if (tok >= p.M) continue;
          const float v = acc(rt, n, 2 * half + e) * sc;
          if (part)
            part[static_cast<size_t>(tok) * p.N + row] = v;
          else
            ActTraits<T>::store(y + static_cast<size_t>(tok) * p.ldy + row, v);
        }
    }
  }
}

// Streaming multiprocessors of the current device, asked once per process
// (0 if the query fails).
// Per-device caches.  A process may drive GPUs of different kinds, so an SM
// count or an occupancy asked on one device must not serve another: each
// cache has a slot per device (up to kMaxDevices).
constexpr int kMaxDevices = 64;

// The value of compute() for the current device, computed once per device.
// compute() returns a value > 0, or <= 0 for a failure, which is returned and
// not cached (the next call asks again).  0 without a current device.
template <typename Compute>
int per_device(std::atomic<int> (&cache)[kMaxDevices], Compute compute) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  int v = cache[dev].load();
  if (v <= 0) {
    v = compute();
    if (v > 0) cache[dev].store(v);
  }
  return v;
}

// Whether a kernel's machine code for the current device is sm_90 or later,
// asked once per kernel signature and device (every kernel of one signature
// in a build has the same targets).  Hopper-only launches check it: a
// programmatic launch (only sm_90 code waits for the kernel before it) and a
// cluster launch (the cluster code is compiled only for sm_90).
template <typename Kernel>
bool sm90_code(Kernel kernel) {
  static std::atomic<int> ok[kMaxDevices] = {};  // 1 yes, 2 no
  return per_device(ok, [&] {
           cudaFuncAttributes a;
           return cudaFuncGetAttributes(&a, kernel) == cudaSuccess && a.binaryVersion >= 90 ? 1 : 2;
         }) == 1;
}

// A programmatic dependent launch of `kernel` (the next kernel in the stream may start before it ends; the
// kernel must pdl_wait before it reads what the kernel before it wrote; check sm90_code first).
template <typename... KArgs, typename... Args>
cudaError_t pdl_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Multiprocessors of the current device (0 if it cannot be asked).
inline int device_sm_count() {
  static std::atomic<int> cache[kMaxDevices] = {};
  return per_device(cache, [] {
    int dev = 0, n = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
                   cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess
               ? n
               : 0;
  });
}

// K splits for a grid of `blocks` blocks when `slots` blocks fit on the GPU at
// once: enough to fill the slots (round_up) or at most one wave (not), at most
// tuning::kMaxSplits, keeping at least tuning::kMinTilesPerSplit of the
// `nclean` K tiles per split; at least 1.  Shared by the two tiled GEMMs.
inline int plan_splits(int slots, long blocks, int nclean, bool round_up) {
  int splits = static_cast<int>(round_up ? (slots + blocks - 1) / blocks : slots / blocks);
  splits = std::min(splits, std::min(tuning::kMaxSplits, nclean / tuning::kMinTilesPerSplit));
  return std::max(splits, 1);
}

// The launch's split of `nclean` K tiles into parts of `per` tiles: at most
// `splits`, none empty (1 without a workspace).  Returns the split count.
inline int split_tiles(int nclean, int splits, bool have_workspace, int* per) {
  if (!have_workspace) splits = 1;
  splits = std::max(1, std::min(splits, std::max(nclean, 1)));
  *per = splits > 1 ? (nclean + splits - 1) / splits : nclean;
  return splits > 1 ? (nclean + *per - 1) / *per : 1;
}

}  // namespace qgemv
