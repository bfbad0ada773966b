// The sections of a checkpoint: see checkpoint_format.hpp and, for the file, checkpoint.cpp.
#include "io/checkpoint_format.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "backend/backend.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "io/bytes.hpp"

namespace fp8::io {

namespace {

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
std::vector<uint8_t> get_blob(ByteReader& r, const char* what) {
  return r.get_bytes(r.get_u64(what), what);
}

fp8_dtype_t get_dtype(ByteReader& r, const char* what) {
  const uint32_t d = r.get_u32(what);
  if (!dtype_valid(static_cast<fp8_dtype_t>(d))) fail(FP8_ERR_CORRUPT, what, " has dtype code ", d, ", which is none");
  return static_cast<fp8_dtype_t>(d);
}

float amax_of(const std::vector<float>& v) {
  float a = 0.0f;
  for (float f : v) a = std::max(a, std::fabs(f));
  return a;
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

}  // namespace

namespace {
bool positive_finite(float f) { return f > 0.0f && f <= FLT_MAX; }
}  // namespace

bool get_flag(ByteReader& r, const char* what) {
  const uint8_t v = r.get_u8(what);
  if (v > 1) fail(FP8_ERR_CORRUPT, what, " is ", static_cast<int>(v), "; expected 0 or 1");
  return v == 1;
}

// ---- parameters ------------------------------------------------------------------------------------

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
    put_blob(w, p.master);
    w.put_u8(p.has_scales ? 1 : 0);
    if (p.has_scales) put_compact_scales(w, p.scales);
  }
  return out;
}

std::vector<ParamState> decode_params(const std::vector<uint8_t>& data) {
  ByteReader r(data.data(), data.size());
  const uint32_t count = r.get_u32("parameter count");
  constexpr size_t kMinRecord = 4 + 4 + 4 + 8 + 8 + 4 + 1 + 8 + 1;  // an empty name and blobs
  if (count > data.size() / kMinRecord)
    fail(FP8_ERR_CORRUPT, "params: ", count, " parameters cannot fit in ", data.size(), " bytes");
  std::vector<ParamState> out(count);
  for (ParamState& p : out) {
    p.name = r.get_string("parameter name");
    p.layout = static_cast<int32_t>(r.get_u32("parameter layout"));
    if (p.layout < kLayoutF32 || p.layout > kLayoutO3)
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' has layout ", p.layout);
    p.value_dtype = get_dtype(r, "parameter value");
    const fp8_dtype_t stored = p.layout == kLayoutF32  ? FP8_DTYPE_F32
                               : p.layout == kLayoutO3 ? FP8_DTYPE_E4M3
                                                       : FP8_DTYPE_F16;
    if (p.value_dtype != stored)
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' is ", dtype_name(p.value_dtype), " at ", layout_name(p.layout),
           ", which stores ", dtype_name(stored));
    p.n = r.get_i64("parameter size");
    p.value = get_blob(r, "parameter value");
    // (n is bounded by the blob first: n * element could wrap around to the blob's size)
    if (p.n < 0 || static_cast<uint64_t>(p.n) > p.value.size() ||
        p.value.size() != bytes_of(p.n, dtype_size(p.value_dtype)))
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' holds ", p.value.size(), " bytes for ", p.n, " ",
           dtype_name(p.value_dtype), " elements");
    p.value_scale_inv = r.get_f32("parameter scale_inv");
    if (p.layout == kLayoutO3 && !positive_finite(p.value_scale_inv))
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' has scale_inv ", p.value_scale_inv, "; expected a finite value > 0");
    p.has_grad = get_flag(r, "gradient flag");
    if (p.has_grad) {
      p.grad_dtype = get_dtype(r, "gradient");
      if (p.grad_dtype != FP8_DTYPE_F32 && !dtype_is_fp8(p.grad_dtype))
        fail(FP8_ERR_CORRUPT, "gradient of '", p.name, "' is ", dtype_name(p.grad_dtype), "; gradients are f32 or FP8");
      p.grad = get_blob(r, "gradient");
      p.grad_scales = get_grad_scales(r);
      // Between accumulations the in-flight fields are 0; scale_inv and amax are >= 0, or NaN when
      // a non-finite addend poisoned the gradient.
      const GradScales& g = p.grad_scales;
      if (g.add_amax != 0.0f || g.next_amax_code != 0 || !(std::isnan(g.scale_inv) || g.scale_inv >= 0.0f) ||
          !(std::isnan(g.amax) || g.amax >= 0.0f))
        fail(FP8_ERR_CORRUPT, "gradient of '", p.name, "' has scales (", g.scale_inv, ", ", g.amax, ", ", g.add_amax,
             ", ", g.next_amax_code, ") no accumulation leaves");
      if (p.grad.size() != bytes_of(p.n, dtype_size(p.grad_dtype)))
        fail(FP8_ERR_CORRUPT, "gradient of '", p.name, "' holds ", p.grad.size(), " bytes for ", p.n, " elements");
    }
    p.master = get_blob(r, "master");
    if (!p.master.empty() && (p.layout != kLayoutO3 || p.master.size() != bytes_of(p.n, 2)))
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' has ", p.master.size(), " bytes of master at ",
           layout_name(p.layout), " for ", p.n, " elements");
    p.has_scales = get_flag(r, "scales flag");
    if (p.has_scales && p.layout == kLayoutF32)
      fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' has per-tensor scales at te");
    if (p.has_scales) {
      p.scales = get_compact_scales(r);
      const CompactScales& c = p.scales;
      bool ok = c.next_m_code == 0 && c.next_v_code == 0 && c.next_p_code == 0;
      for (float f : {c.m_scale_inv, c.v_scale_inv, c.m_amax, c.v_amax, c.p_amax, c.m_scale, c.v_scale, c.w_scale})
        ok = ok && f >= 0.0f && f <= FLT_MAX;
      if (!ok) fail(FP8_ERR_CORRUPT, "parameter '", p.name, "' has per-tensor scales no step leaves");
    }
  }
  r.expect_done("params");
  return out;
}

