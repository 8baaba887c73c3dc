// The product of activations with int8 weight codes in groups along the contracted dim, each
// group its own scale, as an XLA FFI handler (equarx/native_cpu.py builds and registers it):
//   out[r, n] = sum_j scale[j, n] * (sum_{k in group j} x[r, k] * codes[k, n])
// x float32[R, K], codes int8[K, N], scale bfloat16 or float32[K / G, N] -> float32[R, N].
//
// Why a kernel of its own: XLA:CPU cannot put a group's scale inside a dot, so the weight is
// dequantized to a full bfloat16 copy every step (a decode step ~2x a bfloat16 one); here each
// 32-column block of a group's codes is widened once into L1 and used by every row (with one
// row tile's rows or fewer, a decode step's, widened in registers as they are read).
//
// A row's arithmetic does not depend on the other rows or on how the work is split: each
// (row, column) sums its group's products in k order with fused multiply-adds, then adds the
// group's sum times the scale with one more, group after group (batch invariance).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 32;  // columns a block: two 16-lane vectors
constexpr int kRowTile = 8;    // rows whose partial sums stay in registers
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float scale_at(const uint16_t* s, int64_t i) { return bf16_to_float(s[i]); }
inline float scale_at(const float* s, int64_t i) { return s[i]; }

struct Problem {
  const float* x;
  const int8_t* codes;
  int64_t rows, k, n, group;
  float* out;
};

// A block's weights at contraction row k as float32: widened once into a buffer (`Staged`, for
// several row tiles) or widened in registers as the codes are read (`Codes`, for one).
struct Staged {
  const float* w;
#if defined(__AVX512F__)
  void load(int64_t k, __m512& w0, __m512& w1) const {
    w0 = _mm512_loadu_ps(w + k * kCols);
    w1 = _mm512_loadu_ps(w + k * kCols + 16);
  }
#endif
  float at(int64_t k, int64_t c) const { return w[k * kCols + c]; }
};

struct Codes {
  const int8_t* codes;
  int64_t ld;  // codes between contraction rows
#if defined(__AVX512F__)
  void load(int64_t k, __m512& w0, __m512& w1) const {
    const int8_t* c = codes + k * ld;
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 16))));
  }
#endif
  float at(int64_t k, int64_t c) const { return float(codes[k * ld + c]); }
};

// Rows [r0, r0 + RT) of one block: acc[r][c] += scale[c] * sum_k x[r, k] * w[k][c].
template <int RT, typename W>
inline void row_tile(const float* x, int64_t ldx, const W& w, int64_t g, const float* s,
                     float* acc) {
#if defined(__AVX512F__)
  __m512 part[RT][2];
  for (int r = 0; r < RT; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < g; ++k) {
    __m512 w0, w1;
    w.load(k, w0, w1);
    for (int r = 0; r < RT; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      part[r][0] = _mm512_fmadd_ps(xv, w0, part[r][0]);
      part[r][1] = _mm512_fmadd_ps(xv, w1, part[r][1]);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  for (int r = 0; r < RT; ++r) {
    float* a = acc + r * kCols;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(part[r][0], s0, _mm512_loadu_ps(a)));
    _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(part[r][1], s1, _mm512_loadu_ps(a + 16)));
  }
#else
  float part[RT][kCols] = {};
  for (int64_t k = 0; k < g; ++k)
    for (int r = 0; r < RT; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t c = 0; c < kCols; ++c) part[r][c] = std::fma(xv, w.at(k, c), part[r][c]);
    }
  for (int r = 0; r < RT; ++r)
    for (int64_t c = 0; c < kCols; ++c)
      acc[r * kCols + c] = std::fma(part[r][c], s[c], acc[r * kCols + c]);
#endif
}

template <int RT, typename W>
void rows_from(const Problem& p, int64_t r0, const W& w, const float* s, int64_t kg, float* acc) {
  for (; r0 + RT <= p.rows; r0 += RT)
    row_tile<RT>(p.x + r0 * p.k + kg, p.k, w, p.group, s, acc + r0 * kCols);
  if constexpr (RT > 1) {
    if (r0 < p.rows) rows_from<RT - 1>(p, r0, w, s, kg, acc);
  }
}

// Columns [n0, n0 + kCols) (the last block may be short: padded with zero codes), every row.
// w holds the block's codes of one group widened to float32 when several row tiles share them;
// one row tile (a decode step's rows) reads the codes straight, with AVX-512 (measured there).
// acc holds the rows' sums.
template <typename S>
void column_block(const Problem& p, const S* scale, int64_t n0, float* w, float* acc) {
  const int64_t width = std::min(kCols, p.n - n0);
  const bool straight = kAvx512 && width == kCols && p.rows <= kRowTile;
  std::fill(acc, acc + p.rows * kCols, 0.0f);
  float s[kCols] = {};
  for (int64_t kg = 0; kg < p.k; kg += p.group) {
    for (int64_t i = 0; i < width; ++i) s[i] = scale_at(scale, (kg / p.group) * p.n + n0 + i);
    if (straight) {
      rows_from<kRowTile>(p, 0, Codes{p.codes + kg * p.n + n0, p.n}, s, kg, acc);
      continue;
    }
    for (int64_t k = 0; k < p.group; ++k) {
      const int8_t* c = p.codes + (kg + k) * p.n + n0;
      float* wk = w + k * kCols;
      for (int64_t i = 0; i < width; ++i) wk[i] = float(c[i]);
      for (int64_t i = width; i < kCols; ++i) wk[i] = 0.0f;
    }
    rows_from<kRowTile>(p, 0, Staged{w}, s, kg, acc);
  }
  for (int64_t r = 0; r < p.rows; ++r)
    std::memcpy(p.out + r * p.n + n0, acc + r * kCols, width * sizeof(float));
}

// Column blocks handed out one chunk at a time to the caller and to tasks on XLA's intra-op
// pool; the caller works too and waits only for chunks already taken, so a pool busy with other
// work never stalls the product.
template <typename S>
ffi::Error run(const Problem& p, const S* scale, ffi::ThreadPool pool) {
  const int64_t blocks = (p.n + kCols - 1) / kCols;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), blocks));
  const int64_t chunks = std::min<int64_t>(blocks, threads * 4);
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [p, scale, blocks, chunks, shared]() {
    std::vector<float> w, acc;
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      w.resize(p.group * kCols);
      acc.resize(p.rows * kCols);
      for (int64_t b = c * blocks / chunks; b < (c + 1) * blocks / chunks; ++b)
        column_block(p, scale, b * kCols, w.data(), acc.data());
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work]() { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error GroupedMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes, ffi::AnyBuffer scale,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, codes and scale must be 2-D");
  const int64_t rows = xd[0], k = xd[1], n = cd[1];
  if (cd[0] != k || sd[1] != n || sd[0] < 1 || k % sd[0] != 0)
    return ffi::Error::InvalidArgument("codes must be [K, N], scale [K / G, N]");
  if (out->element_count() != size_t(rows * n))
    return ffi::Error::InvalidArgument("the output must be [rows, N]");
  if (rows == 0 || n == 0) return ffi::Error::Success();
  const Problem p{x.typed_data(), codes.typed_data(), rows, k, n, k / sd[0], out->typed_data()};
  switch (scale.element_type()) {
    case ffi::DataType::BF16:
      return run(p, static_cast<const uint16_t*>(scale.untyped_data()), pool);
    case ffi::DataType::F32:
      return run(p, static_cast<const float*>(scale.untyped_data()), pool);
    default:
      return ffi::Error::InvalidArgument("the scale must be bfloat16 or float32");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxGroupedMatmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());
