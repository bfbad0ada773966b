#include "dist/local_transport.hpp"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.hpp"

namespace fp8::dist {

namespace {

enum class Collective : int32_t { kAllReduce, kAllGather, kAllToAll, kBroadcast, kBarrier };

// One rank's call as posted to the group: what it is (compared across ranks) and its buffers.
struct Call {
  Collective what = Collective::kBarrier;
  ElemType type = ElemType::kF32;  // all_reduce only
  ReduceOp op = ReduceOp::kSum;    // all_reduce only
  size_t size = 0;                 // elements for all_reduce, bytes (per rank) otherwise
  const void* send = nullptr;
  void* recv = nullptr;
  int32_t root = 0;    // broadcast only
  size_t stride = 0;   // all_to_all: of send's pieces; all_gather: of recv's (0: `size`)
};

size_t stride_of(const Call& call) { return call.stride ? call.stride : call.size; }

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

// How messages name a call: "all_reduce(16 x f32, sum)", "all_gather(64 bytes)".
std::string describe(const Call& call) {
  std::ostringstream os;
  switch (call.what) {
    case Collective::kAllReduce:
      os << "all_reduce(" << call.size << " x " << elem_type_name(call.type) << ", " << op_name(call.op) << ")";
      break;
    case Collective::kAllGather:
      os << "all_gather(" << call.size << " bytes)";
      break;
    case Collective::kAllToAll:
      os << "all_to_all(" << call.size << " bytes per rank)";
      break;
    case Collective::kBroadcast:
      os << "broadcast(" << call.size << " bytes from rank " << call.root << ")";
      break;
    case Collective::kBarrier:
      os << "barrier()";
      break;
  }
  return os.str();
}

bool same_call(const Call& a, const Call& b) {
  if (a.what != b.what || a.size != b.size || a.root != b.root) return false;
  return a.what != Collective::kAllReduce || (a.type == b.type && a.op == b.op);
}

// The bytes of one rank's result of `call`; refuses a call that cannot run before the rank posts it.
size_t result_bytes(const Call& call, int32_t nranks) {
  size_t bytes = 0;
  switch (call.what) {
    case Collective::kAllReduce: {
      if (call.op != ReduceOp::kSum && call.op != ReduceOp::kMax) {
        fail(FP8_ERR_INVALID_ARGUMENT, "unknown reduction op ", static_cast<int32_t>(call.op));
      }
      const size_t elem = elem_size(call.type);
      if (call.size > std::numeric_limits<size_t>::max() / elem) {
        fail(FP8_ERR_INVALID_ARGUMENT, describe(call), " is larger than memory");
      }
      bytes = call.size * elem;
      if (bytes > 0) require_arg(call.send, "buf");
      return bytes;
    }
    case Collective::kAllGather:
    case Collective::kAllToAll:
      if (call.size > std::numeric_limits<size_t>::max() / static_cast<size_t>(nranks)) {
        fail(FP8_ERR_INVALID_ARGUMENT, describe(call), " over ", nranks, " ranks is larger than memory");
      }
      if (call.stride && call.stride < call.size)
        fail(FP8_ERR_INVALID_ARGUMENT, describe(call), ": a stride of ", call.stride, " bytes; expected at least ",
             call.size);
      bytes = call.size * static_cast<size_t>(nranks);
      if (bytes > 0) {
        require_arg(call.send, "send");
        require_arg(call.recv, "recv");
      }
      return bytes;
    case Collective::kBroadcast:
      if (call.root < 0 || call.root >= nranks)
        fail(FP8_ERR_INVALID_ARGUMENT, describe(call), ": root must be 0 .. ", nranks - 1);
      if (call.size > 0) require_arg(call.recv, "buf");
      return call.size;
    case Collective::kBarrier:
      return 0;
  }
  return 0;
}

// kMax of floats: NaN wins (the lowest rank's, as `acc` holds the lower ranks' result), so a rank's
// overflowed amax is never hidden; otherwise the larger, ties keeping the lower rank's value.
template <typename T>
T larger(T acc, T v) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(acc)) return acc;
    if (std::isnan(v)) return v;
  }
  return v > acc ? v : acc;
}

