#include "dist/nccl_transport.hpp"

#include <cuda.h>  // (types for the driver entry point: libfp8 does not link the driver)
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

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

// ---- the peer windows ----------------------------------------------------------------------------
// Ranks in one process reach each other's memory through peer access (cudaDeviceEnablePeerAccess),
// ranks in other processes of the host through CUDA IPC (cudaIpcGetMemHandle of the allocation
// that holds the region, opened at the region's offset in it). The barrier is a kernel on the
// rank's stream over a signal array per rank (slot k: rank k's last epoch), itself a region; the
// epoch counts on the device, so a captured barrier replays correctly.

// The allocation that holds p (cuMemGetAddressRange): IPC shares whole allocations.
bool allocation_of(const void* p, CUdeviceptr* base) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      f = nullptr;
    (void)cudaGetLastError();
    return reinterpret_cast<Fn>(f);
  }();
  size_t size = 0;
  return fn && fn(base, &size, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS;
}

// This host: its name and boot id (two containers may share a name, not a boot).
std::string host_key() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(name) + "/" + boot;
}

// What each rank tells the others, at a fixed size.
constexpr size_t kHostKey = 128, kBusId = 32;
struct RankCard {
  char host[kHostKey];
  char bus[kBusId];
  uint64_t process;  // process_nonce()
};

// This process, told apart from every other (pids repeat across PID namespaces, e.g. containers
// that share a host name): drawn once.
uint64_t process_nonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32 | rd()) ^ static_cast<uint64_t>(getpid());
  }();
  return nonce;
}
struct RegionCard {
  cudaIpcMemHandle_t handle;
  uint64_t ptr, offset;  // the region, and its offset in its allocation
  uint32_t shareable;    // an IPC handle exists for its allocation
  uint32_t pad;
};

// Why rank `from` cannot reach rank `to`: the codes of the agreement (0: it can).
enum PeerVerdict : uint32_t {
  kReachable = 0,
  kOtherHost = 1,
  kNotVisible = 2,
  kSameGpu = 3,
  kNoPeerAccess = 4,
  kNotShareable = 5,
  kOpenFailed = 6,
  kSetupFailed = 7,
  kNoNvlink = 8,
};
std::string verdict_text(uint32_t code, int32_t from, int32_t to) {
  std::ostringstream os;
  os << "rank " << from << " cannot reach rank " << to << "'s memory: ";
  switch (code) {
    case kOtherHost:
      os << "they run on different hosts";
      break;
    case kNotVisible:
      os << "rank " << to << "'s GPU is not visible to rank " << from << "'s process (CUDA_VISIBLE_DEVICES)";
      break;
    case kSameGpu:
      os << "both run on the same GPU";
      break;
    case kNoPeerAccess:
      os << "cudaDeviceCanAccessPeer says the GPUs have no peer access";
      break;
    case kNotShareable:
      os << "rank " << to << "'s gradient memory cannot be shared with another process (cudaIpcGetMemHandle; "
         << "memory from an allocator set with fp8_context_set_allocator may be such)";
      break;
    case kOpenFailed:
      os << "cudaIpcOpenMemHandle failed";
      break;
    case kNoNvlink:
      os << "their GPUs are joined by PCIe only (no native peer atomics: no NVLink), where NCCL's "
         << "transfers are faster than reading the other GPU's memory";
      break;
    default:
      os << "setting the windows up failed (a CUDA allocation or peer access)";
  }
  return os.str();
}

class NcclWindows final : public PeerWindows {
 public:
  NcclWindows(Transport& t, std::shared_ptr<Backend> backend, const volatile uint32_t* abort)
      : t_(t), backend_(std::move(backend)), abort_(abort) {}
  ~NcclWindows() override {
    // This rank's queued exchanges still reach the others' memory: they finish (or end at the
    // communicator's timeout) before the mappings go.
    try {
      backend_->synchronize();
    } catch (...) {  // (an aborted group: the barriers have ended)
    }
    DeviceScope on(backend_->device(), std::nothrow);
    release_imports();
    if (tables_) cudaFree(tables_);
    if (signals_) cudaFree(signals_);
    if (epoch_) cudaFree(epoch_);
  }
  NcclWindows(const NcclWindows&) = delete;
  NcclWindows& operator=(const NcclWindows&) = delete;

  void* const* table(size_t region) const override { return tables_ + region * static_cast<size_t>(t_.size()); }
  int32_t alignment(size_t region) const override { return alignment_[region]; }
  void barrier() override {
    DeviceScope on(backend_->device());
    backend_->join_side();
    kernels::peer_barrier(reinterpret_cast<uint32_t* const*>(table(signal_region_)), t_.rank(), t_.size(), epoch_,
                          epoch_ + 1, abort_, backend_->stream());
  }
  void close() override {
    backend_->synchronize();
    {
      DeviceScope on(backend_->device());
      release_imports();
    }
    t_.barrier();
  }
  const uint32_t* poisoned() const override { return epoch_ + 1; }

