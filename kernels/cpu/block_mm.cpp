// Weight-only blocks (ggml's Q4_0 / Q4_1 / Q4_K levels, or Q8_0) times float32 activations on an AVX2
// CPU, as llama.cpp multiplies them: each activation row is rounded per block of 32 to int8 (a float32
// scale dx = max|x| / 127, as Q8_0), each block's product is an exact integer sum (vpmaddubsw +
// vpmaddwd), and the block sums are scaled and added in float32:
//   out[m, n] = sum_b dx[m, b] * (d[n, b] * sum_k q[n, b, k] * xq[m, b, k] + m[n, b] * sum_k xq[m, b, k])
// with 4-bit weights (w = d * q + m, q in 0..15, m absent for 8-bit weights, q in [-127, 127]).
// act_levels = 2 (the LM head's input) adds a second int8 level holding what the first rounded off,
// in 256ths of its step: about 15 bits an activation instead of 8, for twice the integer products.
//
// Every output element is computed by the same arithmetic whatever the number of rows and wherever a
// row falls in the batch, so a row's result depends on that row alone (built with -ffp-contract=off: the
// only fused multiply-adds are the explicit ones). Per block b, in order: the block's exact integer sum S
// (both levels: 256 S1 + S2), then acc = fma(d * dx, float(S), acc) and, for 4-bit weights,
// acc = fma(m, xs, acc). Two kernels compute it and give the same bits:
//   narrow (fewer than kWideRows rows): a tile of four weight rows unpacked once for up to four
//     activation rows, each block's lanes added across in integers (vphadd);
//   wide (kWideRows rows and more): an int8 GEMM over a panel of 16 weight rows unpacked once per call
//     into k-steps, activation bytes broadcast against 8 weight rows at a time, no adding across lanes;
//     about twice as fast from 8 rows on (prompts, and decode batches). 8-bit weights widen to int16 and
//     multiply both activation levels with one vpmaddwd.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxTile = 4;  // weight rows multiplied together (lanes of a 128-bit vector of scales)

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

struct Quantized {  // activation rows in int8 blocks
  std::vector<int8_t> q;   // [M, K]
  std::vector<int8_t> q2;  // [M, K]: with two levels, what q rounded off, in 256ths of its step
  std::vector<float> dx;   // [M, nb]: the step of q (one level) or of 256 q + q2 (two levels)
  std::vector<float> xs;   // [M, nb]: dx * the sum of the block's levels
  std::vector<int16_t> qc;  // [M, K]: q, or 256 q + q2 with two levels (|.| <= 32639): for 8-bit weights
  std::vector<int32_t> qsum, q2sum;  // [M, nb]: the sums of q and of q2 (the panel kernel's 8-bit weights)
};

// int32 lanes in order as int8 / int16 (the values fit: no saturation)
inline __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline __m256i pack_i16(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0b11011000);
}
inline int hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01001110));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10110001)));
}

