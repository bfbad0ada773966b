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

// The gradient exchange (fp8.h, "Data parallelism"), bucket by bucket (nn::Bucket), each on the
// backend's communication stream. Every write of gradients through libfp8 calls
// before_grad_write first (refused, FP8_ERR_INVALID_STATE, once the bucket of any of them was
// exchanged since the last step or zero_grad) and after_grad_write when it is queued: under backward
// sync, a bucket whose parameters have all been written since then starts its exchange there.
// Parameters [first, first + count) in the model's order; `unwritten_below`: the call goes on to
// write parameters [0, unwritten_below) (a whole-model backward), so buckets holding any of them wait.
void before_grad_write(fp8_model& m, int32_t first, int32_t count);
void after_grad_write(fp8_model& m, int32_t first, int32_t count, int32_t unwritten_below = 0);

// fp8_model_set_backward_sync: turned on, only what is written from then on counts.
void set_backward_sync(fp8_model& m, bool on);

// Collective: the rest of the exchange. Starts every bucket not started yet, in order, and makes the
// context's stream wait for all of them. With `whole` false each rank needs only its pieces of the
// FP8 gradients averaged (the sharded O3 step's case): their all-gather is left out.
void sync_grads(fp8_model& m, bool whole = true);

// The averaged gradients were used (a step) or dropped (zero_grad, a load): the stream waits for any
// exchange still running, and the next exchange starts afresh.
void grads_consumed(fp8_model& m);

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
// worst (largest) status of any rank and the highest rank that had it (-1 when every rank is FP8_OK).
struct Agreement {
  fp8_status_t status;
  int32_t rank;
};
Agreement agree(Transport& t, const std::shared_ptr<Backend>& be, fp8_status_t mine);
// Whether `mine` is the same on every rank (collective: every rank calls it at the same point).
bool same_on_every_rank(Transport& t, const std::shared_ptr<Backend>& be, bool mine);

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

// Makes a communicator surface in fp8_context_synchronize (NCCL's asynchronous errors) and in the
// backend's blocking waits (its timeout: Backend::set_wait_poll).
void register_comm(Backend* backend, const std::shared_ptr<Transport>& t);
// Throws FP8_ERR_NCCL for the first communicator of `backend` that reports an error.
void check_comms(const Backend* backend);

// The data-parallel state a model keeps: the exchange's progress since the last step or zero_grad,
// and its buffers and tables (the plan), remade when the storage layout changes.
struct ModelComm {
  std::shared_ptr<Transport> transport;
  // fp8_model_set_backward_sync: each bucket is exchanged as soon as the backward has written it.
  bool backward_sync = false;
  // fp8_model_sync_grads was called since the last step or zero_grad (for the refusal's message).
  bool synced_explicitly = false;
  // Per parameter: written since backward sync was turned on or the last step or zero_grad. Per
  // bucket: its parameters still to be written, and how far its exchange went (kNotStarted, kOwnPieces:
  // FP32 gradients and this rank's pieces of the FP8 ones averaged, kWhole: every piece). Whether a
  // bucket is exchanged is decided by the calls, which are the same on every rank, never by what one
  // rank wrote.
  enum : uint8_t { kNotStarted = 0, kOwnPieces = 1, kWhole = 2 };
  std::vector<uint8_t> written, exchanged;
  std::vector<int32_t> pending;
  uint64_t progress_generation = ~uint64_t{0};  // the layout the vectors above are for
  struct Plan;
  std::unique_ptr<Plan> plan;
  ModelComm();
  ~ModelComm();
};

}  // namespace fp8::dist
