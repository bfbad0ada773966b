// Device discovery for fp8_device_count / fp8_device_query.
#pragma once

#include "fp8.h"

namespace fp8 {

int32_t cuda_device_count();  // 0 without a driver or GPU
// Fills every field of `info` but struct_size; throws FP8_ERR_NO_DEVICE for a bad ordinal.
void query_device(int32_t device, fp8_device_info_t* info);

}  // namespace fp8