// Each block of 32: dx = max|x| / 127, q = round-half-even(x / dx) (as x * (1 / dx)); with two levels
// q2 = round((x - q dx) / dx * 256) within [-127, 127]. Eight lanes at a time, each lane's arithmetic a
// scalar one's.
void quantize_rows(const float* x, int64_t M, int64_t K, bool two_levels, bool combined, Quantized& out,
                   bool level_sums = false) {
  const int64_t nb = K / kBlock;
  out.qsum.resize(level_sums ? M * nb : 0);
  out.q2sum.resize(level_sums && two_levels ? M * nb : 0);
  out.qc.resize(combined ? M * K : 0);
  out.q.resize(M * K);
  out.q2.resize(two_levels ? M * K : 0);
  out.dx.resize(M * nb);
  out.xs.resize(M * nb);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * kBlock;  // rows are contiguous: block i of the flat [M * nb]
      __m256 xv[4];
      for (int j = 0; j < 4; ++j) xv[j] = _mm256_loadu_ps(v + 8 * j);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(xv[0], abs_mask), _mm256_and_ps(xv[1], abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(xv[2], abs_mask), _mm256_and_ps(xv[3], abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      const __m256 idv = _mm256_set1_ps(id), dv = _mm256_set1_ps(d);
      __m256i qi[4], q2i[4], both[4];  // both: q, or 256 q + q2 with two levels
      __m256i sum = _mm256_setzero_si256(), sum1 = _mm256_setzero_si256(), sum2 = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256 q = _mm256_round_ps(_mm256_mul_ps(xv[j], idv), kRound);
        qi[j] = both[j] = _mm256_cvtps_epi32(q);
        if (two_levels) {
          const __m256 r = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(xv[j], _mm256_mul_ps(q, dv)), idv),
                                         _mm256_set1_ps(256.f));
          const __m256 q2 = _mm256_min_ps(_mm256_set1_ps(127.f),
                                          _mm256_max_ps(_mm256_set1_ps(-127.f), _mm256_round_ps(r, kRound)));
          q2i[j] = _mm256_cvtps_epi32(q2);
          both[j] = _mm256_add_epi32(_mm256_slli_epi32(qi[j], 8), q2i[j]);
        }
        sum = _mm256_add_epi32(sum, both[j]);
        if (level_sums) {
          sum1 = _mm256_add_epi32(sum1, qi[j]);
          if (two_levels) sum2 = _mm256_add_epi32(sum2, q2i[j]);
        }
      }
      if (level_sums) {
        out.qsum[i] = hsum(sum1);
        if (two_levels) out.q2sum[i] = hsum(sum2);
      }
      if (combined)
        for (int j = 0; j < 4; j += 2)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qc.data() + i * kBlock + 8 * j),
                              pack_i16(both[j], both[j + 1]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * kBlock), pack_i8(qi[0], qi[1], qi[2], qi[3]));
      if (two_levels)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q2.data() + i * kBlock),
                            pack_i8(q2i[0], q2i[1], q2i[2], q2i[3]));
      out.dx[i] = two_levels ? d / 256.f : d;
      out.xs[i] = out.dx[i] * static_cast<float>(hsum(sum));
    }
  });
}

// The levels of block b of weight row n as 32 bytes in the activations' order: u8 for 4-bit weights
// (byte j holds level j in its low nibble and level j + 16 in its high one), i8 for 8-bit.
template <bool kFourBit>
inline __m256i load_levels(const uint8_t* qs, int64_t K, int64_t n, int64_t b) {
  if (kFourBit) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + n * (K / 2) + b * 16));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + n * K + b * kBlock));
}

// The integer sums of one block, 8 lanes: q * xq (or q * (256 xq + xq2)), each lane exact.
template <bool kFourBit>
inline __m256i block_sums(__m256i w, __m256i xv, const __m256i ones) {
  if (kFourBit) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // q in 0..15 times signed xq
  // signed times signed: |w| times x with w's sign moved onto x
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
}

// The scaled block sum added to an output's accumulator, the same instructions in both kernels below:
// acc += (d * dx) * S, then acc += m * xs for 4-bit weights (S the block's exact integer sum).
template <bool kFourBit, typename V>
inline V add_block(V acc, V d, V dx, V sum, V m, V xs);
template <>
inline __m128 add_block<true, __m128>(__m128 acc, __m128 d, __m128 dx, __m128 sum, __m128 m, __m128 xs) {
  return _mm_fmadd_ps(m, xs, _mm_fmadd_ps(_mm_mul_ps(d, dx), sum, acc));
}
template <>
inline __m128 add_block<false, __m128>(__m128 acc, __m128 d, __m128 dx, __m128 sum, __m128, __m128) {
  return _mm_fmadd_ps(_mm_mul_ps(d, dx), sum, acc);
}
template <>
inline __m256 add_block<false, __m256>(__m256 acc, __m256 d, __m256 dx, __m256 sum, __m256, __m256) {
  return _mm256_fmadd_ps(_mm256_mul_ps(d, dx), sum, acc);
}
template <>
inline __m256 add_block<true, __m256>(__m256 acc, __m256 d, __m256 dx, __m256 sum, __m256 m, __m256 xs) {
  return _mm256_fmadd_ps(m, xs, _mm256_fmadd_ps(_mm256_mul_ps(d, dx), sum, acc));
}

