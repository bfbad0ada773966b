#include "dist/transport.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>

#include "backend/backend.hpp"
#include "core/error.hpp"

namespace fp8::dist {

const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return "f32";
    case ElemType::kF64:
      return "f64";
    case ElemType::kU32:
      return "u32";
  }
  return "unknown";  // a value cast from outside the enum: named in messages, refused by elem_size
}

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return 4;
    case ElemType::kF64:
      return 8;
    case ElemType::kU32:
      return 4;
  }
  fail(FP8_ERR_INVALID_ARGUMENT, "unknown collective element type ", static_cast<int32_t>(t));
}

std::vector<unsigned char> gather_host(Transport& t, Backend& be, const void* mine, size_t bytes) {
  const size_t n = static_cast<size_t>(t.size());
  std::vector<unsigned char> out(n * bytes);
  if (!bytes) return out;
  const std::unique_ptr<char, std::function<void(char*)>> staging(static_cast<char*>(be.allocate(n * bytes)),
                                                                  [&be](char* p) { be.release(p); });
  char* slot = staging.get() + static_cast<size_t>(t.rank()) * bytes;
  be.copy_from_host(slot, mine, bytes);
  t.all_gather(slot, staging.get(), bytes);
  be.copy_to_host(out.data(), staging.get(), n * bytes);  // (waits for the collective)
  t.check();
  return out;
}

uint64_t largest_of_ranks(Transport& t, Backend& be, uint64_t mine) {
  const auto all = gather_host(t, be, &mine, sizeof mine);
  uint64_t most = 0;
  for (size_t k = 0; k < all.size(); k += sizeof most) {
    uint64_t v;
    std::memcpy(&v, all.data() + k, sizeof v);
    most = std::max(most, v);
  }
  return most;
}

int32_t common_alignment(const std::vector<void*>& table) {
  uintptr_t bits = 256;
  for (void* p : table) bits |= reinterpret_cast<uintptr_t>(p);
  return static_cast<int32_t>(bits & (~bits + 1));  // (the lowest bit set)
}

void Transport::poll_wait(double waited_seconds) {
  check();
  const double limit = timeout();
  if (limit <= 0.0 || waited_seconds <= limit) return;
  abort();
  fail(FP8_ERR_NCCL, "a wait for this context's GPU work lasted over ", limit,
       " s (fp8_comm_set_timeout) with rank ", rank(), " of ", size(), " of a ", kind(),
       " communicator on it: a rank left, crashed or stalled in a collective; the communicator is aborted");
}

}  // namespace fp8::dist
