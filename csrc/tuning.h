// Every measured constant of the kernels and the dispatch, in one place.
//
// Each number was chosen by a measurement on the H200 (torch 2.11, CUDA 13.0);
// the comment says which one.  "lab" means dev/gemv_lab.cu (a torch-free A/B
// of edited copies of csrc/, run by dev/lab_ab.sh); the tables themselves are
// in the git history of BENCHMARKS.md (sessions of 2026-11-30 to 2026-12-01).
// To try another value, edit a copy of this file in a lab variant: the
// product build has no switches for it.
#pragma once

#include <cstdint>

namespace qgemv {
namespace tuning {

// ---------------------------------------------------------------------------
// GEMV (csrc/gemv_mma.cuh), M = 1..16 tokens
// ---------------------------------------------------------------------------

// Weight ring depth per warp, in tiles (a power of two: the ring index is a
// mask).  Lab (2026-12-01): an 8-stage ring was slower than 4 stages on every
// shape and format, by 1-70% (M = 16 worst).
constexpr int kGemvStages = 4;

// Warps per block at most (the split-K factor's ceiling).
constexpr int kGemvMaxWarps = 8;

// Two row tiles per warp for 9..16 tokens from this many 16-row panels
// (int4 per channel and G = 128 only).  Lab: int4 M = 16 28672x8192
// 64.0 -> 48.6 us, 8192x28672 54.5 -> 45.1 us, 8192x8192 20.6 -> 19.6 us;
// slower at 4096x4096 (256 panels: 128 blocks leave SMs short of warps).
constexpr int kWideMinPanels = 512;

// Resident blocks per SM the register cap is sized for: 65536 registers /
// (kGemvMaxWarps x 32 threads x 2 blocks) = 128 per thread, what
// __launch_bounds__(256, 2) gave.  The int4 M <= 8 instances (95-128
// registers) spilled under caps of 64, 72 or 80 and got slower at every one
// (lab: 28672x8192 int4 39.5 -> 44.7 / 39.6 / 44.7 us).
constexpr int kGemvMinBlocksPerSm = 2;

// Register caps of the int8 instances with one row tile (memory-bound, few
// registers; at 4 warps per block each 8 registers is a block per SM: 72 fit
// 7 blocks of 128 threads, 76 only 6; 96 fit 5, 98 only 4).  Uncapped, the
// row-tile generalisation cost int8 28672x8192 7-9% (lab: M = 1 66.0 ->
// 71.6 us, M = 16 74.7 -> 81.2 us; capped 66.0 and 74.0 us).
constexpr int kInt8RegsOneNTile = 72;
constexpr int kInt8RegsTwoNTiles = 96;

// Warps per block by shape, one row tile (lab, --warps 8,4,2 on 11 shapes x
// 7 formats; within 8% of the best of {2, 4, 8} everywhere):
//   short rows (K <= kShortRowK) with at least kShortRowMinPanels panels: 2
//   (int4 12288x4096 16.7 -> 13.8 us against 8 warps);
//   short rows with kShortRowMidPanels..kShortRowMinPanels - 1 panels: 4
//   (decode's chain of linears, dev/gemv_lab.cu --chain, H100: the fused
//   q/k/v of Llama-3-8B (384 panels) with 4 warps instead of 8 took the
//   chain of 16 layers from 51.4 to 49.7 us a layer for int4 and 56.8 ->
//   53.9 for G = 128 with zero points at M = 1, 3-6% at M = 16, int8
//   level at M = 1; single calls at 288 and 384 panels 12-20% faster.  At
//   224 and 256 panels (the o projections) 4 warps lost up to 35% in single
//   calls at M = 16 and nothing was gained in the chain, so they keep 8);
//   long rows (K >= kLongRowK) with at least kLongRowMinPanels panels: 4;
//   otherwise 8, so that split-K fills the GPU.
constexpr int kShortRowK = 4096;
constexpr int kShortRowMinPanels = 640;
constexpr int kShortRowMidPanels = 288;
constexpr int kLongRowK = 8192;
constexpr int kLongRowMinPanels = 512;
// Two row tiles (M = 16, 7 shapes x 3 formats): what matters is the number of
// warps in flight, about 1500-2000: 2 warps from 768 blocks, 4 from 320, else 8.
constexpr int kWideTwoWarpBlocks = 768;
constexpr int kWideFourWarpBlocks = 320;

// The persistent grid (M <= 8; int8, int4 per channel / G = 128 without zero
// points) from this many waves of resident blocks.  Lab: int4 57344x8192
// M = 8 81.1 -> 74.7 us, 22016x4096 M = 1 22.3 -> 20.5 us, 28672x8192 level;
// with zero points it lost 3-7%, so those keep the plain grid.
constexpr int kPersistMinWaves = 1;

// ---------------------------------------------------------------------------
// Tiled GEMMs for prefill (csrc/gemm_mma.cu, csrc/gemm_wgmma.cu)
// ---------------------------------------------------------------------------

// cp.async pipeline depth of the mma.sync GEMM, and the minimum resident
// blocks of its launch bounds.  Tried in the prefill sweep and not kept:
// 2 stages with 3 blocks per SM (median 1.03x slower).
constexpr int kGemmStages = 3;
constexpr int kGemmMinBlocks = 1;

// Split-K when a GEMM's grid is under one wave: at most kMaxSplits parts,
// each of at least kMinTilesPerSplit K tiles.  These two were set with the
// tiled GEMM (third session) and not swept on their own.
constexpr int kMaxSplits = 8;
constexpr int kMinTilesPerSplit = 8;

// ---------------------------------------------------------------------------
// The dispatch for M > 16 (csrc/torch_bindings.cpp, prefill sweep over
// 4096x4096, 8192x8192, 28672x8192 x int8 / int4 / int4 g128, 17..2048 tokens)
// ---------------------------------------------------------------------------

// Without wgmma: the tiled mma.sync GEMM up to this many tokens (fastest of
// chunks / tiled / dense on 50 of 54 measured pairs at 17-128), then dense.
constexpr int64_t kTiledMaxTokens = 128;
// With wgmma (cc 9.0, sm_90a build): the tiled GEMM below kWgmmaMinTokens
// (kWgmmaMinTokensSmall for weights of at most kSmallWeight elements, where
// the tiled GEMM with several blocks per SM and no permute launch is faster
// up to 64 tokens), the wgmma GEMM up to kWgmmaMaxTokens (within 3-9% of the
// best forced path at every M from 48 to 512), then dequantize + cuBLAS (at
// 1024 it beat the wgmma GEMM by 6-37%, at 2048 by 14-60%).
constexpr int64_t kWgmmaMinTokens = 33;
constexpr int64_t kWgmmaMinTokensSmall = 65;
constexpr int64_t kWgmmaMaxTokens = 512;
constexpr int64_t kSmallWeight = int64_t{1} << 24;

}  // namespace tuning
}  // namespace qgemv
