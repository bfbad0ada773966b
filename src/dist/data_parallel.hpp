// Data parallelism over a communicator (fp8.h, "Data parallelism"): the handle, the model check, the
// broadcast of a model's state, the amax agreement at each scaling update and the gradient exchange.
#pragma once

#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "dist/transport.hpp"
#include "io/checkpoint.hpp"
#include "nn/storage.hpp"

struct fp8_model;
struct fp8_optimizer;
struct fp8_scaling;

struct fp8_comm {
  std::shared_ptr<fp8::Backend> backend;
  // Shared with the models made data-parallel over it: the rank leaves the group when the last goes.
  std::shared_ptr<fp8::dist::Transport> transport;
};

namespace fp8::dist {

// Collective: refuses on every rank (FP8_ERR_INVALID_STATE, naming the first difference) unless the
// ranks' models have the same layers, names, shapes, conversion, recipe and storage level, and,
// with `optimizer_kind` (nullptr: none), optimizers of the same kind. `when` names the call.
void require_same_model(Transport& t, const fp8_model& m, const char* optimizer_kind, const char* when);

// Collective: every rank's parameters, gradients and scaling states become rank 0's.
void broadcast_model(Transport& t, fp8_model& m);

// Collective: each state's history slot 0 (the amax recorded since its last update) becomes the
// maximum over the ranks, before the update reads it. `states` are the model's, all of them, so that
// every rank reduces the same amount whatever is due.
void reduce_amax(Transport& t, fp8_model& m, const std::vector<fp8_scaling*>& states);

// Collective: averages the model's gradients across the ranks. With `whole` false each rank needs
// only its share of the FP8 gradients averaged (the sharded O3 step's case): the final all-gather
// is left out.
void sync_grads(fp8_model& m, bool whole = true);

// The sharded O3 step's agreements (collective): the norm's per-chunk partials (each rank's chunks
// hold values, the others zeros, replicated tensors' chunks the same values everywhere: a max of
// the bits gives every rank every value), the compact scales (the largest codes written, and at
// creation the masters' amaxes), and the E4M3 weights, each rank's share all-gathered.
void agree_partials(fp8_optimizer& o);
void agree_compact_scales(fp8_optimizer& o);
void gather_weights(fp8_model& m);

// Collective: whole copies of the sharded masters (and with `o`, its m and v), for a checkpoint or
// an export; the arenas in `keep` hold them until the caller is done.
io::WholeState gather_whole(const fp8_model& m, const fp8_optimizer* o, std::vector<nn::Arena>& keep);

// Agrees on one status across the ranks after a step that could fail on some of them: returns the
// worst (largest) status of any rank, and the rank that had it.
struct Agreement {
  fp8_status_t status;
  int32_t rank;
};
Agreement agree(Transport& t, const std::shared_ptr<Backend>& be, fp8_status_t mine);

// Runs `local` on this rank, then agrees: when it failed on any rank, every rank runs `undo` (which
// may be collective) and throws: the failed ranks their own error, the others FP8_ERR_INVALID_STATE
// naming the rank that failed, `what`, and `outcome` (what undo left). `local` must be all or
// nothing on its own rank.
template <class Local, class Undo>
void all_or_none(Transport& t, const std::shared_ptr<Backend>& be, const char* what, Local&& local, Undo&& undo,
                 const char* outcome = "so no rank changed") {
  fp8_status_t mine = FP8_OK;
  std::exception_ptr error;
  try {
    local();
  } catch (const Error& e) {
    mine = e.status();
    error = std::current_exception();
  } catch (...) {
    mine = FP8_ERR_INTERNAL;
    error = std::current_exception();
  }
  const Agreement a = agree(t, be, mine);
  if (a.status == FP8_OK) return;
  undo();
  if (error) std::rethrow_exception(error);
  fail(FP8_ERR_INVALID_STATE, what, " failed on rank ", a.rank, " (", fp8_status_string(a.status),
       "; its message says why), ", outcome);
}

// Makes the model's communicator surface in fp8_context_synchronize (NCCL's asynchronous errors).
void register_comm(const Backend* backend, const std::shared_ptr<Transport>& t);
// Throws FP8_ERR_NCCL for the first communicator of `backend` that reports an error.
void check_comms(const Backend* backend);

// The data-parallel state a model keeps (buffers and tables of the exchange), remade when the
// storage layout changes.
struct ModelComm {
  std::shared_ptr<Transport> transport;
  // Set by fp8_model_sync_grads, cleared by the step and zero_grad: whether to exchange is decided by
  // the calls, which are the same on every rank, never by what one rank wrote. While it is set,
  // gradient writes are refused.
  bool explicit_sync = false;
  struct Plan;
  std::unique_ptr<Plan> plan;
  ModelComm();
  ~ModelComm();
};

}  // namespace fp8::dist
