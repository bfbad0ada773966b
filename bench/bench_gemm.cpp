// FP8 and BF16 GEMM through fp8_gemm (cuBLASLt) at the shapes of ../shared/PERFORMANCE.md.
// Each result is first checked on sampled entries against a float64 computation on the host.
// Usage: bench_gemm [out.json]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/format.hpp"
#include "bench/bench_util.hpp"
#include "fp8.h"

namespace {

struct Matrix {
  fp8_tensor_t* t = nullptr;
  std::vector<uint16_t> raw;  // bf16 bits or FP8 codes, as uploaded
};

Matrix random_matrix(fp8_context_t* ctx, fp8_dtype_t dt, int64_t rows, int64_t cols, uint32_t seed) {
  Matrix mat;
  const int64_t shape[2] = {rows, cols};
  CHECK_FP8(fp8_tensor_create(&mat.t, ctx, dt, 2, shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  mat.raw.resize(static_cast<size_t>(rows * cols));
  if (dt == FP8_DTYPE_BF16) {
    for (auto& h : mat.raw) h = fp8::float_to_bf16(normal(rng));
    CHECK_FP8(fp8_tensor_copy_from_host(mat.t, mat.raw.data(), mat.raw.size() * 2));
  } else {
    std::vector<uint8_t> codes(mat.raw.size());
    for (size_t i = 0; i < codes.size(); ++i) mat.raw[i] = codes[i] = fp8::encode_fp8(normal(rng) * 16.0f, false);
    CHECK_FP8(fp8_tensor_copy_from_host(mat.t, codes.data(), codes.size()));
    CHECK_FP8(fp8_tensor_set_scale_inv(mat.t, 1.0f / 16.0f));
  }
  return mat;
}

double element(const Matrix& mat, fp8_dtype_t dt, size_t i) {
  return dt == FP8_DTYPE_BF16 ? fp8::bf16_to_float(mat.raw[i]) : fp8::decode_fp8(static_cast<uint8_t>(mat.raw[i]), false) / 16.0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "bench_gemm.json";
  fp8_context_t* ctx = nullptr;
  CHECK_FP8(fp8_context_create(&ctx, 0));
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  CHECK_FP8(fp8_context_set_stream(ctx, stream));
  FILE* json = std::fopen(json_path, "w");
  std::fprintf(json, "[\n");
  bool first = true;
  std::printf("%-44s %10s %10s %10s\n", "libfp8 gemm (m x n x k)", "ms", "TFLOP/s", "rel.err");
  const int64_t shapes[][3] = {{8192, 8192, 8192}, {16384, 14336, 4096}, {16384, 4096, 14336}, {4096, 4096, 4096},
                               {16384, 4096, 4096}, {1024, 1024, 1024}};
  for (const auto& s : shapes) {
    const int64_t m = s[0], n = s[1], k = s[2];
    for (int variant = 0; variant < 3; ++variant) {
      const fp8_dtype_t in_dt = variant == 2 ? FP8_DTYPE_BF16 : FP8_DTYPE_E4M3;
      const bool fast = variant == 0;
      const std::string name = std::string(variant == 2 ? "bf16" : fast ? "fp8 e4m3 fast_accum" : "fp8 e4m3") + " " +
                               std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
      Matrix a = random_matrix(ctx, in_dt, m, k, 1), b = random_matrix(ctx, in_dt, n, k, 2);
      fp8_tensor_t* d = nullptr;
      const int64_t dshape[2] = {m, n};
      CHECK_FP8(fp8_tensor_create(&d, ctx, FP8_DTYPE_BF16, 2, dshape));
      fp8_gemm_options_t opts;
      fp8_gemm_options_init(&opts);
      opts.fast_accumulation = fast;
      auto run = [&] { CHECK_FP8(fp8_gemm(ctx, a.t, b.t, nullptr, d, nullptr, &opts)); };
      run();
      // Check 256 sampled entries against float64.
      std::vector<uint16_t> out(static_cast<size_t>(m * n));
      CHECK_FP8(fp8_tensor_copy_to_host(d, out.data(), out.size() * 2));
      std::mt19937_64 rng(7);
      double num = 0, den = 0;
      for (int i = 0; i < 256; ++i) {
        const int64_t r = static_cast<int64_t>(rng() % m), c = static_cast<int64_t>(rng() % n);
        double acc = 0;
        for (int64_t x = 0; x < k; ++x)
          acc += element(a, in_dt, static_cast<size_t>(r * k + x)) * element(b, in_dt, static_cast<size_t>(c * k + x));
        const double got = fp8::bf16_to_float(out[static_cast<size_t>(r * n + c)]);
        num += (got - acc) * (got - acc);
        den += acc * acc;
      }
      const double rel = std::sqrt(num / den);
      if (!(rel < 1e-2)) {
        std::fprintf(stderr, "%s: relative error %.3e against float64\n", name.c_str(), rel);
        return 1;
      }
      const double med = fp8bench::median_ms(stream, [&](int) { run(); }, 1, 3, 20);
      const double tflops = 2.0 * m * n * k / med / 1e9;
      std::printf("%-44s %10.4f %10.1f %10.2e\n", name.c_str(), med, tflops, rel);
      std::fprintf(json, "%s  {\"name\": \"%s\", \"ms\": %.5f, \"tflops\": %.2f}", first ? "" : ",\n", name.c_str(), med, tflops);
      first = false;
      fp8_tensor_destroy(a.t);
      fp8_tensor_destroy(b.t);
      fp8_tensor_destroy(d);
    }
  }
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  fp8_context_destroy(ctx);
  cudaStreamDestroy(stream);
  return 0;
}
