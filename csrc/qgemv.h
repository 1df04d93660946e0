// qgemv pointer-level API.
//
// The kernels know nothing about torch: they take raw device pointers, one
// parameter struct, and a stream, and report failures as a Status code that
// the torch glue (torch_bindings.cpp) turns into a readable error.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace qgemv {

enum class Status : int {
  kOk = 0,
  kBadShape,          // a size is outside what any kernel instance supports
  kBadGroupSize,      // group_size not in {32, 64, 128}
  kNoKernel,          // no instantiation for this configuration
  kLaunchFailed,      // cudaGetLastError() after the launch was not cudaSuccess
};

const char* status_string(Status s);

// kFloat32 is accepted by the dequantize kernels only (fp32 activations take
// the dequantize + GEMM path).
enum class ActType : int { kHalf = 0, kBFloat16 = 1, kFloat32 = 2 };

// Parameters of one weight-only GEMV / small-GEMM, y[M, N] = x[M, K] @ W^T.
struct GemvParams {
  const void* x;          // [M, K] activations (fp16 or bf16), row stride ldx elements,
                          // 16-byte aligned rows (K % 8 == 0 and ldx % 8 == 0).
  const void* qweight;    // packed weights, layout in qgemv/formats.py:
                          //   int8: int8  [N, Kp],   Kp = round_up(K, 16)
                          //   int4: int32 [N, Kp/8], Kp = round_up(K, 32), swizzled
  const void* scales;     // fp16 [N] (per channel) or [N, K / group_size]
  const uint8_t* zeros;   // uint8 [N, K / group_size] zero points, or nullptr
                          // (symmetric: implicit zero 8 for int4)
  void* y;                // [M, N] output in the activation type, row stride ldy
  int M, N, K;            // logical sizes (tokens, output channels, input channels)
  int Kp;                 // padded K of the packed weight rows
  int ldx, ldy;           // row strides of x and y, in elements
  int group_size;         // 0 = one scale per output channel
  ActType act;
  int warps_per_block;    // 0 = let the launcher choose (see choose_warps)
  const int32_t* perm;    // [K] or nullptr: multiply x[:, perm] instead of x (an act-order
                          // checkpoint's input order), 16-byte aligned.  The GEMV gathers
                          // in its prologue when gemv_gathers(M, N, K) holds; every other
                          // path needs the caller to gather x first (torch_bindings.cpp).
};

// Largest number of tokens the GEMV kernels take in one launch; above it the
// caller must chunk or use the dequantize + GEMM path (see dispatch in
// torch_bindings.cpp).
constexpr int kMaxGemvTokens = 16;

// The GEMV gathers x[:, perm] itself (each block, in shared memory, before
// its first tile: x and the gathered x, M x K fp16 / bf16 each, and perm, K
// int32) for up to 8 tokens while that takes at most kGatherMaxBytes
// (M = 1 up to K = 4096, M = 3 up to 2048), on at most kGatherMaxPanels
// 16-row panels; elsewhere perm must be nullptr and the caller gathers.
// Every block re-reads x and perm (4 (M + 1) K bytes from L2, against its
// 8 K bytes of int4 weights) and the shared memory cuts the resident blocks.
// Measured on the H200 (bench_import, int4 g128 with zeros, M = 1; us with
// the gather in the GEMV / as its own kernel first / without a perm):
// 4096x4096 6.12 / 10.45 / 6.02, 6144x4096 7.81 / 11.46 / 7.08; but
// 8192x8192 (64 KB) 20.51 / 18.50 / 13.16 and 28672x4096 30.66 / 29.66 /
// 22.82, hence the two limits.
constexpr long long kGatherMaxBytes = 32 * 1024;
constexpr int kGatherMaxPanels = 512;
inline long long gemv_gather_smem_bytes(int M, int K) { return 4LL * M * K + 4LL * K; }
inline bool gemv_gathers(int M, int N, int K) {
  return M >= 1 && M <= 8 && (N + 15) / 16 <= kGatherMaxPanels && gemv_gather_smem_bytes(M, K) <= kGatherMaxBytes;
}

