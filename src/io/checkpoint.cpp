// Checkpoints: a model's (and optimizer's) whole training state in a container file (container.hpp),
// and the model's side of safetensors files. The sections' encoding lives in checkpoint_format.cpp.
//
// Sections:
//   "libfp8"     u32 library version, u32 checkpoint layout version, u8 training flag
//   "recipe"     the recipe's text form (absent for an unconverted model)
//   "params"     per parameter, in the model's order: its name, layout (te/O1/O2/O3), value (dtype,
//                count, bytes, scale_inv for E4M3), the gradient (dtype, bytes, its scales) if saved,
//                O3's F16 master and the per-tensor scales (both through the optimizer holding them)
//   "scaling"    per layer, its scaling states in order: history length, dtype, pending flag,
//                scale, scale_inv, counters, history
//   "weight_copies" (saved between micro-batches) the scale of each Linear's FP8 weight copy, which
//                the next micro-batch reuses: after a load the copy is remade with it
//   "optimizer"  kind, level, hyper-parameters, step scalars, and per parameter its m and v in the
//                parameter's layout
// Loading decodes all of it on the host, checks it against the model, and converts each
// parameter to the optimizer's layout when the file's differs, before any device memory is written.
#include "io/checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "core/optim_rule.hpp"
#include "io/bytes.hpp"
#include "io/checkpoint_format.hpp"
#include "io/container.hpp"
#include "io/safetensors.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"

