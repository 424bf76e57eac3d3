// Float32 helpers on 16 AVX-512 lanes shared by the CPU kernels (fused_ops.cpp, prefill_attention.cpp).
// Each gives the same bits wherever it is used: the kernels promise a row the same result alone and in
// any batch, and the fused ops and the attention read these in the same order. kernels/cpu_build.py
// hashes this header with every source, so a change here rebuilds them all.
#pragma once

#include <immintrin.h>

namespace tandem_simd {

// The 16 lanes summed in a fixed tree: halves, then quarters, then pairs.
inline float sum16(__m512 v) {
  // the upper half through a double-lane extract: AVX-512F alone (the float one needs DQ)
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// e^x, 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-5 polynomial, times 2^n from
// the exponent bits (the decode kernel's exp8, widened). x is clamped to [-87, 88] and e^x is 0 below
// -87 (where 2^n would leave float's normal range). For x <= 0 (a score less its row's maximum) the
// upper clamp changes nothing.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

}  // namespace tandem_simd
