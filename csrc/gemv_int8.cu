// int8 per-channel weight-only GEMV instances: {fp16, bf16} x {1, 2} n-tiles.
#include "gemv_mma.cuh"

#include <atomic>

namespace qgemv {

Status gemv_int8(const GemvParams& p, cudaStream_t stream) {
  if (p.group_size != 0 || p.zeros != nullptr) return Status::kNoKernel;
  if (p.Kp % 16 != 0 || p.K % 8 != 0 || p.K > p.Kp) return Status::kBadShape;
  return dispatch_gemv_tokens<8, 0, false>(p, stream);
}

namespace {
std::atomic<int> g_gemv_pdl{-1};
}  // namespace

void set_gemv_pdl(int mode) { g_gemv_pdl.store(mode); }

int gemv_pdl_flags() {
  int mode = g_gemv_pdl.load();
  if (mode < 0) mode = kGemvPdlDefault;
  if ((mode & kPdlLaunch) == 0) return 0;
  // Compute capability per device, asked once each (0: not asked yet).
  static std::atomic<int> major[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int cc = major[dev].load();
  if (cc == 0) {
    if (cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
    major[dev].store(cc);
  }
  return cc >= 9 ? mode : 0;
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
