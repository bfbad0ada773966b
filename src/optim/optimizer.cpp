#include "optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "core/objects.hpp"
#include "nn/model.hpp"

fp8_optimizer::~fp8_optimizer() {
  if (model) {
    if (model->weight_owner == this) model->weight_owner = nullptr;
    auto& links = model->optimizer_links;
    links.erase(std::remove(links.begin(), links.end(), &model), links.end());
  }
  backend->release(tables);
  backend->release(states);
  backend->release(states_m8);
  backend->release(states_v16);
  backend->release(masters);
  backend->release(scales);
  backend->release(partials);
  backend->release(scalars);
}

namespace fp8::optim {

namespace {

// One row per attribute: its name, range ([min, max], max exclusive when open_max), the kinds that
// use it, and its defaults (SGD, Adam, AdamW; torch.optim's).
struct AttrSpec {
  const char* name;
  double min, max;
  bool min_open, max_open;
  bool sgd, adam;  // used by SGD / by Adam and AdamW
  double defaults[3];
};
constexpr double kInf = HUGE_VAL;
const AttrSpec kAttrs[FP8_OPTIM_ATTR_COUNT] = {
    {"FP8_OPTIM_LR", 0.0, kInf, false, true, true, true, {1e-3, 1e-3, 1e-3}},
    {"FP8_OPTIM_BETA1", 0.0, 1.0, false, true, false, true, {0.9, 0.9, 0.9}},
    {"FP8_OPTIM_BETA2", 0.0, 1.0, false, true, false, true, {0.999, 0.999, 0.999}},
    {"FP8_OPTIM_EPS", 0.0, kInf, true, true, false, true, {1e-8, 1e-8, 1e-8}},
    {"FP8_OPTIM_WEIGHT_DECAY", 0.0, kInf, false, true, true, true, {0.0, 0.0, 1e-2}},
    {"FP8_OPTIM_MOMENTUM", 0.0, 1.0, false, true, true, false, {0.0, 0.0, 0.0}},
    {"FP8_OPTIM_MAX_GRAD_NORM", 0.0, kInf, false, true, true, true, {0.0, 0.0, 0.0}},
};

const AttrSpec& spec(fp8_optimizer_attr_t attr) {
  if (attr < 0 || attr >= FP8_OPTIM_ATTR_COUNT)
    fail(FP8_ERR_INVALID_ARGUMENT, "attr = ", attr, "; expected FP8_OPTIM_LR (0) .. FP8_OPTIM_MAX_GRAD_NORM (",
         FP8_OPTIM_ATTR_COUNT - 1, ")");
  return kAttrs[attr];
}

constexpr int64_t kStateAlign = 16;  // elements: every state slice starts 16-byte aligned, whatever its type
int64_t aligned(int64_t n) { return (n + kStateAlign - 1) / kStateAlign * kStateAlign; }

bool needs_states(const fp8_optimizer& o) {
  return o.kind != FP8_OPTIMIZER_SGD || o.attrs[FP8_OPTIM_MOMENTUM] > 0.0;
}

// Allocates m (and v) in each tensor's layout, zeroed, when the kind needs them now. All or
// nothing: the optimizer takes the allocations only once all three exist.
void allocate_states(fp8_optimizer& o) {
  Backend& be = *o.backend;
  const int per = o.kind == FP8_OPTIMIZER_SGD ? 1 : 2;
  int64_t floats = 0, m8 = 0, v16 = 0;
  for (const OptimTensor& t : o.tensors) {
    if (t.layout <= kLayoutO1) floats += per * aligned(t.n);
    else m8 += aligned(t.n), v16 += aligned(t.n);
  }
  const size_t sizes[3] = {static_cast<size_t>(floats) * sizeof(float), static_cast<size_t>(m8),
                           static_cast<size_t>(v16) * sizeof(uint16_t)};
  void* blocks[3] = {};
  try {
    for (int k = 0; k < 3; ++k) {
      blocks[k] = be.allocate(sizes[k]);
      be.zero(blocks[k], sizes[k]);
    }
  } catch (...) {
    for (void* b : blocks) be.release(b);
    throw;
  }
  o.states = static_cast<float*>(blocks[0]);
  o.states_m8 = static_cast<uint8_t*>(blocks[1]);
  o.states_v16 = static_cast<uint16_t*>(blocks[2]);
  float* f = o.states;
  uint8_t* b = o.states_m8;
  uint16_t* h = o.states_v16;
  o.state_bytes = 0;
  for (OptimTensor& t : o.tensors) {
    if (t.layout <= kLayoutO1) {
      t.m = f;
      f += aligned(t.n);
      if (per == 2) t.v = f, f += aligned(t.n);
      o.state_bytes += static_cast<size_t>(per * t.n) * sizeof(float);
    } else {
      t.m = b;
      t.v = h;
      b += aligned(t.n);
      h += aligned(t.n);
      o.state_bytes += static_cast<size_t>(t.n) * 3;
    }
  }
}

bool has_states(const fp8_optimizer& o) { return o.states || o.states_m8 || o.states_v16; }

// (Re)writes the device tables from the host copies.
void upload_tables(fp8_optimizer& o) {
  Backend& be = *o.backend;
  const size_t tensor_bytes = o.tensors.size() * sizeof(OptimTensor);
  const size_t chunk_offset = (tensor_bytes + 15) / 16 * 16;
  const size_t bytes = chunk_offset + o.chunks.size() * sizeof(OptimChunk);
  if (!o.tables) o.tables = be.allocate(bytes);
  o.device_tensors = static_cast<const OptimTensor*>(o.tables);
  o.device_chunks = reinterpret_cast<const OptimChunk*>(static_cast<const char*>(o.tables) + chunk_offset);
  std::vector<unsigned char> host(bytes, 0);
  if (tensor_bytes) std::memcpy(host.data(), o.tensors.data(), tensor_bytes);
  if (!o.chunks.empty()) std::memcpy(host.data() + chunk_offset, o.chunks.data(), o.chunks.size() * sizeof(OptimChunk));
  if (bytes) be.copy_from_host(o.tables, host.data(), bytes);
}

// Values + masters + gradients + m + v of every tensor, as stored.
size_t training_bytes(const fp8_optimizer& o, const fp8_model& m) {
  size_t total = o.state_bytes;
  for (const auto& layer : m.layers)
    for (const nn::Parameter& p : layer->parameters()) total += p.value->nbytes() + p.grad->nbytes();
  for (const OptimTensor& t : o.tensors)
    if (t.master) total += static_cast<size_t>(t.n) * sizeof(uint16_t);
  return total;
}

// A Linear weight's FP32 value and gradient in `layout`'s storage, as new tensors (the parameter
// keeps its own until make_optimizer commits them all): the value in F16 (O1/O2) or E4M3 with an
// F16 master (O3), the gradient (what it holds so far included) in FP8 in `recipe`'s gradient
// format, and the scales' starting amax. `master` is the tensor's slice (O3), `scales` its
// CompactScales.
struct ConvertedWeight {
  nn::Parameter* param;
  std::unique_ptr<fp8_tensor> value, grad;
};

ConvertedWeight convert_weight(Backend& be, const std::shared_ptr<Backend>& owner, const Recipe& recipe,
                               nn::Parameter& p, int32_t layout, uint16_t* master, CompactScales* scales) {
  const fp8_dtype_t grad_dtype = recipe.dtype_for(FP8_ROLE_BACKWARD);
  const fp8_tensor& old = *p.value;
  const int64_t n = old.numel;
  auto grad = make_tensor(owner, grad_dtype, old.ndim, old.shape, false, nullptr, sizeof(GradScales));
  be.zero(grad->data, scale_inv_offset(grad->nbytes()) + sizeof(GradScales));
  be.grad_accumulate({static_cast<uint8_t*>(grad->data), grad_dtype == FP8_DTYPE_E5M2,
                      static_cast<const float*>(p.grad->data), n, reinterpret_cast<GradScales*>(grad->scale_inv)});
  be.zero(scales, sizeof(CompactScales));
  std::unique_ptr<fp8_tensor> value;
  if (layout != kLayoutO3) {
    value = make_tensor(owner, FP8_DTYPE_F16, old.ndim, old.shape, false, nullptr);
    be.convert({old.data, FP8_DTYPE_F32, value->data, FP8_DTYPE_F16, n});
    be.amax({value->data, FP8_DTYPE_F16, n, &scales->p_amax, nullptr});
  } else {
    be.convert({old.data, FP8_DTYPE_F32, master, FP8_DTYPE_F16, n});
    be.amax({master, FP8_DTYPE_F16, n, &scales->p_amax, nullptr});
    // The first FP8 weight: the master scaled by its own amax, as the later steps do (promote_compact).
    float p_amax = 0.0f;
    be.copy_to_host(&p_amax, &scales->p_amax, sizeof p_amax);
    const auto state = make_scaling(owner, recipe, FP8_ROLE_FORWARD, bound_scale(448.0, p_amax));
    value = make_tensor(owner, FP8_DTYPE_E4M3, old.ndim, old.shape, false, nullptr);
    QuantizeJob q{};
    q.in = master;
    q.in_dtype = FP8_DTYPE_F16;
    q.rows = 1;
    q.cols = n;
    q.out = static_cast<uint8_t*>(value->data);
    q.state = state->state;
    q.out_scale_inv = value->scale_inv;
    if (n > 0) be.quantize(q);
    be.synchronize();  // before `state` is released
  }
  return {&p, lent_by_model(std::move(value)), lent_by_model(std::move(grad))};
}

}  // namespace

const char* kind_name(fp8_optimizer_kind_t k) {
  return k == FP8_OPTIMIZER_SGD ? "SGD" : k == FP8_OPTIMIZER_ADAM ? "Adam" : "AdamW";
}

int32_t resolve_level(const fp8_model& model, fp8_optimizer_kind_t kind) {
  if (!model.recipe) return 0;
  const int64_t backend = model.recipe->get(FP8_RECIPE_BACKEND);
  if (backend == FP8_BACKEND_TE) return 0;
  const int32_t level = static_cast<int32_t>(model.recipe->get(FP8_RECIPE_OPT_LEVEL));
  // auto: the highest level up to opt_level the kind can run (SGD has no moments for O2/O3).
  if (backend == FP8_BACKEND_AUTO && kind == FP8_OPTIMIZER_SGD) return std::min(level, int32_t{kLayoutO1});
  return level;
}

std::unique_ptr<fp8_optimizer> make_optimizer(fp8_model& model, fp8_optimizer_kind_t kind) {
  if (kind < FP8_OPTIMIZER_SGD || kind > FP8_OPTIMIZER_ADAMW)
    fail(FP8_ERR_INVALID_ARGUMENT, "kind = ", kind, "; expected FP8_OPTIMIZER_SGD (0), ADAM (1) or ADAMW (2)");
  const int32_t level = resolve_level(model, kind);
  if (level >= kLayoutO2 && kind == FP8_OPTIMIZER_SGD)
    fail(FP8_ERR_UNSUPPORTED, "the model's recipe asks for MS-AMP level ", layout_name(level),
         ", which keeps Adam's moments in FP8 and F16; SGD has none: use Adam/AdamW, opt_level=O1, backend=auto (O1 for "
         "SGD) or backend=te");
  if (model.weight_owner)
    fail(FP8_ERR_INVALID_STATE, "another optimizer holds this model's Linear weights at ", layout_name(model.weight_level),
         "; destroy it before creating a new one");
  if (level != 0 && !model.optimizer_links.empty())
    fail(FP8_ERR_INVALID_STATE, "MS-AMP level ", layout_name(level), " moves the Linear weights to new storage, but ",
         model.optimizer_links.size(), " other optimizer(s) of this model point at the current one; destroy them first");
  if (model.weight_level != 0 && model.weight_level != level)
    fail(FP8_ERR_INVALID_STATE, "the model's Linear weights are stored at ", layout_name(model.weight_level),
         " by an earlier optimizer, but its recipe asks for ", layout_name(level),
         "; create the optimizer with the same backend and opt_level");
  auto o = std::make_unique<fp8_optimizer>();
  o->backend = model.backend;
  o->model = &model;
  o->kind = kind;
  o->level = level;
  for (int a = 0; a < FP8_OPTIM_ATTR_COUNT; ++a) o->attrs[a] = kAttrs[a].defaults[kind];

  const std::vector<nn::Parameter*> params = nn::all_parameters(model);
  if (params.empty())
    fail(FP8_ERR_INVALID_ARGUMENT, "the model has no parameters to optimise; add layers before fp8_optimizer_create");
  auto layout_of = [&](const nn::Parameter& p) { return p.linear_weight ? level : kLayoutF32; };
  int64_t compact = 0, master_elems = 0;
  for (const nn::Parameter* p : params) {
    if (layout_of(*p) != kLayoutF32) ++compact;
    if (layout_of(*p) == kLayoutO3) master_elems += aligned(p->value->numel);
  }
  Backend& be = *o->backend;
  o->scales = static_cast<CompactScales*>(be.allocate(static_cast<size_t>(compact) * sizeof(CompactScales)));
  o->masters = static_cast<uint16_t*>(be.allocate(static_cast<size_t>(master_elems) * sizeof(uint16_t)));
  CompactScales* next_scales = o->scales;
  uint16_t* next_master = o->masters;
  // Nothing of the model changes until every allocation has succeeded: new storage is made aside
  // and committed at the end.
  std::vector<ConvertedWeight> converted;
  for (nn::Parameter* p : params) {
    const int32_t layout = layout_of(*p);
    OptimTensor t{};
    t.n = p->value->numel;
    t.layout = layout;
    const fp8_tensor* value = p->value.get();
    const fp8_tensor* grad = p->grad.get();
    if (layout != kLayoutF32) {
      t.scales = next_scales++;
      if (layout == kLayoutO3) t.master = next_master, next_master += aligned(t.n);
      if (p->value->dtype == FP8_DTYPE_F32) {
        converted.push_back(convert_weight(be, o->backend, *model.recipe, *p, layout, t.master, t.scales));
        value = converted.back().value.get();
        grad = converted.back().grad.get();
      } else {  // stored at this level by an earlier optimizer: start the states afresh from it
        be.zero(t.scales, sizeof(CompactScales));
        if (layout == kLayoutO3) {
          be.dequantize({static_cast<const uint8_t*>(p->value->data), false, p->value->scale_inv, t.master,
                         FP8_DTYPE_F16, t.n});
          be.amax({t.master, FP8_DTYPE_F16, t.n, &t.scales->p_amax, nullptr});
        } else {
          be.amax({p->value->data, FP8_DTYPE_F16, t.n, &t.scales->p_amax, nullptr});
        }
      }
      t.grad_scales = reinterpret_cast<GradScales*>(grad->scale_inv);
      t.grad_e5m2 = grad->dtype == FP8_DTYPE_E5M2;
      if (layout == kLayoutO3) t.w_scale_inv = value->scale_inv;
    }
    t.param = value->data;
    t.grad = grad->data;
    const int32_t index = static_cast<int32_t>(o->tensors.size());
    o->tensors.push_back(t);
    for (int64_t off = 0; off < t.n; off += kOptimChunk)
      o->chunks.push_back({index, static_cast<int32_t>(std::min(kOptimChunk, t.n - off)), off});
    o->numel += t.n;
  }
  o->parameter_count = static_cast<int32_t>(o->tensors.size());
  if (needs_states(*o)) allocate_states(*o);
  upload_tables(*o);
  o->partials = static_cast<double*>(be.allocate(o->chunks.size() * sizeof(double)));
  o->scalars = static_cast<OptimScalars*>(be.allocate(sizeof(OptimScalars)));
  const OptimScalars zero{};
  be.copy_from_host(o->scalars, &zero, sizeof zero);
  be.synchronize();  // the conversions have read the FP32 tensors released below

  for (size_t i = 0; i < params.size(); ++i) o->value_versions.push_back(params[i]->value->version);
  model.optimizer_links.push_back(&o->model);  // (the destructor takes it out again on a failure)

  // Commit (nothing here throws).
  for (ConvertedWeight& c : converted) {
    // The new value's version continues the old one's, so the layer's weights version (the model's
    // plus its parameters') grows with the model's bump below and its copies are remade.
    c.value->version = c.param->value->version;
    c.param->value = std::move(c.value);
    c.param->grad = std::move(c.grad);
  }

  for (size_t i = 0; i < params.size(); ++i) {
    if (o->tensors[i].layout == kLayoutF32) continue;
    params[i]->grad->write_refusal =
        "this FP8 gradient keeps its per-tensor amax with it (MS-AMP level); add to it with "
        "fp8_model_accumulate_grad, clear it with fp8_model_zero_grad";
    if (o->tensors[i].layout == kLayoutO3)
      params[i]->value->write_refusal =
          "at O3 the optimizer's F16 master is the weight and this E4M3 tensor its copy; write weights before "
          "fp8_optimizer_create, or restore them with fp8_checkpoint_load";
  }
  if (level != 0) {
    model.weight_level = level;
    model.weight_owner = o.get();
    ++model.weights_version;  // the layers remake their weight copies from the new storage
  }
  o->training_bytes = training_bytes(*o, model);
  return o;
}

void ensure_states(fp8_optimizer& o) {
  if (has_states(o)) return;
  allocate_states(o);
  upload_tables(o);
  o.training_bytes = training_bytes(o, *o.model);
}

void set_attr(fp8_optimizer& o, fp8_optimizer_attr_t attr, double value) {
  const AttrSpec& s = spec(attr);
  const bool used = o.kind == FP8_OPTIMIZER_SGD ? s.sgd : s.adam;
  if (!used)
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " does not apply to ", kind_name(o.kind), "; it is for ",
         s.sgd ? "SGD" : "Adam and AdamW");
  check_attr(attr, value);
  o.attrs[attr] = value;
}

