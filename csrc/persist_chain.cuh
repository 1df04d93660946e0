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
// Three forms were measured on the H200 (dev/persist_lab.cu, dev/PERSISTENT.md
// has the numbers; the first two are in git): (1) block items of whole 16-row
// panels, (2) warp items with k-splits and per-warp polling, (3) this one.
// None beats the per-op GEMVs yet.
//   * Work items are (op, unit, k-split): a run of `chunk` k-tiles of one
//     16-row panel (of a gate and an up panel for SiLU * mul).  The host
//     picks each op's split so that every block of the grid gets the same
//     number of tiles of every op, within one item (chain_split), and deals
//     the items round-robin in op order (chain_schedule).  A block's warps
//     split its item's tiles (warp w takes t0 + w, t0 + w + W, ...) and meet
//     in shared memory.
//   * Weights never depend on activations.  Each warp's cp.async ring (kS
//     tiles) streams its tiles of the block's list in order, running on from
//     one item into the next and across op boundaries, so while the block
//     waits for an input its next tiles are already on the way.
//   * A block stores its item's fp32 partial sums ([split][M][N] per op) and
//     counts itself in the unit's arrival counter; the last of a unit's
//     splits sums the partials in split order (deterministic), applies the
//     epilogue, writes the op's output, resets the arrival counter and counts
//     the unit in its op's completion counter.
//   * Thread 0 of a block about to read an op's input spins (ld.acquire.gpu)
//     until the op it depends on has completed every unit; an op seen
//     complete is not waited for again.  The last block out resets the
//     completion counters, so the next launch (a graph replay) starts from
//     zero.
//   * The grid is co-resident: blocks = SMs x resident blocks per SM, from the
//     occupancy API (chain_blocks_per_sm); a larger grid would spin forever.
//
// Every op's activations, partials and output are its own buffers, written
// once per launch, so no SM can hold a stale line of them in L1; partials are
// read through L2 (__ldcg) all the same.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv_mma.cuh"

