// int4 weight-only GEMV instances: {fp16, bf16} x {1, 2} n-tiles x {per
// channel, G = 32 / 64 / 128 symmetric, G = 32 / 64 / 128 with zero points},
// plus two-row-tile versions of the 2-n-tile per-channel and G = 128 ones.
// The group size is a template parameter (see GemvMma in gemv_mma.cuh).
#include "gemv_mma.cuh"

namespace qgemv {

namespace {
template <int kGroup>
Status dispatch_zeros(const GemvParams& p, cudaStream_t stream) {
  return p.zeros != nullptr ? dispatch_gemv_tokens<4, kGroup, true>(p, stream)
                            : dispatch_gemv_tokens<4, kGroup, false>(p, stream);
}
}  // namespace

Status gemv_int4(const GemvParams& p, cudaStream_t stream) {
  if (p.Kp % 32 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  switch (p.group_size) {
    case 0:
      if (p.zeros != nullptr) return Status::kNoKernel;  // zero points are group-wise only
      return dispatch_gemv_tokens<4, 0, false>(p, stream);
    case 32: return dispatch_zeros<32>(p, stream);
    case 64: return dispatch_zeros<64>(p, stream);
    case 128: return dispatch_zeros<128>(p, stream);
  }
  return Status::kBadGroupSize;
}

}  // namespace qgemv
