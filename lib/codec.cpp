// Codec kernels, the payload checker, and the codec registry.
#include "gossip/codec.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>
#include <fmt/format.h>

#include "codec_detail.hpp"
#include "gossip/did_you_mean.hpp"
#include "gossip/error.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define GOSSIP_CODEC_F16C 1
#endif

// The kernels must give the same bits on every rank and level: no multiply-add
// may be contracted into an FMA (a target with FMA, such as the AVX-512
// kernels', would otherwise fuse x̂ + q·scale in one place and not another).
// meson builds the library with -ffp-contract=off; clang also takes it here,
// whatever the build (GCC has no such pragma).
#ifdef __clang__
#pragma clang fp contract(off)
#endif

namespace gossip {
namespace {

constexpr float fp16_max = 65504.0f;

using detail::pad8;
using detail::splitmix;

// Uniform in [0, n) (Lemire's multiply-shift; the tiny bias does not matter here).
std::size_t below(std::uint64_t& s, std::size_t n) noexcept {
  return static_cast<std::size_t>((static_cast<unsigned __int128>(splitmix(s)) * n) >> 64);
}

std::size_t varint_bytes(std::uint64_t v) noexcept {
  std::size_t b = 1;
  while (v >= 0x80) v >>= 7, ++b;
  return b;
}

// topk's magnitude of a change: |x − x̂|, a NaN change as 0 (never selected,
// and it would break the ordering).
inline float magnitude(float x, float hat) noexcept {
  const float a = std::fabs(x - hat);
  return a == a ? a : 0.0f;
}
// Positions (from `first`) and magnitudes of the values whose magnitude
// reaches the threshold (exceeds it when strict), written without a branch.
std::size_t select_scalar(const float* x, const float* hat, std::size_t n, float threshold, bool strict, std::uint32_t first,
                          std::uint32_t* pos, float* mag) noexcept {
  std::size_t c = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = magnitude(x[i], hat[i]);
    pos[c] = first + static_cast<std::uint32_t>(i);
    mag[c] = a;
    c += (strict ? a > threshold : a >= threshold) ? 1 : 0;
  }
  return c;
}
// Moves the values of v[from, count) that reach the pivot to v[m, …), in order; returns where they end.
std::size_t keep_at_least_scalar(float* v, std::size_t m, std::size_t from, std::size_t count, float pivot) noexcept {
  for (std::size_t i = from; i < count; ++i) {  // m ≤ i
    const float a = v[i];
    v[m] = a;
    m += a >= pivot ? 1 : 0;
  }
  return m;
}
std::size_t count_at_least_scalar(const float* v, std::size_t count, float pivot) noexcept {
  std::size_t c = 0;
  for (std::size_t i = 0; i < count; ++i) c += v[i] >= pivot ? 1 : 0;
  return c;
}

// fp16: the change x − x̂, clamped to the fp16 range (what does not fit stays
// in the residual), rounded to nearest even; x̂ += the rounded value.
void fp16_encode_scalar(const float* x, float* hat, std::size_t n, std::uint16_t* out) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float d = std::clamp(x[i] - hat[i], -fp16_max, fp16_max);
    const Eigen::half h(d);
    out[i] = h.x;
    hat[i] += static_cast<float>(h);
  }
}
void fp16_decode_scalar(const std::uint16_t* in, float* hat, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) hat[i] += static_cast<float>(Eigen::half(Eigen::half_impl::raw_uint16_to_half(in[i])));
}

#ifdef GOSSIP_CODEC_F16C
__attribute__((target("avx2,f16c"))) void fp16_encode_f16c(const float* x, float* hat, std::size_t n, std::uint16_t* out) noexcept {
  const __m256 hi = _mm256_set1_ps(fp16_max), lo = _mm256_set1_ps(-fp16_max);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 h = _mm256_loadu_ps(hat + i);
    const __m256 d = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), h), lo), hi);
    const __m128i q = _mm256_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), q);
    _mm256_storeu_ps(hat + i, _mm256_add_ps(h, _mm256_cvtph_ps(q)));
  }
  fp16_encode_scalar(x + i, hat + i, n - i, out + i);
}
__attribute__((target("avx2,f16c"))) void fp16_decode_f16c(const std::uint16_t* in, float* hat, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(hat + i, _mm256_add_ps(_mm256_loadu_ps(hat + i), _mm256_cvtph_ps(q)));
  }
  fp16_decode_scalar(in + i, hat + i, n - i);
}
// Also gates the AVX2 kernels below. cpu_init first: this runs as a static
// initializer, possibly before libgcc's own.
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports
// does not know "f16c".
bool detect_f16c() noexcept {
  __builtin_cpu_init();
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return __builtin_cpu_supports("avx2") && (c & bit_F16C) != 0;
}
const bool have_f16c = detect_f16c();

// AVX-512 (F, BW, DQ, VL) for int8: sixteen values a step, and the
// saturating narrow in one instruction; 1.5 times the AVX2 kernel's speed at
// 1 MiB and 1.1–1.3 at 4 MiB, the same from 16 MiB up, where memory bounds
// both (bench/codec --isa all). fp16 stays on AVX2: its AVX-512 kernel was slower
// at 2–4 MiB. The same operations in the same order as the AVX2 and scalar
// code, so every level gives the same bits.
bool detect_avx512() noexcept {
  return have_f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}
const detail::codec_isa best_isa = detect_avx512() ? detail::codec_isa::avx512 : have_f16c ? detail::codec_isa::avx2 : detail::codec_isa::scalar;
#else
const detail::codec_isa best_isa = detail::codec_isa::scalar;
#endif
std::atomic<int> isa_in_use{static_cast<int>(best_isa)};
bool use(detail::codec_isa level) noexcept { return isa_in_use.load(std::memory_order_relaxed) >= static_cast<int>(level); }

void fp16_encode(const float* x, float* hat, std::size_t n, std::uint16_t* out) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx2)) return fp16_encode_f16c(x, hat, n, out);
#endif
  fp16_encode_scalar(x, hat, n, out);
}
void fp16_decode(const std::uint16_t* in, float* hat, std::size_t n) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx2)) return fp16_decode_f16c(in, hat, n);
#endif
  fp16_decode_scalar(in, hat, n);
}

