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
// Forms 1-4 are in git and in dev/PERSISTENT.md; this header holds form 5, its
// variant form 6 (ChainShape::slices), forms 7-9 (chain7_kernel; form 9 is
// described above that kernel's form-9 branch), forms 11, 12 and 14
// (chain11_kernel; 12 passes paired activations, 14 adds a feed warp that
// bulk-copies the weights into shared-memory rings; int4 only) and form 13
// (chain13_kernel, no block barriers).  dev/persist_lab.cu runs them against
// qgemv's per-op GEMVs; the extension compiles form 20 only (csrc/persist.cu,
// qgemv.persist), the other forms stay for the lab.  Stage 2 (kDecode) adds
// each layer's RoPE, KV-cache write and attention to form 20 (ChainAttn).
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

// The launch's geometry (the host's choice; chain5_smem_bytes sizes it).
struct ChainShape {
  int stage_tiles;  // tiles per ring stage
  int stages;       // ring depth
  int meta_bytes;   // per tile: 0, or chain_meta_bytes
  int x_cap;        // the largest K (elements per token of the input buffer)
  int M;            // tokens
  int skip;         // 0; lab timing experiments only (results wrong): 1 no waits (forms 12-17: the polled words
                    //    taken as they are), 2 no input preparation (form 9; forms 11-17: no hand-off),
                    //    4 no tile math, 8 (forms 14-17) weights from L2, 32 no flush or finish
  int slices = 0;   // finishing: 0 per panel, by the warp completing it (form 5); 1 per block slice, by the sync
                    //    warps once the op's sums are complete everywhere (form 6)
  int sums = 0;     // form 8: fp32 values of the block's sum buffer (chain8_sums)
  int paired = 0;   // form 12: form 11 with paired activations (ChainPaired); 2 (form 17, M = 1): fp16 halves
                    //    with a poison instead of words (chain_half_ready), each buffer two copies
  int chunk = 4;    // forms 14, 16, 17: tiles per ring chunk (stages, a warp's ring, is a multiple)
  int chunked = 0;  // form 14's consumers take the ring chunk by chunk (sh.chunk 2-4): 1 form 16 (the feed warp),
                    //    2 form 17 (every warp fills its own ring), 3 form 20 (form 18's lean loop, chunks of 2, the input copied at once)
  const int4* cursors = nullptr;  // forms 16 and 17: chain16_schedule's records (device memory)
  int classes = 0;                // forms 16 and 17: op classes in `cursors` (chain16_classes)
  // form 20 (lab): each op's input RMSNorm gain (device array of nops fp16 [K] pointers, nullptr
  // for none) and its epsilon; set, the kernel compiled with the norm runs
  const void* const* norms = nullptr;
  float norm_eps = 0.f;
  // lab (forms 11-19, the timed launch): per op and block, [nops][blocks][5]: the cycles on the op's
  // tiles, finishing it, preparing its input; %globaltimer when its outputs are written and when its
  // input was all read
  unsigned long long* stamps = nullptr;
  int rotate = 0;  // lab (QGEMV_CHAIN_STAMPS, forms 16-20): block b runs the schedule of block (b + rotate) % blocks
  // form 20 compiled with kDecode: the layers' attention (device array, Chain5Op::attn indexes it) and the
  // token's cache slot, which is also its rotary position (a device scalar, read at every launch)
  const ChainAttn* attn = nullptr;
  const int* pos = nullptr;
};

constexpr int kChainTileBytes = kPanelRows * kTileBytes;  // 1 KB: one tile of one panel

#ifndef QGEMV_CHAIN_STAMPS
#define QGEMV_CHAIN_STAMPS 0  // the lab defines it 1 (ChainShape::stamps)
#endif
constexpr bool kStamps = QGEMV_CHAIN_STAMPS != 0;

// Bytes of one tile's scales and zero points in `meta` (padded to 16).
__host__ __device__ constexpr int chain_meta_bytes(int group, bool zeros) {
  return group == 0 ? 0 : ((kPanelRows * (128 / group) * (2 + (zeros ? 1 : 0)) + 15) / 16) * 16;
}

