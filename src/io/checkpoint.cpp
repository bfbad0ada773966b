// Checkpoints: a model's (and optimizer's) whole training state in a container file (container.hpp).
//
// Sections (every integer little-endian, every float as its IEEE bits):
//   "libfp8"     u32 library version, u32 checkpoint layout version, u8 training flag
//   "recipe"     the recipe's text form (absent for an unconverted model)
//   "params"     per parameter, in the model's order: its name, layout (te/O1/O2/O3), value (dtype,
//                count, bytes, scale_inv for E4M3), and the gradient (dtype, bytes, its scales) if saved
//   "scaling"    per layer, its scaling states in order: history length, dtype, pending flag,
//                scale, scale_inv, counters, history
//   "optimizer"  kind, level, hyper-parameters, step scalars, and per parameter its m, v, F16 master
//                and per-tensor scales in the parameter's layout
// Loading decodes all of it on the host, checks it against the model, and converts each
// parameter to the optimizer's layout when the file's differs, before any device memory is written.
#include "io/checkpoint.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "core/optim_rule.hpp"
#include "io/bytes.hpp"
#include "io/container.hpp"
#include "io/safetensors.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"

namespace fp8::io {

namespace {

constexpr uint32_t kLayoutVersion = 1;  // of the sections' contents (the container has its own)

// ---- one parameter's stored state, on the host ---------------------------------------------------

struct ParamState {
  std::string name;
  int32_t layout = kLayoutF32;
  fp8_dtype_t value_dtype = FP8_DTYPE_F32;
  int64_t n = 0;
  std::vector<uint8_t> value;
  float value_scale_inv = 1.0f;  // E4M3 values (O3)
  bool has_grad = false;
  fp8_dtype_t grad_dtype = FP8_DTYPE_F32;
  std::vector<uint8_t> grad;
  GradScales grad_scales{};
  // Optimizer state (when the file or the target has an optimizer).
  std::vector<uint8_t> m, v, master;  // empty where the layout or kind has none
  CompactScales scales{};
};

size_t bytes_of(int64_t n, size_t element) { return static_cast<size_t>(n) * element; }

std::vector<uint8_t> download(Backend& be, const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes) be.copy_to_host(out.data(), p, bytes);
  return out;
}

const OptimTensor* optim_tensor(const fp8_optimizer* o, size_t index) {
  return o && index < o->tensors.size() ? &o->tensors[index] : nullptr;
}

// Element sizes of m and v in a layout (F32 for te and O1, E4M3 and F16 for O2/O3).
size_t m_size(int32_t layout) { return layout >= kLayoutO2 ? 1 : 4; }
size_t v_size(int32_t layout) { return layout >= kLayoutO2 ? 2 : 4; }

std::vector<ParamState> read_params(const fp8_model& model, const fp8_optimizer* o, bool gradients) {
  Backend& be = *model.backend;
  std::vector<ParamState> out;
  size_t index = 0;
  for (const auto& layer : model.layers)
    for (const nn::Parameter& p : layer->parameters()) {
      ParamState s;
      s.name = p.name;
      s.value_dtype = p.value->dtype;
      s.n = p.value->numel;
      s.layout = p.value->dtype == FP8_DTYPE_F32 ? kLayoutF32 : p.value->dtype == FP8_DTYPE_E4M3 ? kLayoutO3 : model.weight_level;
      s.value = download(be, p.value->data, p.value->nbytes());
      if (dtype_is_fp8(p.value->dtype)) be.copy_to_host(&s.value_scale_inv, p.value->scale_inv, sizeof(float));
      if (gradients) {
        s.has_grad = true;
        s.grad_dtype = p.grad->dtype;
        s.grad = download(be, p.grad->data, p.grad->nbytes());
        if (dtype_is_fp8(p.grad->dtype)) be.copy_to_host(&s.grad_scales, p.grad_scales(), sizeof(GradScales));
      }
      const fp8_optimizer* owner = o ? o : model.weight_owner;
      if (const OptimTensor* t = optim_tensor(owner, index)) {
        if (t->master) s.master = download(be, t->master, bytes_of(s.n, 2));
        if (o && t->m) s.m = download(be, t->m, bytes_of(s.n, m_size(t->layout)));
        if (o && t->v) s.v = download(be, t->v, bytes_of(s.n, v_size(t->layout)));
        if (t->scales) be.copy_to_host(&s.scales, t->scales, sizeof(CompactScales));
      }
      out.push_back(std::move(s));
      ++index;
    }
  return out;
}

// ---- serialisation ---------------------------------------------------------------------------------

void put_grad_scales(ByteWriter& w, const GradScales& g) {
  w.put_f32(g.scale_inv);
  w.put_f32(g.amax);
  w.put_f32(g.add_amax);
  w.put_u32(g.next_amax_code);
}
GradScales get_grad_scales(ByteReader& r) {
  GradScales g{};
  g.scale_inv = r.get_f32("gradient scale_inv");
  g.amax = r.get_f32("gradient amax");
  g.add_amax = r.get_f32("gradient add_amax");
  g.next_amax_code = r.get_u32("gradient next_amax_code");
  return g;
}
void put_compact_scales(ByteWriter& w, const CompactScales& c) {
  for (float f : {c.m_scale_inv, c.v_scale_inv, c.m_amax, c.v_amax, c.p_amax, c.m_scale, c.v_scale, c.w_scale})
    w.put_f32(f);
  for (uint32_t u : {c.next_m_code, c.next_v_code, c.next_p_code}) w.put_u32(u);
}
CompactScales get_compact_scales(ByteReader& r) {
  CompactScales c{};
  for (float* f : {&c.m_scale_inv, &c.v_scale_inv, &c.m_amax, &c.v_amax, &c.p_amax, &c.m_scale, &c.v_scale, &c.w_scale})
    *f = r.get_f32("optimizer scales");
  for (uint32_t* u : {&c.next_m_code, &c.next_v_code, &c.next_p_code}) *u = r.get_u32("optimizer scales");
  return c;
}
void put_blob(ByteWriter& w, const std::vector<uint8_t>& b) {
  w.put_u64(b.size());
  w.put_bytes(b);
}
std::vector<uint8_t> get_blob(ByteReader& r, const char* what) { return r.get_bytes(r.get_u64(what), what); }

fp8_dtype_t get_dtype(ByteReader& r, const char* what) {
  const uint32_t d = r.get_u32(what);
  if (!dtype_valid(static_cast<fp8_dtype_t>(d))) fail(FP8_ERR_CORRUPT, what, " has dtype code ", d, ", which is none");
  return static_cast<fp8_dtype_t>(d);
}

std::vector<uint8_t> encode_params(const std::vector<ParamState>& params) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_u32(static_cast<uint32_t>(params.size()));
  for (const ParamState& p : params) {
    w.put_string(p.name);
    w.put_u32(static_cast<uint32_t>(p.layout));
    w.put_u32(static_cast<uint32_t>(p.value_dtype));
    w.put_i64(p.n);
    put_blob(w, p.value);
    w.put_f32(p.value_scale_inv);
    w.put_u8(p.has_grad ? 1 : 0);
    if (p.has_grad) {
      w.put_u32(static_cast<uint32_t>(p.grad_dtype));
      put_blob(w, p.grad);
      put_grad_scales(w, p.grad_scales);
    }
  }
  return out;
}

