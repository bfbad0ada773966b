#include "backend/device_info.hpp"

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>

#include "core/error.hpp"
#include "kernels/launch.hpp"

namespace fp8 {

int32_t cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

void query_device(int32_t device, fp8_device_info_t* info) {
  info->device = device;
  info->cublaslt_version = static_cast<int64_t>(cublasLtGetVersion());
  int nccl = 0;
  info->nccl_version = ncclGetVersion(&nccl) == ncclSuccess ? nccl : 0;
  if (device == FP8_DEVICE_CPU) {
    std::snprintf(info->name, sizeof info->name, "%s", "CPU reference backend");
    return;
  }
  const int32_t count = cuda_device_count();
  if (device < 0 || device >= count)
    fail(FP8_ERR_NO_DEVICE, "device ", device, " does not exist; ", count,
         " CUDA device(s) visible, so expected FP8_DEVICE_CPU (-1) or 0..", count - 1);
  cudaDeviceProp prop{};
  kernels::cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::snprintf(info->name, sizeof info->name, "%s", prop.name);
  info->compute_capability = prop.major * 10 + prop.minor;
  info->multiprocessor_count = prop.multiProcessorCount;
  info->total_memory_bytes = prop.totalGlobalMem;
  info->fp8_gemm = info->compute_capability >= 89;
  info->fp8_block_scaling = fp8_block_scaling_supported(info->compute_capability, info->cublaslt_version);
  // NCCL reduces ncclFloat8e4m3/e5m2 from 2.24 on, on sm_90 and newer.
  info->fp8_nccl_reduction = info->nccl_version >= 22400 && info->compute_capability >= 90;
}

}  // namespace fp8
