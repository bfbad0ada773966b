#include "nn/model.hpp"

#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/error.hpp"

namespace fp8::nn {

namespace {

const char* kind_name(int32_t kind) {
  switch (kind) {
    case FP8_LAYER_LINEAR: return "linear";
    case FP8_LAYER_LAYERNORM: return "layernorm";
    case FP8_LAYER_RMSNORM: return "rmsnorm";
    default: return "activation";
  }
}

const char* precision(int32_t p) { return p < 0 ? "-" : p ? "fp8" : "high"; }

}  // namespace

void require_new_layer_name(const fp8_model& m, const char* name) {
  require_arg(name, "name");
  const size_t len = std::strlen(name);
  if (len == 0 || len > 63) fail(FP8_ERR_INVALID_ARGUMENT, "name '", name, "' has ", len, " bytes; expected 1..63");
  if (std::strchr(name, '.'))
    fail(FP8_ERR_INVALID_ARGUMENT, "name '", name, "' contains '.'; it separates layer and parameter names");
  for (const auto& l : m.layers)
    if (l->name() == name) fail(FP8_ERR_INVALID_ARGUMENT, "the model already has a layer named '", name, "'");
}

Layer& layer_at(fp8_model& m, int32_t id) {
  if (id < 0 || static_cast<size_t>(id) >= m.layers.size())
    fail(FP8_ERR_INVALID_ARGUMENT, "layer_id = ", id, "; the model has layers 0..", static_cast<int64_t>(m.layers.size()) - 1);
  return *m.layers[static_cast<size_t>(id)];
}

const Layer& layer_at(const fp8_model& m, int32_t id) { return layer_at(const_cast<fp8_model&>(m), id); }

Step make_step(fp8_model& m) {
  const Recipe* r = m.recipe ? &*m.recipe : nullptr;
  const bool fp8 = r && m.autocast && (m.training || r->get(FP8_RECIPE_USE_AUTOCAST_DURING_EVAL));
  return Step{*m.backend, r, fp8, m.training, m.weights_version};
}

void convert_model(fp8_model& m, const Recipe* recipe, const ConvertChoice& c) {
  for (auto& l : m.layers) {
    const int32_t k = l->kind();
    const bool chosen = k == FP8_LAYER_LINEAR ? c.linear : k == FP8_LAYER_ACTIVATION ? c.activation : c.norm;
    l->convert(c.to_fp8 && chosen ? recipe : nullptr);
  }
}

void update_model_scaling(fp8_model& m) {
  if (!m.recipe) return;
  std::vector<fp8_scaling*> states;
  for (auto& l : m.layers) l->scaling_states(states);
  if (!states.empty()) fp8::update_scaling(*m.backend, states.data(), static_cast<int32_t>(states.size()), *m.recipe);
}

Parameter* find_parameter(fp8_model& m, const std::string& full_name) {
  for (auto& l : m.layers)
    for (Parameter& p : l->parameters())
      if (p.name == full_name) return &p;
  return nullptr;
}

std::string model_report(const fp8_model& m) {
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-16s %-10s %-9s %-5s %-5s %-5s %9s %9s  %s\n", "layer", "kind", "converted",
                "fprop", "dgrad", "wgrad", "fp8 calls", "fallbacks", "reason");
  os << line;
  for (const auto& l : m.layers) {
    const LayerStats& s = l->stats();
    std::snprintf(line, sizeof line, "%-16s %-10s %-9s %-5s %-5s %-5s %9lld %9lld  %s\n", l->name().c_str(),
                  kind_name(l->kind()), l->converted() ? "yes" : "no", precision(s.fprop), precision(s.dgrad),
                  precision(s.wgrad), static_cast<long long>(s.fp8_calls), static_cast<long long>(s.fallback_calls),
                  s.reason.c_str());
    os << line;
  }
  return os.str();
}

}  // namespace fp8::nn
