// The scaling recipes on the GPU, below the C API (their Linear and fp8_quantize/fp8_gemm entry
// points come later, so the sources are compiled into this program):
// - the fused amax + quantize kernels (kernels/cast/recipe_quantize.cu) against the CPU reference
//   (backend/cpu_recipe_quantize.cpp), bit for bit: every scale mode (per-tensor, per-row, 1x128,
//   128x128), every input dtype and format, margins and power-of-two scales, with and without the
//   transposed copy, whole and edge tiles, misaligned buffers, padded and column-major grids, NaN and
//   inf inputs (their cells get scale 1 and are counted), all-zero cells and empty operands;
// - cuBLASLt's GEMMs with per-row and block scales (backend/cublaslt_gemm.cpp) on operands those
//   kernels made, against float64 sums of the dequantised operands, and their refusals.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu_recipe_quantize.hpp"
#include "backend/cublaslt_gemm.hpp"
#include "backend/device_info.hpp"
#include "core/format.hpp"
#include "core/recipe_scaling_rule.hpp"
#include "gpu/gpu_compare.hpp"
#include "kernels/launch.hpp"

namespace {

using fp8::ScaleDesc;
using fp8::ScaleGrid;
using fp8::ScaleMode;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// A device allocation of `bytes` (+ 64 spare bytes so a buffer can start misaligned).
struct Device {
  char* p = nullptr;
  explicit Device(size_t bytes) { EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), bytes + 64), cudaSuccess); }
  ~Device() { cudaFree(p); }
};

struct Case {
  ScaleMode mode;
  fp8_dtype_t dtype;
  bool e5m2, pow2, with_t;
  int margin;
  int64_t rows, cols;
  size_t misalign;  // bytes added to the input and output pointers (breaks 16-byte alignment)
  int64_t ld_pad;   // floats of padding at the end of each grid row
  int specials;     // 0 none, 1 NaN and inf here and there, 2 a zero 128-wide row segment
  uint32_t seed;
  bool col_major = false;  // column-major grids (cuBLASLt's layout of 1x128 scales)
  int sm_count = 0;        // the SMs the launch is told of (fewer blocks, more tiles each); 0: the device's
};

std::string name_of(const Case& c) {
  return std::string(fp8::scale_mode_name(c.mode)) + " " + fp8_dtype_name(c.dtype) + (c.e5m2 ? " e5m2" : " e4m3") +
         (c.pow2 ? " pow2" : "") + " margin " + std::to_string(c.margin) + " [" + std::to_string(c.rows) + ", " +
         std::to_string(c.cols) + "]" + (c.with_t ? " +T" : "") + " misalign " + std::to_string(c.misalign) + " ld+" +
         std::to_string(c.ld_pad) + " specials " + std::to_string(c.specials) +
         (c.col_major ? " column-major grids" : "") + (c.sm_count ? " on " + std::to_string(c.sm_count) + " SMs" : "");
}

// Values with a wide range whose magnitude varies by row and by 128-column block, so that every
// mode's cells get different scales.
std::vector<float> input_values(const Case& c) {
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(c.rows * c.cols));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t k = 0; k < c.cols; ++k) {
      const int shift = static_cast<int>((r * 7 + (k / 128) * 5) % 17) - 8;
      float x = std::ldexp(normal(rng), shift);
      if (c.specials == 1 && rng() % 3000 == 0) x = (rng() & 1) ? NAN : (rng() & 1) ? INFINITY : -INFINITY;
      if (c.specials == 2 && r % 5 == 1 && k < 128) x = (k % 2) ? -0.0f : 0.0f;
      v[static_cast<size_t>(r * c.cols + k)] = x;
    }
  return v;
}

struct Result {
  std::vector<uint8_t> out, out_t;
  std::vector<float> grid, grid_t;
  int64_t nonfinite = 0;
};

ScaleDesc desc(ScaleMode mode, float* p, int64_t rows, int64_t cols, int64_t pad, bool col_major) {
  const ScaleGrid g = fp8::scale_grid(mode, rows, cols);
  return {mode, p, g.rows, g.cols, std::max<int64_t>(col_major ? g.rows : g.cols, 1) + pad, col_major};
}
size_t grid_floats(const ScaleDesc& d) {
  return static_cast<size_t>(std::max<int64_t>(d.col_major ? d.cols : d.rows, 1) * d.ld);
}

