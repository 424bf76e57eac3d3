// int8 x int8 -> int32 matrix product for few rows, with AVX-512 VNNI (vpdpbusd): the decode step's
// linear layers at batch 1-12 on a CPU, eager or compiled. out[m, n] = sum_k x[m, k] * w[n, k], exact,
// as torch._int_mm.
//
// _int_mm (oneDNN) streams an int8 weight at about 40% of a plain read for a few rows of
// activations; this reads each tile of four weight rows with 64-byte loads, once from memory for
// the first four activation rows and from cache for each next four (loadtest/bench/int8_kernel.py,
// a 1B model's weights: 2.3x _int_mm at one row, 1.5x at eight, 1.3x at twelve; SmolLM2's: 2.3x,
// 1.1x, 1.05x, and 0.94x at sixteen). vpdpbusd multiplies unsigned by signed bytes, so the
// activations are shifted by +128 and 128 * sum_k w[n, k] (w_sums, precomputed) is taken off: the
// int32 result is the exact product, the same bits as _int_mm's. More rows than kMaxRows go to
// _int_mm, where oneDNN's blocking wins.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 12;    // activation rows handled here; more go to _int_mm
constexpr int64_t kRowsPerGroup = 4;  // activation rows whose accumulators stay in registers together
constexpr int64_t kRowsPerTile = 4;   // weight rows read together

// The sums of four accumulators' 16 lanes each, as [sum a[0], sum a[1], sum a[2], sum a[3]]: the four
// reduced together (interleave and add within 128-bit lanes, then add the four lanes) in 11
// instructions instead of four reductions of about 8 each. At SmolLM2's K = 576 an accumulator
// takes only 9 vpdpbusd, so the reductions were about half of a tile's instructions at 8 rows.
// Integer sums: the same bits in any order.
inline __m128i reduce4(const __m512i* a) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  // each 128-bit lane: [a0, a1, a2, a3] partial sums of that lane
  const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
  const __m256i u = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}
static_assert(kRowsPerTile == 4, "reduce4 reduces a tile's four accumulators of one activation row");

// One tile of kRowsPerTile weight rows against R activation rows: R * kRowsPerTile accumulators in
// registers over the whole K; a tile's weight bytes come from memory for the first group of rows
// and from the L1/L2 cache for the next ones.
template <int R>
void tile_rows(const uint8_t* xu, int64_t Kp, const int8_t* wp, int64_t K, int64_t n0, int64_t nn,
               int64_t full, __mmask64 tail_mask, const int32_t* sp, int32_t* op, int64_t N) {
  __m512i acc[R][kRowsPerTile];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_si512();
  __m512i wv[kRowsPerTile];
  for (int64_t k = 0; k < full; k += 64) {
    for (int64_t b = 0; b < kRowsPerTile; ++b)
      wv[b] = b < nn ? _mm512_loadu_si512(wp + (n0 + b) * K + k) : _mm512_setzero_si512();
    for (int m = 0; m < R; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * Kp + k);
      for (int64_t b = 0; b < kRowsPerTile; ++b) acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xv, wv[b]);
    }
  }
  if (tail_mask) {  // the last K % 64 bytes: masked loads (zeros past K, and x's padding is 0)
    for (int64_t b = 0; b < kRowsPerTile; ++b)
      wv[b] = b < nn ? _mm512_maskz_loadu_epi8(tail_mask, wp + (n0 + b) * K + full) : _mm512_setzero_si512();
    for (int m = 0; m < R; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * Kp + full);
      for (int64_t b = 0; b < kRowsPerTile; ++b) acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xv, wv[b]);
    }
  }
  int32_t sums[kRowsPerTile];
  for (int64_t b = 0; b < kRowsPerTile; ++b) sums[b] = b < nn ? 128 * sp[n0 + b] : 0;
  const __m128i offsets = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums));
  for (int m = 0; m < R; ++m) {
    const __m128i r = _mm_sub_epi32(reduce4(acc[m]), offsets);
    if (nn == kRowsPerTile) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(op + m * N + n0), r);
    } else {
      int32_t out[kRowsPerTile];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), r);
      for (int64_t b = 0; b < nn; ++b) op[m * N + n0 + b] = out[b];
    }
  }
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_sums) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_mm: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kChar && w.scalar_type() == at::kChar && w_sums.scalar_type() == at::kInt,
              "int8_mm: int8 x and w, int32 w_sums");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  if (M > kMaxRows) return at::_int_mm(x, w.t());
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), sums = w_sums.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kInt));
  if (M == 0 || N == 0) return out;
  // the activations as unsigned bytes (x + 128), padded to whole 64-byte vectors with zeros
  const int64_t Kp = (K + 63) / 64 * 64;
  at::Tensor xu = at::zeros({M, Kp}, x.options().dtype(at::kByte));
  const int8_t* xs = xc.data_ptr<int8_t>();
  uint8_t* xup = xu.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xup[m * Kp + k] = static_cast<uint8_t>(xs[m * K + k] + 128);
  const int8_t* wp = wc.data_ptr<int8_t>();
  const int32_t* sp = sums.data_ptr<int32_t>();
  int32_t* op = out.data_ptr<int32_t>();
  const int64_t full = K / 64 * 64;
  const __mmask64 tail_mask = K == full ? 0 : (~0ULL >> (64 - (K - full)));
  const int64_t num_tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kRowsPerTile, nn = std::min(kRowsPerTile, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerGroup) {
        const uint8_t* xg = xup + m0 * Kp;
        int32_t* og = op + m0 * N;
        switch (std::min(kRowsPerGroup, M - m0)) {
          case 1: tile_rows<1>(xg, Kp, wp, K, n0, nn, full, tail_mask, sp, og, N); break;
          case 2: tile_rows<2>(xg, Kp, wp, K, n0, nn, full, tail_mask, sp, og, N); break;
          case 3: tile_rows<3>(xg, Kp, wp, K, n0, nn, full, tail_mask, sp, og, N); break;
          default: tile_rows<4>(xg, Kp, wp, K, n0, nn, full, tail_mask, sp, og, N); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("int8_mm(Tensor x, Tensor w, Tensor w_sums) -> Tensor");
  m.impl("int8_mm", c10::DispatchKey::CPU, &int8_mm);
}
