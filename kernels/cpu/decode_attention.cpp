// Decode attention on an AVX2 (or AVX-512) CPU, read straight from the paged KV pool: one query row per sequence
// (H heads, Hkv KV heads, G = H / Hkv queries per KV head) over that sequence's cached past and its
// own new key/value, in float32. The compiled decode step calls it once per layer in place of the
// gather and the written-out softmax inductor would generate (shared/engine/compiled/step.py).
//
// Work item: one (sequence, KV head), in sequence-major order where every thread gets several
// sequences, else head-major. Its keys are read once for all G queries of the group: the scores of
// every valid past position and of the step's own token (two keys interleaved), then an exact max, the
// exponentials 8 lanes at a time (exp8) and their sum, then the values weighted by those probabilities
// (with AVX-512, a value row read once for the group's queries, all D outputs of each held in
// registers over all positions), divided by the sum at the end. The keys and values of positions
// ahead are prefetched into L2: the pool's rows are scattered over memory, and waiting for one miss at
// a time took half the time. Every item runs the same instructions in the same order whatever the
// batch, the order of the items and whatever the longest sequence (masked positions are skipped, not
// multiplied by zero), so a sequence gets the same bits alone and in any batch; the AVX-512 and AVX2
// builds give the same bits too (built with -ffp-contract=off: the only fused multiply-adds are the
// explicit ones, lane for lane the same).
//
// Inputs: q [B, H, D] float32; k, v [B, Hkv, D] float32 (the step's own K/V, already rounded to the
// pool's dtype); kv_cache [num_blocks, layers, 2, block_size, Hkv, D] float32, bfloat16 or float16;
// past_blocks [B * nblk] int64 (row b's block table); past_valid [B, nblk * block_size] bool (the past
// positions a row has); step_src [B, nblk * block_size] int64: -1, or the row of this step whose new
// K/V holds that position (a speculative entry's earlier tokens). D must be a multiple of 8.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kAhead = 16;  // positions whose K and V are requested ahead of their scores

// 8 float lanes summed in a fixed order
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// e^x for x <= 0 (a score less the row's maximum), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' degree-5 polynomial, times 2^n from the exponent bits; within 2 ulp of std::exp, and e^x is
// 0 below -87 (where 2^n would leave float's normal range). The scalar std::exp it replaces took a
// third of the kernel's time.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The scaled scores of one key for GN (at most 4) queries D apart, the key read once: each query's sum
// in chunk order over 8 lanes, the lanes added in hsum's order; score g goes to out[g * stride]. GN is
// a template argument so that the accumulators stay in registers (with a run-time count the compiler
// kept them on the stack, and every multiply-add waited on a store and a load).
template <int GN, typename T>
inline void scores_of(const float* q, const T* k, int64_t D, float scale, float* out, int64_t stride) {
  __m256 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 kc = load8(k + c);
    for (int g = 0; g < GN; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kc, acc[g]);
  }
  for (int g = 0; g < GN; ++g) out[g * stride] = hsum(acc[g]) * scale;
}

template <typename T>
inline void scores_of(const float* q, const T* k, int64_t D, int64_t gn, float scale, float* out, int64_t stride) {
  switch (gn) {
    case 1: scores_of<1>(q, k, D, scale, out, stride); break;
    case 2: scores_of<2>(q, k, D, scale, out, stride); break;
    case 3: scores_of<3>(q, k, D, scale, out, stride); break;
    default: scores_of<4>(q, k, D, scale, out, stride); break;
  }
}

