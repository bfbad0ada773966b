// The hardware FP8 conversion the kernels use (cvt.rn.satfinite.{e4m3,e5m2}x2.f32) against the
// library's one definition of the encoding, fp8::encode_fp8, over all 2^32 float inputs, on the GPU.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "core/format.hpp"

namespace {

struct Mismatches {
  unsigned long long count;
  unsigned int first_bits;
};

template <bool E5M2>
__global__ void compare_all(Mismatches* m, uint32_t chunk) {
  const uint64_t base = static_cast<uint64_t>(chunk) << 28;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (1ull << 28);
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    // Two inputs per instruction, as the kernels convert them: the pair (u, u ^ 1).
    const uint32_t u = static_cast<uint32_t>(base + i);
    if (u & 1u) continue;
    const float a = __uint_as_float(u), b = __uint_as_float(u | 1u);
    const __nv_fp8x2_storage_t hw =
        __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
    const uint8_t hw_a = static_cast<uint8_t>(hw & 0xFF), hw_b = static_cast<uint8_t>(hw >> 8);
    if (hw_a != fp8::encode_fp8(a, E5M2) && atomicAdd(&m->count, 1ull) == 0) m->first_bits = u;
    if (hw_b != fp8::encode_fp8(b, E5M2) && atomicAdd(&m->count, 1ull) == 0) m->first_bits = u | 1u;
  }
}

template <bool E5M2>
void run_exhaustive() {
  Mismatches* m = nullptr;
  ASSERT_EQ(cudaMalloc(&m, sizeof *m), cudaSuccess);
  ASSERT_EQ(cudaMemset(m, 0, sizeof *m), cudaSuccess);
  for (uint32_t chunk = 0; chunk < 16; ++chunk) compare_all<E5M2><<<1024, 256>>>(m, chunk);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  Mismatches host{};
  ASSERT_EQ(cudaMemcpy(&host, m, sizeof host, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(m);
  EXPECT_EQ(host.count, 0ull) << "first mismatch at float bits 0x" << std::hex << host.first_bits;
}

TEST(GpuEncoder, HardwareE4M3CastEqualsEncodeFp8OnAll2To32Inputs) { run_exhaustive<false>(); }
TEST(GpuEncoder, HardwareE5M2CastEqualsEncodeFp8OnAll2To32Inputs) { run_exhaustive<true>(); }

}  // namespace
