// Scale descriptors (src/core/scale_desc.hpp): the grid-shape rule of each mode, the descriptor
// check, and the CPU backend refusing every mode but per-tensor before it does any work. The CPU
// backend is internal (hidden in libfp8.so), so its sources are compiled into this test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "core/recipe_scaling_rule.hpp"  // (scale_block)
#include "core/scale_desc.hpp"

namespace {

using fp8::ScaleDesc;
using fp8::ScaleGrid;
using fp8::ScaleMode;

constexpr ScaleMode kModes[] = {ScaleMode::kTensor, ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128};

// A descriptor of `mode` whose grid fits a [rows, cols] operand.
ScaleDesc desc_for(ScaleMode mode, float* ptr, int64_t rows, int64_t cols) {
  const ScaleGrid g = fp8::scale_grid(mode, rows, cols);
  return {mode, ptr, g.rows, g.cols, std::max<int64_t>(g.cols, 1)};
}

// `call` throws fp8::Error with `status` and a message containing every word.
void expect_error(const std::function<void()>& call, fp8_status_t status, std::initializer_list<std::string> words) {
  try {
    call();
    ADD_FAILURE() << "no error, expected " << fp8_status_string(status);
  } catch (const fp8::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const std::string& w : words)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << "no \"" << w << "\" in: " << e.what();
  }
}

TEST(ScaleDesc, GridRule) {
  struct Case {
    int64_t rows, cols;
    ScaleGrid tensor, row, b1x128, b128x128;
  };
  const Case cases[] = {
      {1, 1, {1, 1}, {1, 1}, {1, 1}, {1, 1}},
      {128, 128, {1, 1}, {128, 1}, {128, 1}, {1, 1}},
      {129, 129, {1, 1}, {129, 1}, {129, 2}, {2, 2}},
      {300, 1000, {1, 1}, {300, 1}, {300, 8}, {3, 8}},
      {256, 4096, {1, 1}, {256, 1}, {256, 32}, {2, 32}},
      {5, 127, {1, 1}, {5, 1}, {5, 1}, {1, 1}},
      {0, 0, {1, 1}, {0, 1}, {0, 0}, {0, 0}},  // empty: no scales, but per-tensor keeps its one
  };
  for (const Case& c : cases) {
    const ScaleGrid want[] = {c.tensor, c.row, c.b1x128, c.b128x128};
    for (int i = 0; i < 4; ++i) {
      const ScaleGrid g = fp8::scale_grid(kModes[i], c.rows, c.cols);
      EXPECT_EQ(g.rows, want[i].rows) << fp8::scale_mode_name(kModes[i]) << " [" << c.rows << ", " << c.cols << "]";
      EXPECT_EQ(g.cols, want[i].cols) << fp8::scale_mode_name(kModes[i]) << " [" << c.rows << ", " << c.cols << "]";
    }
  }
  static_assert(fp8::scale_grid(ScaleMode::kBlock1x128, 3, 257).cols == 3, "usable in constant expressions");
  EXPECT_EQ(fp8::kScaleBlock, 128);
}

TEST(ScaleDesc, ModeValuesAndNames) {
  // The values are part of the plan cache key and, later, of files and kernels: pinned.
  EXPECT_EQ(static_cast<int32_t>(ScaleMode::kTensor), 0);
  EXPECT_EQ(static_cast<int32_t>(ScaleMode::kRow), 1);
  EXPECT_EQ(static_cast<int32_t>(ScaleMode::kBlock1x128), 2);
  EXPECT_EQ(static_cast<int32_t>(ScaleMode::kBlock128x128), 3);
  EXPECT_STREQ(fp8::scale_mode_name(ScaleMode::kTensor), "per-tensor");
  EXPECT_STREQ(fp8::scale_mode_name(ScaleMode::kRow), "per-row");
  EXPECT_STREQ(fp8::scale_mode_name(ScaleMode::kBlock1x128), "1x128-block");
  EXPECT_STREQ(fp8::scale_mode_name(ScaleMode::kBlock128x128), "128x128-block");
  EXPECT_STREQ(fp8::scale_mode_name(static_cast<ScaleMode>(7)), "unknown");
}

