// Torch glue: checks, device guard, current stream, shape dispatch, and the
// CUDA-key registrations for the ops whose schemas live in qgemv/ops.py.
//
// Every check names the tensor and the rule, so a failure reads like
// "qgemv.linear_int4: qweight must be int32, got Float".
// Only c10/cuda headers: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE
// headers that a bare CUDA toolkit may lack.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "persist.h"
#include "qgemv.h"
#include "testing.h"
#include "tuning.h"

namespace qgemv {
namespace {

#define QG_CHECK(cond, op, ...) TORCH_CHECK(cond, "qgemv.", op, ": ", __VA_ARGS__)

// Paths for more than kMaxGemvTokens tokens (fp16 / bf16 activations):
//   kChunks: the GEMV once per 16-token chunk (reads the weight M/16 times);
//   kTiled:  the tiled mma.sync GEMM (csrc/gemm_mma.cu), the weight read once
//            per 32 or 64 tokens and dequantized in registers;
//   kDense:  dequantize into a dense weight, then cuBLAS (writes and re-reads
//            N x K x 2 bytes, but its GEMM runs at the wgmma rate);
//   kWgmma:  the Hopper GEMM (csrc/gemm_wgmma.cu): the tiled GEMM's weight
//            stream feeding wgmma; compute capability 9.0 only.
// Measured on the H200 (BENCHMARKS.md, prefill; 4096 x 4096, 8192 x 8192,
// 28672 x 8192 x int8 / int4 / int4 g128, 17..2048 tokens):
//   * 17-32 tokens: the tiled mma.sync GEMM is the fastest or close to it;
//   * 33-512: the wgmma GEMM (within 3-9% of the best forced path at every
//     M from 48 to 512), except on small weights (N x K <= kSmallWeight),
//     where the tiled GEMM, with no activation-permute launch and several
//     blocks per SM, is faster up to 64 tokens;
//   * above 512: dequantize + cuBLAS (at 1024 it beats the wgmma GEMM by
//     6-37%, at 2048 by 14-60%: cuBLAS's fp16 GEMM runs near the
//     tensor-core peak there, the wgmma GEMM at about 75% of it).
// Without wgmma (other GPUs): the tiled GEMM up to 128 tokens (fastest of
// the first three paths on 50 of 54 measured pairs at 17-128), then dense.
// The thresholds are tuning.h's.  Tests and benchmarks force a path through
// qgemv._C.testing.set_prefill_path (forced_prefill_path below).
enum class Prefill : int { kChunks = 0, kTiled = 1, kDense = 2, kWgmma = 3 };
std::atomic<int> forced_prefill_path{-1};  // -1: the measured rule

// Tests and benchmarks turn the GEMV's own gather off to compare it with gathering first.
std::atomic<bool> gemv_gather_enabled{true};

// Whether the GEMV gathers x[:, perm] itself for M tokens of an N x K weight (qgemv.h, gemv_gathers).
bool gather_in_gemv(int64_t M, int64_t N, int64_t K) {
  return gemv_gather_enabled.load() && M >= 1 && M <= kMaxGemvTokens &&
         gemv_gathers(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K));
}

Prefill prefill_path(int64_t N, int64_t K, int64_t M) {
  using namespace tuning;
  const int forced = forced_prefill_path.load();
  if (forced >= 0) return static_cast<Prefill>(forced);
  if (wgmma_supported()) {
    const int64_t first = N * K <= kSmallWeight ? kWgmmaMinTokensSmall : kWgmmaMinTokens;
    if (M < first) return Prefill::kTiled;
    return M <= kWgmmaMaxTokens ? Prefill::kWgmma : Prefill::kDense;
  }
  return M <= kTiledMaxTokens ? Prefill::kTiled : Prefill::kDense;
}

void check_status(Status s, const char* op) {
  TORCH_CHECK(s == Status::kOk, "qgemv.", op, ": ", status_string(s));
}

// The same, naming the configuration a kernel was asked for: with kNoKernel,
// the (activation, format, tokens) that no row of csrc/instances.h matches.
void check_status(Status s, const char* op, const GemvParams& p, int bits) {
  TORCH_CHECK(s == Status::kOk, "qgemv.", op, ": ", status_string(s), " (int", bits, ", group_size ",
              p.group_size, p.zeros != nullptr ? " with zero points" : "", ", ",
              p.act == ActType::kHalf ? "float16" : p.act == ActType::kBFloat16 ? "bfloat16" : "float32",
              " activations, M=", p.M, ", N=", p.N, ", K=", p.K,
              s == Status::kNoKernel ? "; the built kernels are listed in csrc/instances.h)" : ")");
}

ActType act_type(const at::Tensor& x, const char* op) {
  if (x.scalar_type() == at::kHalf) return ActType::kHalf;
  if (x.scalar_type() == at::kBFloat16) return ActType::kBFloat16;
  if (x.scalar_type() == at::kFloat) return ActType::kFloat32;
  QG_CHECK(false, op, "x must be float16, bfloat16 or float32, got ", x.scalar_type());
  return ActType::kHalf;
}

void check_same_device(const at::Tensor& x, const at::Tensor& t, const char* name, const char* op) {
  QG_CHECK(t.device() == x.device(), op, name, " must be on the same device as x (", x.device(),
           "), got ", t.device());
}

// The rules of qgemv/ops.py's _check_x, in its order: x's dtype, rank and
// device, then K.  Returns the [M, K] view of x that the kernels read (a copy
// when x is not contiguous or its rows are not 16-byte aligned).
at::Tensor prepare_x(const at::Tensor& x, int64_t K, const char* op) {
  QG_CHECK(x.is_cuda(), op, "x must be a CUDA tensor, got ", x.device());
  QG_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension");
  at::Tensor x2 = x.reshape({-1, K});
  if (!x2.is_contiguous()) x2 = x2.contiguous();
  if (reinterpret_cast<uintptr_t>(x2.data_ptr()) % 16 != 0) x2 = x2.clone();
  return x2;
}

void check_in_features(const at::Tensor& x, int64_t K, const char* op) {
  QG_CHECK(K > 0 && K % 8 == 0, op, "in_features must be a positive multiple of 8, got ", K);
  QG_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension");
  QG_CHECK(x.size(-1) == K, op, "x.shape[-1] must equal in_features (", K, "), got ", x.size(-1));
}

// The kernels read qweight with 16-byte loads (cp.async, bulk copies) and
// scales as 2-byte halves.  A view that starts elsewhere (a storage offset
// of 4 bytes, say) would raise "misaligned address" inside the kernel, and
// that error poisons the CUDA context for the rest of the process: refuse it
// here, before any launch.
void check_aligned(const at::Tensor& t, int64_t bytes, const char* name, const char* op) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  QG_CHECK(addr % bytes == 0, op, name, " must start on a ", bytes, "-byte boundary (its data pointer is ",
           addr % bytes, " bytes past one, storage offset ", t.storage_offset(), " elements); pass ", name,
           ".clone()");
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = N;
  return s;
}

