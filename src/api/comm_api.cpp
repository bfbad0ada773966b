// Communicators and data-parallel models: handle checks here, the work in src/dist.
#include <cmath>
#include <set>

#include "api/guard.hpp"
#include "dist/data_parallel.hpp"
#include "dist/local_transport.hpp"
#include "dist/nccl_transport.hpp"
#include "nn/model.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

fp8_comm_t* make_comm(std::shared_ptr<fp8::Backend> backend, std::unique_ptr<fp8::dist::Transport> transport) {
  auto comm = std::make_unique<fp8_comm>();
  comm->backend = std::move(backend);
  comm->transport = std::move(transport);
  fp8::dist::register_comm(comm->backend.get(), comm->transport);
  return comm.release();
}

void require_cuda_context(const fp8_context_t* ctx, const char* name, const char* advice) {
  if (ctx->backend->device() == FP8_DEVICE_CPU) fp8::fail(FP8_ERR_UNSUPPORTED, name, " is a CPU context; ", advice);
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_comm_get_id(fp8_comm_id_t* id) {
  return guard("fp8_comm_get_id", [&] {
    require_arg(id, "id");
    fp8::dist::nccl_unique_id(id->bytes);
  });
}

FP8_API fp8_status_t fp8_comm_create(fp8_comm_t** out, fp8_context_t* ctx, int32_t nranks, int32_t rank,
                                     const fp8_comm_id_t* id) {
  return guard("fp8_comm_create", [&] {
    require_arg(out, "out");
    *out = nullptr;
    require_arg(ctx, "ctx");
    require_arg(id, "id");
    if (nranks < 1) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "nranks = ", nranks, "; expected >= 1");
    if (rank < 0 || rank >= nranks)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "rank = ", rank, "; expected 0 .. nranks - 1 = ", nranks - 1);
    require_cuda_context(ctx, "ctx",
                         "ranks on CPU contexts are joined inside one process by fp8_comm_create_local (the "
                         "in-process transport)");
    *out = make_comm(ctx->backend, fp8::dist::nccl_join(ctx->backend, nranks, rank, id->bytes));
  });
}

FP8_API fp8_status_t fp8_comm_create_local(fp8_comm_t** comms, fp8_context_t* const* ctxs, int32_t nranks) {
  return guard("fp8_comm_create_local", [&] {
    require_arg(comms, "comms");
    require_arg(ctxs, "ctxs");
    if (nranks < 1) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "nranks = ", nranks, "; expected >= 1");
    for (int32_t k = 0; k < nranks; ++k) comms[k] = nullptr;
    std::vector<std::shared_ptr<fp8::Backend>> backends;
    std::set<int32_t> devices;
    for (int32_t k = 0; k < nranks; ++k) {
      if (!ctxs[k]) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "ctxs[", k, "] is NULL");
      backends.push_back(ctxs[k]->backend);
      const int32_t device = ctxs[k]->backend->device();
      const bool cpu = device == FP8_DEVICE_CPU;
      if (cpu != (backends.front()->device() == FP8_DEVICE_CPU))
        fp8::fail(FP8_ERR_INVALID_ARGUMENT, "ctxs[", k, "] is a ", cpu ? "CPU" : "CUDA",
                  " context but ctxs[0] is not; ", "expected all CUDA contexts or all CPU contexts");
      if (!cpu) devices.insert(device);
      for (int32_t j = 0; j < k; ++j)
        if (ctxs[j] == ctxs[k])
          fp8::fail(FP8_ERR_INVALID_ARGUMENT, "ctxs[", k, "] is ctxs[", j, "]; expected one context per rank");
    }
    // NCCL when every rank has a GPU of its own; else the in-process transport (through the host
    // for CUDA contexts sharing a GPU, which NCCL refuses).
    const bool nccl = devices.size() == static_cast<size_t>(nranks);
    std::vector<std::unique_ptr<fp8::dist::Transport>> transports =
        nccl ? fp8::dist::nccl_join_all(backends) : fp8::dist::make_local_group(backends);
    std::vector<std::unique_ptr<fp8_comm>> made;
    for (int32_t k = 0; k < nranks; ++k) made.emplace_back(make_comm(backends[k], std::move(transports[k])));
    for (int32_t k = 0; k < nranks; ++k) comms[k] = made[k].release();
  });
}

FP8_API fp8_status_t fp8_comm_wrap_nccl(fp8_comm_t** out, fp8_context_t* ctx, struct ncclComm* nccl) {
  return guard("fp8_comm_wrap_nccl", [&] {
    require_arg(out, "out");
    *out = nullptr;
    require_arg(ctx, "ctx");
    require_arg(nccl, "nccl");
    require_cuda_context(ctx, "ctx", "an NCCL communicator serves a CUDA context");
    *out = make_comm(ctx->backend, fp8::dist::nccl_borrow(ctx->backend, nccl));
  });
}

FP8_API fp8_status_t fp8_comm_rank(const fp8_comm_t* comm, int32_t* rank) {
  return guard("fp8_comm_rank", [&] {
    require_arg(comm, "comm");
    require_arg(rank, "rank");
    *rank = comm->transport->rank();
  });
}

FP8_API fp8_status_t fp8_comm_size(const fp8_comm_t* comm, int32_t* size) {
  return guard("fp8_comm_size", [&] {
    require_arg(comm, "comm");
    require_arg(size, "size");
    *size = comm->transport->size();
  });
}

FP8_API void fp8_comm_destroy(fp8_comm_t* comm) {
  delete comm;
}

