// A chain of dependent weight-only linears in one persistent launch (issue 35,
// stage 1): the decode step's linears, each reading the output of the one
// before, without a kernel boundary between them.
//
// Why: one kernel per matrix pays its ramp-up, its tail and a launch gap, and
// the next matrix's weights, which depend on no activation, wait for the
// previous kernel to end.  Measured on the H200 (BENCHMARKS.md): one kernel
// reading a 7B step's weights reaches 99.5% of the read ceiling, one read
// kernel per matrix 42-46%.
//
// This is form 20 of the forms dev/PERSISTENT.md records (the others are in
// git: the last header that held forms 5-18 is at 60bd530).  The extension
// compiles it in csrc/persist.cu (qgemv.persist.PersistentChain); the lab,
// dev/persist_lab.cu, runs it against qgemv's per-op GEMVs with its timing
// hooks (ChainShape::skip, stamps, rotate).  Stage 2 (kDecode) adds each
// layer's RoPE, KV-cache write and attention (ChainAttn); a kNorm launch may
// end with the final RMSNorm, lm_head and the greedy argmax (ChainHead).  int4 per channel
// and G = 128 with or without zero points, fp16 activations, M = 1.
//
// Not deterministic: a panel's partial sums (one per warp that touched it)
// meet in fp32 atomics, in the order they arrive.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemv_mma.cuh"
#include "mbarrier.cuh"

namespace qgemv {

struct ChainAttn;
struct ChainHead;

#ifndef QGEMV_CHAIN_STAMPS
#define QGEMV_CHAIN_STAMPS 0  // the lab defines it 1 (ChainShape::stamps)
#endif
constexpr bool kStamps = QGEMV_CHAIN_STAMPS != 0;

// The launch's geometry (the host's choice; chain_smem_bytes sizes it).
struct ChainShape {
  int stages;       // a warp's ring: 1 KB tiles (with their meta), a multiple of kChainChunk
  int meta_bytes;   // per tile: 0, or chain_meta_bytes
  int x_cap;        // the largest K (elements per token of the input buffer)
  int M;            // tokens (1)
  int skip = 0;     // 0; lab timing experiments only (results wrong): 1 no waits (the polled halves taken as
                    //    they are), 2 no hand-off at all, 4 no tile math, 8 weights from L2, 16 no copies
                    //    past the ring's first fill, 32 no flush, 64 `slices` block barriers inside each op,
                    //    256 << c no waits for the inputs of op class c only (lab builds)
  int sums = 0;     // fp32 values of the block's sum buffer (chain_sums)
  int stage = 0;    // 1: shared memory holds a second input buffer (x_cap fp16), for the ops with an input perm
  const int4* cursors = nullptr;  // chain_schedule's records (device memory)
  int classes = 0;                // op classes in `cursors` (chain_classes)
  // each op's input RMSNorm gain (device array of nops fp16 [K] pointers, nullptr for none) and its
  // epsilon; set, the kernel compiled with kNorm runs them
  const void* const* norms = nullptr;
  float norm_eps = 0.f;
  // lab (QGEMV_CHAIN_STAMPS, the timed launch): per op and block, [nops][blocks][5]: the cycles on the
  // op's tiles, finishing it, preparing its input; %globaltimer when its outputs are written and when its
  // input was all read
  unsigned long long* stamps = nullptr;
  int rotate = 0;  // lab (QGEMV_CHAIN_STAMPS): block b runs the schedule of block (b + rotate) % blocks
#if QGEMV_CHAIN_STAMPS
  // lab, skip & 64: each warp meets the block's other warps `slices` times inside every op, at even shares of
  // its run (named barrier 3): the barriers of "k-slices in time" (dev/PERSISTENT.md, M > 1), priced at M = 1
  int slices = 0;
#endif
  // kDecode: the layers' attention (device array, ChainOp::attn indexes it) and the token's cache slot,
  // which is also its rotary position (a device scalar, read at every launch)
  const ChainAttn* attn = nullptr;
  const int* pos = nullptr;
  // kNorm: the final RMSNorm, lm_head and the greedy argmax after the last op (device record), or nullptr
  const ChainHead* head = nullptr;
};

constexpr int kChainTileBytes = kPanelRows * kTileBytes;  // 1 KB: one tile of one panel
constexpr int kChainChunk = 2;  // tiles a ring chunk (dev/PERSISTENT.md: chunks of 2 ran best)


// Bytes of one tile's scales and zero points in `meta` (padded to 16).
__host__ __device__ constexpr int chain_meta_bytes(int group, bool zeros) {
  return group == 0 ? 0 : ((kPanelRows * (128 / group) * (2 + (zeros ? 1 : 0)) + 15) / 16) * 16;
}

// Block b's tiles of an op: [first, end) of its (panel, k-tile) stream.
__host__ __device__ inline void chain_range(long long tiles, int b, int blocks, long long& first, long long& end) {
  first = tiles * b / blocks;
  end = tiles * (b + 1) / blocks;
}

enum class ChainOut : int {
  kStore = 0,     // y = round(sums)
  kResidual = 1,  // y = round(round(sums) + res)
  kSiluMul = 2,   // y[:, j] = round(silu(round(sums[:, j])) * round(sums[:, N/2 + j]))   (N/2 % 16 == 0)
};

// One op of the chain.  p: qweight (the packed panels, read in place; fp16:
// the panels), scales (per channel: fp16 [N]; grouped: chain_meta's bytes,
// tile by tile), M, N, K, Kp (= K), group_size;
// x / ldx the op's input (an earlier op's y: ldx its copy stride; or an input
// ready at launch); y / ldy its output ([N], or [N / 2] for kSiluMul).
// N % 16 == 0, K % 128 == 0.
struct ChainOp {
  GemvParams p;
  const void* res;  // kResidual: [N] (an earlier op's output, or plain)
  int out;          // ChainOut
  int flags = 0;    // ChainFlags
  int cls = 0;      // the op's class in the schedule (chain_classes)
  int attn = -1;    // kDecode: the layer's ChainAttn for kChainRope / kChainAttnIn
#ifndef QGEMV_CHAIN_OP112
  int tpp = 0;      // tiles a panel: K / chain_tile_k(bits)
  const uint16_t* perm = nullptr;  // act-order: the stored input k reads input perm[k] ([K]; 16-byte aligned)
#endif
#ifdef QGEMV_CHAIN_OP_PAD
  char lab_pad[QGEMV_CHAIN_OP_PAD];  // lab: the records' size against the walk's time
#endif
};

// A record's tiles a panel and act-order permutation.  Lab builds with
// QGEMV_CHAIN_OP112 keep them in GemvParams fields the chain does not use
// (warps_per_block, perm), so that a record is 112 bytes as before the int4
// slowdown of 2026-12-05 (dev/PERSISTENT.md) instead of 128.
__host__ __device__ inline int chain_op_tpp(const ChainOp& o) {
#ifdef QGEMV_CHAIN_OP112
  return o.p.warps_per_block;
#else
  return o.tpp;
#endif
}
__host__ __device__ inline const uint16_t* chain_op_perm(const ChainOp& o) {
#ifdef QGEMV_CHAIN_OP112
  return reinterpret_cast<const uint16_t*>(o.p.perm);
#else
  return o.perm;
#endif
}
inline void chain_op_set(ChainOp& o, int tpp, const uint16_t* perm) {
#ifdef QGEMV_CHAIN_OP112
  o.p.warps_per_block = tpp;
  o.p.perm = reinterpret_cast<const int32_t*>(perm);
#else
  o.tpp = tpp, o.perm = perm;
#endif
}

// Activations inside the launch carry their own readiness: a buffer of n
// values holds two copies of n fp16, 0xffff until written; a launch writes
// the copy of its parity and poisons the other for the next launch, and a
// consumer polls the values it reads until none is the poison
// (chain_half_ready).  Inputs from outside the launch (the first op's x,
// residuals written before it) and the last op's output are plain.
enum ChainFlags : int {
  kChainPlainX = 1,    // x is plain (ready at launch)
  kChainPlainRes = 2,  // res is plain
  kChainPlainY = 4,    // y is plain (nothing in this launch reads it)
  kChainRope = 8,      // kDecode: the q/k/v op; its finishing rotates q and k and writes the cache
  kChainAttnIn = 16,   // kDecode: the op after attention; the blocks run the attention before its input
};

// int4 with fp16 activations: 8 activations (k 8c .. 8c + 7)
// as the subnormal nibbles meet them, in place (positions 2, 3, 6, 7, which
// meet high nibbles, / 16); returns their sum (fp32, before the division).
__device__ __forceinline__ float chain_nibble_input(uint4& v) {
  __half2* h = reinterpret_cast<__half2*>(&v);
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __half22float2(h[e]);
    sum += f.x + f.y;
  }
  const __half2 sixteenth = __float2half2_rn(0.0625f);
  h[1] = __hmul2(h[1], sixteenth);
  h[3] = __hmul2(h[3], sixteenth);
  return sum;
}

// One 32-k sub-tile of the subnormal-nibble math: u0 / u1 this lane's words of
// rows g / g + 8, xv its 8 activations (chain_nibble_input's); k pairs 0-3
// (low and high nibbles of bytes 0 and 2) into c0, 4-7 into c1 (the same
// accumulator or a second chain).  The sums are 2^-24 of the true ones.
__device__ __forceinline__ void chain_nibble_mma(uint32_t u0, uint32_t u1, const uint4& xv, float (&c0)[4],
                                                 float (&c1)[4]) {
  const uint32_t h0 = u0 >> 8, h1 = u1 >> 8;
  const uint32_t a0[4] = {u0 & 0x000f000fu, u1 & 0x000f000fu, u0 & 0x00f000f0u, u1 & 0x00f000f0u};
  const uint32_t a1[4] = {h0 & 0x000f000fu, h1 & 0x000f000fu, h0 & 0x00f000f0u, h1 & 0x00f000f0u};
  ActTraits<__half>::mma(c0, a0, xv.x, xv.y);
  ActTraits<__half>::mma(c1, a1, xv.z, xv.w);
}

// Output panels per unit (a block owns whole units; a SiLU * mul unit is a
// gate panel and its up panel) and units of op o.
__host__ __device__ inline int chain_ppu(const ChainOp& o) {
  return o.out == static_cast<int>(ChainOut::kSiluMul) ? 2 : 1;
}
__host__ __device__ inline long long chain_units(const ChainOp& o) { return o.p.N / kPanelRows / chain_ppu(o); }
// The block's sum buffer (ChainShape::sums): the most panels a block owns in any
// op, x 16 rows x M.  Host arrays in.
inline int chain_sums(const ChainOp* ops, int nops, int blocks, int M) {
  long long most = 0;
  for (int i = 0; i < nops; ++i) {
    const long long u = chain_units(ops[i]);
    most = std::max(most, (u + blocks - 1) / blocks * chain_ppu(ops[i]));
  }
  return static_cast<int>(most) * kPanelRows * M;
}

// Whether the phase of parity `parity` has completed (no wait).
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// mbar_wait, and when `timed` (the lab) the cycles it waited added to `waited`
// (none when the phase is already complete).
__device__ __forceinline__ void mbar_wait_timed(uint64_t* bar, uint32_t parity, bool timed, long long& waited) {
  if (mbar_test(bar, parity)) return;
  const long long w0 = timed ? clock64() : 0;
  mbar_wait(bar, parity);
  if (timed) waited += clock64() - w0;
}

constexpr int kChainMaxWarps = 16;

// Grouped int4's scales and zero points, per tile (G = 32, 64 or 128: gpt =
// 128 / G groups a tile): for each g in 0..7 and group i, the scales of rows
// g and g + 8 (2 x fp16; a lane's gpt of them in one 4 / 8 / 16-byte load),
// then for each g and i their zero points (2 x uint8).  chain_meta_bytes(G,
// zeros) a tile (G = 128: 48 with zero points, 32 without).  Host arrays in:
// scales fp16 [N, K / G], zeros uint8 [N, K / G] or nullptr.
inline std::vector<uint8_t> chain_meta(const uint16_t* scales, const uint8_t* zeros, int N, int K, int group) {
  const int tiles = K / 128, gpt = 128 / group, ng = K / group, mb = chain_meta_bytes(group, zeros != nullptr);
  std::vector<uint8_t> meta(static_cast<size_t>(N / kPanelRows) * tiles * mb, 0);
  for (int pn = 0; pn < N / kPanelRows; ++pn)
    for (int kt = 0; kt < tiles; ++kt) {
      uint8_t* m = meta.data() + (static_cast<size_t>(pn) * tiles + kt) * mb;
      for (int g = 0; g < 8; ++g)
        for (int i = 0; i < gpt; ++i)
          for (int h = 0; h < 2; ++h) {
            const size_t src = static_cast<size_t>(pn * kPanelRows + g + 8 * h) * ng + kt * gpt + i;
            std::memcpy(m + 4 * (g * gpt + i) + 2 * h, scales + src, 2);
            if (zeros) m[32 * gpt + 2 * (g * gpt + i) + h] = zeros[src];
          }
    }
  return meta;
}

// A walk along a warp's run of one op in its block's panel stream: pos / end
// in the block's tiles, kt the k-tile in the current panel, vp the block's
// panel (unit vp >> shift, gate or up half vp & shift), panel the op's.
struct ChainCursor {
  int pos, end, kt, vp, panel, tpp, u0, shift, half;
};

__device__ __forceinline__ int chain_panel(const ChainCursor& c) {
  return c.u0 + (c.vp >> c.shift) + (c.vp & c.shift) * c.half;
}

// n tiles on, at most to the end of the current panel.
__device__ __forceinline__ void chain_advance(ChainCursor& c, int n) {
  c.pos += n, c.kt += n;
  if (c.kt >= c.tpp) {
    c.kt -= c.tpp, ++c.vp;
    c.panel = chain_panel(c);
  }
}

