// What the benchmark programs share: checks that stop the program with the library's message, and
// the CUDA-event timing every benchmark uses.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "core/format.hpp"
#include "fp8.h"

#define CHECK_FP8(call)                                                                             \
  do {                                                                                              \
    fp8_status_t s_ = (call);                                                                       \
    if (s_ != FP8_OK) {                                                                             \
      std::fprintf(stderr, "%s: %s: %s\n", #call, fp8_status_string(s_), fp8_last_error_message()); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

#define CHECK_CUDA(call)                                               \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

namespace fp8bench {

// Median time in ms of `fn` over `reps` runs, each timed with CUDA events on `stream`. With
// batch > 1, each timed region queues `batch` calls back to back and the time is per call: the
// GPU's throughput without the host's launch latency between an event and the kernel.
double median_ms(cudaStream_t stream, const std::function<void(int)>& fn, int batch = 1, int warmup = 10,
                 int reps = 50) {
  for (int i = 0; i < warmup; ++i) fn(i);
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    for (int k = 0; k < batch; ++k) fn(i * batch + k);
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / batch);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A rows x cols tensor of `dt` on ctx.
inline fp8_tensor_t* matrix(fp8_context_t* ctx, fp8_dtype_t dt, int64_t rows, int64_t cols) {
  fp8_tensor_t* t = nullptr;
  const int64_t shape[2] = {rows, cols};
  CHECK_FP8(fp8_tensor_create(&t, ctx, dt, 2, shape));
  return t;
}

// Normal(0, sd) values from `seed` (never all zeros) into an F32 or BF16 tensor.
inline void fill_normal(fp8_tensor_t* t, float sd, uint32_t seed) {
  int64_t n = 0;
  fp8_dtype_t dt = 0;
  fp8_tensor_numel(t, &n);
  fp8_tensor_dtype(t, &dt);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sd);
  if (dt == FP8_DTYPE_F32) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = normal(rng);
    CHECK_FP8(fp8_tensor_copy_from_host(t, v.data(), v.size() * 4));
  } else {
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = fp8::float_to_bf16(normal(rng));
    CHECK_FP8(fp8_tensor_copy_from_host(t, v.data(), v.size() * 2));
  }
}

}  // namespace fp8bench