constexpr float kUnwritten = -777.0f;  // grid padding and unwritten cells keep it

Result run_cpu(const Case& c, const std::vector<uint8_t>& bytes) {
  Result res;
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  res.out.assign(n, 0xCD);
  res.out_t.assign(n, 0xCD);
  ScaleDesc d = desc(c.mode, nullptr, c.rows, c.cols, c.ld_pad, c.col_major),
            dt = desc(c.mode, nullptr, c.cols, c.rows, c.ld_pad, c.col_major);
  res.grid.assign(grid_floats(d), kUnwritten);
  res.grid_t.assign(grid_floats(dt), kUnwritten);
  d.ptr = res.grid.data();
  dt.ptr = res.grid_t.data();
  fp8::RecipeQuantizeJob j{};
  j.in = bytes.data();
  j.in_dtype = c.dtype;
  j.rows = c.rows;
  j.cols = c.cols;
  j.e5m2 = c.e5m2;
  j.margin = c.margin;
  j.pow2_scales = c.pow2;
  j.out = res.out.data();
  j.out_scale_inv = d;
  if (c.with_t) {
    j.out_t = res.out_t.data();
    j.out_t_scale_inv = dt;
  }
  j.nonfinite_cells = &res.nonfinite;
  fp8::cpu_recipe_quantize(j);
  return res;
}