using GemvFn = Status (*)(const GemvParams&, cudaStream_t);
using GemmFn = Status (*)(const GemvParams&, float*, int, cudaStream_t);
using DequantFn = Status (*)(const GemvParams&, void*, cudaStream_t);
using WgmmaFn = Status (*)(const GemvParams&, void*, float*, int, cudaStream_t);

// perm (act-order): int32 [K] on x's device, contiguous, 16-byte aligned.
// Its values are the caller's to check (a check here would synchronize);
// the GEMV clamps each index into [0, K) so that a bad one cannot read
// outside x.
void check_perm(const at::Tensor& x, const c10::optional<at::Tensor>& perm, int64_t K, const char* op) {
  if (!perm.has_value()) return;
  const at::Tensor& q = *perm;
  check_same_device(x, q, "perm", op);
  QG_CHECK(q.scalar_type() == at::kInt, op, "perm must be int32, got ", q.scalar_type());
  QG_CHECK(q.dim() == 1 && q.size(0) == K, op, "perm must have shape [", K, "], got ", q.sizes());
  QG_CHECK(q.is_contiguous(), op, "perm must be contiguous");
  check_aligned(q, 16, "perm", op);
}

// The one dispatch function: by dtype, token count and weight size (see Prefill and prefill_path).
// With perm, y = x[..., perm] @ W^T: the GEMV gathers x itself where
// gemv_gathers(M, N, K) holds (qgemv.h); every other path gets x gathered here first.
at::Tensor run_linear(const at::Tensor& x, GemvParams p, int bits, GemvFn gemv, GemmFn gemm,
                      WgmmaFn wgmma, DequantFn dequant, const c10::optional<at::Tensor>& perm,
                      const char* op) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor x2 = prepare_x(x, p.K, op);
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, p.N}, x.options());
  p.act = act_type(x, op);
  p.perm = nullptr;
  if (M == 0) return y.reshape(out_shape(x, p.N));
  if (perm.has_value()) {
    if (p.act != ActType::kFloat32 && gather_in_gemv(M, p.N, p.K))
      p.perm = perm->data_ptr<int32_t>();
    else
      x2 = x2.index_select(1, *perm);  // contiguous, freshly allocated: 16-byte aligned rows
  }

  const Prefill path = M <= kMaxGemvTokens ? Prefill::kChunks : prefill_path(p.N, p.K, M);
  GemvParams c = p;  // the whole batch, for the GEMMs
  c.M = static_cast<int>(M);
  c.x = x2.data_ptr();
  c.y = y.data_ptr();
  c.ldx = p.K;
  c.ldy = p.N;
  if (p.act != ActType::kFloat32 && path == Prefill::kWgmma) {
    const WgmmaPlan plan = wgmma_plan(c, bits);
    QG_CHECK(plan.ok, op, "the wgmma GEMM needs a compute-capability 9.0 GPU and a build with sm_90a "
             "(testing.set_prefill_path(", static_cast<int>(Prefill::kWgmma), ") forced it)");
    at::Tensor xperm = at::empty({static_cast<int64_t>(plan.xperm_bytes)}, x.options().dtype(at::kByte));
    at::Tensor ws;
    if (plan.splits > 1) ws = at::empty({plan.splits, M, p.N}, x.options().dtype(at::kFloat));
    check_status(wgmma(c, xperm.data_ptr(), plan.splits > 1 ? ws.data_ptr<float>() : nullptr, plan.splits,
                       stream),
                 op, c, bits);
  } else if (p.act != ActType::kFloat32 && path == Prefill::kTiled) {
    const int splits = gemm_splits(c, bits);  // split-K partials when the grid is small
    at::Tensor ws;
    if (splits > 1) ws = at::empty({splits, M, p.N}, x.options().dtype(at::kFloat));
    check_status(gemm(c, splits > 1 ? ws.data_ptr<float>() : nullptr, splits, stream), op, c, bits);
  } else if (p.act != ActType::kFloat32 && path == Prefill::kChunks) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxGemvTokens) {
      GemvParams c = p;
      c.M = static_cast<int>(std::min<int64_t>(kMaxGemvTokens, M - m0));
      c.x = static_cast<const char*>(x2.data_ptr()) + m0 * p.K * x2.element_size();
      c.y = static_cast<char*>(y.data_ptr()) + m0 * p.N * y.element_size();
      c.ldx = p.K;
      c.ldy = p.N;
      check_status(gemv(c, stream), op, c, bits);
    }
  } else {
    at::Tensor w = at::empty({p.N, p.K}, x.options());
    check_status(dequant(p, w.data_ptr(), stream), op, p, bits);
    at::mm_out(y, x2, w.t());
  }
  return y.reshape(out_shape(x, p.N));
}

GemvParams base_params(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t N, int64_t K, int64_t Kp) {
  GemvParams p{};
  p.qweight = qweight.data_ptr();
  p.scales = scales.data_ptr();
  p.zeros = nullptr;
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.Kp = static_cast<int>(Kp);
  p.group_size = 0;
  p.warps_per_block = 0;
  return p;
}

void check_scales(const at::Tensor& x, const at::Tensor& scales, int64_t N, int64_t groups,
                  const char* op) {
  check_same_device(x, scales, "scales", op);
  QG_CHECK(scales.scalar_type() == at::kHalf, op, "scales must be float16, got ", scales.scalar_type());
  QG_CHECK(scales.is_contiguous(), op, "scales must be contiguous");
  check_aligned(scales, 2, "scales", op);
  if (groups == 0) {
    QG_CHECK(scales.dim() == 1 && scales.size(0) == N, op, "scales must have shape [", N, "], got ",
             scales.sizes());
  } else {
    QG_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups, op,
             "scales must have shape [", N, ", ", groups, "], got ", scales.sizes());
  }
}

at::Tensor linear_int8_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            int64_t in_features, const c10::optional<at::Tensor>& perm) {
  const char* op = "linear_int8";
  act_type(x, op);
  check_same_device(x, qweight, "qweight", op);
  check_same_device(x, scales, "scales", op);
  check_in_features(x, in_features, op);
  QG_CHECK(qweight.scalar_type() == at::kChar, op, "qweight must be int8, got ", qweight.scalar_type());
  QG_CHECK(qweight.dim() == 2, op, "qweight must be 2-D, got ", qweight.dim(), "-D");
  QG_CHECK(qweight.is_contiguous(), op, "qweight must be contiguous");
  const int64_t N = qweight.size(0), K = in_features, Kp = qweight.size(1);
  QG_CHECK(Kp == (K + 15) / 16 * 16, op, "qweight.shape[1] must be round_up(K, 16) = ",
           (K + 15) / 16 * 16, ", got ", Kp);
  check_scales(x, scales, N, 0, op);
  check_aligned(qweight, 16, "qweight", op);
  check_perm(x, perm, K, op);
  GemvParams p = base_params(x, qweight, scales, N, K, Kp);
  return run_linear(x, p, 8, gemv_int8, gemm_int8, wgmma_int8, dequant_int8, perm, op);
}

