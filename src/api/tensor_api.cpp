// Tensors: creation, wrapping, metadata, host copies, scale_inv.
#include <cmath>
#include <cstdio>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

void require_bytes(const fp8_tensor* t, size_t bytes) {
  if (bytes != t->nbytes())
    fp8::fail(FP8_ERR_SHAPE, "bytes = ", bytes, "; expected ", t->nbytes(), " (", t->numel, " elements of ",
              fp8::dtype_name(t->dtype), ", shape ", fp8::shape_string(t->ndim, t->shape), ")");
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_tensor_create(fp8_tensor_t** out, fp8_context_t* ctx, fp8_dtype_t dtype, int32_t ndim,
                                       const int64_t* shape) {
  return guard("fp8_tensor_create", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    *out = fp8::make_tensor(ctx->backend, dtype, ndim, shape, false, nullptr).release();
  });
}

FP8_API fp8_status_t fp8_tensor_wrap(fp8_tensor_t** out, fp8_context_t* ctx, fp8_dtype_t dtype, int32_t ndim,
                                     const int64_t* shape, void* data) {
  return guard("fp8_tensor_wrap", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    *out = fp8::make_tensor(ctx->backend, dtype, ndim, shape, true, data).release();
  });
}

FP8_API fp8_status_t fp8_tensor_wrap_scaled(fp8_tensor_t** out, fp8_context_t* ctx, fp8_dtype_t dtype, int32_t ndim,
                                            const int64_t* shape, void* data, float* scale_inv) {
  return guard("fp8_tensor_wrap_scaled", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    require_arg(scale_inv, "scale_inv");
    if (!fp8::dtype_is_fp8(dtype))
      fp8::fail(FP8_ERR_DTYPE, "dtype ", fp8::dtype_valid(dtype) ? fp8::dtype_name(dtype) : "(not a dtype)",
                "; expected FP8_DTYPE_E4M3 or FP8_DTYPE_E5M2 (other dtypes have no scale: fp8_tensor_wrap)");
    if (reinterpret_cast<uintptr_t>(scale_inv) % alignof(float) != 0)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "scale_inv is not aligned to 4 bytes");
    ctx->backend->check_device_pointer(scale_inv, "scale_inv");
    *out = fp8::make_tensor(ctx->backend, dtype, ndim, shape, true, data, sizeof(float), scale_inv).release();
  });
}

FP8_API void fp8_tensor_destroy(fp8_tensor_t* tensor) {
  if (tensor && tensor->lent_by) {  // not the caller's: its owner releases it
    char what[256];
    std::snprintf(what, sizeof what, "tensor belongs to %s, which releases it; nothing was done", tensor->lent_by);
    fp8::report("fp8_tensor_destroy", what);
    return;
  }
  delete tensor;
}

FP8_API fp8_status_t fp8_tensor_dtype(const fp8_tensor_t* tensor, fp8_dtype_t* dtype) {
  return guard("fp8_tensor_dtype", [&] {
    require_arg(tensor, "tensor");
    require_arg(dtype, "dtype");
    *dtype = tensor->dtype;
  });
}

FP8_API fp8_status_t fp8_tensor_shape(const fp8_tensor_t* tensor, int32_t* ndim, int64_t* shape) {
  return guard("fp8_tensor_shape", [&] {
    require_arg(tensor, "tensor");
    require_arg(ndim, "ndim");
    *ndim = tensor->ndim;
    if (shape)
      for (int32_t i = 0; i < tensor->ndim; ++i) shape[i] = tensor->shape[i];
  });
}

FP8_API fp8_status_t fp8_tensor_numel(const fp8_tensor_t* tensor, int64_t* numel) {
  return guard("fp8_tensor_numel", [&] {
    require_arg(tensor, "tensor");
    require_arg(numel, "numel");
    *numel = tensor->numel;
  });
}

FP8_API fp8_status_t fp8_tensor_data(const fp8_tensor_t* tensor, void** data) {
  return guard("fp8_tensor_data", [&] {
    require_arg(tensor, "tensor");
    require_arg(data, "data");
    *data = tensor->data;
  });
}

FP8_API fp8_status_t fp8_tensor_copy_from_host(fp8_tensor_t* tensor, const void* src, size_t bytes) {
  return guard("fp8_tensor_copy_from_host", [&] {
    require_arg(tensor, "tensor");
    if (tensor->write_refusal) fp8::fail(FP8_ERR_INVALID_STATE, tensor->write_refusal);
    require_bytes(tensor, bytes);
    if (bytes) require_arg(src, "src");
    tensor->backend->copy_from_host(tensor->data, src, bytes);
    ++tensor->version;
  });
}

FP8_API fp8_status_t fp8_tensor_copy_to_host(const fp8_tensor_t* tensor, void* dst, size_t bytes) {
  return guard("fp8_tensor_copy_to_host", [&] {
    require_arg(tensor, "tensor");
    require_bytes(tensor, bytes);
    if (bytes) require_arg(dst, "dst");
    tensor->backend->copy_to_host(dst, tensor->data, bytes);
  });
}

FP8_API fp8_status_t fp8_tensor_get_scale_inv(const fp8_tensor_t* tensor, float* scale_inv) {
  return guard("fp8_tensor_get_scale_inv", [&] {
    require_arg(tensor, "tensor");
    require_arg(scale_inv, "scale_inv");
    fp8::require_fp8(tensor, "tensor");
    float value = 0.0f;
    tensor->backend->copy_to_host(&value, tensor->scale_inv, sizeof value);
    *scale_inv = value;
  });
}

FP8_API fp8_status_t fp8_tensor_set_scale_inv(fp8_tensor_t* tensor, float scale_inv) {
  return guard("fp8_tensor_set_scale_inv", [&] {
    require_arg(tensor, "tensor");
    fp8::require_fp8(tensor, "tensor");
    if (tensor->write_refusal) fp8::fail(FP8_ERR_INVALID_STATE, tensor->write_refusal);
    if (!(std::isfinite(scale_inv) && scale_inv > 0.0f))
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "scale_inv = ", scale_inv, "; expected a finite value > 0");
    tensor->backend->copy_from_host(tensor->scale_inv, &scale_inv, sizeof scale_inv);
  });
}

}  // extern "C"
