// Entry point of the GPU suite: runs the tests on CUDA device 0 when it can run FP8, and otherwise
// exits 77, which CTest reports as "skipped" (never as passed).
#include <gtest/gtest.h>

#include <cstdio>

#include "fp8.h"

int main(int argc, char** argv) {
  int32_t count = 0;
  fp8_device_count(&count);
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  if (count == 0 || fp8_device_query(0, &info) != FP8_OK || !info.fp8_gemm) {
    std::printf("GPU suite skipped: no CUDA device of compute capability 8.9+ (found %d device(s))\n", count);
    return 77;
  }
  std::printf("GPU suite on %s (sm_%d, %d SMs), cuBLASLt %lld, NCCL %d\n", info.name, info.compute_capability,
              info.multiprocessor_count, static_cast<long long>(info.cublaslt_version), info.nccl_version);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
