// The optimizer's MS-AMP levels (O1..O3) on the CPU reference backend: which level a recipe and an
// optimizer kind give, the storage each level uses for a Linear's weight, gradient and Adam moments,
// the FP8 gradient accumulation across micro-batches, the non-finite skip with a "poisoned" FP8
// gradient, and the training bytes of each level (training at every level: test_train_cpu's EndToEnd).
//
// The update is checked three ways, each against a reference written here, never against the library:
//  (a) float64 Adam / SGD on the same (decoded) gradients, with a per-element error budget derived from
//      the storage formats (F16 weights, E4M3 m, F16 v, E4M3 visible weights at O3): every element must
//      lie within its budget, and the same budget must reject a float64 run with a deliberate bug (no
//      bias correction, wrong sign), which shows that the budget is tight enough to catch one;
//  (b) a float re-implementation of the compact update (the bounds that give the per-tensor scales,
//      the decode / update / encode of each element, the promotion of the scales after the pass),
//      written from the description in core/optim_rule.hpp with only core/format.hpp's conversions,
//      which must give the library's bits;
//  (c) the bits of the FP8 gradient after two micro-batches whose dW are exact in float.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/format.hpp"  // the numerics contract: E4M3/E5M2/F16 encode and decode
#include "fp8_test_util.hpp"
#include "optim_reference.hpp"

using namespace fp8test;

namespace {



using Params = std::vector<std::vector<float>>;
using Params64 = std::vector<std::vector<double>>;

// Relative half-ulps (round to nearest) of the storage formats, for normal numbers, and the half of
// the smallest subnormal (in the format's own units).
constexpr double kE4M3Rel = 1.0 / 16;     // 3 mantissa bits: 2^-4
constexpr double kE5M2Rel = 1.0 / 8;      // 2 mantissa bits: 2^-3
constexpr double kBf16Rel = 1.0 / 256;    // 7 mantissa bits: 2^-8
constexpr double kF16Rel = 1.0 / 2048;    // 10 mantissa bits: 2^-11
constexpr double kE4M3Floor = 1.0 / 1024; // 2^-9 / 2
constexpr double kE5M2Floor = 1.0 / 131072; // 2^-16 / 2
constexpr double kF16Floor = 2.9802322387695312e-8;  // 2^-24 / 2

float scale_inv_of(const fp8_tensor_t* t) {
  float s = std::numeric_limits<float>::quiet_NaN();
  EXPECT_OK(fp8_tensor_get_scale_inv(t, &s));
  return s;
}

// The values a tensor stands for, whatever its storage: F32 as is, F16 exactly, FP8 codes times the
// tensor's scale_inv (fp8_dequantize's rule, in float).
std::vector<float> decoded(const fp8_tensor_t* t) {
  const fp8_dtype_t dt = dtype_of(t);
  if (dt == FP8_DTYPE_F32) return download<float>(t);
  std::vector<float> out;
  if (dt == FP8_DTYPE_F16) {
    for (uint16_t h : download<uint16_t>(t)) out.push_back(fp8::f16_to_float(h));
    return out;
  }
  EXPECT_TRUE(dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2) << "dtype " << dt;
  const float si = scale_inv_of(t);
  for (uint8_t c : download<uint8_t>(t)) out.push_back(fp8::dequantize_fp8(c, dt == FP8_DTYPE_E5M2, si));
  return out;
}

// The first element whose bits differ, or "" when all agree.
template <class T>
std::string first_difference(const std::vector<std::vector<T>>& got, const std::vector<std::vector<T>>& want) {
  if (got.size() != want.size()) return "different tensor counts";
  for (size_t k = 0; k < want.size(); ++k) {
    if (got[k].size() != want[k].size()) return "tensor " + std::to_string(k) + " has a different size";
    for (size_t i = 0; i < want[k].size(); ++i)
      if (std::memcmp(&got[k][i], &want[k][i], sizeof(T)) != 0)
        return "tensor " + std::to_string(k) + "[" + std::to_string(i) + "]: got " + std::to_string(got[k][i]) +
               ", want " + std::to_string(want[k][i]);
  }
  return "";
}

// =================================================================================================
// The model used by most tests: two bias-free Linears fc1 (96 -> 64, 6144 weights: two chunks of the
// optimizer, the second partial) and fc2 (64 -> 32, 2048), both multiples of 16, weights N(0, 0.5).
// =================================================================================================

const char* const kLinears[] = {"fc1", "fc2"};
constexpr int64_t kIn[] = {96, 64}, kOut[] = {64, 32};
constexpr int64_t kRows = 32;  // tokens of each micro-batch

struct TwoLinears {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  Optimizer opt;
  Params w32;  // the FP32 weights written before the conversion

  // `recipe`: the recipe text for fp8_convert_model, or nullptr for an unconverted model.
  explicit TwoLinears(const char* recipe, uint32_t seed = 1) {
    for (int k = 0; k < 2; ++k) {
      EXPECT_OK(fp8_model_add_linear(model.get(), kLinears[k], kIn[k], kOut[k], 0, nullptr));
      w32.push_back(randn(static_cast<size_t>(kIn[k] * kOut[k]), seed * 10 + static_cast<uint32_t>(k), 0.5f));
      upload(weight(k), w32.back());
    }
    if (recipe) {
      Recipe r = make_recipe(recipe);
      EXPECT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
    }
  }
  fp8_tensor_t* weight(int k) { return param_tensor(model.get(), std::string(kLinears[k]) + ".weight"); }
  fp8_tensor_t* grad(int k) { return param_tensor(model.get(), std::string(kLinears[k]) + ".weight", true); }
  Params weights() {
    Params p;
    for (int k = 0; k < 2; ++k) p.push_back(decoded(weight(k)));
    return p;
  }
  // The FP32 weights rounded to F16, as the conversion to O1..O3 stores them (the values at O1/O2,
  // the masters at O3).
  Params f16_weights() const {
    Params p = w32;
    for (auto& w : p)
      for (float& f : w) f = fp8::f16_to_float(fp8::float_to_f16(f));
    return p;
  }
  Params grads() {
    Params g;
    for (int k = 0; k < 2; ++k) g.push_back(decoded(grad(k)));
    return g;
  }
  // FP32 gradients from outside libfp8, added with fp8_model_accumulate_grad onto zeroed gradients
  // (requantised into FP8 at O1..O3 in one pass; exact into FP32 at te). Returns them.
  Params set_fp32_grads(uint32_t seed) {
    Params g;
    EXPECT_OK(fp8_model_zero_grad(model.get()));
    for (int k = 0; k < 2; ++k) {
      g.push_back(randn(static_cast<size_t>(kIn[k] * kOut[k]), seed * 100 + static_cast<uint32_t>(k), 0.05f));
      accumulate(k, g.back());
    }
    return g;
  }
  // grad(k) += g (fc1.weight and fc2.weight are the parameters 0 and 1: the Linears have no bias).
  void accumulate(int k, const std::vector<float>& g) {
    Tensor t = make_tensor(ctx.get(), FP8_DTYPE_F32, {kOut[k], kIn[k]});
    upload(t.get(), g);
    EXPECT_OK(fp8_model_accumulate_grad(model.get(), k, t.get()));
  }
  void create(fp8_optimizer_kind_t kind) { opt = make_optimizer(model.get(), kind); }
  // One micro-batch through each Linear (high precision: no autocast): dW += dy^T x. `poison` puts an
  // inf into fc1's dy.
  void backward(uint32_t seed, bool poison = false) {
    for (int k = 0; k < 2; ++k) {
      Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn[k]});
      Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kOut[k]});
      Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kOut[k]});
      upload(x.get(), randn(static_cast<size_t>(kRows * kIn[k]), seed * 1000 + 7 * static_cast<uint32_t>(k), 1.0f));
      std::vector<float> dyh = randn(static_cast<size_t>(kRows * kOut[k]), seed * 1000 + 7 * static_cast<uint32_t>(k) + 3, 0.02f);
      if (poison && k == 0) dyh[5] = std::numeric_limits<float>::infinity();
      upload(dy.get(), dyh);
      EXPECT_OK(fp8_layer_forward(model.get(), k, x.get(), y.get()));
      EXPECT_OK(fp8_layer_backward(model.get(), k, dy.get(), nullptr));
    }
  }
};

const char* recipe_for_level(int level) {
  switch (level) {
    case 0: return "backend=te, small_layer_fallback=0";
    case 1: return "backend=msamp, opt_level=O1, small_layer_fallback=0";
    case 2: return "backend=msamp, opt_level=O2, small_layer_fallback=0";
    default: return "backend=msamp, opt_level=O3, small_layer_fallback=0";
  }
}

// =================================================================================================
// 1. Which level a recipe gives, the storage at each level, and the refusals
// =================================================================================================

// A TwoLinears' weights and gradients as they are now: the handles, their data pointers, their bytes
// and (FP8 tensors) their scale_inv.
struct Snapshot {
  std::vector<const fp8_tensor_t*> handles;
  std::vector<void*> data;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<uint32_t> scale_inv_bits;
};
Snapshot snapshot(TwoLinears& t) {
  Snapshot s;
  for (int k = 0; k < 2; ++k)
    for (const fp8_tensor_t* x : {t.weight(k), t.grad(k)}) {
      s.handles.push_back(x);
      s.data.push_back(data_of(x));
      s.bytes.push_back(tensor_bytes(x));
      const fp8_dtype_t dt = dtype_of(x);
      s.scale_inv_bits.push_back(dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2 ? bits_of(scale_inv_of(x)) : 0u);
    }
  return s;
}
void expect_same_storage(const Snapshot& got, const Snapshot& want, const char* what) {
  EXPECT_EQ(got.handles, want.handles) << what << ": other tensor handles";
  EXPECT_EQ(got.data, want.data) << what << ": the storage moved";
  EXPECT_EQ(got.bytes, want.bytes) << what << ": the stored bytes changed";
  EXPECT_EQ(got.scale_inv_bits, want.scale_inv_bits) << what << ": a scale_inv changed";
}

int32_t storage_level_of(const fp8_model_t* m) {
  int32_t level = -1;
  EXPECT_OK(fp8_model_storage_level(m, &level));
  return level;
}
// How a level stores a Linear weight (under HYBRID) and its gradient.
fp8_dtype_t weight_dtype_at(int level) {
  return level == 0 ? FP8_DTYPE_F32 : level == 3 ? FP8_DTYPE_E4M3 : FP8_DTYPE_F16;
}
fp8_dtype_t grad_dtype_at(int level) {
  return level == 0 ? FP8_DTYPE_F32 : FP8_DTYPE_E5M2;
}

struct LevelCase {
  const char* recipe;
  int32_t storage;           // the model's storage level after fp8_convert_model
  int32_t adam, adamw, sgd;  // expected opt_level, or -1: refused with FP8_ERR_UNSUPPORTED
};

