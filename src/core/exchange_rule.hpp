// The numerics of the FP8 gradient exchange (fp8.h, "Data parallelism"), shared by the CPU reference
// (src/backend/cpu_exchange.cpp) and the CUDA kernels (kernels/dist/exchange.cu), which follow it bit
// for bit. Each rank owns one shard (an element range) of the FP8 gradient arena; it receives every
// rank's codes of that shard with each sender's per-tensor scales (scale_inv and amax), and there:
//   mean = (sum over senders k = 0, 1, ..., N-1 of decode_k) / N, in FP32, one rounding per add;
//   scale = fp8_max / bound, bound = the mean of the senders' amaxes (exchange_bound),
// encodes its shard in one pass, and the shards are all-gathered. The bound is known to every rank
// before any mean is computed (the senders' scales travel with the codes), so the ranks never agree
// on anything in between: no amax pass, no small all-reduce between the transfers. |mean| <= bound
// (each sender's amax is its largest decoded |value|, and rounded sums are monotonic), so nothing
// saturates beyond one rounding; the scale is at most a factor N coarser than the mean's own amax
// would give, which costs range at the bottom (subnormals), not precision: an E5M2/E4M3 rounding is
// relative. Never a sum of FP8 partial sums.
#pragma once

#include "core/optim_rule.hpp"

namespace fp8 {

// The mean of one element over the senders: code(k) is sender k's code of it, decoded with k's
// scale_inv of the element's tensor, summed in rank order and divided by their count. (Wherever
// the codes are: a buffer of received pieces, or the senders' own memory in the peer exchange.)
template <class Code>
FP8_OPTIM_FN float exchange_mean_of(Code&& code, int32_t nranks, const GradScales* sender_scales, int32_t tensor_count,
                                    int32_t tensor, bool e5m2) {
  float sum = dequantize_rn(code(0), e5m2, sender_scales[tensor].scale_inv);
  for (int32_t k = 1; k < nranks; ++k)
    sum = add_rn(
        sum, dequantize_rn(code(k), e5m2, sender_scales[static_cast<int64_t>(k) * tensor_count + tensor].scale_inv));
  // A NaN comes out canonical (0x7FFFFFFF), as the GPU's division gives it (+inf + -inf on the CPU
  // would give another NaN's bits).
  const float mean = div_rn(sum, static_cast<float>(nranks));
  return mean != mean ? bits_float(0x7FFFFFFFu) : mean;
}

// Rank k's gradient element i of this shard at pieces[k * piece_bytes + i].
FP8_OPTIM_FN float exchange_mean(const uint8_t* pieces, int64_t piece_bytes, int32_t nranks, int64_t i,
                                 const GradScales* sender_scales, int32_t tensor_count, int32_t tensor, bool e5m2) {
  return exchange_mean_of([&](int32_t k) { return pieces[k * piece_bytes + i]; }, nranks, sender_scales, tensor_count,
                          tensor, e5m2);
}

// The bound on a tensor's |mean|: the senders' amaxes summed in rank order in float64, divided by N,
// rounded to FP32 (a bound up to that last rounding, which the encoding's own rounding absorbs). A
// non-finite amax of any sender gives a non-finite bound (any NaN as 0x7FFFFFFF).
FP8_HD float exchange_bound(const GradScales* sender_scales, int32_t nranks, int32_t tensor_count, int32_t tensor) {
  double sum = 0.0;
  for (int32_t k = 0; k < nranks; ++k)
    sum += static_cast<double>(sender_scales[static_cast<int64_t>(k) * tensor_count + tensor].amax);
  const float bound = static_cast<float>(sum / static_cast<double>(nranks));
  return bound != bound ? bits_float(0x7FFFFFFFu) : bound;  // (one NaN, the GPU's, on both sides)
}

// Every tensor's scales after the exchange, identical on every rank: ready for a step. The amax
// kept is the bound (what the step's bounds on its writes start from, as after an accumulation).
FP8_HD void exchange_finish(GradScales& g, float bound, bool e5m2) {
  g.scale_inv = 1.0f / fp8_scale_for_bound(bound, e5m2);
  g.amax = bound;
  g.add_amax = 0.0f;
  g.next_amax_code = 0;
}

}  // namespace fp8
