// The model behind fp8_model_t: its layers in order, the conversion recipe, the training and
// autocast flags, the activations of whole-model runs, and the operations over all layers
// (conversion, sequential forward/backward, the batched scaling update, the report).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/layer.hpp"
#include "nn/storage.hpp"

namespace fp8::dist {
struct ModelComm;
}

namespace fp8::nn {

// A tensor over a grow-only buffer: the activations and gradients between the layers of a
// whole-model run keep their memory while batch sizes go up and down.
struct ScratchTensor {
  explicit ScratchTensor(std::shared_ptr<Backend> backend) : storage(backend) { view.backend = std::move(backend); }
  // Points `view` at storage big enough for dtype x shape (FP8: with a scale_inv slot behind it).
  fp8_tensor* bind(fp8_dtype_t dtype, int32_t ndim, const int64_t* shape);
  DeviceBuffer storage;
  fp8_tensor view;
};

// What the backward of a run of layers (a whole-model run or a stack) checks its dy and dx against.
struct RunRecord {
  fp8_dtype_t dtype = FP8_DTYPE_F32, x_dtype = FP8_DTYPE_F32;  // y's, x's
  fp8_dtype_t act = FP8_DTYPE_F32;  // the activations' between the layers (y's but under a residual)
  int32_t ndim = 0;
  int64_t x_shape[FP8_MAX_DIMS] = {}, y_shape[FP8_MAX_DIMS] = {};
  const void* x_data = nullptr;  // the caller's x, which the first layer's backward reads again
  size_t x_bytes = 0;
  std::vector<std::vector<int64_t>> shapes;  // the input shape of each layer after the first
};

}  // namespace fp8::nn

struct fp8_model {
  fp8_model();
  std::shared_ptr<fp8::Backend> backend;
  uint64_t serial;  // unique among this process's models: a forward state names its model by it
  std::shared_ptr<fp8::nn::BufferPool> pool;  // the forward states' buffers (made with the backend)
  std::vector<std::unique_ptr<fp8::nn::Layer>> layers;
  std::optional<fp8::Recipe> recipe;  // set by fp8_convert_model(to_fp8 = 1)
  bool training = true;
  bool autocast = false;  // inside a region, explicit or made by the autowrap
  bool autowrap = false;
  bool step_captured = false;  // an optimizer step of this model was captured in a CUDA graph
  uint64_t weights_version = 0;
  // Every layer call's transient buffers (Step::scratch).
  std::unique_ptr<fp8::nn::DeviceBuffer> call_scratch;
  // The parameters' flat storage, at the level the recipe of the last conversion gives (fixed then),
  // and the optimizer that keeps MS-AMP state (compact scales) for the Linear weights while it lives.
  std::unique_ptr<fp8::nn::ParamStore> store;
  struct fp8_optimizer* weight_owner = nullptr;
  // The gradient bytes per communication bucket once data-parallel (fp8_model_set_bucket_bytes).
  size_t bucket_bytes = FP8_DEFAULT_BUCKET_BYTES;
  // Set by fp8_model_set_comm: the communicator and the data-parallel state (dist/data_parallel.hpp).
  std::unique_ptr<fp8::dist::ModelComm> comm;
  // The `model` field of every live optimizer made on this model: the destructor clears them, so
  // an optimizer that outlives its model refuses to run instead of touching freed memory.
  std::vector<fp8_model**> optimizer_links;

  fp8_model(const fp8_model&) = delete;
  fp8_model& operator=(const fp8_model&) = delete;
  ~fp8_model();
  // fp8_layer_forward / fp8_layer_backward: per layer, the forward awaiting its backward (or the
  // latest eval-mode one, so that a backward can say why it is refused).
  std::vector<std::unique_ptr<fp8_saved>> latest;
  // Whole-model runs: the output of layer i is acts[i] (the last one is the caller's y); the
  // gradients between layers alternate between two buffers. run_saved holds each layer's state of
  // the training-mode fp8_model_forward awaiting fp8_model_backward (empty when none).
  std::vector<std::unique_ptr<fp8::nn::ScratchTensor>> acts;
  std::unique_ptr<fp8::nn::ScratchTensor> grads[2], first_dx;
  std::vector<std::unique_ptr<fp8_saved>> run_saved;
  fp8::nn::RunRecord run;
};

