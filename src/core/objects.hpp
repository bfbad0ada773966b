// The objects behind the opaque handles of fp8.h. Each keeps its context's backend alive through a
// shared_ptr, so a context may be destroyed before the tensors and states made from it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "core/recipe.hpp"
#include "core/scaling_rule.hpp"
#include "fp8.h"

struct fp8_context {
  std::shared_ptr<fp8::Backend> backend;
};

struct fp8_recipe {
  fp8::Recipe recipe;
};

struct fp8_tensor {
  std::shared_ptr<fp8::Backend> backend;
  fp8_dtype_t dtype = FP8_DTYPE_F32;
  int32_t ndim = 0;
  int64_t shape[FP8_MAX_DIMS] = {};
  int64_t numel = 1;
  void* data = nullptr;
  bool owns_data = false;  // the memory is the tensor's own (fp8_tensor_create, a new layer's parameter)
  // Holds the memory behind data (when libfp8 or a DLPack producer owns it), shared with the
  // DLPack consumers it is lent to: it is released with the last of them.
  std::shared_ptr<void> keeper;
  // FP8 dtypes only: the dequantisation factor, in device memory. It shares the data allocation of
  // an owned tensor and has a small allocation of its own for a wrapped one.
  float* scale_inv = nullptr;
  void* scale_inv_allocation = nullptr;
  // Counts writes through fp8_tensor_copy_from_host, so a layer notices new parameter values.
  uint64_t version = 0;
  // Set when the library keeps state the tensor's bytes must agree with (an FP8 gradient's amax,
  // O3's F16 master): fp8_tensor_copy_from_host and fp8_tensor_set_scale_inv refuse with this.
  const char* write_refusal = nullptr;
  // Set on a tensor the library lends out (a model's parameter value or gradient): its owner keeps
  // and releases it, and fp8_tensor_destroy refuses it, naming the owner with this text.
  const char* lent_by = nullptr;

  fp8_tensor() = default;
  fp8_tensor(const fp8_tensor&) = delete;
  fp8_tensor& operator=(const fp8_tensor&) = delete;
  ~fp8_tensor();

  size_t nbytes() const;
  // The tensor as a row-major matrix: cols = last dimension, rows = product of the others.
  int64_t cols() const { return ndim == 0 ? 1 : shape[ndim - 1]; }
  int64_t rows() const {
    int64_t r = 1;
    for (int32_t i = 0; i + 1 < ndim; ++i) r *= shape[i];
    return r;
  }
};

struct fp8_scaling {
  std::shared_ptr<fp8::Backend> backend;
  fp8::ScalingHeader* state = nullptr;  // device memory: header, then the history
  // The allocation holding the state (make_scaling_arena), shared by a model's states and released
  // with the last of them.
  std::shared_ptr<void> arena;
  int32_t history_len = 0;
  fp8_dtype_t dtype = FP8_DTYPE_E4M3;
  uint64_t update_mark = 0;  // the fp8_scaling_update call that last listed it (finds duplicates)
  // Kept by the layers of a model: the state's role, and whether work queued since its last update
  // recorded an amax into it (only such states are updated at the end of a region).
  bool backward_role = false;
  bool pending = false;
  // Current scaling (the recipe's scaling=current when the state was made): each cast makes its
  // scale from its input's amax, with this fp8_max * 2^-margin and power_2_scales (fp8.h).
  bool current = false;
  float current_fp8_max = 0.0f;
  bool current_pow2 = false;

  fp8_scaling() = default;
  fp8_scaling(const fp8_scaling&) = delete;
  fp8_scaling& operator=(const fp8_scaling&) = delete;
  ~fp8_scaling() = default;
};

namespace fp8 {

// Where the scale_inv of an FP8 tensor that shares its data's allocation sits: the first 16-byte
// boundary behind nbytes of codes.
inline size_t scale_inv_offset(size_t nbytes) {
  return (nbytes + 15) / 16 * 16;
}

// Validates dtype, ndim and shape (naming them in the error) and builds a tensor: over the caller's
// `data` when `borrow` is set, else over a new allocation (`data` ignored). An owned FP8 tensor's
// scale_inv slot holds `scale_bytes` (>= 4; an FP8 gradient keeps its GradScales there); a borrowed
// one uses `scale_inv` when given (the caller's), else a slot of its own set to 1.
std::unique_ptr<fp8_tensor> make_tensor(const std::shared_ptr<Backend>& backend, fp8_dtype_t dtype, int32_t ndim,
                                        const int64_t* shape, bool borrow, void* data,
                                        size_t scale_bytes = sizeof(float), float* scale_inv = nullptr);

// Marks `t` as a model's parameter tensor (see fp8_tensor::lent_by) and passes it on.
constexpr const char* kLentByModel =
    "its model (a parameter value or gradient from fp8_model_parameter / fp8_model_parameter_at)";
inline std::unique_ptr<fp8_tensor> lent_by_model(std::unique_ptr<fp8_tensor> t) {
  t->lent_by = kLentByModel;
  return t;
}

// A state with scale `scale`, scale_inv 1/scale (as every update sets it) and a zeroed history.
std::unique_ptr<fp8_scaling> make_scaling(const std::shared_ptr<Backend>& backend, const Recipe& recipe,
                                          fp8_role_t role, float scale = 1.0f);

// States for `roles` under `recipe` in ONE device allocation, in order, each with scale `scale`,
// scale_inv 1/scale and a zeroed history: a model's states, so that they are updated (and, across
// ranks, reduced) together.
std::vector<std::unique_ptr<fp8_scaling>> make_scaling_arena(const std::shared_ptr<Backend>& backend,
                                                             const Recipe& recipe, const std::vector<fp8_role_t>& roles,
                                                             float scale = 1.0f);

// Points a cast at `s`: its state, and under current scaling the rule's parameters.
inline void cast_through(QuantizeJob& job, const fp8_scaling& s) {
  job.state = s.state;
  job.current = s.current;
  job.current_fp8_max = s.current_fp8_max;
  job.current_pow2 = s.current_pow2;
}

// One batched delayed-scaling update of `count` states (already checked against `recipe`).
void update_scaling(Backend& backend, fp8_scaling* const* states, int32_t count, const Recipe& recipe);

}  // namespace fp8
