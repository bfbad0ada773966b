// The optimizer's numerics (documented in fp8.h, "Optimizer"), shared by the CPU reference and the
// CUDA kernels so that both give the same bits:
//  - the squared gradient norm is summed in double (each g*g is exact in double) in one fixed order:
//    per chunk of kOptimChunk elements, then over the chunks' partials, each time with
//    ordered_sum_order's pattern, which a 256-thread block follows on the GPU;
//  - the per-step scalars (clip factor, bias corrections, skip flag) come from finish_step;
//  - each element is updated by sgd_update / adam_update with explicitly rounded float operations
//    (no contraction into FMAs the other side would not make).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/format.hpp"
#include "fp8.h"

namespace fp8 {

constexpr int kSumThreads = 256;        // threads of a summing block; also the CPU's lanes
constexpr int64_t kOptimChunk = 4096;   // elements per chunk (16 per thread)

// One parameter: FP32 value and gradient, and its states (m: SGD momentum or Adam's first moment,
// v: Adam's second moment; nullptr where the kind has none).
struct OptimTensor {
  float* param;
  const float* grad;
  float* m;
  float* v;
  int64_t n;
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
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#define FP8_OPTIM_FN __device__ __forceinline__
#else
inline float mul_rn(float a, float b) { return a * b; }
inline float div_rn(float a, float b) { return a / b; }
inline float sqrt_rn(float a) { return std::sqrt(a); }
inline float fma_rn(float a, float b, float c) { return std::fma(a, b, c); }
#define FP8_OPTIM_FN inline
#endif

// base^e by squaring, in double: the same multiplications on both sides (pow() is not bit-exact).
FP8_HD double pow_uint(double base, uint64_t e) {
  double r = 1.0;
  for (; e; e >>= 1, base *= base)
    if (e & 1) r *= base;
  return r;
}

// Step scalars from the squared norm: the skip on a non-finite gradient, the clip factor and the
// bias corrections for t = steps + 1. Runs on one GPU thread or on the host.
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
  double clip = 1.0;
  if (h.max_grad_norm > 0.0) {
    clip = h.max_grad_norm / (norm + 1e-6);
    if (clip > 1.0) clip = 1.0;
  }
  s.clip = static_cast<float>(clip);
  if (h.kind == FP8_OPTIMIZER_SGD) {
    s.step_size = static_cast<float>(h.lr);
    s.inv_bc2_sqrt = 1.0f;
  } else {
    s.step_size = static_cast<float>(h.lr / (1.0 - pow_uint(h.beta1, t)));
    s.inv_bc2_sqrt = static_cast<float>(1.0 / sqrt(1.0 - pow_uint(h.beta2, t)));
  }
}

// The per-element constants of a step, rounded to float once on the host.
struct OptimElementArgs {
  float weight_decay;  // SGD/Adam: L2 added to g
  float decay;         // AdamW: 1 - lr * wd (1 otherwise)
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float momentum;      // SGD
  fp8_optimizer_kind_t kind;
};

inline OptimElementArgs element_args(const OptimHyper& h) {
  OptimElementArgs a{};
  a.kind = h.kind;
  const bool adamw = h.kind == FP8_OPTIMIZER_ADAMW;
  a.weight_decay = adamw ? 0.0f : static_cast<float>(h.weight_decay);
  a.decay = adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  a.beta1 = static_cast<float>(h.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
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
