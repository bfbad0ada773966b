// Robustness of the C ABI at its edges, on the CPU reference backend: what fp8_device_query reports
// for each architecture, versioned structs of every size from their first release on, tensors the
// library lends, the recipe keys the header documents, and the limits of the norm layers.
#include <gtest/gtest.h>

#include "backend/device_info.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

// ---- fp8_device_query: fp8_block_scaling --------------------------------------------------------

TEST(DeviceInfo, BlockScalingOnHopperNeedsCublasLt129AndIsAlwaysOnBlackwell) {
  // Hopper: cuBLASLt runs 1x128 / 128x128 block scales from 12.9 (cublasLtGetVersion() 120900) on.
  EXPECT_TRUE(fp8::fp8_block_scaling_supported(90, 120900));
  EXPECT_TRUE(fp8::fp8_block_scaling_supported(90, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(90, 120805));
  // sm_100 and newer: with any cuBLASLt.
  EXPECT_TRUE(fp8::fp8_block_scaling_supported(100, 120800));
  EXPECT_TRUE(fp8::fp8_block_scaling_supported(120, 130000));
  // Ada and older: never.
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(89, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(80, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(0, 130100));  // the CPU backend
}

TEST(DeviceInfo, TheCpuBackendReportsNoBlockScaling) {
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  info.fp8_block_scaling = 7;
  FP8_ASSERT_OK(fp8_device_query(FP8_DEVICE_CPU, &info));
  EXPECT_EQ(info.fp8_block_scaling, 0);
  EXPECT_GT(info.cublaslt_version, 0);
}

}  // namespace
