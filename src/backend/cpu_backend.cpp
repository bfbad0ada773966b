// The CPU reference backend: plain loops that define the right answer for every operation.
// Simplicity over speed; the CUDA backend must reproduce these results bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "backend/backend.hpp"
#include "core/activation.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/format.hpp"

namespace fp8 {

namespace {

float load_wide(const void* p, fp8_dtype_t dt, int64_t i) {
  switch (dt) {
    case FP8_DTYPE_F32: return static_cast<const float*>(p)[i];
    case FP8_DTYPE_F16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

void store_wide(void* p, fp8_dtype_t dt, int64_t i, float v) {
  switch (dt) {
    case FP8_DTYPE_F32: static_cast<float*>(p)[i] = v; break;
    case FP8_DTYPE_F16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
  }
}

// An operand element: FP8 decoded, wide types widened.
double load_operand(const void* p, fp8_dtype_t dt, int64_t i) {
  if (dtype_is_fp8(dt)) return decode_fp8(static_cast<const uint8_t*>(p)[i], dt == FP8_DTYPE_E5M2);
  return load_wide(p, dt, i);
}

// dbias[c] += sum over rows of in[r][c], summed in double.
void add_column_sums(const void* in, fp8_dtype_t dt, int64_t rows, int64_t cols, float* dbias) {
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += load_wide(in, dt, r * cols + c);
    dbias[c] = static_cast<float>(dbias[c] + sum);
  }
}

void max_into(float* slot, uint32_t abs) {
  if (abs > float_bits(*slot)) *slot = bits_float(abs);
}

class CpuBackend final : public Backend {
 public:
  int32_t device() const override { return FP8_DEVICE_CPU; }

  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) fail(FP8_ERR_OUT_OF_MEMORY, "could not allocate ", bytes, " bytes of host memory");
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void check_device_pointer(const void*, const char*) const override {}

  void set_stream(CUstream_st* stream) override {
    if (stream != nullptr)
      fail(FP8_ERR_INVALID_ARGUMENT, "stream must be NULL on the CPU backend (device FP8_DEVICE_CPU)");
  }
  CUstream_st* stream() const override { return nullptr; }
  void synchronize() override {}

  void quantize(const QuantizeJob& j) override {
    const float scale = j.state->scale;
    uint32_t amax = 0;
    for (int64_t r = 0; r < j.rows; ++r) {
      for (int64_t c = 0; c < j.cols; ++c) {
        const float x = load_wide(j.in, j.in_dtype, r * j.cols + c);
        amax = std::max(amax, abs_bits(x));
        const uint8_t q = encode_fp8(x * scale, j.e5m2);
        j.out[r * j.cols + c] = q;
        if (j.out_t_scale_inv) j.out_t[c * j.rows + r] = q;
      }
    }
    max_into(scaling_history(j.state), amax);
    *j.out_scale_inv = j.state->scale_inv;
    if (j.out_t_scale_inv) *j.out_t_scale_inv = j.state->scale_inv;
    if (j.dbias) add_column_sums(j.in, j.in_dtype, j.rows, j.cols, j.dbias);
  }

  void bias_grad(const BiasGradJob& j) override { add_column_sums(j.dy, j.dtype, j.rows, j.cols, j.dbias); }

  void convert(const ConvertJob& j) override {
    for (int64_t i = 0; i < j.n; ++i) store_wide(j.out, j.out_dtype, i, load_wide(j.in, j.in_dtype, i));
  }

  void transpose(const TransposeJob& j) override {
    for (int64_t r = 0; r < j.rows; ++r)
      for (int64_t c = 0; c < j.cols; ++c) j.out[c * j.rows + r] = j.in[r * j.cols + c];
    *j.out_scale_inv = *j.in_scale_inv;
  }

  void zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }

  void optimizer_step(const OptimizerStepJob& j) override { cpu_optimizer_step(j); }

  void dequantize(const DequantizeJob& j) override {
    const float scale_inv = *j.scale_inv;
    for (int64_t i = 0; i < j.n; ++i) store_wide(j.out, j.out_dtype, i, dequantize_fp8(j.in[i], j.e5m2, scale_inv));
  }

  void amax(const AmaxJob& j) override {
    uint32_t amax = 0;
    for (int64_t i = 0; i < j.n; ++i) amax = std::max(amax, abs_bits(load_wide(j.in, j.dtype, i)));
    *j.out = bits_float(amax);
    if (j.accumulate) max_into(j.accumulate, amax);
  }

