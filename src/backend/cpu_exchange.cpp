// The CPU reference of the FP8 gradient exchange's local halves (core/exchange_rule.hpp), which the
// CUDA kernels (kernels/dist/exchange.cu) follow bit for bit.
#include <algorithm>

#include "backend/backend.hpp"
#include "core/exchange_rule.hpp"

namespace fp8 {

void cpu_grad_reduce(const GradReduceJob& j) {
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    uint32_t top = 0;
    for (int64_t i = ch.offset; i < ch.offset + ch.len; ++i) {
      j.mean[i] = exchange_mean(j.pieces, j.piece_bytes, j.nranks, i, j.sender_scales, j.tensor_count, ch.tensor,
                                j.e5m2);
      top = std::max(top, abs_bits(j.mean[i]));
    }
    j.amax[ch.tensor] = std::max(j.amax[ch.tensor], top);
  }
}

void cpu_grad_requantize(const GradRequantizeJob& j) {
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const float scale = exchange_scale(j.amax[ch.tensor], j.e5m2);
    for (int64_t i = ch.offset; i < ch.offset + ch.len; ++i) j.codes[i] = encode_fp8_rn(mul_rn(j.mean[i], scale), j.e5m2);
  }
  for (int32_t t = 0; t < j.tensor_count; ++t) exchange_finish(j.scales[t], j.amax[t], j.e5m2);
}

}  // namespace fp8
