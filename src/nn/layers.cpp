// What the layers share, and the two layers without GEMMs: LayerNorm/RMSNorm and activations. Once
// converted, both may write their output in FP8 (E4M3) with a scaling state of their own: the
// hand-off to the Linear that follows, without a bf16 round trip.
#include <algorithm>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "nn/layer.hpp"

namespace fp8::nn {

fp8_tensor* Layer::add_parameter(const char* name, int32_t ndim, const int64_t* shape, float init) {
  Parameter p{name_ + "." + name, lent_by_model(make_tensor(backend_, FP8_DTYPE_F32, ndim, shape, false, nullptr)),
              lent_by_model(make_tensor(backend_, FP8_DTYPE_F32, ndim, shape, false, nullptr))};
  const std::vector<float> values(static_cast<size_t>(p.value->numel), init);
  backend_->copy_from_host(p.value->data, values.data(), p.value->nbytes());
  backend_->zero(p.grad->data, p.grad->nbytes());
  params_.push_back(std::move(p));
  return params_.back().value.get();
}

uint64_t Layer::weights_version(uint64_t model_version) const {
  uint64_t v = model_version;
  for (const Parameter& p : params_) v += p.value->version;
  return v;
}

std::unique_ptr<DeviceBuffer> BufferPool::take(size_t bytes) {
  std::unique_ptr<DeviceBuffer> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t best = free_.size(), largest = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const size_t cap = free_[i]->capacity();
      if (cap >= bytes && (best == free_.size() || cap < free_[best]->capacity())) best = i;
      if (largest == free_.size() || cap > free_[largest]->capacity()) largest = i;
    }
    const size_t pick = best != free_.size() ? best : largest;
    if (pick != free_.size()) {
      out = std::move(free_[pick]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(pick));
    }
  }
  if (!out) out = std::make_unique<DeviceBuffer>(backend_);
  try {
    out->ensure(bytes);
  } catch (...) {
    give(std::move(out));
    throw;
  }
  return out;
}

void BufferPool::give(std::unique_ptr<DeviceBuffer> buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    free_.push_back(std::move(buffer));
  } catch (...) {  // no room to keep it: the buffer is released instead (called from destructors)
  }
}

void require_layer_dtype(const std::string& layer, const fp8_tensor* t, const char* name, bool allow_fp8) {
  if (dtype_is_wide(t->dtype) || (allow_fp8 && dtype_is_fp8(t->dtype))) return;
  fail(FP8_ERR_DTYPE, name, " has dtype ", dtype_name(t->dtype), "; layer '", layer, "' expects f32, f16 or bf16",
       allow_fp8 ? " (or FP8 once converted)" : "");
}

void require_shape(const std::string& layer, const fp8_tensor* t, const char* name, int32_t ndim,
                   const int64_t* shape) {
  if (!has_shape(t, ndim, shape))
    fail(FP8_ERR_SHAPE, name, " has shape ", shape_string(t->ndim, t->shape), "; layer '", layer, "' expects ",
         shape_string(ndim, shape));
}

void Layer::check_saved(const Step& step, const fp8_saved& saved) const {
  if (!saved_current(step, saved))
    fail(FP8_ERR_INVALID_STATE, "the parameters of layer '", name_,
         "' changed since this forward (an optimizer step or a write came between); run the forward again");
}

bool buffers_overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  return a_bytes && b_bytes && pa < pb + b_bytes && pb < pa + a_bytes;
}

void require_disjoint_buffers(const std::string& layer, const fp8_tensor* a, const char* a_name, const fp8_tensor* b,
                              const char* b_name) {
  if (buffers_overlap(a->data, a->nbytes(), b->data, b->nbytes()))
    fail(FP8_ERR_INVALID_ARGUMENT, a_name, " and ", b_name, " overlap in memory; layer '", layer,
         "' needs separate buffers");
}

