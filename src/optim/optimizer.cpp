#include "optim/optimizer.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <string>

#include "core/error.hpp"
#include "core/objects.hpp"
#include "dist/data_parallel.hpp"
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
  backend->release(scales);
  backend->release(partials);
  backend->release(scalars);
  backend->release(hyper);
  backend->release(element_args);
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
int64_t aligned(int64_t n) {
  return (n + kStateAlign - 1) / kStateAlign * kStateAlign;
}

bool needs_states(const fp8_optimizer& o) {
  return o.kind != FP8_OPTIMIZER_SGD || o.attrs[FP8_OPTIM_MOMENTUM] > 0.0;
}

// Allocates m (and v) in each tensor's layout, zeroed, when the kind needs them now. All or
// nothing: the optimizer takes the allocations only once all three exist.
void allocate_states(fp8_optimizer& o) {
  Backend& be = *o.backend;
  const int per = o.kind == FP8_OPTIMIZER_SGD ? 1 : 2;
  int64_t floats = 0, m8 = 0, v16 = 0;
  for (size_t i = 0; i < o.tensors.size(); ++i) {
    const OptimTensor& t = o.tensors[i];
    if (t.layout <= kLayoutO1)
      floats += per * aligned(t.n);
    else
      m8 += aligned(o.owned[i].second - o.owned[i].first), v16 += aligned(o.owned[i].second - o.owned[i].first);
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
  for (size_t i = 0; i < o.tensors.size(); ++i) {
    OptimTensor& t = o.tensors[i];
    if (t.layout <= kLayoutO1) {
      t.m = f;
      f += aligned(t.n);
      if (per == 2) t.v = f, f += aligned(t.n);
      o.state_bytes += static_cast<size_t>(per * t.n) * sizeof(float);
    } else {
      // Indexed by element, holding this rank's [lo, hi) (the whole tensor unless sharded).
      const auto [lo, hi] = o.owned[i];
      t.m = b - lo;
      t.v = h - lo;
      b += aligned(hi - lo);
      h += aligned(hi - lo);
      o.state_bytes += static_cast<size_t>(hi - lo) * 3;
    }
  }
}

bool has_states(const fp8_optimizer& o) {
  return o.states || o.states_m8 || o.states_v16;
}

// The chunks of tensor `index` (parameter p). Every rank lists the same chunks in the same order, so
// the norm's partials line up across ranks; where the masters are sharded, a tensor's chunks also
// break at the boundaries of its bucket's pieces, and the chunks of other ranks' pieces have len 0
// here (this rank neither sums nor updates them; its partial for them stays 0).
void add_chunks(fp8_optimizer& o, const fp8_model& model, const nn::Parameter& p, int32_t index) {
  const int64_t n = p.value->numel;
  const nn::Shares shares = model.store->shares();
  const bool sharded = model.store->masters_sharded() && p.master;
  int64_t piece = 0, at = 0;  // (sharded) the bucket's piece, and p's offset from the bucket's start
  if (sharded) {
    void* base = nullptr;
    size_t used = 0;
    model.store->flat(nn::kValues, FP8_DTYPE_E4M3, &base, &used);
    const nn::Bucket& b = model.store->bucket_of(index);
    piece = static_cast<int64_t>(b.piece(shares.nranks));
    at = static_cast<char*>(p.value->data) - static_cast<char*>(base) - static_cast<int64_t>(b.fp8_at);
  }
  for (int64_t off = 0; off < n;) {
    int64_t end = std::min(n, off + kOptimChunk);
    bool mine = true;
    if (sharded) {
      const int64_t owner = (at + off) / piece;
      end = std::min(end, (owner + 1) * piece - at);
      mine = owner == shares.rank;
    }
    o.chunks.push_back({index, mine ? static_cast<int32_t>(end - off) : 0, off});
    off = end;
  }
}

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
  for (const nn::Parameter* p : nn::all_parameters(m)) {
    total += p->value->nbytes() + p->grad->nbytes();
    if (p->master) total += static_cast<size_t>(p->owned_hi - p->owned_lo) * sizeof(uint16_t);
  }
  return total;
}

}  // namespace

void upload_hyper(fp8_optimizer& o) {
  const OptimHyper h{o.kind,
                     o.attrs[FP8_OPTIM_LR],
                     o.attrs[FP8_OPTIM_BETA1],
                     o.attrs[FP8_OPTIM_BETA2],
                     o.attrs[FP8_OPTIM_EPS],
                     o.attrs[FP8_OPTIM_WEIGHT_DECAY],
                     o.attrs[FP8_OPTIM_MOMENTUM],
                     o.attrs[FP8_OPTIM_MAX_GRAD_NORM]};
  o.backend->copy_from_host(o.hyper, &h, sizeof h);
}

