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
// Design:
//   * The grid is co-resident (blocks = SMs x resident blocks per SM, from
//     the occupancy API; the launcher refuses anything else).  Each block
//     walks a static list of work items, built on the host (the schedule):
//     item = (op, panel), a 16-row panel of one op's weight with all of K,
//     split across the block's warps as in the GEMV (gemv_mma.cuh).
//   * Weights never depend on activations.  Each warp's cp.async ring
//     (kStages tiles) streams the tiles of the block's list in order, running
//     on from one item into the next and across op boundaries; one lane also
//     prefetches the weights, scales and zero points of the item `prefetch`
//     places ahead into L2 (cp.async.bulk.prefetch), so that HBM stays busy
//     while the block waits for an input.
//   * Dependencies are counters in global memory, one per op: a block that
//     finishes an item fences its stores and adds 1 to its op's counter; a
//     warp about to read an op's input spins (lane 0, ld.acquire.gpu) until
//     the counter of the op it depends on reaches that op's item count.
//   * The last block to finish resets the counters, so the next launch (a
//     graph replay) starts from zero.
//   * Epilogues: plain store; store plus a residual; SiLU(gate) * up, where
//     an item is a gate panel and the matching up panel of a fused gate/up
//     weight (rows [0, N/2) gate, [N/2, N) up).
//
// Every op's activations and output are their own buffers, written once per
// launch, so no block can hold a stale line of them in L1.
#pragma once

#include <cstdint>
#include <vector>

#include "gemv_mma.cuh"

namespace qgemv {

enum class ChainEpilogue : int { kStore = 0, kResidual = 1, kSiluMul = 2 };

// One op of a chain: a GEMV y = x @ W^T (GemvParams: x, ldx, y, ldy, M, N, K,
// Kp, scales, zeros, group_size; perm and warps_per_block unused) plus its
// epilogue.  With kSiluMul, y is [M, N / 2]: y = silu(g) * u, g and u the
// GEMV's outputs of rows r and N/2 + r, each rounded to the activation type
// first (what a separate gate/up GEMV then an elementwise kernel computes).
struct ChainOp {
  GemvParams p;
  const void* res;  // kResidual: [M, N] with row stride ldy, added to the GEMV's fp32 result
  int epilogue;     // ChainEpilogue
  int dep;          // index of the op whose output this op reads, or -1
  int items;        // work items (panels; kSiluMul: gate panels)
};

// Synchronization modes of the lab (dev/persist_lab.cu A/Bs them; the sum of):
//   kSignalOne  1: after an item, __syncthreads, then thread 0 alone fences and adds 1 (else every thread
//                  fences its own stores before the barrier);
//   kNoFence    2: no fence at all (a timing probe: results may be wrong);
//   kWaitBlock  4: thread 0 waits for an input and the block meets at a barrier (else lane 0 of each warp
//                  waits, and its warp at __syncwarp).
enum : int { kSignalOne = 1, kNoFence = 2, kWaitBlock = 4 };

// ld.acquire.gpu of a counter that other blocks release.
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The kernel.  ops[nops]; sched: every block's items, block b's in
// sched[off[b] .. off[b + 1]), each (op << 20 | item); cnt[nops + 1]: the
// counters (the last one counts finished blocks).  Shared memory: the warps'
// rings, the split-K reduction buffer, the gate values of a kSiluMul item.
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
__global__ void __launch_bounds__(512, 1)
    chain_kernel(const ChainOp* __restrict__ ops, int nops, const int* __restrict__ sched,
                 const int* __restrict__ off, unsigned* cnt, int prefetch, int mode,
                 unsigned long long* wait_cycles) {
  using Lane = GemvMma<T, kBits, kGroup, kZeros, kNT, 1>;
  constexpr int kTileK = Lane::kTileK;
  constexpr int kSlot = 64;  // uint4 per ring slot: 2 rows x 32 lanes
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint64_t pol = evict_first_policy();
  const int first = off[blockIdx.x], last = off[blockIdx.x + 1];

  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem) + warp * kS * kSlot + lane;
  float* red = reinterpret_cast<float*>(smem + static_cast<size_t>(nwarps) * kS * kSlot * sizeof(uint4));
  float* gate = red + nwarps * kNT * 4 * kWarpSize;  // [kPanelRows][16] gate values of a kSiluMul item

