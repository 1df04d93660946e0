// The persistent chain of linears (issue 35, stage 1): host interface of
// csrc/persist.cu, for the torch glue.  One launch runs a chain of int4
// linears, each reading an earlier one's output, with no kernel boundary
// between them (form 20 of csrc/persist_chain.cuh; dev/PERSISTENT.md), with
// the RMSNorms of the ops' inputs inside the hand-offs when asked.
//
// Stage 2 adds each layer's rotary embedding, KV-cache write and attention
// (PersistAttn).  Supported: int4 per channel and int4 G = 32, 64, 128 with
// or without zero points (bits 4), int8 per channel (bits 8: qgemv's packed
// int8, its panels' own 64-byte tiles) and fp16 / bf16 weights (bits 16:
// each 16-row panel's rows in 64-byte tiles, formats.to_panels' order, in the
// activations' type); fp16 or bf16 activations (bf16: every buffer, cache,
// gain and rotary table in bf16), one token, compute capability 9.x.  K % 128 == 0, N % 16 == 0
// (N % 32 == 0 for SiLU * mul).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "qgemv.h"

namespace qgemv {

// One linear of the chain.  Activations inside the chain carry their own
// readiness: a buffer of n values holds two copies of n fp16 / bf16 (2n x 16 bits),
// 0xffff until written; a launch writes the copy of its parity (launch count
// & 1) and poisons the other for the next.  `*_plain` marks a buffer of plain
// values written before the launch (x, res) or read only after it (y).
struct PersistOp {
  const void* x = nullptr;    // [K] input
  int ldx = 0;                // x's copy stride: the producing linear's N (0: K)
  const void* res = nullptr;  // out == 1: [N] residual added after rounding
  void* y = nullptr;          // [N] output (out == 2: [N / 2])
  const void* weight = nullptr;  // int4 / int8: qweight's bytes (read in place); fp16: panels
  const void* scales = nullptr;  // int4 / int8 per channel: fp16 [N]; grouped: each tile's meta (chain_meta's
                                 // order, tile by tile); fp16 weights: unused
  int N = 0, K = 0;
  int Kp = 0;   // the weight's K, padded to whole tiles (a multiple of 128 int4 / 64 int8 / 32 fp16 inputs; 0: K):
                // inputs K .. Kp - 1 read as zeros
  int out = 0;  // 0: y = round(W x); 1: y = round(round(W x) + res); 2: SiLU * mul of 16-row panel pairs
  bool x_plain = false, res_plain = false, y_plain = false;
  // stage 2 (the decode step): 1, the q/k/v linear of attention `attn` (its q and k rows permuted so that
  // each 16-row panel holds 8 rotation pairs, persist_rope_rows); 2, the linear after it (x: its output)
  int role = 0, attn = -1;
  // act-order: int16 [K] (16-byte aligned, values < 32768): stored input k multiplies input perm[k]; or none
  const void* perm = nullptr;
};

// One layer's attention inside the launch (stage 2; M = 1; "fp16" below: the activations' type).  The
// token's cache slot, also its rotary position, is a device int32 that the
// launch reads.  The q/k/v linear's output is q, k, v in their natural order
// ((heads + 2 kv_heads) x head_dim), rotated.
struct PersistAttn {
  void* k_cache = nullptr;      // fp16 [kv_heads][max_seq][head_dim] (this layer's), written at the slot
  void* v_cache = nullptr;
  const void* cos = nullptr;    // fp16 [max_seq][head_dim]: the model's rotary tables
  const void* sin = nullptr;
  const void* bias = nullptr;   // fp16 [(heads + 2 kv_heads) head_dim] the q/k/v linear's bias (natural order), or none
  // Qwen3: each q / k head's RMSNorm gain (fp16 [head_dim]) and epsilon; ss / count: fp32 and u32
  // [2 (heads + kv_heads)] scratch, zeroed once before the first launch
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  float* qk_ss = nullptr;
  unsigned* qk_count = nullptr;
  float qk_eps = 0.f;
  float* part = nullptr;        // fp32 [persist_attn_part(...)] scratch
  unsigned* count = nullptr;    // [kv_heads], zeroed once before the first launch
  int heads = 0, kv_heads = 0, head_dim = 0, max_seq = 0, splits = 0;
  int per_warp = 0;             // positions a warp before a context is split across blocks, 1..64; 0: 2
  float scale = 0.f;
};

// The head after the last op (kNorm kernels; M = 1; "A" the activations' type): the final RMSNorm of the
// last op's output, lm_head and the greedy argmax.  The last op's output must be a chain buffer (two
// poisoned copies, y_plain false).
struct PersistHead {
  const void* x = nullptr;        // the last op's output (its y), two copies of K values
  int ldx = 0;                    // their stride (the last op's N: K)
  const void* gain = nullptr;     // A [K + 8], 16-byte aligned: the final norm's gain (qgemv.persist.norm_gain)
  float eps = 0.f;
  const void* weight = nullptr;   // A [V][K], row-major, 16-byte aligned, K % 8 == 0: lm_head's weight
  int V = 0, K = 0;
  float* logits = nullptr;        // fp32 [V]: round_A(weight . normed) widened
  void* out = nullptr;            // A [K]: the last op's output as plain values, or nullptr
  void* key = nullptr;            // u64 scratch, zeroed once before the first launch
  unsigned* count = nullptr;      // u32 scratch, zeroed once before the first launch
  long long* token = nullptr;     // int64: the argmax (lowest index of the largest logit)
};

// The head's record in the device layout, to copy to the GPU (empty when a pointer is missing or K is not a
// positive multiple of 8).
std::vector<uint8_t> persist_head_record(const PersistHead& h);

// Floats of PersistAttn::part.
long long persist_attn_part(int heads, int kv_heads, int head_dim, int splits);

// The q/k/v rows' order for the launch: row i of the permuted weight is row
// perm[i] of the natural one (q and k heads' rows in rotation pairs, v as is).
std::vector<int32_t> persist_rope_rows(int heads, int kv_heads, int head_dim);

// The launch's attention form for the chains planned from now on: -1 (the default) the rule (octets where a kv
// head has 4 query heads or more and a unit 128 cache positions or more; persist_chain.cuh, chain_oct_dim),
// 1 an octet of lanes a position everywhere, 0 a warp a position everywhere (the form before 2026-12-07).
// Returns false, changing nothing, for another value.  Process-wide, for the A/B.
bool set_chain_attention_form(int form);
int chain_attention_form();

// Tiles of its walk past its full ring that each warp of the launch asks into L2 at a layer's attention, for the
// chains planned from now on: kChainAttnPrefetchRule (the default) the rule below; else n forced (0 none, n > 0
// before the block's attention units, n < 0 after them, before o's input; |n| <= kChainAttnMaxPrefetch).  Returns
// false, changing nothing, for another value.  Process-wide, for the A/B.
constexpr int kChainAttnMaxPrefetch = 64;
constexpr int kChainAttnPrefetchRule = -1000;
bool set_chain_attention_prefetch(int tiles);
int chain_attention_prefetch();
// The rule, by the query heads a kv head has (gq): 16 tiles after the units where gq == 1, else none.  Measured on
// the H100 (2026-12-07, dev/PERSISTENT.md): 16 after the units took Llama-2-7B's step (gq 1) 1.5-2.5% faster
// (int4, int8; fp16 level), Llama-3-8B's (gq 4) level at 8 tiles and 1% slower at 16.
inline int chain_attn_prefetch_rule(int gq) { return gq == 1 ? -16 : 0; }

// The launch's tables, built on the host once per chain.
struct PersistPlan {
  std::string error;             // empty when the chain is supported
  std::vector<uint8_t> ops;      // the op table (device layout), to copy to the GPU
  std::vector<int32_t> schedule; // [classes][blocks][warps + 1][4]: each warp's run of each op class
  std::vector<int32_t> op_class; // [nops]
  std::vector<uint8_t> attn;     // stage 2: the attention table (device layout), empty without
  int classes = 0, sums = 0, x_cap = 0;
  int stage = 0;                 // 1: some op has an input perm (a second input buffer in shared memory)
  bool octets = false;           // stage 2: the attention's octet form may run (its rule, or forced): the
                                 // decode kernel with it, else the one without (which spills nothing)
  size_t smem = 0;               // dynamic shared memory a block
};

// Bytes of one op in PersistPlan::ops.
int persist_op_bytes();

// Bytes of one fused grouped tile: 1 KB of codes, then its scales (and zero points).
int persist_tile_bytes(int group, bool zeros);

// Grouped int4 weights (G = 32, 64 or 128) as the chain reads them: each 1 KB
// tile of the packed qweight (its panel order, which the launch reads in
// place) followed by the tile's scales and zero points (the meta the launch
// reads from PersistOp::scales): the reference of qgemv.persist.tile_meta.
// Host arrays in (qweight's bytes, scales fp16 [N, K / G], zeros uint8 or
// nullptr).
std::vector<uint8_t> persist_fuse(const uint8_t* qweight, const uint16_t* scales, const uint8_t* zeros, int N,
                                  int K, int group = 128);

// The tables for `blocks` blocks of `warps` warps with `stages` ring slots
// a warp (plan.error names the first rule broken).
PersistPlan persist_plan(const std::vector<PersistOp>& ops, int bits, int group, bool zeros, int blocks, int warps,
                         int stages, const std::vector<PersistAttn>& attns = {});

// Why the chain's grid cannot run on the current device ("" when it can):
// compute capability, this build's machine code, and one block an SM (norm:
// the kernel with the RMSNorms; bf16: bfloat16 activations).
std::string persist_refusal(const PersistPlan& plan, int bits, int group, bool zeros, int blocks, int warps,
                            bool norm = false, bool decode = false, bool bf16 = false);

// One launch: d_ops / d_schedule the plan's tables on the device, d_sync
// [nops + 1] u32 zeroed once before the first launch (the last counts the
// launches: their parity).  d_norms (or nullptr): a device array of nops
// pointers, each op's RMSNorm gain (A [K + 8], 16-byte aligned: the K values, then max|gain| as an fp32 in
// the first 4 bytes of the last 16, which bf16 activations read; qgemv.persist.norm_gain) or nullptr:
// that op reads round(gain * round(x * rsqrt(mean(x^2) + eps))) instead of x.
// d_attn (stage 2, with d_norms): the plan's attention table on the device,
// d_pos the token's slot (int32).  bf16: every activation, gain, cache and
// rotary table is bfloat16 (bits 16: so are the weights), else fp16.  d_head
// (with d_norms): persist_head_record's bytes on the device, run after the last op.
// A cooperative launch: refused, not hung, when the grid cannot be co-resident.
cudaError_t persist_launch(const PersistPlan& plan, const void* d_ops, int nops, const int32_t* d_schedule,
                           unsigned* d_sync, int bits, int group, bool zeros, int blocks, int warps, int stages,
                           cudaStream_t stream, const void* const* d_norms = nullptr, float eps = 0.f,
                           const void* d_attn = nullptr, const int32_t* d_pos = nullptr, bool bf16 = false,
                           const void* d_head = nullptr);

}  // namespace qgemv
