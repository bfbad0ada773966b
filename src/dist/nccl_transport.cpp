#include "dist/nccl_transport.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>

#include "backend/device_scope.hpp"
#include "core/error.hpp"

namespace fp8::dist {

static_assert(sizeof(ncclUniqueId) == kNcclIdBytes, "fp8_comm_id_t holds an ncclUniqueId");

namespace {

void nccl_check(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  fail(FP8_ERR_NCCL, what, ": ", ncclGetErrorString(r), last && *last ? " (" : "", last ? last : "",
       last && *last ? ")" : "");
}

ncclDataType_t nccl_type(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return ncclFloat32;
    case ElemType::kF64:
      return ncclFloat64;
    default:
      return ncclUint32;
  }
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::shared_ptr<Backend> backend, ncclComm_t comm, bool owned)
      : backend_(std::move(backend)), comm_(comm), owned_(owned) {
    nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
    nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
  }
  ~NcclTransport() override {
    backend_->release(token_);
    if (!owned_ || aborted_) return;
    DeviceScope on(backend_->device(), std::nothrow);
    // A communicator with an error pending may never finish its work: destroying it would wait.
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && (async == ncclSuccess || async == ncclInProgress))
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  const char* kind() const override { return "NCCL"; }

  void all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) override {
    check();
    DeviceScope on(backend_->device());
    nccl_check(
        ncclAllReduce(buf, buf, count, nccl_type(type), op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, stream()),
        "ncclAllReduce");
  }
  using Transport::all_gather;
  using Transport::all_to_all;
  void all_gather(const void* send, void* recv, size_t bytes, size_t recv_stride) override {
    if (recv_stride < bytes)
      fail(FP8_ERR_INVALID_ARGUMENT, "all_gather: a stride of ", recv_stride, " bytes; expected at least ", bytes);
    check();
    DeviceScope on(backend_->device());
    if (recv_stride == bytes) {
      nccl_check(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream()), "ncclAllGather");
      return;
    }
    // Strided: a send to and a receive from every other rank, and this rank's own bytes copied
    // unless in place.
    char* own = static_cast<char*>(recv) + static_cast<size_t>(rank_) * recv_stride;
    if (own != send && bytes)
      kernels::cuda_check(cudaMemcpyAsync(own, send, bytes, cudaMemcpyDeviceToDevice, stream()),
                 "cudaMemcpyAsync (all_gather's own piece)");
    group("all_gather (ncclSend/ncclRecv)", [&](int32_t p) {
      if (p == rank_) return ncclSuccess;
      const ncclResult_t r = ncclSend(send, bytes, ncclUint8, p, comm_, stream());
      return r != ncclSuccess ? r
                              : ncclRecv(static_cast<char*>(recv) + p * recv_stride, bytes, ncclUint8, p, comm_, stream());
    });
  }
  void all_to_all(const void* send, size_t send_stride, void* recv, size_t bytes, const Gather& with) override {
    if (send_stride < bytes)
      fail(FP8_ERR_INVALID_ARGUMENT, "all_to_all: a stride of ", send_stride, " bytes; expected at least ", bytes);
    check();
    DeviceScope on(backend_->device());
    group("all_to_all (ncclSend/ncclRecv)", [&](int32_t p) {
      ncclResult_t r = ncclSend(static_cast<const char*>(send) + p * send_stride, bytes, ncclUint8, p, comm_, stream());
      if (r == ncclSuccess) r = ncclRecv(static_cast<char*>(recv) + p * bytes, bytes, ncclUint8, p, comm_, stream());
      if (r == ncclSuccess && with.bytes) r = ncclSend(with.send, with.bytes, ncclUint8, p, comm_, stream());
      if (r == ncclSuccess && with.bytes)
        r = ncclRecv(static_cast<char*>(with.recv) + p * with.bytes, with.bytes, ncclUint8, p, comm_, stream());
      return r;
    });
  }
  void broadcast(void* buf, size_t bytes, int32_t root) override {
    check();
    DeviceScope on(backend_->device());
    nccl_check(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream()), "ncclBroadcast");
  }
  void barrier() override {
    backend_->synchronize();
    // A one-element all-reduce that every rank waits for.
    check();
    DeviceScope on(backend_->device());
    if (!token_) token_ = static_cast<uint32_t*>(backend_->allocate(sizeof(uint32_t)));
    nccl_check(ncclAllReduce(token_, token_, 1, ncclUint32, ncclMax, comm_, stream()), "ncclAllReduce (barrier)");
    backend_->synchronize();
    check();
  }
  void abort() noexcept override {
    if (aborted_.exchange(true)) return;
    // The application keeps a borrowed communicator, but aborting is what it asked for.
    ncclCommAbort(comm_);
  }
  void check() override {
    if (aborted_) fail(FP8_ERR_NCCL, "the communicator was aborted (fp8_comm_abort)");
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress) nccl_check(async, "NCCL reported an asynchronous error");
  }

 private:
  // One NCCL group of `per_peer(p)`'s calls for every rank p. The group is always ended; the first
  // failure of its calls is reported after that.
  template <class PerPeer>
  void group(const char* what, PerPeer&& per_peer) {
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    for (int32_t p = 0; p < size_ && first == ncclSuccess; ++p) first = per_peer(p);
    const ncclResult_t end = ncclGroupEnd();
    nccl_check(first, what);
    nccl_check(end, "ncclGroupEnd");
  }
  // The stream a collective goes on: the backend's, after it waited for the communication stream
  // when the collective is issued outside it (Backend::begin_side), so that the communicator's
  // operations run in the order they were issued.
  cudaStream_t stream() const {
    backend_->join_side();
    return backend_->stream();
  }
  std::shared_ptr<Backend> backend_;
  ncclComm_t comm_;
  bool owned_;
  std::atomic<bool> aborted_{false};
  int size_ = 0, rank_ = 0;
  uint32_t* token_ = nullptr;
};

}  // namespace

