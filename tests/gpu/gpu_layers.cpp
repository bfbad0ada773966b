// The layers on the GPU against the same layers on the CPU reference: one model on each, the same
// weights and inputs, the same sequence of training steps (convert, autocast, forward, backward,
// batched scaling update). Scaling states of a Linear must stay bit-identical step after step (the
// casts and amaxes are bit-exact); outputs and gradients agree within GEMM accumulation order.
#include <cmath>
#include <cstdio>
#include <string>

#include "gpu/gpu_compare.hpp"

using namespace fp8test;

namespace {



// The same model on the CPU and on the GPU, with the same parameter values.
struct Twin {
  Context cpu = make_context(FP8_DEVICE_CPU), gpu = make_context(0);
  Model mc = make_model(cpu.get()), mg = make_model(gpu.get());

  void add_linear(const char* name, int64_t in, int64_t out, uint32_t seed) {
    FP8_ASSERT_OK(fp8_model_add_linear(mc.get(), name, in, out, 1, nullptr));
    FP8_ASSERT_OK(fp8_model_add_linear(mg.get(), name, in, out, 1, nullptr));
    set_param((std::string(name) + ".weight").c_str(), normal_floats(static_cast<size_t>(in * out), seed, 0.0f, 0.05f));
    set_param((std::string(name) + ".bias").c_str(), normal_floats(static_cast<size_t>(out), seed + 1, 0.0f, 0.5f));
  }
  void set_param(const char* name, const std::vector<float>& v) {
    for (fp8_model_t* m : {mc.get(), mg.get()}) {
      fp8_tensor_t* t = nullptr;
      FP8_ASSERT_OK(fp8_model_parameter(m, name, &t, nullptr));
      upload(t, v);
    }
  }
  // TransformerEngine's numerics on FP32 weights and gradients (backend te): the MS-AMP levels'
  // storage has its own GPU test (gpu_train).
  void convert(const char* recipe_text) {
    Recipe r = make_recipe("backend=te");
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), recipe_text));
    FP8_ASSERT_OK(fp8_convert_model(mc.get(), r.get(), nullptr));
    FP8_ASSERT_OK(fp8_convert_model(mg.get(), r.get(), nullptr));
  }
  std::pair<Tensor, Tensor> tensors(fp8_dtype_t dt, const std::vector<int64_t>& shape, const std::vector<float>* v) {
    std::pair<Tensor, Tensor> t{make_tensor(cpu.get(), dt, shape), make_tensor(gpu.get(), dt, shape)};
    if (v) {
      upload(t.first.get(), to_wide_bytes(dt, *v));
      upload(t.second.get(), to_wide_bytes(dt, *v));
    }
    return t;
  }
  // Every Linear's x, W and dy states equal bit for bit on both sides.
  void expect_states_equal() {
    int32_t n = 0;
    fp8_model_layer_count(mc.get(), &n);
    for (int32_t id = 0; id < n; ++id) {
      for (int32_t slot : {FP8_SCALING_INPUT, FP8_SCALING_WEIGHT, FP8_SCALING_GRAD_OUTPUT}) {
        fp8_scaling_t *sc = nullptr, *sg = nullptr;
        ASSERT_EQ(fp8_layer_get_scaling(mc.get(), id, slot, &sc), FP8_OK);
        ASSERT_EQ(fp8_layer_get_scaling(mg.get(), id, slot, &sg), FP8_OK);
        if (!sc) continue;
        ASSERT_NE(sg, nullptr);
        const fp8_scaling_info_t a = info_of(sc), b = info_of(sg);
        EXPECT_EQ(bits_of(a.scale), bits_of(b.scale)) << "layer " << id << " slot " << slot;
        EXPECT_EQ(bits_of(a.amax), bits_of(b.amax)) << "layer " << id << " slot " << slot;
        EXPECT_EQ(a.update_count, b.update_count);
      }
    }
  }
  void expect_grads_close(double tol) {
    int32_t n = 0;
    fp8_model_parameter_count(mc.get(), &n);
    for (int32_t i = 0; i < n; ++i) {
      const char* name = nullptr;
      fp8_tensor_t *gc = nullptr, *gg = nullptr;
      ASSERT_EQ(fp8_model_parameter_at(mc.get(), i, &name, nullptr, &gc), FP8_OK);
      ASSERT_EQ(fp8_model_parameter_at(mg.get(), i, nullptr, nullptr, &gg), FP8_OK);
      const auto want = values(gc);
      const double e = relative_error(values(gg), want);
      EXPECT_LT(e, tol) << name;
      EXPECT_GT(norm2(want), 0.0) << name << " is all zero: the test would prove nothing";
    }
  }
  void report(fp8_model_t* m, int32_t id, fp8_layer_report_t* r) {
    fp8_layer_report_init(r);
    ASSERT_EQ(fp8_layer_get_report(m, id, r), FP8_OK);
  }
};

