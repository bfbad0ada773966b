// The host time of a layer call through the C API, as a framework binding makes it on its hot path
// (issue 15: "a layer call costs <= 10 us of host time in C"): the framework's buffers wrapped as
// tensors (fp8_tensor_wrap, no allocation, no synchronisation), fp8_layer_forward_saved or
// fp8_layer_backward_saved, the wrappers and the saved state destroyed. Layers: a Linear
// (1024 -> 1024, 256 rows, bf16 activations) converted with "backend=te, small_layer_fallback=0" (its
// GEMMs in FP8) and not converted (bf16), and a converted LayerNorm (1024). A converted layer's
// forward runs inside an autocast region of its own per step, as libfp8.torch runs a module's
// forward; the region's begin and end (the batched scaling update) are timed on their own.
//
// Timing: std::chrono::steady_clock around each group of calls, on the host only; the stream is
// synchronised every 8 steps outside the timed parts, so the launch queue never fills and a call's
// time is its own host work. Median and 90th percentile of 400 steps after 50 warm-ups. The results
// are checked once against the same layer's first call (finite, non-zero outputs and gradients).
// Usage: bench_host (no arguments; needs a CUDA GPU)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "core/format.hpp"
#include "fp8.h"

namespace {

constexpr int64_t kRows = 256, kDim = 1024;
constexpr int kWarm = 50, kSteps = 400, kSyncEvery = 8;

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

struct Stats {
  double median = 0, p90 = 0;
};
Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[v.size() * 9 / 10]};
}

fp8_tensor_t* wrap(fp8_context_t* ctx, void* data, int64_t rows, int64_t cols) {
  fp8_tensor_t* t = nullptr;
  const int64_t shape[2] = {rows, cols};
  CHECK_FP8(fp8_tensor_wrap(&t, ctx, FP8_DTYPE_BF16, 2, shape, data));
  return t;
}

// A bf16 buffer of the framework, rows x kDim: device memory with normal values.
void* device_bf16(fp8_context_t* ctx, int64_t rows, float sd, uint32_t seed) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, static_cast<size_t>(rows * kDim) * 2));
  fp8_tensor_t* t = wrap(ctx, p, rows, kDim);
  fp8bench::fill_normal(t, sd, seed);
  fp8_tensor_destroy(t);
  return p;
}

// Fails the program unless the bf16 buffer holds finite values, not all zero.
void check_values(const void* data, size_t count, const char* what) {
  std::vector<uint16_t> host(count);
  CHECK_CUDA(cudaMemcpy(host.data(), data, count * 2, cudaMemcpyDeviceToHost));
  bool nonzero = false;
  for (uint16_t h : host) {
    const float v = fp8::bf16_to_float(h);
    if (!std::isfinite(v)) {
      std::fprintf(stderr, "bench_host: %s holds a non-finite value\n", what);
      std::exit(3);
    }
    nonzero = nonzero || v != 0.0f;
  }
  if (!nonzero) {
    std::fprintf(stderr, "bench_host: %s is all zeros\n", what);
    std::exit(3);
  }
}

struct Row {
  std::string layer, call;
  Stats s;
};