  // Item q of this block's list -> (op, panel of sub-panel s).
  auto op_of = [&](int q) { return sched[q] >> 20; };
  auto panel_of_item = [&](const ChainOp& o, int item, int s) {
    return s == 0 ? item : item + o.p.N / 2 / kPanelRows;
  };
  auto subs_of = [](const ChainOp& o) { return o.epilogue == static_cast<int>(ChainEpilogue::kSiluMul) ? 2 : 1; };
  auto row_bytes_of = [](const ChainOp& o) { return static_cast<size_t>(kBits == 4 ? o.p.Kp / 2 : o.p.Kp); };

  // L2 prefetch of item q's weights, scales and zero points (lane 0 of warp 0).
  auto prefetch_item = [&](int q) {
    if (q >= last) return;
    const ChainOp& o = ops[op_of(q)];
    const int item = sched[q] & 0xfffff;
    const int ng = kGroup ? o.p.K / kGroup : 1;
    for (int s = 0; s < subs_of(o); ++s) {
      const int row0 = panel_of_item(o, item, s) * kPanelRows, rows = min(kPanelRows, o.p.N - row0);
      const char* w = static_cast<const char*>(o.p.qweight) + row0 * row_bytes_of(o);
      pdl_prefetch_l2(w, static_cast<uint32_t>(rows * row_bytes_of(o)));
      if constexpr (kGroup != 0) {
        // scales [N, ng] fp16 and zeros [N, ng] uint8: a panel's rows are contiguous;
        // prefetch whole 16-byte pieces around them.
        const uintptr_t sa = reinterpret_cast<uintptr_t>(static_cast<const __half*>(o.p.scales) + row0 * ng);
        const uintptr_t sb = reinterpret_cast<uintptr_t>(static_cast<const __half*>(o.p.scales) + (row0 + rows) * ng);
        pdl_prefetch_l2(reinterpret_cast<const void*>(sa & ~uintptr_t(15)),
                        static_cast<uint32_t>(((sb + 15) & ~uintptr_t(15)) - (sa & ~uintptr_t(15))));
        if (kZeros) {
          const uintptr_t za = reinterpret_cast<uintptr_t>(o.p.zeros + row0 * ng);
          const uintptr_t zb = reinterpret_cast<uintptr_t>(o.p.zeros + (row0 + rows) * ng);
          pdl_prefetch_l2(reinterpret_cast<const void*>(za & ~uintptr_t(15)),
                          static_cast<uint32_t>(((zb + 15) & ~uintptr_t(15)) - (za & ~uintptr_t(15))));
        }
      }
    }
  };
  if (warp == 0 && lane == 0)
    for (int q = first; q < first + prefetch && q < last; ++q) prefetch_item(q);

  // Issue side: this warp's tiles of every (item, sub-panel) of the list, in order.
  int iq = first, isub = 0, ileft = 0;  // item, sub-panel, tiles left of it for this warp
  const char* src0 = nullptr;
  const char* src1 = nullptr;
  size_t istep = 0;
  auto aim = [&]() {  // first tile of (iq, isub) for this warp; skips panels where it has none
    while (iq < last) {
      const ChainOp& o = ops[op_of(iq)];
      const int nclean = o.p.K / kTileK;
      ileft = warp < nclean ? (nclean - warp + nwarps - 1) / nwarps : 0;
      if (ileft > 0) {
        const int row0 = panel_of_item(o, sched[iq] & 0xfffff, isub) * kPanelRows;
        const int rows = min(kPanelRows, o.p.N - row0);
        const char* panel = static_cast<const char*>(o.p.qweight) + row0 * row_bytes_of(o);
        const int tile_stride = rows * kTileBytes;
        istep = static_cast<size_t>(nwarps) * tile_stride;
        src0 = panel + min(g, rows - 1) * kTileBytes + 16 * t + warp * tile_stride;
        src1 = panel + min(g + 8, rows - 1) * kTileBytes + 16 * t + warp * tile_stride;
        return;
      }
      if (++isub == subs_of(o)) isub = 0, ++iq;
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
        const ChainOp& o = ops[op_of(iq)];
        if (++isub == subs_of(o)) isub = 0, ++iq;
        aim();
      }
    }
    ++issued_all;
    cp_async_commit();  // always commit: keeps the group count uniform
  };
  int consumed = 0;
  auto read_slot = [&](uint4 (&w0)[1], uint4 (&w1)[1]) {
    const uint4* slot = ring + (consumed & (kS - 1)) * kSlot;
    ++consumed;
    w0[0] = slot[0];
    w1[0] = slot[32];
  };
