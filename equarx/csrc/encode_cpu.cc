// The group codec's encode on a CPU, fused with the sum before it, as an XLA FFI handler
// (equarx/native_cpu.py builds and registers it): one piece of the token layout's buffer, read in
// place at the shard a device picks at run time, plus the decoded partial sums that arrived for
// it -> the codes and scale bytes of equarx.groups.encode, bit for bit. That is
// codecs.encode_sum: every encode of a reduce-scatter, and the sum that ends it
// together with the all-gather's encode.
//
// Why a kernel of its own: on XLA:CPU the piece is first copied out of its strided rows, widened
// to a float32 copy for the absmax, and read again to quantize; here each value is read once,
// summed, and its group's absmax, scale and codes follow while the group is in registers.
//
// The same arithmetic as the JAX form, in the same order: each arrival's code times its scale
// (exact: 8-bit codes times a bfloat16 value), added to the running float32 sum in arrival
// order; the scale is the absmax times the float32 reciprocal of code_max, rounded up onto the
// row's grid (group_codec.h: row_scale_parts); a code the value times 1 / scale, rounded to
// float32, then half to even to an integer (fp8: to e4m3, half to even, as XLA converts).
// Built with -ffp-contract=off, so no product and sum are fused into one rounding. A NaN counts
// as Inf in the absmax, so its run decodes to NaN.
// A row's scales need all its runs' absmaxes first: each row is summed into a buffer, then
// scaled, then coded.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "group_codec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace equarx;


// Where a piece lies in the buffer and how its bytes are laid out on the wire.
struct Piece {
  Code code;
  int64_t g, pieces, rows, width, row_stride;
  int64_t code_bytes;  // per group: g (int8), g / 2 (int4)
  int64_t groups;      // per minishard: rows * width / g
  int64_t per_row() const { return width / g; }
  // Per minishard on the wire: the codes, the runs' step bytes, the rows' exponent bytes.
  int64_t code_total() const { return groups * code_bytes; }
  int64_t bytes() const { return code_total() + groups + rows; }
  template <typename Byte>
  Byte* steps(Byte* minishard, int64_t r) const {
    return minishard + code_total() + r * per_row();
  }
  template <typename Byte>
  Byte* exponent(Byte* minishard, int64_t r) const {
    return minishard + code_total() + groups + r;
  }
};

inline int8_t code_of(float v, float inv) {
  return int8_t(bits_of(std::nearbyint(v * inv) + kMagic));
}

// v as float8 e4m3fn, rounded to nearest even as XLA converts: below 2^-6 a multiple of 2^-9
// (the conversion to an integer rounds half to even), above it 3 mantissa bits (the float32
// bits rounded half to even at bit 20); a NaN, or past the largest finite value 448, is NaN.
inline uint32_t fp8_bits(float v) {
  const uint32_t u = bits_of(v), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
  uint32_t b;
  if (a > 0x7f800000u) {
    b = 0x7f;
  } else if (a < 0x3c800000u) {
    b = uint32_t(std::nearbyint(float_of(a) * 512.0f));
  } else {
    b = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - 960;
    if (b > 0x7e) b = 0x7f;
  }
  return b | sign;
}

inline int8_t fp8_of(float v, float inv) { return int8_t(uint8_t(fp8_bits(v * inv))); }

inline float code_max_of(Code code) {
  return code == kInt4 ? kCodeMaxInt4 : (code == kFp8 ? kCodeMaxFp8 : kCodeMaxInt8);
}

