// The sections of a checkpoint file (checkpoint.cpp writes and reads them through these): each
// parameter's stored state, the scaling states and the optimizer, serialised field by field
// (little-endian integers, IEEE float bits), and the conversion of a parameter between the
// optimizer levels' layouts. Pure host code on byte vectors, so the fuzzer runs it as it is.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/optim_rule.hpp"
#include "core/scaling_rule.hpp"
#include "fp8.h"

namespace fp8::io {

inline constexpr uint32_t kCheckpointLayoutVersion = 1;  // of the sections' contents

// One parameter's stored state, on the host, in its layout's types.
struct ParamState {
  std::string name;
  int32_t layout = kLayoutF32;
  fp8_dtype_t value_dtype = FP8_DTYPE_F32;
  int64_t n = 0;
  std::vector<uint8_t> value;
  float value_scale_inv = 1.0f;  // E4M3 values (O3)
  bool has_grad = false;
  fp8_dtype_t grad_dtype = FP8_DTYPE_F32;
  std::vector<uint8_t> grad;
  GradScales grad_scales{};
  // Optimizer state (when the file or the target has an optimizer).
  std::vector<uint8_t> master;  // O3: the F16 master (the weight itself; with the parameter)
  bool has_scales = false;      // O1..O3 with an optimizer: its per-tensor scales
  CompactScales scales{};
  std::vector<uint8_t> m, v;  // the optimizer's moments; empty where the layout or kind has none
};

// One scaling state: the layer that owns it, its format, and its device contents.
struct ScalingRecord {
  std::string layer;
  int32_t history_len = 0;
  fp8_dtype_t dtype = FP8_DTYPE_E4M3;
  bool pending = false;
  ScalingHeader header{};
  std::vector<float> history;
};

// The optimizer's own state besides the per-parameter one.
struct OptimRecord {
  fp8_optimizer_kind_t kind = FP8_OPTIMIZER_ADAM;
  int32_t level = 0;
  double attrs[FP8_OPTIM_ATTR_COUNT] = {};
  OptimScalars scalars{};
};

inline size_t bytes_of(int64_t n, size_t element) {
  return static_cast<size_t>(n) * element;
}
// Element sizes of m and v in a layout (F32 for te and O1, E4M3 and F16 for O2/O3).
inline size_t m_size(int32_t layout) {
  return layout >= kLayoutO2 ? 1 : 4;
}
inline size_t v_size(int32_t layout) {
  return layout >= kLayoutO2 ? 2 : 4;
}

class ByteReader;
// A u8 that must be 0 or 1 (FP8_ERR_CORRUPT naming `what` otherwise).
bool get_flag(ByteReader& r, const char* what);

// Decoders throw FP8_ERR_CORRUPT naming what is inconsistent; they never trust a length field.
std::vector<uint8_t> encode_params(const std::vector<ParamState>& params);
std::vector<ParamState> decode_params(const std::vector<uint8_t>& data);
std::vector<uint8_t> encode_scaling(const std::vector<ScalingRecord>& states);
std::vector<ScalingRecord> decode_scaling(const std::vector<uint8_t>& data);
// The per-parameter part (m, v, master, scales) goes into and comes out of `params`.
std::vector<uint8_t> encode_optimizer(const OptimRecord& o, const std::vector<ParamState>& params);
OptimRecord decode_optimizer(const std::vector<uint8_t>& data, std::vector<ParamState>& params);

// The scales of the FP8 weight copies the Linears hold between micro-batches: (layer index, scale).
using WeightCopies = std::vector<std::pair<uint32_t, float>>;
std::vector<uint8_t> encode_weight_copies(const WeightCopies& copies);
WeightCopies decode_weight_copies(const std::vector<uint8_t>& data);

// The weight as floats: the F16 master at O3 when there is one, else the stored value.
std::vector<float> weight_floats(const ParamState& p);
std::vector<uint8_t> floats_bytes(const std::vector<float>& f);
// Largest |weight| as stored at O1..O3 (the F16 value or master): the amax the optimizer's bounds
// start from (CompactScales::p_amax), as fp8_optimizer_create and each step compute it.
float stored_weight_amax(const ParamState& p);
// Re-encodes a parameter into `layout` (weights, m, v, master, scales): exact widening towards te,
// rounding (and fresh per-tensor scales from the values' amax) towards O1..O3.
void convert_layout(ParamState& p, int32_t layout);
// Re-encodes a saved gradient for a target of `dtype` (FP32, or FP8 with its scales).
void convert_grad(ParamState& p, fp8_dtype_t dtype);

}  // namespace fp8::io
