// AVX-512 + AVX512_BF16 build: the fp32/fp64 kernels of kernel_impl.h plus bf16-input kernels
// whose GEMMs use vdpbf16ps (two bf16 products per fp32 lane per instruction, fp32
// accumulation: twice the fp32-FMA rate). Only called after a runtime CPU check.
//
// bf16 operand layouts (prepared by the host, all zero padded; "pairs" are two consecutive
// bf16 along the GEMM reduction index packed in one 32-bit word, lower half first):
//   q   [B, Hq, Sqp, Dp]      bf16 row-major, NOT pre-scaled (S is scaled in fp32)
//   kt  [B, Hk, nkt, Dp/2, Bk] 32-bit pairs (k[j][2d'], k[j][2d'+1]), per key tile -> S = Q K^T
//   v   [B, Hk, Skp/2, Dv, 2] pairs (v[2j'][d], v[2j'+1][d])          -> O += P V
//   k   [B, Hk, Skp/2, Dp, 2] pairs along keys                        -> dQ += dS K
//   vt  [B, Hk, nkt, Dv/2, Bk] 32-bit pairs (v[j][2d'], v[j][2d'+1]), per key tile -> dP = dO V^T
//   qv  [B, Hq, Sqp/2, Dp, 2] pairs along queries                     -> dK += dS^T Q
//   dout[B, Hq, Sqp, Dv]      bf16 row-major                          -> dP = dO V^T
//   dov [B, Hq, Sqp/2, Dv, 2] pairs along queries                     -> dV += P^T dO
// P and dS are rounded to bf16 for the P V, P^T dO, dS K and dS^T Q products (as GPU flash
// attention does); softmax statistics, S, dP and all accumulators stay fp32. dk comes out as
// sum dS^T q (unscaled q): the host multiplies it by `scale`, not ln 2.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention/kernel_api.h"

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 10)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,bmi2,popcnt")
#define HP_NS isa_avx512bf16
#define HP_VB 64
#define HP_MR 4
#define HP_NVMAX 6
#include "attention/kernel_impl.h"

namespace hp_attn {
namespace HP_NS {
namespace {

// C[MR x NV*16] (+)= sum_k' A32(m, k') . B32[k'][n]   (vdpbf16ps over bf16 pairs)
//   A32(m, k') = TA ? A[k' * lda + m] : A[m * lda + k']   (32-bit pair broadcasts)
template <int MR, int NV, bool TA, bool ACC>
__attribute__((noinline)) void micro_bf16(int K2, const uint32_t* __restrict A, int64_t lda,
                                          const uint32_t* __restrict B, int64_t ldb,
                                          float* __restrict C, int64_t ldc) {
  __m512 c[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) c[m][v] = ACC ? _mm512_loadu_ps(C + m * ldc + v * 16) : _mm512_setzero_ps();
  for (int k = 0; k < K2; ++k) {
    __m512bh b[NV];
    const uint32_t* bk = B + (int64_t)k * ldb;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bk + v * 16);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const uint32_t a32 = TA ? A[(int64_t)k * lda + m] : A[(int64_t)m * lda + k];
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)a32);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) c[m][v] = _mm512_dpbf16_ps(c[m][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + m * ldc + v * 16, c[m][v]);
}

template <bool TA, bool ACC, int NV>
inline void micro_bf16_dispatch(int nb, int K2, const uint32_t* A, int64_t lda,
                                const uint32_t* B, int64_t ldb, float* C, int64_t ldc) {
  if (nb == NV) {
    micro_bf16<HP_MR, NV, TA, ACC>(K2, A, lda, B, ldb, C, ldc);
  } else if constexpr (NV > 1) {
    micro_bf16_dispatch<TA, ACC, NV - 1>(nb, K2, A, lda, B, ldb, C, ldc);
  }
}

// C[M x N] (+)= A[M x 2*K2] B[2*K2 x N]; M % HP_MR == 0, N % 16 == 0; lda / ldb in 32-bit units.
template <bool TA, bool ACC>
void gemm_bf16(int M, int N, int K2, const uint32_t* A, int64_t lda, const uint32_t* B,
               int64_t ldb, float* C, int64_t ldc) {
  const int nvt = N / 16;
  for (int n0 = 0; n0 < nvt;) {
    const int left = nvt - n0;
    const int nblk = (left + HP_NVMAX - 1) / HP_NVMAX;
    const int nb = (left + nblk - 1) / nblk;
    for (int m0 = 0; m0 < M; m0 += HP_MR) {
      const uint32_t* Am = TA ? A + m0 : A + (int64_t)m0 * lda;
      micro_bf16_dispatch<TA, ACC, HP_NVMAX>(nb, K2, Am, lda, B + n0 * 16, ldb,
                                             C + (int64_t)m0 * ldc + n0 * 16, ldc);
    }
    n0 += nb;
  }
}

// fp32 rows [R x N] -> bf16 row-major (as 32-bit pairs along N), N % 32 == 0
inline void rows_to_bf16(const float* src, int R, int N, uint32_t* dst) {
  for (int i = 0; i < R; ++i) {
    const float* s = src + (int64_t)i * N;
    uint32_t* d = dst + (int64_t)i * (N / 2);
    for (int j = 0; j < N; j += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j));
      _mm512_storeu_si512(d + j / 2, (__m512i)h);
    }
  }
}

