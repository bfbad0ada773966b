// The layers of a model: Linear, LayerNorm/RMSNorm and activations. Each owns its parameters (FP32
// masters with FP32 gradients), its delayed-scaling states once converted to FP8, and the buffers
// its forward keeps for the backward. Layers queue work through the Backend only; argument checks
// that depend on the layer (shapes, dtypes, state) live here, the generic ones in src/api.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "core/recipe.hpp"

// What one forward of a layer keeps for its backward (fp8_saved_t). Each layer kind derives its own;
// the fields here let a backward refuse a state that is not its own, consumed, or from eval mode.
struct fp8_saved {
  virtual ~fp8_saved() = default;
  // Gives the state's device buffers back to the model's pool (after its backward has been queued).
  virtual void release() {}
  uint64_t model_serial = 0;  // the model's (fp8_model::serial): unique per model in this process
  int32_t layer_id = -1;
  uint64_t layer_epoch = 0;  // the layer's conversion count when the forward ran
  bool training = false;
  bool consumed = false;
  bool stack = false;  // made by fp8_stack_forward_saved (nn::StackSaved), for fp8_stack_backward_saved
  // Whether the backward reads the caller's x (fp8_saved_needs_input): a norm's and an activation's
  // always; a Linear's only for a high-precision weight gradient from the caller's own x.
  bool reads_input = true;
};