namespace fp8::io {

namespace {

// ---- reading the model ----------------------------------------------------------------------------

std::vector<uint8_t> download(Backend& be, const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes) be.copy_to_host(out.data(), p, bytes);
  return out;
}

const OptimTensor* optim_tensor(const fp8_optimizer* o, size_t index) {
  return o && index < o->tensors.size() ? &o->tensors[index] : nullptr;
}

// The part [lo, hi) of an element-indexed device array (elements of `size` bytes) from host bytes
// holding the whole array.
void upload_range(Backend& be, void* indexed, const std::vector<uint8_t>& whole, int64_t lo, int64_t hi, size_t size) {
  if (whole.empty() || hi <= lo) return;
  be.copy_from_host(static_cast<char*>(indexed) + lo * size, whole.data() + lo * size, (hi - lo) * size);
}

// A whole tensor's state: from the gathered copies where the rank holds a share of it, else its own.
const void* whole_or(const std::vector<const void*>* gathered, size_t i, const void* own) {
  return gathered && i < gathered->size() && (*gathered)[i] ? (*gathered)[i] : own;
}

std::vector<ParamState> read_params(const fp8_model& model, const fp8_optimizer* o, bool gradients,
                                    const WholeState* whole = nullptr) {
  Backend& be = *model.backend;
  const fp8_optimizer* owner = o ? o : model.weight_owner;
  const std::vector<const nn::Parameter*> all = nn::all_parameters(model);
  std::vector<ParamState> out(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const nn::Parameter& p = *all[i];
    ParamState& s = out[i];
    s.name = p.name;
    s.value_dtype = p.value->dtype;
    s.n = p.value->numel;
    // The optimizer's layout where one keeps state (SGD runs O1 on O2 storage), else the storage's.
    const OptimTensor* ot = optim_tensor(owner, i);
    s.layout = ot ? ot->layout : nn::stored_layout(model, p);
    s.value = download(be, p.value->data, p.value->nbytes());
    if (dtype_is_fp8(p.value->dtype)) be.copy_to_host(&s.value_scale_inv, p.value->scale_inv, sizeof(float));
    if (gradients) {
      s.has_grad = true;
      s.grad_dtype = p.grad->dtype;
      s.grad = download(be, p.grad->data, p.grad->nbytes());
      if (dtype_is_fp8(p.grad->dtype)) be.copy_to_host(&s.grad_scales, p.grad_scales(), sizeof(GradScales));
    }
    if (p.master) s.master = download(be, whole_or(whole ? &whole->master : nullptr, i, p.master), bytes_of(s.n, 2));
    if (const OptimTensor* t = ot) {
      if (o && t->m)
        s.m = download(be, whole_or(whole ? &whole->m : nullptr, i, t->m), bytes_of(s.n, m_size(t->layout)));
      if (o && t->v)
        s.v = download(be, whole_or(whole ? &whole->v : nullptr, i, t->v), bytes_of(s.n, v_size(t->layout)));
      if (t->scales) {
        s.has_scales = true;
        be.copy_to_host(&s.scales, t->scales, sizeof(CompactScales));
      }
    }
  }
  return out;
}

std::vector<fp8_scaling*> model_states(const fp8_model& model, std::vector<std::string>* owners = nullptr) {
  std::vector<fp8_scaling*> all;
  for (const auto& layer : model.layers) {
    std::vector<fp8_scaling*> mine;
    layer->scaling_states(mine);
    for (fp8_scaling* s : mine) {
      all.push_back(s);
      if (owners) owners->push_back(layer->name());
    }
  }
  return all;
}

// The model's scaling states as records (device contents copied to the host).
std::vector<ScalingRecord> read_scaling(const fp8_model& model) {
  std::vector<std::string> owners;
  const std::vector<fp8_scaling*> states = model_states(model, &owners);
  std::vector<ScalingRecord> out(states.size());
  for (size_t i = 0; i < states.size(); ++i) {
    const fp8_scaling& s = *states[i];
    ScalingRecord& r = out[i];
    r.layer = owners[i];
    r.history_len = s.history_len;
    r.dtype = s.dtype;
    r.pending = s.pending;
    r.history.resize(static_cast<size_t>(s.history_len));
    model.backend->copy_to_host(&r.header, s.state, sizeof(ScalingHeader));
    model.backend->copy_to_host(r.history.data(), scaling_history(s.state), r.history.size() * sizeof(float));
  }
  return out;
}

// Throws FP8_ERR_INVALID_STATE unless the records fit the model's states one for one.
void check_scaling(const std::vector<ScalingRecord>& records, const fp8_model& model) {
  std::vector<std::string> owners;
  const std::vector<fp8_scaling*> states = model_states(model, &owners);
  if (records.size() != states.size())
    fail(FP8_ERR_INVALID_STATE, "the checkpoint has ", records.size(), " scaling states, the model ", states.size(),
         "; load into a model converted as the saved one was (fp8_checkpoint_read_recipe gives its recipe)");
  for (size_t i = 0; i < states.size(); ++i) {
    const ScalingRecord& r = records[i];
    if (r.layer != owners[i] || r.history_len != states[i]->history_len || r.dtype != states[i]->dtype)
      fail(FP8_ERR_INVALID_STATE, "scaling state ", i, " is layer '", r.layer, "''s (", dtype_name(r.dtype),
           ", history ", r.history_len, ") in the checkpoint, layer '", owners[i], "''s (",
           dtype_name(states[i]->dtype), ", history ", states[i]->history_len,
           ") in the model; load into a model converted with the saved recipe");
  }
}

// The recipe section, parsed: text that does not parse makes a foreign or damaged file.
Recipe saved_recipe(const Section& section) {
  Recipe saved;
  try {
    saved.parse(std::string(section.data.begin(), section.data.end()));
  } catch (const Error& e) {
    fail(FP8_ERR_CORRUPT, "the checkpoint's recipe does not parse: ", e.what());
  }
  return saved;
}

// The file's recipe must be the model's, but for the backend and opt_level (loading converts
// between levels): another margin, interval, format or override would not resume the same run.
void check_recipe(const Section* section, const fp8_model& model) {
  if (!section != !model.recipe)
    fail(FP8_ERR_INVALID_STATE, "the checkpoint's model was ", section ? "" : "not ", "converted to FP8, this one is",
         model.recipe ? "" : " not", "; convert it as the saved one was (fp8_checkpoint_read_recipe gives the recipe)");
  if (!section) return;
  const Recipe saved = saved_recipe(*section);
  Recipe mine = *model.recipe;
  for (fp8_recipe_attr_t a : {FP8_RECIPE_BACKEND, FP8_RECIPE_OPT_LEVEL}) mine.set(a, saved.get(a));
  if (mine.values == saved.values) return;
  std::string differ;  // "margin: 2 in the file, 0 in the model; ..."
  for (int32_t i = 0; i < FP8_RECIPE_ATTR_COUNT; ++i) {
    const auto a = static_cast<fp8_recipe_attr_t>(i);
    if (saved.get(a) == mine.get(a)) continue;
    differ += (differ.empty() ? "" : "; ") + std::string(recipe_attr_spec(a)->key) + ": " +
              value_string(a, saved.get(a)) + " in the file, " + value_string(a, mine.get(a)) + " in the model";
  }
  fail(FP8_ERR_INVALID_STATE, "the checkpoint's recipe differs from the model's (", differ, "): the file's is \"",
       saved.to_string(), "\"; only backend and opt_level may differ (fp8_checkpoint_read_recipe gives it)");
}

OptimRecord read_optimizer(const fp8_optimizer& o) {
  OptimRecord r;
  r.kind = o.kind;
  r.level = o.level;
  std::copy(std::begin(o.attrs), std::end(o.attrs), std::begin(r.attrs));
  o.backend->copy_to_host(&r.scalars, o.scalars, sizeof r.scalars);
  return r;
}

// ---- writing into the model ------------------------------------------------------------------------

void upload(Backend& be, void* dst, const std::vector<uint8_t>& src) {
  if (!src.empty()) be.copy_from_host(dst, src.data(), src.size());
}

// A loaded weight in its target's storage (`ot`: the optimizer tensor that holds its master and
// scales, if any). With `live_moments` the optimizer's moment scales stay as they are (the file
// brings the weight alone). The bounds' starting amax is taken from what will be stored.
void convert_for(ParamState& p, const fp8_model& model, const nn::Parameter& t, const OptimTensor* ot,
                 bool live_moments) {
  convert_layout(p, ot ? ot->layout : nn::stored_layout(model, t));
  if (live_moments && ot && ot->scales) {
    model.backend->copy_to_host(&p.scales, ot->scales, sizeof p.scales);
    p.has_scales = true;
  }
  if (p.has_scales) p.scales.p_amax = stored_weight_amax(p);
}

// The weight's value (and scale_inv), O3 master and per-tensor scales.
void write_weight(Backend& be, nn::Parameter& t, const ParamState& p, const OptimTensor* ot) {
  upload(be, t.value->data, p.value);
  if (dtype_is_fp8(t.value->dtype)) be.copy_from_host(t.value->scale_inv, &p.value_scale_inv, sizeof(float));
  upload_range(be, t.master, p.master, t.owned_lo, t.owned_hi, 2);
  if (ot && ot->scales) be.copy_from_host(ot->scales, &p.scales, sizeof(CompactScales));
}

}  // namespace