at::Tensor linear_int4_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& zeros, bool grouped, int64_t group_size,
                            int64_t in_features, const c10::optional<at::Tensor>& perm, const char* op) {
  act_type(x, op);
  check_same_device(x, qweight, "qweight", op);
  check_same_device(x, scales, "scales", op);
  if (zeros.has_value()) check_same_device(x, *zeros, "zeros", op);
  check_in_features(x, in_features, op);
  QG_CHECK(qweight.scalar_type() == at::kInt, op, "qweight must be int32, got ", qweight.scalar_type());
  QG_CHECK(qweight.dim() == 2, op, "qweight must be 2-D, got ", qweight.dim(), "-D");
  QG_CHECK(qweight.is_contiguous(), op, "qweight must be contiguous");
  const int64_t N = qweight.size(0), K = in_features, Kp = qweight.size(1) * 8;
  QG_CHECK(Kp == (K + 31) / 32 * 32, op, "qweight.shape[1] must be round_up(K, 32) / 8 = ",
           (K + 31) / 32 * 4, ", got ", qweight.size(1));
  int64_t groups = 0;
  if (grouped) {
    QG_CHECK(group_size == 32 || group_size == 64 || group_size == 128, op,
             "group_size must be 32, 64 or 128, got ", group_size);
    QG_CHECK(K % group_size == 0, op, "in_features (", K, ") must be divisible by group_size (",
             group_size, ")");
    groups = K / group_size;
  }
  check_scales(x, scales, N, groups, op);
  GemvParams p = base_params(x, qweight, scales, N, K, Kp);
  p.group_size = static_cast<int>(group_size);
  if (zeros.has_value()) {
    const at::Tensor& z = *zeros;
    QG_CHECK(z.scalar_type() == at::kByte, op, "zeros must be uint8, got ", z.scalar_type());
    QG_CHECK(z.is_contiguous(), op, "zeros must be contiguous");
    QG_CHECK(z.dim() == 2 && z.size(0) == N && z.size(1) == groups, op, "zeros must have shape [", N,
             ", ", groups, "], got ", z.sizes());
    p.zeros = z.data_ptr<uint8_t>();
  }
  check_aligned(qweight, 16, "qweight", op);
  check_perm(x, perm, K, op);
  return run_linear(x, p, 4, gemv_int4, gemm_int4, wgmma_int4, dequant_int4, perm, op);
}

at::Tensor linear_int4_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            int64_t in_features, const c10::optional<at::Tensor>& perm) {
  return linear_int4_impl(x, qweight, scales, c10::nullopt, false, 0, in_features, perm, "linear_int4");
}

at::Tensor linear_int4_grouped_cuda(const at::Tensor& x, const at::Tensor& qweight,
                                    const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                                    int64_t group_size, int64_t in_features,
                                    const c10::optional<at::Tensor>& perm) {
  return linear_int4_impl(x, qweight, scales, zeros, true, group_size, in_features, perm,
                          "linear_int4_grouped");
}

at::Tensor sgemv_cuda(const at::Tensor& A, const at::Tensor& x, int64_t kernel) {
  const char* op = "sgemv";
  QG_CHECK(A.is_cuda(), op, "A must be a CUDA tensor, got ", A.device());
  check_same_device(A, x, "x", op);
  QG_CHECK(A.scalar_type() == at::kFloat, op, "A must be float32, got ", A.scalar_type());
  QG_CHECK(x.scalar_type() == at::kFloat, op, "x must be float32, got ", x.scalar_type());
  QG_CHECK(A.dim() == 2, op, "A must be 2-D [N, K], got ", A.dim(), "-D");
  QG_CHECK(x.dim() == 1 && x.size(0) == A.size(1), op, "x must have shape [", A.size(1), "], got ",
           x.sizes());
  QG_CHECK(kernel >= 0 && kernel <= 3, op, "kernel must be 0 (auto), 1 (k32), 2 (k128) or 3 (k16), got ",
           kernel);
  const c10::cuda::CUDAGuard guard(A.device());
  const at::Tensor A2 = A.contiguous();
  const at::Tensor x2 = x.contiguous();
  at::Tensor y = at::empty({A.size(0)}, A.options());
  if (A.size(0) == 0) return y;
  if (A.size(1) == 0) return y.zero_();
  check_status(sgemv_f32(A2.data_ptr<float>(), x2.data_ptr<float>(), y.data_ptr<float>(),
                         static_cast<int>(A2.size(0)), static_cast<int>(A2.size(1)),
                         static_cast<SgemvKernel>(kernel), c10::cuda::getCurrentCUDAStream()),
               op);
  return y;
}

// x_out = x + delta and the RMSNorm of x_out (gain weight) gathered by perm,
// for the generation engine's act-order layers (csrc/rmsnorm.cu).  The
// rules are qgemv/ops.py's check_add_rms_gather, with its messages.
std::tuple<at::Tensor, at::Tensor> add_rms_gather_cuda(const at::Tensor& x, const at::Tensor& delta,
                                                       const at::Tensor& weight, const at::Tensor& perm,
                                                       double eps) {
  const char* op = "add_rms_gather";
  QG_CHECK(x.is_cuda(), op, "x must be a CUDA tensor, got ", x.device());
  const ActType act = act_type(x, op);
  QG_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension");
  const int64_t H = x.size(-1);
  QG_CHECK(H >= 1 && H <= kNormMaxWidth, op, "x.shape[-1] must be in 1..", kNormMaxWidth, ", got ", H);
  QG_CHECK(delta.sizes() == x.sizes(), op, "delta must have x's shape ", x.sizes(), ", got ", delta.sizes());
  QG_CHECK(delta.scalar_type() == x.scalar_type(), op, "delta must have x's dtype ", x.scalar_type(), ", got ",
           delta.scalar_type());
  QG_CHECK(weight.dim() == 1 && weight.size(0) == H, op, "weight must have shape [", H, "], got ", weight.sizes());
  QG_CHECK(weight.scalar_type() == x.scalar_type(), op, "weight must have x's dtype ", x.scalar_type(), ", got ",
           weight.scalar_type());
  QG_CHECK(perm.scalar_type() == at::kInt, op, "perm must be int32, got ", perm.scalar_type());
  QG_CHECK(perm.dim() == 1 && perm.size(0) == H, op, "perm must have shape [", H, "], got ", perm.sizes());
  QG_CHECK(perm.is_contiguous(), op, "perm must be contiguous");
  QG_CHECK(eps >= 0 && std::isfinite(eps), op, "eps must be a finite number >= 0, got ", eps);
  check_same_device(x, delta, "delta", op);
  check_same_device(x, weight, "weight", op);
  check_same_device(x, perm, "perm", op);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = x.contiguous(), d2 = delta.contiguous(), w2 = weight.contiguous();
  at::Tensor x_out = at::empty(x.sizes(), x.options());
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t rows = x.numel() / H;
  QG_CHECK(rows <= std::numeric_limits<int>::max() / H, op, "x has too many elements (", x.numel(), ")");
  check_status(add_rms_gather(act, x2.data_ptr(), d2.data_ptr(), w2.data_ptr(), perm.data_ptr<int32_t>(),
                              x_out.data_ptr(), y.data_ptr(), static_cast<int>(rows), static_cast<int>(H),
                              static_cast<float>(eps), c10::cuda::getCurrentCUDAStream()),
               op);
  return {x_out, y};
}

