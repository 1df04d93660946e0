// The int4 rows of the GEMV instance table (instances.h): per channel and
// G = 32 / 64 / 128, symmetric or with zero points.  The group size is a
// template parameter (see GemvMma in gemv_mma.cuh).
#include "gemv_mma.cuh"

namespace qgemv {

Status gemv_int4(const GemvParams& p, cudaStream_t stream) {
  if (p.Kp % 32 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  if (p.group_size != 0 && p.group_size != 32 && p.group_size != 64 && p.group_size != 128)
    return Status::kBadGroupSize;
  return dispatch_gemv<4>(p, stream);  // zero points per channel: no row, kNoKernel
}

}  // namespace qgemv
