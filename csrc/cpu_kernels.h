// CPU kernels over one contiguous range: a portable scalar version, and
// AVX-512 and AVX2+F16C versions compiled through target attributes (the build
// itself uses no -march flag, so the extension runs on any x86-64 or Arm CPU)
// and picked at run time (`cpu_isa()`). Packed values travel as their 16-bit
// patterns (uint16_t).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "scale.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define MINDDP_X86_SIMD 1
#include <immintrin.h>
#endif

namespace minddp {

// Scalar conversions: c10's round to nearest even, NaN kept NaN (as torch's .to()).
template <bool BF16> inline uint16_t to_bits(float f) {
  return BF16 ? c10::BFloat16(f).x : c10::Half(f).x;
}
template <bool BF16> inline float from_bits(uint16_t b) {
  return BF16 ? float(c10::BFloat16(b, c10::BFloat16::from_bits()))
              : float(c10::Half(b, c10::Half::from_bits()));
}

// Largest finite magnitude: inf/NaN must not set the scale (they would zero
// every other value); they pass through the conversion unchanged instead.
inline float amax_scalar(const float* x, int64_t n, float m = 0.0f) {
  for (int64_t i = 0; i < n; ++i) {
    float a = std::fabs(x[i]);
    if (a < INFINITY && a > m) m = a;
  }
  return m;
}

template <bool BF16> void pack_scalar(const float* x, int64_t n, float scale, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bits<BF16>(x[i] * scale);
}

// Multiply by the exact reciprocal of a power of two (= divide), then add: two
// roundings, as `dst.add_(packed.float() / scale)`; the build disables FMA
// contraction (-ffp-contract=off) so the compiler cannot fuse them.
template <bool BF16, bool ADD>
void unpack_scalar(const uint16_t* p, int64_t n, float inv, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    float v = from_bits<BF16>(p[i]) * inv;
    dst[i] = ADD ? dst[i] + v : v;
  }
}

// int8 (scale.h), one block of values at a time.
inline float int8_amax_scalar(const float* x, int64_t n, float m = 0.0f) {
  for (int64_t i = 0; i < n; ++i) m = std::max(m, int8_amax_of(x[i]));
  return m;
}

inline void int8_pack_scalar(const float* x, int64_t n, float scale, signed char* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = quantize_int8(x[i], scale);
}

// int8 scales are not powers of two: a correctly rounded division, then the add,
// as the reference does.
template <bool ADD>
void int8_unpack_scalar(const signed char* p, int64_t n, float scale, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(p[i]) / scale;
    dst[i] = ADD ? dst[i] + v : v;
  }
}

// compress_with_feedback's record of one int8 block packed from `fed` (the values
// minus their error): error = decoded - fed where that is finite (0 where a value
// was inf or NaN), and with DECODE out = decoded. The decoded values are
// decompress's, bit for bit.
template <bool DECODE>
void int8_record_scalar(const signed char* p, int64_t n, float scale, const float* fed,
                        float* error, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(p[i]) / scale, d = v - fed[i];
    error[i] = std::fabs(d) <= 3.40282347e38f ? d : 0.0f;  // NaN fails the comparison
    if (DECODE) out[i] = v;
  }
}

#ifdef MINDDP_X86_SIMD
#define MINDDP_AVX512 __attribute__((target("avx512f")))

MINDDP_AVX512 inline float amax_avx512(const float* x, int64_t n) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // two accumulators hide the max latency
    __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    __m512 v1 = _mm512_abs_ps(_mm512_loadu_ps(x + i + 16));
    a0 = _mm512_mask_max_ps(a0, _mm512_cmp_ps_mask(v0, inf, _CMP_LT_OQ), a0, v0);
    a1 = _mm512_mask_max_ps(a1, _mm512_cmp_ps_mask(v1, inf, _CMP_LT_OQ), a1, v1);
  }
  return amax_scalar(x + i, n - i, _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)));
}

// fp32 -> bf16 bits, round to nearest even with NaN -> 0x7FC0: c10's rule,
// bit for bit (AVX512_BF16's vcvtneps2bf16 would flush subnormals instead).
MINDDP_AVX512 inline __m256i bf16_rne(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb,
                                _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// stream: write around the caches (non-temporal stores) when the output is
// too big to be read back from them: it saves reading each destination line
// before writing it. The caller passes stream only for aligned outputs.
template <bool BF16>
MINDDP_AVX512 void pack_avx512(const float* x, int64_t n, float scale, uint16_t* out, bool stream) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), s);
    __m256i h = BF16 ? bf16_rne(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    auto* o = reinterpret_cast<__m256i*>(out + i);
    stream ? _mm256_stream_si256(o, h) : _mm256_storeu_si256(o, h);
  }
  if (stream) _mm_sfence();  // order the streamed stores before the op returns
  pack_scalar<BF16>(x + i, n - i, scale, out + i);
}

template <bool BF16, bool ADD>
MINDDP_AVX512 void unpack_avx512(const uint16_t* p, int64_t n, float inv, float* dst, bool stream) {
  const __m512 s = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    __m512 v = BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                    : _mm512_cvtph_ps(h);
    v = _mm512_mul_ps(v, s);
    if (ADD) v = _mm512_add_ps(_mm512_loadu_ps(dst + i), v);
    stream ? _mm512_stream_ps(dst + i, v) : _mm512_storeu_ps(dst + i, v);
  }
  if (stream) _mm_sfence();
  unpack_scalar<BF16, ADD>(p + i, n - i, inv, dst + i);
}