namespace qgemv {

enum class ChainEpilogue : int { kStore = 0, kResidual = 1, kSiluMul = 2 };

// One op of a chain: y = epilogue(x @ W^T).  GemvParams: x, ldx, y, ldy, M,
// N, K (a multiple of the tile: 128 int4, 64 int8), Kp, scales, zeros,
// group_size; perm and warps_per_block unused.  With kSiluMul, W's rows are
// [gate; up] (N / 2 each, N / 2 a multiple of 16) and y is [M, N / 2]:
// silu(g) * u, g and u each rounded to the activation type first (what a
// gate/up GEMV followed by an elementwise kernel computes).  The plan
// (chain_split) fills units, splits and chunk; the caller gives partial
// (fp32, splits x M x N) and arrivals (units counters, zeroed once).
struct ChainOp {
  GemvParams p;
  const void* res;     // kResidual: [M, N] with row stride ldy, added to the fp32 result
  int epilogue;        // ChainEpilogue
  int dep;             // index of the op whose output this op reads, or -1
  int units;           // 16-row panels (kSiluMul: gate panels)
  int splits;          // k-splits per unit
  int chunk;           // k-tiles per split (the last may have fewer)
  float* partial;      // [splits][M][N]
  unsigned* arrivals;  // [units]
};

// ld.acquire.gpu of a counter that other blocks release.
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The kernel.  ops[nops]; sched: every block's items (block b's in
// sched[off[b] .. off[b + 1])), each (op << 20 | item), item = unit x splits
// + split; done[nops + 1]: per-op completion counters (the last counts
// finished blocks).  wait_cycles: nullptr, or [blocks] counters to which
// thread 0 adds the SM cycles it spun.
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
__global__ void __launch_bounds__(512, 1)
    chain_kernel(const ChainOp* __restrict__ ops, int nops, const int* __restrict__ sched,
                       const int* __restrict__ off, unsigned* done, unsigned long long* wait_cycles) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, kNT, 1>;
  constexpr int kTileK = Lane::kTileK;
  constexpr int kSlot = 64;
  constexpr int kValues = kNT * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint64_t pol = evict_first_policy();
  const int first = off[blockIdx.x], last = off[blockIdx.x + 1];

  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem) + warp * kS * kSlot + lane;
  float* red = reinterpret_cast<float*>(smem + static_cast<size_t>(nwarps) * kS * kSlot * sizeof(uint4));
  __shared__ unsigned s_before;

  auto silu_of = [](const ChainOp& o) { return o.epilogue == static_cast<int>(ChainEpilogue::kSiluMul); };
  auto row_bytes_of = [](const ChainOp& o) { return static_cast<size_t>(kBits == 4 ? o.p.Kp / 2 : o.p.Kp); };
  auto panel_of_unit = [](const ChainOp& o, int u, int s) { return s == 0 ? u : u + o.p.N / 2 / kPanelRows; };
  auto range_of = [&](const ChainOp& o, int item, int& u, int& sp, int& t0, int& t1) {
    u = item / o.splits;
    sp = item - u * o.splits;
    t0 = sp * o.chunk;
    t1 = min(t0 + o.chunk, o.p.K / kTileK);
  };
  auto count_of = [&](int t0, int t1) { return warp < t1 - t0 ? (t1 - t0 - warp + nwarps - 1) / nwarps : 0; };

  // ---- issue side: this warp's tiles (t0 + warp + j W) of every (item, sub-panel), in order.
  int iq = first, isub = 0, ileft = 0;
  const char* src0 = nullptr;
  const char* src1 = nullptr;
  size_t istep = 0;
  auto aim = [&]() {
    while (iq < last) {
      const ChainOp& o = ops[sched[iq] >> 20];
      int u, sp, t0, t1;
      range_of(o, sched[iq] & 0xfffff, u, sp, t0, t1);
      ileft = count_of(t0, t1);
      if (ileft > 0) {
        const int row0 = panel_of_unit(o, u, isub) * kPanelRows, rows = min(kPanelRows, o.p.N - row0);
        const char* panel = static_cast<const char*>(o.p.qweight) + row0 * row_bytes_of(o);
        const size_t tile_stride = static_cast<size_t>(rows) * kTileBytes;
        istep = nwarps * tile_stride;
        src0 = panel + min(g, rows - 1) * kTileBytes + 16 * t + (t0 + warp) * tile_stride;
        src1 = panel + min(g + 8, rows - 1) * kTileBytes + 16 * t + (t0 + warp) * tile_stride;
        return;
      }
      if (++isub == (silu_of(o) ? 2 : 1)) isub = 0, ++iq;
    }
  };
  aim();
  int issued_all = 0;
  auto issue = [&]() {
    if (iq < last) {
      uint4* slot = ring + (issued_all & (kS - 1)) * kSlot;
      cp_async_16(slot, src0, pol);
      cp_async_16(slot + 32, src1, pol);
      src0 += istep;
      src1 += istep;
      if (--ileft == 0) {
        if (++isub == (silu_of(ops[sched[iq] >> 20]) ? 2 : 1)) isub = 0, ++iq;
        aim();
      }
    }
    ++issued_all;
    cp_async_commit();
  };
  int consumed = 0;
