// The optimizer behind fp8_optimizer_t: the hyper-parameters (with their ranges in one table), the
// device tables that list every parameter in chunks, the states, and the step (core/optim_rule.hpp
// holds the numerics both backends follow).
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "fp8.h"

struct fp8_model;

struct fp8_optimizer {
  std::shared_ptr<fp8::Backend> backend;
  fp8_model* model = nullptr;
  fp8_optimizer_kind_t kind = FP8_OPTIMIZER_ADAM;
  double attrs[FP8_OPTIM_ATTR_COUNT] = {};
  int32_t parameter_count = 0;  // the model's when the optimizer was made
  int64_t numel = 0;
  std::vector<fp8::OptimTensor> tensors;  // host copies of the device tables
  std::vector<fp8::OptimChunk> chunks;
  void* tables = nullptr;  // device: tensors, then chunks
  const fp8::OptimTensor* device_tensors = nullptr;  // into tables
  const fp8::OptimChunk* device_chunks = nullptr;
  float* states = nullptr;  // device: each tensor's m (and v), 16-byte aligned slices
  size_t state_bytes = 0;
  double* partials = nullptr;
  fp8::OptimScalars* scalars = nullptr;

  fp8_optimizer() = default;
  fp8_optimizer(const fp8_optimizer&) = delete;
  fp8_optimizer& operator=(const fp8_optimizer&) = delete;
  ~fp8_optimizer();
};

namespace fp8::optim {

std::unique_ptr<fp8_optimizer> make_optimizer(fp8_model& model, fp8_optimizer_kind_t kind);
// Throws FP8_ERR_INVALID_ARGUMENT naming the attribute and its range.
void set_attr(fp8_optimizer& o, fp8_optimizer_attr_t attr, double value);
double get_attr(const fp8_optimizer& o, fp8_optimizer_attr_t attr);
void step(fp8_optimizer& o);
fp8_optimizer_stats_t stats(const fp8_optimizer& o);

}  // namespace fp8::optim