struct LinearCase {
  int64_t m, in, out;
  fp8_dtype_t act;
  const char* recipe;
  int32_t fprop, dgrad, wgrad;  // the precisions the plan must show
};

// FP8 GEMM vs double accumulation: fast accumulation for fprop ~1e-3; a bf16 output adds one rounding.
double tolerance(fp8_dtype_t act) { return act == FP8_DTYPE_BF16 ? 6e-3 : 2e-3; }

TEST(GpuLayers, LinearStepsMatchTheCpuReference) {
  const LinearCase cases[] = {
      {256, 384, 192, FP8_DTYPE_BF16, "small_layer_fallback=off", 1, 1, 1},
      {208, 208, 272, FP8_DTYPE_F32, "small_layer_fallback=off", 1, 1, 1},  // edge tiles of every pass
      {200, 256, 128, FP8_DTYPE_BF16, "small_layer_fallback=off", 1, 1, 0},  // tokens not a multiple of 16
      {128, 200, 128, FP8_DTYPE_BF16, "small_layer_fallback=off", 0, 0, 0},  // in_features not a multiple of 16
      {256, 256, 256, FP8_DTYPE_BF16, "fp8_format=E4M3, small_layer_fallback=off", 1, 1, 1},
      {256, 256, 256, FP8_DTYPE_BF16, "override_linear_precision=off/on/off, small_layer_fallback=off", 1, 0, 1},
      {256, 256, 256, FP8_DTYPE_BF16, "override_linear_precision=on/off/on, small_layer_fallback=off", 0, 1, 0},
      {64, 128, 64, FP8_DTYPE_BF16, "", 0, 0, 0},  // small: the automatic fallback (bench_linear shows the other side)
      // Current scaling: every cast takes its scale from its own amax (an amax pass, then the cast),
      // the dy cast with its transposed copy and fused bias gradient, edge tiles included.
      {256, 384, 192, FP8_DTYPE_BF16, "scaling=current, small_layer_fallback=off", 1, 1, 1},
      {208, 208, 272, FP8_DTYPE_F32, "scaling=current, small_layer_fallback=off", 1, 1, 1},
      {200, 256, 128, FP8_DTYPE_BF16, "scaling=current, margin=2, power_2_scales=on, small_layer_fallback=off", 1, 1, 0},
      {256, 256, 256, FP8_DTYPE_BF16, "scaling=current, fp8_format=E4M3, small_layer_fallback=off", 1, 1, 1},
      // Rowwise and block scaling (grids of scales, cuBLASLt's OUTER_VEC / VEC128 / BLK128x128 GEMMs),
      // partial 128-blocks in every dimension; 200 tokens: wgrad in high precision; 196: all of it.
      {256, 384, 192, FP8_DTYPE_BF16, "scaling=rowwise, small_layer_fallback=off", 1, 1, 1},
      {208, 208, 272, FP8_DTYPE_F32, "scaling=rowwise, margin=1, small_layer_fallback=off", 1, 1, 1},
      {256, 384, 192, FP8_DTYPE_BF16, "scaling=block, small_layer_fallback=off", 1, 1, 1},
      {208, 208, 272, FP8_DTYPE_F32, "scaling=block, power_2_scales=off, small_layer_fallback=off", 1, 1, 1},
      {200, 256, 128, FP8_DTYPE_BF16, "scaling=block, fp8_format=E4M3, small_layer_fallback=off", 1, 1, 0},
      {196, 256, 128, FP8_DTYPE_BF16, "scaling=rowwise, small_layer_fallback=off", 0, 0, 0},
  };
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  ASSERT_EQ(fp8_device_query(0, &info), FP8_OK);
  uint32_t seed = 100;
  for (const LinearCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.m << "x" << c.in << "->" << c.out << " " << fp8_dtype_name(c.act) << " '"
                                      << c.recipe << "'");
    const std::string text = c.recipe;
    if (!info.fp8_block_scaling &&
        (text.find("rowwise") != std::string::npos || text.find("block") != std::string::npos)) {
      std::printf("skipped on %s (no per-row or block-scaled GEMMs): '%s'\n", info.name, c.recipe);
      continue;
    }
    Twin t;
    t.add_linear("fc", c.in, c.out, seed);
    t.convert(c.recipe);
    for (int step = 0; step < 3; ++step) {
      const auto xv = normal_floats(static_cast<size_t>(c.m * c.in), seed + 10 + step, 0.0f, 2.0f + step);
      const auto dyv = normal_floats(static_cast<size_t>(c.m * c.out), seed + 20 + step, 0.0f, 1e-3f);
      auto [x_c, x_g] = t.tensors(c.act, {c.m, c.in}, &xv);
      auto [dy_c, dy_g] = t.tensors(c.act, {c.m, c.out}, &dyv);
      auto [y_c, y_g] = t.tensors(c.act, {c.m, c.out}, nullptr);
      auto [dx_c, dx_g] = t.tensors(c.act, {c.m, c.in}, nullptr);
      for (auto [m, x, y, dy, dx] : {std::tuple{t.mc.get(), x_c.get(), y_c.get(), dy_c.get(), dx_c.get()},
                                     std::tuple{t.mg.get(), x_g.get(), y_g.get(), dy_g.get(), dx_g.get()}}) {
        FP8_ASSERT_OK(fp8_autocast_begin(m));
        FP8_ASSERT_OK(fp8_layer_forward(m, 0, x, y));
        FP8_ASSERT_OK(fp8_autocast_end(m));
        FP8_ASSERT_OK(fp8_layer_backward(m, 0, dy, dx));
      }
      EXPECT_LT(relative_error(values(y_g.get()), values(y_c.get())), tolerance(c.act)) << "y, step " << step;
      EXPECT_LT(relative_error(values(dx_g.get()), values(dx_c.get())), tolerance(c.act)) << "dx, step " << step;
      t.expect_states_equal();
    }
    t.expect_grads_close(2e-3);  // FP32 gradients accumulated over the three steps
    fp8_layer_report_t rc, rg;
    t.report(t.mc.get(), 0, &rc);
    t.report(t.mg.get(), 0, &rg);
    EXPECT_EQ(rg.fprop, c.fprop);
    EXPECT_EQ(rg.dgrad, c.dgrad);
    EXPECT_EQ(rg.wgrad, c.wgrad);
    EXPECT_EQ(rc.fprop, rg.fprop);
    EXPECT_STREQ(rc.reason, rg.reason);
    ++seed;
  }
}