// Narrow kernel: R activation rows (at most 4) against the 4 weight rows of a tile from n0 (nn of them
// real; the rest repeat the last one and are not written), each weight block unpacked once for the R
// rows. A (row, weight row) pair's 8 lanes of integer sums are added across lanes in integers (vphadd),
// so a row's four block sums, one per weight row, are one 4-lane vector.
template <int R, bool kFourBit, bool kTwoLevels>
void tile_rows(const Quantized& xq, int64_t m0, int64_t K, const uint8_t* qs, const float* dt, const float* mt,
               int64_t n0, int64_t nn, float* out, int64_t N) {
  const int64_t nb = K / kBlock;
  static_assert(R >= 1 && R <= 4, "accumulators beyond the registers");
  int64_t rows[kMaxTile];
  for (int r = 0; r < kMaxTile; ++r) rows[r] = n0 + std::min<int64_t>(r, nn - 1);
  __m128 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[kMaxTile];
#pragma GCC unroll 4
    for (int r = 0; r < kMaxTile; ++r) wv[r] = load_levels<kFourBit>(qs, K, rows[r], b);
    const __m128 dv = _mm_loadu_ps(dt + b * kMaxTile);
    const __m128 mv = kFourBit ? _mm_loadu_ps(mt + b * kMaxTile) : _mm_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const int64_t m = m0 + i;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + m * K + b * kBlock));
      __m256i sums;  // per 128-bit half: the four weight rows' sums over that half of the block
      if (kFourBit && !kTwoLevels) {
        // levels times activations in pairs in int16 (|.| <= 2 * 15 * 127), added across lanes in int16
        // twice (8 products, |.| <= 15240), then once more into int32
        __m256i p16[kMaxTile];
#pragma GCC unroll 4
        for (int r = 0; r < kMaxTile; ++r) p16[r] = _mm256_maddubs_epi16(wv[r], xv);
        sums = _mm256_madd_epi16(
            _mm256_hadd_epi16(_mm256_hadd_epi16(p16[0], p16[1]), _mm256_hadd_epi16(p16[2], p16[3])), ones);
      } else {
        __m256i p32[kMaxTile];
        __m256i xv2 = xv;
        if (kTwoLevels)
          xv2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q2.data() + m * K + b * kBlock));
#pragma GCC unroll 4
        for (int r = 0; r < kMaxTile; ++r) {
          p32[r] = block_sums<kFourBit>(wv[r], xv, ones);
          // 256 * (up to 4 * 127 * 127) + the second level's per lane; eight lanes added below 2^31
          if (kTwoLevels)
            p32[r] = _mm256_add_epi32(_mm256_slli_epi32(p32[r], 8), block_sums<kFourBit>(wv[r], xv2, ones));
        }
        sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p32[0], p32[1]), _mm256_hadd_epi32(p32[2], p32[3]));
      }
      const __m128i whole = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
      acc[i] = add_block<kFourBit>(acc[i], dv, _mm_set1_ps(xq.dx[m * nb + b]), _mm_cvtepi32_ps(whole), mv,
                                   _mm_set1_ps(xq.xs[m * nb + b]));
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(16) float total[kMaxTile];
    _mm_store_ps(total, acc[i]);
    for (int r = 0; r < std::min<int64_t>(kMaxTile, nn); ++r) out[(m0 + i) * N + n0 + r] = total[r];
  }
}

// The tile's block scales and offsets in float32, [nb][width], rows past N repeating the last one.
void tile_scales(const uint16_t* d, const uint16_t* m, int64_t nb, int64_t N, int64_t n0, int width, float* dt,
                 float* mt) {
  for (int64_t r = 0; r < width; ++r) {
    const int64_t row = std::min<int64_t>(n0 + r, N - 1);
    for (int64_t b = 0; b < nb; ++b) {
      dt[b * width + r] = half_to_float(d[row * nb + b]);
      if (m != nullptr) mt[b * width + r] = half_to_float(m[row * nb + b]);
    }
  }
}

template <bool kFourBit, bool kTwoLevels>
void run_tiles(const Quantized& xq, int64_t M, int64_t K, int64_t N, const uint8_t* qs, const uint16_t* d,
               const uint16_t* m, float* out) {
  // four weight rows at a time, against up to four activation rows at a time
  const int64_t num_tiles = (N + kMaxTile - 1) / kMaxTile;
  const int64_t nb = K / kBlock;
  at::parallel_for(0, num_tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> dt(nb * kMaxTile, 0.f), mt(nb * kMaxTile, 0.f);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kMaxTile, nn = std::min<int64_t>(kMaxTile, N - n0);
      tile_scales(d, kFourBit ? m : nullptr, nb, N, n0, kMaxTile, dt.data(), mt.data());
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) tile_rows<4, kFourBit, kTwoLevels>(xq, m0, K, qs, dt.data(), mt.data(), n0, nn, out, N);
      if (m0 + 2 <= M) {
        tile_rows<2, kFourBit, kTwoLevels>(xq, m0, K, qs, dt.data(), mt.data(), n0, nn, out, N);
        m0 += 2;
      }
      if (m0 < M) tile_rows<1, kFourBit, kTwoLevels>(xq, m0, K, qs, dt.data(), mt.data(), n0, nn, out, N);
    }
  });
}

