// Weight-only blocks (ggml's Q4_0 / Q4_1 / Q4_K levels, or Q8_0) times float32 activations on an AVX2
// CPU, as llama.cpp multiplies them: each activation row is rounded per block of 32 to int8 (a float32
// scale dx = max|x| / 127, as Q8_0), each block's product is an exact integer sum (vpmaddubsw +
// vpmaddwd), and the block sums are scaled and added in float32:
//   out[m, n] = sum_b dx[m, b] * (d[n, b] * sum_k q[n, b, k] * xq[m, b, k] + m[n, b] * sum_k xq[m, b, k])
// with 4-bit weights (w = d * q + m, q in 0..15, m absent for 8-bit weights, q in [-127, 127]).
// act_levels = 2 (the LM head's input) adds a second int8 level holding what the first rounded off,
// in 256ths of its step: about 15 bits an activation instead of 8, for twice the integer products.
//
// Every output element is computed by the same instructions in the same order whatever the number of
// rows and wherever a row falls in the batch, so a row's result depends on that row alone (built with
// -ffp-contract=off: the only fused multiply-adds are the explicit ones, the same in every template).
// A tile of four weight rows is unpacked once for two activation rows, read from memory for the first
// two and from cache for the next ones; a block's integer sums are added across lanes in integers, so
// one float multiply-add per block scales the four products of an activation row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
};

void quantize_rows(const float* x, int64_t M, int64_t K, bool two_levels, Quantized& out) {
  const int64_t nb = K / kBlock;
  out.q.resize(M * K);
  out.q2.resize(two_levels ? M * K : 0);
  out.dx.resize(M * nb);
  out.xs.resize(M * nb);
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x + i * kBlock;  // rows are contiguous: block i of the flat [M * nb]
      float amax = 0.f;
      for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int k = 0; k < kBlock; ++k) {
        const float q = std::nearbyint(v[k] * id);
        out.q[i * kBlock + k] = static_cast<int8_t>(q);
        if (two_levels) {
          const float q2 = std::min(127.f, std::max(-127.f, std::nearbyint((v[k] - q * d) * id * 256.f)));
          out.q2[i * kBlock + k] = static_cast<int8_t>(q2);
          sum += 256 * static_cast<int>(q) + static_cast<int>(q2);
        } else {
          sum += static_cast<int>(q);
        }
      }
      out.dx[i] = two_levels ? d / 256.f : d;
      out.xs[i] = out.dx[i] * static_cast<float>(sum);
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

// R activation rows (at most 2) against the 4 weight rows of a tile from n0 (nn of them real; the rest
// repeat the last one and are not written). Each block's 8 lanes of integer sums for a (row, weight row)
// pair are added up exactly in integers (vphaddd), so a row's four block sums, one per weight row, are
// one 4-lane vector: scaled by d * dx and added to the row's accumulator, 8 lanes = the four pairs twice
// (the lower and upper four lanes of the block). An output element's arithmetic is the same whatever R:
// its exact block sums, its own scale and accumulator lanes, and at the end lower + upper + offset.
template <int R, bool kFourBit, bool kTwoLevels>
void tile_rows(const Quantized& xq, int64_t m0, int64_t K, const uint8_t* qs, const float* dt, const float* mt,
               int64_t n0, int64_t nn, float* out, int64_t N) {
  const int64_t nb = K / kBlock;
  static_assert(R >= 1 && R <= 2, "accumulators beyond the registers");
  int64_t rows[kMaxTile];
  for (int r = 0; r < kMaxTile; ++r) rows[r] = n0 + std::min<int64_t>(r, nn - 1);
  __m256 acc[R];
  __m128 accm[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    accm[i] = _mm_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[kMaxTile];
#pragma GCC unroll 4
    for (int r = 0; r < kMaxTile; ++r) wv[r] = load_levels<kFourBit>(qs, K, rows[r], b);
    const __m128 dv = _mm_loadu_ps(dt + b * kMaxTile);
    const __m128 mv = kFourBit ? _mm_loadu_ps(mt + b * kMaxTile) : _mm_setzero_ps();
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i) {
      const int64_t m = m0 + i;
      const float dx = xq.dx[m * nb + b];
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + m * K + b * kBlock));
      __m256i xv2 = xv;
      if (kTwoLevels)
        xv2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q2.data() + m * K + b * kBlock));
      __m256i p32[kMaxTile];
