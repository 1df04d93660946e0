// Issue 35's lab: what a dependency costs on this GPU, and the decode step's
// linears as one persistent launch (csrc/persist_chain.cuh) against one
// kernel per linear, in one run.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc dev/persist_lab.cu \
//        csrc/gemv_int4.cu csrc/gemv_int8.cu csrc/runtime.cpp -o /tmp/persist_lab
//   /tmp/persist_lab [--probe-only | --no-probe] [--tma-probe] [--no-ceiling] [--norm] [--model llama3-8b|llama3-70b|qwen2.5-7b|llama2-7b] [--layers L]
//                    [--warps 12,16] [--stages 8] [--formats int4g128a,int4g128,int4,int8] [--skip 0,1]
//   (the persistent launch is the kernel of csrc/persist_chain.cuh (form 20 of dev/PERSISTENT.md; the
//    other forms are in git), M = 1, int4 per channel and G = 128; int8 runs the per-op chains only;
//    --warps: warps per block; --stages: each warp's ring of 1 KB tiles, a multiple of 2 above 2;
//    --skip 0,1,5,37: timing experiments, ChainShape::skip: 1 no waits (the polled halves taken as they
//    are), 2 no hand-off at all, 4 no tile math, 8 the weights copied from L2, 16 no
//    copies past the ring's first fill (the tile math's own rate), 32 no flush, 64 + (n << 16) n
//    block barriers inside every op at even shares of each warp's run (the barriers of dev/PERSISTENT.md's
//    "k-slices in time"; results stay right), 256 << c no
//    waits for op class c's inputs only (the layer's classes: 0 q/k/v, 1 o, 2 gate/up, 3 down);
//    --no-ceiling: skip the 2 GB read that measures the ceiling, for runs under compute-sanitizer;
//    --norm: an RMSNorm before q/k/v and before gate/up, in the reference (a kernel each) and in the
//    persistent launch's hand-off)
//
// Part 1, the probes (a co-resident grid of SMs x 1 blocks of 256 threads):
//   * grid barrier: every block adds 1 to a counter and spins until it holds
//     (r + 1) x blocks; time per barrier from 4000 barriers;
//   * handoff: block r % G waits for a flag to reach r, then sets it to
//     r + 1 (blocks on different SMs): one producer -> consumer latency;
//   * an op's input read by every block at once through L2 (8-57 KB, the
//     same bytes or each block its own);
//   * a split-K reduction: every block adds 4096 or 8192 fp32 sums into one
//     vector, then the grid barrier;
//   * barrier under load: the same barrier while every block also streams
//     weights (256 KB per block between barriers), against the same stream
//     without barriers.
// Part 2, the chain: per layer q/k/v (fused) -> o (+ residual; attention's
// stand-in: o reads q's columns of the q/k/v output) -> gate/up with
// SiLU * mul -> down (+ residual) -> the next layer, every layer its own
// weights, random data.  Three chains in CUDA graphs: the persistent launch;
// qgemv's GEMVs one kernel each with the same glue as small kernels (the
// reference: the persistent result is checked against it); the GEMVs alone
// (the lab's earlier chain).  Plus a plain read of the same weight buffers,
// one kernel per matrix.  Percentages are of the read ceiling measured in
// the same run (a streaming read over 2 GB).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "lab_common.cuh"
#define QGEMV_CHAIN_STAMPS 1  // ChainShape::stamps: the per-op skew (print_skew)
#include "persist_chain.cuh"


namespace {

using qgemv::ChainShape;

// ---- probes ---------------------------------------------------------------
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Round r's grid barrier: every block adds 1 to *ctr and spins until it holds (r + 1) x blocks.
__device__ void grid_barrier(unsigned* ctr, int r) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr, 1u);
    const unsigned need = (r + 1) * gridDim.x;
    while (ld_acquire_gpu(ctr) < need) {
    }
  }
  __syncthreads();
}

// sums (optional, 1024 threads): every thread also adds 4 fp32 sums into
// round r's vector (sums + r * 4096) once during the round's stream, the
// threads' adds spread evenly over it (a split-K op's panels, sent as each
// completes).
__global__ void barrier_kernel(unsigned* ctr, int rounds, const uint4* w, size_t per_block, unsigned* sink,
                               float* sums = nullptr) {
  uint32_t acc = 0;
  const uint4* mine = w ? w + blockIdx.x * per_block * static_cast<size_t>(rounds) : nullptr;
  const size_t iters = (per_block + blockDim.x - 1) / blockDim.x, mine_at = threadIdx.x % iters;
  for (int r = 0; r < rounds; ++r) {
    if (w) {
      size_t it = 0;
      for (size_t i = threadIdx.x; i < per_block; i += blockDim.x, ++it) {
        const uint4 v = __ldcs(mine + r * per_block + i);
        acc ^= v.x ^ v.w;
        if (sums && it == mine_at) {
          const float f = static_cast<float>(v.y & 7u);
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(sums + r * 4096 + 4 * threadIdx.x),
                       "f"(f), "f"(f), "f"(f), "f"(f)
                       : "memory");
        }
      }
    }
    if (ctr) grid_barrier(ctr, r);
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

__global__ void handoff_kernel(unsigned* flag, int rounds) {
  if (threadIdx.x != 0) return;
  for (int r = blockIdx.x; r < rounds; r += gridDim.x) {
    while (ld_acquire_gpu(flag) < static_cast<unsigned>(r)) {
    }
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(static_cast<unsigned>(r + 1)) : "memory");
  }
}

// An op's input as every block reads it: all blocks at once (a grid barrier
// between rounds) read n 16-byte words through L2 (ld.relaxed.gpu, as the
// kernel's polls), the same words (stride 0) or each block its own; thread 0
// counts each read's cycles (the loads, then a block barrier) into *cycles.
__global__ void bcast_kernel(const uint4* src, size_t stride, int n, unsigned* ctr, int rounds,
                             unsigned long long* cycles, unsigned* sink) {
  const uint4* mine = src + blockIdx.x * stride;
  uint32_t acc = 0;
  long long total = 0;
  for (int r = 0; r < rounds; ++r) {
    const long long t0 = clock64();
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint4 v = qgemv::ld_relaxed_gpu_v4(mine + i);
      acc ^= v.x ^ v.w;
    }
    __syncthreads();
    total += clock64() - t0;
    grid_barrier(ctr, r);
  }
  if (threadIdx.x == 0) atomicAdd(cycles, static_cast<unsigned long long>(total));
  if (acc == 0x9e3779b9u) *sink = acc;
}

// A split-K hand-off's reduction: every block adds its n partial sums into
// acc (fp32, one buffer a round; vec 4: red.add.v4.f32, else one float a
// red), then the round's grid barrier (whoever passes it may read acc).
__global__ void reduce_kernel(float* acc, int n, int vec, unsigned* ctr, int rounds) {
  for (int r = 0; r < rounds; ++r) {
    float* a = acc + static_cast<size_t>(r) * n;
    const float v = 1.f + threadIdx.x;
    if (vec == 4) {
      for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(a + i), "f"(v), "f"(v), "f"(v), "f"(v)
                     : "memory");
    } else if (vec == 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(a + i, v);
    }
    grid_barrier(ctr, r);
  }
}

