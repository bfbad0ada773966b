// What the GPU tests share: random inputs in any dtype, results read back as values, the normwise
// relative error used to compare GPU and CPU results that are not bit-exact, and device buffers
// that tensors wrap at an offset (misaligned data).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/format.hpp"
#include "fp8_test_util.hpp"

namespace fp8test {

inline std::vector<float> normal_floats(size_t n, uint32_t seed, float mean = 0.0f, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// The raw bytes of `v` in a wide dtype (rounded to nearest even).
inline std::vector<uint8_t> to_wide_bytes(fp8_dtype_t dt, const std::vector<float>& v) {
  std::vector<uint8_t> bytes(v.size() * fp8_dtype_size(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == FP8_DTYPE_F32) {
      std::memcpy(&bytes[i * 4], &v[i], 4);
    } else {
      const uint16_t h = dt == FP8_DTYPE_F16 ? fp8::float_to_f16(v[i]) : fp8::float_to_bf16(v[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  return bytes;
}

// A tensor's contents as values: wide dtypes widened, FP8 decoded and multiplied by its scale_inv.
inline std::vector<double> values(const fp8_tensor_t* t) {
  fp8_dtype_t dt = 0;
  fp8_tensor_dtype(t, &dt);
  std::vector<double> v;
  if (dt == FP8_DTYPE_F32) {
    for (float x : download<float>(t)) v.push_back(x);
  } else if (dt == FP8_DTYPE_F16 || dt == FP8_DTYPE_BF16) {
    for (uint16_t x : download<uint16_t>(t)) v.push_back(dt == FP8_DTYPE_F16 ? fp8::f16_to_float(x) : fp8::bf16_to_float(x));
  } else {
    float si = 0;
    EXPECT_EQ(fp8_tensor_get_scale_inv(t, &si), FP8_OK);
    for (uint8_t x : download<uint8_t>(t)) v.push_back(static_cast<double>(fp8_decode(x, dt)) * si);
  }
  return v;
}

inline double norm2(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// ||got - want|| / max(||want||, floor). NaN must match NaN; any other non-finite value fails.
// `floor` is the size of the terms that cancel, for results that are mathematically (near) zero.
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want, double floor = 0) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) return INFINITY;
    if (std::isnan(want[i])) continue;
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  den = std::max(std::sqrt(den), floor);
  return den > 0 ? std::sqrt(num) / den : std::sqrt(num);
}

// A device buffer of its own, optionally offset so the data is not 16-byte aligned.
struct DeviceBuffer {
  void* base = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&base, bytes + 64), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(base); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* at(size_t offset) const { return static_cast<char*>(base) + offset; }
};

// A tensor over `data` (not owned).
inline Tensor wrap(fp8_context_t* ctx, fp8_dtype_t dt, const std::vector<int64_t>& shape, void* data) {
  fp8_tensor_t* t = nullptr;
  EXPECT_EQ(fp8_tensor_wrap(&t, ctx, dt, static_cast<int32_t>(shape.size()), shape.data(), data), FP8_OK)
      << fp8_last_error_message();
  return Tensor(t);
}

}  // namespace fp8test
