// A small classification task for end-to-end training tests: Gaussian clusters around random
// means, and the softmax cross-entropy (loss and gradient) computed on the host in float64.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "fp8_test_util.hpp"

namespace fp8test::clusters {

constexpr int kClasses = 16, kFeatures = 32;

struct Clusters {
  std::vector<float> means = fp8test::randn(kClasses * kFeatures, 2024, 1.0f);
  void sample(size_t n, uint32_t seed, std::vector<float>& x, std::vector<int>& label) const {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> cls(0, kClasses - 1);
    x.resize(n * kFeatures);
    label.resize(n);
    for (size_t i = 0; i < n; ++i) {
      label[i] = cls(rng);
      for (int f = 0; f < kFeatures; ++f)
        x[i * kFeatures + f] = means[static_cast<size_t>(label[i] * kFeatures + f)] + normal(rng);
    }
  }
};

// Softmax cross-entropy of logits [n, kClasses] in float64: the mean loss, dlogits = (p - onehot)/n,
// and the number of correct argmaxes.
inline double cross_entropy(const std::vector<float>& logits, const std::vector<int>& label,
                            std::vector<float>* dlogits, int* correct) {
  const size_t n = label.size();
  double loss = 0.0;
  int right = 0;
  if (dlogits) dlogits->assign(n * kClasses, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    const float* z = &logits[i * kClasses];
    const double zmax = *std::max_element(z, z + kClasses);
    double sum = 0.0;
    for (int c = 0; c < kClasses; ++c) sum += std::exp(z[c] - zmax);
    loss += std::log(sum) - (z[label[i]] - zmax);
    right += static_cast<int>(std::max_element(z, z + kClasses) - z) == label[i];
    if (dlogits)
      for (int c = 0; c < kClasses; ++c)
        (*dlogits)[i * kClasses + static_cast<size_t>(c)] =
            static_cast<float>((std::exp(z[c] - zmax) / sum - (c == label[i])) / static_cast<double>(n));
  }
  if (correct) *correct = right;
  return loss / static_cast<double>(n);
}

}  // namespace fp8test::clusters