// The engine's per-op decode attention (csrc/decode_attention.cu): q [B, H, D] against the cache slots
// pad[b] .. slot of k_cache / v_cache [B, Hkv, S, D].  The rules are qgemv/ops.py's check_decode_attention
// (check_rope_decode_attention for the rope form), with its messages.  rope: the token's raw key and value
// [B, Hkv, D], the rotary tables, the optional per-head norms (rope_decode_attention), else nullptr.
struct RopeInputs {
  const at::Tensor& k;
  const at::Tensor& v;
  const at::Tensor& cos;
  const at::Tensor& sin;
  const c10::optional<at::Tensor>& q_norm;
  const c10::optional<at::Tensor>& k_norm;
  double eps;
};

at::Tensor decode_attention_any(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& slot, const at::Tensor& pad, double scale,
                                int64_t splits, const RopeInputs* rope) {
  QG_CHECK(q.is_cuda(), op, "q must be a CUDA tensor, got ", q.device());
  QG_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
           "q must be float16 or bfloat16, got ", q.scalar_type());
  QG_CHECK(q.dim() == 3, op, "q must be [batch, heads, head_dim], got ", q.sizes());
  QG_CHECK(k_cache.dim() == 4, op, "k_cache must be [batch, kv_heads, max_seq, head_dim], got ", k_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), S = k_cache.size(2);
  QG_CHECK(k_cache.size(0) == B && k_cache.size(3) == D, op, "k_cache must be [", B, ", kv_heads, max_seq, ", D,
           "] (q's batch and head_dim), got ", k_cache.sizes());
  QG_CHECK(v_cache.sizes() == k_cache.sizes(), op, "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
           v_cache.sizes());
  QG_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), op,
           "k_cache and v_cache must have q's dtype ", q.scalar_type(), ", got ", k_cache.scalar_type(), " and ",
           v_cache.scalar_type());
  QG_CHECK(B >= 1 && B <= 65535, op, "batch must be in 1..65535, got ", B);
  QG_CHECK(D == 64 || D == 96 || D == 128, op, "head_dim must be 64, 96 or 128, got ", D);
  QG_CHECK(Hkv >= 1 && H % Hkv == 0 && H / Hkv <= kDecodeAttnMaxGroup, op, "heads (", H,
           ") must be kv_heads (", Hkv, ") times 1..", kDecodeAttnMaxGroup);
  QG_CHECK(S >= 1, op, "max_seq must be >= 1, got ", S);
  QG_CHECK(slot.scalar_type() == at::kLong && slot.numel() >= 1, op,
           "slot must be an int64 tensor of >= 1 element, got ",
           slot.scalar_type(), " ", slot.sizes());
  QG_CHECK(pad.scalar_type() == at::kLong && pad.dim() == 1 && pad.size(0) == B, op, "pad must be int64 [", B,
           "], got ", pad.scalar_type(), " ", pad.sizes());
  QG_CHECK(std::isfinite(scale) && scale > 0, op, "scale must be a finite number > 0, got ", scale);
  QG_CHECK(splits >= 0 && splits <= kDecodeAttnMaxSplits, op, "splits must be 0 (chosen) or 1..",
           kDecodeAttnMaxSplits, ", got ", splits);
  check_same_device(q, k_cache, "k_cache", op);
  check_same_device(q, v_cache, "v_cache", op);
  check_same_device(q, slot, "slot", op);
  check_same_device(q, pad, "pad", op);
  QG_CHECK(q.stride(2) == 1, op, "q's head_dim must be contiguous (stride 1), got strides ", q.strides());
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const char* name = c == &k_cache ? "k_cache" : "v_cache";
    QG_CHECK(c->stride(3) == 1 && c->stride(2) == D && c->stride(1) % 8 == 0 && c->stride(0) % 8 == 0, op, name,
             " must have contiguous rows and batch / head strides that are multiples of 8, got strides ",
             c->strides());
    QG_CHECK(reinterpret_cast<uintptr_t>(c->data_ptr()) % 16 == 0, op, name,
             " must start on a 16-byte boundary (pass a contiguous cache)");
  }
  DecodeAttnRope ro{};
  if (rope != nullptr) {
    for (const at::Tensor* t : {&rope->k, &rope->v}) {
      const char* name = t == &rope->k ? "k" : "v";
      QG_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == Hkv && t->size(2) == D, op, name, " must be [", B,
               ", ", Hkv, ", ", D, "] (the token's ", name, " heads), got ", t->sizes());
      QG_CHECK(t->scalar_type() == q.scalar_type(), op, name, " must have q's dtype ", q.scalar_type(), ", got ",
               t->scalar_type());
      check_same_device(q, *t, name, op);
      QG_CHECK(t->stride(2) == 1, op, name, "'s head_dim must be contiguous (stride 1), got strides ", t->strides());
    }
    QG_CHECK(rope->v.strides() == rope->k.strides(), op, "v must have k's strides ", rope->k.strides(), ", got ",
             rope->v.strides());
    // the kernel reads 8 dims at a time in 16-byte loads
    for (const at::Tensor* t : {&q, &rope->k, &rope->v}) {
      const char* name = t == &q ? "q" : t == &rope->k ? "k" : "v";
      QG_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 && t->stride(0) % 8 == 0 && t->stride(1) % 8 == 0,
               op, name, " must start on a 16-byte boundary with batch / head strides that are multiples of 8, got "
               "strides ", t->strides());
    }
    for (const at::Tensor* t : {&rope->cos, &rope->sin}) {
      const char* name = t == &rope->cos ? "cos" : "sin";
      QG_CHECK(t->dim() == 2 && t->size(0) >= S && t->size(1) == D, op, name, " must be [>= ", S, ", ", D,
               "] (a row a cache slot's position), got ", t->sizes());
      QG_CHECK(t->scalar_type() == q.scalar_type(), op, name, " must have q's dtype ", q.scalar_type(), ", got ",
               t->scalar_type());
      QG_CHECK(t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, name,
               " must be contiguous and start on a 16-byte boundary");
      check_same_device(q, *t, name, op);
    }
    QG_CHECK(rope->q_norm.has_value() == rope->k_norm.has_value(), op, "q_norm and k_norm must be given together");
    if (rope->q_norm.has_value()) {
      for (const at::Tensor* t : {&*rope->q_norm, &*rope->k_norm}) {
        const char* name = t == &*rope->q_norm ? "q_norm" : "k_norm";
        QG_CHECK(t->dim() == 1 && t->size(0) == D && t->scalar_type() == q.scalar_type() && t->is_contiguous(), op,
                 name, " must be a contiguous [", D, "] tensor of q's dtype ", q.scalar_type(), ", got ",
                 t->scalar_type(), " ", t->sizes());
        QG_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, name, " must start on a 16-byte boundary");
        check_same_device(q, *t, name, op);
      }
    }
    QG_CHECK(std::isfinite(rope->eps) && rope->eps >= 0, op, "eps must be a finite number >= 0, got ", rope->eps);
    ro.knew = rope->k.data_ptr(), ro.vnew = rope->v.data_ptr();
    ro.kn_sb = rope->k.stride(0), ro.kn_sh = rope->k.stride(1);
    ro.cos = rope->cos.data_ptr(), ro.sin = rope->sin.data_ptr();
    ro.q_norm = rope->q_norm.has_value() ? rope->q_norm->data_ptr() : nullptr;
    ro.k_norm = rope->k_norm.has_value() ? rope->k_norm->data_ptr() : nullptr;
    ro.norm_eps = static_cast<float>(rope->eps);
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor pad2 = pad.contiguous();
  at::Tensor out = at::empty({B, H, D}, q.options());
  const int n = splits > 0 ? static_cast<int>(splits)
                           : decode_attention_splits(static_cast<int>(B), static_cast<int>(Hkv), static_cast<int>(S),
                                                     static_cast<int>(D), rope != nullptr);
  at::Tensor part_o, part_ml;
  if (n > 1) {
    part_o = at::empty({B, H, n, D}, q.options().dtype(at::kFloat));
    part_ml = at::empty({B, H, n, 2}, q.options().dtype(at::kFloat));
  }
  DecodeAttnParams p{};
  p.q = q.data_ptr(), p.k = k_cache.data_ptr(), p.v = v_cache.data_ptr(), p.out = out.data_ptr();
  p.part_o = n > 1 ? part_o.data_ptr<float>() : nullptr;
  p.part_ml = n > 1 ? part_ml.data_ptr<float>() : nullptr;
  p.slot = slot.data_ptr<int64_t>(), p.pad = pad2.data_ptr<int64_t>();
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.kv_sb = k_cache.stride(0), p.kv_sh = k_cache.stride(1);
  QG_CHECK(v_cache.stride(0) == p.kv_sb && v_cache.stride(1) == p.kv_sh, op,
           "v_cache must have k_cache's strides ", k_cache.strides(), ", got ", v_cache.strides());
  p.batch = static_cast<int>(B), p.heads = static_cast<int>(H), p.kv_heads = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(D), p.max_seq = static_cast<int>(S), p.splits = n;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  check_status(decode_attention(q.scalar_type() == at::kHalf ? ActType::kHalf : ActType::kBFloat16, p,
                                rope != nullptr ? &ro : nullptr, c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slot, const at::Tensor& pad, double scale, int64_t splits) {
  return decode_attention_any("decode_attention", q, k_cache, v_cache, slot, pad, scale, splits, nullptr);
}

// rope_decode_attention: the token's q / k norms and rotation and its cache write, then decode_attention
// (one kernel where the engine ran two).  k_cache and v_cache are written in place.
at::Tensor rope_decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot,
                                      const at::Tensor& pad,
                                      const at::Tensor& cos, const at::Tensor& sin,
                                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                      double eps, double scale, int64_t splits) {
  const RopeInputs rope{k, v, cos, sin, q_norm, k_norm, eps};
  return decode_attention_any("rope_decode_attention", q, k_cache, v_cache, slot, pad, scale, splits, &rope);
}

