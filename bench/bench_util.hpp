// What the benchmark programs share: checks that stop the program with the library's message, and
// the CUDA-event timing every benchmark uses; for those whose ranks are threads of one process, the
// checks that end the process at once and the barrier where the ranks meet.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
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

// A failure on one rank ends the process at once: the other ranks' threads are inside libfp8 or
// waiting in NCCL, so no destructor may run (std::exit would run them). The message starts with
// die_program and ": " where it is set, then "rank k: " on a rank's thread (this_rank, which each
// rank's thread sets; -1 elsewhere).
inline thread_local int this_rank = -1;
inline const char* die_program = nullptr;
[[noreturn]] inline void die(const char* call, const char* status, const char* message) {
  std::fflush(stdout);
  const char* program = die_program ? die_program : "";
  const char* colon = die_program ? ": " : "";
  if (this_rank >= 0)
    std::fprintf(stderr, "%s%srank %d: %s: %s: %s\n", program, colon, this_rank, call, status, message);
  else
    std::fprintf(stderr, "%s%s%s: %s: %s\n", program, colon, call, status, message);
  std::fflush(stderr);
  std::_Exit(1);
}

// The ranks meet here (spinning: the wake-up must not skew their start by a scheduler's tick).
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    while (gen_.load(std::memory_order_acquire) == gen) std::this_thread::yield();
  }
  int generation() const { return gen_.load(std::memory_order_acquire); }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

}  // namespace fp8bench

// CHECK_FP8 and CHECK_CUDA for a rank's thread (or any thread while ranks run): fp8bench::die.
#define RCHECK_FP8(call)                                                                     \
  do {                                                                                       \
    const fp8_status_t s_ = (call);                                                          \
    if (s_ != FP8_OK) fp8bench::die(#call, fp8_status_string(s_), fp8_last_error_message()); \
  } while (0)
#define RCHECK_CUDA(call)                                                        \
  do {                                                                           \
    const cudaError_t e_ = (call);                                               \
    if (e_ != cudaSuccess) fp8bench::die(#call, "CUDA", cudaGetErrorString(e_)); \
  } while (0)

namespace fp8bench {

// The time in ms between events a and b recorded on `stream` before and after what `queue` queues
// there (waits for b). A failure ends the process at once (die).
template <class Queue>
float event_ms(cudaStream_t stream, cudaEvent_t a, cudaEvent_t b, const Queue& queue) {
  RCHECK_CUDA(cudaEventRecord(a, stream));
  queue();
  RCHECK_CUDA(cudaEventRecord(b, stream));
  RCHECK_CUDA(cudaEventSynchronize(b));
  float t = 0;
  RCHECK_CUDA(cudaEventElapsedTime(&t, a, b));
  return t;
}

// Median time in ms of `fn` over `reps` runs, each timed with CUDA events on `stream`. With
// batch > 1, each timed region queues `batch` calls back to back and the time is per call: the
// GPU's throughput without the host's launch latency between an event and the kernel.
inline double median_ms(cudaStream_t stream, const std::function<void(int)>& fn, int batch = 1, int warmup = 10,
                        int reps = 50) {
  for (int i = 0; i < warmup; ++i) fn(i);
  cudaEvent_t a, b;
  RCHECK_CUDA(cudaEventCreate(&a));
  RCHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i)
    ms.push_back(event_ms(stream, a, b,
                          [&] {
                            for (int k = 0; k < batch; ++k) fn(i * batch + k);
                          }) /
                 batch);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The device's copy bandwidth, the ceiling of the memory-bound kernels' figures: a device-to-device
// copy of 1 GiB on `stream`, in GB/s of bytes read plus bytes written (median_ms's timing).
inline double copy_bandwidth_gbps(cudaStream_t stream, double* ms_out = nullptr) {
  const size_t n = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  RCHECK_CUDA(cudaMalloc(&src, n));
  RCHECK_CUDA(cudaMalloc(&dst, n));
  RCHECK_CUDA(cudaMemset(src, 0x5A, n));
  const double ms = median_ms(stream, [&](int) { RCHECK_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream)); });
  cudaFree(src);
  cudaFree(dst);
  if (ms_out) *ms_out = ms;
  return 2.0 * static_cast<double>(n) / ms / 1e6;
}

// For the benchmarks that call kernels directly: device 0's name printed, a non-blocking stream
// on it and its SM count (the launchers' grid sizing).
struct KernelDevice {
  cudaStream_t stream = nullptr;
  int sms = 0;
};
inline KernelDevice open_kernel_device() {
  KernelDevice d;
  CHECK_CUDA(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  return d;
}

// One timed operation of a bandwidth table: its time and the GB/s of the bytes it must move.
struct BandwidthRow {
  std::string name;
  double ms, gbps;
};

// A bandwidth table's first row: the device-to-device copy of 1 GiB (the ceiling "of copy" counts against).
inline BandwidthRow copy_ceiling_row(cudaStream_t stream) {
  double ms = 0.0;
  const double gbps = copy_bandwidth_gbps(stream, &ms);
  return {"d2d copy 1 GiB", ms, gbps};
}

// Prints rows (rows[0] the copy ceiling) as a table headed by `title`.
inline void print_bandwidth_rows(const char* title, const std::vector<BandwidthRow>& rows) {
  std::printf("%-52s %10s %12s %9s\n", title, "ms", "GB/s", "of copy");
  for (const BandwidthRow& r : rows)
    std::printf("%-52s %10.4f %12.1f %8.1f%%\n", r.name.c_str(), r.ms, r.gbps, 100.0 * r.gbps / rows[0].gbps);
}

// Writes rows as comma-separated JSON objects {name, ms, gbps}, without the array's brackets (a
// caller may add rows of its own after them).
inline void json_bandwidth_rows(FILE* f, const std::vector<BandwidthRow>& rows) {
  for (size_t i = 0; i < rows.size(); ++i)
    std::fprintf(f, "%s  {\"name\": \"%s\", \"ms\": %.5f, \"gbps\": %.2f}", i ? ",\n" : "", rows[i].name.c_str(),
                 rows[i].ms, rows[i].gbps);
}

// Writes rows as a JSON array of {name, ms, gbps} to `path`.
inline void write_bandwidth_json(const char* path, const std::vector<BandwidthRow>& rows) {
  FILE* json = std::fopen(path, "w");
  std::fprintf(json, "[\n");
  json_bandwidth_rows(json, rows);
  std::fprintf(json, "\n]\n");
  std::fclose(json);
}

}  // namespace fp8bench
