// The numerics contract of DESIGN.md, checked against references written independently of
// src/core/format.hpp: value tables built with ldexp, a nearest-value search in double precision,
// and CUDA's own host-side conversions from cuda_fp8.h / cuda_fp16.h / cuda_bf16.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "core/format.hpp"
#include "fp8.h"

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Format {
  fp8_dtype_t dtype;
  int exp_bits, mant_bits, bias;
  uint8_t max_code;
  __nv_fp8_interpretation_t cuda_kind;
};
const Format kE4M3{FP8_DTYPE_E4M3, 4, 3, 7, 0x7E, __NV_E4M3};
const Format kE5M2{FP8_DTYPE_E5M2, 5, 2, 15, 0x7B, __NV_E5M2};

// Value of a code from the OCP definitions, in double; NaN for NaN codes.
double reference_decode(const Format& f, uint8_t c) {
  const int e = (c >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = c & ((1 << f.mant_bits) - 1);
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  const int e_all = (1 << f.exp_bits) - 1;
  if (f.dtype == FP8_DTYPE_E4M3 && e == e_all && m == 7) return std::nan("");
  if (f.dtype == FP8_DTYPE_E5M2 && e == e_all) return m ? std::nan("") : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - f.bias - f.mant_bits);
  return sign * std::ldexp(1.0 + std::ldexp(m, -f.mant_bits), e - f.bias);
}

// Nearest finite code by search over the value table; ties to the even code; saturating; NaN -> 0x7F.
uint8_t reference_encode(const Format& f, float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= reference_decode(f, f.max_code)) return sign | f.max_code;
  uint8_t lo = 0;
  while (lo < f.max_code && reference_decode(f, lo + 1) <= a) ++lo;
  if (reference_decode(f, lo) == a) return sign | lo;
  const double dlo = a - reference_decode(f, lo), dhi = reference_decode(f, lo + 1) - a;
  const uint8_t pick = dlo < dhi ? lo : dhi < dlo ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  return sign | pick;
}

uint8_t cuda_host_encode(const Format& f, float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, f.cuda_kind); }

// Inputs that sit on every decision boundary: each code's value, the midpoints between neighbours
// (exact ties), one ulp either side of both, zeros, float subnormals, infinities and NaNs.
std::vector<float> boundary_inputs(const Format& f) {
  std::vector<float> v;
  for (int c = 0; c <= f.max_code; ++c) {
    const double lo = reference_decode(f, static_cast<uint8_t>(c));
    const double hi = c < f.max_code ? reference_decode(f, static_cast<uint8_t>(c + 1)) : lo * 2;
    for (double p : {lo, (lo + hi) / 2}) {
      const float x = static_cast<float>(p);
      for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, INFINITY)}) {
        v.push_back(y);
        v.push_back(-y);
      }
    }
  }
  for (float y : {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::max(), INFINITY, -INFINITY, 1e-30f, 1e30f})
    v.push_back(y), v.push_back(-y);
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu})
    v.push_back(from_bits(nan));
  return v;
}

class Fp8FormatTest : public ::testing::TestWithParam<Format> {};

TEST_P(Fp8FormatTest, DecodeOfAll256CodesMatchesTheDefinition) {
  const Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const double want = reference_decode(f, static_cast<uint8_t>(c));
    const float got = fp8_decode(static_cast<uint8_t>(c), f.dtype);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "NaN keeps the code's sign, code " << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
    }
  }
}

TEST_P(Fp8FormatTest, EncodeOfEveryDecodedCodeGivesTheCodeBack) {
  const Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const float v = fp8_decode(static_cast<uint8_t>(c), f.dtype);
    if (std::isnan(v) || std::isinf(v)) continue;
    EXPECT_EQ(fp8_encode(v, f.dtype), c) << "code " << c;
  }
}

TEST_P(Fp8FormatTest, EncodeMatchesNearestValueSearchOnBoundariesTiesAndSpecials) {
  const Format f = GetParam();
  for (float x : boundary_inputs(f))
    ASSERT_EQ(fp8_encode(x, f.dtype), reference_encode(f, x)) << "x = " << x << " bits 0x" << std::hex << bits(x);
}

TEST_P(Fp8FormatTest, EncodeSaturatesOutOfRangeAndInfinityToMax) {
  const Format f = GetParam();
  const float max = fp8_decode(f.max_code, f.dtype);
  for (float x : {max, max * 1.01f, max * 4.0f, std::numeric_limits<float>::max(), INFINITY}) {
    EXPECT_EQ(fp8_encode(x, f.dtype), f.max_code) << x;
    EXPECT_EQ(fp8_encode(-x, f.dtype), 0x80 | f.max_code) << -x;
  }
}

TEST_P(Fp8FormatTest, EncodeMapsEveryNanTo0x7FWhateverItsSign) {
  const Format f = GetParam();
  std::mt19937 rng(7);
  for (int i = 0; i < 10000; ++i) {
    const uint32_t payload = 1 + rng() % 0x7FFFFF;
    EXPECT_EQ(fp8_encode(from_bits(0x7F800000u | payload), f.dtype), 0x7F);
    EXPECT_EQ(fp8_encode(from_bits(0xFF800000u | payload), f.dtype), 0x7F);
  }
}