// The op schemas live in qgemv/ops.py; this number changes with them, and
// qgemv/_ext.py registers these kernels only when its own number matches.
// (TORCH_LIBRARY_IMPL would register them while the library loads, and a
// schema mismatch there, e.g. a stale build after an upgrade, aborts the
// process; registered from a call, it is an exception the loader turns into
// "rebuild the extension" and the reference backend.)
constexpr int kOpsVersion = 6;

void register_cuda_kernels() {
  static std::unique_ptr<torch::Library> lib;
  if (lib) return;
  auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "qgemv", c10::DispatchKey::CUDA, __FILE__,
                                            __LINE__);
  l->impl("linear_int8", &linear_int8_cuda);
  l->impl("linear_int4", &linear_int4_cuda);
  l->impl("linear_int4_grouped", &linear_int4_grouped_cuda);
  l->impl("sgemv", &sgemv_cuda);
  l->impl("add_rms_gather", &add_rms_gather_cuda);
  l->impl("decode_attention", &decode_attention_cuda);
  l->impl("rope_decode_attention", &rope_decode_attention_cuda);
  lib = std::move(l);
}

// ---- the persistent chain (csrc/persist.h), for qgemv/persist.py --------------
// Low-level: pointers travel as integers (the Python class owns the tensors).

// (error, op table uint8 [nops * sizeof(op)], schedule int32 [classes, blocks, warps + 1, 4], op classes,
// classes, sums, x_cap, stage, smem, attention table uint8); ops: (x, res, y, weight, scales, N, K, out,
// x_plain, res_plain, y_plain, ldx, role, attn, perm (0: none), Kp (0: K)); attns: (k_cache, v_cache, cos, sin, part, count, heads, kv_heads,
// head_dim, max_seq, splits, scale, bias (0: none), q_norm, k_norm, qk_ss, qk_count (0: none), qk_eps, per_warp
// (0: 2)).
using PersistOpTuple =
    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, bool, bool, bool, int, int, int, int64_t, int>;
using PersistAttnTuple =
    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int, int, double, int64_t, int64_t,
               int64_t, int64_t, int64_t, double, int>;

