// Prefill (extend) attention on an AVX-512 CPU, read straight from the paged KV pool: the queries of
// prompt chunks ([T, H, D], sequence i's rows the last q_len of its seq_len positions) over their
// causal past, float32 sums, for a pool of float32, bfloat16 or float16.
//
// Work item: one (sequence, tile of QUERY_TILE positions, KV head); items are taken by the threads
// from a shared counter, the costliest (latest tiles) first. An item copies its keys into 16-key
// panels transposed ([D][16], float32) and its values into rows of float32, once for the tile's G x
// tile query rows. Then, for groups of 8 query rows: the scores of 16 keys at a time (8 x 2
// accumulators of 16 lanes, a key chunk's d-th values loaded once for the 8 rows, each row's d-th
// query value broadcast), an exact max per row, exponentials 16 lanes at a time and their sum, then
// the values weighted by the probabilities (8 rows x 4 accumulators of 16 outputs) and divided by the
// sum.
//
// Every query row's result is a function of its own query, its own visible keys and values and their
// positions alone: a score is the sum over d in order; key chunks start at multiples of 16 positions
// (absolute), so a key always lands in the same lane; a key a row does not see (causal, or out of its
// sliding window) gets probability exactly 0, and adding 0 (or 0 times a value) leaves a float as it
// is. So the bits do not depend on which rows share an item, on how a prompt is cut into chunks, on
// the batch, or on the number of threads. Built with -ffp-contract=off: the only fused multiply-adds
// are the explicit ones.
//
// Inputs: q [T, H, D] float32; k_cache, v_cache [N, block_size, Hkv, D] (block stride any, the rest
// contiguous); block_tables [B, M] int32; query_start_loc [B + 1] int32; seq_lens [B] int32; window 0
// (none) or the sliding window. D must be a multiple of 16, at most 128.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd16.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using tandem_simd::exp16;
using tandem_simd::sum16;

constexpr int64_t kLanes = 16;  // keys per chunk (one vector of scores)
constexpr int64_t kRows = 8;    // query rows per pass
constexpr int64_t kMaxD = 128;  // head dims 16 to 128, in 16s



inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[i][j] -> r[j][i] for 16 vectors of 16 floats
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// One item's keys and values as float32: keys in chunks of 16 positions transposed (kt[c][d][16]),
// 16 x 16 at a time, values as rows (vr[j][D]); positions from k0 (a multiple of 16) to k1, those past
// k1 zero.
template <typename T>
void pack(const T* kc, const T* vc, int64_t block_stride, int64_t bs, int64_t Hkv, int64_t D, const int32_t* table,
          int64_t h, int64_t k0, int64_t k1, std::vector<float>& kt, std::vector<float>& vr) {
  const int64_t chunks = (k1 - k0 + kLanes - 1) / kLanes, n = chunks * kLanes;
  kt.resize(chunks * D * kLanes);
  vr.resize(n * D);
  const T* rows[kLanes];
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t p0 = k0 + c * kLanes, count = std::min<int64_t>(kLanes, k1 - p0);
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t p = p0 + std::min(j, count - 1);  // past k1: any row, its scores are never seen
      rows[j] = kc + table[p / bs] * block_stride + ((p % bs) * Hkv + h) * D;
      float* vd = vr.data() + (c * kLanes + j) * D;
      if (j < count) {
        const T* vs = vc + (rows[j] - kc);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vd + d, load16(vs + d));
      } else {
        std::fill(vd, vd + D, 0.f);  // probability 0 times a value: 0 only if the value is finite
      }
    }
    float* kd = kt.data() + c * D * kLanes;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = load16(rows[j] + d0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kd + (d0 + i) * kLanes, r[i]);
    }
  }
}