Result run_gpu(const Case& c, const std::vector<uint8_t>& bytes) {
  Result res;
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  ScaleDesc d = desc(c.mode, nullptr, c.rows, c.cols, c.ld_pad, c.col_major),
            dt = desc(c.mode, nullptr, c.cols, c.rows, c.ld_pad, c.col_major);
  res.grid.assign(grid_floats(d), kUnwritten);
  res.grid_t.assign(grid_floats(dt), kUnwritten);
  Device in(bytes.size()), out(n), out_t(n), g(res.grid.size() * 4), gt(res.grid_t.size() * 4),
      ws(fp8::recipe_quantize_workspace(c.mode, c.rows, c.cols)), count(8);
  const std::vector<uint8_t> poison(n, 0xCD);
  EXPECT_EQ(cudaMemcpy(in.p + c.misalign, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.p + c.misalign, poison.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out_t.p + c.misalign, poison.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(g.p, res.grid.data(), res.grid.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(gt.p, res.grid_t.data(), res.grid_t.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(count.p, 0, 8), cudaSuccess);
  d.ptr = reinterpret_cast<float*>(g.p);
  dt.ptr = reinterpret_cast<float*>(gt.p);
  fp8::RecipeQuantizeJob j{};
  j.in = in.p + c.misalign;
  j.in_dtype = c.dtype;
  j.rows = c.rows;
  j.cols = c.cols;
  j.e5m2 = c.e5m2;
  j.margin = c.margin;
  j.pow2_scales = c.pow2;
  j.out = reinterpret_cast<uint8_t*>(out.p + c.misalign);
  j.out_scale_inv = d;
  if (c.with_t) {
    j.out_t = reinterpret_cast<uint8_t*>(out_t.p + c.misalign);
    j.out_t_scale_inv = dt;
  }
  j.nonfinite_cells = reinterpret_cast<int64_t*>(count.p);
  j.workspace = reinterpret_cast<uint32_t*>(ws.p);
  int device = 0, sms = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  if (c.sm_count > 0) sms = c.sm_count;
  fp8::check_recipe_quantize(j);
  fp8::kernels::recipe_quantize(j, {device, sms}, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  res.out.resize(n);
  res.out_t.resize(n);
  EXPECT_EQ(cudaMemcpy(res.out.data(), out.p + c.misalign, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(res.out_t.data(), out_t.p + c.misalign, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(res.grid.data(), g.p, res.grid.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(res.grid_t.data(), gt.p, res.grid_t.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&res.nonfinite, count.p, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  return res;
}

// First differing index of two byte or float vectors (by bits), or -1.
template <typename T>
int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  return -1;
}

void check(const Case& c) {
  SCOPED_TRACE(name_of(c));
  const std::vector<uint8_t> bytes = fp8test::to_wide_bytes(c.dtype, input_values(c));
  const Result want = run_cpu(c, bytes), got = run_gpu(c, bytes);
  EXPECT_EQ(first_difference(got.out, want.out), -1) << "codes";
  EXPECT_EQ(first_difference(got.grid, want.grid), -1) << "scale grid";
  if (c.with_t) {
    EXPECT_EQ(first_difference(got.out_t, want.out_t), -1) << "transposed codes";
    EXPECT_EQ(first_difference(got.grid_t, want.grid_t), -1) << "transposed scale grid";
  }
  EXPECT_EQ(got.nonfinite, want.nonfinite);
  if (c.specials == 1 && c.rows * c.cols > 20000) EXPECT_GT(want.nonfinite, 0) << "the case has no special cell";
}

constexpr ScaleMode kModes[] = {ScaleMode::kTensor, ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128};

TEST(GpuRecipeQuantize, EveryModeDtypeAndFormatIsBitExactOnWholeAndEdgeTiles) {
  // (200, 256): whole tiles whose transposed rows (200 long) take byte stores, not 16-byte ones.
  const std::pair<int64_t, int64_t> shapes[] = {{128, 128}, {256, 384}, {1, 1},     {3, 200},    {130, 257}, {257, 130},
                                                {512, 64},  {64, 512},  {1000, 24}, {384, 1024}, {200, 256}};
  uint32_t seed = 1;
  for (ScaleMode mode : kModes)
    for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_F16})
      for (bool e5m2 : {false, true})
        for (auto [rows, cols] : shapes) {
          const bool odd = seed % 2 == 1;
          check({mode, dt, e5m2, odd, true, odd ? 3 : 0, rows, cols, 0, 0, 0, seed++});
        }
}

TEST(GpuRecipeQuantize, WithoutTheTransposedCopyMisalignedAndWithPaddedGrids) {
  uint32_t seed = 400;
  for (ScaleMode mode : kModes)
    for (bool with_t : {false, true})
      for (size_t misalign : {size_t{0}, size_t{2}})
        for (auto [rows, cols] : {std::pair<int64_t, int64_t>{256, 256}, {200, 136}})
          check({mode, FP8_DTYPE_BF16, false, false, with_t, 0, rows, cols, misalign, 3, 0, seed++});
}

// The per-row mode without the transposed copy reads each row once where it fits a block (a
// multiple of 8 columns up to 16384, aligned buffers): every width class of that kernel, each side
// of its limit and of its alignment rule, every dtype and format, padded and column-major grids,
// special values and zero rows.
TEST(GpuRecipeQuantize, PerRowWithoutTheTransposedCopyAtEveryWidth) {
  const std::pair<int64_t, int64_t> shapes[] = {{3, 8},    {5, 2048},  {7, 2056},  {9, 4096},  {4, 8192},
                                                {3, 8200}, {2, 16384}, {2, 16392}, {33, 1000}, {17, 4100}};
  uint32_t seed = 450;
  for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_F16})
    for (bool e5m2 : {false, true})
      for (auto [rows, cols] : shapes) {
        const bool odd = seed % 2 == 1;
        check({ScaleMode::kRow, dt, e5m2, odd, false, odd ? 2 : 0, rows, cols, 0, odd ? 3 : 0, 0, seed++});
      }
  for (int specials : {1, 2})
    check({ScaleMode::kRow, FP8_DTYPE_F32, false, false, false, 0, 64, 4096, 0, 0, specials, seed++});
  check({ScaleMode::kRow, FP8_DTYPE_BF16, true, false, false, 0, 300, 2048, 2, 0, 0, seed++});  // misaligned
  Case c{ScaleMode::kRow, FP8_DTYPE_BF16, false, false, false, 0, 40, 8192, 0, 1, 0, seed++};
  c.col_major = true;
  check(c);
}

TEST(GpuRecipeQuantize, ColumnMajorGridsHoldTheSameScales) {
  uint32_t seed = 500;
  for (ScaleMode mode : kModes)
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{256, 384}, {200, 136}}) {
      Case c{mode, FP8_DTYPE_BF16, false, false, true, 0, rows, cols, 0, 1, 0, seed++};
      c.col_major = true;
      check(c);
    }
}

TEST(GpuRecipeQuantize, NanInfAndZeroCellsFollowTheRule) {
  uint32_t seed = 600;
  for (ScaleMode mode : kModes)
    for (int specials : {1, 2})
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{512, 512}, {300, 333}})
        check({mode, FP8_DTYPE_F32, seed % 2 == 0, false, true, 0, rows, cols, 0, 0, specials, seed++});
}