TEST_P(Fp8FormatTest, EncodeRoundsTiesToEven) {
  const Format f = GetParam();
  // Between codes 1 and 2 (subnormals) and between two normals, the exact midpoint goes to the even code.
  for (uint8_t c : {uint8_t{1}, uint8_t{0x21}, uint8_t{0x30}}) {
    const float mid = static_cast<float>((reference_decode(f, c) + reference_decode(f, c + 1)) / 2);
    EXPECT_EQ(fp8_encode(mid, f.dtype), (c & 1) ? c + 1 : c) << "midpoint above code " << int(c);
  }
  // Half the smallest subnormal is a tie between 0 and 1: it rounds to 0, and a hair more rounds to 1.
  const float half_min = static_cast<float>(reference_decode(f, 1) / 2);
  EXPECT_EQ(fp8_encode(half_min, f.dtype), 0);
  EXPECT_EQ(fp8_encode(std::nextafter(half_min, 1.0f), f.dtype), 1);
  EXPECT_EQ(fp8_encode(-half_min, f.dtype), 0x80);
}

TEST_P(Fp8FormatTest, EncodeMatchesReferenceOnMillionsOfRandomBitPatterns) {
  const Format f = GetParam();
  std::mt19937 rng(1234);
  for (int i = 0; i < 2000000; ++i) {
    // Half uniform over all bit patterns, half concentrated on the format's range.
    const float x = (i & 1) ? from_bits(rng()) : std::ldexp(static_cast<float>(rng()) / 4294967296.0f - 0.5f,
                                                            static_cast<int>(rng() % 40) - 22);
    ASSERT_EQ(fp8_encode(x, f.dtype), reference_encode(f, x)) << "x = " << x << " bits 0x" << std::hex << bits(x);
  }
}

// All 2^32 inputs against CUDA's host implementation of __nv_cvt_float_to_fp8 (the GPU suite does
// the same against the hardware instruction). Split over the machine's cores.
TEST_P(Fp8FormatTest, EncodeMatchesCudaHostConversionOnAll2To32Inputs) {
  const Format f = GetParam();
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<uint64_t> mismatches(workers, 0), first_bad(workers, 0);
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      const uint64_t begin = (uint64_t{1} << 32) * w / workers, end = (uint64_t{1} << 32) * (w + 1) / workers;
      for (uint64_t u = begin; u < end; ++u) {
        const float x = from_bits(static_cast<uint32_t>(u));
        if (fp8::encode_fp8(x, f.dtype == FP8_DTYPE_E5M2) != cuda_host_encode(f, x) && mismatches[w]++ == 0)
          first_bad[w] = u;
      }
    });
  }
  for (auto& t : pool) t.join();
  for (unsigned w = 0; w < workers; ++w)
    EXPECT_EQ(mismatches[w], 0u) << "first mismatch at bits 0x" << std::hex << first_bad[w];
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8FormatTest, ::testing::Values(kE4M3, kE5M2),
                         [](const auto& info) { return std::string(fp8_dtype_name(info.param.dtype)); });

TEST(Fp8Format, ScalarApiRejectsNonFp8Dtypes) {
  EXPECT_EQ(fp8_encode(1.0f, FP8_DTYPE_BF16), 0);
  EXPECT_TRUE(std::isnan(fp8_decode(0x38, FP8_DTYPE_F32)));
}

// ---- bf16 and fp16: widening exact, narrowing round-to-nearest-even with NaN -> 0x7FFF -----------

TEST(WideFormats, Bf16AndF16WideningIsExactForAll65536Codes) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want_bf16 = from_bits(h << 16);
    const float got_bf16 = fp8::bf16_to_float(static_cast<uint16_t>(h));
    EXPECT_EQ(bits(got_bf16), bits(want_bf16)) << std::hex << h;
    __half_raw raw;
    raw.x = static_cast<unsigned short>(h);
    const float want_f16 = __half2float(__half(raw));
    const float got_f16 = fp8::f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want_f16)) EXPECT_TRUE(std::isnan(got_f16)) << std::hex << h;
    else EXPECT_EQ(bits(got_f16), bits(want_f16)) << std::hex << h;
  }
}

TEST(WideFormats, NarrowingMatchesCudaHostRoundingOnRandomAndEdgeInputs) {
  std::mt19937 rng(99);
  std::vector<float> inputs = {0.0f, -0.0f, 65504.0f, 65519.996f, 65520.0f, 1e-8f, 2.98e-8f, 6.1e-5f,
                               INFINITY, -INFINITY, std::numeric_limits<float>::max(), 3.0e38f};
  for (int i = 0; i < 4000000; ++i) inputs.push_back(from_bits(rng()));
  for (float x : inputs) {
    const uint16_t want_f16 = __half_raw(__float2half_rn(x)).x;
    const uint16_t want_bf16 = __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
    if (std::isnan(x)) {
      EXPECT_EQ(fp8::float_to_f16(x), 0x7FFF);
      EXPECT_EQ(fp8::float_to_bf16(x), 0x7FFF);
      continue;
    }
    ASSERT_EQ(fp8::float_to_f16(x), want_f16) << "x = " << x << " bits 0x" << std::hex << bits(x);
    ASSERT_EQ(fp8::float_to_bf16(x), want_bf16) << "x = " << x << " bits 0x" << std::hex << bits(x);
  }
}

TEST(Amax, MagnitudeBitsOrderPutsNanAboveInfAboveFinite) {
  EXPECT_GT(fp8::abs_bits(NAN), fp8::abs_bits(INFINITY));
  EXPECT_GT(fp8::abs_bits(-INFINITY), fp8::abs_bits(std::numeric_limits<float>::max()));
  EXPECT_EQ(fp8::abs_bits(-2.5f), bits(2.5f));
  EXPECT_FALSE(fp8::is_finite_bits(fp8::abs_bits(-INFINITY)));
  EXPECT_TRUE(fp8::is_finite_bits(fp8::abs_bits(-std::numeric_limits<float>::max())));
}

}  // namespace