void check_attr(fp8_optimizer_attr_t attr, double value) {
  const AttrSpec& s = spec(attr);
  const bool below = s.min_open ? !(value > s.min) : !(value >= s.min);
  const bool above = s.max_open ? !(value < s.max) : !(value <= s.max);
  if (below || above) {
    const char* hi = s.max == kInf ? "" : s.max_open ? ")" : "]";
    if (s.max == kInf)
      fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", value, "; expected a finite value ", s.min_open ? "> " : ">= ", s.min);
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", value, "; expected ", s.min_open ? "(" : "[", s.min, ", ", s.max, hi);
  }
}

double get_attr(const fp8_optimizer& o, fp8_optimizer_attr_t attr) {
  spec(attr);
  return o.attrs[attr];
}

fp8_model& model_of(const fp8_optimizer& o) {
  if (!o.model) fail(FP8_ERR_INVALID_STATE, "the optimizer's model was destroyed; destroy the optimizer first");
  return *o.model;
}

void step(fp8_optimizer& o) {
  fp8_model& m = model_of(o);
  if (m.autocast) fail(FP8_ERR_INVALID_STATE, "an optimizer step inside fp8_autocast_begin/end; end the region first");
  size_t count = 0;
  for (auto& layer : m.layers) count += layer->parameters().size();
  if (count != static_cast<size_t>(o.parameter_count))
    fail(FP8_ERR_INVALID_STATE, "the model has ", count, " parameters, but had ", o.parameter_count,
         " when the optimizer was made; create a new optimizer after adding layers");
  if (needs_states(o)) ensure_states(o);  // SGD's momentum buffer, on first use
  // An F16 weight written since the last step (fp8_tensor_copy_from_host): its amax, where the
  // moments' bounds start, is taken again.
  size_t i = 0;
  for (auto& layer : m.layers)
    for (const nn::Parameter& p : layer->parameters()) {
      const OptimTensor& t = o.tensors[i];
      if ((t.layout == kLayoutO1 || t.layout == kLayoutO2) && p.value->version != o.value_versions[i]) {
        o.backend->amax({t.param, FP8_DTYPE_F16, t.n, &t.scales->p_amax, nullptr});
        o.value_versions[i] = p.value->version;
      }
      ++i;
    }
  OptimHyper h{o.kind,
               o.attrs[FP8_OPTIM_LR],
               o.attrs[FP8_OPTIM_BETA1],
               o.attrs[FP8_OPTIM_BETA2],
               o.attrs[FP8_OPTIM_EPS],
               o.attrs[FP8_OPTIM_WEIGHT_DECAY],
               o.attrs[FP8_OPTIM_MOMENTUM],
               o.attrs[FP8_OPTIM_MAX_GRAD_NORM]};
  o.backend->optimizer_step({o.device_tensors, static_cast<int64_t>(o.tensors.size()), o.device_chunks, static_cast<int64_t>(o.chunks.size()), o.partials,
                             o.scalars, h});
  ++m.weights_version;  // the layers remake their FP8 and bf16 weight copies at the next forward
}

fp8_optimizer_stats_t stats(const fp8_optimizer& o) {
  OptimScalars s{};
  o.backend->copy_to_host(&s, o.scalars, sizeof s);
  fp8_optimizer_stats_t r{};
  r.steps = static_cast<int64_t>(s.steps);
  r.skipped_steps = static_cast<int64_t>(s.skipped);
  r.last_skipped = s.skip;
  r.last_grad_norm = s.grad_norm;
  r.parameters = o.numel;
  r.state_bytes = static_cast<int64_t>(o.state_bytes);
  r.opt_level = o.level;
  r.training_bytes = static_cast<int64_t>(o.training_bytes);
  return r;
}

}  // namespace fp8::optim
