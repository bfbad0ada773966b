// What replaying a captured CUDA graph gains over queuing the same training step call by call: the
// Fashion-MNIST example's model (784 -> 1024 -> LayerNorm -> GELU -> 1024 -> LayerNorm -> GELU -> 10,
// batch 256, bf16 activations, FP8 at te and O2, AdamW), one step = forward, backward (a fixed
// output gradient: the loss stays out of the measurement), optimizer step, zero_grad. Before timing,
// the graph's result is checked against the eager steps' bit for bit.
//
//   bench_graph [out.json]
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"

namespace {

constexpr int64_t kBatch = 256, kPixels = 784, kHidden = 1024, kClasses = 10;

struct Model {
  cudaStream_t stream = nullptr;
  fp8_context_t* ctx = nullptr;
  fp8_model_t* m = nullptr;
  fp8_optimizer_t* opt = nullptr;
  fp8_tensor_t *x = nullptr, *y = nullptr, *dy = nullptr;

  explicit Model(const char* recipe) {
    CHECK_CUDA(cudaStreamCreate(&stream));
    CHECK_FP8(fp8_context_create(&ctx, 0));
    CHECK_FP8(fp8_context_set_stream(ctx, stream));
    CHECK_FP8(fp8_model_create(&m, ctx));
    CHECK_FP8(fp8_model_add_linear(m, "fc1", kPixels, kHidden, 1, nullptr));
    CHECK_FP8(fp8_model_add_layernorm(m, "ln1", kHidden, 1e-5f, nullptr));
    CHECK_FP8(fp8_model_add_activation(m, "gelu1", FP8_ACTIVATION_GELU, nullptr));
    CHECK_FP8(fp8_model_add_linear(m, "fc2", kHidden, kHidden, 1, nullptr));
    CHECK_FP8(fp8_model_add_layernorm(m, "ln2", kHidden, 1e-5f, nullptr));
    CHECK_FP8(fp8_model_add_activation(m, "gelu2", FP8_ACTIVATION_GELU, nullptr));
    CHECK_FP8(fp8_model_add_linear(m, "fc3", kHidden, kClasses, 1, nullptr));
    int32_t count = 0;
    CHECK_FP8(fp8_model_parameter_count(m, &count));
    uint64_t rng = 7;
    for (int32_t i = 0; i < count; ++i) {
      const char* name = nullptr;
      fp8_tensor_t* v = nullptr;
      CHECK_FP8(fp8_model_parameter_at(m, i, &name, &v, nullptr));
      if (std::strncmp(name, "fc", 2) != 0) continue;
      int64_t n = 0;
      CHECK_FP8(fp8_tensor_numel(v, &n));
      std::vector<float> w(static_cast<size_t>(n));
      for (float& f : w) f = static_cast<float>(((rng = rng * 6364136223846793005ull + 1) >> 40) % 2001 - 1000) * 3e-5f;
      CHECK_FP8(fp8_tensor_copy_from_host(v, w.data(), w.size() * sizeof(float)));
    }
    fp8_recipe_t* r = nullptr;
    CHECK_FP8(fp8_recipe_create(&r));
    CHECK_FP8(fp8_recipe_parse(r, "small_layer_fallback=0"));
    CHECK_FP8(fp8_recipe_parse(r, recipe));
    CHECK_FP8(fp8_convert_model(m, r, nullptr));
    fp8_recipe_destroy(r);
    CHECK_FP8(fp8_model_set_autowrap(m, 1));
    CHECK_FP8(fp8_optimizer_create(&opt, m, FP8_OPTIMIZER_ADAMW));
    const int64_t xs[2] = {kBatch, kPixels}, ys[2] = {kBatch, kClasses};
    CHECK_FP8(fp8_tensor_create(&x, ctx, FP8_DTYPE_BF16, 2, xs));
    CHECK_FP8(fp8_tensor_create(&y, ctx, FP8_DTYPE_BF16, 2, ys));
    CHECK_FP8(fp8_tensor_create(&dy, ctx, FP8_DTYPE_BF16, 2, ys));
    std::vector<uint16_t> hx(static_cast<size_t>(kBatch * kPixels)), hdy(static_cast<size_t>(kBatch * kClasses));
    for (auto& h : hx) h = static_cast<uint16_t>(0x3C00 + ((rng = rng * 6364136223846793005ull + 1) >> 56));
    for (auto& h : hdy) h = static_cast<uint16_t>(0x3800 + ((rng = rng * 6364136223846793005ull + 1) >> 56));
    CHECK_FP8(fp8_tensor_copy_from_host(x, hx.data(), hx.size() * 2));
    CHECK_FP8(fp8_tensor_copy_from_host(dy, hdy.data(), hdy.size() * 2));
  }
  ~Model() {
    fp8_tensor_destroy(x), fp8_tensor_destroy(y), fp8_tensor_destroy(dy);
    fp8_optimizer_destroy(opt);
    fp8_model_destroy(m);
    fp8_context_destroy(ctx);
    cudaStreamDestroy(stream);
  }
  void step() {
    CHECK_FP8(fp8_model_forward(m, x, y));
    CHECK_FP8(fp8_model_backward(m, dy, nullptr));
    CHECK_FP8(fp8_optimizer_step(opt));
    CHECK_FP8(fp8_optimizer_zero_grad(opt));
  }
  std::vector<uint8_t> weights() {
    std::vector<uint8_t> out;
    int32_t count = 0;
    CHECK_FP8(fp8_model_parameter_count(m, &count));
    for (int32_t i = 0; i < count; ++i) {
      fp8_tensor_t* v = nullptr;
      CHECK_FP8(fp8_model_parameter_at(m, i, nullptr, &v, nullptr));
      int64_t n = 0;
      fp8_dtype_t dt = 0;
      CHECK_FP8(fp8_tensor_numel(v, &n));
      CHECK_FP8(fp8_tensor_dtype(v, &dt));
      std::vector<uint8_t> b(static_cast<size_t>(n) * fp8_dtype_size(dt));
      CHECK_FP8(fp8_tensor_copy_to_host(v, b.data(), b.size()));
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
};

struct Row {
  std::string level;
  double eager_ms, graph_ms;
  size_t nodes;
};

Row measure(const char* name, const char* recipe) {
  Model eager(recipe), graphed(recipe);
  // Correct first: 1 + 4 graph replays against 5 eager steps.
  for (int i = 0; i < 5; ++i) eager.step();
  graphed.step();
  CHECK_CUDA(cudaStreamSynchronize(graphed.stream));
  cudaGraph_t graph = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(graphed.stream, cudaStreamCaptureModeThreadLocal));
  graphed.step();
  CHECK_CUDA(cudaStreamEndCapture(graphed.stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  size_t nodes = 0;
  CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
  for (int i = 0; i < 4; ++i) CHECK_CUDA(cudaGraphLaunch(exec, graphed.stream));
  CHECK_CUDA(cudaStreamSynchronize(graphed.stream));
  if (eager.weights() != graphed.weights()) {
    std::fprintf(stderr, "%s: the graph's weights differ from the eager steps'\n", name);
    std::exit(1);
  }
  // Steps queued back to back (10 per timed region): what a training loop sees, launch cost included.
  const double eager_ms = fp8bench::median_ms(
      eager.stream, [&](int) { eager.step(); }, 10, 20, 30);
  const double graph_ms = fp8bench::median_ms(
      graphed.stream, [&](int) { CHECK_CUDA(cudaGraphLaunch(exec, graphed.stream)); }, 10, 20, 30);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return {name, eager_ms, graph_ms, nodes};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Row> rows;
  rows.push_back(measure("te", "backend=te"));
  rows.push_back(measure("O2", "backend=msamp, opt_level=O2"));
  std::printf(
      "\nFashion-MNIST MLP training step (batch %lld), eager vs CUDA graph replay (graph == eager bit for bit)\n",
      static_cast<long long>(kBatch));
  std::printf("| level | eager ms/step | graph ms/step | speedup | graph nodes |\n|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %.3f | %.3f | %.2fx | %zu |\n", r.level.c_str(), r.eager_ms, r.graph_ms,
                r.eager_ms / r.graph_ms, r.nodes);
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (f) {
      std::fprintf(f, "[");
      for (size_t i = 0; i < rows.size(); ++i)
        std::fprintf(f, "%s{\"level\": \"%s\", \"eager_ms\": %.5f, \"graph_ms\": %.5f, \"nodes\": %zu}", i ? ", " : "",
                     rows[i].level.c_str(), rows[i].eager_ms, rows[i].graph_ms, rows[i].nodes);
      std::fprintf(f, "]\n");
      std::fclose(f);
    }
  }
  return 0;
}
