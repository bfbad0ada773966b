// Quantize and fused quantize + transpose + amax through the public API on a CUDA device, against
// the device's own copy bandwidth measured in the same run. Prints a table and writes JSON.
// Usage: bench_quantize [out.json]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/format.hpp"
#include "bench/bench_util.hpp"
#include "fp8.h"

using fp8bench::median_ms;

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : "bench_quantize.json";
  fp8_context_t* gpu = nullptr;
  fp8_context_t* cpu = nullptr;
  CHECK_FP8(fp8_context_create(&gpu, 0));
  CHECK_FP8(fp8_context_create(&cpu, FP8_DEVICE_CPU));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_FP8(fp8_context_set_stream(gpu, stream));
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  CHECK_FP8(fp8_device_query(0, &info));
  std::printf("device: %s (sm_%d)\n", info.name, info.compute_capability);
  std::vector<fp8bench::BandwidthRow> rows{fp8bench::copy_ceiling_row(stream)};

  fp8_recipe_t* recipe = nullptr;
  CHECK_FP8(fp8_recipe_create(&recipe));
  for (auto [m, k] : std::vector<std::pair<int64_t, int64_t>>{{8192, 8192}, {16384, 8192}}) {
    const int64_t n = m * k;
    const int64_t shape[2] = {m, k}, shape_t[2] = {k, m};
    // Two input sets, each larger than L2, alternated between repeats.
    std::vector<uint16_t> host(static_cast<size_t>(n));
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    for (auto& h : host) h = fp8::float_to_bf16(normal(rng));
    fp8_tensor_t *in[2], *q, *qt;
    for (auto& t : in) {
      CHECK_FP8(fp8_tensor_create(&t, gpu, FP8_DTYPE_BF16, 2, shape));
      CHECK_FP8(fp8_tensor_copy_from_host(t, host.data(), host.size() * 2));
    }
    CHECK_FP8(fp8_tensor_create(&q, gpu, FP8_DTYPE_E4M3, 2, shape));
    CHECK_FP8(fp8_tensor_create(&qt, gpu, FP8_DTYPE_E4M3, 2, shape_t));
    fp8_scaling_t* s = nullptr;
    CHECK_FP8(fp8_scaling_create(&s, gpu, recipe, FP8_ROLE_FORWARD));
    CHECK_FP8(fp8_scaling_set_scale(s, 20.0f));

    // Correctness first: the fused kernel against the CPU reference on the whole tensor.
    {
      fp8_tensor_t *cin, *cq, *cqt;
      fp8_scaling_t* cs = nullptr;
      CHECK_FP8(fp8_tensor_create(&cin, cpu, FP8_DTYPE_BF16, 2, shape));
      CHECK_FP8(fp8_tensor_create(&cq, cpu, FP8_DTYPE_E4M3, 2, shape));
      CHECK_FP8(fp8_tensor_create(&cqt, cpu, FP8_DTYPE_E4M3, 2, shape_t));
      CHECK_FP8(fp8_scaling_create(&cs, cpu, recipe, FP8_ROLE_FORWARD));
      CHECK_FP8(fp8_scaling_set_scale(cs, 20.0f));
      CHECK_FP8(fp8_tensor_copy_from_host(cin, host.data(), host.size() * 2));
      CHECK_FP8(fp8_quantize(cpu, cin, cq, cqt, cs));
      CHECK_FP8(fp8_quantize(gpu, in[0], q, qt, s));
      std::vector<uint8_t> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      for (auto [g, c] : {std::pair{q, cq}, std::pair{qt, cqt}}) {
        CHECK_FP8(fp8_tensor_copy_to_host(g, a.data(), a.size()));
        CHECK_FP8(fp8_tensor_copy_to_host(c, b.data(), b.size()));
        if (a != b) {
          std::fprintf(stderr, "MISMATCH against the CPU reference at %lldx%lld\n", (long long)m, (long long)k);
          return 1;
        }
      }
      std::printf("%lldx%lld: GPU cast+transpose+amax matches the CPU reference bit for bit\n", (long long)m, (long long)k);
      fp8_tensor_destroy(cin);
      fp8_tensor_destroy(cq);
      fp8_tensor_destroy(cqt);
      fp8_scaling_destroy(cs);
    }

    const std::string tag = std::to_string(m) + "x" + std::to_string(k);
    const double cast_ms = median_ms(stream, [&](int i) { CHECK_FP8(fp8_quantize(gpu, in[i & 1], q, nullptr, s)); });
    rows.push_back({"quantize bf16->e4m3 + amax " + tag, cast_ms, 3.0 * n / cast_ms / 1e6});
    const double fused_ms = median_ms(stream, [&](int i) { CHECK_FP8(fp8_quantize(gpu, in[i & 1], q, qt, s)); });
    rows.push_back({"quantize+transpose+amax " + tag, fused_ms, 4.0 * n / fused_ms / 1e6});
    const double cast_b = median_ms(stream, [&](int i) { CHECK_FP8(fp8_quantize(gpu, in[i & 1], q, nullptr, s)); }, 20);
    rows.push_back({"quantize bf16->e4m3 + amax " + tag + " batched", cast_b, 3.0 * n / cast_b / 1e6});
    const double fused_b = median_ms(stream, [&](int i) { CHECK_FP8(fp8_quantize(gpu, in[i & 1], q, qt, s)); }, 20);
    rows.push_back({"quantize+transpose+amax " + tag + " batched", fused_b, 4.0 * n / fused_b / 1e6});
    for (auto* t : in) fp8_tensor_destroy(t);
    fp8_tensor_destroy(q);
    fp8_tensor_destroy(qt);
    fp8_scaling_destroy(s);
  }

  fp8bench::print_bandwidth_rows("libfp8", rows);
  fp8bench::write_bandwidth_json(json_path, rows);
  fp8_recipe_destroy(recipe);
  fp8_context_destroy(cpu);
  fp8_context_destroy(gpu);
  cudaStreamDestroy(stream);
  return 0;
}