// The conversion fixes the storage level (te: FP32; msamp or auto: opt_level) and stores the weights
// at it; the optimizer adopts it (SGD runs O1 on O2 storage, which is O1's; backend=msamp O2 and O3
// storage refuse SGD). Neither a creation nor a refusal moves or rewrites anything.
TEST(OptimLevelSelection, BackendAndOptLevelChooseTheLevelPerKind) {
  const LevelCase cases[] = {
      {"backend=te, opt_level=O1", 0, 0, 0, 0},
      {"backend=te, opt_level=O2", 0, 0, 0, 0},
      {"backend=te, opt_level=O3", 0, 0, 0, 0},
      {"backend=msamp, opt_level=O1", 1, 1, 1, 1},
      {"backend=msamp, opt_level=O2", 2, 2, 2, -1},
      {"backend=msamp, opt_level=O3", 3, 3, 3, -1},
      {"backend=auto, opt_level=O1", 1, 1, 1, 1},
      {"backend=auto, opt_level=O2", 2, 2, 2, 1},   // auto: SGD runs O1 on the O2 storage
      {"backend=auto, opt_level=O3", 3, 3, 3, -1},  // E4M3 weights with masters: no SGD
      {"", 2, 2, 2, 1},                             // Accelerate's defaults: auto, O2
  };
  for (const LevelCase& c : cases) {
    const int32_t want[] = {c.sgd, c.adam, c.adamw};
    for (fp8_optimizer_kind_t kind : {FP8_OPTIMIZER_SGD, FP8_OPTIMIZER_ADAM, FP8_OPTIMIZER_ADAMW}) {
      SCOPED_TRACE(std::string("recipe \"") + c.recipe + "\", kind " + std::to_string(kind));
      TwoLinears t(c.recipe);
      // Stored at the level by the conversion itself, before any optimizer.
      EXPECT_EQ(storage_level_of(t.model.get()), c.storage);
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ(dtype_of(t.weight(k)), weight_dtype_at(c.storage));
        EXPECT_EQ(dtype_of(t.grad(k)), grad_dtype_at(c.storage));
      }
      t.set_fp32_grads(3);  // gradients with something in them, which creation must keep
      const Snapshot before = snapshot(t);
      fp8_optimizer_t* o = nullptr;
      if (want[kind] < 0) {
        EXPECT_REFUSED_WORDS(fp8_optimizer_create(&o, t.model.get(), kind), FP8_ERR_UNSUPPORTED, "fp8_optimizer_create",
                             c.storage == 2 ? "O2" : "O3", "SGD");
        EXPECT_EQ(o, nullptr);
        expect_same_storage(snapshot(t), before, "the refused fp8_optimizer_create");
        EXPECT_EQ(storage_level_of(t.model.get()), c.storage);
        continue;
      }
      FP8_ASSERT_OK(fp8_optimizer_create(&o, t.model.get(), kind));
      Optimizer opt(o);
      EXPECT_EQ(stats_of(o).opt_level, want[kind]);
      expect_same_storage(snapshot(t), before, "fp8_optimizer_create");
      EXPECT_EQ(storage_level_of(t.model.get()), c.storage);
    }
  }
}

TEST(OptimLevelSelection, AnUnconvertedModelAlwaysGetsLevelZero) {
  for (fp8_optimizer_kind_t kind : {FP8_OPTIMIZER_SGD, FP8_OPTIMIZER_ADAM, FP8_OPTIMIZER_ADAMW}) {
    TwoLinears never(nullptr);
    EXPECT_EQ(storage_level_of(never.model.get()), 0);
    never.create(kind);
    EXPECT_EQ(stats_of(never.opt.get()).opt_level, 0);
    EXPECT_EQ(dtype_of(never.weight(0)), FP8_DTYPE_F32);
    // Converted to O3, then back to high precision (to_fp8 = 0): no recipe, level 0, and the FP32
    // weights come back from the F16 masters (not from their E4M3 copies).
    TwoLinears back("backend=msamp, opt_level=O3");
    EXPECT_EQ(storage_level_of(back.model.get()), 3);
    fp8_convert_options_t opts;
    fp8_convert_options_init(&opts);
    opts.to_fp8 = 0;
    FP8_ASSERT_OK(fp8_convert_model(back.model.get(), nullptr, &opts));
    EXPECT_EQ(storage_level_of(back.model.get()), 0);
    back.create(kind);
    EXPECT_EQ(stats_of(back.opt.get()).opt_level, 0);
    EXPECT_EQ(dtype_of(back.weight(1)), FP8_DTYPE_F32);
    EXPECT_EQ(download<float>(back.weight(1)), back.f16_weights()[1]);
  }
}

// The dtypes of every parameter from the conversion on (and unchanged by the optimizer): Linear
// weights take the level's storage, biases and norm parameters stay FP32 with FP32 gradients; the FP8
// gradient is E5M2 under HYBRID, E4M3 under E4M3.
TEST(OptimLevelSelection, WeightAndGradientDtypesAtEachLevel) {
  struct Want {
    int level;
    const char* format;
    fp8_dtype_t value, grad;
  };
  const Want wants[] = {
      {0, "HYBRID", FP8_DTYPE_F32, FP8_DTYPE_F32},  {1, "HYBRID", FP8_DTYPE_F16, FP8_DTYPE_E5M2},
      {2, "HYBRID", FP8_DTYPE_F16, FP8_DTYPE_E5M2}, {3, "HYBRID", FP8_DTYPE_E4M3, FP8_DTYPE_E5M2},
      {1, "E4M3", FP8_DTYPE_F16, FP8_DTYPE_E4M3},   {2, "E4M3", FP8_DTYPE_F16, FP8_DTYPE_E4M3},
      {3, "E4M3", FP8_DTYPE_E4M3, FP8_DTYPE_E4M3},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(std::string(level_name(w.level)) + " " + w.format);
    Context ctx = make_context(FP8_DEVICE_CPU);
    Model model = make_model(ctx.get());
    fp8_model_t* m = model.get();
    FP8_ASSERT_OK(fp8_model_add_linear(m, "fc1", 32, 48, 1, nullptr));
    FP8_ASSERT_OK(fp8_model_add_layernorm(m, "ln", 48, 1e-5f, nullptr));
    FP8_ASSERT_OK(fp8_model_add_linear(m, "fc2", 48, 16, 0, nullptr));
    upload(param_tensor(m, "fc1.weight"), randn(32 * 48, 3, 0.3f));
    upload(param_tensor(m, "fc2.weight"), randn(48 * 16, 4, 0.3f));
    const std::string text = std::string(recipe_for_level(w.level)) + ", fp8_format=" + w.format;
    Recipe r = make_recipe(text.c_str());
    FP8_ASSERT_OK(fp8_convert_model(m, r.get(), nullptr));
    EXPECT_EQ(storage_level_of(m), w.level);
    Optimizer o;
    for (int pass = 0; pass < 2; ++pass) {  // right after the conversion, then with the optimizer
      SCOPED_TRACE(pass == 0 ? "after fp8_convert_model" : "after fp8_optimizer_create");
      if (pass == 1) {
        o = make_optimizer(m, FP8_OPTIMIZER_ADAM);
        EXPECT_EQ(stats_of(o.get()).opt_level, w.level);
      }
      for (const char* name : {"fc1.weight", "fc2.weight"}) {
        SCOPED_TRACE(name);
        EXPECT_EQ(dtype_of(param_tensor(m, name)), w.value);
        EXPECT_EQ(dtype_of(param_tensor(m, name, true)), w.grad);
        int32_t ndim = 0;
        int64_t shape[FP8_MAX_DIMS] = {};
        EXPECT_OK(fp8_tensor_shape(param_tensor(m, name), &ndim, shape));
        EXPECT_EQ(ndim, 2);
      }
      for (const char* name : {"fc1.bias", "ln.weight", "ln.bias"}) {
        SCOPED_TRACE(name);
        EXPECT_EQ(dtype_of(param_tensor(m, name)), FP8_DTYPE_F32);
        EXPECT_EQ(dtype_of(param_tensor(m, name, true)), FP8_DTYPE_F32);
      }
      // fp8_model_parameter_at hands out the same tensors.
      fp8_tensor_t *v = nullptr, *g = nullptr;
      const char* name = nullptr;
      FP8_ASSERT_OK(fp8_model_parameter_at(m, 0, &name, &v, &g));
      EXPECT_EQ(std::string(name), "fc1.weight");
      EXPECT_EQ(v, param_tensor(m, "fc1.weight"));
      EXPECT_EQ(g, param_tensor(m, "fc1.weight", true));
      if (w.level == 3) {  // the E4M3 weight's scale_inv maps its amax to 448
        const float si = scale_inv_of(param_tensor(m, "fc1.weight"));
        EXPECT_GT(si, 0.0f);
        const std::vector<float> dec = decoded(param_tensor(m, "fc1.weight"));
        EXPECT_NEAR(amax_of(dec), 448.0f * si, 1e-6f * 448.0f * si);
      }
    }
  }
}