__device__ __forceinline__ uint4 ld_relaxed_gpu_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Whether no value of eight (fp16 or bf16: 0xffff is a NaN in both) is the poison 0xffff.
__device__ __forceinline__ bool chain_half_ready(const uint4& v) {
  return (__vcmpeq2(v.x, 0xffffffffu) | __vcmpeq2(v.y, 0xffffffffu) | __vcmpeq2(v.z, 0xffffffffu) |
          __vcmpeq2(v.w, 0xffffffffu)) == 0u;
}

// One value's 16 bits (fp16 or bf16) into a chain buffer: this launch's copy
// (parity par, copies ld apart) written for the readers that poll it, the
// other copy poisoned for the next launch; a value whose bits are the poison
// (a NaN) is written as another NaN.
__device__ __forceinline__ void chain_store_bits(unsigned short* y, size_t ld, int par, unsigned short bits) {
  if (bits == 0xffffu) bits = 0x7fffu;
  asm volatile("st.relaxed.gpu.global.u16 [%0], %1;" ::"l"(y + static_cast<size_t>(par) * ld), "h"(bits) : "memory");
  y[static_cast<size_t>(par ^ 1) * ld] = 0xffffu;
}

// ---- bfloat16 activations (A = __nv_bfloat16; fp16 is A = __half) ----------
// Every activation buffer, the KV cache, the norms' gains and the rotary
// tables hold the model's type A, and every rounding site rounds to A as the
// per-op path does (chain_round).  The tile math stays fp16's (subnormal
// nibbles and bytes need fp16's 10 mantissa bits): a hand-off into int4 /
// int8 weights stages its bf16 input as fp16 of x 2^e, with 2^e chosen per
// input from a bound on |x| (chain_half_scale), which is exact for every
// value in fp16's normal range (bf16's 8-bit mantissa fits), and the op's
// finishing multiplies its sums by 2^-e (chain_x_unscale).  bf16 weights
// (kBits 16) meet bf16 inputs in bf16 MMAs, unscaled.

// v rounded to A and back.
template <typename A>
__device__ __forceinline__ float chain_round(float v) {
  return to_float(from_float<A>(v));
}
// v rounded to A, as its 16 bits.
template <typename A>
__device__ __forceinline__ unsigned short chain_act_bits(float v) {
  const A h = from_float<A>(v);
  return *reinterpret_cast<const unsigned short*>(&h);
}
// A pair of A (one 32-bit word) as floats.
template <typename A>
__device__ __forceinline__ float2 chain_pair(uint32_t w) {
  if constexpr (std::is_same_v<A, __half>) return __half22float2(*reinterpret_cast<const __half2*>(&w));
  else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
// Two floats as a pair of A (rounded).
template <typename A>
__device__ __forceinline__ uint32_t chain_pack(float a, float b) {
  if constexpr (std::is_same_v<A, __half>) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}
// The largest |x| of eight bf16 (NaNs ignored).
__device__ __forceinline__ float chain_absmax8(const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float m = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = chain_pair<__nv_bfloat16>(w[e]);
    m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return m;
}
// Eight bf16 as fp16 of x mul (mul a power of 2: exact while |x| mul is in fp16's normal range).
__device__ __forceinline__ uint4 chain_bf16_as_half(const uint4& v, float mul) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = chain_pair<__nv_bfloat16>(w[e]);
    o[e] = chain_pack<__half>(f.x * mul, f.y * mul);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}
// The power of 2 that takes inputs bounded by `bound` into fp16's top octave: bound 2^e in [2^14, 2^15), so
// that no staged value overflows fp16 (max 65504) and values down to bound 2^-29 keep every bit; 1 when bound is
// 0 or not finite (an input with an infinity or a NaN), |e| <= 100.
__device__ __forceinline__ float chain_half_scale(float bound) {
  if (!(bound > 0.f) || !isfinite(bound)) return 1.f;
  int k;
  (void)frexpf(bound, &k);  // bound = m 2^k, m in [0.5, 1)
  return ldexpf(1.f, min(max(15 - k, -100), 100));
}
// A hand-off's 2^-e for the op's finishing (bf16 activations into int4 / int8 weights), and the warps'
// maxima the hand-off reduces to choose it (chain_post_max, chain_block_mul).
static __shared__ float chain_x_unscale;
static __shared__ float chain_xmax[kChainMaxWarps];

// Shared memory: the block's sums (sh.sums fp32), the input (M x x_cap fp16,
// as chain_put_chunk prepares it), its 2^-24 x sums (room for M x x_cap / 32
// fp32: G = 32's groups), then with sh.stage the natural-order copy of an
// act-order op's input (M x x_cap fp16) that the input is gathered from.
__host__ __device__ inline size_t chain_xsum_bytes(const ChainShape& sh) {
  return (static_cast<size_t>(sh.M) * (sh.x_cap / 32) * 4 + 15) / 16 * 16;
}
__host__ __device__ inline size_t chain_head_bytes(const ChainShape& sh) {
  return (static_cast<size_t>(sh.sums) * 4 + 15) / 16 * 16 + static_cast<size_t>(sh.M) * sh.x_cap * 2 +
         chain_xsum_bytes(sh) + (sh.stage ? static_cast<size_t>(sh.M) * sh.x_cap * 2 : 0);
}

// The kernel's weight formats (fp16 activations): int4 per channel or G = 128 (one group a tile), with the
// nibbles as fp16 subnormals; int8 per channel (kBits 8: each byte + 128 as an fp16 subnormal); fp16
// (kBits 16: the weights straight into the MMAs).  A tile is 16 rows x 64 bytes: kTileK = 128 int4, 64
// int8 or 32 fp16 inputs; lane t of a quad reads 16 bytes of each of its two rows, and its activations
// start kLaneK t into the tile's (int4: in each 32-k sub-tile).
template <int kBits, int kGroup, bool kZeros>
struct ChainFormat {
  static_assert(kBits == 4 || kBits == 8 || kBits == 16, "int4, int8 or fp16 weights");
  static_assert(kGroup == 0 || (kBits == 4 && (kGroup == 32 || kGroup == 64 || kGroup == 128)),
                "int4 per channel or G = 32, 64, 128; int8 and fp16 per channel");
  static_assert(kGroup != 0 || !kZeros, "zero points are group-wise");
  static constexpr bool kGrouped = kGroup != 0;
  static constexpr int kGpt = kGroup ? 128 / kGroup : 0;  // groups a tile (0: per channel)
  static constexpr int kTileK = kBits == 4 ? 128 : kBits == 8 ? 64 : 32;
  static constexpr int kLaneK = kBits == 8 ? 16 : 8;
  // inputs a 2^-24 x sum covers (the zero points' term): a group, a tile (int4 per channel, int8), none (fp16)
  static constexpr int kSumK = kBits == 16 ? 0 : kBits == 8 ? 64 : kGroup ? kGroup : 128;
  static constexpr int kSumsTile = kGroup ? 128 / kGroup : 1;  // x sums a tile
};
__host__ __device__ constexpr int chain_tile_k(int bits) { return bits == 4 ? 128 : bits == 8 ? 64 : 32; }

// Each warp's run of an op comes from a schedule built on the host, not from
// divisions at every op boundary (about 40 instructions a tile in form 17's
// first profile).  Block b of G owns units [u b / G, u (b + 1) / G) of an
// op's u units, and its tile stream is cut into W equal contiguous runs, one
// per warp.  Ops of one shape (N, K, output step) share a class
// (ChainOp::cls, chain_classes); for class c, block b of `blocks` and warp
// w < W the record is the warp's cursor {pos, end, vp, kt | u0 << 16}, and at w = W the block's units {u0, u1, 0, 0}: layout
// [classes][blocks][W + 1].  The kernel copies its block's records into
// shared memory at its start.  Host arrays in.
constexpr int kChainMaxClasses = 8;

// Each op's class (ops[i].cls); the number of classes, or -1 past kChainMaxClasses.
inline int chain_classes(ChainOp* ops, int nops) {
  int n = 0;
  for (int i = 0; i < nops; ++i) {
    ops[i].cls = -1;
    for (int j = 0; j < i && ops[i].cls < 0; ++j)
      if (ops[j].p.N == ops[i].p.N && ops[j].p.K == ops[i].p.K && ops[j].p.Kp == ops[i].p.Kp &&
          ops[j].out == ops[i].out)
        ops[i].cls = ops[j].cls;
    if (ops[i].cls < 0) {
      if (n == kChainMaxClasses) return -1;
      ops[i].cls = n++;
    }
  }
  return n;
}

// The records for `blocks` blocks of W consumer warps (empty when a k-tile or a
// unit index does not fit its 16 bits).
inline std::vector<int4> chain_schedule(const ChainOp* ops, int nops, int classes, int blocks, int W) {
  std::vector<int4> tab(static_cast<size_t>(classes) * blocks * (W + 1));
  for (int c = 0; c < classes; ++c) {
    const ChainOp* o = nullptr;
    for (int i = 0; i < nops && !o; ++i)
      if (ops[i].cls == c) o = ops + i;
    if (!o) return {};
    const int tpp = chain_op_tpp(*o), ppu = chain_ppu(*o);
    for (int b = 0; b < blocks; ++b) {
      long long u0, u1;
      chain_range(chain_units(*o), b, blocks, u0, u1);
      int4* r = tab.data() + (static_cast<size_t>(c) * blocks + b) * (W + 1);
      for (int w = 0; w < W; ++w) {
        long long a, e;
        chain_range((u1 - u0) * ppu * tpp, w, W, a, e);
        if (tpp > 0xffff || u0 > 0x7fff) return {};
        r[w] = make_int4(static_cast<int>(a), static_cast<int>(e), static_cast<int>(a / tpp),
                         static_cast<int>(a % tpp) | static_cast<int>(u0) << 16);
      }
      r[W] = make_int4(static_cast<int>(u0), static_cast<int>(u1), 0, 0);
    }
  }
  return tab;
}

// A warp's cursor on op o from the block's records (tab, in shared memory).
__device__ __forceinline__ void chain_start(const ChainOp& o, const int4* tab, int warp, int W, ChainCursor& c) {
  const int4 r = tab[o.cls * (W + 1) + warp];
  c.pos = r.x, c.end = r.y, c.vp = r.z, c.kt = r.w & 0xffff, c.u0 = r.w >> 16;
  c.tpp = chain_op_tpp(o);
  c.shift = chain_ppu(o) - 1;
  c.half = o.p.N / kPanelRows / 2;
  c.panel = chain_panel(c);
}

// A warp's walk along its tiles of every op, in the order it sums them:
// aim() finds the next segment (a run of `left` tiles from `tile`, within
// one panel of op i_op; past the last op left stays 0): the copies a warp
// issues into its ring.
struct ChainWalk {
  const ChainOp* ops;
  int nops, G, warp, W;
  int i_op = -1, left = 0;
  long long tile = 0;  // the op's tile (panel * tiles a panel + k-tile) of the segment's next tile
  ChainCursor ic{0, 0, 0, 0, 0, 1, 0, 0, 0};
  const int4* tab = nullptr;  // the block's schedule records (chain_start)

  __device__ __forceinline__ ChainWalk(const ChainOp* o, int n, int w, int nw)
      : ops(o), nops(n), G(gridDim.x), warp(w), W(nw) {}

  __device__ __forceinline__ void aim() {
    while (i_op < nops && ic.pos >= ic.end)
      if (++i_op < nops) {
        chain_start(ops[i_op], tab, warp, W, ic);
      }
    if (i_op >= nops) return;
    tile = static_cast<long long>(ic.panel) * ic.tpp + ic.kt;
    left = min(ic.tpp - ic.kt, ic.end - ic.pos);
    chain_advance(ic, left);
  }
};

// The lab's timing: cycles c[k] of this block into wait_cycles[k * gridDim.x + block], k = 0..4; its SM at k = 5.
struct ChainCycles {
  long long c[5];
};
__device__ __forceinline__ void chain_add_cycles(unsigned long long* wait_cycles, const ChainCycles& v) {
#pragma unroll
  for (int k = 0; k < 5; ++k)
    atomicAdd(wait_cycles + k * gridDim.x + blockIdx.x, static_cast<unsigned long long>(v.c[k]));
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  wait_cycles[5 * gridDim.x + blockIdx.x] = sm;  // [5 blocks + b]: the SM the block ran on
}

// Per-channel scales of rows g and g + 8 of `panel` (for a segment's flush).
__device__ __forceinline__ void chain_row_scales(const ChainOp& o, int panel, int g, float& sc0, float& sc1) {
  const __half* sc = static_cast<const __half*>(o.p.scales) + panel * kPanelRows;
  sc0 = __half2float(sc[g]);
  sc1 = __half2float(sc[g + 8]);
}

// 16 bytes of shared memory in one 128-bit load (the compiler split the x
// loads' uint4 dereference into two LDS.64).
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return v;
}

// One tile: w0 / w1 this lane's 16 bytes of rows g and g + 8, xk its
// activations of the tile.  int8: c0 / c1 accumulate the segment's 2^-24
// sums of (b + 128) x, xa0 / xa1 its x sums.  int4 (subnormal nibbles): xa /
// the 2^-24 x sums of each group (X0: token 2t's; xb token 2t + 1's, G = 128
// only); grouped (kGpt groups a tile): each group folded into acc with its
// scales and zero points (mt); per channel: c0 / c1 accumulate the segment
// and xa0 / xa1 its x sums.  fp16
// weights: c0 / c1 accumulate the segment's true sums.
// One tile's scales and zero points as a lane holds them (chain_meta): s[i]
// the scales of rows g and g + 8 of group i; the zero points' byte pairs,
// two groups a word.
template <int kGpt>
struct ChainTileMeta {
  uint32_t s[kGpt > 0 ? kGpt : 1] = {};
  uint32_t z[kGpt > 1 ? kGpt / 2 : 1] = {};
};

