// Fused CPU AdamW: scalar, AVX2 and AVX-512 kernels from one body (adamw_body.inc), chosen at
// run time; OpenMP over contiguous per-thread ranges processed in cache-sized chunks.
// Build with -O3 -fno-math-errno (else sqrt stays a libm call) -ffp-contract=off (FMAs only
// where written) -fopenmp. Nothing here needs a -m flag: each ISA's functions carry a target
// attribute, so the scalar path runs on any CPU.
#include "adamw.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#define DOS_X86 1
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define DOS_INLINE inline __attribute__((always_inline))

namespace dos {
namespace {

constexpr int64_t kAhead = 1024;  // software prefetch distance, elements (4 KB of fp32)

struct Consts {  // fp32 constants computed in double as torch does, then rounded once
  float scale, decay, w, w_m1, beta2, c2, bc2_sqrt, eps, neg_step;
  bool has_scale, has_wd, lerp_small;
};

Consts make_consts(const AdamwHyper& h) {
  const double step = double(float(h.step));  // torch reads state_step as a float
  const double bc1 = 1 - std::pow(h.beta1, step);
  const double bc2 = 1 - std::pow(h.beta2, step);
  Consts c;
  c.scale = float(h.grad_scale);
  c.has_scale = h.grad_scale != 1.0;
  c.decay = float(1 - h.lr * h.weight_decay);
  c.has_wd = h.weight_decay != 0.0;
  c.w = float(1 - h.beta1);
  c.w_m1 = c.w - 1.0f;
  c.lerp_small = std::abs(c.w) < 0.5f;
  c.beta2 = float(h.beta2);
  c.c2 = float(1 - h.beta2);
  c.bc2_sqrt = float(std::sqrt(bc2));
  c.eps = float(h.eps);
  c.neg_step = float(-(h.lr / bc1));
  return c;
}

size_t elem_size(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kNone ? 0 : 2;
}

DOS_INLINE uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
DOS_INLINE float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16).
DOS_INLINE uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  const uint32_t u = bits(f);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The split master (dos/split_master.py): fp32 <-> (bf16 rounded half away from zero, int16).
DOS_INLINE float split_join(uint16_t h, int16_t l) {
  return from_bits(((uint32_t(h) & 0x8000u) << 16) | uint32_t(int32_t((h & 0x7FFFu) << 16) + l));
}

DOS_INLINE void split_of(float f, uint16_t* h, int16_t* l) {
  const uint32_t u = bits(f), s = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) { *h = uint16_t(s | 0x7FC0u); *l = 0; return; }  // NaN: quiet, lo 0
  const uint32_t ha = (a + 0x8000u) >> 16;
  *h = uint16_t(s | ha);
  *l = int16_t(int32_t(a) - int32_t(ha << 16));
}

// IEEE fp16 <-> fp32 without F16C, as c10::Half (the FP16 library's bit tricks).
DOS_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return from_bits(sign | (two_w < (1u << 27) ? bits(denormalized) : bits(normalized)));
}

DOS_INLINE uint16_t f32_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Calls fn(grad dtype, out dtype) with both as std::integral_constant<int, DType>.
template <class Fn>
DOS_INLINE void dispatch(DType gd, DType od, Fn&& fn) {
  auto with_out = [&](auto g) {
    using C = std::integral_constant<int, int(DType::kF32)>;
    switch (od) {
      case DType::kF32: return fn(g, C{});
      case DType::kBF16: return fn(g, std::integral_constant<int, int(DType::kBF16)>{});
      case DType::kF16: return fn(g, std::integral_constant<int, int(DType::kF16)>{});
      case DType::kNone: return fn(g, std::integral_constant<int, int(DType::kNone)>{});
    }
  };
  switch (gd) {
    case DType::kBF16: return with_out(std::integral_constant<int, int(DType::kBF16)>{});
    case DType::kF16: return with_out(std::integral_constant<int, int(DType::kF16)>{});
    default: return with_out(std::integral_constant<int, int(DType::kF32)>{});
  }
}

}  // namespace

