// Tensors to and from DLPack (fp8.h, "DLPack"): a framework's tensor borrowed, a libfp8 tensor lent,
// through DLPack 0.x's DLManagedTensor or 1.x's DLManagedTensorVersioned.
#include <string>

#include "api/dlpack_versioned.hpp"
#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

// DLPack 1.x: the major version taken (a minor version only adds, keeping the layout), the
// read-only flag, and DLPack 1.1's FP8 type codes (numbers every 1.1 or later header gives them; a
// 0.x header has none).
constexpr uint32_t kDlPackMajor = 1;
constexpr uint64_t kDlReadOnly = uint64_t{1} << 0;
constexpr uint8_t kDlFloat8E4M3fn = 10, kDlFloat8E5M2 = 12;

std::string dl_type_string(DLDataType t) {
  std::string s;
  if (t.bits == 8 && (t.code == kDlFloat8E4M3fn || t.code == kDlFloat8E5M2)) {
    s = t.code == kDlFloat8E4M3fn ? "float8_e4m3fn" : "float8_e5m2";
  } else {
    s = t.code == kDLInt       ? "int"
        : t.code == kDLUInt    ? "uint"
        : t.code == kDLFloat   ? "float"
        : t.code == kDLBfloat  ? "bfloat"
        : t.code == kDLComplex ? "complex"
                               : "code " + std::to_string(t.code) + " ";
    s += std::to_string(t.bits);
  }
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

// `versioned`: DLPack 1.x, whose FP8 type codes 0.x lacks (there FP8 travels as uint8 codes).
fp8_dtype_t from_dl_type(DLDataType t, bool versioned) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) return FP8_DTYPE_F32;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) return FP8_DTYPE_F16;
  if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) return FP8_DTYPE_BF16;
  if (versioned && t.lanes == 1 && t.bits == 8 && t.code == kDlFloat8E4M3fn) return FP8_DTYPE_E4M3;
  if (versioned && t.lanes == 1 && t.bits == 8 && t.code == kDlFloat8E5M2) return FP8_DTYPE_E5M2;
  if (versioned)
    fp8::fail(FP8_ERR_DTYPE, "the DLPack tensor's dtype is ", dl_type_string(t),
              "; expected float32, float16, bfloat16, float8_e4m3fn or float8_e5m2");
  fp8::fail(FP8_ERR_DTYPE, "the DLPack tensor's dtype is ", dl_type_string(t),
            "; expected float32, float16 or bfloat16 (FP8 codes travel as uint8: wrap them with fp8_tensor_wrap "
            "and FP8_DTYPE_E4M3 or E5M2, or pass a DLPack 1.x tensor of float8_e4m3fn or float8_e5m2 to "
            "fp8_tensor_from_dlpack_versioned)");
}

