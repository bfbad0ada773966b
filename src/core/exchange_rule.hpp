// The numerics of the FP8 gradient exchange (fp8.h, "Data parallelism"), shared by the CPU reference
// (src/backend/cpu_exchange.cpp) and the CUDA kernels (kernels/dist/exchange.cu), which follow it bit
// for bit. Each rank owns one shard (an element range) of the FP8 gradient arena; it receives every
// rank's codes of that shard with each sender's per-tensor scale_inv, and there:
//   mean = (sum over senders k = 0, 1, ..., N-1 of decode_k) / N, in FP32, one rounding per add;
// the ranks then agree on each tensor's amax of the mean (a max all-reduce of its bits), requantise
// their shard with scale = fp8_max / amax, and all-gather the codes. Never a sum of FP8 partial sums.
#pragma once

#include "core/optim_rule.hpp"

namespace fp8 {

// Rank k's gradient element i of this shard, decoded with k's scale_inv of the element's tensor,
// summed over the senders in rank order and divided by their count.
FP8_OPTIM_FN float exchange_mean(const uint8_t* pieces, int64_t piece_bytes, int32_t nranks, int64_t i,
                                 const GradScales* sender_scales, int32_t tensor_count, int32_t tensor, bool e5m2) {
  float sum = dequantize_rn(pieces[i], e5m2, sender_scales[tensor].scale_inv);
  for (int32_t k = 1; k < nranks; ++k)
    sum = add_rn(sum, dequantize_rn(pieces[k * piece_bytes + i], e5m2,
                                    sender_scales[static_cast<int64_t>(k) * tensor_count + tensor].scale_inv));
  // A NaN comes out canonical (0x7FFFFFFF), as the GPU's division gives it (+inf + -inf on the CPU
  // would give another NaN's bits).
  const float mean = div_rn(sum, static_cast<float>(nranks));
  return mean != mean ? bits_float(0x7FFFFFFFu) : mean;
}

// The scale of a tensor's averaged gradient from its agreed amax (as bits): fp8_max / amax, 1 for an
// all-zero tensor, FLT_MAX at most, NaN for a non-finite amax (the gradient stays poisoned, so every
// rank skips the step alike).
FP8_HD float exchange_scale(uint32_t amax_bits, bool e5m2) {
  const float amax = bits_float(amax_bits);
  if (!(amax - amax == 0.0f)) return bits_float(0x7FFFFFFFu);
  if (!(amax > 0.0f)) return 1.0f;
  const float s = fp8_spec(e5m2).max_value / amax;
  return s > FLT_MAX ? FLT_MAX : s;
}

// Every tensor's scales after the exchange, identical on every rank: ready for accumulation or a step.
FP8_HD void exchange_finish(GradScales& g, uint32_t amax_bits, bool e5m2) {
  g.scale_inv = 1.0f / exchange_scale(amax_bits, e5m2);
  g.amax = bits_float(amax_bits);
  g.add_amax = 0.0f;
  g.next_amax_code = 0;
}

}  // namespace fp8