// The same for two keys at once (their scores to out[g * stride] and out[g * stride + 1]): each score's
// operations are those of scores_of, in the same order, so the same bits; interleaved, the two keys'
// chains of multiply-adds and their sums across lanes overlap instead of waiting on each other.
template <int GN, typename T, int64_t FixedD = 0>
inline void scores_of2(const float* q, const T* k0, const T* k1, int64_t D, float scale, float* out, int64_t stride) {
  if (FixedD) D = FixedD;  // known at compile time: the loop over the chunks unrolled
  __m256 acc0[GN], acc1[GN];
  for (int g = 0; g < GN; ++g) acc0[g] = acc1[g] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 kc0 = load8(k0 + c), kc1 = load8(k1 + c);
    for (int g = 0; g < GN; ++g) {
      const __m256 qc = _mm256_loadu_ps(q + g * D + c);
      acc0[g] = _mm256_fmadd_ps(qc, kc0, acc0[g]);
      acc1[g] = _mm256_fmadd_ps(qc, kc1, acc1[g]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    out[g * stride] = hsum(acc0[g]) * scale;
    out[g * stride + 1] = hsum(acc1[g]) * scale;
  }
}

template <typename T>
inline void scores_of2(const float* q, const T* k0, const T* k1, int64_t D, int64_t gn, float scale, float* out,
                       int64_t stride) {
  if (D == 64) {  // SmolLM2's and most small models' heads
    switch (gn) {
      case 1: scores_of2<1, T, 64>(q, k0, k1, D, scale, out, stride); return;
      case 2: scores_of2<2, T, 64>(q, k0, k1, D, scale, out, stride); return;
      case 3: scores_of2<3, T, 64>(q, k0, k1, D, scale, out, stride); return;
      default: scores_of2<4, T, 64>(q, k0, k1, D, scale, out, stride); return;
    }
  }
  switch (gn) {
    case 1: scores_of2<1>(q, k0, k1, D, scale, out, stride); break;
    case 2: scores_of2<2>(q, k0, k1, D, scale, out, stride); break;
    case 3: scores_of2<3>(q, k0, k1, D, scale, out, stride); break;
    default: scores_of2<4>(q, k0, k1, D, scale, out, stride); break;
  }
}

// s[0 .. n) := e^(s_j - max s), in place; returns their sum. The exponentials 8 at a time, summed in 8
// lanes then across them in hsum's order; a tail of fewer than 8 goes through the same exp8 in a padded
// vector, its sums after the lanes'.
inline float softmax_in_place(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 lanes = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top8));
    _mm256_storeu_ps(s + j, e);
    lanes = _mm256_add_ps(lanes, e);
  }
  float sum = hsum(lanes);
  if (j < n) {
    alignas(32) float tail[8];
    for (int64_t t = 0; t < 8; ++t) tail[t] = j + t < n ? s[j + t] - top : 0.f;
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t t = 0; j + t < n; ++t) {
      s[j + t] = tail[t];
      sum += tail[t];
    }
  }
  return sum;
}

// o[c0 .. c0 + 8 CN) = sum over positions j in order of p_j v_j[c0 ..], times inv: CN accumulators of 8
// lanes, held in registers over all positions
template <int CN, typename T>
inline void weighted_sum(const float* p, const std::vector<const void*>& values, const std::vector<char>& own,
                         int64_t n, int64_t c0, __m256 inv, float* o) {
  __m256 acc[CN];
  for (int u = 0; u < CN; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pv = _mm256_set1_ps(p[j]);
    if (own[j]) {
      const float* vj = static_cast<const float*>(values[j]) + c0;
      for (int u = 0; u < CN; ++u) acc[u] = _mm256_fmadd_ps(pv, load8(vj + 8 * u), acc[u]);
    } else {
      const T* vj = static_cast<const T*>(values[j]) + c0;
      for (int u = 0; u < CN; ++u) acc[u] = _mm256_fmadd_ps(pv, load8(vj + 8 * u), acc[u]);
    }
  }
  for (int u = 0; u < CN; ++u) _mm256_storeu_ps(o + c0 + 8 * u, _mm256_mul_ps(acc[u], inv));
}

// One query's output o[0 .. D) in passes of up to 64 values (8 accumulators, half of AVX2's registers)
template <typename T>
inline void weighted_sum(const float* p, const std::vector<const void*>& values, const std::vector<char>& own,
                         int64_t n, int64_t D, float inv, float* o) {
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    switch (std::min<int64_t>(8, (D - c0) / 8)) {
      case 1: weighted_sum<1, T>(p, values, own, n, c0, inv8, o); break;
      case 2: weighted_sum<2, T>(p, values, own, n, c0, inv8, o); break;
      case 3: weighted_sum<3, T>(p, values, own, n, c0, inv8, o); break;
      case 4: weighted_sum<4, T>(p, values, own, n, c0, inv8, o); break;
      case 5: weighted_sum<5, T>(p, values, own, n, c0, inv8, o); break;
      case 6: weighted_sum<6, T>(p, values, own, n, c0, inv8, o); break;
      case 7: weighted_sum<7, T>(p, values, own, n, c0, inv8, o); break;
      default: weighted_sum<8, T>(p, values, own, n, c0, inv8, o); break;
    }
  }
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The outputs of GN queries at once, o_g[c] = sum over j in order of p_gj v_j[c], times inv_g, all D =
// 16 CN values of each held in registers over all positions: each value row is read (and converted)
// once for the group, and GN * CN independent accumulators hide the multiply-add's latency that a
// query's 4 or 8 chains waited on. Lane for lane the same operations as the 8-lane loops above, so
// the same bits.
template <int GN, int CN, typename T>
inline void weighted_sums16(const float* p, int64_t n, const std::vector<const void*>& values,
                            const std::vector<char>& own, const float* inv, float* o, int64_t D) {
  __m512 acc[GN][CN];
  for (int g = 0; g < GN; ++g)
    for (int u = 0; u < CN; ++u) acc[g][u] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[CN];
    if (own[j]) {
      for (int u = 0; u < CN; ++u) vv[u] = load16(static_cast<const float*>(values[j]) + 16 * u);
    } else {
      for (int u = 0; u < CN; ++u) vv[u] = load16(static_cast<const T*>(values[j]) + 16 * u);
    }
    for (int g = 0; g < GN; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * n + j]);
      for (int u = 0; u < CN; ++u) acc[g][u] = _mm512_fmadd_ps(pv, vv[u], acc[g][u]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int u = 0; u < CN; ++u) _mm512_storeu_ps(o + g * D + 16 * u, _mm512_mul_ps(acc[g][u], _mm512_set1_ps(inv[g])));
}