const char* kind_name(fp8_optimizer_kind_t k) {
  return k == FP8_OPTIMIZER_SGD ? "SGD" : k == FP8_OPTIMIZER_ADAM ? "Adam" : "AdamW";
}

int32_t resolve_level(const fp8_model& model, fp8_optimizer_kind_t kind) {
  const int32_t level = model.store ? model.store->level() : 0;
  // SGD has no moments to keep in FP8: on O2 storage (the same as O1's) it runs O1.
  if (kind == FP8_OPTIMIZER_SGD && level == kLayoutO2) return kLayoutO1;
  return level;
}

std::unique_ptr<fp8_optimizer> make_optimizer(fp8_model& model, fp8_optimizer_kind_t kind) {
  if (kind < FP8_OPTIMIZER_SGD || kind > FP8_OPTIMIZER_ADAMW)
    fail(FP8_ERR_INVALID_ARGUMENT, "kind = ", kind, "; expected FP8_OPTIMIZER_SGD (0), ADAM (1) or ADAMW (2)");
  const int32_t level = resolve_level(model, kind);
  // SGD has no moments to keep in FP8: backend=msamp asking for O2 is refused, and so is O3 storage
  // (FP8 weights with masters), which auto cannot lower once the model is converted.
  const int32_t model_level = model.store ? model.store->level() : 0;
  const bool msamp = model.recipe && model.recipe->get(FP8_RECIPE_BACKEND) == FP8_BACKEND_MSAMP;
  if (kind == FP8_OPTIMIZER_SGD && (model_level == kLayoutO3 || (model_level == kLayoutO2 && msamp)))
    fail(FP8_ERR_UNSUPPORTED, "the model is stored at MS-AMP level ", layout_name(model_level),
         ", whose optimizer keeps Adam's moments in FP8 and F16; SGD has none: use Adam/AdamW, or convert the model "
         "with opt_level=O1, backend=auto (O1 for SGD on O2) or backend=te");
  if (model.weight_owner)
    fail(FP8_ERR_INVALID_STATE, "another optimizer keeps the MS-AMP state of this model's Linear weights (",
         layout_name(level), "); destroy it before creating a new one");
  if (level != 0 && !model.optimizer_links.empty())
    fail(FP8_ERR_INVALID_STATE, "an MS-AMP optimizer (", layout_name(level), ") keeps the per-tensor state of the ",
         "Linear weights and must be the model's only one, but ", model.optimizer_links.size(),
         " other optimizer(s) of this model exist; destroy them first");
  auto o = std::make_unique<fp8_optimizer>();
  o->backend = model.backend;
  o->model = &model;
  o->kind = kind;
  o->level = level;
  for (int a = 0; a < FP8_OPTIM_ATTR_COUNT; ++a) o->attrs[a] = kAttrs[a].defaults[kind];

  const std::vector<nn::Parameter*> params = nn::all_parameters(model);
  if (params.empty())
    fail(FP8_ERR_INVALID_ARGUMENT, "the model has no parameters to optimise; add layers before fp8_optimizer_create");
  // The optimizer adopts the model's storage as it is: every tensor's layout is how it is stored.
  int64_t compact = 0;
  for (const nn::Parameter* p : params)
    if (nn::stored_layout(model, *p) != kLayoutF32) ++compact;
  Backend& be = *o->backend;
  o->scales = static_cast<CompactScales*>(be.allocate(static_cast<size_t>(compact) * sizeof(CompactScales)));
  o->compact_count = compact;
  CompactScales* next_scales = o->scales;
  for (nn::Parameter* p : params) {
    const int32_t stored = nn::stored_layout(model, *p);
    OptimTensor t{};
    t.n = p->value->numel;
    t.layout = stored == kLayoutO2 ? level : stored;  // (SGD runs O1 on O2 storage)
    if (stored != kLayoutF32) {
      t.scales = next_scales++;
      be.zero(t.scales, sizeof(CompactScales));
      // The moments' bounds start from the weights' amax (of this rank's share of a sharded master:
      // the ranks agree on the largest, dist::agree_compact_scales).
      const bool o3 = stored == kLayoutO3;
      be.amax({o3 ? static_cast<const void*>(p->master + p->owned_lo) : p->value->data, FP8_DTYPE_F16,
               o3 ? p->owned_hi - p->owned_lo : t.n, &t.scales->p_amax, nullptr});
      t.master = p->master;
      t.grad_scales = p->grad_scales();
      t.grad_e5m2 = p->grad->dtype == FP8_DTYPE_E5M2;
      if (o3) t.w_scale_inv = p->value->scale_inv;
    }
    t.param = p->value->data;
    t.grad = p->grad->data;
    const int32_t index = static_cast<int32_t>(o->tensors.size());
    o->tensors.push_back(t);
    o->owned.emplace_back(p->owned_lo, p->owned_hi);
    add_chunks(*o, model, *p, index);
    o->numel += t.n;
  }
  o->parameter_count = static_cast<int32_t>(o->tensors.size());
  o->sharded = model.store->masters_sharded();
  if (needs_states(*o)) allocate_states(*o);
  upload_tables(*o);
  o->partials = static_cast<double*>(be.allocate(o->chunks.size() * sizeof(double)));
  o->scalars = static_cast<OptimScalars*>(be.allocate(sizeof(OptimScalars)));
  const OptimScalars zero{};
  be.copy_from_host(o->scalars, &zero, sizeof zero);
  o->hyper = static_cast<OptimHyper*>(be.allocate(sizeof(OptimHyper)));
  o->element_args = static_cast<OptimElementArgs*>(be.allocate(sizeof(OptimElementArgs)));
  upload_hyper(*o);
  for (const nn::Parameter* p : params) o->value_versions.push_back(p->value->version);
  model.optimizer_links.push_back(&o->model);  // (the destructor takes it out again)
  if (level != 0) model.weight_owner = o.get();
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
  const double old = o.attrs[attr];
  o.attrs[attr] = value;
  try {
    // SGD's momentum buffer now, not at the next step: a captured step could not make it.
    if (needs_states(o) && o.model) ensure_states(o);
    upload_hyper(o);
  } catch (...) {
    o.attrs[attr] = old;
    throw;
  }
}

