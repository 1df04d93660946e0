// The int8 rows of the GEMV instance table (instances.h): per channel.
#include "gemv_mma.cuh"

namespace qgemv {

Status gemv_int8(const GemvParams& p, cudaStream_t stream) {
  if (p.Kp % 16 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  return dispatch_gemv<8>(p, stream);  // groups or zero points: no row, kNoKernel
}

}  // namespace qgemv