void save_checkpoint(const fp8_model& model, const fp8_optimizer* o, const std::string& path, bool gradients,
                     const WholeState* whole) {
  if (o && o->model != &model) fail(FP8_ERR_INVALID_ARGUMENT, "optimizer belongs to another model");
  model.backend->synchronize();
  const std::vector<ParamState> params = read_params(model, o, gradients, whole);
  std::vector<Section> sections;
  std::vector<uint8_t> head;
  ByteWriter w(head);
  w.put_u32(fp8_version_number());
  w.put_u32(kCheckpointLayoutVersion);
  w.put_u8(model.training ? 1 : 0);
  sections.push_back({"libfp8", head});
  if (model.recipe) {
    const std::string text = model.recipe->to_string();
    sections.push_back({"recipe", std::vector<uint8_t>(text.begin(), text.end())});
  }
  sections.push_back({"params", encode_params(params)});
  sections.push_back({"scaling", encode_scaling(read_scaling(model))});
  WeightCopies copies;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    float scale = 0.0f;
    if (model.layers[i]->weight_copy_scale(model.weights_version, &scale))
      copies.emplace_back(static_cast<uint32_t>(i), scale);
  }
  if (!copies.empty()) sections.push_back({"weight_copies", encode_weight_copies(copies)});
  if (o) sections.push_back({"optimizer", encode_optimizer(read_optimizer(*o), params)});
  write_file_atomic(path, encode_container(sections));
}

