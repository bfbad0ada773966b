// The scaling rules of issue 14 (core/recipe_scaling_rule.hpp) and the CPU reference of fused amax +
// quantize for each mode (backend/cpu_recipe_quantize.cpp): each rule against float64 arithmetic and
// against an independent re-implementation written here (bit for bit), the edge cases, the
// dequantisation error per mode, and the transposed copies. The reference is internal (hidden in
// libfp8), so its source is compiled into this test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cpu_recipe_quantize.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "core/recipe_scaling_rule.hpp"
#include "core/scale_desc.hpp"
#include "core/scaling_rule.hpp"
#include "fp8_test_util.hpp"

namespace {

using fp8::ScaleGrid;
using fp8::ScaleMode;

constexpr ScaleMode kModes[] = {ScaleMode::kTensor, ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128};
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// ---- An independent re-implementation, in float64 where the rule allows ----------------------
// The fp8 maximum, the scale (double quotient rounded once to float: for a quotient of two floats
// this equals the float division, since 53 >= 2 * 24 + 2), frexp/ldexp for powers of two, and an
// encoder that picks the nearest of the 256 decoded codes.

double fp8_max(bool e5m2) {
  return e5m2 ? 57344.0 : 448.0;
}

float ref_scale(double amax, bool e5m2, int margin, bool pow2) {
  if (!(amax > 0.0) || std::isinf(amax)) return 1.0f;
  float s = static_cast<float>(std::ldexp(fp8_max(e5m2), -margin) / amax);
  if (std::isinf(s)) s = FLT_MAX;
  if (s < std::ldexp(1.0f, -127)) s = std::ldexp(1.0f, -127);  // keeps 1 / s finite
  if (pow2) {
    int e = 0;
    std::frexp(static_cast<double>(s), &e);  // s = m * 2^e, m in [0.5, 1)
    s = static_cast<float>(std::ldexp(1.0, e - 1));
  }
  return s;
}

// Nearest-even encoder over the table of positive finite codes, saturating, NaN -> 0x7F.
class RefEncoder {
 public:
  explicit RefEncoder(bool e5m2) : e5m2_(e5m2) {
    for (int c = 0; c < 0x80; ++c) {
      const double v = fp8::decode_fp8(static_cast<uint8_t>(c), e5m2);
      if (std::isfinite(v)) values_.push_back(v);  // codes 0.. in increasing order
    }
  }
  uint8_t operator()(float x) const {
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= values_.back()) return static_cast<uint8_t>(sign | (values_.size() - 1));
    const size_t hi = static_cast<size_t>(std::upper_bound(values_.begin(), values_.end(), a) - values_.begin());
    const size_t lo = hi - 1;  // values_[lo] <= a < values_[hi]
    const double dlo = a - values_[lo], dhi = values_[hi] - a;
    const size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return static_cast<uint8_t>(sign | pick);
  }
  bool e5m2() const { return e5m2_; }

 private:
  bool e5m2_;
  std::vector<double> values_;
};

// One layout (the operand or its transposed copy) made by the reference or by the re-implementation.
struct Layout {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;  // dense grid: [grid_rows][grid_cols]
  int64_t grid_rows = 0, grid_cols = 0;
  int64_t nonfinite = 0;
};

// Re-implementation: tiles of th x tw over a [rows, cols] operand given element by element.
Layout ref_layout(const std::function<float(int64_t, int64_t)>& at, int64_t rows, int64_t cols, ScaleMode mode,
                  bool e5m2, int margin, bool pow2) {
  int64_t th = 1, tw = 128;
  if (mode == ScaleMode::kTensor) th = std::max<int64_t>(rows, 1), tw = std::max<int64_t>(cols, 1);
  if (mode == ScaleMode::kRow) tw = std::max<int64_t>(cols, 1);
  if (mode == ScaleMode::kBlock128x128) th = 128;
  Layout out;
  out.grid_rows = mode == ScaleMode::kTensor ? 1 : (rows + th - 1) / th;
  out.grid_cols = mode == ScaleMode::kTensor ? 1 : (cols + tw - 1) / tw;
  out.codes.assign(static_cast<size_t>(rows * cols), 0);
  out.scale_inv.assign(static_cast<size_t>(out.grid_rows * out.grid_cols), 0.0f);
  const RefEncoder enc(e5m2);
  for (int64_t ti = 0; ti < out.grid_rows; ++ti)
    for (int64_t tj = 0; tj < out.grid_cols; ++tj) {
      const int64_t r0 = ti * th, r1 = std::min(rows, r0 + th), c0 = tj * tw, c1 = std::min(cols, c0 + tw);
      double amax = 0.0;
      bool nan = false;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const double x = at(r, c);
          if (std::isnan(x)) nan = true;
          amax = std::max(amax, std::fabs(x));
        }
      if (nan || std::isinf(amax)) ++out.nonfinite;
      const float s = nan ? 1.0f : ref_scale(amax, e5m2, margin, pow2);
      out.scale_inv[static_cast<size_t>(ti * out.grid_cols + tj)] = static_cast<float>(1.0 / s);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) out.codes[static_cast<size_t>(r * cols + c)] = enc(at(r, c) * s);
    }
  return out;
}

// ---- Running the CPU reference ------------------------------------------------------------------

struct Case {
  ScaleMode mode = ScaleMode::kBlock1x128;
  bool e5m2 = false;
  int margin = 0;
  bool pow2 = false;
  fp8_dtype_t dtype = FP8_DTYPE_F32;
  bool with_t = true;
  int64_t ld_pad = 0;  // extra floats at the end of each grid row
};

// The input as the dtype stores it (F16/BF16 rounded from x), and the float values it widens to.
struct Input {
  std::vector<float> f32;
  std::vector<uint16_t> half;
  std::vector<float> values;
};
Input make_input(const std::vector<float>& x, fp8_dtype_t dt) {
  Input in;
  if (dt == FP8_DTYPE_F32) {
    in.f32 = x;
    in.values = x;
    return in;
  }
  for (float v : x) {
    const uint16_t h = dt == FP8_DTYPE_F16 ? fp8::float_to_f16(v) : fp8::float_to_bf16(v);
    in.half.push_back(h);
    in.values.push_back(dt == FP8_DTYPE_F16 ? fp8::f16_to_float(h) : fp8::bf16_to_float(h));
  }
  return in;
}

constexpr float kPadding = -12345.0f;  // grid padding: must stay untouched

struct Result {
  Layout out, out_t;
};

Result run_reference(const std::vector<float>& x, int64_t rows, int64_t cols, const Case& k) {
  const Input in = make_input(x, k.dtype);
  const ScaleGrid g = fp8::scale_grid(k.mode, rows, cols), gt = fp8::scale_grid(k.mode, cols, rows);
  const int64_t ld = std::max<int64_t>(g.cols, 1) + k.ld_pad, ldt = std::max<int64_t>(gt.cols, 1) + k.ld_pad;
  std::vector<float> grid(static_cast<size_t>(std::max<int64_t>(g.rows, 1) * ld), kPadding);
  std::vector<float> grid_t(static_cast<size_t>(std::max<int64_t>(gt.rows, 1) * ldt), kPadding);
  Result res;
  res.out.codes.assign(static_cast<size_t>(rows * cols), 0xAA);
  res.out_t.codes.assign(static_cast<size_t>(rows * cols), 0xAA);
  fp8::RecipeQuantizeJob j{};
  j.in = k.dtype == FP8_DTYPE_F32 ? static_cast<const void*>(in.f32.data()) : in.half.data();
  j.in_dtype = k.dtype;
  j.rows = rows;
  j.cols = cols;
  j.e5m2 = k.e5m2;
  j.margin = k.margin;
  j.pow2_scales = k.pow2;
  j.out = res.out.codes.data();
  j.out_scale_inv = {k.mode, grid.data(), g.rows, g.cols, ld};
  if (k.with_t) {
    j.out_t = res.out_t.codes.data();
    j.out_t_scale_inv = {k.mode, grid_t.data(), gt.rows, gt.cols, ldt};
  }
  int64_t nonfinite = 0;
  j.nonfinite_cells = &nonfinite;
  fp8::cpu_recipe_quantize(j);
  res.out.nonfinite = nonfinite;
  // Dense copies of the grids; the padding must be untouched.
  const auto dense = [](const std::vector<float>& gr, ScaleGrid shape, int64_t ldg, Layout& l) {
    l.grid_rows = shape.rows;
    l.grid_cols = shape.cols;
    for (int64_t i = 0; i < shape.rows; ++i)
      for (int64_t c = 0; c < ldg; ++c) {
        const float v = gr[static_cast<size_t>(i * ldg + c)];
        if (c < shape.cols)
          l.scale_inv.push_back(v);
        else
          EXPECT_EQ(v, kPadding) << "grid padding written at row " << i << " col " << c;
      }
  };
  dense(grid, g, ld, res.out);
  if (k.with_t) dense(grid_t, gt, ldt, res.out_t);
  return res;
}

Layout ref_of(const std::vector<float>& values, int64_t rows, int64_t cols, const Case& k, bool transposed) {
  if (transposed)
    return ref_layout([&](int64_t r, int64_t c) { return values[static_cast<size_t>(c * cols + r)]; }, cols, rows,
                      k.mode, k.e5m2, k.margin, k.pow2);
  return ref_layout([&](int64_t r, int64_t c) { return values[static_cast<size_t>(r * cols + c)]; }, rows, cols, k.mode,
                    k.e5m2, k.margin, k.pow2);
}

void expect_same_layout(const Layout& got, const Layout& want, const std::string& what) {
  ASSERT_EQ(got.grid_rows, want.grid_rows) << what;
  ASSERT_EQ(got.grid_cols, want.grid_cols) << what;
  ASSERT_EQ(got.scale_inv.size(), want.scale_inv.size()) << what;
  for (size_t i = 0; i < want.scale_inv.size(); ++i)
    ASSERT_EQ(bits(got.scale_inv[i]), bits(want.scale_inv[i]))
        << what << ": scale_inv " << i << " is " << got.scale_inv[i] << ", want " << want.scale_inv[i];
  ASSERT_EQ(got.codes.size(), want.codes.size()) << what;
  for (size_t i = 0; i < want.codes.size(); ++i) ASSERT_EQ(got.codes[i], want.codes[i]) << what << ": code " << i;
}

