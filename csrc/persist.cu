// The persistent chain of linears in the extension (csrc/persist.h): form 20
// of csrc/persist_chain.cuh (every warp fills its own ring and refills the
// chunk it has just summed; fp16 or bf16 activations poisoned until written,
// each op's input copied into shared memory at once),
// compiled for M = 1 and chunks of 2 tiles (the lab's best,
// dev/PERSISTENT.md), int4 per channel and G = 128 with or without zero
// points.
#include "persist.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "persist_chain.cuh"

namespace qgemv {
namespace {

// kNorm: each op's input through its RMSNorm gain on the way in (ChainShape::norms); kDecode (with kNorm):
// the layers' rotary embedding, cache write and attention (ChainShape::attn); A: the activations' type
// (__half, or __nv_bfloat16 with bf16 weights for bits 16).
template <int kBits, int kGroup, bool kZeros, bool kNorm, bool kDecode, typename A, bool kOct>
constexpr auto persist_kernel = chain_kernel<kBits, kGroup, kZeros, kNorm, kDecode, A, kOct>;

template <bool kNorm, bool kDecode, typename A, bool kOct, typename F>
bool persist_dispatch_n(int bits, int group, bool zeros, F&& f) {
  if (bits == 16) return group == 0 && !zeros && (f(persist_kernel<16, 0, false, kNorm, kDecode, A, kOct>), true);
  if (bits == 8) return group == 0 && !zeros && (f(persist_kernel<8, 0, false, kNorm, kDecode, A, kOct>), true);
  if (bits != 4) return false;
  if (group == 0 && !zeros) return f(persist_kernel<4, 0, false, kNorm, kDecode, A, kOct>), true;
  if (group == 128 && !zeros) return f(persist_kernel<4, 128, false, kNorm, kDecode, A, kOct>), true;
  if (group == 128 && zeros) return f(persist_kernel<4, 128, true, kNorm, kDecode, A, kOct>), true;
  if (group == 64 && !zeros) return f(persist_kernel<4, 64, false, kNorm, kDecode, A, kOct>), true;
  if (group == 64 && zeros) return f(persist_kernel<4, 64, true, kNorm, kDecode, A, kOct>), true;
  if (group == 32 && !zeros) return f(persist_kernel<4, 32, false, kNorm, kDecode, A, kOct>), true;
  if (group == 32 && zeros) return f(persist_kernel<4, 32, true, kNorm, kDecode, A, kOct>), true;
  return false;
}
template <typename A, typename F>
bool persist_dispatch_a(int bits, int group, bool zeros, bool norm, bool decode, bool oct, F&& f) {
  if (decode)
    return norm && (oct ? persist_dispatch_n<true, true, A, true>(bits, group, zeros, f)
                        : persist_dispatch_n<true, true, A, false>(bits, group, zeros, f));
  return norm ? persist_dispatch_n<true, false, A, false>(bits, group, zeros, f)
              : persist_dispatch_n<false, false, A, false>(bits, group, zeros, f);
}
// f(kernel) for the format (with the RMSNorms or not, with the attention or not and its octet form or not, fp16
// or bf16 activations); false when there is none.
template <typename F>
bool persist_dispatch(int bits, int group, bool zeros, bool norm, bool decode, bool oct, bool bf16, F&& f) {
  return bf16 ? persist_dispatch_a<__nv_bfloat16>(bits, group, zeros, norm, decode, oct, f)
              : persist_dispatch_a<__half>(bits, group, zeros, norm, decode, oct, f);
}

ChainShape persist_shape(const PersistPlan& plan, int group, bool zeros, int stages, const int32_t* d_schedule,
                         const void* const* d_norms = nullptr, float eps = 0.f, const void* d_attn = nullptr,
                         const int32_t* d_pos = nullptr, const void* d_head = nullptr) {
  ChainShape sh{stages, chain_meta_bytes(group, zeros), plan.x_cap, 1};
  sh.sums = plan.sums;
  sh.stage = plan.stage;
  sh.cursors = reinterpret_cast<const int4*>(d_schedule);
  sh.classes = plan.classes;
  sh.norms = d_norms;
  sh.norm_eps = eps;
  sh.attn = static_cast<const ChainAttn*>(d_attn);
  sh.pos = d_pos;
  sh.head = static_cast<const ChainHead*>(d_head);
  return sh;
}

std::string str(const char* a, long long v) { return std::string(a) + std::to_string(v); }

std::atomic<int> chain_attn_form{-1};
std::atomic<int> chain_attn_prefetch{kChainAttnPrefetchRule};

}  // namespace

bool set_chain_attention_form(int form) {
  if (form < -1 || form > 1) return false;
  chain_attn_form.store(form);
  return true;
}
int chain_attention_form() { return chain_attn_form.load(); }

bool set_chain_attention_prefetch(int tiles) {
  if (tiles != kChainAttnPrefetchRule && (tiles < -kChainAttnMaxPrefetch || tiles > kChainAttnMaxPrefetch))
    return false;
  chain_attn_prefetch.store(tiles);
  return true;
}
int chain_attention_prefetch() { return chain_attn_prefetch.load(); }

int persist_op_bytes() { return static_cast<int>(sizeof(ChainOp)); }

std::vector<uint8_t> persist_head_record(const PersistHead& h) {
  if (!h.x || !h.gain || !h.weight || !h.logits || !h.key || !h.count || !h.token || h.K < 8 || h.K % 8 != 0 ||
      h.V < 1 || h.ldx < h.K)
    return {};
  ChainHead r{};
  r.x = static_cast<const unsigned short*>(h.x);
  r.gain = h.gain;
  r.w = h.weight;
  r.logits = h.logits;
  r.out = h.out;
  r.key = static_cast<unsigned long long*>(h.key);
  r.count = h.count;
  r.token = h.token;
  r.V = h.V, r.K = h.K, r.ldx = h.ldx;
  r.eps = h.eps;
  std::vector<uint8_t> out(sizeof(ChainHead));
  std::memcpy(out.data(), &r, sizeof r);
  return out;
}

long long persist_attn_part(int heads, int kv_heads, int head_dim, int splits) {
  if (kv_heads < 1 || heads < kv_heads) return 0;
  return static_cast<long long>(kv_heads) * splits * (heads / kv_heads) * (head_dim + 2);
}

std::vector<int32_t> persist_rope_rows(int heads, int kv_heads, int head_dim) {
  std::vector<int32_t> perm;
  const int D = head_dim, half = D / 2;
  for (int h = 0; h < heads + kv_heads; ++h)  // q heads, then k heads: panel j holds pairs 8j..8j+7
    for (int j = 0; j < half / 8; ++j) {
      for (int r = 0; r < 8; ++r) perm.push_back(h * D + 8 * j + r);
      for (int r = 0; r < 8; ++r) perm.push_back(h * D + half + 8 * j + r);
    }
  for (int r = 0; r < kv_heads * D; ++r) perm.push_back((heads + kv_heads) * D + r);  // v as is
  return perm;
}

int persist_tile_bytes(int group, bool zeros) { return kChainTileBytes + chain_meta_bytes(group, zeros); }

std::vector<uint8_t> persist_fuse(const uint8_t* qweight, const uint16_t* scales, const uint8_t* zeros, int N,
                                  int K, int group) {
  const std::vector<uint8_t> meta = chain_meta(scales, zeros, N, K, group);
  return chain_fuse(qweight, meta.data(), static_cast<size_t>(N / kPanelRows) * (K / 128),
                      chain_meta_bytes(group, zeros != nullptr));
}

PersistPlan persist_plan(const std::vector<PersistOp>& in, int bits, int group, bool zeros, int blocks, int warps,
                         int stages, const std::vector<PersistAttn>& attns) {
  PersistPlan pl;
  const int n = static_cast<int>(in.size());
  if (group != 0 && group != 32 && group != 64 && group != 128)
    return pl.error = str("group_size must be 0 (per channel), 32, 64 or 128, got ", group), pl;
  if (zeros && group == 0) return pl.error = "zero points need a group_size", pl;
  if (bits != 4 && bits != 8 && bits != 16)
    return pl.error = str("bits must be 4 (int4), 8 (int8) or 16 (fp16 weights), got ", bits), pl;
  if (bits != 4 && group != 0) return pl.error = "int8 and fp16 weights are per channel (group must be 0)", pl;
  if (n < 1) return pl.error = "the chain has no linears", pl;
  if (blocks < 1) return pl.error = str("blocks must be at least 1, got ", blocks), pl;
  if (warps < 1 || warps > kChainMaxWarps)
    return pl.error = "warps must be 1.." + std::to_string(kChainMaxWarps) + ", got " + std::to_string(warps), pl;
  if (stages <= kChainChunk || stages % kChainChunk != 0)
    return pl.error = str("stages must be an even number above 2, got ", stages), pl;
  std::vector<ChainOp> ops(n);
  for (int i = 0; i < n; ++i) {
    const PersistOp& a = in[i];
    const std::string at = "linear " + std::to_string(i) + ": ";
    const int tk = chain_tile_k(bits), kp = a.Kp ? a.Kp : a.K;
    if (a.K < 8 || a.K % 8 != 0) return pl.error = at + str("K must be a positive multiple of 8, got ", a.K), pl;
    if (kp % tk != 0 || kp < a.K || kp - a.K >= tk)
      return pl.error = at + "Kp (the weight's K padded to whole tiles) must be K rounded up to a multiple of " +
                        std::to_string(tk) + ", got K " + std::to_string(a.K) + ", Kp " + std::to_string(kp), pl;
    if (group != 0 && a.K % group != 0)
      return pl.error = at + str("K must be a multiple of the group size, got ", a.K), pl;
    if (a.N < 16 || a.N % (a.out == 2 ? 32 : 16) != 0)
      return pl.error = at + "N must be a positive multiple of " + (a.out == 2 ? "32 (SiLU * mul)" : "16") +
                        ", got " + std::to_string(a.N), pl;
    if (a.out < 0 || a.out > 2) return pl.error = at + str("out must be 0, 1 or 2, got ", a.out), pl;
    if (a.ldx != 0 && a.ldx < a.K) return pl.error = at + str("ldx must be 0 or at least K, got ", a.ldx), pl;
    if (!a.x || !a.y || !a.weight || (bits != 16 && !a.scales) || (a.out == 1 && !a.res))  // (grouped: the meta)
      return pl.error = at + "a null pointer (x, y, weight, scales or residual)", pl;
    ChainOp& o = ops[i];
    o = ChainOp{};
    o.p.x = a.x;
    o.p.qweight = a.weight;
    o.p.scales = a.scales;
    o.p.y = a.y;
    o.p.M = 1;
    o.p.N = a.N;
    o.p.K = a.K;
    o.p.Kp = kp;
    o.p.ldx = a.ldx ? a.ldx : a.K;
    o.p.ldy = a.out == 2 ? a.N / 2 : a.N;
    o.p.group_size = group;
    o.p.act = ActType::kHalf;
    o.res = a.res;
    o.out = a.out;
    o.flags = (a.x_plain ? kChainPlainX : 0) | (a.res_plain ? kChainPlainRes : 0) | (a.y_plain ? kChainPlainY : 0);
    chain_op_set(o, kp / tk, static_cast<const uint16_t*>(a.perm));
    if (a.perm) pl.stage = 1;
    pl.x_cap = std::max(pl.x_cap, kp);
  }
  // stage 2: each attention's two linears, its shapes, and its table entry
  const int na = static_cast<int>(attns.size());
  std::vector<ChainAttn> at(na);
  std::vector<int> seen(2 * na, -1);
  for (int i = 0; i < n; ++i) {
    const PersistOp& a = in[i];
    const std::string where = "linear " + std::to_string(i) + ": ";
    if (a.role == 0) continue;
    if (a.role < 0 || a.role > 2 || a.attn < 0 || a.attn >= na)
      return pl.error = where + "role must be 1 or 2 with attn in 0.." + std::to_string(na - 1) + ", got role " +
                        std::to_string(a.role) + " attn " + std::to_string(a.attn), pl;
    int& slot = seen[2 * a.attn + a.role - 1];
    if (slot >= 0) return pl.error = where + "attention " + std::to_string(a.attn) + " already has its " +
                                     (a.role == 1 ? "q/k/v linear" : "linear after it"), pl;
    slot = i;
    ops[i].attn = a.attn;
    ops[i].flags |= a.role == 1 ? kChainRope : kChainAttnIn;
  }
  for (int k = 0; k < na; ++k) {
    const PersistAttn& a = attns[k];
    const std::string where = "attention " + std::to_string(k) + ": ";
    const int qi = seen[2 * k], oi = seen[2 * k + 1];
    if (qi < 0 || oi < 0) return pl.error = where + "needs its q/k/v linear (role 1) and the linear after it (role 2)", pl;
    if (oi <= qi) return pl.error = where + "the linear after it must come after its q/k/v linear", pl;
    const int H = a.heads, Hk = a.kv_heads, D = a.head_dim;
    if (Hk < 1 || H < Hk || H % Hk != 0 || H / Hk > 8)
      return pl.error = where + "heads must be a multiple of kv_heads, at most 8 query heads a kv head, got " +
                        std::to_string(H) + " and " + std::to_string(Hk), pl;
    if (D != 32 && D != 64 && D != 128) return pl.error = where + str("head_dim must be 32, 64 or 128, got ", D), pl;
    if (H / Hk > warps)
      return pl.error = where + "needs a warp a query head of a kv head: warps must be at least " +
                        std::to_string(H / Hk) + ", got " + std::to_string(warps), pl;
    if (a.max_seq < 1 || a.splits < 1)
      return pl.error = where + "max_seq and splits must be positive, got " + std::to_string(a.max_seq) + " and " +
                        std::to_string(a.splits), pl;
    if (!a.k_cache || !a.v_cache || !a.cos || !a.sin || !a.part || !a.count)
      return pl.error = where + "a null pointer (caches, rotary tables, scratch or counters)", pl;
    if (k > 0 && (a.cos != attns[0].cos || a.sin != attns[0].sin || D != attns[0].head_dim ||
                  a.max_seq != attns[0].max_seq))
      return pl.error = where + "every layer must share attention 0's rotary tables, head_dim and max_seq", pl;
    const PersistOp& q = in[qi];
    const PersistOp& o = in[oi];
    if (q.N != (H + 2 * Hk) * D || q.out != 0)
      return pl.error = where + "the q/k/v linear must have N = (heads + 2 kv_heads) head_dim = " +
                        std::to_string((H + 2 * Hk) * D) + " and a plain output, got N = " + std::to_string(q.N), pl;
    if (o.K != H * D) return pl.error = where + str("the linear after it must have K = heads x head_dim, got ", o.K), pl;
    if (q.y_plain || o.x_plain) return pl.error = where + "its buffers live inside the launch (not plain)", pl;
    ChainAttn& c = at[k];
    c.qkv = static_cast<const unsigned short*>(q.y);
    c.out = static_cast<unsigned short*>(const_cast<void*>(o.x));
    c.k_cache = static_cast<__half*>(a.k_cache);
    c.v_cache = static_cast<__half*>(a.v_cache);
    c.cos = static_cast<const __half*>(a.cos);
    c.sin = static_cast<const __half*>(a.sin);
    c.bias = static_cast<const __half*>(a.bias);
    if ((a.q_norm != nullptr) != (a.k_norm != nullptr) || (a.q_norm && (!a.qk_ss || !a.qk_count)))
      return pl.error = where + "q_norm and k_norm come together, with their scratch", pl;
    c.q_norm = static_cast<const __half*>(a.q_norm);
    c.k_norm = static_cast<const __half*>(a.k_norm);
    c.qk_ss = a.qk_ss;
    c.qk_count = a.qk_count;
    c.qk_eps = a.qk_eps;
    c.part = a.part;
    c.count = a.count;
    c.ldq = q.N, c.H = H, c.Hkv = Hk, c.D = D, c.S = a.max_seq, c.splits = a.splits;
    c.scale = a.scale;
    if (a.per_warp < 0 || a.per_warp > 64)
      return pl.error = where + str("per_warp must be 0 (2) or 1..64, got ", a.per_warp), pl;
    c.per_warp = a.per_warp ? a.per_warp : kChainAttnPerWarp;
    c.form = chain_attn_form.load();
    if (c.form == 1 || (c.form < 0 && chain_attn_octets_rule(H / Hk))) pl.octets = true;
    const int pf = chain_attn_prefetch.load();
    c.prefetch = pf != kChainAttnPrefetchRule ? pf : chain_attn_prefetch_rule(H / Hk);
    // the attention's scratch lives in the input buffer (x_cap fp16)
    pl.x_cap = std::max(pl.x_cap, (2 * chain_attn_floats(H / Hk, D, warps) + 127) / 128 * 128);
  }
  if (na > 0) {
    pl.attn.resize(sizeof(ChainAttn) * na);
    std::memcpy(pl.attn.data(), at.data(), pl.attn.size());
  }
  pl.classes = chain_classes(ops.data(), n);
  if (pl.classes < 0) return pl.error = str("more distinct linear shapes than the schedule holds: ", kChainMaxClasses), pl;
  for (int i = 0; i < n; ++i) pl.op_class.push_back(ops[i].cls);
  const std::vector<int4> tab = chain_schedule(ops.data(), n, pl.classes, blocks, warps);
  if (tab.empty()) return pl.error = "a linear too large for the schedule's 16-bit fields", pl;
  pl.schedule.resize(tab.size() * 4);
  std::memcpy(pl.schedule.data(), tab.data(), tab.size() * sizeof(int4));
  pl.sums = chain_sums(ops.data(), n, blocks, 1);
  pl.ops.resize(sizeof(ChainOp) * n);
  std::memcpy(pl.ops.data(), ops.data(), pl.ops.size());
  ChainShape sh = persist_shape(pl, group, zeros, stages, nullptr);
  pl.smem = chain_smem_bytes(sh, warps);
  return pl;
}

std::string persist_refusal(const PersistPlan& plan, int bits, int group, bool zeros, int blocks, int warps, bool norm,
                            bool decode, bool bf16) {
  if (!plan.error.empty()) return plan.error;
  int dev = 0, major = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return "no CUDA device";
  }
  if (major != 9) return str("needs compute capability 9.x (bulk copies, mbarriers), this GPU has ", major);
  std::string why;
  const bool known = persist_dispatch(bits, group, zeros, norm, decode, plan.octets, bf16, [&](auto kernel) {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess || fa.binaryVersion < 90) {
      (void)cudaGetLastError();
      why = "this build of the extension has no sm_90 code (QGEMV_CUDA_ARCHS)";
      return;
    }
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem)) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      why = "needs " + std::to_string(plan.smem) + " bytes of shared memory a block (fewer stages or warps)";
      return;
    }
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * kWarpSize, plan.smem) != cudaSuccess ||
        per_sm < 1) {
      (void)cudaGetLastError();
      why = "one block does not fit an SM";
      return;
    }
    if (blocks > per_sm * sms) why = str("the grid cannot be co-resident: blocks must be at most ", per_sm * sms);
  });
  if (!known) return "no kernel for this format";
  return why;
}