std::vector<ParamState> decode_params(const std::vector<uint8_t>& data) {
  ByteReader r(data.data(), data.size());
  const uint32_t count = r.get_u32("parameter count");
  if (count > data.size()) fail(FP8_ERR_CORRUPT, "params: ", count, " parameters cannot fit in ", data.size(), " bytes");
  std::vector<ParamState> out(count);
  for (ParamState& p : out) {
    p.name = r.get_string("parameter name");
    p.layout = static_cast<int32_t>(r.get_u32("parameter layout"));
    if (p.layout < kLayoutF32 || p.layout > kLayoutO3) fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' has layout ", p.layout);
    p.value_dtype = get_dtype(r, "parameter value");
    p.n = r.get_i64("parameter size");
    p.value = get_blob(r, "parameter value");
    if (p.n < 0 || p.value.size() != bytes_of(p.n, dtype_size(p.value_dtype)))
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' holds ", p.value.size(), " bytes for ", p.n, " ",
           dtype_name(p.value_dtype), " elements");
    p.value_scale_inv = r.get_f32("parameter scale_inv");
    p.has_grad = r.get_u8("gradient flag") != 0;
    if (p.has_grad) {
      p.grad_dtype = get_dtype(r, "gradient");
      p.grad = get_blob(r, "gradient");
      p.grad_scales = get_grad_scales(r);
      if (p.grad.size() != bytes_of(p.n, dtype_size(p.grad_dtype)))
        fail(FP8_ERR_CORRUPT, "gradient of '", p.name, "' holds ", p.grad.size(), " bytes for ", p.n, " elements");
    }
  }
  r.expect_done("params");
  return out;
}