// Block b's tiles of an op: [first, end) of its (panel, k-tile) stream.
__host__ __device__ inline void chain_range(long long tiles, int b, int blocks, long long& first, long long& end) {
  first = tiles * b / blocks;
  end = tiles * (b + 1) / blocks;
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Grouped int4's scales [N, K / group] (fp16) and zero points (uint8, or
// nullptr) in the kernel's tile order: for each 16-row panel, for each
// 128-k tile, 16 rows x (128 / group) scales, then as many zero points,
// padded to chain_meta_bytes.  Host arrays in, host array out.
inline std::vector<uint8_t> chain_meta(const uint16_t* scales, const uint8_t* zeros, int N, int K, int group) {
  const int gpt = 128 / group, ng = K / group, tiles = K / 128;
  const int mb = chain_meta_bytes(group, zeros != nullptr);
  std::vector<uint8_t> meta(static_cast<size_t>(N / kPanelRows) * tiles * mb, 0);
  for (int pn = 0; pn < N / kPanelRows; ++pn)
    for (int kt = 0; kt < tiles; ++kt) {
      uint8_t* m = meta.data() + (static_cast<size_t>(pn) * tiles + kt) * mb;
      for (int r = 0; r < kPanelRows; ++r)
        for (int gi = 0; gi < gpt; ++gi) {
          const size_t src = static_cast<size_t>(pn * kPanelRows + r) * ng + kt * gpt + gi;
          std::memcpy(m + 2 * (r * gpt + gi), scales + src, 2);
          if (zeros) m[2 * kPanelRows * gpt + r * gpt + gi] = zeros[src];
        }
    }
  return meta;
}

// Form 5: every consumer warp its own producer, outputs finished where they
// are summed.
//   * Each op's tile stream is cut into G x W equal contiguous runs, one per
//     consumer warp of the grid (warp w of block b owns run b W + w), so a
//     warp crosses one or two panels of an op, not every panel of its
//     block's range.
//   * Lane 0 of each consumer warp bulk-copies the warp's own runs of all ops,
//     `stage_tiles` tiles a stage, into the warp's own ring of `stages`
//     stages, refilling a stage as soon as the warp has read it: no stage is
//     shared between warps, so no warp waits for another to release one.
//   * A warp adds its partial sums of a panel into the op's fp32 output with
//     atomics, then counts the panel's tiles it summed in the panel's counter;
//     the warp that completes the count finishes the panel: it reads the
//     sums, rounds them to the activation type, applies the op's output step
//     (residual add, or SiLU(gate) * up once both halves' panels are
//     complete), writes the op's output (a [M, N] activation buffer in global
//     memory, the next op's input), and zeroes the sums and the counter.
//   * One more warp per block (the sync warp) counts the block in op i's
//     counter once every consumer warp of the block has finished op i, waits
//     until every block has, bulk-copies op i+1's input into shared memory
//     and lets the consumers in.  While the sync warp waits, the consumers'
//     rings hold op i+1's weights.
enum class ChainOut : int {
  kStore = 0,     // y = round(sums)
  kResidual = 1,  // y = round(round(sums) + res)
  kSiluMul = 2,   // y[:, j] = round(silu(round(sums[:, j])) * round(sums[:, N/2 + j]))   (N/2 % 16 == 0)
};

// One op of a form-5 chain.  p: qweight, scales, zeros, M, N, K, Kp (= K),
// group_size; x / ldx the op's input (an earlier op's y, or an input ready at
// launch); y / ldy its output ([M, N], or [M, N / 2] for kSiluMul).
// N % 16 == 0, K % tile_k == 0, K % 8 == 0, ldx % 8 == 0.
struct Chain5Op {
  GemvParams p;
  const uint8_t* meta;   // grouped int4: chain_meta, else nullptr
  float* acc;            // [M, N] fp32, zero before the first launch; left zero
  unsigned* panel_cnt;   // [N / 16] (kSiluMul: [N / 32]) zero before the first launch; left zero
  const void* res;       // kResidual: [M, N], row stride N
  int out;               // ChainOut
  int flags = 0;         // form 12 (ChainPaired): which of x, res, y are plain activations
  int cls = 0;           // forms 16 and 17: the op's class in the schedule (chain16_classes)
  int attn = -1;         // form 20 with kDecode: the layer's ChainAttn for kChainRope / kChainAttnIn
};

// Form 12's activations carry their own readiness: each element of an op's
// output is a 32-bit word, the value (fp16) in the low half and the launch's
// epoch in the high half, written by the producing block without a fence or
// a count; a consumer polls the words it reads until their epoch is the
// launch's.  Inputs from outside the launch (the first op's x, residuals
// written before it) and the last op's output are plain.
enum ChainPaired : int {
  kChainPlainX = 1,    // x is plain (ready at launch)
  kChainPlainRes = 2,  // res is plain
  kChainPlainY = 4,    // y is plain (nothing in this launch reads it)
  kChainRope = 8,      // form 20, kDecode: the q/k/v op; its finishing rotates q and k and writes the cache
  kChainAttnIn = 16,   // form 20, kDecode: the op after attention; the blocks run the attention before its input
};

constexpr int kChain5MaxWarps = 16;
// Form 9 may run more consumer warps (chain7_kernel's 96 registers allow 20 and the control warp).
constexpr int kChain9MaxWarps = 20;
__host__ __device__ constexpr int chain7_max_warps(int form) { return form >= 9 ? kChain9MaxWarps : kChain5MaxWarps; }

// Named barrier 2: the consumer warps arrive (no wait) when they are past an
// op, the control warp waits for them and `threads` in all.
__device__ __forceinline__ void chain_ops_arrive(int threads) {
  asm volatile("bar.arrive 2, %0;" ::"r"(threads) : "memory");
}
__device__ __forceinline__ void chain_ops_wait(int threads) {
  asm volatile("bar.sync 2, %0;" ::"r"(threads) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_cta_smem(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(smem_u32(p)) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_cta_smem(unsigned* p, unsigned v) {
  asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(smem_u32(p)), "r"(v) : "memory");
}
__device__ __forceinline__ float ld_relaxed_gpu_f32(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One value of op o's output from its complete fp32 sums: round, then the
// op's output step (residual add, or SiLU(gate) * up); the sums it read are
// zeroed for the next launch.  o.acc row stride N; for kSiluMul, row < N / 2.
template <typename T>
__device__ __forceinline__ void chain_finish_value(const Chain5Op& o, int tok, int row) {
  const GemvParams& p = o.p;
  float* sp = o.acc + static_cast<size_t>(tok) * p.N + row;
  float v = to_float(from_float<T>(ld_relaxed_gpu_f32(sp)));
  if (o.out == static_cast<int>(ChainOut::kSiluMul)) {
    const int half = p.N / 2;
    const float u = to_float(from_float<T>(ld_relaxed_gpu_f32(sp + half)));
    v = v / (1.f + __expf(-v)) * u;
    sp[half] = 0.f;
  } else if (o.out == static_cast<int>(ChainOut::kResidual)) {
    v += to_float(static_cast<const T*>(o.res)[static_cast<size_t>(tok) * p.N + row]);
  }
  static_cast<T*>(p.y)[static_cast<size_t>(tok) * p.ldy + row] = from_float<T>(v);
  *sp = 0.f;
}

// Shared memory of a form-5 launch: per-warp full barriers and the input
// barrier, the flags (known, done[nops]), the rings, the input; each part
// starts on a 128-byte boundary.
__host__ __device__ inline size_t chain5_head_bytes(int warps, int stages, int nops) {
  return ((static_cast<size_t>(warps) * stages + 1) * 8 + (nops + 1) * 4 + 127) / 128 * 128;
}
__host__ __device__ inline size_t chain5_ring_bytes(const ChainShape& sh, int warps) {
  const size_t ring = static_cast<size_t>(warps) * sh.stages * sh.stage_tiles * (kChainTileBytes + sh.meta_bytes);
  return (ring + 127) / 128 * 128;
}
template <typename T>
__host__ __device__ inline size_t chain5_smem_bytes(const ChainShape& sh, int warps, int nops) {
  return chain5_head_bytes(warps, sh.stages, nops) + chain5_ring_bytes(sh, warps) +
         static_cast<size_t>(sh.M) * sh.x_cap * sizeof(T);
}

// One tile's words (rows g and g + 8) and, for grouped int4, its scales and
// zero points, from shared memory: tile, and mt its meta (chain_meta order).
template <typename Lane, typename T, bool kZeros>
__device__ __forceinline__ void chain_load_tile(const unsigned char* tile, const unsigned char* mt, int g, int t,
                                                uint4 (&w0)[1], uint4 (&w1)[1], TileMeta (&m)[1]) {
  constexpr int kGpt = Lane::kGroupsPerTile;
  w0[0] = *reinterpret_cast<const uint4*>(tile + g * kTileBytes + 16 * t);
  w1[0] = *reinterpret_cast<const uint4*>(tile + (g + 8) * kTileBytes + 16 * t);
  if constexpr (Lane::kGrouped) {
    const __half* ms = reinterpret_cast<const __half*>(mt);
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
      const int gi = q4 / Lane::kSubPerGroup;
      m[0].s0[q4] = __half2float(ms[g * kGpt + gi]);
      m[0].s1[q4] = __half2float(ms[(g + 8) * kGpt + gi]);
      if constexpr (kZeros) {
        const unsigned char* mz = mt + kPanelRows * kGpt * 2;
        m[0].z0[q4] = magic_zero_pair<T>(mz[g * kGpt + gi]);
        m[0].z1[q4] = magic_zero_pair<T>(mz[(g + 8) * kGpt + gi]);
      }
    }
  }
}

// ops[nops], op i reading op i-1's output (op 0: an input ready at launch);
// sync[nops] (form 6: [2 nops]) zero before the first launch, left zero.  wait_cycles: nullptr,
// or [3 x blocks]: the sync warp's cycles spinning on other blocks ([b]) and
// copying inputs ([blocks + b]), consumer warp 0's cycles waiting for weight
// stages ([2 blocks + b]).
template <typename T, int kBits, int kGroup, bool kZeros>
__global__ void __launch_bounds__((kChain5MaxWarps + 1) * 32, 1)
    chain5_kernel(const Chain5Op* __restrict__ ops, int nops, ChainShape sh, unsigned* sync,
                  unsigned long long* wait_cycles) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, 1, 1>;
  constexpr int kTileK = Lane::kTileK;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = (blockDim.x >> 5) - 1;  // consumer warps; warp W syncs
  const int G = gridDim.x;
  const int S = sh.stages, TS = sh.stage_tiles;
  const int stage_bytes = TS * (kChainTileBytes + sh.meta_bytes);

  extern __shared__ __align__(128) unsigned char chain_smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(chain_smem);  // [W][S]
  uint64_t* xbar = full + W * S;
  unsigned* known = reinterpret_cast<unsigned*>(xbar + 1);  // ops whose input is in xs: known > i lets op i in
  unsigned* done = known + 1;                               // [nops]: consumer warps finished with op i
  unsigned char* ring = chain_smem + chain5_head_bytes(W, S, nops);
  T* xs = reinterpret_cast<T*>(ring + chain5_ring_bytes(sh, W));

  if (threadIdx.x == 0) {
    for (int s = 0; s < W * S; ++s) mbar_init(full + s, 1);
    mbar_init(xbar, 1);
    *known = 0;
    for (int i = 0; i < nops; ++i) done[i] = 0;
    mbar_init_fence();
  }
  __syncthreads();

  auto tiles_of = [](const GemvParams& p) { return static_cast<long long>(p.N / kPanelRows) * (p.K / kTileK); };

  // Form 6: this block's slice of op o's output, from the complete fp32 sums
  // (the sync warp's 32 lanes; sums and counters left zero).
  auto finish_slice = [&](const Chain5Op& o, int ln) {
    const int n_out = o.out == static_cast<int>(ChainOut::kSiluMul) ? o.p.N / 2 : o.p.N;
    long long r0, r1;
    chain_range(n_out, blockIdx.x, G, r0, r1);
    const int rows = static_cast<int>(r1 - r0);
    for (int q = ln; q < rows * o.p.M; q += 32) chain_finish_value<T>(o, q / rows, static_cast<int>(r0) + q % rows);
    __syncwarp();
  };

  if (warp == W) {  // ---- the sync warp (lane 0; in form 6 every lane finishes slices)
    if (lane != 0 && !sh.slices) return;
    long long spin = 0, copy = 0;
    // Every block has counted itself in sync[c]: lane 0 spins, the warp follows.
    auto wait_all = [&](int c) {
      const long long c0 = wait_cycles ? clock64() : 0;
      if (lane == 0 && !(sh.skip & 1))
        while (ld_acquire_gpu(sync + c) < static_cast<unsigned>(G)) {
        }
      __syncwarp(sh.slices ? 0xffffffffu : 1u);
      if (wait_cycles) spin += clock64() - c0;
    };
    // This block counted in sync[c] (after the warp's writes); the old count.
    auto arrive = [&](int c) {
      __threadfence();
      __syncwarp(sh.slices ? 0xffffffffu : 1u);
      unsigned before = 0;
      if (lane == 0) before = atomicAdd(sync + c, 1u);
      return before;
    };
    for (int i = 0; i <= nops; ++i) {
      if (i > 0) {  // op i-1 done here, then everywhere
        if (lane == 0)
          while (*reinterpret_cast<volatile unsigned*>(done + i - 1) < static_cast<unsigned>(W)) {
          }
        const unsigned before = arrive(i - 1);
        if (!sh.slices) {
          if (i == nops) {
            // Nobody polls the last counter, and every block that counted itself
            // in it is past every other poll: the last one resets them all.
            if (before == static_cast<unsigned>(G - 1)) {
              __threadfence();
              for (int j = 0; j < nops; ++j) atomicExch(sync + j, 0u);
            }
            break;
          }
          wait_all(i - 1);
        } else {  // form 6: op i-1's sums complete everywhere, this block's slice of its output, then everyone's
          wait_all(i - 1);
          if (!(sh.skip & 32)) finish_slice(ops[i - 1], lane);
          const unsigned b2 = arrive(nops + i - 1);
          if (i == nops) {  // the last arriver resets every counter (every block is past every poll)
            if (lane == 0 && b2 == static_cast<unsigned>(G - 1)) {
              __threadfence();
              for (int j = 0; j < 2 * nops; ++j) atomicExch(sync + j, 0u);
            }
            break;
          }
          wait_all(nops + i - 1);
        }
      }
      // Op i's input -> xs (every consumer warp has finished op i-1, the last reader of xs).
      if (lane == 0) {
        const long long c1 = wait_cycles ? clock64() : 0;
        const GemvParams& p = ops[i].p;
        const uint32_t row_bytes = static_cast<uint32_t>(p.K) * sizeof(T);
        // Other blocks wrote the input with ordinary stores; the bulk copy reads
        // through the async proxy.
        asm volatile("fence.proxy.async.global;" ::: "memory");
        mbar_expect_tx(xbar, row_bytes * p.M);
        for (int m = 0; m < p.M; ++m)
          bulk_copy(xs + static_cast<size_t>(m) * sh.x_cap,
                    static_cast<const T*>(p.x) + static_cast<size_t>(m) * p.ldx, row_bytes, xbar);
        mbar_wait(xbar, i & 1);
        if (wait_cycles) copy += clock64() - c1;
        st_release_cta_smem(known, static_cast<unsigned>(i + 1));
      }
    }
    if (wait_cycles && lane == 0) {
      atomicAdd(wait_cycles + blockIdx.x, static_cast<unsigned long long>(spin));
      atomicAdd(wait_cycles + G + blockIdx.x, static_cast<unsigned long long>(copy));
    }
    return;
  }

  // ---- a consumer warp: its runs of every op, through its own ring
  const int g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * W + warp, GW = G * W;
  uint64_t* my_full = full + warp * S;
  unsigned char* my_ring = ring + static_cast<size_t>(warp) * S * stage_bytes;
  const uint64_t pol = evict_first_policy();

  // Lane 0's copy cursor: op, next tile, end of the warp's run of that op.
  int c_op = -1;
  long long c_pos = 0, c_end = 0;
  uint32_t issued = 0;
  auto issue_next = [&] {  // lane 0: the next stage of the warp's stream, if any
    while (c_pos >= c_end) {
      if (++c_op >= nops) return;
      chain_range(tiles_of(ops[c_op].p), gw, GW, c_pos, c_end);
    }
    const Chain5Op& co = ops[c_op];
    const int n = static_cast<int>(min(static_cast<long long>(TS), c_end - c_pos));
    const int slot = issued % S;
    unsigned char* dst = my_ring + static_cast<size_t>(slot) * stage_bytes;
    mbar_expect_tx(my_full + slot, static_cast<uint32_t>(n * (kChainTileBytes + sh.meta_bytes)));
    bulk_copy(dst, static_cast<const char*>(co.p.qweight) + c_pos * kChainTileBytes, n * kChainTileBytes,
              my_full + slot, pol);
    if (sh.meta_bytes)
      bulk_copy(dst + TS * kChainTileBytes, co.meta + c_pos * sh.meta_bytes, n * sh.meta_bytes, my_full + slot,
                pol);
    c_pos += n;
    ++issued;
  };
  if (lane == 0)
    for (int s = 0; s < S; ++s) issue_next();

  uint32_t consumed = 0;
  long long stall = 0;
  auto release = [&] {  // the stage being read is done: refill it with the warp's next
    __syncwarp();
    if (lane == 0) {
      fence_proxy_async_smem();
      issue_next();
    }
    ++consumed;
  };
  for (int i = 0; i < nops; ++i) {
    const Chain5Op& o = ops[i];
    const GemvParams& p = o.p;
    if (lane == 0)
      while (ld_acquire_cta_smem(known) <= static_cast<unsigned>(i)) {
      }
    __syncwarp();
    const int tpp = p.K / kTileK;
    const bool silu = o.out == static_cast<int>(ChainOut::kSiluMul);
    const int half_panels = p.N / kPanelRows / 2;
    long long a, e;
    chain_range(tiles_of(p), gw, GW, a, e);
    const unsigned char* stage = nullptr;  // the stage being read, its tiles, the next one's position
    int stage_n = 0, r = 0;
    for (long long c = a; c < e;) {  // one panel segment a pass
      const int panel = static_cast<int>(c / tpp);
      int kt = static_cast<int>(c % tpp);
      const int kt_end = static_cast<int>(min(static_cast<long long>(tpp), kt + (e - c)));
      const int seg_tiles = kt_end - kt;
      Lane L(p, lane, panel, xs, sh.x_cap);
      float sc0 = 1.f, sc1 = 1.f;  // per-channel scales of rows g and g + 8: loaded now, used at the flush
      if constexpr (!Lane::kGrouped) {
        sc0 = __half2float(static_cast<const __half*>(p.scales)[panel * kPanelRows + g]);
        sc1 = __half2float(static_cast<const __half*>(p.scales)[panel * kPanelRows + g + 8]);
      }
      for (int j = 0; kt < kt_end; ++kt, ++j, ++c, ++r) {
        if (r == stage_n) {  // the next stage of the run
          if (stage) release();
          const int slot = consumed % S;
          const long long f0 = wait_cycles && warp == 0 && lane == 0 ? clock64() : 0;
          mbar_wait(my_full + slot, (consumed / S) & 1);
          if (wait_cycles && warp == 0 && lane == 0) stall += clock64() - f0;
          stage = my_ring + static_cast<size_t>(slot) * stage_bytes;
          stage_n = static_cast<int>(min(static_cast<long long>(TS), e - c));
          r = 0;
        }
        const unsigned char* tile = stage + r * kChainTileBytes;
        uint4 w0[1], w1[1];
        TileMeta m[1];
        chain_load_tile<Lane, T, kZeros>(tile, stage + TS * kChainTileBytes + r * sh.meta_bytes, g, t, w0, w1, m);
        if (sh.skip & 4) {
          if (w0[0].x == 0x12345678u && w1[0].y == 0x9abcdef0u) L.acc[0][0][0][0] += 1.f;  // keeps the reads
        } else if (j & 1) {
          L.template tile<1, false>(kt, w0, w1, m);
        } else {
          L.template tile<0, false>(kt, w0, w1, m);
        }
      }
      // The segment's partial sums into acc, its tiles into the panel's count;
      // the warp that completes the panel (for SiLU * mul, the pair of gate
      // and up panels) finishes it.
      if (sh.skip & 32) continue;  // lab timing: no flush, no finish
#pragma unroll
      for (int i4 = 0; i4 < 4; ++i4) {
        const int row = panel * kPanelRows + g + (i4 >= 2 ? 8 : 0);
        const int tok = 2 * t + (i4 & 1);
        if (tok < p.M) {
          float v = L.acc[0][0][0][i4] + L.acc[1][0][0][i4];
          if constexpr (!Lane::kGrouped) v *= i4 >= 2 ? sc1 : sc0;
          atomicAdd(o.acc + static_cast<size_t>(tok) * p.N + row, v);
        }
      }
      if (sh.slices) continue;  // form 6: the sync warps finish the op once every sum is in
      __threadfence();
      __syncwarp();
      const int pidx = silu ? panel % half_panels : panel;
      const unsigned target = silu ? 2u * tpp : static_cast<unsigned>(tpp);
      unsigned before = 0;
      if (lane == 0) before = atomicAdd(o.panel_cnt + pidx, static_cast<unsigned>(seg_tiles));
      before = __shfl_sync(0xffffffffu, before, 0);
      if (before + seg_tiles == target) {
        __threadfence();  // every other warp's sums of the panel, seen
        const int r0 = pidx * kPanelRows;
        for (int q = lane; q < kPanelRows * p.M; q += 32)
          chain_finish_value<T>(o, q / kPanelRows, r0 + q % kPanelRows);
        if (lane == 0) o.panel_cnt[pidx] = 0;
      }
    }
    if (stage) release();  // the op's last stage
    // Op i is finished by this warp: its sums and outputs are out.
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(done + i, 1u);
  }
  if (wait_cycles && warp == 0 && lane == 0)
    atomicAdd(wait_cycles + 2 * G + blockIdx.x, static_cast<unsigned long long>(stall));
}

template <typename T, int kBits, int kGroup, bool kZeros>
bool chain5_fits(const ChainShape& sh, int warps, int nops) {
  auto kernel = chain5_kernel<T, kBits, kGroup, kZeros>;
  const size_t smem = chain5_smem_bytes<T>(sh, warps, nops);
  if (warps < 1 || warps > kChain5MaxWarps) return false;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, (warps + 1) * kWarpSize, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n >= 1;
}

template <typename T, int kBits, int kGroup, bool kZeros>
Status chain5_launch(const Chain5Op* d_ops, int nops, const ChainShape& sh, unsigned* d_sync, int blocks, int warps,
                     cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > kChain5MaxWarps || blocks < 1 || nops < 1) return Status::kBadShape;
  chain5_kernel<T, kBits, kGroup, kZeros><<<blocks, (warps + 1) * kWarpSize, chain5_smem_bytes<T>(sh, warps, nops),
                                            stream>>>(d_ops, nops, sh, d_sync, wait_cycles);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// Forms 7 and 8: form 5's per-warp rings, with consumer warps that never
// make a round trip to global memory.
//   * A consumer warp reads a whole ring stage into registers and hands the
//     stage back to the copy engine at once (lane 0 refills it before the
//     warp's math on it), so the refill overlaps the math.
//   * One control warp per block does every global hand-off: once the block's
//     consumers are past op i it counts the block in sync[i], waits for every
//     block and bulk-copies op i+1's input into shared memory; consumers wait
//     on that copy's mbarrier.
//   * Form 7 (kOwn false): the warps' runs are form 5's (G x W equal runs of
//     each op's stream).  At the end of a panel segment a consumer writes its
//     partial sums (16 rows x M, fp32) and a header into the next slot of its
//     own queue in shared memory (kChain7Queue slots, full and empty
//     mbarriers).  The control warp takes the ready entries, one per warp a
//     pass: their sums go out by red.add, one fence a pass, their tile counts
//     into the panels' counters (a lane per entry), and it finishes the panels
//     they complete.
//   * Form 8 (kOwn true): a block owns whole output panels of every op (for
//     SiLU * mul, each gate panel with its up panel), so no sum leaves the
//     block before it is complete.  The block's tile stream is cut into W
//     equal runs; a consumer adds each segment's sums into the block's sum
//     buffer in shared memory (a shared-memory float atomic: a CAS loop on
//     sm_90) and, at the op's end, arrives on named barrier 2; the control
//     warp waits there, finishes the block's panels from that buffer and
//     writes the op's output.  No global atomics on sums, no panel counters,
//     one fence per op and block.
//   * Form 9 (kForm 9): form 8's schedule and control warp; the consumers'
//     weights come through per-lane cp.async rings, and int4 with fp16
//     activations uses the nibbles as fp16 subnormals (below).
constexpr int kChain7Queue = 4;

// Forms 9 and 11, int4 with fp16 activations: 8 activations (k 8c .. 8c + 7)
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

// Shared memory of a form-7/8 launch: the rings' barriers, the queues' full
// and empty barriers, the input barrier (and one unused); the rings; the queues
// (form 7) or the sum buffer (form 8); the input.
__host__ __device__ inline size_t chain7_head_bytes(int warps, int stages) {
  return ((static_cast<size_t>(warps) * (stages + 2 * kChain7Queue) + 2) * 8 + 127) / 128 * 128;
}
// One queue entry: {op, panel, tiles, last} then sums[tok][16] (fp32).
__host__ __device__ inline int chain7_entry_bytes(int M) { return 16 + 64 * M; }
__host__ __device__ inline size_t chain7_mid_bytes(const ChainShape& sh, int warps, bool own) {
  const size_t b = own ? static_cast<size_t>(sh.sums) * 4
                       : static_cast<size_t>(warps) * kChain7Queue * chain7_entry_bytes(sh.M);
  return (b + 127) / 128 * 128;
}
// Form 9 adds the input's group sums (M x x_cap / 32 fp32) after the input.
template <typename T>
__host__ __device__ inline size_t chain7_smem_bytes(const ChainShape& sh, int warps, bool own, bool xsums = false) {
  return chain7_head_bytes(warps, sh.stages) + chain5_ring_bytes(sh, warps) + chain7_mid_bytes(sh, warps, own) +
         static_cast<size_t>(sh.M) * sh.x_cap * sizeof(T) + (xsums ? static_cast<size_t>(sh.M) * (sh.x_cap / 32) * 4 : 0);
}

// Form 8: output panels per unit (a SiLU * mul unit is a gate panel and its
// up panel) and units of op o.
__host__ __device__ inline int chain8_ppu(const Chain5Op& o) {
  return o.out == static_cast<int>(ChainOut::kSiluMul) ? 2 : 1;
}
__host__ __device__ inline long long chain8_units(const Chain5Op& o) { return o.p.N / kPanelRows / chain8_ppu(o); }
// Form 8's sum buffer (ChainShape::sums): the most panels a block owns in any
// op, x 16 rows x M.  Host arrays in.
inline int chain8_sums(const Chain5Op* ops, int nops, int blocks, int M) {
  long long most = 0;
  for (int i = 0; i < nops; ++i) {
    const long long u = chain8_units(ops[i]);
    most = std::max(most, (u + blocks - 1) / blocks * chain8_ppu(ops[i]));
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

// ops[nops] as for form 5 (form 8 uses no acc or panel_cnt); sync[nops] zero
// before the first launch, left zero; sh.stage_tiles == kTS; form 8:
// sh.sums >= chain8_sums.  wait_cycles: nullptr, or [5 x blocks]: the control
// warp's cycles spinning on other blocks ([b]) and flushing or finishing
// ([blocks + b]); consumer warp 0's cycles waiting for weight stages
// ([2 blocks + b]), for inputs ([3 blocks + b]) and (form 7) for a free queue
// slot ([4 blocks + b]).
// 96 registers a thread: 21 warps of them fill the register file (the
// launch bound of 21 warps would give the compiler only 80).
template <typename T, int kBits, int kGroup, bool kZeros, int kTS, int kForm>
__global__ void __maxnreg__(96)
    chain7_kernel(const Chain5Op* __restrict__ ops, int nops, ChainShape sh, unsigned* sync,
                  unsigned long long* wait_cycles) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, 1, 1>;
  static_assert(kForm >= 7 && kForm <= 9, "forms 7 to 9");
  constexpr bool kOwn = kForm >= 8;
  constexpr int kTileK = Lane::kTileK;
  constexpr int kGpt = Lane::kGroupsPerTile;
  constexpr int Q = kChain7Queue;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = (blockDim.x >> 5) - 1;  // consumer warps; warp W is the control warp
  const int G = gridDim.x;
  const int S = sh.stages;
  const int stage_bytes = kTS * (kChainTileBytes + sh.meta_bytes);
  const int entry_bytes = chain7_entry_bytes(sh.M);

  extern __shared__ __align__(128) unsigned char chain_smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(chain_smem);  // [W][S]
  uint64_t* qfull = full + W * S;                             // [W][Q]
  uint64_t* qempty = qfull + W * Q;                           // [W][Q]
  uint64_t* xbar = qempty + W * Q;                            // op i's input is in xs: phase i
  unsigned char* ring = chain_smem + chain7_head_bytes(W, S);
  unsigned char* mid = ring + chain5_ring_bytes(sh, W);  // form 7: the queues; form 8: the sum buffer
  float* sums = reinterpret_cast<float*>(mid);
  T* xs = reinterpret_cast<T*>(mid + chain7_mid_bytes(sh, W, kOwn));

  if (threadIdx.x == 0) {
    for (int s = 0; s < W * (S + 2 * Q) + 1; ++s) mbar_init(full + s, 1);
    mbar_init_fence();
  }
  if constexpr (kOwn)
    for (int q = threadIdx.x; q < sh.sums; q += blockDim.x) sums[q] = 0.f;
  __syncthreads();

  auto tiles_of = [](const GemvParams& p) { return static_cast<long long>(p.N / kPanelRows) * (p.K / kTileK); };
  // Form 8: this block's units of op o, [u0, u1), and the block's tiles.
  auto own_range = [&](const Chain5Op& o, long long& u0, long long& u1) {
    chain_range(chain8_units(o), blockIdx.x, G, u0, u1);
    return (u1 - u0) * chain8_ppu(o) * (o.p.K / kTileK);
  };

  if (warp == W) {  // ---- the control warp
    long long spin = 0, busy = 0;
    auto copy_input = [&](int i) {  // op i's input -> xs, completing phase i of xbar
      if (lane != 0) return;
      const GemvParams& p = ops[i].p;
      const uint32_t row_bytes = static_cast<uint32_t>(p.K) * sizeof(T);
      asm volatile("fence.proxy.async.global;" ::: "memory");  // other blocks wrote it with ordinary stores
      mbar_expect_tx(xbar, row_bytes * p.M);
      for (int m = 0; m < p.M; ++m)
        bulk_copy(xs + static_cast<size_t>(m) * sh.x_cap, static_cast<const T*>(p.x) + static_cast<size_t>(m) * p.ldx,
                  row_bytes, xbar);
    };
    copy_input(0);
    uint32_t head = 0;  // form 7, lane w < W: the entries of consumer warp w taken so far
    const bool flush = !(sh.skip & 32);
    for (int i = 0; i < nops; ++i) {
      const Chain5Op& o = ops[i];
      const GemvParams& p = o.p;
      const bool silu = o.out == static_cast<int>(ChainOut::kSiluMul);
      const int vals = kPanelRows * p.M;
      if constexpr (kOwn) {
        // Every consumer is past op i: finish the block's panels from the sums.
        chain_ops_wait((W + 1) * 32);
        const long long b0 = wait_cycles ? clock64() : 0;
        long long u0, u1;
        own_range(o, u0, u1);
        const int ppu = chain8_ppu(o);
        const int count = static_cast<int>(u1 - u0) * vals;
        for (int q = lane; flush && q < count; q += 32) {
          const int u = q / vals, tok = (q % vals) / kPanelRows, r = q % kPanelRows;
          float* sp = sums + (static_cast<size_t>(u * ppu) * p.M + tok) * kPanelRows + r;
          float v = to_float(from_float<T>(*sp));
          if (silu) {
            float* up = sp + p.M * kPanelRows;
            v = v / (1.f + __expf(-v)) * to_float(from_float<T>(*up));
            *up = 0.f;
          }
          const int row = static_cast<int>(u0 + u) * kPanelRows + r;
          if (o.out == static_cast<int>(ChainOut::kResidual))
            v += to_float(static_cast<const T*>(o.res)[static_cast<size_t>(tok) * p.N + row]);
          static_cast<T*>(p.y)[static_cast<size_t>(tok) * p.ldy + row] = from_float<T>(v);
          *sp = 0.f;
        }
        if (wait_cycles) busy += clock64() - b0;
      } else {
        const int tpp = p.K / kTileK;
        const int half_panels = p.N / kPanelRows / 2;
        const unsigned target = silu ? 2u * tpp : static_cast<unsigned>(tpp);
        int lasts = 0;
        while (lasts < W) {  // one pass: every consumer warp's next entry, if it is ready
          bool ready = false;
          int panel = 0, tiles = 0, last = 0;
          if (lane < W) {
            const int q = static_cast<int>(head % Q);
            ready = mbar_test(qfull + lane * Q + q, (head / Q) & 1);
            if (ready) {
              const int* h = reinterpret_cast<const int*>(mid + static_cast<size_t>(lane * Q + q) * entry_bytes);
              panel = h[1], tiles = h[2], last = h[3];
            }
          }
          const unsigned mask = __ballot_sync(0xffffffffu, ready);
          if (!mask) continue;
          const long long b0 = wait_cycles ? clock64() : 0;
          bool complete = false;
          if (flush) {
            for (unsigned mk = mask; mk; mk &= mk - 1) {  // the sums out, a warp-wide pass per entry
              const int w = __ffs(mk) - 1;
              const int pn = __shfl_sync(0xffffffffu, panel, w);
              const int hw = static_cast<int>(__shfl_sync(0xffffffffu, head, w) % Q);
              const float* v = reinterpret_cast<const float*>(mid + static_cast<size_t>(w * Q + hw) * entry_bytes + 16);
              if (__shfl_sync(0xffffffffu, tiles, w) == 0) continue;
              for (int q = lane; q < vals; q += 32)
                atomicAdd(o.acc + static_cast<size_t>(q / kPanelRows) * p.N + pn * kPanelRows + q % kPanelRows, v[q]);
            }
            __threadfence();
            if (ready && tiles > 0) {
              const int pidx = silu ? panel % half_panels : panel;
              complete = atomicAdd(o.panel_cnt + pidx, static_cast<unsigned>(tiles)) + tiles == target;
            }
          }
          __syncwarp();
          if (ready) {  // the slot is read: back to its warp
            mbar_arrive(qempty + lane * Q + head % Q);
            ++head;
          }
          lasts += __popc(__ballot_sync(0xffffffffu, ready && last));
          unsigned cm = __ballot_sync(0xffffffffu, complete);
          if (cm) {
            __threadfence();  // every other block's sums of these panels, seen
            for (; cm; cm &= cm - 1) {
              const int w = __ffs(cm) - 1;
              const int pn = __shfl_sync(0xffffffffu, panel, w);
              const int pidx = silu ? pn % half_panels : pn;
              for (int q = lane; q < vals; q += 32)
                chain_finish_value<T>(o, q / kPanelRows, pidx * kPanelRows + q % kPanelRows);
              if (lane == 0) o.panel_cnt[pidx] = 0;
            }
          }
          if (wait_cycles) busy += clock64() - b0;
        }
      }
      // Every consumer warp is past op i (xs is free); this block's sums and
      // finished panels are out.
      __threadfence();
      __syncwarp();
      unsigned before = 0;
      if (lane == 0) before = atomicAdd(sync + i, 1u);
      if (i + 1 == nops) {
        // Nobody polls the last counter, and every block that counted itself in
        // it is past every other poll: the last one resets them all.
        if (lane == 0 && before == static_cast<unsigned>(G - 1)) {
          __threadfence();
          for (int j = 0; j < nops; ++j) atomicExch(sync + j, 0u);
        }
        break;
      }
      const long long c0 = wait_cycles ? clock64() : 0;
      if (lane == 0 && !(sh.skip & 1))
        while (ld_acquire_gpu(sync + i) < static_cast<unsigned>(G)) {
        }
      __syncwarp();
      if (wait_cycles) spin += clock64() - c0;
      copy_input(i + 1);
    }
    if (wait_cycles && lane == 0) {
      atomicAdd(wait_cycles + blockIdx.x, static_cast<unsigned long long>(spin));
      atomicAdd(wait_cycles + G + blockIdx.x, static_cast<unsigned long long>(busy));
    }
    return;
  }

  // ---- a consumer warp: its runs of every op, through its own ring
  const int g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * W + warp, GW = G * W;
  uint64_t* my_full = full + warp * S;
  unsigned char* my_ring = ring + static_cast<size_t>(warp) * S * stage_bytes;
  const uint64_t pol = evict_first_policy();
  const bool timed = wait_cycles && warp == 0 && lane == 0;
  long long w_stage = 0, w_input = 0, w_queue = 0;

  // A walk along the warp's run of one op, without divisions past its start:
  // pos / end in the op's stream (form 7) or the block's (form 8); kt the
  // k-tile in the current panel; vp the block's panel index (form 8: unit
  // vp >> sh, gate or up half vp & 1); panel the op's panel.
  struct Cursor {
    int pos, end, kt, vp, panel, tpp, u0, shift, half;
  };
  auto panel_of = [](const Cursor& c) { return c.u0 + (c.vp >> c.shift) + (c.vp & c.shift) * c.half; };
  auto start = [&](const Chain5Op& o, Cursor& c) {
    long long a, e;
    c.tpp = o.p.K / kTileK;
    if constexpr (kOwn) {
      long long u0, u1;
      chain_range(own_range(o, u0, u1), warp, W, a, e);
      c.u0 = static_cast<int>(u0);
      c.shift = chain8_ppu(o) - 1;
      c.half = o.p.N / kPanelRows / 2;
    } else {
      chain_range(tiles_of(o.p), gw, GW, a, e);
      c.u0 = 0, c.shift = 0, c.half = 0;
    }
    c.pos = static_cast<int>(a), c.end = static_cast<int>(e);
    c.kt = c.pos % c.tpp, c.vp = c.pos / c.tpp;
    c.panel = panel_of(c);
  };
  // Tiles in the stage at the cursor (form 8's stages end at panel ends).
  auto stage_len = [&](const Cursor& c) {
    const int n = min(kTS, c.end - c.pos);
    return kOwn ? min(n, c.tpp - c.kt) : n;
  };
  auto advance = [&](Cursor& c, int n) {  // n <= kTS < tpp: at most one panel end
    c.pos += n, c.kt += n;
    if (c.kt >= c.tpp) {
      c.kt -= c.tpp, ++c.vp;
      c.panel = panel_of(c);
    }
  };

  int c_op = -1;  // lane 0's copy cursor
  Cursor cc{0, 0, 0, 0, 0, 1, 0, 0, 0};
  uint32_t issued = 0;
  auto issue_next = [&] {
    while (cc.pos >= cc.end) {
      if (++c_op >= nops) return;
      start(ops[c_op], cc);
    }
    const Chain5Op& co = ops[c_op];
    const int n = stage_len(cc);
    // the stage's first tile in the op's stream
    const long long src = kOwn ? static_cast<long long>(cc.panel) * cc.tpp + cc.kt : cc.pos;
    const int slot = issued % S;
    unsigned char* dst = my_ring + static_cast<size_t>(slot) * stage_bytes;
    mbar_expect_tx(my_full + slot, static_cast<uint32_t>(n * (kChainTileBytes + sh.meta_bytes)));
    bulk_copy(dst, static_cast<const char*>(co.p.qweight) + src * kChainTileBytes, n * kChainTileBytes,
              my_full + slot, pol);
    if (sh.meta_bytes)
      bulk_copy(dst + kTS * kChainTileBytes, co.meta + src * sh.meta_bytes, n * sh.meta_bytes, my_full + slot, pol);
    advance(cc, n);
    ++issued;
  };
  if (kForm != 9 && lane == 0)
    for (int s = 0; s < S; ++s) issue_next();

  uint32_t consumed = 0, pushed = 0;
  // A segment's sums (per-channel formats: times the rows' scales), this
  // lane's four of them: v[i4] for token 2t + (i4 & 1), row g (+ 8 for i4 >= 2).
  auto seg_sums = [&](const Lane& L, float sc0, float sc1, float (&v)[4]) {
#pragma unroll
    for (int i4 = 0; i4 < 4; ++i4) {
      v[i4] = L.acc[0][0][0][i4] + L.acc[1][0][0][i4];
      if constexpr (!Lane::kGrouped) v[i4] *= i4 >= 2 ? sc1 : sc0;
    }
  };
  // Form 7: a segment's sums into the warp's next queue slot, then the slot to
  // the control warp.
  auto push = [&](int i, int panel, int tiles, bool last, const Lane& L, float sc0, float sc1, int M) {
    const int q = static_cast<int>(pushed % Q);
    const long long q0 = timed ? clock64() : 0;
    mbar_wait(qempty + warp * Q + q, ((pushed / Q) & 1) ^ 1);
    if (timed) w_queue += clock64() - q0;
    unsigned char* e = mid + static_cast<size_t>(warp * Q + q) * entry_bytes;
    float* v = reinterpret_cast<float*>(e + 16);
    float s4[4];
    seg_sums(L, sc0, sc1, s4);
#pragma unroll
    for (int i4 = 0; i4 < 4; ++i4) {
      const int tok = 2 * t + (i4 & 1);
      if (tiles > 0 && tok < M) v[tok * kPanelRows + g + (i4 >= 2 ? 8 : 0)] = s4[i4];
    }
    if (lane == 0) {
      int* h = reinterpret_cast<int*>(e);
      h[0] = i, h[1] = panel, h[2] = tiles, h[3] = last;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(qfull + warp * Q + q);
    ++pushed;
  };

  // One tile's words (rows g and g + 8) and, for grouped formats, its scales
  // and zero points, from a ring slot: tile, and mt its meta (chain_meta order).
  auto load_tile = [&](const unsigned char* tile, const unsigned char* mt, uint4 (&w0)[1], uint4 (&w1)[1],
                       TileMeta (&m)[1]) { chain_load_tile<Lane, T, kZeros>(tile, mt, g, t, w0, w1, m); };
  // One tile's math into bank `bank` (two independent MMA chains).
  auto tile_math = [&](Lane& L, int kt, int bank, const uint4 (&w0)[1], const uint4 (&w1)[1],
                       const TileMeta (&m)[1]) {
    if (sh.skip & 4) {
      if (w0[0].x == 0x12345678u && w1[0].y == 0x9abcdef0u) L.acc[0][0][0][0] += 1.f;  // keeps the reads
    } else if (bank) {
      L.template tile<1, false>(kt, w0, w1, m);
    } else {
      L.template tile<0, false>(kt, w0, w1, m);
    }
  };
  // Form 8/9: a segment's sums into the block's sum buffer (block panel vp), the banks zeroed.
  auto seg_to_block = [&](Lane& L, int vp, float sc0, float sc1, int M) {
    if (!(sh.skip & 32)) {
      float s4[4];
      seg_sums(L, sc0, sc1, s4);
      float* sp = sums + static_cast<size_t>(vp) * M * kPanelRows;
#pragma unroll
      for (int i4 = 0; i4 < 4; ++i4) {
        const int tok = 2 * t + (i4 & 1);
        if (tok < M) atomicAdd(sp + tok * kPanelRows + g + (i4 >= 2 ? 8 : 0), s4[i4]);
      }
    }
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i4 = 0; i4 < 4; ++i4) L.acc[b][0][0][i4] = 0.f;
  };

  if constexpr (kForm >= 9) {
    // Form 9: the per-op kernel's pipeline.  Every lane copies its own 2 x 16
    // bytes of each tile (and lanes 0.. of the tile's meta) into a ring of kTS
    // one-tile slots with cp.async, one commit group a tile, kTS - 1 tiles in
    // flight; the issue cursor runs on across ops, never waiting for an input.
    // A run's source pointers step one tile at a time; the cursor is consulted
    // once per panel segment.
    const int slot_bytes = kChainTileBytes + sh.meta_bytes;
    const int lane_off = g * kTileBytes + 16 * t;
    const int meta_lanes = sh.meta_bytes / 16;
    unsigned char* const ring_end = my_ring + kTS * slot_bytes;
    int i_op = -1, left = 0;  // the issue side: op, tiles left in its current segment
    Cursor ic{0, 0, 0, 0, 0, 1, 0, 0, 0};
    const char* wsrc = nullptr;
    const uint8_t* msrc = nullptr;
    unsigned char* idst = my_ring;
    auto aim = [&] {  // the issue side's next segment (past the last op: left = 0)
      while (i_op < nops && ic.pos >= ic.end)
        if (++i_op < nops) start(ops[i_op], ic);
      if (i_op >= nops) return;
      const Chain5Op& co = ops[i_op];
      const long long tile = static_cast<long long>(ic.panel) * ic.tpp + ic.kt;
      left = min(ic.tpp - ic.kt, ic.end - ic.pos);
      wsrc = static_cast<const char*>(co.p.qweight) + tile * kChainTileBytes + lane_off;
      if (lane < meta_lanes) msrc = co.meta + tile * sh.meta_bytes + 16 * lane;
      advance(ic, left);
    };
    auto issue_tile = [&] {  // every lane: the warp's next tile, or an empty group
      if (left > 0) {
        cp_async_16(idst + lane_off, wsrc, pol);
        cp_async_16(idst + lane_off + 8 * kTileBytes, wsrc + 8 * kTileBytes, pol);
        if (lane < meta_lanes) {
          cp_async_16(idst + kChainTileBytes + 16 * lane, msrc, pol);
          msrc += sh.meta_bytes;
        }
        wsrc += kChainTileBytes;
        if (--left == 0) aim();
      }
      idst += slot_bytes;
      if (idst == ring_end) idst = my_ring;
      cp_async_commit();
    };
    aim();
    for (int s = 0; s < kTS - 1; ++s) issue_tile();
    const unsigned char* rslot = my_ring;  // the slot the next tile is read from

    // int4 with fp16 activations: the nibbles are used as they lie.  A nibble
    // q masked in place is the fp16 subnormal q 2^-24 (low nibble of a byte)
    // or 16 q 2^-24 (high nibble), exact, so dequantisation is one AND per
    // pair of weights, with no subtraction; the activations the high nibbles
    // meet (k & 2 within each 8) are divided by 16 once per op, and the zero
    // point comes out of the MMA's sum through the group's sum of x:
    // sum (q - z) x = 2^24 MMA - z sum x.  xsum holds 2^-24 sum x per group
    // (kXk k: the group, or 128 for per-channel scales), so the fp32 sums
    // stay 2^-24 of the true ones until the segment's flush.
    constexpr bool kNib = kBits == 4 && std::is_same_v<T, __half>;
    constexpr int kXk = kGroup ? kGroup : 128;
    const int xs_groups = sh.x_cap / 32;
    float* xsum = reinterpret_cast<float*>(xs + static_cast<size_t>(sh.M) * sh.x_cap);  // [M][x_cap / 32]
    // Op o's input in xs, in place: the high nibbles' activations / 16, and xsum (every consumer warp, then a
    // named barrier among them).
    auto prep_input = [&](const GemvParams& p) {
      // Every consumer warp is past the last op's reads of xs and xsum (they
      // are ordered already, through the control warp's barrier and the input
      // copy's mbarrier; this barrier says so where racecheck can see it).
      asm volatile("bar.sync 1, %0;" ::"r"(W * 32) : "memory");
      constexpr int kLanes = kXk / 8;  // 16-byte chunks per xsum entry
      const int chunks = p.K / 8;
      for (int m = 0; m < p.M; ++m)
        for (int c0 = warp * 32; c0 < chunks; c0 += W * 32) {  // warp-uniform: the shuffles below
          const int c = c0 + lane;
          float sum = 0.f;
          if (c < chunks) {
            uint4* px = reinterpret_cast<uint4*>(xs + static_cast<size_t>(m) * sh.x_cap) + c;
            uint4 v = *px;
            sum = chain_nibble_input(v);
            *px = v;
          }
#pragma unroll
          for (int o = kLanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
          if (c < chunks && lane % kLanes == 0) xsum[m * xs_groups + c / kLanes] = sum * 0x1p-24f;
        }
      asm volatile("bar.sync 1, %0;" ::"r"(W * 32) : "memory");
    };

    for (int i = 0; i < nops; ++i) {
      const Chain5Op& o = ops[i];
      const GemvParams& p = o.p;
      Cursor cur;  // before the wait: the op's fields come from global memory
      start(o, cur);
      Lane L(p, lane, 0, xs, sh.x_cap);  // the other formats' math
      const int tok0 = min(2 * t, p.M - 1), tok1 = min(2 * t + 1, p.M - 1);
      {
        const long long i0 = timed ? clock64() : 0;
        mbar_wait(xbar, i & 1);  // op i's input is in xs
        if (timed) w_input += clock64() - i0;
      }
      if constexpr (kNib)
        if (!(sh.skip & 2)) prep_input(p);
      while (cur.pos < cur.end) {  // one panel segment a pass
        const int seg = min(cur.tpp - cur.kt, cur.end - cur.pos);
        float sc0 = 1.f, sc1 = 1.f;  // per-channel scales of rows g and g + 8, for the flush
        if constexpr (!Lane::kGrouped) {
          sc0 = __half2float(static_cast<const __half*>(p.scales)[cur.panel * kPanelRows + g]);
          sc1 = __half2float(static_cast<const __half*>(p.scales)[cur.panel * kPanelRows + g + 8]);
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const T* xk = L.xl[0] + cur.kt * kTileK;
        const float* X0 = xsum + tok0 * xs_groups + cur.kt * (kTileK / kXk);
        const float* X1 = xsum + tok1 * xs_groups + cur.kt * (kTileK / kXk);
        for (int s = 0; s < seg; ++s) {
          {
            const long long f0 = timed ? clock64() : 0;
            cp_async_wait<kTS - 2>();  // this tile's group has landed (this lane's copies)
            __syncwarp();              // ... and every lane's: the meta is shared, the oldest slot free
            if (timed) w_stage += clock64() - f0;
          }
          issue_tile();  // into the slot the warp finished with last tile
          const uint4 w0 = *reinterpret_cast<const uint4*>(rslot + lane_off);
          const uint4 w1 = *reinterpret_cast<const uint4*>(rslot + lane_off + 8 * kTileBytes);
          const unsigned char* mt = rslot + kChainTileBytes;
          if constexpr (kNib) {
            if (sh.skip & 4) {
              if (w0.x == 0x12345678u && w1.y == 0x9abcdef0u) acc[0] += 1.f;  // keeps the reads
            } else {
              float part[4] = {};
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                chain_nibble_mma(word_of(w0, j), word_of(w1, j), *reinterpret_cast<const uint4*>(xk + 32 * j), part,
                                 part);
                if ((j + 1) % (kXk / 32) == 0) {  // an xsum entry's end: fold with its scale and zero point
                  const int q = j / (kXk / 32);
                  float s0 = 1.f, s1 = 1.f, z0 = 8.f, z1 = 8.f;
                  if constexpr (Lane::kGrouped) {
                    const __half* ms = reinterpret_cast<const __half*>(mt);
                    s0 = __half2float(ms[g * kGpt + q]);
                    s1 = __half2float(ms[(g + 8) * kGpt + q]);
                    if constexpr (kZeros) {
                      z0 = static_cast<float>(mt[kPanelRows * kGpt * 2 + g * kGpt + q]);
                      z1 = static_cast<float>(mt[kPanelRows * kGpt * 2 + (g + 8) * kGpt + q]);
                    }
                  }
                  const float xa = X0[q], xb = X1[q], sz0 = -s0 * z0, sz1 = -s1 * z1;
                  float v[4];
#pragma unroll
                  for (int e = 0; e < 4; ++e) {
                    v[e] = part[e];
                    part[e] = 0.f;
                  }
                  acc[0] = fmaf(sz0, xa, fmaf(v[0], s0, acc[0]));
                  acc[1] = fmaf(sz0, xb, fmaf(v[1], s0, acc[1]));
                  acc[2] = fmaf(sz1, xa, fmaf(v[2], s1, acc[2]));
                  acc[3] = fmaf(sz1, xb, fmaf(v[3], s1, acc[3]));
                }
              }
            }
          } else {
            uint4 w0a[1] = {w0}, w1a[1] = {w1};
            TileMeta m[1];
            load_tile(rslot, mt, w0a, w1a, m);
            tile_math(L, cur.kt + s, s & 1, w0a, w1a, m);
          }
          rslot += slot_bytes;
          if (rslot == ring_end) rslot = my_ring;
          xk += kTileK;
          X0 += kTileK / kXk;
          X1 += kTileK / kXk;
        }
        if constexpr (kNib) {  // the sums are 2^-24 of the true ones
#pragma unroll
          for (int e = 0; e < 4; ++e) L.acc[0][0][0][e] = acc[e] * 0x1p24f, L.acc[1][0][0][e] = 0.f;
        }
        seg_to_block(L, cur.vp, sc0, sc1, p.M);
        advance(cur, seg);
      }
      chain_ops_arrive((W + 1) * 32);  // the warp's sums of op i are in the block's buffer
    }
    cp_async_wait<0>();
  } else {
    for (int i = 0; i < nops; ++i) {
      const Chain5Op& o = ops[i];
      const GemvParams& p = o.p;
      {
        const long long i0 = timed ? clock64() : 0;
        mbar_wait(xbar, i & 1);  // op i's input is in xs
        if (timed) w_input += clock64() - i0;
      }
      Cursor cur;
      start(o, cur);
      Lane L(p, lane, 0, xs, sh.x_cap);
      if (cur.pos == cur.end) {
        if constexpr (kOwn) {
          chain_ops_arrive((W + 1) * 32);
        } else {
          push(i, 0, 0, true, L, 1.f, 1.f, p.M);
        }
        continue;
      }
      int seg = 0;                 // the segment's tiles so far
      float sc0 = 1.f, sc1 = 1.f;  // per-channel scales of rows g and g + 8: loaded now, used at the segment's end
      auto load_scales = [&] {
        if constexpr (!Lane::kGrouped) {
          sc0 = __half2float(static_cast<const __half*>(p.scales)[cur.panel * kPanelRows + g]);
          sc1 = __half2float(static_cast<const __half*>(p.scales)[cur.panel * kPanelRows + g + 8]);
        }
      };
      load_scales();
      while (cur.pos < cur.end) {
        const int n = stage_len(cur);
        const int slot = consumed % S;
        {
          const long long f0 = timed ? clock64() : 0;
          mbar_wait(my_full + slot, (consumed / S) & 1);
          if (timed) w_stage += clock64() - f0;
        }
        const unsigned char* stage = my_ring + static_cast<size_t>(slot) * stage_bytes;
        uint4 w0[kTS][1], w1[kTS][1];
        TileMeta m[kTS][1];
#pragma unroll
        for (int r = 0; r < kTS; ++r)
          if (r < n)
            load_tile(stage + r * kChainTileBytes, stage + kTS * kChainTileBytes + r * sh.meta_bytes, w0[r], w1[r],
                      m[r]);
        // The stage is in registers: back to the copy engine before the math.
        __syncwarp();
        if (lane == 0) {
          fence_proxy_async_smem();
          issue_next();
        }
        ++consumed;
#pragma unroll
        for (int r = 0; r < kTS; ++r) {
          if (r < n) {
            tile_math(L, cur.kt, r & 1, w0[r], w1[r], m[r]);
            ++seg;
            const bool end = cur.pos + 1 == cur.end;
            if (cur.kt + 1 == cur.tpp || end) {  // the segment's end
              if constexpr (kOwn) {
                seg_to_block(L, cur.vp, sc0, sc1, p.M);
              } else {
                push(i, cur.panel, seg, end, L, sc0, sc1, p.M);
#pragma unroll
                for (int b = 0; b < 2; ++b)
#pragma unroll
                  for (int i4 = 0; i4 < 4; ++i4) L.acc[b][0][0][i4] = 0.f;
              }
              seg = 0;
            }
            advance(cur, 1);
            if (cur.kt == 0 && !end) load_scales();  // a new panel
          }
        }
      }
      if constexpr (kOwn) chain_ops_arrive((W + 1) * 32);  // the warp's sums of op i are in the block's buffer
    }
  }
  if (timed) {
    atomicAdd(wait_cycles + 2 * G + blockIdx.x, static_cast<unsigned long long>(w_stage));
    atomicAdd(wait_cycles + 3 * G + blockIdx.x, static_cast<unsigned long long>(w_input));
    atomicAdd(wait_cycles + 4 * G + blockIdx.x, static_cast<unsigned long long>(w_queue));
  }
}

// Form 7, 8 or 9 (chain7_kernel's kForm): the kernel for sh.stage_tiles.
// Forms 7 and 8 take 2- or 4-tile stages; form 9 takes sh.stages == 1
// and a ring of sh.stage_tiles = 4 or 8 one-tile slots.  f(kernel) for it; false
// when there is none.
template <typename T, int kBits, int kGroup, bool kZeros, typename F>
bool chain7_dispatch(const ChainShape& sh, int form, F&& f) {
#define QGEMV_CHAIN7(TS, FORM) f(chain7_kernel<T, kBits, kGroup, kZeros, TS, FORM>)
  if (form >= 9 && sh.stages != 1) return false;
  const int ts = sh.stage_tiles;
  if (form == 7 && ts == 2) QGEMV_CHAIN7(2, 7);
  else if (form == 7 && ts == 4) QGEMV_CHAIN7(4, 7);
  else if (form == 8 && ts == 2) QGEMV_CHAIN7(2, 8);
  else if (form == 8 && ts == 4) QGEMV_CHAIN7(4, 8);
  else if (form == 9 && ts == 4) QGEMV_CHAIN7(4, 9);
  else if (form == 9 && ts == 8) QGEMV_CHAIN7(8, 9);
  else return false;
#undef QGEMV_CHAIN7
  return true;
}

// Whether sh fits one block per SM with `warps` consumer warps.
template <typename T, int kBits, int kGroup, bool kZeros>
bool chain7_fits(const ChainShape& sh, int warps, int form) {
  if (warps < 1 || warps > chain7_max_warps(form) || sh.M > 8) return false;
  const size_t smem = chain7_smem_bytes<T>(sh, warps, form >= 8, form >= 9);
  bool fits = false;
  const bool known = chain7_dispatch<T, kBits, kGroup, kZeros>(sh, form, [&](auto kernel) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, (warps + 1) * kWarpSize, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    fits = n >= 1;
  });
  return known && fits;
}

template <typename T, int kBits, int kGroup, bool kZeros>
Status chain7_launch(const Chain5Op* d_ops, int nops, const ChainShape& sh, unsigned* d_sync, int blocks, int warps,
                     int form, cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > chain7_max_warps(form) || blocks < 1 || nops < 1 || sh.M > 8) return Status::kBadShape;
  const size_t smem = chain7_smem_bytes<T>(sh, warps, form >= 8, form >= 9);
  const dim3 threads((warps + 1) * kWarpSize);
  if (!chain7_dispatch<T, kBits, kGroup, kZeros>(sh, form, [&](auto kernel) {
        kernel<<<blocks, threads, smem, stream>>>(d_ops, nops, sh, d_sync, wait_cycles);
      }))
    return Status::kBadShape;
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// ---- Form 11 ---------------------------------------------------------------
// Form 9's schedule (blocks own whole output panels; each block's tile stream
// cut into W contiguous runs, one per warp) with three changes that ncu's
// form-9 profile asked for (hot loop 150 SASS a tile, 0.41 issued a cycle per
// scheduler, consumers 11 us a layer waiting for inputs):
//   * Weights go straight to registers: each lane loads its 2 x 16 bytes of a
//     tile (and its 4 + 2 bytes of scales and zero points, chain_meta11) kD
//     tiles ahead with ld.global.nc, in a register ring unrolled kD times: no
//     shared-memory ring, no cp.async groups, no slot bookkeeping.
//   * No control warp: every warp finishes a slice of the block's outputs;
//     thread 0 counts the block and spins; every warp copies a slice of the
//     next input from global memory (L2) into shared memory while preparing
//     it.  The op hand-off is four block barriers.
//   * The math is form 9's (int4 with fp16 activations: nibbles as fp16
//     subnormals, high-nibble activations / 16, zero points through group
//     sums), two MMA chains a tile; M = 1 (kM1) folds only its column.
// int4 per channel and G = 128 only (one group a tile), fp16 activations.
constexpr int kChain11MaxWarps = 16;

// Form 11's scales and zero points, per tile: for each g in 0..7 the scales
// of rows g and g + 8 (2 x fp16: one 32-bit load per lane), then for each g
// their zero points (2 x uint8: one 16-bit load).  48 bytes a tile with
// zero points, 32 without: chain_meta_bytes(128, zeros).  Host arrays in.
inline std::vector<uint8_t> chain_meta11(const uint16_t* scales, const uint8_t* zeros, int N, int K) {
  const int tiles = K / 128, mb = chain_meta_bytes(128, zeros != nullptr);
  std::vector<uint8_t> meta(static_cast<size_t>(N / kPanelRows) * tiles * mb, 0);
  for (int pn = 0; pn < N / kPanelRows; ++pn)
    for (int kt = 0; kt < tiles; ++kt) {
      uint8_t* m = meta.data() + (static_cast<size_t>(pn) * tiles + kt) * mb;
      for (int g = 0; g < 8; ++g)
        for (int h = 0; h < 2; ++h) {
          const size_t src = static_cast<size_t>(pn * kPanelRows + g + 8 * h) * tiles + kt;
          std::memcpy(m + 4 * g + 2 * h, scales + src, 2);
          if (zeros) m[32 + 2 * g + h] = zeros[src];
        }
    }
  return meta;
}

// A walk along a warp's run of one op in its block's panel stream: pos / end
// in the block's tiles, kt the k-tile in the current panel, vp the block's
// panel (unit vp >> shift, gate or up half vp & shift), panel the op's.
struct Chain11Cursor {
  int pos, end, kt, vp, panel, tpp, u0, shift, half;
};

__device__ __forceinline__ int chain11_panel(const Chain11Cursor& c) {
  return c.u0 + (c.vp >> c.shift) + (c.vp & c.shift) * c.half;
}

// chain_range in 32 bits (a 64-bit division is a long software routine, and
// forms 11-17 cut every op at every op boundary): n x (blocks + 1) must stay
// below 2^32, as it does for any model (Llama-3-70B's gate/up: 229K tiles).
__device__ __forceinline__ void chain_range32(unsigned n, unsigned b, unsigned blocks, int& first, int& end) {
  first = static_cast<int>(n * b / blocks);
  end = static_cast<int>(n * (b + 1) / blocks);
}

// Warp `warp` of W in block b of G: its run of op o.
__device__ __forceinline__ void chain11_start(const Chain5Op& o, int b, int G, int warp, int W, Chain11Cursor& c) {
  int u0, u1;
  chain_range32(static_cast<unsigned>(chain8_units(o)), b, G, u0, u1);
  c.tpp = o.p.K / 128;
  chain_range32(static_cast<unsigned>((u1 - u0) * chain8_ppu(o) * c.tpp), warp, W, c.pos, c.end);
  c.u0 = u0;
  c.shift = chain8_ppu(o) - 1;
  c.half = o.p.N / kPanelRows / 2;
  c.kt = c.pos % c.tpp, c.vp = c.pos / c.tpp;
  c.panel = chain11_panel(c);
}

// n tiles on, at most to the end of the current panel.
__device__ __forceinline__ void chain11_advance(Chain11Cursor& c, int n) {
  c.pos += n, c.kt += n;
  if (c.kt >= c.tpp) {
    c.kt -= c.tpp, ++c.vp;
    c.panel = chain11_panel(c);
  }
}

__device__ __forceinline__ uint4 ld_relaxed_gpu_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Whether no fp16 of eight is the poison 0xffff (ChainShape::paired 2).
__device__ __forceinline__ bool chain_half_ready(const uint4& v) {
  return (__vcmpeq2(v.x, 0xffffffffu) | __vcmpeq2(v.y, 0xffffffffu) | __vcmpeq2(v.z, 0xffffffffu) |
          __vcmpeq2(v.w, 0xffffffffu)) == 0u;
}

// Whether four paired words all carry epoch e.
__device__ __forceinline__ bool paired_ready(const uint4& v, unsigned e) {
  return (v.x >> 16) == e && (v.y >> 16) == e && (v.z >> 16) == e && (v.w >> 16) == e;
}

__device__ __forceinline__ void red_release_add_gpu(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Shared memory: the block's sums (sh.sums fp32), the input (M x x_cap fp16,
// high-nibble positions / 16), its group sums (M x x_cap / 128 fp32, 2^-24
// sum x).
__host__ __device__ inline size_t chain11_smem_bytes(const ChainShape& sh) {
  return (static_cast<size_t>(sh.sums) * 4 + 15) / 16 * 16 + static_cast<size_t>(sh.M) * sh.x_cap * 2 +
         (static_cast<size_t>(sh.M) * (sh.x_cap / 128) * 4 + 15) / 16 * 16;
}

// The formats of forms 11-13: int4 per channel or G = 128 (one group a tile), fp16 activations.
template <int kGroup, bool kZeros>
struct Chain11Format {
  static_assert(kGroup == 0 || kGroup == 128, "forms 11-13: int4 per channel or G = 128");
  static_assert(kGroup != 0 || !kZeros, "zero points are group-wise");
  static constexpr bool kGrouped = kGroup != 0;
};

// Forms 16 and 17 take each warp's run of an op from a schedule built on the
// host, not from divisions at every op boundary (about 40 instructions a tile
// in form 17's first profile).  Ops of one shape (N, K, output step) share a
// class (Chain5Op::cls, chain16_classes); for class c, block b of `blocks`
// and consumer warp w < W the record is chain11_start's cursor {pos, end, vp,
// kt | u0 << 16}, and at w = W the block's units {u0, u1, 0, 0}: layout
// [classes][blocks][W + 1].  The kernel copies its block's records into
// shared memory at its start.  Host arrays in.
constexpr int kChainMaxClasses = 8;

// Each op's class (ops[i].cls); the number of classes, or -1 past kChainMaxClasses.
inline int chain16_classes(Chain5Op* ops, int nops) {
  int n = 0;
  for (int i = 0; i < nops; ++i) {
    ops[i].cls = -1;
    for (int j = 0; j < i && ops[i].cls < 0; ++j)
      if (ops[j].p.N == ops[i].p.N && ops[j].p.K == ops[i].p.K && ops[j].out == ops[i].out) ops[i].cls = ops[j].cls;
    if (ops[i].cls < 0) {
      if (n == kChainMaxClasses) return -1;
      ops[i].cls = n++;
    }
  }
  return n;
}

// The records for `blocks` blocks of W consumer warps (empty when a k-tile or a
// unit index does not fit its 16 bits).
inline std::vector<int4> chain16_schedule(const Chain5Op* ops, int nops, int classes, int blocks, int W) {
  std::vector<int4> tab(static_cast<size_t>(classes) * blocks * (W + 1));
  for (int c = 0; c < classes; ++c) {
    const Chain5Op* o = nullptr;
    for (int i = 0; i < nops && !o; ++i)
      if (ops[i].cls == c) o = ops + i;
    if (!o) return {};
    const int tpp = o->p.K / 128, ppu = chain8_ppu(*o);
    for (int b = 0; b < blocks; ++b) {
      long long u0, u1;
      chain_range(chain8_units(*o), b, blocks, u0, u1);
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

// chain11_start from the block's records (tab, in shared memory).
__device__ __forceinline__ void chain16_start(const Chain5Op& o, const int4* tab, int warp, int W, Chain11Cursor& c) {
  const int4 r = tab[o.cls * (W + 1) + warp];
  c.pos = r.x, c.end = r.y, c.vp = r.z, c.kt = r.w & 0xffff, c.u0 = r.w >> 16;
  c.tpp = o.p.K / 128;
  c.shift = chain8_ppu(o) - 1;
  c.half = o.p.N / kPanelRows / 2;
  c.panel = chain11_panel(c);
}

// A warp's walk along its tiles of every op, in the order it sums them:
// aim() finds the next segment (a run of `left` tiles from `tile`, within
// one panel of op i_op; past the last op left stays 0).  The issue side of
// forms 11-13 walks it for its own warp, form 14's feed lane for the warp it
// feeds.
struct Chain11Walk {
  const Chain5Op* ops;
  int nops, G, warp, W;
  int i_op = -1, left = 0;
  long long tile = 0;  // the op's tile (panel * K / 128 + k-tile) of the segment's next tile
  Chain11Cursor ic{0, 0, 0, 0, 0, 1, 0, 0, 0};
  const int4* tab = nullptr;  // forms 16 and 17: the block's schedule records (chain16_start)

  __device__ __forceinline__ Chain11Walk(const Chain5Op* o, int n, int w, int nw)
      : ops(o), nops(n), G(gridDim.x), warp(w), W(nw) {}

  __device__ __forceinline__ void aim() {
    while (i_op < nops && ic.pos >= ic.end)
      if (++i_op < nops) {
        if (tab) chain16_start(ops[i_op], tab, warp, W, ic);
        else chain11_start(ops[i_op], blockIdx.x, G, warp, W, ic);
      }
    if (i_op >= nops) return;
    tile = static_cast<long long>(ic.panel) * ic.tpp + ic.kt;
    left = min(ic.tpp - ic.kt, ic.end - ic.pos);
    chain11_advance(ic, left);
  }
};

// Tiles of every op that warp `warp` of W in this block sums.
__device__ __forceinline__ unsigned chain11_warp_tiles(const Chain5Op* ops, int nops, int warp, int W) {
  unsigned n = 0;
  Chain11Cursor c;
  for (int i = 0; i < nops; ++i) {
    chain11_start(ops[i], blockIdx.x, gridDim.x, warp, W, c);
    n += static_cast<unsigned>(c.end - c.pos);
  }
  return n;
}

// The issue side of forms 11 and 13: this lane's words of its warp's next
// tiles, across ops, kD tiles ahead in registers (bw0 / bw1: rows g / g + 8;
// bs / bz: their scales and zero points, chain_meta11).  fetch(d) with a
// compile-time d (an unrolled loop) keeps the ring in registers.
template <int kD, bool kGrouped, bool kZeros>
struct Chain11Issue {
  Chain11Walk wk;
  int g, t, mb;
  const uint4* wsrc = nullptr;
  const uint8_t* msrc = nullptr;
  uint4 bw0[kD], bw1[kD];
  uint32_t bs[kD], bz[kD];

  __device__ __forceinline__ Chain11Issue(const Chain5Op* o, int n, const ChainShape& sh, int lane)
      : wk(o, n, threadIdx.x >> 5, blockDim.x >> 5), g(lane >> 2), t(lane & 3), mb(sh.meta_bytes) {}

  // The next segment (past the last op: wk.left stays 0).
  __device__ __forceinline__ void aim() {
    wk.aim();
    if (wk.left == 0) return;
    const Chain5Op& o = wk.ops[wk.i_op];
    wsrc = reinterpret_cast<const uint4*>(static_cast<const char*>(o.p.qweight) + wk.tile * kChainTileBytes +
                                          g * kTileBytes + 16 * t);
    if constexpr (kGrouped) msrc = o.meta + wk.tile * mb;
  }

  __device__ __forceinline__ void fetch(int d) {
    if (wk.left > 0) {
      bw0[d] = ldg_stream(wsrc);
      bw1[d] = ldg_stream(wsrc + 8 * kTileBytes / 16);
      if constexpr (kGrouped) {
        bs[d] = __ldg(reinterpret_cast<const unsigned*>(msrc + 4 * g));
        if constexpr (kZeros) bz[d] = __ldg(reinterpret_cast<const unsigned short*>(msrc + 32 + 2 * g));
        msrc += mb;
      }
      wsrc += kChainTileBytes / 16;
      if (--wk.left == 0) aim();
    }
  }

  __device__ __forceinline__ void prime() {
    aim();
#pragma unroll
    for (int d = 0; d < kD; ++d) fetch(d);
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
__device__ __forceinline__ void chain11_row_scales(const Chain5Op& o, int panel, int g, float& sc0, float& sc1) {
  const __half* sc = static_cast<const __half*>(o.p.scales) + panel * kPanelRows;
  sc0 = __half2float(sc[g]);
  sc1 = __half2float(sc[g + 8]);
}

// One tile of forms 11 and 13 (int4 with fp16 activations, subnormal
// nibbles): xk this lane's activations of the tile, xa / xb the tile's
// 2^-24 x sums for tokens 2t and 2t + 1.  Grouped (G = 128, one group a
// tile): folded into acc with the tile's scales and zero points; per
// channel: c0 / c1 accumulate the segment and xa0 / xa1 its x sums.
// 16 bytes of shared memory in one 128-bit load (form 19: the compiler split the x
// loads' uint4 dereference into two LDS.64).
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return v;
}

template <bool kGrouped, bool kZeros, bool kM1, bool kLds128 = false>
__device__ __forceinline__ void chain11_tile(const uint4& w0, const uint4& w1, uint32_t bs, uint32_t bz,
                                             const __half* xk, float xa, float xb, float (&acc)[4], float (&c0)[4],
                                             float (&c1)[4], float& xa0, float& xa1) {
  float p0[4] = {0.f, 0.f, 0.f, 0.f}, p1[4] = {0.f, 0.f, 0.f, 0.f};
  float(&q0)[4] = kGrouped ? p0 : c0;
  float(&q1)[4] = kGrouped ? p1 : c1;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (kLds128)
      chain_nibble_mma(word_of(w0, j), word_of(w1, j), lds128(xk + 32 * j), q0, q1);
    else  // (a reference into shared memory: the compiler loads each half where its MMA needs it)
      chain_nibble_mma(word_of(w0, j), word_of(w1, j), *reinterpret_cast<const uint4*>(xk + 32 * j), q0, q1);
  }
  if constexpr (kGrouped) {
    const __half2 s2 = *reinterpret_cast<const __half2*>(&bs);
    const float s0 = __low2float(s2), s1 = __high2float(s2);
    float z0 = 8.f, z1 = 8.f;
    if constexpr (kZeros) {
      z0 = static_cast<float>(bz & 0xffu);
      z1 = static_cast<float>((bz >> 8) & 0xffu);
    }
    const float sz0 = -s0 * z0, sz1 = -s1 * z1;
    acc[0] = fmaf(sz0, xa, fmaf(p0[0] + p1[0], s0, acc[0]));
    acc[2] = fmaf(sz1, xa, fmaf(p0[2] + p1[2], s1, acc[2]));
    if constexpr (!kM1) {
      acc[1] = fmaf(sz0, xb, fmaf(p0[1] + p1[1], s0, acc[1]));
      acc[3] = fmaf(sz1, xb, fmaf(p0[3] + p1[3], s1, acc[3]));
    }
  } else {
    xa0 += xa;
    if constexpr (!kM1) xa1 += xb;
  }
}

// A warp's current panel segment in forms 11 and 13: its sums so far and
// where the next tile's activations and x sums are.
template <bool kGrouped, bool kZeros, bool kM1, bool kLds128 = false>
struct Chain11Seg {
  int len = 0, left = 0;  // tiles in the segment; not yet summed
  bool open = false;
  float acc[4] = {}, c0[4] = {}, c1[4] = {}, xa0 = 0.f, xa1 = 0.f, sc0 = 1.f, sc1 = 1.f;
  const __half* xk = nullptr;                 // this lane's activations of the next tile
  const float *X0 = nullptr, *X1 = nullptr;  // its 2^-24 x sums, tokens 2t and 2t + 1

  __device__ __forceinline__ void begin(const Chain11Cursor& cur, const Chain5Op& o, int g, const __half* xk0,
                                        const float* x0, const float* x1) {
    len = left = min(cur.tpp - cur.kt, cur.end - cur.pos);
    open = true;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = c0[e] = c1[e] = 0.f;
    xa0 = xa1 = 0.f;
    xk = xk0, X0 = x0, X1 = x1;
    if constexpr (!kGrouped) chain11_row_scales(o, cur.panel, g, sc0, sc1);
  }

  __device__ __forceinline__ void tile(const uint4& w0, const uint4& w1, uint32_t bs, uint32_t bz) {
    chain11_tile<kGrouped, kZeros, kM1, kLds128>(w0, w1, bs, bz, xk, *X0, kM1 ? 0.f : *X1, acc, c0, c1, xa0, xa1);
    xk += 128;
    ++X0;
    ++X1;
    --left;
  }

  // Past the segment's last tile: flush() its sums, the cursor past it.
  template <typename F>
  __device__ __forceinline__ void close(Chain11Cursor& cur, F&& flush) {
    if (!open) return;
    flush();
    chain11_advance(cur, len);
    open = false;
  }

  // The segment's sum of value e (row g or g + 8 as e >= 2, token 2t + (e & 1)), at its true scale.
  __device__ __forceinline__ float value(int e) const {
    if constexpr (kGrouped) return acc[e] * 0x1p24f;
    return (c0[e] + c1[e] - 8.f * ((e & 1) ? xa1 : xa0)) * 0x1p24f * (e >= 2 ? sc1 : sc0);
  }
};

// The consumer loop of forms 11 and 13: the tiles in the issue side's order,
// kD a pass (so that the ring's index is a compile-time constant);
// boundary() moves to the next segment (false: the warp is done), before()
// runs before each tile's math.
template <int kD, typename Issue, typename Seg, typename B, typename P>
__device__ __forceinline__ void chain11_consume(Issue& is, Seg& seg, B&& boundary, P&& before) {
  is.prime();
  for (;;) {
#pragma unroll
    for (int d = 0; d < kD; ++d) {
      if (seg.left == 0 && !boundary()) return;
      before();
      seg.tile(is.bw0[d], is.bw1[d], is.bs[d], is.bz[d]);
      is.fetch(d);
    }
  }
}

// Whether one block of `threads` threads and `smem` bytes fits an SM, for the
// kernel that dispatch(f) hands to f (false when there is none).
template <typename D>
bool chain_kernel_fits(D&& dispatch, size_t smem, int threads) {
  bool fits = false;
  const bool known = dispatch([&](auto kernel) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    fits = n >= 1;
  });
  return known && fits;
}

// Launches dispatch's kernel with (ops, nops, sh, sync, wait_cycles).
template <typename D>
Status chain_kernel_launch(D&& dispatch, const Chain5Op* d_ops, int nops, const ChainShape& sh, unsigned* d_sync,
                           int blocks, int threads, size_t smem, cudaStream_t stream, unsigned long long* wait_cycles) {
  if (!dispatch([&](auto kernel) {
        kernel<<<blocks, threads, smem, stream>>>(d_ops, nops, sh, d_sync, wait_cycles);
      }))
    return Status::kBadShape;
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

// ---- Form 14: form 12 fed by a warp of its own ---------------------------------
// Form 12's consumers and hand-off; the weights come from shared memory.  One
// more warp per block, the feed, streams every consumer warp's tiles (lane w
// feeds warp w) into that warp's ring of sh.stages one-tile slots, across op
// boundaries, waiting only for free slots: no activation ever stops it, so
// HBM keeps streaming while the consumers hand an op over.  The ring is cut
// into chunks of sh.chunk slots; the feed fills a chunk with up to that many
// consecutive tiles of one panel segment (one bulk copy) and writes how many;
// the chunk's mbarrier counts the bytes in.  A consumer warp takes the tiles
// into registers (kD ahead, as form 11) and arrives on the chunk's empty
// mbarrier once its last tile is in registers, which frees it.  Grouped formats keep each tile's scales and
// zero points (chain_meta11's bytes) right after its 1 KB (chain14_fuse), so
// that one copy carries both: a bulk copy is issued one lane at a time.

// Tiles (1 KB each) with each one's mb meta bytes after it.  Host arrays in.
inline std::vector<uint8_t> chain14_fuse(const uint8_t* tiles, const uint8_t* meta, size_t n, int mb) {
  const size_t ts = kChainTileBytes + mb;
  std::vector<uint8_t> out(n * ts);
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(out.data() + i * ts, tiles + i * kChainTileBytes, kChainTileBytes);
    std::memcpy(out.data() + i * ts + kChainTileBytes, meta + i * mb, mb);
  }
  return out;
}

__host__ __device__ inline size_t chain14_ring_offset(const ChainShape& sh) {
  return (chain11_smem_bytes(sh) + 127) / 128 * 128;
}
// Form 11's shared memory, then W x sh.stages slots of a tile and its meta,
// each chunk's full and empty mbarriers and its tile count.
// ... and, forms 16 and 17, the block's schedule records (chain16_schedule).
__host__ __device__ inline size_t chain14_smem_bytes(const ChainShape& sh, int W) {
  const size_t slots = static_cast<size_t>(W) * sh.stages, chunks = slots / sh.chunk;
  const size_t ring = chain14_ring_offset(sh) + slots * (kChainTileBytes + sh.meta_bytes) + chunks * (8 + 8 + 4);
  return (ring + 15) / 16 * 16 + static_cast<size_t>(sh.classes) * (W + 1) * 16;
}

struct Chain14Ring {
  unsigned char* w;  // [W * R][ts]
  uint64_t* full;    // [W * R / chunk]: the feed's bytes in
  uint64_t* empty;   // [W * R / chunk]: the consumer warp is done with it
  unsigned* len;     // [W * R / chunk]: tiles in the chunk
  int4* tab;         // forms 16 and 17: [sh.classes][W + 1] the block's schedule records
  int R, C, K, ts;   // slots and chunks a warp, tiles a chunk, bytes a tile (with its meta)

  __device__ __forceinline__ Chain14Ring(unsigned char* smem, const ChainShape& sh, int W)
      : R(sh.stages), C(sh.stages / sh.chunk), K(sh.chunk), ts(kChainTileBytes + sh.meta_bytes) {
    const size_t slots = static_cast<size_t>(W) * R;
    w = smem + chain14_ring_offset(sh);
    full = reinterpret_cast<uint64_t*>(w + slots * ts);
    empty = full + W * C;
    len = reinterpret_cast<unsigned*>(empty + W * C);
    tab = reinterpret_cast<int4*>(smem + (chain14_smem_bytes(sh, W) - static_cast<size_t>(sh.classes) * (W + 1) * 16));
  }
};

// The feed warp: lane w < W streams consumer warp w's tiles through its ring.
__device__ __forceinline__ void chain14_feed(const Chain5Op* ops, int nops, int W, const Chain14Ring& rg,
                                             int skip) {
  const int lane = threadIdx.x & 31;
  const bool mine = lane < W;
  Chain11Walk wk(ops, nops, mine ? lane : 0, W);
  const unsigned total = mine ? chain11_warp_tiles(ops, nops, lane, W) : 0u;
  unsigned tiles = 0, chunks = 0;
  int c = 0;
  const char* wsrc = nullptr;
  auto aim = [&] {
    wk.aim();
    if (wk.left == 0) return;
    wsrc = static_cast<const char*>(ops[wk.i_op].p.qweight) + wk.tile * rg.ts;
    if (skip & 8)  // lab: the block's own 64 tiles of op 0 over and over (L2 hits; results wrong)
      wsrc = static_cast<const char*>(ops[0].p.qweight) +
             (static_cast<long long>(blockIdx.x) * 64 + wk.tile % 64) * rg.ts;
  };
  if (mine) aim();
  while (__any_sync(0xffffffffu, tiles < total)) {
    if (tiles >= total) continue;
    for (int k = 0; k < rg.C && tiles < total; ++k) {
      const int q = lane * rg.C + c;
      // the chunk's previous round (lap - 1) must have been emptied; none before the first lap
      const unsigned lap = chunks / static_cast<unsigned>(rg.C);
      if (lap > 0 && !mbar_test(rg.empty + q, (lap - 1) & 1u)) break;
      const int n = min(rg.K, wk.left);
      const size_t slot = static_cast<size_t>(lane) * rg.R + c * rg.K;
      rg.len[q] = static_cast<unsigned>(n);  // before the arrive (a release): the taker reads it after its wait
      mbar_expect_tx(rg.full + q, n * rg.ts);
      bulk_copy(rg.w + slot * rg.ts, wsrc, n * rg.ts, rg.full + q);
      wsrc += n * rg.ts;
      tiles += n, ++chunks;
      if (++c == rg.C) c = 0;
      if ((wk.left -= n) == 0) aim();
    }
  }
}

// Form 14's issue side, in Chain11Issue's shape: this lane's words of its
// warp's next tiles, taken from the warp's ring kD tiles ahead.
template <int kD, bool kGrouped, bool kZeros>
struct Chain14Take {
  const Chain14Ring& rg;
  int warp, lane, g, t;
  unsigned n = 0, total;
  int c = 0, in = 0;  // the chunk; its tiles not yet taken
  const unsigned char* wp = nullptr;  // this lane's words of the next tile in the ring
  uint32_t phase = 0;
  bool timed = false;     // the lab: count the cycles waiting for the feed
  long long waited = 0;
  uint4 bw0[kD], bw1[kD];
  uint32_t bs[kD], bz[kD];

  __device__ __forceinline__ Chain14Take(const Chain14Ring& r, const Chain5Op* ops, int nops, int W)
      : rg(r), warp(threadIdx.x >> 5), lane(threadIdx.x & 31), g(lane >> 2), t(lane & 3),
        total(chain11_warp_tiles(ops, nops, threadIdx.x >> 5, W)) {}

  __device__ __forceinline__ void fetch(int d) {
    if (n >= total) return;
    if (in == 0) {
      const int q = warp * rg.C + c;
      mbar_wait_timed(rg.full + q, phase, timed, waited);
      in = static_cast<int>(rg.len[q]);
      wp = rg.w + (static_cast<size_t>(warp) * rg.R + c * rg.K) * rg.ts + g * kTileBytes + 16 * t;
    }
    bw0[d] = *reinterpret_cast<const uint4*>(wp);
    bw1[d] = *reinterpret_cast<const uint4*>(wp + 8 * kTileBytes);
    if constexpr (kGrouped) {  // the tile's meta: 4 g + 32 + 2 g bytes past its 1 KB, wp is g * 64 + 16 t in
      const unsigned char* m = wp + (kChainTileBytes - g * kTileBytes - 16 * t);
      bs[d] = *reinterpret_cast<const unsigned*>(m + 4 * g);
      if constexpr (kZeros) bz[d] = *reinterpret_cast<const unsigned short*>(m + 32 + 2 * g);
    }
    ++n;
    wp += rg.ts;
    if (--in == 0) give_back();
  }

  // The chunk's last tile is in registers: free it for the feed.
  __device__ __forceinline__ void give_back() {
    __syncwarp();  // every lane's loads of the chunk are done before it is given back
    if (lane == 0) mbar_arrive(rg.empty + warp * rg.C + c);
    if (++c == rg.C) c = 0, phase ^= 1u;
  }

  __device__ __forceinline__ void prime() {
#pragma unroll
    for (int d = 0; d < kD; ++d) fetch(d);
  }
};

// Forms 16 and 17: a warp's ring read chunk by chunk, without form 14's
// register ring.  The feed (or the warp itself) cuts each panel segment into
// chunks of min(kChunk, tiles left), as the consumer's segments are cut, so
// the consumer knows a chunk's length without reading it.  A full chunk is
// summed in one unrolled pass (slot offsets are immediates, no per-tile
// checks), a segment's short last chunk tile by tile; the shared-memory loads
// come straight before the math (the other warps hide their latency).
template <int kChunk, int kTs, bool kGrouped, bool kZeros>
struct Chain16Ring {
  const unsigned char* w;  // this lane's weight words in the warp's first slot
  const unsigned char* m;  // the first slot's meta
  uint64_t* full;          // the warp's chunks' full mbarriers
  int g;

  __device__ __forceinline__ Chain16Ring(const Chain14Ring& rg, int warp, int lane)
      : w(rg.w + static_cast<size_t>(warp) * rg.R * kTs + (lane >> 2) * kTileBytes + 16 * (lane & 3)),
        m(rg.w + static_cast<size_t>(warp) * rg.R * kTs + kChainTileBytes), full(rg.full + warp * rg.C),
        g(lane >> 2) {}

  // Chunk q's copy is in (phase), the cycles waited added to `waited` when timed.
  __device__ __forceinline__ void wait(int q, uint32_t phase, bool timed, long long& waited) const {
    mbar_wait_timed(full + q, phase, timed, waited);
  }

  // The tiles of chunk q into the segment (its next min(kChunk, seg.left)).
  template <typename Seg>
  __device__ __forceinline__ void sum(int q, Seg& seg) const {
    auto tile = [&](int at) {
      const uint4 w0 = *reinterpret_cast<const uint4*>(w + at);
      const uint4 w1 = *reinterpret_cast<const uint4*>(w + at + 8 * kTileBytes);
      uint32_t bs = 0, bz = 0;
      if constexpr (kGrouped) {
        bs = *reinterpret_cast<const unsigned*>(m + at + 4 * g);
        if constexpr (kZeros) bz = *reinterpret_cast<const unsigned short*>(m + at + 32 + 2 * g);
      }
      seg.tile(w0, w1, bs, bz);
    };
    const int at = q * kChunk * kTs;
    if (seg.left >= kChunk) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) tile(at + j * kTs);
    } else {
      const int n = seg.left;
      for (int j = 0; j < n; ++j) tile(at + j * kTs);
    }
  }
};

// Form 16's consumer loop: chunks filled by the feed warp (chain14_feed),
// each given back through its empty mbarrier once summed.  waited: the
// cycles spent waiting for the feed (the lab's, when timed).
template <int kChunk, int kTs, bool kGrouped, bool kZeros, typename Seg, typename B>
__device__ __forceinline__ void chain16_consume(const Chain14Ring& rg, Seg& seg, B&& boundary, bool timed,
                                                long long& waited) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Chain16Ring<kChunk, kTs, kGrouped, kZeros> ring(rg, warp, lane);
  uint64_t* empty = rg.empty + warp * rg.C;
  int c = 0;
  uint32_t phase = 0;
  for (;;) {
    if (seg.left == 0 && !boundary()) return;
    ring.wait(c, phase, timed, waited);
    ring.sum(c, seg);
    __syncwarp();  // every lane's loads of the chunk are done before it is given back
    if (lane == 0) mbar_arrive(empty + c);
    if (++c == rg.C) c = 0, phase ^= 1u;
  }
}

// Form 17's consumer loop: form 16's, but every warp fills its own ring (no
// feed warp).  The warp walks its tiles (Chain11Walk) up to rg.C chunks
// ahead of its sums; once it has summed a chunk, lane 0 copies the walk's
// next chunk into the freed slots at once, so a freed chunk is refilled
// without waiting for another warp to notice.  skip & 8 (the lab): the
// block's own 64 tiles of op 0 over and over (L2 hits; results wrong).
template <int kChunk, int kTs, bool kGrouped, bool kZeros, bool kLean = false, typename Seg, typename B>
__device__ __forceinline__ void chain17_consume(const Chain14Ring& rg, const Chain5Op* ops, int nops, int W, int skip,
                                                Seg& seg, B&& boundary, bool timed, long long& waited) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Chain16Ring<kChunk, kTs, kGrouped, kZeros> ring(rg, warp, lane);
  unsigned char* slots = rg.w + static_cast<size_t>(warp) * rg.R * kTs;
  // the issue side: the warp's walk; `ahead` chunks copied and not yet summed (the next one goes
  // `ahead` chunks past the one to sum, c)
  Chain11Walk wk(ops, nops, warp, W);
  wk.tab = rg.tab;
  const char* src = nullptr;
  int ahead = 0, c = 0;
  uint32_t phase = 0;
  auto aim = [&] {
    wk.aim();
    if (wk.left == 0) return;
    src = static_cast<const char*>(ops[wk.i_op].p.qweight) + wk.tile * kTs;
    if (skip & 8)
      src = static_cast<const char*>(ops[0].p.qweight) + (static_cast<long long>(blockIdx.x) * 64 + wk.tile % 64) * kTs;
  };
  auto top_up = [&] {  // the walk's next chunks into every free chunk of the ring
    while (ahead < rg.C && wk.left > 0) {
      const int n = min(kChunk, wk.left), q = c + ahead < rg.C ? c + ahead : c + ahead - rg.C;
      if (lane == 0) {
        mbar_expect_tx(ring.full + q, n * kTs);
        bulk_copy(slots + q * kChunk * kTs, src, n * kTs, ring.full + q);
      }
      src += n * kTs;
      ++ahead;
      if ((wk.left -= n) == 0) aim();
    }
  };
  aim();
  top_up();
  if constexpr (kLean) {
    // Form 19: the chunk just summed is the one to refill (the ring is full until the walk ends, and
    // the walk's chunks lie in the ring in the order they are summed), so no count of chunks ahead
    // and no search for a free one.
    for (;;) {
      if (seg.left == 0 && !boundary()) return;
      ring.wait(c, phase, timed, waited);
      ring.sum(c, seg);
      __syncwarp();  // as below: every lane's reads of the chunk are done before its refill
      if (wk.left > 0) {
        const int n = min(kChunk, wk.left);
        if (lane == 0) {
          mbar_expect_tx(ring.full + c, n * kTs);
          bulk_copy(slots + c * (kChunk * kTs), src, n * kTs, ring.full + c);
        }
        src += n * kTs;
        if ((wk.left -= n) == 0) aim();
      }
      if (++c == rg.C) c = 0, phase ^= 1u;
    }
  } else {
    for (;;) {
      if (seg.left == 0 && !boundary()) return;
      ring.wait(c, phase, timed, waited);
      ring.sum(c, seg);
      // Every lane's reads of the chunk are done (their values are in the sums) before lane 0 has
      // the copy engine overwrite it: the CTA's own ordering, as a consumer's release through an
      // mbarrier orders a producer's next copy into the slot (no proxy fence: it compiled to
      // MEMBAR.ALL.CTA, once a chunk).
      __syncwarp();
      --ahead;
      if (++c == rg.C) c = 0, phase ^= 1u;
      top_up();
    }
  }
}

// Form 20's preparation of an fp16 input (ChainShape::paired 2, M = 1): every
// chunk of 8 halves of this launch's copy copied into xs at once
// (cp.async, L2 only: no registers hold the data in flight, so a K of 14336,
// 3.5 chunks a thread, is one L2 round trip, not two), then each thread takes
// its own chunks back (its copies, seen after its wait), polls again those
// that still hold the poison, and writes them back as chain_nibble_input
// makes them, with the 2^-24 sums of each 128.  Thread i: chunks i, i + n, ...
// in both passes (n = nthreads, a multiple of 32: the 16-lane shuffles).
// src: the copy to read; nowait: a plain input (written before the launch)
// or the lab's timing without waits.
__device__ __forceinline__ void chain_async_input(const uint4* src, int chunks, int nthreads, __half* xs, float* xsum,
                                                  bool nowait) {
  const int lane = threadIdx.x & 31;
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  for (int c = threadIdx.x; c < chunks; c += nthreads) cp_async_16_shared_data(xs4 + c, src + c);
  cp_async_commit();
  cp_async_wait<0>();
  for (int cb = threadIdx.x - lane; cb < chunks; cb += nthreads) {  // warp-uniform (the shuffles)
    const int c = cb + lane;
    float sum = 0.f;
    if (c < chunks) {
      uint4 v = xs4[c];
      while (!nowait && !chain_half_ready(v)) v = ld_relaxed_gpu_v4(src + c);
      sum = chain_nibble_input(v);
      xs4[c] = v;
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (c < chunks && lane % 16 == 0) xsum[c / 16] = sum * 0x1p-24f;
  }
}

// Form 20's input with its RMSNorm (M = 1, fp16 halves; every consumer thread
// calls it between the block barriers of the hand-off): the input's copy
// for this launch (parity par; or plain fp16) into xs at once, as
// chain_async_input copies it, with the fp32 sum of its squares; one block barrier; then each
// value y = round(w * round(s * rsqrt(mean(s^2) + eps))), as transformers'
// LlamaRMSNorm and qgemv's add_rms_gather round, then the nibble transform
// and the 2^-24 group sums of the plain preparation.  Thread i handles
// chunks i, i + n, ... in both passes (n = nthreads, a multiple of 32).
// Not inlined: once an op boundary, and kept out of the tile loop's registers.
template <typename Sync>
__device__ __noinline__ void chain_norm_input(const GemvParams& p, int o_flags, int par, const void* norm, float eps,
                                                 int chunks, int nthreads, Sync&& csync, __half* xs, float* xsum,
                                                 bool nowait) {
  __shared__ float partial[kChain11MaxWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* xs4 = reinterpret_cast<uint4*>(xs);
  float ss = 0.f;
  // as chain_async_input: every chunk copied at once, the poisoned ones polled again
  const bool plain = (o_flags & kChainPlainX) != 0;
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) +
                                                    (plain ? size_t{0} : static_cast<size_t>(par) * p.ldx));
  for (int c = threadIdx.x; c < chunks; c += nthreads) cp_async_16_shared_data(xs4 + c, src + c);
  cp_async_commit();
  cp_async_wait<0>();
  for (int c = threadIdx.x; c < chunks; c += nthreads) {
    uint4 v = xs4[c];
    if (!plain && !nowait && !chain_half_ready(v)) {
      do v = ld_relaxed_gpu_v4(src + c);
      while (!chain_half_ready(v));
      xs4[c] = v;
    }
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __half22float2(h[q]);
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) partial[warp] = ss;
  csync();
  float total = 0.f;
  for (int w = 0; w < nthreads / 32; ++w) total += partial[w];
  const float r = rsqrtf(total / static_cast<float>(p.K) + eps);
  const uint4* gain = static_cast<const uint4*>(norm);
  for (int cb = warp * 32; cb < chunks; cb += nthreads) {  // warp-uniform (the shuffles)
    const int c = cb + lane;
    float s = 0.f;
    if (c < chunks) {
      uint4 v = xs4[c];
      const uint4 g = __ldg(gain + c);
      __half2* h = reinterpret_cast<__half2*>(&v);
      const __half2* gh = reinterpret_cast<const __half2*>(&g);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 a = __half22float2(h[q]), w = __half22float2(gh[q]);
        h[q] = __floats2half2_rn(__half2float(__float2half_rn(a.x * r)) * w.x,
                                 __half2float(__float2half_rn(a.y * r)) * w.y);
      }
      s = chain_nibble_input(v);
      xs4[c] = v;
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (c < chunks && lane % 16 == 0) xsum[c / 16] = s * 0x1p-24f;
  }
}

// ---- Stage 2: a layer's attention inside the launch (form 20, kDecode; M = 1, fp16)
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
  float* part;                // [Hkv][splits][gq][D + 2]: a split's weighted values, then its max and sum
  unsigned* count;            // [Hkv]: splits done; zero before the first launch, left zero
  int ldq, H, Hkv, D, S, splits;
  float scale;                // the scores' scale (D^-1/2)
};

// Shared memory the attention needs (floats), inside the input buffer xs: the
// group's queries, the token's k and v, a chunk's scores, then two buffers of
// a chunk's K and V rows (fp16, copied at once; the next chunk's copy flies
// while the block sums this one).
constexpr int kChainAttnChunk = 32;  // cache positions a chunk
__host__ __device__ inline int chain_attn_floats(int gq, int D) {
  return gq * D + 2 * D + gq * kChainAttnChunk + 2 * kChainAttnChunk * D;
}

// The q/k/v op's finishing with the rotation (M = 1; sums: the block's panels
// [u0, u0 + count / 16) of this op, complete).  Pairs meet in one warp (rows r
// and r ^ 8 of a panel are values q and q ^ 8 of an iteration), so the loop is
// warp-uniform and each warp reads both halves of a pair before zeroing.
__device__ __noinline__ void chain_rope_finish(const ChainAttn& a, int pos, int par, float* sums, int u0, int count,
                                               unsigned short* y, int ldy, int nthreads) {
  const int lane = threadIdx.x & 31, D = a.D, half = D / 2;
  const int q_rows = a.H * D, qk_rows = (a.H + a.Hkv) * D;
  if (pos < 0 || pos >= a.S) __trap();  // the slot outside the cache: stop rather than write outside it
  const __half* cs = a.cos + static_cast<size_t>(pos) * D;
  const __half* sn = a.sin + static_cast<size_t>(pos) * D;
  for (int qb = threadIdx.x - lane; qb < count; qb += nthreads) {
    const int q = qb + lane;
    const bool on = q < count;
    const int u = q / kPanelRows, r = q % kPanelRows, row = (u0 + u) * kPanelRows + r;
    float* sp = sums + static_cast<size_t>(u) * kPanelRows + r;
    float v = 0.f, w = 0.f;
    if (on) {
      v = __half2float(__float2half_rn(*sp));
      if (row < qk_rows) w = __half2float(__float2half_rn(sp[r < 8 ? 8 : -8]));
    }
    __syncwarp();
    if (!on) continue;
    *sp = 0.f;
    int nat = row;  // the row's place in the natural order
    if (row < qk_rows) {
      const int head = row / D, f = 8 * ((row % D) / kPanelRows) + (r & 7);
      nat = head * D + (r < 8 ? f : half + f);
      const float c = __half2float(cs[f]), s = __half2float(sn[f]);
      // x1 = row f, x2 = row f + D / 2: (x1 c - x2 s, x2 c + x1 s); here v is this row's, w its pair's
      v = r < 8 ? v * c - w * s : v * c + w * s;
    }
    const __half hv = __float2half_rn(v);
    unsigned short bits = __half_as_ushort(hv);
    if (bits == 0xffffu) bits = 0x7fffu;  // a NaN, never the poison
    unsigned short* yp = y + nat;
    asm volatile("st.relaxed.gpu.global.u16 [%0], %1;" ::"l"(yp + static_cast<size_t>(par) * ldy), "h"(bits) : "memory");
    yp[static_cast<size_t>(par ^ 1) * ldy] = 0xffffu;
    if (nat >= q_rows) {  // k or v of kv head kh: the cache at the token's slot
      const bool is_k = nat < qk_rows;
      const int off = nat - (is_k ? q_rows : qk_rows), kh = off / D;
      (is_k ? a.k_cache : a.v_cache)[(static_cast<size_t>(kh) * a.S + pos) * D + off % D] = hv;
    }
  }
}

// 8 fp16 of a chain buffer, polled until none is the poison, as floats.
__device__ __forceinline__ void chain_poll8(const unsigned short* p, float* out, float mul) {
  const uint4* src = reinterpret_cast<const uint4*>(p);
  uint4 v = ld_relaxed_gpu_v4(src);
  while (!chain_half_ready(v)) v = ld_relaxed_gpu_v4(src);
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __half22float2(h[e]);
    out[2 * e] = f.x * mul, out[2 * e + 1] = f.y * mul;
  }
}