__global__ void add_kernel(const __half* a, const __half* b, __half* y, int n) {  // y = a + b (fp32, rounded)
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half_rn(__half2float(a[i]) + __half2float(b[i]));
}
// --norm: y = round(w * round(x * rsqrt(mean(x^2) + eps))) per row of H (one block of 1024 threads a row), as
// transformers' LlamaRMSNorm and qgemv's add_rms_gather round.
constexpr float kNormEps = 1e-5f;
__global__ void rms_kernel(const __half* x, const __half* w, __half* y, int H) {
  __shared__ float part[32];
  const __half* xr = x + static_cast<size_t>(blockIdx.x) * H;
  __half* yr = y + static_cast<size_t>(blockIdx.x) * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = __half2float(xr[i]);
    ss = fmaf(v, v, ss);
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
  for (int k = 0; k < static_cast<int>(blockDim.x >> 5); ++k) total += part[k];
  const float r = rsqrtf(total / static_cast<float>(H) + kNormEps);
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    yr[i] = __float2half_rn(__half2float(w[i]) * __half2float(__float2half_rn(__half2float(xr[i]) * r)));
}
// y[m, i] = silu(gu[m, i]) * gu[m, I + i]
__global__ void silu_mul_kernel(const __half* gu, __half* y, int M, int I) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= M * I) return;
  const int m = i / I, c = i % I;
  const float g = __half2float(gu[static_cast<size_t>(m) * 2 * I + c]);
  const float u = __half2float(gu[static_cast<size_t>(m) * 2 * I + I + c]);
  y[i] = __float2half_rn(g / (1.f + __expf(-g)) * u);
}

struct Model {
  const char* name;
  int layers, H, Nqkv, I;
};
const Model kModels[] = {
    {"llama3-8b", 16, 4096, 6144, 14336},
    {"llama3-70b", 4, 8192, 10240, 28672},
    {"qwen2.5-7b", 16, 3584, 4608, 18944},
    {"llama2-7b", 16, 4096, 12288, 11008},  // (no GQA: q/k/v 3 x 4096; gate/up 688 units, 5.2 a block)
};

struct Fmt {
  const char* name;
  int bits, group;
  bool zeros;
};