// ---- scaling states --------------------------------------------------------------------------------

struct ScalingRecord {
  int32_t history_len;
  fp8_dtype_t dtype;
  bool pending;
  std::vector<uint8_t> raw;  // header + history, as in device memory (put field by field below)
};

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

std::vector<uint8_t> encode_scaling(const fp8_model& model) {
  std::vector<std::string> owners;
  const std::vector<fp8_scaling*> states = model_states(model, &owners);
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_u32(static_cast<uint32_t>(states.size()));
  for (size_t i = 0; i < states.size(); ++i) {
    const fp8_scaling& s = *states[i];
    std::vector<uint8_t> raw(sizeof(ScalingHeader) + sizeof(float) * static_cast<size_t>(s.history_len));
    model.backend->copy_to_host(raw.data(), s.state, raw.size());
    ScalingHeader h;
    std::memcpy(&h, raw.data(), sizeof h);
    w.put_string(owners[i]);
    w.put_u32(static_cast<uint32_t>(s.history_len));
    w.put_u32(static_cast<uint32_t>(s.dtype));
    w.put_u8(s.pending ? 1 : 0);
    w.put_f32(h.scale);
    w.put_f32(h.scale_inv);
    w.put_u64(h.nonfinite_count);
    w.put_u64(h.update_count);
    for (int32_t k = 0; k < s.history_len; ++k) {
      float f;
      std::memcpy(&f, raw.data() + sizeof h + sizeof(float) * static_cast<size_t>(k), sizeof f);
      w.put_f32(f);
    }
  }
  return out;
}

// Decodes the states and checks them against the model's (same layers, lengths and formats).
std::vector<ScalingRecord> decode_scaling(const std::vector<uint8_t>& data, const fp8_model& model) {
  std::vector<std::string> owners;
  const std::vector<fp8_scaling*> states = model_states(model, &owners);
  ByteReader r(data.data(), data.size());
  const uint32_t count = r.get_u32("scaling state count");
  if (count != states.size())
    fail(FP8_ERR_INVALID_STATE, "the checkpoint has ", count, " scaling states, the model ", states.size(),
         "; load into a model converted as the saved one was (fp8_checkpoint_read_recipe gives its recipe)");
  std::vector<ScalingRecord> out;
  for (size_t i = 0; i < states.size(); ++i) {
    const std::string owner = r.get_string("scaling state layer");
    ScalingRecord rec;
    rec.history_len = static_cast<int32_t>(r.get_u32("amax history length"));
    rec.dtype = get_dtype(r, "scaling state");
    rec.pending = r.get_u8("pending flag") != 0;
    if (owner != owners[i] || rec.history_len != states[i]->history_len || rec.dtype != states[i]->dtype)
      fail(FP8_ERR_INVALID_STATE, "scaling state ", i, " is layer '", owner, "''s (", dtype_name(rec.dtype),
           ", history ", rec.history_len, ") in the checkpoint, layer '", owners[i], "''s (",
           dtype_name(states[i]->dtype), ", history ", states[i]->history_len,
           ") in the model; load into a model converted with the saved recipe");
    ScalingHeader h{};
    h.scale = r.get_f32("scale");
    h.scale_inv = r.get_f32("scale_inv");
    h.nonfinite_count = r.get_u64("nonfinite count");
    h.update_count = r.get_u64("update count");
    rec.raw.resize(sizeof h + sizeof(float) * static_cast<size_t>(rec.history_len));
    std::memcpy(rec.raw.data(), &h, sizeof h);
    for (int32_t k = 0; k < rec.history_len; ++k) {
      const float f = r.get_f32("amax history");
      std::memcpy(rec.raw.data() + sizeof h + sizeof(float) * static_cast<size_t>(k), &f, sizeof f);
    }
    out.push_back(std::move(rec));
  }
  r.expect_done("scaling");
  return out;
}

// ---- optimizer ----------------------------------------------------------------------------------------

struct OptimRecord {
  fp8_optimizer_kind_t kind;
  int32_t level;
  double attrs[FP8_OPTIM_ATTR_COUNT];
  OptimScalars scalars;
};

