// LayerNorm / RMSNorm on the GPU against the CPU reference (float statistics against double):
// forward outputs in every dtype (FP8 included) with the saved statistics, and the backward's dx,
// dgamma and dbeta, on awkward shapes: the vector kernels (d a multiple of 8 up to 8192, aligned
// buffers: 1, 2 and 4 groups of 8 columns per thread), the element kernels (rows held in registers
// up to d = 2048, re-read up to 8192), and the two-kernel backward of wider rows (d > 8192), each
// side of every limit; and misaligned buffers, which take the element kernels.
#include <cmath>
#include <random>

#include "core/format.hpp"
#include "gpu/gpu_compare.hpp"

using namespace fp8test;

namespace {

TEST(GpuNorm, ForwardAndBackwardMatchTheCpuReference) {
  Context cpu = make_context(FP8_DEVICE_CPU), gpu = make_context(0);
  Recipe recipe = make_recipe();
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 1},    {3, 1000}, {257, 64}, {2, 3, 40}, {128, 4096}, {2048, 1024}, {1000, 3000}, {3, 9000},
      {5, 2048}, {7, 2049}, {4, 8192}, {3, 8193},  {9, 2056},   {6, 4104},    {33, 8},      {2, 7}};
  uint32_t seed = 1;
  for (fp8_norm_t kind : {FP8_NORM_LAYERNORM, FP8_NORM_RMSNORM}) {
    const bool rms = kind == FP8_NORM_RMSNORM;
    for (fp8_dtype_t x_dt : {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16}) {
      for (const auto& shape : shapes) {
        const int64_t d = shape.back();
        int64_t n = 1;
        for (auto s : shape) n *= s;
        const int64_t rows = n / d;
        SCOPED_TRACE(::testing::Message() << (rms ? "rmsnorm" : "layernorm") << " x " << fp8_dtype_name(x_dt) << " rows "
                                          << rows << " d " << d);
        const auto xb = to_wide_bytes(x_dt, normal_floats(static_cast<size_t>(n), seed++, 2.0f, 1.5f));
        const auto dyb = to_wide_bytes(x_dt, normal_floats(static_cast<size_t>(n), seed++, 0.0f, 1.5f));
        const auto gb = to_wide_bytes(FP8_DTYPE_F32, normal_floats(static_cast<size_t>(d), seed++, 1.0f, 1.5f));
        const auto bb = to_wide_bytes(FP8_DTYPE_F32, normal_floats(static_cast<size_t>(d), seed++, 0.0f, 1.5f));
        auto twin = [&](fp8_dtype_t dt, const std::vector<int64_t>& s, const std::vector<uint8_t>* bytes) {
          std::pair<Tensor, Tensor> t{make_tensor(cpu.get(), dt, s), make_tensor(gpu.get(), dt, s)};
          if (bytes) {
            upload(t.first.get(), *bytes);
            upload(t.second.get(), *bytes);
          }
          return t;
        };
        auto [x_c, x_g] = twin(x_dt, shape, &xb);
        auto [dy_c, dy_g] = twin(x_dt, shape, &dyb);
        auto [g_c, g_g] = twin(FP8_DTYPE_F32, {d}, &gb);
        auto [b_c, b_g] = twin(FP8_DTYPE_F32, {d}, &bb);
        auto [m_c, m_g] = twin(FP8_DTYPE_F32, {rows}, nullptr);
        auto [s_c, s_g] = twin(FP8_DTYPE_F32, {rows}, nullptr);
        for (fp8_dtype_t y_dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_E4M3}) {
          auto [y_c, y_g] = twin(y_dt, shape, nullptr);
          Scaling sc_c, sc_g;
          if (y_dt == FP8_DTYPE_E4M3) {
            sc_c = make_scaling(cpu.get(), recipe.get(), FP8_ROLE_FORWARD);
            sc_g = make_scaling(gpu.get(), recipe.get(), FP8_ROLE_FORWARD);
            FP8_ASSERT_OK(fp8_scaling_set_scale(sc_c.get(), 16.0f));
            FP8_ASSERT_OK(fp8_scaling_set_scale(sc_g.get(), 16.0f));
          }
          FP8_ASSERT_OK(fp8_norm_forward(cpu.get(), kind, x_c.get(), g_c.get(), rms ? nullptr : b_c.get(), 1e-5f, y_c.get(),
                                         sc_c.get(), rms ? nullptr : m_c.get(), s_c.get()));
          FP8_ASSERT_OK(fp8_norm_forward(gpu.get(), kind, x_g.get(), g_g.get(), rms ? nullptr : b_g.get(), 1e-5f, y_g.get(),
                                         sc_g.get(), rms ? nullptr : m_g.get(), s_g.get()));
          // float statistics against double: 1e-5; bf16 output: one rounding (4e-3); FP8: rare step flips.
          const double bound = y_dt == FP8_DTYPE_F32 ? 1e-5 : y_dt == FP8_DTYPE_BF16 ? 4e-3 : 2e-2;
          EXPECT_LT(relative_error(values(y_g.get()), values(y_c.get())), bound) << "y " << fp8_dtype_name(y_dt);
          EXPECT_LT(relative_error(values(s_g.get()), values(s_c.get())), 1e-5) << "rstd";
          if (!rms) EXPECT_LT(relative_error(values(m_g.get()), values(m_c.get())), 1e-5) << "mean";
        }
        for (fp8_dtype_t dx_dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16}) {
          auto [dx_c, dx_g] = twin(dx_dt, shape, nullptr);
          auto [dg_c, dg_g] = twin(FP8_DTYPE_F32, {d}, nullptr);
          auto [db_c, db_g] = twin(FP8_DTYPE_F32, {d}, nullptr);
          FP8_ASSERT_OK(fp8_norm_backward(cpu.get(), kind, x_c.get(), g_c.get(), rms ? nullptr : m_c.get(), s_c.get(), dy_c.get(),
                                          dx_c.get(), dg_c.get(), rms ? nullptr : db_c.get()));
          FP8_ASSERT_OK(fp8_norm_backward(gpu.get(), kind, x_g.get(), g_g.get(), rms ? nullptr : m_g.get(), s_g.get(), dy_g.get(),
                                          dx_g.get(), dg_g.get(), rms ? nullptr : db_g.get()));
          // dx = rstd * (g - mean(g) - xhat * mean(g xhat)) cancels to ~0 when d is 1: measure its
          // error against the size of rstd * g instead.
          double rstd_max = 0;
          for (double v : values(s_c.get())) rstd_max = std::max(rstd_max, v);
          const double floor = norm2(values(dy_c.get())) * rstd_max * 0.1;
          EXPECT_LT(relative_error(values(dx_g.get()), values(dx_c.get()), floor), dx_dt == FP8_DTYPE_F32 ? 1e-4 : 4e-3) << "dx";
          EXPECT_LT(relative_error(values(dg_g.get()), values(dg_c.get())), 1e-4) << "dgamma";
          if (!rms) EXPECT_LT(relative_error(values(db_g.get()), values(db_c.get())), 1e-4) << "dbeta";
        }
      }
    }
  }
}