// The block's units of one layer's attention (every consumer thread; csync
// the block barrier; sm: chain_attn_floats floats of shared memory).  Each
// chunk's K and V rows are copied into shared memory at once (cp.async: one
// round trip a chunk, and the split's first chunk is on its way while the
// block waits for q/k/v's outputs).  Thread e owns (query head e / D, dim
// e % D) and e + nthreads (gq D <= 2 nthreads).
template <typename Sync>
__device__ __noinline__ void chain_attention(const ChainAttn& a, int pos, int par, int nthreads, Sync&& csync,
                                             float* sm) {
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = nthreads / 32;
  const int gq = a.H / a.Hkv, D = a.D, L = pos + 1, units = a.Hkv * a.splits, pairs = gq * D;
  float* qf = sm;                                          // [gq][D] queries x scale
  float* kv = qf + pairs;                                  // [2][D] the token's k, v
  float* sc = kv + 2 * D;                                  // [gq][kChainAttnChunk] a chunk's scores
  // [2][K, V][kChainAttnChunk][D]: two chunks' rows
  __half* rows = reinterpret_cast<__half*>(sc + gq * kChainAttnChunk);
  const unsigned short* src = a.qkv + static_cast<size_t>(par) * a.ldq;
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int h = unit / a.splits, s = unit % a.splits;
    const int p0 = static_cast<int>(static_cast<long long>(s) * L / a.splits);
    const int p1 = static_cast<int>(static_cast<long long>(s + 1) * L / a.splits);
    const __half* kc = a.k_cache + static_cast<size_t>(h) * a.S * D;
    const __half* vc = a.v_cache + static_cast<size_t>(h) * a.S * D;
    // the chunk at c0 into buffer b: its K and V rows in flight (row pos, not yet written, is copied and
    // never read)
    auto fetch = [&](int c0, int b) {
      const int n = min(kChainAttnChunk, p1 - c0), words = n * D / 8;
      const uint4* k4 = reinterpret_cast<const uint4*>(kc + static_cast<size_t>(c0) * D);
      const uint4* v4 = reinterpret_cast<const uint4*>(vc + static_cast<size_t>(c0) * D);
      uint4* ks4 = reinterpret_cast<uint4*>(rows + static_cast<size_t>(2 * b) * kChainAttnChunk * D);
      uint4* vs4 = ks4 + kChainAttnChunk * D / 8;
      for (int c = threadIdx.x; c < 2 * words; c += nthreads)
        cp_async_16_shared_data(c < words ? ks4 + c : vs4 + (c - words), c < words ? k4 + c : v4 + (c - words));
      cp_async_commit();
    };
    if (p0 < p1) fetch(p0, 0);
    for (int c = threadIdx.x; c < pairs / 8; c += nthreads) chain_poll8(src + h * pairs + 8 * c, qf + 8 * c, a.scale);
    if (p1 == L)
      for (int c = threadIdx.x; c < D / 4; c += nthreads) {
        const int at = c < D / 8 ? a.H * D + h * D + 8 * c : (a.H + a.Hkv) * D + h * D + 8 * (c - D / 8);
        chain_poll8(src + at, kv + 8 * c, 1.f);
      }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, acc[2] = {0.f, 0.f};
    for (int c0 = p0, b = 0; c0 < p1; c0 += kChainAttnChunk, b ^= 1) {
      const int n = min(kChainAttnChunk, p1 - c0);
      const __half* ks = rows + static_cast<size_t>(2 * b) * kChainAttnChunk * D;
      const __half* vs = ks + kChainAttnChunk * D;
      if (c0 + kChainAttnChunk < p1) {  // the next chunk's copy flies while this one is summed
        fetch(c0 + kChainAttnChunk, b ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      csync();  // the chunk's rows, the queries and the token's k / v are in
      // scores: a warp a position; lanes over the dims, one shuffle reduction a query head
      for (int pl = warp; pl < n; pl += W) {
        const int p = c0 + pl;
        float part[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) part[j] = 0.f;
        for (int d = lane; d < D; d += 32) {
          const float k = p == pos ? kv[d] : __half2float(ks[pl * D + d]);
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (j < gq) part[j] = fmaf(qf[j * D + d], k, part[j]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j >= gq) break;
          float v = part[j];
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
          if (lane == 0) sc[j * kChainAttnChunk + pl] = v;
        }
      }
      csync();
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int e = threadIdx.x + k * nthreads;
        if (e >= pairs) break;
        const int j = e / D, d = e % D;
        const float* sj = sc + j * kChainAttnChunk;
        float mx = m[k];
        for (int pl = 0; pl < n; ++pl) mx = fmaxf(mx, sj[pl]);
        const float alpha = __expf(m[k] - mx);
        float lk = l[k] * alpha, ak = acc[k] * alpha;
        for (int pl = 0; pl < n; ++pl) {
          const float pe = __expf(sj[pl] - mx);
          lk += pe;
          ak = fmaf(pe, c0 + pl == pos ? kv[D + d] : __half2float(vs[pl * D + d]), ak);
        }
        m[k] = mx, l[k] = lk, acc[k] = ak;
      }
      csync();  // the chunk's scores and rows are read before the copies two chunks on
    }
    float* ps = a.part + (static_cast<size_t>(h) * a.splits + s) * gq * (D + 2);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int e = threadIdx.x + k * nthreads;
      if (e >= pairs) break;
      const int j = e / D, d = e % D;
      ps[j * (D + 2) + d] = acc[k];
      if (d == 0) ps[j * (D + 2) + D] = m[k], ps[j * (D + 2) + D + 1] = l[k];
    }
    __threadfence();  // the split's values before its count
    csync();
    if (threadIdx.x == 0) last = atomicAdd(a.count + h, 1u) == static_cast<unsigned>(a.splits - 1);
    csync();
    if (last) {  // every split of kv head h is in: merge them into o's input
      __threadfence();
      if (threadIdx.x == 0) a.count[h] = 0u;  // for the next launch (nobody else touches it in this one)
      const float* ph = a.part + static_cast<size_t>(h) * a.splits * gq * (D + 2);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int e = threadIdx.x + k * nthreads;
        if (e >= pairs) break;
        const int j = e / D, d = e % D;
        // one pass, the running max rescaling the sums (unrolled: 8 splits' loads in flight at once)
        float mx = -INFINITY, den = 0.f, num = 0.f;
#pragma unroll 8
        for (int t = 0; t < a.splits; ++t) {
          const float* pt = ph + (t * gq + j) * (D + 2);
          const float mt = __ldcg(pt + D), lt = __ldcg(pt + D + 1), at = __ldcg(pt + d);
          if (mt == -INFINITY) continue;  // an empty split
          const float m2 = fmaxf(mx, mt), r = __expf(mx - m2), w = __expf(mt - m2);
          den = fmaf(den, r, lt * w);
          num = fmaf(num, r, at * w);
          mx = m2;
        }
        unsigned short bits = __half_as_ushort(__float2half_rn(num / den));
        if (bits == 0xffffu) bits = 0x7fffu;
        unsigned short* op = a.out + h * pairs + e;
        asm volatile("st.relaxed.gpu.global.u16 [%0], %1;" ::"l"(op + static_cast<size_t>(par) * a.H * D), "h"(bits)
                     : "memory");
        op[static_cast<size_t>(par ^ 1) * a.H * D] = 0xffffu;
      }
    }
    csync();  // the scratch is free for the block's next unit
  }
}