void put_scalars(ByteWriter& w, const OptimScalars& s) {
  w.put_f64(s.sumsq);
  w.put_f32(s.grad_norm);
  w.put_f32(s.clip);
  w.put_f32(s.step_size);
  w.put_f32(s.inv_bc2_sqrt);
  w.put_u32(static_cast<uint32_t>(s.skip));
  w.put_u64(s.steps);
  w.put_u64(s.skipped);
}
OptimScalars get_scalars(ByteReader& r) {
  OptimScalars s{};
  s.sumsq = r.get_f64("optimizer scalars");
  s.grad_norm = r.get_f32("optimizer scalars");
  s.clip = r.get_f32("optimizer scalars");
  s.step_size = r.get_f32("optimizer scalars");
  s.inv_bc2_sqrt = r.get_f32("optimizer scalars");
  s.skip = static_cast<int32_t>(r.get_u32("optimizer scalars"));
  s.steps = r.get_u64("optimizer scalars");
  s.skipped = r.get_u64("optimizer scalars");
  return s;
}

std::vector<uint8_t> encode_optimizer(const fp8_optimizer& o, const std::vector<ParamState>& params) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_u32(static_cast<uint32_t>(o.kind));
  w.put_u32(static_cast<uint32_t>(o.level));
  for (double a : o.attrs) w.put_f64(a);
  OptimScalars s{};
  o.backend->copy_to_host(&s, o.scalars, sizeof s);
  put_scalars(w, s);
  w.put_u32(static_cast<uint32_t>(params.size()));
  for (const ParamState& p : params) {
    put_blob(w, p.m);
    put_blob(w, p.v);
    put_blob(w, p.master);
    put_compact_scales(w, p.scales);
  }
  return out;
}

OptimRecord decode_optimizer(const std::vector<uint8_t>& data, std::vector<ParamState>& params) {
  ByteReader r(data.data(), data.size());
  OptimRecord rec{};
  rec.kind = static_cast<fp8_optimizer_kind_t>(r.get_u32("optimizer kind"));
  rec.level = static_cast<int32_t>(r.get_u32("optimizer level"));
  if (rec.kind < FP8_OPTIMIZER_SGD || rec.kind > FP8_OPTIMIZER_ADAMW || rec.level < 0 || rec.level > kLayoutO3)
    fail(FP8_ERR_CORRUPT, "optimizer kind ", rec.kind, " / level ", rec.level, " is none libfp8 has");
  for (double& a : rec.attrs) a = r.get_f64("optimizer attribute");
  rec.scalars = get_scalars(r);
  const uint32_t count = r.get_u32("optimizer tensor count");
  if (count != params.size())
    fail(FP8_ERR_CORRUPT, "optimizer section lists ", count, " tensors, params ", params.size());
  for (ParamState& p : params) {
    p.m = get_blob(r, "optimizer m");
    p.v = get_blob(r, "optimizer v");
    p.master = get_blob(r, "optimizer master");
    p.scales = get_compact_scales(r);
    const bool moments = rec.kind != FP8_OPTIMIZER_SGD;
    const bool m_ok = p.m.empty() || p.m.size() == bytes_of(p.n, m_size(p.layout));
    const bool v_ok = moments ? p.v.size() == bytes_of(p.n, v_size(p.layout)) || (p.v.empty() && p.m.empty()) : p.v.empty();
    const bool master_ok = p.layout == kLayoutO3 ? p.master.size() == bytes_of(p.n, 2) : p.master.empty();
    if (!m_ok || !v_ok || !master_ok)
      fail(FP8_ERR_CORRUPT, "optimizer state of '", p.name, "' has ", p.m.size(), "/", p.v.size(), "/", p.master.size(),
           " bytes of m/v/master for ", p.n, " elements at ", layout_name(p.layout));
  }
  r.expect_done("optimizer");
  return rec;
}

// ---- conversion between layouts ----------------------------------------------------------------------

float amax_of(const std::vector<float>& v) {
  float a = 0.0f;
  for (float f : v) a = std::max(a, std::fabs(f));
  return a;
}

