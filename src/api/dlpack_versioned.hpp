// DLPack 1.x's versioned managed tensor (fp8.h, "DLPack"), declared here when dlpack/dlpack.h is
// older (Debian's is 0.6, which has only DLManagedTensor), with the layout DLPack 1.0 fixed
// (checked below, so that a header of either version gives the same offsets).
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>

#ifndef DLPACK_MAJOR_VERSION
extern "C" {
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};
}
#endif
static_assert(offsetof(DLManagedTensorVersioned, manager_ctx) == 8 &&
                  offsetof(DLManagedTensorVersioned, deleter) == 8 + sizeof(void*) &&
                  offsetof(DLManagedTensorVersioned, flags) == 8 + 2 * sizeof(void*) &&
                  offsetof(DLManagedTensorVersioned, dl_tensor) == 16 + 2 * sizeof(void*),
              "DLPack 1.x's DLManagedTensorVersioned layout");