namespace scalar {
#define DOS_TGT
struct V {
  using F = float;
  static constexpr int W = 1;
  static DOS_INLINE F set1(float x) { return x; }
  static DOS_INLINE F load(const float* p) { return *p; }
  static DOS_INLINE void store(float* p, F x) { *p = x; }
  static DOS_INLINE F load_bf16(const uint16_t* p) { return from_bits(uint32_t(*p) << 16); }
  static DOS_INLINE void store_bf16(uint16_t* p, F x) { *p = f32_to_bf16(x); }
  static DOS_INLINE F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static DOS_INLINE void store_f16(uint16_t* p, F x) { *p = f32_to_f16(x); }
  static DOS_INLINE F load_split(const uint16_t* h, const int16_t* l) { return split_join(*h, *l); }
  static DOS_INLINE void store_split(uint16_t* h, int16_t* l, F x) { split_of(x, h, l); }
  // Pairs (lowp_body.inc): 2W consecutive values, here element 0 and element 1. Named by the
  // shared bodies; the scalar kernels never take them (one element at a time, the reference's order).
  static DOS_INLINE void load_f32_eo(const float* p, F& e, F& o) { e = p[0]; o = p[1]; }
  static DOS_INLINE void store_f32_eo(float* p, F e, F o) { p[0] = e; p[1] = o; }
  static DOS_INLINE void load_bf16_eo(const uint16_t* p, F& e, F& o) { e = load_bf16(p); o = load_bf16(p + 1); }
  static DOS_INLINE void store_bf16_eo(uint16_t* p, F e, F o) { store_bf16(p, e); store_bf16(p + 1, o); }
  static DOS_INLINE void load_split_eo(const uint16_t* h, const int16_t* l, F& e, F& o) {
    e = load_split(h, l);
    o = load_split(h + 1, l + 1);
  }
  static DOS_INLINE void store_split_eo(uint16_t* h, int16_t* l, F e, F o) {
    store_split(h, l, e);
    store_split(h + 1, l + 1, o);
  }
  static DOS_INLINE F add(F a, F b) { return a + b; }
  static DOS_INLINE F sub(F a, F b) { return a - b; }
  static DOS_INLINE F mul(F a, F b) { return a * b; }
  static DOS_INLINE F div(F a, F b) { return a / b; }
  static DOS_INLINE F sqrt(F a) { return std::sqrt(a); }
  // NOTE: unfused (as torch's scalar tail): a software fma would be ~50x slower without FMA.
  static DOS_INLINE F fma(F a, F b, F c) { return a * b + c; }
  // int8 state codes (lowp_body.inc). Arguments of rint are >= 0 (or NaN/inf): the 2^23 trick
  // rounds half to even there without libm; max(NaN, 0) is 0, as MAXPS with 0 second.
  static DOS_INLINE F abs(F a) { return std::fabs(a); }
  static DOS_INLINE F max0(F a) { return a > 0.0f ? a : 0.0f; }
  static DOS_INLINE F min(F a, F b) { return a < b ? a : b; }
  static DOS_INLINE F rint(F a) { return (a + 0x1p23f) - 0x1p23f; }
  static DOS_INLINE F copysign(F mag, F sgn) { return from_bits(bits(mag) | (bits(sgn) & 0x80000000u)); }
  static DOS_INLINE F load_i8(const int8_t* p) { return float(*p); }
  static DOS_INLINE F load_u8(const uint8_t* p) { return float(*p); }
  static DOS_INLINE void store_i8(int8_t* p, F x) { *p = int8_t(int(x)); }
  static DOS_INLINE void store_u8(uint8_t* p, F x) { *p = uint8_t(int(x)); }
  using I = uint32_t;  // running max of |x|'s bits: NaN > inf > finite, so NaN is never lost
  static DOS_INLINE I izero() { return 0; }
  static DOS_INLINE I imax_abs(I acc, F x) { const uint32_t b = bits(x) & 0x7FFFFFFFu; return b > acc ? b : acc; }
  static DOS_INLINE uint32_t ireduce(I acc) { return acc; }
};
#include "adamw_body.inc"
#include "lowp_body.inc"
#undef DOS_TGT
}  // namespace scalar