PersistPlan persist_plan_of(const std::vector<PersistOpTuple>& in, int bits, int group, bool zeros, int blocks, int warps,
                            int stages, const std::vector<PersistAttnTuple>& attn_in) {
  std::vector<PersistOp> ops;
  for (const auto& t : in) {
    PersistOp o;
    o.x = reinterpret_cast<const void*>(std::get<0>(t));
    o.res = reinterpret_cast<const void*>(std::get<1>(t));
    o.y = reinterpret_cast<void*>(std::get<2>(t));
    o.weight = reinterpret_cast<const void*>(std::get<3>(t));
    o.scales = reinterpret_cast<const void*>(std::get<4>(t));
    o.N = std::get<5>(t), o.K = std::get<6>(t), o.out = std::get<7>(t);
    o.x_plain = std::get<8>(t), o.res_plain = std::get<9>(t), o.y_plain = std::get<10>(t);
    o.ldx = std::get<11>(t);
    o.role = std::get<12>(t), o.attn = std::get<13>(t);
    o.perm = reinterpret_cast<const void*>(std::get<14>(t));
    o.Kp = std::get<15>(t);
    ops.push_back(o);
  }
  std::vector<PersistAttn> attns;
  for (const auto& t : attn_in) {
    PersistAttn a;
    a.k_cache = reinterpret_cast<void*>(std::get<0>(t));
    a.v_cache = reinterpret_cast<void*>(std::get<1>(t));
    a.cos = reinterpret_cast<const void*>(std::get<2>(t));
    a.sin = reinterpret_cast<const void*>(std::get<3>(t));
    a.part = reinterpret_cast<float*>(std::get<4>(t));
    a.count = reinterpret_cast<unsigned*>(std::get<5>(t));
    a.heads = std::get<6>(t), a.kv_heads = std::get<7>(t), a.head_dim = std::get<8>(t);
    a.max_seq = std::get<9>(t), a.splits = std::get<10>(t);
    a.scale = static_cast<float>(std::get<11>(t));
    a.bias = reinterpret_cast<const void*>(std::get<12>(t));
    a.q_norm = reinterpret_cast<const void*>(std::get<13>(t));
    a.k_norm = reinterpret_cast<const void*>(std::get<14>(t));
    a.qk_ss = reinterpret_cast<float*>(std::get<15>(t));
    a.qk_count = reinterpret_cast<unsigned*>(std::get<16>(t));
    a.qk_eps = static_cast<float>(std::get<17>(t));
    a.per_warp = std::get<18>(t);
    attns.push_back(a);
  }
  return persist_plan(ops, bits, group, zeros, blocks, warps, stages, attns);
}

pybind11::tuple persist_plan_py(const std::vector<PersistOpTuple>& in, int group, bool zeros, int blocks, int warps,
                                int stages, const std::vector<PersistAttnTuple>& attns, int bits) {
  const PersistPlan pl = persist_plan_of(in, bits, group, zeros, blocks, warps, stages, attns);
  at::Tensor ops = at::empty({static_cast<int64_t>(pl.ops.size())}, at::kByte);
  if (!pl.ops.empty()) std::memcpy(ops.data_ptr(), pl.ops.data(), pl.ops.size());
  at::Tensor sched = at::empty({static_cast<int64_t>(pl.schedule.size())}, at::kInt);
  if (!pl.schedule.empty()) std::memcpy(sched.data_ptr(), pl.schedule.data(), pl.schedule.size() * 4);
  if (pl.error.empty()) sched = sched.view({pl.classes, blocks, warps + 1, 4});
  at::Tensor attn = at::empty({static_cast<int64_t>(pl.attn.size())}, at::kByte);
  if (!pl.attn.empty()) std::memcpy(attn.data_ptr(), pl.attn.data(), pl.attn.size());
  return pybind11::make_tuple(pl.error, ops, sched, pl.op_class, pl.classes, pl.sums, pl.x_cap, pl.stage,
                              static_cast<int64_t>(pl.smem), attn, pl.octets);
}

PersistPlan persist_plan_from(int classes, int sums, int x_cap, int64_t smem, int stage = 0, bool octets = true) {
  PersistPlan pl;
  pl.classes = classes, pl.sums = sums, pl.x_cap = x_cap, pl.smem = static_cast<size_t>(smem), pl.stage = stage;
  pl.octets = octets;
  return pl;
}

// The head's record (uint8, persist_head_record; empty when a pointer is 0 or K is not a positive multiple
// of 8): pointers as integers.
at::Tensor persist_head_py(int64_t x, int ldx, int64_t gain, double eps, int64_t weight, int V, int K, int64_t logits,
                           int64_t out, int64_t key, int64_t count, int64_t token) {
  PersistHead h;
  h.x = reinterpret_cast<const void*>(x), h.ldx = ldx;
  h.gain = reinterpret_cast<const void*>(gain), h.eps = static_cast<float>(eps);
  h.weight = reinterpret_cast<const void*>(weight), h.V = V, h.K = K;
  h.logits = reinterpret_cast<float*>(logits), h.out = reinterpret_cast<void*>(out);
  h.key = reinterpret_cast<void*>(key), h.count = reinterpret_cast<unsigned*>(count);
  h.token = reinterpret_cast<long long*>(token);
  const std::vector<uint8_t> r = persist_head_record(h);
  at::Tensor t = at::empty({static_cast<int64_t>(r.size())}, at::kByte);
  if (!r.empty()) std::memcpy(t.data_ptr(), r.data(), r.size());
  return t;
}

// Plain pybind functions, not dispatcher ops.  fuse's checks are a backstop
// (ValueError; qgemv/persist.py checks first: on torch 2.11 an exception out
// of the extension ends the process).
#define PS_CHECK(cond, op, ...) \
  if (!(cond)) throw pybind11::value_error(c10::str("qgemv.persist.", op, ": ", __VA_ARGS__))

// zeros: uint8 [N, K / G], or an empty tensor (no zero points); group: G (32, 64 or 128).
at::Tensor persist_fuse_py(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros, int64_t N,
                           int64_t K, int64_t group) {
  const char* op = "fuse";
  const bool has_zeros = zeros.numel() > 0;
  PS_CHECK(group == 32 || group == 64 || group == 128, op, "group must be 32, 64 or 128, got ", group);
  PS_CHECK(qweight.device().is_cpu() && scales.device().is_cpu() && zeros.device().is_cpu(), op,
           "tensors must be on the CPU");
  PS_CHECK(N >= 16 && N % 16 == 0 && K >= 128 && K % 128 == 0, op, "N must be a multiple of 16 and K of 128, got ",
           N, " x ", K);
  PS_CHECK(qweight.is_contiguous() && qweight.dtype() == at::kInt && qweight.numel() == N * K / 8, op,
           "qweight must be contiguous int32 with N * K / 8 = ", N * K / 8, " words, got ", qweight.dtype(), " ",
           qweight.sizes());
  PS_CHECK(scales.is_contiguous() && scales.dtype() == at::kHalf && scales.numel() == N * (K / group), op,
           "scales must be contiguous float16 [N, K / ", group, "], got ", scales.dtype(), " ", scales.sizes());
  if (has_zeros)
    PS_CHECK(zeros.is_contiguous() && zeros.dtype() == at::kByte && zeros.numel() == N * (K / group), op,
             "zeros must be contiguous uint8 [N, K / ", group, "], got ", zeros.dtype(), " ", zeros.sizes());
  const std::vector<uint8_t> out = persist_fuse(static_cast<const uint8_t*>(qweight.data_ptr()),
                                                static_cast<const uint16_t*>(scales.data_ptr()),
                                                has_zeros ? static_cast<const uint8_t*>(zeros.data_ptr()) : nullptr,
                                                static_cast<int>(N), static_cast<int>(K), static_cast<int>(group));
  at::Tensor t = at::empty({static_cast<int64_t>(out.size())}, at::kByte);
  std::memcpy(t.data_ptr(), out.data(), out.size());
  return t;
}