// ---- scaling states --------------------------------------------------------------------------------

std::vector<uint8_t> encode_scaling(const std::vector<ScalingRecord>& states) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_u32(static_cast<uint32_t>(states.size()));
  for (const ScalingRecord& s : states) {
    w.put_string(s.layer);
    w.put_u32(static_cast<uint32_t>(s.history_len));
    w.put_u32(static_cast<uint32_t>(s.dtype));
    w.put_u8(s.pending ? 1 : 0);
    w.put_f32(s.header.scale);
    w.put_f32(s.header.scale_inv);
    w.put_u64(s.header.nonfinite_count);
    w.put_u64(s.header.update_count);
    for (float f : s.history) w.put_f32(f);
  }
  return out;
}

std::vector<ScalingRecord> decode_scaling(const std::vector<uint8_t>& data) {
  ByteReader r(data.data(), data.size());
  const uint32_t count = r.get_u32("scaling state count");
  constexpr size_t kMinRecord = 4 + 4 + 4 + 1 + 4 + 4 + 8 + 8 + 4;  // an empty name, one history slot
  if (count > data.size() / kMinRecord)
    fail(FP8_ERR_CORRUPT, "scaling: ", count, " states cannot fit in ", data.size(), " bytes");
  std::vector<ScalingRecord> out(count);
  for (ScalingRecord& s : out) {
    s.layer = r.get_string("scaling state layer");
    s.history_len = static_cast<int32_t>(r.get_u32("amax history length"));
    s.dtype = get_dtype(r, "scaling state");
    if (s.history_len < 1 || static_cast<size_t>(s.history_len) > r.remaining() / sizeof(float) ||
        !dtype_is_fp8(s.dtype))
      fail(FP8_ERR_CORRUPT, "scaling state of layer '", s.layer, "' has history length ", s.history_len, " and dtype ",
           dtype_name(s.dtype));
    s.pending = get_flag(r, "pending flag");
    s.header.scale = r.get_f32("scale");
    s.header.scale_inv = r.get_f32("scale_inv");
    if (!positive_finite(s.header.scale) || !positive_finite(s.header.scale_inv))
      fail(FP8_ERR_CORRUPT, "scaling state of layer '", s.layer, "' has scale ", s.header.scale, " and scale_inv ",
           s.header.scale_inv, "; expected finite values > 0");
    s.header.nonfinite_count = r.get_u64("nonfinite count");
    s.header.update_count = r.get_u64("update count");
    s.history.resize(static_cast<size_t>(s.history_len));
    for (float& f : s.history) f = r.get_f32("amax history");
  }
  r.expect_done("scaling");
  return out;
}

