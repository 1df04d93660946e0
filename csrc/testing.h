// Test and benchmark knobs: force a path or block shape that the measured
// rules would not choose, so that tests and sweeps reach every kernel.  Not
// part of the pointer API (qgemv.h); Python reaches them as qgemv._C.testing.
#pragma once

namespace qgemv {
namespace testing {

// The wgmma GEMM's block shape: -1 the rule, else 0 .. wgmma_shape_count() - 1
// (0: 64 tokens x 256 rows; 1: 128 tokens x 128 rows, warp-specialized).
void set_wgmma_shape(int shape);
int wgmma_shape_count();

}  // namespace testing
}  // namespace qgemv