#pragma unroll
  for (int j = 0; j < kS - 1; ++j) issue();

  constexpr int kValues = kNT * 4;
  int satisfied = -1;  // every op up to this one has finished (an op's items waited for the op before)
  for (int q = first; q < last; ++q) {
    const int opi = op_of(q), item = sched[q] & 0xfffff;
    const ChainOp& o = ops[opi];
    const GemvParams& p = o.p;
    if (warp == 0 && lane == 0 && prefetch > 0) prefetch_item(q + prefetch);
    // The input: wait until every item of the op this one reads has finished.
    if (o.dep > satisfied) {
      const bool waiter = (mode & kWaitBlock) ? threadIdx.x == 0 : lane == 0;
      if (waiter) {
        const unsigned need = static_cast<unsigned>(ops[o.dep].items);
        const long long t0 = wait_cycles ? clock64() : 0;
        while (ld_acquire_gpu(cnt + o.dep) < need) {
        }
        if (wait_cycles) atomicAdd(wait_cycles + blockIdx.x, static_cast<unsigned long long>(clock64() - t0));
      }
      if (mode & kWaitBlock)
        __syncthreads();
      else
        __syncwarp();
      satisfied = o.dep;
    }
    const int nclean = p.K / kTileK;
    const int count = warp < nclean ? (nclean - warp + nwarps - 1) / nwarps : 0;
    const int subs = subs_of(o);
    for (int s = 0; s < subs; ++s) {
      const int panel = panel_of_item(o, item, s);
      Lane L(p, lane, panel, static_cast<const T*>(p.x), p.ldx);
      TileMeta cur[1], nxt[1];
      if (Lane::kGrouped && count > 0) L.template load_meta<false>(warp, cur);
      int tile = warp;
      for (int j = 0; j < count; ++j, tile += nwarps) {
        uint4 w0[1], w1[1];
        cp_async_wait<kS - 2>();
        read_slot(w0, w1);
        issue();
        if (Lane::kGrouped && j + 1 < count) L.template load_meta<false>(tile + nwarps, nxt);
        L.template tile<0, false>(tile, w0, w1, cur);
        cur[0] = nxt[0];
      }
      // Split-K reduction across warps: red[warp][value][lane].
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = L.acc[0][0][n][i];
          if constexpr (Lane::kBanks == 2) v += L.acc[1][0][n][i];
          red[(warp * kValues + n * 4 + i) * kWarpSize + lane] = v;
        }
      __syncthreads();
      const __half* scales = static_cast<const __half*>(p.scales);
      for (int v = threadIdx.x; v < kValues * kWarpSize; v += blockDim.x) {
        const int ln = v % kWarpSize, qv = v / kWarpSize;
        const int n = qv / 4, i = qv % 4;
        float sum = 0.f;
        for (int w2 = 0; w2 < nwarps; ++w2) sum += red[(w2 * kValues + qv) * kWarpSize + ln];
        const int r = (ln >> 2) + (i >= 2 ? 8 : 0);  // row inside the panel
        const int row = panel * kPanelRows + r;
        const int tok = n * 8 + 2 * (ln & 3) + (i & 1);
        if (row < p.N && tok < p.M) {
          if constexpr (!Lane::kGrouped) sum *= __half2float(scales[row]);
          if (o.epilogue == static_cast<int>(ChainEpilogue::kSiluMul)) {
            const float rounded = to_float(from_float<T>(sum));
            if (s == 0) {
              gate[r * 16 + tok] = rounded;
            } else {
              const float gv = gate[r * 16 + tok];
              const float a = gv / (1.f + __expf(-gv)) * rounded;
              ActTraits<T>::store(static_cast<T*>(p.y) + static_cast<size_t>(tok) * p.ldy + row - p.N / 2, a);
            }
          } else {
            if (o.epilogue == static_cast<int>(ChainEpilogue::kResidual))
              sum += to_float(static_cast<const T*>(o.res)[static_cast<size_t>(tok) * p.ldy + row]);
            ActTraits<T>::store(static_cast<T*>(p.y) + static_cast<size_t>(tok) * p.ldy + row, sum);
          }
        }
      }
      if (!(mode & (kSignalOne | kNoFence))) __threadfence();
      __syncthreads();  // red and gate are rewritten by the next panel
    }
    if (threadIdx.x == 0) {
      if ((mode & kSignalOne) && !(mode & kNoFence)) __threadfence();  // cumulative: the block's stores, seen at the barrier
      atomicAdd(cnt + opi, 1u);
    }
  }
  cp_async_wait<0>();
  // The last block out resets the counters for the next launch: every block
  // has passed its last wait by then.
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(cnt + nops, 1u) == gridDim.x - 1) {
      for (int i = 0; i <= nops; ++i) atomicExch(cnt + i, 0u);
    }
  }
}