// chain11_kernel's kFeed: where the consumers' weights come from.
constexpr int kFeedNone = 0;     // forms 11-13: each lane's own loads, a register ring
constexpr int kFeedWarp = 1;     // form 14: a feed warp's shared-memory rings, a register ring
constexpr int kFeedChunks = 2;   // form 16: a feed warp's rings, summed chunk by chunk
constexpr int kFeedSelf = 3;     // form 17: every warp fills its own ring, summed chunk by chunk

template <int kGroup, bool kZeros, int kD, bool kM1, bool kPaired, int kFeed, int kChunk = 4, bool kHalves = false,
          bool kLean = false, bool kNorm = false, bool kDecode = false>
__global__ void __launch_bounds__(kChain11MaxWarps * 32, 1)
    chain11_kernel(const Chain5Op* __restrict__ ops, int nops, ChainShape sh, unsigned* sync,
                   unsigned long long* wait_cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // bulk copies and mbarrier waits need sm_90: the host launches this on compute capability 9.x only
#else
  using T = __half;
  constexpr bool kGrouped = Chain11Format<kGroup, kZeros>::kGrouped;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // form 14: warp W is the feed; nthreads: the consumers
  constexpr bool kFeedWarpToo = kFeed == kFeedWarp || kFeed == kFeedChunks;  // one more warp: the feed
  constexpr bool kChunked = kFeed == kFeedChunks || kFeed == kFeedSelf;
  const int W = (blockDim.x >> 5) - (kFeedWarpToo ? 1 : 0), G = gridDim.x, nthreads = W * 32;
  const int g = lane >> 2, t = lane & 3;
  const int M = sh.M, xg = sh.x_cap / 128;

  extern __shared__ __align__(128) unsigned char chain_smem[];
  float* sums = reinterpret_cast<float*>(chain_smem);
  T* xs = reinterpret_cast<T*>(chain_smem + (static_cast<size_t>(sh.sums) * 4 + 15) / 16 * 16);
  float* xsum = reinterpret_cast<float*>(xs + static_cast<size_t>(M) * sh.x_cap);  // [M][x_cap / 128]
  for (int q = threadIdx.x; q < sh.sums; q += nthreads) sums[q] = 0.f;
  // Form 14: the consumers' rings; the feed warp leaves for its loop.
  [[maybe_unused]] const Chain14Ring rg(chain_smem, sh, W);
  if constexpr (kFeed) {
    for (int q = threadIdx.x; q < W * rg.C; q += blockDim.x) mbar_init(rg.full + q, 1), mbar_init(rg.empty + q, 1);
    mbar_init_fence();
  }
  if constexpr (kChunked) {  // the block's schedule records
    for (int q = threadIdx.x; q < sh.classes * (W + 1); q += blockDim.x)
      rg.tab[q] = sh.cursors[(static_cast<size_t>(q / (W + 1)) * G + (kStamps ? (blockIdx.x + sh.rotate) % G : blockIdx.x)) *
                                 (W + 1) + q % (W + 1)];
  }
  __syncthreads();
  if constexpr (kFeedWarpToo) {
    if (warp == W) {
      chain14_feed(ops, nops, W, rg, sh.skip);
      return;
    }
  }
  // The block's barrier among the consumers (form 14: not the feed warp).
  auto csync = [&] {
    if constexpr (kFeed) asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
    else __syncthreads();
  };
  const bool timed = wait_cycles && threadIdx.x == 0;
  // The lab's cycle counts (thread 0 of the block, when timed), in shared memory, not in registers
  // every thread would hold: spinning (forms 14-17: waiting for the feed), waiting for the block's
  // warps, finishing, preparing.
  // Then, per op class (Chain5Op::cls), its preparing and finishing cycles.
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
  // Form 12: this launch's epoch (1..32767; the previous launch left its count in sync[nops]).
  // kHalves (ChainShape::paired 2, M = 1): fp16 halves instead, 0xffff while not written; each buffer holds
  // two copies, the launch's parity selecting one (the row of M = 2): a launch writes its copy and poisons the
  // other, which the next launch writes (chain_half_ready).
  const unsigned launch = kPaired ? __ldcg(sync + nops) : 0u;
  const unsigned epoch = kPaired ? launch % 32767u + 1u : 0u;
  [[maybe_unused]] const int par = static_cast<int>(launch & 1u);
  const long long t_begin = timed ? clock64() : 0;

  // ---- the issue side
  auto make_issue = [&] {
    if constexpr (kFeed == kFeedWarp) return Chain14Take<kD, kGrouped, kZeros>(rg, ops, nops, W);
    else if constexpr (kFeed == kFeedNone) return Chain11Issue<kD, kGrouped, kZeros>(ops, nops, sh, lane);
    else return 0;  // forms 16 and 17 read their rings themselves
  };
  auto is = make_issue();
  if constexpr (kFeed == kFeedWarp) is.timed = timed;

  // ---- the consumer side
  int i = -1;  // the op being consumed
  Chain11Cursor cur{0, 0, 0, 0, 0, 1, 0, 0, 0};
  Chain11Seg<kGrouped, kZeros, kM1, kLean> seg;
  const int tokx = min(g, M - 1), tok0 = min(2 * t, M - 1), tok1 = min(2 * t + 1, M - 1);

  // Op o's input: global (written by other blocks in this launch: through L2)
  // -> xs, the high-nibble positions / 16, and 2^-24 x the sums of each 128.
  auto prep_input = [&](const GemvParams& p, int o_flags, int cls, [[maybe_unused]] int oi) {
    if (sh.skip & 2) return;  // lab: no hand-off at all (results wrong)
    const long long b0 = timed ? clock64() : 0;
    csync();  // thread 0's spin is over; every warp is past the last op's reads of xs
    const long long p0 = timed ? clock64() : 0;
    if (timed) t_warps += p0 - b0;
    const int chunks = p.K / 8;
    if constexpr (kNorm) {
      // form 20 with ChainShape::norms (M = 1): RMSNorm of the input on the way in (chain_norm_input)
      if (const void* norm = sh.norms[oi]) {
        chain_norm_input(p, o_flags, par, norm, sh.norm_eps, chunks, nthreads, csync, xs, xsum, (sh.skip & 1) != 0);
        csync();
        if (timed) {
          const long long v = clock64() - p0;
          t_prep += v;
          per_class(cls, 0, v);
        }
        if (kStamps && timed && sh.stamps) t_mark[0] = clock64(), stamp(oi, 2, t_mark[0] - t_mark[1]), stamp(oi, 4, gtime());
        return;
      }
    }
    if constexpr (kHalves && kLean) {  // form 20: the input copied at once
      const bool plain = (o_flags & kChainPlainX) != 0;
      const uint16_t* x16 = static_cast<const uint16_t*>(p.x) + (plain ? size_t{0} : static_cast<size_t>(par) * p.ldx);
      chain_async_input(reinterpret_cast<const uint4*>(x16), chunks, nthreads, xs, xsum, plain || (sh.skip & 1));
    } else {
      // chunks in flight per thread: the L2 loads first, then the math (4 spilled in form 12; form 12
      // with kD = 4 spills at 2, and more at 1; form 17 with 4, down's 14336 inputs in one round: 1.8 us
      // a layer slower on the H200; form 18 with 4: 1.5 slower, 124 registers against 118, though
      // down's preparation fell from 1.63 to 1.37)
      constexpr int kU = 2;
      for (int m = 0; m < M; ++m)
        for (int cb = warp * 32; cb < chunks; cb += kU * W * 32) {  // warp-uniform (the shuffles)
          uint4 vs[kU];
          if (kHalves && !(o_flags & kChainPlainX)) {
            // 8 halves a chunk, this launch's copy, polled until none is the poison
            const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + static_cast<size_t>(par) * p.ldx);
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int c = cb + u * W * 32 + lane;
              if (c < chunks) vs[u] = ld_relaxed_gpu_v4(src + c);
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int c = cb + u * W * 32 + lane;
              if (c < chunks)
                while (!(sh.skip & 1) && !chain_half_ready(vs[u])) vs[u] = ld_relaxed_gpu_v4(src + c);
            }
          } else if (kPaired && !(o_flags & kChainPlainX)) {
            // 8 words a chunk, polled until all carry this launch's epoch
            const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(p.x) + static_cast<size_t>(m) * p.ldx);
            uint4 a[kU], b[kU];
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int c = cb + u * W * 32 + lane;
              if (c < chunks) a[u] = ld_relaxed_gpu_v4(src + 2 * c), b[u] = ld_relaxed_gpu_v4(src + 2 * c + 1);
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int c = cb + u * W * 32 + lane;
              if (c < chunks) {
                // (skip & 1, the lab: take the words as they are, to time the hand-off without the grid's waits)
                while (!(sh.skip & 1) && (!paired_ready(a[u], epoch) || !paired_ready(b[u], epoch)))
                  a[u] = ld_relaxed_gpu_v4(src + 2 * c), b[u] = ld_relaxed_gpu_v4(src + 2 * c + 1);
                vs[u] = make_uint4(__byte_perm(a[u].x, a[u].y, 0x5410), __byte_perm(a[u].z, a[u].w, 0x5410),
                                   __byte_perm(b[u].x, b[u].y, 0x5410), __byte_perm(b[u].z, b[u].w, 0x5410));
              }
            }
          } else {
            const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + static_cast<size_t>(m) * p.ldx);
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int c = cb + u * W * 32 + lane;
              if (c < chunks) vs[u] = __ldcg(src + c);
            }
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int c = cb + u * W * 32 + lane;
            if (cb + u * W * 32 >= chunks) break;
            float s = 0.f;
            if (c < chunks) {
              uint4 v = vs[u];
              s = chain_nibble_input(v);
              reinterpret_cast<uint4*>(xs + static_cast<size_t>(m) * sh.x_cap)[c] = v;
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (c < chunks && lane % 16 == 0) xsum[m * xg + c / 16] = s * 0x1p-24f;
          }
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

  // Every warp is past op i: finish the block's panels, count the block, wait for the others.
  auto op_end = [&](int oi) {
    const Chain5Op& o = ops[oi];
    const GemvParams& p = o.p;
    if (sh.skip & 2) return;  // lab: no hand-off at all (results wrong)
    int u0, u1;
    if constexpr (kChunked) {
      const int4 r = rg.tab[o.cls * (W + 1) + W];
      u0 = r.x, u1 = r.y;
    } else {
      chain_range32(static_cast<unsigned>(chain8_units(o)), blockIdx.x, G, u0, u1);
    }
    const int ppu = chain8_ppu(o), vals = kPanelRows * M;
    if constexpr (kDecode && kHalves) {
      if (o.flags & kChainRope) {  // stage 2: q/k/v, rotated, into its output and the cache
        const long long f0 = timed ? clock64() : 0;
        csync();
        chain_rope_finish(sh.attn[o.attn], *sh.pos, par, sums, u0, (u1 - u0) * vals, static_cast<unsigned short*>(p.y),
                          p.ldy, nthreads);
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
    const bool pres = kPaired && !(o.flags & kChainPlainRes), py = kPaired && !(o.flags & kChainPlainY);
    // (a paired residual was some earlier op's input: every block has seen all of it)
    auto res_at = [&](int tok, int row) {
      const size_t at = static_cast<size_t>(tok) * p.N + row;
      if constexpr (kHalves)  // the launch's copy (M = 1: tok 0)
        if (pres) return to_float(__ldcg(static_cast<const T*>(o.res) + static_cast<size_t>(par) * p.N + row));
      return pres ? __half2float(__ushort_as_half(static_cast<unsigned short>(__ldcg(static_cast<const uint32_t*>(o.res) + at))))
                  : to_float(__ldcg(static_cast<const T*>(o.res) + at));
    };
    float res0 = 0.f;
    if (resid && threadIdx.x < count)
      res0 = res_at((threadIdx.x % vals) / kPanelRows,
                    static_cast<int>(u0 + threadIdx.x / vals) * kPanelRows + threadIdx.x % kPanelRows);
    const long long f0 = timed ? clock64() : 0;
    if (kStamps && timed && sh.stamps) stamp(oi, 0, f0 - t_mark[0]);
    csync();
    const long long f1 = timed ? clock64() : 0;
    for (int q = threadIdx.x; q < count; q += nthreads) {
      const int u = q / vals, tok = (q % vals) / kPanelRows, r = q % kPanelRows;
      float* sp = sums + (static_cast<size_t>(u * ppu) * M + tok) * kPanelRows + r;
      float v = to_float(from_float<T>(*sp));
      if (silu) {
        float* up = sp + M * kPanelRows;
        v = v / (1.f + __expf(-v)) * to_float(from_float<T>(*up));
        *up = 0.f;
      }
      const int row = static_cast<int>(u0 + u) * kPanelRows + r;
      if (resid) v += q == threadIdx.x ? res0 : res_at(tok, row);
      const size_t at = static_cast<size_t>(tok) * p.ldy + row;
      if (kHalves && py) {  // M = 1: tok 0; the other copy poisoned for the next launch
        unsigned short bits = __half_as_ushort(__float2half_rn(v));
        if (bits == 0xffffu) bits = 0x7fffu;  // a NaN, never the poison
        unsigned short* yp = static_cast<unsigned short*>(p.y) + row;
        asm volatile("st.relaxed.gpu.global.u16 [%0], %1;" ::"l"(yp + static_cast<size_t>(par) * p.ldy), "h"(bits) : "memory");
        yp[static_cast<size_t>(par ^ 1) * p.ldy] = 0xffffu;
      } else if (py) {
        const uint32_t word = __half_as_ushort(__float2half_rn(v)) | (epoch << 16);
        asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(static_cast<uint32_t*>(p.y) + at), "r"(word) : "memory");
      } else {
        static_cast<T*>(p.y)[at] = from_float<T>(v);
      }
      *sp = 0.f;
    }
    if constexpr (kPaired) {  // no count: the words say when they are there
      if (oi + 1 == nops && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(sync + nops, 1u);  // the next epoch
      if (timed) {
        const long long v = clock64() - f1;
        t_warps += f1 - f0, t_finish += v;
        per_class(o.cls, 1, v);
      }
      if (kStamps && timed && sh.stamps) t_mark[1] = clock64(), stamp(oi, 1, t_mark[1] - f0), stamp(oi, 3, gtime());
      return;
    }
    csync();  // the block's outputs of op oi are written
    if (timed) t_warps += f1 - f0, t_finish += clock64() - f1;
    if (threadIdx.x == 0) {
      if (oi + 1 == nops) {
        // Nobody polls the last counter, and every block that counted itself
        // in it is past every other poll: the last one resets them all.
        __threadfence();
        if (atomicAdd(sync + oi, 1u) == static_cast<unsigned>(G - 1)) {
          __threadfence();
          for (int j = 0; j < nops; ++j) atomicExch(sync + j, 0u);
        }
      } else if (!(sh.skip & 1)) {
        // A release reduction (the block's outputs, ordered before it by the
        // barrier, are visible to whoever acquires the count), no return
        // value: the first poll leaves at once.
        red_release_add_gpu(sync + oi, 1u);
        const long long s0 = timed ? clock64() : 0;
        while (ld_acquire_gpu(sync + oi) < static_cast<unsigned>(G)) {
        }
        if (timed) t_spin += clock64() - s0;
      }
    }
  };

  // The segment's sums (2^-24 of the true ones) into the block's buffer.
  auto seg_flush = [&] {
    float* sp = sums + static_cast<size_t>(cur.vp) * M * kPanelRows;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 2 * t + (e & 1);
      if ((!kM1 || (e & 1) == 0) && tok < M) atomicAdd(sp + tok * kPanelRows + g + (e >= 2 ? 8 : 0), seg.value(e));
    }
  };

  // Past a segment's last tile (or before the first): the next segment, through op ends.  false: done.
  auto boundary = [&]() -> bool {
    seg.close(cur, seg_flush);
    while (cur.pos >= cur.end) {
      if (i >= 0) op_end(i);
      if (++i >= nops) return false;
      if constexpr (kChunked) chain16_start(ops[i], rg.tab, warp, W, cur);
      else chain11_start(ops[i], blockIdx.x, G, warp, W, cur);
      if constexpr (kDecode && kHalves) {
        if (ops[i].flags & kChainAttnIn) {  // stage 2: the layer's attention writes this op's input
          const long long a0 = timed ? clock64() : 0;
          csync();  // every warp is past the last op's reads of xs, the attention's scratch
          chain_attention(sh.attn[ops[i].attn], *sh.pos, par, nthreads, csync, reinterpret_cast<float*>(xs));
          if (timed) t_prep += clock64() - a0;
        }
      }
      prep_input(ops[i].p, ops[i].flags, ops[i].cls, i);
    }
    seg.begin(cur, ops[i], g, xs + static_cast<size_t>(tokx) * sh.x_cap + 8 * t + cur.kt * 128,
              xsum + tok0 * xg + cur.kt, xsum + tok1 * xg + cur.kt);
    return true;
  };

  if constexpr (kChunked) {
    constexpr int kTs = kChainTileBytes + chain_meta_bytes(kGroup, kZeros);
    if constexpr (kFeed == kFeedChunks)
      chain16_consume<kChunk, kTs, kGrouped, kZeros>(rg, seg, boundary, timed, t_spin);  // t_spin: waiting for the feed
    else
      chain17_consume<kChunk, kTs, kGrouped, kZeros, kLean>(rg, ops, nops, W, sh.skip, seg, boundary, timed, t_spin);
  } else {
    chain11_consume<kD>(is, seg, boundary, [] {});
    if constexpr (kFeed) t_spin = is.waited;  // form 14: no spin; the cycles waiting for the feed instead
  }
  if (timed) {
    chain_add_cycles(wait_cycles, ChainCycles{{t_spin, t_warps, t_finish, t_prep, clock64() - t_begin}});
    for (int k = 0; k < 2 * kChainMaxClasses; ++k)  // after the SM id: [(6 + k) blocks + b]
      atomicAdd(wait_cycles + (6 + k) * gridDim.x + blockIdx.x, static_cast<unsigned long long>(t_acc[4 + k]));
  }
#endif
}