// x, y, dy and dx each 2 bytes off 16-byte alignment in turn (bf16, d = 4096, a shape the vector
// kernels take when aligned): each result as close to the CPU's as when aligned.
TEST(GpuNorm, MisalignedBuffersMatchTheCpuReference) {
  Context cpu = make_context(FP8_DEVICE_CPU), gpu = make_context(0);
  const int64_t rows = 64, d = 4096, n = rows * d;
  const std::vector<int64_t> shape = {rows, d};
  const auto xb = to_wide_bytes(FP8_DTYPE_BF16, normal_floats(n, 11, 2.0f, 1.5f));
  const auto dyb = to_wide_bytes(FP8_DTYPE_BF16, normal_floats(n, 12, 0.0f, 1.5f));
  const auto gb = to_wide_bytes(FP8_DTYPE_F32, normal_floats(d, 14, 1.0f, 1.5f));
  const auto bb = to_wide_bytes(FP8_DTYPE_F32, normal_floats(d, 15, 0.0f, 1.5f));
  auto made = [&](fp8_context_t* ctx, fp8_dtype_t dt, const std::vector<int64_t>& s,
                  const std::vector<uint8_t>* bytes) {
    Tensor t = make_tensor(ctx, dt, s);
    if (bytes) upload(t.get(), *bytes);
    return t;
  };
  Tensor x_c = made(cpu.get(), FP8_DTYPE_BF16, shape, &xb), dy_c = made(cpu.get(), FP8_DTYPE_BF16, shape, &dyb);
  Tensor g_c = made(cpu.get(), FP8_DTYPE_F32, {d}, &gb), b_c = made(cpu.get(), FP8_DTYPE_F32, {d}, &bb);
  Tensor m_c = made(cpu.get(), FP8_DTYPE_F32, {rows}, nullptr), s_c = made(cpu.get(), FP8_DTYPE_F32, {rows}, nullptr);
  Tensor y_c = made(cpu.get(), FP8_DTYPE_BF16, shape, nullptr), dx_c = made(cpu.get(), FP8_DTYPE_BF16, shape, nullptr);
  Tensor dg_c = made(cpu.get(), FP8_DTYPE_F32, {d}, nullptr), db_c = made(cpu.get(), FP8_DTYPE_F32, {d}, nullptr);
  FP8_ASSERT_OK(fp8_norm_forward(cpu.get(), FP8_NORM_LAYERNORM, x_c.get(), g_c.get(), b_c.get(), 1e-5f, y_c.get(),
                                 nullptr, m_c.get(), s_c.get()));
  FP8_ASSERT_OK(fp8_norm_backward(cpu.get(), FP8_NORM_LAYERNORM, x_c.get(), g_c.get(), m_c.get(), s_c.get(), dy_c.get(),
                                  dx_c.get(), dg_c.get(), db_c.get()));
  const size_t bytes = static_cast<size_t>(n) * 2;
  for (int off = 0; off < 5; ++off) {  // which buffer is off: none, x, y, dy, dx
    SCOPED_TRACE(::testing::Message() << "misaligned buffer " << off);
    const auto at = [&](int which) { return which == off ? size_t{2} : size_t{0}; };
    DeviceBuffer xbuf(bytes), ybuf(bytes), dybuf(bytes), dxbuf(bytes);
    Tensor x_g = wrap(gpu.get(), FP8_DTYPE_BF16, shape, xbuf.at(at(1)));
    Tensor y_g = wrap(gpu.get(), FP8_DTYPE_BF16, shape, ybuf.at(at(2)));
    Tensor dy_g = wrap(gpu.get(), FP8_DTYPE_BF16, shape, dybuf.at(at(3)));
    Tensor dx_g = wrap(gpu.get(), FP8_DTYPE_BF16, shape, dxbuf.at(at(4)));
    upload(x_g.get(), xb);
    upload(dy_g.get(), dyb);
    Tensor g_g = made(gpu.get(), FP8_DTYPE_F32, {d}, &gb), b_g = made(gpu.get(), FP8_DTYPE_F32, {d}, &bb);
    Tensor m_g = made(gpu.get(), FP8_DTYPE_F32, {rows}, nullptr), s_g = made(gpu.get(), FP8_DTYPE_F32, {rows}, nullptr);
    Tensor dg_g = made(gpu.get(), FP8_DTYPE_F32, {d}, nullptr), db_g = made(gpu.get(), FP8_DTYPE_F32, {d}, nullptr);
    FP8_ASSERT_OK(fp8_norm_forward(gpu.get(), FP8_NORM_LAYERNORM, x_g.get(), g_g.get(), b_g.get(), 1e-5f, y_g.get(),
                                   nullptr, m_g.get(), s_g.get()));
    FP8_ASSERT_OK(fp8_norm_backward(gpu.get(), FP8_NORM_LAYERNORM, x_g.get(), g_g.get(), m_g.get(), s_g.get(),
                                    dy_g.get(), dx_g.get(), dg_g.get(), db_g.get()));
    EXPECT_LT(relative_error(values(y_g.get()), values(y_c.get())), 4e-3) << "y";
    EXPECT_LT(relative_error(values(s_g.get()), values(s_c.get())), 1e-5) << "rstd";
    EXPECT_LT(relative_error(values(dx_g.get()), values(dx_c.get())), 4e-3) << "dx";
    EXPECT_LT(relative_error(values(dg_g.get()), values(dg_c.get())), 1e-4) << "dgamma";
    EXPECT_LT(relative_error(values(db_g.get()), values(db_c.get())), 1e-4) << "dbeta";
  }
}

}  // namespace