#pragma unroll
  for (int j = 0; j < kS - 1; ++j) issue();

  int satisfied = -1;
  for (int q = first; q < last; ++q) {
    const int opi = sched[q] >> 20;
    const ChainOp& o = ops[opi];
    const GemvParams& p = o.p;
    int u, sp, t0, t1;
    range_of(o, sched[q] & 0xfffff, u, sp, t0, t1);
    if (o.dep > satisfied) {
      if (threadIdx.x == 0) {
        const unsigned need = static_cast<unsigned>(ops[o.dep].units);
        const long long c0 = wait_cycles ? clock64() : 0;
        while (ld_acquire_gpu(done + o.dep) < need) {
        }
        if (wait_cycles) atomicAdd(wait_cycles + blockIdx.x, static_cast<unsigned long long>(clock64() - c0));
      }
      __syncthreads();
      satisfied = o.dep;
    }
    const int count = count_of(t0, t1);
    float* part = o.partial + static_cast<size_t>(sp) * p.M * p.N;
    for (int s = 0; s < (silu_of(o) ? 2 : 1); ++s) {
      const int panel = panel_of_unit(o, u, s);
      Lane L(p, lane, panel, static_cast<const T*>(p.x), p.ldx);
      TileMeta cur[1], nxt[1];
      if (Lane::kGrouped && count > 0) L.template load_meta<false>(t0 + warp, cur);
      int tile = t0 + warp;
      for (int j = 0; j < count; ++j, tile += nwarps) {
        uint4 w0[1], w1[1];
        cp_async_wait<kS - 2>();
        const uint4* slot = ring + (consumed & (kS - 1)) * kSlot;
        ++consumed;
        w0[0] = slot[0];
        w1[0] = slot[32];
        issue();
        if (Lane::kGrouped && j + 1 < count) L.template load_meta<false>(tile + nwarps, nxt);
        if (j & 1)
          L.template tile<1, false>(tile, w0, w1, cur);
        else
          L.template tile<0, false>(tile, w0, w1, cur);
        cur[0] = nxt[0];
      }
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          red[(warp * kValues + n * 4 + i) * kWarpSize + lane] = L.acc[0][0][n][i] + L.acc[1][0][n][i];
      __syncthreads();
      for (int v = threadIdx.x; v < kValues * kWarpSize; v += blockDim.x) {
        const int ln = v % kWarpSize, qv = v / kWarpSize, n = qv / 4, i = qv % 4;
        float sum = 0.f;
        for (int w2 = 0; w2 < nwarps; ++w2) sum += red[(w2 * kValues + qv) * kWarpSize + ln];
        const int row = panel * kPanelRows + (ln >> 2) + (i >= 2 ? 8 : 0);
        const int tok = n * 8 + 2 * (ln & 3) + (i & 1);
        if (row < p.N && tok < p.M) part[static_cast<size_t>(tok) * p.N + row] = sum;
      }
      __syncthreads();  // red is rewritten next
    }
    if (threadIdx.x == 0) {
      __threadfence();  // cumulative: the block's partials, seen at the barrier
      s_before = atomicAdd(o.arrivals + u, 1u);
    }
    __syncthreads();
    if (s_before != static_cast<unsigned>(o.splits - 1)) continue;  // uniform: s_before is shared
    __threadfence();
    const int row0 = u * kPanelRows;
    const int rows = silu_of(o) ? kPanelRows : min(kPanelRows, p.N - row0);
    const __half* scales = static_cast<const __half*>(p.scales);
    for (int e = threadIdx.x; e < rows * p.M; e += blockDim.x) {
      const int r = e % kPanelRows, tok = e / kPanelRows, row = row0 + r;
      auto total = [&](int rr) {
        float v = 0.f;
        for (int s2 = 0; s2 < o.splits; ++s2)
          v += __ldcg(o.partial + (static_cast<size_t>(s2) * p.M + tok) * p.N + rr);
        if constexpr (!Lane::kGrouped) v *= __half2float(scales[rr]);
        return v;
      };
      T* y = static_cast<T*>(p.y) + static_cast<size_t>(tok) * p.ldy;
      if (silu_of(o)) {
        const float gv = to_float(from_float<T>(total(row)));
        const float uv = to_float(from_float<T>(total(row + p.N / 2)));
        ActTraits<T>::store(y + row, gv / (1.f + __expf(-gv)) * uv);
      } else {
        float v = total(row);
        if (o.epilogue == static_cast<int>(ChainEpilogue::kResidual))
          v += to_float(static_cast<const T*>(o.res)[static_cast<size_t>(tok) * p.ldy + row]);
        ActTraits<T>::store(y + row, v);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      o.arrivals[u] = 0;
      __threadfence();
      atomicAdd(done + opi, 1u);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done + nops, 1u) == gridDim.x - 1) {
      for (int i = 0; i <= nops; ++i) atomicExch(done + i, 0u);
    }
  }
}