TEST(GpuRecipeQuantize, EmptyOperandsWriteOnlyThePerTensorScale) {
  for (ScaleMode mode : kModes)
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 5}, {7, 0}, {0, 0}})
      check({mode, FP8_DTYPE_BF16, false, false, true, 0, rows, cols, 0, 0, 0, 9});
}

// The launches told of one or three SMs: a few blocks each walk many tiles (edge tiles among them,
// strides of 1-6 tiles that wrap around a row of 8), through every kernel's pipeline of the next
// tile's loads and its alternating shared buffers.
TEST(GpuRecipeQuantize, FewBlocksWalkingManyTilesAreBitExact) {
  uint32_t seed = 900;
  for (ScaleMode mode : kModes)
    for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_F16})
      for (int sms : {1, 3})
        for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1000, 900}, {384, 1024}})
          for (bool with_t : {true, false}) {
            if (!with_t && dt != FP8_DTYPE_BF16) continue;
            Case c{mode, dt, sms == 3, false, with_t, 0, rows, cols, 0, 0, 0, seed++};
            c.sm_count = sms;
            check(c);
          }
}

TEST(GpuRecipeQuantize, LargeOperandsAreBitExact) {
  uint32_t seed = 800;
  for (ScaleMode mode : kModes) check({mode, FP8_DTYPE_BF16, false, false, true, 0, 4096, 4096, 0, 0, 0, seed++});
}

// ---- GEMMs with per-row and block scales -----------------------------------------------------

bool scaled_gemms_here() {
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return fp8::fp8_block_scaling_supported(major * 10 + minor, static_cast<int64_t>(cublasLtGetVersion()));
}