// Form 11's kernel (form 12: paired activations; form 14: paired, with the
// feed warp) for kD = sh.stage_tiles (2 or 4) and M; f(kernel); false when
// there is none.
template <int kGroup, bool kZeros, bool kPaired, int kFeed, typename F>
bool chain11_dispatch_p(const ChainShape& sh, F&& f) {
  const bool m1 = sh.M == 1;
  if (sh.stage_tiles == 2)
    m1 ? f(chain11_kernel<kGroup, kZeros, 2, true, kPaired, kFeed>)
       : f(chain11_kernel<kGroup, kZeros, 2, false, kPaired, kFeed>);
  else if (sh.stage_tiles == 4)
    m1 ? f(chain11_kernel<kGroup, kZeros, 4, true, kPaired, kFeed>)
       : f(chain11_kernel<kGroup, kZeros, 4, false, kPaired, kFeed>);
  else
    return false;
  return true;
}
template <int kGroup, bool kZeros, typename F>
bool chain11_dispatch(const ChainShape& sh, F&& f) {
  return sh.paired ? chain11_dispatch_p<kGroup, kZeros, true, kFeedNone>(sh, f)
                   : chain11_dispatch_p<kGroup, kZeros, false, kFeedNone>(sh, f);
}

template <int kGroup, bool kZeros>
bool chain11_fits(const ChainShape& sh, int warps) {
  if (warps < 1 || warps > kChain11MaxWarps || sh.M > 8) return false;
  return chain_kernel_fits([&](auto&& f) { return chain11_dispatch<kGroup, kZeros>(sh, f); }, chain11_smem_bytes(sh),
                           warps * kWarpSize);
}

