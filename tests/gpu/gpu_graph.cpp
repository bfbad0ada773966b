// A whole training step (autocast forward, backward, optimizer step, zero_grad) captured in a CUDA
// graph and replayed N times gives the bits of N eager steps, at te and at O2, with the learning
// rate changed between replays and new data each step; an allocation during capture is refused.
#include <cuda_runtime_api.h>

#include <cstdio>

#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

constexpr int64_t kTokens = 64, kIn = 256, kHidden = 512;
constexpr int kSteps = 6;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

float lr_of(int step) {
  return 1e-3f * (1.0f + 0.5f * static_cast<float>(step));
}

// One model on its own stream, with its x and dy buffers.
struct Trainer {
  cudaStream_t stream = nullptr;
  Context ctx = make_context(0);
  Model model;
  Optimizer opt;
  Tensor x, y, dy;

  explicit Trainer(const char* recipe) {
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    EXPECT_OK(fp8_context_set_stream(ctx.get(), stream));
    model = make_model(ctx.get());
    fp8_model_t* m = model.get();
    EXPECT_OK(fp8_model_add_linear(m, "fc1", kIn, kHidden, 1, nullptr));
    EXPECT_OK(fp8_model_add_layernorm(m, "ln", kHidden, 1e-5f, nullptr));
    EXPECT_OK(fp8_model_add_activation(m, "act", FP8_ACTIVATION_GELU, nullptr));
    EXPECT_OK(fp8_model_add_linear(m, "fc2", kHidden, kIn, 1, nullptr));
    set_param(m, "fc1.weight", randn(kIn * kHidden, 1, 0.06f));
    set_param(m, "fc1.bias", randn(kHidden, 2, 0.1f));
    set_param(m, "ln.weight", randn(kHidden, 3, 0.1f, 1.0f));
    set_param(m, "fc2.weight", randn(kIn * kHidden, 4, 0.04f));
    Recipe r = make_recipe(recipe);
    EXPECT_OK(fp8_convert_model(m, r.get(), nullptr));
    EXPECT_OK(fp8_model_set_autowrap(m, 1));
    opt = make_optimizer(m, FP8_OPTIMIZER_ADAMW);
    x = make_tensor(ctx.get(), FP8_DTYPE_BF16, {kTokens, kIn});
    y = make_tensor(ctx.get(), FP8_DTYPE_BF16, {kTokens, kIn});
    dy = make_tensor(ctx.get(), FP8_DTYPE_BF16, {kTokens, kIn});
  }
  ~Trainer() {
    x.reset(), y.reset(), dy.reset();
    opt.reset();
    model.reset();
    ctx.reset();
    cudaStreamDestroy(stream);
  }
  // The data and learning rate of step `i` (outside any capture).
  void prepare(int i) {
    auto bf16 = [](const std::vector<float>& f) {
      std::vector<uint16_t> h(f.size());
      for (size_t k = 0; k < f.size(); ++k) h[k] = static_cast<uint16_t>(bits_of(f[k]) >> 16);
      return h;
    };
    upload(x.get(), bf16(randn(kTokens * kIn, 100 + i, 1.0f)));
    upload(dy.get(), bf16(randn(kTokens * kIn, 200 + i, 0.01f)));
    EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_LR, lr_of(i)));
  }
  // The step itself: what the graph captures.
  fp8_status_t step() {
    fp8_status_t st = fp8_model_forward(model.get(), x.get(), y.get());
    if (st == FP8_OK) st = fp8_model_backward(model.get(), dy.get(), nullptr);
    if (st == FP8_OK) st = fp8_optimizer_step(opt.get());
    if (st == FP8_OK) st = fp8_optimizer_zero_grad(opt.get());
    return st;
  }
  // Every parameter's stored bytes, and every scaling state's scale and history.
  std::vector<std::vector<uint8_t>> state() {
    std::vector<std::vector<uint8_t>> out;
    int32_t count = 0;
    EXPECT_OK(fp8_model_parameter_count(model.get(), &count));
    for (int32_t i = 0; i < count; ++i) {
      fp8_tensor_t* v = nullptr;
      EXPECT_OK(fp8_model_parameter_at(model.get(), i, nullptr, &v, nullptr));
      out.push_back(tensor_bytes(v));
    }
    for (int32_t layer = 0; layer < 4; ++layer)
      for (int32_t slot = FP8_SCALING_INPUT; slot <= FP8_SCALING_OUTPUT; ++slot) {
        fp8_scaling_t* s = nullptr;
        EXPECT_OK(fp8_layer_get_scaling(model.get(), layer, slot, &s));
        if (!s) continue;
        const fp8_scaling_info_t info = info_of(s);
        std::vector<uint8_t> b(sizeof info);
        std::memcpy(b.data(), &info, sizeof info);
        out.push_back(b);
      }
    return out;
  }
};