  void scaling_update(const ScalingUpdateJob& j) override {
    for (int32_t s = 0; s < j.count; ++s) {
      const ScalingUpdateItem& item = j.items[s];
      ScalingHeader* h = item.state;
      float* hist = scaling_history(h);
      if (!is_finite_bits(abs_bits(hist[0]))) {
        ++h->nonfinite_count;
        hist[0] = 0.0f;
      }
      uint32_t a = float_bits(hist[0]);
      if (j.algo_max)
        for (int32_t k = 1; k < j.history_len; ++k) a = std::max(a, float_bits(hist[k]));
      if (scaling_recomputes(h->update_count, j.interval)) {
        h->scale = next_scale(bits_float(a), item.fp8_max_scaled, h->scale);
        h->scale_inv = 1.0f / h->scale;
      }
      ++h->update_count;
      for (int32_t k = j.history_len - 1; k > 0; --k) hist[k] = hist[k - 1];
      hist[0] = 0.0f;
    }
  }

  void activation(const ActivationJob& j) override {
    const bool fp8_out = j.out_state != nullptr;
    const float scale = fp8_out ? j.out_state->scale : 1.0f;
    uint32_t amax = 0;
    auto put = [&](int64_t i, float v) {
      if (fp8_out) {
        amax = std::max(amax, abs_bits(v));
        static_cast<uint8_t*>(j.out)[i] = encode_fp8(v * scale, j.out_dtype == FP8_DTYPE_E5M2);
      } else {
        store_wide(j.out, j.out_dtype, i, v);
      }
    };
    const int64_t half = j.cols / 2;
    for (int64_t r = 0; r < j.rows; ++r) {
      if (j.act == FP8_ACTIVATION_SWIGLU) {
        for (int64_t c = 0; c < half; ++c) {
          const float a = load_wide(j.x, j.x_dtype, r * j.cols + c), b = load_wide(j.x, j.x_dtype, r * j.cols + half + c);
          if (!j.backward) {
            put(r * half + c, swiglu(a, b));
          } else {
            const float dy = load_wide(j.dy, j.x_dtype, r * half + c);
            put(r * j.cols + c, swiglu_grad_a(a, b, dy));
            put(r * j.cols + half + c, swiglu_grad_b(a, dy));
          }
        }
        continue;
      }
      for (int64_t c = 0; c < j.cols; ++c) {
        const int64_t i = r * j.cols + c;
        const float x = load_wide(j.x, j.x_dtype, i);
        if (!j.backward) {
          put(i, j.act == FP8_ACTIVATION_RELU ? relu(x) : gelu(x));
        } else {
          const float dy = load_wide(j.dy, j.x_dtype, i);
          put(i, j.act == FP8_ACTIVATION_RELU ? relu_grad(x, dy) : gelu_grad(x, dy));
        }
      }
    }
    if (fp8_out) {
      max_into(scaling_history(j.out_state), amax);
      *j.out_scale_inv = j.out_state->scale_inv;
    }
  }