template <int kGroup, bool kZeros>
Status chain11_launch(const Chain5Op* d_ops, int nops, const ChainShape& sh, unsigned* d_sync, int blocks, int warps,
                      cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > kChain11MaxWarps || blocks < 1 || nops < 1 || sh.M > 8) return Status::kBadShape;
  return chain_kernel_launch([&](auto&& f) { return chain11_dispatch<kGroup, kZeros>(sh, f); }, d_ops, nops, sh,
                             d_sync, blocks, warps * kWarpSize, chain11_smem_bytes(sh), stream, wait_cycles);
}

// Form 14: `warps` consumer warps and the feed warp (16 warps in all at most:
// a 17th would leave 96 registers a thread, as one SM quarter would hold 5
// warps); sh.paired set, sh.stages ring slots per consumer warp (a multiple
// of sh.chunk, more than kD).  Forms 16 and 17 (sh.chunked): chunks of 2-4
// tiles and sh.meta_bytes the format's (both compiled in), kD = 2 (unused),
// and the schedule (sh.cursors, sh.classes: chain16_schedule for these blocks
// and warps).
template <int kGroup, bool kZeros, typename F>
bool chain14_dispatch(const ChainShape& sh, F&& f) {
  if (!sh.chunked) return chain11_dispatch_p<kGroup, kZeros, true, kFeedWarp>(sh, f);
  if (sh.meta_bytes != chain_meta_bytes(kGroup, kZeros) || sh.stage_tiles != 2) return false;
  auto chunk = [&](auto feed) {  // forms 16 and 17: the chunk's tiles compiled in (2, 3 or 4)
    constexpr int kFeed = decltype(feed)::value;
    const bool m1 = sh.M == 1;
    if constexpr (kFeed == kFeedSelf) {
      if (sh.chunked == 3) {  // form 20: form 18's halves, the lean loop and the input copied at once, M = 1, chunks of 2; norm: the RMSNorms
        if (!m1 || sh.paired != 2 || sh.chunk != 2) return false;
        if (sh.norms) f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 2, true, true, true>);
        else f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 2, true, true>);
        return true;
      }
    }
    if (sh.norms) return false;
    if (kFeed == kFeedSelf && sh.paired == 2) {  // halves: form 18, M = 1
      if (!m1) return false;
      if (sh.chunk == 2) f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 2, true>);
      else if (sh.chunk == 4) f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 4, true>);
      else return false;
    } else if (sh.chunk == 2)
      m1 ? f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 2>) : f(chain11_kernel<kGroup, kZeros, 2, false, true, kFeed, 2>);
    else if (sh.chunk == 3)
      m1 ? f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 3>) : f(chain11_kernel<kGroup, kZeros, 2, false, true, kFeed, 3>);
    else if (sh.chunk == 4)
      m1 ? f(chain11_kernel<kGroup, kZeros, 2, true, true, kFeed, 4>) : f(chain11_kernel<kGroup, kZeros, 2, false, true, kFeed, 4>);
    else
      return false;
    return true;
  };
  return sh.chunked >= 2 ? chunk(std::integral_constant<int, kFeedSelf>{})
                         : chunk(std::integral_constant<int, kFeedChunks>{});
}
// Threads of a form 14 block: the consumers and (except form 17) the feed warp.
__host__ inline int chain14_threads(const ChainShape& sh, int warps) {
  return (warps + (sh.chunked >= 2 ? 0 : 1)) * kWarpSize;
}
__host__ inline bool chain14_shape_ok(const ChainShape& sh, int warps) {
  return warps >= 1 && chain14_threads(sh, warps) <= kChain11MaxWarps * kWarpSize && sh.M <= 8 && sh.paired &&
         sh.stages > sh.stage_tiles && sh.chunk >= 1 && sh.stages % sh.chunk == 0 &&
         (!sh.chunked || (sh.chunk >= 2 && sh.chunk <= 4 && sh.stage_tiles == 2 && sh.cursors && sh.classes > 0 &&
                          sh.classes <= kChainMaxClasses));
}