namespace {

// What a norm or activation forward keeps: a reference to x (which the caller keeps alive) and, for
// a norm, each row's mean and rstd.
struct ElementwiseSaved final : fp8_saved {
  const void* x = nullptr;
  fp8_dtype_t x_dtype = FP8_DTYPE_F32;
  int32_t ndim = 0;
  int64_t x_shape[FP8_MAX_DIMS] = {};
  uint64_t weights_version = 0;  // norms: the weight (gamma) and bias (beta) the forward used
  PooledBuffer stats;            // norms: rows floats of mean (LayerNorm), then rows floats of rstd
  void release() override { stats.reset(); }
  int64_t rows() const {
    int64_t r = 1;
    for (int32_t i = 0; i + 1 < ndim; ++i) r *= x_shape[i];
    return r;
  }
  int64_t cols() const { return ndim > 0 ? x_shape[ndim - 1] : 1; }
};

// Shared by the norm and activation layers: the optional FP8 output with its state, and the checks.
class ElementwiseBase : public Layer {
 public:
  using Layer::Layer;

  std::vector<fp8_role_t> state_roles(const Recipe* recipe) const override {
    if (!recipe) return {};
    return {FP8_ROLE_FORWARD};  // the FP8 output
  }
  void convert(const Recipe* recipe, States states) noexcept override {
    converted_ = recipe && states.size() == 1;
    s_out_ = converted_ ? std::move(states[0]) : nullptr;
    ++epoch_;
  }
  void scaling_states(std::vector<fp8_scaling*>& out) override {
    if (s_out_) out.push_back(s_out_.get());
  }
  fp8_scaling* scaling(int32_t slot) override { return slot == FP8_SCALING_OUTPUT ? s_out_.get() : nullptr; }

  bool saved_current(const Step& step, const fp8_saved& saved) const override {
    return params_.empty() || static_cast<const ElementwiseSaved&>(saved).weights_version == weights_version(step);
  }

  void check_dx(const fp8_saved& saved, const fp8_tensor* dx) const override {
    const ElementwiseSaved& s = static_cast<const ElementwiseSaved&>(saved);
    require_layer_dtype(name_, dx, "dx", false);
    require_shape(name_, dx, "dx", s.ndim, s.x_shape);
  }

 protected:
  // Checks x and y (y of `y_cols` columns, x's leading dimensions) and returns the output state for
  // an FP8 y (which needs the layer converted).
  ScalingHeader* check_forward(const fp8_tensor* x, const fp8_tensor* y, int64_t y_cols) {
    require_layer_dtype(name_, x, "x", false);
    require_layer_dtype(name_, y, "y", true);
    if (x->ndim < 1) fail(FP8_ERR_SHAPE, "x has shape []; layer '", name_, "' expects at least one dimension");
    int64_t y_shape[FP8_MAX_DIMS];
    for (int32_t i = 0; i < x->ndim; ++i) y_shape[i] = x->shape[i];
    y_shape[x->ndim - 1] = y_cols;
    require_shape(name_, y, "y", x->ndim, y_shape);
    require_disjoint_buffers(name_, x, "x", y, "y");
    if (!dtype_is_fp8(y->dtype)) return nullptr;
    if (!converted_)
      fail(FP8_ERR_INVALID_STATE, "y has dtype ", dtype_name(y->dtype), " but layer '", name_,
           "' is not converted to FP8; call fp8_convert_model first or pass a wide y");
    if (y->dtype != s_out_->dtype)
      fail(FP8_ERR_DTYPE, "y has dtype ", dtype_name(y->dtype), "; layer '", name_, "' writes FP8 as ",
           dtype_name(s_out_->dtype), " (the recipe's forward format)");
    if (s_out_->current)
      fail(FP8_ERR_UNSUPPORTED, "y has dtype ", dtype_name(y->dtype), " but layer '", name_,
           "' is converted with scaling=current, which needs y's amax before its cast; pass a wide y (the "
           "Linear after it casts it)");
    return s_out_->state;
  }

  // The state of a forward that has passed its checks; records the output's precision.
  // `records`: this layer's own kernel records y's amax (not the next layer's cast).
  std::unique_ptr<ElementwiseSaved> begin_forward(const Step& step, const fp8_tensor* x, ScalingHeader* y_state,
                                                  bool records = true) {
    auto s = std::make_unique<ElementwiseSaved>();
    s->weights_version = weights_version(step);
    s->x = x->data;
    s->x_dtype = x->dtype;
    s->ndim = x->ndim;
    std::copy(x->shape, x->shape + x->ndim, s->x_shape);
    stats_.fprop = y_state ? 1 : 0;
    if (y_state) {
      if (step.fp8) ++stats_.fp8_calls;
      if (records) s_out_->pending = true;
    }
    return s;
  }

