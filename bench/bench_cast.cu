// The cast + transpose + amax kernel (kernels/cast/cast_transpose.cu) called directly, in the forms
// the 1b GPT preset's step runs (8192 tokens, d = 2048, MLP 8192): the x casts (plain and with the
// GELU folded in), the dy casts with the bias gradient (plain bf16 and f32, and with GELU's
// backward folded in) and the weights' grouped F16 copies. "of copy" counts the bytes the cast must
// move (inputs read once, both FP8 layouts written once) against a device-to-device copy of the
// same run. Bit-exactness against the CPU reference is tests/gpu/gpu_casts' and gpu_layers' job.
// Usage: bench_cast [out.json]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/jobs.hpp"
#include "bench/bench_util.hpp"
#include "core/scaling_rule.hpp"
#include "kernels/launch.hpp"

using fp8bench::median_ms;

namespace {

// Device buffers that live until the end of the program.
template <typename T>
T* device_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return static_cast<T*>(p);
}

// n values of a normal-like spread (sums of hashed uniforms; never all zeros) in `dt`'s layout.
void* random_input(fp8_dtype_t dt, int64_t n, uint32_t seed) {
  const size_t width = dt == FP8_DTYPE_F32 ? 4 : 2;
  std::vector<uint8_t> host(static_cast<size_t>(n) * width);
  uint32_t h = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    float v = -2.0f;
    for (int k = 0; k < 4; ++k) {
      h ^= h << 13, h ^= h >> 17, h ^= h << 5;
      v += static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    }
    if (dt == FP8_DTYPE_F32) {
      std::memcpy(&host[static_cast<size_t>(i) * 4], &v, 4);
    } else {
      const uint16_t b = dt == FP8_DTYPE_BF16 ? fp8::float_to_bf16(v) : fp8::float_to_f16(v);
      std::memcpy(&host[static_cast<size_t>(i) * 2], &b, 2);
    }
  }
  void* d = device_alloc<void>(host.size());
  CHECK_CUDA(cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice));
  return d;
}

// A delayed-scaling state (header + 16 history slots) with the given scale.
fp8::ScalingHeader* scaling_state(float scale) {
  std::vector<uint8_t> host(sizeof(fp8::ScalingHeader) + 16 * sizeof(float), 0);
  fp8::ScalingHeader h{};
  h.scale = scale;
  h.scale_inv = 1.0f / scale;
  std::memcpy(host.data(), &h, sizeof h);
  auto* d = device_alloc<fp8::ScalingHeader>(host.size());
  CHECK_CUDA(cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice));
  return d;
}

// The job for one [rows, cols] cast of `dt` with both layouts written.
fp8::QuantizeJob cast_job(fp8_dtype_t dt, int64_t rows, int64_t cols, bool e5m2, uint32_t seed) {
  fp8::QuantizeJob j{};
  j.in = random_input(dt, rows * cols, seed);
  j.in_dtype = dt;
  j.rows = rows;
  j.cols = cols;
  j.out = device_alloc<uint8_t>(static_cast<size_t>(rows * cols));
  j.out_t = device_alloc<uint8_t>(static_cast<size_t>(rows * cols));
  j.e5m2 = e5m2;
  j.state = scaling_state(e5m2 ? 256.0f : 32.0f);
  float* scales = device_alloc<float>(2 * sizeof(float));
  j.out_scale_inv = fp8::tensor_scale(scales);
  j.out_t_scale_inv = fp8::tensor_scale(scales + 1);
  return j;
}

void with_bias_gradient(fp8::QuantizeJob& j) {
  j.dbias = device_alloc<float>(static_cast<size_t>(j.cols) * sizeof(float));
  j.dbias_partials = device_alloc<float>(static_cast<size_t>(fp8::bias_grad_partials(j.rows, j.cols)) * sizeof(float));
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "bench_cast.json";
  const fp8bench::KernelDevice dev = fp8bench::open_kernel_device();
  cudaStream_t stream = dev.stream;
  const int sms = dev.sms;
  const fp8::kernels::LaunchLimits lim{0, sms};
  std::vector<fp8bench::BandwidthRow> rows{fp8bench::copy_ceiling_row(stream)};
  const int64_t tokens = 8192, d = 2048, hidden = 8192;
  // One cast: bytes per element = the input's width (+ act_x's) + 2 FP8 layouts.
  auto time_cast = [&](const std::string& name, const fp8::QuantizeJob& j) {
    const double width = j.in_dtype == FP8_DTYPE_F32 ? 4.0 : 2.0;
    const double bytes = static_cast<double>(j.rows * j.cols) * (width * (j.act_x ? 2.0 : 1.0) + 2.0);
    const double ms = median_ms(
        stream, [&](int) { fp8::kernels::cast_transpose(j, lim, stream); }, 20);
    rows.push_back({name, ms, bytes / ms / 1e6});
  };
  {
    fp8::QuantizeJob x = cast_job(FP8_DTYPE_BF16, tokens, hidden, false, 1);
    time_cast("x bf16 8192x8192 (fc2 without the fold)", x);
    x.act_forward = true;
    time_cast("x = GELU(h) bf16 8192x8192 (fc2)", x);
  }
  time_cast("x bf16 8192x2048 (proj)", cast_job(FP8_DTYPE_BF16, tokens, d, false, 2));
  {
    fp8::QuantizeJob dy = cast_job(FP8_DTYPE_BF16, tokens, hidden, true, 3);
    with_bias_gradient(dy);
    time_cast("dy bf16 8192x8192 +dbias (fc1 without the fold)", dy);
    dy.act_x = random_input(FP8_DTYPE_BF16, tokens * hidden, 4);
    time_cast("dy = dGELU(h) * g bf16 8192x8192 +dbias (fc1)", dy);
  }
  {
    fp8::QuantizeJob dy = cast_job(FP8_DTYPE_BF16, tokens, 3 * d, true, 5);
    with_bias_gradient(dy);
    time_cast("dy bf16 8192x6144 +dbias (qkv)", dy);
  }
  {
    fp8::QuantizeJob dy = cast_job(FP8_DTYPE_F32, tokens, d, true, 6);
    with_bias_gradient(dy);
    time_cast("dy f32 8192x2048 +dbias (proj, fc2)", dy);
  }
  {  // the weights' FP8 copies at O2: 16 blocks x (qkv, proj, fc1, fc2), F16, one grouped launch
    std::vector<fp8::QuantizeJob> w;
    double bytes = 0.0;
    for (int layer = 0; layer < 16; ++layer)
      for (auto [r, c] : {std::pair{3 * d, d}, std::pair{d, d}, std::pair{hidden, d}, std::pair{d, hidden}}) {
        w.push_back(cast_job(FP8_DTYPE_F16, r, c, false, 100 + static_cast<uint32_t>(w.size())));
        bytes += static_cast<double>(r * c) * 4.0;
      }
    const double ms = median_ms(
        stream, [&](int) { fp8::kernels::cast_transpose_group(w.data(), w.size(), lim, stream); }, 5);
    rows.push_back({"weights f16, 64 tensors grouped (805M values)", ms, bytes / ms / 1e6});
  }
  fp8bench::print_bandwidth_rows("cast + transpose + amax", rows);
  fp8bench::write_bandwidth_json(json_path, rows);
  return 0;
}
