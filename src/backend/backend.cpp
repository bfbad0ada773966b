#include "backend/backend.hpp"

#include "core/error.hpp"

namespace fp8 {

void* Backend::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(allocator_mutex_);
  if (!alloc_) return native_allocate(bytes);
  void* p = alloc_(allocator_user_, bytes, device(), stream());
  if (!p)
    fail(FP8_ERR_OUT_OF_MEMORY, "the application's allocator (fp8_context_set_allocator) returned NULL for ", bytes,
         " bytes on device ", device());
  try {
    hooked_.emplace(p, std::make_pair(free_, allocator_user_));
  } catch (...) {
    free_(allocator_user_, p, device(), stream());
    throw;
  }
  return p;
}

void Backend::release(void* p) noexcept {
  if (!p) return;
  std::lock_guard<std::mutex> lock(allocator_mutex_);
  auto it = hooked_.find(p);
  if (it == hooked_.end()) return native_release(p);
  const auto [free_fn, user] = it->second;
  hooked_.erase(it);
  free_fn(user, p, device(), stream());
}

void Backend::set_allocator(fp8_alloc_fn alloc, fp8_free_fn free_fn, void* user) {
  std::lock_guard<std::mutex> lock(allocator_mutex_);
  alloc_ = alloc;
  free_ = free_fn;
  allocator_user_ = user;
}

}  // namespace fp8