// Scores of R query rows (q rows D apart) against the chunks [c0, c1) of kt: s[r][16 c + lane]
template <int R>
void scores(const float* q, const float* kt, int64_t D, int64_t c0, int64_t c1, float scale, float* s, int64_t stride) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t c = c0;
  for (; c + 2 <= c1; c += 2) {  // two chunks at once: 2R independent chains
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const float* k0 = kt + c * D * kLanes;
    const float* k1 = k0 + D * kLanes;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 x0 = _mm512_loadu_ps(k0 + d * kLanes), x1 = _mm512_loadu_ps(k1 + d * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_set1_ps(q[r * D + d]);
        a0[r] = _mm512_fmadd_ps(qv, x0, a0[r]);
        a1[r] = _mm512_fmadd_ps(qv, x1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * stride + c * kLanes, _mm512_mul_ps(a0[r], sc));
      _mm512_storeu_ps(s + r * stride + (c + 1) * kLanes, _mm512_mul_ps(a1[r], sc));
    }
  }
  for (; c < c1; ++c) {
    __m512 a0[R];
    for (int r = 0; r < R; ++r) a0[r] = _mm512_setzero_ps();
    const float* k0 = kt + c * D * kLanes;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 x0 = _mm512_loadu_ps(k0 + d * kLanes);
      for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), x0, a0[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * stride + c * kLanes, _mm512_mul_ps(a0[r], sc));
  }
}

// The lanes of the chunk from key j0 that lie in [lo, hi]
inline __mmask16 lanes_in(int64_t j0, int64_t lo, int64_t hi) {
  uint32_t bits = 0xffffu;
  if (lo > j0) bits = lo - j0 >= kLanes ? 0u : bits & (0xffffu << (lo - j0));
  if (hi < j0 + kLanes - 1) bits = hi < j0 ? 0u : bits & (0xffffu >> (kLanes - 1 - (hi - j0)));
  return static_cast<__mmask16>(bits);
}

// A row's probabilities in place over chunks [0, c1) (keys outside [lo, hi] of the row: exactly 0);
// returns 1 / their sum
inline float softmax_row(float* s, int64_t c1, int64_t lo, int64_t hi) {
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = none;
  for (int64_t c = lo / kLanes; c < c1; ++c)
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(none, lanes_in(c * kLanes, lo, hi), s + c * kLanes));
  const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(m));  // a max: exact in any order
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t c = 0; c < c1; ++c) {
    const __mmask16 keep = lanes_in(c * kLanes, lo, hi);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + c * kLanes), t)));
    _mm512_storeu_ps(s + c * kLanes, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  return 1.0f / sum16(lanes);
}

// o[r] = inv[r] * sum over keys j < n in order of p[r][j] v[j], R rows, D = 16 CN
template <int R, int CN>
void weighted(const float* p, int64_t stride, const float* vr, int64_t n, const float* inv, float* o, int64_t ostride) {
  __m512 acc[R][CN];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < CN; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[CN];
    for (int u = 0; u < CN; ++u) v[u] = _mm512_loadu_ps(vr + j * CN * 16 + 16 * u);
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * stride + j]);
      for (int u = 0; u < CN; ++u) acc[r][u] = _mm512_fmadd_ps(pv, v[u], acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < CN; ++u)
      _mm512_storeu_ps(o + r * ostride + 16 * u, _mm512_mul_ps(acc[r][u], _mm512_set1_ps(inv[r])));
}

// The same for kRows rows, R at a time: R x D / 16 accumulators and a value row within the 32
// registers (eight rows of 64 values would need 32 accumulators alone)
template <int CN>
void weighted_rows(const float* p, int64_t stride, const float* vr, int64_t n, const float* inv, float* o,
                   int64_t ostride, int64_t rows) {
  constexpr int R = CN <= 4 ? 4 : 2;
  for (int64_t r = 0; r < rows; r += R) weighted<R, CN>(p + r * stride, stride, vr, n, inv + r, o + r * ostride, ostride);
}

