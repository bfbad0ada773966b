// The optimizer behind fp8_optimizer_t: the hyper-parameters (with their ranges in one table), the
// opt level and the storage it gives each parameter, the device tables that list every parameter
// in chunks, the states, and the step (core/optim_rule.hpp holds the numerics both backends follow).
//
// State layout (ready to be sharded over ranks by ranges of chunks): each kind of state is one flat
// allocation with a 16-element-aligned slice per tensor — FP32 m/v (te layout, biases and norms at
// every level, O1's weights), E4M3 m and F16 v (O2/O3), F16 masters (O3) — plus one CompactScales
// per Linear weight.
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
  int32_t level = 0;  // 0: te (FP32 everything); 1..3: MS-AMP O1..O3 for the Linear weights
  double attrs[FP8_OPTIM_ATTR_COUNT] = {};
  int32_t parameter_count = 0;  // the model's when the optimizer was made
  int64_t numel = 0;
  std::vector<fp8::OptimTensor> tensors;  // host copies of the device tables
  std::vector<fp8::OptimChunk> chunks;
  // Per tensor, the elements whose m and v (and O3 master) this rank keeps: the whole tensor, or its
  // share when the model's masters are sharded over ranks (len-0 chunks elsewhere).
  std::vector<std::pair<int64_t, int64_t>> owned;
  bool sharded = false;
  void* tables = nullptr;  // device: tensors, then chunks
  const fp8::OptimTensor* device_tensors = nullptr;  // into tables
  const fp8::OptimChunk* device_chunks = nullptr;
  // The flat state allocations (see above); nullptr where no tensor has that state.
  float* states = nullptr;      // FP32 m (and v)
  uint8_t* states_m8 = nullptr;
  uint16_t* states_v16 = nullptr;
  fp8::CompactScales* scales = nullptr;
  size_t state_bytes = 0;     // m and v, as stored
  int64_t compact_count = 0;   // CompactScales at `scales`
  size_t training_bytes = 0;  // values + masters + gradients + m + v, as stored
  std::vector<uint64_t> value_versions;  // each parameter value's version at the last step
  double* partials = nullptr;
  fp8::OptimScalars* scalars = nullptr;
  // Device memory the step reads: the hyper-parameters (uploaded by every set) and the per-element
  // constants the step derives from them.
  fp8::OptimHyper* hyper = nullptr;
  fp8::OptimElementArgs* element_args = nullptr;

  fp8_optimizer() = default;
  fp8_optimizer(const fp8_optimizer&) = delete;
  fp8_optimizer& operator=(const fp8_optimizer&) = delete;
  ~fp8_optimizer();
};

namespace fp8::optim {

// The level a model's recipe gives an optimizer of `kind`: 0 (te) for an unconverted model or
// backend te; the recipe's opt_level for backend msamp; for auto (which prefers MS-AMP, as
// Accelerate documents) the same, capped at O1 for SGD, which has no moments to keep in FP8.
int32_t resolve_level(const fp8_model& model, fp8_optimizer_kind_t kind);
const char* kind_name(fp8_optimizer_kind_t kind);  // "SGD", "Adam", "AdamW"

// Makes the optimizer; at O1..O3 converts the model's Linear weights (values and gradients) to the
// level's storage. Refuses (FP8_ERR_UNSUPPORTED) a level the kind cannot run and a second optimizer
// over weights another one holds (FP8_ERR_INVALID_STATE).
std::unique_ptr<fp8_optimizer> make_optimizer(fp8_model& model, fp8_optimizer_kind_t kind);
// Throws FP8_ERR_INVALID_ARGUMENT naming the attribute and its range.
void set_attr(fp8_optimizer& o, fp8_optimizer_attr_t attr, double value);
// The range check alone (FP8_ERR_INVALID_ARGUMENT naming the attribute and its range).
void check_attr(fp8_optimizer_attr_t attr, double value);
double get_attr(const fp8_optimizer& o, fp8_optimizer_attr_t attr);
// Copies o.attrs to the device memory the step reads (after any change of them). Synchronous.
void upload_hyper(fp8_optimizer& o);
// One update (fp8_optimizer_step); with other_sumsq, a joint step (fp8_optimizer_step_joint):
// device pointers to the other gradients' squared norm and to where their clip factor goes (or nullptr).
void step(fp8_optimizer& o, const float* other_sumsq = nullptr, float* clip_out = nullptr);
// The optimizer's model; FP8_ERR_INVALID_STATE once the model is destroyed.
fp8_model& model_of(const fp8_optimizer& o);
// Allocates m (and v) now if they do not exist yet (SGD makes its momentum buffer at the first step
// that needs one); a checkpoint load that brings states calls it.
void ensure_states(fp8_optimizer& o);
fp8_optimizer_stats_t stats(const fp8_optimizer& o);

}  // namespace fp8::optim
