// The optimizer's numerics (documented in fp8.h, "Optimizer"), shared by the CPU reference and the
// CUDA kernels so that both give the same bits:
//  - the squared gradient norm is summed in double (each g*g is exact in double) in one fixed order:
//    per chunk of kOptimChunk elements, then over the chunks' partials, each time with
//    ordered_sum_order's pattern, which a 256-thread block follows on the GPU;
//  - the per-step scalars (clip factor, bias corrections, skip flag) come from finish_step;
//  - each element is updated by sgd_update / adam_update with explicitly rounded float operations
//    (no contraction into FMAs the other side would not make);
//  - at the MS-AMP levels (OptimLayout) update_element decodes the stored value, FP8 gradient and
//    moments, runs the same rule and encodes them back; the per-tensor scales of the writes come
//    from finish_compact before the pass and become the stored ones in promote_compact after it, and
//    FP8 gradients accumulate through grad_sum_*. The GPU decodes with the conversion instructions
//    and encodes with the hardware FP8 cast, both equal to format.hpp's functions.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/format.hpp"
#include "fp8.h"

#ifdef __CUDACC__
#include <cuda_fp8.h>
#endif

namespace fp8 {

constexpr int kSumThreads = 256;        // threads of a summing block; also the CPU's lanes
constexpr int64_t kOptimChunk = 4096;   // elements per chunk (16 per thread)

// How one tensor's training state is stored: the opt level's layout for it. Linear weights take
// their level's layout; biases and norm parameters stay FP32 at every level (as in MS-AMP).
enum OptimLayout : int32_t {
  kLayoutF32 = 0,  // F32 value, F32 gradient, F32 m/v                       (te)
  kLayoutO1 = 1,   // F16 value, FP8 gradient, F32 m/v
  kLayoutO2 = 2,   // F16 value, FP8 gradient, E4M3 m, scaled F16 v
  kLayoutO3 = 3,   // E4M3 value + F16 master, FP8 gradient, E4M3 m, scaled F16 v
};
inline const char* layout_name(int32_t layout) {
  return layout == kLayoutO1 ? "O1" : layout == kLayoutO2 ? "O2" : layout == kLayoutO3 ? "O3" : "te";
}

// An FP8 gradient's scales, in device memory next to its codes (core/grad_rule.hpp has the rule):
// the stored codes decode as code * scale_inv, and amax is the largest |decoded| value. All zero
// means "nothing accumulated yet".
struct GradScales {
  float scale_inv;
  float amax;
  float add_amax;           // amax of the addend of the accumulation in flight
  uint32_t next_amax_code;  // max |code| written by that accumulation
};

// The per-tensor scales of a compact (O1..O3) tensor's states, in device memory. A step computes
// the scales of its writes (m_scale, v_scale, w_scale) in finish_compact from bounds on the new
// values, so one pass can write them; promote_compact then makes them the stored ones and turns
// the max codes written into the amaxes the next bounds start from.
struct CompactScales {
  float m_scale_inv, v_scale_inv;  // of the stored m (E4M3) and v (F16)
  float m_amax, v_amax, p_amax;    // largest stored |m|, |v|, |value or master|
  float m_scale, v_scale, w_scale; // this step's writes
  uint32_t next_m_code, next_v_code, next_p_code;  // max |code| written this step
  uint32_t reserved;
};

// One parameter: its value, gradient and states in its layout's types (nullptr where it has none).
struct OptimTensor {
  void* param;          // F32, F16 (O1/O2) or E4M3 codes (O3)
  const void* grad;     // F32, or FP8 codes with grad_scales
  void* m;              // F32 (SGD momentum, Adam's m; te and O1) or E4M3 codes (O2/O3)
  void* v;              // F32 (te, O1) or F16 codes (O2/O3)
  uint16_t* master;     // O3: F16 master weights
  GradScales* grad_scales;    // FP8 gradients
  CompactScales* scales;      // O1..O3
  float* w_scale_inv;         // O3: the E4M3 value's scale_inv
  int64_t n;
  int32_t layout;
  int32_t grad_e5m2;
};

// A slice of one tensor's elements [offset, offset + len), len <= kOptimChunk.
struct OptimChunk {
  int32_t tensor;
  int32_t len;
  int64_t offset;
};

// Hyper-parameters of one step, as the user set them.
struct OptimHyper {
  fp8_optimizer_kind_t kind;
  double lr, beta1, beta2, eps, weight_decay, momentum, max_grad_norm;
};

// Per-step scalars, in device memory; the counters persist across steps.
struct OptimScalars {
  double sumsq;        // sum of g^2 over every gradient
  float grad_norm;     // sqrt(sumsq) as float
  float clip;          // factor applied to g
  float step_size;     // SGD: lr; Adam: lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // Adam: 1 / sqrt(1 - beta2^t)
  int32_t skip;        // 1: a gradient was not finite; nothing is updated
  int32_t reserved;
  uint64_t steps;      // t: steps applied
  uint64_t skipped;    // steps skipped
};

// Explicitly rounded float operations: the CUDA intrinsics are never fused by the compiler, and the
// host build keeps -ffp-contract=off for the same reason.
#ifdef __CUDACC__
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#define FP8_OPTIM_FN __device__ __forceinline__
__device__ __forceinline__ uint8_t encode_e4m3(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);  // = encode_fp8 (gpu_encoder_exhaustive)
}
__device__ __forceinline__ uint8_t encode_fp8_rn(float x, bool e5m2) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}
// Exact widenings by the conversion instructions (FP8 -> f16 -> f32, f16 -> f32): the same values as
// format.hpp's decoders, in one or two instructions instead of a dozen.
__device__ __forceinline__ float decode_f16(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float dequantize_rn(uint8_t c, bool e5m2, float scale_inv) {
  const __half h = __nv_cvt_fp8_to_halfraw(c, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __fmul_rn(__half2float(h), scale_inv);  // a NaN comes out canonical, as dequantize_fp8's
}
#define FP8_OPTIM_FN __device__ __forceinline__
#else
inline float add_rn(float a, float b) { return a + b; }
inline float mul_rn(float a, float b) { return a * b; }
inline float div_rn(float a, float b) { return a / b; }
inline float sqrt_rn(float a) { return std::sqrt(a); }
inline float fma_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline uint8_t encode_e4m3(float x) { return encode_fp8(x, false); }
inline uint8_t encode_fp8_rn(float x, bool e5m2) { return encode_fp8(x, e5m2); }
inline float decode_f16(uint16_t h) { return f16_to_float(h); }
inline float dequantize_rn(uint8_t c, bool e5m2, float scale_inv) { return dequantize_fp8(c, e5m2, scale_inv); }
#define FP8_OPTIM_FN inline
#endif

// Double operations both sides round alike: nvcc would otherwise contract a*b+c into an FMA.
FP8_HD double dmul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FP8_HD double dadd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// base^e by squaring, in double: the same multiplications on both sides (pow() is not bit-exact).
FP8_HD double pow_uint(double base, uint64_t e) {
  double r = 1.0;
  for (; e; e >>= 1, base *= base)
    if (e & 1) r *= base;
  return r;
}

// The clip factor of a gradient norm (torch's clip_grad_norm_): min(1, max_grad_norm / (norm + 1e-6)),
// 1 without clipping; 0 for an infinite norm, NaN for a NaN one.
FP8_HD double clip_factor(double norm, const OptimHyper& h) {
  if (!(h.max_grad_norm > 0.0)) return 1.0;
  const double clip = h.max_grad_norm / (norm + 1e-6);
  return clip > 1.0 ? 1.0 : clip;
}

// Step scalars from the squared norm: the skip on a non-finite gradient, the clip factor and the
// bias corrections for t = steps + 1. Runs on one GPU thread or on the host. (finish_joint_step
// below is what a step calls.)
FP8_HD void finish_step(OptimScalars& s, double sumsq, const OptimHyper& h) {
  s.sumsq = sumsq;
  const double norm = sqrt(sumsq);
  s.grad_norm = static_cast<float>(norm);
  if (!(sumsq - sumsq == 0.0)) {  // inf or NaN (finite values give exactly 0)
    s.skip = 1;
    ++s.skipped;
    return;
  }
  s.skip = 0;
  const uint64_t t = ++s.steps;
  s.clip = static_cast<float>(clip_factor(norm, h));
  if (h.kind == FP8_OPTIMIZER_SGD) {
    s.step_size = static_cast<float>(h.lr);
    s.inv_bc2_sqrt = 1.0f;
  } else {
    s.step_size = static_cast<float>(h.lr / (1.0 - pow_uint(h.beta1, t)));
    s.inv_bc2_sqrt = static_cast<float>(1.0 / sqrt(1.0 - pow_uint(h.beta2, t)));
  }
}

// finish_step over the model's squared norm plus, for fp8_optimizer_step_joint, `other` (the
// squared norm of gradients outside the model, added last; nullptr: none; a negative one counts as
// NaN: no sum of squares is negative); the clip factor of that joint norm goes to *clip_out (when
// set) for the caller's own gradients, also when the model's step is skipped (0 for an infinite
// norm, NaN for a NaN one, as clip_grad_norm_ gives them).
FP8_HD void finish_joint_step(OptimScalars& s, double sumsq, const float* other, float* clip_out, const OptimHyper& h) {
  if (other) sumsq = *other >= 0.0f ? sumsq + static_cast<double>(*other) : static_cast<double>(nanf(""));
  finish_step(s, sumsq, h);
  if (clip_out) *clip_out = static_cast<float>(clip_factor(sqrt(sumsq), h));
}

// The per-element constants of a step, rounded to float once per step.
struct OptimElementArgs {
  float weight_decay;  // SGD/Adam: L2 added to g
  float decay;         // AdamW: 1 - lr * wd (1 otherwise)
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float momentum;      // SGD
  fp8_optimizer_kind_t kind;
};

// Computed once per step where the step runs (one GPU thread, or the host), from the hyper-parameters
// in device memory, so a captured step replays with the values set since.
FP8_HD OptimElementArgs element_args(const OptimHyper& h) {
  OptimElementArgs a{};
  a.kind = h.kind;
  const bool adamw = h.kind == FP8_OPTIMIZER_ADAMW;
  a.weight_decay = adamw ? 0.0f : static_cast<float>(h.weight_decay);
  a.decay = adamw ? static_cast<float>(dadd(1.0, -dmul(h.lr, h.weight_decay))) : 1.0f;
  a.beta1 = static_cast<float>(h.beta1);
  a.one_minus_beta1 = static_cast<float>(dadd(1.0, -h.beta1));
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(dadd(1.0, -h.beta2));
  a.eps = static_cast<float>(h.eps);
  a.momentum = static_cast<float>(h.momentum);
  return a;
}

// SGD: g' = g*clip + wd*p; b = momentum*b + g' (when momentum > 0); p -= lr*b.
FP8_OPTIM_FN void sgd_update(float& p, float g, float* b, const OptimElementArgs& a, const OptimScalars& s) {
  g = fma_rn(a.weight_decay, p, mul_rn(g, s.clip));
  if (b) g = *b = fma_rn(a.momentum, *b, g);
  p = fma_rn(-s.step_size, g, p);
}

// Adam / AdamW (see fp8.h for the formula).
FP8_OPTIM_FN void adam_update(float& p, float g, float& m, float& v, const OptimElementArgs& a, const OptimScalars& s) {
  g = mul_rn(g, s.clip);
  p = mul_rn(p, a.decay);                // AdamW's decoupled decay (x1 for Adam)
  g = fma_rn(a.weight_decay, p, g);      // Adam's L2 term (0 for AdamW)
  m = fma_rn(a.beta1, m, mul_rn(a.one_minus_beta1, g));
  v = fma_rn(a.beta2, v, mul_rn(a.one_minus_beta2, mul_rn(g, g)));
  const float denom = fma_rn(sqrt_rn(v), s.inv_bc2_sqrt, a.eps);
  p = fma_rn(-s.step_size, div_rn(m, denom), p);
}

// ---- FP8 gradients (O1..O3) --------------------------------------------------------------------
// A gradient accumulates micro-batch after micro-batch in FP8: each addition requantises the sum in
// one pass with scale = fp8_max / (amax + add_amax), a bound on |stored + addend| known before the
// pass, and records the largest code it writes. A non-finite addend poisons the gradient (scale and
// scale_inv NaN, so every decoded value is NaN and the optimizer skips the step) until it is zeroed.
// The scale that maps a bound on a gradient's |values| to fp8_max: 1 for a zero bound, FLT_MAX at
// most, NaN for a non-finite bound (the gradient stays poisoned, so the step is skipped; every rank
// alike where the bound is agreed). The accumulation's bound and the exchange's both end here.
FP8_HD float fp8_scale_for_bound(float bound, bool e5m2) {
  if (!(bound - bound == 0.0f)) return bits_float(0x7FFFFFFFu);
  if (!(bound > 0.0f)) return 1.0f;
  const float s = fp8_spec(e5m2).max_value / bound;
  return s > FLT_MAX ? FLT_MAX : s;
}

FP8_HD float grad_sum_scale(const GradScales& g, bool e5m2) {
  return fp8_scale_for_bound(g.amax + g.add_amax, e5m2);
}

FP8_OPTIM_FN uint8_t grad_sum_code(uint8_t stored, float add, float stored_scale_inv, float scale, bool e5m2) {
  return encode_fp8_rn(mul_rn(add_rn(dequantize_rn(stored, e5m2, stored_scale_inv), add), scale), e5m2);
}

// A gradient whose amax is 0 holds only zeros (as zero_grad leaves it): the sum is the addend itself
// (a zero addend keeps its sign), and the pass does not read the stored codes.
FP8_HD bool grad_sum_onto_zeros(const GradScales& g) {
  return g.amax == 0.0f;
}
FP8_OPTIM_FN uint8_t grad_sum_first_code(float add, float scale, bool e5m2) {
  return encode_fp8_rn(mul_rn(add, scale), e5m2);
}

// After the pass: the new scale_inv and amax (from the largest code written); ready for the next.
FP8_HD void grad_sum_finish(GradScales& g, bool e5m2) {
  const float scale = grad_sum_scale(g, e5m2);
  g.scale_inv = 1.0f / scale;
  g.amax = decode_fp8(static_cast<uint8_t>(g.next_amax_code), e5m2) * g.scale_inv;
  g.add_amax = 0.0f;
  g.next_amax_code = 0;
}

// ---- compact states (O2/O3) ---------------------------------------------------------------------
// The scale that maps `bound` to `max` (1 when there is nothing to scale).
FP8_HD float bound_scale(double max, double bound) {
  if (!(bound > 0.0) || !(bound < HUGE_VAL)) return 1.0f;
  const double s = max / bound;
  return s > FLT_MAX ? FLT_MAX : static_cast<float>(s);
}

constexpr double kF16Max = 65504.0;

// Before the update pass of a step that is applied: the scales of this step's writes, from bounds
// on the new values (|g'| <= amax(g) clip + wd_L2 amax(p); m' = b1 m + (1-b1) g'; v' = b2 v +
// (1-b2) g'^2), so nothing saturates beyond rounding. O3's FP8 weight takes the master's amax of the
// previous step (delayed, as TransformerEngine scales weights): a weight that grew past it this step
// saturates there until the next step; its F16 master never does.
FP8_HD void finish_compact(CompactScales& c, const GradScales& g, const OptimScalars& s, const OptimHyper& h,
                           int32_t layout) {
  if (s.skip || layout < kLayoutO2) return;
  const bool adamw = h.kind == FP8_OPTIMIZER_ADAMW;
  const double l2 = adamw ? 0.0 : static_cast<double>(static_cast<float>(h.weight_decay));
  const double gp = dadd(dmul(g.amax, s.clip), dmul(l2, c.p_amax));
  const double b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
  const double bm = dadd(dmul(b1, c.m_amax), dmul(static_cast<float>(1.0 - h.beta1), gp));
  const double bv = dadd(dmul(b2, c.v_amax), dmul(static_cast<float>(1.0 - h.beta2), dmul(gp, gp)));
  c.m_scale = bound_scale(448.0, bm);
  c.v_scale = bound_scale(kF16Max, bv);
  c.w_scale = bound_scale(448.0, c.p_amax);
}

// After the update pass: this step's write scales become the stored ones, and the largest codes
// written become the amaxes the next bounds start from.
FP8_HD void promote_compact(CompactScales& c, float* w_scale_inv, const OptimScalars& s, int32_t layout) {
  if (s.skip || layout == kLayoutF32) return;
  if (layout >= kLayoutO2) {
    c.m_scale_inv = 1.0f / c.m_scale;
    c.v_scale_inv = 1.0f / c.v_scale;
    c.m_amax = decode_fp8(static_cast<uint8_t>(c.next_m_code), false) * c.m_scale_inv;
    c.v_amax = f16_to_float(static_cast<uint16_t>(c.next_v_code)) * c.v_scale_inv;
  }
  if (layout == kLayoutO3) *w_scale_inv = 1.0f / c.w_scale;
  c.p_amax = f16_to_float(static_cast<uint16_t>(c.next_p_code));
  c.next_m_code = c.next_v_code = c.next_p_code = 0;
}

// float -> F16 code, round to nearest even (the hardware conversion on the GPU; NaN -> 0x7FFF).
FP8_OPTIM_FN uint16_t to_f16(float x) {
#ifdef __CUDA_ARCH__
  if ((float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return __half_as_ushort(__float2half_rn(x));
#else
  return float_to_f16(x);
#endif
}

// The largest codes one thread wrote (|code| orders like |value| for finite FP8 and F16 codes).
struct CompactMax {
  uint32_t m = 0, v = 0, p = 0;
};

// The gradient element the optimizer sees (FP8 decoded with its scale_inv, or FP32).
FP8_OPTIM_FN float grad_at(const OptimTensor& t, int64_t i, float grad_scale_inv) {
  if (t.layout == kLayoutF32) return static_cast<const float*>(t.grad)[i];
  return dequantize_rn(static_cast<const uint8_t*>(t.grad)[i], t.grad_e5m2 != 0, grad_scale_inv);
}

// One element of any layout: decode value, gradient and states, apply the kind's rule, encode back.
// SGD uses its momentum buffer where it has one (with momentum 0 that gives the same p as none).
FP8_OPTIM_FN void update_element(const OptimTensor& t, int64_t i, float grad_scale_inv, const CompactScales& c,
                                 const OptimElementArgs& a, const OptimScalars& s, CompactMax& mx) {
  const float g = grad_at(t, i, grad_scale_inv);
  if (t.layout == kLayoutF32) {
    float* p = static_cast<float*>(t.param) + i;
    if (a.kind == FP8_OPTIMIZER_SGD) sgd_update(*p, g, t.m ? static_cast<float*>(t.m) + i : nullptr, a, s);
    else adam_update(*p, g, static_cast<float*>(t.m)[i], static_cast<float*>(t.v)[i], a, s);
    return;
  }
  uint16_t* p16 = t.layout == kLayoutO3 ? t.master : static_cast<uint16_t*>(t.param);
  float p = decode_f16(p16[i]);
  if (a.kind == FP8_OPTIMIZER_SGD) {
    sgd_update(p, g, t.m ? static_cast<float*>(t.m) + i : nullptr, a, s);
  } else if (t.layout == kLayoutO1) {
    adam_update(p, g, static_cast<float*>(t.m)[i], static_cast<float*>(t.v)[i], a, s);
  } else {
    uint8_t* m8 = static_cast<uint8_t*>(t.m);
    uint16_t* v16 = static_cast<uint16_t*>(t.v);
    float m = dequantize_rn(m8[i], false, c.m_scale_inv);
    float v = mul_rn(decode_f16(v16[i]), c.v_scale_inv);
    adam_update(p, g, m, v, a, s);
    const uint8_t mq = encode_e4m3(mul_rn(m, c.m_scale));
    const uint16_t vq = to_f16(mul_rn(v, c.v_scale));
    m8[i] = mq;
    v16[i] = vq;
    mx.m = mx.m > (mq & 0x7Fu) ? mx.m : (mq & 0x7Fu);
    mx.v = mx.v > (vq & 0x7FFFu) ? mx.v : (vq & 0x7FFFu);
  }
  const uint16_t pq = to_f16(p);
  p16[i] = pq;
  mx.p = mx.p > (pq & 0x7FFFu) ? mx.p : (pq & 0x7FFFu);
  if (t.layout == kLayoutO3) static_cast<uint8_t*>(t.param)[i] = encode_e4m3(mul_rn(decode_f16(pq), c.w_scale));
}

#ifndef __CUDACC__
// The fixed order in which both backends sum n values in double: lane t of kSumThreads adds
// values t, t + kSumThreads, ... in turn, then the lanes are combined pairwise, s[t] += s[t + h] for
// h = kSumThreads/2, ..., 1. Each summing block on the GPU does exactly this.
template <class Value>
double ordered_sum(Value value, int64_t n) {
  double s[kSumThreads];
  for (int t = 0; t < kSumThreads; ++t) {
    double acc = 0.0;
    for (int64_t i = t; i < n; i += kSumThreads) acc += value(i);
    s[t] = acc;
  }
  for (int h = kSumThreads / 2; h > 0; h /= 2)
    for (int t = 0; t < h; ++t) s[t] += s[t + h];
  return s[0];
}
#endif

}  // namespace fp8
