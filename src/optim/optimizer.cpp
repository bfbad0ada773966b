#include "optim/optimizer.hpp"

#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "nn/model.hpp"

fp8_optimizer::~fp8_optimizer() {
  backend->release(tables);
  backend->release(states);
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

const char* kind_name(fp8_optimizer_kind_t k) {
  return k == FP8_OPTIMIZER_SGD ? "SGD" : k == FP8_OPTIMIZER_ADAM ? "Adam" : "AdamW";
}

const AttrSpec& spec(fp8_optimizer_attr_t attr) {
  if (attr < 0 || attr >= FP8_OPTIM_ATTR_COUNT)
    fail(FP8_ERR_INVALID_ARGUMENT, "attr = ", attr, "; expected FP8_OPTIM_LR (0) .. FP8_OPTIM_MAX_GRAD_NORM (",
         FP8_OPTIM_ATTR_COUNT - 1, ")");
  return kAttrs[attr];
}

constexpr int64_t kStateAlign = 4;  // floats: each tensor's state slice starts 16-byte aligned
int64_t aligned(int64_t n) { return (n + kStateAlign - 1) / kStateAlign * kStateAlign; }

bool needs_states(const fp8_optimizer& o) {
  return o.kind != FP8_OPTIMIZER_SGD || o.attrs[FP8_OPTIM_MOMENTUM] > 0.0;
}

// Allocates the states (zeroed) when the kind needs them now, and (re)writes the device tables.
void build_tables(fp8_optimizer& o) {
  Backend& be = *o.backend;
  if (!o.states && needs_states(o)) {
    const int per = o.kind == FP8_OPTIMIZER_SGD ? 1 : 2;
    int64_t floats = 0;
    for (const OptimTensor& t : o.tensors) floats += per * aligned(t.n);
    o.state_bytes = static_cast<size_t>(floats) * sizeof(float);
    o.states = static_cast<float*>(be.allocate(o.state_bytes));
    be.zero(o.states, o.state_bytes);
    float* next = o.states;
    for (OptimTensor& t : o.tensors) {
      t.m = next;
      next += aligned(t.n);
      if (per == 2) {
        t.v = next;
        next += aligned(t.n);
      }
    }
  }
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

}  // namespace

std::unique_ptr<fp8_optimizer> make_optimizer(fp8_model& model, fp8_optimizer_kind_t kind) {
  if (kind < FP8_OPTIMIZER_SGD || kind > FP8_OPTIMIZER_ADAMW)
    fail(FP8_ERR_INVALID_ARGUMENT, "kind = ", kind, "; expected FP8_OPTIMIZER_SGD (0), ADAM (1) or ADAMW (2)");
  auto o = std::make_unique<fp8_optimizer>();
  o->backend = model.backend;
  o->model = &model;
  o->kind = kind;
  for (int a = 0; a < FP8_OPTIM_ATTR_COUNT; ++a) o->attrs[a] = kAttrs[a].defaults[kind];
  for (auto& layer : model.layers) {
    for (nn::Parameter& p : layer->parameters()) {
      const int32_t index = static_cast<int32_t>(o->tensors.size());
      o->tensors.push_back({static_cast<float*>(p.value->data), static_cast<const float*>(p.grad->data), nullptr,
                            nullptr, p.value->numel});
      for (int64_t off = 0; off < p.value->numel; off += kOptimChunk)
        o->chunks.push_back({index, static_cast<int32_t>(std::min(kOptimChunk, p.value->numel - off)), off});
      o->numel += p.value->numel;
    }
  }
  if (o->tensors.empty())
    fail(FP8_ERR_INVALID_ARGUMENT, "the model has no parameters to optimise; add layers before fp8_optimizer_create");
  o->parameter_count = static_cast<int32_t>(o->tensors.size());
  build_tables(*o);
  o->partials = static_cast<double*>(o->backend->allocate(o->chunks.size() * sizeof(double)));
  o->scalars = static_cast<OptimScalars*>(o->backend->allocate(sizeof(OptimScalars)));
  const OptimScalars zero{};
  o->backend->copy_from_host(o->scalars, &zero, sizeof zero);
  return o;
}

void set_attr(fp8_optimizer& o, fp8_optimizer_attr_t attr, double value) {
  const AttrSpec& s = spec(attr);
  const bool used = o.kind == FP8_OPTIMIZER_SGD ? s.sgd : s.adam;
  if (!used)
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " does not apply to ", kind_name(o.kind), "; it is for ",
         s.sgd ? "SGD" : "Adam and AdamW");
  const bool below = s.min_open ? !(value > s.min) : !(value >= s.min);
  const bool above = s.max_open ? !(value < s.max) : !(value <= s.max);
  if (below || above) {
    const char* hi = s.max == kInf ? "" : s.max_open ? ")" : "]";
    if (s.max == kInf)
      fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", value, "; expected a finite value ", s.min_open ? "> " : ">= ", s.min);
    fail(FP8_ERR_INVALID_ARGUMENT, s.name, " = ", value, "; expected ", s.min_open ? "(" : "[", s.min, ", ", s.max, hi);
  }
  o.attrs[attr] = value;
}

double get_attr(const fp8_optimizer& o, fp8_optimizer_attr_t attr) {
  spec(attr);
  return o.attrs[attr];
}

void step(fp8_optimizer& o) {
  fp8_model& m = *o.model;
  if (m.autocast) fail(FP8_ERR_INVALID_STATE, "an optimizer step inside fp8_autocast_begin/end; end the region first");
  size_t count = 0;
  for (auto& layer : m.layers) count += layer->parameters().size();
  if (count != static_cast<size_t>(o.parameter_count))
    fail(FP8_ERR_INVALID_STATE, "the model has ", count, " parameters, but had ", o.parameter_count,
         " when the optimizer was made; create a new optimizer after adding layers");
  if (!o.states && needs_states(o)) build_tables(o);  // SGD's momentum buffer, on first use
  OptimHyper h{o.kind,
               o.attrs[FP8_OPTIM_LR],
               o.attrs[FP8_OPTIM_BETA1],
               o.attrs[FP8_OPTIM_BETA2],
               o.attrs[FP8_OPTIM_EPS],
               o.attrs[FP8_OPTIM_WEIGHT_DECAY],
               o.attrs[FP8_OPTIM_MOMENTUM],
               o.attrs[FP8_OPTIM_MAX_GRAD_NORM]};
  o.backend->optimizer_step({o.device_tensors, o.device_chunks, static_cast<int64_t>(o.chunks.size()), o.partials,
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
  return r;
}

}  // namespace fp8::optim
