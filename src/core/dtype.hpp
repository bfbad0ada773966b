// Facts about fp8_dtype_t values, and the shape arithmetic every tensor check uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fp8.h"

namespace fp8 {

bool dtype_valid(fp8_dtype_t dt);
size_t dtype_size(fp8_dtype_t dt);  // 0 for an invalid value
const char* dtype_name(fp8_dtype_t dt);
inline bool dtype_is_fp8(fp8_dtype_t dt) { return dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2; }
inline bool dtype_is_wide(fp8_dtype_t dt) {
  return dt == FP8_DTYPE_F32 || dt == FP8_DTYPE_F16 || dt == FP8_DTYPE_BF16;
}

// "[4, 8]"
std::string shape_string(int32_t ndim, const int64_t* shape);

}  // namespace fp8
