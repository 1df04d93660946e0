// int4 weight-only GEMV instances: {fp16, bf16} x {symmetric, zero points} x {1, 2} n-tiles.
// Per-channel and group-wise (32/64/128) share one instance: the group size
// is a runtime value because it only decides when partial sums are folded.
#include "gemv_mma.cuh"

namespace qgemv {

Status gemv_int4(const GemvParams& p, int num_sms, cudaStream_t stream) {
  if (p.group_size != 0 && p.group_size != 32 && p.group_size != 64 && p.group_size != 128)
    return Status::kBadGroupSize;
  if (p.Kp % 32 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  if (p.zeros != nullptr) {
    if (p.group_size == 0) return Status::kNoKernel;  // zero points are group-wise only
    return dispatch_gemv_tokens<4, true>(p, num_sms, stream);
  }
  return dispatch_gemv_tokens<4, false>(p, num_sms, stream);
}

}  // namespace qgemv