// Wide kernel, for 4-bit weights and one activation level with many rows: the same sums and the same
// float instructions per output as the narrow one (so a row's bits do not depend on which kernel its
// batch took), laid out as an int8 GEMM. A panel of 16 weight rows is unpacked once per call into
// k-steps of 4 levels (vector s of block b holds levels 4s..4s+3 of 8 weight rows), so a broadcast of
// 4 activation bytes times it gives 8 weight rows' partial sums at once, with no adding across lanes;
// a block's 8 k-steps add up in int16 (|.| <= 8 * 2 * 15 * 127 = 30480) before one vpmaddwd into int32.
constexpr int kPanel = 16;  // weight rows of a panel: two vectors of 8

// 8 x 8 transpose of 4-byte groups: out[s] lane r = v[r] lane s
inline void transpose8(const __m256* v, __m256* out) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  out[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  out[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  out[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  out[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

void unpack_panel(const uint8_t* qs, int64_t K, int64_t N, int64_t n0, __m256i* panel) {
  const int64_t nb = K / kBlock;
  for (int half = 0; half < 2; ++half) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[8];
      for (int r = 0; r < 8; ++r)
        v[r] = _mm256_castsi256_ps(load_levels<true>(qs, K, std::min<int64_t>(n0 + half * 8 + r, N - 1), b));
      __m256 out[8];
      transpose8(v, out);
      for (int s = 0; s < 8; ++s) panel[(b * 8 + s) * 2 + half] = _mm256_castps_si256(out[s]);
    }
  }
}

// The wide kernel for 8-bit weights, one or two activation levels: weights widened to int16, activations
// as q (or 256 q + q2, which fits int16), so one vpmaddwd multiplies both levels, two levels of k at a
// time for 8 weight rows; a block's 16 steps add up in int32 (|.| <= 16 * 2 * 127 * 32639 < 2^31) to
// the narrow kernel's exact sum.
void unpack_panel16(const uint8_t* qs, int64_t K, int64_t N, int64_t n0, __m256i* panel) {
  const int64_t nb = K / kBlock;
  for (int half = 0; half < 2; ++half) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256 lo[8], hi[8];
      for (int r = 0; r < 8; ++r) {
        const __m256i w = load_levels<false>(qs, K, std::min<int64_t>(n0 + half * 8 + r, N - 1), b);
        lo[r] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)));      // levels 0..15
        hi[r] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1)));  // 16..31
      }
      __m256 out[8];
      transpose8(lo, out);
      for (int s = 0; s < 8; ++s) panel[(b * 16 + s) * 2 + half] = _mm256_castps_si256(out[s]);
      transpose8(hi, out);
      for (int s = 0; s < 8; ++s) panel[(b * 16 + 8 + s) * 2 + half] = _mm256_castps_si256(out[s]);
    }
  }
}