// Values with a wide dynamic range: sign * [1, 2) * 2^[lo, hi], and a magnitude that varies by row
// and by column block so that finer scales matter.
std::vector<float> random_values(int64_t rows, int64_t cols, uint32_t seed, int lo = -14, int hi = 6) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(lo, hi), row_shift(-8, 8);
  std::vector<int> shifts(static_cast<size_t>(rows + cols / 128 + 1));
  for (int& s : shifts) s = row_shift(gen);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float m = (gen() & 1u) ? -mant(gen) : mant(gen);
      x[static_cast<size_t>(r * cols + c)] =
          std::ldexp(m, expo(gen) + shifts[static_cast<size_t>(r)] + shifts[static_cast<size_t>(rows + c / 128)]);
    }
  return x;
}

std::string case_name(const Case& k, int64_t rows, int64_t cols) {
  return std::string(fp8::scale_mode_name(k.mode)) + (k.e5m2 ? " E5M2" : " E4M3") + " margin " +
         std::to_string(k.margin) + (k.pow2 ? " pow2" : "") + " dtype " + std::to_string(k.dtype) + " [" +
         std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

// ---- The rules ----------------------------------------------------------------------------------

TEST(CurrentScaleRule, IsTheCorrectlyRoundedFloat64Quotient) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-140, 127);
  for (bool e5m2 : {false, true})
    for (int margin : {0, 1, 5, 32})
      for (int i = 0; i < 20000; ++i) {
        const float a = static_cast<float>(std::ldexp(mant(gen), expo(gen)));
        if (!(a > 0.0f) || std::isinf(a)) continue;
        const float m = fp8::scaled_fp8_max(e5m2, margin);
        ASSERT_EQ(static_cast<double>(m), std::ldexp(fp8_max(e5m2), -margin));
        const float s = fp8::current_scale(a, m);
        const double exact = static_cast<double>(m) / a;
        if (exact > FLT_MAX) {
          ASSERT_EQ(s, FLT_MAX) << a;
          continue;
        }
        if (exact < std::ldexp(1.0, -127)) {
          ASSERT_EQ(s, std::ldexp(1.0f, -127)) << a;
          continue;
        }
        ASSERT_EQ(bits(s), bits(ref_scale(a, e5m2, margin, false))) << "amax " << a;
        if (exact >= FLT_MIN) {
          ASSERT_LE(std::fabs(s - exact), std::ldexp(exact, -24)) << "amax " << a;
        }
      }
}

TEST(CurrentScaleRule, ZeroNaNAndInfiniteAmaxGiveUnitScaleTinyAmaxGivesFltMax) {
  const float m = fp8::scaled_fp8_max(false, 0);
  EXPECT_EQ(fp8::current_scale(0.0f, m), 1.0f);
  EXPECT_EQ(fp8::current_scale(kNaN, m), 1.0f);
  EXPECT_EQ(fp8::current_scale(kInf, m), 1.0f);
  EXPECT_EQ(fp8::current_scale(-1.0f, m), 1.0f);
  EXPECT_TRUE(fp8::amax_is_nonfinite(kNaN));
  EXPECT_TRUE(fp8::amax_is_nonfinite(kInf));
  EXPECT_FALSE(fp8::amax_is_nonfinite(FLT_MAX));
  EXPECT_FALSE(fp8::amax_is_nonfinite(0.0f));
  // 448 / amax overflows below amax = 448 / FLT_MAX (about 1.3e-36).
  EXPECT_EQ(fp8::current_scale(std::numeric_limits<float>::denorm_min(), m), FLT_MAX);
  EXPECT_EQ(fp8::current_scale(1e-37f, m), FLT_MAX);
  EXPECT_LT(fp8::current_scale(1e-35f, m), FLT_MAX);
  EXPECT_EQ(fp8::recipe_scale(1e-40f, m, true), std::ldexp(1.0f, 127));
  // The largest amax: a normal scale. With a large margin the quotient goes below 2^-127 (here
  // 448 * 2^-32 / FLT_MAX is about 2^-151, which would round to 0): raised to 2^-127, whose inverse
  // is finite.
  EXPECT_EQ(fp8::current_scale(FLT_MAX, m), static_cast<float>(448.0 / FLT_MAX));
  const float min_scale = std::ldexp(1.0f, -127);
  for (bool pow2 : {false, true}) {
    EXPECT_EQ(fp8::recipe_scale(FLT_MAX, fp8::scaled_fp8_max(false, 32), pow2), min_scale);
    EXPECT_EQ(fp8::recipe_scale(std::ldexp(1.0f, 126), fp8::scaled_fp8_max(false, 10), pow2), min_scale);
    EXPECT_EQ(fp8::recipe_scale_inv(fp8::recipe_scale(FLT_MAX, fp8::scaled_fp8_max(true, 32), pow2)),
              std::ldexp(1.0f, 127));
  }
  // A subnormal quotient above 2^-127 stays (448 * 2^-135 = 1.75 * 2^-127), and rounds to 2^-127.
  const float sub = fp8::current_scale(std::ldexp(1.0f, 103), fp8::scaled_fp8_max(false, 32));
  EXPECT_EQ(sub, 1.75f * min_scale);
  EXPECT_LT(sub, FLT_MIN);
  EXPECT_EQ(fp8::recipe_scale(std::ldexp(1.0f, 103), fp8::scaled_fp8_max(false, 32), true), min_scale);
  EXPECT_TRUE(std::isfinite(fp8::recipe_scale_inv(sub)));
  for (int margin : {0, 16, 32})
    for (bool pow2 : {false, true}) {
      EXPECT_EQ(bits(fp8::recipe_scale(std::ldexp(1.0f, 103), fp8::scaled_fp8_max(false, margin), pow2)),
                bits(ref_scale(std::ldexp(1.0, 103), false, margin, pow2)));
      EXPECT_EQ(bits(fp8::recipe_scale(FLT_MAX, fp8::scaled_fp8_max(false, margin), pow2)),
                bits(ref_scale(FLT_MAX, false, margin, pow2)));
    }
}

TEST(PowerOfTwoScales, ExactPowersStayAndValuesJustBelowDropToTheNextPowerDown) {
  for (int e = -149; e <= 127; ++e) {
    const float p = std::ldexp(1.0f, e);
    ASSERT_EQ(fp8::round_scale_pow2(p), p) << e;
    const float below = std::nextafter(p, 0.0f);
    if (below > 0.0f) {
      ASSERT_EQ(fp8::round_scale_pow2(below), std::ldexp(1.0f, e - 1)) << e;
    }
    const float above = std::nextafter(p, kInf);
    if (e > -149) {  // above 2^-149 is 2^-148; above 2^127 is still finite
      ASSERT_EQ(fp8::round_scale_pow2(above), p) << e;
    }
  }
  EXPECT_EQ(fp8::round_scale_pow2(FLT_MAX), std::ldexp(1.0f, 127));
  EXPECT_EQ(fp8::round_scale_pow2(3.0f * std::ldexp(1.0f, -149)), std::ldexp(1.0f, -148));  // subnormal
  EXPECT_EQ(fp8::round_scale_pow2(std::nextafter(FLT_MIN, 0.0f)), std::ldexp(1.0f, -127));
  EXPECT_EQ(bits(fp8::round_scale_pow2(0.0f)), bits(0.0f));
  EXPECT_EQ(fp8::round_scale_pow2(kInf), kInf);
  EXPECT_TRUE(std::isnan(fp8::round_scale_pow2(kNaN)));
  EXPECT_EQ(fp8::round_scale_pow2(-3.0f), -2.0f);
}

TEST(PowerOfTwoScales, MatchFrexpOnRandomScalesAndNeverExceedTheScale) {
  std::mt19937 gen(11);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = gen() & 0x7FFFFFFFu;
    if (u >= 0x7F800000u || u == 0) continue;
    float s;
    std::memcpy(&s, &u, sizeof s);
    const float p = fp8::round_scale_pow2(s);
    int e = 0;
    std::frexp(static_cast<double>(s), &e);
    ASSERT_EQ(static_cast<double>(p), std::ldexp(1.0, e - 1)) << s;
    ASSERT_LE(p, s);
    ASSERT_GT(2.0 * p, static_cast<double>(s));
  }
}

TEST(ScaleBlocks, EveryElementMapsIntoTheGridOfItsMode) {
  for (ScaleMode mode : kModes)
    for (int64_t rows : {1, 127, 128, 129, 300})
      for (int64_t cols : {1, 100, 128, 257}) {
        const ScaleGrid g = fp8::scale_grid(mode, rows, cols);
        const fp8::ScaleBlock b = fp8::scale_block(mode, rows, cols);
        std::vector<int> hits(static_cast<size_t>(g.rows * g.cols), 0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t off = fp8::scale_offset(b, g.cols, r, c);
            ASSERT_GE(off, 0);
            ASSERT_LT(off, g.rows * g.cols) << fp8::scale_mode_name(mode);
            ++hits[static_cast<size_t>(off)];
          }
        for (int h : hits) ASSERT_GT(h, 0) << fp8::scale_mode_name(mode) << ": a cell without elements";
      }
}

// ---- The CPU reference, bit for bit against the re-implementation --------------------------------

TEST(RecipeQuantize, EveryModeMatchesTheIndependentReimplementationBitForBit) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {3, 128},  {5, 300}, {130, 257},
                                                {128, 128}, {257, 64}, {2, 1000}};
  uint32_t seed = 1;
  for (ScaleMode mode : kModes)
    for (bool e5m2 : {false, true})
      for (bool pow2 : {false, true})
        for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_F16})
          for (auto [rows, cols] : shapes) {
            Case k;
            k.mode = mode;
            k.e5m2 = e5m2;
            k.pow2 = pow2;
            k.dtype = dt;
            k.margin = (seed % 3 == 0) ? 2 : 0;
            k.ld_pad = seed % 2;
            const std::vector<float> x =
                random_values(rows, cols, seed++, dt == FP8_DTYPE_F16 ? -8 : -14, dt == FP8_DTYPE_F16 ? -2 : 4);
            const Result got = run_reference(x, rows, cols, k);
            const std::vector<float> values = make_input(x, dt).values;
            const std::string name = case_name(k, rows, cols);
            expect_same_layout(got.out, ref_of(values, rows, cols, k, false), name);
            expect_same_layout(got.out_t, ref_of(values, rows, cols, k, true), name + " (transposed copy)");
            ASSERT_EQ(got.out.nonfinite, 0) << name;
          }
}

