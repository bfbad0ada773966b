// Activations on the GPU against the CPU reference on the same inputs, forward and backward, every
// input dtype and output dtype (FP8 included), awkward shapes. The two use the same float formulas
// but different tanhf/expf, so the comparison is by relative error, not bit for bit.
#include <cmath>
#include <random>

#include "core/format.hpp"
#include "gpu/gpu_compare.hpp"

using namespace fp8test;

namespace {

TEST(GpuActivation, ForwardAndBackwardMatchTheCpuReference) {
  Context cpu = make_context(FP8_DEVICE_CPU), gpu = make_context(0);
  Recipe recipe = make_recipe();
  const std::vector<std::vector<int64_t>> shapes = {{1, 2}, {3, 1000}, {257, 64}, {2, 3, 40}, {1024, 1024}};
  uint32_t seed = 1;
  for (fp8_activation_t act : {FP8_ACTIVATION_RELU, FP8_ACTIVATION_GELU, FP8_ACTIVATION_SWIGLU}) {
    for (fp8_dtype_t x_dt : {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16}) {
      for (fp8_dtype_t out_dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
        for (const auto& shape : shapes) {
          for (bool backward : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "act " << act << " x " << fp8_dtype_name(x_dt) << " out "
                                              << fp8_dtype_name(out_dt) << " rows " << shape.front() << " cols "
                                              << shape.back() << (backward ? " backward" : " forward"));
            std::vector<int64_t> y_shape = shape;
            if (act == FP8_ACTIVATION_SWIGLU) y_shape.back() /= 2;
            const std::vector<int64_t>& out_shape = backward ? shape : y_shape;
            int64_t n = 1, n_y = 1;
            for (auto d : shape) n *= d;
            for (auto d : y_shape) n_y *= d;
            const auto xb = to_wide_bytes(x_dt, normal_floats(static_cast<size_t>(n), seed++, 0.0f, 2.0f));
            const auto dyb = to_wide_bytes(x_dt, normal_floats(static_cast<size_t>(n_y), seed++, 0.0f, 2.0f));
            Tensor x_c = make_tensor(cpu.get(), x_dt, shape), x_g = make_tensor(gpu.get(), x_dt, shape);
            Tensor dy_c = make_tensor(cpu.get(), x_dt, y_shape), dy_g = make_tensor(gpu.get(), x_dt, y_shape);
            Tensor o_c = make_tensor(cpu.get(), out_dt, out_shape), o_g = make_tensor(gpu.get(), out_dt, out_shape);
            upload(x_c.get(), xb);
            upload(x_g.get(), xb);
            upload(dy_c.get(), dyb);
            upload(dy_g.get(), dyb);
            Scaling s_c, s_g;
            const bool fp8_out = fp8_dtype_size(out_dt) == 1;
            if (fp8_out) {
              const fp8_role_t role = out_dt == FP8_DTYPE_E5M2 ? FP8_ROLE_BACKWARD : FP8_ROLE_FORWARD;
              s_c = make_scaling(cpu.get(), recipe.get(), role);
              s_g = make_scaling(gpu.get(), recipe.get(), role);
              FP8_ASSERT_OK(fp8_scaling_set_scale(s_c.get(), 8.0f));
              FP8_ASSERT_OK(fp8_scaling_set_scale(s_g.get(), 8.0f));
            }
            if (!backward) {
              FP8_ASSERT_OK(fp8_activation_forward(cpu.get(), act, x_c.get(), o_c.get(), s_c.get()));
              FP8_ASSERT_OK(fp8_activation_forward(gpu.get(), act, x_g.get(), o_g.get(), s_g.get()));
            } else {
              FP8_ASSERT_OK(fp8_activation_backward(cpu.get(), act, x_c.get(), dy_c.get(), o_c.get(), s_c.get()));
              FP8_ASSERT_OK(fp8_activation_backward(gpu.get(), act, x_g.get(), dy_g.get(), o_g.get(), s_g.get()));
            }
            // f32: ulps of tanhf/expf; bf16: rare one-ulp flips of the rounding; FP8: rare one-step flips.
            const double bound = out_dt == FP8_DTYPE_F32 ? 1e-6 : out_dt == FP8_DTYPE_BF16 ? 2e-3 : 2e-2;
            EXPECT_LT(relative_error(values(o_g.get()), values(o_c.get())), bound);
            if (fp8_out) {
              const float a_c = info_of(s_c.get()).amax, a_g = info_of(s_g.get()).amax;
              EXPECT_NEAR(a_g, a_c, a_c * 1e-6);
            }
          }
        }
      }
    }
  }
}

}  // namespace