// R activation rows (at most 2) against a panel's 16 weight rows from n0 (nn of them written). 4-bit:
// a block is 8 k-steps of 4 levels (vpmaddubsw, the steps added in int16, one vpmaddwd); 8-bit: 16
// k-steps of 2 int16 levels (vpmaddwd, added in int32).
template <int R, bool kFourBit>
void panel_rows(const Quantized& xq, int64_t m0, int64_t K, const __m256i* panel, const float* dt, const float* mt,
                int64_t n0, int64_t nn, float* out, int64_t N) {
  constexpr int kSteps = kFourBit ? 8 : 16;
  const int64_t nb = K / kBlock;
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i part[R][2];  // int16 sums of level pairs (4-bit) or int32 sums (8-bit), per weight row
    const __m256i* w = panel + b * 2 * kSteps;
#pragma GCC unroll 16
    for (int s = 0; s < kSteps; ++s) {
      const __m256i w0 = _mm256_load_si256(w + 2 * s), w1 = _mm256_load_si256(w + 2 * s + 1);
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i) {
        int32_t four;  // four int8 levels, or two int16 ones
        if (kFourBit) std::memcpy(&four, xq.q.data() + (m0 + i) * K + b * kBlock + 4 * s, 4);
        else std::memcpy(&four, xq.qc.data() + (m0 + i) * K + b * kBlock + 2 * s, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        if (kFourBit) {
          const __m256i p0 = _mm256_maddubs_epi16(w0, xb), p1 = _mm256_maddubs_epi16(w1, xb);
          part[i][0] = s == 0 ? p0 : _mm256_add_epi16(part[i][0], p0);
          part[i][1] = s == 0 ? p1 : _mm256_add_epi16(part[i][1], p1);
        } else {
          const __m256i p0 = _mm256_madd_epi16(w0, xb), p1 = _mm256_madd_epi16(w1, xb);
          part[i][0] = s == 0 ? p0 : _mm256_add_epi32(part[i][0], p0);
          part[i][1] = s == 0 ? p1 : _mm256_add_epi32(part[i][1], p1);
        }
      }
    }
    const __m256 d0 = _mm256_loadu_ps(dt + b * kPanel), d1 = _mm256_loadu_ps(dt + b * kPanel + 8);
    const __m256 mm0 = kFourBit ? _mm256_loadu_ps(mt + b * kPanel) : _mm256_setzero_ps();
    const __m256 mm1 = kFourBit ? _mm256_loadu_ps(mt + b * kPanel + 8) : _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i) {
      const __m256 dx = _mm256_set1_ps(xq.dx[(m0 + i) * nb + b]);
      const __m256 xs = kFourBit ? _mm256_set1_ps(xq.xs[(m0 + i) * nb + b]) : _mm256_setzero_ps();
      __m256i sum0 = part[i][0], sum1 = part[i][1];
      if (kFourBit) {
        sum0 = _mm256_madd_epi16(sum0, ones);
        sum1 = _mm256_madd_epi16(sum1, ones);
      }
      acc[i][0] = add_block<kFourBit>(acc[i][0], d0, dx, _mm256_cvtepi32_ps(sum0), mm0, xs);
      acc[i][1] = add_block<kFourBit>(acc[i][1], d1, dx, _mm256_cvtepi32_ps(sum1), mm1, xs);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float total[kPanel];
    _mm256_store_ps(total, acc[i][0]);
    _mm256_store_ps(total + 8, acc[i][1]);
    for (int r = 0; r < std::min<int64_t>(kPanel, nn); ++r) out[(m0 + i) * N + n0 + r] = total[r];
  }
}

template <bool kFourBit>
void run_panels(const Quantized& xq, int64_t M, int64_t K, int64_t N, const uint8_t* qs, const uint16_t* d,
                const uint16_t* m, float* out) {
  constexpr int kSteps = kFourBit ? 8 : 16;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t nb = K / kBlock;
  at::parallel_for(0, num_panels, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> dt(nb * kPanel), mt(kFourBit ? nb * kPanel : 0);
    std::vector<__m256i> panel(nb * 2 * kSteps);  // [nb][k-steps][2 vectors of 8 weight rows]
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, nn = std::min<int64_t>(kPanel, N - n0);
      tile_scales(d, kFourBit ? m : nullptr, nb, N, n0, kPanel, dt.data(), mt.data());
      if (kFourBit) unpack_panel(qs, K, N, n0, panel.data());
      else unpack_panel16(qs, K, N, n0, panel.data());
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2)
        panel_rows<2, kFourBit>(xq, m0, K, panel.data(), dt.data(), mt.data(), n0, nn, out, N);
      if (m0 < M) panel_rows<1, kFourBit>(xq, m0, K, panel.data(), dt.data(), mt.data(), n0, nn, out, N);
    }
  });
}

constexpr int64_t kWideRows = 3;  // from this many rows the wide kernel runs (the same bits as the narrow one)