// int8: per block, scale = max|x − x̂| / 127 and q = round(d / scale); both
// sides then add q·scale. The maximum is taken on the bit patterns of |d|
// (ordered like the values for non-negative floats), which vectorizes.
struct int8_block {
  float scale, inv;
};
int8_block int8_scale(std::uint32_t top) noexcept {
  float amax = std::bit_cast<float>(top);
  // A non-finite change is not sent, nor one so small that 127 / max overflows
  // (subnormal): both stay in the residual, and inv 0 keeps NaN out of the int conversion.
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  if (!std::isfinite(amax) || !std::isfinite(inv)) return {0.0f, 0.0f};
  return {amax / 127.0f, inv};
}
// Written so that compilers vectorize it (no branch or clamp in the loop, and
// q, an int8 pointer, declared not to alias x and x̂): it is the whole kernel
// on CPUs without AVX2, such as ARM. Here (x86-64 baseline, SSE2) int8's
// encode takes 0.25 ms a MiB where a loop that branched on the sign and
// clamped took 1.8 (bench/codec --isa scalar).
void int8_quantize_scalar(const float* __restrict xb, float* __restrict hb, std::size_t m, int8_block s,
                          std::int8_t* __restrict qb) noexcept {
  if (s.inv == 0) {  // a zero or non-finite block: nothing is sent, and x̂ adds 0·0 as the receiver's does
    for (std::size_t i = 0; i < m; ++i) {
      qb[i] = 0;
      hb[i] += 0.0f * s.scale;
    }
    return;
  }
  // No clamp: |d·inv| ≤ 127·(1 + 2^-23) for a finite scale (every d of the
  // block is finite then), which rounds to at most 127.
  for (std::size_t i = 0; i < m; ++i) {
    const float v = (xb[i] - hb[i]) * s.inv;
    const auto c = static_cast<std::int8_t>(static_cast<int>(v + std::copysign(0.5f, v)));
    qb[i] = c;
    hb[i] += static_cast<float>(c) * s.scale;
  }
}
std::uint32_t int8_top_scalar(const float* xb, const float* hb, std::size_t m) noexcept {
  std::uint32_t top = 0;
  for (std::size_t i = 0; i < m; ++i) top = std::max(top, std::bit_cast<std::uint32_t>(xb[i] - hb[i]) & 0x7fffffffu);
  return top;
}
void int8_encode_scalar(const float* x, float* hat, std::size_t n, std::size_t block, float* scales, std::int8_t* q) noexcept {
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t m = std::min(block, n - b0);
    const int8_block s = int8_scale(int8_top_scalar(x + b0, hat + b0, m));
    scales[k] = s.scale;
    int8_quantize_scalar(x + b0, hat + b0, m, s, q + b0);
  }
}

#ifdef GOSSIP_CODEC_F16C
// The same arithmetic as the scalar code, eight values at a time (no FMA:
// x̂ must come out as the receiver's q·scale + x̂, bit for bit; these
// functions must not be compiled with "fma" enabled, or GCC may contract the
// multiply and add). Returns q as int32. No clamp: |d·inv| ≤ 127·(1 + 2^-23)
// for a finite scale, which rounds to at most 127; with scale 0 (a NaN or
// infinite change, v NaN) q comes out as −128 and adds −128·0 on both sides,
// where the scalar code sends 0: either leaves x̂ as the receiver makes it.
__attribute__((target("avx2"), always_inline)) inline __m256i int8_step(const float* xb, float* hb, __m256 inv, __m256 scale) noexcept {
  const __m256 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  const __m256 h = _mm256_loadu_ps(hb);
  const __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xb), h), inv);
  const __m256i c = _mm256_cvttps_epi32(_mm256_add_ps(v, _mm256_or_ps(half, _mm256_and_ps(v, sign))));
  _mm256_storeu_ps(hb, _mm256_add_ps(h, _mm256_mul_ps(_mm256_cvtepi32_ps(c), scale)));
  return c;
}
__attribute__((target("avx2"))) void int8_encode_avx2(const float* x, float* hat, std::size_t n, std::size_t block, float* scales,
                                                      std::int8_t* q) noexcept {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  // packs work within 128-bit lanes: this puts the four groups of eight back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t m = std::min(block, n - b0);
    const float* xb = x + b0;
    float* hb = hat + b0;
    __m256i vtop = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 8 <= m; i += 8) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xb + i), _mm256_loadu_ps(hb + i));
      vtop = _mm256_max_epu32(vtop, _mm256_and_si256(_mm256_castps_si256(d), abs_mask));
    }
    __m128i t4 = _mm_max_epu32(_mm256_castsi256_si128(vtop), _mm256_extracti128_si256(vtop, 1));
    t4 = _mm_max_epu32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_max_epu32(t4, _mm_shuffle_epi32(t4, 0xb1));
    const std::uint32_t top = std::max(static_cast<std::uint32_t>(_mm_cvtsi128_si32(t4)), int8_top_scalar(xb + i, hb + i, m - i));
    const int8_block s = int8_scale(top);
    scales[k] = s.scale;
    const __m256 inv = _mm256_set1_ps(s.inv), scale = _mm256_set1_ps(s.scale);
    std::int8_t* qb = q + b0;
    i = 0;
    // The second pass runs from L1; meanwhile it fetches the lines ahead, so
    // that memory is not idle while a block is quantized.
    const std::size_t last = n - b0 - 1, ahead = std::max<std::size_t>(block, 512);
    for (; i + 32 <= m; i += 32) {  // 32 at a time: one 32-byte store of q
      for (const std::size_t pf : {std::min(i + ahead, last), std::min(i + ahead + 16, last)}) {
        _mm_prefetch(reinterpret_cast<const char*>(xb + pf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(hb + pf), _MM_HINT_T0);
      }
      const __m256i c0 = int8_step(xb + i, hb + i, inv, scale), c1 = int8_step(xb + i + 8, hb + i + 8, inv, scale);
      const __m256i c2 = int8_step(xb + i + 16, hb + i + 16, inv, scale), c3 = int8_step(xb + i + 24, hb + i + 24, inv, scale);
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), _mm256_permutevar8x32_epi32(p, order));
    }
    for (; i + 8 <= m; i += 8) {
      const __m256i c = int8_step(xb + i, hb + i, inv, scale);
      const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + i), _mm_packs_epi16(p16, p16));
    }
    int8_quantize_scalar(xb + i, hb + i, m - i, s, qb + i);
  }
}
__attribute__((target("avx2"))) void int8_decode_avx2(const float* scales, const std::int8_t* q, float* hat, std::size_t n,
                                                      std::size_t block) noexcept {
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t m = std::min(block, n - b0);
    const float s = scales[k];
    const __m256 scale = _mm256_set1_ps(s);
    const std::int8_t* qb = q + b0;
    float* hb = hat + b0;
    std::size_t i = 0;
    for (; i + 8 <= m; i += 8) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + i))));
      _mm256_storeu_ps(hb + i, _mm256_add_ps(_mm256_loadu_ps(hb + i), _mm256_mul_ps(v, scale)));
    }
    for (; i < m; ++i) hb[i] += static_cast<float>(qb[i]) * s;
  }
}