cudaError_t persist_launch(const PersistPlan& plan, const void* d_ops, int nops, const int32_t* d_schedule,
                           unsigned* d_sync, int bits, int group, bool zeros, int blocks, int warps, int stages,
                           cudaStream_t stream, const void* const* d_norms, float eps, const void* d_attn,
                           const int32_t* d_pos, bool bf16, const void* d_head) {
  if ((d_attn != nullptr) != (d_pos != nullptr) || (d_attn && !d_norms) || (d_head && !d_norms))
    return cudaErrorInvalidValue;
  const ChainShape sh = persist_shape(plan, group, zeros, stages, d_schedule, d_norms, eps, d_attn, d_pos, d_head);
  cudaError_t err = cudaErrorInvalidValue;
  persist_dispatch(bits, group, zeros, d_norms != nullptr, d_attn != nullptr, plan.octets, bf16, [&](auto kernel) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem));
    if (err != cudaSuccess) return;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(warps * kWarpSize);
    cfg.dynamicSmemBytes = plan.smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;  // co-resident or refused: never a hang
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    err = cudaLaunchKernelEx(&cfg, kernel, static_cast<const ChainOp*>(d_ops), nops, sh, d_sync,
                             static_cast<unsigned long long*>(nullptr));
  });
  return err;
}

}  // namespace qgemv