// A second optimizer while one keeps the MS-AMP state of the weights is refused; after the first is
// destroyed a new one works on the same storage (handles, pointers and bits kept). The storage level
// is the model's, fixed while an optimizer exists: a conversion to another level is refused, naming
// both levels, and leaves the storage as it was (so does one that would change the FP8 gradients'
// format); the same level again goes through in place. Once the optimizer is gone the level can change.
TEST(OptimLevelSelection, OneOptimizerAtATimeAndTheLevelStaysFixedWhileOneExists) {
  TwoLinears t(recipe_for_level(2));
  t.create(FP8_OPTIMIZER_ADAM);
  fp8_optimizer_t* o = nullptr;
  EXPECT_REFUSED_WORDS(fp8_optimizer_create(&o, t.model.get(), FP8_OPTIMIZER_ADAMW), FP8_ERR_INVALID_STATE,
                       "fp8_optimizer_create", "O2", "destroy");
  EXPECT_EQ(o, nullptr);
  const std::vector<uint8_t> initial = tensor_bytes(t.weight(0));
  t.backward(1);
  FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
  const Snapshot stepped = snapshot(t);
  EXPECT_NE(stepped.bytes[0], initial) << "the step changed nothing";
  t.opt.reset();
  // The same level again: allowed, and the stored weights are kept bit for bit, where they were.
  t.create(FP8_OPTIMIZER_ADAMW);
  ASSERT_NE(t.opt, nullptr);
  EXPECT_EQ(stats_of(t.opt.get()).opt_level, 2);
  EXPECT_EQ(stats_of(t.opt.get()).steps, 0);
  expect_same_storage(snapshot(t), stepped, "a new optimizer on the same storage");
  // Another level while it lives: refused, naming both, nothing changed.
  for (int level : {3, 1, 0}) {
    SCOPED_TRACE(std::string("to ") + level_name(level));
    Recipe r = make_recipe(recipe_for_level(level));
    EXPECT_REFUSED_WORDS(fp8_convert_model(t.model.get(), r.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_convert_model",
                         "O2", level_name(level), "destroy");
    EXPECT_EQ(storage_level_of(t.model.get()), 2);
    expect_same_storage(snapshot(t), stepped, "the refused conversion");
  }
  fp8_convert_options_t back;
  fp8_convert_options_init(&back);
  back.to_fp8 = 0;
  EXPECT_REFUSED_WORDS(fp8_convert_model(t.model.get(), nullptr, &back), FP8_ERR_INVALID_STATE, "fp8_convert_model",
                       "O2", "te", "destroy");
  expect_same_storage(snapshot(t), stepped, "the refused conversion to high precision");
  // The same level with the other FP8 format would store the gradients as E4M3: refused as well.
  const std::string e4m3 = std::string(recipe_for_level(2)) + ", fp8_format=E4M3";
  Recipe other_format = make_recipe(e4m3.c_str());
  EXPECT_REFUSED_WORDS(fp8_convert_model(t.model.get(), other_format.get(), nullptr), FP8_ERR_INVALID_STATE,
                       "fp8_convert_model", "e4m3", "e5m2", "destroy");
  expect_same_storage(snapshot(t), stepped, "the refused conversion to E4M3 gradients");
  // The same level and format (another margin): goes through, in place.
  const std::string margin = std::string(recipe_for_level(2)) + ", margin=1";
  Recipe same = make_recipe(margin.c_str());
  FP8_ASSERT_OK(fp8_convert_model(t.model.get(), same.get(), nullptr));
  expect_same_storage(snapshot(t), stepped, "a conversion at the same level");
  // The optimizer still runs on that storage.
  t.backward(2);
  FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
  EXPECT_EQ(stats_of(t.opt.get()).steps, 1);
  EXPECT_EQ(data_of(t.weight(0)), stepped.data[0]);
  EXPECT_NE(tensor_bytes(t.weight(0)), stepped.bytes[0]) << "the step did not reach the weights";
  // Once it is gone, the conversion to O3 goes through and the next optimizer runs at O3.
  t.opt.reset();
  Recipe o3 = make_recipe(recipe_for_level(3));
  FP8_ASSERT_OK(fp8_convert_model(t.model.get(), o3.get(), nullptr));
  EXPECT_EQ(storage_level_of(t.model.get()), 3);
  EXPECT_EQ(dtype_of(t.weight(0)), FP8_DTYPE_E4M3);
  t.create(FP8_OPTIMIZER_ADAM);
  EXPECT_EQ(stats_of(t.opt.get()).opt_level, 3);
}

// Tensors whose bytes must agree with state the library keeps refuse direct writes, from the
// conversion on (with or without an optimizer), naming the way that keeps it: an FP8 gradient (its
// amax) at every level, O3's E4M3 weight (a copy of the model's F16 master), which
// fp8_model_write_parameter writes.
TEST(OptimLevelSelection, DirectWritesToAnFp8GradientOrAnO3WeightAreRefused) {
  for (int level : {1, 3}) {
    for (bool with_optimizer : {false, true}) {
      SCOPED_TRACE(std::string(level_name(level)) + (with_optimizer ? " with an optimizer" : " without optimizer"));
      TwoLinears t(recipe_for_level(level));
      if (with_optimizer) t.create(FP8_OPTIMIZER_ADAM);
      const int64_t n = kIn[0] * kOut[0];
      const std::vector<uint8_t> codes(static_cast<size_t>(n), 0x38);
      t.set_fp32_grads(4);
      const std::vector<uint8_t> before = download<uint8_t>(t.grad(0));
      const float before_si = scale_inv_of(t.grad(0));
      EXPECT_REFUSED_WORDS(fp8_tensor_copy_from_host(t.grad(0), codes.data(), codes.size()), FP8_ERR_INVALID_STATE,
                           "fp8_tensor_copy_from_host", "amax", "fp8_model_accumulate_grad");
      EXPECT_REFUSED_WORDS(fp8_tensor_set_scale_inv(t.grad(0), 2.0f), FP8_ERR_INVALID_STATE, "fp8_tensor_set_scale_inv",
                           "amax", "fp8_model_accumulate_grad");
      EXPECT_EQ(download<uint8_t>(t.grad(0)), before);
      EXPECT_EQ(bits_of(scale_inv_of(t.grad(0))), bits_of(before_si));
      if (level == 3) {
        const std::vector<uint8_t> w_before = download<uint8_t>(t.weight(0));
        const float w_si = scale_inv_of(t.weight(0));
        EXPECT_REFUSED_WORDS(fp8_tensor_copy_from_host(t.weight(0), codes.data(), codes.size()), FP8_ERR_INVALID_STATE,
                             "fp8_tensor_copy_from_host", "master", "fp8_model_write_parameter");
        EXPECT_REFUSED_WORDS(fp8_tensor_set_scale_inv(t.weight(0), 2.0f), FP8_ERR_INVALID_STATE,
                             "fp8_tensor_set_scale_inv", "master", "fp8_model_write_parameter");
        EXPECT_EQ(download<uint8_t>(t.weight(0)), w_before);
        EXPECT_EQ(bits_of(scale_inv_of(t.weight(0))), bits_of(w_si));
        // The way it names: the weight becomes the E4M3 copy of the new values (here all 0.875, whose
        // amax maps to 448 with scale 512: every code 448, scale_inv 2^-9).
        set_param(t.model.get(), "fc1.weight", std::vector<float>(static_cast<size_t>(n), 0.875f));
        EXPECT_EQ(bits_of(scale_inv_of(t.weight(0))), bits_of(1.0f / 512.0f));
        for (float v : decoded(t.weight(0))) ASSERT_EQ(v, 0.875f);
      } else {  // an F16 weight is the weight itself: writable
        const std::vector<uint16_t> half(static_cast<size_t>(n), 0x3C00);
        EXPECT_OK(fp8_tensor_copy_from_host(t.weight(0), half.data(), half.size() * 2));
        EXPECT_EQ(download<uint16_t>(t.weight(0)), half);
      }
    }
  }
}

// At te (level 0) two optimizers on one model are allowed, as before.
TEST(OptimLevelSelection, TeLevelAllowsSeveralOptimizers) {
  TwoLinears t(recipe_for_level(0));
  Optimizer a = make_optimizer(t.model.get(), FP8_OPTIMIZER_ADAM);
  Optimizer b = make_optimizer(t.model.get(), FP8_OPTIMIZER_SGD);
  EXPECT_NE(a, nullptr);
  EXPECT_NE(b, nullptr);
}

// Optimizers made on the unconverted model (te: FP32 storage) hold that storage: converting to an
// MS-AMP level is refused while any exists, naming both levels, and changes nothing (the layers stay
// unconverted; the optimizers go on running); once they are gone it goes through. An MS-AMP
// optimizer is then the model's only one; one that outlives its model refuses to run.
TEST(OptimLevelSelection, ALevelChangeNeedsNoOptimizerAndNoneOutlivesItsModel) {
  TwoLinears t(nullptr);
  Optimizer te = make_optimizer(t.model.get(), FP8_OPTIMIZER_ADAM);  // unconverted: te
  Optimizer te2 = make_optimizer(t.model.get(), FP8_OPTIMIZER_SGD);
  const Snapshot before = snapshot(t);
  Recipe r = make_recipe(recipe_for_level(2));
  for (int alive = 2; alive >= 1; --alive) {
    SCOPED_TRACE(std::to_string(alive) + " optimizer(s)");
    EXPECT_REFUSED_WORDS(fp8_convert_model(t.model.get(), r.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_convert_model",
                         "O2", "te", std::to_string(alive) + " optimizer(s)", "destroy them");
    EXPECT_EQ(storage_level_of(t.model.get()), 0);
    expect_same_storage(snapshot(t), before, "the refused conversion");
    int32_t has = -1;
    EXPECT_OK(fp8_model_has_fp8_layers(t.model.get(), &has));
    EXPECT_EQ(has, 0) << "the refused conversion converted layers";
    te2.reset();
  }
  t.backward(1);
  FP8_ASSERT_OK(fp8_optimizer_step(te.get()));
  EXPECT_EQ(stats_of(te.get()).steps, 1);
  te.reset();
  const Params w = t.weights();  // FP32, after the te step
  FP8_ASSERT_OK(fp8_convert_model(t.model.get(), r.get(), nullptr));
  EXPECT_EQ(storage_level_of(t.model.get()), 2);
  EXPECT_EQ(dtype_of(t.weight(0)), FP8_DTYPE_F16);
  for (int k = 0; k < 2; ++k) {
    std::vector<uint16_t> want;
    for (float f : w[static_cast<size_t>(k)]) want.push_back(fp8::float_to_f16(f));
    EXPECT_EQ(download<uint16_t>(t.weight(k)), want) << "the conversion rounds the current FP32 weights to F16";
  }
  t.create(FP8_OPTIMIZER_ADAM);
  ASSERT_NE(t.opt, nullptr);
  fp8_optimizer_t* o = nullptr;
  EXPECT_REFUSED_WORDS(fp8_optimizer_create(&o, t.model.get(), FP8_OPTIMIZER_ADAMW), FP8_ERR_INVALID_STATE,
                       "fp8_optimizer_create", "O2", "destroy");
  EXPECT_EQ(o, nullptr);
  t.model.reset();  // destroyed before its optimizer
  EXPECT_REFUSED_WORDS(fp8_optimizer_step(t.opt.get()), FP8_ERR_INVALID_STATE, "fp8_optimizer_step", "destroyed");
  EXPECT_REFUSED_WORDS(fp8_optimizer_zero_grad(t.opt.get()), FP8_ERR_INVALID_STATE, "fp8_optimizer_zero_grad",
                       "destroyed");
}

// What an optimizer whose model was destroyed first still does (fp8.h: destroy it before the model;
// the model's destructor unlinks it): what concerns only the optimizer's own state works
// (fp8_optimizer_set_float / get_float, with the usual range checks, and fp8_optimizer_get_stats,
// which reports the steps it made); every call that would touch the model (step, step_joint,
// zero_grad, and a checkpoint with that optimizer, even for another live model) is refused with
// FP8_ERR_INVALID_STATE, naming the cause and the fix, and changes nothing. Then it is destroyed
// cleanly (the sanitizer build checks the memory). At te and O1..O3, SGD at O1 with its momentum set
// only after the model is gone (no state is allocated for it then).
TEST(OptimLevelSelection, AnOptimizerOutlivingItsModelKeepsItsOwnStateAndRefusesTheModelsWork) {
  struct Case {
    int level;
    fp8_optimizer_kind_t kind;
  };
  for (const Case c : {Case{0, FP8_OPTIMIZER_ADAM}, Case{1, FP8_OPTIMIZER_SGD}, Case{2, FP8_OPTIMIZER_ADAM},
                       Case{3, FP8_OPTIMIZER_ADAMW}}) {
    SCOPED_TRACE(std::string(level_name(c.level)) + " kind " + std::to_string(c.kind));
    TwoLinears t(recipe_for_level(c.level));
    t.create(c.kind);
    ASSERT_NE(t.opt, nullptr);
    fp8_optimizer_t* o = t.opt.get();
    Hyper h;
    h.kind = c.kind;
    h.lr = 0.01;
    apply(o, h);
    t.backward(1);
    FP8_ASSERT_OK(fp8_optimizer_step(o));
    const fp8_optimizer_stats_t before = stats_of(o);
    ASSERT_EQ(before.steps, 1);
    ASSERT_EQ(before.opt_level, c.level);

    t.model.reset();  // destroyed before its optimizer

    // The optimizer's own state.
    EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_LR, 0.5));
    double lr = -1.0;
    EXPECT_OK(fp8_optimizer_get_float(o, FP8_OPTIM_LR, &lr));
    EXPECT_EQ(lr, 0.5);
    EXPECT_REFUSED_WORDS(fp8_optimizer_set_float(o, FP8_OPTIM_LR, -1.0), FP8_ERR_INVALID_ARGUMENT,
                         "fp8_optimizer_set_float", "FP8_OPTIM_LR", ">= 0");
    EXPECT_OK(fp8_optimizer_get_float(o, FP8_OPTIM_LR, &lr));
    EXPECT_EQ(lr, 0.5) << "a refused value was kept";
    if (c.kind == FP8_OPTIMIZER_SGD) EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_MOMENTUM, 0.9));
    fp8_optimizer_stats_t s = stats_of(o);
    EXPECT_EQ(s.steps, before.steps);
    EXPECT_EQ(s.skipped_steps, before.skipped_steps);
    EXPECT_EQ(bits_of(s.last_grad_norm), bits_of(before.last_grad_norm));
    EXPECT_EQ(s.parameters, before.parameters);
    EXPECT_EQ(s.state_bytes, before.state_bytes) << "no state is allocated for a model that is gone";
    EXPECT_EQ(s.opt_level, before.opt_level);
    EXPECT_EQ(s.training_bytes, before.training_bytes);

    // What needs the model.
    const char* words[] = {"the optimizer's model was destroyed", "destroy the optimizer first"};
    EXPECT_REFUSED_WORDS(fp8_optimizer_step(o), FP8_ERR_INVALID_STATE, "fp8_optimizer_step", words[0], words[1]);
    Tensor other_sumsq = make_tensor(t.ctx.get(), FP8_DTYPE_F32, {1});
    Tensor clip = make_tensor(t.ctx.get(), FP8_DTYPE_F32, {1});
    upload(other_sumsq.get(), std::vector<float>{1.0f});
    upload(clip.get(), std::vector<float>{-3.0f});
    EXPECT_REFUSED_WORDS(fp8_optimizer_step_joint(o, other_sumsq.get(), clip.get()), FP8_ERR_INVALID_STATE,
                         "fp8_optimizer_step_joint", words[0], words[1]);
    EXPECT_EQ(download<float>(clip.get()), std::vector<float>{-3.0f}) << "a refused joint step wrote clip_coef";
    EXPECT_REFUSED_WORDS(fp8_optimizer_zero_grad(o), FP8_ERR_INVALID_STATE, "fp8_optimizer_zero_grad", words[0],
                         words[1]);
    EXPECT_EQ(stats_of(o).steps, before.steps) << "a refused step counted";

    // A checkpoint with it, even for a live model of the same shape, is refused before any file work.
    TwoLinears live(recipe_for_level(c.level));
    const std::string path = ::testing::TempDir() + "fp8_orphan_optimizer_" + level_name(c.level) + ".ckpt";
    std::remove(path.c_str());
    EXPECT_REFUSED_WORDS(fp8_checkpoint_save(live.model.get(), o, path.c_str(), 0), FP8_ERR_INVALID_STATE,
                         "fp8_checkpoint_save", words[0], words[1]);
    std::FILE* f = std::fopen(path.c_str(), "rb");
    EXPECT_EQ(f, nullptr) << "a refused save wrote " << path;
    if (f) std::fclose(f);
    const Snapshot live_before = snapshot(live);
    EXPECT_REFUSED_WORDS(fp8_checkpoint_load(live.model.get(), o, path.c_str()), FP8_ERR_INVALID_STATE,
                         "fp8_checkpoint_load", words[0], words[1]);
    expect_same_storage(snapshot(live), live_before, "a refused load");

    t.opt.reset();  // after its model: no use of the model's freed memory (ASan / valgrind)
  }
}

