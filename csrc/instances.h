// The kernel instances this build contains: one table per kernel family.
//
// Each table is an X-macro: X(...) is called once per row, and a row is one
// template configuration that is compiled, for fp16 and for bf16
// activations.  The dispatchers (gemv_mma.cuh, gemm_mma.cu, gemm_wgmma.cu)
// turn the runtime configuration into a row by the measured rules of
// tuning.h, look it up here, and answer Status::kNoKernel ("no kernel for
// this configuration") when no row matches.  To add a configuration, add a
// row; nothing else enumerates them.
#pragma once

// GEMV, 1..16 tokens (gemv_mma.cuh):
//   bits, group size (0 = per channel), zero points, n-tiles (8 tokens
//   each), row tiles per warp (16-row panels), persistent-grid variant.
// Token classes: 1 n-tile up to 8 tokens, 2 up to 16; 2 row tiles for 9..16
// tokens once N has tuning::kWideMinPanels panels (int4 per channel and
// G = 128 only: the G = 32 / 64 metadata spills at 2 row tiles).  The
// persistent grid is used once the plain grid exceeds
// tuning::kPersistMinWaves waves (one n-tile and one row tile, per channel
// or G = 128, without zero points: with them it lost 3-7%).
#define QGEMV_GEMV_INSTANCES(X) \
  X(8, 0, false, 1, 1, true)    \
  X(8, 0, false, 2, 1, false)   \
  X(4, 0, false, 1, 1, true)    \
  X(4, 0, false, 2, 1, false)   \
  X(4, 0, false, 2, 2, false)   \
  X(4, 32, false, 1, 1, false)  \
  X(4, 32, false, 2, 1, false)  \
  X(4, 64, false, 1, 1, false)  \
  X(4, 64, false, 2, 1, false)  \
  X(4, 128, false, 1, 1, true)  \
  X(4, 128, false, 2, 1, false) \
  X(4, 128, false, 2, 2, false) \
  X(4, 32, true, 1, 1, false)   \
  X(4, 32, true, 2, 1, false)   \
  X(4, 64, true, 1, 1, false)   \
  X(4, 64, true, 2, 1, false)   \
  X(4, 128, true, 1, 1, false)  \
  X(4, 128, true, 2, 1, false)  \
  X(4, 128, true, 2, 2, false)

// Tiled tensor-core GEMM, any M (gemm_mma.cu; used for 17..tuning::
// kTiledMaxTokens tokens where the wgmma GEMM does not run):
//   bits, grouped (group size and zero points are runtime values there),
//   n-tiles per block (4: 32 tokens, 8: 64 tokens; gemm_tokens() picks the
//   one that pads M least).
#define QGEMV_GEMM_INSTANCES(X) \
  X(8, false, 4)                \
  X(8, false, 8)                \
  X(4, false, 4)                \
  X(4, false, 8)                \
  X(4, true, 4)                 \
  X(4, true, 8)

// wgmma GEMM for prefill on compute capability 9.0 (gemm_wgmma.cu):
//   bits, grouped, tokens per block, 64-row tiles per warpgroup,
//   warp-specialized kernel.  The block shape is wgmma_shape()'s: 64 x 2
//   (plain kernel) up to 64 tokens, 128 x 1 (warp-specialized) above.
#define QGEMV_WGMMA_INSTANCES(X) \
  X(8, false, 64, 2, 0)          \
  X(8, false, 128, 1, 1)         \
  X(4, false, 64, 2, 0)          \
  X(4, false, 128, 1, 1)         \
  X(4, true, 64, 2, 0)           \
  X(4, true, 128, 1, 1)

namespace qgemv {

// A GEMV row, looked up at compile time: 0 none, 1 a row, 2 a row with the
// persistent-grid variant (the launchers and dispatch ask it).
constexpr int gemv_row(int bits, int group, bool zeros, int nt, int rt) {
#define QGEMV_ROW(B, G, Z, NT, RT, P) \
  if (bits == B && group == G && zeros == Z && nt == NT && rt == RT) return P ? 2 : 1;
  QGEMV_GEMV_INSTANCES(QGEMV_ROW)
#undef QGEMV_ROW
  return 0;
}

}  // namespace qgemv