inline float load_in(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline float load_in(const float* p, int64_t i) { return p[i]; }

// The scales of each arrival's row r: sa[w * per_row + k] for arrival w, run k.
inline void arrival_scales(const Piece& a, const std::vector<const int8_t*>& wires, int64_t b,
                           int64_t r, float* sa) {
  for (size_t w = 0; w < wires.size(); ++w) {
    const int8_t* m = wires[w] + b * a.bytes();
    row_scales(a.steps(m, r), a.exponent(m, r), 1, a.per_row(), sa + w * a.per_row());
  }
}

// Any g, any processor: one group at a time.
template <int G, typename In>
void encode_generic(const Piece& a, const In* in, const std::vector<const int8_t*>& wires,
                    int8_t* out) {
  const float code_max = code_max_of(a.code);
  const int64_t per_row = a.per_row();
  std::vector<float> xs(per_row * G), amax(per_row), inv(per_row), sa(wires.size() * per_row);
  for (int64_t b = 0; b < a.pieces; ++b) {
    int8_t* codes = out + b * a.bytes();
    for (int64_t r = 0; r < a.rows; ++r) {
      const In* row = in + (b * a.rows + r) * a.row_stride;
      arrival_scales(a, wires, b, r, sa.data());
      for (int64_t j = 0; j < per_row; ++j) {
        const int64_t k = r * per_row + j;
        float* x = xs.data() + j * G;
        for (int i = 0; i < G; ++i) x[i] = load_in(row, j * G + i);
        for (size_t w = 0; w < wires.size(); ++w) {
          float q[G];
          load_codes<G>(a.code, wires[w] + b * a.bytes(), k, q);
          const float s = sa[w * per_row + j];
          for (int i = 0; i < G; ++i) x[i] = x[i] + q[i] * s;
        }
        float m = 0.0f;
        bool nan = false;
        for (int i = 0; i < G; ++i) {
          const float v = std::fabs(x[i]);
          nan |= std::isnan(v);
          m = v > m ? v : m;
        }
        amax[j] = nan ? INFINITY : m;
      }
      row_scale_parts(amax.data(), per_row, code_max, a.steps(codes, r), a.exponent(codes, r),
                      inv.data());
      for (int64_t j = 0; j < per_row; ++j) {
        const int64_t k = r * per_row + j;
        const float* x = xs.data() + j * G;
        if (a.code == kInt4) {
          for (int i = 0; i < G / 2; ++i)
            codes[k * (G / 2) + i] = int8_t((code_of(x[i], inv[j]) & 0x0f) |
                                            (uint8_t(code_of(x[i + G / 2], inv[j])) << 4));
        } else if (a.code == kFp8) {
          for (int i = 0; i < G; ++i) codes[k * G + i] = fp8_of(x[i], inv[j]);
        } else {
          for (int i = 0; i < G; ++i) codes[k * G + i] = code_of(x[i], inv[j]);
        }
      }
    }
  }
}

#ifdef __AVX512F__
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 codes: the conversion rounds half to even (the rounding mode XLA:CPU's threads keep); for
// a finite product the same integer as round-then-magic-add (the scalar form).
inline __m128i codes16(__m512 x, __m512 inv) {
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x, inv)));
}

// fp8_bits of 16 products at once.
inline __m128i fp8_16(__m512 x, __m512 inv) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, inv));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_srli_epi32(_mm512_xor_si512(u, a), 24);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(a, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7ffff)));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(up, 20), _mm512_set1_epi32(960));
  const __m512i small = _mm512_cvtps_epi32(
      _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f)));
  __m512i b = _mm512_mask_blend_epi32(
      _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000)), normal, small);
  b = _mm512_mask_mov_epi32(
      b, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)) |
             _mm512_cmpgt_epi32_mask(b, _mm512_set1_epi32(0x7e)),
      _mm512_set1_epi32(0x7f));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(b, sign));
}

// The maxima of 16 vectors' lanes, m[j] -> lane j: pairs of vectors fold their halves into one
// vector four times (15 shuffle pairs instead of 16 horizontal reductions), which leaves group
// 4k + q in lane 4q + k; one permutation puts it in lane 4k + q.
inline __m512 lane_maxima(__m512* m) {
  for (int j = 0; j < 8; ++j)
    m[j] = _mm512_max_ps(_mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0xee));
  for (int j = 0; j < 4; ++j)
    m[j] = _mm512_max_ps(_mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(m[2 * j], m[2 * j + 1], 0xdd));
  for (int j = 0; j < 2; ++j)
    m[j] = _mm512_max_ps(_mm512_shuffle_ps(m[2 * j], m[2 * j + 1], 0x44),
                         _mm512_shuffle_ps(m[2 * j], m[2 * j + 1], 0xee));
  const __m512 folded = _mm512_max_ps(_mm512_shuffle_ps(m[0], m[1], 0x88),
                                      _mm512_shuffle_ps(m[0], m[1], 0xdd));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), folded);
}

