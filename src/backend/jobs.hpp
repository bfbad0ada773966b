// The work items the backends execute. Plain structs of pointers and sizes, shared by the API
// layer, the CPU reference and the CUDA launchers; every pointer is device memory of the backend.
#pragma once

#include <cstdint>

#include "core/scaling_rule.hpp"
#include "fp8.h"

namespace fp8 {

// out[r][c] = encode(in[r][c] * state.scale); out_t[c][r] = the same code (when out_t != nullptr);
// state history slot 0 = max(slot 0, amax(in)); out_scale_inv / out_t_scale_inv = state.scale_inv.
struct QuantizeJob {
  const void* in;
  fp8_dtype_t in_dtype;  // F32, F16 or BF16
  int64_t rows, cols;    // the input viewed as a row-major matrix
  uint8_t* out;
  uint8_t* out_t;  // [cols][rows] or nullptr
  bool e5m2;
  ScalingHeader* state;
  float* out_scale_inv;
  float* out_t_scale_inv;  // nullptr when out_t is
};

// out[i] = convert(decode(in[i]) * *scale_inv)
struct DequantizeJob {
  const uint8_t* in;
  bool e5m2;
  const float* scale_inv;
  void* out;
  fp8_dtype_t out_dtype;
  int64_t n;
};

// *out = amax(in); *accumulate = max(*accumulate, amax(in)) when accumulate != nullptr.
struct AmaxJob {
  const void* in;
  fp8_dtype_t dtype;
  int64_t n;
  float* out;
  float* accumulate;
};

// One state of a batched scaling update (the rule in core/scaling_rule.hpp).
struct ScalingUpdateItem {
  ScalingHeader* state;
  float fp8_max_scaled;  // fp8_max * 2^-margin for the state's format
  int32_t recompute;     // 1 on updates where the interval says the scale is recomputed
};

struct ScalingUpdateJob {
  const ScalingUpdateItem* items;  // host array
  int32_t count;
  int32_t history_len;
  bool algo_max;  // false: most_recent
};

}  // namespace fp8