void load_checkpoint(fp8_model& model, fp8_optimizer* o, const std::string& path,
                     const std::function<void()>& checked) {
  if (o && o->model != &model) fail(FP8_ERR_INVALID_ARGUMENT, "optimizer belongs to another model");
  const std::vector<uint8_t> file = read_file(path);
  const std::vector<Section> sections = decode_container(file.data(), file.size());
  // 1. Decode and check everything.
  const Section& head_section = require_section(sections, "libfp8");
  ByteReader head(head_section.data.data(), head_section.data.size());
  head.get_u32("library version");
  const uint32_t layout_version = head.get_u32("checkpoint layout version");
  if (layout_version > kCheckpointLayoutVersion)
    fail(FP8_ERR_VERSION, "the checkpoint's layout version is ", layout_version, "; this libfp8 reads up to ",
         kCheckpointLayoutVersion);
  const bool training = get_flag(head, "training flag");
  check_recipe(find_section(sections, "recipe"), model);
  std::vector<ParamState> params = decode_params(require_section(sections, "params").data);
  const std::vector<ScalingRecord> scaling = decode_scaling(require_section(sections, "scaling").data);
  check_scaling(scaling, model);
  WeightCopies copies;
  if (const Section* s = find_section(sections, "weight_copies")) copies = decode_weight_copies(s->data);
  for (const auto& [layer, scale] : copies)
    if (layer >= model.layers.size() || model.layers[layer]->kind() != FP8_LAYER_LINEAR ||
        !model.layers[layer]->converted())
      fail(FP8_ERR_INVALID_STATE, "the checkpoint holds an FP8 weight copy of layer ", layer,
           ", which is no converted Linear of this model");
  const Section* optim_section = find_section(sections, "optimizer");
  OptimRecord optim{};
  if (optim_section) optim = decode_optimizer(optim_section->data, params);
  if (o && !optim_section)
    fail(FP8_ERR_INVALID_STATE, "the checkpoint holds no optimizer state; pass optimizer = NULL, or save with one");
  if (optim_section)
    for (int a = 0; a < FP8_OPTIM_ATTR_COUNT; ++a) try {
        optim::check_attr(a, optim.attrs[a]);
      } catch (const Error& e) {
        fail(FP8_ERR_CORRUPT, "the checkpoint's optimizer has ", e.what());
      }
  if (o && optim.kind != o->kind)
    fail(FP8_ERR_INVALID_STATE, "the checkpoint's optimizer is ", optim::kind_name(optim.kind), ", this one ",
         optim::kind_name(o->kind), "; create the optimizer with the saved kind");

  const std::vector<nn::Parameter*> targets = nn::all_parameters(model);
  if (targets.size() != params.size())
    fail(FP8_ERR_INVALID_STATE, "the checkpoint has ", params.size(), " parameters, the model ", targets.size());
  fp8_optimizer* owner = o ? o : model.weight_owner;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamState& p = params[i];
    const nn::Parameter& t = *targets[i];
    if (nn::current_parameter_name(p.name) != t.name || p.n != t.value->numel)
      fail(FP8_ERR_INVALID_STATE, "parameter ", i, " is '", p.name, "' of ", p.n, " elements in the checkpoint, '",
           t.name, "' of ", t.value->numel, " in the model");
    if (!o) {  // the weights alone: keep this model's states
      p.m.clear();
      p.v.clear();
    }
    convert_for(p, model, t, optim_tensor(owner, i), !o);
    convert_grad(p, t.grad->dtype);
    if (p.value.size() != t.value->nbytes() || (p.has_grad && p.grad.size() != t.grad->nbytes()))
      fail(FP8_ERR_INTERNAL, "'", t.name, "' converted to ", p.value.size(), " value bytes for a tensor of ",
           t.value->nbytes());
    if (o && o->kind != FP8_OPTIMIZER_SGD && p.v.empty() && !p.m.empty())
      fail(FP8_ERR_CORRUPT, "optimizer state of '", p.name, "' has m but no v");
  }

  // 2. Write. Nothing above touched the model or the optimizer.
  if (checked) checked();
  Backend& be = *model.backend;
  if (o && std::any_of(params.begin(), params.end(), [](const ParamState& p) { return !p.m.empty(); }))
    optim::ensure_states(*o);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamState& p = params[i];
    nn::Parameter& t = *targets[i];
    const OptimTensor* ot = optim_tensor(owner, i);
    write_weight(be, t, p, ot);
    if (p.has_grad) {
      upload(be, t.grad->data, p.grad);
      if (dtype_is_fp8(t.grad->dtype)) be.copy_from_host(t.grad_scales(), &p.grad_scales, sizeof(GradScales));
    } else {
      be.zero(t.grad->data, t.grad->nbytes());
      if (dtype_is_fp8(t.grad->dtype)) be.zero(t.grad_scales(), sizeof(GradScales));
    }
    // m and v: this rank's share [owned_lo, owned_hi) (the whole tensor unless sharded).
    const auto write_state = [&](void* state, const std::vector<uint8_t>& bytes, size_t size) {
      if (!o || !state) return;
      if (bytes.empty())
        be.zero(static_cast<char*>(state) + t.owned_lo * size, bytes_of(t.owned_hi - t.owned_lo, size));
      else
        upload_range(be, state, bytes, t.owned_lo, t.owned_hi, size);
    };
    if (ot) write_state(ot->m, p.m, m_size(ot->layout)), write_state(ot->v, p.v, v_size(ot->layout));
  }
  const std::vector<fp8_scaling*> states = model_states(model);
  for (size_t i = 0; i < states.size(); ++i) {
    be.copy_from_host(states[i]->state, &scaling[i].header, sizeof(ScalingHeader));
    be.copy_from_host(scaling_history(states[i]->state), scaling[i].history.data(),
                      scaling[i].history.size() * sizeof(float));
    states[i]->pending = scaling[i].pending;
  }
  if (o) {
    std::copy(std::begin(optim.attrs), std::end(optim.attrs), std::begin(o->attrs));
    optim::upload_hyper(*o);
    be.copy_from_host(o->scalars, &optim.scalars, sizeof optim.scalars);
  }
  nn::drop_kept_states(model);  // their weights are gone
  model.training = training;
  ++model.weights_version;  // the layers remake their weight copies, with the saved scales where
  for (auto& layer : model.layers) layer->pin_weight_copy_scale(0.0f);  // an earlier load's pins go
  for (const auto& [layer, scale] : copies) model.layers[layer]->pin_weight_copy_scale(scale);  // mid-step
  be.synchronize();
}