#define GOSSIP_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
// GCC 12's AVX-512 intrinsics leave an operand uninitialized on purpose and
// then warn about it (GCC bug 105593, fixed in 13): quiet within these kernels.
#if defined(__GNUC__) && !defined(__clang__)
#define GOSSIP_AVX512_BEGIN _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define GOSSIP_AVX512_END _Pragma("GCC diagnostic pop")
#else
#define GOSSIP_AVX512_BEGIN
#define GOSSIP_AVX512_END
#endif
GOSSIP_AVX512_BEGIN
// int8_step's arithmetic, sixteen at a time; q narrowed with saturation
// (INT_MIN from a NaN becomes −128, as AVX2's packs make it).
GOSSIP_AVX512 void int8_encode_avx512(const float* x, float* hat, std::size_t n, std::size_t block, float* scales, std::int8_t* q) noexcept {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512 half = _mm512_set1_ps(0.5f), sign = _mm512_set1_ps(-0.0f);
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t m = std::min(block, n - b0);
    const float* xb = x + b0;
    float* hb = hat + b0;
    __m512i vtop = _mm512_setzero_si512();
    std::size_t i = 0;
    for (; i + 16 <= m; i += 16) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(xb + i), _mm512_loadu_ps(hb + i));
      vtop = _mm512_max_epu32(vtop, _mm512_and_si512(_mm512_castps_si512(d), abs_mask));
    }
    const std::uint32_t top = std::max(_mm512_reduce_max_epu32(vtop), int8_top_scalar(xb + i, hb + i, m - i));
    const int8_block s = int8_scale(top);
    scales[k] = s.scale;
    const __m512 inv = _mm512_set1_ps(s.inv), scale = _mm512_set1_ps(s.scale);
    std::int8_t* qb = q + b0;
    // As in the AVX2 kernel: fetch the lines ahead while this block is quantized from L1.
    const std::size_t last = n - b0 - 1, ahead = std::max<std::size_t>(block, 512);
    const auto step16 = [&](std::size_t j) GOSSIP_AVX512 {
      const __m512 h = _mm512_loadu_ps(hb + j);
      const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xb + j), h), inv);
      const __m512i c = _mm512_cvttps_epi32(_mm512_add_ps(v, _mm512_or_ps(half, _mm512_and_ps(v, sign))));
      _mm512_storeu_ps(hb + j, _mm512_add_ps(h, _mm512_mul_ps(_mm512_cvtepi32_ps(c), scale)));
      return _mm512_cvtsepi32_epi8(c);
    };
    for (i = 0; i + 32 <= m; i += 32) {
      for (const std::size_t pf : {std::min(i + ahead, last), std::min(i + ahead + 16, last)}) {
        _mm_prefetch(reinterpret_cast<const char*>(xb + pf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(hb + pf), _MM_HINT_T0);
      }
      const __m128i a = step16(i), b = step16(i + 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
    }
    for (; i + 16 <= m; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), step16(i));
    int8_quantize_scalar(xb + i, hb + i, m - i, s, qb + i);
  }
}
GOSSIP_AVX512 void int8_decode_avx512(const float* scales, const std::int8_t* q, float* hat, std::size_t n, std::size_t block) noexcept {
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t m = std::min(block, n - b0);
    const float s = scales[k];
    const __m512 scale = _mm512_set1_ps(s);
    const std::int8_t* qb = q + b0;
    float* hb = hat + b0;
    std::size_t i = 0;
    for (; i + 16 <= m; i += 16) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + i))));
      _mm512_storeu_ps(hb + i, _mm512_add_ps(_mm512_loadu_ps(hb + i), _mm512_mul_ps(v, scale)));
    }
    for (; i < m; ++i) hb[i] += static_cast<float>(qb[i]) * s;
  }
}
GOSSIP_AVX512_END
#undef GOSSIP_AVX512
#undef GOSSIP_AVX512_BEGIN
#undef GOSSIP_AVX512_END

// topk: positions whose |x − x̂| reaches the threshold (exceeds it when
// strict), and their magnitudes, in increasing order. Two kernels, by how
// many values are expected to pass:
// - dense: eight compared at a time and written without a branch (a branch
//   per group of eight mispredicts at every group that holds one): the
//   group's positions and magnitudes are packed by a table permutation and
//   all eight stored, the count advanced by the matches. It stores as many
//   bytes as it reads.
// - sparse (under 1 in 32 passes, as at topk's usual ratios): a chunk of
//   2048 values is compared into a bitmap, and its set bits are then read
//   while the chunk is still in L1: the pass reads the model and stores
//   little more than what passes.
// `pos` and `mag` need room for n + 8.
struct compress_table {
  std::uint64_t perm[256];  // per mask: the set lanes' numbers, one per byte, in order
  constexpr compress_table() : perm() {
    for (unsigned mask = 0; mask < 256; ++mask) {
      std::uint64_t p = 0;
      for (unsigned lane = 0, at = 0; lane < 8; ++lane)
        if (mask >> lane & 1) p |= std::uint64_t{lane} << (8 * at++);
      perm[mask] = p;
    }
  }
};
constexpr compress_table compress{};
__attribute__((target("avx2"), always_inline)) inline __m256i compress_perm(unsigned mask) noexcept {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(compress.perm[mask])));
}
// |x − x̂| of eight values, a NaN change as 0.
__attribute__((target("avx2"), always_inline)) inline __m256 magnitude8(const float* x, const float* hat) noexcept {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 a = _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(hat)), abs_mask);
  return _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q));
}
// |x − x̂| of eight values, and which of them pass. A NaN magnitude fails the
// comparison, so it is never selected and need not be zeroed.
template <bool Strict>
__attribute__((target("avx2"), always_inline)) inline unsigned passing8(const float* x, const float* hat, __m256 t, __m256& a) noexcept {
  a = _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(hat)), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, t, Strict ? _CMP_GT_OQ : _CMP_GE_OQ)));
}
template <bool Strict>
__attribute__((target("avx2"))) std::size_t select_dense_avx2(const float* x, const float* hat, std::size_t from, std::size_t n, float threshold,
                                                              std::uint32_t* pos, float* mag) noexcept {
  const __m256 t = _mm256_set1_ps(threshold);
  const __m256i eight = _mm256_set1_epi32(8);
  __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(from)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  std::size_t c = 0, i = from;
  for (; i + 8 <= n; i += 8, at = _mm256_add_epi32(at, eight)) {
    __m256 a;
    const unsigned mask = passing8<Strict>(x + i, hat + i, t, a);
    const __m256i perm = compress_perm(mask);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + c), _mm256_permutevar8x32_epi32(at, perm));
    _mm256_storeu_ps(mag + c, _mm256_permutevar8x32_ps(a, perm));
    c += static_cast<std::size_t>(std::popcount(mask));
  }
  return c + select_scalar(x + i, hat + i, n - i, threshold, Strict, static_cast<std::uint32_t>(i), pos + c, mag + c);
}
template <bool Strict>
__attribute__((target("avx2"))) std::size_t select_sparse_avx2(const float* x, const float* hat, std::size_t n, float threshold,
                                                               std::uint32_t* pos, float* mag) noexcept {
  constexpr std::size_t chunk = 2048;
  const __m256 t = _mm256_set1_ps(threshold);
  std::uint64_t bitmap[chunk / 64];
  std::size_t c = 0, c0 = 0;
  for (; c0 + chunk <= n; c0 += chunk) {
    for (std::size_t w = 0; w < chunk / 64; ++w) {
      std::uint64_t bits = 0;
      for (std::size_t g = 0; g < 8; ++g) {
        __m256 a;
        const std::size_t i = c0 + 64 * w + 8 * g;
        bits |= static_cast<std::uint64_t>(passing8<Strict>(x + i, hat + i, t, a)) << (8 * g);
      }
      bitmap[w] = bits;
    }
    // Most words hold none, one or two set bits: two are read without a
    // branch (a missing one reads a position of the chunk, and is not counted).
    for (std::size_t w = 0; w < chunk / 64; ++w) {
      std::uint64_t bits = bitmap[w];
      const std::size_t base = c0 + 64 * w;
      const auto set = static_cast<std::size_t>(std::popcount(bits));
      if (set > 2) [[unlikely]] {
        for (; bits; bits &= bits - 1) {
          const std::size_t i = base + static_cast<std::size_t>(std::countr_zero(bits));
          pos[c] = static_cast<std::uint32_t>(i);
          mag[c++] = std::fabs(x[i] - hat[i]);
        }
        continue;
      }
      const std::size_t i1 = base + (static_cast<std::size_t>(std::countr_zero(bits)) & 63);
      bits &= bits - 1;
      const std::size_t i2 = base + (static_cast<std::size_t>(std::countr_zero(bits)) & 63);
      pos[c] = static_cast<std::uint32_t>(i1);
      mag[c] = std::fabs(x[i1] - hat[i1]);
      pos[c + 1] = static_cast<std::uint32_t>(i2);
      mag[c + 1] = std::fabs(x[i2] - hat[i2]);
      c += set;
    }
  }
  return c + select_dense_avx2<Strict>(x, hat, c0, n, threshold, pos + c, mag + c);
}
// How many of v reach the pivot; then those values, moved to the front in order.
__attribute__((target("avx2"))) std::size_t count_at_least_avx2(const float* v, std::size_t count, float pivot) noexcept {
  const __m256 p = _mm256_set1_ps(pivot);
  std::size_t c = 0, i = 0;
  for (; i + 8 <= count; i += 8) {
    const auto mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), p, _CMP_GE_OQ)));
    c += static_cast<std::size_t>(std::popcount(mask));
  }
  return c + count_at_least_scalar(v + i, count - i, pivot);
}
__attribute__((target("avx2"))) std::size_t keep_at_least_avx2(float* v, std::size_t count, float pivot) noexcept {
  const __m256 p = _mm256_set1_ps(pivot);
  std::size_t m = 0, i = 0;
  for (; i + 8 <= count; i += 8) {  // m ≤ i: the store never overtakes what is still to be read
    const __m256 a = _mm256_loadu_ps(v + i);
    const auto mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, p, _CMP_GE_OQ)));
    _mm256_storeu_ps(v + m, _mm256_permutevar8x32_ps(a, compress_perm(mask)));
    m += static_cast<std::size_t>(std::popcount(mask));
  }
  return keep_at_least_scalar(v, m, i, count, pivot);
}
// topk's sample: magnitudes of the blocks of eight values that start at `starts`.
__attribute__((target("avx2"))) void sample_blocks_avx2(const float* x, const float* hat, const std::uint32_t* starts, std::size_t blocks,
                                                       float* mag) noexcept {
  for (std::size_t j = 0; j < blocks; ++j) _mm256_storeu_ps(mag + 8 * j, magnitude8(x + starts[j], hat + starts[j]));
}
#endif