// rows (at most kRows) rounded up to the pass's R: the rows past `rows` are computed and not used
void weighted_rows(const float* p, int64_t stride, const float* vr, int64_t n, const float* inv, float* o,
                   int64_t ostride, int64_t D, int64_t rows) {
  switch (D / 16) {
    case 1: weighted_rows<1>(p, stride, vr, n, inv, o, ostride, rows); break;
    case 2: weighted_rows<2>(p, stride, vr, n, inv, o, ostride, rows); break;
    case 3: weighted_rows<3>(p, stride, vr, n, inv, o, ostride, rows); break;
    case 4: weighted_rows<4>(p, stride, vr, n, inv, o, ostride, rows); break;
    case 5: weighted_rows<5>(p, stride, vr, n, inv, o, ostride, rows); break;
    case 6: weighted_rows<6>(p, stride, vr, n, inv, o, ostride, rows); break;
    case 7: weighted_rows<7>(p, stride, vr, n, inv, o, ostride, rows); break;
    default: weighted_rows<8>(p, stride, vr, n, inv, o, ostride, rows); break;
  }
}

// scores<R> for R = rows (1 to kRows): a decode row's group of G queries runs G rows, not kRows
void scores_rows(int64_t rows, const float* q, const float* kt, int64_t D, int64_t c1, float scale, float* s,
                 int64_t stride) {
  switch (rows) {
    case 1: scores<1>(q, kt, D, 0, c1, scale, s, stride); break;
    case 2: scores<2>(q, kt, D, 0, c1, scale, s, stride); break;
    case 3: scores<3>(q, kt, D, 0, c1, scale, s, stride); break;
    case 4: scores<4>(q, kt, D, 0, c1, scale, s, stride); break;
    case 5: scores<5>(q, kt, D, 0, c1, scale, s, stride); break;
    case 6: scores<6>(q, kt, D, 0, c1, scale, s, stride); break;
    case 7: scores<7>(q, kt, D, 0, c1, scale, s, stride); break;
    default: scores<kRows>(q, kt, D, 0, c1, scale, s, stride); break;
  }
}

struct Item {
  int64_t seq, lo, hi, h;  // the tile's first and last-plus-one query positions, its KV head
  int64_t cost;
};

struct Args {
  const float* q;
  float* out;
  const int32_t *tables, *starts, *lens;
  int64_t M, H, Hkv, D, bs, block_stride, window;
  float scale;
};

// One item: rows ordered (position, query of the group); q rows of a position are G x D contiguous
template <typename T>
void run_item(const Args& a, const T* kc, const T* vc, const Item& it, std::vector<float>& kt, std::vector<float>& vr,
              std::vector<float>& s, std::vector<float>& qs) {
  const int64_t G = a.H / a.Hkv, D = a.D, seq_len = a.lens[it.seq];
  const int64_t first = seq_len - (a.starts[it.seq + 1] - a.starts[it.seq]);  // position of the first query
  const int64_t kmin = a.window > 0 ? std::max<int64_t>(it.lo - a.window + 1, 0) : 0;
  const int64_t k0 = kmin / kLanes * kLanes, k1 = it.hi;  // keys [k0, hi): absolute chunks of 16
  pack(kc, vc, a.block_stride, a.bs, a.Hkv, D, a.tables + it.seq * a.M, it.h, k0, k1, kt, vr);
  const int64_t rows = (it.hi - it.lo) * G, stride = (k1 - k0 + kLanes - 1) / kLanes * kLanes;
  qs.resize(kRows * D);
  s.resize(kRows * stride);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t rn = std::min(kRows, rows - r0);
    const int64_t last = it.lo + (r0 + rn - 1) / G;  // the group's last position: no key after it is seen
    const int64_t c1 = (last - k0) / kLanes + 1;
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t pos = it.lo + (r0 + r) / G, g = (r0 + r) % G;
      const float* src = a.q + ((a.starts[it.seq] + pos - first) * a.H + it.h * G + g) * D;
      std::copy(src, src + D, qs.data() + r * D);
    }
    scores_rows(rn, qs.data(), kt.data(), D, c1, a.scale, s.data(), stride);
    float inv[kRows];
    const int64_t wn = std::min<int64_t>(kRows, (rn + 3) / 4 * 4);  // rows the weighted sums run (passes of 4 or 2)
    for (int64_t r = 0; r < wn; ++r) {
      const int64_t pos = it.lo + std::min(r0 + r, rows - 1) / G;
      const int64_t lo = (a.window > 0 ? std::max<int64_t>(pos - a.window + 1, 0) : 0) - k0;
      inv[r] = softmax_row(s.data() + r * stride, c1, lo, pos - k0);
    }
    alignas(64) float o[kRows * kMaxD];
    weighted_rows(s.data(), stride, vr.data(), last - k0 + 1, inv, o, D, D, wn);
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t pos = it.lo + (r0 + r) / G, g = (r0 + r) % G;
      std::copy(o + r * D, o + (r + 1) * D, a.out + ((a.starts[it.seq] + pos - first) * a.H + it.h * G + g) * D);
    }
  }
}