TEST(ScaleDesc, TensorScale) {
  float s = 0.5f;
  const ScaleDesc d = fp8::tensor_scale(&s);
  EXPECT_TRUE(d.is_tensor());
  EXPECT_EQ(d.ptr, &s);
  EXPECT_EQ(d.rows, 1);
  EXPECT_EQ(d.cols, 1);
  EXPECT_EQ(d.ld, 1);
  const float* cs = &s;
  EXPECT_EQ(fp8::tensor_scale(cs).ptr, &s);
  const ScaleDesc none{};  // a default descriptor: per-tensor, absent
  EXPECT_TRUE(none.is_tensor());
  EXPECT_EQ(none.ptr, nullptr);
  EXPECT_FALSE(ScaleDesc{ScaleMode::kRow}.is_tensor());
}

TEST(ScaleDesc, CheckAgainstShape) {
  float s = 1.0f;
  for (ScaleMode mode : kModes)
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {129, 300}, {256, 4096}, {0, 16}})
      EXPECT_NO_THROW(fp8::check_scale_desc(desc_for(mode, &s, rows, cols), rows, cols, "x"))
          << fp8::scale_mode_name(mode) << " [" << rows << ", " << cols << "]";
  fp8::check_scale_desc(fp8::tensor_scale(&s), 1000, 3000, "x");  // per-tensor fits any shape

  ScaleDesc d = desc_for(ScaleMode::kBlock1x128, &s, 129, 300);  // [129, 3]
  d.ld = 8;                                                      // a padded grid is fine
  EXPECT_NO_THROW(fp8::check_scale_desc(d, 129, 300, "x"));
  d.ld = 2;  // narrower than a grid row
  expect_error([&] { fp8::check_scale_desc(d, 129, 300, "x"); }, FP8_ERR_SHAPE, {"x", "1x128-block", "[129, 3]"});
  d.ld = 3;
  expect_error([&] { fp8::check_scale_desc(d, 129, 400, "w"); }, FP8_ERR_SHAPE, {"w", "[129, 4]"});
  expect_error([&] { fp8::check_scale_desc(desc_for(ScaleMode::kRow, &s, 10, 16), 11, 16, "a"); }, FP8_ERR_SHAPE,
               {"a", "per-row", "[11, 1]"});
  expect_error([&] { fp8::check_scale_desc(desc_for(ScaleMode::kBlock128x128, &s, 128, 128), 129, 128, "b"); },
               FP8_ERR_SHAPE, {"b", "128x128-block", "[2, 1]"});
  ScaleDesc t = fp8::tensor_scale(&s);
  t.rows = 2;
  expect_error([&] { fp8::check_scale_desc(t, 2, 2, "t"); }, FP8_ERR_SHAPE, {"t", "per-tensor"});
  expect_error(
      [&] {
        fp8::check_scale_desc(ScaleDesc{static_cast<ScaleMode>(9), &s}, 1, 1, "m");
      },
      FP8_ERR_INVALID_ARGUMENT, {"m", "9"});
}

TEST(ScaleDesc, RequireTensorScale) {
  float s = 1.0f;
  EXPECT_NO_THROW(fp8::require_tensor_scale(fp8::tensor_scale(&s), "x"));
  EXPECT_NO_THROW(fp8::require_tensor_scale(ScaleDesc{}, "x"));
  for (ScaleMode mode : {ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128})
    expect_error([&] { fp8::require_tensor_scale(desc_for(mode, &s, 4, 4), "thing"); }, FP8_ERR_UNSUPPORTED,
                 {"thing", fp8::scale_mode_name(mode), "per-tensor"});
  expect_error(
      [&] {
        fp8::require_tensor_scale(ScaleDesc{static_cast<ScaleMode>(9), &s}, "thing");
      },
      FP8_ERR_UNSUPPORTED, {"thing", "unknown"});
}

