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
// Form 4 (the earlier three are in git and in dev/PERSISTENT.md): a producer
// warp that never waits for an activation.
//   * One block per SM.  Every op's weight tiles, in their stored order
//     (16-row panels, each panel's K tiles in a row: one contiguous stream),
//     are cut into as many equal contiguous ranges as there are blocks; block
//     b owns range b of every op.  So every block streams the same bytes of
//     every op, whatever the shape, and no item list is needed.
//   * Warp W (the producer) walks the block's ranges of all ops in order and
//     copies them, `stage_tiles` tiles a stage, into a ring of `stages`
//     stages in shared memory with bulk copies (cp.async.bulk, completing on
//     the stage's mbarrier).  It waits only for a free stage, never for an
//     activation, so while the block waits for op i's input the ring fills
//     with op i's (and op i+1's) weights.
//   * Grouped int4's scales and zero points are read in the same stream:
//     `meta`, a copy of them in tile order made once on the host (16 rows x
//     groups of the tile, fp16 scales then uint8 zeros, padded to 16 bytes).
//   * Warps 0..W-1 (the consumers) take the stage's tiles round-robin and
//     run qgemv's GEMV lane code (GemvMma) on them; a warp adds its fp32
//     partial sums of each panel it touched into the op's fp32 output with
//     atomics (red.add).
//   * Dependencies: after its last tile of op i a block counts itself in
//     sync[i]; before op i+1 it waits until sync[i] holds every block (one
//     thread spins with ld.acquire.gpu).  Then its consumers build op i+1's
//     input in shared memory from op i's fp32 output (ChainInput: rounding,
//     residual add, SiLU * mul), each block the whole input, so no second
//     barrier is needed for the glue.  The residual stream lives in each
//     block's shared memory.
//   * Op i's fp32 output is zeroed (a slice per block) once every block has
//     built op i+1's input; the last block out resets the counters, so a
//     graph replay starts clean.
//
// Not deterministic: a panel's partial sums (one per warp that touched it)
// meet in an fp32 atomic, in the order they arrive.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_mma.cuh"
#include "mbarrier.cuh"

namespace qgemv {

// How an op's input is built from the previous op's fp32 output `prev`
// ([M, prev N]); every value is rounded to the activation type where the
// per-op chain would round it.
enum class ChainInput : int {
  kExternal = 0,  // x = x_in ([M, K], row stride K); the residual stream = x
  kRound = 1,     // x = prev[:, :K]                 (attention's stand-in: o reads q)
  kResidual = 2,  // x = prev + residual; residual = x
  kSiluMul = 3,   // x = silu(prev[:, k]) * prev[:, K + k]   (prev = [gate | up])
};

// One op of a chain.  p: qweight, scales, zeros, M, N, K, Kp (= K), group_size
// (x, y, ldx, ldy, perm unused).  N % 16 == 0, K % tile_k == 0.
struct ChainOp {
  GemvParams p;
  const uint8_t* meta;  // grouped int4: per-tile scales / zeros (chain_meta_bytes each), else nullptr
  float* acc;           // [M, N] fp32, zero before the first launch; the kernel leaves it zero
  const void* x_in;     // kExternal's activations
  int input;            // ChainInput
};

// The launch's geometry (the host's choice; chain_smem_bytes sizes it).
struct ChainShape {
  int stage_tiles;  // tiles per ring stage
  int stages;       // ring depth
  int meta_bytes;   // per tile: 0, or chain_meta_bytes
  int x_cap;        // the largest K (elements per token of the input buffer)
  int width;        // the residual stream's width (elements per token)
  int M;            // tokens
  int skip;         // 0; lab timing experiments only (results wrong): 1 no waits, 2 no input build, 4 no tile math,
                    //    8 a bulk copy per tile
};

constexpr int kChainTileBytes = kPanelRows * kTileBytes;  // 1 KB: one tile of one panel
constexpr int kChainMaxWarps = 12;                        // consumer warps

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

__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// ops[nops]; sync[nops + 1] zeroed before the first launch (the kernel leaves
// it zeroed); out: [M, width], the last op's output plus the residual stream.
// wait_cycles: nullptr, or [3 x blocks] counters to which each block adds the
// cycles its thread 0 spent spinning on other blocks ([b]), building inputs
// ([blocks + b]) and waiting for weight stages to land ([2 blocks + b]).
template <typename T, int kBits, int kGroup, bool kZeros>
__global__ void __launch_bounds__((kChainMaxWarps + 1) * 32, 1)
    chain_kernel(const ChainOp* __restrict__ ops, int nops, ChainShape sh, unsigned* sync, T* out,
                 unsigned long long* wait_cycles) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, 1, 1>;
  constexpr int kTileK = Lane::kTileK;
  constexpr int kGpt = Lane::kGroupsPerTile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = (blockDim.x >> 5) - 1;  // consumer warps; warp W is the producer
  const int G = gridDim.x;
  const int S = sh.stages, TS = sh.stage_tiles;
  const int stage_bytes = TS * (kChainTileBytes + sh.meta_bytes);

