// The all-gather's last step on a CPU, as an XLA FFI handler (equarx/native_cpu.py builds and
// registers it): int8, int4 or fp8 (e4m3) codes of rotated runs of g values and their rows'
// scale bytes -> the values with the rotation undone, in bfloat16 or float32. The same function as
// equarx.groups.unrotate_codes, bit for bit: a run's inverse rotation is (M q) s / g with M = D H
// (D the fixed signs, H the Sylvester Hadamard matrix, entries +-1), whose sums of the codes are
// exact in float32 in any order (integers below 2^12; e4m3 codes are multiples of 2^-9 below 2^9,
// so runs of up to 64 stay below 2^24 units), then one product with s / g (a bfloat16 value over
// a power of two) and one rounding.
//
// Why a kernel of its own: XLA:CPU runs that product as a fused broadcast-multiply-reduce at
// about 25 GFLOP/s, the default codec's largest cost between blocking transfers; with AVX-512 a
// run of 32 is two vectors and H q is five butterfly stages (docs/results.md).
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "group_codec.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace equarx;

template <typename Out>
inline void store(Out* o, int i, float v);
template <>
inline void store<uint16_t>(uint16_t* o, int i, float v) { o[i] = f32_to_bf16(v); }
template <>
inline void store<float>(float* o, int i, float v) { o[i] = v; }

// Where the values go: `rows` rows of `per_row` runs each (their codes and scales consecutive),
// row t's values at out + t * stride.
struct Rows {
  int64_t rows, per_row, stride;
};

// A butterfly stage of stride h inside a vector of `lanes`: lane l takes lane l ^ h, and its
// own value with the sign + (bit h of l clear) or - (set).
inline void stage_constants(int lanes, int h, int32_t* idx, float* sign) {
  for (int l = 0; l < lanes; ++l) {
    idx[l] = l ^ h;
    sign[l] = (l & h) ? -1.0f : 1.0f;
  }
}

// Any g: acc = M q as a matrix-vector product (mt = M^T, row j = column j of M). Sums start from
// +0, so a zero sum is +0 as in XLA's reduce.
template <int G, typename Out>
void unrotate_generic(Code code, const int8_t* codes, const float* scales, const float* mt,
                      Out* out, Rows shape) {
  for (int64_t t = 0, k = 0; t < shape.rows; ++t)
  for (int64_t j = 0; j < shape.per_row; ++j, ++k) {
    Out* const o = out + t * shape.stride + j * G;
    float q[G];
    load_codes<G>(code, codes, k, q);
    float acc[G] = {0};
    for (int j = 0; j < G; ++j) {
      const float qj = q[j];
      const float* col = mt + j * G;
      for (int i = 0; i < G; ++i) acc[i] += col[i] * qj;
    }
    const float s = scales[k] / float(G);
    for (int i = 0; i < G; ++i) store<Out>(o, i, acc[i] * s);
  }
}

#ifdef __AVX512F__
// v' [l] = v[l ^ h] + v[l] * (bit h of l ? -1 : 1): one butterfly stage inside a vector, the
// swap of lanes l and l ^ h by a fixed shuffle (strides 8 and 4 move 128-bit blocks, 2 and 1
// move lanes within them).
template <int H>
inline __m512 butterfly(__m512 v, __m512 sign) {
  __m512 swapped;
  if constexpr (H == 8) swapped = _mm512_shuffle_f32x4(v, v, 0x4e);
  else if constexpr (H == 4) swapped = _mm512_shuffle_f32x4(v, v, 0xb1);
  else if constexpr (H == 2) swapped = _mm512_permute_ps(v, 0x4e);
  else swapped = _mm512_permute_ps(v, 0xb1);
  return _mm512_fmadd_ps(v, sign, swapped);
}

// A vector's lanes as a GCC vector of float bits: bf16_round_bits's operand.
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline __m256i to_bf16_bits(__m512 x) {
  return _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(
      bf16_round_bits(reinterpret_cast<u32x16>(x))));
}

inline __m256i to_bf16(__m512 x) {
#ifdef __AVX512BF16__
  // One conversion instruction rounds the same way (NaN: its top bits, made quiet), but reads a
  // subnormal input as zero: a vector holding one takes the integer rounding instead.
  const __mmask16 subnormal =
      _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ) &
      _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  if (!subnormal) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#endif
  return to_bf16_bits(x);
}

