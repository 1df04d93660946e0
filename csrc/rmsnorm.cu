// The generation engine's residual add + RMSNorm, with the normalized row
// gathered into an act-order linear's input order, in one kernel
// (qgemv::add_rms_gather; qgemv.h).  Written because torch.compile emits
// this as two kernels (the norm, then the gather): measured on the H200 with
// dev/glue_gather_probe.py, 3.06 us per call against 1.78 for the same norm
// without the gather, twice per decoder layer of an act-order model.
//
// One block per row.  The row s = x + delta (rounded to the activation type,
// as torch's add is) goes to x_out and to shared memory, with the gain w;
// the block sums s^2 in fp32; then
//   y[k] = round(w[p] * round(s[p] * rsqrt(mean(s^2) + eps))),  p = perm[k]:
// the operations of transformers' LlamaRMSNorm (fp32 statistics, the
// normalized value cast back, then the gain), gathered.
// perm is clamped into [0, H): a bad index gives wrong outputs, never a read
// outside the row.
#include <algorithm>
#include <cstdint>

#include "qgemv_common.cuh"

namespace qgemv {
namespace {

// kVec: 16-byte accesses (x, delta, w, y rows and perm in pieces of kV
// elements; H % kV == 0 and aligned pointers), so that a row of 4096 fp16
// takes one load per thread (512 threads) instead of a loop of dependent
// scalar loads: the first version, one 2-byte element per thread and step
// with 256 threads, took 8.2 us at H = 4096 on the H200, this one 2.65.
// (Loading perm before the row instead of after the reduction measured
// 2.62: no gain, not kept.)
template <typename T, bool kVec>
__global__ void add_rms_gather_kernel(const T* __restrict__ x, const T* __restrict__ delta,
                                      const T* __restrict__ w, const int32_t* __restrict__ perm,
                                      T* __restrict__ x_out, T* __restrict__ y, int H, float eps) {
  constexpr int kV = kVec ? 16 / sizeof(T) : 1;  // elements per access
  extern __shared__ __align__(16) unsigned char norm_smem[];
  T* srow = reinterpret_cast<T*>(norm_smem);  // s = x + delta, rounded (exact as T)
  T* wrow = srow + H;                         // the gain, copied so that the gather reads shared memory
  float* warp_sums = reinterpret_cast<float*>(wrow + H);
  const size_t base = static_cast<size_t>(blockIdx.x) * H;
  const int pieces = H / kV;
  float ss = 0.f;
  for (int c = threadIdx.x; c < pieces; c += blockDim.x) {
    T xv[kV], dv[kV], sv[kV], wv[kV];
    if constexpr (kVec) {
      *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(x + base + c * kV);
      *reinterpret_cast<uint4*>(dv) = *reinterpret_cast<const uint4*>(delta + base + c * kV);
      *reinterpret_cast<uint4*>(wv) = *reinterpret_cast<const uint4*>(w + c * kV);
    } else {
      xv[0] = x[base + c];
      dv[0] = delta[base + c];
      wv[0] = w[c];
    }
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      sv[i] = from_float<T>(to_float(xv[i]) + to_float(dv[i]));
      const float f = to_float(sv[i]);
      ss = fmaf(f, f, ss);
    }
    if constexpr (kVec) {
      *reinterpret_cast<uint4*>(x_out + base + c * kV) = *reinterpret_cast<const uint4*>(sv);
      *reinterpret_cast<uint4*>(srow + c * kV) = *reinterpret_cast<const uint4*>(sv);
      *reinterpret_cast<uint4*>(wrow + c * kV) = *reinterpret_cast<const uint4*>(wv);
    } else {
      x_out[base + c] = sv[0];
      srow[c] = sv[0];
      wrow[c] = wv[0];
    }
  }
  ss = warp_sum(ss);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) warp_sums[warp] = ss;
  __syncthreads();  // also publishes srow and wrow
  float total = 0.f;
  for (int i = 0; i < nwarps; ++i) total += warp_sums[i];  // the same order in every thread
  const float r = rsqrtf(total / static_cast<float>(H) + eps);
  const unsigned last = static_cast<unsigned>(H - 1);
  for (int c = threadIdx.x; c < pieces; c += blockDim.x) {
    int32_t pv[kV];
    T yv[kV];
    if constexpr (kVec) {
#pragma unroll
      for (int i = 0; i < kV; i += 4)
        *reinterpret_cast<int4*>(pv + i) = *reinterpret_cast<const int4*>(perm + c * kV + i);
    } else {
      pv[0] = perm[c];
    }
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      const unsigned p = min(static_cast<unsigned>(pv[i]), last);
      const T n = from_float<T>(to_float(srow[p]) * r);
      yv[i] = from_float<T>(to_float(wrow[p]) * to_float(n));
    }
    if constexpr (kVec) {
      *reinterpret_cast<uint4*>(y + base + c * kV) = *reinterpret_cast<const uint4*>(yv);
    } else {
      y[base + c] = yv[0];
    }
  }
}

template <typename T, bool kVec>
Status launch(const void* x, const void* delta, const void* w, const int32_t* perm, void* x_out, void* y, int rows,
              int H, float eps, cudaStream_t stream) {
  constexpr int kV = kVec ? 16 / sizeof(T) : 1;
  const int pieces = H / kV;
  const int threads = std::min(1024, std::max(32, (pieces + 31) / 32 * 32));  // one piece per thread up to 1024
  const size_t smem = 2 * static_cast<size_t>(H) * sizeof(T) + kWarpSize * sizeof(float);  // rows, warp sums
  auto kernel = add_rms_gather_kernel<T, kVec>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess)
    return Status::kLaunchFailed;
  kernel<<<rows, threads, smem, stream>>>(static_cast<const T*>(x), static_cast<const T*>(delta),
                                          static_cast<const T*>(w), perm, static_cast<T*>(x_out),
                                          static_cast<T*>(y), H, eps);
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

template <typename T>
Status launch_any(const void* x, const void* delta, const void* w, const int32_t* perm, void* x_out, void* y,
                  int rows, int H, float eps, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const bool aligned = [&] {
    for (const void* ptr : {x, delta, w, static_cast<const void*>(perm), static_cast<const void*>(x_out),
                            static_cast<const void*>(y)})
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
    return true;
  }();
  if (H % kV == 0 && aligned) return launch<T, true>(x, delta, w, perm, x_out, y, rows, H, eps, stream);
  return launch<T, false>(x, delta, w, perm, x_out, y, rows, H, eps, stream);
}

}  // namespace

Status add_rms_gather(ActType act, const void* x, const void* delta, const void* w, const int32_t* perm,
                      void* x_out, void* y, int rows, int H, float eps, cudaStream_t stream) {
  if (rows < 0 || H < 1 || H > kNormMaxWidth || rows > 0x7fffffff / H) return Status::kBadShape;
  if (rows == 0) return Status::kOk;
  switch (act) {
    case ActType::kHalf:
      return launch_any<__half>(x, delta, w, perm, x_out, y, rows, H, eps, stream);
    case ActType::kBFloat16:
      return launch_any<__nv_bfloat16>(x, delta, w, perm, x_out, y, rows, H, eps, stream);
    case ActType::kFloat32:
      return launch_any<float>(x, delta, w, perm, x_out, y, rows, H, eps, stream);
  }
  return Status::kNoKernel;
}

}  // namespace qgemv