  extern __shared__ __align__(128) unsigned char chain_smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(chain_smem);
  uint64_t* empty = full + S;
  unsigned char* ring = chain_smem + ((2 * S * 8 + 127) / 128) * 128;
  T* xs = reinterpret_cast<T*>(ring + static_cast<size_t>(S) * stage_bytes);
  T* resid = xs + static_cast<size_t>(sh.M) * sh.x_cap;

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, W);
    }
    mbar_init_fence();
  }
  __syncthreads();

  auto tiles_of = [](const ChainOp& o) { return static_cast<long long>(o.p.N / kPanelRows) * (o.p.K / kTileK); };

  if (warp == W) {  // ---- the producer: every op's range, stage by stage, never waiting on an activation
    if (lane == 0) {
      const uint64_t pol = evict_first_policy();
      uint32_t cnt = 0;
      for (int i = 0; i < nops; ++i) {
        const ChainOp& o = ops[i];
        long long a, e;
        chain_range(tiles_of(o), blockIdx.x, G, a, e);
        for (long long c = a; c < e; c += TS, ++cnt) {
          const int n = static_cast<int>(min(static_cast<long long>(TS), e - c));
          const int slot = cnt % S;
          if (cnt >= static_cast<uint32_t>(S)) mbar_wait(empty + slot, ((cnt / S) - 1) & 1);
          unsigned char* dst = ring + static_cast<size_t>(slot) * stage_bytes;
          mbar_expect_tx(full + slot, static_cast<uint32_t>(n * (kChainTileBytes + sh.meta_bytes)));
          if (sh.skip & 8) {  // lab: one bulk copy per tile instead of one per stage
            for (int j = 0; j < n; ++j)
              bulk_copy(dst + j * kChainTileBytes, static_cast<const char*>(o.p.qweight) + (c + j) * kChainTileBytes,
                        kChainTileBytes, full + slot, pol);
          } else {
            bulk_copy(dst, static_cast<const char*>(o.p.qweight) + c * kChainTileBytes, n * kChainTileBytes,
                      full + slot, pol);
          }
          if (sh.meta_bytes)
            bulk_copy(dst + TS * kChainTileBytes, o.meta + c * sh.meta_bytes, n * sh.meta_bytes, full + slot, pol);
        }
      }
    }
    return;
  }

  // ---- the consumers
  const int nthreads = W * 32, tid = threadIdx.x;
  const int g = lane >> 2, t = lane & 3;
  uint32_t base = 0;  // stages of earlier ops in this block's stream
  long long stall = 0;  // thread 0's cycles waiting for stages (wait_cycles)

  // A slice of acc [M, N] back to zero (block b's share).
  auto zero_slice = [&](const ChainOp& o) {
    const long long n = static_cast<long long>(o.p.M) * o.p.N;
    long long a, e;
    chain_range(n, blockIdx.x, G, a, e);
    for (long long j = a + tid; j < e; j += nthreads) o.acc[j] = 0.f;
  };
  auto wait_for = [&](int i) {  // every block has counted itself in sync[i]
    if (tid == 0 && !(sh.skip & 1)) {
      const long long c0 = wait_cycles ? clock64() : 0;
      while (ld_acquire_gpu(sync + i) < static_cast<unsigned>(G)) {
      }
      if (wait_cycles) atomicAdd(wait_cycles + blockIdx.x, static_cast<unsigned long long>(clock64() - c0));
    }
    consumer_sync(nthreads);
  };
  // Op o's input in xs ([M, x_cap]) from the previous op's fp32 output; the
  // residual stream updated where the input says so.  Each thread takes 4
  // elements a step and kBatch steps at a time, loads first: the loads come
  // from L2 while the weights stream, and one round trip per step would cost
  // microseconds at K = 14336.
  auto build_input = [&](const ChainOp& o, const ChainOp* prev, int K, T* dst, bool to_resid) {
    constexpr int kBatch = 10;  // M = 1, K = 14336 on 12 warps: every load of a build in flight at once
    const int M = o.p.M, input = o.input;
    const int pn = prev ? prev->p.N : 0;
    const int ld = dst == xs ? sh.x_cap : sh.width;
    for (int e0 = tid * 4; e0 < M * K; e0 += nthreads * 4 * kBatch) {
      float v[kBatch][4], u[kBatch][4];
#pragma unroll
      for (int bi = 0; bi < kBatch; ++bi) {
        const int e = e0 + bi * nthreads * 4;
        if (e >= M * K) break;
        const int m = e / K, k = e % K;
        if (input == static_cast<int>(ChainInput::kExternal)) {
          const T* x = static_cast<const T*>(o.x_in) + static_cast<size_t>(m) * K + k;
#pragma unroll
          for (int j = 0; j < 4; ++j) v[bi][j] = to_float(x[j]);
        } else {
          const float4 a4 = __ldcg(reinterpret_cast<const float4*>(prev->acc + static_cast<size_t>(m) * pn + k));
          v[bi][0] = a4.x, v[bi][1] = a4.y, v[bi][2] = a4.z, v[bi][3] = a4.w;
          if (input == static_cast<int>(ChainInput::kSiluMul)) {
            const float4 u4 = __ldcg(reinterpret_cast<const float4*>(prev->acc + static_cast<size_t>(m) * pn + K + k));
            u[bi][0] = u4.x, u[bi][1] = u4.y, u[bi][2] = u4.z, u[bi][3] = u4.w;
          }
        }
      }
#pragma unroll
      for (int bi = 0; bi < kBatch; ++bi) {
        const int e = e0 + bi * nthreads * 4;
        if (e >= M * K) break;
        const int m = e / K, k = e % K;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float x = v[bi][j];
          if (input != static_cast<int>(ChainInput::kExternal)) {
            x = to_float(from_float<T>(x));
            if (input == static_cast<int>(ChainInput::kSiluMul))
              x = x / (1.f + __expf(-x)) * to_float(from_float<T>(u[bi][j]));
            else if (input == static_cast<int>(ChainInput::kResidual))
              x += to_float(resid[static_cast<size_t>(m) * sh.width + k + j]);
          }
          const T r = from_float<T>(x);
          dst[static_cast<size_t>(m) * ld + k + j] = r;
          if (to_resid) resid[static_cast<size_t>(m) * sh.width + k + j] = r;
        }
      }
    }
  };

  for (int i = 0; i < nops; ++i) {
    const ChainOp& o = ops[i];
    const GemvParams& p = o.p;
    if (i > 0) {
      wait_for(i - 1);
      if (i >= 2) zero_slice(ops[i - 2]);  // every block has built op i-1's input from it
    }
    const bool to_resid = o.input == static_cast<int>(ChainInput::kExternal) ||
                          o.input == static_cast<int>(ChainInput::kResidual);
    const long long b0 = wait_cycles && tid == 0 ? clock64() : 0;
    if (!(sh.skip & 2) || i == 0) build_input(o, i > 0 ? &ops[i - 1] : nullptr, p.K, xs, to_resid);
    consumer_sync(nthreads);
    if (wait_cycles && tid == 0) atomicAdd(wait_cycles + G + blockIdx.x, static_cast<unsigned long long>(clock64() - b0));

    const int tpp = p.K / kTileK;
    long long a, e;
    chain_range(tiles_of(o), blockIdx.x, G, a, e);
    const int nstages = static_cast<int>((e - a + TS - 1) / TS);
    int waited = 0, released = 0;  // this warp's stages of the op: full seen, empty arrived
    auto reach = [&](int q) {      // release the stages before q, then wait for q's tiles
      for (; released < q; ++released) {
        const uint32_t c = base + released;
        if (released >= waited) {
          if (lane == 0 || !(sh.skip & 16)) mbar_wait(full + c % S, (c / S) & 1);
          waited = released + 1;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + c % S);
      }
      if (q < nstages && waited <= q) {
        const uint32_t c = base + q;
        const long long f0 = wait_cycles && tid == 0 ? clock64() : 0;
        if (lane == 0 || !(sh.skip & 16)) mbar_wait(full + c % S, (c / S) & 1);
        __syncwarp();  // lane 0's acquire of the stage, shared with the warp
        if (wait_cycles && tid == 0) stall += clock64() - f0;
        waited = q + 1;
      }
    };
    // This warp's tiles: positions warp, warp + W, ... of the op's range; the
    // stage / slot and panel / k-tile of each follow incrementally (divisions
    // once per op: per tile they cost as much as the tile's math).
    const int len = static_cast<int>(e - a);
    int pos = warp;
    if (pos < len) {
      int q = pos / TS, r = pos % TS;
      int panel = static_cast<int>((a + pos) / tpp), kt = static_cast<int>((a + pos) % tpp);
      while (pos < len) {
        Lane L(p, lane, panel, xs, sh.x_cap);
        int j = 0;
        do {
          reach(q);
          const unsigned char* stage = ring + static_cast<size_t>((base + q) % S) * stage_bytes;
          const unsigned char* tile = stage + r * kChainTileBytes;
          uint4 w0[1], w1[1];
          w0[0] = *reinterpret_cast<const uint4*>(tile + g * kTileBytes + 16 * t);
          w1[0] = *reinterpret_cast<const uint4*>(tile + (g + 8) * kTileBytes + 16 * t);
          TileMeta m[1];
          if constexpr (Lane::kGrouped) {
            const unsigned char* mt = stage + TS * kChainTileBytes + r * sh.meta_bytes;
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
          if (sh.skip & 4) {
            if (w0[0].x == 0x12345678u && w1[0].y == 0x9abcdef0u) L.acc[0][0][0][0] += 1.f;  // keeps the reads
          } else if (j & 1) {
            L.template tile<1, false>(kt, w0, w1, m);
          } else {
            L.template tile<0, false>(kt, w0, w1, m);
          }
          ++j;
          pos += W;
          kt += W;
          for (r += W; r >= TS; r -= TS) ++q;
        } while (pos < len && kt < tpp);
        // This warp's partial sums of the panel into the op's output.
#pragma unroll
        for (int i4 = 0; i4 < 4; ++i4) {
          const int row = panel * kPanelRows + g + (i4 >= 2 ? 8 : 0);
          const int tok = 2 * t + (i4 & 1);
          if (tok < p.M) {
            float v = L.acc[0][0][0][i4] + L.acc[1][0][0][i4];
            if constexpr (!Lane::kGrouped) v *= __half2float(static_cast<const __half*>(p.scales)[row]);
            atomicAdd(o.acc + static_cast<size_t>(tok) * p.N + row, v);
          }
        }
        for (; kt >= tpp; kt -= tpp) ++panel;
      }
    }
    reach(nstages);
    base += nstages;
    consumer_sync(nthreads);  // every warp's atomics issued
    if (tid == 0) {
      __threadfence();
      atomicAdd(sync + i, 1u);
    }
  }

  if (wait_cycles && tid == 0) atomicAdd(wait_cycles + 2 * G + blockIdx.x, static_cast<unsigned long long>(stall));
  // The end: the last op's output plus the residual stream -> out (block 0).
  wait_for(nops - 1);
  if (nops >= 2) zero_slice(ops[nops - 2]);
  if (blockIdx.x == 0) {
    ChainOp fin = ops[nops - 1];
    fin.input = static_cast<int>(ChainInput::kResidual);
    build_input(fin, &ops[nops - 1], sh.width, out, false);
    consumer_sync(nthreads);
    for (long long j = tid; j < static_cast<long long>(fin.p.M) * fin.p.N; j += nthreads) fin.acc[j] = 0.f;
  }
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(sync + nops, 1u) == static_cast<unsigned>(G - 1))
      for (int i = 0; i <= nops; ++i) atomicExch(sync + i, 0u);
  }
}