template <int kBits, int kGpt, bool kZeros, bool kM1, bool kLds128 = false, bool kBf16 = false>
__device__ __forceinline__ void chain_tile(const uint4& w0, const uint4& w1, const ChainTileMeta<kGpt>& mt,
                                             const __half* xk, const float* X0, float xb, float (&acc)[4],
                                             float (&c0)[4], float (&c1)[4], float& xa0, float& xa1) {
  static_assert(kM1 || kGpt <= 1, "two tokens' group sums: G = 128 only");
  if constexpr (kBits == 16) {
    // fp16 (bf16: kBf16) weights: this lane's 8 of rows g and g + 8 (k 8t .. 8t + 7 of the 32) meet its 8
    // activations, pairs (0, 1) and (2, 3) in one MMA, (4, 5) and (6, 7) in the other
    using W16 = std::conditional_t<kBf16, __nv_bfloat16, __half>;
    const uint4 xv = lds128(xk);
    const uint32_t a0[4] = {w0.x, w1.x, w0.y, w1.y}, a1[4] = {w0.z, w1.z, w0.w, w1.w};
    ActTraits<W16>::mma(c0, a0, xv.x, xv.y);
    ActTraits<W16>::mma(c1, a1, xv.z, xv.w);
  } else if constexpr (kBits == 8) {
    // int8 (per channel): this lane's 16 of rows g and g + 8 (k 16t .. 16t + 15 of the 64), a word of 4 at
    // a time; each byte + 128 (u, 1..255) as the fp16 subnormal u 2^-24, bytes 0 and 2 of a word in one
    // register, 1 and 3 in the other, against the activations chain_put_chunk<8> stored as (x0, x2, x1, x3)
    const uint4 xv0 = lds128(xk), xv1 = lds128(xk + 8);
    const uint32_t xw[8] = {xv0.x, xv0.y, xv0.z, xv0.w, xv1.x, xv1.y, xv1.z, xv1.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t u0 = word_of(w0, j) ^ 0x80808080u, u1 = word_of(w1, j) ^ 0x80808080u;
      const uint32_t a[4] = {__byte_perm(u0, 0u, 0x4240), __byte_perm(u1, 0u, 0x4240), __byte_perm(u0, 0u, 0x4341),
                             __byte_perm(u1, 0u, 0x4341)};
      ActTraits<__half>::mma((j & 1) ? c1 : c0, a, xw[2 * j], xw[2 * j + 1]);
    }
    xa0 += X0[0];
    if constexpr (!kM1) xa1 += xb;
  } else {
    // the 32-k sub-tile j's MMAs (its activations: chain_nibble_input's)
    auto sub = [&](int j, float(&q0)[4], float(&q1)[4]) {
      if constexpr (kLds128)
        chain_nibble_mma(word_of(w0, j), word_of(w1, j), lds128(xk + 32 * j), q0, q1);
      else  // (a reference into shared memory: the compiler loads each half where its MMA needs it)
        chain_nibble_mma(word_of(w0, j), word_of(w1, j), *reinterpret_cast<const uint4*>(xk + 32 * j), q0, q1);
    };
    if constexpr (kGpt > 0) {
      constexpr int kSub = 4 / kGpt;  // sub-tiles a group
#pragma unroll
      for (int i = 0; i < kGpt; ++i) {
        float p0[4] = {0.f, 0.f, 0.f, 0.f}, p1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kSub; ++j) sub(i * kSub + j, p0, p1);
        const __half2 s2 = *reinterpret_cast<const __half2*>(&mt.s[i]);
        const float s0 = __low2float(s2), s1 = __high2float(s2);
        float z0 = 8.f, z1 = 8.f;
        if constexpr (kZeros) {
          const uint32_t zw = kGpt == 1 ? mt.z[0] : mt.z[i / 2] >> (16 * (i & 1));
          z0 = static_cast<float>(zw & 0xffu);
          z1 = static_cast<float>((zw >> 8) & 0xffu);
        }
        const float sz0 = -s0 * z0, sz1 = -s1 * z1, xa = X0[i];
        acc[0] = fmaf(sz0, xa, fmaf(p0[0] + p1[0], s0, acc[0]));
        acc[2] = fmaf(sz1, xa, fmaf(p0[2] + p1[2], s1, acc[2]));
        if constexpr (!kM1) {
          acc[1] = fmaf(sz0, xb, fmaf(p0[1] + p1[1], s0, acc[1]));
          acc[3] = fmaf(sz1, xb, fmaf(p0[3] + p1[3], s1, acc[3]));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) sub(j, c0, c1);
      xa0 += X0[0];
      if constexpr (!kM1) xa1 += xb;
    }
  }
}

// A warp's current panel segment: its sums so far and
// where the next tile's activations and x sums are.
template <int kBits, int kGpt, bool kZeros, bool kM1, bool kLds128 = false, bool kBf16 = false>
struct ChainSeg {
  static constexpr int kTileK = chain_tile_k(kBits);
  static constexpr bool kGrouped = kGpt > 0;
  int len = 0, left = 0;  // tiles in the segment; not yet summed
  bool open = false;
  float acc[4] = {}, c0[4] = {}, c1[4] = {}, xa0 = 0.f, xa1 = 0.f, sc0 = 1.f, sc1 = 1.f;
  const __half* xk = nullptr;                 // this lane's activations of the next tile
  const float *X0 = nullptr, *X1 = nullptr;  // its 2^-24 x sums, tokens 2t and 2t + 1

  __device__ __forceinline__ void begin(const ChainCursor& cur, const ChainOp& o, int g, const __half* xk0,
                                        const float* x0, const float* x1) {
    len = left = min(cur.tpp - cur.kt, cur.end - cur.pos);
    open = true;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = c0[e] = c1[e] = 0.f;
    xa0 = xa1 = 0.f;
    xk = xk0, X0 = x0, X1 = x1;
    if constexpr (!kGrouped && kBits != 16) chain_row_scales(o, cur.panel, g, sc0, sc1);
  }

  __device__ __forceinline__ void tile(const uint4& w0, const uint4& w1, const ChainTileMeta<kGpt>& mt) {
    const float xb = kBits == 16 || kM1 ? 0.f : *X1;
    chain_tile<kBits, kGpt, kZeros, kM1, kLds128, kBf16>(w0, w1, mt, xk, X0, xb, acc, c0, c1, xa0, xa1);
    xk += kTileK;
    X0 += kGpt > 1 ? kGpt : 1;  // the next tile's x sums
    X1 += kGpt > 1 ? kGpt : 1;
    --left;
  }

#if QGEMV_CHAIN_STAMPS
  // Lab builds, ChainShape::skip & 4 (no tile math): the chunk's tiles counted as summed, their bytes unread.
  __device__ __forceinline__ void pass(int n) {
    left -= min(n, left);
  }
  // Lab builds, skip & 64 (ChainShape::slices): the op's barriers.  Each warp arrives exactly `total` times an
  // op (the rest at the op's end, before op_end's block barrier), so the generations of barrier 3 line up.
  int sl_len = 0, sl_seen = 0, sl_done = 0, sl_total = 0;
  __device__ __forceinline__ void slice_start(int run_tiles, int total) {
    sl_len = run_tiles, sl_seen = 0, sl_done = 0, sl_total = total;
  }
  __device__ __forceinline__ void slice_sync() {
    asm volatile("bar.sync 3, %0;" ::"r"(static_cast<int>(blockDim.x)) : "memory");
    ++sl_done;
  }
  __device__ __forceinline__ void slice_check(int summed) {
    sl_seen += summed;
    while (sl_done < sl_total && static_cast<long long>(sl_seen) * (sl_total + 1) >=
                                     static_cast<long long>(sl_done + 1) * sl_len)
      slice_sync();
  }
  __device__ __forceinline__ void slice_finish() {
    while (sl_done < sl_total) slice_sync();
  }
#endif

  // Past the segment's last tile: flush() its sums, the cursor past it.
  template <typename F>
  __device__ __forceinline__ void close(ChainCursor& cur, F&& flush) {
    if (!open) return;
    flush();
    chain_advance(cur, len);
    open = false;
  }

  // The segment's sum of value e (row g or g + 8 as e >= 2, token 2t + (e & 1)), at its true scale.
  __device__ __forceinline__ float value(int e) const {
    if constexpr (kBits == 16) return c0[e] + c1[e];
    if constexpr (kGrouped) return acc[e] * 0x1p24f;
    constexpr float kZero = kBits == 8 ? 128.f : 8.f;  // the codes' offset: int8 b + 128, int4 per channel q - 8
    return (c0[e] + c1[e] - kZero * ((e & 1) ? xa1 : xa0)) * 0x1p24f * (e >= 2 ? sc1 : sc0);
  }
};

// Tiles (1 KB each) with each one's mb meta bytes after it.  Host arrays in.
inline std::vector<uint8_t> chain_fuse(const uint8_t* tiles, const uint8_t* meta, size_t n, int mb) {
  const size_t ts = kChainTileBytes + mb;
  std::vector<uint8_t> out(n * ts);
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(out.data() + i * ts, tiles + i * kChainTileBytes, kChainTileBytes);
    std::memcpy(out.data() + i * ts + kChainTileBytes, meta + i * mb, mb);
  }
  return out;
}

__host__ __device__ inline size_t chain_ring_offset(const ChainShape& sh) {
  return (chain_head_bytes(sh) + 127) / 128 * 128;
}
// Shared memory: chain_head_bytes, then W x sh.stages slots of a tile and its
// meta, each chunk's mbarrier, the block's schedule records (chain_schedule).
__host__ __device__ inline size_t chain_smem_bytes(const ChainShape& sh, int W) {
  const size_t slots = static_cast<size_t>(W) * sh.stages, chunks = slots / kChainChunk;
  const size_t ring = chain_ring_offset(sh) + slots * (kChainTileBytes + sh.meta_bytes) + chunks * 8;
  return (ring + 15) / 16 * 16 + static_cast<size_t>(sh.classes) * (W + 1) * 16;
}

struct ChainRing {
  unsigned char* w;  // [W * R][ts]
  uint64_t* full;    // [W * R / chunk]: the chunk's bytes are in
  int4* tab;         // [sh.classes][W + 1] the block's schedule records
  int R, C, K, ts;   // slots and chunks a warp, tiles a chunk, bytes a tile (with its meta)

  __device__ __forceinline__ ChainRing(unsigned char* smem, const ChainShape& sh, int W)
      : R(sh.stages), C(sh.stages / kChainChunk), K(kChainChunk), ts(kChainTileBytes + sh.meta_bytes) {
    const size_t slots = static_cast<size_t>(W) * R;
    w = smem + chain_ring_offset(sh);
    full = reinterpret_cast<uint64_t*>(w + slots * ts);
    tab = reinterpret_cast<int4*>(smem + (chain_smem_bytes(sh, W) - static_cast<size_t>(sh.classes) * (W + 1) * 16));
  }
};

// A warp's ring read chunk by chunk.  The warp cuts each panel segment into
// chunks of min(kChunk, tiles left), as the consumer's segments are cut, so
// the consumer knows a chunk's length without reading it.  A full chunk is
// summed in one unrolled pass (slot offsets are immediates, no per-tile
// checks), a segment's short last chunk tile by tile; the shared-memory loads
// come straight before the math (the other warps hide their latency).
template <int kChunk, int kTs, int kGpt, bool kZeros>
struct ChainChunks {
  const unsigned char* w;  // this lane's weight words in the warp's first slot
  const unsigned char* m;  // the first slot's meta
  uint64_t* full;          // the warp's chunks' full mbarriers
  int g;

  __device__ __forceinline__ ChainChunks(const ChainRing& rg, int warp, int lane)
      : w(rg.w + static_cast<size_t>(warp) * rg.R * kTs + (lane >> 2) * kTileBytes + 16 * (lane & 3)),
        m(rg.w + static_cast<size_t>(warp) * rg.R * kTs + kChunk * kChainTileBytes), full(rg.full + warp * rg.C),
        g(lane >> 2) {}

  // Chunk q's copy is in (phase), the cycles waited added to `waited` when timed.
  __device__ __forceinline__ void wait(int q, uint32_t phase, bool timed, long long& waited) const {
    mbar_wait_timed(full + q, phase, timed, waited);
  }

  // The tiles of chunk q into the segment (its next min(kChunk, seg.left)).  A chunk holds its tiles, then
  // their scales and zero points (grouped formats): tile j at j KB, its meta at kChunk KB + j mb.
  template <typename Seg>
  __device__ __forceinline__ void sum(int q, Seg& seg) const {
    constexpr int kMb = kTs - kChainTileBytes;  // meta bytes a tile
    auto tile = [&](int at, int mat) {
      const uint4 w0 = *reinterpret_cast<const uint4*>(w + at);
      const uint4 w1 = *reinterpret_cast<const uint4*>(w + at + 8 * kTileBytes);
      ChainTileMeta<kGpt> mt;
      if constexpr (kGpt > 0) {  // this lane's scales (rows g, g + 8 of each group), then zero points
        const unsigned char* ms = m + mat + 4 * kGpt * g;
        if constexpr (kGpt == 1) {
          mt.s[0] = *reinterpret_cast<const unsigned*>(ms);
        } else if constexpr (kGpt == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(ms);
          mt.s[0] = v.x, mt.s[1] = v.y;
        } else {
          const uint4 v = *reinterpret_cast<const uint4*>(ms);
          mt.s[0] = v.x, mt.s[1] = v.y, mt.s[2] = v.z, mt.s[3] = v.w;
        }
        if constexpr (kZeros) {
          const unsigned char* mz = m + mat + 32 * kGpt + 2 * kGpt * g;
          if constexpr (kGpt == 1) {
            mt.z[0] = *reinterpret_cast<const unsigned short*>(mz);
          } else if constexpr (kGpt == 2) {
            mt.z[0] = *reinterpret_cast<const unsigned*>(mz);
          } else {
            const uint2 v = *reinterpret_cast<const uint2*>(mz);
            mt.z[0] = v.x, mt.z[1] = v.y;
          }
        }
      }
      seg.tile(w0, w1, mt);
    };
    const int at = q * kChunk * kTs;
    if (seg.left >= kChunk) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) tile(at + j * kChainTileBytes, at + j * kMb);
    } else {
      const int n = seg.left;
      for (int j = 0; j < n; ++j) tile(at + j * kChainTileBytes, at + j * kMb);
    }
  }
};

