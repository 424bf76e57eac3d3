// The eager step's small ops, each one pass over its rows instead of torch's chain of elementwise ops
// (an output tensor, a read and a write per op): the residual add + RMSNorm, the rotate-half rotary
// embedding of q and k, and SiLU(gate) * up. Float32 in and out, AVX-512F, rows split over torch's
// threads.
//
// Every output row is a function of its own input row alone (a norm sums its row's squares in one
// fixed order, 16 lanes then the lanes in a fixed tree), so a row's bits do not depend on the batch,
// the chunking or the thread count. Against torch's ops: rotary is the same bits (each product and sum
// rounded as torch rounds it: built with -ffp-contract=off and no fused multiply-add there); the norm's
// sum of squares and SiLU's exponential are computed in our own order and polynomial, so they differ
// from torch's in the last bits (kernels/fused_cpu.py: the engine uses one or the other for a run).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd16.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using tandem_simd::exp16;
using tandem_simd::sum16;

constexpr int64_t kLanes = 16;



inline __mmask16 tail(int64_t n) { return static_cast<__mmask16>(n >= kLanes ? 0xFFFF : (1u << n) - 1); }

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1,
              what, ": float32 [T, H] with contiguous rows");
}

// (weight * (s * rsqrt(mean(s^2) + eps)), s) with s = x + residual (x alone without one): as
// kernels/rms_norm.py's reference, rounding after each product and the sum of squares in our order
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.scalar_type() == at::kFloat,
              "add_rms_norm: a float32 weight [H]");
  const bool has_res = residual.has_value();
  if (has_res) {
    check_rows(*residual, "add_rms_norm");
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm: the residual is x's shape");
  }
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({T, H}, x.options());
  at::Tensor sum = has_res ? at::empty({T, H}, x.options()) : x;
  const float* wp = w.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x.data_ptr<float>() + t * x.stride(0);
      const float* rr = has_res ? residual->data_ptr<float>() + t * residual->stride(0) : nullptr;
      float* sr = sum.data_ptr<float>() + t * sum.stride(0);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < H; c += kLanes) {
        const __mmask16 m = tail(H - c);
        __m512 v = _mm512_maskz_loadu_ps(m, xr + c);
        if (has_res) {
          v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, rr + c));
          _mm512_mask_storeu_ps(sr + c, m, v);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      // torch's mean is the sum over H; rsqrt is 1 / sqrt, each rounded
      const float inv = 1.0f / std::sqrt(sum16(acc) / static_cast<float>(H) + feps);
      const __m512 vi = _mm512_set1_ps(inv);
      float* o = out.data_ptr<float>() + t * H;
      for (int64_t c = 0; c < H; c += kLanes) {
        const __mmask16 m = tail(H - c);
        const __m512 v = _mm512_maskz_loadu_ps(m, sr + c);
        _mm512_mask_storeu_ps(o + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wp + c), _mm512_mul_ps(v, vi)));
      }
    }
  });
  return {out, sum};
}

// rotate-half rotary of one head row: (x1 c - x2 s, x2 c + x1 s), each product and sum rounded
inline void rotate(const float* x, const float* c, const float* s, float* o, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const __mmask16 m = tail(half - i);
    const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i), x2 = _mm512_maskz_loadu_ps(m, x + half + i);
    const __m512 vc = _mm512_maskz_loadu_ps(m, c + i), vs = _mm512_maskz_loadu_ps(m, s + i);
    _mm512_mask_storeu_ps(o + i, m, _mm512_sub_ps(_mm512_mul_ps(x1, vc), _mm512_mul_ps(x2, vs)));
    _mm512_mask_storeu_ps(o + half + i, m, _mm512_add_ps(_mm512_mul_ps(x2, vc), _mm512_mul_ps(x1, vs)));
  }
}

void check_heads(const at::Tensor& t, int64_t T, int64_t D) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.size(0) == T && t.size(2) == D &&
                  t.stride(2) == 1 && t.stride(1) == D,
              "rotary: q and k float32 [T, heads, D], each head's values contiguous");
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  check_heads(q, T, D);
  check_heads(k, T, D);
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == half && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary: float32 cos and sin [T, D/2]");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qo = at::empty({T, q.size(1), D}, q.options()), ko = at::empty({T, k.size(1), D}, k.options());
  const int64_t hq = q.size(1), hk = k.size(1);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cc.data_ptr<float>() + t * half;
      const float* s = sc.data_ptr<float>() + t * half;
      for (int64_t h = 0; h < hq; ++h)
        rotate(q.data_ptr<float>() + t * q.stride(0) + h * D, c, s, qo.data_ptr<float>() + (t * hq + h) * D, half);
      for (int64_t h = 0; h < hk; ++h)
        rotate(k.data_ptr<float>() + t * k.stride(0) + h * D, c, s, ko.data_ptr<float>() + (t * hk + h) * D, half);
    }
  });
  return {qo, ko};
}

// SiLU(gate) * up of [T, 2I] rows (gate the first I values, up the last I): gate / (1 + e^-gate), times up
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: an even number of columns");
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gate_up.data_ptr<float>() + t * gate_up.stride(0);
      float* o = out.data_ptr<float>() + t * I;
      for (int64_t i = 0; i < I; i += kLanes) {
        const __mmask16 m = tail(I - i);
        const __m512 vg = _mm512_maskz_loadu_ps(m, g + i), vu = _mm512_maskz_loadu_ps(m, g + I + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), vg));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_div_ps(vg, _mm512_add_ps(one, e)), vu));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_fused, lib) {
  lib.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  lib.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
  lib.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  lib.impl("rotary", c10::DispatchKey::CPU, &rotary);
  lib.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}
