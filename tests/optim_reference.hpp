// The optimizer's documented order and rounding (core/optim_rule.hpp), written again for the tests
// that pin the library to it bit for bit: explicitly rounded float and double operations, and the
// fixed summation order of the gradient norm.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fp8test::rule {

// volatile: no contraction into an FMA the rule does not make.
inline float mul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline double dmul(double a, double b) {
  volatile double r = a * b;
  return r;
}
inline double dadd(double a, double b) {
  volatile double r = a + b;
  return r;
}
inline double pow_by_squaring(double base, uint64_t e) {
  double r = 1.0;
  for (; e; e >>= 1, base = dmul(base, base))
    if (e & 1) r = dmul(r, base);
  return r;
}

constexpr int kLanes = 256;
constexpr size_t kChunk = 4096;

// The fixed summation order: lane t adds values t, t + 256, ... in turn; then the lanes are
// combined pairwise, s[t] += s[t + h] for h = 128, 64, ..., 1.
inline double lane_sum(const std::vector<double>& values) {
  double s[kLanes];
  for (int t = 0; t < kLanes; ++t) {
    double acc = 0.0;
    for (size_t i = static_cast<size_t>(t); i < values.size(); i += kLanes) acc += values[i];
    s[t] = acc;
  }
  for (int h = kLanes / 2; h > 0; h /= 2)
    for (int t = 0; t < h; ++t) s[t] += s[t + h];
  return s[0];
}
// Per chunk of 4096 elements of each tensor in parameter order, then over the chunks' partials.
inline double rule_sumsq(const std::vector<std::vector<float>>& g) {
  std::vector<double> partials;
  for (const auto& t : g)
    for (size_t off = 0; off < t.size(); off += kChunk) {
      std::vector<double> sq;
      for (size_t i = off; i < std::min(t.size(), off + kChunk); ++i)
        sq.push_back(static_cast<double>(t[i]) * static_cast<double>(t[i]));  // exact in double
      partials.push_back(lane_sum(sq));
    }
  return lane_sum(partials);
}

}  // namespace fp8test::rule