inline void store16(uint16_t* o, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16(v));
}
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }

// g = 32: H q by the fast Walsh-Hadamard transform on two vectors of 16 (the stride-16 stage
// between them, strides 8..1 inside each), then the signs D (the first row of M^T).
template <typename Out>
void unrotate32(Code code, const int8_t* codes, const float* scales, const float* mt, Out* out,
                Rows shape) {
  __m512 sign[4];
  for (int s = 0; s < 4; ++s) {
    alignas(64) int32_t idx[16];
    alignas(64) float sg[16];
    stage_constants(16, 8 >> s, idx, sg);
    sign[s] = _mm512_load_ps(sg);
  }
  const __m512 d_lo = _mm512_loadu_ps(mt), d_hi = _mm512_loadu_ps(mt + 16);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t t = 0, k = 0; t < shape.rows; ++t)
  for (int64_t j = 0; j < shape.per_row; ++j, ++k) {
    Out* const o = out + t * shape.stride + j * 32;
    __m512 a, b;
    load32(code, codes, k, &a, &b);
    __m512 lo = _mm512_add_ps(a, b), hi = _mm512_sub_ps(a, b);
    lo = butterfly<1>(butterfly<2>(butterfly<4>(butterfly<8>(lo, sign[0]), sign[1]), sign[2]),
                      sign[3]);
    hi = butterfly<1>(butterfly<2>(butterfly<4>(butterfly<8>(hi, sign[0]), sign[1]), sign[2]),
                      sign[3]);
    // The signs as d v + 0: a zero sum stays +0, as the plain sum of products gives it.
    lo = _mm512_fmadd_ps(lo, d_lo, zero);
    hi = _mm512_fmadd_ps(hi, d_hi, zero);
    const __m512 sc = _mm512_set1_ps(scales[k] / 32.0f);
    store16(o, _mm512_mul_ps(lo, sc));
    store16(o + 16, _mm512_mul_ps(hi, sc));
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The same with AVX2 (no AVX-512): a run of 32 is four vectors of 8; strides 16 and 8 between
// them, 4..1 inside each.
inline __m256 butterfly8(__m256 v, __m256i swap, __m256 sign) {
  return _mm256_fmadd_ps(v, sign, _mm256_permutevar8x32_ps(v, swap));
}

// 8 codes from 8 sign-extended bytes as int32 lanes (int4: the low or high nibbles).
inline __m256 codes8(Code code, __m256i b, bool high) {
  if (code == kInt4)
    return _mm256_cvtepi32_ps(high ? _mm256_srai_epi32(b, 4)
                                   : _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28));
  if (code == kFp8)
    return _mm256_i32gather_ps(fp8_table(), _mm256_and_si256(b, _mm256_set1_epi32(0xff)), 4);
  return _mm256_cvtepi32_ps(b);
}

// 8 lanes as a GCC vector of float bits (bf16_round_bits's operand); store32's packs keep each
// lane's low 16 bits.
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline __m256i bf16_bits8(__m256 x) {
  return reinterpret_cast<__m256i>(bf16_round_bits(reinterpret_cast<u32x8>(x)));
}

inline void store32(uint16_t* o, const __m256* v) {
  for (int h = 0; h < 2; ++h) {
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(v[2 * h]), bf16_bits8(v[2 * h + 1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * h),
                        _mm256_permute4x64_epi64(packed, 0xd8));
  }
}
inline void store32(float* o, const __m256* v) {
  for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + 8 * r, v[r]);
}