// The consumer loop: every warp fills its own ring.  The warp walks its
// tiles (ChainWalk) ahead of its sums; the ring starts full, and once the
// warp has summed a chunk, lane 0 refills that chunk with the walk's next one
// at once (the ring is full until the walk ends and holds the walk's chunks in
// summing order: no count of chunks ahead, no search for a free one).  skip &
// 8 (the lab): the block's own 64 tiles of op 0 over and over (L2 hits;
// results wrong).  waited: the cycles spent waiting for a chunk (when timed).
template <int kChunk, int kTs, int kGpt, bool kZeros, typename Seg, typename B>
__device__ __forceinline__ void chain_consume(const ChainRing& rg, const ChainOp* ops, int nops, int W, int skip,
                                                Seg& seg, B&& boundary, bool timed, long long& waited) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const ChainChunks<kChunk, kTs, kGpt, kZeros> ring(rg, warp, lane);
  unsigned char* slots = rg.w + static_cast<size_t>(warp) * rg.R * kTs;
  ChainWalk wk(ops, nops, warp, W);
  wk.tab = rg.tab;
  constexpr int kMb = kTs - kChainTileBytes;  // meta bytes a tile (grouped formats), read from p.scales
  const char* src = nullptr;   // the walk's next tile in the weight (qgemv's packed panels, read in place)
  const char* msrc = nullptr;  // and its meta (chain_meta's order, tile by tile)
  int c = 0;
  uint32_t phase = 0;
  auto aim = [&] {
    wk.aim();
    if (wk.left == 0) return;
    const long long t = (skip & 8) ? static_cast<long long>(blockIdx.x) * 64 + wk.tile % 64 : wk.tile;
    const GemvParams& p = ops[(skip & 8) ? 0 : wk.i_op].p;
    src = static_cast<const char*>(p.qweight) + t * kChainTileBytes;
    if constexpr (kMb > 0) msrc = static_cast<const char*>(p.scales) + t * kMb;
  };
  // chunk q <- the walk's next min(kChunk, left) tiles: lane 0 copies the tiles, lane 1 their meta
#if QGEMV_CHAIN_STAMPS
  int waits = 0;  // lab (skip & 16): chunks waited for; only the first fill is copied (and waited for)
#endif
  auto fill = [&](int q) {
    const int n = min(kChunk, wk.left);
#if QGEMV_CHAIN_STAMPS
    if ((skip & 16) && waits > 0) {  // lab: no copy, the walk advanced alone (results wrong)
      src += n * kChainTileBytes;
      if constexpr (kMb > 0) msrc += n * kMb;
      if ((wk.left -= n) == 0) aim();
      return;
    }
#endif
    if (lane == 0) mbar_expect_tx(ring.full + q, n * kTs);
    if constexpr (kMb > 0) {
      if (lane < 2)
        bulk_copy(slots + q * (kChunk * kTs) + (lane ? kChunk * kChainTileBytes : 0), lane ? msrc : src,
                  n * (lane ? kMb : kChainTileBytes), ring.full + q);
      msrc += n * kMb;
    } else {
      if (lane == 0) bulk_copy(slots + q * (kChunk * kTs), src, n * kChainTileBytes, ring.full + q);
    }
    src += n * kChainTileBytes;
    if ((wk.left -= n) == 0) aim();
  };
  // Lane 0: the walk's next n tiles past the ring (and their meta) asked into L2, across its segments (the
  // boundary calls it where HBM would idle: ChainAttn::prefetch).
  auto ahead = [&](int n) {
    if (lane != 0 || wk.left == 0) return;
    ChainWalk w2 = wk;
    const char* s = src;
    const char* ms = msrc;
    for (;;) {
      const int k = min(n, w2.left);
      pdl_prefetch_l2(s, k * kChainTileBytes);
      if constexpr (kMb > 0) pdl_prefetch_l2(ms, k * kMb);
      if ((n -= k) == 0) return;
      w2.left = 0;
      w2.aim();
      if (w2.left == 0) return;
      const GemvParams& p = ops[w2.i_op].p;
      s = static_cast<const char*>(p.qweight) + w2.tile * kChainTileBytes;
      if constexpr (kMb > 0) ms = static_cast<const char*>(p.scales) + w2.tile * kMb;
    }
  };
  aim();
  for (int q = 0; q < rg.C && wk.left > 0; ++q) fill(q);
  for (;;) {
    if (seg.left == 0 && !boundary(ahead)) return;
#if QGEMV_CHAIN_STAMPS
    if (!(skip & 16) || waits < rg.C) ring.wait(c, phase, timed, waited);
    ++waits;
#else
    ring.wait(c, phase, timed, waited);
#endif
#if QGEMV_CHAIN_STAMPS
    const int sl_before = seg.left;
    if (skip & 4) seg.pass(kChunk);  // lab: no tile math (results wrong)
    else
#endif
      ring.sum(c, seg);
#if QGEMV_CHAIN_STAMPS
    if (skip & 64) seg.slice_check(sl_before - seg.left);  // lab: the op's slice barriers
#endif
    // Every lane's reads of the chunk are done (their values are in the sums) before lane 0 has the copy
    // engine overwrite it: the CTA's own ordering (no proxy fence: it compiled to MEMBAR.ALL.CTA, once a chunk).
    __syncwarp();
    if (wk.left > 0) fill(c);
    if (++c == rg.C) c = 0, phase ^= 1u;
  }
}

// An op's input as the launch reads it (M = 1): this launch's copy of a
// buffer written inside it (parity par), or the plain fp16 written before it.
__device__ __forceinline__ const uint4* chain_input_src(const GemvParams& p, int o_flags, int par) {
  const bool plain = (o_flags & kChainPlainX) != 0;
  return reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) +
                                        (plain ? size_t{0} : static_cast<size_t>(par) * p.ldx));
}

// Every chunk of 8 halves of src copied into xs4 at once (cp.async, L2 only:
// no registers hold the data in flight, so a K of 14336, 3.5 chunks a thread,
// is one L2 round trip, not two); thread i copies chunks i, i + n, ... (n =
// nthreads) and waits for its own copies only.
__device__ __forceinline__ void chain_copy_input(uint4* xs4, const uint4* src, int chunks, int nthreads) {
  for (int c = threadIdx.x; c < chunks; c += nthreads) cp_async_16_shared_data(xs4 + c, src + c);
  cp_async_commit();
  cp_async_wait<0>();
}

// chain_copy_input, then the chunks still holding the poison (their
// producers had not written them yet) copied again, all of a thread's in
// one round, until none is left: a round trip a round, not one for each
// late chunk in turn (polled one by one, down's input, 2.7-3.5 chunks a
// thread, was read 2.4-3.1 µs after gate/up's last output; settled like
// this, 1.2-1.5 µs: H100, dev/PERSISTENT.md).  The copies read L2
// (cp.async.cg, past L1) as the first one does, so each round sees the
// producers' latest stores.  nowait: a plain input, or the lab's timing
// without waits.
__device__ __forceinline__ void chain_settle_input(uint4* xs4, const uint4* src, int chunks, int nthreads,
                                                   bool nowait) {
  chain_copy_input(xs4, src, chunks, nthreads);
  if (nowait) return;
  for (;;) {
    bool late = false;
    for (int c = threadIdx.x; c < chunks; c += nthreads)
      if (!chain_half_ready(xs4[c])) {
        cp_async_16_shared_data(xs4 + c, src + c);
        late = true;
      }
    if (!late) return;
    cp_async_commit();
    cp_async_wait<0>();
  }
}

// Chunk c (inputs 8c .. 8c + 7 in the stored order) of an act-order op's
// input, gathered from its natural-order copy xnat: input perm[k] for each k.
__device__ __forceinline__ uint4 chain_gather_chunk(const __half* xnat, const uint16_t* perm, int c) {
  const uint4 pi = __ldg(reinterpret_cast<const uint4*>(perm) + c);
  const uint16_t* ip = reinterpret_cast<const uint16_t*>(&pi);
  const uint16_t* xn = reinterpret_cast<const uint16_t*>(xnat);
  uint4 v;
  uint16_t* hv = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
  for (int e = 0; e < 8; ++e) hv[e] = xn[ip[e]];
  return v;
}

// A chunk of 8 prepared activations into xs (int4: as chain_nibble_input
// makes them; int8: each 4 as (x0, x2, x1, x3); fp16 weights: as they are),
// with the 2^-24 sums of each kSumK from kSumK / 8 lanes' chunks (none for
// fp16).  Every lane of the warp calls it (the
// shuffles); `on`: whether c is a chunk.
template <int kBits, int kSumK>
__device__ __forceinline__ void chain_put_chunk(uint4* xs4, float* xsum, int c, bool on, uint4 v) {
  constexpr int kLanes = kSumK / 8;  // chunks a sum covers
  if constexpr (kBits == 16) {
    if (on) xs4[c] = v;
  } else if constexpr (kBits == 8) {
    float sum = 0.f;
    if (on) {
      const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __half22float2(h[e]);
        sum += f.x + f.y;
      }
      xs4[c] = make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410),
                          __byte_perm(v.z, v.w, 0x7632));
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (on && (threadIdx.x & (kLanes - 1)) == 0) xsum[c / kLanes] = sum * 0x1p-24f;
  } else {
    float sum = 0.f;
    if (on) {
      sum = chain_nibble_input(v);
      xs4[c] = v;
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (on && (threadIdx.x & (kLanes - 1)) == 0) xsum[c / kLanes] = sum * 0x1p-24f;
  }
}

// A hand-off's 2^e (bf16 inputs of int4 / int8 weights), in two halves around one block barrier: every
// thread posts its bound m on |x| (chain_post_max: its warp's largest into chain_xmax); after the barrier,
// chain_block_mul gives every thread chain_half_scale(f x the block's largest), and thread 0 keeps 2^-e
// (chain_x_unscale) for the op's finishing.
__device__ __forceinline__ void chain_post_max(float m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) chain_xmax[threadIdx.x >> 5] = m;
}
__device__ __forceinline__ float chain_block_mul(int nthreads, float f) {
  float b = 0.f;
  for (int w = 0; w < nthreads / 32; ++w) b = fmaxf(b, chain_xmax[w]);
  const float mul = chain_half_scale(b * f);
  if (threadIdx.x == 0) chain_x_unscale = 1.f / mul;  // (exact: a power of 2)
  return mul;
}

// bf16 inputs (A) of int4 / int8 weights, as chain_async_input prepares
// fp16 ones: every chunk settled first (chain_settle_input), its largest |x|; the
// block's 2^e (chain_post_max, a barrier, chain_block_mul; after the barrier
// an act-order op's gather may read any chunk); then each chunk put as fp16 of
// x 2^e.
template <int kBits, int kSumK, typename Sync>
__device__ __forceinline__ void chain_scaled_input(const uint4* src, int chunks, int nthreads, uint4* xs4, float* xsum,
                                                   bool nowait, const uint16_t* perm, __half* xnat, Sync&& csync) {
  const int lane = threadIdx.x & 31;
  uint4* in4 = perm ? reinterpret_cast<uint4*>(xnat) : xs4;
  chain_settle_input(in4, src, chunks, nthreads, nowait);
  float m = 0.f;
  for (int c = threadIdx.x; c < chunks; c += nthreads) m = fmaxf(m, chain_absmax8(in4[c]));
  chain_post_max(m);
  csync();
  const float mul = chain_block_mul(nthreads, 1.f);
  for (int cb = threadIdx.x - lane; cb < chunks; cb += nthreads) {  // warp-uniform (the shuffles)
    const int c = cb + lane;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (c < chunks) v = chain_bf16_as_half(perm ? chain_gather_chunk(xnat, perm, c) : xs4[c], mul);
    chain_put_chunk<kBits, kSumK>(xs4, xsum, c, c < chunks, v);
  }
}

// The preparation of an op's fp16 input: chain_settle_input, then each
// thread puts its own chunks (chain_put_chunk).  Thread i: chunks i, i + n,
// ... (n = nthreads, a multiple of 32: the 16-lane shuffles).  An act-order
// op (perm): the input is settled in xnat, one block barrier (csync), then
// each chunk gathered (chain_gather_chunk) and put.  bf16 inputs (A):
// chain_scaled_input for int4 / int8 weights; bf16 weights take them as fp16
// weights take fp16 ones.
template <int kBits, int kSumK, typename A = __half, typename Sync>
__device__ __forceinline__ void chain_async_input(const uint4* src, int chunks, int nthreads, __half* xs, float* xsum,
                                                  bool nowait, const uint16_t* perm, __half* xnat, Sync&& csync) {
  const int lane = threadIdx.x & 31;
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  if constexpr (!std::is_same_v<A, __half> && kBits != 16) {
    chain_scaled_input<kBits, kSumK>(src, chunks, nthreads, xs4, xsum, nowait, perm, xnat, csync);
  } else {
    if (perm) {
      uint4* xn4 = reinterpret_cast<uint4*>(xnat);
      chain_settle_input(xn4, src, chunks, nthreads, nowait);
      csync();  // every chunk of the natural order is in
      for (int cb = threadIdx.x - lane; cb < chunks; cb += nthreads) {  // warp-uniform (the shuffles)
        const int c = cb + lane;
        chain_put_chunk<kBits, kSumK>(xs4, xsum, c, c < chunks, c < chunks ? chain_gather_chunk(xnat, perm, c) : uint4{});
      }
      return;
    }
    chain_settle_input(xs4, src, chunks, nthreads, nowait);
    if constexpr (kBits == 16) return;  // the chunks stay as copied
    for (int cb = threadIdx.x - lane; cb < chunks; cb += nthreads) {  // warp-uniform (the shuffles)
      const int c = cb + lane;
      chain_put_chunk<kBits, kSumK>(xs4, xsum, c, c < chunks, c < chunks ? xs4[c] : uint4{});
    }
  }
}

