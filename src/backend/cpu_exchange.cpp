// The CPU reference of the FP8 gradient exchange's local halves (core/exchange_rule.hpp), which the
// CUDA kernels (kernels/dist/exchange.cu) follow bit for bit.
#include <algorithm>

#include "backend/backend.hpp"
#include "core/exchange_rule.hpp"

namespace fp8 {

namespace {

float mean_at(const GradExchangeJob& j, int64_t i, int32_t tensor) {
  return exchange_mean(j.pieces, j.piece_bytes, j.nranks, i, j.sender_scales, j.tensor_count, tensor, j.e5m2);
}

}  // namespace

void cpu_grad_exchange(const GradExchangeJob& j) {
  if (j.scales)
    for (int32_t t = 0; t < j.tensor_count; ++t) {
      j.bounds[t] = exchange_bound(j.sender_scales, j.nranks, j.tensor_count, t);
      exchange_finish(j.scales[t], j.bounds[t], j.e5m2);
    }
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const float scale = fp8_scale_for_bound(j.bounds[ch.tensor], j.e5m2);
    for (int64_t i = ch.offset; i < ch.offset + ch.len; ++i)
      j.codes[i] = encode_fp8_rn(mul_rn(mean_at(j, i, ch.tensor), scale), j.e5m2);
  }
}

}  // namespace fp8