template <int kGroup, bool kZeros>
bool chain14_fits(const ChainShape& sh, int warps) {
  if (!chain14_shape_ok(sh, warps)) return false;
  return chain_kernel_fits([&](auto&& f) { return chain14_dispatch<kGroup, kZeros>(sh, f); },
                           chain14_smem_bytes(sh, warps), chain14_threads(sh, warps));
}

template <int kGroup, bool kZeros>
Status chain14_launch(const Chain5Op* d_ops, int nops, const ChainShape& sh, unsigned* d_sync, int blocks, int warps,
                      cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (!chain14_shape_ok(sh, warps) || blocks < 1 || nops < 1) return Status::kBadShape;
  return chain_kernel_launch([&](auto&& f) { return chain14_dispatch<kGroup, kZeros>(sh, f); }, d_ops,
                             nops, sh, d_sync, blocks, chain14_threads(sh, warps), chain14_smem_bytes(sh, warps), stream,
                             wait_cycles);
}

// ---- Form 13 ----------------------------------------------------------------
// Form 12 without block barriers: every warp runs its own dataflow.
//   * The input lives in shared memory by 128-k slices (one tile's k), each
//     with a flag.  A warp about to use slice s of op i checks its flag; the
//     first warp that needs it claims it, polls the slice's paired words
//     (form 12) in L2, writes the prepared slice (high-nibble positions / 16)
//     and its 2^-24 sum, and sets the flag; others wait on the flag.  So a
//     warp starts on the slices that are there, not when all are.
//   * A panel unit's sums meet in shared memory (atomics), with a count of
//     the tiles summed; the warp that completes the count finishes the unit
//     (round, residual, SiLU * mul) and writes its paired output words.
//   * Op parity double-buffers the input, its sums and counts; a warp enters
//     op i once every warp of the block is past op i - 2 (a shared counter).
// M = 1, int4 per channel or G = 128 with fp16, paired activations (the lab's
// form-12 ops).  Measured: no faster than form 12 (dev/PERSISTENT.md).
constexpr int kChain13MaxWarps = 16;