#pragma GCC unroll 4
      for (int r = 0; r < kMaxTile; ++r) {
        p32[r] = block_sums<kFourBit>(wv[r], xv, ones);
        // 256 * (up to 4 * 127 * 127) + the second level's per lane; four lanes added below 2^31
        if (kTwoLevels) p32[r] = _mm256_add_epi32(_mm256_slli_epi32(p32[r], 8), block_sums<kFourBit>(wv[r], xv2, ones));
      }
      const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p32[0], p32[1]), _mm256_hadd_epi32(p32[2], p32[3]));
      const __m128 sv = _mm_mul_ps(dv, _mm_set1_ps(dx));  // the four weight rows' d * dx
      acc[i] = _mm256_fmadd_ps(_mm256_set_m128(sv, sv), _mm256_cvtepi32_ps(sums), acc[i]);
      if (kFourBit) accm[i] = _mm_fmadd_ps(mv, _mm_set1_ps(xq.xs[m * nb + b]), accm[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(16) float total[kMaxTile];
    const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    _mm_store_ps(total, _mm_add_ps(halves, accm[i]));
    for (int r = 0; r < std::min<int64_t>(kMaxTile, nn); ++r) out[(m0 + i) * N + n0 + r] = total[r];
  }
}

template <bool kFourBit, bool kTwoLevels>
void run_tiles(const Quantized& xq, int64_t M, int64_t K, int64_t N, const uint8_t* qs, const uint16_t* d,
               const uint16_t* m, float* out) {
  // four weight rows at a time, against two activation rows at a time: the weight rows' bytes read from
  // memory for the first two activation rows and from cache for the next ones
  const int64_t num_tiles = (N + kMaxTile - 1) / kMaxTile;
  const int64_t nb = K / kBlock;
  at::parallel_for(0, num_tiles, 8, [&](int64_t begin, int64_t end) {
    // the tile's block scales and offsets in float32, [nb][kMaxTile]
    std::vector<float> dt(nb * kMaxTile, 0.f), mt(nb * kMaxTile, 0.f);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kMaxTile, nn = std::min<int64_t>(kMaxTile, N - n0);
      for (int64_t r = 0; r < kMaxTile; ++r) {
        const int64_t row = n0 + std::min<int64_t>(r, nn - 1);
        for (int64_t b = 0; b < nb; ++b) {
          dt[b * kMaxTile + r] = half_to_float(d[row * nb + b]);
          if (kFourBit) mt[b * kMaxTile + r] = half_to_float(m[row * nb + b]);
        }
      }
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2) tile_rows<2, kFourBit, kTwoLevels>(xq, m0, K, qs, dt.data(), mt.data(), n0, nn, out, N);
      if (m0 < M) tile_rows<1, kFourBit, kTwoLevels>(xq, m0, K, qs, dt.data(), mt.data(), n0, nn, out, N);
    }
  });
}

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
  Quantized xq;
  quantize_rows(xc.data_ptr<float>(), M, K, two, xq);
  const auto* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  if (four_bit) {
    const at::Tensor mc = m->contiguous();
    TORCH_CHECK(mc.scalar_type() == at::kHalf && mc.sizes() == dc.sizes(), "block_mm: m is float16 like d");
    const auto* mp = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
    if (two) run_tiles<true, true>(xq, M, K, N, qp, dp, mp, out.data_ptr<float>());
    else run_tiles<true, false>(xq, M, K, N, qp, dp, mp, out.data_ptr<float>());
  } else if (two) {
    run_tiles<false, true>(xq, M, K, N, qp, dp, nullptr, out.data_ptr<float>());
  } else {
    run_tiles<false, false>(xq, M, K, N, qp, dp, nullptr, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_blocks, lib) {
  lib.def("block_mm(Tensor x, Tensor qs, Tensor d, Tensor? m, int act_levels) -> Tensor");
  lib.impl("block_mm", c10::DispatchKey::CPU, &block_mm);
}
