// What the group codec's CPU kernels share (equarx/csrc/*.cc, built into one library by
// equarx/native_cpu.py): float bits, bfloat16 conversions as XLA does them, the code ids, and
// with AVX-512 the load of a run's 32 codes.
#pragma once

#include <array>
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

// Round to nearest even, as XLA converts; a NaN keeps its sign and top bits, made quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

enum Code : int64_t { kInt8 = 0, kInt4 = 1, kFp8 = 2 };

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
    *lo = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p)), fp8_table(), 4);
    *hi = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p + 1)), fp8_table(), 4);
    return;
  }
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
}
#endif

}  // namespace equarx