// The layers use the storage the conversion made: an FP8 forward right after the conversion gives
// what a te model with the same FP32 weights gives, within the weights' rounding to F16 or E4M3;
// fp8_optimizer_create changes nothing of it (the bits of a twin without optimizer); and after
// fp8_model_write_parameter (here the weights negated) the next forward uses the new values, not
// the layers' earlier weight copies.
TEST(OptimLevelSelection, AForwardRightAfterTheConversionUsesTheLevelsStorage) {
  const std::vector<float> xh = randn(static_cast<size_t>(kRows * kIn[0]), 77, 1.0f);
  auto forward = [&](TwoLinears& m) {
    Tensor x = make_tensor(m.ctx.get(), FP8_DTYPE_F32, {kRows, kIn[0]});
    Tensor y = make_tensor(m.ctx.get(), FP8_DTYPE_F32, {kRows, kOut[0]});
    upload(x.get(), xh);
    EXPECT_OK(fp8_autocast_begin(m.model.get()));
    EXPECT_OK(forward_only(m.model.get(), 0, x.get(), y.get()));
    EXPECT_OK(fp8_autocast_end(m.model.get()));
    return download<float>(y.get());
  };
  // ||a - sign * b|| / ||b||
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b, double sign) {
    double num = 0, den = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      num += std::pow(a[i] - sign * b[i], 2);
      den += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(num / den);
  };
  TwoLinears te(recipe_for_level(0));
  const std::vector<float> reference = forward(te);
  for (int level : {1, 2, 3}) {
    SCOPED_TRACE(level_name(level));
    TwoLinears t(recipe_for_level(level)), twin(recipe_for_level(level));
    t.create(FP8_OPTIMIZER_ADAM);
    const std::vector<float> converted = forward(t);
    EXPECT_EQ(converted, forward(twin)) << "fp8_optimizer_create changed what the forward reads";
    // E4M3 x and weight: ~3% normwise per operand; a stale scale is off by orders of magnitude.
    EXPECT_LT(rel(converted, reference, 1.0), 0.1) << "the forward at the level differs from te's";
    std::vector<float> negated = t.w32[0];
    for (float& f : negated) f = -f;
    set_param(t.model.get(), "fc1.weight", negated);
    EXPECT_LT(rel(forward(t), reference, -1.0), 0.1)
        << "the forward after fp8_model_write_parameter used stale weights";
  }
}

// =================================================================================================
// 2. Each level's update against float64, with a per-element budget derived from the storage
// =================================================================================================


// How a level stores what the update reads back next step (relative half-ulp, and the absolute floor
// as a fraction of the tensor's scaled range where the format has one).
struct Storage {
  double p_rel, p_floor;  // the weight the next step starts from (F16 master / value, or F32)
  double m_rel, m_floor;  // m: E4M3 with a per-tensor scale (floor: 2^-10 of bound/448), or F32
  double v_rel;           // v: F16 with a per-tensor scale, or F32
  bool visible_e4m3;      // O3: the tensor the user reads is E4M3 of the master (delayed scale)
};
Storage storage_of(int level) {
  const double f32 = 1.0 / 16777216;  // 2^-24
  switch (level) {
    case 0: return {f32, 0.0, f32, 0.0, f32, false};
    case 1: return {kF16Rel, kF16Floor, f32, 0.0, f32, false};
    case 2: return {kF16Rel, kF16Floor, kE4M3Rel, kE4M3Floor, kF16Rel, false};
    default: return {kF16Rel, kF16Floor, kE4M3Rel, kE4M3Floor, kF16Rel, true};
  }
}

// The formulas of fp8.h in float64 (Adam, AdamW, SGD with momentum; no clipping), and next to each
// element a bound on |library - float64| that follows the library's storage through the steps:
//   m~_t = b1 Q(m~_{t-1}) + (1-b1) g      => E_m,t <= b1 (E_m,t-1 + m_rel (|m_{t-1}| + E_m,t-1) + floor)
//   v~_t likewise with v_rel;
//   u = a m / (sqrt(v) ibc2 + eps)          => |u~ - u| <= a (E_m / D_lo + |m| (D_hi - D_lo) / (D_lo D))
//   p~_t = Q_p(p~_{t-1} decay - u~)        => E_p,t <= decay E_p,t-1 + |u~ - u| + p_rel |p~_t| + floor
// plus 1e-6 of each quantity for the float arithmetic. `bug` runs a deliberately wrong rule:
// 1 = no bias corrections, 2 = the update added instead of subtracted.
struct Budget64 {
  Params64 p, m, v, ep, em, ev;
  std::vector<double> m_amax;  // largest |m| of each tensor (for the E4M3 floor)
  int64_t t = 0;
  Storage st;
  int bug = 0;

  Budget64(const Params& init, Storage s, int bug_ = 0) : st(s), bug(bug_) {
    for (const auto& x : init) {
      p.emplace_back(x.begin(), x.end());
      for (Params64* z : {&m, &v, &ep, &em, &ev}) z->emplace_back(x.size(), 0.0);
    }
    m_amax.assign(init.size(), 0.0);
  }

  void step(const Params& g, const Hyper& h) {
    ++t;
    const bool sgd = h.kind == FP8_OPTIMIZER_SGD;
    const double bc1 = bug == 1 || sgd ? 1.0 : 1.0 - std::pow(h.beta1, static_cast<double>(t));
    const double bc2 = bug == 1 || sgd ? 1.0 : 1.0 - std::pow(h.beta2, static_cast<double>(t));
    const double a = (bug == 2 ? -1.0 : 1.0) * h.lr / bc1, ibc2 = 1.0 / std::sqrt(bc2);
    const double decay = h.kind == FP8_OPTIMIZER_ADAMW ? 1.0 - h.lr * h.weight_decay : 1.0;
    for (size_t k = 0; k < p.size(); ++k) {
      const double g_amax = amax_of(g[k]);
      const double m_bound = sgd ? h.momentum * m_amax[k] + g_amax
                                 : h.beta1 * m_amax[k] * (1.0 + st.m_rel) + (1.0 - h.beta1) * g_amax;
      double new_m_amax = 0.0;
      for (size_t i = 0; i < p[k].size(); ++i) {
        const double gi = g[k][i];
        double u, eu;
        if (sgd) {
          // b = momentum b + g (b = g the first time); the buffer is F32 at O1.
          em[k][i] = h.momentum * (em[k][i] + 1e-6 * std::fabs(m[k][i]));
          m[k][i] = h.momentum > 0.0 ? h.momentum * m[k][i] + gi : gi;
          u = a * m[k][i];
          eu = a * em[k][i] + 1e-6 * std::fabs(u);
        } else {
          const double qm = st.m_rel * (std::fabs(m[k][i]) + em[k][i]) + st.m_floor * m_bound / 448.0;
          em[k][i] = h.beta1 * (em[k][i] + qm) + 1e-6 * std::fabs(m[k][i]);
          ev[k][i] = h.beta2 * (ev[k][i] + st.v_rel * (v[k][i] + ev[k][i])) + 1e-6 * v[k][i];
          m[k][i] = h.beta1 * m[k][i] + (1.0 - h.beta1) * gi;
          v[k][i] = h.beta2 * v[k][i] + (1.0 - h.beta2) * gi * gi;
          // The m used by this step carries em; after this step it is quantised (counted next step).
          const double D = std::sqrt(v[k][i]) * ibc2 + h.eps;
          const double D_lo = std::sqrt(std::max(v[k][i] - ev[k][i], 0.0)) * ibc2 + h.eps;
          const double D_hi = std::sqrt(v[k][i] + ev[k][i]) * ibc2 + h.eps;
          u = a * m[k][i] / D;
          eu = std::fabs(a) * (em[k][i] / D_lo + std::fabs(m[k][i]) * (D_hi - D_lo) / (D_lo * D)) + 1e-6 * std::fabs(u);
        }
        new_m_amax = std::max(new_m_amax, std::fabs(m[k][i]));
        p[k][i] = p[k][i] * decay - u;
        ep[k][i] = decay * ep[k][i] + eu + st.p_rel * (std::fabs(p[k][i]) + ep[k][i]) + st.p_floor +
                   1e-7 * std::fabs(p[k][i]);
      }
      m_amax[k] = new_m_amax;
    }
  }

  // The budget of the value the user reads: at O3 the E4M3 copy of the master, scaled by the master's
  // amax before this step (`prev_amax`: the float64 amax and its own uncertainty): E4M3 rounding,
  // its subnormal floor, and saturation of a master that grew past that amax.
  double visible_budget(size_t k, size_t i, double prev_amax, double prev_amax_err) const {
    double b = ep[k][i];
    if (!st.visible_e4m3) return b;
    const double mag = std::fabs(p[k][i]) + ep[k][i];
    b += kE4M3Rel * mag + kE4M3Floor * (prev_amax + prev_amax_err) / 448.0;
    b += std::max(0.0, mag - (prev_amax - prev_amax_err) * (1.0 - 1e-6));
    return b * (1.0 + 1e-6);
  }
};

struct Compare {
  double worst_ratio = 0.0;   // max over elements of |got - want| / budget
  double rel_weight = 0.0;    // max over tensors of ||got - want|| / ||want||
  double rel_step = 0.0;      // max over tensors of ||got - want|| / ||want - init||
  int64_t over = 0, total = 0;
};
Compare compare(const Params& got, const Budget64& ref, const Params& init, const std::vector<double>& prev_amax,
                const std::vector<double>& prev_amax_err) {
  Compare c;
  for (size_t k = 0; k < got.size(); ++k) {
    double num = 0.0, den = 0.0, disp = 0.0;
    for (size_t i = 0; i < got[k].size(); ++i) {
      const double d = static_cast<double>(got[k][i]) - ref.p[k][i];
      const double b = ref.visible_budget(k, i, prev_amax[k], prev_amax_err[k]);
      c.worst_ratio = std::max(c.worst_ratio, std::fabs(d) / b);
      c.over += std::fabs(d) > b;
      ++c.total;
      num += d * d;
      den += ref.p[k][i] * ref.p[k][i];
      disp += std::pow(ref.p[k][i] - init[k][i], 2);
    }
    c.rel_weight = std::max(c.rel_weight, std::sqrt(num / den));
    c.rel_step = std::max(c.rel_step, std::sqrt(num / disp));
  }
  return c;
}

struct LevelRunCase {
  int level;
  fp8_optimizer_kind_t kind;
};
class OptimLevelVsFloat64 : public ::testing::TestWithParam<LevelRunCase> {};

