// Launch helpers shared by every kernel file.
#include <cuda_runtime_api.h>

#include "core/error.hpp"
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

void cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  const fp8_status_t status = err == cudaErrorMemoryAllocation ? FP8_ERR_OUT_OF_MEMORY : FP8_ERR_CUDA;
  fail(status, what, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

int grid_size(const void* kernel, int threads, int64_t work_blocks, int sm_count) {
  int per_sm = 0;
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0), "occupancy query");
  const int64_t full = static_cast<int64_t>(sm_count) * (per_sm > 0 ? per_sm : 1);
  return static_cast<int>(work_blocks < 1 ? 1 : (work_blocks < full ? work_blocks : full));
}

}  // namespace fp8::kernels
