// Tensors to and from DLPack (fp8.h, "DLPack"): a framework's tensor borrowed, a libfp8 tensor lent.
#include <dlpack/dlpack.h>

#include <string>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

std::string dl_type_string(DLDataType t) {
  const char* code = t.code == kDLInt       ? "int"
                     : t.code == kDLUInt    ? "uint"
                     : t.code == kDLFloat   ? "float"
                     : t.code == kDLBfloat  ? "bfloat"
                     : t.code == kDLComplex ? "complex"
                                            : "code ";
  std::string s = code;
  if (t.code > kDLComplex) s += std::to_string(t.code) + " ";
  s += std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

fp8_dtype_t from_dl_type(DLDataType t) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) return FP8_DTYPE_F32;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) return FP8_DTYPE_F16;
  if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) return FP8_DTYPE_BF16;
  fp8::fail(FP8_ERR_DTYPE, "the DLPack tensor's dtype is ", dl_type_string(t),
            "; expected float32, float16 or bfloat16 (FP8 codes travel as uint8: wrap them with fp8_tensor_wrap "
            "and FP8_DTYPE_E4M3 or E5M2)");
}

DLDataType to_dl_type(fp8_dtype_t d) {
  switch (d) {
    case FP8_DTYPE_F32:
      return {kDLFloat, 32, 1};
    case FP8_DTYPE_F16:
      return {kDLFloat, 16, 1};
    case FP8_DTYPE_BF16:
      return {kDLBfloat, 16, 1};
    default:  // E4M3, E5M2: the codes
      return {kDLUInt, 8, 1};
  }
}

std::string device_string(DLDevice d) {
  const char* type = d.device_type == kDLCPU           ? "kDLCPU"
                     : d.device_type == kDLCUDA        ? "kDLCUDA"
                     : d.device_type == kDLCUDAHost    ? "kDLCUDAHost"
                     : d.device_type == kDLCUDAManaged ? "kDLCUDAManaged"
                                                       : nullptr;
  std::string s = type ? type : "device type " + std::to_string(d.device_type);
  return s + " " + std::to_string(d.device_id);
}

// A DLPack tensor lent by libfp8: the managed struct, its shape and strides, and the memory's keeper.
struct Lent {
  DLManagedTensor managed{};
  int64_t shape[FP8_MAX_DIMS] = {};
  int64_t strides[FP8_MAX_DIMS] = {};
  std::shared_ptr<void> keeper;
};

void delete_lent(DLManagedTensor* m) {
  delete static_cast<Lent*>(m->manager_ctx);
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_tensor_from_dlpack(fp8_tensor_t** out, fp8_context_t* ctx, DLManagedTensor* managed) {
  return guard("fp8_tensor_from_dlpack", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    require_arg(managed, "managed");
    const DLTensor& dl = managed->dl_tensor;
    const int32_t device = ctx->backend->device();
    const bool on_device = device == FP8_DEVICE_CPU
                               ? dl.device.device_type == kDLCPU || dl.device.device_type == kDLCUDAHost
                               : (dl.device.device_type == kDLCUDA || dl.device.device_type == kDLCUDAManaged) &&
                                     dl.device.device_id == device;
    if (!on_device)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "the DLPack tensor is on ", device_string(dl.device), "; expected ",
                device == FP8_DEVICE_CPU ? std::string("host memory (kDLCPU) for a CPU context")
                                         : "kDLCUDA " + std::to_string(device) + ", the context's device");
    const fp8_dtype_t dtype = from_dl_type(dl.dtype);
    if (dl.ndim < 0 || dl.ndim > FP8_MAX_DIMS)
      fp8::fail(FP8_ERR_SHAPE, "the DLPack tensor has ", dl.ndim, " dimensions; expected 0..", FP8_MAX_DIMS);
    if (dl.ndim > 0) require_arg(dl.shape, "managed->dl_tensor.shape");
    // Row-major and compact: each stride is the product of the later sizes (free where a size is 1,
    // and everywhere in an empty tensor, which torch exports with strides such as [1, 1]).
    bool empty = false;
    for (int32_t i = 0; i < dl.ndim; ++i) empty = empty || dl.shape[i] == 0;
    if (dl.strides && !empty) {
      int64_t expect = 1;
      for (int32_t i = dl.ndim - 1; i >= 0; --i) {
        if (dl.shape[i] != 1 && dl.strides[i] != expect)
          fp8::fail(FP8_ERR_SHAPE, "the DLPack tensor's strides are ", fp8::shape_string(dl.ndim, dl.strides),
                    " (elements) for shape ", fp8::shape_string(dl.ndim, dl.shape),
                    "; expected a contiguous row-major tensor (make it contiguous first)");
        expect *= dl.shape[i];
      }
    }
    void* data = static_cast<char*>(dl.data) + dl.byte_offset;
    auto t = fp8::make_tensor(ctx->backend, dtype, dl.ndim, dl.shape, true, data);
    // From here the tensor owns `managed`: its deleter runs when the last holder lets go.
    t->keeper = std::shared_ptr<void>(managed, [](void* p) {
      auto* m = static_cast<DLManagedTensor*>(p);
      if (m->deleter) m->deleter(m);
    });
    *out = t.release();
  });
}

FP8_API fp8_status_t fp8_tensor_to_dlpack(const fp8_tensor_t* tensor, DLManagedTensor** out) {
  return guard("fp8_tensor_to_dlpack", [&] {
    require_arg(tensor, "tensor");
    require_arg(out, "out");
    auto lent = std::make_unique<Lent>();
    lent->keeper = tensor->keeper;
    int64_t stride = 1;
    for (int32_t i = tensor->ndim - 1; i >= 0; --i) {
      lent->shape[i] = tensor->shape[i];
      lent->strides[i] = stride;
      stride *= tensor->shape[i];
    }
    DLTensor& dl = lent->managed.dl_tensor;
    dl.data = tensor->data;
    const int32_t device = tensor->backend->device();
    dl.device = device == FP8_DEVICE_CPU ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, device};
    dl.ndim = tensor->ndim;
    dl.dtype = to_dl_type(tensor->dtype);
    dl.shape = lent->shape;
    dl.strides = lent->strides;
    dl.byte_offset = 0;
    lent->managed.manager_ctx = lent.get();
    lent->managed.deleter = delete_lent;
    *out = &lent.release()->managed;
  });
}

}  // extern "C"