// An op's input with its RMSNorm (M = 1, fp16 halves; every thread
// calls it between the block barriers of the hand-off): the input's copy
// for this launch (parity par; or plain fp16) into xs at once, as
// chain_async_input copies it, with the fp32 sum of its squares; one block barrier; then each
// value y = round(w * round(s * rsqrt(mean(s^2) + eps))), as transformers'
// LlamaRMSNorm and qgemv's add_rms_gather round, then put as the plain
// preparation puts them (chain_put_chunk).  Thread i handles chunks i, i +
// n, ... in both passes (n = nthreads, a multiple of 32).  Inlined, as the
// kernel's other op-boundary code: a call inside the consume loop made the
// ABI keep the loop's state across it (chain_kernel's note).
template <int kBits, int kSumK, typename A = __half, typename Sync>
__device__ __forceinline__ void chain_norm_input(const GemvParams& p, int o_flags, int par, const void* norm, float eps,
                                                 int chunks, int nthreads, Sync&& csync, __half* xs, float* xsum,
                                                 bool nowait, const uint16_t* perm, __half* xnat) {
  // bf16 inputs of int4 / int8 weights: staged as fp16 of y 2^e, e from |y| <= max|x| r max|gain| (the two
  // roundings to bf16 add at most 2^-8 each); max|gain| is a constant of the chain, which the host stores as
  // an fp32 after the gain's K values (persist_launch's d_norms)
  constexpr bool kScaled = !std::is_same_v<A, __half> && kBits != 16;
  __shared__ float partial[kChainMaxWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  uint4* in4 = perm ? reinterpret_cast<uint4*>(xnat) : xs4;  // where the natural order is copied
  const uint4* gain = static_cast<const uint4*>(norm);
  float ss = 0.f, mx = 0.f;
  // as chain_async_input: every chunk copied at once, the poisoned ones copied again (chain_settle_input)
  const uint4* src = chain_input_src(p, o_flags, par);
  chain_settle_input(in4, src, chunks, nthreads, nowait || (o_flags & kChainPlainX));
  for (int c = threadIdx.x; c < chunks; c += nthreads) {
    const uint4 v = in4[c];
    const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = chain_pair<A>(h[q]);
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
    if constexpr (kScaled) mx = fmaxf(mx, chain_absmax8(v));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if constexpr (kScaled) chain_post_max(mx);
  if (lane == 0) partial[warp] = ss;
  csync();
  float total = 0.f;
  for (int w = 0; w < nthreads / 32; ++w) total += partial[w];
  const float r = rsqrtf(total / static_cast<float>(p.K) + eps);
  float mul = 1.f;
  if constexpr (kScaled)
    mul = chain_block_mul(nthreads, r * __ldg(reinterpret_cast<const float*>(gain + chunks)) * 1.02f);
  for (int cb = warp * 32; cb < chunks; cb += nthreads) {  // warp-uniform (the shuffles)
    const int c = cb + lane;
    uint4 v{};
    if (c < chunks) {
      v = perm ? chain_gather_chunk(xnat, perm, c) : xs4[c];  // (an act-order op's gain comes in its stored order)
      const uint4 g = __ldg(gain + c);
      uint32_t* h = reinterpret_cast<uint32_t*>(&v);
      const uint32_t* gh = reinterpret_cast<const uint32_t*>(&g);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 a = chain_pair<A>(h[q]), w = chain_pair<A>(gh[q]);
        const float y0 = chain_round<A>(a.x * r) * w.x, y1 = chain_round<A>(a.y * r) * w.y;
        if constexpr (kScaled) h[q] = chain_pack<__half>(chain_round<A>(y0) * mul, chain_round<A>(y1) * mul);
        else h[q] = chain_pack<A>(y0, y1);
      }
    }
    chain_put_chunk<kBits, kSumK>(xs4, xsum, c, c < chunks, v);
  }
}

// ---- Stage 2: a layer's attention inside the launch (kDecode; M = 1, fp16)
// The q/k/v op's rows of q and k are permuted on the host so that each
// 16-row panel holds 8 rotation pairs: panel j of a head holds the head's rows
// 8j..8j+7 and D/2+8j..D/2+8j+7 (D the head size).  Its finishing rotates
// them (the token's position a device scalar: one CUDA graph serves every
// step), writes q, k and v in their natural order into its output (two
// poisoned copies, as every chain buffer) and k and v into the cache at the
// token's slot.  Then, before the next op's (o's) input, every block runs its
// units of the attention: a unit is (kv head, context split), its kv head's
// gq = H / Hkv query heads over the split's cache positions, with an online
// softmax; the split's (max, sum, weighted values) go to a scratch buffer,
// and the last split of a kv head to arrive (a counter) merges them
// (flash-decoding's merge) into o's input, poisoned copies as any output.
struct ChainAttn {
  const unsigned short* qkv;  // the q/k/v op's output: two copies of (H + 2 Hkv) D fp16, copy stride ldq
  unsigned short* out;        // the attention's output (o's input): two copies of H D fp16
  __half* k_cache;            // [Hkv][S][D] this layer's
  __half* v_cache;
  const __half* cos;          // [S][D] the model's rotary tables (cos[., f] == cos[., f + D / 2])
  const __half* sin;
  const __half* bias;         // nullptr, or [(H + 2 Hkv) D] the q/k/v linear's bias (Qwen2), natural order
  const __half* q_norm;       // nullptr, or [D] each q head's RMSNorm gain (Qwen3); k_norm the k heads'
  const __half* k_norm;
  float* qk_ss;               // with q_norm: [2][H + Hkv] each head's sum of squares (a launch's parity a row)
  unsigned* qk_count;         // with q_norm: [2][H + Hkv] rows counted into it; zero before the first launch
  float qk_eps;
  float* part;                // [Hkv][splits][gq][D + 2]: a split's weighted values, then its max and sum
  unsigned* count;            // [Hkv]: splits done; zero before the first launch, left zero
  int ldq, H, Hkv, D, S, splits;
  int per_warp;               // positions a warp before a context is split across blocks (1..64)
  int form;                   // -1: the rule (at chain_oct_dim), 1: an octet of lanes a position, 0: a warp a position
  int prefetch;               // tiles a warp asked into L2 past its full ring: > 0 before the block's units, < 0 after
  float scale;                // the scores' scale (D^-1/2)
};

// The launch's slot and its rotary row, read once at the launch's start (every
// op of every layer uses the same ones): the finishing's rotation then needs
// no global load on the critical path.
constexpr int kChainAttnMaxDim = 128;
static __shared__ int chain_slot;
static __shared__ float chain_rope_cs[2 * kChainAttnMaxDim];  // cos, then sin, of the slot's row

template <typename A = __half>
__device__ __forceinline__ void chain_decode_prologue(const ChainAttn* attn, const int* slot) {
  const int pos = *slot, D = attn[0].D;
  if (pos < 0 || pos >= attn[0].S) __trap();  // the slot outside the cache: stop rather than write outside it
  if (threadIdx.x == 0) chain_slot = pos;
  for (int f = threadIdx.x; f < D; f += blockDim.x) {
    chain_rope_cs[f] = to_float(reinterpret_cast<const A*>(attn[0].cos)[static_cast<size_t>(pos) * D + f]);
    chain_rope_cs[kChainAttnMaxDim + f] = to_float(reinterpret_cast<const A*>(attn[0].sin)[static_cast<size_t>(pos) * D + f]);
  }
}  // (the kernel's next block barrier publishes them)

// Attention's shared memory (floats, inside the input buffer xs): the
// group's queries and the token's k and v; then either two buffers of a
// chunk's K and V rows (fp16, cp.async) or, for the block's merge, each warp's
// (max, sum) and values.
constexpr int kChainAttnChunk = 32;   // cache positions a chunk
// ChainAttn::per_warp's default: 2 a warp (32 positions a unit of 16 warps) against 8 (128), H200 2026-12-05,
// attention µs a layer (Llama-3-8B): +6.6 / +8.3 against +10.9 / +11.6 at contexts 256 / 768, +6.4 / +5.9 at 64
constexpr int kChainAttnPerWarp = 2;
__host__ __device__ inline int chain_attn_floats(int gq, int D, int W) {
  const int rows = 2 * 2 * kChainAttnChunk * D / 2;  // fp16 K and V, two buffers
  const int merge = W * D + 2 * W;
  return gq * D + 2 * D + (rows > merge ? rows : merge);
}

// The q/k/v op's finishing with the rotation (M = 1; sums: the block's panels
// [u0, u0 + count / 16) of this op, complete).  Pairs meet in one warp (rows r
// and r ^ 8 of a panel are values q and q ^ 8 of an iteration), so the loop is
// warp-uniform and each warp reads both halves of a pair before zeroing.
// A: the activations' type; kScaled: the sums are 2^e of the true ones
// (bf16 inputs staged for int4 / int8 weights: chain_x_unscale).
template <typename A = __half, bool kScaled = false>
__device__ __forceinline__ void chain_rope_finish(const ChainAttn& a, int pos, int par, float* sums, int u0, int count,
                                               unsigned short* y, int ldy, int nthreads) {
  const int lane = threadIdx.x & 31, D = a.D, half = D / 2;
  const float xun = kScaled ? chain_x_unscale : 1.f;
  auto sum_at = [&](const float* q) { return kScaled ? *q * xun : *q; };
  auto bias = [&](int i) { return to_float(reinterpret_cast<const A*>(a.bias)[i]); };
  const int q_rows = a.H * D, qk_rows = (a.H + a.Hkv) * D;
  const float* cs = chain_rope_cs;  // the slot's row (chain_decode_prologue)
  const float* sn = chain_rope_cs + kChainAttnMaxDim;
  const int nh = a.H + a.Hkv;
  if (a.q_norm) {
    // Qwen3's per-head RMSNorm of q and k needs each head's sum of squares, and a head's rows may lie in
    // several blocks: every q / k row adds its square to its head's sum (this launch's row of qk_ss), then
    // counts itself; the rows are normalized once a head's count reaches D (below).  A thread counts all
    // its rows before it waits for any, so no wait depends on a row its own block has not counted.  Next
    // launch's row of the sums and counts (the other parity) is zeroed here, where nothing reads it.
    for (int q = threadIdx.x; q < count; q += nthreads) {
      const int u = q / kPanelRows, r = q % kPanelRows, row = (u0 + u) * kPanelRows + r;
      if (row >= qk_rows) continue;
      const int head = row / D, f = 8 * ((row % D) / kPanelRows) + (r & 7);
      float v = chain_round<A>(sum_at(sums + static_cast<size_t>(u) * kPanelRows + r));
      if (a.bias) v = chain_round<A>(v + bias(head * D + (r < 8 ? f : half + f)));
      atomicAdd(a.qk_ss + par * nh + head, v * v);
      a.qk_ss[(par ^ 1) * nh + head] = 0.f;
      a.qk_count[(par ^ 1) * nh + head] = 0u;
    }
    __threadfence();  // the squares before the counts
    for (int q = threadIdx.x; q < count; q += nthreads) {
      const int row = (u0 + q / kPanelRows) * kPanelRows + q % kPanelRows;
      if (row < qk_rows) atomicAdd(a.qk_count + par * nh + row / D, 1u);
    }
  }
  for (int qb = threadIdx.x - lane; qb < count; qb += nthreads) {
    const int q = qb + lane;
    const bool on = q < count;
    const int u = q / kPanelRows, r = q % kPanelRows, row = (u0 + u) * kPanelRows + r;
    float* sp = sums + static_cast<size_t>(u) * kPanelRows + r;
    // the row's place in the natural order, and its rotation pair's (q and k rows)
    const int head = row / D, f = 8 * ((row % D) / kPanelRows) + (r & 7);
    const bool rot = row < qk_rows;
    const int nat = rot ? head * D + (r < 8 ? f : half + f) : row, pair = head * D + (r < 8 ? half + f : f);
    float v = 0.f, w = 0.f;
    if (on) {  // round(W x), then round(+ bias) as the per-op linear's bias add
      v = chain_round<A>(sum_at(sp));
      if (a.bias) v = chain_round<A>(v + bias(nat));
      if (rot) {
        w = chain_round<A>(sum_at(sp + (r < 8 ? 8 : -8)));
        if (a.bias) w = chain_round<A>(w + bias(pair));
      }
    }
    __syncwarp();
    if (!on) continue;
    *sp = 0.f;
    if (rot && a.q_norm) {  // the head's RMSNorm (Qwen3), rounded as transformers' Qwen3RMSNorm
      const unsigned* cnt = a.qk_count + par * nh + head;
      unsigned seen;
      do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(cnt) : "memory");
      while (seen < static_cast<unsigned>(D));
      float ss;
      asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(ss) : "l"(a.qk_ss + par * nh + head) : "memory");
      const float rs = rsqrtf(ss / static_cast<float>(D) + a.qk_eps);
      const __half* gain = head < a.H ? a.q_norm : a.k_norm;  // (A's bits)
      const int dv = nat - head * D, dw = pair - head * D;  // this row's and its pair's dims
      const A* ga = reinterpret_cast<const A*>(gain);
      v = chain_round<A>(chain_round<A>(v * rs) * to_float(ga[dv]));
      w = chain_round<A>(chain_round<A>(w * rs) * to_float(ga[dw]));
    }
    if (rot) {
      const float c = cs[f], s = sn[f];
      // x1 = row f, x2 = row f + D / 2: (x1 c - x2 s, x2 c + x1 s); here v is this row's, w its pair's
      v = r < 8 ? v * c - w * s : v * c + w * s;
    }
    const unsigned short hv = chain_act_bits<A>(v);
    chain_store_bits(y + nat, ldy, par, hv);
    if (nat >= q_rows) {  // k or v of kv head kh: the cache at the token's slot
      const bool is_k = nat < qk_rows;
      const int off = nat - (is_k ? q_rows : qk_rows), kh = off / D;
      reinterpret_cast<unsigned short*>(is_k ? a.k_cache : a.v_cache)[(static_cast<size_t>(kh) * a.S + pos) * D +
                                                                     off % D] = hv;
    }
  }
}

