// The seed's fp32 SGEMV family, y[N] = A[N, K] @ x[K]:
//
//   k32  : one warp per row, lane k reads A[row, k + 32 i] (scalar loads).
//   k128 : one warp per row, each lane reads a float4, a warp covers 128 k per
//          step; needs K % 4 == 0 and 16-byte aligned A and x.
//   k16  : K <= 16, two rows per warp (16 lanes per row), reduced with a
//          16-wide shuffle tree.
//
// Unlike the seed, every variant takes any N and K (tails are guarded), and
// the two streaming variants keep kUnroll independent loads in flight per
// lane so that a warp has enough bytes outstanding to cover DRAM latency.
// Rows of A are read once: evict-first, no L1 allocation.
#include "qgemv_common.cuh"

namespace qgemv {
namespace {

constexpr int kRowsPerBlockSgemv = 4;  // 4 warps per block, as in the seed
constexpr int kUnrollSgemv = 4;

__global__ void sgemv_k32_kernel(const float* __restrict__ A, const float* __restrict__ x,
                                 float* __restrict__ y, int N, int K) {
  const int row = blockIdx.x * kRowsPerBlockSgemv + threadIdx.y;
  if (row >= N) return;  // uniform per warp
  const int lane = threadIdx.x;
  const float* a = A + static_cast<size_t>(row) * K;
  const uint64_t pol = evict_first_policy();
  float sum = 0.f;
  int k = lane;
  for (; k + 32 * (kUnrollSgemv - 1) < K; k += 32 * kUnrollSgemv) {
    float av[kUnrollSgemv];
#pragma unroll
    for (int u = 0; u < kUnrollSgemv; ++u) av[u] = ld_stream_f1(a + k + 32 * u, pol);
#pragma unroll
    for (int u = 0; u < kUnrollSgemv; ++u) sum = fmaf(av[u], __ldg(x + k + 32 * u), sum);
  }
  for (; k < K; k += 32) sum = fmaf(ld_stream_f1(a + k, pol), __ldg(x + k), sum);
  sum = warp_sum(sum);
  if (lane == 0) y[row] = sum;
}

__global__ void sgemv_k128_kernel(const float* __restrict__ A, const float* __restrict__ x,
                                  float* __restrict__ y, int N, int K) {
  const int row = blockIdx.x * kRowsPerBlockSgemv + threadIdx.y;
  if (row >= N) return;
  const int lane = threadIdx.x;
  const int K4 = K / 4;
  const float* a = A + static_cast<size_t>(row) * K;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const uint64_t pol = evict_first_policy();
  float sum = 0.f;
  int i = lane;
  for (; i + 32 * (kUnrollSgemv - 1) < K4; i += 32 * kUnrollSgemv) {
    float4 av[kUnrollSgemv];
#pragma unroll
    for (int u = 0; u < kUnrollSgemv; ++u) av[u] = ld_stream_f4(a + 4 * (i + 32 * u), pol);
#pragma unroll
    for (int u = 0; u < kUnrollSgemv; ++u) {
      const float4 xv = __ldg(x4 + i + 32 * u);
      sum = fmaf(av[u].x, xv.x, fmaf(av[u].y, xv.y, fmaf(av[u].z, xv.z, fmaf(av[u].w, xv.w, sum))));
    }
  }
  for (; i < K4; i += 32) {
    const float4 av = ld_stream_f4(a + 4 * i, pol);
    const float4 xv = __ldg(x4 + i);
    sum = fmaf(av.x, xv.x, fmaf(av.y, xv.y, fmaf(av.z, xv.z, fmaf(av.w, xv.w, sum))));
  }
  sum = warp_sum(sum);
  if (lane == 0) y[row] = sum;
}

template <int kRowsPerWarp>
__global__ void sgemv_k16_kernel(const float* __restrict__ A, const float* __restrict__ x,
                                 float* __restrict__ y, int N, int K) {
  constexpr int kLanesPerRow = kWarpSize / kRowsPerWarp;
  const int lane = threadIdx.x;
  const int k = lane % kLanesPerRow;
  const int row = (blockIdx.x * kRowsPerBlockSgemv + threadIdx.y) * kRowsPerWarp + lane / kLanesPerRow;
  // Every lane takes part in the shuffles, so out-of-range rows add zeros
  // instead of returning early.
  float v = 0.f;
  if (row < N && k < K) v = A[static_cast<size_t>(row) * K + k] * __ldg(x + k);
  v = warp_sum<kLanesPerRow>(v);
  if (row < N && k == 0) y[row] = v;
}

}  // namespace

SgemvKernel sgemv_choose(int N, int K, const float* A, const float* x) {
  (void)N;
  if (K <= 16) return SgemvKernel::kK16;
  const bool aligned = (reinterpret_cast<uintptr_t>(A) % 16 == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0);
  if (K % 4 == 0 && aligned) return SgemvKernel::kK128;
  return SgemvKernel::kK32;
}

Status sgemv_f32(const float* A, const float* x, float* y, int N, int K, SgemvKernel which,
                 cudaStream_t stream) {
  if (N < 1 || K < 1) return Status::kBadShape;
  if (which == SgemvKernel::kAuto) which = sgemv_choose(N, K, A, x);
  const dim3 block(kWarpSize, kRowsPerBlockSgemv);
  switch (which) {
    case SgemvKernel::kK32:
      sgemv_k32_kernel<<<(N + kRowsPerBlockSgemv - 1) / kRowsPerBlockSgemv, block, 0, stream>>>(A, x, y, N, K);
      break;
    case SgemvKernel::kK128:
      if (K % 4 != 0 || sgemv_choose(N, 1 << 20, A, x) != SgemvKernel::kK128) return Status::kBadShape;
      sgemv_k128_kernel<<<(N + kRowsPerBlockSgemv - 1) / kRowsPerBlockSgemv, block, 0, stream>>>(A, x, y, N, K);
      break;
    case SgemvKernel::kK16: {
      if (K > 16) return Status::kBadShape;
      constexpr int kRowsPerBlock16 = kRowsPerBlockSgemv * 2;
      sgemv_k16_kernel<2><<<(N + kRowsPerBlock16 - 1) / kRowsPerBlock16, block, 0, stream>>>(A, x, y, N, K);
      break;
    }
    default:
      return Status::kNoKernel;
  }
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

}  // namespace qgemv
