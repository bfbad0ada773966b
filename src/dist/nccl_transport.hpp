// The NCCL implementation of dist::Transport (one rank per GPU; one host or many).
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "dist/transport.hpp"

struct ncclComm;

namespace fp8::dist {

constexpr size_t kNcclIdBytes = 128;  // sizeof(ncclUniqueId)

// ncclGetUniqueId, written into `id` (kNcclIdBytes).
void nccl_unique_id(unsigned char* id);
// ncclCommInitRank on `backend`'s device: blocks until all `nranks` ranks have joined.
std::unique_ptr<Transport> nccl_join(std::shared_ptr<Backend> backend, int32_t nranks, int32_t rank,
                                     const unsigned char* id);
// ncclCommInitAll over the backends' devices (all different): one rank each, in order.
std::vector<std::unique_ptr<Transport>> nccl_join_all(const std::vector<std::shared_ptr<Backend>>& backends);
// A communicator the application made and keeps (never destroyed by libfp8); it must be on
// `backend`'s device.
std::unique_ptr<Transport> nccl_borrow(std::shared_ptr<Backend> backend, ncclComm* comm);

}  // namespace fp8::dist