// The weight as floats: the F16 master at O3 when there is one, else the stored value.
std::vector<float> weight_floats(const ParamState& p) {
  std::vector<float> out(static_cast<size_t>(p.n));
  for (int64_t i = 0; i < p.n; ++i) {
    const size_t k = static_cast<size_t>(i);
    if (!p.master.empty()) {
      uint16_t h;
      std::memcpy(&h, p.master.data() + 2 * k, 2);
      out[k] = f16_to_float(h);
    } else if (p.value_dtype == FP8_DTYPE_F32) {
      std::memcpy(&out[k], p.value.data() + 4 * k, 4);
    } else if (p.value_dtype == FP8_DTYPE_F16) {
      uint16_t h;
      std::memcpy(&h, p.value.data() + 2 * k, 2);
      out[k] = f16_to_float(h);
    } else {
      out[k] = dequantize_fp8(p.value[k], p.value_dtype == FP8_DTYPE_E5M2, p.value_scale_inv);
    }
  }
  return out;
}

// m or v as floats (empty when absent).
std::vector<float> state_floats(const std::vector<uint8_t>& raw, int32_t layout, bool is_m, const CompactScales& c,
                                int64_t n) {
  if (raw.empty()) return {};
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    if (layout <= kLayoutO1) {
      std::memcpy(&out[k], raw.data() + 4 * k, 4);
    } else if (is_m) {
      out[k] = dequantize_fp8(raw[k], false, c.m_scale_inv);
    } else {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * k, 2);
      out[k] = f16_to_float(h) * c.v_scale_inv;
    }
  }
  return out;
}

std::vector<uint8_t> floats_bytes(const std::vector<float>& f) {
  std::vector<uint8_t> out(f.size() * 4);
  if (!f.empty()) std::memcpy(out.data(), f.data(), out.size());
  return out;
}

// Re-encodes a parameter saved at `p.layout` into `layout` (weights, m, v, master, scales): exact
// widening towards te, rounding (and fresh per-tensor scales from the values' amax) towards O1..O3.
void convert_layout(ParamState& p, int32_t layout) {
  if (p.layout == layout && !(layout == kLayoutO3 && p.master.empty())) return;  // (O3 needs its master)
  const std::vector<float> w = weight_floats(p);
  const std::vector<float> m = state_floats(p.m, p.layout, true, p.scales, p.n);
  const std::vector<float> v = state_floats(p.v, p.layout, false, p.scales, p.n);
  CompactScales c{};
  p.master.clear();
  p.value_scale_inv = 1.0f;
  if (layout == kLayoutF32) {
    p.value_dtype = FP8_DTYPE_F32;
    p.value = floats_bytes(w);
  } else {
    std::vector<uint8_t> f16(static_cast<size_t>(p.n) * 2);
    float p_amax = 0.0f;
    for (size_t k = 0; k < w.size(); ++k) {
      const uint16_t h = float_to_f16(w[k]);
      std::memcpy(f16.data() + 2 * k, &h, 2);
      p_amax = std::max(p_amax, std::fabs(f16_to_float(h)));
    }
    c.p_amax = p_amax;
    if (layout == kLayoutO3) {
      const float scale = bound_scale(448.0, p_amax);
      p.value_dtype = FP8_DTYPE_E4M3;
      p.value.resize(static_cast<size_t>(p.n));
      for (size_t k = 0; k < w.size(); ++k) {
        uint16_t h;
        std::memcpy(&h, f16.data() + 2 * k, 2);
        p.value[k] = encode_fp8(f16_to_float(h) * scale, false);
      }
      p.value_scale_inv = 1.0f / scale;
      p.master = std::move(f16);
    } else {
      p.value_dtype = FP8_DTYPE_F16;
      p.value = std::move(f16);
    }
  }
  if (layout <= kLayoutO1) {
    p.m = floats_bytes(m);
    p.v = floats_bytes(v);
  } else if (!m.empty()) {
    const float ms = bound_scale(448.0, amax_of(m)), vs = bound_scale(kF16Max, amax_of(v));
    c.m_scale_inv = 1.0f / ms;
    c.v_scale_inv = 1.0f / vs;
    p.m.assign(static_cast<size_t>(p.n), 0);
    p.v.assign(static_cast<size_t>(p.n) * 2, 0);
    uint32_t m_top = 0, v_top = 0;
    for (size_t k = 0; k < m.size(); ++k) {
      p.m[k] = encode_fp8(m[k] * ms, false);
      const uint16_t h = float_to_f16(v[k] * vs);
      std::memcpy(p.v.data() + 2 * k, &h, 2);
      m_top = std::max<uint32_t>(m_top, p.m[k] & 0x7Fu);
      v_top = std::max<uint32_t>(v_top, h & 0x7FFFu);
    }
    c.m_amax = decode_fp8(static_cast<uint8_t>(m_top), false) * c.m_scale_inv;
    c.v_amax = f16_to_float(static_cast<uint16_t>(v_top)) * c.v_scale_inv;
  }
  p.scales = c;
  p.layout = layout;
}