TEST(RecipeQuantize, HalfInputsQuantiseAsTheirExactlyWidenedFloats) {
  for (fp8_dtype_t dt : {FP8_DTYPE_BF16, FP8_DTYPE_F16}) {
    Case k;
    k.mode = ScaleMode::kBlock1x128;
    k.dtype = dt;
    const std::vector<float> x = random_values(9, 200, 99, -8, -2);
    const Result half = run_reference(x, 9, 200, k);
    k.dtype = FP8_DTYPE_F32;
    const Result wide = run_reference(make_input(x, dt).values, 9, 200, k);
    expect_same_layout(half.out, wide.out, "half vs widened");
    expect_same_layout(half.out_t, wide.out_t, "half vs widened (transposed)");
  }
}

TEST(RecipeQuantize, AllZeroTileHasUnitScaleAndZeroCodes) {
  std::vector<float> x = random_values(2, 384, 5);
  for (int64_t c = 128; c < 256; ++c) x[static_cast<size_t>(384 + c)] = (c % 2) ? -0.0f : 0.0f;  // row 1, tile 1
  Case k;
  const Result r = run_reference(x, 2, 384, k);
  ASSERT_EQ(r.out.grid_cols, 3);
  EXPECT_EQ(r.out.scale_inv[3 + 1], 1.0f);
  for (int64_t c = 128; c < 256; ++c) EXPECT_EQ(r.out.codes[static_cast<size_t>(384 + c)], (c % 2) ? 0x80 : 0x00);
  EXPECT_EQ(r.out.nonfinite, 0);
  // An all-zero tensor: every mode gives scale 1 everywhere.
  for (ScaleMode mode : kModes) {
    k.mode = mode;
    const Result z = run_reference(std::vector<float>(200 * 3, 0.0f), 3, 200, k);
    for (float si : z.out.scale_inv) EXPECT_EQ(si, 1.0f) << fp8::scale_mode_name(mode);
    for (float si : z.out_t.scale_inv) EXPECT_EQ(si, 1.0f) << fp8::scale_mode_name(mode);
  }
}

TEST(RecipeQuantize, NanOrInfInOneTileOnlyAffectsThatTilesScale) {
  for (float bad : {kNaN, -kInf}) {
    for (ScaleMode mode : {ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128}) {
      const int64_t rows = 260, cols = 300;
      std::vector<float> x = random_values(rows, cols, 21);
      const int64_t br = 140, bc = 200;  // in 1x128 tile (140, 1), 128x128 block (1, 1), row 140
      x[static_cast<size_t>(br * cols + bc)] = bad;
      Case k;
      k.mode = mode;
      const Result got = run_reference(x, rows, cols, k);
      const std::string name = case_name(k, rows, cols) + (std::isnan(bad) ? " NaN" : " -inf");
      expect_same_layout(got.out, ref_of(x, rows, cols, k, false), name);
      expect_same_layout(got.out_t, ref_of(x, rows, cols, k, true), name + " (transposed copy)");
      EXPECT_EQ(got.out.nonfinite, 1) << name;
      // Same data without the bad value: only the bad cell's scale differs, and it is 1.
      std::vector<float> clean = x;
      clean[static_cast<size_t>(br * cols + bc)] = 0.0f;
      const Result ok = run_reference(clean, rows, cols, k);
      const fp8::ScaleBlock b = fp8::scale_block(mode, rows, cols);
      const int64_t bad_cell = fp8::scale_offset(b, got.out.grid_cols, br, bc);
      for (int64_t i = 0; i < static_cast<int64_t>(got.out.scale_inv.size()); ++i) {
        if (i == bad_cell)
          EXPECT_EQ(got.out.scale_inv[static_cast<size_t>(i)], 1.0f) << name;
        else
          EXPECT_EQ(bits(got.out.scale_inv[static_cast<size_t>(i)]), bits(ok.out.scale_inv[static_cast<size_t>(i)]))
              << name << " cell " << i;
      }
      EXPECT_EQ(got.out.codes[static_cast<size_t>(br * cols + bc)], std::isnan(bad) ? 0x7F : 0xFE) << name;
    }
    // Per tensor: the whole tensor's scale is 1.
    Case k;
    k.mode = ScaleMode::kTensor;
    std::vector<float> x = random_values(4, 50, 3);
    x[17] = bad;
    const Result got = run_reference(x, 4, 50, k);
    EXPECT_EQ(got.out.scale_inv[0], 1.0f);
    EXPECT_EQ(got.out_t.scale_inv[0], 1.0f);
    EXPECT_EQ(got.out.nonfinite, 1);
  }
}

TEST(RecipeQuantize, TinyAmaxTileGetsFltMaxScaleAndStillEncodesItsValues) {
  std::vector<float> x = random_values(1, 256, 8);
  for (int64_t c = 128; c < 256; ++c)
    x[static_cast<size_t>(c)] = std::ldexp(static_cast<float>(c - 112), -140);  // subnormal
  for (bool pow2 : {false, true}) {
    Case k;
    k.pow2 = pow2;
    const Result r = run_reference(x, 1, 256, k);
    expect_same_layout(r.out, ref_of(x, 1, 256, k, false), pow2 ? "tiny pow2" : "tiny");
    const float scale = pow2 ? std::ldexp(1.0f, 127) : FLT_MAX;
    EXPECT_EQ(bits(r.out.scale_inv[1]), bits(1.0f / scale));
    for (int64_t c = 128; c < 256; ++c) {
      const uint8_t q = r.out.codes[static_cast<size_t>(c)];
      EXPECT_EQ(q, fp8::encode_fp8(x[static_cast<size_t>(c)] * scale, false));
      EXPECT_NE(q, 0) << "a tiny value must not vanish: " << c;
    }
  }
}

TEST(RecipeQuantize, PartialLastTileUsesItsOwnAmax) {
  // K = 300: tiles of 128, 128 and 44; the 44 last elements are small and get their own scale.
  const int64_t rows = 130, cols = 300;
  std::vector<float> x = random_values(rows, cols, 31, -2, 2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 256; c < cols; ++c) x[static_cast<size_t>(r * cols + c)] *= 1.0f / 1024.0f;
  for (ScaleMode mode : {ScaleMode::kBlock1x128, ScaleMode::kBlock128x128}) {
    Case k;
    k.mode = mode;
    const Result res = run_reference(x, rows, cols, k);
    const fp8::ScaleBlock b = fp8::scale_block(mode, rows, cols);
    for (int64_t gi = 0; gi < res.out.grid_rows; ++gi) {
      double amax = 0.0;
      const int64_t r0 = gi * b.rows, r1 = std::min(rows, r0 + b.rows);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 256; c < cols; ++c)
          amax = std::max(amax, std::fabs(double{x[static_cast<size_t>(r * cols + c)]}));
      const float want = static_cast<float>(1.0 / ref_scale(amax, false, 0, false));
      EXPECT_EQ(bits(res.out.scale_inv[static_cast<size_t>(gi * 3 + 2)]), bits(want)) << fp8::scale_mode_name(mode);
    }
    // Partial blocks along rows too (130 = 128 + 2) for 128x128.
    EXPECT_EQ(res.out.grid_rows, mode == ScaleMode::kBlock128x128 ? 2 : rows);
  }
}

TEST(RecipeQuantize, PowerOfTwoScalesKeepTheCellsAmaxAboveHalfTheFp8Max) {
  for (ScaleMode mode : kModes) {
    Case k;
    k.mode = mode;
    k.pow2 = true;
    k.e5m2 = mode == ScaleMode::kRow;
    const int64_t rows = 150, cols = 333;
    const std::vector<float> x = random_values(rows, cols, 41);
    const Result res = run_reference(x, rows, cols, k);
    const fp8::ScaleBlock b = fp8::scale_block(mode, rows, cols);
    std::vector<double> amax(res.out.scale_inv.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        double& a = amax[static_cast<size_t>(fp8::scale_offset(b, res.out.grid_cols, r, c))];
        a = std::max(a, std::fabs(double{x[static_cast<size_t>(r * cols + c)]}));
      }
    for (size_t i = 0; i < amax.size(); ++i) {
      const float si = res.out.scale_inv[i];
      int e = 0;
      ASSERT_EQ(std::frexp(si, &e), 0.5f) << "scale_inv " << si << " is not a power of two";
      const double scaled = amax[i] / si;
      ASSERT_LE(scaled, fp8_max(k.e5m2)) << fp8::scale_mode_name(mode);
      ASSERT_GT(scaled, fp8_max(k.e5m2) / 2) << fp8::scale_mode_name(mode);
    }
  }
}

// |dequantised - x| <= |x| * (2^-(mant+1) + 2^-21) + (half the format's smallest step) * scale_inv * (1 + 2^-20):
// the FP8 rounding, plus the float rounding of x * scale, of scale_inv and of the dequantising multiply.
double error_bound(double x, bool e5m2, double scale_inv) {
  const fp8::Fp8Spec s = fp8::fp8_spec(e5m2);
  const double half_step = std::ldexp(1.0, 1 - s.bias - s.mant_bits - 1);
  return std::fabs(x) * (std::ldexp(1.0, -(s.mant_bits + 1)) + std::ldexp(1.0, -21)) +
         half_step * scale_inv * (1.0 + std::ldexp(1.0, -20));
}

// Checks the dequantised layout (the operand or its transposed copy, given by `at`) against the source.
void expect_within_bounds(const Layout& l, int64_t rows, int64_t cols, ScaleMode mode, bool e5m2,
                          const std::function<double(int64_t, int64_t)>& at, const std::string& name) {
  const fp8::ScaleBlock b = fp8::scale_block(mode, rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float si = l.scale_inv[static_cast<size_t>(fp8::scale_offset(b, l.grid_cols, r, c))];
      const double dq = fp8::dequantize_fp8(l.codes[static_cast<size_t>(r * cols + c)], e5m2, si);
      const double x = at(r, c);
      ASSERT_LE(std::fabs(dq - x), error_bound(x, e5m2, si)) << name << " at (" << r << ", " << c << "): " << x;
    }
}

TEST(RecipeQuantize, DequantisationErrorIsWithinTheBoundOfEachMode) {
  const int64_t rows = 200, cols = 390;
  const std::vector<float> x = random_values(rows, cols, 51);
  for (ScaleMode mode : kModes)
    for (bool e5m2 : {false, true})
      for (bool pow2 : {false, true}) {
        Case k;
        k.mode = mode;
        k.e5m2 = e5m2;
        k.pow2 = pow2;
        k.margin = pow2 ? 0 : 1;
        const Result res = run_reference(x, rows, cols, k);
        const std::string name = case_name(k, rows, cols);
        expect_within_bounds(
            res.out, rows, cols, mode, e5m2, [&](int64_t r, int64_t c) { return x[static_cast<size_t>(r * cols + c)]; },
            name);
        // Round trip through the transposed copy: dequantised, it is the source's transpose.
        expect_within_bounds(
            res.out_t, cols, rows, mode, e5m2,
            [&](int64_t r, int64_t c) { return x[static_cast<size_t>(c * cols + r)]; }, name + " (transposed copy)");
      }
}

