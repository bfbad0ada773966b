// The activations and their derivatives, one definition for the CPU reference and the kernels.
// Float arithmetic with the standard expf; the two backends agree to the last bit or two of
// those functions (the GPU suite compares them with a tolerance, not bit for bit).
#pragma once

#include <cmath>

#include "core/format.hpp"
#include "fp8.h"

namespace fp8 {

FP8_HD float act_exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
FP8_HD float act_sigmoid(float x) { return 1.0f / (1.0f + act_exp(-x)); }

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluK = 0.044715f;

// ReLU keeps NaN (NaN < 0 is false) and -0.
FP8_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }
FP8_HD float relu_grad(float x, float dy) { return x > 0.0f ? dy : 0.0f; }

// GELU, tanh approximation (TransformerEngine's, torch's gelu(approximate="tanh")):
// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as x * sigmoid(2u) =
// x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh u) = sigmoid(2u)). That form has no
// cancellation for negative x, and on the GPU it costs one exponential and one division where
// tanhf's two paths cost both and more (the casts that fold GELU in spend much of their time here).
FP8_HD float gelu_u(float x) { return kGeluC * x * (1.0f + kGeluK * x * x); }
FP8_HD float gelu(float x) { return x / (1.0f + act_exp(-2.0f * gelu_u(x))); }
FP8_HD float gelu_grad(float x, float dy) {
  // Far out the derivative is 1 or 0; below about -10.08, exp(-2u) overflows (and inf * 0 is NaN).
  if (x > 10.0f) return dy;
  if (x < -10.0f) return 0.0f;
  const float e = act_exp(-2.0f * gelu_u(x));
  const float s = 1.0f / (1.0f + e);  // sigmoid(2u); 1 - s = e s
  const float du = kGeluC * (1.0f + 3.0f * kGeluK * x * x);
  // d/dx [x s] = s + x s' = s + 2 x s (1 - s) du
  return dy * (s * (1.0f + 2.0f * x * du * e * s));
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
