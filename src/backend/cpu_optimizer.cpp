// The CPU reference of the optimizer step: core/optim_rule.hpp's order and element rules, which
// the CUDA kernels (kernels/optim/optimizer.cu) follow bit for bit.
#include "backend/backend.hpp"

namespace fp8 {

void cpu_optimizer_step(const OptimizerStepJob& j) {
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const float* g = j.tensors[ch.tensor].grad + ch.offset;
    j.partials[c] = ordered_sum([g](int64_t i) { return static_cast<double>(g[i]) * static_cast<double>(g[i]); },
                                ch.len);
  }
  const double* partials = j.partials;
  finish_step(*j.scalars, ordered_sum([partials](int64_t i) { return partials[i]; }, j.chunk_count), j.hyper);
  const OptimScalars& s = *j.scalars;
  if (s.skip) return;
  const OptimElementArgs a = element_args(j.hyper);
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const OptimTensor& t = j.tensors[ch.tensor];
    for (int64_t i = ch.offset; i < ch.offset + ch.len; ++i) {
      if (a.kind == FP8_OPTIMIZER_SGD) sgd_update(t.param[i], t.grad[i], a.momentum > 0.0f ? t.m + i : nullptr, a, s);
      else adam_update(t.param[i], t.grad[i], t.m[i], t.v[i], a, s);
    }
  }
}

}  // namespace fp8