// out[i] = combine(...combine(combine(b0[i], b1[i]), b2[i])..., b{N-1}[i]): rank order, rank 0 first.
// memcpy per element: the posted buffers are untyped and need not be aligned for T.
template <typename T, typename Combine>
void reduce_in_rank_order(const std::vector<Call>& calls, size_t count, unsigned char* out, Combine combine) {
  std::memcpy(out, calls[0].send, count * sizeof(T));
  for (size_t k = 1; k < calls.size(); ++k) {
    const auto* in = static_cast<const unsigned char*>(calls[k].send);
    for (size_t i = 0; i < count; ++i) {
      T acc;
      T v;
      std::memcpy(&acc, out + i * sizeof(T), sizeof(T));
      std::memcpy(&v, in + i * sizeof(T), sizeof(T));
      acc = combine(acc, v);
      std::memcpy(out + i * sizeof(T), &acc, sizeof(T));
    }
  }
}

template <typename T>
void reduce(const std::vector<Call>& calls, size_t count, ReduceOp op, unsigned char* out) {
  if (op == ReduceOp::kSum) {
    // In T: float sums round at every step, u32 sums wrap.
    reduce_in_rank_order<T>(calls, count, out, [](T a, T b) { return static_cast<T>(a + b); });
  } else {
    reduce_in_rank_order<T>(calls, count, out, larger<T>);
  }
}

// Rank `rank`'s result of `call`, read from every rank's posted buffers into `out` (private).
void compute_result(const std::vector<Call>& calls, int32_t rank, const Call& call, unsigned char* out) noexcept {
  const size_t bytes = call.size;
  switch (call.what) {
    case Collective::kAllReduce:
      switch (call.type) {
        case ElemType::kF32:
          reduce<float>(calls, call.size, call.op, out);
          break;
        case ElemType::kF64:
          reduce<double>(calls, call.size, call.op, out);
          break;
        case ElemType::kU32:
          reduce<uint32_t>(calls, call.size, call.op, out);
          break;
      }
      break;
    case Collective::kAllGather:
      for (size_t k = 0; k < calls.size(); ++k) std::memcpy(out + k * bytes, calls[k].send, bytes);
      break;
    case Collective::kAllToAll:
      for (size_t k = 0; k < calls.size(); ++k) {
        std::memcpy(out + k * bytes,
                    static_cast<const unsigned char*>(calls[k].send) + static_cast<size_t>(rank) * stride_of(calls[k]),
                    bytes);
      }
      break;
    case Collective::kBroadcast:
      std::memcpy(out, calls[static_cast<size_t>(call.root)].send, bytes);
      break;
    case Collective::kBarrier:
      break;
  }
}

enum class Failure { kNone, kAborted, kDeparted, kMismatch, kRankFailed, kTimedOut };

// What the ranks' transports share. Everything is guarded by `mutex`, except that between a
// collective's two barriers every rank reads calls[k] and rank k's buffers unlocked: rank k is
// inside the collective until the second barrier, so neither changes.
struct Group {
  explicit Group(int32_t n) : size(n), calls(static_cast<size_t>(n)) {}

  const int32_t size;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Call> calls;  // calls[k]: rank k's current call
  int32_t arrived = 0;      // ranks waiting at the current barrier
  uint64_t generation = 0;  // barriers completed: a waiter goes on when it moves
  Failure failure = Failure::kNone;
  int32_t failed_rank = -1;     // kDeparted, kRankFailed, kMismatch (the rank that differs)
  std::string failure_message;  // kMismatch, kRankFailed; empty when it could not be built
};

// Only the first failure is kept: it is the cause, what follows (ranks leaving on the error) is not.
void record_failure(Group& g, Failure failure, int32_t rank, std::string message) noexcept {
  if (g.failure != Failure::kNone) return;
  g.failure = failure;
  g.failed_rank = rank;
  g.failure_message = std::move(message);
  g.changed.notify_all();
}