// After a weights change, the first Linear that needs an FP8 weight copy makes every due copy in one
// grouped cast (nn::make_weight_copies; on the GPU one launch over all the weights, on the CPU one
// cast after another). Five Linears of awkward shapes (edge tiles, rows and columns not multiples
// of 128, one layer left unconverted), FP32 weights (te, new values each step) and F16 ones (O2,
// the same values remade): the weight states equal the CPU's bit for bit after every step (the
// amaxes the grouped cast records), and every y agrees as the Linear's own steps do.
TEST(GpuLayers, WeightCopiesMadeTogetherMatchTheCpuReference) {
  const struct {
    const char* name;
    int64_t in, out;
  } layers[] = {{"a", 208, 272}, {"b", 384, 192}, {"c", 48, 80}, {"d", 200, 128}, {"e", 256, 384}};
  for (const char* level : {"backend=te", "backend=msamp, opt_level=O2"}) {
    SCOPED_TRACE(level);
    Twin t;
    uint32_t seed = 500;
    for (const auto& l : layers) t.add_linear(l.name, l.in, l.out, seed += 2);
    t.convert((std::string(level) + ", small_layer_fallback=off").c_str());
    const bool te = std::string(level) == "backend=te";
    const int64_t m = 64;
    for (int step = 0; step < 3; ++step) {
      if (step > 0) {
        if (te)  // new FP32 values; O2's F16 storage keeps its values and remakes the copies
          for (const auto& l : layers)
            t.set_param((std::string(l.name) + ".weight").c_str(),
                        normal_floats(static_cast<size_t>(l.in * l.out), seed += 2, 0.0f, 0.05f * (step + 1)));
        FP8_ASSERT_OK(fp8_model_weights_changed(t.mc.get()));
        FP8_ASSERT_OK(fp8_model_weights_changed(t.mg.get()));
      }
      for (fp8_model_t* model : {t.mc.get(), t.mg.get()}) FP8_ASSERT_OK(fp8_autocast_begin(model));
      for (int32_t id = 0; id < 5; ++id) {
        const auto xv = normal_floats(static_cast<size_t>(m * layers[id].in), seed + 100 * step + id, 0.0f, 2.0f);
        auto [x_c, x_g] = t.tensors(FP8_DTYPE_BF16, {m, layers[id].in}, &xv);
        auto [y_c, y_g] = t.tensors(FP8_DTYPE_BF16, {m, layers[id].out}, nullptr);
        FP8_ASSERT_OK(fp8_layer_forward(t.mc.get(), id, x_c.get(), y_c.get()));
        FP8_ASSERT_OK(fp8_layer_forward(t.mg.get(), id, x_g.get(), y_g.get()));
        EXPECT_LT(relative_error(values(y_g.get()), values(y_c.get())), tolerance(FP8_DTYPE_BF16))
            << "y of " << layers[id].name << ", step " << step;
      }
      for (fp8_model_t* model : {t.mc.get(), t.mg.get()}) FP8_ASSERT_OK(fp8_autocast_end(model));
      t.expect_states_equal();
    }
    fp8_layer_report_t r;
    t.report(t.mg.get(), 3, &r);
    EXPECT_EQ(r.fprop, 0) << "d (in_features 200) is not converted";
    t.report(t.mg.get(), 4, &r);
    EXPECT_EQ(r.fp8_calls, 3) << "e ran in FP8 at every step";
  }
}