TEST(RecipeQuantize, FinerScalesResolveSmallValuesThatPerTensorFlushes) {
  // One large outlier in row 0's first tile; the small values elsewhere survive 1x128 scaling but
  // underflow per tensor (E4M3's smallest step 2^-9 times 1e4 / 448 is far above 1e-3).
  const int64_t rows = 4, cols = 256;
  std::vector<float> x(static_cast<size_t>(rows * cols), 1e-3f);
  x[0] = 1e4f;
  Case k;
  k.mode = ScaleMode::kTensor;
  const Result tensor = run_reference(x, rows, cols, k);
  k.mode = ScaleMode::kBlock1x128;
  const Result block = run_reference(x, rows, cols, k);
  EXPECT_EQ(tensor.out.codes[300], 0x00);
  const float dq =
      fp8::dequantize_fp8(block.out.codes[300], false, block.out.scale_inv[static_cast<size_t>(1 * 2 + 0)]);
  EXPECT_NEAR(dq, 1e-3, 1e-3 / 16);
}

TEST(RecipeQuantize, TransposedCopyOf1x128IsQuantisedAlongItsOwnK) {
  const int64_t rows = 300, cols = 200;
  const std::vector<float> x = random_values(rows, cols, 61);
  std::vector<float> xt(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) xt[static_cast<size_t>(c * rows + r)] = x[static_cast<size_t>(r * cols + c)];
  for (ScaleMode mode : {ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128, ScaleMode::kTensor}) {
    Case k;
    k.mode = mode;
    const Result res = run_reference(x, rows, cols, k);
    Case kt = k;
    kt.with_t = false;
    const Result direct = run_reference(xt, cols, rows, kt);
    expect_same_layout(res.out_t, direct.out,
                       std::string(fp8::scale_mode_name(mode)) + ": copy vs quantised transpose");
    const ScaleGrid gt = fp8::scale_grid(mode, cols, rows);
    EXPECT_EQ(res.out_t.grid_rows, gt.rows);
    EXPECT_EQ(res.out_t.grid_cols, gt.cols);
  }
  // 1x128: the copy's scales are per 128 source rows of one column, so they differ from transposing.
  Case k;
  const Result res = run_reference(x, rows, cols, k);
  EXPECT_EQ(res.out_t.grid_rows, cols);
  EXPECT_EQ(res.out_t.grid_cols, 3);
  bool some_code_differs = false;
  for (int64_t r = 0; r < rows && !some_code_differs; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (res.out_t.codes[static_cast<size_t>(c * rows + r)] != res.out.codes[static_cast<size_t>(r * cols + c)]) {
        some_code_differs = true;
        break;
      }
  EXPECT_TRUE(some_code_differs);
}

TEST(RecipeQuantize, TransposeOf128x128IsTheTransposedCodesAndScales) {
  const int64_t rows = 300, cols = 260;
  for (bool pow2 : {false, true}) {
    Case k;
    k.mode = ScaleMode::kBlock128x128;
    k.pow2 = pow2;
    const Result res = run_reference(random_values(rows, cols, 71), rows, cols, k);
    ASSERT_EQ(res.out_t.grid_rows, res.out.grid_cols);
    ASSERT_EQ(res.out_t.grid_cols, res.out.grid_rows);
    for (int64_t i = 0; i < res.out.grid_rows; ++i)
      for (int64_t j = 0; j < res.out.grid_cols; ++j)
        ASSERT_EQ(bits(res.out_t.scale_inv[static_cast<size_t>(j * res.out_t.grid_cols + i)]),
                  bits(res.out.scale_inv[static_cast<size_t>(i * res.out.grid_cols + j)]));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(res.out_t.codes[static_cast<size_t>(c * rows + r)], res.out.codes[static_cast<size_t>(r * cols + c)]);
  }
}

TEST(RecipeQuantize, RowwiseTransposedCopyHasOneScalePerSourceColumn) {
  const int64_t rows = 40, cols = 70;
  const std::vector<float> x = random_values(rows, cols, 81);
  Case k;
  k.mode = ScaleMode::kRow;
  const Result res = run_reference(x, rows, cols, k);
  ASSERT_EQ(res.out_t.grid_rows, cols);
  ASSERT_EQ(res.out_t.grid_cols, 1);
  for (int64_t c = 0; c < cols; ++c) {
    double amax = 0.0;
    for (int64_t r = 0; r < rows; ++r) amax = std::max(amax, std::fabs(double{x[static_cast<size_t>(r * cols + c)]}));
    EXPECT_EQ(bits(res.out_t.scale_inv[static_cast<size_t>(c)]),
              bits(static_cast<float>(1.0 / ref_scale(amax, false, 0, false))));
  }
}

TEST(RecipeQuantize, EmptyOperandWritesOnlyThePerTensorScale) {
  for (ScaleMode mode : kModes) {
    Case k;
    k.mode = mode;
    const Result res = run_reference({}, 0, 128, k);
    if (mode == ScaleMode::kTensor) {
      ASSERT_EQ(res.out.scale_inv.size(), 1u);
      EXPECT_EQ(res.out.scale_inv[0], 1.0f);
    } else {
      EXPECT_EQ(res.out.grid_rows * res.out.grid_cols,
                fp8::scale_grid(mode, 0, 128).rows * fp8::scale_grid(mode, 0, 128).cols);
    }
  }
}

// ---- Misuse ---------------------------------------------------------------------------------------

void expect_status(const std::function<void()>& call, fp8_status_t status, const std::string& word) {
  try {
    call();
    ADD_FAILURE() << "no error, expected " << fp8_status_string(status);
  } catch (const fp8::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << "no \"" << word << "\" in: " << e.what();
  }
}

TEST(RecipeQuantize, RefusesWrongGridsModesDtypesAndMargins) {
  std::vector<float> in(4 * 256, 1.0f), grid(8), grid_t(256);
  std::vector<uint8_t> out(in.size()), out_t(in.size());
  const auto job = [&] {
    fp8::RecipeQuantizeJob j{};
    j.in = in.data();
    j.in_dtype = FP8_DTYPE_F32;
    j.rows = 4;
    j.cols = 256;
    j.out = out.data();
    j.out_scale_inv = {ScaleMode::kBlock1x128, grid.data(), 4, 2, 2};
    j.out_t = out_t.data();
    j.out_t_scale_inv = {ScaleMode::kBlock1x128, grid_t.data(), 256, 1, 1};
    return j;
  };
  EXPECT_NO_THROW(fp8::cpu_recipe_quantize(job()));
  auto j = job();
  j.out_scale_inv.cols = 1;
  expect_status([&] { fp8::cpu_recipe_quantize(j); }, FP8_ERR_SHAPE, "out_scale_inv");
  j = job();
  j.out_t_scale_inv.rows = 4;
  expect_status([&] { fp8::cpu_recipe_quantize(j); }, FP8_ERR_SHAPE, "out_t_scale_inv");
  j = job();
  j.out_t_scale_inv = {ScaleMode::kRow, grid_t.data(), 256, 1, 1};
  expect_status([&] { fp8::cpu_recipe_quantize(j); }, FP8_ERR_INVALID_ARGUMENT, "keeps the mode");
  j = job();
  j.in_dtype = FP8_DTYPE_E4M3;
  expect_status([&] { fp8::cpu_recipe_quantize(j); }, FP8_ERR_DTYPE, "F32");
  j = job();
  j.margin = 33;
  expect_status([&] { fp8::cpu_recipe_quantize(j); }, FP8_ERR_INVALID_ARGUMENT, "margin");
  j = job();
  j.out = nullptr;
  expect_status([&] { fp8::cpu_recipe_quantize(j); }, FP8_ERR_INVALID_ARGUMENT, "out");
}

}  // namespace

// ---- Current scaling through the C API (fp8_quantize with a state made under scaling=current) ----

float amax_of_values(const std::vector<float>& v) {
  float a = 0.0f;
  for (float f : v) a = std::max(a, std::fabs(f));
  return a;
}

namespace api {

using fp8test::Context;
using fp8test::Recipe;
using fp8test::Scaling;
using fp8test::Tensor;

// One fp8_quantize (with its transposed copy) of `x` in dtype k.dtype through a current-scaling
// state of k's format, margin and power_2_scales, on the CPU backend: the codes and scale_inv of
// both layouts, and the state afterwards. A second cast through the same state follows when
// `then` is not empty (its result replaces the first).
struct ApiResult {
  Layout out, out_t;
  fp8_scaling_info_t info{};
};
ApiResult quantize_current(const std::vector<std::vector<float>>& inputs, int64_t rows, int64_t cols, const Case& k) {
  Context ctx = fp8test::make_context(FP8_DEVICE_CPU);
  fp8_context_t* c = ctx.get();
  const std::string text = "scaling=current, fp8_format=HYBRID, margin=" + std::to_string(k.margin) +
                           ", power_2_scales=" + (k.pow2 ? "on" : "off");
  Recipe recipe = fp8test::make_recipe(text.c_str());
  Scaling state = fp8test::make_scaling(c, recipe.get(), k.e5m2 ? FP8_ROLE_BACKWARD : FP8_ROLE_FORWARD);
  fp8_scaling_t* s = state.get();
  const fp8_dtype_t q = k.e5m2 ? FP8_DTYPE_E5M2 : FP8_DTYPE_E4M3;
  Tensor tin = fp8test::make_tensor(c, k.dtype, {rows, cols}), tout = fp8test::make_tensor(c, q, {rows, cols}),
         tout_t = fp8test::make_tensor(c, q, {cols, rows});
  fp8_tensor_t *in = tin.get(), *out = tout.get(), *out_t = tout_t.get();
  ApiResult res;
  for (const std::vector<float>& x : inputs) {
    const Input input = make_input(x, k.dtype);
    if (k.dtype == FP8_DTYPE_F32)
      EXPECT_EQ(fp8_tensor_copy_from_host(in, input.f32.data(), input.f32.size() * 4), FP8_OK);
    else
      EXPECT_EQ(fp8_tensor_copy_from_host(in, input.half.data(), input.half.size() * 2), FP8_OK);
    EXPECT_EQ(fp8_quantize(c, in, out, out_t, s), FP8_OK) << fp8_last_error_message();
  }
  for (auto [t, l] : {std::pair{out, &res.out}, std::pair{out_t, &res.out_t}}) {
    l->codes.resize(static_cast<size_t>(rows * cols));
    EXPECT_EQ(fp8_tensor_copy_to_host(t, l->codes.data(), l->codes.size()), FP8_OK);
    float si = 0.0f;
    EXPECT_EQ(fp8_tensor_get_scale_inv(t, &si), FP8_OK);
    l->scale_inv = {si};
    l->grid_rows = l->grid_cols = 1;
  }
  fp8_scaling_info_init(&res.info);
  EXPECT_EQ(fp8_scaling_get_info(s, &res.info), FP8_OK);
  return res;
}

}  // namespace api