template <typename T>
void attend(const Args& a, const T* kc, const T* vc, int64_t B, int64_t tile) {
  std::vector<Item> items;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t seq_len = a.lens[i], q_len = a.starts[i + 1] - a.starts[i];
    if (q_len == 0) continue;  // a sequence with no query this step
    for (int64_t t0 = (seq_len - q_len) / tile * tile; t0 < seq_len; t0 += tile) {
      const int64_t lo = std::max(t0, seq_len - q_len), hi = std::min(t0 + tile, seq_len);
      const int64_t span = a.window > 0 ? std::min<int64_t>(hi, a.window + tile) : hi;
      for (int64_t h = 0; h < a.Hkv; ++h) items.push_back({i, lo, hi, h, (hi - lo) * span});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, vr, s, qs;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next++; i < n; i = next++) run_item<T>(a, kc, vc, items[i], kt, vr, s, qs);
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, int64_t window, int64_t tile) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "prefill_attention: q is float32 [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "prefill_attention: k/v caches [N, bs, Hkv, D] alike");
  const int64_t D = q.size(2), H = q.size(1), Hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= kMaxD && H % Hkv == 0,
              "prefill_attention: head dim 16..128 in 16s, KV heads dividing heads");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == D && k_cache.stride(1) == Hkv * D,
              "prefill_attention: a block's [bs, Hkv, D] contiguous");
  TORCH_CHECK(tile > 0, "prefill_attention: tile > 0");
  const at::Tensor qc = q.contiguous(), tc = block_tables.to(at::kInt).contiguous();
  const at::Tensor sc = query_start_loc.to(at::kInt).contiguous(), lc = seq_lens.to(at::kInt).contiguous();
  at::Tensor out = at::zeros_like(qc);
  const int64_t B = lc.size(0);
  if (qc.size(0) == 0 || B == 0) return out;
  Args a{qc.data_ptr<float>(), out.data_ptr<float>(), tc.data_ptr<int32_t>(), sc.data_ptr<int32_t>(),
         lc.data_ptr<int32_t>(), tc.size(1), H, Hkv, D, bs, k_cache.stride(0), window, static_cast<float>(scale)};
  switch (k_cache.scalar_type()) {
    case at::kFloat: attend<float>(a, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), B, tile); break;
    case at::kBFloat16:
      attend<at::BFloat16>(a, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), B, tile);
      break;
    case at::kHalf: attend<at::Half>(a, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), B, tile); break;
    default: TORCH_CHECK(false, "prefill_attention: a float32, bfloat16 or float16 pool");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_prefill_attn, lib) {
  lib.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
          "Tensor seq_lens, float scale, int window, int tile) -> Tensor");
  lib.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention);
}