// g = 32: a group is two vectors; a row's groups go 16 at a time through the sums and
// absmaxes (16 absmaxes folded into one vector), then the row's scales, then its codes.
template <Code kCode, typename In>
void encode32(const Piece& a, const In* in, const std::vector<const int8_t*>& wires,
              int8_t* out) {
  const float code_max = code_max_of(kCode);
  const int64_t per_row = a.per_row();
  std::vector<float> xs(per_row * 32), amax(per_row + 16), inv(per_row),
      sa(wires.size() * per_row);
  __m512 m[16];
  const __m512 inf = _mm512_set1_ps(INFINITY);
  for (int64_t b = 0; b < a.pieces; ++b) {
    int8_t* codes = out + b * a.bytes();
    for (int64_t r = 0; r < a.rows; ++r) {
      const In* row = in + (b * a.rows + r) * a.row_stride;
      arrival_scales(a, wires, b, r, sa.data());
      for (int64_t j0 = 0; j0 < per_row; j0 += 16) {
        const int n = int(per_row - j0 < 16 ? per_row - j0 : 16);
        for (int j = 0; j < n; ++j) {
          __m512 lo = load16(row + (j0 + j) * 32), hi = load16(row + (j0 + j) * 32 + 16);
          for (size_t w = 0; w < wires.size(); ++w) {
            __m512 c0, c1;
            load32(kCode, wires[w] + b * a.bytes(), r * per_row + j0 + j, &c0, &c1);
            const __m512 s = _mm512_set1_ps(sa[w * per_row + j0 + j]);
            lo = _mm512_add_ps(lo, _mm512_mul_ps(c0, s));
            hi = _mm512_add_ps(hi, _mm512_mul_ps(c1, s));
          }
          _mm512_storeu_ps(xs.data() + 32 * (j0 + j), lo);
          _mm512_storeu_ps(xs.data() + 32 * (j0 + j) + 16, hi);
          // A NaN counts as Inf (a maximum would drop it): its group's absmax is Inf.
          m[j] = _mm512_mask_mov_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)),
                                    _mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q), inf);
        }
        for (int j = n; j < 16; ++j) m[j] = _mm512_setzero_ps();
        _mm512_storeu_ps(amax.data() + j0, lane_maxima(m));
      }
      row_scale_parts(amax.data(), per_row, code_max, a.steps(codes, r), a.exponent(codes, r),
                      inv.data());
      for (int64_t j = 0; j < per_row; ++j) {
        const int64_t k = r * per_row + j;
        const __m512 iv = _mm512_set1_ps(inv[j]);
        const __m512 x0 = _mm512_loadu_ps(xs.data() + 32 * j);
        const __m512 x1 = _mm512_loadu_ps(xs.data() + 32 * j + 16);
        const __m128i q0 = kCode == kFp8 ? fp8_16(x0, iv) : codes16(x0, iv);
        const __m128i q1 = kCode == kFp8 ? fp8_16(x1, iv) : codes16(x1, iv);
        if (kCode == kInt4) {
          const __m128i packed = _mm_or_si128(
              _mm_and_si128(q0, _mm_set1_epi8(0x0f)),
              _mm_and_si128(_mm_slli_epi16(q1, 4), _mm_set1_epi8(int8_t(0xf0))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k * 16), packed);
        } else {
          auto* p = reinterpret_cast<__m128i*>(codes + k * 32);
          _mm_storeu_si128(p, q0);
          _mm_storeu_si128(p + 1, q1);
        }
      }
    }
  }
}
#endif