at::Tensor block_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                    int64_t act_levels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_mm: x is float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  const bool four_bit = m.has_value() && m->defined();
  TORCH_CHECK(K % kBlock == 0, "block_mm: K is a whole number of blocks of 32");
  TORCH_CHECK(act_levels == 1 || act_levels == 2, "block_mm: act_levels is 1 or 2");
  const bool two = act_levels == 2;
  TORCH_CHECK(qs.dim() == 2 && qs.size(1) == (four_bit ? K / 2 : K), "block_mm: qs is [N, K / 2] (4-bit) or [N, K] (8-bit)");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.size(0) == N && d.size(1) == K / kBlock, "block_mm: d is float16 [N, K / 32]");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xc = x.contiguous(), qc = qs.contiguous(), dc = d.contiguous();
  const bool wide = M >= kWideRows;
  Quantized xq;
  quantize_rows(xc.data_ptr<float>(), M, K, two, wide && !four_bit, xq);
  const auto* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  if (four_bit) {
    const at::Tensor mc = m->contiguous();
    TORCH_CHECK(mc.scalar_type() == at::kHalf && mc.sizes() == dc.sizes(), "block_mm: m is float16 like d");
    const auto* mp = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
    if (two) run_tiles<true, true>(xq, M, K, N, qp, dp, mp, out.data_ptr<float>());
    else if (wide) run_panels<true>(xq, M, K, N, qp, dp, mp, out.data_ptr<float>());
    else run_tiles<true, false>(xq, M, K, N, qp, dp, mp, out.data_ptr<float>());
  } else if (wide) {
    run_panels<false>(xq, M, K, N, qp, dp, nullptr, out.data_ptr<float>());
  } else if (two) {
    run_tiles<false, true>(xq, M, K, N, qp, dp, nullptr, out.data_ptr<float>());
  } else {
    run_tiles<false, false>(xq, M, K, N, qp, dp, nullptr, out.data_ptr<float>());
  }
  return out;
}


// Panel kernel (built where the CPU has AVX-512 VNNI; ``pack_panels`` / ``panel_mm``): the weight is
// repacked once, at load, into panels of 16 weight rows, block by block, in the order vpdpbusd reads
// it, with the block's float16 scales (and offsets) beside its levels, so a step unpacks nothing but
// nibbles and adds nothing across lanes. One record per (panel, block):
//   4-bit: 4 vectors of 64 bytes, byte 4r + j of vector t holding level 4t + j of weight row r in its
//          low nibble and level 16 + 4t + j in its high one; then d [16] and m [16] as float16.
//   8-bit: 8 vectors, byte 4r + j of vector s holding level 4s + j of row r plus 128 (unsigned, as
//          vpdpbusd's first operand wants); then d [16].
// vpdpbusd(acc, levels, four activation bytes broadcast) adds 4 products for each of the 16 weight
// rows, so a block's 8 k-steps leave its exact integer sum S of all 16 rows in one vector (8-bit
// weights: less 128 times the block's sum of activation levels). With two activation levels S is
// 256 S1 + S2, as the narrow kernel's. Then the same float instructions per output as both kernels
// above: acc = fma(d * dx, S, acc), and acc = fma(m, xs, acc) for 4-bit weights. So a row's output
// has the same bits from the panels as from ``block_mm`` on any build, alone or in any batch.
constexpr int64_t kPanelRows = 16;

int64_t record_bytes(bool four_bit) { return four_bit ? 4 * 64 + 2 * 2 * kPanelRows : 8 * 64 + 2 * kPanelRows; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHavePanels = true;

at::Tensor pack_panels(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                       int64_t K) {
  const bool four_bit = m.has_value() && m->defined();
  const int64_t N = qs.size(0), nb = K / kBlock, P = (N + kPanelRows - 1) / kPanelRows;
  TORCH_CHECK(K % kBlock == 0 && qs.size(1) == (four_bit ? K / 2 : K), "pack_panels: qs is [N, K / 2] or [N, K]");
  const at::Tensor qc = qs.contiguous(), dc = d.contiguous();
  const at::Tensor mc = four_bit ? m->contiguous() : at::Tensor();
  const int64_t rec = record_bytes(four_bit);
  at::Tensor out = at::zeros({P, nb, rec}, qs.options().dtype(at::kByte));
  const auto* q = static_cast<const uint8_t*>(qc.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const auto* mp = four_bit ? reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>()) : nullptr;
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, P * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / nb, b = i % nb;
      uint8_t* r0 = o + i * rec;
      auto* scales = reinterpret_cast<uint16_t*>(r0 + (four_bit ? 4 : 8) * 64);
      for (int64_t r = 0; r < kPanelRows; ++r) {
        const int64_t n = p * kPanelRows + r;
        if (n >= N) break;  // rows past N stay zero (their outputs are not written)
        scales[r] = dp[n * nb + b];
        if (four_bit) scales[kPanelRows + r] = mp[n * nb + b];
        for (int64_t k = 0; k < kBlock; ++k) {
          if (four_bit) {  // ggml's byte j: level j low, level j + 16 high
            const uint8_t byte = q[n * (K / 2) + b * 16 + (k & 15)];
            const uint8_t level = k < 16 ? (byte & 15) : (byte >> 4);
            const int64_t t = (k & 15) / 4, j = k % 4;
            r0[t * 64 + 4 * r + j] |= k < 16 ? level : static_cast<uint8_t>(level << 4);
          } else {
            const int64_t s = k / 4, j = k % 4;
            r0[s * 64 + 4 * r + j] = static_cast<uint8_t>(static_cast<int8_t>(q[n * K + b * kBlock + k]) + 128);
          }
        }
      }
    }
  });
  return out;
}

