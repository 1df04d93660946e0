// Does compute-sanitizer racecheck follow bulk copies that complete on an
// mbarrier?  A standalone probe for the hazards it reports in the wgmma GEMM's
// warp-specialized kernel (BENCHMARKS.md, "Correctness runs").
//
// One block: warp 0 is the producer, warps 1..4 the consumers, a ring of
// kStages stages of kStageBytes.  Per stage, producer lane 0 arms full[s]
// with the stage's byte count and each of its lanes issues one bulk copy
// (cp.async.bulk global -> shared, complete_tx on full[s]).  Consumers wait
// on full[s], read the stage, and one lane per consumer warp arrives on
// empty[s]; the producer waits on empty[s] before it refills the stage.
// This is the ring of gemm_wgmma.cu reduced to its synchronisation, built
// from the same helpers (csrc/mbarrier.cuh).
//
//   mode 0: as above (correct);
//   mode 1: consumers arrive on empty[s] before they read the stage (a real
//           write-after-read race: the producer may refill the stage while
//           they read it; the phases still line up, so nothing hangs).
//
// Build and run (sm_90):
//   nvcc -arch=sm_90a -O2 -o /tmp/rc_bulk eval/racecheck_bulk_copy.cu
//   compute-sanitizer --tool racecheck /tmp/rc_bulk 0
//   compute-sanitizer --tool racecheck /tmp/rc_bulk 1
// The program checks every consumer's sum against the host's and prints
// "ok" or the number of wrong sums (mode 1 may or may not corrupt a run;
// racecheck is what should tell).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "../csrc/mbarrier.cuh"  // the same helpers as the wgmma kernel

constexpr int kStages = 4;
constexpr int kCopies = 8;  // one per producer lane
constexpr int kCopyBytes = 512;
constexpr int kStageBytes = kCopies * kCopyBytes;
constexpr int kStageWords = kStageBytes / 4;
constexpr int kConsumerWarps = 4;
constexpr int kIters = 64;

__global__ void ring_kernel(const uint32_t* __restrict__ src, uint32_t* __restrict__ sums, int mode) {
  __shared__ alignas(128) uint32_t ring[kStages][kStageWords];
  __shared__ uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp == 0) {
    for (int it = 0; it < kIters; ++it) {
      const int s = it % kStages;
      if (it >= kStages) mbar_wait(&empty[s], ((it / kStages) - 1) & 1);
      if (lane == 0) mbar_expect_tx(&full[s], kStageBytes);
      __syncwarp();
      if (lane < kCopies) {
        const uint32_t* g = src + static_cast<size_t>(it) * kStageWords + lane * (kCopyBytes / 4);
        bulk_copy(&ring[s][lane * (kCopyBytes / 4)], g, kCopyBytes, &full[s]);
      }
    }
  } else {
    const int t = threadIdx.x - 32;
    uint32_t acc = 0;
    for (int it = 0; it < kIters; ++it) {
      const int s = it % kStages;
      mbar_wait(&full[s], (it / kStages) & 1);
      if (mode == 1 && lane == 0) mbar_arrive(&empty[s]);
      for (int w = t; w < kStageWords; w += 32 * kConsumerWarps) acc += ring[s][w] * static_cast<uint32_t>(it + 1);
      __syncwarp();
      if (mode == 0 && lane == 0) mbar_arrive(&empty[s]);
    }
    sums[t] = acc;
  }
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  const size_t words = static_cast<size_t>(kIters) * kStageWords;
  std::vector<uint32_t> h(words);
  for (size_t i = 0; i < words; ++i) h[i] = static_cast<uint32_t>(i * 2654435761u);
  uint32_t *d_src = nullptr, *d_sums = nullptr;
  const int threads = 32 * kConsumerWarps;
  cudaMalloc(&d_src, words * 4);
  cudaMalloc(&d_sums, threads * 4);
  cudaMemcpy(d_src, h.data(), words * 4, cudaMemcpyHostToDevice);
  cudaMemset(d_sums, 0xff, threads * 4);
  ring_kernel<<<1, 32 * (1 + kConsumerWarps)>>>(d_src, d_sums, mode);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 3;
  }
  std::vector<uint32_t> got(threads);
  cudaMemcpy(got.data(), d_sums, threads * 4, cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int t = 0; t < threads; ++t) {
    uint32_t want = 0;
    for (int it = 0; it < kIters; ++it)
      for (int w = t; w < kStageWords; w += threads) want += h[static_cast<size_t>(it) * kStageWords + w] * (it + 1);
    bad += want != got[t];
  }
  std::printf("mode %d: %s (%d of %d sums wrong)\n", mode, bad ? "WRONG" : "ok", bad, threads);
  cudaFree(d_src);
  cudaFree(d_sums);
  return bad && mode == 0 ? 1 : 0;
}