// Why `rank` cannot go on: waiting in `call` (`waited`), calling it, or in check() (`call` NULL).
std::string failure_reason(const Group& g, int32_t rank, const Call* call, bool waited) {
  std::ostringstream os;
  switch (g.failure) {
    case Failure::kNone:
      break;
    case Failure::kMismatch:
      // A rank waiting in the mismatched collective gets the message alone: it names its call.
      if (call != nullptr && !waited) os << "rank " << rank << " called " << describe(*call) << " after ";
      if (g.failure_message.empty()) {
        os << "collective mismatch: rank " << g.failed_rank << " called another collective than rank 0";
      }
      os << g.failure_message;
      return os.str();
    case Failure::kAborted:
      os << "the communicator was aborted (fp8_comm_abort)";
      break;
    case Failure::kDeparted:
      os << "rank " << g.failed_rank << " left the group (its communicator was destroyed)";
      break;
    case Failure::kRankFailed:
      os << "rank " << g.failed_rank << " could not take part in a collective";
      if (!g.failure_message.empty()) os << " (" << g.failure_message << ")";
      break;
    case Failure::kTimedOut:
      os << "rank " << g.failed_rank << " "
         << (g.failure_message.empty() ? "timed out in a collective (fp8_comm_set_timeout)" : g.failure_message);
      if (call != nullptr && g.failed_rank != rank) os << "; rank " << rank << " was in " << describe(*call);
      return os.str();
  }
  if (call != nullptr && waited) os << " while rank " << rank << " waited in " << describe(*call);
  if (call != nullptr && !waited) os << " before rank " << rank << " called " << describe(*call);
  return os.str();
}

// The first rank whose call differs from rank 0's, or 0 when every rank posted the same call.
size_t first_mismatched_rank(const std::vector<Call>& calls) noexcept {
  for (size_t k = 1; k < calls.size(); ++k) {
    if (!same_call(calls[k], calls[0])) return k;
  }
  return 0;
}

// Empty when it cannot be built: failure_reason then says less, but every rank is still released.
std::string mismatch_message(const std::vector<Call>& calls, size_t rank) noexcept {
  try {
    std::ostringstream os;
    os << "collective mismatch: rank " << rank << " called " << describe(calls[rank]) << " while rank 0 called "
       << describe(calls[0]) << "; every rank must call the same collectives in the same order";
    return os.str();
  } catch (...) {
    return {};
  }
}

// The peer windows of ranks on host memory: plain pointers, and the group's barrier.
class HostWindows final : public PeerWindows {
 public:
  // all[k * regions + i]: rank k's region i.
  HostWindows(Transport& t, const std::vector<PeerRegion>& regions, const std::vector<uint64_t>& all) : t_(t) {
    const size_t n = static_cast<size_t>(t.size());
    for (size_t i = 0; i < regions.size(); ++i) {
      std::vector<void*>& table = tables_.emplace_back();
      for (size_t k = 0; k < n; ++k)
        table.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(all[k * regions.size() + i])));
      alignment_.push_back(common_alignment(table));
      keep_.push_back(regions[i].keep);
    }
  }
  void* const* table(size_t region) const override { return tables_[region].data(); }
  int32_t alignment(size_t region) const override { return alignment_[region]; }
  void barrier() override { t_.barrier(); }
  const uint32_t* poisoned() const override { return &never_; }  // (the group's barrier throws instead)
  void close() override { t_.barrier(); }

 private:
  Transport& t_;
  std::vector<std::vector<void*>> tables_;
  std::vector<int32_t> alignment_;
  static constexpr uint32_t never_ = 0;
  std::vector<std::shared_ptr<void>> keep_;
};

class LocalTransport final : public Transport {
 public:
  // `device`: the rank's CUDA backend, whose buffers are staged through the host; nullptr: host buffers.
  LocalTransport(std::shared_ptr<Group> group, int32_t rank, std::shared_ptr<Backend> device)
      : group_(std::move(group)), rank_(rank), device_(std::move(device)) {}
  LocalTransport(const LocalTransport&) = delete;
  LocalTransport& operator=(const LocalTransport&) = delete;

