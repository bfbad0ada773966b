// The scaling recipes below the C API, called directly:
// - the fused amax + quantize (kernels/cast/recipe_quantize.cu) at the issue-14 shapes (8192x8192
//   and 16384x8192, bf16 in; the scale grids laid out as the Linear passes them to cuBLASLt,
//   gemm_grid): each scale mode with and without the transposed copy, against a
//   device-to-device copy measured in the same run ("of copy" counts the bytes the operation must
//   move: 2 read + 1 or 2 written per element; the per-tensor mode, and the per-row mode with the
//   transposed copy, read the input twice, which the figure does not credit: report_recipes.py
//   adds a column that does), one call per timed
//   region and 20 in a row (per call: each call's launch and last wave overlap the next one's, as
//   in a training step);
// - cuBLASLt's FP8 GEMM (bf16 out) at the issue-3 shapes with per-tensor scales (with and without
//   fast accumulation), per-row scales, and 1x128 x 128x128 (the Linear's fprop and dgrad) and
//   1x128 x 1x128 (its wgrad) block scales.
// Results are checked against the CPU reference and float64 by tests/gpu/gpu_recipes; bench/peer_recipes.py
// times torch._scaled_mm's modes. Usage: bench_recipes [out.json]
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cublaslt_gemm.hpp"
#include "backend/jobs.hpp"
#include "bench/bench_util.hpp"
#include "kernels/launch.hpp"