  // Checks dy (of `dy_cols` columns) and dx against the saved forward.
  void check_backward(const ElementwiseSaved& s, const fp8_tensor* dy, const fp8_tensor* dx, int64_t dy_cols) {
    if (!dx) fail(FP8_ERR_INVALID_ARGUMENT, "argument 'dx' is NULL; layer '", name_, "' needs it");
    require_layer_dtype(name_, dy, "dy", false);
    int64_t dy_shape[FP8_MAX_DIMS];
    for (int32_t i = 0; i < s.ndim; ++i) dy_shape[i] = s.x_shape[i];
    dy_shape[s.ndim - 1] = dy_cols;
    require_shape(name_, dy, "dy", s.ndim, dy_shape);
    check_dx(s, dx);
    require_disjoint_buffers(name_, dy, "dy", dx, "dx");
    stats_.dgrad = 0;
  }

  std::unique_ptr<fp8_scaling> s_out_;
};

class Norm final : public ElementwiseBase {
 public:
  Norm(std::shared_ptr<Backend> backend, std::string name, bool rms, int64_t dim, float eps)
      : ElementwiseBase(backend, std::move(name), rms ? FP8_LAYER_RMSNORM : FP8_LAYER_LAYERNORM),
        rms_(rms),
        dim_(dim),
        eps_(eps) {
    add_parameter("weight", 1, &dim, 1.0f);  // (gamma and beta; torch's names)
    if (!rms) add_parameter("bias", 1, &dim, 0.0f);
  }

  int64_t input_features() const override { return dim_; }

  std::unique_ptr<fp8_saved> forward(const Step& step, const fp8_tensor* x, fp8_tensor* y,
                                     const FoldedActivation* /*folded: never into a norm or an activation*/) override {
    if (x->ndim >= 1 && x->cols() != dim_)
      fail(FP8_ERR_SHAPE, "x has shape ", shape_string(x->ndim, x->shape), "; layer '", name_, "' expects [.., ", dim_,
           "]");
    ScalingHeader* state = check_forward(x, y, dim_);
    auto s = begin_forward(step, x, state);
    const int64_t rows = x->rows();
    NormJob j{};
    j.rms = rms_;
    j.x = x->data;
    j.x_dtype = x->dtype;
    j.rows = rows;
    j.cols = dim_;
    j.gamma = static_cast<const float*>(params_[0].value->data);
    j.beta = rms_ ? nullptr : static_cast<const float*>(params_[1].value->data);
    j.eps = eps_;
    j.y = y->data;
    j.y_dtype = y->dtype;
    j.y_state = state;
    j.y_scale_inv = tensor_scale(state ? y->scale_inv : nullptr);
    if (step.training) {
      s->stats = PooledBuffer(step.pool, static_cast<size_t>(2 * rows) * sizeof(float));
      j.mean = rms_ ? nullptr : s->stats.get<float>();
      j.rstd = s->stats.get<float>() + rows;
    }
    if (rows > 0) step.backend.norm(j);
    return s;
  }

  void backward(const Step& step, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, const void* dx_base,
                const FoldedActivation* /*folded: never for a norm or an activation*/) override {
    const ElementwiseSaved& s = static_cast<const ElementwiseSaved&>(saved);
    check_backward(s, dy, dx, dim_);
    NormJob j{};
    j.rms = rms_;
    j.backward = true;
    j.x = s.x;
    j.x_dtype = s.x_dtype;
    j.rows = s.rows();
    j.cols = dim_;
    j.gamma = static_cast<const float*>(params_[0].value->data);
    j.mean = rms_ ? nullptr : s.stats.get<float>();
    j.rstd = s.stats.get<float>() + j.rows;
    j.dy = dy->data;
    j.dy_dtype = dy->dtype;
    j.dx = dx->data;
    j.dx_dtype = dx->dtype;
    j.dx_base = dx_base;
    j.dgamma = static_cast<float*>(params_[0].grad->data);
    j.dbeta = rms_ ? nullptr : static_cast<float*>(params_[1].grad->data);
    j.accumulate_params = true;
    if (j.rows > 0) step.backend.norm(j);
  }