void int8_encode(const float* x, float* hat, std::size_t n, std::size_t block, float* scales, std::int8_t* q) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx512)) return int8_encode_avx512(x, hat, n, block, scales, q);
  if (use(detail::codec_isa::avx2)) return int8_encode_avx2(x, hat, n, block, scales, q);
#endif
  int8_encode_scalar(x, hat, n, block, scales, q);
}

// Positions with |x − x̂| ≥ threshold (> when strict), in increasing order,
// and their magnitudes; `pos` and `mag` have room for n + 8. `expected`: how
// many are expected to pass, which picks the kernel.
std::size_t select(const float* x, const float* hat, std::size_t n, float threshold, bool strict, std::size_t expected, std::uint32_t* pos,
                   float* mag) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx2) && expected < n / 32)
    return strict ? select_sparse_avx2<true>(x, hat, n, threshold, pos, mag) : select_sparse_avx2<false>(x, hat, n, threshold, pos, mag);
  if (use(detail::codec_isa::avx2))
    return strict ? select_dense_avx2<true>(x, hat, 0, n, threshold, pos, mag) : select_dense_avx2<false>(x, hat, 0, n, threshold, pos, mag);
#endif
  (void)expected;
  return select_scalar(x, hat, n, threshold, strict, 0, pos, mag);
}

// How many of v reach the pivot; those values, moved to the front in order (returns their count).
std::size_t count_at_least(const float* v, std::size_t count, float pivot) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx2)) return count_at_least_avx2(v, count, pivot);
#endif
  return count_at_least_scalar(v, count, pivot);
}
std::size_t keep_at_least(float* v, std::size_t count, float pivot) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx2)) return keep_at_least_avx2(v, count, pivot);
#endif
  return keep_at_least_scalar(v, 0, 0, count, pivot);
}

// topk's sample: the magnitudes of the blocks of eight values that start at `starts`.
void sample_blocks(const float* x, const float* hat, const std::uint32_t* starts, std::size_t blocks, float* mag) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx2)) return sample_blocks_avx2(x, hat, starts, blocks, mag);
#endif
  for (std::size_t j = 0; j < blocks; ++j)
    for (std::size_t i = 0; i < 8; ++i) mag[8 * j + i] = magnitude(x[starts[j] + i], hat[starts[j] + i]);
}

// The k-th largest (1 ≤ k ≤ count) of v, non-negative and not NaN, without
// reordering v, and how many values are larger than it: a radix select on
// the bit patterns (which order like the values), 11, 11 and 10 bits at a
// time, each level counting only the values that share the bits found so far.
struct kth_value {
  float value;
  std::size_t greater;
};
kth_value kth_largest_unmoved(const float* v, std::size_t count, std::size_t k) noexcept {
  std::uint32_t hist[2048];
  std::uint32_t found = 0;  // the answer's bits above `done`
  std::size_t greater = 0;
  int done = 32;
  for (const int width : {11, 11, 10}) {
    const int shift = done - width;
    const std::uint32_t bins = 1u << width;
    std::fill(hist, hist + bins, 0u);
    if (done == 32) {
      for (std::size_t i = 0; i < count; ++i) ++hist[std::bit_cast<std::uint32_t>(v[i]) >> shift];
    } else {
      for (std::size_t i = 0; i < count; ++i) {
        const auto u = std::bit_cast<std::uint32_t>(v[i]);
        hist[(u >> shift) & (bins - 1)] += (u >> done) == (found >> done) ? 1u : 0u;
      }
    }
    std::size_t need = k - greater;  // the answer's rank among the values in the bins left
    std::uint32_t b = bins - 1;
    while (hist[b] < need) need -= hist[b], greater += hist[b], --b;
    found |= b << shift;
    done = shift;
  }
  return {std::bit_cast<float>(found), greater};
}

// The r-th largest (1 ≤ r ≤ count) of v, non-negative and not NaN; v is
// reordered. Most of a large v is far below the answer: a pivot a little
// below it, from a subsample of 1024, leaves only the values at or above it
// (all of the largest ones, ties included) for the exact selection. The count
// and the move of those values run eight at a time, without a branch.
float kth_largest(float* v, std::size_t count, std::size_t r) noexcept {
  constexpr std::size_t sub = 1024;
  if (count > 4 * sub && r < count / 8) {
    float pick[sub];
    const std::size_t stride = count / sub;
    for (std::size_t j = 0; j < sub; ++j) pick[j] = v[j * stride];
    // Aimed at twice the expected rank in the subsample, plus a margin: too
    // high a pivot (rarely) only costs a selection over all of v.
    const std::size_t rank = std::min(sub, 2 * (r * sub / count) + 16);
    const float pivot = kth_largest_unmoved(pick, sub, rank).value;
    if (count_at_least(v, count, pivot) >= r) count = keep_at_least(v, count, pivot);
  }
  return kth_largest_unmoved(v, count, r).value;
}

void int8_decode(const float* scales, const std::int8_t* q, float* hat, std::size_t n, std::size_t block) noexcept {
#ifdef GOSSIP_CODEC_F16C
  if (use(detail::codec_isa::avx512)) return int8_decode_avx512(scales, q, hat, n, block);
  if (use(detail::codec_isa::avx2)) return int8_decode_avx2(scales, q, hat, n, block);
#endif
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t m = std::min(block, n - b0);
    const float scale = scales[k];
    for (std::size_t i = 0; i < m; ++i) hat[b0 + i] += static_cast<float>(q[b0 + i]) * scale;
  }
}