DLDataType to_dl_type(fp8_dtype_t d, bool versioned) {
  switch (d) {
    case FP8_DTYPE_F32:
      return {kDLFloat, 32, 1};
    case FP8_DTYPE_F16:
      return {kDLFloat, 16, 1};
    case FP8_DTYPE_BF16:
      return {kDLBfloat, 16, 1};
    case FP8_DTYPE_E4M3:
      return versioned ? DLDataType{kDlFloat8E4M3fn, 8, 1} : DLDataType{kDLUInt, 8, 1};
    default:  // E5M2
      return versioned ? DLDataType{kDlFloat8E5M2, 8, 1} : DLDataType{kDLUInt, 8, 1};
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

// A producer's tensor borrowed (either struct): the checks (fp8.h) and a tensor over its memory,
// which the caller makes the managed struct's owner once nothing can fail.
std::unique_ptr<fp8_tensor> borrow(fp8_context_t* ctx, const DLTensor& dl, bool versioned) {
  const int32_t device = ctx->backend->device();
  const bool on_device = device == FP8_DEVICE_CPU
                             ? dl.device.device_type == kDLCPU || dl.device.device_type == kDLCUDAHost
                             : (dl.device.device_type == kDLCUDA || dl.device.device_type == kDLCUDAManaged) &&
                                   dl.device.device_id == device;
  if (!on_device)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "the DLPack tensor is on ", device_string(dl.device), "; expected ",
              device == FP8_DEVICE_CPU ? std::string("host memory (kDLCPU) for a CPU context")
                                       : "kDLCUDA " + std::to_string(device) + ", the context's device");
  const fp8_dtype_t dtype = from_dl_type(dl.dtype, versioned);
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
  return fp8::make_tensor(ctx->backend, dtype, dl.ndim, dl.shape, true, data);
}

// The owner of a borrowed managed struct: runs its deleter once, when the last holder lets go.
template <class Managed>
struct Owner {
  explicit Owner(Managed* m) : managed(m) {}
  Owner(const Owner&) = delete;
  Owner& operator=(const Owner&) = delete;
  ~Owner() {
    if (managed->deleter) managed->deleter(managed);
  }
  Managed* managed;
};

// From here the tensor owns `managed`. (The owner is made before the tensor takes it: a
// shared_ptr made from the pointer and a deleter would run the deleter if its own allocation
// failed, and the caller keeps `managed` on failure.)
template <class Managed>
fp8_tensor_t* own(std::unique_ptr<fp8_tensor> t, Managed* managed) {
  auto owner = std::make_shared<Owner<Managed>>(managed);
  t->keeper = std::shared_ptr<void>(owner, managed);
  return t.release();
}

// A DLPack tensor lent by libfp8 (either struct): the managed struct, its shape and strides, and the
// memory's keeper.
template <class Managed>
struct Lent {
  Managed managed{};
  int64_t shape[FP8_MAX_DIMS] = {};
  int64_t strides[FP8_MAX_DIMS] = {};
  std::shared_ptr<void> keeper;
};

template <class Managed>
Managed* lend(const fp8_tensor_t* tensor, bool versioned) {
  auto lent = std::make_unique<Lent<Managed>>();
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
  dl.dtype = to_dl_type(tensor->dtype, versioned);
  dl.shape = lent->shape;
  dl.strides = lent->strides;
  dl.byte_offset = 0;
  lent->managed.manager_ctx = lent.get();
  lent->managed.deleter = [](Managed* m) { delete static_cast<Lent<Managed>*>(m->manager_ctx); };
  return &lent.release()->managed;
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_tensor_from_dlpack(fp8_tensor_t** out, fp8_context_t* ctx, DLManagedTensor* managed) {
  return guard("fp8_tensor_from_dlpack", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    require_arg(managed, "managed");
    *out = own(borrow(ctx, managed->dl_tensor, false), managed);
  });
}

FP8_API fp8_status_t fp8_tensor_from_dlpack_versioned(fp8_tensor_t** out, fp8_context_t* ctx,
                                                      DLManagedTensorVersioned* managed) {
  return guard("fp8_tensor_from_dlpack_versioned", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    require_arg(managed, "managed");
    if (managed->version.major != kDlPackMajor)
      fp8::fail(FP8_ERR_VERSION, "the DLPack tensor's version is ", managed->version.major, ".", managed->version.minor,
                "; expected 1.x (a DLPack 0.x tensor goes to fp8_tensor_from_dlpack)");
    if (managed->flags & kDlReadOnly)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "the DLPack tensor is read-only (DLPACK_FLAG_BITMASK_READ_ONLY); ",
                "expected a writable one: libfp8 tensors may be written by any call they are passed to");
    *out = own(borrow(ctx, managed->dl_tensor, true), managed);
  });
}

FP8_API fp8_status_t fp8_tensor_to_dlpack(const fp8_tensor_t* tensor, DLManagedTensor** out) {
  return guard("fp8_tensor_to_dlpack", [&] {
    require_arg(tensor, "tensor");
    require_arg(out, "out");
    *out = lend<DLManagedTensor>(tensor, false);
  });
}

FP8_API fp8_status_t fp8_tensor_to_dlpack_versioned(const fp8_tensor_t* tensor, DLManagedTensorVersioned** out) {
  return guard("fp8_tensor_to_dlpack_versioned", [&] {
    require_arg(tensor, "tensor");
    require_arg(out, "out");
    DLManagedTensorVersioned* m = lend<DLManagedTensorVersioned>(tensor, true);
    m->version = {kDlPackMajor, 1};  // 1.1: the first with FP8 type codes
    m->flags = 0;
    *out = m;
  });
}

}  // extern "C"
