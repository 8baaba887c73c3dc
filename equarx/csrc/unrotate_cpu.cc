// The all-gather's last step on a CPU, as an XLA FFI handler (equarx/native_cpu.py builds and
// registers it): int8 codes of rotated runs of g values and their bfloat16 scales -> the values
// with the rotation undone, in bfloat16 or float32. The same function as
// equarx.groups.unrotate_codes, bit for bit: a run's inverse rotation is (M q) s / g with M = D H
// (D the fixed signs, H the Sylvester Hadamard matrix, entries +-1), whose sums of integer codes
// are exact in float32 in any order, then one product with s / g and one rounding.
//
// Why a kernel of its own: XLA:CPU runs that product as a fused broadcast-multiply-reduce at
// about 25 GFLOP/s, the default codec's largest cost between blocking transfers; with AVX-512 a
// run of 32 is two vectors and H q is five butterfly stages (docs/results.md).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as XLA converts; a NaN keeps its sign and top bits, made quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <typename Out>
inline void store(Out* o, int i, float v);
template <>
inline void store<uint16_t>(uint16_t* o, int i, float v) { o[i] = f32_to_bf16(v); }
template <>
inline void store<float>(float* o, int i, float v) { o[i] = v; }

// Any g: acc = M q as a matrix-vector product (mt = M^T, row j = column j of M). Sums start from
// +0, so a zero sum is +0 as in XLA's reduce.
template <int G, typename Out>
void unrotate_generic(const int8_t* codes, const uint16_t* scales, const float* mt, Out* out,
                      int64_t groups) {
  for (int64_t k = 0; k < groups; ++k) {
    const int8_t* q = codes + k * G;
    float acc[G] = {0};
    for (int j = 0; j < G; ++j) {
      const float qj = float(q[j]);
      const float* col = mt + j * G;
      for (int i = 0; i < G; ++i) acc[i] += col[i] * qj;
    }
    const float s = bf16_to_f32(scales[k]) / float(G);
    for (int i = 0; i < G; ++i) store<Out>(out + k * G, i, acc[i] * s);
  }
}

#ifdef __AVX512F__
// v' [l] = v[l ^ h] + v[l] * (bit h of l ? -1 : 1): one butterfly stage inside a vector.
inline __m512 butterfly(__m512 v, __m512i swap, __m512 sign) {
  return _mm512_fmadd_ps(v, sign, _mm512_permutexvar_ps(swap, v));
}

inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

inline void store16(uint16_t* o, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16(v));
}
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }

// g = 32: H q by the fast Walsh-Hadamard transform on two vectors of 16 (the stride-16 stage
// between them, strides 8..1 inside each), then the signs D (the first row of M^T).
template <typename Out>
void unrotate32(const int8_t* codes, const uint16_t* scales, const float* mt, Out* out,
                int64_t groups) {
  __m512i swap[4];
  __m512 sign[4];
  for (int s = 0; s < 4; ++s) {
    const int h = 8 >> s;
    alignas(64) int32_t idx[16];
    alignas(64) float sg[16];
    for (int l = 0; l < 16; ++l) {
      idx[l] = l ^ h;
      sg[l] = (l & h) ? -1.0f : 1.0f;
    }
    swap[s] = _mm512_load_si512(idx);
    sign[s] = _mm512_load_ps(sg);
  }
  const __m512 d_lo = _mm512_loadu_ps(mt), d_hi = _mm512_loadu_ps(mt + 16);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t k = 0; k < groups; ++k) {
    const int8_t* q = codes + k * 32;
    const __m512 a = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    const __m512 b = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    __m512 lo = _mm512_add_ps(a, b), hi = _mm512_sub_ps(a, b);
    for (int s = 0; s < 4; ++s) {
      lo = butterfly(lo, swap[s], sign[s]);
      hi = butterfly(hi, swap[s], sign[s]);
    }
    // The signs as d v + 0: a zero sum stays +0, as the plain sum of products gives it.
    lo = _mm512_fmadd_ps(lo, d_lo, zero);
    hi = _mm512_fmadd_ps(hi, d_hi, zero);
    const __m512 sc = _mm512_set1_ps(bf16_to_f32(scales[k]) / 32.0f);
    store16(out + k * 32, _mm512_mul_ps(lo, sc));
    store16(out + k * 32 + 16, _mm512_mul_ps(hi, sc));
  }
}
#endif

template <typename Out>
ffi::Error dispatch(int64_t g, const int8_t* c, const uint16_t* s, const float* mt, Out* o,
                    int64_t groups) {
#ifdef __AVX512F__
  if (g == 32) {
    unrotate32<Out>(c, s, mt, o, groups);
    return ffi::Error::Success();
  }
#endif
  switch (g) {
    case 8: unrotate_generic<8, Out>(c, s, mt, o, groups); break;
    case 16: unrotate_generic<16, Out>(c, s, mt, o, groups); break;
    case 32: unrotate_generic<32, Out>(c, s, mt, o, groups); break;
    case 64: unrotate_generic<64, Out>(c, s, mt, o, groups); break;
    default: return ffi::Error::InvalidArgument("group size must be 8, 16, 32 or 64");
  }
  return ffi::Error::Success();
}

// codes int8[..., C], scale bytes int8[..., 2 C / g], mt float32[..., g, g] (only its first
// g x g block is read: under vmap it may be broadcast), out bfloat16 or float32 [..., C].
ffi::Error Unrotate(ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::S8> scale_bytes,
                    ffi::Buffer<ffi::F32> mt, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = mt.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("the matrix must be g x g");
  const int64_t g = dims[dims.size() - 1];
  if (g <= 0 || codes.element_count() % g != 0 ||
      scale_bytes.element_count() != 2 * (codes.element_count() / g) ||
      out->element_count() != codes.element_count())
    return ffi::Error::InvalidArgument("codes, scales and output do not match the group size");
  const int64_t groups = codes.element_count() / g;
  const int8_t* c = codes.typed_data();
  const auto* s = reinterpret_cast<const uint16_t*>(scale_bytes.typed_data());
  const float* m = mt.typed_data();
  switch (out->element_type()) {
    case ffi::DataType::BF16:
      return dispatch<uint16_t>(g, c, s, m, static_cast<uint16_t*>(out->untyped_data()), groups);
    case ffi::DataType::F32:
      return dispatch<float>(g, c, s, m, static_cast<float*>(out->untyped_data()), groups);
    default:
      return ffi::Error::InvalidArgument("output must be bfloat16 or float32");
  }
}


}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxUnrotateInt8, Unrotate,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());
