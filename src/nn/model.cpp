#include "nn/model.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "dist/data_parallel.hpp"

namespace {
std::atomic<uint64_t> next_model_serial{1};
}

fp8_model::fp8_model() : serial(next_model_serial++) {}

fp8_model::~fp8_model() {
  for (fp8_model** link : optimizer_links) *link = nullptr;
  // An exchange still running on the communication stream uses the model's memory: the stream's
  // later work (and so an allocator's reuse of what is released next) comes after it.
  if (comm) {
    try {
      backend->join_side();
    } catch (...) {  // (a destructor reports nothing; the context's next call will)
    }
  }
}

namespace fp8::nn {

const char* kind_name(int32_t kind) {
  switch (kind) {
    case FP8_LAYER_LINEAR:
      return "linear";
    case FP8_LAYER_LAYERNORM:
      return "layernorm";
    case FP8_LAYER_RMSNORM:
      return "rmsnorm";
    default:
      return "activation";
  }
}

namespace {

const char* precision(int32_t p) {
  return p < 0 ? "-" : p ? "fp8" : "high";
}

}  // namespace

void require_new_layer_name(const fp8_model& m, const char* name) {
  require_arg(name, "name");
  const size_t len = std::strlen(name);
  if (len == 0 || len > kMaxLayerName)
    fail(FP8_ERR_INVALID_ARGUMENT, "name '", name, "' has ", len, " bytes; expected 1..", kMaxLayerName);
  if (name[0] == '.' || name[len - 1] == '.' || std::strstr(name, ".."))
    fail(FP8_ERR_INVALID_ARGUMENT, "name '", name, "' has an empty part between dots; expected a name like 'fc1' or ",
         "'blocks.0.mlp.fc1'");
  for (const auto& l : m.layers)
    if (l->name() == name) fail(FP8_ERR_INVALID_ARGUMENT, "the model already has a layer named '", name, "'");
}

Layer& layer_at(fp8_model& m, int32_t id) {
  if (id < 0 || static_cast<size_t>(id) >= m.layers.size())
    fail(FP8_ERR_INVALID_ARGUMENT, "layer_id = ", id, "; the model has layers 0..",
         static_cast<int64_t>(m.layers.size()) - 1);
  return *m.layers[static_cast<size_t>(id)];
}

const Layer& layer_at(const fp8_model& m, int32_t id) {
  return layer_at(const_cast<fp8_model&>(m), id);
}

Step make_step(fp8_model& m) {
  const Recipe* r = m.recipe ? &*m.recipe : nullptr;
  const bool fp8 = r && m.autocast && (m.training || r->get(FP8_RECIPE_USE_AUTOCAST_DURING_EVAL));
  if (!m.call_scratch) m.call_scratch = std::make_unique<DeviceBuffer>(m.backend);
  if (!m.pool) m.pool = std::make_shared<BufferPool>(m.backend);
  return Step{*m.backend,
              r,
              fp8,
              m.training,
              m.weights_version,
              m.call_scratch.get(),
              m.pool,
              m.backend->capture_id(),
              m.step_captured,
              m.layers};
}

std::unique_ptr<fp8_saved> layer_forward(fp8_model& m, int32_t id, const fp8_tensor* x, fp8_tensor* y) {
  Layer& layer = layer_at(m, id);
  const Step step = make_step(m);
  std::unique_ptr<fp8_saved> s = layer.forward(step, x, y);
  s->model_serial = m.serial;
  s->layer_id = id;
  s->layer_epoch = layer.epoch();
  s->training = step.training;
  return s;
}

namespace {

// The refusals of a backward given `saved`, before anything runs.
void require_own_state(const fp8_model& m, int32_t id, const fp8_saved& s) {
  const Layer& layer = layer_at(m, id);
  if (s.stack)
    fail(FP8_ERR_INVALID_ARGUMENT, "saved comes from fp8_stack_forward_saved; differentiate it with ",
         "fp8_stack_backward_saved, not layer by layer");
  if (s.model_serial != m.serial)
    fail(FP8_ERR_INVALID_ARGUMENT, "saved comes from another model's forward; layer '", layer.name(),
         "' differentiates only its own");
  if (s.layer_id != id)
    fail(FP8_ERR_INVALID_ARGUMENT, "saved comes from the forward of layer '", layer_at(m, s.layer_id).name(),
         "', not of layer '", layer.name(), "' (layer_id ", id, ")");
  if (s.consumed)
    fail(FP8_ERR_INVALID_STATE, "saved was already differentiated; layer '", layer.name(),
         "' runs one backward per forward (run the forward again)");
  if (!s.training)
    fail(FP8_ERR_INVALID_STATE, "layer '", layer.name(), "' has no training-mode forward to differentiate: ",
         "saved comes from a forward in eval mode (fp8_model_set_training(model, 1) first)");
  if (s.layer_epoch != layer.epoch())
    fail(FP8_ERR_INVALID_STATE, "layer '", layer.name(), "' was converted (fp8_convert_model) after this forward; ",
         "run the forward again");
}

// What the first layer's dx adds to under the backward flags: nullptr, dx itself
// (FP8_BACKWARD_ACCUMULATE_DX), or dy (FP8_BACKWARD_ADD_DY: the gradient of a residual that is x).
const void* dx_base(uint32_t flags, const fp8_tensor* dy, const fp8_tensor* dx) {
  const bool accumulate = (flags & FP8_BACKWARD_ACCUMULATE_DX) != 0, add_dy = (flags & FP8_BACKWARD_ADD_DY) != 0;
  if (accumulate && add_dy)
    fail(FP8_ERR_INVALID_ARGUMENT, "flags = ", flags,
         "; FP8_BACKWARD_ACCUMULATE_DX and FP8_BACKWARD_ADD_DY exclude each other");
  if (!add_dy) return accumulate && dx ? dx->data : nullptr;
  if (!dx) fail(FP8_ERR_INVALID_ARGUMENT, "dx is NULL; FP8_BACKWARD_ADD_DY writes dx = dy + the input gradient");
  if (!aligned16(dy->data))  // (a Linear's FP8 dgrad reads it as its GEMM's C, which must be aligned as dx)
    fail(FP8_ERR_INVALID_ARGUMENT, "dy's data is not 16-byte aligned, which FP8_BACKWARD_ADD_DY needs");
  if (dx->dtype != dy->dtype)
    fail(FP8_ERR_DTYPE, "dx has dtype ", dtype_name(dx->dtype), " and dy ", dtype_name(dy->dtype),
         "; FP8_BACKWARD_ADD_DY adds dy into dx, which takes dy's dtype");
  if (!has_shape(dx, dy->ndim, dy->shape))
    fail(FP8_ERR_SHAPE, "dx has shape ", shape_string(dx->ndim, dx->shape), " and dy ",
         shape_string(dy->ndim, dy->shape), "; FP8_BACKWARD_ADD_DY adds dy into dx, which takes dy's shape");
  return dy->data;
}

// What the first layer's dx adds to in fp8_stack_backward_saved_add: base, of dx's shape and dtype,
// 16-byte aligned (a Linear's FP8 dgrad reads it as its GEMM's C), dx itself or apart from it (dx is
// never NULL: the C API requires it).
const void* dx_base(const fp8_tensor* base, const fp8_tensor* dx) {
  if (base->dtype != dx->dtype)
    fail(FP8_ERR_DTYPE, "base has dtype ", dtype_name(base->dtype), " and dx ", dtype_name(dx->dtype),
         "; base is added into dx, which takes its dtype");
  if (!has_shape(base, dx->ndim, dx->shape))
    fail(FP8_ERR_SHAPE, "base has shape ", shape_string(base->ndim, base->shape), " and dx ",
         shape_string(dx->ndim, dx->shape), "; base is added into dx, which takes its shape");
  if (!aligned16(base->data)) fail(FP8_ERR_INVALID_ARGUMENT, "base's data is not 16-byte aligned, which it needs");
  if (base->data != dx->data && buffers_overlap(base->data, base->nbytes(), dx->data, dx->nbytes()))
    fail(FP8_ERR_INVALID_ARGUMENT, "base and dx overlap in memory; base must be dx itself or apart from it");
  return base->data;
}

}  // namespace

void layer_backward(fp8_model& m, int32_t id, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, uint32_t flags) {
  const void* base = dx_base(flags, dy, dx);
  require_own_state(m, id, saved);
  const Step step = make_step(m);
  Layer& layer = layer_at(m, id);
  layer.check_saved(step, saved);
  const int32_t first = first_parameter(m, id), count = static_cast<int32_t>(layer.parameters().size());
  dist::before_grad_write(m, first, count);
  layer.backward(step, saved, dy, dx, base);
  saved.consumed = true;
  saved.release();
  dist::after_grad_write(m, first, count);
}

void drop_kept_states(fp8_model& m) {
  m.latest.clear();
  m.run_saved.clear();
}

void add_layer(fp8_model& m, std::unique_ptr<Layer> layer) {
  if (!m.store) {
    m.store = std::make_unique<ParamStore>(m.backend);
    if (m.comm) m.store->set_shares({m.comm->transport->size(), m.comm->transport->rank(), m.bucket_bytes});
  }
  drop_kept_states(m);  // a run's states no longer match the layers
  m.layers.push_back(std::move(layer));
  try {
    // Before conversion the layout keeps room to append, so adding layers copies little.
    m.store->layout(all_parameters(m), m.store->level(), FP8_DTYPE_E5M2, true);
  } catch (...) {
    m.layers.pop_back();
    throw;
  }
}

int32_t storage_level(const Recipe* recipe) {
  if (!recipe || recipe->get(FP8_RECIPE_BACKEND) == FP8_BACKEND_TE) return 0;
  return static_cast<int32_t>(recipe->get(FP8_RECIPE_OPT_LEVEL));
}

void convert_model(fp8_model& m, const Recipe* recipe, const ConvertChoice& c) {
  const Recipe* target = c.to_fp8 ? recipe : nullptr;
  const int32_t level = storage_level(target);
  const int32_t old_level = m.store ? m.store->level() : 0;
  if (level == 3 && old_level != 3 && m.comm)
    fail(FP8_ERR_INVALID_STATE,
         "the conversion would store the Linear weights at O3, whose F16 masters the ranks "
         "shard, but the model is data-parallel already; convert before fp8_model_set_comm, which gives each rank "
         "its share of rank 0's masters");
  if (level != old_level && !m.optimizer_links.empty())
    fail(FP8_ERR_INVALID_STATE, "the conversion stores the Linear weights at ", layout_name(level), " instead of ",
         layout_name(old_level), ", but ", m.optimizer_links.size(),
         " optimizer(s) of this model hold the current storage; destroy them first");
  // The same level in the other FP8 format moves the gradients to another arena just the same.
  const fp8_dtype_t grad8 = target ? target->dtype_for(FP8_ROLE_BACKWARD) : FP8_DTYPE_E5M2;
  if (level != 0 && m.store && grad8 != m.store->grad_dtype() && !m.optimizer_links.empty())
    fail(FP8_ERR_INVALID_STATE, "the conversion stores the Linear weight gradients in ", dtype_name(grad8),
         " instead of ", dtype_name(m.store->grad_dtype()), ", but ", m.optimizer_links.size(),
         " optimizer(s) of this model hold the current storage; destroy them first");
  // 1. Everything that can fail: the layers' scaling states (one arena for the model), then the storage.
  auto chosen = [&](const Layer& l) {
    const int32_t k = l.kind();
    return k == FP8_LAYER_LINEAR ? c.linear : k == FP8_LAYER_ACTIVATION ? c.activation : c.norm;
  };
  std::vector<fp8_role_t> roles;
  std::vector<size_t> first;  // each layer's first state in `roles`
  for (auto& l : m.layers) {
    first.push_back(roles.size());
    for (fp8_role_t r : l->state_roles(chosen(*l) ? target : nullptr)) roles.push_back(r);
  }
  first.push_back(roles.size());
  Layer::States arena = target ? make_scaling_arena(m.backend, *target, roles) : Layer::States{};
  std::vector<Layer::States> states(m.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i)
    for (size_t k = first[i]; k < first[i + 1]; ++k) states[i].push_back(std::move(arena[k]));
  if (m.store) {
    // Exact sizes from now on (no room for layers, which a converted model does not take), unless
    // an optimizer holds the storage's pointers.
    m.store->layout(all_parameters(m), level, grad8, !m.optimizer_links.empty());
  }
  // 2. Commit.
  for (size_t i = 0; i < m.layers.size(); ++i)
    m.layers[i]->convert(chosen(*m.layers[i]) ? target : nullptr, std::move(states[i]));
  if (level != old_level) ++m.weights_version;  // the layers remake their weight copies from the new storage
}

void update_model_scaling(fp8_model& m, bool backward_only) {
  if (!m.recipe) return;
  std::vector<fp8_scaling*> all, due;
  for (auto& l : m.layers) l->scaling_states(all);
  for (fp8_scaling* s : all)
    if (s->pending && (!backward_only || s->backward_role)) due.push_back(s);
  // (Under data parallelism the reduce runs whatever is due here: the calls decide, not one rank's flags.)
  if (due.empty() && !m.comm) return;
  // Under data parallelism every state's amax (history slot 0) is max-reduced across the ranks in one
  // collective first, so that every rank computes the same scales.
  if (m.comm) dist::reduce_amax(*m.comm->transport, m, all);
  if (due.empty()) return;
  fp8::update_scaling(*m.backend, due.data(), static_cast<int32_t>(due.size()), *m.recipe);
  for (fp8_scaling* s : due) s->pending = false;
}

AutowrapRegion::AutowrapRegion(fp8_model& m) : m_(m) {
  if (m.autowrap && m.recipe && !m.autocast) m.autocast = opened_ = true;
}

AutowrapRegion::~AutowrapRegion() {
  if (opened_) m_.autocast = false;
}

void AutowrapRegion::close() {
  if (!opened_) return;
  m_.autocast = opened_ = false;
  update_model_scaling(m_);
}

namespace {

// The bytes a tensor of dtype x shape takes, with an FP8 tensor's scale_inv slot behind its codes.
size_t tensor_bytes(fp8_dtype_t dtype, int32_t ndim, const int64_t* shape) {
  int64_t numel = 1;
  for (int32_t i = 0; i < ndim; ++i) numel *= shape[i];
  const size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
  return dtype_is_fp8(dtype) ? scale_inv_offset(bytes) + sizeof(float) : std::max<size_t>(bytes, 1);
}

// Points `view` (which owns nothing) at `base`, of at least tensor_bytes.
fp8_tensor* lay_view(fp8_tensor& view, char* base, fp8_dtype_t dtype, int32_t ndim, const int64_t* shape) {
  int64_t numel = 1;
  for (int32_t i = 0; i < ndim; ++i) numel *= shape[i];
  view.dtype = dtype;
  view.ndim = ndim;
  std::copy(shape, shape + ndim, view.shape);
  view.numel = numel;
  view.data = base;
  view.scale_inv =
      dtype_is_fp8(dtype) ? reinterpret_cast<float*>(base + scale_inv_offset(static_cast<size_t>(numel))) : nullptr;
  return &view;
}

}  // namespace

fp8_tensor* ScratchTensor::bind(fp8_dtype_t dtype, int32_t ndim, const int64_t* shape) {
  return lay_view(view, storage.ensure<char>(tensor_bytes(dtype, ndim, shape)), dtype, ndim, shape);
}

namespace {

const char* layer_label(const fp8_model& m, size_t i) {
  return m.layers[i]->name().c_str();
}

// The output features of layers [first, first + count) for input features `cols`, checked against
// each layer's needs.
std::vector<int64_t> chain_features(const fp8_model& m, size_t first, size_t count, int64_t cols) {
  std::vector<int64_t> out;
  for (size_t i = first; i < first + count; ++i) {
    const int64_t need = m.layers[i]->input_features();
    if (need != 0 && need != cols) {
      if (i == first)
        fail(FP8_ERR_SHAPE, "x has ", cols, " features (last dimension); the first layer '", layer_label(m, i),
             "' expects ", need);
      fail(FP8_ERR_SHAPE, "layer '", layer_label(m, i), "' expects ", need, " input features, but layer '",
           layer_label(m, i - 1), "' before it gives ", cols);
    }
    cols = m.layers[i]->output_features(cols);
    out.push_back(cols);
  }
  return out;
}

// t has `dtype` (that of `whose`) and `shape`.
void require_run_tensor(const fp8_tensor* t, const char* name, fp8_dtype_t dtype, int32_t ndim, const int64_t* shape,
                        const char* whose) {
  if (t->dtype != dtype)
    fail(FP8_ERR_DTYPE, name, " has dtype ", dtype_name(t->dtype), "; expected ", dtype_name(dtype), " (", whose,
         "'s)");
  if (!has_shape(t, ndim, shape))
    fail(FP8_ERR_SHAPE, name, " has shape ", shape_string(t->ndim, t->shape), "; expected ", shape_string(ndim, shape));
}

// What a run is: the whole model's (x's dtype throughout), a stack's (y's throughout), or a stack's
// with a residual added (fp8_stack_forward_residual: `act` between the layers, y the residual's).
struct RunKind {
  bool whole_model = false;
  const fp8_tensor* residual = nullptr;
  fp8_dtype_t act = FP8_DTYPE_F32;  // with a residual
};

// The checks of a run's x and y (layers [first, first + count)), before anything runs; the output
// features of each layer and the activations' dtype. x has the activations' dtype, except that the
// first layer of a stack (not of a whole-model run) may be a norm taking another one.
std::pair<std::vector<int64_t>, fp8_dtype_t> check_stack(const fp8_model& m, size_t first, size_t count,
                                                         const fp8_tensor* x, const fp8_tensor* y, const RunKind& run) {
  const fp8_dtype_t act = run.whole_model ? x->dtype : run.residual ? run.act : y->dtype;
  const char* what = run.whole_model ? "a whole-model run" : "a stack";
  const char* act_from = run.whole_model ? "x" : run.residual ? "act_dtype" : "y";
  if (act != FP8_DTYPE_F32 && act != FP8_DTYPE_BF16)
    fail(FP8_ERR_DTYPE, act_from, run.residual ? " is " : " has dtype ", dtype_name(act), "; ", what,
         " takes f32 or bf16 activations");
  const int32_t k = m.layers[first]->kind();
  if (x->dtype != act && (k != FP8_LAYER_LAYERNORM && k != FP8_LAYER_RMSNORM))
    fail(FP8_ERR_DTYPE, "x has dtype ", dtype_name(x->dtype), " and ", act_from, " ", dtype_name(act), "; ", what,
         " starting with layer '", layer_label(m, first), "' (not a norm) takes x of the activations' dtype");
  if (x->dtype != FP8_DTYPE_F32 && x->dtype != FP8_DTYPE_BF16)
    fail(FP8_ERR_DTYPE, "x has dtype ", dtype_name(x->dtype), "; ", what, " takes f32 or bf16 x");
  if (x->ndim < 1) fail(FP8_ERR_SHAPE, "x has shape []; expected [.., features]");
  std::vector<int64_t> cols = chain_features(m, first, count, x->cols());
  int64_t shape[FP8_MAX_DIMS];
  std::copy(x->shape, x->shape + x->ndim, shape);
  shape[x->ndim - 1] = cols.back();
  if (run.residual) {
    const size_t last = first + count - 1;
    if (m.layers[last]->kind() != FP8_LAYER_LINEAR)
      fail(FP8_ERR_UNSUPPORTED, "layer '", layer_label(m, last), "', the last of the stack, is not a Linear; the ",
           "residual is added by the last Linear's GEMM");
    const fp8_dtype_t rd = run.residual->dtype;
    if (rd != FP8_DTYPE_F32 && rd != FP8_DTYPE_BF16)
      fail(FP8_ERR_DTYPE, "residual has dtype ", dtype_name(rd), "; expected f32 or bf16");
    // (A high-precision GEMM writes D in its operands' dtype or F32: F32 activations give no BF16 y.)
    if (rd == FP8_DTYPE_BF16 && act == FP8_DTYPE_F32)
      fail(FP8_ERR_DTYPE, "residual has dtype bf16 and act_dtype is f32; a residual of bf16 takes bf16 activations");
    require_run_tensor(run.residual, "residual", rd, x->ndim, shape, "the stack's output");
    require_run_tensor(y, "y", rd, x->ndim, shape, "the residual");
    // The GEMM reads the residual where it writes y: the same buffer or none of it.
    if (run.residual->data != y->data) require_disjoint_buffers(layer_label(m, last), run.residual, "residual", y, "y");
  } else {
    require_run_tensor(y, "y", act, x->ndim, shape, run.whole_model ? "x" : "the activations");
  }
  // The first layer's backward reads x again, after the last layer has written y.
  require_disjoint_buffers(layer_label(m, first), x, "x", y, "y");
  return {cols, act};
}

// Layers [first, first + saved.size()) in order, each one's y the next one's x: layer i writes
// bind(i - first, dtype, shape), the last one y. A converted norm or activation hands its output to
// a Linear that runs its forward GEMM in FP8 in E4M3 (no round trip through the activation dtype);
// a converted ReLU or GELU before a Linear that can take it (Layer::takes_folded_input) writes
// nothing: the Linear's x cast computes it from the activation's input, with the activation's state.
// The activations between the layers have dtype `act`; with a residual the last layer (a Linear)
// adds it to y. Returns the input shape of each layer after the first (x's number of dimensions each).
template <typename Bind>
std::vector<std::vector<int64_t>> run_forward(fp8_model& m, const Step& step, size_t first,
                                              std::vector<std::unique_ptr<fp8_saved>>& saved,
                                              const std::vector<int64_t>& cols, fp8_dtype_t act,
                                              const fp8_tensor* residual, const fp8_tensor* x, fp8_tensor* y,
                                              Bind bind) {
  const size_t n = saved.size();
  const int64_t rows = x->rows();
  int64_t shape[FP8_MAX_DIMS];
  std::copy(x->shape, x->shape + x->ndim, shape);
  std::vector<std::vector<int64_t>> shapes;
  const fp8_tensor* in = x;
  FoldedActivation fold{};
  const FoldedActivation* folded = nullptr;  // the activation the layer takes into its x cast
  for (size_t k = 0; k < n; ++k) {
    const size_t i = first + k;
    Layer& layer = *m.layers[i];
    if (k + 1 < n) {
      shape[x->ndim - 1] = cols[k];
      shapes.emplace_back(shape, shape + x->ndim);
    }
    // A foldable activation before a Linear that takes it: no output of its own (in stays its input).
    const bool fold_next = k + 1 < n && step.fp8 && m.layers[i + 1]->takes_folded_input(step, rows) &&
                           (k + 2 < n || (aligned16(y->data) && (!residual || aligned16(residual->data))));
    if (fold_next && (saved[k] = layer.forward_into_next(step, in, &fold)) != nullptr) {
      folded = &fold;
    } else {
      fp8_tensor* out = y;
      if (k + 1 < n) {
        const bool handoff = step.fp8 && layer.converted() && layer.kind() != FP8_LAYER_LINEAR &&
                             m.layers[i + 1]->takes_fp8_input(step, rows);
        out = bind(k, handoff ? FP8_DTYPE_E4M3 : act, x->ndim, shape);
      }
      saved[k] = k + 1 == n && residual ? layer.forward_residual(step, in, out, folded, {residual, act})
                                        : layer.forward(step, in, out, folded);
      folded = nullptr;
      in = out;
    }
    saved[k]->model_serial = m.serial;
    saved[k]->layer_id = static_cast<int32_t>(i);
    saved[k]->layer_epoch = layer.epoch();
    saved[k]->training = step.training;
  }
  return shapes;
}

// What a run's backward checks against.
RunRecord record_run(const fp8_tensor* x, const fp8_tensor* y, fp8_dtype_t act,
                     std::vector<std::vector<int64_t>> shapes) {
  RunRecord r;
  r.dtype = y->dtype;
  r.act = act;
  r.x_dtype = x->dtype;
  r.ndim = x->ndim;
  std::copy(x->shape, x->shape + x->ndim, r.x_shape);
  std::copy(y->shape, y->shape + y->ndim, r.y_shape);
  r.x_data = x->data;
  r.x_bytes = x->nbytes();
  r.shapes = std::move(shapes);
  return r;
}

// The checks of a run's backward (layers first.. with `saved`): dy and dx against the forward, what
// the first layer's backward would refuse in dx, and every layer's weights unchanged since; all of
// them before any layer runs, so that a refusal leaves every gradient and scaling state as it was.
void check_run_backward(const fp8_model& m, size_t first, const RunRecord& r,
                        const std::vector<std::unique_ptr<fp8_saved>>& saved, const Step& step, const fp8_tensor* dy,
                        const fp8_tensor* dx) {
  require_run_tensor(dy, "dy", r.dtype, r.ndim, r.y_shape, "the forward's y");
  if (dx) {
    const Layer& layer = *m.layers[first];
    require_run_tensor(dx, "dx", r.x_dtype, r.ndim, r.x_shape, "the forward's x");
    if (saved[0]->reads_input && buffers_overlap(r.x_data, r.x_bytes, dx->data, dx->nbytes()))
      fail(FP8_ERR_INVALID_ARGUMENT, "dx and the forward's x overlap in memory; layer '", layer.name(),
           "''s backward reads x while it writes dx");
    layer.check_dx(*saved[0], dx);
    require_disjoint_buffers(layer.name(), dy, "dy", dx, "dx");
  }
  for (size_t k = 0; k < saved.size(); ++k) m.layers[first + k]->check_saved(step, *saved[k]);
}

// The backward of run_forward's layers, last to first. The gradients between layers (the
// activations' dtype) alternate between bind_grad(0, ..) and bind_grad(1, ..) (never the buffer the
// layer reads its dy from); layer `first`'s goes to dx (added to dx_base, when given), or, for a norm
// or an activation when dx is nullptr, to bind_grad(2, x_dtype, ..) (they always make one). An activation's backward
// (ReLU, GELU) is folded into the dy cast of the Linear before it where that Linear can take it
// (Layer::folds_activation_grad), so the activation's gradient is never written out. The layers' parameters start at
// params_first in the model's order.
template <typename BindGrad>
void run_backward(fp8_model& m, const Step& step, size_t first, std::vector<std::unique_ptr<fp8_saved>>& saved,
                  const RunRecord& run, const fp8_tensor* dy, fp8_tensor* dx, const void* dx_base, int32_t params_first,
                  BindGrad bind_grad) {
  const size_t n = saved.size();
  const int32_t ndim = dy->ndim;
  int32_t end = params_first;  // the parameters of layers [first, i] are [params_first, end)
  for (size_t k = 0; k < n; ++k) end += static_cast<int32_t>(m.layers[first + k]->parameters().size());
  dist::before_grad_write(m, params_first, end - params_first);
  const fp8_tensor* g_out = dy;
  int slot = 0;  // the buffer the next gradient between layers goes to
  FoldedActivation fold{};
  bool folding = false;  // the layer's backward takes the gradient of the activation after it
  for (size_t k = n; k-- > 0;) {
    const size_t i = first + k;
    Layer& layer = *m.layers[i];
    if (!folding && k > 0 && layer.foldable_activation(*saved[k], &fold) &&
        m.layers[i - 1]->folds_activation_grad(*saved[k - 1], k > 1 || dx)) {
      folding = true;  // (the activation runs no backward of its own)
    } else {
      fp8_tensor* g_in = dx;
      if (k > 0) {
        g_in = bind_grad(slot, run.act, ndim, run.shapes[k - 1].data());
        slot ^= 1;
      } else if (!dx && layer.kind() != FP8_LAYER_LINEAR) {
        g_in = bind_grad(2, run.x_dtype, ndim, run.x_shape);
      }
      layer.backward(step, *saved[k], g_out, g_in, k == 0 ? dx_base : nullptr, folding ? &fold : nullptr);
      folding = false;
      g_out = g_in;
    }
    saved[k]->consumed = true;
    saved[k]->release();
    const auto count = static_cast<int32_t>(layer.parameters().size());
    end -= count;
    // Buckets may start now, but none holding a parameter this call has still to write.
    dist::after_grad_write(m, end, count, end);
  }
}

}  // namespace

void model_forward(fp8_model& m, const fp8_tensor* x, fp8_tensor* y) {
  const size_t n = m.layers.size();
  if (n == 0) fail(FP8_ERR_INVALID_STATE, "the model has no layers");
  RunKind whole;
  whole.whole_model = true;
  const auto [cols, act] = check_stack(m, 0, n, x, y, whole);
  m.run_saved.clear();
  const Step step = make_step(m);
  while (m.acts.size() + 1 < n) m.acts.push_back(std::make_unique<ScratchTensor>(m.backend));
  std::vector<std::unique_ptr<fp8_saved>> saved(n);
  auto shapes = run_forward(
      m, step, 0, saved, cols, act, nullptr, x, y,
      [&](size_t k, fp8_dtype_t dt, int32_t ndim, const int64_t* shape) { return m.acts[k]->bind(dt, ndim, shape); });
  if (m.training) {
    m.run_saved = std::move(saved);
    m.run = record_run(x, y, act, std::move(shapes));
  }
}

void model_backward(fp8_model& m, const fp8_tensor* dy, fp8_tensor* dx) {
  if (m.run_saved.empty() || m.run_saved.size() != m.layers.size())
    fail(FP8_ERR_INVALID_STATE,
         "no training-mode fp8_model_forward to differentiate (none ran, it ran in eval "
         "mode, it was already differentiated, or the model was converted or changed mode since)");
  const Step step = make_step(m);
  check_run_backward(m, 0, m.run, m.run_saved, step, dy, dx);
  for (auto& g : m.grads)
    if (!g) g = std::make_unique<ScratchTensor>(m.backend);
  if (!m.first_dx) m.first_dx = std::make_unique<ScratchTensor>(m.backend);
  run_backward(m, step, 0, m.run_saved, m.run, dy, dx, nullptr, 0,
               [&](int which, fp8_dtype_t dt, int32_t nd, const int64_t* shape) {
                 return which == 2 ? m.first_dx->bind(dt, nd, shape) : m.grads[which]->bind(dt, nd, shape);
               });
  m.run_saved.clear();
  update_model_scaling(m, true);
  // The exchanges started above overlapped the backward; the stream waits for them here, so that a
  // captured backward joins what it forked and the gradients are whole when the call is done.
  m.backend->join_side();
}

namespace {

struct StackSaved final : fp8_saved {
  int32_t first = 0;
  std::vector<std::unique_ptr<fp8_saved>> layers;
  std::vector<PooledBuffer> memory;  // the outputs of layers first ..; given back where no backward reads it
  RunRecord run;
  void release() override {
    for (auto& l : layers) l->release();
    memory.clear();
  }
};

}  // namespace

std::unique_ptr<fp8_saved> stack_forward(fp8_model& m, int32_t first, int32_t count, const fp8_tensor* x, fp8_tensor* y,
                                         const fp8_tensor* residual, fp8_dtype_t act) {
  const auto layers = static_cast<int64_t>(m.layers.size());
  if (first < 0 || first >= layers)
    fail(FP8_ERR_INVALID_ARGUMENT, "first_layer = ", first, "; the model has layers 0..", layers - 1);
  if (count < 1 || first + int64_t{count} > layers)
    fail(FP8_ERR_INVALID_ARGUMENT, "layer_count = ", count, "; expected 1..", layers - first, " (layers ", first,
         " to ", layers - 1, " follow the first)");
  const auto f = static_cast<size_t>(first), n = static_cast<size_t>(count);
  RunKind kind;
  kind.residual = residual;
  kind.act = act;
  const auto [cols, acts] = check_stack(m, f, n, x, y, kind);
  const Step step = make_step(m);
  auto s = std::make_unique<StackSaved>();
  s->layers.resize(n);
  s->memory.resize(n - 1);
  std::vector<fp8_tensor> views(n - 1);  // (the layers' states keep data pointers, not these views)
  for (fp8_tensor& v : views) v.backend = m.backend;  // (a folded activation lays no view; all are destroyed)
  auto shapes = run_forward(m, step, f, s->layers, cols, acts, residual, x, y,
                            [&](size_t k, fp8_dtype_t dt, int32_t nd, const int64_t* shape) {
                              s->memory[k] = PooledBuffer(step.pool, tensor_bytes(dt, nd, shape));
                              return lay_view(views[k], s->memory[k].get<char>(), dt, nd, shape);
                            });
  // An activation no backward reads goes back to the pool now (an E4M3 hand-off to an FP8 Linear,
  // which keeps its own transposed copy), for the next forward to use.
  for (size_t k = 1; k < n; ++k)
    if (!step.training || !s->layers[k]->reads_input) s->memory[k - 1].reset();
  s->stack = true;
  s->model_serial = m.serial;
  s->layer_id = first;
  s->training = step.training;
  s->reads_input = s->layers[0]->reads_input;
  s->first = first;
  s->run = record_run(x, y, acts, std::move(shapes));
  return s;
}

void stack_backward(fp8_model& m, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, uint32_t flags,
                    const fp8_tensor* base_tensor) {
  if (!saved.stack)
    fail(FP8_ERR_INVALID_ARGUMENT, "saved comes from fp8_layer_forward_saved; differentiate it with ",
         "fp8_layer_backward_saved");
  auto& s = static_cast<StackSaved&>(saved);
  if (s.model_serial != m.serial)
    fail(FP8_ERR_INVALID_ARGUMENT, "saved comes from another model's fp8_stack_forward_saved");
  const auto n = s.layers.size();
  const auto f = static_cast<size_t>(s.first);
  const std::string range = "layers '" + m.layers[f]->name() + "'..'" + m.layers[f + n - 1]->name() + "'";
  if (s.consumed)
    fail(FP8_ERR_INVALID_STATE, "saved was already differentiated; ", range,
         " run one backward per forward (run the forward again)");
  if (!s.training)
    fail(FP8_ERR_INVALID_STATE, range, " have no training-mode forward to differentiate: saved comes from a ",
         "forward in eval mode (fp8_model_set_training(model, 1) first)");
  for (size_t k = 0; k < n; ++k)
    if (s.layers[k]->layer_epoch != m.layers[f + k]->epoch())
      fail(FP8_ERR_INVALID_STATE, "layer '", m.layers[f + k]->name(),
           "' was converted (fp8_convert_model) after this forward; run the forward again");
  const Step step = make_step(m);
  check_run_backward(m, f, s.run, s.layers, step, dy, dx);
  const void* base = base_tensor ? dx_base(base_tensor, dx) : dx_base(flags, dy, dx);
  // The gradients between the layers: pool buffers for the call (two alternating, and the first
  // layer's dx when the caller wants none).
  PooledBuffer grads[3];
  fp8_tensor views[3];
  for (fp8_tensor& v : views) v.backend = m.backend;
  run_backward(m, step, f, s.layers, s.run, dy, dx, base, first_parameter(m, s.first),
               [&](int which, fp8_dtype_t dt, int32_t nd, const int64_t* shape) {
                 grads[which] = PooledBuffer(step.pool, tensor_bytes(dt, nd, shape));
                 return lay_view(views[which], grads[which].get<char>(), dt, nd, shape);
               });
  s.consumed = true;
  s.release();
}

void zero_grad(fp8_model& m) {
  dist::grads_consumed(m);  // (an exchange still running finishes before the zeros)
  if (m.store) m.store->zero_grads();
}

int32_t first_parameter(const fp8_model& m, int32_t layer_id) {
  int32_t first = 0;
  for (int32_t i = 0; i < layer_id; ++i)
    first += static_cast<int32_t>(m.layers[static_cast<size_t>(i)]->parameters().size());
  return first;
}

Parameter& parameter_at(fp8_model& m, int32_t index) {
  int64_t seen = 0;
  for (auto& l : m.layers)
    for (Parameter& p : l->parameters())
      if (seen++ == index) return p;
  fail(FP8_ERR_INVALID_ARGUMENT, "index = ", index, "; expected 0..", seen - 1, " (the model has ", seen,
       " parameters)");
}

std::vector<Parameter*> all_parameters(fp8_model& m) {
  std::vector<Parameter*> out;
  for (auto& l : m.layers)
    for (Parameter& p : l->parameters()) out.push_back(&p);
  return out;
}

std::vector<const Parameter*> all_parameters(const fp8_model& m) {
  std::vector<const Parameter*> out;
  for (const auto& l : m.layers)
    for (const Parameter& p : l->parameters()) out.push_back(&p);
  return out;
}

int32_t stored_layout(const fp8_model& m, const Parameter& p) {
  if (p.value->dtype == FP8_DTYPE_F32) return kLayoutF32;
  return p.value->dtype == FP8_DTYPE_E4M3 ? kLayoutO3 : m.store->level();
}

std::string current_parameter_name(const std::string& full_name) {
  // Norms named their parameters gamma and beta before they took torch's names.
  const auto ends = [&](const char* tail) {
    const size_t n = std::strlen(tail);
    return full_name.size() > n && full_name.compare(full_name.size() - n, n, tail) == 0;
  };
  if (ends(".gamma")) return full_name.substr(0, full_name.size() - 6) + ".weight";
  if (ends(".beta")) return full_name.substr(0, full_name.size() - 5) + ".bias";
  return full_name;
}

Parameter* find_parameter(fp8_model& m, const std::string& full_name) {
  for (const std::string& name : {full_name, current_parameter_name(full_name)})
    for (auto& l : m.layers)
      for (Parameter& p : l->parameters())
        if (p.name == name) return &p;
  return nullptr;
}

std::string model_report(const fp8_model& m) {
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-16s %-10s %-9s %-8s %-5s %-5s %-5s %9s %9s  %s\n", "layer", "kind", "converted",
                "scaling", "fprop", "dgrad", "wgrad", "fp8 calls", "fallbacks", "reason");
  os << line;
  // The recipe's scaling names, as its text form has them.
  const char* scaling = "-";
  if (m.recipe) {
    const AttrSpec* spec = recipe_attr_spec(FP8_RECIPE_SCALING);
    scaling = spec->names[m.recipe->get(FP8_RECIPE_SCALING) - spec->min];
  }
  for (const auto& l : m.layers) {
    const LayerStats& s = l->stats();
    std::snprintf(line, sizeof line, "%-16s %-10s %-9s %-8s %-5s %-5s %-5s %9lld %9lld  %s\n", l->name().c_str(),
                  kind_name(l->kind()), l->converted() ? "yes" : "no", l->converted() ? scaling : "-",
                  precision(s.fprop), precision(s.dgrad),
                  precision(s.wgrad), static_cast<long long>(s.fp8_calls), static_cast<long long>(s.fallback_calls),
                  s.reason.c_str());
    os << line;
  }
  return os.str();
}

}  // namespace fp8::nn
