// Forward states owned by the caller (fp8_layer_forward_saved): the scenarios the CPU tests and the
// GPU suite both run. Two forwards of one layer in flight, differentiated in either order, against
// the same pairs run one after the other and against two twin layers with the same parameters.
#pragma once

#include <string>
#include <vector>

#include "fp8_test_util.hpp"

namespace fp8test::saved_cases {

constexpr int64_t kRows = 32, kIn = 64, kOut = 48;

enum class Kind { kLinear, kLinearFp8, kLayerNorm, kGelu };
inline const char* kind_name(Kind k) {
  return k == Kind::kLinear      ? "Linear"
         : k == Kind::kLinearFp8 ? "LinearFp8"
         : k == Kind::kLayerNorm ? "LayerNorm"
                                 : "Gelu";
}
// InFlight: forward 1, forward 2, then the backwards; Pairs: forward and backward of 1, then of 2;
// Twins: 1 through layer "a", 2 through layer "b" (same parameters).
enum class Mode { kInFlight, kPairs, kTwins };

struct Outputs {
  std::vector<float> y[2], dx[2];
  std::vector<std::vector<float>> grads;  // every parameter gradient of the model, in order
};

inline int64_t out_features(Kind k) {
  return k == Kind::kLinear || k == Kind::kLinearFp8 ? kOut : kIn;
}

// Adds one layer of `kind` named `name` with fixed parameters; returns its id.
inline int32_t add_layer(fp8_model_t* m, Kind kind, const std::string& name) {
  int32_t id = -1;
  switch (kind) {
    case Kind::kLinear:
    case Kind::kLinearFp8:
      EXPECT_OK(fp8_model_add_linear(m, name.c_str(), kIn, kOut, 1, &id));
      set_param(m, name + ".weight", randn(static_cast<size_t>(kIn * kOut), 11, 0.125f));
      set_param(m, name + ".bias", randn(static_cast<size_t>(kOut), 12, 0.5f));
      break;
    case Kind::kLayerNorm:
      EXPECT_OK(fp8_model_add_layernorm(m, name.c_str(), kIn, 1e-5f, &id));
      set_param(m, name + ".weight", randn(static_cast<size_t>(kIn), 13, 0.2f, 1.0f));
      set_param(m, name + ".bias", randn(static_cast<size_t>(kIn), 14, 0.2f));
      break;
    case Kind::kGelu:
      EXPECT_OK(fp8_model_add_activation(m, name.c_str(), FP8_ACTIVATION_GELU, &id));
      break;
  }
  return id;
}

// Runs the two forward/backward pairs of `kind` on `device` as `mode` says; `second_first`
// differentiates forward 2 before forward 1 (in flight) or runs pair 2 first (pairs).
inline Outputs run(int32_t device, Kind kind, Mode mode, bool second_first) {
  Context ctx = make_context(device);
  Model model = make_model(ctx.get());
  fp8_model_t* m = model.get();
  const int32_t a = add_layer(m, kind, "a");
  const int32_t b = mode == Mode::kTwins ? add_layer(m, kind, "b") : a;
  const bool fp8 = kind == Kind::kLinearFp8;
  if (fp8) {
    Recipe r = make_recipe("small_layer_fallback=0, backend=te");
    EXPECT_OK(fp8_convert_model(m, r.get(), nullptr));
    EXPECT_OK(fp8_autocast_begin(m));
  }
  const int64_t out = out_features(kind);
  Tensor x[2], y[2], dy[2], dx[2];
  for (int i = 0; i < 2; ++i) {
    x[i] = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
    upload(x[i].get(), randn(static_cast<size_t>(kRows * kIn), 100 + i, 1.0f, 0.1f));
    y[i] = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, out});
    dy[i] = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, out});
    upload(dy[i].get(), randn(static_cast<size_t>(kRows * out), 200 + i, 1.0f));
    dx[i] = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  }
  const int32_t layer[2] = {a, b};
  Saved saved[2];
  auto forward = [&](int i) {
    fp8_saved_t* s = nullptr;
    EXPECT_OK(fp8_layer_forward_saved(m, layer[i], x[i].get(), y[i].get(), &s));
    saved[i].reset(s);
  };
  auto backward = [&](int i) {
    EXPECT_OK(fp8_layer_backward_saved(m, layer[i], saved[i].get(), dy[i].get(), dx[i].get(), 0));
  };
  const int first = second_first ? 1 : 0, second = 1 - first;
  if (mode == Mode::kPairs) {
    forward(first), backward(first), forward(second), backward(second);
  } else {
    forward(0), forward(1), backward(first), backward(second);
  }
  if (fp8) EXPECT_OK(fp8_autocast_end(m));
  Outputs o;
  for (int i = 0; i < 2; ++i) o.y[i] = download<float>(y[i].get()), o.dx[i] = download<float>(dx[i].get());
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t p = 0; p < count; ++p) {
    fp8_tensor_t* g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, p, nullptr, nullptr, &g));
    o.grads.push_back(download<float>(g));
  }
  return o;
}