// Programmatic dependent launch of the GEMV (compute capability 9.0 and up):
// the launch may begin while the kernel before it in the stream finishes.
// Each block then waits (griddepcontrol.wait) until that kernel has
// completed and its writes are visible before it reads x, copies weights
// into shared memory or writes y.  Flags (a mode is their sum):
//   kPdlLaunch   1: launch as a programmatic dependent launch;
//   kPdlPrefetch 2: before the wait, prefetch the start of the block's weight
//                   panels into L2 (only L2: every write lands there, so a
//                   weight written by the kernel before is never read stale);
//   kPdlRelease  4: let the next programmatic launch begin as soon as every
//                   block of this one has started.
// set_gemv_pdl(mode): -1 the default (kGemvPdlDefault), 0 off, or kPdlLaunch
// plus any of the others.  gemv_pdl_flags: the flags the next launch on the
// current device uses (0 where unsupported).
enum : int { kPdlLaunch = 1, kPdlPrefetch = 2, kPdlRelease = 4 };
// Off by default: in the decode benchmark (one CUDA graph per step, the GEMVs
// between torch.compile'd glue kernels) every mode cost about 2.8% per token
// on the H200; it gains only where GEMVs follow each other (BENCHMARKS.md).
constexpr int kGemvPdlDefault = 0;
void set_gemv_pdl(int mode);
int gemv_pdl_flags();

Status gemv_int4(const GemvParams& p, cudaStream_t stream);
Status gemv_int8(const GemvParams& p, cudaStream_t stream);

// Tiled GEMM for any M >= 1 (meant for prefill, M > 16): the packed weight is
// read once per 32 or 64 tokens and dequantized in registers
// (csrc/gemm_mma.cu).  Same formats and parameters as the GEMV;
// warps_per_block is ignored.  When the grid is too small to fill the GPU,
// K is split: gemm_splits(p, bits) says into how many parts, and the caller
// passes that count with a float workspace of splits x M x N elements
// (workspace nullptr or splits 1: no split).
int gemm_splits(const GemvParams& p, int bits);
Status gemm_int4(const GemvParams& p, float* workspace, int splits, cudaStream_t stream);
Status gemm_int8(const GemvParams& p, float* workspace, int splits, cudaStream_t stream);

// Hopper GEMM for prefill (csrc/gemm_wgmma.cu): the tiled GEMM's weight
// stream and register dequantization feeding wgmma (sm_90a; H100 / H200).
// wgmma_plan says whether it runs here (ok: this build has sm_90a code and
// the device is compute capability 9.0), the K splits it wants, and the
// bytes of the permuted-activation workspace it needs (xperm, 16-byte
// aligned); partial is a float workspace of splits x M x N when splits > 1.
struct WgmmaPlan {
  bool ok;
  int splits;
  size_t xperm_bytes;
};
WgmmaPlan wgmma_plan(const GemvParams& p, int bits);
bool wgmma_supported();  // the current device can run this build's wgmma GEMM (asked per device)
Status wgmma_int4(const GemvParams& p, void* xperm, float* partial, int splits, cudaStream_t stream);
Status wgmma_int8(const GemvParams& p, void* xperm, float* partial, int splits, cudaStream_t stream);
// (Its block shape can be forced for tests: testing.h.)

// Shared by the two tiled GEMMs: shape checks, and the fixed-order sum of
// split-K partials [splits, M, N] into p.y.
Status check_int4_gemm(const GemvParams& p);
Status check_int8_gemm(const GemvParams& p);
Status reduce_splits(const GemvParams& p, const float* partial, int splits, cudaStream_t stream);

// Dequantize the packed weight of p into w_out[N, K] (activation type),
// w = (q - zero) * scale rounded once.  Used for the prefill (M > 16) path.
Status dequant_int4(const GemvParams& p, void* w_out, cudaStream_t stream);
Status dequant_int8(const GemvParams& p, void* w_out, cudaStream_t stream);

// The generation engine's residual add + RMSNorm with an act-order gather
// (csrc/rmsnorm.cu), over `rows` contiguous rows of width H (1..kNormMaxWidth)
// of the activation type: x_out = x + delta; y[k] = w[perm[k]] * n[perm[k]],
// n = x_out / sqrt(mean(x_out^2) + eps) rounded to the activation type.
constexpr int kNormMaxWidth = 16384;  // two rows of it in shared memory: 128 KB in fp32
Status add_rms_gather(ActType act, const void* x, const void* delta, const void* w, const int32_t* perm,
                      void* x_out, void* y, int rows, int H, float eps, cudaStream_t stream);

