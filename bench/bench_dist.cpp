// The cost of data parallelism on one GPU (NCCL with one rank): a Linear training step at MS-AMP O2
// (forward, backward, AdamW step, zero_grad) without a communicator, with one, and with one and
// backward sync (each bucket's exchange started from inside the backward). (A group of one rank has
// nothing to average or agree on: what remains is the checks for NCCL's asynchronous errors and the
// bookkeeping of the buckets.)
//
// Usage: bench_dist [out.json]
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"

namespace {

fp8_context_t* ctx = nullptr;
cudaStream_t stream = nullptr;
FILE* json = nullptr;
bool first_row = true;

void row(const std::string& name, double ms) {
  std::printf("%-52s %9.4f ms\n", name.c_str(), ms);
  std::fflush(stdout);
  std::fprintf(json, "%s {\"name\": \"%s\", \"ms\": %.5f}", first_row ? "" : ",\n", name.c_str(), ms);
  first_row = false;
}

struct Step {
  fp8_model_t* model = nullptr;
  fp8_optimizer_t* opt = nullptr;
  fp8_comm_t* comm = nullptr;
};

// Linear k -> n with bias at O2, data-parallel over a one-rank NCCL communicator when `dp`, with
// backward sync when `backward_sync`.
Step make_step(int64_t k, int64_t n, bool dp, bool backward_sync) {
  Step s;
  CHECK_FP8(fp8_model_create(&s.model, ctx));
  CHECK_FP8(fp8_model_add_linear(s.model, "fc", k, n, 1, nullptr));
  fp8_tensor_t *w = nullptr, *b = nullptr;
  CHECK_FP8(fp8_model_parameter(s.model, "fc.weight", &w, nullptr));
  CHECK_FP8(fp8_model_parameter(s.model, "fc.bias", &b, nullptr));
  fp8bench::fill_normal(w, 1.0f / std::sqrt(static_cast<float>(k)), 1);
  fp8bench::fill_normal(b, 0.1f, 2);
  fp8_recipe_t* r = nullptr;
  CHECK_FP8(fp8_recipe_create(&r));
  CHECK_FP8(fp8_recipe_parse(r, "backend=msamp, opt_level=O2, small_layer_fallback=0"));
  CHECK_FP8(fp8_convert_model(s.model, r, nullptr));
  fp8_recipe_destroy(r);
  CHECK_FP8(fp8_model_set_autowrap(s.model, 1));
  if (dp) {
    CHECK_FP8(fp8_comm_create_local(&s.comm, &ctx, 1));
    CHECK_FP8(fp8_model_set_comm(s.model, s.comm));
    if (backward_sync) CHECK_FP8(fp8_model_set_backward_sync(s.model, 1));
  }
  CHECK_FP8(fp8_optimizer_create(&s.opt, s.model, FP8_OPTIMIZER_ADAMW));
  return s;
}

void destroy(Step& s) {
  fp8_optimizer_destroy(s.opt);
  fp8_model_destroy(s.model);
  fp8_comm_destroy(s.comm);
}

}  // namespace

int main(int argc, char** argv) {
  json = std::fopen(argc > 1 ? argv[1] : "bench_dist.json", "w");
  if (!json) return 1;
  CHECK_FP8(fp8_context_create(&ctx, 0));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_FP8(fp8_context_set_stream(ctx, stream));
  std::fprintf(json, "[\n");

  // A Linear training step, 16384 tokens, 8192 -> 8192, bf16 activations.
  const int64_t m = 16384, k = 8192, n = 8192;
  fp8_tensor_t *x = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, k), *y = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, n);
  fp8_tensor_t *dy = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, n), *dx = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, k);
  fp8bench::fill_normal(x, 1.0f, 3);
  fp8bench::fill_normal(dy, 1e-3f, 4);
  // The steps alternate, each timed by itself, so that clocks drifting over the run weigh on all
  // alike; the medians of 30 each after 3 warm-ups.
  constexpr int kSteps = 3;
  const char* const names[kSteps] = {"O2 linear step 16384x8192->8192, no communicator",
                                     "O2 linear step 16384x8192->8192, NCCL 1 rank",
                                     "O2 linear step 16384x8192->8192, NCCL 1 rank, backward sync"};
  Step steps[kSteps] = {make_step(k, n, false, false), make_step(k, n, true, false), make_step(k, n, true, true)};
  const auto run = [&](Step& s) {
    CHECK_FP8(fp8_model_forward(s.model, x, y));
    CHECK_FP8(fp8_model_backward(s.model, dy, dx));
    CHECK_FP8(fp8_optimizer_step(s.opt));
    CHECK_FP8(fp8_optimizer_zero_grad(s.opt));
  };
  for (int w = 0; w < 3; ++w)
    for (Step& s : steps) run(s);
  std::vector<double> ms[kSteps];
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int rep = 0; rep < 30; ++rep)
    for (int dp = 0; dp < kSteps; ++dp) {
      CHECK_CUDA(cudaEventRecord(a, stream));
      run(steps[dp]);
      CHECK_CUDA(cudaEventRecord(b, stream));
      CHECK_CUDA(cudaEventSynchronize(b));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
      ms[dp].push_back(t);
    }
  double step_ms[kSteps];
  for (int dp = 0; dp < kSteps; ++dp) {
    std::sort(ms[dp].begin(), ms[dp].end());
    step_ms[dp] = ms[dp][ms[dp].size() / 2];
    row(names[dp], step_ms[dp]);
    destroy(steps[dp]);
  }
  std::printf("data-parallel overhead at 1 rank: %+.2f%% (backward sync: %+.2f%%)\n",
              100.0 * (step_ms[1] / step_ms[0] - 1.0), 100.0 * (step_ms[2] / step_ms[0] - 1.0));
  for (fp8_tensor_t* t : {x, y, dy, dx}) fp8_tensor_destroy(t);
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  fp8_context_destroy(ctx);
  return 0;
}