// capture_us with its own events; 30 replays.
template <typename F>
float graph_us(F&& body, cudaStream_t st) {
  static cudaEvent_t a = nullptr, b = nullptr;
  if (!a) {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  return capture_us(body, st, a, b, 30);
}

// One linear's packed weight on the device.
struct Lin {
  void *w = nullptr, *s = nullptr, *z = nullptr;
  void* meta = nullptr;  // G = 128: each 1 KB tile's scales and zero points (chain_meta), the launch's p.scales
  int N, K, Kp;
  size_t wbytes, bytes;
};

Lin make_lin(const Fmt& f, int N, int K, std::mt19937& rng) {
  Lin L;
  L.N = N;
  L.K = K;
  L.Kp = f.bits == 4 ? (K + 31) / 32 * 32 : (K + 15) / 16 * 16;
  L.wbytes = f.bits == 4 ? size_t(N) * L.Kp / 2 : size_t(N) * L.Kp;
  const int ng = f.group ? K / f.group : 1;
  std::vector<uint8_t> hw(L.wbytes);
  for (auto& v : hw) v = static_cast<uint8_t>(rng());
  if (f.bits == 8)
    for (auto& v : hw)
      if (v == 0x80) v = 0x81;  // the int8 format's codes are -127..127
  if (f.bits == 4 && !f.zeros)  // codes 1..15 (and more 8s): q - 8 has mean 0, else the chain's bias grows layer by layer
    for (auto& v : hw) {
      if ((v & 0x0f) == 0) v |= 0x08;
      if ((v & 0xf0) == 0) v |= 0x80;
    }
  // Scales so that a linear maps activations of size 1 to about 0.1 (a chain
  // of 16 layers, SiLU * mul included, then stays finite in fp16): codes
  // minus zero have a standard deviation of about 6.5 (int4, random zero
  // points), 4.6 (int4, zero 8) and 73 (int8).
  const float sd = 10.f * (f.bits == 8 ? 73.f : f.zeros ? 6.5f : 4.6f);
  std::uniform_real_distribution<float> us(0.5f, 1.5f);
  std::vector<__half> hs(size_t(N) * ng);
  for (auto& v : hs) v = __float2half(us(rng) / (sd * std::sqrt(float(K))));
  L.bytes = L.wbytes + hs.size() * 2;
  CK(cudaMalloc(&L.w, L.wbytes));
  CK(cudaMemcpy(L.w, hw.data(), L.wbytes, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&L.s, hs.size() * 2));
  CK(cudaMemcpy(L.s, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
  std::vector<uint8_t> hz_keep;
  if (f.zeros) {
    std::vector<uint8_t>& hz = hz_keep;
    hz.resize(size_t(N) * ng);
    for (auto& v : hz) v = rng() & 15;
    CK(cudaMalloc(&L.z, hz.size()));
    CK(cudaMemcpy(L.z, hz.data(), hz.size(), cudaMemcpyHostToDevice));
    L.bytes += hz.size();
  }
  if (f.group == 128) {
    const uint16_t* hs16 = reinterpret_cast<const uint16_t*>(hs.data());
    const auto meta = qgemv::chain_meta(hs16, f.zeros ? hz_keep.data() : nullptr, N, K, 128);
    CK(cudaMalloc(&L.meta, meta.size()));
    CK(cudaMemcpy(L.meta, meta.data(), meta.size(), cudaMemcpyHostToDevice));
  }
  return L;
}

qgemv::GemvParams params(const Fmt& f, const Lin& L, const void* x, int ldx, void* y, int ldy, int M) {
  qgemv::GemvParams p{};
  p.x = x;
  p.qweight = L.w;
  p.scales = L.s;
  p.zeros = static_cast<const uint8_t*>(L.z);
  p.y = y;
  p.M = M;
  p.N = L.N;
  p.K = L.K;
  p.Kp = L.Kp;
  p.ldx = ldx;
  p.ldy = ldy;
  p.group_size = f.group;
  p.act = qgemv::ActType::kHalf;
  return p;
}

__half* dalloc(size_t n) {
  __half* p;
  CK(cudaMalloc(&p, n * 2));
  CK(cudaMemset(p, 0xff, n * 2));  // poison: NaN
  return p;
}

struct Variant {
  int warps, stages;  // warps a block; each warp's ring of 1 KB tiles
  int skip;           // ChainShape::skip (timing experiments)
};

// The persistent launch's kernel for format f (norm: with the hand-offs' RMSNorms): f(kernel); false for
// a format it does not run.
template <typename F>
bool chain_dispatch(const Fmt& fm, bool norm, F&& f) {
  if (fm.bits != 4 || (fm.group != 0 && fm.group != 128)) return false;
  auto pick = [&](auto kn) {
    constexpr bool kN = decltype(kn)::value;
    if (fm.group == 0) f(qgemv::chain_kernel<4, 0, false, kN>);
    else if (fm.zeros) f(qgemv::chain_kernel<4, 128, true, kN>);
    else f(qgemv::chain_kernel<4, 128, false, kN>);
  };
  norm ? pick(std::true_type{}) : pick(std::false_type{});
  return true;
}

// Whether one block of `warps` warps and sh's shared memory fits an SM (ops == nullptr), else the launch.
bool launch_chain(const Fmt& fm, const Variant& v, const ChainShape& sh, const qgemv::ChainOp* ops, int nops,
                  unsigned* sync, int blocks, cudaStream_t st, unsigned long long* wait = nullptr) {
  const size_t smem = qgemv::chain_smem_bytes(sh, v.warps);
  bool ok = false;
  const bool known = chain_dispatch(fm, sh.norms != nullptr, [&](auto kernel) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (!ops) {
      int n = 0;
      ok = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, v.warps * 32, smem) == cudaSuccess && n >= 1;
      (void)cudaGetLastError();
      return;
    }
    kernel<<<blocks, v.warps * 32, smem, st>>>(ops, nops, sh, sync, wait);
    ok = cudaGetLastError() == cudaSuccess;
  });
  return known && ok;
}

// ChainShape::stamps of one timed launch ([op][block][5]: cycles on the tiles, finishing, preparing the
// input; %globaltimer at the outputs written and at the input read), per op class and layer (µs): the
// blocks' time on the op's tiles (mean, the slowest over the median); their outputs' times (the last
// over the median: the skew a hand-off waits for); each block's input read after the last producer's
// outputs (median: propagation and the read); preparing (fastest / median / slowest block).
static void print_skew(const char* name, int M, const std::vector<qgemv::ChainOp>& ops, int classes,
                       const std::vector<unsigned long long>& st, int blocks, int clock_khz, int layers) {
  const int nops = static_cast<int>(ops.size());
  const double cyc_us = 1e3 / clock_khz;
  auto at = [&](int o, int b, int k) { return st[(static_cast<size_t>(o) * blocks + b) * 5 + k]; };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  {  // the timer's resolution: the smallest positive gap between blocks' stamps of one op
    std::vector<unsigned long long> d;
    for (int b = 0; b < blocks; ++b) d.push_back(at(nops / 2, b, 3));
    std::sort(d.begin(), d.end());
    unsigned long long gap = ~0ull;
    for (size_t q = 1; q < d.size(); ++q)
      if (d[q] > d[q - 1]) gap = std::min(gap, d[q] - d[q - 1]);
    std::printf("%-10s %3d   globaltimer: smallest gap between blocks %llu ns\n", name, M, gap);
  }
  std::printf("%-10s %3d   skew per layer and op class (us): tiles mean / slowest-median; outputs last-median; "
              "input read after the last output (median); preparing min / median / max\n", name, M);
  for (int c = 0; c < classes; ++c) {
    double tm = 0, tx = 0, om = 0, pr = 0, p0 = 0, p1 = 0, p2 = 0;
    int n = 0;
    for (int o = 0; o < nops; ++o) {
      if (ops[o].cls != c) continue;
      std::vector<double> work(blocks), done(blocks), prep(blocks), after;
      for (int b = 0; b < blocks; ++b)
        work[b] = at(o, b, 0) * cyc_us, done[b] = double(at(o, b, 3)), prep[b] = at(o, b, 2) * cyc_us;
      const double last = *std::max_element(done.begin(), done.end());
      double wmean = 0;
      for (double w : work) wmean += w;
      tm += wmean / blocks, tx += *std::max_element(work.begin(), work.end()) - median(work);
      om += (last - median(done)) * 1e-3;
      if (o + 1 < nops) {  // the next op reads this one's outputs
        for (int b = 0; b < blocks; ++b) after.push_back((double(at(o + 1, b, 4)) - last) * 1e-3);
        pr += median(after);
      }
      std::vector<double> sp = prep;
      std::sort(sp.begin(), sp.end());
      p0 += sp[0], p1 += sp[blocks / 2], p2 += sp[blocks - 1];
      ++n;
    }
    const qgemv::ChainOp* o = nullptr;
    for (const qgemv::ChainOp& q : ops)
      if (!o && q.cls == c) o = &q;
    const double k = 1.0 / layers;
    std::printf("%-10s %3d     %dx%d: tiles %.2f / %.2f; outputs %.2f; input after %.2f; preparing %.2f / %.2f / %.2f\n",
                name, M, o->p.N, o->p.K, tm * k, tx * k, om * k, pr * k, p0 * k, p1 * k, p2 * k);
    // The schedule's balance: blocks own whole units (panels; gate/up's a panel pair), so with u units over
    // G blocks some own one more than others.  The blocks' mean time on the class's tiles by the units they
    // own.  (2026-12-06: the lighter blocks finish early, but an even split of the tiles made every block as
    // slow as the most loaded one, since the blocks share HBM; dev/PERSISTENT.md, "Tried and not kept".)
    {
      const long long units = qgemv::chain_units(*o);
      std::map<long long, std::pair<double, int>> by;  // units a block owns -> (its time summed, blocks)
      for (int b = 0; b < blocks; ++b) {
        long long u0, u1;
        qgemv::chain_range(units, b, blocks, u0, u1);
        double w = 0;
        for (int q = 0; q < nops; ++q)
          if (ops[q].cls == c) w += at(q, b, 0) * cyc_us;
        by[u1 - u0].first += w * k, by[u1 - u0].second += 1;
      }
      std::printf("%-10s %3d       balance: %lld units over %d blocks (mean %.2f);", name, M, units, blocks,
                  double(units) / blocks);
      for (const auto& e : by)
        std::printf(" %d blocks of %lld units: tiles %.2f us;", e.second.second, e.first,
                    e.second.first / e.second.second);
      std::printf("\n");
    }
    (void)n;
  }
}
int run_chain(const Model& m, int layers, const std::vector<Fmt>& fmts, const std::vector<int>& Ms,
              const std::vector<Variant>& variants, double ceiling, int sms, int clock_khz, bool norm) {
  unsigned long long* wait_dev;
  CK(cudaMalloc(&wait_dev, sizeof(unsigned long long) * 5 * 4096));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  int failures = 0;
  std::printf("\nchain %s, %d layers, read ceiling %.0f GB/s\n", m.name, layers, ceiling);
  std::printf("%-10s %3s %-22s %6s %9s %8s %7s %9s\n", "format", "M", "form", "blocks", "us/layer", "GB/s", "%ceil",
              "rel.err");
  for (const Fmt& f : fmts) {
    std::mt19937 rng(7);
    std::vector<Lin> lins;
    double layer_bytes = 0;
    for (int l = 0; l < layers; ++l) {
      lins.push_back(make_lin(f, m.Nqkv, m.H, rng));
      lins.push_back(make_lin(f, m.H, m.H, rng));
      lins.push_back(make_lin(f, 2 * m.I, m.H, rng));
      lins.push_back(make_lin(f, m.H, m.I, rng));
      if (l == 0)
        for (int i = 0; i < 4; ++i) layer_bytes += lins[i].bytes;
    }
    const float read_us = graph_us(
        [&] {
          for (const Lin& L : lins)
            read_kernel<<<sms * 8, 512, 0, st>>>(static_cast<const uint4*>(L.w), L.wbytes / 16, sink);
        },
        st) / layers;
    double layer_wbytes = 0;
    for (int i = 0; i < 4; ++i) layer_wbytes += lins[i].wbytes;
    std::printf("%-10s %3s %-22s %6s %9.1f %8.0f %6.1f%%\n", f.name, "-", "read, one kernel/matrix", "-", read_us,
                layer_wbytes / (read_us * 1e3), 100 * layer_wbytes / (read_us * 1e3) / ceiling);
    for (int M : Ms) {
      // Activations: X[l] the layer inputs (X[layers] the output), per layer
      // qkv, h (after o), act (after SiLU * mul); the reference's own copies.
      std::vector<__half*> X(layers + 1), Q(layers), Hh(layers), A(layers);
      std::vector<__half*> rX(layers + 1), rQ(layers), rH(layers), rA(layers), rGU(layers), rO(layers), rD(layers);
      for (int l = 0; l <= layers; ++l) X[l] = dalloc(size_t(M) * m.H), rX[l] = dalloc(size_t(M) * m.H);
      for (int l = 0; l < layers; ++l) {
        Q[l] = dalloc(size_t(M) * m.Nqkv), rQ[l] = dalloc(size_t(M) * m.Nqkv);
        Hh[l] = dalloc(size_t(M) * m.H), rH[l] = dalloc(size_t(M) * m.H), rO[l] = dalloc(size_t(M) * m.H);
        A[l] = dalloc(size_t(M) * m.I), rA[l] = dalloc(size_t(M) * m.I);
        rGU[l] = dalloc(size_t(M) * 2 * m.I), rD[l] = dalloc(size_t(M) * m.H);
      }
      std::vector<__half> hx(size_t(M) * m.H);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& v : hx) v = __float2half(nd(rng));
      CK(cudaMemcpy(X[0], hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
      // --norm: each layer's two RMSNorm gains (0.5-1.5) and the reference's normalized inputs (fp16
      // activations: the launch reads no max|gain| after the gains, qgemv.persist.norm_gain)
      std::vector<__half*> G1(layers, nullptr), G2(layers, nullptr), rN1(layers, nullptr), rN2(layers, nullptr);
      if (norm) {
        std::uniform_real_distribution<float> ug(0.5f, 1.5f);
        std::vector<__half> hg(m.H);
        for (int l = 0; l < layers; ++l) {
          for (__half** g : {&G1[l], &G2[l]}) {
            for (auto& v : hg) v = __float2half(ug(rng));
            *g = dalloc(m.H);
            CK(cudaMemcpy(*g, hg.data(), hg.size() * 2, cudaMemcpyHostToDevice));
          }
          rN1[l] = dalloc(size_t(M) * m.H), rN2[l] = dalloc(size_t(M) * m.H);
        }
      }
      CK(cudaMemcpy(rX[0], hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));

      // The chain: per layer q/k/v -> o (reads q; attention's stand-in) -> gate/up (after o + residual) ->
      // down (after SiLU * mul); the next layer's q/k/v reads down + residual, and so does the output
      // X[layers].  Every op writes its own activation buffer and the next op reads it.  Inside the launch
      // a buffer of n values holds two fp16 copies (the launch's parity picks one), 0xffff until written;
      // X[0] (the first input, and layer 0's first residual) and X[layers] (the output) stay plain.
      std::vector<qgemv::ChainOp> ops;
      std::vector<void*> halves;
      std::vector<size_t> halves_bytes;
      auto halloc = [&](size_t n) {
        void* q;
        CK(cudaMalloc(&q, n * 4));
        CK(cudaMemset(q, 0xff, n * 4));
        halves.push_back(q);
        halves_bytes.push_back(n * 4);
        return q;
      };
      void* px_next = nullptr;  // the next layer's input
      for (int l = 0; l < layers; ++l) {
        const Lin* L = &lins[4 * l];
        void* px = l == 0 ? static_cast<void*>(X[0]) : px_next;
        void* pq = halloc(size_t(M) * m.Nqkv);
        void* ph = halloc(size_t(M) * m.H);
        void* pa = halloc(size_t(M) * m.I);
        const bool last = l + 1 == layers;
        px_next = last ? static_cast<void*>(X[layers]) : halloc(size_t(M) * m.H);
        struct {
          const void *x, *res;
          int ldx;
          void* y;
          int ldy, flags;
          qgemv::ChainOut out;
        } io[4] = {{px, nullptr, m.H, pq, m.Nqkv, l == 0 ? qgemv::kChainPlainX : 0, qgemv::ChainOut::kStore},
                   {pq, px, m.Nqkv, ph, m.H, l == 0 ? qgemv::kChainPlainRes : 0, qgemv::ChainOut::kResidual},
                   {ph, nullptr, m.H, pa, m.I, 0, qgemv::ChainOut::kSiluMul},
                   {pa, ph, m.I, px_next, m.H, last ? qgemv::kChainPlainY : 0, qgemv::ChainOut::kResidual}};
        for (int j = 0; j < 4; ++j) {
          qgemv::ChainOp o{};
          o.p = params(f, L[j], io[j].x, io[j].ldx, io[j].y, io[j].ldy, M);
          if (L[j].meta) o.p.scales = L[j].meta;  // G = 128: the tiles in place, their meta beside them
          o.res = io[j].res;
          o.out = static_cast<int>(io[j].out);
          o.flags = io[j].flags;
          qgemv::chain_op_set(o, L[j].K / qgemv::chain_tile_k(4), nullptr);
          ops.push_back(o);
        }
      }
      const int nops = static_cast<int>(ops.size());
      // Op classes (one per shape and output step): the schedule, and the per-class hand-off times.
      const int classes = qgemv::chain_classes(ops.data(), nops);
      qgemv::ChainOp* d_ops;
      CK(cudaMalloc(&d_ops, ops.size() * sizeof(qgemv::ChainOp)));
      CK(cudaMemcpy(d_ops, ops.data(), ops.size() * sizeof(qgemv::ChainOp), cudaMemcpyHostToDevice));
      unsigned* d_cnt;  // [nops + 1]: the last counts the launches (their parity)
      CK(cudaMalloc(&d_cnt, (nops + 1) * 4));
      CK(cudaMemset(d_cnt, 0, (nops + 1) * 4));
      // --norm: each op's input RMSNorm gain (q/k/v: the layer's first, gate/up: its second)
      const void** d_norms = nullptr;
      if (norm) {
        std::vector<const void*> hn(ops.size(), nullptr);
        for (int l = 0; l < layers; ++l) hn[4 * l] = G1[l], hn[4 * l + 2] = G2[l];
        CK(cudaMalloc(&d_norms, hn.size() * sizeof(void*)));
        CK(cudaMemcpy(d_norms, hn.data(), hn.size() * sizeof(void*), cudaMemcpyHostToDevice));
      }

      // The reference: one kernel per GEMV and per glue step.
      auto gemv = [&](const qgemv::GemvParams& p) {
        const qgemv::Status s = f.bits == 4 ? qgemv::gemv_int4(p, st) : qgemv::gemv_int8(p, st);
        if (s != qgemv::Status::kOk) {
          std::fprintf(stderr, "gemv status %d\n", static_cast<int>(s));
          std::exit(1);
        }
      };
      auto per_op = [&](bool glue) {
        for (int l = 0; l < layers; ++l) {
          const Lin* L = &lins[4 * l];
          if (glue && norm) rms_kernel<<<M, 1024, 0, st>>>(rX[l], G1[l], rN1[l], m.H);
          gemv(params(f, L[0], glue && norm ? rN1[l] : rX[l], m.H, rQ[l], m.Nqkv, M));
          gemv(params(f, L[1], rQ[l], m.Nqkv, rO[l], m.H, M));
          if (glue) add_kernel<<<(M * m.H + 255) / 256, 256, 0, st>>>(rO[l], rX[l], rH[l], M * m.H);
          if (glue && norm) rms_kernel<<<M, 1024, 0, st>>>(rH[l], G2[l], rN2[l], m.H);
          gemv(params(f, L[2], glue ? (norm ? rN2[l] : rH[l]) : rO[l], m.H, rGU[l], 2 * m.I, M));
          if (glue) silu_mul_kernel<<<(M * m.I + 255) / 256, 256, 0, st>>>(rGU[l], rA[l], M, m.I);
          gemv(params(f, L[3], rA[l], m.I, rD[l], m.H, M));
          if (glue) add_kernel<<<(M * m.H + 255) / 256, 256, 0, st>>>(rD[l], rH[l], rX[l + 1], M * m.H);
        }
      };
      per_op(true);
      CK(cudaStreamSynchronize(st));
      std::vector<__half> ref(size_t(M) * m.H);
      CK(cudaMemcpy(ref.data(), rX[layers], ref.size() * 2, cudaMemcpyDeviceToHost));
      double refmax = 0;
      bool finite = true;
      for (auto v : ref) {
        const float a = std::fabs(__half2float(v));
        finite = finite && std::isfinite(a);
        refmax = std::max(refmax, double(a));
      }
      if (!finite || refmax == 0) {
        // Which buffer first went wrong, in chain order.
        auto bad = [&](const __half* d, size_t n) {
          std::vector<__half> h(n);
          CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
          double mx = 0;
          for (auto v : h) {
            const float a = std::fabs(__half2float(v));
            if (!std::isfinite(a)) return -1.0;
            mx = std::max(mx, double(a));
          }
          return mx;
        };
        for (int l = 0; l < layers; ++l) {
          const std::pair<const char*, std::pair<const __half*, size_t>> bufs[] = {
              {"qkv", {rQ[l], size_t(M) * m.Nqkv}}, {"o", {rO[l], size_t(M) * m.H}}, {"h", {rH[l], size_t(M) * m.H}},
              {"gate_up", {rGU[l], size_t(M) * 2 * m.I}}, {"act", {rA[l], size_t(M) * m.I}},
              {"down", {rD[l], size_t(M) * m.H}}, {"x_next", {rX[l + 1], size_t(M) * m.H}}};
          bool stop = false;
          for (const auto& b : bufs) {
            const double mx = bad(b.second.first, b.second.second);
            if (mx < 0 || mx == 0) {
              std::printf("%-10s %3d reference: layer %d %s is %s\n", f.name, M, l, b.first, mx < 0 ? "not finite" : "zero");
              stop = true;
              break;
            }
          }
          if (stop) break;
        }
        std::printf("%-10s %3d the per-op reference output is not finite or all zero: FAIL\n", f.name, M);
        ++failures;
        refmax = 1;
      }
      const float glue_us = graph_us([&] { per_op(true); }, st) / layers;
      const float gemv_us = graph_us([&] { per_op(false); }, st) / layers;
      auto row = [&](const char* form, int blocks, float us, double err) {
        const double gbs = layer_bytes / (us * 1e3);
        std::printf("%-10s %3d %-22s %6d %9.1f %8.0f %6.1f%%", f.name, M, form, blocks, us, gbs, 100 * gbs / ceiling);
        if (err >= 0) std::printf(" %9.1e%s", err, err < 2e-2 ? "" : "  FAIL");
        std::printf("\n");
        std::fflush(stdout);
      };
      row("per-op GEMVs + glue", 0, glue_us, -1);
      row("per-op GEMVs alone", 0, gemv_us, -1);
      std::printf("%-10s %3d reference output max |y| %.3g (input 1)\n", f.name, M, refmax);

      for (const Variant& v : variants) {
        const int blocks = sms;
        ChainShape sh{v.stages, qgemv::chain_meta_bytes(f.group, f.zeros), std::max(m.H, m.I), M, v.skip};
        sh.sums = qgemv::chain_sums(ops.data(), nops, blocks, M);
        sh.norms = norm ? d_norms : nullptr;
        sh.norm_eps = kNormEps;
        sh.slices = (v.skip >> 16) & 255;  // skip 64 + (n << 16): n block barriers inside each op
        int4* d_tab = nullptr;  // the schedule for these blocks and warps
        const std::vector<int4> tab =
            classes > 0 ? qgemv::chain_schedule(ops.data(), nops, classes, blocks, v.warps) : std::vector<int4>{};
        if (!tab.empty()) {
          CK(cudaMalloc(&d_tab, tab.size() * sizeof(int4)));
          CK(cudaMemcpy(d_tab, tab.data(), tab.size() * sizeof(int4), cudaMemcpyHostToDevice));
          sh.cursors = d_tab, sh.classes = classes;
        }
        struct Free {
          void* p;
          ~Free() { cudaFree(p); }
        } free_tab{d_tab};  // at the end of this variant, or at its `continue`
        char form[48];
        std::string tag;
        const char* bit_names[] = {" nowait", " noprep", " nomath", " l2feed", " nocopy", " noflush", " slices"};
        for (int bit = 0; bit < 7; ++bit)
          if (v.skip & (1 << bit)) tag += bit_names[bit];
        if (v.skip & 64) tag += std::to_string((v.skip >> 16) & 255);
        for (int c = 0; c < 8; ++c)
          if (v.skip & (256 << c)) tag += " nowait-c" + std::to_string(c);
        std::snprintf(form, sizeof form, "persist w%d s%d%s", v.warps, v.stages, tag.c_str());
        if (M != 1 || !d_tab || !launch_chain(f, v, sh, nullptr, nops, nullptr, blocks, st)) {
          std::printf("%-10s %3d %s: does not run (%zu B of shared memory; M = 1, int4 per channel or G = 128)\n",
                      f.name, M, form, qgemv::chain_smem_bytes(sh, v.warps));
          continue;
        }
        for (int l = 1; l <= layers; ++l) CK(cudaMemset(X[l], 0xff, size_t(M) * m.H * 2));  // poison
        // the activation buffers as new: a never-written element reads as the poison 0xffff
        for (size_t q = 0; q < halves.size(); ++q) CK(cudaMemset(halves[q], 0xff, halves_bytes[q]));
        unsigned long long* wait = nullptr;
        auto go = [&] {
          const bool ok = launch_chain(f, v, sh, d_ops, nops, d_cnt, blocks, st, wait);
          if (!ok) {
            std::fprintf(stderr, "persistent launch failed\n");
            std::exit(1);
          }
        };
        // the last layer's output against the reference's: the largest error over the output's largest value
        auto out_err = [&]() {
          std::vector<__half> out(ref.size());
          CK(cudaMemcpy(out.data(), X[layers], out.size() * 2, cudaMemcpyDeviceToHost));
          double e = 0;
          for (size_t q = 0; q < out.size(); ++q) {
            const double d = std::fabs(double(__half2float(out[q])) - __half2float(ref[q]));
            e = std::max(e, d != d ? 1e30 : d);
          }
          return e / refmax;
        };
        go();
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        double err = out_err();
        // every skip bit is a timing experiment whose result is wrong by design, but the slices' barriers (64)
        const bool exact = (v.skip & ~(64 | (255 << 16))) == 0;
        if (!exact) err = -1;
        else failures += !(err < 2e-2);
        const float us = graph_us(go, st) / layers;
        // The second check: after many graph replays the counters must still be right.
        const double err2 = out_err();
        if (exact) {
          err = std::max(err, err2);
          failures += !(err2 < 2e-2);
        }
        // Where the time goes: one more launch with each block's spin cycles counted.
        // per block: 5 counts, its SM, then preparing and finishing per op class
        const int nwc = 6 + 2 * qgemv::kChainMaxClasses;
        CK(cudaMemset(wait_dev, 0, sizeof(unsigned long long) * nwc * blocks));
        // each op's and block's stamps too (ChainShape::stamps)
        const size_t nst = static_cast<size_t>(nops) * blocks * 5;
        unsigned long long* d_st = nullptr;
        CK(cudaMalloc(&d_st, nst * 8));
        CK(cudaMemset(d_st, 0, nst * 8));
        sh.stamps = d_st;
        wait = wait_dev;
        go();
        wait = nullptr;
        sh.stamps = nullptr;
        CK(cudaStreamSynchronize(st));
        std::vector<unsigned long long> hst(d_st ? nst : 0);
        if (d_st) {
          CK(cudaMemcpy(hst.data(), d_st, nst * 8, cudaMemcpyDeviceToHost));
          CK(cudaFree(d_st));
        }
        std::vector<unsigned long long> wc(nwc * blocks);
        CK(cudaMemcpy(wc.data(), wait_dev, sizeof(unsigned long long) * nwc * blocks, cudaMemcpyDeviceToHost));
        double wsum = 0, wmax = 0, bsum = 0, ssum = 0, isum = 0, qsum = 0;
        for (int b2 = 0; b2 < blocks; ++b2) {
          wsum += wc[b2], wmax = std::max(wmax, double(wc[b2]));
          bsum += wc[blocks + b2], ssum += wc[2 * blocks + b2];
          isum += wc[3 * blocks + b2], qsum += wc[4 * blocks + b2];
        }
        const double per_us = 1e3 / clock_khz / layers;  // cycles -> us per layer
        row(form, blocks, us, err);
        std::printf("%-10s %3d   per layer, warp 0 of a block (mean): %.2f us waiting for its ring (%.1f the most), "
                    "%.2f waiting for the block's warps, %.2f finishing, %.2f preparing the input; %.2f in all\n",
                    f.name, M, wsum / blocks * per_us, wmax * per_us, bsum / blocks * per_us, ssum / blocks * per_us,
                    isum / blocks * per_us, qsum / blocks * per_us);
        {
          // The spread of the blocks' own times (thread 0, start to end): the slowest sets every hand-off.
          std::vector<double> tot(blocks);
          for (int b2 = 0; b2 < blocks; ++b2) tot[b2] = wc[4 * blocks + b2] * per_us;
          std::vector<double> srt = tot;
          std::sort(srt.begin(), srt.end());
          std::printf("%-10s %3d   a block's time (us per layer): min %.2f, median %.2f, 90th %.2f, max %.2f\n", f.name,
                      M, srt[0], srt[blocks / 2], srt[blocks * 9 / 10], srt[blocks - 1]);
          // Each op class's hand-off (thread 0, a block's mean): preparing its input, finishing its outputs.
          std::printf("%-10s %3d   per layer and op class, preparing / finishing (us):", f.name, M);
          for (int c = 0; c < classes; ++c) {
            const qgemv::ChainOp* o = nullptr;
            for (const qgemv::ChainOp& q : ops)
              if (!o && q.cls == c) o = &q;
            double pc = 0, fc = 0;
            for (int b2 = 0; b2 < blocks; ++b2) pc += wc[(6 + 2 * c) * blocks + b2], fc += wc[(7 + 2 * c) * blocks + b2];
            std::printf(" %dx%d %.2f / %.2f;", o->p.N, o->p.K, pc / blocks * per_us, fc / blocks * per_us);
          }
          std::printf("\n");
          if (!hst.empty()) print_skew(f.name, M, ops, classes, hst, blocks, clock_khz, layers);
          if (!hst.empty() && std::getenv("LAB_SMMAP")) {
            // Is a block's speed its SM's or its work's?  Each block's time on each op class's tiles (us a
            // layer) in three timed launches: the one above, the same again, and one with every block running
            // another block's schedule (ChainShape::rotate); then correlated by SM and by schedule slot.
            const int rot = blocks / 3 + 1;
            std::vector<std::vector<double>> tim;  // [run * classes + class][block]
            std::vector<std::vector<int>> smof;    // [run][block]
            for (int run = 0; run < 3; ++run) {
              std::vector<unsigned long long> w2(wc), s2(hst);
              if (run > 0) {
                CK(cudaMemset(wait_dev, 0, sizeof(unsigned long long) * nwc * blocks));
                CK(cudaMalloc(&d_st, nst * 8));
                CK(cudaMemset(d_st, 0, nst * 8));
                sh.stamps = d_st, wait = wait_dev, sh.rotate = run == 2 ? rot : 0;
                go();
                wait = nullptr, sh.stamps = nullptr, sh.rotate = 0;
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(w2.data(), wait_dev, sizeof(unsigned long long) * nwc * blocks, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(s2.data(), d_st, nst * 8, cudaMemcpyDeviceToHost));
                CK(cudaFree(d_st));
              }
              smof.emplace_back(blocks);
              for (int b2 = 0; b2 < blocks; ++b2) smof[run][b2] = static_cast<int>(w2[5 * blocks + b2]);
              for (int c = 0; c < classes; ++c) {
                std::vector<double> t(blocks, 0.0);
                for (int b2 = 0; b2 < blocks; ++b2)
                  for (int o = 0; o < nops; ++o)
                    if (ops[o].cls == c) t[b2] += s2[(static_cast<size_t>(o) * blocks + b2) * 5] * per_us;
                tim.push_back(t);
              }
            }
            auto corr = [](const std::vector<double>& a, const std::vector<double>& b) {
              const double n = static_cast<double>(a.size());
              double ma = 0, mb = 0;
              for (size_t q = 0; q < a.size(); ++q) ma += a[q] / n, mb += b[q] / n;
              double sab = 0, saa = 0, sbb = 0;
              for (size_t q = 0; q < a.size(); ++q)
                sab += (a[q] - ma) * (b[q] - mb), saa += (a[q] - ma) * (a[q] - ma), sbb += (b[q] - mb) * (b[q] - mb);
              return sab / std::sqrt(saa * sbb);
            };
            bool same_sms = true;
            for (int b2 = 0; b2 < blocks; ++b2) same_sms &= smof[0][b2] == smof[1][b2] && smof[0][b2] == smof[2][b2];
            std::printf("%-10s %3d   SM map: a block's SM the same in the three launches: %s\n", f.name, M,
                        same_sms ? "yes" : "no");
            for (int c = 0; c < classes; ++c) {
              // by SM: launch 3's time of the block on SM s; by slot: launch 3's time of the block that ran slot s
              std::vector<double> a = tim[c], b = tim[classes + c], bysm(blocks), byslot(blocks);
              std::vector<int> at_sm(1024, -1);
              for (int b2 = 0; b2 < blocks; ++b2) at_sm[smof[2][b2] & 1023] = b2;
              for (int b2 = 0; b2 < blocks; ++b2) {
                const int j = at_sm[smof[0][b2] & 1023];
                bysm[b2] = j >= 0 ? tim[2 * classes + c][j] : 0.0;
                byslot[b2] = tim[2 * classes + c][(b2 - rot % blocks + blocks) % blocks];  // it ran slot b2
              }
              std::vector<double> srt = a;
              std::sort(srt.begin(), srt.end());
              std::printf("%-10s %3d   SM map, class %d: us a layer min %.2f median %.2f max %.2f; correlation with "
                          "the same launch again %.2f, with the rotated launch by SM %.2f, by slot %.2f\n", f.name, M, c,
                          srt[0], srt[blocks / 2], srt[blocks - 1], corr(a, b), corr(a, bysm), corr(a, byslot));
            }
            if (std::getenv("LAB_SMMAP_ALL"))
              for (int c = 0; c < classes; ++c) {
                std::printf("%-10s %3d   SM map, class %d, block:sm:us (launch 1, rotated):", f.name, M, c);
                for (int b2 = 0; b2 < blocks; ++b2)
                  std::printf(" %d:%d:%.2f:%.2f", b2, smof[0][b2], tim[c][b2], tim[2 * classes + c][b2]);
                std::printf("\n");
              }
          }
          if (std::getenv("LAB_BLOCKS")) {  // sm:time of every block, for the SM-to-speed map
            std::printf("%-10s %3d   blocks", f.name, M);
            for (int b2 = 0; b2 < blocks; ++b2) std::printf(" %llu:%.2f", wc[5 * blocks + b2], tot[b2]);
            std::printf("\n");
          }
          if (!hst.empty() && std::getenv("LAB_BALANCE")) {
            // The schedule's light slots (fewer units) to the slowest blocks: per op class, each block's
            // cycles a tile on its own slot (the stamped launch above), blocks from slowest to fastest given
            // the slots from lightest to heaviest; then the launch timed with the permuted records beside the
            // plain ones, alternately.  Whether a block's speed is its own (its SM's, as a block stays on its
            // SM) and so worth a schedule that weights it.
            const int W = v.warps;
            std::vector<int4> bal(tab);
            for (int c = 0; c < classes; ++c) {
              const qgemv::ChainOp* o = nullptr;
              int nc = 0;
              for (const qgemv::ChainOp& q : ops)
                if (q.cls == c) nc++, o = o ? o : &q;
              auto tiles_of = [&](int slot) {
                const int4 r = tab[(static_cast<size_t>(c) * blocks + slot) * (W + 1) + W];
                return static_cast<double>(r.y - r.x) * qgemv::chain_ppu(*o) * qgemv::chain_op_tpp(*o);
              };
              std::vector<double> cpt(blocks);
              for (int b2 = 0; b2 < blocks; ++b2) {
                double cyc = 0;
                for (int q = 0; q < nops; ++q)
                  if (ops[q].cls == c) cyc += static_cast<double>(hst[(static_cast<size_t>(q) * blocks + b2) * 5]);
                cpt[b2] = tiles_of(b2) > 0 ? cyc / (tiles_of(b2) * nc) : 0.0;
              }
              std::vector<int> slots(blocks), order(blocks);
              for (int b2 = 0; b2 < blocks; ++b2) slots[b2] = order[b2] = b2;
              std::stable_sort(slots.begin(), slots.end(), [&](int a, int b) { return tiles_of(a) < tiles_of(b); });
              std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cpt[a] > cpt[b]; });
              for (int k = 0; k < blocks; ++k)
                for (int w = 0; w <= W; ++w)
                  bal[(static_cast<size_t>(c) * blocks + order[k]) * (W + 1) + w] =
                      tab[(static_cast<size_t>(c) * blocks + slots[k]) * (W + 1) + w];
              std::vector<double> srt = cpt;
              std::sort(srt.begin(), srt.end());
              std::printf("%-10s %3d   balance, class %d: cycles a tile min %.0f median %.0f 90th %.0f max %.0f\n",
                          f.name, M, c, srt[0], srt[blocks / 2], srt[blocks * 9 / 10], srt[blocks - 1]);
            }
            for (int round = 0; round < 2; ++round)
              for (int which = 0; which < 2; ++which) {
                const std::vector<int4>& t2 = which ? bal : tab;
                CK(cudaMemcpy(d_tab, t2.data(), t2.size() * sizeof(int4), cudaMemcpyHostToDevice));
                go();
                CK(cudaStreamSynchronize(st));
                const double e2 = out_err();
                const float u2 = graph_us(go, st) / layers;
                if ((v.skip & ~(64 | (255 << 16))) == 0) failures += !(e2 < 2e-2);
                std::printf("%-10s %3d   balance round %d, %s records: %.2f us a layer, error %.1e\n", f.name, M, round,
                            which ? "permuted" : "plain", u2, e2);
              }
            CK(cudaMemcpy(d_tab, tab.data(), tab.size() * sizeof(int4), cudaMemcpyHostToDevice));
          }
        }
      }
      CK(cudaFree(d_ops));
      for (void* q : halves) CK(cudaFree(q));
      CK(cudaFree(d_cnt));
      if (d_norms) CK(cudaFree(d_norms));
      for (auto* p : X) CK(cudaFree(p));
      for (auto* p : rX) CK(cudaFree(p));
      for (auto* v : {&Q, &Hh, &A, &rQ, &rH, &rA, &rGU, &rO, &rD})
        for (auto* p : *v) CK(cudaFree(p));
    }
    for (Lin& L : lins) {
      CK(cudaFree(L.w));
      CK(cudaFree(L.s));
      if (L.z) CK(cudaFree(L.z));
      if (L.meta) CK(cudaFree(L.meta));
    }
  }
  return failures;
}