// The schedule: op i's items go to blocks round-robin, continuing from where
// op i - 1 stopped, so that the blocks given one item more differ from op to
// op.  Returns sched (op << 20 | item, grouped by block, each block's items
// in op order) and off[blocks + 1].
inline void chain_schedule(const std::vector<int>& items, int blocks, std::vector<int>& sched,
                           std::vector<int>& off) {
  std::vector<std::vector<int>> per(blocks);
  int c = 0;
  for (size_t op = 0; op < items.size(); ++op) {
    for (int j = 0; j < items[op]; ++j) per[(c + j) % blocks].push_back(static_cast<int>(op) << 20 | j);
    c = (c + items[op]) % blocks;
  }
  sched.clear();
  off.assign(1, 0);
  for (const auto& v : per) {
    sched.insert(sched.end(), v.begin(), v.end());
    off.push_back(static_cast<int>(sched.size()));
  }
}

template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
size_t chain_smem_bytes(int warps) {
  return static_cast<size_t>(warps) * kS * 64 * sizeof(uint4) +
         static_cast<size_t>(warps) * kNT * 4 * kWarpSize * sizeof(float) + kPanelRows * 16 * sizeof(float);
}

// Resident blocks per SM of this instance at `warps` warps (0 if it cannot run).
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
int chain_blocks_per_sm(int warps) {
  auto kernel = chain_kernel<T, kBits, kGroup, kZeros, kNT, kS>;
  const size_t smem = chain_smem_bytes<T, kBits, kGroup, kZeros, kNT, kS>(warps);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
      cudaSuccess)
    return 0;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, warps * kWarpSize, smem) != cudaSuccess) return 0;
  return n;
}

// Launch on `blocks` blocks (at most SMs x chain_blocks_per_sm: co-resident,
// else the spins would never end).  d_ops / d_sched / d_off / d_cnt on the
// device; d_cnt zeroed once before the first launch (the kernel re-zeroes it).
// wait_cycles: nullptr, or [blocks] counters to which each block's waiter adds
// the SM clock cycles it spun (the lab's measure of dependency waits).
template <typename T, int kBits, int kGroup, bool kZeros, int kNT, int kS>
Status chain_launch(const ChainOp* d_ops, int nops, const int* d_sched, const int* d_off, unsigned* d_cnt,
                    int blocks, int warps, int prefetch, int mode, cudaStream_t stream,
                    unsigned long long* wait_cycles = nullptr) {
  if (warps < 1 || warps > 16 || blocks < 1) return Status::kBadShape;
  const size_t smem = chain_smem_bytes<T, kBits, kGroup, kZeros, kNT, kS>(warps);
  chain_kernel<T, kBits, kGroup, kZeros, kNT, kS>
      <<<blocks, warps * kWarpSize, smem, stream>>>(d_ops, nops, d_sched, d_off, d_cnt, prefetch, mode,
                                                                                 wait_cycles);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

}  // namespace qgemv