// Sparse segments: values (fp32), then positions as a bitmap or as LEB128
// varints of the gaps (first position, then next − previous − 1), whichever
// is smaller.
std::size_t write_sparse(const float* x, float* hat, std::span<const std::uint32_t> kept, std::size_t n, std::byte* out, codec_kind kind,
                         bool half, double& energy) noexcept {
  std::byte* values = out + sizeof(codec_segment);
  const std::size_t value_bytes = half ? 2 : 4;
  energy = 0;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    // Kept positions are far apart in a large tensor: fetch ahead, or each is a wait on memory.
    constexpr std::size_t ahead = 16;
    if (j + ahead < kept.size()) {
      __builtin_prefetch(x + kept[j + ahead]);
      __builtin_prefetch(hat + kept[j + ahead], 1);
    }
    const std::uint32_t i = kept[j];
    float d = x[i] - hat[i];
    if (half) {
      // Rounded to fp16 (clamped to its range) as the fp16 codec does; what
      // the rounding leaves stays in x − x̂ for a later message.
      const Eigen::half h(std::clamp(d, -fp16_max, fp16_max));
      std::memcpy(values + 2 * j, &h.x, 2);
      d = static_cast<float>(h);
    } else {
      std::memcpy(values + 4 * j, &d, 4);
    }
    hat[i] += d;
    energy += static_cast<double>(d) * d;
  }
  std::size_t gaps = 0;
  for (std::size_t j = 0; j < kept.size(); ++j) gaps += varint_bytes(j == 0 ? kept[0] : kept[j] - kept[j - 1] - 1);
  const std::size_t bitmap = (n + 7) / 8;
  std::byte* idx = values + kept.size() * value_bytes;
  codec_segment sg;
  sg.kind = static_cast<std::uint8_t>(kind);
  if (half) sg.flags = codec_segment::half_values;
  sg.param = static_cast<std::uint32_t>(kept.size());
  std::size_t index_bytes;
  if (bitmap <= gaps) {
    sg.index_mode = 0;
    index_bytes = bitmap;
    std::memset(idx, 0, bitmap);
    auto* bits = reinterpret_cast<std::uint8_t*>(idx);
    for (const std::uint32_t i : kept) bits[i >> 3] |= static_cast<std::uint8_t>(1u << (i & 7));
  } else {
    sg.index_mode = 1;
    index_bytes = gaps;
    auto* p = reinterpret_cast<std::uint8_t*>(idx);
    for (std::size_t j = 0; j < kept.size(); ++j) {
      std::uint64_t v = j == 0 ? kept[0] : kept[j] - kept[j - 1] - 1;
      while (v >= 0x80) *p++ = static_cast<std::uint8_t>(v | 0x80), v >>= 7;
      *p++ = static_cast<std::uint8_t>(v);
    }
  }
  const std::size_t used = sizeof(codec_segment) + kept.size() * value_bytes + index_bytes;
  sg.bytes = pad8(used);
  std::memset(out + used, 0, sg.bytes - used);
  std::memcpy(out, &sg, sizeof sg);
  return sg.bytes;
}

using detail::fail;

// Bytes of a segment's body (header excluded, unpadded) under a dense kind.
std::size_t dense_body_bytes(codec_kind k, std::size_t n, std::size_t block) noexcept {
  switch (k) {
    case codec_kind::fp16: return n * 2;
    case codec_kind::int8: return (n + block - 1) / block * 4 + n;
    default: return n * sizeof(float);
  }
}

}  // namespace

detail::codec_isa detail::codec_isa_best() noexcept { return best_isa; }
detail::codec_isa detail::kernel_isa(codec_kind kind, codec_isa level) noexcept {
  switch (kind) {
    case codec_kind::int8: return level;
    case codec_kind::fp16:
    case codec_kind::topk: return std::min(level, codec_isa::avx2);
    default: return codec_isa::scalar;
  }
}
detail::codec_isa detail::use_codec_isa(codec_isa level) noexcept {
  const int l = std::min(static_cast<int>(level), static_cast<int>(best_isa));
  return static_cast<codec_isa>(isa_in_use.exchange(l, std::memory_order_relaxed));
}

std::string_view to_string(codec_kind k) noexcept {
  switch (k) {
    case codec_kind::none: return "none";
    case codec_kind::fp16: return "fp16";
    case codec_kind::int8: return "int8";
    case codec_kind::topk: return "topk";
    case codec_kind::randomk: return "randomk";
    case codec_kind::lowrank: return "lowrank";
  }
  return "?";
}

codec::codec(codec_settings s, std::string name) : m_settings(s), m_name(name.empty() ? std::string(to_string(s.kind)) : std::move(name)) {
  GOSSIP_ASSERT(m_settings.block > 0, "codec block size must be positive");
  GOSSIP_ASSERT(m_settings.rank > 0, "codec rank must be positive");
  GOSSIP_ASSERT(m_settings.fallback == codec_kind::none || m_settings.fallback == codec_kind::fp16 || m_settings.fallback == codec_kind::int8,
                "a lowrank codec falls back to none, fp16 or int8");
}

bool codec::sends_whole_change() const noexcept {
  const auto k = m_settings.kind;
  return k == codec_kind::none || k == codec_kind::fp16 || k == codec_kind::int8;
}

bool codec::drift_from_held() const noexcept {
  using d = codec_settings::drift_reference;
  if (!compresses() || m_settings.drift == d::sent) return false;
  return m_settings.drift == d::held || m_settings.kind == codec_kind::topk || m_settings.kind == codec_kind::randomk;
}

codec_kind codec::kind_for(std::size_t count, std::size_t rows) const noexcept {
  if (count < m_settings.min_elements) return codec_kind::none;
  if (m_settings.kind != codec_kind::lowrank) return m_settings.kind;
  const codec_kind fb = m_settings.fallback;
  if (rows == 0 || count % rows != 0) return fb;
  const std::size_t cols = count / rows, r = m_settings.rank;
  if (r > std::min(rows, cols)) return fb;
  // Factored only where P and Q are smaller than what the fallback sends.
  if (detail::lowrank_segment_bytes(rows, cols, r) >= pad8(sizeof(codec_segment) + dense_body_bytes(fb, count, m_settings.block))) return fb;
  return codec_kind::lowrank;
}

std::size_t codec::state_floats(std::size_t count, std::size_t rows) const noexcept {
  return kind_for(count, rows) == codec_kind::lowrank ? m_settings.rank * (count / rows) : 0;
}

std::size_t codec::kept(std::size_t count) const noexcept {
  if (count == 0) return 0;
  const double k = std::ceil(m_settings.ratio * static_cast<double>(count));
  return std::clamp<std::size_t>(static_cast<std::size_t>(k), 1, count);
}

std::size_t codec::segment_capacity(std::size_t count) const noexcept {
  const std::size_t full = pad8(sizeof(codec_segment) + count * sizeof(float));  // a first message is fp32
  switch (kind_for(count)) {
    case codec_kind::none: return full;
    case codec_kind::fp16: return full;
    case codec_kind::lowrank: return full;  // smaller than its fallback by construction
    case codec_kind::int8: return std::max(full, pad8(sizeof(codec_segment) + (count + m_settings.block - 1) / m_settings.block * 4 + count));
    case codec_kind::topk:
    case codec_kind::randomk: return std::max(full, pad8(sizeof(codec_segment) + kept(count) * sizeof(float) + (count + 7) / 8));
  }
  return full;
}