  // Sets up this rank's side; returns the verdict (kReachable or why not) and fills `peer`.
  uint32_t setup(const std::vector<PeerRegion>& regions, int32_t* peer);

 private:
  void release_imports() noexcept {
    for (void* base : imports_) cudaIpcCloseMemHandle(base);
    imports_.clear();
  }

  Transport& t_;
  std::shared_ptr<Backend> backend_;
  const volatile uint32_t* abort_;
  std::vector<std::shared_ptr<void>> keep_;
  std::vector<int32_t> alignment_;
  size_t signal_region_ = 0;
  void** tables_ = nullptr;      // device: [region][rank]
  uint32_t* signals_ = nullptr;  // device: nranks slots
  uint32_t* epoch_ = nullptr;    // device: the barriers so far, then the poisoned word
  std::vector<void*> imports_;   // what cudaIpcOpenMemHandle opened
};

uint32_t NcclWindows::setup(const std::vector<PeerRegion>& regions, int32_t* peer) {
  const auto n = static_cast<size_t>(t_.size());
  const auto me = static_cast<size_t>(t_.rank());
  const int device = backend_->device();
  DeviceScope on(device);
  // This rank's signals (a region of its own: allocated here, so IPC can share it) and epoch.
  std::vector<PeerRegion> all = regions;
  uint32_t verdict = kReachable;
  const auto cuda_ok = [&](cudaError_t e) {
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      if (verdict == kReachable) verdict = kSetupFailed, *peer = static_cast<int32_t>(me);
    }
    return e == cudaSuccess;
  };
  // (Zeroed on the backend's stream, which the gathers below synchronise before any rank learns
  // where the signals are.)
  if (cuda_ok(cudaMalloc(reinterpret_cast<void**>(&signals_), n * sizeof(uint32_t))))
    backend_->zero(signals_, n * sizeof(uint32_t));
  if (cuda_ok(cudaMalloc(reinterpret_cast<void**>(&epoch_), 2 * sizeof(uint32_t))))
    backend_->zero(epoch_, 2 * sizeof(uint32_t));
  signal_region_ = all.size();
  all.push_back({signals_, n * sizeof(uint32_t), nullptr});
  for (const PeerRegion& r : regions) keep_.push_back(r.keep);

  // Every rank's card and its regions' cards, gathered.
  const size_t card_bytes = sizeof(RankCard) + all.size() * sizeof(RegionCard);
  std::vector<unsigned char> mine(card_bytes, 0);
  RankCard rc{};
  std::strncpy(rc.host, host_key().c_str(), kHostKey - 1);
  if (cudaDeviceGetPCIBusId(rc.bus, kBusId, device) != cudaSuccess) (void)cudaGetLastError();
  rc.process = process_nonce();
  std::memcpy(mine.data(), &rc, sizeof rc);
  for (size_t i = 0; i < all.size(); ++i) {
    RegionCard c{};
    c.ptr = reinterpret_cast<uintptr_t>(all[i].data);
    CUdeviceptr base = 0;
    if (all[i].data && allocation_of(all[i].data, &base) &&
        cudaIpcGetMemHandle(&c.handle, reinterpret_cast<void*>(base)) == cudaSuccess) {
      c.shareable = 1;
      c.offset = c.ptr - static_cast<uint64_t>(base);
    }
    (void)cudaGetLastError();
    std::memcpy(mine.data() + sizeof(RankCard) + i * sizeof(RegionCard), &c, sizeof c);
  }
  const std::vector<unsigned char> cards = gather_host(t_, *backend_, mine.data(), card_bytes);
  const auto card = [&](size_t k) {
    RankCard c;
    std::memcpy(&c, cards.data() + k * card_bytes, sizeof c);
    return c;
  };
  const auto region_card = [&](size_t k, size_t i) {
    RegionCard c;
    std::memcpy(&c, cards.data() + k * card_bytes + sizeof(RankCard) + i * sizeof(RegionCard), sizeof c);
    return c;
  };

  // Each peer's regions as this rank reaches them.
  std::vector<std::vector<void*>> reach(all.size(), std::vector<void*>(n, nullptr));
  for (size_t k = 0; k < n && verdict == kReachable; ++k) {
    const RankCard theirs = card(k);
    const bool same_process = theirs.process == rc.process && std::strncmp(theirs.host, rc.host, kHostKey) == 0;
    if (k != me) {
      int dev = -1, can = 0, atomics = 0;
      if (std::strncmp(theirs.host, rc.host, kHostKey) != 0)
        verdict = kOtherHost;
      else if (cudaDeviceGetByPCIBusId(&dev, theirs.bus) != cudaSuccess)
        verdict = kNotVisible;
      else if (dev == device)
        verdict = kSameGpu;
      else if (cudaDeviceCanAccessPeer(&can, device, dev) != cudaSuccess || !can)
        verdict = kNoPeerAccess;
      else if (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, device, dev) != cudaSuccess ||
               !atomics)
        verdict = kNoNvlink;
      else if (same_process) {
        const cudaError_t e = cudaDeviceEnablePeerAccess(dev, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) verdict = kSetupFailed;
      }
      (void)cudaGetLastError();
      if (verdict != kReachable) {
        *peer = static_cast<int32_t>(k);
        break;
      }
    }
    for (size_t i = 0; i < all.size(); ++i) {
      const RegionCard c = region_card(k, i);
      if (k == me || same_process) {
        reach[i][k] = reinterpret_cast<void*>(static_cast<uintptr_t>(c.ptr));
        continue;
      }
      if (!c.shareable) {
        verdict = kNotShareable, *peer = static_cast<int32_t>(k);
        break;
      }
      void* base = nullptr;
      if (cudaIpcOpenMemHandle(&base, c.handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        (void)cudaGetLastError();
        verdict = kOpenFailed, *peer = static_cast<int32_t>(k);
        break;
      }
      imports_.push_back(base);
      reach[i][k] = static_cast<char*>(base) + c.offset;
    }
  }
  if (verdict != kReachable) return verdict;
  std::vector<void*> flat;
  for (const std::vector<void*>& r : reach) {
    alignment_.push_back(common_alignment(r));
    flat.insert(flat.end(), r.begin(), r.end());
  }
  if (cuda_ok(cudaMalloc(reinterpret_cast<void**>(&tables_), flat.size() * sizeof(void*))))
    backend_->copy_from_host(tables_, flat.data(), flat.size() * sizeof(void*));
  return verdict;
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::shared_ptr<Backend> backend, ncclComm_t comm, bool owned)
      : backend_(std::move(backend)), comm_(comm), owned_(owned) {
    {
      // Mapped host memory the peer barriers poll: abort() (and a failed check()) sets it, so a
      // barrier waiting for a rank that is gone ends. Made here, so that abort() never races it.
      DeviceScope on(backend_->device());
      void* p = nullptr;
      kernels::cuda_check(cudaHostAlloc(&p, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
                          "cudaHostAlloc (the peer barrier's abort flag)");
      abort_flag_ = static_cast<volatile uint32_t*>(p);
      *abort_flag_ = 0u;
    }
    nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
    nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
  }
  ~NcclTransport() override {
    backend_->release(token_);
    cudaFreeHost(const_cast<uint32_t*>(abort_flag_));
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
  std::unique_ptr<PeerWindows> map_peers(const std::vector<PeerRegion>& regions, std::string* why) override {
    check();
    DeviceScope on(backend_->device());
    auto windows = std::make_unique<NcclWindows>(*this, backend_, abort_flag_);
    int32_t peer = 0;
    const uint32_t verdict = windows->setup(regions, &peer);
    // The worst verdict of any rank, with who found it: code << 24 | rank << 12 | peer.
    const uint32_t mine =
        verdict == kReachable ? 0u : verdict << 24 | static_cast<uint32_t>(rank_) << 12 | static_cast<uint32_t>(peer);
    const auto word = static_cast<uint32_t>(largest_of_ranks(*this, *backend_, mine));
    if (word == 0) return windows;
    *why = verdict_text(word >> 24, static_cast<int32_t>((word >> 12) & 0xFFFu), static_cast<int32_t>(word & 0xFFFu));
    windows->close();
    return nullptr;
  }

  void abort() noexcept override {
    *abort_flag_ = 1u;
    if (aborted_.exchange(true)) return;
    // The application keeps a borrowed communicator, but aborting is what it asked for.
    ncclCommAbort(comm_);
  }
  void check() override {
    if (aborted_) fail(FP8_ERR_NCCL, "the communicator was aborted (fp8_comm_abort)");
    ncclResult_t async = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm_, &async);
    if (got != ncclSuccess || (async != ncclSuccess && async != ncclInProgress))
      *abort_flag_ = 1u;  // (the barriers end)
    nccl_check(got, "ncclCommGetAsyncError");
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
  volatile uint32_t* abort_flag_ = nullptr;  // mapped host memory
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