// The GPU model's Linears `ids` ran their latest forward and backward GEMMs all in FP8.
void expect_all_fp8(Twin& t, std::initializer_list<int32_t> ids) {
  for (int32_t id : ids) {
    fp8_layer_report_t r;
    t.report(t.mg.get(), id, &r);
    EXPECT_EQ(r.fprop, 1) << "layer " << id;
    EXPECT_EQ(r.dgrad, 1) << "layer " << id;
    EXPECT_EQ(r.wgrad, 1) << "layer " << id;
  }
}

// LayerNorm -> Linear -> GELU -> Linear with FP8 hand-offs (E4M3 outputs of the norm and the
// activation feed the Linears directly), forward and backward, bf16 activations.
TEST(GpuLayers, MlpBlockWithFp8HandOffsMatchesTheCpuReference) {
  const int64_t tokens = 272, d = 128, f = 512;  // 272 rows: full and edge tiles in every transposing pass
  Twin t;
  for (fp8_model_t* m : {t.mc.get(), t.mg.get()}) {
    FP8_ASSERT_OK(fp8_model_add_layernorm(m, "ln", d, 1e-5f, nullptr));
  }
  t.add_linear("fc1", d, f, 7);
  for (fp8_model_t* m : {t.mc.get(), t.mg.get()}) FP8_ASSERT_OK(fp8_model_add_activation(m, "gelu", FP8_ACTIVATION_GELU, nullptr));
  t.add_linear("fc2", f, d, 9);
  t.set_param("ln.weight", normal_floats(d, 11, 1.0f, 0.2f));
  t.set_param("ln.bias", normal_floats(d, 12, 0.0f, 0.2f));
  t.convert("small_layer_fallback=off");
  const fp8_dtype_t bf = FP8_DTYPE_BF16, e4 = FP8_DTYPE_E4M3;
  for (int step = 0; step < 3; ++step) {
    const auto xv = normal_floats(static_cast<size_t>(tokens * d), 30 + step, 0.5f, 1.5f);
    const auto dyv = normal_floats(static_cast<size_t>(tokens * d), 40 + step, 0.0f, 1e-2f);
    auto [x_c, x_g] = t.tensors(bf, {tokens, d}, &xv);
    auto [h0_c, h0_g] = t.tensors(e4, {tokens, d}, nullptr);
    auto [h1_c, h1_g] = t.tensors(bf, {tokens, f}, nullptr);
    auto [h2_c, h2_g] = t.tensors(e4, {tokens, f}, nullptr);
    auto [y_c, y_g] = t.tensors(bf, {tokens, d}, nullptr);
    auto [dy_c, dy_g] = t.tensors(bf, {tokens, d}, &dyv);
    auto [g2_c, g2_g] = t.tensors(bf, {tokens, f}, nullptr);
    auto [g1_c, g1_g] = t.tensors(bf, {tokens, f}, nullptr);
    auto [g0_c, g0_g] = t.tensors(bf, {tokens, d}, nullptr);
    auto [dx_c, dx_g] = t.tensors(bf, {tokens, d}, nullptr);
    for (auto [m, x, h0, h1, h2, y, dy, g2, g1, g0, dx] :
         {std::tuple{t.mc.get(), x_c.get(), h0_c.get(), h1_c.get(), h2_c.get(), y_c.get(), dy_c.get(), g2_c.get(),
                     g1_c.get(), g0_c.get(), dx_c.get()},
          std::tuple{t.mg.get(), x_g.get(), h0_g.get(), h1_g.get(), h2_g.get(), y_g.get(), dy_g.get(), g2_g.get(),
                     g1_g.get(), g0_g.get(), dx_g.get()}}) {
      FP8_ASSERT_OK(fp8_autocast_begin(m));
      FP8_ASSERT_OK(fp8_layer_forward(m, 0, x, h0));
      FP8_ASSERT_OK(fp8_layer_forward(m, 1, h0, h1));
      FP8_ASSERT_OK(fp8_layer_forward(m, 2, h1, h2));
      FP8_ASSERT_OK(fp8_layer_forward(m, 3, h2, y));
      FP8_ASSERT_OK(fp8_autocast_end(m));
      FP8_ASSERT_OK(fp8_layer_backward(m, 3, dy, g2));
      FP8_ASSERT_OK(fp8_layer_backward(m, 2, g2, g1));
      FP8_ASSERT_OK(fp8_layer_backward(m, 1, g1, g0));
      FP8_ASSERT_OK(fp8_layer_backward(m, 0, g0, dx));
    }
    // The hand-offs are FP8 codes of float results (norm statistics in float vs double, tanhf):
    // a few codes may round the other way, so they are compared as values, like the rest.
    EXPECT_LT(relative_error(values(h0_g.get()), values(h0_c.get())), 1e-2) << "norm output, step " << step;
    EXPECT_LT(relative_error(values(h2_g.get()), values(h2_c.get())), 1e-2) << "gelu output, step " << step;
    EXPECT_LT(relative_error(values(y_g.get()), values(y_c.get())), 1e-2) << "y, step " << step;
    EXPECT_LT(relative_error(values(dx_g.get()), values(dx_c.get())), 2e-2) << "dx, step " << step;
  }
  t.expect_grads_close(2e-2);
  expect_all_fp8(t, {1, 3});
}