  void norm(const NormJob& j) override {
    const int64_t d = j.cols;
    if (!j.backward) {
      const bool fp8_out = j.y_state != nullptr;
      const float scale = fp8_out ? j.y_state->scale : 1.0f;
      uint32_t amax = 0;
      for (int64_t r = 0; r < j.rows; ++r) {
        double mean = 0, sq = 0;
        for (int64_t c = 0; c < d; ++c) mean += load_wide(j.x, j.x_dtype, r * d + c);
        mean = j.rms ? 0.0 : mean / static_cast<double>(d);
        for (int64_t c = 0; c < d; ++c) {
          const double v = load_wide(j.x, j.x_dtype, r * d + c) - mean;
          sq += v * v;
        }
        const float rstd = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(d) + j.eps));
        if (j.mean) j.mean[r] = static_cast<float>(mean);
        if (j.rstd) j.rstd[r] = rstd;
        for (int64_t c = 0; c < d; ++c) {
          const double xhat = (load_wide(j.x, j.x_dtype, r * d + c) - mean) * rstd;
          const float y = static_cast<float>(xhat * j.gamma[c] + (j.beta ? j.beta[c] : 0.0f));
          if (fp8_out) {
            amax = std::max(amax, abs_bits(y));
            static_cast<uint8_t*>(j.y)[r * d + c] = encode_fp8(y * scale, j.y_dtype == FP8_DTYPE_E5M2);
          } else {
            store_wide(j.y, j.y_dtype, r * d + c, y);
          }
        }
      }
      if (fp8_out) {
        max_into(scaling_history(j.y_state), amax);
        *j.y_scale_inv = j.y_state->scale_inv;
      }
      return;
    }
    std::vector<double> dgamma(static_cast<size_t>(d), 0.0), dbeta(static_cast<size_t>(d), 0.0);
    for (int64_t r = 0; r < j.rows; ++r) {
      const double mean = j.rms ? 0.0 : j.mean[r], rstd = j.rstd[r];
      double mean_g = 0, mean_gx = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double xhat = (load_wide(j.x, j.x_dtype, r * d + c) - mean) * rstd;
        const double dy = load_wide(j.dy, j.dy_dtype, r * d + c);
        const double g = dy * j.gamma[c];
        mean_g += g;
        mean_gx += g * xhat;
        dgamma[static_cast<size_t>(c)] += dy * xhat;
        dbeta[static_cast<size_t>(c)] += dy;
      }
      mean_g = j.rms ? 0.0 : mean_g / static_cast<double>(d);
      mean_gx /= static_cast<double>(d);
      for (int64_t c = 0; c < d; ++c) {
        const double xhat = (load_wide(j.x, j.x_dtype, r * d + c) - mean) * rstd;
        const double g = load_wide(j.dy, j.dy_dtype, r * d + c) * j.gamma[c];
        store_wide(j.dx, j.dx_dtype, r * d + c, static_cast<float>(rstd * (g - mean_g - xhat * mean_gx)));
      }
    }
    for (int64_t c = 0; c < d; ++c) {
      const size_t i = static_cast<size_t>(c);
      j.dgamma[c] = static_cast<float>(j.accumulate_params ? j.dgamma[c] + dgamma[i] : dgamma[i]);
      if (j.dbeta) j.dbeta[c] = static_cast<float>(j.accumulate_params ? j.dbeta[c] + dbeta[i] : dbeta[i]);
    }
  }

  void gemm(const GemmJob& j) override {
    // Operands widened once to double; the sum is exact enough to be the reference for cuBLASLt.
    // Stored [k][m] / [k][n] when transposed; gathered here into [m][k] / [n][k].
    std::vector<double> a(static_cast<size_t>(j.m * j.k)), b(static_cast<size_t>(j.n * j.k));
    for (int64_t r = 0; r < j.m; ++r)
      for (int64_t k = 0; k < j.k; ++k)
        a[static_cast<size_t>(r * j.k + k)] = load_operand(j.a, j.a_dtype, j.a_transposed ? k * j.m + r : r * j.k + k);
    for (int64_t c = 0; c < j.n; ++c)
      for (int64_t k = 0; k < j.k; ++k)
        b[static_cast<size_t>(c * j.k + k)] = load_operand(j.b, j.b_dtype, j.b_transposed ? k * j.n + c : c * j.k + k);
    const double scale = static_cast<double>(j.alpha) * (j.a_scale_inv ? *j.a_scale_inv : 1.0f) *
                         (j.b_scale_inv ? *j.b_scale_inv : 1.0f);
    const bool fp8_out = j.d_state != nullptr;
    const float d_scale = fp8_out ? j.d_state->scale : 1.0f;
    uint32_t amax = 0;
    for (int64_t r = 0; r < j.m; ++r) {
      for (int64_t c = 0; c < j.n; ++c) {
        double acc = 0.0;
        const double* ar = &a[static_cast<size_t>(r * j.k)];
        const double* bc = &b[static_cast<size_t>(c * j.k)];
        for (int64_t k = 0; k < j.k; ++k) acc += ar[k] * bc[k];
        double v = scale * acc;
        if (j.bias) v += load_wide(j.bias, j.bias_dtype, c);
        const int64_t i = r * j.n + c;
        if (j.accumulate) v += load_wide(j.d, j.d_dtype, i);
        const float value = static_cast<float>(v);
        if (fp8_out) {
          amax = std::max(amax, abs_bits(value));
          static_cast<uint8_t*>(j.d)[i] = encode_fp8(value * d_scale, j.d_dtype == FP8_DTYPE_E5M2);
        } else {
          store_wide(j.d, j.d_dtype, i, value);
        }
      }
    }
    if (fp8_out) {
      max_into(scaling_history(j.d_state), amax);
      *j.d_scale_inv = j.d_state->scale_inv;
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace fp8