// "" when launched, else why not (returned, not thrown: on torch 2.11 an
// exception out of the extension ends the process, see ops._precheck_cuda).
// norms: 0, or the device address of nops pointers (each op's RMSNorm gain or 0; qgemv/persist.py keeps them).
// bf16: bfloat16 activations (and tables; bits 16: weights), else float16.  octets: the plan's (the decode
// kernel with the attention's octet form, or the one without).
std::string persist_launch_py(const at::Tensor& ops, const at::Tensor& schedule, const at::Tensor& sync, int group,
                              bool zeros, int blocks, int warps, int stages, int classes, int sums, int x_cap,
                              int64_t smem, int64_t norms, double eps, int64_t attn, int64_t pos, int bits,
                              int stage, bool bf16, int64_t head, bool octets) {
  if (!ops.is_cuda() || !schedule.is_cuda() || !sync.is_cuda() || ops.device() != sync.device() ||
      schedule.device() != sync.device())
    return "ops, schedule and sync must be CUDA tensors on one device";
  if (ops.dtype() != at::kByte || schedule.dtype() != at::kInt || sync.dtype() != at::kInt)
    return "ops must be uint8, schedule and sync int32";
  const int64_t nops = ops.numel() / static_cast<int64_t>(persist_op_bytes());
  if (nops < 1 || sync.numel() != nops + 1) return c10::str("sync must hold nops + 1 = ", nops + 1, " counters");
  c10::cuda::CUDAGuard guard(ops.device());
  const cudaError_t err = persist_launch(persist_plan_from(classes, sums, x_cap, smem, stage, octets), ops.data_ptr(),
                                         static_cast<int>(nops), schedule.data_ptr<int32_t>(),
                                         reinterpret_cast<unsigned*>(sync.data_ptr<int32_t>()), bits, group, zeros, blocks,
                                         warps, stages, c10::cuda::getCurrentCUDAStream(),
                                         reinterpret_cast<const void* const*>(norms), static_cast<float>(eps),
                                         reinterpret_cast<const void*>(attn), reinterpret_cast<const int32_t*>(pos),
                                         bf16, reinterpret_cast<const void*>(head));
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace

}  // namespace qgemv