template <typename Out>
void unrotate32(Code code, const int8_t* codes, const float* scales, const float* mt, Out* out,
                Rows shape) {
  __m256i swap[3];
  __m256 sign[3];
  for (int s = 0; s < 3; ++s) {
    alignas(32) int32_t idx[8];
    alignas(32) float sg[8];
    stage_constants(8, 4 >> s, idx, sg);
    swap[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    sign[s] = _mm256_load_ps(sg);
  }
  __m256 d[4];
  for (int r = 0; r < 4; ++r) d[r] = _mm256_loadu_ps(mt + 8 * r);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t t = 0, k = 0; t < shape.rows; ++t)
  for (int64_t j = 0; j < shape.per_row; ++j, ++k) {
    Out* const o = out + t * shape.stride + j * 32;
    __m256 v[4];
    for (int r = 0; r < 4; ++r) {
      const int8_t* p = code == kInt4 ? codes + k * 16 + 8 * (r & 1) : codes + k * 32 + 8 * r;
      const __m256i b =
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      v[r] = codes8(code, b, code == kInt4 && r >= 2);
    }
    for (int r = 0; r < 2; ++r) {  // stride 16
      const __m256 a = v[r], b = v[r + 2];
      v[r] = _mm256_add_ps(a, b);
      v[r + 2] = _mm256_sub_ps(a, b);
    }
    for (int r = 0; r < 4; r += 2) {  // stride 8
      const __m256 a = v[r], b = v[r + 1];
      v[r] = _mm256_add_ps(a, b);
      v[r + 1] = _mm256_sub_ps(a, b);
    }
    const __m256 sc = _mm256_set1_ps(scales[k] / 32.0f);
    for (int r = 0; r < 4; ++r) {
      for (int s = 0; s < 3; ++s) v[r] = butterfly8(v[r], swap[s], sign[s]);
      // The signs as d v + 0: a zero sum stays +0, as the plain sum of products gives it.
      v[r] = _mm256_mul_ps(_mm256_fmadd_ps(v[r], d[r], zero), sc);
    }
    store32(o, v);
  }
}
#endif

template <typename Out>
ffi::Error dispatch(Code code, int64_t g, const int8_t* c, const float* s, const float* mt,
                    Out* o, Rows groups) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (g == 32) {
    unrotate32<Out>(code, c, s, mt, o, groups);
    return ffi::Error::Success();
  }
#endif
  switch (g) {
    case 8: unrotate_generic<8, Out>(code, c, s, mt, o, groups); break;
    case 16: unrotate_generic<16, Out>(code, c, s, mt, o, groups); break;
    case 32: unrotate_generic<32, Out>(code, c, s, mt, o, groups); break;
    case 64: unrotate_generic<64, Out>(code, c, s, mt, o, groups); break;
    default: return ffi::Error::InvalidArgument("group size must be 8, 16, 32 or 64");
  }
  return ffi::Error::Success();
}

// codes int8[..., C] (C = W, or W / 2 for int4), steps int8[..., W / g] and exponents
// int8[..., 1] (a row's scale bytes, group_codec.h), mt float32 [..., g, g] (only its first
// g x g block is read: under vmap it may be broadcast), out bfloat16 or float32 [..., W];
// `code` 0 int8, 1 int4, 2 fp8.
ffi::Error Unrotate(ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::S8> steps,
                    ffi::Buffer<ffi::S8> exponents, ffi::Buffer<ffi::F32> mt, int64_t code,
                    ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = mt.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("the matrix must be g x g");
  if (code != kInt8 && code != kInt4 && code != kFp8)
    return ffi::Error::InvalidArgument("code must be 0 (int8), 1 (int4) or 2 (fp8)");
  const int64_t g = dims[dims.size() - 1], values = out->element_count();
  const int64_t rows = exponents.element_count();
  if (g <= 0 || g % 2 != 0 || rows < 1 || values % (g * rows) != 0 ||
      codes.element_count() != (code == kInt4 ? values / 2 : values) ||
      steps.element_count() != values / g)
    return ffi::Error::InvalidArgument("codes, scales and output do not match the group size");
  std::vector<float> scales(values / g);
  row_scales(steps.typed_data(), exponents.typed_data(), rows, values / (g * rows),
             scales.data());
  const Rows groups{1, values / g, 0};
  const int8_t* c = codes.typed_data();
  const float* s = scales.data();
  const float* m = mt.typed_data();
  const Code k = Code(code);
  switch (out->element_type()) {
    case ffi::DataType::BF16:
      return dispatch<uint16_t>(k, g, c, s, m, static_cast<uint16_t*>(out->untyped_data()),
                                groups);
    case ffi::DataType::F32:
      return dispatch<float>(k, g, c, s, m, static_cast<float*>(out->untyped_data()), groups);
    default:
      return ffi::Error::InvalidArgument("output must be bfloat16 or float32");
  }
}