void probes(int sms, double ceiling) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  unsigned *ctr, *sink;
  CK(cudaMalloc(&ctr, 4));
  CK(cudaMalloc(&sink, 4));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto time = [&](auto&& body) { return median_event_us(st, a, b, 7, [](int) {}, body); };
  std::printf("\nprobes (%d blocks of 256 threads, one per SM)\n", sms);
  for (int per_sm : {1, 2}) {
    const int G = sms * per_sm;
    const int R = 4000;
    const float t0 = time([&] { barrier_kernel<<<G, 256, 0, st>>>(nullptr, R, nullptr, 0, sink); });
    const float t1 = time([&] {
      CK(cudaMemsetAsync(ctr, 0, 4, st));
      barrier_kernel<<<G, 256, 0, st>>>(ctr, R, nullptr, 0, sink);
    });
    std::printf("grid barrier, %d blocks: %.3f us each (%d barriers in %.0f us; empty loop %.0f us)\n", G,
                (t1 - t0) / R, R, t1, t0);
    const int H = 20000;
    const float th = time([&] {
      CK(cudaMemsetAsync(ctr, 0, 4, st));
      handoff_kernel<<<G, 32, 0, st>>>(ctr, H);
    });
    std::printf("handoff between blocks, %d blocks: %.3f us per producer -> consumer hop\n", G, th / H);
  }
  // Every block reads an op's input at once, against each its own bytes.
  {
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    const int G = sms, R = 200;
    uint4* buf;
    unsigned long long* cyc;
    const size_t most = size_t(57344) / 16 * G;
    CK(cudaMalloc(&buf, most * 16));
    CK(cudaMemset(buf, 1, most * 16));
    CK(cudaMalloc(&cyc, 8));
    std::printf("every block reads an input through L2, all at once (512 threads; us per read, nominal clock):\n");
    for (int bytes : {8192, 16384, 28672, 57344}) {
      float us[2];
      for (int distinct = 0; distinct < 2; ++distinct) {
        CK(cudaMemsetAsync(ctr, 0, 4, st));
        CK(cudaMemsetAsync(cyc, 0, 8, st));
        bcast_kernel<<<G, 512, 0, st>>>(buf, distinct ? bytes / 16 : 0, bytes / 16, ctr, R, cyc, sink);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        unsigned long long c;
        CK(cudaMemcpy(&c, cyc, 8, cudaMemcpyDeviceToHost));
        us[distinct] = static_cast<float>(double(c) / G / R / khz * 1e3);
      }
      std::printf("  %5d B: %.3f us the same bytes, %.3f us each block its own\n", bytes, us[0], us[1]);
    }
    CK(cudaFree(buf));
    CK(cudaFree(cyc));
  }
  // A split-K hand-off's reduction (the down projection's 4096 outputs, say): the barrier alone, then with the adds.
  {
    const int G = sms, R = 200;
    for (int n : {4096, 8192}) {
      float* acc;
      CK(cudaMalloc(&acc, sizeof(float) * n * R));
      float us[3];
      for (int vec : {0, 1, 4}) {
        us[vec == 4 ? 2 : vec] = time([&] {
          CK(cudaMemsetAsync(ctr, 0, 4, st));
          reduce_kernel<<<G, 512, 0, st>>>(acc, n, vec, ctr, R);
        }) / R;
      }
      std::printf("every block adds %d fp32 partial sums, then a grid barrier: %.3f us a round (the barrier alone "
                  "%.3f; one float a red %.3f)\n", n, us[2], us[0], us[1]);
      CK(cudaFree(acc));
    }
  }
  // Barrier under load: each block streams per_block x 16 bytes between barriers.
  const int G = sms;
  for (size_t kb : {64, 256, 1024}) {
    const size_t per_block = kb * 1024 / 16;
    const int R = 16;
    uint4* w;
    const size_t total = per_block * R * G;
    CK(cudaMalloc(&w, total * 16));
    CK(cudaMemset(w, 1, total * 16));
    const float tl = time([&] { barrier_kernel<<<G, 1024, 0, st>>>(nullptr, R, w, per_block, sink); });
    const float tb = time([&] {
      CK(cudaMemsetAsync(ctr, 0, 4, st));
      barrier_kernel<<<G, 1024, 0, st>>>(ctr, R, w, per_block, sink);
    });
    float* sums;
    CK(cudaMalloc(&sums, sizeof(float) * 4096 * R));
    const float ts = time([&] {
      CK(cudaMemsetAsync(ctr, 0, 4, st));
      barrier_kernel<<<G, 1024, 0, st>>>(ctr, R, w, per_block, sink, sums);
    });
    CK(cudaFree(sums));
    std::printf("stream %4zu KB/block, adding 4096 fp32 sums into one vector along the way, then barrier: %.2f us "
                "per round\n", kb, ts / R);
    std::printf("stream %4zu KB/block then barrier: %.2f us per round with, %.2f without (%.1f%% / %.1f%% of ceiling)\n",
                kb, tb / R, tl / R, 100 * total * 16 / (tb * 1e3) / ceiling, 100 * total * 16 / (tl * 1e3) / ceiling);
    CK(cudaFree(w));
  }
  CK(cudaFree(ctr));
  CK(cudaFree(sink));
}