// The split of op o over `workers` (blocks): the k-tiles per item (chunk, at
// least min_chunk) that give the busiest worker the fewest tiles of this op
// when items are dealt round-robin, ties to the larger chunk (fewer items).
// Sets units, splits, chunk.
inline void chain_split(ChainOp& o, int warps, int tile_k, int min_chunk) {
  const bool silu = o.epilogue == static_cast<int>(ChainEpilogue::kSiluMul);
  o.units = num_panels(silu ? o.p.N / 2 : o.p.N);
  const int tiles = o.p.K / tile_k;
  const int per_tile = silu ? 2 : 1;  // panels each tile of an item covers
  long best = -1;
  for (int c = std::min(min_chunk, tiles); c <= tiles; ++c) {
    const int splits = (tiles + c - 1) / c, chunk = (tiles + splits - 1) / splits;
    const long items = static_cast<long>(o.units) * splits;
    const long load = (items + warps - 1) / warps * chunk * per_tile;
    if (best < 0 || load < best || (load == best && chunk > o.chunk)) {
      best = load;
      o.splits = splits;
      o.chunk = chunk;
    }
  }
}

// The schedule: op i's items go to the grid's warps round-robin, continuing
// from where op i - 1 stopped, so that the warps given one item more differ
// from op to op.  Returns sched (op << 20 | item, grouped by warp, each warp's
// items in op order) and off[warps + 1].
inline void chain_schedule(const std::vector<ChainOp>& ops, int warps, std::vector<int>& sched,
                           std::vector<int>& off) {
  std::vector<std::vector<int>> per(warps);
  long c = 0;
  for (size_t op = 0; op < ops.size(); ++op) {
    const long items = static_cast<long>(ops[op].units) * ops[op].splits;
    for (long j = 0; j < items; ++j) per[(c + j) % warps].push_back(static_cast<int>(op) << 20 | static_cast<int>(j));
    c = (c + items) % warps;
  }
  sched.clear();
  off.assign(1, 0);
  for (const auto& v : per) {
    sched.insert(sched.end(), v.begin(), v.end());
    off.push_back(static_cast<int>(sched.size()));
  }
}

// Shared memory: the warps' rings and the reduction buffer (sized for kNT = 2).
template <int kS>
size_t chain_smem_bytes(int warps) {
  return static_cast<size_t>(warps) * kS * 64 * sizeof(uint4) + static_cast<size_t>(warps) * 8 * kWarpSize * sizeof(float);
}

// Resident blocks per SM of this instance at `warps` warps (0 if it cannot run).
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
int chain_blocks_per_sm(int warps) {
  auto kernel = chain_kernel<T, kBits, kGroup, kZeros, kNT, kS>;
  const size_t smem = chain_smem_bytes<kS>(warps);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
      cudaSuccess)
    return 0;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, warps * kWarpSize, smem) != cudaSuccess) return 0;
  return n;
}

// Launch on `blocks` blocks of `warps` warps (blocks at most SMs x
// chain_blocks_per_sm: co-resident).  d_ops / d_sched / d_off / d_done on the
// device, the schedule made for blocks x warps warps; d_done zeroed once
// before the first launch (the kernel re-zeroes it), and so are the ops'
// arrival counters.
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
Status chain_launch(const ChainOp* d_ops, int nops, const int* d_sched, const int* d_off, unsigned* d_done,
                    int blocks, int warps, cudaStream_t stream, unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > 16 || blocks < 1) return Status::kBadShape;
  chain_kernel<T, kBits, kGroup, kZeros, kNT, kS><<<blocks, warps * kWarpSize, chain_smem_bytes<kS>(warps), stream>>>(
      d_ops, nops, d_sched, d_off, d_done, wait_cycles);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

}  // namespace qgemv