// The Python module: register_kernels(), the public PDL knob, and the
// testing submodule; the ops themselves are reached via torch.ops.qgemv.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using qgemv::Prefill;
  namespace tn = qgemv::tuning;
  m.attr("OPS_VERSION") = qgemv::kOpsVersion;
  m.def("register_kernels", &qgemv::register_cuda_kernels,
        "Register the CUDA kernels of the qgemv ops (their schemas must already be defined).");
  m.def("wgmma_available", []() { return qgemv::wgmma_supported(); },
        "True when this build has the sm_90a wgmma GEMM and the current device can run it.");
  m.def("set_gemv_pdl", [](int v) {
          if (v < -1 || v > 7 || (v > 0 && (v & qgemv::kPdlLaunch) == 0))
            throw pybind11::value_error("qgemv.set_gemv_pdl: mode must be -1 (the default), 0 (off) or 1 (launch) "
                                        "plus 2 (L2 prefetch) and/or 4 (early release), got " + std::to_string(v));
          qgemv::set_gemv_pdl(v);
        },
        "Programmatic dependent launch of the GEMV (M <= 16) on compute capability 9.0+ (flags in "
        "csrc/qgemv.h); -1 restores the default. Python: qgemv.set_gemv_pdl.");
  m.def("gemv_pdl_flags", &qgemv::gemv_pdl_flags,
        "The programmatic-launch flags the GEMV uses on the current device (0: ordinary launches). The launch "
        "also needs sm_90+ machine code, checked per kernel.");
  m.attr("gemv_pdl_default") = static_cast<int>(qgemv::kGemvPdlDefault);

  auto t = m.def_submodule("testing", "Knobs for tests and benchmarks: force a prefill path or wgmma block shape, "
                                      "and the dispatch's thresholds (csrc/tuning.h).");
  t.attr("PREFILL_CHUNKS") = static_cast<int>(Prefill::kChunks);
  t.attr("PREFILL_TILED") = static_cast<int>(Prefill::kTiled);
  t.attr("PREFILL_DENSE") = static_cast<int>(Prefill::kDense);
  t.attr("PREFILL_WGMMA") = static_cast<int>(Prefill::kWgmma);
  t.attr("tiled_max_tokens") = tn::kTiledMaxTokens;
  t.attr("wgmma_min_tokens") = tn::kWgmmaMinTokens;
  t.attr("wgmma_min_tokens_small") = tn::kWgmmaMinTokensSmall;
  t.attr("wgmma_max_tokens") = tn::kWgmmaMaxTokens;
  t.attr("small_weight") = tn::kSmallWeight;
  t.attr("max_gemv_tokens") = qgemv::kMaxGemvTokens;
  t.def("set_prefill_path", [](int v) {
          if (v < -1 || v > 3)
            throw pybind11::value_error("qgemv.set_prefill_path: path must be -1 (the measured rule), "
                                        "0 (GEMV chunks), 1 (tiled GEMM), 2 (dequantize + cuBLAS) or "
                                        "3 (wgmma GEMM), got " + std::to_string(v));
          qgemv::forced_prefill_path.store(v);
        },
        "Force the path for more than 16 tokens; -1 restores the measured rule.");
  t.def("get_prefill_path", []() { return qgemv::forced_prefill_path.load(); });
  t.def("prefill_path", [](int64_t n, int64_t k, int64_t mt) {
          return mt <= qgemv::kMaxGemvTokens ? -1 : static_cast<int>(qgemv::prefill_path(n, k, mt));
        },
        "Path the dispatch takes for mt tokens of an n x k weight on the current device: 0 chunks, 1 tiled, "
        "2 dense, 3 wgmma; -1 one GEMV launch.");
  t.def("set_gemv_gather", [](bool on) { qgemv::gemv_gather_enabled.store(on); },
        "False: an act-order perm is applied by gathering x first (one more kernel) instead of inside the "
        "GEMV; True (the default) restores the in-kernel gather.");
  t.def("gemv_gathers", &qgemv::gather_in_gemv,
        "Whether the GEMV gathers x[:, perm] itself for m tokens of an n x k weight (qgemv.h, gemv_gathers).");
  t.def("decode_attention_split_rule", &qgemv::decode_attention_split_rule,
        "decode_attention's split count for (sequence, kv head) pairs when `slots` of its blocks fit on the GPU "
        "at once, for a cache of max_seq slots (host only).", pybind11::arg("pairs"), pybind11::arg("slots"),
        pybind11::arg("max_seq"));
  t.def("set_decode_attention_stages", [](int v) {
          if (!qgemv::set_decode_attention_stages(v))
            throw pybind11::value_error(
                "qgemv.set_decode_attention_stages: stages must be 0 (the rule), 2, 3 or 4, got " + std::to_string(v));
        },
        "decode_attention's K / V tiles a block holds: 0 (the default) follows the rule, 2, 3 or 4 force a count "
        "(more in flight, fewer blocks an SM); the split count chosen for splits=0 follows the blocks an SM holds.",
        pybind11::arg("stages"));
  t.def("decode_attention_stages", &qgemv::decode_attention_stages);
  t.def("set_chain_attention_form", [](int v) {
          if (!qgemv::set_chain_attention_form(v))
            throw pybind11::value_error("qgemv.set_chain_attention_form: form must be -1, 0 or 1, got " +
                                        std::to_string(v));
        },
        "The persistent launch's attention for the chains planned from now on: -1 (the default) the rule (an octet "
        "of lanes a cache position where a kv head has 4 query heads or more and a unit 128 positions or more, "
        "else a warp a position), 1 octets everywhere, 0 a warp a position everywhere.", pybind11::arg("form"));
  t.def("chain_attention_form", &qgemv::chain_attention_form);
  t.def("set_chain_attention_prefetch", [](std::optional<int> v) {
          const int tiles = v ? *v : qgemv::kChainAttnPrefetchRule;
          if ((v && *v == qgemv::kChainAttnPrefetchRule) || !qgemv::set_chain_attention_prefetch(tiles))
            throw pybind11::value_error("qgemv.set_chain_attention_prefetch: tiles must be None (the rule) or in [-" +
                                        std::to_string(qgemv::kChainAttnMaxPrefetch) + ", " +
                                        std::to_string(qgemv::kChainAttnMaxPrefetch) + "], got " + std::to_string(*v));
        },
        "Tiles of its walk past its full ring that each warp of the persistent launch asks into L2 at a layer's "
        "attention, for the chains planned from now on: None (the default) the rule (persist.h: 16 after the units "
        "where a kv head has one query head, else none), else n forced: 0 none, n > 0 before the block's attention "
        "units, n < 0 after them.", pybind11::arg("tiles"));
  t.def("chain_attention_prefetch", []() -> std::optional<int> {
          const int v = qgemv::chain_attention_prefetch();
          return v == qgemv::kChainAttnPrefetchRule ? std::nullopt : std::optional<int>(v);
        },
        "The persistent launch's attention prefetch: None (the rule) or the forced tiles (set_chain_attention_prefetch).");
  t.def("decode_attention_stage_rule", &qgemv::decode_attention_stage_rule,
        "decode_attention's stage count for (sequence, kv head) pairs when `slots3` of its 3-stage blocks fit on "
        "the GPU at once (host only).", pybind11::arg("pairs"), pybind11::arg("slots3"));
  t.def("wgmma_shape_count", &qgemv::testing::wgmma_shape_count);
  t.def("set_wgmma_shape", [](int v) {
          if (v < -1 || v >= qgemv::testing::wgmma_shape_count())
            throw pybind11::value_error("qgemv.set_wgmma_shape: shape must be -1 (the rule) or 0.." +
                                        std::to_string(qgemv::testing::wgmma_shape_count() - 1) + ", got " +
                                        std::to_string(v));
          qgemv::testing::set_wgmma_shape(v);
        },
        "Force the wgmma GEMM's block shape (0: 64 tokens x 256 rows, 1: 128 tokens x 128 rows, "
        "warp-specialized); -1 restores the rule.");

  auto ps = m.def_submodule("persist", "The persistent chain of linears (csrc/persist.h); qgemv.persist is the API.");
  ps.def("tile_bytes", &qgemv::persist_tile_bytes, "Bytes of one fused tile for (group, zeros).");
  ps.def("fuse", &qgemv::persist_fuse_py, "Grouped int4 weights in the chain's tiles (CPU tensors in, uint8 out).",
         pybind11::arg("qweight"), pybind11::arg("scales"), pybind11::arg("zeros"), pybind11::arg("N"),
         pybind11::arg("K"), pybind11::arg("group") = 128);
  ps.def("plan", &qgemv::persist_plan_py, "The chain's tables (host only; pointers as integers).",
         pybind11::arg("ops"), pybind11::arg("group"), pybind11::arg("zeros"), pybind11::arg("blocks"),
         pybind11::arg("warps"), pybind11::arg("stages"),
         pybind11::arg("attns") = std::vector<qgemv::PersistAttnTuple>{}, pybind11::arg("bits") = 4);
  ps.def("rope_rows", &qgemv::persist_rope_rows,
         "The q/k/v rows' order for the launch: permuted row i is natural row rope_rows[i].",
         pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"));
  ps.def("attn_part", &qgemv::persist_attn_part, "Floats of one attention's scratch.", pybind11::arg("heads"),
         pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("splits"));
  ps.def("op_bytes", &qgemv::persist_op_bytes, "Bytes of one op in the plan's op table.");
  ps.def("refusal", [](int64_t smem, int group, bool zeros, int blocks, int warps, bool norm, bool decode, int bits,
                       bool bf16, bool octets) {
           return qgemv::persist_refusal(qgemv::persist_plan_from(0, 0, 0, smem, 0, octets), bits, group, zeros,
                                         blocks, warps, norm, decode, bf16);
         },
         "Why a grid of a plan (its shared memory a block) cannot run on the current device, or ''.",
         pybind11::arg("smem"), pybind11::arg("group"), pybind11::arg("zeros"), pybind11::arg("blocks"),
         pybind11::arg("warps"), pybind11::arg("norm") = false, pybind11::arg("decode") = false,
         pybind11::arg("bits") = 4, pybind11::arg("bf16") = false, pybind11::arg("octets") = true);
  ps.def("launch", &qgemv::persist_launch_py,
         "One launch of the chain on the current stream: '' when launched, else why not (never raises).",
         pybind11::arg("ops"), pybind11::arg("schedule"), pybind11::arg("sync"), pybind11::arg("group"),
         pybind11::arg("zeros"), pybind11::arg("blocks"), pybind11::arg("warps"), pybind11::arg("stages"),
         pybind11::arg("classes"), pybind11::arg("sums"), pybind11::arg("x_cap"), pybind11::arg("smem"),
         pybind11::arg("norms") = 0, pybind11::arg("eps") = 0.0, pybind11::arg("attn") = 0, pybind11::arg("pos") = 0,
         pybind11::arg("bits") = 4, pybind11::arg("stage") = 0, pybind11::arg("bf16") = false,
         pybind11::arg("head") = 0, pybind11::arg("octets") = true);
  ps.def("head_record", &qgemv::persist_head_py,
         "The head's record (the final RMSNorm, lm_head, the greedy argmax) in the device layout; empty if invalid.",
         pybind11::arg("x"), pybind11::arg("ldx"), pybind11::arg("gain"), pybind11::arg("eps"), pybind11::arg("weight"),
         pybind11::arg("V"), pybind11::arg("K"), pybind11::arg("logits"), pybind11::arg("out"), pybind11::arg("key"),
         pybind11::arg("count"), pybind11::arg("token"));
}