// How far ahead of the block being multiplied its thread asks for the panel's next bytes (into L2).
// A thread reading weights from memory is bound by the cache misses it has in flight, not by the
// instructions per block: on a 2-core Intel Xeon a block took 7.6 ns from cache and 23-34 ns from
// memory. Prefetching 16 KiB ahead took a batch-1 pass over 420 MB of 4-bit panels from 17 to 20 GB/s
// and an 8-row pass from 10.5 to 14.5 GB/s (T0 and NTA hints were slower; 8-32 KiB about the same).
constexpr int64_t kPrefetchBytes = 16384;

// R activation rows (at most kGroup) from m0 against one panel from n0 (nn rows of it written).
template <int R, bool kFourBit, bool kTwoLevels>
void panel_group(const Quantized& xq, int64_t m0, int64_t K, const uint8_t* panel, int64_t n0, int64_t nn,
                 float* out, int64_t N) {
  const int64_t nb = K / kBlock, rec = record_bytes(kFourBit);
  constexpr int kSteps = 8;  // k-steps of 4 levels in a block
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* r0 = panel + b * rec;
    for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(reinterpret_cast<const char*>(r0 + kPrefetchBytes + line), _MM_HINT_T1);
    __m512i w[kSteps];
    if (kFourBit) {
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(r0 + 64 * t);
        w[t] = _mm512_and_si512(v, low);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int s = 0; s < kSteps; ++s) w[s] = _mm512_loadu_si512(r0 + 64 * s);
    }
    const auto* scales = reinterpret_cast<const __m256i*>(r0 + (kFourBit ? 4 : 8) * 64);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(scales));
    const __m512 mv = kFourBit ? _mm512_cvtph_ps(_mm256_loadu_si256(scales + 1)) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t m = m0 + i;
      const int8_t* x1 = xq.q.data() + m * K + b * kBlock;
      // the block's k-steps in two chains of four (even and odd), added at the end: half the wait on
      // vpdpbusd's latency per row, and the same exact integer sum
      __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
      __m512i t1 = _mm512_setzero_si512(), t2 = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int s = 0; s < kSteps; s += 2) {
        int32_t four, next;
        std::memcpy(&four, x1 + 4 * s, 4);
        std::memcpy(&next, x1 + 4 * s + 4, 4);
        s1 = _mm512_dpbusd_epi32(s1, w[s], _mm512_set1_epi32(four));
        t1 = _mm512_dpbusd_epi32(t1, w[s + 1], _mm512_set1_epi32(next));
        if (kTwoLevels) {
          std::memcpy(&four, xq.q2.data() + m * K + b * kBlock + 4 * s, 4);
          std::memcpy(&next, xq.q2.data() + m * K + b * kBlock + 4 * s + 4, 4);
          s2 = _mm512_dpbusd_epi32(s2, w[s], _mm512_set1_epi32(four));
          t2 = _mm512_dpbusd_epi32(t2, w[s + 1], _mm512_set1_epi32(next));
        }
      }
      s1 = _mm512_add_epi32(s1, t1);
      if (kTwoLevels) s2 = _mm512_add_epi32(s2, t2);
      if (!kFourBit) {  // the levels were stored plus 128
        s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(128 * xq.qsum[m * nb + b]));
        if (kTwoLevels) s2 = _mm512_sub_epi32(s2, _mm512_set1_epi32(128 * xq.q2sum[m * nb + b]));
      }
      const __m512i sum = kTwoLevels ? _mm512_add_epi32(_mm512_slli_epi32(s1, 8), s2) : s1;
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xq.dx[m * nb + b])), _mm512_cvtepi32_ps(sum), acc[i]);
      if (kFourBit) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq.xs[m * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    if (nn == kPanelRows) {
      _mm512_storeu_ps(out + (m0 + i) * N + n0, acc[i]);
    } else {
      _mm512_mask_storeu_ps(out + (m0 + i) * N + n0, static_cast<__mmask16>((1u << nn) - 1), acc[i]);
    }
  }
}

