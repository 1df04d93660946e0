// int8 per-channel weight-only GEMV instances: {fp16, bf16} x {1, 2} n-tiles.
#include "gemv_mma.cuh"

namespace qgemv {

Status gemv_int8(const GemvParams& p, cudaStream_t stream) {
  if (p.group_size != 0 || p.zeros != nullptr) return Status::kNoKernel;
  if (p.Kp % 16 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  return dispatch_gemv_tokens<8, 0, false>(p, stream);
}

const char* status_string(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kBadShape: return "shape not supported by any kernel";
    case Status::kBadGroupSize: return "group_size must be 32, 64 or 128";
    case Status::kNoKernel: return "no kernel for this configuration";
    case Status::kLaunchFailed: return "kernel launch failed";
  }
  return "unknown status";
}

}  // namespace qgemv