// ---- the CPU backend ----------------------------------------------------------------------------

// Host buffers for one small FP8 operation of [kRows, kCols] on the CPU backend.
constexpr int64_t kRows = 4, kCols = 8, kN = kRows * kCols;

struct Buffers {
  std::vector<float> in = std::vector<float>(kN, 1.5f);
  std::vector<uint8_t> codes = std::vector<uint8_t>(kN, 0x38);  // E4M3 1.0
  std::vector<uint8_t> out = std::vector<uint8_t>(kN, 0xAB), out_t = std::vector<uint8_t>(kN, 0xAB);
  std::vector<float> wide = std::vector<float>(kN, -7.0f);
  std::vector<float> scales = std::vector<float>(64, -3.0f);  // big enough for any grid here
  alignas(16) unsigned char state_bytes[sizeof(fp8::ScalingHeader) + 4 * sizeof(float)] = {};

  Buffers() {
    fp8::ScalingHeader h{};
    h.scale = 2.0f;
    h.scale_inv = 0.5f;
    std::memcpy(state_bytes, &h, sizeof h);
  }
  fp8::ScalingHeader* state() { return reinterpret_cast<fp8::ScalingHeader*>(state_bytes); }
  float* history() { return fp8::scaling_history(state()); }

  // Nothing written: outputs, scales and the scaling state as they were made.
  void expect_untouched(const std::string& what) {
    EXPECT_EQ(out, std::vector<uint8_t>(kN, 0xAB)) << what;
    EXPECT_EQ(out_t, std::vector<uint8_t>(kN, 0xAB)) << what;
    EXPECT_EQ(wide, std::vector<float>(kN, -7.0f)) << what;
    EXPECT_EQ(scales, std::vector<float>(64, -3.0f)) << what;
    EXPECT_EQ(history()[0], 0.0f) << what;
  }
};

fp8::QuantizeJob quantize_job(Buffers& b) {
  fp8::QuantizeJob q{};
  q.in = b.in.data();
  q.in_dtype = FP8_DTYPE_F32;
  q.rows = kRows;
  q.cols = kCols;
  q.out = b.out.data();
  q.out_t = b.out_t.data();
  q.e5m2 = false;
  q.state = b.state();
  q.out_scale_inv = fp8::tensor_scale(&b.scales[0]);
  q.out_t_scale_inv = fp8::tensor_scale(&b.scales[4]);
  q.out_scale = fp8::tensor_scale(&b.scales[8]);
  return q;
}

fp8::GemmJob gemm_job(Buffers& b) {
  fp8::GemmJob g{};
  g.a = g.b = b.codes.data();
  g.a_dtype = g.b_dtype = FP8_DTYPE_E4M3;
  g.a_scale_inv = fp8::tensor_scale(&b.scales[0]);
  g.b_scale_inv = fp8::tensor_scale(&b.scales[4]);
  g.m = kRows;
  g.n = kRows;
  g.k = kCols;
  g.d = b.wide.data();
  g.d_dtype = FP8_DTYPE_F32;
  g.alpha = 1.0f;
  return g;
}

fp8::ActivationJob activation_job(Buffers& b) {
  fp8::ActivationJob j{};
  j.act = FP8_ACTIVATION_RELU;
  j.x = b.in.data();
  j.x_dtype = FP8_DTYPE_F32;
  j.rows = kRows;
  j.cols = kCols;
  j.out = b.out.data();
  j.out_dtype = FP8_DTYPE_E4M3;
  j.out_state = b.state();
  j.out_scale_inv = fp8::tensor_scale(&b.scales[0]);
  return j;
}

fp8::NormJob norm_job(Buffers& b, const std::vector<float>& gamma) {
  fp8::NormJob j{};
  j.rms = true;
  j.x = b.in.data();
  j.x_dtype = FP8_DTYPE_F32;
  j.rows = kRows;
  j.cols = kCols;
  j.gamma = gamma.data();
  j.eps = 1e-5f;
  j.y = b.out.data();
  j.y_dtype = FP8_DTYPE_E4M3;
  j.y_state = b.state();
  j.y_scale_inv = fp8::tensor_scale(&b.scales[0]);
  return j;
}

