// Small helpers for the test programs: owning handles and a status check that prints the message.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fp8.h"

#define FP8_ASSERT_OK(expr)                                                                        \
  do {                                                                                             \
    const fp8_status_t fp8_assert_status_ = (expr);                                                \
    ASSERT_EQ(fp8_assert_status_, FP8_OK) << #expr << " -> " << fp8_status_string(fp8_assert_status_) \
                                          << ": " << fp8_last_error_message();                     \
  } while (0)
#define EXPECT_OK(expr) EXPECT_EQ((expr), FP8_OK) << #expr << ": " << fp8_last_error_message()

// `call` returns `status`, and fp8_last_error_message() starts with "fn:" and contains every word.
#define EXPECT_REFUSED_WORDS(call, status, fn, ...)                                                           \
  do {                                                                                                       \
    const fp8_status_t st_ = (call);                                                                         \
    EXPECT_EQ(st_, status) << #call << " -> " << fp8_status_string(st_) << ": " << fp8_last_error_message(); \
    const std::string msg_ = fp8_last_error_message();                                                       \
    EXPECT_EQ(msg_.rfind(std::string(fn) + ":", 0), 0u) << #call << ": " << msg_;                            \
    for (const std::string& w_ : std::initializer_list<std::string>{__VA_ARGS__})                            \
      EXPECT_NE(msg_.find(w_), std::string::npos) << #call << ": no \"" << w_ << "\" in: " << msg_;          \
  } while (0)
#define EXPECT_REFUSED(call, status, fn, word) EXPECT_REFUSED_WORDS(call, status, fn, word)

