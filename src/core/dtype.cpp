#include "core/dtype.hpp"

#include <sstream>

namespace fp8 {

bool dtype_valid(fp8_dtype_t dt) { return dt >= FP8_DTYPE_F32 && dt <= FP8_DTYPE_E5M2; }

size_t dtype_size(fp8_dtype_t dt) {
  switch (dt) {
    case FP8_DTYPE_F32: return 4;
    case FP8_DTYPE_F16:
    case FP8_DTYPE_BF16: return 2;
    case FP8_DTYPE_E4M3:
    case FP8_DTYPE_E5M2: return 1;
    default: return 0;
  }
}

const char* dtype_name(fp8_dtype_t dt) {
  switch (dt) {
    case FP8_DTYPE_F32: return "f32";
    case FP8_DTYPE_F16: return "f16";
    case FP8_DTYPE_BF16: return "bf16";
    case FP8_DTYPE_E4M3: return "e4m3";
    case FP8_DTYPE_E5M2: return "e5m2";
    default: return "unknown";
  }
}

std::string shape_string(int32_t ndim, const int64_t* shape) {
  std::ostringstream os;
  os << '[';
  for (int32_t i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

}  // namespace fp8
