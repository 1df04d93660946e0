// What the torch-free labs (dev/gemv_lab.cu, dev/persist_lab.cu) share: the
// CUDA error check and the plain streaming read that is their floor.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// What a timed lab section needs: a non-blocking stream, two events around
// the timed work, and a word the read kernels write their XOR to.
struct LabTimer {
  cudaStream_t st;
  cudaEvent_t a, b;
  unsigned* sink;
  LabTimer() {
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaMalloc(&sink, 4));
  }
};

// Every 16-byte word of p[0, n) read once, streaming (__ldcs); the XOR keeps
// the loads alive.
__global__ void read_kernel(const uint4* p, size_t n, unsigned* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // practically never; keeps the loads alive
}

// Median µs between two events around body() on stream st, over reps runs
// after 3 warm-ups; before(i) runs ahead of each timed run, outside the events.
template <typename Before, typename Body>
float median_event_us(cudaStream_t st, cudaEvent_t a, cudaEvent_t b, int reps, Before&& before, Body&& body) {
  for (int i = 0; i < 3; ++i) body();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    before(i);
    CK(cudaEventRecord(a, st));
    body();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.f);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// Median µs of one replay of the graph that body() launches into st when
// captured (reps replays after 3 warm-ups).
template <typename F>
float capture_us(F&& body, cudaStream_t st, cudaEvent_t a, cudaEvent_t b, int reps = 20) {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&exec, g, 0));
  const float us = median_event_us(st, a, b, reps, [](int) {}, [&] { CK(cudaGraphLaunch(exec, st)); });
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(g));
  return us;
}

// A buffer of `bytes` (set to ones) and the median µs of read_kernel over
// its first `n` bytes (sms x 8 blocks of 512 threads, after 3 warm-ups): the
// labs' read ceiling is bytes / us(bytes) over 2 GB.
struct ReadBuffer {
  void* p = nullptr;
  unsigned* sink = nullptr;
  size_t bytes;
  explicit ReadBuffer(size_t b) : bytes(b) {
    CK(cudaMalloc(&p, bytes));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(p, 1, bytes));
  }
  ~ReadBuffer() {
    cudaFree(p);
    cudaFree(sink);
  }
  float us(size_t n, int sms, cudaEvent_t a, cudaEvent_t b, int reps) {
    return median_event_us(0, a, b, reps, [](int) {}, [&] {
      read_kernel<<<sms * 8, 512>>>(static_cast<const uint4*>(p), n / 16, sink);
    });
  }
};