// Per-tensor descriptors work as the plain pointers did (the full numerics are the other tests').
TEST(ScaleDescCpuBackend, TensorScalesRun) {
  const auto be = fp8::make_cpu_backend();
  Buffers b;
  be->quantize(quantize_job(b));
  EXPECT_EQ(b.scales[0], 0.5f);
  EXPECT_EQ(b.scales[4], 0.5f);
  EXPECT_EQ(b.scales[8], 2.0f);
  EXPECT_EQ(b.history()[0], 1.5f);
  EXPECT_EQ(b.out[0], fp8::encode_fp8(3.0f, false));  // 1.5 * 2
  EXPECT_EQ(b.out_t[0], fp8::encode_fp8(3.0f, false));

  Buffers g;
  g.scales[0] = 0.5f;
  g.scales[4] = 0.25f;
  be->gemm(gemm_job(g));
  EXPECT_EQ(g.wide[0], kCols * 0.5f * 0.25f);

  Buffers d;
  d.scales[0] = 0.25f;
  be->dequantize({d.codes.data(), false, fp8::tensor_scale(&d.scales[0]), d.wide.data(), FP8_DTYPE_F32, kN});
  EXPECT_EQ(d.wide[kN - 1], 0.25f);

  Buffers t;
  t.scales[0] = 0.125f;
  be->transpose(
      {t.codes.data(), kRows, kCols, t.out.data(), fp8::tensor_scale(&t.scales[0]), fp8::tensor_scale(&t.scales[4])});
  EXPECT_EQ(t.scales[4], 0.125f);
  EXPECT_EQ(t.out[0], 0x38);
}

// Every descriptor of every job, in each mode but per-tensor: FP8_ERR_UNSUPPORTED naming the field
// and the mode, before anything is written.
TEST(ScaleDescCpuBackend, RefusesOtherModes) {
  const auto be = fp8::make_cpu_backend();
  const std::vector<float> gamma(kCols, 1.0f);
  struct Field {
    const char* name;
    std::function<void(Buffers&, ScaleMode)> run;
  };
  // Each descriptor gets a grid that fits its operand, so only the mode is wrong.
  const Field fields[] = {
      {"out_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         auto q = quantize_job(b);
         q.out_scale_inv = desc_for(m, &b.scales[0], kRows, kCols);
         be->quantize(q);
       }},
      {"out_t_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         auto q = quantize_job(b);
         q.out_t_scale_inv = desc_for(m, &b.scales[0], kCols, kRows);
         be->quantize(q);
       }},
      {"out_scale",
       [&](Buffers& b, ScaleMode m) {
         auto q = quantize_job(b);
         q.out_scale = desc_for(m, &b.scales[0], kRows, kCols);
         be->quantize(q);
       }},
      {"in_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         be->transpose({b.codes.data(), kRows, kCols, b.out.data(), desc_for(m, &b.scales[0], kRows, kCols),
                        fp8::tensor_scale(&b.scales[4])});
       }},
      {"out_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         be->transpose({b.codes.data(), kRows, kCols, b.out.data(), fp8::tensor_scale(&b.scales[0]),
                        desc_for(m, &b.scales[4], kCols, kRows)});
       }},
      {"scale_inv",
       [&](Buffers& b, ScaleMode m) {
         be->dequantize(
             {b.codes.data(), false, desc_for(m, &b.scales[0], kRows, kCols), b.wide.data(), FP8_DTYPE_F32, kN});
       }},
      {"out_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         auto j = activation_job(b);
         j.out_scale_inv = desc_for(m, &b.scales[0], kRows, kCols);
         be->activation(j);
       }},
      {"y_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         auto j = norm_job(b, gamma);
         j.y_scale_inv = desc_for(m, &b.scales[0], kRows, kCols);
         be->norm(j);
       }},
      {"d_scale_inv",
       [&](Buffers& b, ScaleMode m) {
         auto g = gemm_job(b);
         g.d = b.out.data();
         g.d_dtype = FP8_DTYPE_E4M3;
         g.d_state = b.state();
         g.d_scale_inv = desc_for(m, &b.scales[8], kRows, kRows);
         be->gemm(g);
       }},
  };
  for (const Field& f : fields) {
    for (ScaleMode mode : {ScaleMode::kRow, ScaleMode::kBlock1x128, ScaleMode::kBlock128x128}) {
      Buffers b;
      const std::string what = std::string(f.name) + " " + fp8::scale_mode_name(mode);
      SCOPED_TRACE(what);
      expect_error([&] { f.run(b, mode); }, FP8_ERR_UNSUPPORTED, {f.name, fp8::scale_mode_name(mode), "CPU backend"});
      b.expect_untouched(what);
    }
  }
}