// fp8_quantize through a current-scaling state is the per-tensor rule: the same codes and scale_inv
// as the CPU reference's per-tensor mode and as the independent re-implementation, for every input
// dtype, format, margin and power-of-two setting, the transposed copy included. The state shows
// the cast: slot 0 holds amax(in) as the rule defines it, the scale and scale_inv it used, one
// update per cast and the non-finite ones counted.
TEST(CurrentScalingApi, Fp8QuantizeIsThePerTensorReferenceBitForBit) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {5, 300}, {130, 257}, {64, 64}};
  uint32_t seed = 500;
  for (bool e5m2 : {false, true})
    for (bool pow2 : {false, true})
      for (int margin : {0, 2})
        for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_BF16, FP8_DTYPE_F16})
          for (auto [rows, cols] : shapes) {
            Case k;
            k.mode = ScaleMode::kTensor;
            k.e5m2 = e5m2;
            k.pow2 = pow2;
            k.margin = margin;
            k.dtype = dt;
            const std::vector<float> x =
                random_values(rows, cols, seed++, dt == FP8_DTYPE_F16 ? -8 : -14, dt == FP8_DTYPE_F16 ? -2 : 4);
            const std::string name = "api " + case_name(k, rows, cols);
            const api::ApiResult got = api::quantize_current({x}, rows, cols, k);
            const Result want = run_reference(x, rows, cols, k);
            expect_same_layout(got.out, want.out, name);
            expect_same_layout(got.out_t, want.out_t, name + " (transposed copy)");
            const std::vector<float> values = make_input(x, dt).values;
            expect_same_layout(got.out, ref_of(values, rows, cols, k, false), name + " vs re-implementation");
            const float amax = amax_of_values(values);
            EXPECT_EQ(bits(got.info.amax), bits(amax)) << name;
            EXPECT_EQ(bits(got.info.scale), bits(ref_scale(amax, e5m2, margin, pow2))) << name;
            EXPECT_EQ(bits(got.info.scale_inv), bits(got.out.scale_inv[0])) << name;
            EXPECT_EQ(got.info.update_count, 1) << name;
            EXPECT_EQ(got.info.nonfinite_count, 0) << name;
          }
}

// Each cast takes its own amax: a second, smaller input through the same state gets its own scale
// (slot 0 is replaced, not max-accumulated), and the casts are counted.
TEST(CurrentScalingApi, EachCastScalesByItsOwnAmax) {
  Case k;
  k.mode = ScaleMode::kTensor;
  std::vector<float> big = random_values(16, 32, 7, 2, 6), small = random_values(16, 32, 8, -10, -6);
  const api::ApiResult got = api::quantize_current({big, small}, 16, 32, k);
  expect_same_layout(got.out, run_reference(small, 16, 32, k).out, "second cast");
  EXPECT_EQ(got.info.amax, amax_of_values(small));
  EXPECT_EQ(got.info.update_count, 2);
}

// Non-finite and degenerate inputs: NaN anywhere or inf give scale 1 and are counted; all zeros give
// scale 1 and zero codes; a subnormal-only input gives FLT_MAX (its quotient overflows).
TEST(CurrentScalingApi, NonFiniteZeroAndTinyInputsFollowTheRule) {
  Case k;
  k.mode = ScaleMode::kTensor;
  struct Special {
    const char* what;
    float value;  // written at element 3 of an otherwise normal input, or everywhere (all)
    bool all;
    float scale;
    int64_t nonfinite;
  };
  const Special cases[] = {{"NaN", kNaN, false, 1.0f, 1},     {"inf", kInf, false, 1.0f, 1},
                           {"-inf", -kInf, false, 1.0f, 1},  {"zeros", 0.0f, true, 1.0f, 0},
                           {"subnormal", 1e-42f, true, FLT_MAX, 0}};
  for (const Special& c : cases) {
    std::vector<float> x = random_values(8, 40, 21, -3, 3);
    if (c.all) std::fill(x.begin(), x.end(), c.value);
    else x[3] = c.value;
    const api::ApiResult got = api::quantize_current({x}, 8, 40, k);
    EXPECT_EQ(got.info.scale, c.scale) << c.what;
    EXPECT_EQ(got.info.nonfinite_count, c.nonfinite) << c.what;
    expect_same_layout(got.out, run_reference(x, 8, 40, k).out, c.what);
  }
}

// The FP8 outputs that another kernel casts (a GEMM's D, an activation's or a norm's y) need their
// scale before the output exists: a current-scaling state is refused there with FP8_ERR_UNSUPPORTED
// naming the argument, and the output keeps its bytes.
TEST(CurrentScalingApi, OutputsCastInsideAnotherKernelRefuseACurrentState) {
  api::Context ctx = fp8test::make_context(FP8_DEVICE_CPU);
  fp8_context_t* c = ctx.get();
  api::Recipe recipe = fp8test::make_recipe("scaling=current");
  api::Scaling state = fp8test::make_scaling(c, recipe.get(), FP8_ROLE_FORWARD);
  fp8_scaling_t* s = state.get();
  api::Tensor ta = fp8test::make_tensor(c, FP8_DTYPE_F32, {16, 16}), ta8 = fp8test::make_tensor(c, FP8_DTYPE_E4M3, {16, 16}),
              td = fp8test::make_tensor(c, FP8_DTYPE_E4M3, {16, 16}), tg = fp8test::make_tensor(c, FP8_DTYPE_F32, {16});
  fp8_tensor_t *a = ta.get(), *a8 = ta8.get(), *d = td.get(), *gamma = tg.get();
  const std::vector<float> ones(256, 1.0f), gammas(16, 1.0f);
  const std::vector<uint8_t> marker(256, 0x5A);
  ASSERT_EQ(fp8_tensor_copy_from_host(a, ones.data(), 1024), FP8_OK);
  ASSERT_EQ(fp8_tensor_copy_from_host(gamma, gammas.data(), 64), FP8_OK);
  ASSERT_EQ(fp8_tensor_copy_from_host(d, marker.data(), 256), FP8_OK);
  const std::vector<uint8_t> one_codes(256, 0x38);  // 1.0 in E4M3
  ASSERT_EQ(fp8_tensor_copy_from_host(a8, one_codes.data(), 256), FP8_OK);
  const std::pair<const char*, std::function<fp8_status_t()>> calls[] = {
      {"d_scaling", [&] { return fp8_gemm(c, a8, a8, nullptr, d, s, nullptr); }},
      {"y_scaling", [&] { return fp8_activation_forward(c, FP8_ACTIVATION_GELU, a, d, s); }},
      {"y_scaling", [&] { return fp8_norm_forward(c, FP8_NORM_RMSNORM, a, gamma, nullptr, 1e-5f, d, s, nullptr, nullptr); }},
  };
  for (const auto& [arg, call] : calls) {
    EXPECT_EQ(call(), FP8_ERR_UNSUPPORTED) << arg;
    const std::string msg = fp8_last_error_message();
    EXPECT_NE(msg.find(arg), std::string::npos) << msg;
    EXPECT_NE(msg.find("current scaling"), std::string::npos) << msg;
  }
  std::vector<uint8_t> after(256);
  ASSERT_EQ(fp8_tensor_copy_to_host(d, after.data(), 256), FP8_OK);
  EXPECT_EQ(after, marker);
}

// A column-major grid (cuBLASLt's layout of 1x128 scales: the rows' scales of one K block side by
// side) holds the same scale of each cell as the row-major one, at ptr[j * ld + i]; ld must cover
// the grid's rows, and the codes do not change.
TEST(RecipeQuantize, ColumnMajorGridsHoldTheSameScalesAtTheTransposedOffsets) {
  for (ScaleMode mode : kModes) {
    const int64_t rows = 200, cols = 300;
    const std::vector<float> x = random_values(rows, cols, 77);
    const ScaleGrid g = fp8::scale_grid(mode, rows, cols);
    std::vector<float> row_major(static_cast<size_t>(g.rows * g.cols)), col_major(static_cast<size_t>(g.cols * (g.rows + 2)), kPadding);
    std::vector<uint8_t> codes_r(static_cast<size_t>(rows * cols)), codes_c(codes_r.size());
    fp8::RecipeQuantizeJob j{};
    j.in = x.data();
    j.in_dtype = FP8_DTYPE_F32;
    j.rows = rows;
    j.cols = cols;
    j.out = codes_r.data();
    j.out_scale_inv = {mode, row_major.data(), g.rows, g.cols, g.cols};
    fp8::cpu_recipe_quantize(j);
    j.out = codes_c.data();
    j.out_scale_inv = {mode, col_major.data(), g.rows, g.cols, g.rows + 2, true};
    fp8::cpu_recipe_quantize(j);
    EXPECT_EQ(codes_c, codes_r) << fp8::scale_mode_name(mode);
    for (int64_t i = 0; i < g.rows; ++i)
      for (int64_t k = 0; k < g.cols; ++k) {
        ASSERT_EQ(bits(col_major[static_cast<size_t>(k * (g.rows + 2) + i)]), bits(row_major[static_cast<size_t>(i * g.cols + k)]))
            << fp8::scale_mode_name(mode) << " cell " << i << ", " << k;
        EXPECT_EQ(col_major[static_cast<size_t>(k * (g.rows + 2) + g.rows)], kPadding) << "padding written";
      }
    j.out_scale_inv = {mode, col_major.data(), g.rows, g.cols, std::max<int64_t>(g.rows, 1) - 1, true};
    if (g.rows > 1) {
      EXPECT_THROW(fp8::cpu_recipe_quantize(j), fp8::Error) << "ld below the grid's rows";
    }
  }
}

