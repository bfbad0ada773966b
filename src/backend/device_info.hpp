// Device discovery for fp8_device_count / fp8_device_query.
#pragma once

#include <cstdint>

#include "fp8.h"

namespace fp8 {

// cuBLASLt runs FP8 GEMMs with per-row (OUTER_VEC_32F), 1x128 (VEC128_32F) and 128x128
// (BLK128x128_32F) scales on Hopper (sm_90) only, from 12.9 on (cublasLtGetVersion() 120900);
// Blackwell's block-scaled FP8 is MXFP8, another format (cuBLASLt refuses these modes there).
constexpr int64_t kCublasLtHopperBlockScalingVersion = 120900;
constexpr bool fp8_block_scaling_supported(int32_t compute_capability, int64_t cublaslt_version) {
  return compute_capability == 90 && cublaslt_version >= kCublasLtHopperBlockScalingVersion;
}

int32_t cuda_device_count();  // 0 without a driver or GPU
// Fills every field of `info` but struct_size; throws FP8_ERR_NO_DEVICE for a bad ordinal.
void query_device(int32_t device, fp8_device_info_t* info);

}  // namespace fp8
