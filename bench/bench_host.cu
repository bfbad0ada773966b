// The host time of a layer call through the C API, as a framework binding makes it on its hot path
// (issue 15: "a layer call costs <= 10 us of host time in C"): the framework's buffers wrapped as
// tensors (fp8_tensor_wrap, no allocation, no synchronisation), fp8_layer_forward_saved or
// fp8_layer_backward_saved, the wrappers and the saved state destroyed. Layers: a Linear
// (1024 -> 1024, 256 rows, bf16 activations) converted with "backend=te, small_layer_fallback=0" (its
// GEMMs in FP8) and not converted (bf16), and a converted LayerNorm (1024). A converted layer's
// forward runs inside an autocast region of its own per step, as libfp8.torch runs a module's
// forward; the region's begin and end (the batched scaling update) are timed on their own.
//
// A call's host time is mostly the CUDA launches it makes, which no library can make cheaper; the
// floors are timed in the same run the same way: an empty kernel's launch, cuBLASLt's matmul call
// with its descriptors and algorithm made beforehand (FP8 and bf16, the Linear's shape), and a
// bf16 tensor's wrap and destroy. `--trace` runs two steps per layer and prints a marker line before
// each call of the second: under `ncu`, whose "==PROF==" lines name each kernel as it launches, it
// lists the kernels every call launches.
//
// Timing: std::chrono::steady_clock around each group of calls, on the host only; the stream is
// synchronised every 8 steps outside the timed parts, so the launch queue never fills and a call's
// time is its own host work. Median and 90th percentile of 400 steps after 50 warm-ups. The results
// are checked once against the same layer's first call (finite, non-zero outputs and gradients).
// Usage: bench_host [--trace] (needs a CUDA GPU)
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "core/format.hpp"
#include "fp8.h"