// Four Adam / AdamW steps at each level: the first on an FP32 gradient added before the optimizer
// exists (fp8_model_accumulate_grad: requantised into the level's FP8 gradient), the others on
// gradients of a backward. Every element must lie within its
// budget (Budget64); the same library run must break the budget of a float64 run without bias
// corrections and of one with the update's sign flipped, on most elements.
TEST_P(OptimLevelVsFloat64, EveryElementWithinTheStorageBudgetAndBrokenRulesFail) {
  const LevelRunCase pc = GetParam();
  Hyper h;
  h.kind = pc.kind;
  h.weight_decay = pc.kind == FP8_OPTIMIZER_ADAMW ? 0.05 : 0.0;
  const double lrs[] = {0.02, 0.01, 0.03, 0.015};

  TwoLinears t(recipe_for_level(pc.level));
  const Params g_fp32 = t.set_fp32_grads(7);
  const Params master0 = t.f16_weights();
  t.create(pc.kind);
  apply(t.opt.get(), h);
  ASSERT_EQ(stats_of(t.opt.get()).opt_level, pc.level);

  // The added gradient: each element within E5M2's half-ulp of the FP32 one (scale_inv maps
  // the amax to 57344, so the subnormal floor is 2^-17 scale_inv).
  Params g = t.grads();
  for (int k = 0; k < 2; ++k) {
    if (pc.level == 0) {
      EXPECT_EQ(g[k], g_fp32[k]);
      continue;
    }
    const float si = scale_inv_of(t.grad(k));
    EXPECT_NEAR(si, amax_of(g_fp32[k]) / 57344.0f, 1e-6f * si);
    // Bit for bit: the requantising accumulation onto an empty gradient, scale = 57344 / amax(g).
    const float scale = 57344.0f / amax_of(g_fp32[k]);
    EXPECT_EQ(bits_of(si), bits_of(1.0f / scale));
    const std::vector<uint8_t> codes = download<uint8_t>(t.grad(k));
    size_t diff = 0;
    while (diff < codes.size() && codes[diff] == fp8::encode_fp8(g_fp32[k][diff] * scale, true)) ++diff;
    EXPECT_EQ(diff, codes.size()) << "added gradient: first code that differs";
    double worst = 0.0;
    for (size_t i = 0; i < g[k].size(); ++i) {
      const double err = std::fabs(static_cast<double>(g[k][i]) - g_fp32[k][i]);
      worst = std::max(worst, err / (kE5M2Rel * std::fabs(g_fp32[k][i]) + kE5M2Floor * 57344.0 * si));
    }
    EXPECT_LE(worst, 1.0) << "added gradient of tensor " << k;
  }

  // The float64 run starts where the library's update starts: the weights as stored, i.e. the F16
  // master at O3 (the E4M3 weight the user reads is a rounding of it).
  const Params init = pc.level == 3 ? master0 : t.weights();
  if (pc.level == 1 || pc.level == 2) {
    EXPECT_EQ(init, master0) << "conversion rounds the FP32 weights to F16";
  }
  const Storage st = storage_of(pc.level);
  Budget64 ref(init, st), no_bc(init, st, 1), flipped(init, st, 2);
  Compare last;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step + 1));
    if (step > 0) {
      FP8_ASSERT_OK(fp8_optimizer_zero_grad(t.opt.get()));
      t.backward(static_cast<uint32_t>(step));
      g = t.grads();
    }
    for (const auto& gk : g) ASSERT_GT(amax_of(gk), 0.0f);
    // The O3 weight's scale: the master's amax before this step (the float64 amax, give or take the
    // master's budget).
    std::vector<double> prev_amax, prev_err;
    for (size_t k = 0; k < ref.p.size(); ++k) {
      double a = 0.0, e = 0.0;
      for (size_t i = 0; i < ref.p[k].size(); ++i) a = std::max(a, std::fabs(ref.p[k][i])), e = std::max(e, ref.ep[k][i]);
      prev_amax.push_back(a);
      prev_err.push_back(e);
    }
    h.lr = lrs[step];
    FP8_ASSERT_OK(fp8_optimizer_set_float(t.opt.get(), FP8_OPTIM_LR, h.lr));
    FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
    ref.step(g, h);
    no_bc.step(g, h);
    flipped.step(g, h);
    const Params got = t.weights();
    last = compare(got, ref, init, prev_amax, prev_err);
    EXPECT_EQ(last.over, 0) << "elements outside their budget; worst |err|/budget " << last.worst_ratio;
    const Compare bad1 = compare(got, no_bc, init, prev_amax, prev_err);
    const Compare bad2 = compare(got, flipped, init, prev_amax, prev_err);
    // A step moves every weight by about lr (Adam), well beyond the budget, so a broken rule puts most
    // elements out (the bias correction matters less as t grows: 1 - 0.9^4 = 0.34).
    EXPECT_GT(bad1.over, bad1.total / 2) << "the budget would accept Adam without bias correction";
    EXPECT_GT(bad2.over, bad2.total / 2) << "the budget would accept the update with its sign flipped";
    const fp8_optimizer_stats_t s = stats_of(t.opt.get());
    EXPECT_EQ(s.steps, step + 1);
    EXPECT_EQ(s.last_skipped, 0);
  }
  // Whole-tensor figures. F16 weights: each step rounds to 2^-11 relative, so after 4 steps the
  // relative error is below 4 * 2^-11 ~ 2e-3 (and much less in rms). With E4M3 m (O2/O3) the update
  // of steps 2..4 reads m with up to 2^-4 relative error (rms ~2^-4/sqrt(3) for uniform rounding),
  // times b1 = 0.9: the displacement's rms relative error stays below 2^-4. At O3 the visible weight
  // itself is E4M3: its relative error is at most 2^-4 per element (saturation aside).
  std::printf("[ %s %s ] worst |err|/budget %.3f, ||err||/||w|| %.3g, ||err||/||w - w0|| %.3g\n",
              level_name(pc.level), pc.kind == FP8_OPTIMIZER_ADAM ? "Adam " : "AdamW", last.worst_ratio,
              last.rel_weight, last.rel_step);
  RecordProperty("rel_weight", std::to_string(last.rel_weight));
  RecordProperty("rel_step", std::to_string(last.rel_step));
  if (pc.level <= 1) {
    EXPECT_LT(last.rel_weight, pc.level == 0 ? 1e-6 : 4 * kF16Rel);
    EXPECT_LT(last.rel_step, pc.level == 0 ? 1e-5 : 0.02);
  } else if (pc.level == 2) {
    EXPECT_LT(last.rel_weight, 4 * kF16Rel + 0.05 * kE4M3Rel);
    EXPECT_LT(last.rel_step, kE4M3Rel);
  } else {
    EXPECT_LT(last.rel_weight, kE4M3Rel);
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, OptimLevelVsFloat64,
                         ::testing::Values(LevelRunCase{0, FP8_OPTIMIZER_ADAM}, LevelRunCase{1, FP8_OPTIMIZER_ADAM},
                                           LevelRunCase{1, FP8_OPTIMIZER_ADAMW}, LevelRunCase{2, FP8_OPTIMIZER_ADAM},
                                           LevelRunCase{2, FP8_OPTIMIZER_ADAMW}, LevelRunCase{3, FP8_OPTIMIZER_ADAM},
                                           LevelRunCase{3, FP8_OPTIMIZER_ADAMW}),
                         [](const ::testing::TestParamInfo<LevelRunCase>& i) {
                           return std::string(level_name(i.param.level)) +
                                  (i.param.kind == FP8_OPTIMIZER_ADAM ? "Adam" : "AdamW");
                         });

// O3 keeps an F16 master (the model's, made by the conversion): steps much smaller than the E4M3 weight's resolution
// still add up. 60 Adam steps of lr 2e-3 on one fixed gradient move each weight by ~0.12, about two
// E4M3 steps at |w| ~ 0.5 (whose ulp is 2^-4 there), while each single step is 1/30 of that ulp: an
// optimizer that updated the E4M3 weight itself would leave it where it was.
TEST(OptimLevelO3, SmallStepsAccumulateInTheMaster) {
  TwoLinears t(recipe_for_level(3));
  t.set_fp32_grads(3);
  const Params master0 = t.f16_weights();
  t.create(FP8_OPTIMIZER_ADAM);
  Hyper h;
  h.lr = 2e-3;
  apply(t.opt.get(), h);
  const Params init = t.weights(), g = t.grads();
  Budget64 ref(master0, storage_of(3));
  for (int s = 0; s < 60; ++s) {
    FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));  // the gradient stays: no zero_grad
    ref.step(g, h);
  }
  const Params got = t.weights();
  double moved = 0.0, ref_moved = 0.0, err = 0.0;
  int64_t changed = 0, total = 0;
  for (size_t k = 0; k < got.size(); ++k)
    for (size_t i = 0; i < got[k].size(); ++i) {
      moved += std::pow(static_cast<double>(got[k][i]) - init[k][i], 2);
      ref_moved += std::pow(ref.p[k][i] - master0[k][i], 2);
      err += std::pow(got[k][i] - ref.p[k][i], 2);
      changed += got[k][i] != init[k][i];
      ++total;
    }
  std::printf("[ O3 master ] ||w - w0|| %.4f (float64 %.4f), ||err||/||w_ref - w0|| %.3f, %lld of %lld changed\n",
              std::sqrt(moved), std::sqrt(ref_moved), std::sqrt(err / ref_moved), static_cast<long long>(changed),
              static_cast<long long>(total));
  EXPECT_GT(changed, total * 3 / 4);
  // The visible weights follow the float64 run up to E4M3 rounding (rms ~2^-4/sqrt(3) of |w|, about a
  // quarter of the displacement here), not stuck at w0 (which would be an error of 1.0).
  EXPECT_LT(std::sqrt(err / ref_moved), 0.5);
  EXPECT_NEAR(std::sqrt(moved / ref_moved), 1.0, 0.25);
}

// =================================================================================================
// 3. Bytes, FP8 gradient accumulation, and poisoned gradients
// =================================================================================================

// training_bytes = values + masters + gradients + m + v as stored: per weight 4+4+4+4 (te),
// 2+1+4+4 (O1), 2+1+1+2 (O2), 1+2+1+1+2 (O3); FP32 parameters (biases, norms) 16 at every level.
TEST(OptimLevelBytes, TrainingBytesPerParameterAtEachLevel) {
  const int64_t per_weight[] = {16, 11, 6, 7};
  const int64_t state_per_weight[] = {8, 8, 3, 3};
  for (int level = 0; level <= 3; ++level) {
    SCOPED_TRACE(level_name(level));
    for (fp8_optimizer_kind_t kind : {FP8_OPTIMIZER_ADAM, FP8_OPTIMIZER_ADAMW}) {
      TwoLinears t(recipe_for_level(level));
      t.create(kind);
      const fp8_optimizer_stats_t s = stats_of(t.opt.get());
      const int64_t P = 96 * 64 + 64 * 32;
      EXPECT_EQ(s.parameters, P);
      EXPECT_EQ(s.training_bytes, per_weight[level] * P);
      EXPECT_EQ(s.state_bytes, state_per_weight[level] * P);
    }
    // With a bias, a LayerNorm and a bias-free Linear: W weights at the level's cost, F FP32 ones at 16.
    Context ctx = make_context(FP8_DEVICE_CPU);
    Model model = make_model(ctx.get());
    fp8_model_t* m = model.get();
    FP8_ASSERT_OK(fp8_model_add_linear(m, "fc1", 64, 48, 1, nullptr));
    FP8_ASSERT_OK(fp8_model_add_layernorm(m, "ln", 48, 1e-5f, nullptr));
    FP8_ASSERT_OK(fp8_model_add_linear(m, "fc2", 48, 32, 1, nullptr));
    upload(param_tensor(m, "fc1.weight"), randn(64 * 48, 1, 0.2f));
    Recipe r = make_recipe(recipe_for_level(level));
    FP8_ASSERT_OK(fp8_convert_model(m, r.get(), nullptr));
    Optimizer o = make_optimizer(m, FP8_OPTIMIZER_ADAM);
    const int64_t W = 64 * 48 + 48 * 32, F = 48 + 48 + 48 + 32;
    const fp8_optimizer_stats_t s = stats_of(o.get());
    EXPECT_EQ(s.parameters, W + F);
    EXPECT_EQ(s.training_bytes, per_weight[level] * W + 16 * F);
    EXPECT_EQ(s.state_bytes, state_per_weight[level] * W + 8 * F);
  }
}