FP8_API fp8_status_t fp8_comm_abort(fp8_comm_t* comm) {
  return guard("fp8_comm_abort", [&] {
    require_arg(comm, "comm");
    comm->transport->abort();
  });
}

FP8_API fp8_status_t fp8_comm_set_timeout(fp8_comm_t* comm, double seconds) {
  return guard("fp8_comm_set_timeout", [&] {
    require_arg(comm, "comm");
    if (!(seconds >= 0.0) || !std::isfinite(seconds))
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "seconds = ", seconds, "; expected a finite number >= 0 (0: wait forever)");
    comm->transport->set_timeout(seconds);
  });
}

FP8_API fp8_status_t fp8_comm_get_timeout(const fp8_comm_t* comm, double* seconds) {
  return guard("fp8_comm_get_timeout", [&] {
    require_arg(comm, "comm");
    require_arg(seconds, "seconds");
    *seconds = comm->transport->timeout();
  });
}

FP8_API fp8_status_t fp8_model_set_comm(fp8_model_t* model, fp8_comm_t* comm) {
  return guard("fp8_model_set_comm", [&] {
    require_arg(model, "model");
    // The model's state: agreed on across the ranks below.
    const auto checks = [&] {
      if (!model->optimizer_links.empty())
        fp8::fail(FP8_ERR_INVALID_STATE, "the model has an optimizer; set the communicator before ",
                  "fp8_optimizer_create (or destroy the optimizer first)");
      if (model->autocast) fp8::fail(FP8_ERR_INVALID_STATE, "inside an autocast region; end it first");
      if (model->store && model->store->masters_sharded())
        fp8::fail(FP8_ERR_INVALID_STATE, "the model's F16 master weights are sharded over its ",
                  model->store->shares().nranks, " ranks (O3), so this rank holds only its share; it cannot leave or ",
                  "change its group. Save a checkpoint and load it into a model built anew");
    };
    if (!comm) {
      checks();
      model->backend->join_side();  // (an exchange still running uses the buffers that go)
      model->comm.reset();
      if (model->store) model->store->set_shares({});
      return;
    }
    // Each rank's own checks first, agreed on: a rank that refuses does not leave the others waiting.
    // (Through the communicator's own context: on a rank whose comm belongs to another context than
    // its model, the group is still the comm's.)
    fp8::dist::Transport& t = *comm->transport;
    fp8::dist::all_or_none(
        t, comm->backend, "fp8_model_set_comm",
        [&] {
          if (comm->backend != model->backend)
            fp8::fail(FP8_ERR_INVALID_ARGUMENT, "comm belongs to another context (device ", comm->backend->device(),
                      "); expected one made from the model's context (device ", model->backend->device(), ")");
          checks();
        },
        [] {});
    fp8::dist::require_same_model(t, *model, nullptr, "fp8_model_set_comm");
    // Rank 0's model everywhere, then the shares (at O3 each rank keeps its share of those masters).
    fp8::dist::broadcast_model(t, *model);
    fp8::nn::ParamStore* store = model->store.get();
    fp8::dist::all_or_none(
        t, model->backend, "fp8_model_set_comm",
        [&] {
          if (!store) return;
          const fp8::nn::Shares before = store->shares();
          store->set_shares({t.size(), t.rank(), model->bucket_bytes});
          try {
            store->layout(fp8::nn::all_parameters(*model), store->level(), store->grad_dtype(), false);
          } catch (...) {
            store->set_shares(before);
            throw;
          }
        },
        [] {}, "so no rank is data-parallel (every rank holds rank 0's parameters)");
    auto dp = std::make_unique<fp8::dist::ModelComm>();
    dp->transport = comm->transport;
    model->comm = std::move(dp);
  });
}

FP8_API fp8_status_t fp8_model_sync_grads(fp8_model_t* model) {
  return guard("fp8_model_sync_grads", [&] {
    require_arg(model, "model");
    if (!model->comm) return;
    // (As the step's, this check is not worth a host round trip to agree on: see fp8.h, "Misuse".)
    if (model->autocast) fp8::fail(FP8_ERR_INVALID_STATE, "inside an autocast region; end it first");
    fp8::dist::sync_grads(*model);  // (buckets averaged since the last step or zero_grad are left alone)
    model->comm->synced_explicitly = true;
  });
}

FP8_API fp8_status_t fp8_model_set_backward_sync(fp8_model_t* model, int32_t on) {
  return guard("fp8_model_set_backward_sync", [&] {
    require_arg(model, "model");
    fp8::require_flag(on, "on");
    if (!model->comm) fp8::fail(FP8_ERR_INVALID_STATE, "the model is not data-parallel; fp8_model_set_comm first");
    fp8::dist::set_backward_sync(*model, on != 0);
  });
}

FP8_API fp8_status_t fp8_model_set_bucket_bytes(fp8_model_t* model, size_t bytes) {
  return guard("fp8_model_set_bucket_bytes", [&] {
    require_arg(model, "model");
    if (bytes < FP8_MIN_BUCKET_BYTES)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "bytes = ", bytes, "; expected at least FP8_MIN_BUCKET_BYTES (",
                FP8_MIN_BUCKET_BYTES, ")");
    if (model->comm)
      fp8::fail(FP8_ERR_INVALID_STATE, "the model is already data-parallel and its buckets are laid out; set the ",
                "bucket size before fp8_model_set_comm");
    model->bucket_bytes = bytes;
  });
}

}  // extern "C"
