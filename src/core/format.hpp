// The numerics contract in one place: FP8 (E4M3/E5M2), fp16 and bf16 conversions and the amax bit
// trick. Host and device code include this same header, so the CPU reference and the CUDA kernels
// cannot drift apart; the CUDA kernels encode with the hardware instruction instead, and the GPU
// suite proves that instruction equal to encode_fp8() over all 2^32 inputs.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP8_HD __host__ __device__ __forceinline__
#else
#define FP8_HD inline
#endif

namespace fp8 {

FP8_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FP8_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// |x| as bits. For non-negative floats the integer order is the numeric order, and every NaN
// compares above +inf, so an integer max over these is an amax that propagates NaN and inf.
FP8_HD uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }
FP8_HD bool is_finite_bits(uint32_t abs) { return abs < 0x7F800000u; }

// Layout of an FP8 format. kMantBits/kBias give the value; max_code is the largest finite code.
struct Fp8Spec {
  int mant_bits;
  int bias;
  uint8_t max_code;  // 0x7E (448) for E4M3, 0x7B (57344) for E5M2
  float max_value;
};
FP8_HD Fp8Spec fp8_spec(bool e5m2) {
  return e5m2 ? Fp8Spec{2, 15, 0x7B, 57344.0f} : Fp8Spec{3, 7, 0x7E, 448.0f};
}

// float -> FP8: round to nearest even, saturate to +-max (infinities too), any NaN -> 0x7F.
FP8_HD uint8_t encode_fp8(float x, bool e5m2) {
  const Fp8Spec s = fp8_spec(e5m2);
  const uint32_t bits = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7F;
  if (abs >= float_bits(s.max_value)) return static_cast<uint8_t>(sign | s.max_code);
  const int exp = static_cast<int>(abs >> 23) - 127;  // unbiased float exponent
  const int min_normal_exp = 1 - s.bias;
  uint32_t code;
  if (exp >= min_normal_exp) {
    // Normal in FP8: drop 23 - mant_bits mantissa bits with round-half-even; a carry into the
    // exponent is the correct result. Values below max_value never round past it.
    const int shift = 23 - s.mant_bits;
    const uint32_t rounded = abs + ((1u << (shift - 1)) - 1u) + ((abs >> shift) & 1u);
    code = (rounded >> shift) - (static_cast<uint32_t>(127 - s.bias) << s.mant_bits);
  } else {
    // Subnormal in FP8 (or zero): code = round_half_even(significand * 2^(exp-23) / 2^(min_normal_exp - mant_bits)).
    // A result of 2^mant_bits is the smallest normal, which this encoding spells correctly.
    if ((abs >> 23) == 0) return sign;  // float zero or subnormal: far below half the smallest step
    const uint32_t significand = (abs & 0x7FFFFFu) | 0x800000u;
    const int rshift = 23 + min_normal_exp - s.mant_bits - exp;  // >= 24 - mant_bits
    if (rshift > 25) return sign;                                // below half the smallest step
    const uint32_t q = significand >> rshift;
    const uint32_t rem = significand & ((1u << rshift) - 1u);
    const uint32_t half = 1u << (rshift - 1);
    code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  }
  return static_cast<uint8_t>(sign | code);
}

// FP8 -> float, exact. NaN codes give a quiet NaN with the code's sign; E5M2 infinities stay infinite.
FP8_HD float decode_fp8(uint8_t c, bool e5m2) {
  const Fp8Spec s = fp8_spec(e5m2);
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const int exp_bits = 7 - s.mant_bits;
  const uint32_t e = (c >> s.mant_bits) & ((1u << exp_bits) - 1u);
  const uint32_t m = c & ((1u << s.mant_bits) - 1u);
  const uint32_t e_all = (1u << exp_bits) - 1u;
  if (e5m2 ? (e == e_all) : (e == e_all && m == 7u)) {
    return bits_float(sign | ((m == 0u && e5m2) ? 0x7F800000u : 0x7FC00000u));
  }
  if (e == 0) {
    // m * 2^(1 - bias - mant_bits): exact in float.
    const float step = bits_float(static_cast<uint32_t>(127 + 1 - s.bias - s.mant_bits) << 23);
    return bits_float(sign | float_bits(static_cast<float>(m) * step));
  }
  return bits_float(sign | ((e - s.bias + 127) << 23) | (m << (23 - s.mant_bits)));
}

// Dequantised value decode(c) * scale_inv. A NaN comes out as the canonical 0x7FFFFFFF: the GPU's
// multiply canonicalises NaNs while the CPU's keeps their payload, so the contract fixes one.
FP8_HD float dequantize_fp8(uint8_t c, bool e5m2, float scale_inv) {
  const float v = decode_fp8(c, e5m2) * scale_inv;
  return (float_bits(v) & 0x7FFFFFFFu) > 0x7F800000u ? bits_float(0x7FFFFFFFu) : v;
}

// bf16 <-> float. bf16 -> float is exact; float -> bf16 rounds to nearest even, NaN -> 0x7FFF.
FP8_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
FP8_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp16 <-> float. fp16 -> float is exact; float -> fp16 rounds to nearest even (overflow to inf),
// NaN -> 0x7FFF.
FP8_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  // The hardware conversion (exact, as below) for every value, then a select that keeps a NaN's
  // sign and payload as the code below does: no branch, so an f16-input cast stays memory-bound.
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  const uint32_t nan =
      (static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7F800000u | (static_cast<uint32_t>(h & 0x3FFu) << 13);
  return (h & 0x7FFFu) > 0x7C00u ? bits_float(nan) : f;
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return bits_float(sign | 0x7F800000u | (m << 13));
  if (e == 0) return bits_float(sign | float_bits(static_cast<float>(m) * 5.9604644775390625e-8f));  // 2^-24
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
#endif
}
FP8_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7FFF;
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  const int exp = static_cast<int>(abs >> 23) - 127;
  if (exp >= -14) {  // normal fp16
    const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
  }
  if ((abs >> 23) == 0) return sign;
  const uint32_t significand = (abs & 0x7FFFFFu) | 0x800000u;
  const int rshift = -1 - exp;  // 23 + (-14 - 10) - exp
  if (rshift > 25) return sign;
  const uint32_t q = significand >> rshift;
  const uint32_t rem = significand & ((1u << rshift) - 1u);
  const uint32_t half = 1u << (rshift - 1);
  return static_cast<uint16_t>(sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u)));
}

}  // namespace fp8