#ifdef DOS_X86
namespace avx2 {
#define DOS_TGT __attribute__((target("avx2,fma,f16c")))
struct V {
  using F = __m256;
  static constexpr int W = 8;
  DOS_TGT static DOS_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  DOS_TGT static DOS_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  DOS_TGT static DOS_INLINE void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  DOS_TGT static DOS_INLINE F load_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  // bf16 bits of x (round to nearest even, NaN -> 0x7FC0) in the low half of each 32-bit lane
  DOS_TGT static DOS_INLINE __m256i bf16_bits(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
  }
  DOS_TGT static DOS_INLINE void store_bf16(uint16_t* p, F x) {
    const __m256i r = bf16_bits(x);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  DOS_TGT static DOS_INLINE F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // The split master from `top` (the hi bits in the top half of each lane; the low half is
  // ignored) and `lv` (lo, sign-extended): as split_join.
  DOS_TGT static DOS_INLINE F join_top(__m256i top, __m256i lv) {
    const __m256i s = _mm256_and_si256(top, _mm256_set1_epi32(int(0x80000000u)));
    const __m256i a = _mm256_add_epi32(_mm256_and_si256(top, _mm256_set1_epi32(0x7FFF0000)), lv);
    return _mm256_castsi256_ps(_mm256_or_si256(s, a));
  }
  DOS_TGT static DOS_INLINE F load_split(const uint16_t* h, const int16_t* l) {
    const __m256i hv = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    const __m256i lv = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l)));
    return join_top(_mm256_slli_epi32(hv, 16), lv);
  }
  // As split_of: hv = the hi bits (low half of each lane), lv = lo (sign-extended, 0 for NaN).
  DOS_TGT static DOS_INLINE void split_bits(F x, __m256i& hv, __m256i& lv) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i s = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000));
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i ha = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x8000)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    hv = _mm256_blendv_epi8(_mm256_or_si256(s, ha), _mm256_or_si256(s, _mm256_set1_epi32(0x7FC0)), nan);
    lv = _mm256_andnot_si256(nan, _mm256_sub_epi32(a, _mm256_slli_epi32(ha, 16)));
  }
  DOS_TGT static DOS_INLINE void store_split(uint16_t* h, int16_t* l, F x) {
    __m256i hv, lv;
    split_bits(x, hv, lv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h),
                     _mm_packus_epi32(_mm256_castsi256_si128(hv), _mm256_extracti128_si256(hv, 1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l),
                     _mm_packs_epi32(_mm256_castsi256_si128(lv), _mm256_extracti128_si256(lv, 1)));
  }
  // Pairs (lowp_body.inc): 2W consecutive 16-bit values, even elements in `e` and odd ones in
  // `o`, by shifts and masks within 32-bit lanes: no widening or narrowing shuffles.
  // fp32 pairs: 2W floats as the even elements in order in `e` and the odd ones in `o` (the
  // lane order of the 16-bit pairs), two shuffles each way
  DOS_TGT static DOS_INLINE void load_f32_eo(const float* p, F& e, F& o) {
    const F a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    e = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), _MM_SHUFFLE(3, 1, 2, 0)));
    o = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  DOS_TGT static DOS_INLINE void store_f32_eo(float* p, F e, F o) {
    const F lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
  DOS_TGT static DOS_INLINE void load_bf16_eo(const uint16_t* p, F& e, F& o) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    e = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    o = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  DOS_TGT static DOS_INLINE void store_bf16_eo(uint16_t* p, F e, F o) {
    // as the AVX-512 one: even elements' bits end in the low halves, odd ones' in the top halves
    const __m256i ue = _mm256_castps_si256(e), uo = _mm256_castps_si256(o), one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(0x7FFF);
    __m256i re = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(ue, bias), _mm256_and_si256(_mm256_srli_epi32(ue, 16), one)), 16);
    __m256i ro = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(uo, bias), _mm256_and_si256(_mm256_srli_epi32(uo, 16), one)),
        _mm256_set1_epi32(int(0xFFFF0000u)));
    const __m256 ne = _mm256_cmp_ps(e, e, _CMP_UNORD_Q), no = _mm256_cmp_ps(o, o, _CMP_UNORD_Q);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_or_ps(ne, no)) != 0, 0)) {  // NaN -> 0x7FC0
      re = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(re), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), ne));
      ro = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ro), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), no));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(re, ro));
  }
  DOS_TGT static DOS_INLINE void load_split_eo(const uint16_t* h, const int16_t* l, F& e, F& o) {
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    const __m256i lv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
    e = join_top(_mm256_slli_epi32(hv, 16), _mm256_srai_epi32(_mm256_slli_epi32(lv, 16), 16));
    o = join_top(hv, _mm256_srai_epi32(lv, 16));
  }
  // split_of in place, as the AVX-512 one
  DOS_TGT static DOS_INLINE void store_split_eo(uint16_t* h, int16_t* l, F e, F o) {
    const __m256i ue = _mm256_castps_si256(e), uo = _mm256_castps_si256(o);
    const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i half = _mm256_set1_epi32(0x8000);
    const __m256i ne = _mm256_cmpgt_epi32(_mm256_and_si256(ue, mag), inf);
    const __m256i no = _mm256_cmpgt_epi32(_mm256_and_si256(uo, mag), inf);
    __m256i he = _mm256_srli_epi32(_mm256_add_epi32(ue, half), 16);
    __m256i ho = _mm256_and_si256(_mm256_add_epi32(uo, half), _mm256_set1_epi32(int(0xFFFF0000u)));
    if (__builtin_expect(!_mm256_testz_si256(_mm256_or_si256(ne, no), _mm256_or_si256(ne, no)), 0)) {
      const __m256i q = _mm256_set1_epi32(0x7FC0);
      he = _mm256_blendv_epi8(he, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(ue, 16), half), q), ne);
      ho = _mm256_blendv_epi8(ho, _mm256_slli_epi32(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(uo, 16), half), q), 16), no);
    }
    const __m256i le = _mm256_andnot_si256(ne, _mm256_and_si256(ue, _mm256_set1_epi32(0xFFFF)));
    const __m256i lo = _mm256_andnot_si256(no, _mm256_slli_epi32(uo, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), _mm256_or_si256(he, ho));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l), _mm256_or_si256(le, lo));
  }
  DOS_TGT static DOS_INLINE void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  DOS_TGT static DOS_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  DOS_TGT static DOS_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  DOS_TGT static DOS_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  DOS_TGT static DOS_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  DOS_TGT static DOS_INLINE F sqrt(F a) { return _mm256_sqrt_ps(a); }
  DOS_TGT static DOS_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  DOS_TGT static DOS_INLINE F abs(F a) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7FFFFFFF)));
  }
  DOS_TGT static DOS_INLINE F max0(F a) { return _mm256_max_ps(a, _mm256_setzero_ps()); }
  DOS_TGT static DOS_INLINE F min(F a, F b) { return _mm256_min_ps(a, b); }
  DOS_TGT static DOS_INLINE F rint(F a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  DOS_TGT static DOS_INLINE F copysign(F mag, F sgn) {
    return _mm256_or_ps(mag, _mm256_and_ps(sgn, _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)))));
  }
  DOS_TGT static DOS_INLINE F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  DOS_TGT static DOS_INLINE F load_u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  DOS_TGT static DOS_INLINE void store_i8(int8_t* p, F x) {
    const __m256i i = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  DOS_TGT static DOS_INLINE void store_u8(uint8_t* p, F x) {
    const __m256i i = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  using I = __m256i;
  DOS_TGT static DOS_INLINE I izero() { return _mm256_setzero_si256(); }
  DOS_TGT static DOS_INLINE I imax_abs(I acc, F x) {
    return _mm256_max_epi32(acc, _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF)));
  }
  DOS_TGT static DOS_INLINE uint32_t ireduce(I acc) {
    alignas(32) uint32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), acc);
    uint32_t r = 0;
    for (uint32_t x : t) r = x > r ? x : r;
    return r;
  }
};
#include "adamw_body.inc"
#include "lowp_body.inc"
#undef DOS_TGT
}  // namespace avx2