// SGD at O1 (msamp O1, or auto O2, whose storage is O1's): F16 values and FP8 gradients (3 bytes per
// weight) until momentum needs its F32 buffer (+4).
TEST(OptimLevelBytes, SgdAtO1AddsTheMomentumBufferOnFirstUse) {
  for (const char* recipe : {recipe_for_level(1), "backend=auto, opt_level=O2"}) {
    SCOPED_TRACE(recipe);
    TwoLinears t(recipe);
    t.set_fp32_grads(1);
    t.create(FP8_OPTIMIZER_SGD);
    EXPECT_EQ(stats_of(t.opt.get()).opt_level, 1);
    const int64_t P = 96 * 64 + 64 * 32;
    EXPECT_EQ(stats_of(t.opt.get()).training_bytes, 3 * P);
    EXPECT_EQ(stats_of(t.opt.get()).state_bytes, 0);
    FP8_ASSERT_OK(fp8_optimizer_set_float(t.opt.get(), FP8_OPTIM_MOMENTUM, 0.9));
    FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
    EXPECT_EQ(stats_of(t.opt.get()).training_bytes, 7 * P);
    EXPECT_EQ(stats_of(t.opt.get()).state_bytes, 4 * P);
  }
}

// Two micro-batches into one FP8 gradient. The data are multiples of 1/16 with small integer
// numerators, so each dW = dy^T x is exact in float; the backward rounds it to BF16 (b(dW)) before
// adding where its GEMM writes BF16 (b = identity with F32 activations), and the expected codes
// follow bit for bit:
//   after the first:  scale1 = fp8_max / amax(b(dW1)),                q1 = encode(b(dW1) * scale1)
//   after the second: scale2 = fp8_max / (amax(q1) + amax(b(dW2))), q2 = encode((q1/scale1 + b(dW2)) * scale2)
// and the decoded sum is within the format's half-ulp of dW1 (first rounding) plus that of the sum,
// plus BF16's half-ulp of each addend.
class OptimLevelGradAccumulation : public ::testing::TestWithParam<const char*> {};

// Floats into an F32 tensor, or rounded to nearest even into a BF16 one.
void upload_as(fp8_tensor_t* t, const std::vector<float>& v, fp8_dtype_t dt) {
  if (dt == FP8_DTYPE_F32) return upload(t, v);
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = fp8::float_to_bf16(v[i]);
  upload(t, h);
}

// (`act`: the activations' dtype; the layer runs in high precision, so dW is exact in float and
// the backward rounds it to BF16 where its GEMM writes BF16: BF16 activations; F32 ones give F32.)
void two_micro_batches(const char* format, fp8_dtype_t act) {
  SCOPED_TRACE(act == FP8_DTYPE_BF16 ? "bf16 activations" : "f32 activations");
  const bool e5m2 = std::string(format) == "HYBRID";
  const double fmax = e5m2 ? 57344.0 : 448.0, rel = e5m2 ? kE5M2Rel : kE4M3Rel, floor = e5m2 ? kE5M2Floor : kE4M3Floor;
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  fp8_model_t* m = model.get();
  const int64_t in = 32, out = 16, rows = 16;
  FP8_ASSERT_OK(fp8_model_add_linear(m, "fc", in, out, 0, nullptr));
  upload(param_tensor(m, "fc.weight"), randn(static_cast<size_t>(in * out), 5, 0.3f));
  const std::string text = std::string("backend=msamp, opt_level=O2, fp8_format=") + format;
  Recipe r = make_recipe(text.c_str());
  FP8_ASSERT_OK(fp8_convert_model(m, r.get(), nullptr));
  Optimizer o = make_optimizer(m, FP8_OPTIMIZER_ADAM);
  fp8_tensor_t* grad = param_tensor(m, "fc.weight", true);
  ASSERT_EQ(dtype_of(grad), e5m2 ? FP8_DTYPE_E5M2 : FP8_DTYPE_E4M3);

  std::mt19937 rng(11);
  std::uniform_int_distribution<int> num(1, 8), sign(0, 1);
  auto small = [&](size_t n, float unit) {  // non-zero k * unit, |k| in 1..8
    std::vector<float> v(n);
    for (float& f : v) f = static_cast<float>(num(rng) * (sign(rng) ? 1 : -1)) * unit;
    return v;
  };
  std::vector<std::vector<float>> dws, added;  // dW exact, and as the backward adds it
  for (int mb = 0; mb < 2; ++mb) {
    const std::vector<float> x = small(static_cast<size_t>(rows * in), 0.0625f);
    const std::vector<float> dy = small(static_cast<size_t>(rows * out), 0.0625f);
    Tensor xt = make_tensor(ctx.get(), act, {rows, in});
    Tensor yt = make_tensor(ctx.get(), act, {rows, out});
    Tensor dyt = make_tensor(ctx.get(), act, {rows, out});
    upload_as(xt.get(), x, act);  // (k/16: exact in BF16 too)
    upload_as(dyt.get(), dy, act);
    FP8_ASSERT_OK(fp8_layer_forward(m, 0, xt.get(), yt.get()));
    FP8_ASSERT_OK(fp8_layer_backward(m, 0, dyt.get(), nullptr));
    std::vector<float> dw(static_cast<size_t>(out * in), 0.0f);
    for (int64_t o_ = 0; o_ < out; ++o_)
      for (int64_t i = 0; i < in; ++i) {
        double s = 0.0;
        for (int64_t r_ = 0; r_ < rows; ++r_) s += static_cast<double>(dy[r_ * out + o_]) * x[r_ * in + i];
        dw[static_cast<size_t>(o_ * in + i)] = static_cast<float>(s);  // exact: 16 terms of k/256 or k/64
      }
    dws.push_back(dw);
    if (act == FP8_DTYPE_BF16)
      for (float& v : dw) v = fp8::bf16_to_float(fp8::float_to_bf16(v));
    added.push_back(dw);
  }
  // The expected codes, step by step.
  const float scale1 = static_cast<float>(fmax / amax_of(added[0]));
  std::vector<uint8_t> q1(added[0].size());
  float amax1 = 0.0f;
  for (size_t i = 0; i < q1.size(); ++i) {
    q1[i] = fp8::encode_fp8(added[0][i] * scale1, e5m2);
    amax1 = std::max(amax1, std::fabs(fp8::dequantize_fp8(q1[i], e5m2, 1.0f / scale1)));
  }
  const float scale2 = static_cast<float>(fmax) / (amax1 + amax_of(added[1]));
  std::vector<uint8_t> q2(q1.size());
  for (size_t i = 0; i < q2.size(); ++i)
    q2[i] = fp8::encode_fp8((fp8::dequantize_fp8(q1[i], e5m2, 1.0f / scale1) + added[1][i]) * scale2, e5m2);
  EXPECT_EQ(download<uint8_t>(grad), q2);
  EXPECT_EQ(bits_of(scale_inv_of(grad)), bits_of(1.0f / scale2));
  const std::vector<float> after_two = decoded(grad);

  // Against the float64 sum: within rel * |dW1| (the first requantisation) + rel * |dW1 + dW2| (the
  // second) + the subnormal floors, element by element; and not the second micro-batch alone.
  const std::vector<float>& got = after_two;
  double worst = 0.0, num2 = 0.0, den2 = 0.0, alone2 = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double sum = static_cast<double>(dws[0][i]) + dws[1][i];
    const double bound = rel * (std::fabs(dws[0][i]) + std::fabs(sum)) + floor * (1.0 / scale1 + 1.0 / scale2) +
                         kBf16Rel * (std::fabs(dws[0][i]) + std::fabs(dws[1][i]));
    worst = std::max(worst, std::fabs(got[i] - sum) / bound);
    num2 += std::pow(got[i] - sum, 2);
    den2 += sum * sum;
    alone2 += std::pow(got[i] - dws[1][i], 2);
  }
  std::printf("[ grad accumulation %s ] ||err||/||dW1 + dW2|| %.4f, worst |err|/bound %.3f\n", format,
              std::sqrt(num2 / den2), worst);
  EXPECT_LE(worst, 1.0);
  EXPECT_LT(std::sqrt(num2 / den2), rel);
  EXPECT_GT(std::sqrt(alone2 / den2), 4 * rel) << "the gradient looks like the second micro-batch alone";

  // A third addend from outside libfp8 (fp8_model_accumulate_grad) follows the same rule.
  const std::vector<float> dw3 = small(static_cast<size_t>(out * in), 0.125f);
  Tensor g3 = make_tensor(ctx.get(), FP8_DTYPE_F32, {out, in});
  upload(g3.get(), dw3);
  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 0, g3.get()));
  float amax2 = 0.0f;
  for (uint8_t c : q2) amax2 = std::max(amax2, std::fabs(fp8::dequantize_fp8(c, e5m2, 1.0f / scale2)));
  const float scale3 = static_cast<float>(fmax) / (amax2 + amax_of(dw3));
  std::vector<uint8_t> q3(q2.size());
  for (size_t i = 0; i < q3.size(); ++i)
    q3[i] = fp8::encode_fp8((fp8::dequantize_fp8(q2[i], e5m2, 1.0f / scale2) + dw3[i]) * scale3, e5m2);
  EXPECT_EQ(download<uint8_t>(grad), q3);
  EXPECT_EQ(bits_of(scale_inv_of(grad)), bits_of(1.0f / scale3));
}

TEST_P(OptimLevelGradAccumulation, TwoMicroBatchesRequantiseTheSumInOnePass) {
  for (fp8_dtype_t act : {FP8_DTYPE_F32, FP8_DTYPE_BF16}) two_micro_batches(GetParam(), act);
}

INSTANTIATE_TEST_SUITE_P(Formats, OptimLevelGradAccumulation, ::testing::Values("HYBRID", "E4M3"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

// fp8_model_accumulate_grad with BF16 addends (what the Linear's backward adds at O1..O3): onto a
// zeroed FP8 gradient the codes are encode(g * scale) (a -0 addend keeps its sign), then the
// requantised sum; an FP32 gradient adds the widened values exactly; other dtypes are refused.
TEST(OptimLevelAccumulateGrad, Bf16AddendsFollowTheRuleAndOtherDtypesAreRefused) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  fp8_model_t* m = model.get();
  const int64_t in = 32, out = 16, n = in * out;
  FP8_ASSERT_OK(fp8_model_add_linear(m, "fc", in, out, 1, nullptr));
  Recipe r = make_recipe("backend=msamp, opt_level=O2, fp8_format=HYBRID");
  FP8_ASSERT_OK(fp8_convert_model(m, r.get(), nullptr));
  fp8_tensor_t* wgrad = param_tensor(m, "fc.weight", true);
  fp8_tensor_t* bgrad = param_tensor(m, "fc.bias", true);
  ASSERT_EQ(dtype_of(wgrad), FP8_DTYPE_E5M2);
  ASSERT_EQ(dtype_of(bgrad), FP8_DTYPE_F32);
  auto bf16_tensor = [&](const std::vector<float>& v, std::vector<float>* rounded) {
    std::vector<uint16_t> h(v.size());
    rounded->resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      h[i] = fp8::float_to_bf16(v[i]);
      (*rounded)[i] = fp8::bf16_to_float(h[i]);
    }
    Tensor t = make_tensor(ctx.get(), FP8_DTYPE_BF16, {static_cast<int64_t>(v.size())});
    upload(t.get(), h);
    return t;
  };
  std::vector<float> g1, g2, b1;
  std::vector<float> raw1 = randn(static_cast<size_t>(n), 21, 0.3f);
  raw1[5] = -0.0f;
  raw1[6] = 0.0f;
  Tensor t1 = bf16_tensor(raw1, &g1), t2 = bf16_tensor(randn(static_cast<size_t>(n), 22, 0.7f), &g2);
  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 0, t1.get()));
  const float scale1 = 57344.0f / amax_of(g1);
  std::vector<uint8_t> q1(g1.size());
  for (size_t i = 0; i < q1.size(); ++i) q1[i] = fp8::encode_fp8(g1[i] * scale1, true);
  EXPECT_EQ(download<uint8_t>(wgrad), q1);
  EXPECT_EQ(download<uint8_t>(wgrad)[5], 0x80) << "a -0 addend onto zeros keeps its sign";
  EXPECT_EQ(download<uint8_t>(wgrad)[6], 0x00);
  EXPECT_EQ(bits_of(scale_inv_of(wgrad)), bits_of(1.0f / scale1));

  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 0, t2.get()));
  float amax1 = 0.0f;
  for (uint8_t c : q1) amax1 = std::max(amax1, std::fabs(fp8::dequantize_fp8(c, true, 1.0f / scale1)));
  const float scale2 = 57344.0f / (amax1 + amax_of(g2));
  std::vector<uint8_t> q2(q1.size());
  for (size_t i = 0; i < q2.size(); ++i)
    q2[i] = fp8::encode_fp8((fp8::dequantize_fp8(q1[i], true, 1.0f / scale1) + g2[i]) * scale2, true);
  EXPECT_EQ(download<uint8_t>(wgrad), q2);
  EXPECT_EQ(bits_of(scale_inv_of(wgrad)), bits_of(1.0f / scale2));

  Tensor tb = bf16_tensor(randn(static_cast<size_t>(out), 23, 0.5f), &b1);
  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 1, tb.get()));
  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 1, tb.get()));
  const std::vector<float> bias_grad = download<float>(bgrad);
  for (size_t i = 0; i < b1.size(); ++i) EXPECT_EQ(bits_of(bias_grad[i]), bits_of(b1[i] + b1[i])) << i;

  const std::vector<uint8_t> before = download<uint8_t>(wgrad);
  for (fp8_dtype_t dt : {FP8_DTYPE_F16, FP8_DTYPE_E4M3}) {
    Tensor bad = make_tensor(ctx.get(), dt, {n});
    EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 0, bad.get()), FP8_ERR_DTYPE, "fp8_model_accumulate_grad",
                         "g has dtype", "expected f32 or bf16");
  }
  EXPECT_EQ(download<uint8_t>(wgrad), before) << "a refused addend changed the gradient";
}