// ---- safetensors ------------------------------------------------------------------------------------

void export_safetensors(const fp8_model& model, const std::string& path, const WholeState* whole) {
  model.backend->synchronize();
  const std::vector<ParamState> params = read_params(model, nullptr, false, whole);
  const std::vector<const nn::Parameter*> all = nn::all_parameters(model);
  std::vector<SafeTensor> tensors;
  for (size_t i = 0; i < all.size(); ++i) {
    const ParamState& p = params[i];
    SafeTensor st;
    st.name = p.name;
    st.shape.assign(all[i]->value->shape, all[i]->value->shape + all[i]->value->ndim);
    if (p.value_dtype == FP8_DTYPE_F32 || p.value_dtype == FP8_DTYPE_F16) {
      st.dtype = p.value_dtype == FP8_DTYPE_F32 ? "F32" : "F16";
      st.data = p.value;
    } else if (!p.master.empty()) {  // O3: the F16 master is the weight
      st.dtype = "F16";
      st.data = p.master;
    } else {
      st.dtype = "F32";
      st.data = floats_bytes(weight_floats(p));
    }
    tensors.push_back(std::move(st));
  }
  char version[32];
  std::snprintf(version, sizeof version, "libfp8 %d.%d.%d", FP8_VERSION_MAJOR, FP8_VERSION_MINOR, FP8_VERSION_PATCH);
  write_file_atomic(path, encode_safetensors(tensors, {{"format", "pt"}, {"producer", version}}));
}