namespace fp8test {

struct ContextDeleter { void operator()(fp8_context_t* p) const { fp8_context_destroy(p); } };
struct RecipeDeleter { void operator()(fp8_recipe_t* p) const { fp8_recipe_destroy(p); } };
struct TensorDeleter { void operator()(fp8_tensor_t* p) const { fp8_tensor_destroy(p); } };
struct ScalingDeleter { void operator()(fp8_scaling_t* p) const { fp8_scaling_destroy(p); } };
struct ModelDeleter { void operator()(fp8_model_t* p) const { fp8_model_destroy(p); } };
struct OptimizerDeleter { void operator()(fp8_optimizer_t* p) const { fp8_optimizer_destroy(p); } };
struct SavedDeleter {
  void operator()(fp8_saved_t* p) const { fp8_saved_destroy(p); }
};
using Context = std::unique_ptr<fp8_context_t, ContextDeleter>;
using Recipe = std::unique_ptr<fp8_recipe_t, RecipeDeleter>;
using Tensor = std::unique_ptr<fp8_tensor_t, TensorDeleter>;
using Scaling = std::unique_ptr<fp8_scaling_t, ScalingDeleter>;
using Model = std::unique_ptr<fp8_model_t, ModelDeleter>;
using Optimizer = std::unique_ptr<fp8_optimizer_t, OptimizerDeleter>;
using Saved = std::unique_ptr<fp8_saved_t, SavedDeleter>;

inline Context make_context(int32_t device) {
  fp8_context_t* c = nullptr;
  EXPECT_EQ(fp8_context_create(&c, device), FP8_OK) << fp8_last_error_message();
  return Context(c);
}
inline Recipe make_recipe(const char* text = "") {
  fp8_recipe_t* r = nullptr;
  EXPECT_EQ(fp8_recipe_create(&r), FP8_OK);
  EXPECT_EQ(fp8_recipe_parse(r, text), FP8_OK) << fp8_last_error_message();
  return Recipe(r);
}
inline Tensor make_tensor(fp8_context_t* ctx, fp8_dtype_t dt, std::vector<int64_t> shape) {
  fp8_tensor_t* t = nullptr;
  EXPECT_EQ(fp8_tensor_create(&t, ctx, dt, static_cast<int32_t>(shape.size()), shape.data()), FP8_OK)
      << fp8_last_error_message();
  return Tensor(t);
}
inline Scaling make_scaling(fp8_context_t* ctx, const fp8_recipe_t* r, fp8_role_t role) {
  fp8_scaling_t* s = nullptr;
  EXPECT_EQ(fp8_scaling_create(&s, ctx, r, role), FP8_OK) << fp8_last_error_message();
  return Scaling(s);
}

template <typename T>
void upload(fp8_tensor_t* t, const std::vector<T>& host) {
  ASSERT_EQ(fp8_tensor_copy_from_host(t, host.data(), host.size() * sizeof(T)), FP8_OK) << fp8_last_error_message();
}
template <typename T>
std::vector<T> download(const fp8_tensor_t* t) {
  int64_t n = 0;
  fp8_dtype_t dt = 0;
  fp8_tensor_numel(t, &n);
  fp8_tensor_dtype(t, &dt);
  std::vector<T> host(static_cast<size_t>(n) * fp8_dtype_size(dt) / sizeof(T));
  EXPECT_EQ(fp8_tensor_copy_to_host(t, host.data(), host.size() * sizeof(T)), FP8_OK) << fp8_last_error_message();
  return host;
}

inline fp8_scaling_info_t info_of(const fp8_scaling_t* s) {
  fp8_scaling_info_t info;
  fp8_scaling_info_init(&info);
  EXPECT_EQ(fp8_scaling_get_info(s, &info), FP8_OK) << fp8_last_error_message();
  return info;
}

inline Model make_model(fp8_context_t* ctx) {
  fp8_model_t* m = nullptr;
  EXPECT_EQ(fp8_model_create(&m, ctx), FP8_OK) << fp8_last_error_message();
  return Model(m);
}
// A training-mode forward whose backward never comes (its state is dropped at once): what the
// convenience fp8_layer_forward refuses to do twice in a row.
inline fp8_status_t forward_only(fp8_model_t* m, int32_t layer_id, const fp8_tensor_t* x, fp8_tensor_t* y) {
  fp8_saved_t* saved = nullptr;
  const fp8_status_t st = fp8_layer_forward_saved(m, layer_id, x, y, &saved);
  fp8_saved_destroy(saved);
  return st;
}

inline Optimizer make_optimizer(fp8_model_t* m, fp8_optimizer_kind_t kind) {
  fp8_optimizer_t* o = nullptr;
  EXPECT_EQ(fp8_optimizer_create(&o, m, kind), FP8_OK) << fp8_last_error_message();
  return Optimizer(o);
}

// Normal(mean, stddev) floats from a fixed seed.
inline std::vector<float> randn(size_t n, uint32_t seed, float stddev, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> v(n);
  for (float& f : v) f = normal(rng);
  return v;
}

inline float amax_of(const std::vector<float>& v) {
  float a = 0.0f;
  for (float f : v) a = std::max(a, std::fabs(f));
  return a;
}

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A model's parameter "<layer>.<param>" (its gradient with grad), and what tensors hold.
inline fp8_tensor_t* param_tensor(fp8_model_t* m, const std::string& name, bool grad = false) {
  fp8_tensor_t* value = nullptr;
  fp8_tensor_t* g = nullptr;
  EXPECT_OK(fp8_model_parameter(m, name.c_str(), &value, &g));
  return grad ? g : value;
}
// Writes float values into a parameter whatever its storage (fp8_model_write_parameter).
inline void set_param(fp8_model_t* m, const std::string& name, const std::vector<float>& v) {
  int32_t count = 0;
  ASSERT_EQ(fp8_model_parameter_count(m, &count), FP8_OK);
  for (int32_t i = 0; i < count; ++i) {
    const char* n = nullptr;
    ASSERT_EQ(fp8_model_parameter_at(m, i, &n, nullptr, nullptr), FP8_OK);
    if (name == n) {
      ASSERT_EQ(fp8_model_write_parameter(m, i, FP8_DTYPE_F32, v.data(), v.size() * sizeof(float)), FP8_OK)
          << fp8_last_error_message();
      return;
    }
  }
  FAIL() << "no parameter " << name;
}
inline fp8_dtype_t dtype_of(const fp8_tensor_t* t) {
  fp8_dtype_t dt = -1;
  EXPECT_OK(fp8_tensor_dtype(t, &dt));
  return dt;
}
// A tensor's data pointer (fp8_tensor_data).
inline void* data_of(const fp8_tensor_t* t) {
  void* d = nullptr;
  EXPECT_OK(fp8_tensor_data(t, &d));
  return d;
}
// The stored bytes, whatever the dtype.
inline std::vector<uint8_t> tensor_bytes(const fp8_tensor_t* t) {
  int64_t n = 0;
  EXPECT_OK(fp8_tensor_numel(t, &n));
  std::vector<uint8_t> b(static_cast<size_t>(n) * fp8_dtype_size(dtype_of(t)));
  EXPECT_OK(fp8_tensor_copy_to_host(t, b.data(), b.size()));
  return b;
}
inline fp8_optimizer_stats_t stats_of(const fp8_optimizer_t* o) {
  fp8_optimizer_stats_t s;
  fp8_optimizer_stats_init(&s);
  EXPECT_OK(fp8_optimizer_get_stats(o, &s));
  return s;
}
// The optimizer level's name (0 te, 1..3 O1..O3).
inline const char* level_name(int level) { return level == 0 ? "te" : level == 1 ? "O1" : level == 2 ? "O2" : "O3"; }


// An optimizer's hyper-parameters, as the tests set them, and the calls that set them.
struct Hyper {
  fp8_optimizer_kind_t kind = FP8_OPTIMIZER_ADAM;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, momentum = 0.0,
         max_grad_norm = 0.0;
};

// Sets every hyper-parameter the kind uses.
inline void apply(fp8_optimizer_t* o, const Hyper& h) {
  EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_LR, h.lr));
  EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_WEIGHT_DECAY, h.weight_decay));
  EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_MAX_GRAD_NORM, h.max_grad_norm));
  if (h.kind == FP8_OPTIMIZER_SGD) {
    EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_MOMENTUM, h.momentum));
  } else {
    EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_BETA1, h.beta1));
    EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_BETA2, h.beta2));
    EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_EPS, h.eps));
  }
}

}  // namespace fp8test