// ---- GEMMs with per-row and block scales on the CPU backend ---------------------------------------

// One GEMM of random E4M3 operands a [m, k] and b [n, k] with scale grids of modes (ma, mb), random
// positive scales; returns D (f32) and checks it against float64 sum_k a*sa(cell) * b*sb(cell).
void check_scaled_gemm(ScaleMode ma, ScaleMode mb, int64_t m, int64_t n, int64_t k, bool col_major_a, uint32_t seed) {
  SCOPED_TRACE(std::string(fp8::scale_mode_name(ma)) + " x " + fp8::scale_mode_name(mb) + " m " + std::to_string(m) +
               " n " + std::to_string(n) + " k " + std::to_string(k));
  uint32_t s = seed;
  const auto next = [&s] { return s = s * 1664525u + 1013904223u; };
  std::vector<uint8_t> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k));
  for (auto& c : a) c = static_cast<uint8_t>(next() >> 24) & 0xF7;  // no NaN codes (0x7F, 0xFF)
  for (auto& c : b) c = static_cast<uint8_t>(next() >> 24) & 0xF7;
  const ScaleGrid ga = fp8::scale_grid(ma, m, k), gb = fp8::scale_grid(mb, n, k);
  ScaleDesc da{ma, nullptr, ga.rows, ga.cols, col_major_a ? ga.rows : ga.cols, col_major_a};
  ScaleDesc db{mb, nullptr, gb.rows, gb.cols, gb.cols};
  std::vector<float> sa(static_cast<size_t>(ga.rows * ga.cols)), sb(static_cast<size_t>(gb.rows * gb.cols));
  for (auto& v : sa) v = std::ldexp(1.0f + static_cast<float>(next() % 1000) / 1000.0f, static_cast<int>(next() % 9) - 4);
  for (auto& v : sb) v = std::ldexp(1.0f + static_cast<float>(next() % 1000) / 1000.0f, static_cast<int>(next() % 9) - 4);
  da.ptr = sa.data();
  db.ptr = sb.data();
  std::vector<float> d(static_cast<size_t>(m * n), -1.0f);
  fp8::GemmJob g{};
  g.a = a.data();
  g.b = b.data();
  g.a_dtype = g.b_dtype = FP8_DTYPE_E4M3;
  g.a_scale_inv = da;
  g.b_scale_inv = db;
  g.m = m;
  g.n = n;
  g.k = k;
  g.d = d.data();
  g.d_dtype = FP8_DTYPE_F32;
  g.alpha = 1.0f;
  fp8::make_cpu_backend()->gemm(g);
  const fp8::ScaleBlock ba = fp8::scale_block(ma, m, k), bb = fp8::scale_block(mb, n, k);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      // Each scaled element is exact in double; their product rounds once, then the sum in k order.
      double want = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double x = static_cast<double>(fp8::decode_fp8(a[static_cast<size_t>(i * k + kk)], false)) *
                         sa[static_cast<size_t>(da.at(i / ba.rows, kk / ba.cols))];
        const double y = static_cast<double>(fp8::decode_fp8(b[static_cast<size_t>(j * k + kk)], false)) *
                         sb[static_cast<size_t>(db.at(j / bb.rows, kk / bb.cols))];
        want += x * y;
      }
      ASSERT_EQ(d[static_cast<size_t>(i * n + j)], static_cast<float>(want)) << "d[" << i << "][" << j << "]";
    }
}