// fp8_model_accumulate_grad's refusals, at FP32 storage (te) and at each FP8-gradient level: a NULL
// model or g, an index out of 0..count-1, a g of another context (a second CPU context: same device,
// other context), of another dtype than F32/BF16, or of another element count. Each names the
// argument and what was expected, and leaves every weight and gradient as it was (bytes, scale_inv
// and data pointers), here gradients made nonzero by an accepted call first.
class OptimLevelAccumulateGradRefusals : public ::testing::TestWithParam<int> {};

TEST_P(OptimLevelAccumulateGradRefusals, EachNamesItsArgumentAndChangesNothing) {
  const int level = GetParam();
  TwoLinears t(recipe_for_level(level));
  fp8_model_t* m = t.model.get();
  ASSERT_EQ(storage_level_of(m), level);
  ASSERT_EQ(dtype_of(t.grad(0)), grad_dtype_at(level));
  int32_t count = -1;
  FP8_ASSERT_OK(fp8_model_parameter_count(m, &count));
  ASSERT_EQ(count, 2);  // fc1.weight, fc2.weight
  t.set_fp32_grads(5);
  const Snapshot before = snapshot(t);
  const int64_t n0 = kIn[0] * kOut[0], n1 = kIn[1] * kOut[1];
  Tensor good = make_tensor(t.ctx.get(), FP8_DTYPE_F32, {n0});
  upload(good.get(), randn(static_cast<size_t>(n0), 9, 0.05f));
  const char* fn = "fp8_model_accumulate_grad";
  const int32_t kInv = FP8_ERR_INVALID_ARGUMENT;

  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(nullptr, 0, good.get()), kInv, fn, "'model'", "NULL");
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 0, nullptr), kInv, fn, "'g'", "NULL");
  expect_same_storage(snapshot(t), before, "a NULL argument");
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, -1, good.get()), kInv, fn, "index = -1", "expected 0..1",
                       "2 parameters");
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, count, good.get()), kInv, fn, "index = 2", "expected 0..1",
                       "2 parameters");
  expect_same_storage(snapshot(t), before, "an index out of range");

  Context other = make_context(FP8_DEVICE_CPU);
  Tensor foreign = make_tensor(other.get(), FP8_DTYPE_F32, {n0});
  upload(foreign.get(), randn(static_cast<size_t>(n0), 9, 0.05f));
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 0, foreign.get()), kInv, fn, "g belongs to another context",
                       "expected the model's");
  expect_same_storage(snapshot(t), before, "a g of another context");

  for (fp8_dtype_t dt : {FP8_DTYPE_F16, FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    Tensor bad = make_tensor(t.ctx.get(), dt, {n0});
    const std::string name = dt == FP8_DTYPE_F16 ? "f16" : dt == FP8_DTYPE_E4M3 ? "e4m3" : "e5m2";
    EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 0, bad.get()), FP8_ERR_DTYPE, fn, "g has dtype " + name,
                         "expected f32 or bf16");
  }
  expect_same_storage(snapshot(t), before, "a g of another dtype");

  for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16})
    for (int64_t wrong : {n0 - 1, n0 + 1, n1}) {
      Tensor bad = make_tensor(t.ctx.get(), dt, {wrong});
      EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 0, bad.get()), FP8_ERR_SHAPE, fn,
                           "g has " + std::to_string(wrong) + " elements", "parameter 'fc1.weight' has " +
                           std::to_string(n0));
    }
  // fc1's own count onto fc2.weight.
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(m, 1, good.get()), FP8_ERR_SHAPE, fn,
                       "g has " + std::to_string(n0) + " elements", "parameter 'fc2.weight' has " + std::to_string(n1));
  expect_same_storage(snapshot(t), before, "a g of another element count");

  // The refusals left the model usable: the same g is accepted and changes fc1's gradient.
  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 0, good.get()));
  EXPECT_NE(tensor_bytes(t.grad(0)), before.bytes[1]);
}

INSTANTIATE_TEST_SUITE_P(Levels, OptimLevelAccumulateGradRefusals, ::testing::Values(0, 1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return std::string(level_name(i.param)); });

class OptimLevelPoison : public ::testing::TestWithParam<int> {};

// An inf in a backward poisons the FP8 gradient: it decodes as NaN, each step is skipped (weights and
// stats untouched), a further finite micro-batch does not heal it; zero_grad does, and the training
// then goes on exactly as on a twin model that never saw the inf.
TEST_P(OptimLevelPoison, BackwardWithInfSkipsUntilZeroGrad) {
  const int level = GetParam();
  Hyper h;
  h.lr = 0.01;
  TwoLinears t(recipe_for_level(level)), twin(recipe_for_level(level));
  for (TwoLinears* x : {&t, &twin}) {
    x->create(FP8_OPTIMIZER_ADAM);
    apply(x->opt.get(), h);
    x->backward(1);
    FP8_ASSERT_OK(fp8_optimizer_step(x->opt.get()));
    FP8_ASSERT_OK(fp8_optimizer_zero_grad(x->opt.get()));
  }
  std::vector<std::vector<uint8_t>> before;
  for (int k = 0; k < 2; ++k) before.push_back(download<uint8_t>(t.weight(k)));

  t.backward(2, /*poison=*/true);
  EXPECT_TRUE(std::isnan(scale_inv_of(t.grad(0))));
  for (float v : decoded(t.grad(0))) ASSERT_TRUE(std::isnan(v)) << "a poisoned gradient decodes as NaN";
  FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
  fp8_optimizer_stats_t s = stats_of(t.opt.get());
  EXPECT_EQ(s.last_skipped, 1);
  EXPECT_EQ(s.steps, 1);
  EXPECT_EQ(s.skipped_steps, 1);
  for (int k = 0; k < 2; ++k) EXPECT_EQ(download<uint8_t>(t.weight(k)), before[static_cast<size_t>(k)]);

  t.backward(3);  // finite, accumulated onto the poisoned gradient
  for (float v : decoded(t.grad(0))) ASSERT_TRUE(std::isnan(v)) << "a finite micro-batch healed the poison";
  FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
  s = stats_of(t.opt.get());
  EXPECT_EQ(s.skipped_steps, 2);
  EXPECT_EQ(s.steps, 1);
  for (int k = 0; k < 2; ++k) EXPECT_EQ(download<uint8_t>(t.weight(k)), before[static_cast<size_t>(k)]);

  FP8_ASSERT_OK(fp8_optimizer_zero_grad(t.opt.get()));
  for (float v : decoded(t.grad(0))) ASSERT_EQ(v, 0.0f) << "zero_grad left something in the gradient";
  for (TwoLinears* x : {&t, &twin}) {
    x->backward(4);
    FP8_ASSERT_OK(fp8_optimizer_step(x->opt.get()));
  }
  s = stats_of(t.opt.get());
  EXPECT_EQ(s.last_skipped, 0);
  EXPECT_EQ(s.steps, 2);
  for (int k = 0; k < 2; ++k) {
    EXPECT_NE(download<uint8_t>(t.weight(k)), before[static_cast<size_t>(k)]);
    EXPECT_EQ(download<uint8_t>(t.weight(k)), download<uint8_t>(twin.weight(k))) << "tensor " << k;
    if (level == 3) EXPECT_EQ(bits_of(scale_inv_of(t.weight(k))), bits_of(scale_inv_of(twin.weight(k))));
  }
}

// An inf in an FP32 gradient added before the optimizer exists poisons the FP8 gradient, and the
// optimizer made afterwards skips it.
TEST_P(OptimLevelPoison, NonFiniteGradientAddedBeforeCreationIsSkipped) {
  const int level = GetParam();
  TwoLinears t(recipe_for_level(level));
  std::vector<float> g = randn(96 * 64, 9, 0.05f);
  g[100] = -std::numeric_limits<float>::infinity();
  FP8_ASSERT_OK(fp8_model_zero_grad(t.model.get()));
  t.accumulate(0, g);
  for (float v : decoded(t.grad(0))) ASSERT_TRUE(std::isnan(v));
  t.create(FP8_OPTIMIZER_ADAMW);
  for (float v : decoded(t.grad(0))) ASSERT_TRUE(std::isnan(v));
  const std::vector<uint8_t> before = download<uint8_t>(t.weight(0));
  FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
  EXPECT_EQ(stats_of(t.opt.get()).last_skipped, 1);
  EXPECT_EQ(download<uint8_t>(t.weight(0)), before) << "AdamW's decay must not apply on a skipped step either";
  FP8_ASSERT_OK(fp8_optimizer_zero_grad(t.opt.get()));
  t.backward(1);
  FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
  EXPECT_EQ(stats_of(t.opt.get()).steps, 1);
  EXPECT_NE(download<uint8_t>(t.weight(0)), before);
}

INSTANTIATE_TEST_SUITE_P(Levels, OptimLevelPoison, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return std::string(level_name(i.param)); });

// =================================================================================================
// 4. The compact update bit for bit against a re-implementation
// =================================================================================================

using namespace fp8test::rule;

// The scale that maps `bound` to `max`: max/bound rounded to float (at most FLT_MAX); 1 for a bound
// that is 0 or not finite.
float scale_for(double max, double bound) {
  if (!(bound > 0.0) || !(bound < HUGE_VAL)) return 1.0f;
  const double s = max / bound;
  return s > FLT_MAX ? FLT_MAX : static_cast<float>(s);
}

// One Linear weight at O1..O3 as the library stores it: the F16 value (O1/O2) or F16 master (O3),
// m and v (F32 at O1; E4M3 codes and F16 codes with per-tensor scales at O2/O3), and the amaxes the
// next step's bounds start from.
struct CompactTensor {
  std::vector<uint16_t> p16;
  std::vector<float> m32, v32;
  std::vector<uint8_t> m8, w8;
  std::vector<uint16_t> v16;
  float m_scale_inv = 0, v_scale_inv = 0, m_amax = 0, v_amax = 0, p_amax = 0, w_scale_inv = 1;
};

struct CompactRule {
  int level;
  std::vector<CompactTensor> ts;
  uint64_t t = 0;