// One parity's shared memory: sums (sh.sums fp32), unit counts (sh.sums / 16
// u32), the input (x_cap fp16), its slice sums (x_cap / 128 fp32) and flags
// (x_cap / 128 u32); then two done counters.
__host__ __device__ inline size_t chain13_parity_bytes(const ChainShape& sh) {
  const size_t slices = sh.x_cap / 128;
  return (static_cast<size_t>(sh.sums) * 4 + 15) / 16 * 16 + (static_cast<size_t>(sh.sums / 16) * 4 + 15) / 16 * 16 +
         static_cast<size_t>(sh.x_cap) * 2 + (slices * 4 + 15) / 16 * 16 + (slices * 4 + 15) / 16 * 16;
}
__host__ __device__ inline size_t chain13_smem_bytes(const ChainShape& sh) { return 2 * chain13_parity_bytes(sh) + 16; }

__device__ __forceinline__ unsigned ld_volatile_u32(const unsigned* p) { return *static_cast<const volatile unsigned*>(p); }

template <int kGroup, bool kZeros, int kD>
__global__ void __launch_bounds__(kChain13MaxWarps * 32, 1)
    chain13_kernel(const Chain5Op* __restrict__ ops, int nops, ChainShape sh, unsigned* sync,
                   unsigned long long* wait_cycles) {
  using T = __half;
  constexpr bool kGrouped = Chain11Format<kGroup, kZeros>::kGrouped;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = blockDim.x >> 5, G = gridDim.x;
  const int g = lane >> 2, t = lane & 3;
  const unsigned epoch = __ldcg(sync + nops) % 32767u + 1u;

  extern __shared__ __align__(128) unsigned char chain_smem[];
  const size_t pb = chain13_parity_bytes(sh);
  const int slices = sh.x_cap / 128;
  unsigned* done = reinterpret_cast<unsigned*>(chain_smem + 2 * pb);  // [2]: warps past an op of each parity
  for (size_t q = threadIdx.x; q < (2 * pb + 16) / 4; q += blockDim.x) reinterpret_cast<unsigned*>(chain_smem)[q] = 0u;
  __syncthreads();
  // Parity par's buffers.
  auto sums_of = [&](int par) { return reinterpret_cast<float*>(chain_smem + par * pb); };
  auto cnt_of = [&](int par) {
    return reinterpret_cast<unsigned*>(chain_smem + par * pb + (static_cast<size_t>(sh.sums) * 4 + 15) / 16 * 16);
  };
  auto xs_of = [&](int par) {
    return reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(cnt_of(par)) +
                                (static_cast<size_t>(sh.sums / 16) * 4 + 15) / 16 * 16);
  };
  auto xsum_of = [&](int par) { return reinterpret_cast<float*>(xs_of(par) + sh.x_cap); };
  auto flag_of = [&](int par) {
    return reinterpret_cast<unsigned*>(reinterpret_cast<unsigned char*>(xsum_of(par)) + (slices * 4 + 15) / 16 * 16);
  };
  const bool timed = wait_cycles && threadIdx.x == 0;
  long long t_slice = 0, t_done = 0;
  const long long t_begin = timed ? clock64() : 0;

  // ---- the issue side (form 11's)
  Chain11Issue<kD, kGrouped, kZeros> is(ops, nops, sh, lane);

  // ---- the consumer side
  int i = -1, par = 0, kt = 0;
  unsigned want = 0;  // flag value of a ready slice of op i: 2 i + 2 (claimed: 2 i + 1)
  Chain11Cursor cur{0, 0, 0, 0, 0, 1, 0, 0, 0};
  Chain11Seg<kGrouped, kZeros, true> seg;

  // Slice s of op i's input into shared memory (this warp claimed it): 4 elements a lane.
  auto load_slice = [&](int s) {
    const Chain5Op& o = ops[i];
    const size_t at = static_cast<size_t>(s) * 128 + 4 * lane;
    uint32_t h0, h1;
    if (o.flags & kChainPlainX) {
      const uint2 v = __ldcg(reinterpret_cast<const uint2*>(static_cast<const T*>(o.p.x) + at));
      h0 = v.x, h1 = v.y;
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(o.p.x) + at);
      uint4 w = ld_relaxed_gpu_v4(src);
      while (!paired_ready(w, epoch)) {
        __nanosleep(32);
        w = ld_relaxed_gpu_v4(src);
      }
      h0 = __byte_perm(w.x, w.y, 0x5410), h1 = __byte_perm(w.z, w.w, 0x5410);
    }
    const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&h0));
    const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&h1));
    float sum = f0.x + f0.y + f1.x + f1.y;
    // elements 4 lane + 2, + 3 sit at positions 2, 3 or 6, 7 of their 8: they meet high nibbles
    const __half2 q1 = __hmul2(*reinterpret_cast<const __half2*>(&h1), __float2half2_rn(0.0625f));
    *reinterpret_cast<uint2*>(xs_of(par) + at) = make_uint2(h0, *reinterpret_cast<const uint32_t*>(&q1));
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o2);
    if (lane == 0) xsum_of(par)[s] = sum * 0x1p-24f;
    __threadfence_block();
    __syncwarp();
    if (lane == 0) *static_cast<volatile unsigned*>(flag_of(par) + s) = want;
  };
  // Slice s of op i is in shared memory once this returns (warp-uniform).
  auto ensure_slice = [&](int s) {
    unsigned* f = flag_of(par) + s;
    const long long w0 = timed ? clock64() : 0;
    unsigned claimed = 0;
    if (lane == 0) {
      const unsigned v = ld_volatile_u32(f);
      claimed = v < want - 1 && atomicCAS(f, v, want - 1) == v;
    }
    if (__shfl_sync(0xffffffffu, claimed, 0)) {
      load_slice(s);
    } else {
      while (ld_volatile_u32(f) != want) __nanosleep(20);
      __threadfence_block();
    }
    if (timed) t_slice += clock64() - w0;
  };

  // The segment's sums into the unit's; the warp that completes the unit finishes it.
  auto seg_flush = [&] {
    const Chain5Op& o = ops[i];
    float* sums = sums_of(par);
    if (t == 0) {
      atomicAdd(sums + cur.vp * kPanelRows + g, seg.value(0));
      atomicAdd(sums + cur.vp * kPanelRows + g + 8, seg.value(2));
    }
    __threadfence_block();
    __syncwarp();
    const int unit = cur.vp >> cur.shift, ppu = cur.shift + 1;
    unsigned complete = 0;
    if (lane == 0)
      complete = atomicAdd(cnt_of(par) + unit, static_cast<unsigned>(seg.len)) + seg.len ==
                 static_cast<unsigned>(ppu * cur.tpp);
    if (!__shfl_sync(0xffffffffu, complete, 0)) return;
    __threadfence_block();
    if (lane < kPanelRows) {
      const int r = lane;
      float* sp = sums + unit * ppu * kPanelRows + r;
      float v = to_float(from_float<T>(*sp));
      if (ppu == 2) {
        float* up = sp + kPanelRows;
        v = v / (1.f + __expf(-v)) * to_float(from_float<T>(*up));
        *up = 0.f;
      }
      *sp = 0.f;
      const int row = (cur.u0 + unit) * kPanelRows + r;
      if (o.out == static_cast<int>(ChainOut::kResidual)) {
        if (o.flags & kChainPlainRes) {
          v += to_float(__ldcg(static_cast<const T*>(o.res) + row));
        } else {
          const uint32_t* rp = static_cast<const uint32_t*>(o.res) + row;
          uint32_t w;
          asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(w) : "l"(rp));
          while ((w >> 16) != epoch) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(w) : "l"(rp));
          v += __half2float(__ushort_as_half(static_cast<unsigned short>(w)));
        }
      }
      if (o.flags & kChainPlainY) {
        static_cast<T*>(o.p.y)[row] = from_float<T>(v);
      } else {
        const uint32_t word = __half_as_ushort(__float2half_rn(v)) | (epoch << 16);
        asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(static_cast<uint32_t*>(o.p.y) + row), "r"(word));
      }
    }
    if (lane == 0) cnt_of(par)[unit] = 0u;
  };

  auto boundary = [&]() -> bool {
    seg.close(cur, seg_flush);
    while (cur.pos >= cur.end) {
      if (i >= 0) {  // this warp is past op i
        __threadfence_block();
        __syncwarp();
        if (lane == 0) atomicAdd(done + par, 1u);
        if (i + 1 == nops && blockIdx.x == 0 && warp == 0 && lane == 0) atomicAdd(sync + nops, 1u);  // next epoch
      }
      if (++i >= nops) return false;
      chain11_start(ops[i], blockIdx.x, G, warp, W, cur);
      par = i & 1;
      want = 2u * i + 2u;
      // every warp of the block is past op i - 2 (its buffers are this op's)
      const long long w0 = timed ? clock64() : 0;
      const unsigned need = static_cast<unsigned>(W) * static_cast<unsigned>(i >> 1);
      while (ld_volatile_u32(done + par) < need) __nanosleep(32);
      __threadfence_block();
      if (timed) t_done += clock64() - w0;
    }
    kt = cur.kt;
    seg.begin(cur, ops[i], g, xs_of(par) + 8 * t + kt * 128, xsum_of(par) + kt, xsum_of(par) + kt);
    return true;
  };

  chain11_consume<kD>(is, seg, boundary, [&] {
    if (__any_sync(0xffffffffu, ld_volatile_u32(flag_of(par) + kt) != want)) ensure_slice(kt);  // warp-uniform
    ++kt;
  });
  if (timed) chain_add_cycles(wait_cycles, ChainCycles{{t_slice, t_done, 0, 0, clock64() - t_begin}});
}

template <int kGroup, bool kZeros, typename F>
bool chain13_dispatch(const ChainShape& sh, F&& f) {
  if (sh.M != 1) return false;
  if (sh.stage_tiles == 2) f(chain13_kernel<kGroup, kZeros, 2>);
  else if (sh.stage_tiles == 4) f(chain13_kernel<kGroup, kZeros, 4>);
  else return false;
  return true;
}

template <int kGroup, bool kZeros>
bool chain13_fits(const ChainShape& sh, int warps) {
  if (warps < 1 || warps > kChain13MaxWarps) return false;
  return chain_kernel_fits([&](auto&& f) { return chain13_dispatch<kGroup, kZeros>(sh, f); }, chain13_smem_bytes(sh),
                           warps * kWarpSize);
}

template <int kGroup, bool kZeros>
Status chain13_launch(const Chain5Op* d_ops, int nops, const ChainShape& sh, unsigned* d_sync, int blocks, int warps,
                      cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > kChain13MaxWarps || blocks < 1 || nops < 2) return Status::kBadShape;
  return chain_kernel_launch([&](auto&& f) { return chain13_dispatch<kGroup, kZeros>(sh, f); }, d_ops, nops, sh,
                             d_sync, blocks, warps * kWarpSize, chain13_smem_bytes(sh), stream, wait_cycles);
}

}  // namespace qgemv
