// int4 weight-only GEMV instances: {fp16, bf16} x {per channel, group-wise,
// group-wise with zero points} x {1, 2} n-tiles.  The group size (32/64/128)
// is a runtime value: it only decides when partial sums are folded.
#include "gemv_mma.cuh"

namespace qgemv {

Status gemv_int4(const GemvParams& p, cudaStream_t stream) {
  if (p.group_size != 0 && p.group_size != 32 && p.group_size != 64 && p.group_size != 128)
    return Status::kBadGroupSize;
  if (p.Kp % 32 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  if (p.group_size == 0) {
    if (p.zeros != nullptr) return Status::kNoKernel;  // zero points are group-wise only
    return dispatch_gemv_tokens<4, kPerChannel>(p, stream);
  }
  if (p.zeros != nullptr) return dispatch_gemv_tokens<4, kGroupAsym>(p, stream);
  return dispatch_gemv_tokens<4, kGroupSym>(p, stream);
}

}  // namespace qgemv