// One forward and backward of a fresh layer of `kind` on `device` (the same scales every time) with
// dx holding `old` before the backward and `flags` for it; returns dx.
inline std::vector<float> backward_into(int32_t device, Kind kind, const std::vector<float>& old, uint32_t flags) {
  Context ctx = make_context(device);
  Model model = make_model(ctx.get());
  const int32_t id = add_layer(model.get(), kind, "a");
  if (kind == Kind::kLinearFp8) {
    Recipe r = make_recipe("small_layer_fallback=0, backend=te");
    EXPECT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
    EXPECT_OK(fp8_model_set_autowrap(model.get(), 1));
  }
  const int64_t out = out_features(kind);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  upload(x.get(), randn(static_cast<size_t>(kRows * kIn), 3, 1.0f));
  Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, out});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, out});
  upload(dy.get(), randn(static_cast<size_t>(kRows * out), 4, 1.0f));
  Tensor dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  upload(dx.get(), old);
  fp8_saved_t* s = nullptr;
  EXPECT_OK(fp8_layer_forward_saved(model.get(), id, x.get(), y.get(), &s));
  Saved saved(s);
  EXPECT_OK(fp8_layer_backward_saved(model.get(), id, saved.get(), dy.get(), dx.get(), flags));
  return download<float>(dx.get());
}

// One forward and backward of a fresh layer of `kind` under `recipe` (nullptr: not converted) on
// `device`, with x overwritten by NaNs between them when `overwrite_x` (fp8_saved_needs_input said 0:
// the backward must not read it). Returns y, dx and the parameter gradients in y[0], dx[0] and grads;
// *needs_input and *needs_after (after the backward) get what fp8_saved_needs_input said.
inline Outputs input_use(int32_t device, Kind kind, const char* recipe, bool overwrite_x, int32_t* needs_input,
                         int32_t* needs_after) {
  Context ctx = make_context(device);
  Model model = make_model(ctx.get());
  const int32_t id = add_layer(model.get(), kind, "a");
  if (recipe) {
    Recipe r = make_recipe(recipe);
    EXPECT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
    EXPECT_OK(fp8_model_set_autowrap(model.get(), 1));
  }
  const int64_t out = out_features(kind);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  upload(x.get(), randn(static_cast<size_t>(kRows * kIn), 5, 1.0f, 0.1f));
  Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, out});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, out});
  upload(dy.get(), randn(static_cast<size_t>(kRows * out), 6, 1.0f));
  Tensor dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  fp8_saved_t* s = nullptr;
  EXPECT_OK(fp8_layer_forward_saved(model.get(), id, x.get(), y.get(), &s));
  Saved saved(s);
  EXPECT_OK(fp8_saved_needs_input(saved.get(), needs_input));
  if (overwrite_x) upload(x.get(), std::vector<float>(static_cast<size_t>(kRows * kIn), NAN));
  EXPECT_OK(fp8_layer_backward_saved(model.get(), id, saved.get(), dy.get(), dx.get(), 0));
  EXPECT_OK(fp8_saved_needs_input(saved.get(), needs_after));
  Outputs o;
  o.y[0] = download<float>(y.get());
  o.dx[0] = download<float>(dx.get());
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(model.get(), &count));
  for (int32_t p = 0; p < count; ++p) {
    fp8_tensor_t* g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(model.get(), p, nullptr, nullptr, &g));
    o.grads.push_back(download<float>(g));
  }
  return o;
}

// The cases of input_use: a layer, its recipe, and whether its backward reads x.
struct InputUseCase {
  const char* name;
  Kind kind;
  const char* recipe;
  bool reads_x;
};
inline const InputUseCase kInputUseCases[] = {
    {"LinearHighPrecision", Kind::kLinear, nullptr, true},
    {"LinearFp8", Kind::kLinearFp8, "small_layer_fallback=0, backend=te", false},
    {"LinearFp8O2", Kind::kLinearFp8, "small_layer_fallback=0, backend=msamp, opt_level=O2", false},
    {"LinearFp8CurrentScaling", Kind::kLinearFp8, "small_layer_fallback=0, backend=te, scaling=current", false},
    {"LinearFp8Rowwise", Kind::kLinearFp8, "small_layer_fallback=0, backend=te, scaling=rowwise", false},
    {"LinearFp8WgradInHighPrecision", Kind::kLinearFp8,
     "small_layer_fallback=0, backend=te, override_linear_precision=off/off/on", true},
    {"LinearSmallLayerFallback", Kind::kLinearFp8, "backend=te", true},
    {"LayerNorm", Kind::kLayerNorm, "backend=te", true},
    {"Gelu", Kind::kGelu, "backend=te", true},
};

}  // namespace fp8test::saved_cases