std::size_t codec::payload_capacity(std::span<const std::size_t> counts) const noexcept {
  std::size_t b = sizeof(codec_payload);
  for (const auto n : counts) b += segment_capacity(n);
  return b;
}

void codec::prepare(std::size_t max_count, std::size_t max_side) {
  if (max_count > std::numeric_limits<std::uint32_t>::max())
    throw config_error(fmt::format("codec '{}': a tensor of {} values is too large (at most 2^32 − 1 per tensor)", m_name, max_count));
  if (m_settings.kind == codec_kind::topk) {
    m_sample.resize(max_count + 8);  // select()'s room
    m_indices.resize(max_count + 8);
  } else if (m_settings.kind == codec_kind::randomk) {
    m_indices.resize(kept(max_count) + 1);
  } else if (m_settings.kind == codec_kind::lowrank && max_count > 0) {
    m_factors.resize(m_settings.rank * (max_side == any_side ? max_count + 1 : max_side));
  }
}

std::size_t codec::encode(const float* x, float* hat, std::size_t n, std::byte* out, bool absolute, std::uint64_t seed, std::size_t rows,
                          float* state) noexcept {
  codec_segment sg;
  m_change_energy = -1;
  codec_kind kind = n == 0 ? codec_kind::none : kind_for(n, rows);
  // No state to warm-start from, or no scratch prepared for this shape: the fallback.
  if (kind == codec_kind::lowrank && (state == nullptr || m_factors.size() < m_settings.rank * (rows + n / rows))) kind = m_settings.fallback;
  if (kind == codec_kind::lowrank) {
    if (!absolute) return encode_lowrank(x, hat, rows, n / rows, out, seed, state);
    detail::seed_directions(state, state_floats(n, rows), seed);  // the first message is x in fp32; the next starts from random directions
  }
  if (absolute && (kind == codec_kind::fp16 || kind == codec_kind::int8)) {
    std::fill(hat, hat + n, 0.0f);  // both sides start this stream's x̂ from zero
    sg.flags = codec_segment::reset;
  } else if (absolute) {
    kind = codec_kind::none;
  }
  sg.kind = static_cast<std::uint8_t>(kind);
  std::byte* body = out + sizeof sg;
  std::size_t used = sizeof sg;
  switch (kind) {
    case codec_kind::none:
      std::memcpy(body, x, n * sizeof(float));
      std::memcpy(hat, x, n * sizeof(float));
      used += n * sizeof(float);
      break;
    case codec_kind::fp16:
      fp16_encode(x, hat, n, reinterpret_cast<std::uint16_t*>(body));
      used += n * 2;
      break;
    case codec_kind::int8: {
      const std::size_t blocks = (n + m_settings.block - 1) / m_settings.block;
      sg.param = static_cast<std::uint32_t>(m_settings.block);
      int8_encode(x, hat, n, m_settings.block, reinterpret_cast<float*>(body), reinterpret_cast<std::int8_t*>(body + blocks * 4));
      used += blocks * 4 + n;
      break;
    }
    case codec_kind::randomk: {
      // One uniform position in each of k equal strata: exactly k positions,
      // each kept with probability k/n, in increasing order, O(k) draws.
      const std::size_t k = kept(n);
      std::uint64_t s = seed ^ m_settings.seed * 0x2545f4914f6cdd1dull;
      for (std::size_t j = 0; j < k; ++j) {
        const std::size_t lo = j * n / k, hi = (j + 1) * n / k;
        m_indices[j] = static_cast<std::uint32_t>(lo + below(s, hi - lo));
      }
      return write_sparse(x, hat, {m_indices.data(), k}, n, out, kind, m_settings.half_values, m_change_energy);
    }
    case codec_kind::topk: {
      const std::size_t k = kept(n);
      float* mag = m_sample.data();
      std::uint32_t* pos = m_indices.data();
      // A threshold from a sample of |x − x̂| (no sort of the tensor), aimed at
      // about 1.3 k values, which are then trimmed to k exactly: the sample
      // decides the cost, not what is sent.
      std::size_t samples = std::min(n, std::max<std::size_t>(4096, static_cast<std::size_t>(256.0 / m_settings.ratio)));
      if (samples == n) {
        for (std::size_t i = 0; i < n; ++i) mag[i] = magnitude(x[i], hat[i]);
      } else {
        // Blocks of eight consecutive values, one at a uniform position in
        // each of samples/8 equal strata (a block is one vector load, and its
        // cache line is fetched once for eight values; where changes come in
        // runs of like size, eight neighbours count as fewer samples: see the
        // second selection below). Stratum starts in 32.32 fixed point; two
        // 32-bit draws per splitmix. The starts are drawn first, so that the
        // reads that follow overlap.
        const std::size_t blocks = samples / 8;
        samples = blocks * 8;
        const std::uint64_t step = (static_cast<std::uint64_t>(n) << 32) / blocks;
        std::uint64_t s = seed, at = 0, bits = 0;
        for (std::size_t j = 0; j < blocks; ++j, at += step) {
          const std::uint64_t lo = at >> 32, starts = ((at + step) >> 32) - lo - 7;  // a stratum holds ≥ 8 values
          if (j % 2 == 0) bits = splitmix(s);
          const std::uint64_t u = j % 2 == 0 ? bits & 0xffffffffu : bits >> 32;
          pos[j] = static_cast<std::uint32_t>(lo + ((u * starts) >> 32));
        }
        sample_blocks(x, hat, pos, blocks, mag);
      }
      const double aim = 1.3 * static_cast<double>(k);
      const auto above = std::min(samples, static_cast<std::size_t>(std::ceil(aim * static_cast<double>(samples) / static_cast<double>(n))));
      const float threshold = kth_largest(mag, samples, std::max<std::size_t>(above, 1));
      // A zero threshold keeps only non-zero changes.
      std::size_t c = select(x, hat, n, threshold, !(threshold > 0), static_cast<std::size_t>(aim), pos, mag);
      if (c < k && threshold > 0) {
        // The sample put the threshold too high: changes of like size sit
        // together (a channel's scale), and blocks of eight from such runs
        // count as fewer independent samples than they are. Rare, but k must
        // hold: every non-zero change is a candidate, and the trim below picks k.
        c = select(x, hat, n, 0.0f, true, n, pos, mag);
      }
      if (c > k) {
        // The k-th largest magnitude among the candidates, then a stable
        // filter that keeps index order: larger ones, and ties up to k.
        const kth_value kth = kth_largest_unmoved(mag, c, k);
        std::size_t ties = k - kth.greater, w = 0;
        for (std::size_t j = 0; j < c; ++j) {
          const float a = mag[j];
          const bool tie = a == kth.value && ties > 0;
          pos[w] = pos[j];
          w += a > kth.value || tie ? 1 : 0;
          ties -= tie ? 1 : 0;
        }
        c = w;
      }
      return write_sparse(x, hat, {pos, c}, n, out, kind, m_settings.half_values, m_change_energy);
    }
    case codec_kind::lowrank: break;  // encoded above
  }
  sg.bytes = pad8(used);
  std::memset(out + used, 0, sg.bytes - used);
  std::memcpy(out, &sg, sizeof sg);
  return sg.bytes;
}