 private:
  bool rms_;
  int64_t dim_;
  float eps_;
};

class Activation final : public ElementwiseBase {
 public:
  Activation(std::shared_ptr<Backend> backend, std::string name, fp8_activation_t act)
      : ElementwiseBase(std::move(backend), std::move(name), FP8_LAYER_ACTIVATION), act_(act) {}

  int64_t output_features(int64_t in) const override {
    if (act_ != FP8_ACTIVATION_SWIGLU) return in;
    if (in % 2 != 0)
      fail(FP8_ERR_SHAPE, "layer '", name_, "' (SwiGLU) needs an even number of input features [gate | up]; it gets ",
           in);
    return in / 2;
  }

  std::unique_ptr<fp8_saved> forward(const Step& step, const fp8_tensor* x, fp8_tensor* y,
                                     const FoldedActivation* /*folded: never into a norm or an activation*/) override {
    const bool glu = act_ == FP8_ACTIVATION_SWIGLU;
    if (x->ndim >= 1 && glu && x->cols() % 2 != 0)
      fail(FP8_ERR_SHAPE, "x has shape ", shape_string(x->ndim, x->shape), "; layer '", name_,
           "' (SwiGLU) expects an even last dimension [gate | up]");
    ScalingHeader* state = check_forward(x, y, x->ndim >= 1 ? (glu ? x->cols() / 2 : x->cols()) : 0);
    auto s = begin_forward(step, x, state);
    ActivationJob j{};
    j.act = act_;
    j.x = x->data;
    j.x_dtype = x->dtype;
    j.rows = x->rows();
    j.cols = x->cols();
    j.out = y->data;
    j.out_dtype = y->dtype;
    j.out_state = state;
    j.out_scale_inv = tensor_scale(state ? y->scale_inv : nullptr);
    if (x->numel > 0) step.backend.activation(j);
    return s;
  }

  bool foldable_activation(const fp8_saved& saved, FoldedActivation* out) const override {
    if (act_ != FP8_ACTIVATION_RELU && act_ != FP8_ACTIVATION_GELU) return false;
    *out = {act_, static_cast<const ElementwiseSaved&>(saved).x, nullptr};
    return true;
  }

  std::unique_ptr<fp8_saved> forward_into_next(const Step& step, const fp8_tensor* x, FoldedActivation* out) override {
    if ((act_ != FP8_ACTIVATION_RELU && act_ != FP8_ACTIVATION_GELU) || !converted_ || s_out_->current) return nullptr;
    require_layer_dtype(name_, x, "x", false);
    if (x->ndim < 1) fail(FP8_ERR_SHAPE, "x has shape []; layer '", name_, "' expects at least one dimension");
    *out = {act_, x->data, s_out_.get()};
    // (The E4M3 output the next layer's cast makes: that cast marks the state pending once queued.)
    return begin_forward(step, x, s_out_->state, false);
  }

  void backward(const Step& step, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, const void* dx_base,
                const FoldedActivation* /*folded: never for a norm or an activation*/) override {
    const ElementwiseSaved& s = static_cast<const ElementwiseSaved&>(saved);
    const int64_t cols = s.cols();
    check_backward(s, dy, dx, act_ == FP8_ACTIVATION_SWIGLU ? cols / 2 : cols);
    if (dy->dtype != s.x_dtype)
      fail(FP8_ERR_DTYPE, "dy has dtype ", dtype_name(dy->dtype), "; layer '", name_, "' expects ",
           dtype_name(s.x_dtype), " (the forward's x)");
    ActivationJob j{};
    j.act = act_;
    j.backward = true;
    j.x = s.x;
    j.dy = dy->data;
    j.x_dtype = s.x_dtype;
    j.rows = s.rows();
    j.cols = cols;
    j.out = dx->data;
    j.out_dtype = dx->dtype;
    j.base = dx_base;
    if (j.rows * j.cols > 0) step.backend.activation(j);
  }

 private:
  fp8_activation_t act_;
};

}  // namespace

std::unique_ptr<Layer> make_norm(std::shared_ptr<Backend> backend, std::string name, bool rms, int64_t dim, float eps) {
  return std::make_unique<Norm>(std::move(backend), std::move(name), rms, dim, eps);
}

std::unique_ptr<Layer> make_activation(std::shared_ptr<Backend> backend, std::string name, fp8_activation_t act) {
  return std::make_unique<Activation>(std::move(backend), std::move(name), act);
}

}  // namespace fp8::nn
