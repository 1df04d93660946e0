// int8 per-channel weight-only GEMV instances: {fp16, bf16} x {1, 2} n-tiles.
#include "gemv_mma.cuh"

namespace qgemv {

Status gemv_int8(const GemvParams& p, cudaStream_t stream) {
  if (p.group_size != 0 || p.zeros != nullptr) return Status::kNoKernel;
  if (p.Kp % 16 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  return dispatch_gemv_tokens<8, 0, false>(p, stream);
}

}  // namespace qgemv
