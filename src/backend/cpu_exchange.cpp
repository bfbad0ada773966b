// The CPU reference of the FP8 gradient exchange's local halves (core/exchange_rule.hpp), which the
// CUDA kernels (kernels/dist/exchange.cu) follow bit for bit.
#include <algorithm>

#include "backend/backend.hpp"
#include "core/exchange_rule.hpp"

namespace fp8 {

namespace {

float mean_at(const GradExchangeJob& j, int64_t i, int32_t tensor) {
  if (j.peer_codes)
    return exchange_mean_of([&](int32_t k) { return j.peer_codes[k][j.peer_at + i]; }, j.nranks, j.sender_scales,
                            j.tensor_count, tensor, j.e5m2);
  return exchange_mean(j.pieces, j.piece_bytes, j.nranks, i, j.sender_scales, j.tensor_count, tensor, j.e5m2);
}

}  // namespace

void cpu_grad_exchange(const GradExchangeJob& j) {
  if (j.peer_poisoned && *j.peer_poisoned) return;
  if (j.scales)
    for (int32_t t = 0; t < j.tensor_count; ++t) {
      j.bounds[t] = exchange_bound(j.sender_scales, j.nranks, j.tensor_count, t);
      exchange_finish(j.scales[t], j.bounds[t], j.e5m2);
    }
  for (int64_t c = 0; c < j.chunk_count; ++c) {
    const OptimChunk& ch = j.chunks[c];
    const float scale = fp8_scale_for_bound(j.bounds[ch.tensor], j.e5m2);
    for (int64_t i = ch.offset; i < ch.offset + ch.len; ++i) {
      const uint8_t code = encode_fp8_rn(mul_rn(mean_at(j, i, ch.tensor), scale), j.e5m2);
      if (!j.peer_outputs) {
        j.codes[i] = code;
        continue;
      }
      for (int32_t k = 0; k < j.nranks; ++k) j.peer_outputs[k][j.peer_at + i] = code;
    }
  }
}

void cpu_gather_peer_scales(const PeerScalesJob& j) {
  if (j.poisoned && *j.poisoned) return;
  for (int32_t k = 0; k < j.nranks; ++k)
    for (int32_t t = 0; t < j.tensor_count; ++t)
      j.senders[static_cast<int64_t>(k) * j.tensor_count + t] = j.peer_scales[k][j.first + t];
  for (int32_t t = 0; t < j.tensor_count; ++t) j.bounds[t] = exchange_bound(j.senders, j.nranks, j.tensor_count, t);
}

}  // namespace fp8
