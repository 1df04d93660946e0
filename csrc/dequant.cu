// Dequantize packed weights to a dense [N, K] matrix for the prefill path
// (M > 16 tokens), where a tensor-core GEMM on the dense weight beats any
// GEMV.  w = (q - zero) * scale is computed in fp32 and rounded once.
#include "qgemv_common.cuh"

namespace qgemv {
namespace {

// Eight consecutive outputs with 16-byte stores (rows are K % 8 == 0 long, so
// every 8-element chunk is 16-byte aligned for 2-byte types).
template <typename OutT>
__device__ __forceinline__ void store8(OutT* o, const OutT (&v)[8]) {
  static_assert(sizeof(OutT) == 2 || sizeof(OutT) == 4, "store8: 2- or 4-byte outputs");
  const uint4* src = reinterpret_cast<const uint4*>(v);
  uint4* dst = reinterpret_cast<uint4*>(o);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(OutT)) / 2; ++i) dst[i] = src[i];
}

// One thread per logical int4 word (8 consecutive k of one row).
template <typename OutT>
__global__ void dequant_int4_kernel(const GemvParams p, OutT* __restrict__ out) {
  const int words = p.K / 8;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.N * words) return;
  const int row = idx / words, lw = idx % words;
  // Undo the word swizzle: within a block of 4c words (c = 4 except in the
  // tail) logical word 4j + t is stored at position t*c + j.
  const int nfull = p.Kp / 128;
  const int block = lw / 16, j = (lw % 16) / 4, t = lw % 4;
  const int c = block < nfull ? 4 : (p.Kp % 128) / 32;
  // Panels (formats.to_panels): block `block` of row i of an r-row panel
  // starts at word block*16*r + i*4c of the panel.
  const int p0 = row / kPanelRows * kPanelRows, r = min(kPanelRows, p.N - p0), i = row - p0;
  const uint32_t* q = static_cast<const uint32_t*>(p.qweight) + static_cast<size_t>(p0) * (p.Kp / 8);
  const uint32_t w = q[block * 16 * r + i * 4 * c + t * c + j];
  const __half* scales = static_cast<const __half*>(p.scales);
  float scale, zero = 8.f;
  if (p.group_size > 0) {
    const int ng = p.K / p.group_size, gi = lw * 8 / p.group_size;
    scale = __half2float(scales[row * ng + gi]);
    if (p.zeros != nullptr) zero = p.zeros[row * ng + gi];
  } else {
    scale = __half2float(scales[row]);
  }
  // Nibble position i holds logical element kOrder[i] = {0,2,4,6,1,3,5,7}.
  OutT v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = (i < 4) ? 2 * i : 2 * (i - 4) + 1;
    v[e] = from_float<OutT>((static_cast<float>((w >> (4 * i)) & 0xf) - zero) * scale);
  }
  store8(out + static_cast<size_t>(row) * p.K + lw * 8, v);
}

// One thread per 8 consecutive int8 weights of one row.
template <typename OutT>
__global__ void dequant_int8_kernel(const GemvParams p, OutT* __restrict__ out) {
  const int chunks = p.K / 8;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.N * chunks) return;
  const int row = idx / chunks, ch = idx % chunks;
  // Panels (formats.to_panels): 64-byte tile `tile` of row i of an r-row
  // panel starts at byte tile*64*r + i*seg, seg = 64 (or the row's remainder
  // in the last, partial tile).
  const int p0 = row / kPanelRows * kPanelRows, r = min(kPanelRows, p.N - p0), i = row - p0;
  const int tile = ch / 8, seg = tile < p.Kp / kTileBytes ? kTileBytes : p.Kp % kTileBytes;
  const int8_t* q = static_cast<const int8_t*>(p.qweight) + static_cast<size_t>(p0) * p.Kp + tile * kTileBytes * r +
                    i * seg + (ch % 8) * 8;
  const float scale = __half2float(static_cast<const __half*>(p.scales)[row]);
  const uint2 raw = *reinterpret_cast<const uint2*>(q);  // 8 int8, 8-byte aligned (Kp % 16 == 0)
  const int8_t* b = reinterpret_cast<const int8_t*>(&raw);
  OutT v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = from_float<OutT>(static_cast<float>(b[e]) * scale);
  store8(out + static_cast<size_t>(row) * p.K + ch * 8, v);
}

template <typename OutT>
Status run_int4(const GemvParams& p, void* out, cudaStream_t stream) {
  const int total = p.N * (p.K / 8);
  dequant_int4_kernel<OutT><<<(total + 255) / 256, 256, 0, stream>>>(p, static_cast<OutT*>(out));
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

template <typename OutT>
Status run_int8(const GemvParams& p, void* out, cudaStream_t stream) {
  const int total = p.N * (p.K / 8);
  dequant_int8_kernel<OutT><<<(total + 255) / 256, 256, 0, stream>>>(p, static_cast<OutT*>(out));
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kLaunchFailed;
}

}  // namespace

// The output type follows p.act.
Status dequant_int4(const GemvParams& p, void* w_out, cudaStream_t stream) {
  switch (p.act) {
    case ActType::kHalf: return run_int4<__half>(p, w_out, stream);
    case ActType::kBFloat16: return run_int4<__nv_bfloat16>(p, w_out, stream);
    case ActType::kFloat32: return run_int4<float>(p, w_out, stream);
  }
  return Status::kNoKernel;
}

Status dequant_int8(const GemvParams& p, void* w_out, cudaStream_t stream) {
  switch (p.act) {
    case ActType::kHalf: return run_int8<__half>(p, w_out, stream);
    case ActType::kBFloat16: return run_int8<__nv_bfloat16>(p, w_out, stream);
    case ActType::kFloat32: return run_int8<float>(p, w_out, stream);
  }
  return Status::kNoKernel;
}

}  // namespace qgemv