  // Leaving: the others, waiting for this rank or calling later, fail instead of waiting forever.
  ~LocalTransport() override {
    std::lock_guard<std::mutex> lock(group_->mutex);
    record_failure(*group_, Failure::kDeparted, rank_, {});
  }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return group_->size; }
  const char* kind() const override { return "local"; }

  void all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) override {
    run({Collective::kAllReduce, type, op, count, buf, buf});
  }
  using Transport::all_gather;
  using Transport::all_to_all;
  void all_gather(const void* send, void* recv, size_t bytes, size_t recv_stride) override {
    Call call{Collective::kAllGather, ElemType::kF32, ReduceOp::kSum, bytes, send, recv};
    call.stride = recv_stride;
    run(call);
  }
  void all_to_all(const void* send, size_t send_stride, void* recv, size_t bytes, const Gather& with) override {
    if (with.bytes) all_gather(with.send, with.recv, with.bytes);
    Call call{Collective::kAllToAll, ElemType::kF32, ReduceOp::kSum, bytes, send, recv};
    call.stride = send_stride;
    run(call);
  }
  void broadcast(void* buf, size_t bytes, int32_t root) override {
    Call call{Collective::kBroadcast, ElemType::kF32, ReduceOp::kSum, bytes, buf, buf};
    call.root = root;
    run(call);
  }
  void barrier() override { run({}); }

  // Host buffers: every rank's threads reach every rank's memory as it is.
  std::unique_ptr<PeerWindows> map_peers(const std::vector<PeerRegion>& regions, std::string* why) override {
    if (device_) {
      *why = "the in-process transport's ranks on CUDA contexts exchange through host memory";
      return nullptr;
    }
    const size_t n = static_cast<size_t>(size());
    std::vector<uint64_t> mine, all(n * regions.size());
    for (const PeerRegion& r : regions) mine.push_back(reinterpret_cast<uintptr_t>(r.data));
    all_gather(mine.data(), all.data(), mine.size() * sizeof(uint64_t));
    return std::make_unique<HostWindows>(*this, regions, all);
  }

  void abort() noexcept override {
    std::lock_guard<std::mutex> lock(group_->mutex);
    record_failure(*group_, Failure::kAborted, -1, {});
  }

  void check() override {
    std::lock_guard<std::mutex> lock(group_->mutex);
    if (group_->failure != Failure::kNone) fail(FP8_ERR_NCCL, failure_reason(*group_, rank_, nullptr, false));
  }

 private:
  // Posts `call`, waits until every rank has posted the same, computes this rank's result into a
  // private buffer, waits until every rank has read, then writes the result.
  void run(const Call& call) {
    if (!device_) return run_host(call);
    // Device buffers: the rank's queued work first, then the collective over host copies.
    Call host = call;
    std::vector<unsigned char> send, recv;
    try {  // (a failure here, before posting, must release the others as run_host's own does)
      const size_t in_bytes = send_bytes(call, group_->size);
      send.resize(in_bytes);
      recv.resize(result_bytes(call, group_->size));
      device_->synchronize();
      if (in_bytes) device_->copy_to_host(send.data(), call.send, in_bytes);
    } catch (const std::exception& e) {
      fail_before_posting(call, e.what());
      throw;
    }
    host.send = send.data();
    host.recv = recv.data();
    host.stride = 0;  // staged contiguously: send's pieces (all_to_all) and recv's
    if (call.what == Collective::kAllToAll && call.stride) {
      // Only the pieces a rank reads travel: piece p of the host copy is piece p at p * stride.
      std::vector<unsigned char> packed(call.size * static_cast<size_t>(group_->size));
      for (size_t p = 0; p < static_cast<size_t>(group_->size); ++p)
        std::memcpy(packed.data() + p * call.size, send.data() + p * call.stride, call.size);
      send.swap(packed);
      host.send = send.data();
    }
    run_host(host);
    scatter_result(call, recv.data(), recv.size(),
                   [&](void* dst, const void* src, size_t n) { device_->copy_from_host(dst, src, n); });
  }

  // Writes a rank's result (`bytes`, contiguous) to call.recv: all_gather's pieces at its stride.
  template <class Copy>
  static void scatter_result(const Call& call, const unsigned char* result, size_t bytes, Copy&& copy) {
    if (!bytes) return;
    if (call.what != Collective::kAllGather || stride_of(call) == call.size) return copy(call.recv, result, bytes);
    for (size_t off = 0, k = 0; off < bytes; off += call.size, ++k)
      copy(static_cast<unsigned char*>(call.recv) + k * call.stride, result + off, call.size);
  }

  // The bytes `call` reads from this rank's send buffer.
  static size_t send_bytes(const Call& call, int32_t nranks) {
    switch (call.what) {
      case Collective::kAllReduce:
        return call.size * elem_size(call.type);
      case Collective::kAllToAll:
        return stride_of(call) * static_cast<size_t>(nranks - 1) + call.size;
      case Collective::kAllGather:
      case Collective::kBroadcast:
        return call.size;
      case Collective::kBarrier:
        return 0;
    }
    return 0;
  }

  void run_host(const Call& call) {
    Group& g = *group_;
    std::vector<unsigned char> result;
    try {
      // Before posting, so that nothing can fail once the others may read this rank's buffers.
      result.resize(result_bytes(call, g.size));
    } catch (const std::exception& e) {
      fail_before_posting(call, e.what());
      throw;
    }

    std::unique_lock<std::mutex> lock(g.mutex);
    if (g.failure != Failure::kNone) fail(FP8_ERR_NCCL, failure_reason(g, rank_, &call, false));
    const uint64_t posted = g.generation;
    g.calls[static_cast<size_t>(rank_)] = call;
    if (++g.arrived == g.size) {
      const size_t mismatched = first_mismatched_rank(g.calls);
      if (mismatched == 0) {
        g.arrived = 0;
        ++g.generation;
        g.changed.notify_all();
      } else {
        record_failure(g, Failure::kMismatch, static_cast<int32_t>(mismatched), mismatch_message(g.calls, mismatched));
      }
    } else {
      const auto released = [&] { return g.generation != posted || g.failure != Failure::kNone; };
      const double limit = timeout();
      if (limit <= 0.0) {
        g.changed.wait(lock, released);
      } else if (!g.changed.wait_for(lock, std::chrono::duration<double>(limit), released)) {
        record_failure(g, Failure::kTimedOut, rank_, timeout_message(g, call, limit));
      }
    }
    if (g.generation == posted) {  // released by a failure, not by the last rank to post
      --g.arrived;
      fail(FP8_ERR_NCCL, failure_reason(g, rank_, &call, true));
    }
    if (result.empty()) return;

    lock.unlock();
    compute_result(g.calls, rank_, call, result.data());
    lock.lock();
    // No failure releases this wait: a rank leaving it could free a buffer another still reads.
    // It is bounded, as every rank is past the first barrier and only computing.
    const uint64_t read = g.generation;
    if (++g.arrived == g.size) {
      g.arrived = 0;
      ++g.generation;
      g.changed.notify_all();
    } else {
      g.changed.wait(lock, [&] { return g.generation != read; });
    }
    lock.unlock();
    scatter_result(call, result.data(), result.size(), [](void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); });
  }

  // Empty when it cannot be built (failure_reason then says less).
  std::string timeout_message(const Group& g, const Call& call, double limit) const noexcept {
    try {
      std::ostringstream os;
      os << "waited over " << limit << " s (fp8_comm_set_timeout) in " << describe(call) << " while only "
         << g.arrived << " of " << g.size << " ranks had called it; the group is aborted";
      return os.str();
    } catch (...) {
      return {};
    }
  }

  // A rank that throws before posting would leave the others waiting for it: fail them too.
  void fail_before_posting(const Call& call, const char* what) noexcept {
    std::string message;
    try {
      message = describe(call) + ": " + what;
    } catch (...) {
      // failure_reason names the rank without the details
    }
    std::lock_guard<std::mutex> lock(group_->mutex);
    record_failure(*group_, Failure::kRankFailed, rank_, std::move(message));
  }

  std::shared_ptr<Group> group_;
  int32_t rank_;
  std::shared_ptr<Backend> device_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> make_local_group(int32_t nranks) {
  if (nranks < 1) fail(FP8_ERR_INVALID_ARGUMENT, "a local group needs at least one rank, got ", nranks);
  auto group = std::make_shared<Group>(nranks);
  std::vector<std::unique_ptr<Transport>> ranks;
  ranks.reserve(static_cast<size_t>(nranks));
  for (int32_t r = 0; r < nranks; ++r) ranks.push_back(std::make_unique<LocalTransport>(group, r, nullptr));
  return ranks;
}

std::vector<std::unique_ptr<Transport>> make_local_group(const std::vector<std::shared_ptr<Backend>>& backends) {
  const auto nranks = static_cast<int32_t>(backends.size());
  if (nranks < 1) fail(FP8_ERR_INVALID_ARGUMENT, "a local group needs at least one rank, got ", nranks);
  auto group = std::make_shared<Group>(nranks);
  std::vector<std::unique_ptr<Transport>> ranks;
  for (int32_t r = 0; r < nranks; ++r) {
    const auto& b = backends[static_cast<size_t>(r)];
    ranks.push_back(std::make_unique<LocalTransport>(group, r, b->device() == FP8_DEVICE_CPU ? nullptr : b));
  }
  return ranks;
}

}  // namespace fp8::dist