template <int GN, typename T>
inline bool weighted_sums16(const float* p, int64_t n, const std::vector<const void*>& values,
                            const std::vector<char>& own, const float* inv, float* o, int64_t D) {
  switch (D) {
    case 16: weighted_sums16<GN, 1, T>(p, n, values, own, inv, o, D); return true;
    case 32: weighted_sums16<GN, 2, T>(p, n, values, own, inv, o, D); return true;
    case 48: weighted_sums16<GN, 3, T>(p, n, values, own, inv, o, D); return true;
    case 64: weighted_sums16<GN, 4, T>(p, n, values, own, inv, o, D); return true;
    default: return false;
  }
}
#endif

// The outputs of queries g0 .. g0 + gn (gn at most 4) of a group: o_g = sum over j of p_gj v_j / sum_g
template <typename T>
inline void weighted_sums(const float* p, int64_t n, const std::vector<const void*>& values,
                          const std::vector<char>& own, const float* inv, float* o, int64_t D, int64_t gn) {
#ifdef __AVX512F__
  bool done = false;
  switch (gn) {
    case 1: done = weighted_sums16<1, T>(p, n, values, own, inv, o, D); break;
    case 2: done = weighted_sums16<2, T>(p, n, values, own, inv, o, D); break;
    case 3: done = weighted_sums16<3, T>(p, n, values, own, inv, o, D); break;
    default: done = weighted_sums16<4, T>(p, n, values, own, inv, o, D); break;
  }
  if (done) return;
#endif
  for (int64_t g = 0; g < gn; ++g) weighted_sum<T>(p + g * n, values, own, n, D, inv[g], o + g * D);
}

// One sequence's positions in order (its valid past, then its own token): byte pointers to the start
// of each position's K and V rows (all KV heads), and whether the row is a float32 row of this step.
struct Positions {
  std::vector<const char*> keys, values;
  std::vector<char> own;
};