// Shared memory of a launch: the barriers, the ring, the input and the residual stream.
template <typename T>
size_t chain_smem_bytes(const ChainShape& sh) {
  return ((2 * sh.stages * 8 + 127) / 128) * 128 +
         static_cast<size_t>(sh.stages) * sh.stage_tiles * (kChainTileBytes + sh.meta_bytes) +
         static_cast<size_t>(sh.M) * (sh.x_cap + sh.width) * sizeof(T);
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

// Whether the chain can run as one co-resident grid of `blocks` blocks of
// warps + 1 warps: sets the shared-memory attribute and checks that one block
// fits on an SM (the caller passes at most the SM count).
template <typename T, int kBits, int kGroup, bool kZeros>
bool chain_fits(const ChainShape& sh, int warps) {
  auto kernel = chain_kernel<T, kBits, kGroup, kZeros>;
  const size_t smem = chain_smem_bytes<T>(sh);
  if (warps < 1 || warps > kChainMaxWarps) return false;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
      cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it, or the next launch's check reports it
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
Status chain_launch(const ChainOp* d_ops, int nops, const ChainShape& sh, unsigned* d_sync, T* out, int blocks,
                    int warps, cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > kChainMaxWarps || blocks < 1 || nops < 1) return Status::kBadShape;
  chain_kernel<T, kBits, kGroup, kZeros><<<blocks, (warps + 1) * kWarpSize, chain_smem_bytes<T>(sh), stream>>>(
      d_ops, nops, sh, d_sync, out, wait_cycles);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

}  // namespace qgemv