// ---- The scale-grid API: fp8_scale_grid_shape, fp8_quantize_scaled, fp8_gemm_scaled ------------

namespace api {

// A CPU context with the default recipe, and tensors on it.
struct Cpu {
  Context ctx = fp8test::make_context(FP8_DEVICE_CPU);
  Recipe recipe = fp8test::make_recipe();
  Tensor tensor(fp8_dtype_t dt, std::vector<int64_t> shape) { return fp8test::make_tensor(ctx.get(), dt, std::move(shape)); }
  Tensor grid(fp8_scale_mode_t mode, int64_t rows, int64_t cols) {
    int64_t shape[2] = {-1, -1};
    EXPECT_EQ(fp8_scale_grid_shape(mode, rows, cols, shape), FP8_OK) << fp8_last_error_message();
    return tensor(FP8_DTYPE_F32, {shape[0], shape[1]});
  }
};

using fp8test::download;

ScaleMode mode_of(fp8_scale_mode_t m) {
  return m == FP8_SCALE_MODE_ROW ? ScaleMode::kRow : m == FP8_SCALE_MODE_BLOCK_1X128 ? ScaleMode::kBlock1x128 : ScaleMode::kBlock128x128;
}

}  // namespace api

// The grid shapes of fp8.h's "Scale grids" (cuBLASLt's layouts), and the refusals.
TEST(ScaleGridApi, ShapesFollowTheLayoutCublasLtReads) {
  struct Case {
    fp8_scale_mode_t mode;
    int64_t rows, cols, want0, want1;
  };
  const Case cases[] = {{FP8_SCALE_MODE_ROW, 300, 1000, 300, 1},         {FP8_SCALE_MODE_BLOCK_1X128, 300, 1000, 8, 300},
                        {FP8_SCALE_MODE_BLOCK_128X128, 300, 1000, 3, 8}, {FP8_SCALE_MODE_BLOCK_128X128, 300, 300, 3, 4},
                        {FP8_SCALE_MODE_BLOCK_128X128, 128, 640, 1, 8},  {FP8_SCALE_MODE_BLOCK_1X128, 7, 0, 0, 7},
                        {FP8_SCALE_MODE_ROW, 7, 0, 7, 1},                {FP8_SCALE_MODE_BLOCK_128X128, 0, 5, 0, 4}};
  for (const Case& c : cases) {
    int64_t shape[2] = {-1, -1};
    ASSERT_EQ(fp8_scale_grid_shape(c.mode, c.rows, c.cols, shape), FP8_OK) << fp8_last_error_message();
    EXPECT_EQ(shape[0], c.want0) << c.mode << " [" << c.rows << ", " << c.cols << "]";
    EXPECT_EQ(shape[1], c.want1) << c.mode << " [" << c.rows << ", " << c.cols << "]";
  }
  int64_t shape[2] = {-1, -1};
  EXPECT_EQ(fp8_scale_grid_shape(0, 4, 4, shape), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp8_last_error_message()).find("FP8_SCALE_MODE_ROW"), std::string::npos);
  EXPECT_EQ(fp8_scale_grid_shape(FP8_SCALE_MODE_ROW, -1, 4, shape), FP8_ERR_SHAPE);
  // Sizes no FP8 operand has (the block counts would overflow): refused, naming both.
  constexpr int64_t kMax = int64_t{1} << 62, kHuge = std::numeric_limits<int64_t>::max();
  for (fp8_scale_mode_t mode : {FP8_SCALE_MODE_ROW, FP8_SCALE_MODE_BLOCK_1X128, FP8_SCALE_MODE_BLOCK_128X128})
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, kHuge},
                                     {kHuge - 100, 5},
                                     {0, kMax + 1},
                                     {int64_t{1} << 32, int64_t{1} << 31}}) {
      EXPECT_EQ(fp8_scale_grid_shape(mode, rows, cols, shape), FP8_ERR_SHAPE)
          << mode << " [" << rows << ", " << cols << "]";
      EXPECT_NE(std::string(fp8_last_error_message()).find("2^62"), std::string::npos) << fp8_last_error_message();
    }
  ASSERT_EQ(fp8_scale_grid_shape(FP8_SCALE_MODE_BLOCK_1X128, 0, kMax, shape), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(shape[0], kMax / 128);
  EXPECT_EQ(shape[1], 0);
  shape[0] = shape[1] = -1;
  EXPECT_EQ(fp8_scale_grid_shape(FP8_SCALE_MODE_ROW, 4, 4, nullptr), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(shape[0], -1) << "a refusal writes nothing";
}

// Every refusal of fp8_quantize_scaled names the argument and leaves all four outputs as they were.
TEST(ScaleGridApi, QuantizeScaledMisuseLeavesEveryOutputUnchanged) {
  api::Cpu cpu, other;
  const int64_t m = 16, k = 256;
  fp8_context_t* c = cpu.ctx.get();
  auto in = cpu.tensor(FP8_DTYPE_F32, {m, k});
  auto out = cpu.tensor(FP8_DTYPE_E4M3, {m, k}), out_t = cpu.tensor(FP8_DTYPE_E4M3, {k, m});
  auto g = cpu.grid(FP8_SCALE_MODE_ROW, m, k), gt = cpu.grid(FP8_SCALE_MODE_ROW, k, m);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 37) - 18.5f;
  fp8test::upload(in.get(), x);
  const std::vector<uint8_t> code_marker(static_cast<size_t>(m * k), 0xAB);
  const std::vector<float> g_marker(static_cast<size_t>(m), -5.0f), gt_marker(static_cast<size_t>(k), -6.0f);
  fp8test::upload(out.get(), code_marker);
  fp8test::upload(out_t.get(), code_marker);
  fp8test::upload(g.get(), g_marker);
  fp8test::upload(gt.get(), gt_marker);
  auto f32_out = cpu.tensor(FP8_DTYPE_F32, {m, k}), short_out = cpu.tensor(FP8_DTYPE_E4M3, {m, 128});
  auto f16_grid = cpu.tensor(FP8_DTYPE_F16, {m, 1}), grid_3d = cpu.tensor(FP8_DTYPE_F32, {m, 1, 1});
  auto f32_out_t = cpu.tensor(FP8_DTYPE_F32, {k, m}), unturned_t = cpu.tensor(FP8_DTYPE_E4M3, {m, k});
  auto short_gt = cpu.tensor(FP8_DTYPE_F32, {k - 1, 1}), foreign_out = other.tensor(FP8_DTYPE_E4M3, {m, k});
  const fp8_recipe_t* r = cpu.recipe.get();
  const auto q = [&](fp8_context_t* ctx, const fp8_tensor_t* src, fp8_scale_mode_t mode, const fp8_recipe_t* rec,
                     fp8_tensor_t* o, fp8_tensor_t* og, fp8_tensor_t* ot,
                     fp8_tensor_t* otg) { return fp8_quantize_scaled(ctx, src, mode, rec, o, og, ot, otg); };
  constexpr fp8_scale_mode_t kRow = FP8_SCALE_MODE_ROW;
  const std::vector<std::tuple<std::function<fp8_status_t()>, fp8_status_t, std::vector<std::string>>> bad = {
      {[&] { return q(nullptr, in.get(), kRow, r, out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"ctx"}},
      {[&] { return q(c, nullptr, kRow, r, out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"in"}},
      {[&] { return q(c, in.get(), kRow, nullptr, out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"recipe"}},
      {[&] { return q(c, in.get(), kRow, r, nullptr, g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"out"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), nullptr, out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"out_scales"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), g.get(), nullptr, gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"out_transposed"}},
      {[&] { return q(c, in.get(), 0, r, out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"mode = 0"}},
      {[&] { return q(c, in.get(), 4, r, out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"mode = 4"}},
      {[&] { return q(c, in.get(), kRow, r, f32_out.get(), g.get(), out_t.get(), gt.get()); }, FP8_ERR_DTYPE, {"out"}},
      {[&] { return q(c, in.get(), kRow, r, short_out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_SHAPE,
       {"out"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), f16_grid.get(), out_t.get(), gt.get()); },
       FP8_ERR_DTYPE,
       {"out_scales"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), grid_3d.get(), out_t.get(), gt.get()); },
       FP8_ERR_SHAPE,
       {"out_scales", "[16, 1]"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), g.get(), f32_out_t.get(), gt.get()); },
       FP8_ERR_DTYPE,
       {"out_transposed"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), g.get(), unturned_t.get(), gt.get()); },
       FP8_ERR_SHAPE,
       {"out_transposed", "[256, 16]"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), g.get(), out_t.get(), short_gt.get()); },
       FP8_ERR_SHAPE,
       {"out_t_scales", "[256, 1]"}},
      {[&] { return q(c, in.get(), kRow, r, out.get(), g.get(), out_t.get(), g.get()); },
       FP8_ERR_SHAPE,
       {"out_t_scales"}},
      {[&] { return q(c, in.get(), kRow, r, foreign_out.get(), g.get(), out_t.get(), gt.get()); },
       FP8_ERR_INVALID_ARGUMENT,
       {"out", "another context"}},
  };
  for (const auto& [call, status, words] : bad) {
    const fp8_status_t got = call();
    const std::string msg = fp8_last_error_message();
    EXPECT_EQ(got, status) << msg;
    EXPECT_EQ(msg.rfind("fp8_quantize_scaled:", 0), 0u) << msg;
    for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "no \"" << w << "\" in: " << msg;
    EXPECT_EQ(api::download<uint8_t>(out.get()), code_marker) << msg;
    EXPECT_EQ(api::download<uint8_t>(out_t.get()), code_marker) << msg;
    EXPECT_EQ(api::download<float>(g.get()), g_marker) << msg;
    EXPECT_EQ(api::download<float>(gt.get()), gt_marker) << msg;
  }
  // The same call, put right, writes them all.
  ASSERT_EQ(q(c, in.get(), kRow, r, out.get(), g.get(), out_t.get(), gt.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_NE(api::download<uint8_t>(out.get()), code_marker);
  EXPECT_NE(api::download<float>(gt.get()), gt_marker);
}

// More refusals of fp8_gemm_scaled, each naming its argument and leaving D as it was.
TEST(ScaleGridApi, GemmScaledMisuseLeavesDUnchanged) {
  api::Cpu cpu;
  const int64_t m = 16, n = 16, k = 256;
  fp8_context_t* c = cpu.ctx.get();
  auto a = cpu.tensor(FP8_DTYPE_E4M3, {m, k}), b = cpu.tensor(FP8_DTYPE_E4M3, {n, k});
  auto ga = cpu.grid(FP8_SCALE_MODE_ROW, m, k), gb = cpu.grid(FP8_SCALE_MODE_ROW, n, k);
  auto g1 = cpu.grid(FP8_SCALE_MODE_BLOCK_1X128, m, k), g2a = cpu.grid(FP8_SCALE_MODE_BLOCK_128X128, m, k);
  auto f16_grid = cpu.tensor(FP8_DTYPE_F16, {m, 1}), f32_bias = cpu.tensor(FP8_DTYPE_F32, {n});
  auto d = cpu.tensor(FP8_DTYPE_F32, {m, n});
  auto a0 = cpu.tensor(FP8_DTYPE_E4M3, {m, 0}), b0 = cpu.tensor(FP8_DTYPE_E4M3, {n, 0});
  auto ga0 = cpu.grid(FP8_SCALE_MODE_ROW, m, 0), gb0 = cpu.grid(FP8_SCALE_MODE_ROW, n, 0);
  alignas(16) static float aligned_host[64];  // the grid 4 bytes in: not 16-byte aligned
  const int64_t grid_shape[2] = {m, 1};
  fp8_tensor_t* misaligned = nullptr;
  ASSERT_EQ(fp8_tensor_wrap(&misaligned, c, FP8_DTYPE_F32, 2, grid_shape, aligned_host + 1), FP8_OK)
      << fp8_last_error_message();
  const fp8test::Tensor misaligned_grid(misaligned);
  const std::vector<float> marker(static_cast<size_t>(m * n), -5.0f);
  fp8test::upload(d.get(), marker);
  fp8_gemm_options_t v0;
  fp8_gemm_options_init(&v0);
  v0.struct_size = 0;
  constexpr fp8_scale_mode_t kRow = FP8_SCALE_MODE_ROW;
  const std::vector<std::tuple<std::function<fp8_status_t()>, fp8_status_t, std::vector<std::string>>> bad = {
      {[&] { return fp8_gemm_scaled(c, a.get(), kRow, nullptr, b.get(), kRow, gb.get(), nullptr, d.get(), nullptr); },
       FP8_ERR_INVALID_ARGUMENT,
       {"a_scales"}},
      {[&] { return fp8_gemm_scaled(c, a.get(), kRow, ga.get(), b.get(), kRow, nullptr, nullptr, d.get(), nullptr); },
       FP8_ERR_INVALID_ARGUMENT,
       {"b_scales"}},
      {[&] {
         return fp8_gemm_scaled(c, a.get(), kRow, f16_grid.get(), b.get(), kRow, gb.get(), nullptr, d.get(), nullptr);
       },
       FP8_ERR_DTYPE,
       {"a_scales", "f32"}},
      {[&] {
         return fp8_gemm_scaled(c, a.get(), kRow, misaligned_grid.get(), b.get(), kRow, gb.get(), nullptr, d.get(),
                                nullptr);
       },
       FP8_ERR_INVALID_ARGUMENT,
       {"a_scales", "16-byte aligned"}},
      {[&] {
         return fp8_gemm_scaled(c, a.get(), kRow, ga.get(), b.get(), kRow, gb.get(), f32_bias.get(), d.get(), nullptr);
       },
       FP8_ERR_DTYPE,
       {"bias", "bf16"}},
      {[&] {
         return fp8_gemm_scaled(c, a0.get(), kRow, ga0.get(), b0.get(), kRow, gb0.get(), nullptr, d.get(), nullptr);
       },
       FP8_ERR_SHAPE,
       {"k = 0"}},
      {[&] { return fp8_gemm_scaled(c, a.get(), kRow, ga.get(), b.get(), kRow, gb.get(), nullptr, d.get(), &v0); },
       FP8_ERR_INVALID_ARGUMENT,
       {"options"}},
      {[&] {
         return fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_128X128,
                                cpu.grid(FP8_SCALE_MODE_BLOCK_128X128, m, k).get(), b.get(), kRow, gb.get(), nullptr,
                                d.get(), nullptr);
       },
       FP8_ERR_UNSUPPORTED,
       {"a_mode = FP8_SCALE_MODE_BLOCK_128X128", "b_mode = FP8_SCALE_MODE_ROW"}},
      {[&] {
         return fp8_gemm_scaled(c, a.get(), kRow, ga.get(), b.get(), FP8_SCALE_MODE_BLOCK_1X128, g1.get(), nullptr,
                                d.get(), nullptr);
       },
       FP8_ERR_UNSUPPORTED,
       {"a_mode = FP8_SCALE_MODE_ROW", "b_mode = FP8_SCALE_MODE_BLOCK_1X128"}},
  };
  for (const auto& [call, status, words] : bad) {
    const fp8_status_t got = call();
    const std::string msg = fp8_last_error_message();
    EXPECT_EQ(got, status) << msg;
    EXPECT_EQ(msg.rfind("fp8_gemm_scaled:", 0), 0u) << msg;
    for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "no \"" << w << "\" in: " << msg;
    EXPECT_EQ(api::download<float>(d.get()), marker) << msg;
  }
}