namespace {
// A sparse segment (topk, randomk): k values (fp32, or fp16 bits), then their
// positions as a bitmap or as gaps.
template <class Value>
decode_status decode_sparse(const codec_segment& sg, const std::byte* body, std::size_t room, float* hat, std::size_t n) noexcept {
  const std::size_t k = sg.param;
  if (k > n) return fail("a sparse segment keeps more values than the tensor has");
  if (k * sizeof(Value) > room) return fail("a sparse segment's values run past its end");
  const auto* values = reinterpret_cast<const Value*>(body);
  const auto value = [values](std::size_t j) {
    if constexpr (std::is_same_v<Value, float>) return values[j];
    else return static_cast<float>(Eigen::half(Eigen::half_impl::raw_uint16_to_half(values[j])));
  };
  const auto* idx = reinterpret_cast<const std::uint8_t*>(body + k * sizeof(Value));
  const std::size_t idx_room = room - k * sizeof(Value);
  std::size_t used = 0;
  if (sg.index_mode == 0) {
    const std::size_t bitmap = (n + 7) / 8;
    if (bitmap > idx_room) return fail("a sparse segment's bitmap runs past its end");
    std::size_t set = 0;
    for (std::size_t b = 0; b < bitmap; ++b) set += static_cast<std::size_t>(std::popcount(idx[b]));
    if (n % 8 != 0 && (idx[bitmap - 1] >> (n % 8)) != 0) return fail("a sparse segment's bitmap marks positions past the tensor's end");
    if (set != k) return fail("a sparse segment's bitmap does not mark as many positions as it has values");
    std::size_t j = 0;
    for (std::size_t b = 0; b < bitmap; ++b)
      for (std::uint8_t bits = idx[b]; bits; bits &= static_cast<std::uint8_t>(bits - 1))
        hat[b * 8 + static_cast<std::size_t>(std::countr_zero(bits))] += value(j++);
    used = bitmap;
  } else if (sg.index_mode == 1) {
    // Positions are checked in a first pass, so a bad one leaves x̂ untouched.
    for (int pass = 0; pass < 2; ++pass) {
      std::size_t p = 0, next = 0;
      for (std::size_t j = 0; j < k; ++j) {
        std::uint64_t v = 0;
        for (int shift = 0;; shift += 7) {
          if (p >= idx_room) return fail("a sparse segment's positions run past its end");
          if (shift > 63) return fail("a sparse segment has an overlong position varint");
          const std::uint8_t byte = idx[p++];
          v |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
          if (!(byte & 0x80)) break;
        }
        if (v >= n || next + v >= n) return fail("a sparse segment names a position past the tensor's end");
        const std::size_t i = next + v;
        if (pass == 1) hat[i] += value(j);
        next = i + 1;
      }
      used = p;
    }
  } else {
    return fail("a sparse segment has an unknown position encoding");
  }
  if (sg.bytes != pad8(sizeof sg + k * sizeof(Value) + used)) return fail("a sparse segment's size does not match its contents");
  return {};
}

}  // namespace

decode_status decode_segment(std::span<const std::byte> seg, float* hat, std::size_t n, bool primed) noexcept {
  codec_segment sg;
  if (seg.size() < sizeof sg) return fail("a tensor's segment header is truncated");
  std::memcpy(&sg, seg.data(), sizeof sg);
  if (sg.bytes < sizeof sg || sg.bytes > seg.size() || sg.bytes % 8 != 0) return fail("a tensor's segment size is out of bounds");
  const std::byte* body = seg.data() + sizeof sg;
  const std::size_t room = sg.bytes - sizeof sg;
  const auto kind = static_cast<codec_kind>(sg.kind);
  const bool reset = (sg.flags & codec_segment::reset) != 0, half = (sg.flags & codec_segment::half_values) != 0;
  if (sg.flags & ~(codec_segment::reset | codec_segment::half_values)) return fail("a segment has unknown flags");
  if (half && kind != codec_kind::topk && kind != codec_kind::randomk) return fail("a segment that is not topk or randomk has fp16 values");
  if (reset && kind != codec_kind::fp16 && kind != codec_kind::int8) return fail("a segment that is not fp16 or int8 asks for a reset");
  if (kind != codec_kind::none && !primed && !reset)
    return decode_status{"a compressed change arrived before the stream's first full message", 0, true};
  switch (kind) {
    case codec_kind::lowrank: return detail::decode_lowrank(sg, body, room, hat, n);
    case codec_kind::none:
      if (sg.bytes != pad8(sizeof sg + n * sizeof(float))) return fail("an fp32 segment's size does not match the tensor");
      std::memcpy(hat, body, n * sizeof(float));
      return {};
    case codec_kind::fp16:
      if (sg.bytes != pad8(sizeof sg + n * 2)) return fail("an fp16 segment's size does not match the tensor");
      if (reset) std::fill(hat, hat + n, 0.0f);
      fp16_decode(reinterpret_cast<const std::uint16_t*>(body), hat, n);
      return {};
    case codec_kind::int8: {
      const std::size_t block = sg.param;
      if (block == 0) return fail("an int8 segment has block size 0");
      const std::size_t blocks = (n + block - 1) / block;
      if (sg.bytes != pad8(sizeof sg + blocks * 4 + n)) return fail("an int8 segment's size does not match the tensor and block size");
      const auto* scales = reinterpret_cast<const float*>(body);
      for (std::size_t k = 0; k < blocks; ++k)
        if (!(scales[k] >= 0 && std::isfinite(scales[k]))) return fail("an int8 segment has a negative or non-finite scale");
      if (reset) std::fill(hat, hat + n, 0.0f);
      int8_decode(scales, reinterpret_cast<const std::int8_t*>(body + blocks * 4), hat, n, block);
      return {};
    }
    case codec_kind::topk:
    case codec_kind::randomk:
      return half ? decode_sparse<std::uint16_t>(sg, body, room, hat, n) : decode_sparse<float>(sg, body, room, hat, n);
  }
  return fail("a segment names an unknown codec");
}

decode_status decode_payload(std::span<const std::byte> payload, std::span<const std::size_t> counts, float* hat, bool primed) noexcept {
  codec_payload ph;
  if (payload.size() < sizeof ph) return fail("the codec header is truncated");
  std::memcpy(&ph, payload.data(), sizeof ph);
  if (ph.magic != codec_payload::magic_value) return fail("the payload is not codec-encoded (bad magic): do both ranks use the same [codec]?");
  std::size_t elements = 0;
  for (const auto n : counts) elements += n;
  if (ph.tensors != counts.size() || ph.elements != elements) return fail("the codec header's tensor count or size does not match the model");
  std::size_t at = sizeof ph, offset = 0;
  for (std::size_t t = 0; t < counts.size(); ++t) {
    auto st = decode_segment(payload.subspan(at), hat + offset, counts[t], primed);
    if (!st.ok()) {
      st.tensor = t;
      return st;
    }
    codec_segment sg;
    std::memcpy(&sg, payload.data() + at, sizeof sg);
    at += sg.bytes;
    offset += counts[t];
  }
  if (at != payload.size()) return decode_status{"the payload has bytes after its last tensor", counts.size() - 1};
  return {};
}

