// Host-side state of the library: status strings and the GEMV's programmatic
// launch mode (qgemv.h).  No kernels here.
#include <atomic>

#include <cuda_runtime.h>

#include "qgemv.h"

namespace qgemv {

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