namespace fp8::nn {

// Throws FP8_ERR_INVALID_ARGUMENT unless `name` can name a new layer of `m`.
void require_new_layer_name(const fp8_model& m, const char* name);
Layer& layer_at(fp8_model& m, int32_t id);
const Layer& layer_at(const fp8_model& m, int32_t id);

// The step description for a layer call now.
Step make_step(fp8_model& m);

// Adds a layer and lays its parameters into the model's storage; all or nothing.
void add_layer(fp8_model& m, std::unique_ptr<Layer> layer);

// The storage level a conversion under `recipe` gives the Linear weights: 0 (FP32) without a
// recipe or with backend te, else the recipe's opt_level (backend msamp, or auto, which prefers it).
int32_t storage_level(const Recipe* recipe);

struct ConvertChoice {
  bool to_fp8, linear, norm, activation;
};
// Converts the chosen layers and lays the parameters out at the recipe's storage level; all or
// nothing (FP8_ERR_INVALID_STATE when the level would change under a live optimizer).
void convert_model(fp8_model& m, const Recipe* recipe, const ConvertChoice& choice);

// One batched update of the states that recorded an amax since their last update (only the
// gradient states when `backward_only`).
void update_model_scaling(fp8_model& m, bool backward_only = false);

// One layer's forward (fp8_layer_forward_saved): the state it returns names the model and layer.
std::unique_ptr<fp8_saved> layer_forward(fp8_model& m, int32_t id, const fp8_tensor* x, fp8_tensor* y);
// The backward of the forward that made `saved`, after refusing a state of another model or layer,
// of an earlier conversion, consumed, or from eval mode; marks it consumed and gives its buffers back.
void layer_backward(fp8_model& m, int32_t id, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, uint32_t flags);
// Layers [first, first + count) as one stack, as model_forward runs them all (fp8_stack_forward_saved):
// the state holds each layer's and the activations between them that their backwards read.
// With `residual` (fp8_stack_forward_residual) y = residual + the stack's output, the activations
// between the layers of dtype `act`.
std::unique_ptr<fp8_saved> stack_forward(fp8_model& m, int32_t first, int32_t count, const fp8_tensor* x, fp8_tensor* y,
                                         const fp8_tensor* residual = nullptr, fp8_dtype_t act = FP8_DTYPE_F32);
// Its backward (fp8_stack_backward_saved); every refusal comes before any layer runs. flags: the
// FP8_BACKWARD_* flags; with `base` (fp8_stack_backward_saved_add, flags 0) dx = base + the input
// gradient.
void stack_backward(fp8_model& m, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, uint32_t flags,
                    const fp8_tensor* base = nullptr);
// Drops the forward states the model keeps itself (fp8_layer_forward's and fp8_model_forward's), as
// a mode change or a conversion does.
void drop_kept_states(fp8_model& m);

// Runs the layers in order (fp8_model_forward) and back (fp8_model_backward).
void model_forward(fp8_model& m, const fp8_tensor* x, fp8_tensor* y);
void model_backward(fp8_model& m, const fp8_tensor* dy, fp8_tensor* dx);

// Opens a region for one call when the autowrap asks for it and none is open. close() ends it at
// the end of a successful call and updates the states the call recorded; on an error the
// destructor just ends it.
class AutowrapRegion {
 public:
  explicit AutowrapRegion(fp8_model& m);
  ~AutowrapRegion();
  void close();
  AutowrapRegion(const AutowrapRegion&) = delete;
  AutowrapRegion& operator=(const AutowrapRegion&) = delete;

 private:
  fp8_model& m_;
  bool opened_ = false;
};

// Sets every gradient to zero.
void zero_grad(fp8_model& m);
// The index (in the model's order) of layer `layer_id`'s first parameter.
int32_t first_parameter(const fp8_model& m, int32_t layer_id);

// The parameter at `index` in the model's order; FP8_ERR_INVALID_ARGUMENT naming the range otherwise.
Parameter& parameter_at(fp8_model& m, int32_t index);
// Every parameter, in the model's order (layers in order, then each layer's own).
std::vector<Parameter*> all_parameters(fp8_model& m);
std::vector<const Parameter*> all_parameters(const fp8_model& m);
// How a parameter is stored now (OptimLayout): FP32 (te), F16 (the model's O1 or O2), E4M3 (O3).
int32_t stored_layout(const fp8_model& m, const Parameter& p);

// "<layer>.<param>" -> the parameter, or nullptr. A norm's parameters are also found by their
// names of earlier releases (gamma, beta).
Parameter* find_parameter(fp8_model& m, const std::string& full_name);
// A parameter's full name of an earlier release as it is now ("ln.gamma" -> "ln.weight").
std::string current_parameter_name(const std::string& full_name);
// The longest layer name (bytes): room for torch's dotted module paths.
constexpr size_t kMaxLayerName = 127;

std::string model_report(const fp8_model& m);
const char* kind_name(int32_t layer_kind);  // "linear", "layernorm", "rmsnorm", "activation"

}  // namespace fp8::nn
