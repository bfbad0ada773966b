// Version, status strings, the per-thread error message, dtypes and the scalar conversions.
#include "api/guard.hpp"
#include "core/format.hpp"

#define FP8_STR2(x) #x
#define FP8_STR(x) FP8_STR2(x)

extern "C" {

FP8_API uint32_t fp8_version_number(void) { return FP8_VERSION_NUMBER; }

FP8_API const char* fp8_version_string(void) {
  return FP8_STR(FP8_VERSION_MAJOR) "." FP8_STR(FP8_VERSION_MINOR) "." FP8_STR(FP8_VERSION_PATCH);
}

FP8_API const char* fp8_status_string(fp8_status_t status) {
  switch (status) {
    case FP8_OK: return "FP8_OK";
    case FP8_ERR_INVALID_ARGUMENT: return "FP8_ERR_INVALID_ARGUMENT";
    case FP8_ERR_DTYPE: return "FP8_ERR_DTYPE";
    case FP8_ERR_SHAPE: return "FP8_ERR_SHAPE";
    case FP8_ERR_INVALID_STATE: return "FP8_ERR_INVALID_STATE";
    case FP8_ERR_OUT_OF_MEMORY: return "FP8_ERR_OUT_OF_MEMORY";
    case FP8_ERR_CUDA: return "FP8_ERR_CUDA";
    case FP8_ERR_CUBLAS: return "FP8_ERR_CUBLAS";
    case FP8_ERR_NCCL: return "FP8_ERR_NCCL";
    case FP8_ERR_UNSUPPORTED: return "FP8_ERR_UNSUPPORTED";
    case FP8_ERR_IO: return "FP8_ERR_IO";
    case FP8_ERR_CORRUPT: return "FP8_ERR_CORRUPT";
    case FP8_ERR_VERSION: return "FP8_ERR_VERSION";
    case FP8_ERR_BUFFER_TOO_SMALL: return "FP8_ERR_BUFFER_TOO_SMALL";
    case FP8_ERR_NO_DEVICE: return "FP8_ERR_NO_DEVICE";
    case FP8_ERR_INTERNAL: return "FP8_ERR_INTERNAL";
    default: return "FP8_ERR_UNKNOWN";
  }
}

FP8_API const char* fp8_last_error_message(void) { return fp8::last_error(); }

FP8_API size_t fp8_dtype_size(fp8_dtype_t dtype) { return fp8::dtype_size(dtype); }
FP8_API const char* fp8_dtype_name(fp8_dtype_t dtype) { return fp8::dtype_name(dtype); }

FP8_API uint8_t fp8_encode(float x, fp8_dtype_t dtype) {
  if (!fp8::dtype_is_fp8(dtype)) return 0;
  return fp8::encode_fp8(x, dtype == FP8_DTYPE_E5M2);
}

FP8_API float fp8_decode(uint8_t code, fp8_dtype_t dtype) {
  if (!fp8::dtype_is_fp8(dtype)) return fp8::bits_float(0x7FC00000u);
  return fp8::decode_fp8(code, dtype == FP8_DTYPE_E5M2);
}

}  // extern "C"
