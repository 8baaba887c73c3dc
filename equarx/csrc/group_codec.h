// What the group codec's CPU kernels share (equarx/csrc/*.cc, built into one library by
// equarx/native_cpu.py): float bits, bfloat16 conversions as XLA does them, the code ids, the
// scales' bytes (equarx.codec_spec.scale_parts), and with AVX-512 the load of a run's 32 codes.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace equarx {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t b) { return float_of(uint32_t(b) << 16); }

// Round to nearest even, as XLA converts; a NaN keeps its sign and top bits, made quiet (XLA
// leaves a NaN's bits free: equarx/groups.py, "NaN"). U is a float's bits (uint32_t) or a GCC
// vector of them (the AVX paths' lanes), so the scalar and vector paths round by the same lines;
// the bfloat16 is the low 16 bits of each result.
template <typename U>
inline U bf16_round_bits(U u) {
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const U quiet = (u >> 16) | 0x40u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
}

inline uint16_t f32_to_bf16(float f) { return uint16_t(bf16_round_bits(bits_of(f))); }

// Every constant of the codec comes from equarx/codec_spec.py, its one specification, as the
// build's -D flags (codec_spec.cpp_defines, equarx/native_cpu.py): none is written here.
#ifndef EQUARX_NOT_FINITE
#error "build through equarx/native_cpu.py: the codec's constants come from equarx/codec_spec.py"
#endif

enum Code : int64_t { kInt8 = EQUARX_CODE_ID_INT8, kInt4 = EQUARX_CODE_ID_INT4, kFp8 = EQUARX_CODE_ID_FP8 };

// The scale grid (codec_spec: NOT_FINITE, E_MIN, E_MAX, STEP_BITS, EXPONENT_BIAS), the rounding's
// constant and each code's largest value.
constexpr int kNotFinite = EQUARX_NOT_FINITE, kEMin = EQUARX_E_MIN, kEMax = EQUARX_E_MAX,
              kStepBits = EQUARX_STEP_BITS, kExponentBias = EQUARX_EXPONENT_BIAS;
constexpr float kMagic = EQUARX_ROUNDING_MAGIC;  // codec_spec.round_half_even
constexpr float kCodeMaxInt8 = EQUARX_CODE_MAX_INT8, kCodeMaxInt4 = EQUARX_CODE_MAX_INT4,
                kCodeMaxFp8 = EQUARX_CODE_MAX_FP8;

// codec_spec.scale_value: a run's scale from its step byte and its row's exponent (the float
// whose bits are 2^e's less step * 2^18).
inline float scale_value(int step, int e) {
  if (step == kNotFinite) return float_of(0x7fc00000u);
  return float_of((uint32_t(e + 127) << 23) - (uint32_t(step) << kStepBits));
}

// codec_spec.row_scales for `rows` rows of `per_row` runs: their step bytes (per_row a row) and
// exponent bytes (one a row, biased by 127) -> out[rows * per_row].
inline void row_scales(const int8_t* steps, const int8_t* exponents, int64_t rows,
                       int64_t per_row, float* out) {
  for (int64_t t = 0; t < rows; ++t, steps += per_row, out += per_row) {
    const int e = int(uint8_t(exponents[t])) - kExponentBias;
    for (int64_t k = 0; k < per_row; ++k) out[k] = scale_value(uint8_t(steps[k]), e);
  }
}

// codec_spec.scale_parts for one row: its runs' absmaxes (a NaN counted as Inf) -> its runs' step
// bytes, its exponent byte (biased by 127) and each run's 1 / scale (0: not finite).
// The same integer steps as the JAX form: the row's exponent from the bits of its largest
// finite scale, then each run's scale rounded up to 5 mantissa bits and counted down from 2^e.
inline void row_scale_parts(const float* amax, int64_t per_row, float code_max, int8_t* steps,
                            int8_t* exponent, float* inv) {
  const float recip = float(1.0 / double(code_max));
  float m = 0.0f;
  for (int64_t k = 0; k < per_row; ++k) {
    const float s = amax[k] * recip;
    if (s < INFINITY && s > m) m = s;
  }
  const uint32_t mb = bits_of(m);
  int e = int((mb >> 23) & 0xffu) - 127 + ((mb & 0x7fffffu) != 0);
  e = e < kEMin ? kEMin : (e > kEMax ? kEMax : e);
  for (int64_t k = 0; k < per_row; ++k) {
    const float s = amax[k] * recip;
    int step = kNotFinite;
    inv[k] = 0.0f;
    if (s < INFINITY) {
      constexpr uint32_t unit = (1u << kStepBits) - 1;
      const uint32_t up = (bits_of(s) + unit) & ~unit;  // rounded up to 5 mantissa bits
      const int64_t at = (int64_t(uint32_t(e + 127) << 23) - int64_t(up)) >> kStepBits;
      step = int(at < kNotFinite - 1 ? at : kNotFinite - 1);
      inv[k] = 1.0f / scale_value(step, e);
    }
    steps[k] = int8_t(uint8_t(step));
  }
  *exponent = int8_t(uint8_t(e + kExponentBias));
}

// e4m3 (no infinities; S.1111.111 is NaN) as float32, exactly.
inline float fp8_to_f32(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
  if ((b & 0x7fu) == 0x7fu) return float_of(sign | 0x7fc00000u);
  if (e == 0) return float_of(sign | bits_of(float(m) * 0x1p-9f));
  return float_of(sign | ((e + 120u) << 23) | (m << 20));
}

// fp8_to_f32 of every byte, for the vector paths' gathers.
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_to_f32(uint8_t(i));
    return t;
  }();
  return table.data();
}

// Run k's codes as floats (int4: a run's first half in the low nibbles of its g / 2 bytes, its
// second half in the high ones, as groups.encode packs them).
template <int G>
inline void load_codes(Code code, const int8_t* codes, int64_t k, float* q) {
  if (code == kInt4) {
    const int8_t* b = codes + k * (G / 2);
    for (int j = 0; j < G / 2; ++j) {
      q[j] = float(int8_t(uint8_t(b[j]) << 4) >> 4);
      q[j + G / 2] = float(b[j] >> 4);
    }
  } else if (code == kFp8) {
    for (int j = 0; j < G; ++j) q[j] = fp8_table()[uint8_t(codes[k * G + j])];
  } else {
    for (int j = 0; j < G; ++j) q[j] = float(codes[k * G + j]);
  }
}

#ifdef __AVX512F__
// fp8_to_f32 of 16 bytes by their bits (a table gather was the fp8 kernels' largest cost):
// normal values shift into place under a rebiased exponent, subnormals are m * 2^-9.
inline __m512 fp8x16(__m128i bytes) {
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal =
      _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512i small = _mm512_castps_si512(
      _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)));
  __m512i bits = _mm512_mask_blend_epi32(
      _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, small);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)),
                               _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

// The run's 32 codes as two vectors of 16 floats (values 0-15, 16-31).
inline void load32(Code code, const int8_t* codes, int64_t k, __m512* lo, __m512* hi) {
  if (code == kInt4) {
    const __m512i b = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 16)));
    *lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28));
    *hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(b, 4));
    return;
  }
  const auto* p = reinterpret_cast<const __m128i*>(codes + k * 32);
  if (code == kFp8) {
    *lo = fp8x16(_mm_loadu_si128(p));
    *hi = fp8x16(_mm_loadu_si128(p + 1));
    return;
  }
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
}
#endif

}  // namespace equarx
