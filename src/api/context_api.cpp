// Contexts and device queries.
#include <cstring>

#include "api/guard.hpp"
#include "dist/data_parallel.hpp"
#include "backend/device_info.hpp"

using fp8::guard;
using fp8::require_arg;

extern "C" {

FP8_API fp8_status_t fp8_context_create(fp8_context_t** out, int32_t device) {
  return guard("fp8_context_create", [&] {
    require_arg(out, "out");
    auto ctx = std::make_unique<fp8_context>();
    if (device == FP8_DEVICE_CPU) ctx->backend = fp8::make_cpu_backend();
    else ctx->backend = fp8::make_cuda_backend(device);
    *out = ctx.release();
  });
}

FP8_API void fp8_context_destroy(fp8_context_t* ctx) { delete ctx; }

FP8_API fp8_status_t fp8_context_device(const fp8_context_t* ctx, int32_t* device) {
  return guard("fp8_context_device", [&] {
    require_arg(ctx, "ctx");
    require_arg(device, "device");
    *device = ctx->backend->device();
  });
}

FP8_API fp8_status_t fp8_context_set_allocator(fp8_context_t* ctx, fp8_alloc_fn alloc, fp8_free_fn free_fn,
                                               void* user) {
  return guard("fp8_context_set_allocator", [&] {
    require_arg(ctx, "ctx");
    if (!alloc != !free_fn)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT,
                alloc ? "free_fn is NULL but alloc is not" : "alloc is NULL but free_fn is not",
                "; expected both set, or both NULL for libfp8's own allocator");
    ctx->backend->set_allocator(alloc, free_fn, user);
  });
}

FP8_API fp8_status_t fp8_context_set_stream(fp8_context_t* ctx, struct CUstream_st* stream) {
  return guard("fp8_context_set_stream", [&] {
    require_arg(ctx, "ctx");
    ctx->backend->set_stream(stream);
  });
}

FP8_API fp8_status_t fp8_context_get_stream(const fp8_context_t* ctx, struct CUstream_st** stream) {
  return guard("fp8_context_get_stream", [&] {
    require_arg(ctx, "ctx");
    require_arg(stream, "stream");
    *stream = ctx->backend->stream();
  });
}

FP8_API fp8_status_t fp8_context_synchronize(fp8_context_t* ctx) {
  return guard("fp8_context_synchronize", [&] {
    require_arg(ctx, "ctx");
    ctx->backend->synchronize();
    fp8::dist::check_comms(ctx->backend.get());
  });
}

FP8_API void fp8_device_info_init(fp8_device_info_t* info) {
  if (!info) return;
  std::memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
}

FP8_API fp8_status_t fp8_device_query(int32_t device, fp8_device_info_t* info) {
  return guard("fp8_device_query", [&] {
    require_arg(info, "info");
    fp8::require_struct_size(info, fp8::kDeviceInfoV1Size, "info", "fp8_device_info_init");
    fp8_device_info_t result;
    fp8_device_info_init(&result);
    fp8::query_device(device, &result);
    fp8::write_versioned(info, result);
  });
}

FP8_API fp8_status_t fp8_device_count(int32_t* count) {
  return guard("fp8_device_count", [&] {
    require_arg(count, "count");
    *count = fp8::cuda_device_count();
  });
}

}  // extern "C"