void import_safetensors(fp8_model& model, const std::string& path, bool others_allowed) {
  // The header first, then only the parameters' bytes, one tensor at a time: a part of a large
  // checkpoint costs the memory of that part, not of the file.
  const FileReader file(path);
  const SafetensorsIndex st = read_safetensors_index(file);
  const std::vector<nn::Parameter*> targets = nn::all_parameters(model);
  // The file's tensors under the parameter names they stand for (earlier releases' names included);
  // the first in file order where two stand for one.
  std::unordered_map<std::string, const SafeTensorPlace*> by_name;
  for (const SafeTensorPlace& t : st.tensors) by_name.emplace(nn::current_parameter_name(t.name), &t);
  if (!others_allowed) {
    std::unordered_set<std::string> names;
    for (const nn::Parameter* p : targets) names.insert(p->name);
    for (const SafeTensorPlace& t : st.tensors)
      if (names.count(nn::current_parameter_name(t.name)) == 0)
        fail(FP8_ERR_INVALID_STATE, "the file's tensor '", t.name, "' is no parameter of the model");
  }
  // Every name, shape and dtype is checked before any tensor is read.
  std::vector<std::pair<const SafeTensorPlace*, fp8_dtype_t>> sources;
  for (const nn::Parameter* target : targets) {
    const nn::Parameter& t = *target;
    const auto found = by_name.find(t.name);
    if (found == by_name.end()) fail(FP8_ERR_INVALID_STATE, "the file has no tensor '", t.name, "'");
    const SafeTensorPlace& place = *found->second;
    const std::vector<int64_t> shape(t.value->shape, t.value->shape + t.value->ndim);
    if (place.shape != shape)
      fail(FP8_ERR_SHAPE, "tensor '", t.name, "' has shape ",
           shape_string(static_cast<int32_t>(place.shape.size()), place.shape.data()), " in the file, ",
           shape_string(t.value->ndim, t.value->shape), " in the model");
    fp8_dtype_t dtype = FP8_DTYPE_F32;
    if (place.dtype == "F16")
      dtype = FP8_DTYPE_F16;
    else if (place.dtype == "BF16")
      dtype = FP8_DTYPE_BF16;
    else if (place.dtype != "F32")
      fail(FP8_ERR_UNSUPPORTED, "tensor '", t.name, "' is ", place.dtype, "; libfp8 imports F32, F16 and BF16");
    sources.emplace_back(&place, dtype);
  }
  std::vector<ParamState> params;
  for (size_t i = 0; i < targets.size(); ++i) {
    const nn::Parameter& t = *targets[i];
    const auto [place, dtype] = sources[i];
    ParamState p;
    p.name = t.name;
    p.n = t.value->numel;
    const std::vector<uint8_t> bytes =
        file.read_at(st.data_start + place->begin, place->end - place->begin, "tensor '" + place->name + "'");
    p.value = floats_bytes(widen_host(dtype, bytes.data(), p.n));
    convert_for(p, model, t, optim_tensor(model.weight_owner, i), true);
    params.push_back(std::move(p));
  }
  Backend& be = *model.backend;
  for (size_t i = 0; i < params.size(); ++i)
    write_weight(be, *targets[i], params[i], optim_tensor(model.weight_owner, i));
  ++model.weights_version;
  be.synchronize();
}

std::vector<float> widen_host(fp8_dtype_t dtype, const void* src, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  const unsigned char* b = static_cast<const unsigned char*>(src);
  for (size_t k = 0; k < out.size(); ++k) {
    if (dtype == FP8_DTYPE_F32) {
      std::memcpy(&out[k], b + 4 * k, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b + 2 * k, 2);
      out[k] = dtype == FP8_DTYPE_F16 ? f16_to_float(h) : bf16_to_float(h);
    }
  }
  return out;
}

void write_parameter(fp8_model& model, size_t index, fp8_dtype_t dtype, const void* src) {
  const std::vector<nn::Parameter*> targets = nn::all_parameters(model);
  nn::Parameter& t = *targets.at(index);
  ParamState p;
  p.name = t.name;
  p.n = t.value->numel;
  p.value = floats_bytes(widen_host(dtype, src, p.n));
  convert_for(p, model, t, optim_tensor(model.weight_owner, index), true);
  write_weight(*model.backend, t, p, optim_tensor(model.weight_owner, index));
  ++t.value->version;  // the layer remakes its weight copies; an optimizer takes the new amax
  model.backend->synchronize();
}

Recipe checkpoint_recipe(const std::string& path) {
  const std::vector<uint8_t> file = read_file(path);
  const std::vector<Section> sections = decode_container(file.data(), file.size());
  const Section* s = find_section(sections, "recipe");
  if (!s) fail(FP8_ERR_INVALID_STATE, "the checkpoint's model was not converted to FP8: it has no recipe");
  return saved_recipe(*s);
}

}  // namespace fp8::io