// The saved gradient re-encoded for a target of `dtype` (FP32, or FP8 with its scales).
void convert_grad(ParamState& p, fp8_dtype_t dtype) {
  if (!p.has_grad || p.grad_dtype == dtype) return;
  std::vector<float> g(static_cast<size_t>(p.n));
  for (size_t k = 0; k < g.size(); ++k) {
    if (p.grad_dtype == FP8_DTYPE_F32) std::memcpy(&g[k], p.grad.data() + 4 * k, 4);
    else g[k] = dequantize_fp8(p.grad[k], p.grad_dtype == FP8_DTYPE_E5M2, p.grad_scales.scale_inv);
  }
  p.grad_dtype = dtype;
  p.grad_scales = GradScales{};
  if (dtype == FP8_DTYPE_F32) {
    p.grad = floats_bytes(g);
    return;
  }
  p.grad.assign(static_cast<size_t>(p.n), 0);  // the CPU reference's accumulation into an empty gradient
  cpu_grad_accumulate({p.grad.data(), dtype == FP8_DTYPE_E5M2, g.data(), p.n, &p.grad_scales});
}

// ---- writing into the model ------------------------------------------------------------------------

void upload(Backend& be, void* dst, const std::vector<uint8_t>& src) {
  if (!src.empty()) be.copy_from_host(dst, src.data(), src.size());
}

}  // namespace

void save_checkpoint(const fp8_model& model, const fp8_optimizer* o, const std::string& path, bool gradients) {
  if (o && o->model != &model) fail(FP8_ERR_INVALID_ARGUMENT, "optimizer belongs to another model");
  model.backend->synchronize();
  const std::vector<ParamState> params = read_params(model, o, gradients);
  std::vector<Section> sections;
  std::vector<uint8_t> head;
  ByteWriter w(head);
  w.put_u32(fp8_version_number());
  w.put_u32(kLayoutVersion);
  w.put_u8(model.training ? 1 : 0);
  sections.push_back({"libfp8", head});
  if (model.recipe) {
    const std::string text = model.recipe->to_string();
    sections.push_back({"recipe", std::vector<uint8_t>(text.begin(), text.end())});
  }
  sections.push_back({"params", encode_params(params)});
  sections.push_back({"scaling", encode_scaling(model)});
  if (o) sections.push_back({"optimizer", encode_optimizer(*o, params)});
  write_file_atomic(path, encode_container(sections));
}