// An operand [rows, k] quantised on the GPU in `mode` with the grid laid out as cuBLASLt reads it,
// and the same operand dequantised on the host (codes and grid copied back).
struct ScaledOperand {
  Device codes, grid;
  ScaleDesc desc;
  std::vector<double> values;  // rows x k, dequantised
  ScaledOperand(ScaleMode mode, int64_t rows, int64_t k, bool e5m2, uint32_t seed)
      : codes(static_cast<size_t>(rows * k)), grid(static_cast<size_t>((rows + 8) * ((k + 127) / 128 + 4)) * 4) {
    const ScaleGrid g = fp8::scale_grid(mode, rows, k);
    desc = fp8::gemm_grid(mode, rows, k, reinterpret_cast<float*>(grid.p));
    Case c{mode, FP8_DTYPE_BF16, e5m2, false, false, 0, rows, k, 0, 0, 0, seed};
    const std::vector<uint8_t> bytes = fp8test::to_wide_bytes(FP8_DTYPE_BF16, input_values(c));
    Device in(bytes.size()), ws(fp8::recipe_quantize_workspace(mode, rows, k) + 4);
    EXPECT_EQ(cudaMemcpy(in.p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    fp8::RecipeQuantizeJob j{};
    j.in = in.p;
    j.in_dtype = FP8_DTYPE_BF16;
    j.rows = rows;
    j.cols = k;
    j.e5m2 = e5m2;
    j.out = reinterpret_cast<uint8_t*>(codes.p);
    j.out_scale_inv = desc;
    j.workspace = reinterpret_cast<uint32_t*>(ws.p);
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    fp8::check_recipe_quantize(j);
    fp8::kernels::recipe_quantize(j, {0, sms}, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> q(static_cast<size_t>(rows * k));
    std::vector<float> scales(static_cast<size_t>(std::max<int64_t>(desc.col_major ? g.cols : g.rows, 1) * desc.ld));
    EXPECT_EQ(cudaMemcpy(q.data(), codes.p, q.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(scales.data(), grid.p, scales.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    const fp8::ScaleBlock b = fp8::scale_block(mode, rows, k);
    values.resize(q.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t kk = 0; kk < k; ++kk)
        values[static_cast<size_t>(r * k + kk)] = static_cast<double>(fp8::decode_fp8(q[static_cast<size_t>(r * k + kk)], e5m2)) *
                                                  scales[static_cast<size_t>(desc.at(r / b.rows, kk / b.cols))];
  }
};

// D [m, n] (f32, or bf16 with a bf16 bias) = A [m, k] . B [n, k]^T through cuBLASLt, against float64.
void check_scaled_gemm(ScaleMode ma, ScaleMode mb, int64_t m, int64_t n, int64_t k, bool bf16_out, uint32_t seed) {
  SCOPED_TRACE(std::string(fp8::scale_mode_name(ma)) + " x " + fp8::scale_mode_name(mb) + " m " + std::to_string(m) +
               " n " + std::to_string(n) + " k " + std::to_string(k) + (bf16_out ? " bf16 out + bias" : " f32 out"));
  const ScaledOperand a(ma, m, k, false, seed), b(mb, n, k, seed % 2 == 1, seed + 1);
  const fp8_dtype_t d_dtype = bf16_out ? FP8_DTYPE_BF16 : FP8_DTYPE_F32;
  Device d(static_cast<size_t>(m * n) * 4), bias(static_cast<size_t>(n) * 2);
  std::vector<float> bias_values(static_cast<size_t>(n));
  std::vector<uint16_t> bias_bits(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    bias_bits[static_cast<size_t>(j)] = fp8::float_to_bf16(0.25f * static_cast<float>(j % 7) - 0.75f);
    bias_values[static_cast<size_t>(j)] = fp8::bf16_to_float(bias_bits[static_cast<size_t>(j)]);
  }
  EXPECT_EQ(cudaMemcpy(bias.p, bias_bits.data(), bias_bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  fp8::GemmJob g{};
  g.a = a.codes.p;
  g.b = b.codes.p;
  g.a_dtype = FP8_DTYPE_E4M3;
  g.b_dtype = seed % 2 == 1 ? FP8_DTYPE_E5M2 : FP8_DTYPE_E4M3;
  g.a_scale_inv = a.desc;
  g.b_scale_inv = b.desc;
  g.m = m;
  g.n = n;
  g.k = k;
  g.d = d.p;
  g.d_dtype = d_dtype;
  if (bf16_out) {
    g.bias = bias.p;
    g.bias_dtype = FP8_DTYPE_BF16;
  }
  g.alpha = 1.0f;
  g.fast_accumulation = ma == ScaleMode::kRow;  // allowed with per-row scales only
  fp8::check_gemm_scales(g, "CUDA");
  fp8::CublasLtGemm gemm(0);
  gemm.run(g, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<double> got(static_cast<size_t>(m * n));
  if (bf16_out) {
    std::vector<uint16_t> raw(got.size());
    EXPECT_EQ(cudaMemcpy(raw.data(), d.p, raw.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < raw.size(); ++i) got[i] = fp8::bf16_to_float(raw[i]);
  } else {
    std::vector<float> raw(got.size());
    EXPECT_EQ(cudaMemcpy(raw.data(), d.p, raw.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < raw.size(); ++i) got[i] = raw[i];
  }
  std::vector<double> want(got.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = bf16_out ? bias_values[static_cast<size_t>(j)] : 0.0;
      for (int64_t kk = 0; kk < k; ++kk)
        sum += a.values[static_cast<size_t>(i * k + kk)] * b.values[static_cast<size_t>(j * k + kk)];
      want[static_cast<size_t>(i * n + j)] = sum;
    }
  // The bounds of gpu_gemm's per-tensor cases: the tensor cores' FP8 accumulation (promoted to FP32
  // every 128 K under block scales), looser with fast accumulation; a bf16 D rounds once more.
  const double err = fp8test::relative_error(got, want);
  const double bound = bf16_out ? 5e-3 : g.fast_accumulation ? 3e-3 : 5e-4;
  EXPECT_LT(err, bound);
  std::printf("  %s x %s m=%lld n=%lld k=%lld %s%s: rel err %.2e (bound %.0e)\n", fp8::scale_mode_name(ma),
              fp8::scale_mode_name(mb), static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
              bf16_out ? "bf16 + bias" : "f32", g.fast_accumulation ? " fast" : "", err, bound);
  EXPECT_GT(fp8test::norm2(want), 0.0);
}

TEST(GpuScaledGemm, EveryPairCublasLtRunsMatchesFloat64) {
  if (!scaled_gemms_here()) GTEST_SKIP() << "per-row and block-scaled GEMMs need sm_90 and cuBLASLt >= 12.9";
  uint32_t seed = 900;
  for (auto [ma, mb] : {std::pair{ScaleMode::kRow, ScaleMode::kRow}, std::pair{ScaleMode::kBlock1x128, ScaleMode::kBlock1x128},
                        std::pair{ScaleMode::kBlock1x128, ScaleMode::kBlock128x128},
                        std::pair{ScaleMode::kBlock128x128, ScaleMode::kBlock1x128}})
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{256, 512, 1024}, {136, 264, 528}, {512, 128, 1040}})
      for (bool bf16_out : {false, true}) check_scaled_gemm(ma, mb, m, n, k, bf16_out, seed++);
}

// What cuBLASLt cannot run is refused before it is asked, naming the argument.
TEST(GpuScaledGemm, LayoutsAndShapesCublasLtCannotTakeAreRefused) {
  if (!scaled_gemms_here()) GTEST_SKIP() << "per-row and block-scaled GEMMs need sm_90 and cuBLASLt >= 12.9";
  const ScaledOperand a(ScaleMode::kBlock1x128, 128, 256, false, 1), b(ScaleMode::kBlock128x128, 128, 256, false, 2);
  Device d(128 * 128 * 4);
  fp8::GemmJob g{};
  g.a = a.codes.p;
  g.b = b.codes.p;
  g.a_dtype = g.b_dtype = FP8_DTYPE_E4M3;
  g.a_scale_inv = a.desc;
  g.b_scale_inv = b.desc;
  g.m = g.n = 128;
  g.k = 256;
  g.d = d.p;
  g.d_dtype = FP8_DTYPE_F32;
  g.alpha = 1.0f;
  fp8::CublasLtGemm gemm(0);
  const auto refused = [&](fp8::GemmJob job, fp8_status_t status, const char* word) {
    try {
      fp8::check_gemm_scales(job, "CUDA");
      gemm.run(job, nullptr);
      ADD_FAILURE() << "not refused: " << word;
    } catch (const fp8::Error& e) {
      EXPECT_EQ(e.status(), status) << e.what();
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  fp8::GemmJob row_major = g;
  row_major.a_scale_inv.col_major = false;
  row_major.a_scale_inv.ld = 2;
  refused(row_major, FP8_ERR_INVALID_ARGUMENT, "column-major");
  fp8::GemmJob unpadded = g;
  unpadded.b_scale_inv.ld = 2;  // ceil(256 / 128) = 2 K blocks, not padded to 4
  refused(unpadded, FP8_ERR_INVALID_ARGUMENT, "multiple of 4");
  fp8::GemmJob both_2d = g;
  both_2d.a_scale_inv = b.desc;
  refused(both_2d, FP8_ERR_UNSUPPORTED, "128x128");
  fp8::GemmJob odd = g;
  odd.m = 124;  // (its grid follows, so only cuBLASLt's own limit is left)
  odd.a_scale_inv.rows = 124;
  odd.a_scale_inv.ld = 124;
  refused(odd, FP8_ERR_SHAPE, "multiples of 8");
}

// ---- The scale-grid API on both backends -------------------------------------------------------

// fp8_quantize_scaled bit for bit on the GPU and the CPU (codes and grids of both layouts), then
// fp8_gemm_scaled on those operands within gpu_gemm's bounds of the CPU's float64 sums.
TEST(GpuScaleGridApi, QuantizeScaledIsBitExactAndGemmScaledMatchesTheCpu) {
  if (!scaled_gemms_here()) GTEST_SKIP() << "per-row and block-scaled GEMMs need sm_90 and cuBLASLt >= 12.9";
  using fp8test::Tensor;
  fp8test::Context cpu = fp8test::make_context(FP8_DEVICE_CPU), gpu = fp8test::make_context(0);
  fp8test::Recipe recipe = fp8test::make_recipe("");
  const int64_t m = 264, n = 136, k = 528;
  // Grids filled with a marker first: the 128x128 grid's padding columns must stay untouched.
  const auto grid = [](fp8_context_t* ctx, fp8_scale_mode_t mode, int64_t rows, int64_t cols) {
    int64_t shape[2];
    EXPECT_EQ(fp8_scale_grid_shape(mode, rows, cols, shape), FP8_OK);
    Tensor t = fp8test::make_tensor(ctx, FP8_DTYPE_F32, {shape[0], shape[1]});
    fp8test::upload(t.get(), std::vector<float>(static_cast<size_t>(shape[0] * shape[1]), kUnwritten));
    return t;
  };
  const std::vector<uint8_t> xa = fp8test::to_wide_bytes(FP8_DTYPE_BF16, fp8test::normal_floats(m * k, 5, 0.0f, 3.0f));
  const std::vector<uint8_t> xb = fp8test::to_wide_bytes(FP8_DTYPE_BF16, fp8test::normal_floats(n * k, 6, 0.0f, 0.01f));
  for (auto [am, bm] : {std::pair{FP8_SCALE_MODE_ROW, FP8_SCALE_MODE_ROW},
                        std::pair{FP8_SCALE_MODE_BLOCK_1X128, FP8_SCALE_MODE_BLOCK_128X128},
                        std::pair{FP8_SCALE_MODE_BLOCK_128X128, FP8_SCALE_MODE_BLOCK_1X128},
                        std::pair{FP8_SCALE_MODE_BLOCK_1X128, FP8_SCALE_MODE_BLOCK_1X128}}) {
    SCOPED_TRACE(std::to_string(am) + " x " + std::to_string(bm));
    std::vector<std::vector<float>> d_values;
    std::vector<std::vector<uint8_t>> bytes;
    for (fp8_context_t* ctx : {cpu.get(), gpu.get()}) {
      Tensor a_in = fp8test::make_tensor(ctx, FP8_DTYPE_BF16, {m, k}), b_in = fp8test::make_tensor(ctx, FP8_DTYPE_BF16, {n, k});
      fp8test::upload(a_in.get(), xa);
      fp8test::upload(b_in.get(), xb);
      Tensor a = fp8test::make_tensor(ctx, FP8_DTYPE_E4M3, {m, k}), at = fp8test::make_tensor(ctx, FP8_DTYPE_E4M3, {k, m});
      Tensor b = fp8test::make_tensor(ctx, FP8_DTYPE_E5M2, {n, k}), d = fp8test::make_tensor(ctx, FP8_DTYPE_F32, {m, n});
      Tensor ga = grid(ctx, am, m, k), gat = grid(ctx, am, k, m), gb = grid(ctx, bm, n, k);
      ASSERT_EQ(fp8_quantize_scaled(ctx, a_in.get(), am, recipe.get(), a.get(), ga.get(), at.get(), gat.get()), FP8_OK)
          << fp8_last_error_message();
      ASSERT_EQ(fp8_quantize_scaled(ctx, b_in.get(), bm, recipe.get(), b.get(), gb.get(), nullptr, nullptr), FP8_OK)
          << fp8_last_error_message();
      ASSERT_EQ(fp8_gemm_scaled(ctx, a.get(), am, ga.get(), b.get(), bm, gb.get(), nullptr, d.get(), nullptr), FP8_OK)
          << fp8_last_error_message();
      std::vector<uint8_t> all;
      for (const fp8_tensor_t* t : {a.get(), at.get(), ga.get(), gat.get(), b.get(), gb.get()}) {
        const auto v = fp8test::download<uint8_t>(t);
        all.insert(all.end(), v.begin(), v.end());
      }
      bytes.push_back(all);
      d_values.push_back(fp8test::download<float>(d.get()));
    }
    EXPECT_EQ(bytes[1], bytes[0]) << "codes and grids differ between the GPU and the CPU";
    const std::vector<double> want(d_values[0].begin(), d_values[0].end()), got(d_values[1].begin(), d_values[1].end());
    EXPECT_LT(fp8test::relative_error(got, want), 5e-4);
  }
}

}  // namespace