template <typename T>
void positions_of(int64_t b, const T* cp, const float* kp, const float* vp, const int64_t* bp, const bool* mp,
                  const int64_t* sp, int64_t L, int64_t bs, int64_t nblk, int64_t layers, int64_t layer, int64_t row,
                  Positions& out) {
  const int64_t half = bs * row;  // a block's K (or V) of one layer
  out.keys.clear(); out.values.clear(); out.own.clear();
  for (int64_t l = 0; l < L; ++l) {
    if (!mp[b * L + l]) continue;
    const int64_t r = sp[b * L + l];
    if (r >= 0) {
      out.keys.push_back(reinterpret_cast<const char*>(kp + r * row));
      out.values.push_back(reinterpret_cast<const char*>(vp + r * row));
      out.own.push_back(1);
    } else {
      const T* base = cp + (bp[b * nblk + l / bs] * layers + layer) * 2 * half + (l % bs) * row;
      out.keys.push_back(reinterpret_cast<const char*>(base));
      out.values.push_back(reinterpret_cast<const char*>(base + half));
      out.own.push_back(0);
    }
  }
  out.keys.push_back(reinterpret_cast<const char*>(kp + b * row));
  out.values.push_back(reinterpret_cast<const char*>(vp + b * row));
  out.own.push_back(1);
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache, int64_t layer,
            const at::Tensor& blocks, const at::Tensor& valid, const at::Tensor& src, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), G = H / Hkv;
  const int64_t L = valid.size(1), bs = cache.size(3), nblk = L / bs, layers = cache.size(1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const T* cp = cache.data_ptr<T>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const bool* mp = valid.data_ptr<bool>();
  const int64_t* sp = src.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = Hkv * D;        // one position's K (or V) in a block
  // Items in sequence-major order where every thread gets several sequences (a sequence's positions
  // are found once for its KV heads, and its rows' pages are near in time: 1.17x at batch 32 on Zen 4
  // against head-major); with few sequences, head-major, so that a lone sequence's heads (beside its
  // companion row) go to different threads. Either way an item's arithmetic is the same, so the order
  // changes no bits.
  const bool by_sequence = B >= 4 * at::get_num_threads();
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));  // one head's row in the pool
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Positions pos;
    int64_t pos_of = -1;                 // the sequence whose positions `pos` holds
    std::vector<float> scores;           // [G, n]: n = valid past positions + the own token
    std::vector<const void*> keys, values;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = by_sequence ? item % Hkv : item / B, b = by_sequence ? item / Hkv : item % B;
      if (b != pos_of) {
        positions_of<T>(b, cp, kp, vp, bp, mp, sp, L, bs, nblk, layers, layer, row, pos);
        pos_of = b;
      }
      const int64_t n = static_cast<int64_t>(pos.own.size());
      keys.resize(n); values.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t off = h * D * (pos.own[j] ? static_cast<int64_t>(sizeof(float)) : static_cast<int64_t>(sizeof(T)));
        keys[j] = pos.keys[j] + off;
        values[j] = pos.values[j] + off;
      }
      const std::vector<char>& own = pos.own;
      // The pool's rows are scattered over memory, read at the pace of one miss at a time unless asked
      // ahead: the key and the value of a position kAhead ahead are requested while this one's scores
      // are computed, into L2 (T1), not L1: requests into L1 held its few miss buffers, and every load
      // behind them waited (on Zen 4, one step's attention at batch 32 took 1.4x as long with T0).
      auto fetch = [&](int64_t j) {
        const char* kb = static_cast<const char*>(keys[j]);
        const char* vb = static_cast<const char*>(values[j]);
        for (int64_t off = 0; off < bytes; off += 64) {
          _mm_prefetch(kb + off, _MM_HINT_T1);
          _mm_prefetch(vb + off, _MM_HINT_T1);
        }
      };
      scores.resize(G * n);
      const float* qrow = qp + (b * H + h * G) * D;
      for (int64_t j = 0; j < std::min<int64_t>(kAhead, n); ++j) fetch(j);
      for (int64_t j = 0; j < n;) {
        // each key chunk read once for the group's queries; two pool keys at a time where they follow
        const int64_t step = j + 1 < n && !own[j] && !own[j + 1] ? 2 : 1;
        for (int64_t i = j; i < j + step; ++i)
          if (i + kAhead < n) fetch(i + kAhead);
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const int64_t gn = std::min<int64_t>(4, G - g0);
          float* out = scores.data() + g0 * n + j;
          if (step == 2) scores_of2(qrow + g0 * D, static_cast<const T*>(keys[j]), static_cast<const T*>(keys[j + 1]), D, gn, scale, out, n);
          else if (own[j]) scores_of(qrow + g0 * D, static_cast<const float*>(keys[j]), D, gn, scale, out, n);
          else scores_of(qrow + g0 * D, static_cast<const T*>(keys[j]), D, gn, scale, out, n);
        }
        j += step;
      }
      float inv[4];
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, G - g0);
        for (int64_t g = g0; g < g0 + gn; ++g) inv[g - g0] = 1.0f / softmax_in_place(scores.data() + g * n, n);
        weighted_sums<T>(scores.data() + g0 * n, n, values, own, inv, op + (b * H + h * G + g0) * D, D, gn);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                            int64_t layer, const at::Tensor& past_blocks, const at::Tensor& past_valid,
                            const at::Tensor& step_src) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q, k, v are [B, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: q, k, v are float32");
  TORCH_CHECK(q.size(2) % 8 == 0 && k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0,
              "decode_attention: head dims must match (a multiple of 8) and KV heads divide heads");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2 && kv_cache.size(4) == k.size(1) &&
              kv_cache.size(5) == q.size(2), "decode_attention: kv_cache is [blocks, layers, 2, block, Hkv, D]");
  TORCH_CHECK(past_valid.size(1) % kv_cache.size(3) == 0 && past_blocks.numel() * kv_cache.size(3) ==
              past_valid.numel(), "decode_attention: block table and past mask disagree");
  TORCH_CHECK(kv_cache.is_contiguous(), "decode_attention: kv_cache must be contiguous (it is never copied)");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), cc = kv_cache;
  const at::Tensor bc = past_blocks.to(at::kLong).contiguous(), mc = past_valid.to(at::kBool).contiguous();
  const at::Tensor sc = step_src.to(at::kLong).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  switch (kv_cache.scalar_type()) {
    case at::kFloat: attend<float>(qc, kc, vc, cc, layer, bc, mc, sc, out); break;
    case at::kBFloat16: attend<at::BFloat16>(qc, kc, vc, cc, layer, bc, mc, sc, out); break;
    case at::kHalf: attend<at::Half>(qc, kc, vc, cc, layer, bc, mc, sc, out); break;
    default: TORCH_CHECK(false, "decode_attention: kv_cache must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_attn, lib) {
  lib.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, int layer, Tensor past_blocks, "
          "Tensor past_valid, Tensor step_src) -> Tensor");
  lib.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