namespace fp8::nn {

// Device memory that grows on demand and never shrinks (contents are lost when it grows), so a
// steady training loop allocates nothing.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}
  ~DeviceBuffer() { backend_->release(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T = void>
  T* ensure(size_t bytes) {
    if (bytes > bytes_) {
      void* fresh = backend_->allocate(bytes);
      backend_->release(data_);
      data_ = fresh;
      bytes_ = bytes;
    }
    return static_cast<T*>(data_);
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  size_t capacity() const { return bytes_; }

 private:
  std::shared_ptr<Backend> backend_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// One layer call's transient buffers, carved out of the model's call scratch (Step::scratch): the
// call adds up its sizes, then takes the base once, so the scratch grows (if it must) before any
// pointer into it is handed out. Every region starts 256-byte aligned.
class ScratchLayout {
 public:
  size_t add(size_t bytes) {
    const size_t at = total_;
    total_ += (bytes + 255) / 256 * 256;
    return at;
  }
  char* base(DeviceBuffer& scratch) const { return scratch.ensure<char>(total_); }

 private:
  size_t total_ = 0;
};

// Device buffers lent to forward states (fp8_saved) and given back when a state is consumed or
// destroyed, so a steady loop allocates nothing however many forwards are in flight. Shared by a
// model and every state it made (a state may outlive its model). Best fit: the smallest free buffer
// that holds the request, else the largest free one grown, else a new one.
class BufferPool {
 public:
  explicit BufferPool(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}
  std::unique_ptr<DeviceBuffer> take(size_t bytes);
  void give(std::unique_ptr<DeviceBuffer> buffer);

 private:
  std::shared_ptr<Backend> backend_;
  std::mutex mutex_;  // fp8_saved_destroy may come from another thread (a binding's collector)
  std::vector<std::unique_ptr<DeviceBuffer>> free_;
};

// A buffer on loan from a pool for as long as the forward state holding it lives.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(std::shared_ptr<BufferPool> pool, size_t bytes) : pool_(std::move(pool)), buffer_(pool_->take(bytes)) {}
  PooledBuffer(PooledBuffer&&) = default;
  PooledBuffer& operator=(PooledBuffer&& other) noexcept {
    reset();
    pool_ = std::move(other.pool_);
    buffer_ = std::move(other.buffer_);
    return *this;
  }
  ~PooledBuffer() { reset(); }
  void reset() {
    if (buffer_) pool_->give(std::move(buffer_));
  }
  template <typename T = void>
  T* get() const {
    return buffer_ ? buffer_->get<T>() : nullptr;
  }

 private:
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<DeviceBuffer> buffer_;
};

class Layer;

// What a layer call needs from its model.
struct Step {
  Backend& backend;
  const Recipe* recipe;      // the conversion recipe; nullptr when the model is not converted
  bool fp8;                  // FP8 is on for this call (autocast, and training or FP8 eval allowed)
  bool training;
  uint64_t weights_version;  // grows with fp8_model_weights_changed and optimizer steps
  // The model's scratch for what one layer call needs only while it runs (a Linear's casts of x and
  // dy, its new FP32 dW before it joins an FP8 gradient): one for all layers, since the calls of a
  // model run one after the other on its stream.
  DeviceBuffer* scratch;
  const std::shared_ptr<BufferPool>& pool;  // lends the forward states their buffers
  uint64_t capture_id;                      // the CUDA graph capture under way on the stream (0: none)
  // An optimizer step of this model was captured: its replays change the weights behind the host's
  // back, so an eager call remakes weight copies instead of trusting their version.
  bool steps_replayed;
  // The model's layers, whose FP8 weight copies the first Linear that needs a new one makes
  // together (make_weight_copies).
  const std::vector<std::unique_ptr<Layer>>& layers;
};

// A parameter's value and gradient: views into the model's flat storage (nn/storage.hpp). FP32
// both, except a Linear weight under an MS-AMP level (set when the model is converted): an F16 value
// (O1/O2) or an E4M3 one (O3, with its F16 master), and an FP8 gradient whose GradScales sit where
// grad's scale_inv points. A layer's constructor makes them with memory of their own, which the
// model's storage takes over when the layer is added.
struct Parameter {
  std::string name;  // "<layer>.<weight|bias>"
  std::unique_ptr<fp8_tensor> value, grad;
  uint16_t* master = nullptr;  // O3: the F16 master weight, indexed by element: it holds [owned_lo, owned_hi)
  int64_t owned_lo = 0, owned_hi = 0;  // the whole tensor, except O3 masters sharded over ranks
  bool linear_weight = false;  // takes its opt level's layout
  GradScales* grad_scales() const { return reinterpret_cast<GradScales*>(grad->scale_inv); }  // FP8 grad only
};

// Precision of one GEMM in the latest forward: -1 not run yet, 0 high precision, 1 FP8.
struct LayerStats {
  int32_t fprop = -1, dgrad = -1, wgrad = -1;
  int64_t fp8_calls = 0;       // forwards whose main GEMM (or output) was FP8
  int64_t fallback_calls = 0;  // forwards of a converted layer under FP8 that ran in high precision
  std::string reason;          // why the latest such forward did not run (all) in FP8
};

// An elementwise activation (ReLU or GELU) that a run of layers folds into a Linear's cast: its
// forward into the x cast of the Linear after it (the activation's E4M3 output never written, cast
// with the activation's output state), its backward into the dy cast of the Linear before it (its dx
// never written).
struct FoldedActivation {
  fp8_activation_t act;
  const void* x;       // the activation's input (the Linear's y before it), activation dtype
  fp8_scaling* state;  // forward: the activation's output state, which scales x's cast
};

// A residual the last layer of a stack adds to its output (fp8_stack_forward_residual): y =
// residual + layer(x), y and the residual of one dtype, x (wide) and dx of `act`.
struct ResidualAdd {
  const fp8_tensor* residual;
  fp8_dtype_t act;
};

class Layer {
 public:
  Layer(std::shared_ptr<Backend> backend, std::string name, int32_t kind)
      : backend_(std::move(backend)), name_(std::move(name)), kind_(kind) {}
  virtual ~Layer() = default;

  const std::string& name() const { return name_; }
  int32_t kind() const { return kind_; }
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  const LayerStats& stats() const { return stats_; }
  bool converted() const { return converted_; }

  // y = layer(x); returns what the backward of this forward needs (also in eval mode). The caller
  // (nn::layer_forward) fills in the fields of fp8_saved itself. With `folded` (only where
  // takes_folded_input said yes) x is the input of the activation before the layer, and the layer
  // computes y = layer(folded->act(x)).
  virtual std::unique_ptr<fp8_saved> forward(const Step& step, const fp8_tensor* x, fp8_tensor* y,
                                             const FoldedActivation* folded = nullptr) = 0;
  // The same with a residual added to y: a Linear's GEMM adds it (the runner asks no other kind).
  virtual std::unique_ptr<fp8_saved> forward_residual(const Step& /*step*/, const fp8_tensor* /*x*/, fp8_tensor* /*y*/,
                                                      const FoldedActivation* /*folded*/, const ResidualAdd& /*r*/) {
    fail(FP8_ERR_INTERNAL, "layer '", name_, "' cannot add a residual");
  }
  // An activation layer (ReLU, GELU, converted): the forward whose output the next layer computes
  // itself (takes_folded_input): the checks and the state of a forward, no work; fills `out`.
  // nullptr for a layer that cannot.
  virtual std::unique_ptr<fp8_saved> forward_into_next(const Step& /*step*/, const fp8_tensor* /*x*/,
                                                       FoldedActivation* /*out*/) {
    return nullptr;
  }
  // A Linear: whether a forward of `rows` rows under `step` can take an activation folded into its x
  // cast (FP8 fprop and weight gradient, training, delayed scaling).
  virtual bool takes_folded_input(const Step& /*step*/, int64_t /*rows*/) const { return false; }
  // Differentiates the forward that made `saved` (already checked to be this layer's, unconsumed, of
  // this conversion and from training mode). dx may be nullptr when no input gradient is wanted (a
  // Linear); with dx_base (of dx's dtype and shape: dx itself to accumulate, or a residual's
  // gradient) dx = dx_base + the layer's dx. With `folded` (only where folds_activation_grad said
  // yes) dy is the gradient of folded->act(y), not of y.
  virtual void backward(const Step& step, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, const void* dx_base,
                        const FoldedActivation* folded = nullptr) = 0;
  // An activation layer: whether its backward of `saved` can be folded into the layer before it,
  // and what that layer then needs (ReLU and GELU can; SwiGLU changes the width and cannot).
  virtual bool foldable_activation(const fp8_saved& /*saved*/, FoldedActivation* /*out*/) const { return false; }
  // A Linear: whether its backward of `saved` can take `act`'s gradient folded into its dy cast (an
  // FP8 dy cast with its transposed copy under delayed scaling, and an FP8 dgrad if dx is wanted).
  virtual bool folds_activation_grad(const fp8_saved& /*saved*/, bool /*dx_wanted*/) const { return false; }
  // Conversions so far: a forward state from an earlier one is refused.
  uint64_t epoch() const { return epoch_; }
  // Whether the parameters `saved`'s forward used are still the layer's (an optimizer step or a write
  // since makes its backward wrong); layers without parameters are always current.
  virtual bool saved_current(const Step& /*step*/, const fp8_saved& /*saved*/) const { return true; }
  // Throws FP8_ERR_INVALID_STATE unless saved_current: run before any layer of a backward does.
  void check_saved(const Step& step, const fp8_saved& saved) const;

  // Conversion in two steps, so that a model converts all or nothing: the roles of the scaling
  // states the layer needs as an FP8 one under `recipe` (none for recipe == nullptr or a layer FP8
  // cannot run), which the model makes in one arena for all its layers, then taking them (never
  // throws). Parameters are untouched either way.
  using States = std::vector<std::unique_ptr<fp8_scaling>>;
  virtual std::vector<fp8_role_t> state_roles(const Recipe* recipe) const = 0;
  virtual void convert(const Recipe* recipe, States states) noexcept = 0;
  // The scaling states the model updates in its batched call (none unless converted).
  virtual void scaling_states(std::vector<fp8_scaling*>& out) = 0;
  // The state behind an FP8_SCALING_* slot, or nullptr if the layer has none there.
  virtual fp8_scaling* scaling(int32_t slot) = 0;

  // For whole-model runs: the input features the layer needs (0: any), the output features it
  // gives for `in` of them (throws FP8_ERR_SHAPE naming the layer when it cannot take `in`), and
  // whether a forward of `rows` rows under `step` would take its x in E4M3 (an FP8 forward GEMM).
  virtual int64_t input_features() const { return 0; }
  virtual int64_t output_features(int64_t in) const { return in; }
  virtual bool takes_fp8_input(const Step&, int64_t /*rows*/) const { return false; }
  // The checks of a backward's dx that need no dy (dtype, shape, alignment against the saved
  // forward), so a whole-model backward can make them before any layer runs.
  virtual void check_dx(const fp8_saved& /*saved*/, const fp8_tensor* /*dx*/) const {}

  // Checkpoints taken between micro-batches: the scale of the FP8 weight copy the layer holds for
  // the model's weights version (false when it holds none), and, after a load, the scale its next
  // copy is made with, recording no amax (the original copy's was recorded already); 0 unpins.
  virtual bool weight_copy_scale(uint64_t /*model_version*/, float* /*scale*/) const { return false; }
  virtual void pin_weight_copy_scale(float /*scale*/) {}
  // Adds the cast of the layer's next FP8 weight copy to `jobs` (true) when it is due: under delayed
  // scaling, a layer that used its copy at this weights version or the one before and whose copy
  // for these weights is still to make; then, once the casts are queued, weight_copy_made counts it
  // as made (make_weight_copies).
  virtual bool stage_weight_copy(const Step& /*step*/, std::vector<QuantizeJob>& /*jobs*/) { return false; }
  virtual void weight_copy_made(const Step& /*step*/) {}

 protected:
  // Adds a parameter with a zeroed gradient, its value filled with `init`.
  fp8_tensor* add_parameter(const char* name, int32_t ndim, const int64_t* shape, float init);
  // The layer's parameter values change when the model's version or a parameter's own grows.
  uint64_t weights_version(const Step& step) const { return weights_version(step.weights_version); }
  uint64_t weights_version(uint64_t model_version) const;
  std::unique_ptr<fp8_scaling> new_state(const Recipe& recipe, fp8_role_t role, float scale = 1.0f) const {
    return make_scaling(backend_, recipe, role, scale);
  }

  std::shared_ptr<Backend> backend_;
  std::string name_;
  int32_t kind_;
  std::vector<Parameter> params_;
  LayerStats stats_;
  bool converted_ = false;
  uint64_t epoch_ = 0;  // convert() increments it
};

// Makes the FP8 weight copies of every layer of step.layers whose copy is due (stage_weight_copy)
// in one Backend::quantize_group: the copies each layer's first FP8 call after a weights change
// would make (same scales, same amaxes recorded), but in one pass over the weights instead of one
// launch per layer, too small each to fill the GPU.
void make_weight_copies(const Step& step);

std::unique_ptr<Layer> make_linear(std::shared_ptr<Backend> backend, std::string name, int64_t in_features,
                                   int64_t out_features, bool with_bias);
std::unique_ptr<Layer> make_norm(std::shared_ptr<Backend> backend, std::string name, bool rms, int64_t dim,
                                 float eps);
std::unique_ptr<Layer> make_activation(std::shared_ptr<Backend> backend, std::string name, fp8_activation_t act);

// Checks shared by the layers; messages name the layer and the argument.
void require_layer_dtype(const std::string& layer, const fp8_tensor* t, const char* name, bool allow_fp8);
// Whether t has `ndim` dimensions of `shape`.
inline bool has_shape(const fp8_tensor* t, int32_t ndim, const int64_t* shape) {
  if (t->ndim != ndim) return false;
  for (int32_t i = 0; i < ndim; ++i)
    if (t->shape[i] != shape[i]) return false;
  return true;
}
void require_shape(const std::string& layer, const fp8_tensor* t, const char* name, int32_t ndim, const int64_t* shape);
void require_disjoint_buffers(const std::string& layer, const fp8_tensor* a, const char* a_name, const fp8_tensor* b,
                              const char* b_name);
// Whether p is 16-byte aligned (what FP8 GEMMs and the vector paths of the casts need).
inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool buffers_overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

}  // namespace fp8::nn
