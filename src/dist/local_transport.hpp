// The in-process transport: N ranks in one process, each calling its collectives from its own thread,
// over host memory. It is how everything distributed is tested without a GPU, so it checks what NCCL
// would silently get wrong or hang on.
//
// Semantics, beyond transport.hpp's contract:
// - A collective returns only when every rank has called it and has read what it needs; each rank
//   then writes its own result, so the in-place forms (all_reduce, all_gather with
//   send == recv + rank * bytes) are safe.
// - all_reduce is deterministic: kSum adds in rank order, r = b0[i]; r = r + b1[i]; ... in the
//   element type (kU32 wraps). kMax of kU32 compares unsigned values. kMax of kF32/kF64 takes the
//   larger value and NaN wins: if any rank holds a NaN the result is the NaN of the lowest such rank
//   (an overflowed amax must not be hidden by a healthy rank); equal values (-0 and +0) keep the
//   lower rank's. Every rank ends with the same bytes.
// - Mismatch detection: when the ranks do not call the same collective (operation, element type,
//   op, size), every rank throws FP8_ERR_NCCL naming the two calls, instead of exchanging garbage.
// - Never hangs: abort() from any thread, or a rank leaving the group (its Transport destroyed),
//   makes every waiting and every later collective on every rank throw FP8_ERR_NCCL with the
//   reason; so does a rank failing before it could take part (a NULL buffer, an allocation). A
//   collective that every rank had already joined when that happens still completes.
// - A failed group stays failed, the first failure being the reason given (as NCCL after an abort).
// - Ranks on CUDA contexts (several on one GPU, which NCCL refuses) take part through host memory:
//   each collective waits for the rank's stream, copies its buffers to the host and the result back.
//   Slow, and meant for testing multi-rank code on one GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "dist/transport.hpp"

namespace fp8::dist {

// A group of `nranks` (>= 1) ranks; element k is rank k's transport. Destroying one means that rank
// left the group. The transports share the group, so they may be destroyed in any order.
// With `backends` (one per rank), the buffers are memory of rank k's backend: a CUDA backend's are
// staged through the host.
std::vector<std::unique_ptr<Transport>> make_local_group(int32_t nranks);
std::vector<std::unique_ptr<Transport>> make_local_group(const std::vector<std::shared_ptr<Backend>>& backends);

}  // namespace fp8::dist