// The same block as one stack (fp8_stack_forward_saved / fp8_stack_backward_saved), x an FP32
// residual into BF16 activations, 528 hidden features (edge tiles along both dimensions), GELU and
// ReLU: the activation's forward is folded into fc2's x cast and its backward into fc1's dy cast
// (the cast kernel with the activation, its input staged through shared memory for the gradient),
// on both backends, and the GPU's results stay close to the CPU reference's.
TEST(GpuLayers, StackFoldingTheActivationMatchesTheCpuReference) {
  const int64_t tokens = 272, d = 128, f = 528;
  for (fp8_activation_t act : {FP8_ACTIVATION_GELU, FP8_ACTIVATION_RELU}) {
    SCOPED_TRACE(act == FP8_ACTIVATION_GELU ? "GELU" : "ReLU");
    Twin t;
    for (fp8_model_t* m : {t.mc.get(), t.mg.get()}) {
      FP8_ASSERT_OK(fp8_model_add_layernorm(m, "ln", d, 1e-5f, nullptr));
    }
    t.add_linear("fc1", d, f, 17);
    for (fp8_model_t* m : {t.mc.get(), t.mg.get()}) FP8_ASSERT_OK(fp8_model_add_activation(m, "act", act, nullptr));
    t.add_linear("fc2", f, d, 19);
    t.set_param("ln.weight", normal_floats(d, 21, 1.0f, 0.2f));
    t.set_param("ln.bias", normal_floats(d, 22, 0.0f, 0.2f));
    t.set_param("fc1.bias", normal_floats(f, 23, 0.0f, 0.5f));
    t.convert("small_layer_fallback=off");
    for (int step = 0; step < 3; ++step) {
      const auto xv = normal_floats(static_cast<size_t>(tokens * d), 50 + step, 0.5f, 1.5f);
      const auto dyv = normal_floats(static_cast<size_t>(tokens * d), 60 + step, 0.0f, 1e-2f);
      auto [x_c, x_g] = t.tensors(FP8_DTYPE_F32, {tokens, d}, &xv);
      auto [y_c, y_g] = t.tensors(FP8_DTYPE_BF16, {tokens, d}, nullptr);
      auto [dy_c, dy_g] = t.tensors(FP8_DTYPE_BF16, {tokens, d}, &dyv);
      auto [dx_c, dx_g] = t.tensors(FP8_DTYPE_F32, {tokens, d}, nullptr);
      for (auto [m, x, y, dy, dx] : {std::tuple{t.mc.get(), x_c.get(), y_c.get(), dy_c.get(), dx_c.get()},
                                     std::tuple{t.mg.get(), x_g.get(), y_g.get(), dy_g.get(), dx_g.get()}}) {
        fp8_saved_t* saved = nullptr;
        FP8_ASSERT_OK(fp8_autocast_begin(m));
        FP8_ASSERT_OK(fp8_stack_forward_saved(m, 0, 4, x, y, &saved));
        FP8_ASSERT_OK(fp8_stack_backward_saved(m, saved, dy, dx, 0));
        FP8_ASSERT_OK(fp8_autocast_end(m));
        fp8_saved_destroy(saved);
      }
      EXPECT_LT(relative_error(values(y_g.get()), values(y_c.get())), 1e-2) << "y, step " << step;
      EXPECT_LT(relative_error(values(dx_g.get()), values(dx_c.get())), 2e-2) << "dx, step " << step;
    }
    t.expect_grads_close(2e-2);
    expect_all_fp8(t, {1, 3});
    // The activation's output state scaled fc2's x cast, and fc1's gradient state recorded the amax
    // of the folded values (the activation's dx): on both backends within the last bits of tanhf.
    for (auto [id, slot] : {std::pair{2, FP8_SCALING_OUTPUT}, std::pair{1, FP8_SCALING_GRAD_OUTPUT}}) {
      fp8_scaling_t *sc = nullptr, *sg = nullptr;
      FP8_ASSERT_OK(fp8_layer_get_scaling(t.mc.get(), id, slot, &sc));
      FP8_ASSERT_OK(fp8_layer_get_scaling(t.mg.get(), id, slot, &sg));
      EXPECT_NEAR(info_of(sg).scale, info_of(sc).scale, 1e-3 * info_of(sc).scale) << "layer " << id;
      EXPECT_NE(info_of(sc).scale, 1.0f) << "layer " << id;
      EXPECT_EQ(info_of(sg).update_count, info_of(sc).update_count) << "layer " << id;
    }
  }
}