void nccl_unique_id(unsigned char* id) {
  ncclUniqueId u;
  nccl_check(ncclGetUniqueId(&u), "ncclGetUniqueId");
  std::memcpy(id, &u, sizeof u);
}

std::unique_ptr<Transport> nccl_join(std::shared_ptr<Backend> backend, int32_t nranks, int32_t rank,
                                     const unsigned char* id) {
  ncclUniqueId u;
  std::memcpy(&u, id, sizeof u);
  DeviceScope on(backend->device());
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRank(&comm, nranks, u, rank), "ncclCommInitRank");
  try {
    return std::make_unique<NcclTransport>(std::move(backend), comm, true);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

std::vector<std::unique_ptr<Transport>> nccl_join_all(const std::vector<std::shared_ptr<Backend>>& backends) {
  std::vector<int> devices;
  for (const auto& b : backends) devices.push_back(b->device());
  std::vector<ncclComm_t> comms(backends.size(), nullptr);
  nccl_check(ncclCommInitAll(comms.data(), static_cast<int>(comms.size()), devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<Transport>> out;
  try {
    for (size_t i = 0; i < comms.size(); ++i) {
      out.push_back(std::make_unique<NcclTransport>(backends[i], comms[i], true));
      comms[i] = nullptr;
    }
  } catch (...) {
    for (ncclComm_t c : comms)
      if (c) ncclCommDestroy(c);
    throw;
  }
  return out;
}

std::unique_ptr<Transport> nccl_borrow(std::shared_ptr<Backend> backend, ncclComm* comm) {
  int device = -1;
  nccl_check(ncclCommCuDevice(comm, &device), "ncclCommCuDevice");
  if (device != backend->device())
    fail(FP8_ERR_INVALID_ARGUMENT, "nccl is a communicator of device ", device, "; expected one of ctx's device ",
         backend->device());
  return std::make_unique<NcclTransport>(std::move(backend), comm, false);
}

}  // namespace fp8::dist