namespace avx512 {
#define DOS_TGT __attribute__((target("avx512f,avx2,fma,f16c")))
struct V {
  using F = __m512;
  static constexpr int W = 16;
  DOS_TGT static DOS_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  DOS_TGT static DOS_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  DOS_TGT static DOS_INLINE void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  DOS_TGT static DOS_INLINE F load_bf16(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  // bf16 bits of x (round to nearest even, NaN -> 0x7FC0) in the low half of each 32-bit lane
  DOS_TGT static DOS_INLINE __m512i bf16_bits(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  }
  DOS_TGT static DOS_INLINE void store_bf16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
  DOS_TGT static DOS_INLINE F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // The split master from `top` (the hi bits in the top half of each lane; the low half is
  // ignored) and `lv` (lo, sign-extended): as split_join.
  DOS_TGT static DOS_INLINE F join_top(__m512i top, __m512i lv) {
    const __m512i s = _mm512_and_si512(top, _mm512_set1_epi32(int(0x80000000u)));
    const __m512i a = _mm512_add_epi32(_mm512_and_si512(top, _mm512_set1_epi32(0x7FFF0000)), lv);
    return _mm512_castsi512_ps(_mm512_or_si512(s, a));
  }
  DOS_TGT static DOS_INLINE F load_split(const uint16_t* h, const int16_t* l) {
    const __m512i hv = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    const __m512i lv = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(l)));
    return join_top(_mm512_slli_epi32(hv, 16), lv);
  }
  // As split_of: hv = the hi bits (low half of each lane), lv = lo (sign-extended, 0 for NaN).
  DOS_TGT static DOS_INLINE void split_bits(F x, __m512i& hv, __m512i& lv) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i s = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000));
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i ha = _mm512_srli_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x8000)), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000));
    hv = _mm512_mask_blend_epi32(nan, _mm512_or_si512(s, ha), _mm512_or_si512(s, _mm512_set1_epi32(0x7FC0)));
    lv = _mm512_maskz_mov_epi32(_mm512_knot(nan), _mm512_sub_epi32(a, _mm512_slli_epi32(ha, 16)));
  }
  DOS_TGT static DOS_INLINE void store_split(uint16_t* h, int16_t* l, F x) {
    __m512i hv, lv;
    split_bits(x, hv, lv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtepi32_epi16(hv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l), _mm512_cvtepi32_epi16(lv));
  }
  // Pairs (lowp_body.inc): 2W consecutive 16-bit values, even elements in `e` and odd ones in
  // `o`, by shifts and masks within 32-bit lanes: no widening or narrowing shuffles (VPMOVZXWD,
  // VPMOVDW: the shuffle port's work, five of them per 16 elements for the split master's four
  // streams and the gradient; docs/DESIGN.md §3.7).
  // fp32 pairs: 2W floats as the even elements in order in `e` and the odd ones in `o` (the
  // lane order of the 16-bit pairs), one two-source permute per vector each way
  DOS_TGT static DOS_INLINE void load_f32_eo(const float* p, F& e, F& o) {
    const F a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    e = _mm512_permutex2var_ps(a, ev, b);
    o = _mm512_permutex2var_ps(a, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), b);
  }
  DOS_TGT static DOS_INLINE void store_f32_eo(float* p, F e, F o) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_ps(p, _mm512_permutex2var_ps(e, lo, o));
    _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(e, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), o));
  }
  DOS_TGT static DOS_INLINE void load_bf16_eo(const uint16_t* p, F& e, F& o) {
    const __m512i u = _mm512_loadu_si512(p);
    e = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    o = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  DOS_TGT static DOS_INLINE void store_bf16_eo(uint16_t* p, F e, F o) {
    // round to nearest even in place: the bf16 bits of the even elements end in the low halves
    // (>> 16), those of the odd ones in the top halves (mask)
    const __m512i ue = _mm512_castps_si512(e), uo = _mm512_castps_si512(o), one = _mm512_set1_epi32(1);
    const __m512i bias = _mm512_set1_epi32(0x7FFF);
    __m512i re = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(ue, bias), _mm512_and_si512(_mm512_srli_epi32(ue, 16), one)), 16);
    __m512i ro = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(uo, bias), _mm512_and_si512(_mm512_srli_epi32(uo, 16), one)),
        _mm512_set1_epi32(int(0xFFFF0000u)));
    const __mmask16 ne = _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q), no = _mm512_cmp_ps_mask(o, o, _CMP_UNORD_Q);
    if (__builtin_expect((ne | no) != 0, 0)) {  // NaN -> 0x7FC0
      re = _mm512_mask_mov_epi32(re, ne, _mm512_set1_epi32(0x7FC0));
      ro = _mm512_mask_mov_epi32(ro, no, _mm512_set1_epi32(0x7FC00000));
    }
    _mm512_storeu_si512(p, _mm512_or_si512(re, ro));
  }
  DOS_TGT static DOS_INLINE void load_split_eo(const uint16_t* h, const int16_t* l, F& e, F& o) {
    const __m512i hv = _mm512_loadu_si512(h), lv = _mm512_loadu_si512(l);
    e = join_top(_mm512_slli_epi32(hv, 16), _mm512_srai_epi32(_mm512_slli_epi32(lv, 16), 16));
    o = join_top(hv, _mm512_srai_epi32(lv, 16));
  }
  // split_of in place: hi = (u + 0x8000) >> 16 rounds |x| half away from zero (the carry never
  // reaches the sign bit: |x| <= inf), and lo is the low 16 bits of u (a - (ha << 16) has them and
  // fits an int16); a NaN gives sign | 0x7FC0 and 0.
  DOS_TGT static DOS_INLINE void store_split_eo(uint16_t* h, int16_t* l, F e, F o) {
    const __m512i ue = _mm512_castps_si512(e), uo = _mm512_castps_si512(o);
    const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i half = _mm512_set1_epi32(0x8000);
    const __mmask16 ne = _mm512_cmpgt_epi32_mask(_mm512_and_si512(ue, mag), inf);
    const __mmask16 no = _mm512_cmpgt_epi32_mask(_mm512_and_si512(uo, mag), inf);
    __m512i he = _mm512_srli_epi32(_mm512_add_epi32(ue, half), 16);
    __m512i ho = _mm512_and_si512(_mm512_add_epi32(uo, half), _mm512_set1_epi32(int(0xFFFF0000u)));
    if (__builtin_expect((ne | no) != 0, 0)) {
      const __m512i q = _mm512_set1_epi32(0x7FC0);
      he = _mm512_mask_mov_epi32(he, ne, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(ue, 16), half), q));
      ho = _mm512_mask_mov_epi32(ho, no, _mm512_slli_epi32(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(uo, 16), half), q), 16));
    }
    const __m512i le = _mm512_maskz_and_epi32(_mm512_knot(ne), ue, _mm512_set1_epi32(0xFFFF));
    const __m512i lo = _mm512_maskz_slli_epi32(_mm512_knot(no), uo, 16);
    _mm512_storeu_si512(h, _mm512_or_si512(he, ho));
    _mm512_storeu_si512(l, _mm512_or_si512(le, lo));
  }
  DOS_TGT static DOS_INLINE void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  DOS_TGT static DOS_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  DOS_TGT static DOS_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  DOS_TGT static DOS_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  DOS_TGT static DOS_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  DOS_TGT static DOS_INLINE F sqrt(F a) { return _mm512_sqrt_ps(a); }
  DOS_TGT static DOS_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  DOS_TGT static DOS_INLINE F abs(F a) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  DOS_TGT static DOS_INLINE F max0(F a) { return _mm512_max_ps(a, _mm512_setzero_ps()); }
  DOS_TGT static DOS_INLINE F min(F a, F b) { return _mm512_min_ps(a, b); }
  DOS_TGT static DOS_INLINE F rint(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  DOS_TGT static DOS_INLINE F copysign(F mag, F sgn) {
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(sgn), _mm512_set1_epi32(int(0x80000000u)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
  }
  DOS_TGT static DOS_INLINE F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  DOS_TGT static DOS_INLINE F load_u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  DOS_TGT static DOS_INLINE void store_i8(int8_t* p, F x) {  // codes are in range: truncation
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
  }
  DOS_TGT static DOS_INLINE void store_u8(uint8_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
  }
  using I = __m512i;
  DOS_TGT static DOS_INLINE I izero() { return _mm512_setzero_si512(); }
  DOS_TGT static DOS_INLINE I imax_abs(I acc, F x) {
    return _mm512_max_epi32(acc, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  DOS_TGT static DOS_INLINE uint32_t ireduce(I acc) { return uint32_t(_mm512_reduce_max_epi32(acc)); }
};
#include "adamw_body.inc"
#include "lowp_body.inc"
#undef DOS_TGT
}  // namespace avx512
#endif  // DOS_X86

bool isa_supported(Isa isa) {
#ifdef DOS_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
  if (isa == Isa::kAvx512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return isa == Isa::kScalar;
}

namespace {
using RunFn = void (*)(const Consts&, const AdamwArrays&, int64_t, int64_t);

RunFn pick(Isa isa) {
#ifdef DOS_X86
  if (isa == Isa::kAvx512) return &avx512::run;
  if (isa == Isa::kAvx2) return &avx2::run;
#endif
  return &scalar::run;
}

constexpr int64_t kBlock = 64;            // work ranges start on 64-element boundaries
constexpr int64_t kChunk = 1 << 14;       // elements per call: ~230 KB of state and gradient
constexpr int64_t kMinPerThread = 1 << 15;

void run_range(RunFn fn, const Consts& c, const AdamwArrays& a, int64_t lo, int64_t hi) {
  for (int64_t s = lo; s < hi; s += kChunk) fn(c, a, s, std::min(hi, s + kChunk));
}

std::atomic<bool> g_fixed_ranges{false};
}  // namespace

void set_fixed_ranges(bool fixed) { g_fixed_ranges.store(fixed); }
bool fixed_ranges() { return g_fixed_ranges.load(); }

void adamw(const AdamwArrays& a, const AdamwHyper& h, int threads, Isa isa) {
  if (a.n <= 0) return;
  const Consts c = make_consts(h);
  const RunFn fn = pick(isa);
  const int64_t most = (a.n + kMinPerThread - 1) / kMinPerThread;
  const int t = int(std::max<int64_t>(1, std::min<int64_t>(threads, most)));
  if (t == 1) return run_range(fn, c, a, 0, a.n);
  if (fixed_ranges()) {
    const int64_t blocks = (a.n + kBlock - 1) / kBlock;
#pragma omp parallel num_threads(t)
    {
#ifdef _OPENMP
      const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
      const int64_t id = 0, nt = 1;
#endif
      run_range(fn, c, a, std::min(a.n, blocks * id / nt * kBlock), std::min(a.n, blocks * (id + 1) / nt * kBlock));
    }
    return;
  }
  // Chunks handed out dynamically, not one fixed range per thread: the lane shares the host's
  // cores with the training loop's own threads (Python, CUDA launches and copies, NVML), and with
  // fixed ranges one preempted thread held up the whole subgroup (docs/DESIGN.md §10). Every
  // element's update is independent, so the result is the same bitwise.
  const int64_t chunks = (a.n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
  for (int64_t i = 0; i < chunks; ++i) fn(c, a, i * kChunk, std::min(a.n, (i + 1) * kChunk));
}

namespace {
using LowpFn = void (*)(const Consts&, const LowpArrays&, int64_t, int64_t);

LowpFn pick_lowp(Isa isa, StateFmt fmt) {
  const bool q = fmt == StateFmt::kInt8;
#ifdef DOS_X86
  const bool sp = fmt == StateFmt::kBF16Split;
  if (isa == Isa::kAvx512) return q ? &avx512::run_int8 : sp ? &avx512::run_split : &avx512::run_bf16;
  if (isa == Isa::kAvx2) return q ? &avx2::run_int8 : sp ? &avx2::run_split : &avx2::run_bf16;
#endif
  return q ? &scalar::run_int8 : sp ? &scalar::run_split : &scalar::run_bf16;
}
}  // namespace

void adamw_lowp(const LowpArrays& a, StateFmt fmt, const AdamwHyper& h, int threads, Isa isa) {
  if (a.hi <= a.lo) return;
  const Consts c = make_consts(h);
  const LowpFn fn = pick_lowp(isa, fmt);
  const bool q = fmt == StateFmt::kInt8;
  // work units: whole int8 blocks (threads never share one), else 64-element groups of [lo, hi)
  const int64_t unit = q ? kQuantBlock : kBlock;
  const int64_t u_lo = q ? a.lo / unit : 0;
  const int64_t u_hi = q ? (a.hi + unit - 1) / unit : (a.hi - a.lo + unit - 1) / unit;
  const int64_t most = ((u_hi - u_lo) * unit + kMinPerThread - 1) / kMinPerThread;
  const int t = int(std::max<int64_t>(1, std::min<int64_t>(threads, most)));
  auto run = [&](int64_t b, int64_t e) {  // work units [b, e)
    if (b >= e) return;
    if (q) return fn(c, a, b, e);
    fn(c, a, a.lo + b * unit, std::min(a.hi, a.lo + e * unit));
  };
  if (t == 1) return run(u_lo, u_hi);
  if (fixed_ranges()) {
#pragma omp parallel num_threads(t)
    {
#ifdef _OPENMP
      const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
      const int64_t id = 0, nt = 1;
#endif
      run(u_lo + (u_hi - u_lo) * id / nt, u_lo + (u_hi - u_lo) * (id + 1) / nt);
    }
    return;
  }
  // Dynamic chunks of whole units, as in adamw() above (one preempted thread no longer holds up
  // the subgroup); chunks never split a unit, so the result is the same bitwise.
  const int64_t per = std::max<int64_t>(1, kChunk / unit);
  const int64_t chunks = (u_hi - u_lo + per - 1) / per;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
  for (int64_t i = 0; i < chunks; ++i) run(u_lo + i * per, std::min(u_hi, u_lo + (i + 1) * per));
}

}  // namespace dos