namespace {

constexpr int64_t kRows = 256, kDim = 1024;
int kWarm = 50, kSteps = 400;  // (--trace: 1 and 1)
constexpr int kSyncEvery = 8;
bool trace = false;

// --trace: a marker line before each call of the last step, flushed so that it lands in order with
// ncu's lines.
void mark(bool last_step, const char* layer, const char* call) {
  if (!trace || !last_step) return;
  std::printf("trace: %s: %s\n", layer, call);
  std::fflush(stdout);
}

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
    const bool last = it == kWarm + kSteps - 1;
    // The host time of one call, with the marker that --trace prints before it.
    const auto timed = [&](const char* call, auto&& fn) {
      mark(last, label, call);
      const Clock::time_point t0 = Clock::now();
      fn();
      return us_since(t0);
    };
    fp8_saved_t* saved = nullptr;
    const double begin = timed("autocast_begin", [&] {  // (an unconverted model has no regions)
      if (recipe_text) CHECK_FP8(fp8_autocast_begin(model));
    });
    const double fwd = timed("forward", [&] {
      fp8_tensor_t* tx = wrap(ctx, x, kRows, kDim);
      fp8_tensor_t* ty = wrap(ctx, y, kRows, kDim);
      CHECK_FP8(fp8_layer_forward_saved(model, id, tx, ty, &saved));
      fp8_tensor_destroy(ty);
      fp8_tensor_destroy(tx);
    });
    const double end = timed("autocast_end", [&] {
      if (recipe_text) CHECK_FP8(fp8_autocast_end(model));
    });
    const double bwd = timed("backward", [&] {
      fp8_tensor_t* tdy = wrap(ctx, dy, kRows, kDim);
      fp8_tensor_t* tdx = wrap(ctx, dx, kRows, kDim);
      CHECK_FP8(fp8_layer_backward_saved(model, id, saved, tdy, tdx, 0));
      fp8_saved_destroy(saved);
      fp8_tensor_destroy(tdx);
      fp8_tensor_destroy(tdy);
    });

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
  mark(true, label, "(end)");
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

#define CHECK_CUBLAS(call)                                                  \
  do {                                                                      \
    cublasStatus_t s_ = (call);                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                      \
      std::fprintf(stderr, "%s: %s\n", #call, cublasLtGetStatusString(s_)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

__global__ void empty_kernel() {}

// The host time of `call` over the steps, timed as the layers' calls are.
template <typename Call>
Stats time_host(cudaStream_t stream, Call&& call) {
  std::vector<double> t;
  for (int it = 0; it < kWarm + kSteps; ++it) {
    if (it % kSyncEvery == 0) CHECK_CUDA(cudaStreamSynchronize(stream));
    const Clock::time_point t0 = Clock::now();
    call();
    const double us = us_since(t0);
    if (it >= kWarm) t.push_back(us);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  return stats_of(t);
}

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof value));
}

// cuBLASLt's matmul call alone for y[kRows][kDim] = x[kRows][kDim] W[kDim][kDim]^T, E4M3 (unit scales,
// fast accumulation) or bf16 in, bf16 out, its descriptors and algorithm made beforehand as libfp8
// keeps them: the floor of a GEMM's host time. The operands hold 0x38 bytes (E4M3 1.0; bf16 1.1e-5).
Stats cublaslt_floor(cudaStream_t stream, bool fp8_in) {
  const cudaDataType_t in = fp8_in ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  const size_t elem = fp8_in ? 1 : 2, ws_bytes = size_t{32} << 20;
  void *a = nullptr, *b = nullptr, *d = nullptr, *ws = nullptr;
  float* one = nullptr;
  CHECK_CUDA(cudaMalloc(&a, kRows * kDim * elem));
  CHECK_CUDA(cudaMalloc(&b, kDim * kDim * elem));
  CHECK_CUDA(cudaMalloc(&d, kRows * kDim * 2));
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_CUDA(cudaMalloc(&one, sizeof(float)));
  CHECK_CUDA(cudaMemset(a, 0x38, kRows * kDim * elem));
  CHECK_CUDA(cudaMemset(b, 0x38, kDim * kDim * elem));
  const float host_one = 1.0f, alpha = 1.0f, beta = 0.0f;
  CHECK_CUDA(cudaMemcpy(one, &host_one, sizeof host_one, cudaMemcpyHostToDevice));
  cublasLtHandle_t handle = nullptr;
  CHECK_CUBLAS(cublasLtCreate(&handle));
  cublasLtMatmulDesc_t desc = nullptr;
  CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  if (fp8_in) {
    set_attribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(one));
    set_attribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(one));
    set_attribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(1));
  }
  // Column-major, as cuBLASLt sees row-major data: D'(n x m) = (W' (k x n))^T x' (k x m).
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&la, in, kDim, kDim, kDim));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lb, in, kDim, kRows, kDim));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, kDim, kRows, kDim));
  cublasLtMatmulPreference_t pref = nullptr;
  CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  CHECK_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, &result, &found));
  if (found == 0) {
    std::fprintf(stderr, "bench_host: cuBLASLt has no algorithm for the floor's GEMM\n");
    std::exit(1);
  }
  const Stats s = time_host(stream, [&] {
    CHECK_CUBLAS(
        cublasLtMatmul(handle, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &result.algo, ws, ws_bytes, stream));
  });
  check_values(d, static_cast<size_t>(kRows * kDim), "the floor GEMM's y");
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(handle);
  for (void* p : {a, b, d, ws, static_cast<void*>(one)}) CHECK_CUDA(cudaFree(p));
  return s;
}

// The floors of the layers' calls (see the top): rows of layer "floor".
void time_floors(fp8_context_t* ctx, cudaStream_t stream, std::vector<Row>& rows) {
  rows.push_back({"floor", "empty kernel launch", time_host(stream, [&] { empty_kernel<<<1, 32, 0, stream>>>(); })});
  CHECK_CUDA(cudaGetLastError());
  rows.push_back({"floor", "cublasLtMatmul E4M3 -> bf16, plan made", cublaslt_floor(stream, true)});
  rows.push_back({"floor", "cublasLtMatmul bf16 -> bf16, plan made", cublaslt_floor(stream, false)});
  void* x = device_bf16(ctx, kRows, 1.0f, 3);
  rows.push_back({"floor", "fp8_tensor_wrap + fp8_tensor_destroy (bf16)",
                  time_host(stream, [&] { fp8_tensor_destroy(wrap(ctx, x, kRows, kDim)); })});
  CHECK_CUDA(cudaFree(x));
}
}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--trace") != 0) {
      std::fprintf(stderr, "bench_host: unknown argument '%s'; usage: bench_host [--trace]\n", argv[i]);
      return 2;
    }
    trace = true;
    kWarm = kSteps = 1;
  }
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
  if (!trace) time_floors(ctx, stream, rows);

  std::printf("\n| layer | call | median us | p90 us |\n|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %.1f | %.1f |\n", r.layer.c_str(), r.call.c_str(), r.s.median, r.s.p90);
  CHECK_FP8(fp8_context_set_stream(ctx, nullptr));
  CHECK_CUDA(cudaStreamDestroy(stream));
  fp8_context_destroy(ctx);
  return 0;
}