// fp8_quantize_scaled is the reference of each mode, in cuBLASLt's grid layout: the same codes and
// the same scale per cell as the CPU reference with row-major grids, for both layouts.
TEST(ScaleGridApi, QuantizeScaledIsTheReferenceInTheGemmLayout) {
  api::Cpu cpu;
  const int64_t rows = 200, cols = 300;
  const std::vector<float> x = random_values(rows, cols, 91);
  auto in = cpu.tensor(FP8_DTYPE_F32, {rows, cols});
  ASSERT_EQ(fp8_tensor_copy_from_host(in.get(), x.data(), x.size() * 4), FP8_OK);
  for (fp8_scale_mode_t m : {FP8_SCALE_MODE_ROW, FP8_SCALE_MODE_BLOCK_1X128, FP8_SCALE_MODE_BLOCK_128X128}) {
    SCOPED_TRACE(m);
    const ScaleMode mode = api::mode_of(m);
    auto out = cpu.tensor(FP8_DTYPE_E5M2, {rows, cols}), out_t = cpu.tensor(FP8_DTYPE_E5M2, {cols, rows});
    auto g = cpu.grid(m, rows, cols), gt = cpu.grid(m, cols, rows);
    ASSERT_EQ(fp8_quantize_scaled(cpu.ctx.get(), in.get(), m, cpu.recipe.get(), out.get(), g.get(), out_t.get(), gt.get()),
              FP8_OK)
        << fp8_last_error_message();
    Case k;
    k.mode = mode;
    k.e5m2 = true;
    k.pow2 = mode != ScaleMode::kRow;  // power_2_scales=auto
    const Result want = run_reference(x, rows, cols, k);
    EXPECT_EQ(api::download<uint8_t>(out.get()), want.out.codes);
    EXPECT_EQ(api::download<uint8_t>(out_t.get()), want.out_t.codes);
    const std::vector<float> grid = api::download<float>(g.get()), grid_t = api::download<float>(gt.get());
    const fp8::ScaleDesc d = fp8::gemm_grid(mode, rows, cols, nullptr), dt = fp8::gemm_grid(mode, cols, rows, nullptr);
    for (int64_t i = 0; i < want.out.grid_rows; ++i)
      for (int64_t j = 0; j < want.out.grid_cols; ++j)
        ASSERT_EQ(bits(grid[static_cast<size_t>(d.at(i, j))]), bits(want.out.scale_inv[static_cast<size_t>(i * want.out.grid_cols + j)]))
            << "cell " << i << ", " << j;
    for (int64_t i = 0; i < want.out_t.grid_rows; ++i)
      for (int64_t j = 0; j < want.out_t.grid_cols; ++j)
        ASSERT_EQ(bits(grid_t[static_cast<size_t>(dt.at(i, j))]),
                  bits(want.out_t.scale_inv[static_cast<size_t>(i * want.out_t.grid_cols + j)]))
            << "transposed cell " << i << ", " << j;
  }
}

// fp8_gemm_scaled on operands fp8_quantize_scaled made: the float64 sum of the dequantised
// products (the CPU backend accumulates in double), plus a bf16 bias, for every pair.
TEST(ScaleGridApi, GemmScaledIsTheSumOfTheDequantisedProducts) {
  api::Cpu cpu;
  const int64_t m = 40, n = 24, k = 300;
  const std::vector<float> xa = random_values(m, k, 92, -4, 4), xb = random_values(n, k, 93, -4, 4);
  auto a_in = cpu.tensor(FP8_DTYPE_F32, {m, k}), b_in = cpu.tensor(FP8_DTYPE_F32, {n, k});
  ASSERT_EQ(fp8_tensor_copy_from_host(a_in.get(), xa.data(), xa.size() * 4), FP8_OK);
  ASSERT_EQ(fp8_tensor_copy_from_host(b_in.get(), xb.data(), xb.size() * 4), FP8_OK);
  std::vector<uint16_t> bias_bits(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) bias_bits[static_cast<size_t>(j)] = fp8::float_to_bf16(0.5f * static_cast<float>(j % 5) - 1.0f);
  auto bias = cpu.tensor(FP8_DTYPE_BF16, {n});
  ASSERT_EQ(fp8_tensor_copy_from_host(bias.get(), bias_bits.data(), bias_bits.size() * 2), FP8_OK);
  for (auto [am, bm] : {std::pair{FP8_SCALE_MODE_ROW, FP8_SCALE_MODE_ROW},
                        std::pair{FP8_SCALE_MODE_BLOCK_1X128, FP8_SCALE_MODE_BLOCK_1X128},
                        std::pair{FP8_SCALE_MODE_BLOCK_1X128, FP8_SCALE_MODE_BLOCK_128X128},
                        std::pair{FP8_SCALE_MODE_BLOCK_128X128, FP8_SCALE_MODE_BLOCK_1X128}}) {
    SCOPED_TRACE(std::to_string(am) + " x " + std::to_string(bm));
    auto a = cpu.tensor(FP8_DTYPE_E4M3, {m, k}), b = cpu.tensor(FP8_DTYPE_E5M2, {n, k});
    auto ga = cpu.grid(am, m, k), gb = cpu.grid(bm, n, k);
    ASSERT_EQ(fp8_quantize_scaled(cpu.ctx.get(), a_in.get(), am, cpu.recipe.get(), a.get(), ga.get(), nullptr, nullptr), FP8_OK);
    ASSERT_EQ(fp8_quantize_scaled(cpu.ctx.get(), b_in.get(), bm, cpu.recipe.get(), b.get(), gb.get(), nullptr, nullptr), FP8_OK);
    auto d = cpu.tensor(FP8_DTYPE_F32, {m, n});
    ASSERT_EQ(fp8_gemm_scaled(cpu.ctx.get(), a.get(), am, ga.get(), b.get(), bm, gb.get(), bias.get(), d.get(), nullptr),
              FP8_OK)
        << fp8_last_error_message();
    // Dequantise each operand through its grid, then sum in double.
    const auto dequantised = [](const fp8_tensor_t* q, const fp8_tensor_t* grid, ScaleMode mode, int64_t rows, int64_t kk,
                                bool e5m2) {
      const std::vector<uint8_t> codes = api::download<uint8_t>(q);
      const std::vector<float> g = api::download<float>(grid);
      const fp8::ScaleDesc desc = fp8::gemm_grid(mode, rows, kk, nullptr);
      const fp8::ScaleBlock blk = fp8::scale_block(mode, rows, kk);
      std::vector<double> v(codes.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < kk; ++c)
          v[static_cast<size_t>(r * kk + c)] = static_cast<double>(fp8::decode_fp8(codes[static_cast<size_t>(r * kk + c)], e5m2)) *
                                               g[static_cast<size_t>(desc.at(r / blk.rows, c / blk.cols))];
      return v;
    };
    const std::vector<double> va = dequantised(a.get(), ga.get(), api::mode_of(am), m, k, false),
                              vb = dequantised(b.get(), gb.get(), api::mode_of(bm), n, k, true);
    const std::vector<float> got = api::download<float>(d.get());
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0.0;
        for (int64_t c = 0; c < k; ++c) want += va[static_cast<size_t>(i * k + c)] * vb[static_cast<size_t>(j * k + c)];
        want += fp8::bf16_to_float(bias_bits[static_cast<size_t>(j)]);
        ASSERT_NEAR(got[static_cast<size_t>(i * n + j)], want, 1e-6 * (std::fabs(want) + 1.0)) << i << ", " << j;
      }
  }
}