// The all-gather's end in one call: the wire bytes of every piece of every shard as they arrived
// (relative shard r of N, piece p of P: argument r * P + p, each int8[counts[p], ., .] as
// groups.encode lays it out) un-rotated straight into their place in the layout's buffer, out
// (bfloat16 or float32): relative shard r is shard (device + r) % N, and row i of piece p's
// minishards starts at element bases[p] + shard * shard_stride + i * row_stride. This replaces
// putting codes and scales in place as bytes (a switch over N concatenations, and a copy)
// before un-rotating them.
ffi::Error GatherUnrotate(ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::F32> mt,
                          ffi::RemainingArgs wires, ffi::Result<ffi::AnyBuffer> out,
                          int64_t code, ffi::Span<const int64_t> bases,
                          ffi::Span<const int64_t> counts, int64_t rows, int64_t width,
                          int64_t row_stride, int64_t shard_stride, int64_t shards) {
  const auto dims = mt.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("the matrix must be g x g");
  if (code != kInt8 && code != kInt4 && code != kFp8)
    return ffi::Error::InvalidArgument("code must be 0 (int8), 1 (int4) or 2 (fp8)");
  const int64_t g = dims[dims.size() - 1], pieces = int64_t(bases.size());
  if (g <= 0 || g % 2 != 0 || width % g != 0 || rows < 1 || shards < 1 ||
      int64_t(counts.size()) != pieces || int64_t(wires.size()) != shards * pieces)
    return ffi::Error::InvalidArgument("the pieces do not match the group size or the shards");
  if (device.element_count() != 1 || device.typed_data()[0] < 0 ||
      device.typed_data()[0] >= shards)
    return ffi::Error::InvalidArgument("the device index is outside the shards");
  const int64_t d = device.typed_data()[0], per_row = width / g;
  const int64_t code_bytes = (code == kInt4 ? g / 2 : g) * per_row * rows;
  const int64_t minishard_bytes = code_bytes + (per_row + 1) * rows;
  std::vector<std::pair<const int8_t*, int64_t>> wire;  // (bytes, out offset) per argument
  for (int64_t r = 0; r < shards; ++r) {
    for (int64_t p = 0; p < pieces; ++p) {
      auto w = wires.get<ffi::Buffer<ffi::S8>>(size_t(r * pieces + p));
      const int64_t start = bases[p] + ((d + r) % shards) * shard_stride;
      const int64_t last = start + (counts[p] * rows - 1) * row_stride + width;
      if (w.has_error() || w->element_count() != counts[p] * minishard_bytes || start < 0 ||
          last > int64_t(out->element_count()))
        return ffi::Error::InvalidArgument("a piece does not fit its wire bytes or the output");
      wire.emplace_back(w->typed_data(), start);
    }
  }
  const float* m = mt.typed_data();
  std::vector<float> s(rows * per_row);
  const auto run = [&](auto* o) -> ffi::Error {
    for (size_t i = 0; i < wire.size(); ++i) {
      for (int64_t b = 0; b < counts[int64_t(i) % pieces]; ++b) {
        const int8_t* c = wire[i].first + b * minishard_bytes;
        row_scales(c + code_bytes, c + code_bytes + rows * per_row, rows, per_row, s.data());
        const ffi::Error e = dispatch(Code(code), g, c, s.data(), m, o + wire[i].second +
                                      b * rows * row_stride, Rows{rows, per_row, row_stride});
        if (e.failure()) return e;
      }
    }
    return ffi::Error::Success();
  };
  switch (out->element_type()) {
    case ffi::DataType::BF16: return run(static_cast<uint16_t*>(out->untyped_data()));
    case ffi::DataType::F32: return run(static_cast<float*>(out->untyped_data()));
    default: return ffi::Error::InvalidArgument("output must be bfloat16 or float32");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxGatherUnrotate, GatherUnrotate,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("code")
                                  .Attr<ffi::Span<const int64_t>>("bases")
                                  .Attr<ffi::Span<const int64_t>>("counts")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("row_stride")
                                  .Attr<int64_t>("shard_stride")
                                  .Attr<int64_t>("shards"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxUnrotate, Unrotate,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("code")
                                  .Ret<ffi::AnyBuffer>());
