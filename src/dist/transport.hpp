// The one interface behind fp8_comm_t: the collectives data parallelism needs, over NCCL
// (nccl_transport.cpp) or over libfp8's in-process transport among CPU contexts whose ranks run on
// threads (local_transport.cpp; how CI tests everything distributed without a GPU).
//
// Every rank calls the same collectives, with the same sizes, in the same order. Buffers are memory
// of the rank's backend (device memory under NCCL, host memory on the CPU backend). Under NCCL a
// collective is enqueued on the backend's stream and returns; the local transport runs it to
// completion before it returns. Each collective gives the same bytes on every rank.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fp8.h"

namespace fp8 {
class Backend;
}

namespace fp8::dist {

enum class ElemType : int32_t { kF32, kF64, kU32 };

// Memory of this rank that the other ranks read and write directly (Transport::map_peers).
struct PeerRegion {
  void* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<void> keep;  // holds the memory while the windows live
};

// Every rank's regions, as this rank reaches them, and a barrier between the ranks' streams: the
// peer exchange (data_parallel.cpp) reads the senders' codes where they are and writes the means
// into every rank's memory, with no transfer through buffers of the transport.
class PeerWindows {
 public:
  virtual ~PeerWindows() = default;
  // Rank k's region i, as a table of nranks pointers (rank order) in the backend's memory (device
  // memory for kernels under NCCL), valid while the windows live; alignment: the largest power of
  // two up to 256 that divides every pointer of it.
  virtual void* const* table(size_t region) const = 0;
  virtual int32_t alignment(size_t region) const = 0;
  // Everything this rank queued on its backend's stream before the call is done and visible to
  // what every rank queues after its own call (an asynchronous barrier on the GPU). Every rank
  // calls it the same number of times.
  virtual void barrier() = 0;
  // A word in the backend's memory, nonzero once a barrier of this rank ended by an abort (the
  // communicator's timeout, fp8_comm_abort, an NCCL error) instead of meeting the others: the
  // exchange's kernels queued after it then read and write nothing (a peer that is slow, not gone,
  // must not get this rank's sums of its unfinished gradients).
  virtual const uint32_t* poisoned() const = 0;
  // Collective: every rank stops reaching the others' regions (closes what it mapped) and waits for
  // all the others to have done so, before any of the memory goes.
  virtual void close() = 0;
};

// The largest power of two up to 256 that divides every pointer of `table`.
int32_t common_alignment(const std::vector<void*>& table);
enum class ReduceOp : int32_t { kSum, kMax };

const char* elem_type_name(ElemType t);  // "f32", "f64", "u32"
size_t elem_size(ElemType t);

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  virtual const char* kind() const = 0;  // "NCCL" or "local"

  // buf[i] = op over the ranks of buf[i], in place. Sums of floats: NCCL's order; the local
  // transport adds in rank order (rank 0 first). Max of kU32 compares the bit patterns: that is how
  // amaxes travel (non-negative floats order like their bits, and NaN sorts above infinity).
  virtual void all_reduce(void* buf, size_t count, ElemType type, ReduceOp op) = 0;
  // recv = every rank's `bytes` of send, in rank order: rank k's at recv + k * recv_stride
  // (recv_stride >= bytes). send == recv + rank * recv_stride is the in-place form.
  virtual void all_gather(const void* send, void* recv, size_t bytes, size_t recv_stride) = 0;
  void all_gather(const void* send, void* recv, size_t bytes) { all_gather(send, recv, bytes, bytes); }
  // An all-gather that travels with an all_to_all (in the same group: one launch under NCCL).
  struct Gather {
    const void* send = nullptr;
    void* recv = nullptr;
    size_t bytes = 0;  // 0: none
  };
  // Piece k of recv (`bytes` each, contiguous) = rank k's `bytes` at send + rank * send_stride
  // (send_stride >= bytes), and with.recv = every rank's with.bytes of with.send, in rank order.
  // send and recv do not overlap.
  virtual void all_to_all(const void* send, size_t send_stride, void* recv, size_t bytes, const Gather& with) = 0;
  void all_to_all(const void* send, void* recv, size_t bytes) { all_to_all(send, bytes, recv, bytes, {}); }
  // Collective: the ranks' `regions` (memory of their backends, the same roles in the same order on
  // every rank) mapped into every rank's reach, or nullptr on every rank, with the reason in *why,
  // where some rank cannot reach another's memory (another host, no peer access between the GPUs,
  // memory that cannot be shared, a transport without it). Never throws for that alone.
  virtual std::unique_ptr<PeerWindows> map_peers(const std::vector<PeerRegion>& regions, std::string* why) {
    (void)regions;
    *why = std::string("the ") + kind() + " transport has no direct access to the other ranks' memory";
    return nullptr;
  }
  // buf = root's buf on every rank.
  virtual void broadcast(void* buf, size_t bytes, int32_t root) = 0;
  // Waits until every rank has arrived (the local transport), or for the stream's queued work and
  // then every rank (NCCL).
  virtual void barrier() = 0;

  // Thread safe, from any thread: every collective in flight or called later, on every rank of the
  // group, fails with FP8_ERR_NCCL instead of waiting (ncclCommAbort under NCCL).
  virtual void abort() noexcept = 0;
  // Throws FP8_ERR_NCCL with the reason when the group was aborted, a rank left it, or NCCL
  // reported an error asynchronously (ncclCommGetAsyncError) since the last call.
  virtual void check() = 0;

  // fp8_comm_set_timeout: how long a wait for the group may last before it aborts the group
  // (0: forever). Any thread.
  void set_timeout(double seconds) noexcept { timeout_s_.store(seconds); }
  double timeout() const noexcept { return timeout_s_.load(); }
  // Called while a blocking wait of this rank's backend waits for the GPU (Backend::set_wait_poll),
  // with the seconds waited so far: check(), and once the wait outlasts the timeout, abort() and
  // FP8_ERR_NCCL. (Under NCCL a collective with a rank gone never ends: its kernel waits on the
  // device, and only the abort ends it.)
  void poll_wait(double waited_seconds);

 private:
  std::atomic<double> timeout_s_{FP8_DEFAULT_COMM_TIMEOUT_S};
};

// Collective: every rank's `bytes` of host data `mine`, in rank order, gathered through `be`'s memory
// (synchronous).
std::vector<unsigned char> gather_host(Transport& t, Backend& be, const void* mine, size_t bytes);
// Collective: the largest of the ranks' values (through gather_host).
uint64_t largest_of_ranks(Transport& t, Backend& be, uint64_t mine);

}  // namespace fp8::dist