// 8 values (A) of a chain buffer, polled until none is the poison, as floats.
template <typename A = __half>
__device__ __forceinline__ void chain_poll8(const unsigned short* p, float* out, float mul) {
  const uint4* src = reinterpret_cast<const uint4*>(p);
  uint4 v = ld_relaxed_gpu_v4(src);
  while (!chain_half_ready(v)) v = ld_relaxed_gpu_v4(src);
  const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = chain_pair<A>(h[e]);
    out[2 * e] = f.x * mul, out[2 * e + 1] = f.y * mul;
  }
}

// kDpl consecutive values (A) of shared memory (kDpl-aligned) as floats, in one load.
template <int kDpl, typename A>
__device__ __forceinline__ void chain_ld_dims(const A* p, float (&o)[kDpl]) {
  if constexpr (kDpl == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = chain_pair<A>(u.x), b = chain_pair<A>(u.y);
    o[0] = a.x, o[1] = a.y, o[2] = b.x, o[3] = b.y;
  } else if constexpr (kDpl == 2) {
    const float2 a = chain_pair<A>(*reinterpret_cast<const uint32_t*>(p));
    o[0] = a.x, o[1] = a.y;
  } else {
    o[0] = to_float(*p);
  }
}

// The octet form of a unit's positions (ChainAttn::form 1).  Lane 8 g + r of a
// warp: octet g takes one position at a time, lane r its 4 kDpl dims (a
// row's 8-value pieces r and r + 8 for head size 128: each octet's loads of a
// row cover contiguous 128-byte runs, no bank conflicts).  A score is the
// lanes' partial dot products summed over the octet (3 shuffles, where a warp
// a position took 5 for each of its positions), each octet runs its own online
// softmax, and the warp's four merge at the end.  Measured on the H100 (2026-12-07, dev/attn_probe.py, µs a
// layer over the norms-only chain, a warp a position -> octets, two rounds): Llama-3-8B (GQA 4) at 4096
// +20.0 / +19.2 -> +16.8 / +16.2, at 768 (48 positions a unit) +10.0 / +9.9 -> +9.8 / +10.0; Llama-2-7B (no GQA:
// half the warps without a position of a 32-position chunk) at 640 +11.6 -> +12.3, at 2048 +21.5 / +21.2 ->
// +22.4 / +22.0.  Hence the rule: octets where a kv head has 4 query heads or more and the unit 128 positions or
// more (ChainAttn::form -1), else a warp a position.  The rule's heads half (the host's plan reads it too):
__host__ __device__ constexpr bool chain_attn_octets_rule(int gq) { return gq >= 4; }
// Its dims' index:
template <int kDpl>
__device__ __forceinline__ int chain_oct_dim(int r, int i) {
  return kDpl == 1 ? 4 * r + i : (i / 8) * 64 + 8 * r + (i % 8);
}
// The lane's 4 kDpl values (A) of a shared-memory row, as 16-bit pairs.
template <int kDpl, typename A>
__device__ __forceinline__ void chain_oct_load(const A* row, int r, uint32_t (&u)[2 * kDpl]) {
  if constexpr (kDpl == 1) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + 4 * r);
    u[0] = v.x, u[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < kDpl / 2; ++j) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + 64 * j + 8 * r);
      u[4 * j] = v.x, u[4 * j + 1] = v.y, u[4 * j + 2] = v.z, u[4 * j + 3] = v.w;
    }
  }
}

// The block's units of one layer's attention (every consumer thread; csync
// the block barrier; sm: chain_attn_floats floats of shared memory).  The
// context is split across blocks only when it is long: splits = min(a.splits,
// ceil(L / (W a.per_warp))), one unit a block (one split: no merge
// across blocks).  A unit's K and V rows come through shared memory in chunks
// (cp.async, two buffers: the next chunk's copy flies while this one is
// summed; the first is issued before the wait for q/k/v).  In form 0
// (the octet form above where its rule takes a unit) warp w takes query
// head w % gq and every (W / gq)-th position of each chunk from slice w / gq,
// with its own online softmax (lanes over the dims, kDpl = D / 32 each; the
// score all-reduced by shuffles; two positions at a time): few registers (the
// kernel calls this with the tile loop's state live) and no block barrier
// inside a chunk.  Then the head's warps merge in shared memory, and a split's
// result goes to the scratch, where the kv head's last split merges them (as
// flash-decoding does), or with one split straight into o's input.
// kOct: the octet form compiled in (its 4 kDpl dims a lane spill the decode kernels at the 128-register cap;
// without it every decode kernel spills nothing: chain_kernel's kOct).
template <int kDpl, typename A, bool kOct, typename Sync>
__device__ __forceinline__ void chain_attention(const ChainAttn& a, int par, int nthreads, Sync&& csync, float* sm) {
  __shared__ int last;
  constexpr int kD = 32 * kDpl;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = nthreads / 32;
  const int pos = chain_slot, gq = a.H / a.Hkv, L = pos + 1, pairs = gq * kD;
  const int splits = min(a.splits, (L + W * a.per_warp - 1) / (W * a.per_warp));
  const int units = a.Hkv * splits;
  const int hj = warp % gq, slices = W / gq, slice = warp / gq;  // this warp's query head and position slice
  const bool busy = slice < slices;
  float* qf = sm;                // [gq][kD] queries x scale
  float* kv = qf + pairs;        // [2][kD] the token's k, v
  float* big = kv + 2 * kD;      // the chunks' rows, or the merge's buffers
  A* rows = reinterpret_cast<A*>(big);  // [2][K, V][kChainAttnChunk][kD]
  const unsigned short* src = a.qkv + static_cast<size_t>(par) * a.ldq;
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int h = unit / splits, s = unit % splits;
    const int p0 = static_cast<int>(static_cast<long long>(s) * L / splits);
    const int p1 = static_cast<int>(static_cast<long long>(s + 1) * L / splits);
    const A* kc = reinterpret_cast<const A*>(a.k_cache) + static_cast<size_t>(h) * a.S * kD;
    const A* vc = reinterpret_cast<const A*>(a.v_cache) + static_cast<size_t>(h) * a.S * kD;
    // the chunk at c0 into buffer b (row pos, not yet written, is copied and never read)
    auto fetch = [&](int c0, int b) {
      const int words = min(kChainAttnChunk, p1 - c0) * kD / 8;
      const uint4* k4 = reinterpret_cast<const uint4*>(kc + static_cast<size_t>(c0) * kD);
      const uint4* v4 = reinterpret_cast<const uint4*>(vc + static_cast<size_t>(c0) * kD);
      uint4* ks4 = reinterpret_cast<uint4*>(rows + static_cast<size_t>(2 * b) * kChainAttnChunk * kD);
      uint4* vs4 = ks4 + kChainAttnChunk * kD / 8;
      for (int c = threadIdx.x; c < 2 * words; c += nthreads)
        cp_async_16_shared_data(c < words ? ks4 + c : vs4 + (c - words), c < words ? k4 + c : v4 + (c - words));
      cp_async_commit();
    };
    fetch(p0, 0);  // p0 < p1: every unit has a position (splits <= L)
    for (int c = threadIdx.x; c < pairs / 8; c += nthreads) chain_poll8<A>(src + h * pairs + 8 * c, qf + 8 * c, a.scale);
    if (p1 == L)
      for (int c = threadIdx.x; c < kD / 4; c += nthreads) {
        const int at = c < kD / 8 ? a.H * kD + h * kD + 8 * c : (a.H + a.Hkv) * kD + h * kD + 8 * (c - kD / 8);
        chain_poll8<A>(src + at, kv + 8 * c, 1.f);
      }
    csync();  // the queries and the token's k / v
    if (kOct && (a.form == 1 || (a.form < 0 && chain_attn_octets_rule(gq) && p1 - p0 >= 4 * kChainAttnChunk))) {
      constexpr int kE = 4 * kDpl;  // dims a lane
      const int g = lane >> 3, r = lane & 7;
      const unsigned omask = 0xffu << (lane & 24);
      float q[kE], acc[kE], m = -INFINITY, l = 0.f;
#pragma unroll
      for (int i = 0; i < kE; ++i) q[i] = qf[hj * kD + chain_oct_dim<kDpl>(r, i)], acc[i] = 0.f;
      for (int c0 = p0, b = 0; c0 < p1; c0 += kChainAttnChunk, b ^= 1) {
        const int n = min(kChainAttnChunk, p1 - c0);
        cp_async_wait<0>();  // the chunk's copies, then the barrier: form 0's loop below says why
        csync();
        if (c0 + kChainAttnChunk < p1) fetch(c0 + kChainAttnChunk, b ^ 1);
        const A* ks = rows + static_cast<size_t>(2 * b) * kChainAttnChunk * kD;
        const A* vs = ks + kChainAttnChunk * kD;
        if (busy)
          for (int pl = 4 * slice + g; pl < n; pl += 4 * slices) {
            const bool tok = c0 + pl == pos;  // the token's own k / v: from kv (not yet in the cache)
            float s0 = 0.f, s1 = 0.f;
            if (!tok) {
              uint32_t u[2 * kDpl];
              chain_oct_load<kDpl>(ks + pl * kD, r, u);
#pragma unroll
              for (int w = 0; w < 2 * kDpl; ++w) {
                const float2 f = chain_pair<A>(u[w]);
                s0 = fmaf(q[2 * w], f.x, s0), s1 = fmaf(q[2 * w + 1], f.y, s1);
              }
            } else {
#pragma unroll
              for (int i = 0; i < kE; i += 2)
                s0 = fmaf(q[i], kv[chain_oct_dim<kDpl>(r, i)], s0),
                s1 = fmaf(q[i + 1], kv[chain_oct_dim<kDpl>(r, i + 1)], s1);
            }
            float sc = s0 + s1;
            sc += __shfl_xor_sync(omask, sc, 1);
            sc += __shfl_xor_sync(omask, sc, 2);
            sc += __shfl_xor_sync(omask, sc, 4);
            const float mx = fmaxf(m, sc), rs = __expf(m - mx), e1 = __expf(sc - mx);
            l = fmaf(l, rs, e1);
            m = mx;
            if (!tok) {
              uint32_t u[2 * kDpl];
              chain_oct_load<kDpl>(vs + pl * kD, r, u);
#pragma unroll
              for (int w = 0; w < 2 * kDpl; ++w) {
                const float2 f = chain_pair<A>(u[w]);
                acc[2 * w] = fmaf(acc[2 * w], rs, e1 * f.x), acc[2 * w + 1] = fmaf(acc[2 * w + 1], rs, e1 * f.y);
              }
            } else {
#pragma unroll
              for (int i = 0; i < kE; ++i) acc[i] = fmaf(acc[i], rs, e1 * kv[kD + chain_oct_dim<kDpl>(r, i)]);
            }
          }
      }
      // the warp's four octets into one (an octet without positions: max -inf, sum and values 0)
#pragma unroll
      for (int o = 8; o < 32; o <<= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o), lo = __shfl_xor_sync(0xffffffffu, l, o);
        const float mx = fmaxf(m, mo);
        const float f0 = m == -INFINITY ? 0.f : __expf(m - mx), f1 = mo == -INFINITY ? 0.f : __expf(mo - mx);
        l = l * f0 + lo * f1;
#pragma unroll
        for (int i = 0; i < kE; ++i) acc[i] = acc[i] * f0 + __shfl_xor_sync(0xffffffffu, acc[i], o) * f1;
        m = mx;
      }
      csync();  // every warp is past the last chunk's rows (the merge's buffers overlay them)
      if (lane == 0) big[warp] = m, big[W + warp] = l;
      if (g == 0)
#pragma unroll
        for (int i = 0; i < kE; ++i) big[2 * W + warp * kD + chain_oct_dim<kDpl>(r, i)] = acc[i];
    } else {
    float q[kDpl], acc[kDpl], m = -INFINITY, l = 0.f;
#pragma unroll
    for (int e = 0; e < kDpl; ++e) q[e] = qf[hj * kD + lane * kDpl + e], acc[e] = 0.f;
    // position p's (k, v) of this lane's dims: the token's from kv, the others from the chunk's rows
    auto row = [&](const A* ks, const A* vs, int pl, int p, float (&k)[kDpl], float (&v)[kDpl]) {
      chain_ld_dims<kDpl>(ks + pl * kD + lane * kDpl, k);  // one shared load each (8, 4 or 2 bytes)
      chain_ld_dims<kDpl>(vs + pl * kD + lane * kDpl, v);
      if (p == pos)
#pragma unroll
        for (int e = 0; e < kDpl; ++e) k[e] = kv[lane * kDpl + e], v[e] = kv[kD + lane * kDpl + e];
    };
    auto take = [&](float sc, const float (&v)[kDpl]) {  // one position into the online softmax
      const float mx = fmaxf(m, sc), r = __expf(m - mx), e1 = __expf(sc - mx);
      l = fmaf(l, r, e1);
#pragma unroll
      for (int e = 0; e < kDpl; ++e) acc[e] = fmaf(acc[e], r, e1 * v[e]);
      m = mx;
    };
    for (int c0 = p0, b = 0; c0 < p1; c0 += kChainAttnChunk, b ^= 1) {
      const int n = min(kChainAttnChunk, p1 - c0);
      cp_async_wait<0>();  // this thread's copies of the chunk (the only ones in flight)
      // Every thread's copies of the chunk are in, and every warp is past the other buffer's last use (the
      // previous chunk's sums): only now may the next chunk's copies go into it.  Issued before this barrier,
      // a warp with no query head (gq not dividing W) ran ahead and overwrote the rows the others were still
      // summing once a context had three chunks or more.
      csync();
      if (c0 + kChainAttnChunk < p1) fetch(c0 + kChainAttnChunk, b ^ 1);  // flies while this chunk is summed
      const A* ks = rows + static_cast<size_t>(2 * b) * kChainAttnChunk * kD;
      const A* vs = ks + kChainAttnChunk * kD;
      if (busy)
        for (int pl = slice; pl < n; pl += 2 * slices) {  // two positions at a time: two shuffle chains
          const int pl2 = pl + slices;
          const bool two = pl2 < n;
          float k0[kDpl], v0[kDpl], k1[kDpl], v1[kDpl];
          row(ks, vs, pl, c0 + pl, k0, v0);
          row(ks, vs, two ? pl2 : pl, c0 + (two ? pl2 : pl), k1, v1);
          float s0 = 0.f, s1 = 0.f;
#pragma unroll
          for (int e = 0; e < kDpl; ++e) s0 = fmaf(q[e], k0[e], s0), s1 = fmaf(q[e], k1[e], s1);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, o);
            s1 += __shfl_xor_sync(0xffffffffu, s1, o);
          }
          take(s0, v0);
          if (two) take(s1, v1);
        }
    }
    // the block's merge: each warp's (max, sum) and values, then (head, dim) threads over the head's warps
    csync();  // every warp is past the last chunk's rows (the merge's buffers overlay them)
    if (lane == 0) big[warp] = m, big[W + warp] = l;