void load_checkpoint(fp8_model& model, fp8_optimizer* o, const std::string& path) {
  if (o && o->model != &model) fail(FP8_ERR_INVALID_ARGUMENT, "optimizer belongs to another model");
  const std::vector<uint8_t> file = read_file(path);
  const std::vector<Section> sections = decode_container(file.data(), file.size());
  // 1. Decode and check everything.
  const Section& head_section = require_section(sections, "libfp8");
  ByteReader head(head_section.data.data(), head_section.data.size());
  head.get_u32("library version");
  const uint32_t layout_version = head.get_u32("checkpoint layout version");
  if (layout_version > kLayoutVersion)
    fail(FP8_ERR_VERSION, "the checkpoint's layout version is ", layout_version, "; this libfp8 reads up to ",
         kLayoutVersion);
  const bool training = head.get_u8("training flag") != 0;
  std::vector<ParamState> params = decode_params(require_section(sections, "params").data);
  const std::vector<ScalingRecord> scaling = decode_scaling(require_section(sections, "scaling").data, model);
  const Section* optim_section = find_section(sections, "optimizer");
  OptimRecord optim{};
  if (optim_section) optim = decode_optimizer(optim_section->data, params);
  if (o && !optim_section)
    fail(FP8_ERR_INVALID_STATE, "the checkpoint holds no optimizer state; pass optimizer = NULL, or save with one");
  if (o && optim.kind != o->kind)
    fail(FP8_ERR_INVALID_STATE, "the checkpoint's optimizer is kind ", optim.kind, ", this one ", o->kind,
         "; create the optimizer with the saved kind");

  std::vector<nn::Parameter*> targets;
  for (auto& layer : model.layers)
    for (nn::Parameter& p : layer->parameters()) targets.push_back(&p);
  if (targets.size() != params.size())
    fail(FP8_ERR_INVALID_STATE, "the checkpoint has ", params.size(), " parameters, the model ", targets.size());
  fp8_optimizer* owner = o ? o : model.weight_owner;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamState& p = params[i];
    const nn::Parameter& t = *targets[i];
    if (p.name != t.name || p.n != t.value->numel)
      fail(FP8_ERR_INVALID_STATE, "parameter ", i, " is '", p.name, "' of ", p.n, " elements in the checkpoint, '",
           t.name, "' of ", t.value->numel, " in the model");
    const OptimTensor* ot = optim_tensor(owner, i);
    const int32_t layout = ot ? ot->layout : t.value->dtype == FP8_DTYPE_F32 ? kLayoutF32 : model.weight_level;
    if (layout == kLayoutO3 && !ot)
      fail(FP8_ERR_INVALID_STATE, "'", t.name, "' is stored at O3 but no optimizer holds its master; create one first");
    if (!o) {  // the weights alone: keep this model's states
      p.m.clear();
      p.v.clear();
    }
    convert_layout(p, layout);
    if (!o && ot && ot->scales) {  // keep the live optimizer's moment scales, take the weight's amax
      CompactScales live{};
      model.backend->copy_to_host(&live, ot->scales, sizeof live);
      live.p_amax = p.scales.p_amax;
      p.scales = live;
    }
    convert_grad(p, t.grad->dtype);
    if (o && o->kind != FP8_OPTIMIZER_SGD && p.v.empty() && !p.m.empty())
      fail(FP8_ERR_CORRUPT, "optimizer state of '", p.name, "' has m but no v");
  }

  // 2. Write. Nothing above touched the model or the optimizer.
  Backend& be = *model.backend;
  if (o && std::any_of(params.begin(), params.end(), [](const ParamState& p) { return !p.m.empty(); }))
    optim::ensure_states(*o);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamState& p = params[i];
    nn::Parameter& t = *targets[i];
    upload(be, t.value->data, p.value);
    if (dtype_is_fp8(t.value->dtype)) be.copy_from_host(t.value->scale_inv, &p.value_scale_inv, sizeof(float));
    if (p.has_grad) {
      upload(be, t.grad->data, p.grad);
      if (dtype_is_fp8(t.grad->dtype)) be.copy_from_host(t.grad_scales(), &p.grad_scales, sizeof(GradScales));
    } else {
      be.zero(t.grad->data, t.grad->nbytes());
      if (dtype_is_fp8(t.grad->dtype)) be.zero(t.grad_scales(), sizeof(GradScales));
    }
    if (const OptimTensor* ot = optim_tensor(owner, i)) {
      if (ot->master) upload(be, ot->master, p.master);
      if (ot->scales) be.copy_from_host(ot->scales, &p.scales, sizeof(CompactScales));
      if (o && ot->m) p.m.empty() ? be.zero(ot->m, bytes_of(p.n, m_size(ot->layout))) : upload(be, ot->m, p.m);
      if (o && ot->v) p.v.empty() ? be.zero(ot->v, bytes_of(p.n, v_size(ot->layout))) : upload(be, ot->v, p.v);
    }
  }
  const std::vector<fp8_scaling*> states = model_states(model);
  for (size_t i = 0; i < states.size(); ++i) {
    upload(be, states[i]->state, scaling[i].raw);
    states[i]->pending = scaling[i].pending;
  }
  if (o) {
    std::copy(std::begin(optim.attrs), std::end(optim.attrs), std::begin(o->attrs));
    be.copy_from_host(o->scalars, &optim.scalars, sizeof optim.scalars);
  }
  model.training = training;
  ++model.weights_version;  // the layers remake their weight copies
  be.synchronize();
}

// ---- safetensors ------------------------------------------------------------------------------------