// Decode attention for the engine's per-op step (csrc/decode_attention.cu): one query token a sequence
// against the cache slots pad[b] .. slot only (not the whole cache), every query head of a kv head's GQA
// group in one block; fp16 or bf16.  splits > 1 cuts each sequence's visible keys into that many shares
// and merges them (part_o, part_ml: fp32 workspace), decode_attention_splits picks the count.
constexpr int kDecodeAttnMaxGroup = 16;   // query heads a kv head (the MMA's 16 rows)
constexpr int kDecodeAttnMaxSplits = 64;
struct DecodeAttnParams {
  const void* q;          // [batch, heads, head_dim]: element strides q_sb, q_sh, dims contiguous
  void* k;                // caches [batch, kv_heads, max_seq, head_dim]: element strides kv_sb, kv_sh,
  void* v;                //   rows contiguous; 16-byte aligned rows (pointers and strides); written by rope only
  void* out;              // [batch, heads, head_dim], contiguous
  float* part_o;          // splits > 1: [batch, heads, splits, head_dim]
  float* part_ml;         // splits > 1: [batch, heads, splits, 2] (max of the base-2 scores, denominator)
  const int64_t* slot;    // device scalar: the query's cache slot (its key and value are written there)
  const int64_t* pad;     // device [batch]: the slots before pad[b] are sequence b's left padding
  long long q_sb, q_sh, kv_sb, kv_sh;
  int batch, heads, kv_heads, head_dim, max_seq, splits;
  float scale_log2;       // the softmax scale times log2(e)
};
// rope_decode_attention's inputs (decode_attention with rope): q above is then the token's query before its
// norm and rotation; knew / vnew [batch, kv_heads, head_dim] (element strides kn_sb, kn_sh, dims contiguous)
// its key and value.  The kernel normalizes q and k per head by q_norm / k_norm ([head_dim] of the activation
// type, both or neither; epsilon norm_eps), rotates them by cos / sin ([max_seq, head_dim] rows of the
// activation type) at position max(slot - pad[b], 0), writes k and v into the caches at the slot, and
// attends with them.
struct DecodeAttnRope {
  const void* knew;
  const void* vnew;
  long long kn_sb, kn_sh;
  const void* cos;
  const void* sin;
  const void* q_norm;
  const void* k_norm;
  float norm_eps;
};
bool decode_attention_supported(int head_dim, int heads, int kv_heads);  // head_dim 64 / 96 / 128, group <= 16
int decode_attention_splits(int batch, int kv_heads, int max_seq, int head_dim, bool rope = false);  // this device
// Its rule: pairs = batch x kv_heads, slots = the GPU's resident blocks of the kernel (host only).
int decode_attention_split_rule(long long pairs, long long slots, int max_seq);
// rope: nullptr for plain decode attention.
Status decode_attention(ActType act, const DecodeAttnParams& p, const DecodeAttnRope* rope, cudaStream_t stream);
// K / V tiles a block holds: 0 (the default) follows decode_attention_stage_rule, 2 / 3 / 4 force a count
// (stages - 1 in flight while one is summed; more stages, fewer blocks an SM); a device whose blocks may not
// have that much shared memory runs fewer (sm_86 / sm_89, head_dim 128: 2).  Returns false, changing nothing,
// for another value.  Process-wide, for the A/B.
bool set_decode_attention_stages(int stages);
int decode_attention_stages();
// The rule (host only): 3 stages where the (sequence, kv head) pairs fill the GPU's resident 3-stage blocks
// (slots3), else 4.
int decode_attention_stage_rule(long long pairs, long long slots3);

// The seed's fp32 SGEMV family: y[N] = A[N, K] @ x[K], all fp32, contiguous.
enum class SgemvKernel : int { kAuto = 0, kK32 = 1, kK128 = 2, kK16 = 3 };
SgemvKernel sgemv_choose(int N, int K, const float* A, const float* x);
Status sgemv_f32(const float* A, const float* x, float* y, int N, int K, SgemvKernel which,
                 cudaStream_t stream);

}  // namespace qgemv