// TMA streaming alone: block b copies its slice of w through `stages` slots
// of `chunk` bytes (bulk copies, each slot's copy cut into `issuers` pieces
// issued by as many lanes), thread 0 waiting for each slot in order and
// refilling it at once: `stages` copies always in flight, nothing consumed.
__global__ void tma_stream_kernel(const char* w, size_t per_block, int chunk, int stages, int issuers,
                                  unsigned* sink) {
  extern __shared__ __align__(128) unsigned char tma_smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(tma_smem);
  unsigned char* ring = tma_smem + 1024;
  const char* src = w + blockIdx.x * per_block;
  const int n = static_cast<int>(per_block / chunk);
  const int piece = chunk / issuers;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(full + s, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const uint64_t pol = qgemv::evict_first_policy();
  auto issue = [&](int i) {
    const int slot = i % stages;
    if (threadIdx.x == 0) mbar_expect_tx(full + slot, chunk);
    __syncwarp();
    if (threadIdx.x < issuers)
      bulk_copy(ring + static_cast<size_t>(slot) * chunk + threadIdx.x * piece,
                src + static_cast<size_t>(i) * chunk + threadIdx.x * piece, piece, full + slot, pol);
  };
  for (int i = 0; i < stages && i < n; ++i) issue(i);
  uint32_t acc = 0;
  for (int i = 0; i < n; ++i) {
    mbar_wait(full + i % stages, (i / stages) & 1);
    acc ^= ring[static_cast<size_t>(i % stages) * chunk + threadIdx.x];
    __syncwarp();
    if (i + stages < n) issue(i + stages);
  }
  if (acc == 0x9eu && threadIdx.x == 999) *sink = acc;
}

void tma_probe(int sms, double ceiling) {
  LabTimer lt;
  cudaStream_t st = lt.st;
  cudaEvent_t a = lt.a, b = lt.b;
  unsigned* sink = lt.sink;
  const size_t total = size_t(1) << 30;
  char* w;
  CK(cudaMalloc(&w, total));
  CK(cudaMemset(w, 1, total));
  std::printf("\nTMA stream probe (1 GB, %% of the read ceiling; blocks x stages x chunk KB, issuing lanes)\n");
  for (int per_sm : {1, 2})
    for (int chunk_kb : {4, 8, 16, 32})
      for (int stages : {2, 4, 8})
        for (int issuers : {1, 4}) {
          const size_t smem = 1024 + size_t(stages) * chunk_kb * 1024;
          if (smem * per_sm > 220 * 1024) continue;
          CK(cudaFuncSetAttribute(tma_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
          const int G = sms * per_sm;
          const size_t per_block = total / G / (chunk_kb * 1024) * (chunk_kb * 1024);
          const float us = median_event_us(st, a, b, 5, [](int) {}, [&] {
            tma_stream_kernel<<<G, 64, smem, st>>>(w, per_block, chunk_kb * 1024, stages, issuers, sink);
          });
          CK(cudaGetLastError());
          const double gbs = double(per_block) * G / (us * 1e3);
          std::printf("  %3d x %d x %2d KB, %d lanes: %5.0f GB/s %5.1f%% (%.1f GB/s an SM, %d KB in flight)\n", G,
                      stages, chunk_kb, issuers, gbs, 100 * gbs / ceiling, gbs / sms, stages * chunk_kb * per_sm);
        }
  CK(cudaFree(w));
}

bool parse(char* text, const char* flag, std::vector<int>& out) {
  for (char* tok = std::strtok(text, ","); tok; tok = std::strtok(nullptr, ",")) {
    char* end;
    const long v = std::strtol(tok, &end, 10);
    if (*end || v < 0 || v > (1L << 24)) {  // (--skip's slices: 64 + (n << 16))
      std::fprintf(stderr, "%s: expected non-negative integers up to 2^24, got %s\n", flag, tok);
      return false;
    }
    out.push_back(static_cast<int>(v));
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool probe_only = false, no_probe = false, tma = false, no_ceiling = false, norm = false;
  const Model* model = &kModels[0];
  int layers = 0;
  std::vector<int> warps, stages, skips;
  std::vector<Fmt> fmts;
  const Fmt all[] = {{"int4g128a", 4, 128, true}, {"int4g128", 4, 128, false}, {"int4", 4, 0, false},
                     {"int8", 8, 0, false}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--probe-only") {
      probe_only = true;
    } else if (a == "--no-probe") {
      no_probe = true;
    } else if (a == "--no-ceiling") {
      no_ceiling = true;
    } else if (a == "--tma-probe") {
      tma = true;
    } else if (a == "--norm") {
      norm = true;
    } else if (a == "--model" && has) {
      model = nullptr;
      for (const Model& m : kModels)
        if (std::strcmp(m.name, argv[i + 1]) == 0) model = &m;
      ++i;
      if (!model) {
        std::fprintf(stderr, "--model: llama3-8b, llama3-70b, qwen2.5-7b or llama2-7b\n");
        return 2;
      }
    } else if (a == "--layers" && has) {
      layers = std::atoi(argv[++i]);
    } else if (a == "--warps" && has) {
      if (!parse(argv[++i], "--warps", warps)) return 2;
    } else if (a == "--stages" && has) {
      if (!parse(argv[++i], "--stages", stages)) return 2;
    } else if (a == "--skip" && has) {
      if (!parse(argv[++i], "--skip", skips)) return 2;
    } else if (a == "--formats" && has) {
      for (char* tok = std::strtok(argv[++i], ","); tok; tok = std::strtok(nullptr, ",")) {
        bool found = false;
        for (const Fmt& f : all)
          if (std::strcmp(f.name, tok) == 0) fmts.push_back(f), found = true;
        if (!found) {
          std::fprintf(stderr, "--formats: unknown %s\n", tok);
          return 2;
        }
      }
    } else {
      std::fprintf(stderr, "unknown argument %s (see the header of dev/persist_lab.cu)\n", argv[i]);
      return 2;
    }
  }
  for (int s : stages)
    if (s <= qgemv::kChainChunk || s % qgemv::kChainChunk) {
      std::fprintf(stderr, "--stages: a multiple of %d above %d\n", qgemv::kChainChunk, qgemv::kChainChunk);
      return 2;
    }
  for (int w : warps)
    if (w < 1 || w > qgemv::kChainMaxWarps) {
      std::fprintf(stderr, "--warps: 1..%d\n", qgemv::kChainMaxWarps);
      return 2;
    }
  if (warps.empty()) warps = {16};
  if (stages.empty()) stages = {8};
  if (skips.empty()) skips = {0};

  if (fmts.empty()) fmts = {all[0], all[2], all[3]};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  double ceiling = 4350;  // --no-ceiling (runs under compute-sanitizer): the H200's, for the percentages only
  if (!no_ceiling) {
    ReadBuffer rb(size_t(2) << 30);
    ceiling = rb.bytes / (rb.us(rb.bytes, prop.multiProcessorCount, a, b, 5) * 1e3);  // GB/s
  }
  std::printf("read ceiling: %.0f GB/s\n", ceiling);
  if (tma) tma_probe(prop.multiProcessorCount, ceiling);
  if (!no_probe) probes(prop.multiProcessorCount, ceiling);
  else std::printf("(probes skipped)\n");
  if (probe_only) return 0;
  std::vector<Variant> variants;
  for (int w : warps)
    for (int s : stages)
      for (int k : skips)
        variants.push_back({w, s, k});
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int failures = run_chain(*model, layers ? layers : model->layers, fmts, {1}, variants, ceiling,
                                 prop.multiProcessorCount, clock_khz, norm);
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "every persistent result matches the per-op chain",
              failures);
  return failures ? 1 : 0;
}