codec codec::resolve(bool network) const {
  if (!m_settings.automatic) return *this;
  if (!network) return codec();
  codec_settings s = m_settings;
  s.automatic = false;
  return codec(s);
}

codec_registry_t& codec_registry() {
  static codec_registry_t r = [] {
    codec_registry_t c("codec");
    const option_spec min_elements{"min_elements", std::int64_t{0}, "tensors with fewer values are sent in fp32 (e.g. biases; integer >= 0)"};
    const option_spec step{"step", 0.0,
                           "merge step towards a sender's lag-corrected x̂, in (0, 1]; 0: the fraction of a change's energy this codec keeps "
                           "(measured) for topk, randomk and lowrank, and a plain merge of x̂ for fp16 and int8"};
    const option_spec drift{"drift", std::string("auto"),
                            "what the policy's drift is measured from: \"sent\" (x at the last send), \"held\" (the x̂ the freshest "
                            "target holds, so what the codec has not delivered counts), \"auto\" (held for topk and randomk, sent otherwise)"};
    const option_spec start{"start", std::string("shared"),
                            "a stream's first message: \"shared\" (when both ranks started from the same model, checked by fingerprint "
                            "at connection, both ends start from it and the first message is a compressed change; otherwise the model) "
                            "or \"model\" (always the model)"};
    auto base = [](const options& o, codec_kind k) {
      codec_settings s;
      s.kind = k;
      const auto m = o.integer("min_elements");
      if (m < 0) throw config_error(fmt::format("{}: key 'min_elements' must be >= 0, got {}", o.where("min_elements"), m));
      s.min_elements = static_cast<std::size_t>(m);
      const double g = o.real("step");
      if (!(g >= 0 && g <= 1)) throw config_error(fmt::format("{}: key 'step' must be in [0, 1] (0: automatic), got {}", o.where("step"), g));
      s.step = g;
      const auto& st = o.string("start");
      if (st != "shared" && st != "model")
        throw config_error(fmt::format("{}: key 'start' must be \"shared\" or \"model\", got \"{}\"", o.where("start"), st));
      s.shared_start = st == "shared";
      const auto& dr = o.string("drift");
      if (dr == "auto") s.drift = codec_settings::drift_reference::automatic;
      else if (dr == "sent") s.drift = codec_settings::drift_reference::sent;
      else if (dr == "held") s.drift = codec_settings::drift_reference::held;
      else throw config_error(fmt::format("{}: key 'drift' must be \"auto\", \"sent\" or \"held\", got \"{}\"", o.where("drift"), dr));
      return s;
    };
    auto block = [](const options& o) {
      const auto b = o.integer("block");
      if (b < 1 || b > (std::int64_t{1} << 24))
        throw config_error(fmt::format("{}: key 'block' must be in 1..16777216, got {}", o.where("block"), b));
      return static_cast<std::size_t>(b);
    };
    auto ratio = [](const options& o) {
      const double r = o.real("ratio");
      if (!(r > 0 && r <= 1)) throw config_error(fmt::format("{}: key 'ratio' must be in (0, 1], got {}", o.where("ratio"), r));
      return r;
    };
    c.add({"auto",
           "int8 where messages cross a network between processes (UCX, ranks paced by [engine] max_lead > 0), none in-process "
           "(loopback), through the switch and for device models (default)",
           {{"block", std::int64_t{256}, "int8: values per scale (1..16777216)"}, min_elements, step, start, drift},
           [base, block](const options& o) {
             auto s = base(o, codec_kind::int8);
             s.block = block(o);
             s.automatic = true;
             return codec(s, "auto");
           }});
    c.add({"none", "the model in fp32, as without a codec", {}, [](const options&) { return codec(); }});
    c.add({"fp16", "the change since the last send in fp16 (2 bytes a value)", {min_elements, step, start, drift},
           [base](const options& o) { return codec(base(o, codec_kind::fp16)); }});
    c.add({"int8", "the change in int8 with one fp32 scale per block (about 1 byte a value)",
           {{"block", std::int64_t{256}, "values per scale (1..16777216)"}, min_elements, step, start, drift},
           [base, block](const options& o) {
             auto s = base(o, codec_kind::int8);
             s.block = block(o);
             return codec(s);
           }});
    const option_spec values{"values", std::string("fp32"),
                             "how the kept values travel: fp32, or fp16 (2 bytes; the rounding stays in the residual for a later message)"};
    auto half_values = [](const options& o) {
      const auto& v = o.string("values");
      if (v != "fp32" && v != "fp16") throw config_error(fmt::format("{}: key 'values' must be \"fp32\" or \"fp16\", got \"{}\"", o.where("values"), v));
      return v == "fp16";
    };
    c.add({"topk", "the largest changes by magnitude (sampled threshold), positions as bitmap or gaps",
           {{"ratio", 0.01, "fraction of each tensor's values sent (in (0, 1])"}, values, min_elements, step, start, drift},
           [base, ratio, half_values](const options& o) {
             auto s = base(o, codec_kind::topk);
             s.ratio = ratio(o);
             s.half_values = half_values(o);
             return codec(s);
           }});
    c.add({"randomk", "changes at random positions (one per stratum), positions as bitmap or gaps",
           {{"ratio", 0.01, "fraction of each tensor's values sent (in (0, 1])"}, {"seed", std::int64_t{1}, "seed of the positions (mixed with rank and round)"},
            values, min_elements, step, start, drift},
           [base, ratio, half_values](const options& o) {
             auto s = base(o, codec_kind::randomk);
             s.ratio = ratio(o);
             s.half_values = half_values(o);
             s.seed = static_cast<std::uint64_t>(o.integer("seed"));
             return codec(s);
           }});
    c.add({"lowrank", "each matrix's change as rank-r factors P·Qᵀ (PowerSGD, warm-started); other tensors by the fallback",
           {{"rank", std::int64_t{4}, "rank of each matrix's change (1..256)"},
            {"fallback", std::string("fp16"), "codec for 1-D tensors and matrices too small to gain: none, fp16 or int8"},
            {"block", std::int64_t{256}, "values per scale, when the fallback is int8 (1..16777216)"},
            min_elements, step, start, drift},
           [base, block](const options& o) {
             auto s = base(o, codec_kind::lowrank);
             const auto rk = o.integer("rank");
             if (rk < 1 || rk > 256) throw config_error(fmt::format("{}: key 'rank' must be in 1..256, got {}", o.where("rank"), rk));
             s.rank = static_cast<std::size_t>(rk);
             const auto& fb = o.string("fallback");
             if (fb == "none") s.fallback = codec_kind::none;
             else if (fb == "fp16") s.fallback = codec_kind::fp16;
             else if (fb == "int8") s.fallback = codec_kind::int8;
             else
               throw config_error(fmt::format("{}: key 'fallback' must be \"none\", \"fp16\" or \"int8\", got \"{}\"", o.where("fallback"), fb));
             s.block = block(o);
             return codec(s);
           }});
    return c;
  }();
  return r;
}

codec make_codec(const component_config& c) {
  const auto& r = codec_registry();
  if (!r.contains(c.name)) {
    std::vector<std::string> known;
    for (const auto& e : r.entries()) known.push_back(e.name);
    throw config_error(fmt::format("{}: unknown codec '{}'{}; known codecs: {}", c.opts.where(), c.name, detail::did_you_mean(c.name, known),
                                   r.names_joined()));
  }
  return r.make(c.name, c.opts);
}

}  // namespace gossip