// The same kernels, 8 lanes wide, for CPUs without AVX-512 (AMD before Zen 4,
// many cloud VMs): without them those fall back to the scalar loops, which
// convert one element at a time and run slower than torch's own casts.
#define MINDDP_AVX2 __attribute__((target("avx2,f16c")))

MINDDP_AVX2 inline float amax_avx2(const float* x, int64_t n) {
  const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.0f);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // |v| where finite, else 0 (inf and NaN compare false)
    __m256 v0 = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    __m256 v1 = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8));
    a0 = _mm256_max_ps(a0, _mm256_and_ps(v0, _mm256_cmp_ps(v0, inf, _CMP_LT_OQ)));
    a1 = _mm256_max_ps(a1, _mm256_and_ps(v1, _mm256_cmp_ps(v1, inf, _CMP_LT_OQ)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(a0, a1));
  return amax_scalar(x + i, n - i, amax_scalar(lanes, 8));
}

// bf16 bits of 8 floats, c10's rule as in bf16_rne above.
MINDDP_AVX2 inline __m128i bf16_rne_avx2(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb,
                                _mm256_set1_epi32(0x7FFF))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Narrow 32 -> 16 bits: packus works per 128-bit lane, the permute joins them.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

template <bool BF16>
MINDDP_AVX2 void pack_avx2(const float* x, int64_t n, float scale, uint16_t* out, bool stream) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
    __m128i h = BF16 ? bf16_rne_avx2(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    auto* o = reinterpret_cast<__m128i*>(out + i);
    stream ? _mm_stream_si128(o, h) : _mm_storeu_si128(o, h);
  }
  if (stream) _mm_sfence();
  pack_scalar<BF16>(x + i, n - i, scale, out + i);
}

template <bool BF16, bool ADD>
MINDDP_AVX2 void unpack_avx2(const uint16_t* p, int64_t n, float inv, float* dst, bool stream) {
  const __m256 s = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    __m256 v = BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                    : _mm256_cvtph_ps(h);
    v = _mm256_mul_ps(v, s);
    if (ADD) v = _mm256_add_ps(_mm256_loadu_ps(dst + i), v);
    stream ? _mm256_stream_ps(dst + i, v) : _mm256_storeu_ps(dst + i, v);
  }
  if (stream) _mm_sfence();
  unpack_scalar<BF16, ADD>(p + i, n - i, inv, dst + i);
}

// The int8 kernels, 8 lanes wide; AVX-512 CPUs run these too.
// |x| with NaN counted infinite, as int8_amax_of.
MINDDP_AVX2 inline float int8_amax_avx2(const float* x, int64_t n) {
  const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    a = _mm256_max_ps(a, _mm256_blendv_ps(v, inf, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  return int8_amax_scalar(x + i, n - i, int8_amax_scalar(lanes, 8));
}

// quantize_int8 eight at a time: NaN -> 0, clamp, round to nearest even, narrow.
MINDDP_AVX2 inline void int8_pack_avx2(const float* x, int64_t n, float scale, signed char* out) {
  const __m256 s = _mm256_set1_ps(scale), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
    v = _mm256_andnot_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), v);
    v = _mm256_round_ps(_mm256_min_ps(_mm256_max_ps(v, lo), hi),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i q = _mm256_cvtps_epi32(v);
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(w, w));
  }
  int8_pack_scalar(x + i, n - i, scale, out + i);
}

// A correctly rounded division, then the add: as the scalar loop and the reference.
template <bool ADD>
MINDDP_AVX2 void int8_unpack_avx2(const signed char* p, int64_t n, float scale, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i));
    __m256 v = _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
    if (ADD) v = _mm256_add_ps(_mm256_loadu_ps(dst + i), v);
    _mm256_storeu_ps(dst + i, v);
  }
  int8_unpack_scalar<ADD>(p + i, n - i, scale, dst + i);
}

template <bool DECODE>
MINDDP_AVX2 void int8_record_avx2(const signed char* p, int64_t n, float scale,
                                  const float* fed, float* error, float* out) {
  const __m256 s = _mm256_set1_ps(scale), sign = _mm256_set1_ps(-0.0f);
  const __m256 largest = _mm256_set1_ps(3.40282347e38f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i));
    __m256 v = _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
    __m256 d = _mm256_sub_ps(v, _mm256_loadu_ps(fed + i));
    __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, d), largest, _CMP_LE_OQ);
    _mm256_storeu_ps(error + i, _mm256_and_ps(d, finite));
    if (DECODE) _mm256_storeu_ps(out + i, v);
  }
  int8_record_scalar<DECODE>(p + i, n - i, scale, fed + i, error + i, out + i);
}
#endif

// The kernels to run: the widest instruction set this CPU has, or a narrower
// one named by MINDDP_CPU_ISA=scalar|avx2|avx512 (so tests can check every
// path on one machine; a wider one than the CPU has is ignored). Found once.
enum class Isa { kScalar, kAvx2, kAvx512 };
inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}
inline Isa cpu_isa() {
  static const Isa isa = [] {
    Isa best = Isa::kScalar;
#ifdef MINDDP_X86_SIMD
    if (__builtin_cpu_supports("avx512f")) best = Isa::kAvx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) best = Isa::kAvx2;
#endif
    const char* asked = std::getenv("MINDDP_CPU_ISA");
    for (Isa narrower : {Isa::kScalar, Isa::kAvx2}) {
      if (asked && narrower < best && std::strcmp(asked, isa_name(narrower)) == 0) return narrower;
    }
    return best;
  }();
  return isa;
}

}  // namespace minddp