  // `p16`: the F16 values as the conversion left them (O3: the master is the F16 of the FP32
  // weight, which the test computes itself).
  CompactRule(int lvl, const std::vector<std::vector<uint16_t>>& p16) : level(lvl) {
    for (const auto& p : p16) {
      CompactTensor c;
      c.p16 = p;
      c.m32.assign(p.size(), 0.0f);
      c.v32.assign(p.size(), 0.0f);
      c.m8.assign(p.size(), 0);
      c.v16.assign(p.size(), 0);
      for (uint16_t h : p) c.p_amax = std::max(c.p_amax, std::fabs(fp8::f16_to_float(h)));
      ts.push_back(c);
    }
  }

  // g: the decoded gradients (the FP8 codes times their scale_inv).
  void step(const Params& g, const Hyper& h) {
    const double sumsq = rule_sumsq(g);
    if (!(sumsq - sumsq == 0.0)) return;
    const uint64_t tt = ++t;
    double clip_d = 1.0;
    if (h.max_grad_norm > 0.0) clip_d = std::min(1.0, h.max_grad_norm / (std::sqrt(sumsq) + 1e-6));
    const float clip = static_cast<float>(clip_d);
    const bool adamw = h.kind == FP8_OPTIMIZER_ADAMW;
    const float step_size = static_cast<float>(h.lr / (1.0 - pow_by_squaring(h.beta1, tt)));
    const float ibc2 = static_cast<float>(1.0 / std::sqrt(1.0 - pow_by_squaring(h.beta2, tt)));
    const float wd = adamw ? 0.0f : static_cast<float>(h.weight_decay);
    const float decay = adamw ? static_cast<float>(1.0 - dmul(h.lr, h.weight_decay)) : 1.0f;
    const float b1 = static_cast<float>(h.beta1), omb1 = static_cast<float>(1.0 - h.beta1);
    const float b2 = static_cast<float>(h.beta2), omb2 = static_cast<float>(1.0 - h.beta2);
    const float eps = static_cast<float>(h.eps);
    for (size_t k = 0; k < ts.size(); ++k) {
      CompactTensor& c = ts[k];
      // The scales of this step's writes, from bounds on the new values: |g'| <= amax(g) clip +
      // wd amax(p); |m'| <= b1 amax(m) + (1-b1)|g'|; |v'| <= b2 amax(v) + (1-b2) |g'|^2.
      const double gp = dadd(dmul(amax_of(g[k]), clip), dmul(static_cast<double>(wd), c.p_amax));
      const double bm = dadd(dmul(b1, c.m_amax), dmul(omb1, gp));
      const double bv = dadd(dmul(b2, c.v_amax), dmul(omb2, dmul(gp, gp)));
      const float m_scale = scale_for(448.0, bm), v_scale = scale_for(65504.0, bv), w_scale = scale_for(448.0, c.p_amax);
      uint32_t top_m = 0, top_v = 0, top_p = 0;
      for (size_t i = 0; i < c.p16.size(); ++i) {
        float p = fp8::f16_to_float(c.p16[i]);
        float m = level == 1 ? c.m32[i] : fp8::decode_fp8(c.m8[i], false) * c.m_scale_inv;
        float v = level == 1 ? c.v32[i] : mul_rn(fp8::f16_to_float(c.v16[i]), c.v_scale_inv);
        float gi = mul_rn(g[k][i], clip);
        p = mul_rn(p, decay);
        gi = std::fma(wd, p, gi);
        m = std::fma(b1, m, mul_rn(omb1, gi));
        v = std::fma(b2, v, mul_rn(omb2, mul_rn(gi, gi)));
        const float denom = std::fma(std::sqrt(v), ibc2, eps);
        p = std::fma(-step_size, m / denom, p);
        if (level == 1) {
          c.m32[i] = m;
          c.v32[i] = v;
        } else {
          c.m8[i] = fp8::encode_fp8(mul_rn(m, m_scale), false);
          c.v16[i] = fp8::float_to_f16(mul_rn(v, v_scale));
          top_m = std::max<uint32_t>(top_m, c.m8[i] & 0x7Fu);
          top_v = std::max<uint32_t>(top_v, c.v16[i] & 0x7FFFu);
        }
        c.p16[i] = fp8::float_to_f16(p);
        top_p = std::max<uint32_t>(top_p, c.p16[i] & 0x7FFFu);
      }
      if (level == 3) {
        c.w8.resize(c.p16.size());
        for (size_t i = 0; i < c.p16.size(); ++i) c.w8[i] = fp8::encode_fp8(mul_rn(fp8::f16_to_float(c.p16[i]), w_scale), false);
        c.w_scale_inv = 1.0f / w_scale;
      }
      if (level >= 2) {
        c.m_scale_inv = 1.0f / m_scale;
        c.v_scale_inv = 1.0f / v_scale;
        c.m_amax = fp8::decode_fp8(static_cast<uint8_t>(top_m), false) * c.m_scale_inv;
        c.v_amax = fp8::f16_to_float(static_cast<uint16_t>(top_v)) * c.v_scale_inv;
      }
      c.p_amax = fp8::f16_to_float(static_cast<uint16_t>(top_p));
    }
  }
};

struct ExactCase {
  const char* name;
  int level;
  Hyper hyper;
};
void PrintTo(const ExactCase& c, std::ostream* os) { *os << c.name; }
class OptimLevelExact : public ::testing::TestWithParam<ExactCase> {};

// Five steps (the first on an FP32 gradient added before the optimizer, the others on backward gradients, one of them
// two micro-batches): the library's F16 values (O1/O2) or E4M3 weights and their scale_inv (O3)
// have the re-implementation's bits after every step.
TEST_P(OptimLevelExact, SameBitsAsTheReimplementedRule) {
  const ExactCase& ec = GetParam();
  Hyper h = ec.hyper;
  TwoLinears t(recipe_for_level(ec.level));
  std::vector<std::vector<uint16_t>> p16;
  for (int k = 0; k < 2; ++k) {  // the F16 of the FP32 weights written before it, as conversion makes it
    std::vector<uint16_t> h16;
    for (float f : t.w32[static_cast<size_t>(k)]) h16.push_back(fp8::float_to_f16(f));
    p16.push_back(h16);
  }
  t.set_fp32_grads(5);
  t.create(h.kind);
  apply(t.opt.get(), h);
  if (ec.level != 3) {
    for (int k = 0; k < 2; ++k) ASSERT_EQ(download<uint16_t>(t.weight(k)), p16[static_cast<size_t>(k)]);
  }
  CompactRule rule(ec.level, p16);
  const double lrs[] = {0.02, 0.01, 0.03, 0.015, 0.02};
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step + 1));
    if (step > 0) {
      FP8_ASSERT_OK(fp8_optimizer_zero_grad(t.opt.get()));
      t.backward(static_cast<uint32_t>(step) + 20);
      if (step == 2) t.backward(40);  // two micro-batches
    }
    const Params g = t.grads();
    h.lr = lrs[step];
    FP8_ASSERT_OK(fp8_optimizer_set_float(t.opt.get(), FP8_OPTIM_LR, h.lr));
    FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
    rule.step(g, h);
    ASSERT_EQ(stats_of(t.opt.get()).last_skipped, 0);
    for (int k = 0; k < 2; ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      const CompactTensor& c = rule.ts[static_cast<size_t>(k)];
      if (ec.level == 3) {
        EXPECT_EQ(bits_of(scale_inv_of(t.weight(k))), bits_of(c.w_scale_inv));
        const std::vector<uint8_t> got = download<uint8_t>(t.weight(k));
        size_t diff = 0;
        while (diff < got.size() && got[diff] == c.w8[diff]) ++diff;
        EXPECT_EQ(diff, got.size()) << "first difference at " << diff;
      } else {
        const std::vector<uint16_t> got = download<uint16_t>(t.weight(k));
        size_t diff = 0;
        while (diff < got.size() && got[diff] == c.p16[diff]) ++diff;
        EXPECT_EQ(diff, got.size()) << "first difference at " << diff << ": got "
                                    << (diff < got.size() ? fp8::f16_to_float(got[diff]) : 0.0f) << ", want "
                                    << (diff < got.size() ? fp8::f16_to_float(c.p16[diff]) : 0.0f);
      }
    }
  }
}

const ExactCase kExactCases[] = {
    {"O1Adam", 1, {FP8_OPTIMIZER_ADAM, 0, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0}},
    {"O2Adam", 2, {FP8_OPTIMIZER_ADAM, 0, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0}},
    {"O2AdamL2Clipped", 2, {FP8_OPTIMIZER_ADAM, 0, 0.8, 0.99, 1e-6, 0.1, 0.0, 0.5}},
    {"O2AdamW", 2, {FP8_OPTIMIZER_ADAMW, 0, 0.9, 0.999, 1e-8, 0.05, 0.0, 0.0}},
    {"O3Adam", 3, {FP8_OPTIMIZER_ADAM, 0, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.0}},
    {"O3AdamWClipped", 3, {FP8_OPTIMIZER_ADAMW, 0, 0.85, 0.995, 1e-3, 0.2, 0.0, 0.5}},
};
INSTANTIATE_TEST_SUITE_P(Cases, OptimLevelExact, ::testing::ValuesIn(kExactCases),
                         [](const ::testing::TestParamInfo<ExactCase>& i) { return std::string(i.param.name); });

// =================================================================================================
// 5. SGD with momentum at O1 against float64
// =================================================================================================

// F16 weights and an F32 momentum buffer: each step rounds the weight to F16 (2^-11 relative), the
// buffer is exact up to float rounding, so every element lies within Budget64's F16 budget; an SGD
// without momentum breaks it.
TEST(OptimLevelSgd, MomentumAtO1MatchesFloat64WithinF16Rounding) {
  // auto O2: SGD runs O1 on the O2 storage (auto O3 refuses SGD: OptimLevelSelection).
  for (const char* recipe : {"backend=msamp, opt_level=O1", "backend=auto, opt_level=O2"}) {
    SCOPED_TRACE(recipe);
    TwoLinears t(recipe);
    t.set_fp32_grads(2);
    t.create(FP8_OPTIMIZER_SGD);
    ASSERT_EQ(stats_of(t.opt.get()).opt_level, 1);
    Hyper h;
    h.kind = FP8_OPTIMIZER_SGD;
    h.momentum = 0.9;
    apply(t.opt.get(), h);
    const double lrs[] = {0.2, 0.1, 0.3, 0.15, 0.2};
    const Params init = t.weights();
    Hyper plain = h;
    plain.momentum = 0.0;
    Budget64 ref(init, storage_of(1)), no_momentum(init, storage_of(1));
    Compare c;
    const std::vector<double> unused(2, 0.0);
    for (int step = 0; step < 5; ++step) {
      SCOPED_TRACE("step " + std::to_string(step + 1));
      if (step > 0) {
        FP8_ASSERT_OK(fp8_optimizer_zero_grad(t.opt.get()));
        t.backward(static_cast<uint32_t>(step) + 50);
      }
      const Params g = t.grads();
      h.lr = plain.lr = lrs[step];
      FP8_ASSERT_OK(fp8_optimizer_set_float(t.opt.get(), FP8_OPTIM_LR, h.lr));
      FP8_ASSERT_OK(fp8_optimizer_step(t.opt.get()));
      ref.step(g, h);
      no_momentum.step(g, plain);
      const Params got = t.weights();
      c = compare(got, ref, init, unused, unused);
      EXPECT_EQ(c.over, 0) << "worst |err|/budget " << c.worst_ratio;
      if (step >= 2) {  // the buffer holds 1.9x the gradient by then (0.9 + 1 of similar sizes... or less)
        const Compare bad = compare(got, no_momentum, init, unused, unused);
        EXPECT_GT(bad.over, bad.total / 2) << "the budget would accept SGD without momentum";
      }
    }
    std::printf("[ O1 SGD momentum ] worst |err|/budget %.3f, ||err||/||w|| %.3g, ||err||/||w - w0|| %.3g\n",
                c.worst_ratio, c.rel_weight, c.rel_step);
    EXPECT_LT(c.rel_weight, 5 * kF16Rel);
    EXPECT_LT(c.rel_step, 0.02);
  }
}

}  // namespace