// Every pair cuBLASLt runs, with partial K blocks and row blocks, a column-major grid (cuBLASLt's
// 1x128 layout) among them: D is the float64 sum of the scaled products, rounded once.
TEST(ScaledGemmCpu, EveryPairMatchesTheFloat64SumOfScaledProducts) {
  uint32_t seed = 1;
  for (auto [ma, mb] : {std::pair{ScaleMode::kRow, ScaleMode::kRow}, std::pair{ScaleMode::kBlock1x128, ScaleMode::kBlock1x128},
                        std::pair{ScaleMode::kBlock1x128, ScaleMode::kBlock128x128},
                        std::pair{ScaleMode::kBlock128x128, ScaleMode::kBlock1x128}})
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{16, 24, 256}, {136, 8, 300}, {8, 144, 130}})
      for (bool col_major_a : {false, true}) check_scaled_gemm(ma, mb, m, n, k, col_major_a, seed++);
}

// The pairs and settings no backend runs are refused before any work, D untouched.
TEST(ScaledGemmCpu, UnsupportedPairsAndSettingsAreRefused) {
  const auto be = fp8::make_cpu_backend();
  struct Bad {
    const char* what;
    std::function<void(fp8::GemmJob&, Buffers&)> change;
    fp8_status_t status;
    const char* word;
  };
  const Bad bad[] = {
      {"128x128 x 128x128",
       [](fp8::GemmJob& g, Buffers& b) {
         g.a_scale_inv = desc_for(ScaleMode::kBlock128x128, &b.scales[0], kRows, kCols);
         g.b_scale_inv = desc_for(ScaleMode::kBlock128x128, &b.scales[4], kRows, kCols);
       },
       FP8_ERR_UNSUPPORTED, "128x128"},
      {"per-row x per-tensor",
       [](fp8::GemmJob& g, Buffers& b) { g.a_scale_inv = desc_for(ScaleMode::kRow, &b.scales[0], kRows, kCols); },
       FP8_ERR_UNSUPPORTED, "per-tensor"},
      {"fast accumulation",
       [](fp8::GemmJob& g, Buffers& b) {
         g.a_scale_inv = desc_for(ScaleMode::kBlock1x128, &b.scales[0], kRows, kCols);
         g.b_scale_inv = desc_for(ScaleMode::kBlock128x128, &b.scales[4], kRows, kCols);
         g.fast_accumulation = true;
       },
       FP8_ERR_INVALID_ARGUMENT, "fast accumulation"},
      {"FP8 D",
       [](fp8::GemmJob& g, Buffers& b) {
         g.a_scale_inv = desc_for(ScaleMode::kRow, &b.scales[0], kRows, kCols);
         g.b_scale_inv = desc_for(ScaleMode::kRow, &b.scales[4], kRows, kCols);
         g.d = b.out.data();
         g.d_dtype = FP8_DTYPE_E4M3;
         g.d_state = b.state();
         g.d_scale_inv = fp8::tensor_scale(&b.scales[8]);
       },
       FP8_ERR_UNSUPPORTED, "FP8 D"},
      {"grid of the wrong shape",
       [](fp8::GemmJob& g, Buffers& b) {
         g.a_scale_inv = desc_for(ScaleMode::kRow, &b.scales[0], kRows + 1, kCols);
         g.b_scale_inv = desc_for(ScaleMode::kRow, &b.scales[4], kRows, kCols);
       },
       FP8_ERR_SHAPE, "a_scale_inv"},
  };
  for (const Bad& x : bad) {
    SCOPED_TRACE(x.what);
    Buffers b;
    fp8::GemmJob g = gemm_job(b);
    x.change(g, b);
    expect_error([&] { be->gemm(g); }, x.status, {x.word});
    b.expect_untouched(x.what);
  }
}

}  // namespace