class GraphReplay : public ::testing::TestWithParam<const char*> {};

TEST_P(GraphReplay, NReplaysEqualNEagerStepsBitForBit) {
  const char* recipe = GetParam();
  Trainer eager(recipe), graphed(recipe);
  for (int i = 0; i < kSteps; ++i) {
    eager.prepare(i);
    FP8_ASSERT_OK(eager.step());
  }
  FP8_ASSERT_OK(fp8_context_synchronize(eager.ctx.get()));

  // One eager step (the buffers reach their sizes), then the capture, then kSteps - 1 replays.
  graphed.prepare(0);
  FP8_ASSERT_OK(graphed.step());
  FP8_ASSERT_OK(fp8_context_synchronize(graphed.ctx.get()));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(graphed.stream, cudaStreamCaptureModeThreadLocal));
  const fp8_status_t captured = graphed.step();
  CUDA_OK(cudaStreamEndCapture(graphed.stream, &graph));
  FP8_ASSERT_OK(captured);
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  for (int i = 1; i < kSteps; ++i) {
    graphed.prepare(i);  // new data and a new learning rate between replays
    CUDA_OK(cudaGraphLaunch(exec, graphed.stream));
  }
  CUDA_OK(cudaStreamSynchronize(graphed.stream));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  fp8_optimizer_stats_t se = stats_of(eager.opt.get()), sg = stats_of(graphed.opt.get());
  EXPECT_EQ(sg.steps, kSteps);
  EXPECT_EQ(se.steps, sg.steps);
  EXPECT_EQ(se.last_grad_norm, sg.last_grad_norm);
  const auto a = eager.state(), b = graphed.state();
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(a[k], b[k]) << "parameter or scaling state " << k;
  // After the last replay eager calls work again, on the weights the replays made.
  for (Trainer* t : {&eager, &graphed}) {
    t->prepare(kSteps);
    FP8_ASSERT_OK(fp8_model_set_training(t->model.get(), 0));
    FP8_ASSERT_OK(fp8_model_forward(t->model.get(), t->x.get(), t->y.get()));
  }
  EXPECT_EQ(tensor_bytes(eager.y.get()), tensor_bytes(graphed.y.get())) << "an eager forward after the replays";
  int32_t level = -1;
  FP8_ASSERT_OK(fp8_model_storage_level(graphed.model.get(), &level));
  std::printf("[ %s ] %zu graph nodes; %d replays == %d eager steps bit for bit (storage level %d, grad norm %g)\n",
              recipe, nodes, kSteps - 1, kSteps - 1, level, static_cast<double>(sg.last_grad_norm));
}

INSTANTIATE_TEST_SUITE_P(Levels, GraphReplay,
                         ::testing::Values("backend=te, small_layer_fallback=0",
                                           "backend=msamp, opt_level=O2, small_layer_fallback=0"),
                         [](const auto& info) { return std::string(info.index == 0 ? "te" : "O2"); });

// A shape the buffers have not seen needs memory, which a capture cannot allocate: refused, saying
// what to do, and the model works again once the capture has ended.
TEST(GraphCapture, AnAllocationDuringCaptureIsRefused) {
  Trainer t("backend=te, small_layer_fallback=0");
  t.prepare(0);
  FP8_ASSERT_OK(t.step());
  Tensor x4 = make_tensor(t.ctx.get(), FP8_DTYPE_BF16, {4 * kTokens, kIn});
  Tensor y4 = make_tensor(t.ctx.get(), FP8_DTYPE_BF16, {4 * kTokens, kIn});
  FP8_ASSERT_OK(fp8_context_synchronize(t.ctx.get()));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(t.stream, cudaStreamCaptureModeThreadLocal));
  const fp8_status_t st = fp8_model_forward(t.model.get(), x4.get(), y4.get());
  const std::string msg = fp8_last_error_message();
  cudaStreamEndCapture(t.stream, &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  EXPECT_EQ(st, FP8_ERR_INVALID_STATE) << msg;
  EXPECT_NE(msg.find("before capturing"), std::string::npos) << msg;
  FP8_ASSERT_OK(fp8_model_forward(t.model.get(), x4.get(), y4.get()));  // eager again: allowed
  FP8_ASSERT_OK(fp8_context_synchronize(t.ctx.get()));
}

}  // namespace
