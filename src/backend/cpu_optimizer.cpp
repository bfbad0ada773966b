// The CPU reference of the optimizer step and of FP8 gradient accumulation: core/optim_rule.hpp's
// order and element rules, which the CUDA kernels (kernels/optim/) follow bit for bit.
#include <algorithm>

#include "backend/backend.hpp"

namespace fp8 {

namespace {

const float* grad_scale_inv(const OptimTensor& t) {
  return t.grad_scales ? &t.grad_scales->scale_inv : nullptr;
}

}  // namespace

void cpu_optimizer_norm(const OptimizerStepJob& j) {
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const OptimTensor& t = j.tensors[ch.tensor];
    const float* si = grad_scale_inv(t);
    const float scale_inv = si ? *si : 1.0f;
    j.partials[c] = ordered_sum(
        [&](int64_t i) {
          const double g = grad_at(t, ch.offset + i, scale_inv);
          return g * g;
        },
        ch.len);
  }
}

void cpu_optimizer_update(const OptimizerStepJob& j) {
  const double* partials = j.partials;
  finish_joint_step(*j.scalars, ordered_sum([partials](int64_t i) { return partials[i]; }, j.chunk_count),
                    j.other_sumsq, j.clip_out, *j.hyper);
  *j.args = element_args(*j.hyper);
  const OptimScalars& s = *j.scalars;
  if (s.skip) return;
  for (int64_t i = 0; i < j.tensor_count; ++i) {
    const OptimTensor& t = j.tensors[i];
    if (t.scales) finish_compact(*t.scales, *t.grad_scales, s, *j.hyper, t.layout);
  }
  const OptimElementArgs a = *j.args;
  const CompactScales none{};
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const OptimTensor& t = j.tensors[ch.tensor];
    const float* si = grad_scale_inv(t);
    const float scale_inv = si ? *si : 1.0f;
    const CompactScales& cs = t.scales ? *t.scales : none;
    CompactMax mx;
    for (int64_t i = ch.offset; i < ch.offset + ch.len; ++i) update_element(t, i, scale_inv, cs, a, s, mx);
    if (t.scales) {
      t.scales->next_m_code = std::max(t.scales->next_m_code, mx.m);
      t.scales->next_v_code = std::max(t.scales->next_v_code, mx.v);
      t.scales->next_p_code = std::max(t.scales->next_p_code, mx.p);
    }
  }
}

void cpu_optimizer_promote(const OptimizerStepJob& j) {
  const OptimScalars& s = *j.scalars;
  for (int64_t i = 0; i < j.tensor_count; ++i) {
    const OptimTensor& t = j.tensors[i];
    if (t.scales) promote_compact(*t.scales, t.w_scale_inv, s, t.layout);
  }
}

void cpu_grad_accumulate(const GradAccumulateJob& j) {
  const bool bf16 = j.add_dtype == FP8_DTYPE_BF16;
  auto add = [&](int64_t i) {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(j.add)[i]) : static_cast<const float*>(j.add)[i];
  };
  if (!j.codes) {
    for (int64_t i = 0; i < j.n; ++i) j.f32[i] = add_rn(j.f32[i], add(i));
    return;
  }
  GradScales& g = *j.scales;
  uint32_t add_amax = 0;
  for (int64_t i = 0; i < j.n; ++i) add_amax = std::max(add_amax, abs_bits(add(i)));
  g.add_amax = bits_float(add_amax);
  const float scale = grad_sum_scale(g, j.e5m2);
  const bool onto_zeros = grad_sum_onto_zeros(g);
  uint32_t top = 0;
  for (int64_t i = 0; i < j.n; ++i) {
    j.codes[i] = onto_zeros ? grad_sum_first_code(add(i), scale, j.e5m2)
                            : grad_sum_code(j.codes[i], add(i), g.scale_inv, scale, j.e5m2);
    top = std::max<uint32_t>(top, j.codes[i] & 0x7Fu);
  }
  g.next_amax_code = std::max(g.next_amax_code, top);  // as the GPU's atomicMax
  grad_sum_finish(g, j.e5m2);
}

}  // namespace fp8