#pragma unroll
    for (int e = 0; e < kDpl; ++e) big[2 * W + warp * kD + lane * kDpl + e] = acc[e];
    }  // (form 0)
    float* wm = big;          // [W] maxima
    float* wl = wm + W;       // [W] sums
    float* wv = wl + W;       // [W][kD] values
    csync();
    float* ps = a.part + (static_cast<size_t>(h) * a.splits + s) * gq * (kD + 2);
    for (int t = threadIdx.x; t < pairs; t += nthreads) {
      const int j = t / kD, d = t % kD;
      float mx = -INFINITY;
      for (int w = j; w < gq * slices; w += gq) mx = fmaxf(mx, wm[w]);
      float den = 0.f, num = 0.f;
      if (mx != -INFINITY)
        for (int w = j; w < gq * slices; w += gq) {
          const float f = __expf(wm[w] - mx);  // a warp without positions: exp(-inf) = 0
          den = fmaf(wl[w], f, den);
          num = fmaf(wv[w * kD + d], f, num);
        }
      if (splits == 1) {  // the unit is the whole context: o's input at once
        chain_store_bits(a.out + h * pairs + t, static_cast<size_t>(a.H) * kD, par, chain_act_bits<A>(num / den));
      } else {
        ps[j * (kD + 2) + d] = num;
        if (d == 0) ps[j * (kD + 2) + kD] = mx, ps[j * (kD + 2) + kD + 1] = den;
      }
    }
    if (splits > 1) {
      __threadfence();  // the split's values before its count
      csync();
      if (threadIdx.x == 0) last = atomicAdd(a.count + h, 1u) == static_cast<unsigned>(splits - 1);
      csync();
      if (last) {  // every split of kv head h is in: merge them into o's input
        __threadfence();
        if (threadIdx.x == 0) a.count[h] = 0u;  // for the next launch (nobody else touches it in this one)
        const float* ph = a.part + static_cast<size_t>(h) * a.splits * gq * (kD + 2);
        for (int e = threadIdx.x; e < pairs; e += nthreads) {
          const int j = e / kD, d = e % kD;
          // one pass, the running max rescaling the sums (unrolled: 8 splits' loads in flight at once)
          float mx = -INFINITY, den = 0.f, num = 0.f;
#pragma unroll 8
          for (int t = 0; t < splits; ++t) {
            const float* pt = ph + (t * gq + j) * (kD + 2);
            const float mt = __ldcg(pt + kD), lt = __ldcg(pt + kD + 1), at = __ldcg(pt + d);
            const float m2 = fmaxf(mx, mt), r = __expf(mx - m2), w = __expf(mt - m2);
            den = fmaf(den, r, lt * w);
            num = fmaf(num, r, at * w);
            mx = m2;
          }
          chain_store_bits(a.out + h * pairs + e, static_cast<size_t>(a.H) * kD, par, chain_act_bits<A>(num / den));
        }
      }
    }
    csync();  // the scratch and the merge's buffers are free for the block's next unit
  }
}

// chain_attention for the layer's head size (32, 64 or 128: the plan refuses others).
template <typename A = __half, bool kOct = true, typename Sync>
__device__ __forceinline__ void chain_attention_any(const ChainAttn& a, int par, int nthreads, Sync&& csync,
                                                 float* sm) {
  if (a.D == 128) chain_attention<4, A, kOct>(a, par, nthreads, csync, sm);
  else if (a.D == 64) chain_attention<2, A, kOct>(a, par, nthreads, csync, sm);
  else chain_attention<1, A, kOct>(a, par, nthreads, csync, sm);
}

// ---- The head: the final RMSNorm, lm_head and the greedy argmax (kNorm; M = 1)
// After the last op, every block polls the last op's output (two poisoned
// copies, as every chain buffer), normalizes it with the final gain as the
// layers' hand-offs do (chain_norm_input), and computes its rows [V b / G,
// V (b + 1) / G) of the logits: fp32 sums rounded to A, as the per-op
// lm_head's output is, stored as fp32.  The weight is the model's lm_head
// (A [V][K], row-major), read in place with 16-byte loads that skip L1, two
// rows a warp and 8 loads a row in flight a lane.  Each block posts its
// largest logit with one 64-bit atomicMax (the lowest row on ties, as
// torch.argmax); the last block to count writes the token and resets the key
// and the count for the next launch.
struct ChainHead {
  const unsigned short* x;  // the last op's output: two copies of K values, ldx apart
  const void* gain;         // A [K + 8]: the final RMSNorm's gain (qgemv.persist.norm_gain's layout)
  const void* w;            // A [V][K], 16-byte aligned rows (K % 8 == 0)
  float* logits;            // fp32 [V]
  void* out;                // A [K]: the last op's output as plain values (block 0 copies it), or nullptr
  unsigned long long* key;  // the argmax's key: zero before the first launch, left zero
  unsigned* count;          // blocks done: zero before the first launch, left zero
  long long* token;         // the greedy token
  int V, K, ldx;
  float eps;
};

// A logit and its row as a key whose unsigned order is (value, then the lower row): NaN above +inf.
__device__ __forceinline__ unsigned long long chain_argmax_key(float v, long long row) {
  unsigned u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - static_cast<unsigned>(row));
}

// 8 weights (A) times 8 activations (A), added to s in fp32.
template <typename A>
__device__ __forceinline__ float chain_dot8(const uint4& w, const uint4& x, float s) {
  const uint32_t wh[4] = {w.x, w.y, w.z, w.w}, xh[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 a = chain_pair<A>(wh[e]), b = chain_pair<A>(xh[e]);
    s = fmaf(a.x, b.x, fmaf(a.y, b.y, s));
  }
  return s;
}

