// The activations and their derivatives, one definition for the CPU reference and the kernels.
// Float arithmetic with the standard tanhf/expf; the two backends agree to the last bit or two of
// those functions (the GPU suite compares them with a tolerance, not bit for bit).
#pragma once

#include <cmath>

#include "core/format.hpp"
#include "fp8.h"

namespace fp8 {

FP8_HD float act_tanh(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}
FP8_HD float act_sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return 1.0f / (1.0f + expf(-x));
#else
  return 1.0f / (1.0f + std::exp(-x));
#endif
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluK = 0.044715f;

// ReLU keeps NaN (NaN < 0 is false) and -0.
FP8_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }
FP8_HD float relu_grad(float x, float dy) { return x > 0.0f ? dy : 0.0f; }

// GELU, tanh approximation (TransformerEngine's, torch's gelu(approximate="tanh")).
FP8_HD float gelu(float x) { return 0.5f * x * (1.0f + act_tanh(kGeluC * (x + kGeluK * x * x * x))); }
FP8_HD float gelu_grad(float x, float dy) {
  const float t = act_tanh(kGeluC * (x + kGeluK * x * x * x));
  const float du = kGeluC * (1.0f + 3.0f * kGeluK * x * x);
  const float g = dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
  // Far out the derivative is 1 or 0; the formula computes 0 * inf there (|x| > ~5e19). Selected
  // after the fact rather than branched around: the casts that fold this run it on every value,
  // and a branch per value cost more than the formula's few extra instructions.
  return x > 10.0f ? dy : x < -10.0f ? 0.0f : g;
}

// An elementwise activation (ReLU or GELU; anything else is GELU) and its gradient, for the casts
// that fold them in (QuantizeJob::act_forward, act_x).
FP8_HD float act_value(fp8_activation_t act, float x) {
  return act == FP8_ACTIVATION_RELU ? relu(x) : gelu(x);
}
FP8_HD float act_grad(fp8_activation_t act, float x, float dy) {
  return act == FP8_ACTIVATION_RELU ? relu_grad(x, dy) : gelu_grad(x, dy);
}

// SwiGLU on a pair (a from the first half of the row, b from the second): silu(a) * b.
FP8_HD float swiglu(float a, float b) { return a * act_sigmoid(a) * b; }
FP8_HD float swiglu_grad_a(float a, float b, float dy) {
  const float s = act_sigmoid(a);
  return dy * b * s * (1.0f + a * (1.0f - s));
}
FP8_HD float swiglu_grad_b(float a, float dy) { return dy * a * act_sigmoid(a); }

}  // namespace fp8
