// The fixed-order sum of split-K partials, shared by the tiled GEMMs
// (gemm_mma.cu and gemm_wgmma.cu): each split writes fp32 partials
// [splits, M, N] and this kernel adds them in split order, so results do not
// depend on which split finished first.
#include <algorithm>

#include "qgemv_common.cuh"

namespace qgemv {
namespace {

// y[tok, row] = sum over splits of partial[z, tok, row], in split order.
template <typename T>
__global__ void reduce_splits_kernel(const float* __restrict__ partial, int splits, int M, int N, T* y, int ldy) {
  const size_t mn = static_cast<size_t>(M) * N;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < mn;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int z = 0; z < splits; ++z) v += partial[z * mn + i];
    ActTraits<T>::store(y + (i / N) * ldy + i % N, v);
  }
}

}  // namespace

Status reduce_splits(const GemvParams& p, const float* partial, int splits, cudaStream_t stream) {
  const size_t mn = static_cast<size_t>(p.M) * p.N;
  const int blocks = static_cast<int>(std::min<size_t>((mn + 255) / 256, 4096));
  if (p.act == ActType::kHalf)
    reduce_splits_kernel<__half><<<blocks, 256, 0, stream>>>(partial, splits, p.M, p.N, static_cast<__half*>(p.y), p.ldy);
  else if (p.act == ActType::kBFloat16)
    reduce_splits_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(partial, splits, p.M, p.N,
                                                                    static_cast<__nv_bfloat16*>(p.y), p.ldy);
  else
    return Status::kNoKernel;
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

}  // namespace qgemv