// fp32 rows [R x N] (R even) -> 32-bit pairs along rows: dst[i'][n] = (src[2i'][n], src[2i'+1][n])
inline void rows_to_bf16_pairs(const float* src, int R, int N, uint32_t* dst) {
  for (int i = 0; i < R; i += 2) {
    const float* s0 = src + (int64_t)i * N;
    const float* s1 = s0 + N;
    uint32_t* d = dst + (int64_t)(i / 2) * N;
    for (int j = 0; j < N; j += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s0 + j)));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s1 + j)));
      _mm512_storeu_si512(d + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

inline void scale_rows(float* S, int n, float c) {
  const __m512 cv = _mm512_set1_ps(c);
  for (int j = 0; j < n; j += 16) _mm512_storeu_ps(S + j, _mm512_mul_ps(_mm512_loadu_ps(S + j), cv));
}

void fwd_bf16(const FwdArgs& a) {
  typedef VecT<float>::V V;
  constexpr int L = 16;
  constexpr int Bk = kTileK;
  const int Bq = (int)a.Bq, Dp = (int)a.Dp, Dv = (int)a.Dv;
  float* S = scratch_alloc<float>((int64_t)Bq * Bk);
  uint32_t* Pb = scratch_alloc<uint32_t>((int64_t)Bq * Bk / 2);
  float* O = scratch_alloc<float>((int64_t)Bq * Dv);
  float* mrow = scratch_alloc<float>(Bq);
  V* lvec = static_cast<V*>(static_cast<void*>(scratch_alloc<float>((int64_t)Bq * L)));
  if (!S || !Pb || !O || !mrow || !lvec) __builtin_trap();
  const int64_t g = a.kv_group, goff = a.kv_offset;
  const float ninf = -__builtin_inff();
  const float sscale = (float)a.sscale;
  const bool softcap = a.softcap2 > 0;
  // S stays unscaled (raw q.k) when sscale > 0 and there is no softcap / ALiBi: max(c*S) = c*max(S)
  // and the scale is fused into the exponent; otherwise S is scaled up front.
  const bool prescale = !(sscale > 0) || softcap || a.alibi2;
  const float cexp = prescale ? 1.0f : sscale;  // factor still to apply to S in the exponent
  const TileGemmFn xg = a.ext_gemm;  // AMX brgemm when the host found it (see kernel_api.h)
  for (;;) {
    const int64_t it = __atomic_fetch_add(a.counter, 1, __ATOMIC_RELAXED);
    if (it >= a.nitems) break;
    const int64_t item = a.order[it];
    const int64_t qt = item % a.nqt;
    const int64_t bh = item / a.nqt;
    const int64_t h = bh % a.Hq, b = bh / a.Hq, kvh = (h + goff) / g;
    const uint32_t* Q = static_cast<const uint32_t*>(a.q) + ((bh * a.Sqp) + qt * Bq) * Dp / 2;
    const uint32_t* KT = static_cast<const uint32_t*>(a.kt) + (b * a.Hk + kvh) * (Dp / 2) * a.Skp;
    const uint32_t* Vv = static_cast<const uint32_t*>(a.v) + (b * a.Hk + kvh) * (a.Skp / 2) * Dv;
    const TileInfo& qi = a.qti[b * a.nqt + qt];
    const int32_t* qp = a.qpos + b * a.Sqp + qt * Bq;
    const int32_t* qd = a.qdoc + b * a.Sqp + qt * Bq;
    const int32_t* kp = a.kpos + b * a.Skp;
    const int32_t* kd = a.kdoc + b * a.Skp;
    zero_buf(O, (int64_t)Bq * Dv);
    for (int i = 0; i < Bq; ++i) {
      mrow[i] = ninf;
      lvec[i] = V{};  // per-lane partial row sums, reduced once at the end
    }
    for (int64_t kt = 0; kt < a.nkt; ++kt) {
      const int cls = classify(qi, a.kti[b * a.nkt + kt], a.causal, a.window, a.qblk != nullptr);
      if (cls == kTileSkip) continue;
      if (xg)
        xg(Bq, Bk, Dp, Q, Dp, KT + kt * Bk * (Dp / 2), Bk, S, Bk, 0);
      else
        gemm_bf16<false, false>(Bq, Bk, Dp / 2, Q, Dp / 2, KT + kt * Bk * (Dp / 2), Bk, S, Bk);
      if (prescale) scale_rows(S, Bq * Bk, sscale);
      if (softcap) softcap_tile<float>(S, (int64_t)Bq * Bk, (float)a.softcap2, nullptr);
      if (a.alibi2)
        add_alibi<float>(S, Bq, Bk, qp, kp + kt * Bk, static_cast<const float*>(a.alibi2)[h]);
      if (cls == kTilePartial)
        apply_mask(S, Bq, Bk, qp, qd, kp + kt * Bk, kd + kt * Bk, a.causal, a.window,
                   blk_at(a.qblk, b * a.Sqp + qt * Bq), blk_at(a.kblk, b * a.Skp + kt * Bk));
      const bool any = softmax_tile<float, true>(S, Bq, mrow, lvec, O, Dv, cexp);
      if (!any) continue;
      rows_to_bf16(S, Bq, Bk, Pb);
      if (xg)
        xg(Bq, Dv, Bk, Pb, Bk, Vv + (kt * Bk / 2) * Dv, Dv, O, Dv, 1);
      else
        gemm_bf16<false, true>(Bq, Dv, Bk / 2, Pb, Bk / 2, Vv + (kt * Bk / 2) * Dv, Dv, O, Dv);
    }
    float* out = static_cast<float*>(a.out) + ((bh * a.Sqp) + qt * Bq) * Dv;
    float* lse = static_cast<float*>(a.lse) + bh * a.Sqp + qt * Bq;
    const float* sink2 = a.sink2 ? static_cast<const float*>(a.sink2) + h : nullptr;
    for (int i = 0; i < Bq; ++i)
      finish_row<float>(out + (int64_t)i * Dv, O + (int64_t)i * Dv, Dv, mrow[i],
                        hsum<float>(lvec[i]), sink2, lse[i]);
  }
  if (xg && a.ext_release) a.ext_release();
  free(S);
  free(Pb);
  free(O);
  free(mrow);
  free(lvec);
}

void bwd_bf16(const BwdArgs& a) {
  typedef VecT<float>::V V;
  constexpr int L = 16;
  constexpr int Bk = kTileK;
  const int Bq = (int)a.Bq, Dp = (int)a.Dp, Dv = (int)a.Dv;
  float* P = scratch_alloc<float>((int64_t)Bq * Bk);
  float* dS = scratch_alloc<float>((int64_t)Bq * Bk);
  uint32_t* PT = scratch_alloc<uint32_t>((int64_t)Bq * Bk / 2);
  uint32_t* dSb = scratch_alloc<uint32_t>((int64_t)Bq * Bk / 2);
  uint32_t* dST = scratch_alloc<uint32_t>((int64_t)Bq * Bk / 2);
  float* dK = scratch_alloc<float>((int64_t)Bk * Dp);
  float* dV = scratch_alloc<float>((int64_t)Bk * Dv);
  if (!P || !dS || !PT || !dSb || !dST || !dK || !dV) __builtin_trap();
  const int64_t g = a.kv_group, goff = a.kv_offset;
  const float sscale = (float)a.sscale;
  const bool softcap = a.softcap2 > 0;
  const bool prescale = !(sscale > 0) || softcap || a.alibi2;  // see fwd_bf16
  const V cv = vsplat<float>(prescale ? 1.0f : sscale);  // factor still to apply in the exponent
  float* G = softcap ? scratch_alloc<float>((int64_t)Bq * Bk) : nullptr;  // 1 - tanh^2
  if (softcap && !G) __builtin_trap();
  // With the AMX provider dK / dV hold dK^T, dV^T [Dp x Bk] (= Q^T dS, dO^T P from the host's
  // per-tile transposed q / dout), transposed once per key tile.
  const TileGemmFn xg = a.ext_gemm;
  for (;;) {
    const int64_t it = __atomic_fetch_add(a.counter, 1, __ATOMIC_RELAXED);
    if (it >= a.nitems) break;
    const int64_t c = it % a.nc;
    const int64_t bkv = it / a.nc;
    const int64_t kvh = bkv % a.Hk, b = bkv / a.Hk;
    int64_t h0, h_end;  // the query heads that read KV head kvh
    kv_query_heads(kvh, g, goff, a.Hq, &h0, &h_end);
    const uint32_t* KT = static_cast<const uint32_t*>(a.kt) + bkv * (Dp / 2) * a.Skp;
    const uint32_t* VT = static_cast<const uint32_t*>(a.vt) + bkv * (Dv / 2) * a.Skp;
    const uint32_t* Kv = static_cast<const uint32_t*>(a.k) + bkv * (a.Skp / 2) * Dp;
    const int32_t* qpb = a.qpos + b * a.Sqp;
    const int32_t* qdb = a.qdoc + b * a.Sqp;
    const int32_t* kp = a.kpos + b * a.Skp;
    const int32_t* kd = a.kdoc + b * a.Skp;
    for (int64_t kt = c; kt < a.nkt; kt += a.nc) {
      zero_buf(dK, (int64_t)Bk * Dp);
      zero_buf(dV, (int64_t)Bk * Dv);
      const TileInfo& ki = a.kti[b * a.nkt + kt];
      for (int64_t h = h0; h < h_end && ki.any; ++h) {
        const int64_t bh = b * a.Hq + h;
        for (int64_t qt = 0; qt < a.nqt; ++qt) {
          const int cls = classify(a.qti[b * a.nqt + qt], ki, a.causal, a.window, a.qblk != nullptr);
          if (cls == kTileSkip) continue;
          const int64_t row0 = bh * a.Sqp + qt * Bq;
          const uint32_t* Q = static_cast<const uint32_t*>(a.q) + row0 * Dp / 2;
          const uint32_t* Qv = xg ? nullptr : static_cast<const uint32_t*>(a.qv) + (row0 / 2) * Dp;
          const uint16_t* Qt = xg ? static_cast<const uint16_t*>(a.qt) + row0 * Dp : nullptr;
          const uint16_t* dOt = xg ? static_cast<const uint16_t*>(a.dot) + row0 * Dv : nullptr;
          const uint32_t* dO = static_cast<const uint32_t*>(a.dout) + row0 * Dv / 2;
          const uint32_t* dOv = xg ? nullptr : static_cast<const uint32_t*>(a.dov) + (row0 / 2) * Dv;
          const float* lse2 = static_cast<const float*>(a.lse2) + row0;
          const float* delta = static_cast<const float*>(a.delta) + row0;
          float* dQ = static_cast<float*>(a.dq_part) + (c * a.B * a.Hq * a.Sqp + row0) * Dp;
          if (xg)
            xg(Bq, Bk, Dp, Q, Dp, KT + kt * Bk * (Dp / 2), Bk, P, Bk, 0);
          else
            gemm_bf16<false, false>(Bq, Bk, Dp / 2, Q, Dp / 2, KT + kt * Bk * (Dp / 2), Bk, P, Bk);
          if (prescale) scale_rows(P, Bq * Bk, sscale);
          if (softcap) softcap_tile<float>(P, (int64_t)Bq * Bk, (float)a.softcap2, G);
          if (a.alibi2)
            add_alibi<float>(P, Bq, Bk, qpb + qt * Bq, kp + kt * Bk,
                             static_cast<const float*>(a.alibi2)[h]);
          if (cls == kTilePartial)
            apply_mask(P, Bq, Bk, qpb + qt * Bq, qdb + qt * Bq, kp + kt * Bk, kd + kt * Bk,
                       a.causal, a.window, blk_at(a.qblk, b * a.Sqp + qt * Bq),
                       blk_at(a.kblk, b * a.Skp + kt * Bk));
          for (int i = 0; i < Bq; ++i) {  // P = 2^(c * S - lse2); masked -inf * c>0 -> 0
            float* p = P + (int64_t)i * Bk;
            const V lv = vsplat<float>(lse2[i]);
            for (int j = 0; j < Bk; j += L)
              vstore<float>(p + j, vexp2(vload<float>(p + j) * cv - lv));
          }
          // dV += P^T dO
          rows_to_bf16_pairs(P, Bq, Bk, PT);
          if (xg)
            xg(Dv, Bk, Bq, dOt, Bq, PT, Bk, dV, Bk, 1);  // dV^T += dO^T P
          else
            gemm_bf16<true, true>(Bk, Dv, Bq / 2, PT, Bk, dOv, Dv, dV, Dv);
          // dP = dO V^T ; dS = P * (dP - delta)
          if (xg)
            xg(Bq, Bk, Dv, dO, Dv, VT + kt * Bk * (Dv / 2), Bk, dS, Bk, 0);
          else
            gemm_bf16<false, false>(Bq, Bk, Dv / 2, dO, Dv / 2, VT + kt * Bk * (Dv / 2), Bk, dS, Bk);
          for (int i = 0; i < Bq; ++i) {
            float* ds = dS + (int64_t)i * Bk;
            const float* p = P + (int64_t)i * Bk;
            const V dv = vsplat<float>(delta[i]);
            for (int j = 0; j < Bk; j += L)
              vstore<float>(ds + j, vload<float>(p + j) * (vload<float>(ds + j) - dv));
            if (G) {  // through the softcap: d raw = d capped * (1 - tanh^2)
              const float* gr = G + (int64_t)i * Bk;
              for (int j = 0; j < Bk; j += L)
                vstore<float>(ds + j, vload<float>(ds + j) * vload<float>(gr + j));
            }
          }
          // dQ_part += dS K ; dK += dS^T Q
          rows_to_bf16(dS, Bq, Bk, dSb);
          rows_to_bf16_pairs(dS, Bq, Bk, dST);
          if (xg) {
            xg(Bq, Dp, Bk, dSb, Bk, Kv + (kt * Bk / 2) * Dp, Dp, dQ, Dp, 1);
            xg(Dp, Bk, Bq, Qt, Bq, dST, Bk, dK, Bk, 1);  // dK^T += Q^T dS
          } else {
            gemm_bf16<false, true>(Bq, Dp, Bk / 2, dSb, Bk / 2, Kv + (kt * Bk / 2) * Dp, Dp, dQ, Dp);
            gemm_bf16<true, true>(Bk, Dp, Bq / 2, dST, Bk, Qv, Dp, dK, Dp);
          }
        }
      }
      store_dkdv<float>(a, bkv, kt, dK, dV, xg != nullptr);
    }
  }
  if (xg && a.ext_release) a.ext_release();
  free(P);
  free(dS);
  free(PT);
  free(dSb);
  free(dST);
  free(dK);
  free(dV);
  free(G);
}

}  // namespace
}  // namespace HP_NS
}  // namespace hp_attn
#pragma GCC pop_options

namespace hp_attn {
const KernelTable* kernels_avx512bf16() {
  static const KernelTable table = {"avx512bf16",     HP_NS::fwd_f32, HP_NS::fwd_f64,
                                    HP_NS::bwd_f32,   HP_NS::bwd_f64, HP_NS::fwd_bf16,
                                    HP_NS::bwd_bf16};
  return &table;
}
}  // namespace hp_attn
#else
namespace hp_attn {
const KernelTable* kernels_avx512bf16() { return nullptr; }
}  // namespace hp_attn
#endif
