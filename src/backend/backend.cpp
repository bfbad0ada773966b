#include "backend/backend.hpp"

#include "core/error.hpp"

namespace fp8 {

void* Backend::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (capture_id())  // an allocation would invalidate the capture; say what to do instead
    fail(FP8_ERR_INVALID_STATE, "libfp8 needs ", bytes, " more bytes of device memory while the context's stream is ",
         "being captured into a CUDA graph; run the same step once before capturing it (libfp8's buffers grow to ",
         "fit the shapes they see and are kept)");
  fp8_alloc_fn alloc = nullptr;
  fp8_free_fn free_fn = nullptr;
  void* user = nullptr;
  {
    std::lock_guard<std::mutex> lock(allocator_mutex_);
    alloc = alloc_, free_fn = free_, user = allocator_user_;
  }
  if (!alloc) return native_allocate(bytes);
  // The application's functions run outside the lock: they may free other blocks of this context.
  void* p = alloc(user, bytes, device(), stream());
  if (!p)
    fail(FP8_ERR_OUT_OF_MEMORY, "the application's allocator (fp8_context_set_allocator) returned NULL for ", bytes,
         " bytes on device ", device());
  try {
    std::lock_guard<std::mutex> lock(allocator_mutex_);
    hooked_.emplace(p, std::make_pair(free_fn, user));
  } catch (...) {
    free_fn(user, p, device(), stream());
    throw;
  }
  return p;
}

void Backend::release(void* p) noexcept {
  if (!p) return;
  fp8_free_fn free_fn = nullptr;
  void* user = nullptr;
  {
    std::lock_guard<std::mutex> lock(allocator_mutex_);
    auto it = hooked_.find(p);
    if (it != hooked_.end()) {
      free_fn = it->second.first;
      user = it->second.second;
      hooked_.erase(it);
    }
  }
  if (free_fn) free_fn(user, p, device(), stream());
  else native_release(p);
}

void Backend::set_allocator(fp8_alloc_fn alloc, fp8_free_fn free_fn, void* user) {
  std::lock_guard<std::mutex> lock(allocator_mutex_);
  alloc_ = alloc;
  free_ = free_fn;
  allocator_user_ = user;
}

}  // namespace fp8
