// fp8_gemm on the GPU (cuBLASLt) against the CPU reference on the same operands: relative error
// ||gpu - cpu|| / ||cpu|| within the bound each output type allows, for every type combination,
// bias, accumulation, fast accumulation, FP8 output with its amax, and shapes with odd m.
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>

#include "core/format.hpp"
#include "gpu/gpu_compare.hpp"

using namespace fp8test;

namespace {

// The same random operand on both backends.
std::pair<Tensor, Tensor> twin(fp8_context_t* cpu, fp8_context_t* gpu, fp8_dtype_t dt, int64_t rows, int64_t cols,
                               float scale_inv, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensor c = make_tensor(cpu, dt, {rows, cols}), g = make_tensor(gpu, dt, {rows, cols});
  if (fp8_dtype_size(dt) > 1) {
    const auto raw = to_wide_bytes(dt, normal_floats(static_cast<size_t>(rows * cols), seed));
    upload(c.get(), raw);
    upload(g.get(), raw);
  } else {
    std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
    for (auto& q : codes) q = fp8_encode(normal(rng) * 32.0f, dt);
    upload(c.get(), codes);
    upload(g.get(), codes);
    EXPECT_EQ(fp8_tensor_set_scale_inv(c.get(), scale_inv), FP8_OK);
    EXPECT_EQ(fp8_tensor_set_scale_inv(g.get(), scale_inv), FP8_OK);
  }
  return {std::move(c), std::move(g)};
}

struct Case {
  fp8_dtype_t a, b, d;
  int64_t m, n, k;
  bool bias, accumulate, fast;
  double bound;  // relative error allowed
};

class GpuGemm : public ::testing::TestWithParam<Case> {
 protected:
  Context cpu = make_context(FP8_DEVICE_CPU);
  Context gpu = make_context(0);
};

TEST_P(GpuGemm, MatchesTheCpuReference) {
  const Case c = GetParam();
  auto [a_c, a_g] = twin(cpu.get(), gpu.get(), c.a, c.m, c.k, 1.0f / 64, 11);
  auto [b_c, b_g] = twin(cpu.get(), gpu.get(), c.b, c.n, c.k, 1.0f / 32, 12);
  Tensor bias_c, bias_g;
  const fp8_dtype_t bias_dt = fp8_dtype_size(c.a) == 1 ? FP8_DTYPE_BF16 : c.d;
  if (c.bias) {
    const auto raw = to_wide_bytes(bias_dt, normal_floats(static_cast<size_t>(c.n), 13, 0.0f, 1.0f));
    bias_c = make_tensor(cpu.get(), bias_dt, {c.n});
    bias_g = make_tensor(gpu.get(), bias_dt, {c.n});
    upload(bias_c.get(), raw);
    upload(bias_g.get(), raw);
  }
  Tensor d_c = make_tensor(cpu.get(), c.d, {c.m, c.n}), d_g = make_tensor(gpu.get(), c.d, {c.m, c.n});
  if (c.accumulate) {
    auto [start_c, start_g] = twin(cpu.get(), gpu.get(), FP8_DTYPE_BF16, c.m, c.n, 1, 14);
    const auto raw = download<uint16_t>(start_c.get());
    std::vector<uint8_t> bytes(static_cast<size_t>(c.m * c.n) * fp8_dtype_size(c.d));
    for (size_t i = 0; i < raw.size(); ++i) {
      if (c.d == FP8_DTYPE_F32) {
        const float v = fp8::bf16_to_float(raw[i]);
        std::memcpy(&bytes[i * 4], &v, 4);
      } else {
        std::memcpy(&bytes[i * 2], &raw[i], 2);
      }
    }
    upload(d_c.get(), bytes);
    upload(d_g.get(), bytes);
  } else {
    upload(d_g.get(), std::vector<uint8_t>(static_cast<size_t>(c.m * c.n) * fp8_dtype_size(c.d), 0xCD));  // poison
  }
  Recipe recipe = make_recipe();
  Scaling s_c, s_g;
  const bool fp8_out = fp8_dtype_size(c.d) == 1;
  if (fp8_out) {
    const fp8_role_t role = c.d == FP8_DTYPE_E5M2 ? FP8_ROLE_BACKWARD : FP8_ROLE_FORWARD;
    s_c = make_scaling(cpu.get(), recipe.get(), role);
    s_g = make_scaling(gpu.get(), recipe.get(), role);
    FP8_ASSERT_OK(fp8_scaling_set_scale(s_c.get(), 0.75f));
    FP8_ASSERT_OK(fp8_scaling_set_scale(s_g.get(), 0.75f));
  }
  fp8_gemm_options_t opts;
  fp8_gemm_options_init(&opts);
  opts.accumulate = c.accumulate;
  opts.fast_accumulation = c.fast;
  opts.alpha = 1.5f;
  FP8_ASSERT_OK(fp8_gemm(cpu.get(), a_c.get(), b_c.get(), bias_c.get(), d_c.get(), s_c.get(), &opts));
  FP8_ASSERT_OK(fp8_gemm(gpu.get(), a_g.get(), b_g.get(), bias_g.get(), d_g.get(), s_g.get(), &opts));
  FP8_ASSERT_OK(fp8_context_synchronize(gpu.get()));
  const double err = relative_error(values(d_g.get()), values(d_c.get()));
  EXPECT_LT(err, c.bound) << fp8_dtype_name(c.a) << " x " << fp8_dtype_name(c.b) << " -> " << fp8_dtype_name(c.d)
                          << " m=" << c.m << " n=" << c.n << " k=" << c.k;
  std::printf("  %s x %s -> %s  m=%lld n=%lld k=%lld bias=%d acc=%d fast=%d  rel err %.2e (bound %.0e)\n",
              fp8_dtype_name(c.a), fp8_dtype_name(c.b), fp8_dtype_name(c.d), (long long)c.m, (long long)c.n,
              (long long)c.k, c.bias, c.accumulate, c.fast, err, c.bound);
  if (fp8_out) {
    const float amax_c = info_of(s_c.get()).amax, amax_g = info_of(s_g.get()).amax;
    // The amax is of the unrounded product, so it carries the accumulation error (measured 9e-5).
    EXPECT_NEAR(amax_g, amax_c, amax_c * 1e-3) << "amax of the output";
  }
}

// Bounds. BF16 operands with an f32 output: only the summation order differs (1e-5). FP8 operands:
// Hopper's FP8 tensor cores add products with fewer than fp32's 24 significant bits and cuBLASLt
// promotes partial sums to fp32 only periodically (measured on an H100: 3e-5 to 1.3e-4, so 5e-4);
// fast accumulation never promotes (measured 8.5e-4 at k=2048, so 3e-3). A bf16 output adds one
// bf16 rounding (5e-3 in norm); an FP8 output one E4M3 rounding (0.07).
INSTANTIATE_TEST_SUITE_P(
    Cases, GpuGemm,
    ::testing::Values(Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_F32, 128, 256, 512, false, false, false, 5e-4},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_BF16, 1000, 512, 1024, false, false, false, 5e-3},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_BF16, 333, 64, 4096, true, false, true, 5e-3},
                      Case{FP8_DTYPE_E5M2, FP8_DTYPE_E4M3, FP8_DTYPE_BF16, 256, 128, 256, true, false, false, 5e-3},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E5M2, FP8_DTYPE_F32, 96, 160, 272, false, true, false, 5e-4},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_F32, 17, 16, 16, true, true, false, 5e-4},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_F32, 512, 512, 2048, false, false, true, 3e-3},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, 256, 256, 256, false, false, false, 0.07},
                      Case{FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, FP8_DTYPE_E4M3, 200, 128, 512, true, false, true, 0.07},
                      Case{FP8_DTYPE_BF16, FP8_DTYPE_BF16, FP8_DTYPE_BF16, 300, 200, 100, true, false, false, 5e-3},
                      Case{FP8_DTYPE_BF16, FP8_DTYPE_BF16, FP8_DTYPE_F32, 64, 48, 40, true, true, false, 1e-5},
                      Case{FP8_DTYPE_BF16, FP8_DTYPE_BF16, FP8_DTYPE_F32, 7, 9, 13, false, false, false, 1e-5},
                      // The Linear's backward: dgrad e5m2 x e4m3 -> bf16, wgrad accumulated into f32.
                      Case{FP8_DTYPE_E5M2, FP8_DTYPE_E4M3, FP8_DTYPE_BF16, 256, 384, 192, false, false, false, 5e-3},
                      Case{FP8_DTYPE_E5M2, FP8_DTYPE_E4M3, FP8_DTYPE_F32, 192, 384, 256, false, true, false, 5e-4},
                      Case{FP8_DTYPE_F32, FP8_DTYPE_F32, FP8_DTYPE_F32, 70, 33, 129, true, true, false, 1e-6},
                      Case{FP8_DTYPE_F16, FP8_DTYPE_F16, FP8_DTYPE_F16, 64, 80, 96, true, false, false, 2e-3}));