void check_attr(fp8_optimizer_attr_t attr, double value) {
  const AttrSpec& s = spec(attr);
  const auto outside = [&](double v) {
    const bool below = s.min_open ? !(v > s.min) : !(v >= s.min);
    const bool above = s.max_open ? !(v < s.max) : !(v <= s.max);
    return below || above;
  };
  const auto range = [&] {
    std::ostringstream r;
    if (s.max == kInf)
      r << "a finite value " << (s.min_open ? "> " : ">= ") << s.min;
    else
      r << (s.min_open ? "(" : "[") << s.min << ", " << s.max << (s.max_open ? ")" : "]");
    return r.str();
  };
  if (outside(value)) fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", value, "; expected ", range());
  // The step computes in float: the value it will use must be in range too (eps = 1e-50 would be
  // 0 there, lr = 1e39 infinite, beta = 1 - 1e-10 exactly 1), and not 0 where the caller's is not
  // (a max_grad_norm of 1e-50 would turn clipping off).
  const float f = static_cast<float>(value);
  std::ostringstream v;
  v << std::setprecision(17) << value;
  if (!std::isfinite(f))
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", v.str(), " overflows float, the step's precision (at most ", FLT_MAX,
         ")");
  if (value != 0.0 && f == 0.0f)
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", v.str(), " rounds to 0 in float, the step's precision (its smallest ",
         "value is ", FLT_TRUE_MIN, ")");
  if (outside(f))
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", v.str(), " rounds to ", f,
         " in float, the step's precision; expected ", range(), " there");
}

double get_attr(const fp8_optimizer& o, fp8_optimizer_attr_t attr) {
  spec(attr);
  return o.attrs[attr];
}

fp8_model& model_of(const fp8_optimizer& o) {
  if (!o.model) fail(FP8_ERR_INVALID_STATE, "the optimizer's model was destroyed; destroy the optimizer first");
  return *o.model;
}

void step(fp8_optimizer& o, const float* other_sumsq, float* clip_out) {
  fp8_model& m = model_of(o);
  // (Under data parallelism these refusals are the same on every rank when the ranks make the same
  // calls; a step is not worth a host round trip to agree on them.)
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
  const OptimizerStepJob job{o.device_tensors, static_cast<int64_t>(o.tensors.size()),
                             o.device_chunks,  static_cast<int64_t>(o.chunks.size()),
                             o.partials,       o.scalars,
                             o.hyper,          o.element_args,
                             other_sumsq,      clip_out};
  if (o.backend->capture_id()) m.step_captured = true;
  // Data parallel: every rank steps from the same averaged gradients, so the norm, the skip and the
  // update agree without further communication where the optimizer state is replicated.
  // Sharded (O3 data-parallel): each rank steps its share of the Linear weights from its share of
  // the averaged gradients, the ranks agree on the norm's partials and on the compact scales, and
  // the E4M3 weights are all-gathered.
  if (m.comm) dist::sync_grads(m, !o.sharded);  // (what the backward has not exchanged yet, and a wait)
  o.backend->optimizer_norm(job);
  if (o.sharded) dist::agree_partials(o);
  o.backend->optimizer_update(job);
  if (o.sharded) dist::agree_compact_scales(o);
  o.backend->optimizer_promote(job);
  if (o.sharded) dist::gather_weights(m);
  dist::grads_consumed(m);
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