// One layer's steps: region begin, forward (wrap x and y, forward_saved, destroy the wrappers),
// region end, backward (wrap dy and dx, backward_saved, destroy the wrappers and the state).
void run_layer(fp8_context_t* ctx, cudaStream_t stream, const char* label, const char* recipe_text, bool norm,
               std::vector<Row>& rows) {
  fp8_model_t* model = nullptr;
  CHECK_FP8(fp8_model_create(&model, ctx));
  int32_t id = -1;
  if (norm) {
    CHECK_FP8(fp8_model_add_layernorm(model, "ln", kDim, 1e-5f, &id));
  } else {
    CHECK_FP8(fp8_model_add_linear(model, "fc", kDim, kDim, 1, &id));
    fp8_tensor_t* w = nullptr;
    CHECK_FP8(fp8_model_parameter_at(model, 0, nullptr, &w, nullptr));
    fp8bench::fill_normal(w, 0.03f, 11);
  }
  if (recipe_text) {
    fp8_recipe_t* r = nullptr;
    CHECK_FP8(fp8_recipe_create(&r));
    CHECK_FP8(fp8_recipe_parse(r, recipe_text));
    CHECK_FP8(fp8_convert_model(model, r, nullptr));
    fp8_recipe_destroy(r);
  }
  const size_t n = static_cast<size_t>(kRows * kDim);
  void* x = device_bf16(ctx, kRows, 1.0f, 1);
  void* dy = device_bf16(ctx, kRows, 0.1f, 2);
  void *y = nullptr, *dx = nullptr;
  CHECK_CUDA(cudaMalloc(&y, n * 2));
  CHECK_CUDA(cudaMalloc(&dx, n * 2));
  std::vector<double> t_begin, t_fwd, t_end, t_bwd;
  for (int it = 0; it < kWarm + kSteps; ++it) {
    if (it % kSyncEvery == 0) CHECK_CUDA(cudaStreamSynchronize(stream));
    // (An unconverted model has no regions: fp8_autocast_begin refuses it.)
    Clock::time_point t0 = Clock::now();
    if (recipe_text) CHECK_FP8(fp8_autocast_begin(model));
    const double begin = us_since(t0);

    t0 = Clock::now();
    fp8_tensor_t* tx = wrap(ctx, x, kRows, kDim);
    fp8_tensor_t* ty = wrap(ctx, y, kRows, kDim);
    fp8_saved_t* saved = nullptr;
    CHECK_FP8(fp8_layer_forward_saved(model, id, tx, ty, &saved));
    fp8_tensor_destroy(ty);
    fp8_tensor_destroy(tx);
    const double fwd = us_since(t0);

    t0 = Clock::now();
    if (recipe_text) CHECK_FP8(fp8_autocast_end(model));
    const double end = us_since(t0);

    t0 = Clock::now();
    fp8_tensor_t* tdy = wrap(ctx, dy, kRows, kDim);
    fp8_tensor_t* tdx = wrap(ctx, dx, kRows, kDim);
    CHECK_FP8(fp8_layer_backward_saved(model, id, saved, tdy, tdx, 0));
    fp8_saved_destroy(saved);
    fp8_tensor_destroy(tdx);
    fp8_tensor_destroy(tdy);
    const double bwd = us_since(t0);

    if (it == 0) {  // (the outputs of a real call: timing a call that does nothing would say nothing)
      CHECK_CUDA(cudaStreamSynchronize(stream));
      check_values(y, n, "y");
      check_values(dx, n, "dx");
    }
    if (it >= kWarm) {
      t_begin.push_back(begin);
      t_fwd.push_back(fwd);
      t_end.push_back(end);
      t_bwd.push_back(bwd);
    }
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (recipe_text) rows.push_back({label, "autocast_begin", stats_of(t_begin)});
  rows.push_back({label, "forward (2 wraps, forward_saved, 2 destroys)", stats_of(t_fwd)});
  if (recipe_text) rows.push_back({label, "autocast_end (scaling update)", stats_of(t_end)});
  rows.push_back({label, "backward (2 wraps, backward_saved, 3 destroys)", stats_of(t_bwd)});
  CHECK_CUDA(cudaFree(x));
  CHECK_CUDA(cudaFree(y));
  CHECK_CUDA(cudaFree(dy));
  CHECK_CUDA(cudaFree(dx));
  fp8_model_destroy(model);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    std::fprintf(stderr, "bench_host: needs a CUDA GPU\n");
    return 1;
  }
  fp8_context_t* ctx = nullptr;
  CHECK_FP8(fp8_context_create(&ctx, 0));
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_FP8(fp8_context_set_stream(ctx, stream));
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  CHECK_FP8(fp8_device_query(0, &info));
  std::printf("host time per call, %s, %lld x %lld bf16 activations; median and p90 of %d steps\n", info.name,
              static_cast<long long>(kRows), static_cast<long long>(kDim), kSteps);

  std::vector<Row> rows;
  run_layer(ctx, stream, "Linear FP8 (te)", "backend=te, small_layer_fallback=0", false, rows);
  run_layer(ctx, stream, "Linear bf16", nullptr, false, rows);
  run_layer(ctx, stream, "LayerNorm (te)", "backend=te, small_layer_fallback=0", true, rows);

  std::printf("\n| layer | call | median us | p90 us |\n|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %.1f | %.1f |\n", r.layer.c_str(), r.call.c_str(), r.s.median, r.s.p90);
  CHECK_FP8(fp8_context_set_stream(ctx, nullptr));
  CHECK_CUDA(cudaStreamDestroy(stream));
  fp8_context_destroy(ctx);
  return 0;
}