using fp8bench::median_ms;

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "bench_recipe_quantize.json";
  const fp8bench::KernelDevice dev = fp8bench::open_kernel_device();
  cudaStream_t stream = dev.stream;
  const int sms = dev.sms;
  std::vector<fp8bench::BandwidthRow> rows{fp8bench::copy_ceiling_row(stream)};
  const fp8::ScaleMode modes[] = {fp8::ScaleMode::kTensor, fp8::ScaleMode::kRow, fp8::ScaleMode::kBlock1x128,
                                  fp8::ScaleMode::kBlock128x128};
  for (auto [m, k] : std::vector<std::pair<int64_t, int64_t>>{{8192, 8192}, {16384, 8192}}) {
    const int64_t n = m * k;
    void* in = nullptr;
    uint8_t *out = nullptr, *out_t = nullptr;
    float *grid = nullptr, *grid_t = nullptr;
    uint32_t* ws = nullptr;
    CHECK_CUDA(cudaMalloc(&in, static_cast<size_t>(n) * 2));
    CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(n)));
    CHECK_CUDA(cudaMalloc(&out_t, static_cast<size_t>(n)));
    CHECK_CUDA(cudaMalloc(&grid, static_cast<size_t>(m + k) * 128 * 4));  // room for every mode's grid
    CHECK_CUDA(cudaMalloc(&grid_t, static_cast<size_t>(m + k) * 128 * 4));
    CHECK_CUDA(cudaMalloc(&ws, static_cast<size_t>(m + k) * 4));
    // Not zeros: bf16 0x3E00..0x3FFF spans [0.125, 2) with every mantissa.
    std::vector<uint16_t> host(static_cast<size_t>(n));
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint16_t>(0x3E00 + (i * 2654435761u >> 7) % 0x200) | ((i & 1) << 15);
    CHECK_CUDA(cudaMemcpy(in, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    const std::string tag = std::to_string(m) + "x" + std::to_string(k);
    for (fp8::ScaleMode mode : modes)
      for (bool with_t : {false, true}) {
        fp8::RecipeQuantizeJob j{};
        j.in = in;
        j.in_dtype = FP8_DTYPE_BF16;
        j.rows = m;
        j.cols = k;
        j.out = out;
        j.out_scale_inv = fp8::gemm_grid(mode, m, k, grid);  // (the layouts the Linear's GEMMs read)
        if (with_t) {
          j.out_t = out_t;
          j.out_t_scale_inv = fp8::gemm_grid(mode, k, m, grid_t);
        }
        j.workspace = ws;
        const std::string name = std::string("recipe quantize ") + fp8::scale_mode_name(mode) + (with_t ? " +T " : " ") + tag;
        const double bytes = (with_t ? 4.0 : 3.0) * static_cast<double>(n);
        for (int batch : {1, 20}) {
          const double ms = median_ms(
              stream, [&](int) { fp8::kernels::recipe_quantize(j, {0, sms}, stream); }, batch);
          rows.push_back({batch == 1 ? name : name + " (20 in a row)", ms, bytes / ms / 1e6});
        }
      }
    for (void* p : {in, static_cast<void*>(out), static_cast<void*>(out_t), static_cast<void*>(grid),
                    static_cast<void*>(grid_t), static_cast<void*>(ws)})
      cudaFree(p);
  }

  // GEMMs: A [m, k] x B [n, k]^T -> bf16 [m, n], operands of random codes (no NaN), scales near 1.
  fp8::CublasLtGemm gemm(0);
  struct Pair {
    const char* name;
    fp8::ScaleMode a, b;
    bool fast;
  };
  const Pair pairs[] = {{"per-tensor fast", fp8::ScaleMode::kTensor, fp8::ScaleMode::kTensor, true},
                        {"per-tensor", fp8::ScaleMode::kTensor, fp8::ScaleMode::kTensor, false},
                        {"per-row fast", fp8::ScaleMode::kRow, fp8::ScaleMode::kRow, true},
                        {"per-row", fp8::ScaleMode::kRow, fp8::ScaleMode::kRow, false},
                        {"1x128 x 128x128", fp8::ScaleMode::kBlock1x128, fp8::ScaleMode::kBlock128x128, false},
                        {"1x128 x 1x128", fp8::ScaleMode::kBlock1x128, fp8::ScaleMode::kBlock1x128, false}};
  struct GemmRow {
    std::string name;
    double ms, tflops;
  };
  std::vector<GemmRow> gemm_rows;
  for (auto [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {8192, 8192, 8192}, {16384, 14336, 4096}, {16384, 4096, 14336}, {4096, 4096, 4096}, {16384, 4096, 4096}}) {
    uint8_t *a = nullptr, *b = nullptr;
    void* d = nullptr;
    float* scales = nullptr;
    CHECK_CUDA(cudaMalloc(&a, static_cast<size_t>(m * k)));
    CHECK_CUDA(cudaMalloc(&b, static_cast<size_t>(n * k)));
    CHECK_CUDA(cudaMalloc(&d, static_cast<size_t>(m * n) * 2));
    const size_t scale_floats = static_cast<size_t>((m + n) * ((k + 127) / 128 + 4));
    CHECK_CUDA(cudaMalloc(&scales, scale_floats * 4));
    std::vector<uint8_t> codes(static_cast<size_t>(std::max(m, n) * k));
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 2654435761u) >> 13) & 0xB7;  // |x| < 2
    CHECK_CUDA(cudaMemcpy(a, codes.data(), static_cast<size_t>(m * k), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(b, codes.data(), static_cast<size_t>(n * k), cudaMemcpyHostToDevice));
    std::vector<float> ones(scale_floats, 0.0625f);
    CHECK_CUDA(cudaMemcpy(scales, ones.data(), scale_floats * 4, cudaMemcpyHostToDevice));
    const int64_t padded = ((k + 127) / 128 + 3) / 4 * 4;  // (a's grid takes at most m * padded floats)
    const std::string tag = std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
    for (const Pair& pr : pairs) {
      fp8::GemmJob g{};
      g.a = a;
      g.b = b;
      g.a_dtype = g.b_dtype = FP8_DTYPE_E4M3;
      g.a_scale_inv = fp8::gemm_grid(pr.a, m, k, scales);
      g.b_scale_inv = fp8::gemm_grid(pr.b, n, k, scales + static_cast<size_t>(m) * padded);
      g.m = m;
      g.n = n;
      g.k = k;
      g.d = d;
      g.d_dtype = FP8_DTYPE_BF16;
      g.alpha = 1.0f;
      g.fast_accumulation = pr.fast;
      fp8::check_gemm_scales(g, "CUDA");
      const double ms = median_ms(stream, [&](int) { gemm.run(g, stream); }, 1, 3, 20);
      gemm_rows.push_back({std::string("libfp8 gemm ") + pr.name + " " + tag, ms, 2.0 * m * n * k / ms / 1e9});
    }
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), d, static_cast<void*>(scales)}) cudaFree(p);
  }
  fp8bench::print_bandwidth_rows("", rows);
  FILE* json = std::fopen(json_path, "w");
  std::fprintf(json, "[\n");
  fp8bench::json_bandwidth_rows(json, rows);
  std::printf("\n%-52s %10s %12s\n", "", "ms", "TFLOP/s");
  for (const GemmRow& r : gemm_rows) {
    std::printf("%-52s %10.4f %12.1f\n", r.name.c_str(), r.ms, r.tflops);
    std::fprintf(json, ",\n  {\"name\": \"%s\", \"ms\": %.5f, \"tflops\": %.1f}", r.name.c_str(), r.ms, r.tflops);
  }
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  cudaStreamDestroy(stream);
  return 0;
}