// Every misuse is refused naming the argument, D untouched.
TEST(ScaleGridApi, MisuseIsRefusedNamingTheArgument) {
  api::Cpu cpu;
  const int64_t m = 16, n = 16, k = 256;
  auto in = cpu.tensor(FP8_DTYPE_F32, {m, k}), a = cpu.tensor(FP8_DTYPE_E4M3, {m, k}), b = cpu.tensor(FP8_DTYPE_E4M3, {n, k});
  auto b5 = cpu.tensor(FP8_DTYPE_E5M2, {n, k}), a5 = cpu.tensor(FP8_DTYPE_E5M2, {m, k});
  auto g_row = cpu.grid(FP8_SCALE_MODE_ROW, m, k), g_1x = cpu.grid(FP8_SCALE_MODE_BLOCK_1X128, m, k);
  auto g_2d = cpu.grid(FP8_SCALE_MODE_BLOCK_128X128, n, k), g_2d_a = cpu.grid(FP8_SCALE_MODE_BLOCK_128X128, m, k);
  auto d = cpu.tensor(FP8_DTYPE_F32, {m, n}), d8 = cpu.tensor(FP8_DTYPE_E4M3, {m, n});
  auto wrong = cpu.tensor(FP8_DTYPE_F32, {3, 3}), out_t = cpu.tensor(FP8_DTYPE_E4M3, {k, m});
  const std::vector<float> marker(static_cast<size_t>(m * n), -5.0f);
  ASSERT_EQ(fp8_tensor_copy_from_host(d.get(), marker.data(), marker.size() * 4), FP8_OK);
  fp8_context_t* c = cpu.ctx.get();
  struct Bad {
    fp8_status_t status;
    const char* fn;
    std::vector<std::string> words;
    fp8_status_t got;
  };
  fp8_gemm_options_t fast;
  fp8_gemm_options_init(&fast);
  fast.fast_accumulation = 1;
  fp8_gemm_options_t not_a_flag;
  fp8_gemm_options_init(&not_a_flag);
  not_a_flag.accumulate = 7;
  const Bad bad[] = {
      {FP8_ERR_INVALID_ARGUMENT,
       "fp8_quantize_scaled",
       {"mode", "FP8_SCALE_MODE_ROW"},
       fp8_quantize_scaled(c, in.get(), 7, cpu.recipe.get(), a.get(), g_row.get(), nullptr, nullptr)},
      {FP8_ERR_SHAPE,
       "fp8_quantize_scaled",
       {"out_scales", "[16, 1]"},
       fp8_quantize_scaled(c, in.get(), FP8_SCALE_MODE_ROW, cpu.recipe.get(), a.get(), wrong.get(), nullptr, nullptr)},
      {FP8_ERR_INVALID_ARGUMENT,
       "fp8_quantize_scaled",
       {"out_t_scales"},
       fp8_quantize_scaled(c, in.get(), FP8_SCALE_MODE_ROW, cpu.recipe.get(), a.get(), g_row.get(), out_t.get(),
                           nullptr)},
      {FP8_ERR_DTYPE,
       "fp8_quantize_scaled",
       {"in"},
       fp8_quantize_scaled(c, a.get(), FP8_SCALE_MODE_ROW, cpu.recipe.get(), a5.get(), g_row.get(), nullptr, nullptr)},
      {FP8_ERR_UNSUPPORTED,
       "fp8_gemm_scaled",
       {"128x128"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_128X128, g_2d_a.get(), b.get(), FP8_SCALE_MODE_BLOCK_128X128,
                       g_2d.get(), nullptr, d.get(), nullptr)},
      {FP8_ERR_UNSUPPORTED,
       "fp8_gemm_scaled",
       {"per-row", "1x128"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_ROW, g_row.get(), b.get(), FP8_SCALE_MODE_BLOCK_1X128, g_1x.get(),
                       nullptr, d.get(), nullptr)},
      {FP8_ERR_SHAPE,
       "fp8_gemm_scaled",
       {"b_scales"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_1X128, g_1x.get(), b.get(), FP8_SCALE_MODE_BLOCK_128X128,
                       wrong.get(), nullptr, d.get(), nullptr)},
      {FP8_ERR_INVALID_ARGUMENT,
       "fp8_gemm_scaled",
       {"fast accumulation"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_1X128, g_1x.get(), b.get(), FP8_SCALE_MODE_BLOCK_128X128,
                       g_2d.get(), nullptr, d.get(), &fast)},
      {FP8_ERR_DTYPE,
       "fp8_gemm_scaled",
       {"d", "bf16 or f32"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_ROW, g_row.get(), b.get(), FP8_SCALE_MODE_ROW, g_row.get(), nullptr,
                       d8.get(), nullptr)},
      {FP8_ERR_DTYPE,
       "fp8_gemm_scaled",
       {"e5m2"},
       fp8_gemm_scaled(c, a5.get(), FP8_SCALE_MODE_ROW, g_row.get(), b5.get(), FP8_SCALE_MODE_ROW, g_row.get(), nullptr,
                       d.get(), nullptr)},
      {FP8_ERR_INVALID_ARGUMENT,
       "fp8_gemm_scaled",
       {"b_mode"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_ROW, g_row.get(), b.get(), 0, g_row.get(), nullptr, d.get(),
                       nullptr)},
      {FP8_ERR_INVALID_ARGUMENT,
       "fp8_gemm_scaled",
       {"options->accumulate"},
       fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_ROW, g_row.get(), b.get(), FP8_SCALE_MODE_ROW, g_row.get(), nullptr,
                       d.get(), &not_a_flag)},
  };
  (void)fast;
  for (const Bad& x : bad) {
    EXPECT_EQ(x.got, x.status) << x.fn << " " << x.words.front();
  }
  // (The messages, each right after its call.)
  for (const auto& [call, words] : std::vector<std::pair<std::function<fp8_status_t()>, std::vector<std::string>>>{
           {[&] {
              return fp8_quantize_scaled(c, in.get(), FP8_SCALE_MODE_ROW, cpu.recipe.get(), a.get(), wrong.get(),
                                         nullptr, nullptr);
            },
            {"fp8_quantize_scaled", "out_scales", "[16, 1]"}},
           {[&] {
              return fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_128X128, g_2d_a.get(), b.get(),
                                     FP8_SCALE_MODE_BLOCK_128X128, g_2d.get(), nullptr, d.get(), nullptr);
            },
            {"fp8_gemm_scaled", "128x128", "1x128"}},
           {[&] {
              return fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_1X128, g_1x.get(), b.get(),
                                     FP8_SCALE_MODE_BLOCK_128X128, wrong.get(), nullptr, d.get(), nullptr);
            },
            {"fp8_gemm_scaled", "b_scales", "fp8_scale_grid_shape"}},
           {[&] {
              return fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_ROW, g_row.get(), b.get(), FP8_SCALE_MODE_BLOCK_1X128,
                                     g_1x.get(), nullptr, d.get(), nullptr);
            },
            {"fp8_gemm_scaled", "a_mode = FP8_SCALE_MODE_ROW", "b_mode = FP8_SCALE_MODE_BLOCK_1X128"}},
           {[&] {
              return fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_BLOCK_1X128, g_1x.get(), b.get(),
                                     FP8_SCALE_MODE_BLOCK_128X128, g_2d.get(), nullptr, d.get(), &fast);
            },
            {"fp8_gemm_scaled", "options->fast_accumulation = 1", "expected 0"}},
           {[&] {
              return fp8_gemm_scaled(c, a.get(), FP8_SCALE_MODE_ROW, g_row.get(), b.get(), FP8_SCALE_MODE_ROW,
                                     g_row.get(), nullptr, d.get(), &not_a_flag);
            },
            {"fp8_gemm_scaled", "options->accumulate = 7", "expected 0 or 1"}},
           {[&] {
              fp8_gemm_options_t o;
              fp8_gemm_options_init(&o);
              o.fast_accumulation = 2;
              return fp8_gemm(c, a.get(), b.get(), nullptr, d.get(), nullptr, &o);
            },
            {"fp8_gemm", "options->fast_accumulation = 2", "expected 0 or 1"}}}) {
    EXPECT_NE(call(), FP8_OK);
    const std::string msg = fp8_last_error_message();
    for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "no \"" << w << "\" in: " << msg;
  }
  EXPECT_EQ(api::download<float>(d.get()), marker) << "a refused GEMM wrote D";
}