// The head (every consumer thread, after the last op's finishing; xs: the input buffer, free by then).  A
// call, not inlined: nothing of the tile loop is live across it, and inlined it changed ptxas's schedule of
// the chunk loop in 36 of the 54 kernels.
template <typename A>
__device__ __noinline__ void chain_head(const ChainHead& hd, int par, int nthreads, __half* xs) {
  auto csync = [&] { asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory"); };
  __shared__ unsigned long long best_of[kChainMaxWarps];
  constexpr int kU = 8;  // 16-byte loads a row in flight a lane
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = nthreads / 32, chunks = hd.K / 8;
  GemvParams p{};
  p.x = hd.x, p.ldx = hd.ldx, p.K = hd.K;
  csync();  // every warp is past the last op's reads of xs
  chain_norm_input<16, 0, A>(p, 0, par, hd.gain, hd.eps, chunks, nthreads, csync, xs, nullptr, false, nullptr,
                             nullptr);
  if (blockIdx.x == 0 && hd.out)  // (every value is in: this block polled them all)
    for (int c = threadIdx.x; c < chunks; c += nthreads)
      reinterpret_cast<uint4*>(hd.out)[c] = __ldcg(reinterpret_cast<const uint4*>(hd.x + static_cast<size_t>(par) * hd.ldx) + c);
  csync();  // the normed input in xs
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  const uint64_t policy = evict_first_policy();
  long long r0, r1;
  chain_range(hd.V, blockIdx.x, gridDim.x, r0, r1);
  unsigned long long best = 0ull;
  for (long long row = r0 + 2 * warp; row < r1; row += 2 * W) {
    const bool two = row + 1 < r1;
    const uint4* w0 = reinterpret_cast<const uint4*>(static_cast<const A*>(hd.w) + row * hd.K);
    const uint4* w1 = two ? w0 + chunks : w0;
    float s0 = 0.f, s1 = 0.f;
    for (int c0 = 0; c0 < chunks; c0 += 32 * kU) {
      uint4 a[kU], b[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int c = c0 + 32 * u + lane;
        a[u] = b[u] = make_uint4(0u, 0u, 0u, 0u);
        if (c < chunks) a[u] = ld_stream_v4(w0 + c, policy), b[u] = ld_stream_v4(w1 + c, policy);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int c = c0 + 32 * u + lane;
        if (c < chunks) {
          const uint4 xv = xs4[c];
          s0 = chain_dot8<A>(a[u], xv, s0);
          s1 = chain_dot8<A>(b[u], xv, s1);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, o);
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    if (lane == 0) {
      const float v0 = to_float(from_float<A>(s0));
      hd.logits[row] = v0;
      best = max(best, chain_argmax_key(v0, row));
      if (two) {
        const float v1 = to_float(from_float<A>(s1));
        hd.logits[row + 1] = v1;
        best = max(best, chain_argmax_key(v1, row + 1));
      }
    }
  }
  if (lane == 0) best_of[warp] = best;
  csync();
  if (threadIdx.x == 0) {
    for (int w = 1; w < W; ++w) best = max(best, best_of[w]);
    atomicMax(hd.key, best);
    __threadfence();  // the key before the count
    if (atomicAdd(hd.count, 1u) == gridDim.x - 1) {
      __threadfence();
      const unsigned long long k = atomicExch(hd.key, 0ull);
      *hd.token = static_cast<long long>(0xffffffffu - static_cast<unsigned>(k & 0xffffffffull));
      *hd.count = 0u;  // (every block has counted: nothing else touches it in this launch)
    }
  }
}

// ---- The kernel (form 20) -------------------------------------------------
// Every warp streams its own runs of every op's tiles (chain_schedule's
// records) through its ring of shared-memory chunks of kChainChunk tiles and
// refills the chunk it has just summed (chain_consume); the block owns
// whole output panels and finishes them after a block barrier (op_end);
// activations are fp16 halves, 0xffff until written, two copies a buffer
// (the launch's parity picks one), so a hand-off is a poll of the input, not
// a grid-wide count (prep_input, chain_async_input).  M = 1 (sh.M).  kNorm:
// the ops' input RMSNorms in the hand-offs (sh.norms); kDecode (with kNorm):
// each layer's RoPE, KV-cache write and attention (sh.attn, sh.pos); kOct
// (with kDecode): the attention's octet form compiled in, which spills 2-7
// values in every decode kernel (2026-12-07), so the launch takes the kernel
// without it where the plan's rule never picks it (PersistPlan::octets).
// Every op-boundary function is inlined: with the norm, the rotation and the
// attention as calls (noinline), the calls inside the consume loop made the
// call ABI keep the loop's state in local memory, 6-10 local loads and stores
// on each chunk's path in the decode kernels (16-64 byte stack frames, ptxas;
// 2026-12-05); inlined, every kernel has no stack frame.
// ops[nops]; sync[nops + 1] zero before the first launch (sync[nops] counts
// the launches: their parity).  wait_cycles: nullptr, or the lab's cycle
// counts (ChainCycles, then per op class); compiled in the lab's builds only
// (QGEMV_CHAIN_STAMPS), so the extension's kernels carry no timing code.
template <int kBits, int kGroup, bool kZeros, bool kNorm = false, bool kDecode = false, typename A = __half,
          bool kOct = true>
__global__ void __launch_bounds__(kChainMaxWarps * 32, 1)
    chain_kernel(const ChainOp* __restrict__ ops, int nops, ChainShape sh, unsigned* sync,
                 unsigned long long* wait_cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // bulk copies and mbarrier waits need sm_90: the host launches this on compute capability 9.x only
#else
  using T = A;  // the activations' type: __half or __nv_bfloat16
  using Fmt = ChainFormat<kBits, kGroup, kZeros>;
  // bf16 inputs of int4 / int8 weights are staged as fp16 of x 2^e (chain_async_input): the sums are 2^e of the
  // true ones until the finishing; bf16 weights meet bf16 inputs as they are
  constexpr bool kScaled = !std::is_same_v<A, __half> && kBits != 16;
  constexpr bool kBf16W = !std::is_same_v<A, __half> && kBits == 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = blockDim.x >> 5, G = gridDim.x, nthreads = W * 32;
  const int g = lane >> 2, t = lane & 3;
  const int M = sh.M, xg = sh.x_cap / 32;

  extern __shared__ __align__(128) unsigned char chain_smem[];
  float* sums = reinterpret_cast<float*>(chain_smem);
  __half* xs = reinterpret_cast<__half*>(chain_smem + (static_cast<size_t>(sh.sums) * 4 + 15) / 16 * 16);  // (or bf16 bits)
  float* xsum = reinterpret_cast<float*>(xs + static_cast<size_t>(M) * sh.x_cap);  // [M][x_cap / 32]
  __half* xnat = reinterpret_cast<__half*>(reinterpret_cast<unsigned char*>(xsum) + chain_xsum_bytes(sh));  // sh.stage
  for (int q = threadIdx.x; q < sh.sums; q += nthreads) sums[q] = 0.f;
  const ChainRing rg(chain_smem, sh, W);
  for (int q = threadIdx.x; q < W * rg.C; q += blockDim.x) mbar_init(rg.full + q, 1);
  mbar_init_fence();
  if constexpr (kDecode) chain_decode_prologue<A>(sh.attn, sh.pos);
  // the block's schedule records
  for (int q = threadIdx.x; q < sh.classes * (W + 1); q += blockDim.x)
    rg.tab[q] = sh.cursors[(static_cast<size_t>(q / (W + 1)) * G + (kStamps ? (blockIdx.x + sh.rotate) % G : blockIdx.x)) *
                               (W + 1) + q % (W + 1)];
  __syncthreads();
  auto csync = [&] { asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory"); };
  const bool timed = kStamps && wait_cycles && threadIdx.x == 0;  // (the lab's builds only)
  // The lab's cycle counts (thread 0 of the block, when timed), in shared memory, not in registers
  // every thread would hold: waiting for the ring, waiting for the block's warps, finishing, preparing.
  // Then, per op class (ChainOp::cls), its preparing and finishing cycles.
  __shared__ long long t_acc[4 + 2 * kChainMaxClasses];
  long long& t_spin = t_acc[0];
  long long& t_warps = t_acc[1];
  long long& t_finish = t_acc[2];
  long long& t_prep = t_acc[3];
  if (timed)
    for (int k = 0; k < 4 + 2 * kChainMaxClasses; ++k) t_acc[k] = 0;
  // sh.stamps (lab builds with QGEMV_CHAIN_STAMPS only: the extension's kernels stay without the code,
  // which costs the G = 128 kernel without zero points 16 more bytes of spills): thread 0's last marks, the end of the input's preparation and of the op's finishing
  __shared__ long long t_mark[2];
  auto gtime = [] {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
  };
  auto stamp = [&](int oi, int k, unsigned long long v) { sh.stamps[(static_cast<size_t>(oi) * gridDim.x + blockIdx.x) * 5 + k] = v; };
  if (kStamps && timed && sh.stamps) t_mark[1] = clock64();
  auto per_class = [&](int cls, int k, long long v) {  // k: 0 preparing, 1 finishing
    if (cls >= 0 && cls < kChainMaxClasses) t_acc[4 + 2 * cls + k] += v;
  };
  // This launch's parity: each activation buffer holds two copies, the parity selecting one; a launch
  // writes its copy and poisons the other, which the next launch writes (chain_half_ready).
  const unsigned launch = __ldcg(sync + nops);
  const int par = static_cast<int>(launch & 1u);
  const long long t_begin = timed ? clock64() : 0;

  int i = -1;  // the op being consumed
  ChainCursor cur{0, 0, 0, 0, 0, 1, 0, 0, 0};
  ChainSeg<kBits, Fmt::kGpt, kZeros, true, true, kBf16W> seg;
  const int tokx = min(g, M - 1), tok0 = min(2 * t, M - 1), tok1 = min(2 * t + 1, M - 1);

  // Op o's input: global (written by other blocks in this launch: through L2)
  // -> xs, the high-nibble positions / 16, and 2^-24 x the sums of each 128.
  auto prep_input = [&](const GemvParams& p, int o_flags, int cls, int oi) {
    if (sh.skip & 2) return;  // lab: no hand-off at all (results wrong)
    const long long b0 = timed ? clock64() : 0;
    csync();  // thread 0's spin is over; every warp is past the last op's reads of xs
    const long long p0 = timed ? clock64() : 0;
    if (timed) t_warps += p0 - b0;
    const int chunks = p.K / 8;
    // lab builds: skip bit 8 + c takes the inputs of op class c without waiting (one hand-off's wait)
    const bool nowait = (sh.skip & 1) || (kStamps && cls >= 0 && cls < 8 && ((sh.skip >> (8 + cls)) & 1));
    {
      bool normed = false;
      if constexpr (kNorm) {
        if (const void* norm = sh.norms[oi]) {  // RMSNorm of the input on the way in
          chain_norm_input<kBits, Fmt::kSumK, A>(p, o_flags, par, norm, sh.norm_eps, chunks, nthreads, csync, xs,
                                                 xsum, nowait, chain_op_perm(ops[oi]), xnat);
          normed = true;
        }
      }
      if (!normed)  // the input copied at once
        chain_async_input<kBits, Fmt::kSumK, A>(chain_input_src(p, o_flags, par), chunks, nthreads, xs, xsum,
                                                (o_flags & kChainPlainX) || nowait, chain_op_perm(ops[oi]), xnat, csync);
      if (p.Kp > p.K) {  // a weight padded to whole tiles: zero inputs past K, and the x sums of whole padded groups
        uint4* xs4 = reinterpret_cast<uint4*>(xs);
        for (int c = chunks + threadIdx.x; c < p.Kp / 8; c += nthreads) xs4[c] = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (Fmt::kSumK > 0)
          for (int q = (p.K + Fmt::kSumK - 1) / Fmt::kSumK + threadIdx.x; q < p.Kp / Fmt::kSumK; q += nthreads)
            xsum[q] = 0.f;
      }
    }
    csync();
    if (timed) {
      const long long v = clock64() - p0;
      t_prep += v;
      per_class(cls, 0, v);
    }
    if (kStamps && timed && sh.stamps) t_mark[0] = clock64(), stamp(oi, 2, t_mark[0] - t_mark[1]), stamp(oi, 4, gtime());
  };

  // Every warp is past op oi: finish the block's panels (the next ops poll their values).
  auto op_end = [&](int oi) {
    const ChainOp& o = ops[oi];
    const GemvParams& p = o.p;
    if (sh.skip & 2) return;  // lab: no hand-off at all (results wrong)
    const int4 r = rg.tab[o.cls * (W + 1) + W];
    const int u0 = r.x, u1 = r.y;
    const int ppu = chain_ppu(o), vals = kPanelRows * M;
    if constexpr (kDecode) {
      if (o.flags & kChainRope) {  // stage 2: q/k/v, rotated, into its output and the cache
        const long long f0 = timed ? clock64() : 0;
        csync();
        chain_rope_finish<A, kScaled>(sh.attn[o.attn], chain_slot, par, sums, u0, (u1 - u0) * vals,
                                      static_cast<unsigned short*>(p.y), p.ldy, nthreads);
        if (timed) {
          const long long v = clock64() - f0;
          t_finish += v;
          per_class(o.cls, 1, v);
        }
        return;
      }
    }
    const bool silu = o.out == static_cast<int>(ChainOut::kSiluMul);
    const bool resid = o.out == static_cast<int>(ChainOut::kResidual);
    const int count = (u1 - u0) * vals;
    // The residual (an earlier op's output, complete since its hand-off) of
    // this thread's first value: its L2 round trip under the barrier's wait.
    const bool pres = !(o.flags & kChainPlainRes), py = !(o.flags & kChainPlainY);
    // (a residual inside the launch was some earlier op's input: every block has seen all of it)
    auto res_at = [&](int tok, int row) {
      if (pres) return to_float(__ldcg(static_cast<const T*>(o.res) + static_cast<size_t>(par) * p.N + row));
      return to_float(__ldcg(static_cast<const T*>(o.res) + static_cast<size_t>(tok) * p.N + row));
    };
    float res0 = 0.f;
    if (resid && threadIdx.x < count)
      res0 = res_at((threadIdx.x % vals) / kPanelRows,
                    static_cast<int>(u0 + threadIdx.x / vals) * kPanelRows + threadIdx.x % kPanelRows);
    const long long f0 = timed ? clock64() : 0;
    if (kStamps && timed && sh.stamps) stamp(oi, 0, f0 - t_mark[0]);
    csync();
    const long long f1 = timed ? clock64() : 0;
    const float xun = kScaled ? chain_x_unscale : 1.f;  // (kScaled: the sums are 2^e of the true ones)
    for (int q = threadIdx.x; q < count; q += nthreads) {
      const int u = q / vals, tok = (q % vals) / kPanelRows, r = q % kPanelRows;
      float* sp = sums + (static_cast<size_t>(u * ppu) * M + tok) * kPanelRows + r;
      float v = to_float(from_float<T>(kScaled ? *sp * xun : *sp));
      if (silu) {
        float* up = sp + M * kPanelRows;
        v = v / (1.f + __expf(-v)) * to_float(from_float<T>(kScaled ? *up * xun : *up));
        *up = 0.f;
      }
      const int row = static_cast<int>(u0 + u) * kPanelRows + r;
      if (resid) v += q == threadIdx.x ? res0 : res_at(tok, row);
      if (py) {  // this launch's copy; the other poisoned for the next launch
        chain_store_bits(static_cast<unsigned short*>(p.y) + row, p.ldy, par, chain_act_bits<T>(v));
      } else {
        static_cast<T*>(p.y)[static_cast<size_t>(tok) * p.ldy + row] = from_float<T>(v);
      }
      *sp = 0.f;
    }
    if (oi + 1 == nops && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(sync + nops, 1u);  // the next parity
    if (timed) {
      const long long v = clock64() - f1;
      t_warps += f1 - f0, t_finish += v;
      per_class(o.cls, 1, v);
    }
    if (kStamps && timed && sh.stamps) t_mark[1] = clock64(), stamp(oi, 1, t_mark[1] - f0), stamp(oi, 3, gtime());
  };

  // The segment's sums (2^-24 of the true ones) into the block's buffer.
  auto seg_flush = [&] {
    float* sp = sums + static_cast<size_t>(cur.vp) * M * kPanelRows;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 2 * t + (e & 1);
      if ((e & 1) == 0 && tok < M) atomicAdd(sp + tok * kPanelRows + g + (e >= 2 ? 8 : 0), seg.value(e));
    }
  };

  // Past a segment's last tile (or before the first): the next segment, through op ends.  false: done.
  // ahead(n): lane 0 of each warp asks L2 for its walk's next n tiles past its ring (chain_consume).
  auto boundary = [&](auto&& ahead) -> bool {
    seg.close(cur, seg_flush);
    while (cur.pos >= cur.end) {
#if QGEMV_CHAIN_STAMPS
      if (i >= 0 && (sh.skip & 64)) seg.slice_finish();  // lab: this op's barriers all met
#endif
      if (i >= 0) op_end(i);
      if (++i >= nops) return false;
      chain_start(ops[i], rg.tab, warp, W, cur);
#if QGEMV_CHAIN_STAMPS
      if (sh.skip & 64) seg.slice_start(cur.end - cur.pos, sh.slices);
#endif
      if constexpr (kDecode) {
        if (ops[i].flags & kChainAttnIn) {  // stage 2: the layer's attention writes this op's input
          const long long a0 = timed ? clock64() : 0;
          const ChainAttn& at = sh.attn[ops[i].attn];
          // HBM idles while the rings are full and the blocks attend: the walks' next tiles into L2 meanwhile
          if (at.prefetch > 0) ahead(at.prefetch);
          csync();  // every warp is past the last op's reads of xs, the attention's scratch
          chain_attention_any<A, kOct>(at, par, nthreads, csync, reinterpret_cast<float*>(xs));
          if (at.prefetch < 0) ahead(-at.prefetch);
          if (timed) t_prep += clock64() - a0;
        }
      }
      prep_input(ops[i].p, ops[i].flags, ops[i].cls, i);
    }
    seg.begin(cur, ops[i], g, xs + static_cast<size_t>(tokx) * sh.x_cap + Fmt::kLaneK * t + cur.kt * Fmt::kTileK,
              xsum + tok0 * xg + cur.kt * Fmt::kSumsTile, xsum + tok1 * xg + cur.kt * Fmt::kSumsTile);
    return true;
  };

  constexpr int kTs = kChainTileBytes + chain_meta_bytes(kGroup, kZeros);
  chain_consume<kChainChunk, kTs, Fmt::kGpt, kZeros>(rg, ops, nops, W, sh.skip, seg, boundary, timed, t_spin);
  if constexpr (kNorm) {
    if (sh.head) chain_head<A>(*sh.head, par, nthreads, xs);
  }
  if (timed) {
    chain_add_cycles(wait_cycles, ChainCycles{{t_spin, t_warps, t_finish, t_prep, clock64() - t_begin}});
    for (int k = 0; k < 2 * kChainMaxClasses; ++k)  // after the SM id: [(6 + k) blocks + b]
      atomicAdd(wait_cycles + (6 + k) * gridDim.x + blockIdx.x, static_cast<unsigned long long>(t_acc[4 + k]));
  }
#endif
}

}  // namespace qgemv