template <bool kFourBit, bool kTwoLevels>
void run_panel_groups(const Quantized& xq, int64_t M, int64_t K, int64_t N, const uint8_t* panels, float* out) {
  const int64_t P = (N + kPanelRows - 1) / kPanelRows, nb = K / kBlock, rec = record_bytes(kFourBit);
  // activation rows per pass over a panel (accumulators in registers): 16 unpack each block's nibbles
  // once for twice the rows 8 did, 6-14% less time at 16-64 rows on the AMD EPYC Zen 4 (one thread,
  // alternating with 8 in one process); then 8, then what is left
  constexpr int kGroup = 16;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = panels + p * nb * rec;
      const int64_t n0 = p * kPanelRows, nn = std::min<int64_t>(kPanelRows, N - n0);
      int64_t m0 = 0;
      for (; m0 + kGroup <= M; m0 += kGroup) panel_group<kGroup, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N);
      if (m0 + 8 <= M) {
        panel_group<8, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N);
        m0 += 8;
      }
      switch (M - m0) {
        case 7: panel_group<7, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        case 6: panel_group<6, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        case 5: panel_group<5, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        case 4: panel_group<4, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        case 3: panel_group<3, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        case 2: panel_group<2, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        case 1: panel_group<1, kFourBit, kTwoLevels>(xq, m0, K, panel, n0, nn, out, N); break;
        default: break;
      }
    }
  });
}

at::Tensor panel_mm(const at::Tensor& x, const at::Tensor& panels, int64_t N, bool four_bit, int64_t act_levels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_mm: x is float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "panel_mm: K is a whole number of blocks of 32");
  TORCH_CHECK(act_levels == 1 || act_levels == 2, "panel_mm: act_levels is 1 or 2");
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (N + kPanelRows - 1) / kPanelRows && panels.size(1) == nb &&
                  panels.size(2) == record_bytes(four_bit) && panels.is_contiguous(),
              "panel_mm: panels are pack_panels' of an [N, K] weight");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xc = x.contiguous();
  const bool two = act_levels == 2;
  Quantized xq;
  quantize_rows(xc.data_ptr<float>(), M, K, two, false, xq, !four_bit);
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (four_bit) {
    if (two) run_panel_groups<true, true>(xq, M, K, N, pp, op);
    else run_panel_groups<true, false>(xq, M, K, N, pp, op);
  } else {
    if (two) run_panel_groups<false, true>(xq, M, K, N, pp, op);
    else run_panel_groups<false, false>(xq, M, K, N, pp, op);
  }
  return out;
}
#else
constexpr bool kHavePanels = false;

at::Tensor pack_panels(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "pack_panels: this build has no AVX-512 VNNI");
}

at::Tensor panel_mm(const at::Tensor&, const at::Tensor&, int64_t, bool, int64_t) {
  TORCH_CHECK(false, "panel_mm: this build has no AVX-512 VNNI");
}
#endif

bool has_panels() { return kHavePanels; }

}  // namespace

TORCH_LIBRARY(tandem_blocks, lib) {
  lib.def("block_mm(Tensor x, Tensor qs, Tensor d, Tensor? m, int act_levels) -> Tensor");
  lib.impl("block_mm", c10::DispatchKey::CPU, &block_mm);
  lib.def("pack_panels(Tensor qs, Tensor d, Tensor? m, int K) -> Tensor");
  lib.impl("pack_panels", c10::DispatchKey::CPU, &pack_panels);
  lib.def("panel_mm(Tensor x, Tensor panels, int N, bool four_bit, int act_levels) -> Tensor");
  lib.impl("panel_mm", c10::DispatchKey::CPU, &panel_mm);
  lib.def("has_panels() -> bool", &has_panels);
}