void export_safetensors(const fp8_model& model, const std::string& path) {
  model.backend->synchronize();
  const std::vector<ParamState> params = read_params(model, nullptr, false);
  std::vector<SafeTensor> tensors;
  size_t index = 0;
  for (const auto& layer : model.layers)
    for (const nn::Parameter& t : layer->parameters()) {
      const ParamState& p = params[index++];
      SafeTensor st;
      st.name = p.name;
      st.shape.assign(t.value->shape, t.value->shape + t.value->ndim);
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

void import_safetensors(fp8_model& model, const std::string& path) {
  const std::vector<uint8_t> file = read_file(path);
  const SafetensorsFile st = decode_safetensors(file.data(), file.size());
  std::vector<nn::Parameter*> targets;
  for (auto& layer : model.layers)
    for (nn::Parameter& p : layer->parameters()) targets.push_back(&p);
  for (const SafeTensor& t : st.tensors)
    if (std::none_of(targets.begin(), targets.end(), [&](const nn::Parameter* p) { return p->name == t.name; }))
      fail(FP8_ERR_INVALID_STATE, "the file's tensor '", t.name, "' is no parameter of the model");
  std::vector<ParamState> params;
  for (size_t i = 0; i < targets.size(); ++i) {
    const nn::Parameter& t = *targets[i];
    auto it = std::find_if(st.tensors.begin(), st.tensors.end(), [&](const SafeTensor& s) { return s.name == t.name; });
    if (it == st.tensors.end()) fail(FP8_ERR_INVALID_STATE, "the file has no tensor '", t.name, "'");
    const std::vector<int64_t> shape(t.value->shape, t.value->shape + t.value->ndim);
    if (it->shape != shape)
      fail(FP8_ERR_SHAPE, "tensor '", t.name, "' has shape ", shape_string(static_cast<int32_t>(it->shape.size()),
           it->shape.data()), " in the file, ", shape_string(t.value->ndim, t.value->shape), " in the model");
    ParamState p;
    p.name = t.name;
    p.n = t.value->numel;
    std::vector<float> f(static_cast<size_t>(p.n));
    for (size_t k = 0; k < f.size(); ++k) {
      if (it->dtype == "F32") {
        std::memcpy(&f[k], it->data.data() + 4 * k, 4);
      } else if (it->dtype == "F16" || it->dtype == "BF16") {
        uint16_t h;
        std::memcpy(&h, it->data.data() + 2 * k, 2);
        f[k] = it->dtype == "F16" ? f16_to_float(h) : bf16_to_float(h);
      } else {
        fail(FP8_ERR_UNSUPPORTED, "tensor '", t.name, "' is ", it->dtype, "; libfp8 imports F32, F16 and BF16");
      }
    }
    p.value = floats_bytes(f);
    const OptimTensor* ot = optim_tensor(model.weight_owner, i);
    const int32_t layout = ot ? ot->layout : t.value->dtype == FP8_DTYPE_F32 ? kLayoutF32 : model.weight_level;
    if (layout == kLayoutO3 && !ot)
      fail(FP8_ERR_INVALID_STATE, "'", t.name, "' is stored at O3 but no optimizer holds its master; create one first");
    convert_layout(p, layout);
    if (ot && ot->scales) {  // the optimizer's moment scales stay; the weight's amax is the new one
      CompactScales live{};
      model.backend->copy_to_host(&live, ot->scales, sizeof live);
      live.p_amax = p.scales.p_amax;
      p.scales = live;
    }
    params.push_back(std::move(p));
  }
  Backend& be = *model.backend;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamState& p = params[i];
    nn::Parameter& t = *targets[i];
    upload(be, t.value->data, p.value);
    if (dtype_is_fp8(t.value->dtype)) be.copy_from_host(t.value->scale_inv, &p.value_scale_inv, sizeof(float));
    if (const OptimTensor* ot = optim_tensor(model.weight_owner, i)) {
      if (ot->master) upload(be, ot->master, p.master);
      if (ot->scales) be.copy_from_host(ot->scales, &p.scales, sizeof(CompactScales));
    }
  }
  ++model.weights_version;
  be.synchronize();
}

std::string checkpoint_recipe(const std::string& path) {
  const std::vector<uint8_t> file = read_file(path);
  const std::vector<Section> sections = decode_container(file.data(), file.size());
  const Section* s = find_section(sections, "recipe");
  if (!s) fail(FP8_ERR_INVALID_STATE, "the checkpoint's model was not converted to FP8: it has no recipe");
  return std::string(s->data.begin(), s->data.end());
}

}  // namespace fp8::io