// The same kind of block as one residual stack (fp8_stack_forward_residual / FP8_BACKWARD_ADD_DY):
// y = x + block(x) in F32 with fc2's GEMM adding x as C to its output from BF16 activations, and
// dx = dy + the block's dx written by ln's backward pass (its dx base). Against the CPU reference
// the block's part of y and of dx stay within the stack test's bounds. Against a third model that
// runs the plain stack on the GPU (BF16 y; dy exact in BF16, its backward accumulated onto a copy of
// dy): dx and every parameter gradient bit for bit, and y - x within BF16's rounding of the plain y.
// 128 tokens (full tiles) and 272 (edge tiles).
TEST(GpuLayers, ResidualStackMatchesTheCpuReference) {
  const std::vector<int64_t> shapes[] = {{2, 64, 256}, {2, 136, 128}};
  for (const std::vector<int64_t>& shape : shapes) {
    const int64_t d = shape[2], f = 4 * d, tokens = shape[0] * shape[1];
    const size_t n = static_cast<size_t>(tokens * d);
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, d " << d);
    Twin t;
    Model mp = make_model(t.gpu.get());  // the GPU's plain stack
    for (fp8_model_t* m : {t.mc.get(), t.mg.get(), mp.get()}) {
      FP8_ASSERT_OK(fp8_model_add_layernorm(m, "ln", d, 1e-5f, nullptr));
      FP8_ASSERT_OK(fp8_model_add_linear(m, "fc1", d, f, 1, nullptr));
      FP8_ASSERT_OK(fp8_model_add_activation(m, "act", FP8_ACTIVATION_GELU, nullptr));
      FP8_ASSERT_OK(fp8_model_add_linear(m, "fc2", f, d, 1, nullptr));
    }
    const std::pair<const char*, std::vector<float>> params[] = {
        {"ln.weight", normal_floats(static_cast<size_t>(d), 71, 1.0f, 0.2f)},
        {"ln.bias", normal_floats(static_cast<size_t>(d), 72, 0.0f, 0.2f)},
        {"fc1.weight", normal_floats(static_cast<size_t>(d * f), 73, 0.0f, 0.05f)},
        {"fc1.bias", normal_floats(static_cast<size_t>(f), 74, 0.0f, 0.5f)},
        {"fc2.weight", normal_floats(static_cast<size_t>(f * d), 75, 0.0f, 0.05f)},
        {"fc2.bias", normal_floats(static_cast<size_t>(d), 76, 0.0f, 0.5f)},
    };
    for (const auto& [name, v] : params) {
      t.set_param(name, v);
      set_param(mp.get(), name, v);
    }
    const char* recipe = "small_layer_fallback=off";
    t.convert(recipe);
    Recipe r = make_recipe("backend=te");
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), recipe));
    FP8_ASSERT_OK(fp8_convert_model(mp.get(), r.get(), nullptr));
    double worst_y = 0, worst_dx = 0;
    for (int step = 0; step < 3; ++step) {
      const auto xv = normal_floats(n, 80 + step, 0.5f, 1.5f);
      auto dyv = normal_floats(n, 90 + step, 0.0f, 1e-2f);
      for (float& v : dyv) v = fp8::bf16_to_float(fp8::float_to_bf16(v));  // the same numbers in F32 and BF16
      auto [x_c, x_g] = t.tensors(FP8_DTYPE_F32, shape, &xv);
      auto [y_c, y_g] = t.tensors(FP8_DTYPE_F32, shape, nullptr);
      auto [dy_c, dy_g] = t.tensors(FP8_DTYPE_F32, shape, &dyv);
      auto [dx_c, dx_g] = t.tensors(FP8_DTYPE_F32, shape, nullptr);
      for (auto [m, x, y, dy, dx] : {std::tuple{t.mc.get(), x_c.get(), y_c.get(), dy_c.get(), dx_c.get()},
                                     std::tuple{t.mg.get(), x_g.get(), y_g.get(), dy_g.get(), dx_g.get()}}) {
        fp8_saved_t* saved = nullptr;
        FP8_ASSERT_OK(fp8_autocast_begin(m));
        FP8_ASSERT_OK(fp8_stack_forward_residual(m, 0, 4, x, x, y, FP8_DTYPE_BF16, &saved));
        FP8_ASSERT_OK(fp8_stack_backward_saved(m, saved, dy, dx, FP8_BACKWARD_ADD_DY));
        FP8_ASSERT_OK(fp8_autocast_end(m));
        fp8_saved_destroy(saved);
      }
      Tensor y_p = make_tensor(t.gpu.get(), FP8_DTYPE_BF16, shape),
             dy_p = make_tensor(t.gpu.get(), FP8_DTYPE_BF16, shape);
      Tensor dx_p = make_tensor(t.gpu.get(), FP8_DTYPE_F32, shape);
      upload(dy_p.get(), to_wide_bytes(FP8_DTYPE_BF16, dyv));
      upload(dx_p.get(), dyv);
      fp8_saved_t* saved = nullptr;
      FP8_ASSERT_OK(fp8_autocast_begin(mp.get()));
      FP8_ASSERT_OK(fp8_stack_forward_saved(mp.get(), 0, 4, x_g.get(), y_p.get(), &saved));
      FP8_ASSERT_OK(fp8_stack_backward_saved(mp.get(), saved, dy_p.get(), dx_p.get(), FP8_BACKWARD_ACCUMULATE_DX));
      FP8_ASSERT_OK(fp8_autocast_end(mp.get()));
      fp8_saved_destroy(saved);

      // The block's parts: y - x and dx - dy.
      const auto yc = values(y_c.get()), yg = values(y_g.get()), yp = values(y_p.get());
      const auto dxc = values(dx_c.get()), dxg = values(dx_g.get());
      std::vector<double> xd(xv.begin(), xv.end()), dyd(dyv.begin(), dyv.end()), block_c(n), block_g(n), grad_c(n),
          grad_g(n);
      for (size_t i = 0; i < n; ++i) {
        block_c[i] = yc[i] - xd[i];
        block_g[i] = yg[i] - xd[i];
        grad_c[i] = dxc[i] - dyd[i];
        grad_g[i] = dxg[i] - dyd[i];
      }
      const double ey = relative_error(block_g, block_c), edx = relative_error(grad_g, grad_c);
      worst_y = std::max(worst_y, ey);
      worst_dx = std::max(worst_dx, edx);
      EXPECT_LT(ey, 1e-2) << "y - x, step " << step;
      EXPECT_LT(edx, 2e-2) << "dx - dy, step " << step;
      EXPECT_GT(norm2(block_c), 0.1 * norm2(xd)) << "y is x alone: the block's output is missing, step " << step;
      EXPECT_GT(norm2(grad_c), 0.05 * norm2(dyd)) << "dx is dy alone: the block's gradient is missing, step " << step;

      // The plain GPU stack: y within BF16's rounding of the block's part (the GEMM adds x before
      // its one F32 rounding; cuBLASLt may pick another kernel, another summation order, for the F32
      // D with C: 1e-5 of the largest output); dx bit for bit (the same codes through the same GEMMs).
      double yp_max = 0.0;
      for (float v : yp) yp_max = std::max(yp_max, static_cast<double>(std::fabs(v)));
      for (size_t i = 0; i < n; ++i)
        ASSERT_LE(std::fabs(block_g[i] - yp[i]),
                  std::fabs(yp[i]) / 256.0 + 2.4e-7 * std::fabs(yg[i]) + 1e-5 * yp_max + 1e-7)
            << "y " << i << " (y " << yg[i] << ", x " << xd[i] << ", plain y " << yp[i] << "), step " << step;
      const auto dx_res = download<float>(dx_g.get()), dx_plain = download<float>(dx_p.get());
      for (size_t i = 0; i < n; ++i)
        ASSERT_EQ(bits_of(dx_res[i]), bits_of(dx_plain[i]))
            << "dx " << i << " (" << dx_res[i] << " vs " << dx_plain[i] << "), step " << step;
      int32_t count = 0;
      FP8_ASSERT_OK(fp8_model_parameter_count(t.mg.get(), &count));
      for (int32_t i = 0; i < count; ++i) {
        const char* name = nullptr;
        fp8_tensor_t *g_res = nullptr, *g_plain = nullptr;
        FP8_ASSERT_OK(fp8_model_parameter_at(t.mg.get(), i, &name, nullptr, &g_res));
        FP8_ASSERT_OK(fp8_model_parameter_at(mp.get(), i, nullptr, nullptr, &g_plain));
        // (bit for bit but for fc2's bias, whose column sums the cast kernel may order differently
        // for an F32 dy than for a BF16 one)
        if (std::string(name) == "fc2.bias")
          EXPECT_LT(relative_error(values(g_res), values(g_plain)), 1e-6) << name << ", step " << step;
        else
          EXPECT_TRUE(tensor_bytes(g_res) == tensor_bytes(g_plain))
              << name << "'s gradient differs from the plain stack's, step " << step;
      }
    }
    t.expect_grads_close(2e-2);
    expect_all_fp8(t, {1, 3});
    std::printf("residual stack, %lld tokens, d %lld: y - x vs CPU %.2e, dx - dy %.2e (worst of 3 steps)\n",
                static_cast<long long>(tokens), static_cast<long long>(d), worst_y, worst_dx);
  }
}

}  // namespace