// cuBLASLt assumes 256-byte aligned matrices unless told; wrapped tensors at 16-byte offsets must
// get an algorithm that works for them (and the same answer).
TEST(GpuGemmAlignment, Fp8OperandsAndOutputAt16ByteOffsetsMatchTheCpuReference) {
  Context cpu = make_context(FP8_DEVICE_CPU), gpu = make_context(0);
  const int64_t m = 64, n = 96, k = 128;
  auto [a_c, a_own] = twin(cpu.get(), gpu.get(), FP8_DTYPE_E4M3, m, k, 1.0f / 64, 21);
  auto [b_c, b_own] = twin(cpu.get(), gpu.get(), FP8_DTYPE_E4M3, n, k, 1.0f / 32, 22);
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 1 << 20), cudaSuccess);
  char* base = static_cast<char*>(buf);
  void *pa = nullptr, *pb = nullptr;
  FP8_ASSERT_OK(fp8_tensor_data(a_own.get(), &pa));
  FP8_ASSERT_OK(fp8_tensor_data(b_own.get(), &pb));
  ASSERT_EQ(cudaMemcpy(base + 16, pa, m * k, cudaMemcpyDeviceToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(base + 65536 + 48, pb, n * k, cudaMemcpyDeviceToDevice), cudaSuccess);
  const int64_t sa[2] = {m, k}, sb[2] = {n, k}, sd[2] = {m, n};
  fp8_tensor_t *a_g = nullptr, *b_g = nullptr, *d_g = nullptr;
  FP8_ASSERT_OK(fp8_tensor_wrap(&a_g, gpu.get(), FP8_DTYPE_E4M3, 2, sa, base + 16));
  FP8_ASSERT_OK(fp8_tensor_wrap(&b_g, gpu.get(), FP8_DTYPE_E4M3, 2, sb, base + 65536 + 48));
  FP8_ASSERT_OK(fp8_tensor_wrap(&d_g, gpu.get(), FP8_DTYPE_BF16, 2, sd, base + 131072 + 16));
  Tensor hold_a(a_g), hold_b(b_g), hold_d(d_g);
  FP8_ASSERT_OK(fp8_tensor_set_scale_inv(a_g, 1.0f / 64));
  FP8_ASSERT_OK(fp8_tensor_set_scale_inv(b_g, 1.0f / 32));
  Tensor d_c = make_tensor(cpu.get(), FP8_DTYPE_BF16, {m, n});
  FP8_ASSERT_OK(fp8_gemm(cpu.get(), a_c.get(), b_c.get(), nullptr, d_c.get(), nullptr, nullptr));
  FP8_ASSERT_OK(fp8_gemm(gpu.get(), a_g, b_g, nullptr, d_g, nullptr, nullptr));
  FP8_ASSERT_OK(fp8_context_synchronize(gpu.get()));
  EXPECT_LT(relative_error(values(d_g), values(d_c.get())), 5e-3);
  hold_a.reset();
  hold_b.reset();
  hold_d.reset();
  cudaFree(buf);
}

}  // namespace