// ---- optimizer ----------------------------------------------------------------------------------------

namespace {

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

}  // namespace

std::vector<uint8_t> encode_optimizer(const OptimRecord& o, const std::vector<ParamState>& params) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_u32(static_cast<uint32_t>(o.kind));
  w.put_u32(static_cast<uint32_t>(o.level));
  for (double a : o.attrs) w.put_f64(a);
  put_scalars(w, o.scalars);
  w.put_u32(static_cast<uint32_t>(params.size()));
  for (const ParamState& p : params) {
    put_blob(w, p.m);
    put_blob(w, p.v);
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
    const bool moments = rec.kind != FP8_OPTIMIZER_SGD;
    const bool m_ok = p.m.empty() || p.m.size() == bytes_of(p.n, m_size(p.layout));
    const bool v_ok =
        moments ? p.v.size() == bytes_of(p.n, v_size(p.layout)) || (p.v.empty() && p.m.empty()) : p.v.empty();
    if (!m_ok || !v_ok)
      fail(FP8_ERR_CORRUPT, "optimizer state of '", p.name, "' has ", p.m.size(), "/", p.v.size(), " bytes of m/v for ",
           p.n, " elements at ", layout_name(p.layout));
  }
  r.expect_done("optimizer");
  return rec;
}

// ---- weight copies -----------------------------------------------------------------------------------

std::vector<uint8_t> encode_weight_copies(const WeightCopies& copies) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_u32(static_cast<uint32_t>(copies.size()));
  for (const auto& [layer, scale] : copies) {
    w.put_u32(layer);
    w.put_f32(scale);
  }
  return out;
}

WeightCopies decode_weight_copies(const std::vector<uint8_t>& data) {
  ByteReader r(data.data(), data.size());
  const uint32_t count = r.get_u32("weight copy count");
  if (count > data.size() / 8) fail(FP8_ERR_CORRUPT, "weight_copies: ", count, " entries in ", data.size(), " bytes");
  WeightCopies out;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t layer = r.get_u32("weight copy layer");
    const float scale = r.get_f32("weight copy scale");
    if (!(scale > 0.0f && scale <= FLT_MAX) || (!out.empty() && layer <= out.back().first))
      fail(FP8_ERR_CORRUPT, "weight copy of layer ", layer, " has scale ", scale, " or is out of order");
    out.emplace_back(layer, scale);
  }
  r.expect_done("weight_copies");
  return out;
}

// ---- conversion between layouts ----------------------------------------------------------------------

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

std::vector<uint8_t> floats_bytes(const std::vector<float>& f) {
  std::vector<uint8_t> out(f.size() * 4);
  if (!f.empty()) std::memcpy(out.data(), f.data(), out.size());
  return out;
}

float stored_weight_amax(const ParamState& p) {
  const std::vector<uint8_t>& f16 = p.master.empty() ? p.value : p.master;
  uint32_t top = 0;
  for (size_t k = 0; k + 1 < f16.size(); k += 2) top = std::max<uint32_t>(top, (f16[k] | (f16[k + 1] << 8)) & 0x7FFFu);
  return f16_to_float(static_cast<uint16_t>(top));
}

// Re-encodes a parameter saved at `p.layout` into `layout` (weights, m, v, master, scales): exact
// widening towards te, rounding (and fresh per-tensor scales from the values' amax) towards O1..O3.
void convert_layout(ParamState& p, int32_t layout) {
  if (p.layout == layout && !(layout == kLayoutO3 && p.master.empty())) return;  // (O3 needs its master)
  p.has_scales = layout != kLayoutF32;
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
    if (p.grad_dtype == FP8_DTYPE_F32)
      std::memcpy(&g[k], p.grad.data() + 4 * k, 4);
    else
      g[k] = dequantize_fp8(p.grad[k], p.grad_dtype == FP8_DTYPE_E5M2, p.grad_scales.scale_inv);
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

}  // namespace fp8::io