template <typename In>
ffi::Error dispatch(const Piece& a, const In* in, const std::vector<const int8_t*>& wires,
                    int8_t* out) {
#ifdef __AVX512F__
  if (a.g == 32) {
    if (a.code == kInt4)
      encode32<kInt4, In>(a, in, wires, out);
    else if (a.code == kFp8)
      encode32<kFp8, In>(a, in, wires, out);
    else
      encode32<kInt8, In>(a, in, wires, out);
    return ffi::Error::Success();
  }
#endif
  switch (a.g) {
    case 8: encode_generic<8, In>(a, in, wires, out); break;
    case 16: encode_generic<16, In>(a, in, wires, out); break;
    case 32: encode_generic<32, In>(a, in, wires, out); break;
    case 64: encode_generic<64, In>(a, in, wires, out); break;
    default: return ffi::Error::InvalidArgument("group size must be 8, 16, 32 or 64");
  }
  return ffi::Error::Success();
}

// buf bfloat16 or float32 (the layout's whole buffer), shard int32[] (the run-time part of the
// piece's offset), then any number of arrivals (wire bytes of the same piece); out the piece's
// wire bytes int8[pieces, .]. The piece's rows: row i (of pieces * rows) starts at element
// base + shard * shard_stride + i * row_stride and holds `width` values; 0 <= shard < shards.
ffi::Error EncodeSum(ffi::AnyBuffer buf, ffi::Buffer<ffi::S32> shard, ffi::RemainingArgs arrivals,
                     ffi::Result<ffi::Buffer<ffi::S8>> out, int64_t code, int64_t group,
                     int64_t pieces, int64_t rows, int64_t width, int64_t row_stride,
                     int64_t base, int64_t shard_stride, int64_t shards) {
  if (code != kInt8 && code != kInt4 && code != kFp8)
    return ffi::Error::InvalidArgument("code must be 0 (int8), 1 (int4) or 2 (fp8)");
  if (group <= 0 || group % 2 != 0 || width % group != 0 || pieces < 1 || rows < 1)
    return ffi::Error::InvalidArgument("width must be a multiple of an even group size");
  const Piece a{Code(code), group, pieces, rows, width, row_stride,
                code == kInt4 ? group / 2 : group, rows * width / group};
  if (out->element_count() != pieces * a.bytes())
    return ffi::Error::InvalidArgument("the output does not hold the piece's wire bytes");
  if (shard.element_count() != 1) return ffi::Error::InvalidArgument("shard must be a scalar");
  const int64_t index = shard.typed_data()[0];
  if (index < 0 || index >= shards)
    return ffi::Error::InvalidArgument("the shard index is outside the buffer");
  const int64_t start = base + index * shard_stride;
  const int64_t last = start + (pieces * rows - 1) * row_stride + width;
  if (start < 0 || row_stride < width || last > int64_t(buf.element_count()))
    return ffi::Error::InvalidArgument("the piece lies outside the buffer");
  std::vector<const int8_t*> wires;
  for (size_t i = 0; i < arrivals.size(); ++i) {
    auto w = arrivals.get<ffi::Buffer<ffi::S8>>(i);
    if (!w.has_error() && w->element_count() == out->element_count()) {
      wires.push_back(w->typed_data());
      continue;
    }
    return ffi::Error::InvalidArgument("every arrival must be int8 wire bytes of the piece");
  }
  int8_t* o = out->typed_data();
  switch (buf.element_type()) {
    case ffi::DataType::BF16:
      return dispatch<uint16_t>(a, static_cast<const uint16_t*>(buf.untyped_data()) + start,
                                wires, o);
    case ffi::DataType::F32:
      return dispatch<float>(a, static_cast<const float*>(buf.untyped_data()) + start, wires, o);
    default:
      return ffi::Error::InvalidArgument("the buffer must be bfloat16 or float32");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxEncodeSum, EncodeSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Attr<int64_t>("code")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("pieces")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("row_stride")
                                  .Attr<int64_t>("base")
                                  .Attr<int64_t>("shard_stride")
                                  .Attr<int64_t>("shards"));
