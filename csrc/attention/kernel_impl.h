// Flash-style CPU attention kernels, written once with GCC vector extensions and compiled per
// ISA by kernel_{avx512,avx2,base}.cpp. Torch-free on purpose (see kernel_api.h).
//
// Before including this file a translation unit must
//   * include <cstdint>, <cstdlib>, <cstring> and kernel_api.h (outside any target pragma),
//   * define HP_NS (namespace for this ISA), HP_VB (vector bytes: 64 / 32 / 16),
//     HP_MR (micro-kernel rows) and HP_NVMAX (max vectors per micro-kernel row),
//   * then switch on its `#pragma GCC target(...)`.
// Everything here lives in an anonymous namespace except the KernelTable accessor.
//
// Algorithm (per work item):
//   forward  : one query tile of one head; loop over key tiles that the tile summaries say can
//              be visible; S = Q K^T (log2 domain, Q pre-scaled), mask only partial tiles,
//              online softmax (running max m, running sum l), O += P V; O /= l at the end.
//   backward : one (batch, kv head, chunk of key tiles); for each key tile, for each query head
//              of the GQA group and each visible query tile, recompute S and P from Q, K and the
//              saved lse, then dV += P^T dO, dP = dO V^T, dS = P (dP - delta),
//              dQ_part[chunk] += dS K, dK += dS^T Q. dK / dV are private to the item, dQ
//              partials are private to the chunk, so there are no races and the result is
//              deterministic whatever the thread count or scheduling.

#ifndef HP_NS
#error "define HP_NS before including kernel_impl.h"
#endif

namespace hp_attn {
namespace HP_NS {
namespace {

template <typename T>
struct VecT;

template <typename T>
struct IsF32 {
  static constexpr bool value = false;
};
template <>
struct IsF32<float> {
  static constexpr bool value = true;
};

// Transposed copy of a row-major [R x C] block into [C x R] (dst row stride ldd), times `mul`.
template <typename T>
inline void transpose_block(const T* __restrict src, int R, int C, T* __restrict dst, int64_t ldd,
                            T mul) {
  for (int r0 = 0; r0 < R; r0 += 16)
    for (int c0 = 0; c0 < C; c0 += 16)
      for (int c = c0; c < c0 + 16 && c < C; ++c)
        for (int r = r0; r < r0 + 16 && r < R; ++r)
          dst[(int64_t)c * ldd + r] = src[(int64_t)r * C + c] * mul;
}

template <>
struct VecT<float> {
  typedef float V __attribute__((vector_size(HP_VB)));
  typedef float VU __attribute__((vector_size(HP_VB), aligned(4)));
  typedef int32_t I __attribute__((vector_size(HP_VB)));
  static constexpr int L = HP_VB / 4;
};

template <>
struct VecT<double> {
  typedef double V __attribute__((vector_size(HP_VB)));
  typedef double VU __attribute__((vector_size(HP_VB), aligned(8)));
  typedef int64_t I __attribute__((vector_size(HP_VB)));
  static constexpr int L = HP_VB / 8;
};

template <typename T>
inline typename VecT<T>::V vload(const T* p) {
  return *reinterpret_cast<const typename VecT<T>::VU*>(p);
}
template <typename T>
inline void vstore(T* p, typename VecT<T>::V x) {
  *reinterpret_cast<typename VecT<T>::VU*>(p) = x;
}
template <typename T>
inline typename VecT<T>::V vsplat(T x) {
  typename VecT<T>::V v = {};
  return v + x;
}

template <typename T>
inline T neg_inf() {
  return -__builtin_inf();
}
// Horizontal max / sum of one vector by halving (log2(L) dependent steps). Where the compiler
// has __builtin_shufflevector (GCC >= 12, clang) the halves are lane shuffles that stay in
// registers; otherwise they go through memory.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HP_HAVE_SHUFFLEVECTOR 1
template <typename H, typename W, size_t... I>
inline H lower_half(W x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, I...);
}
template <typename H, typename W, size_t... I>
inline H upper_half(W x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, (I + sizeof...(I))...);
}
#endif
template <typename T, int N, typename W>
inline T hreduce(W x, bool is_max) {
  if constexpr (N == 1) {
    return x[0];
  } else {
    typedef T H __attribute__((vector_size(N / 2 * sizeof(T))));
#ifdef HP_HAVE_SHUFFLEVECTOR
    const H lo = lower_half<H>(x, std::make_index_sequence<N / 2>{});
    const H hi = upper_half<H>(x, std::make_index_sequence<N / 2>{});
#else
    H lo, hi;
    memcpy(&lo, &x, sizeof(H));
    memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(H), sizeof(H));
#endif
    return hreduce<T, N / 2>(is_max ? (lo > hi ? lo : hi) : lo + hi, is_max);
  }
}
template <typename T>
inline T hmax(typename VecT<T>::V x) {
  return hreduce<T, VecT<T>::L>(x, true);
}
template <typename T>
inline T hsum(typename VecT<T>::V x) {
  return hreduce<T, VecT<T>::L>(x, false);
}
template <typename T>
inline typename VecT<T>::V vmax(typename VecT<T>::V a, typename VecT<T>::V b) {
  return a > b ? a : b;
}

inline float sexp2(float x) { return __builtin_exp2f(x); }
inline double sexp2(double x) { return __builtin_exp2(x); }
inline float slog2(float x) { return __builtin_log2f(x); }
inline double slog2(double x) { return __builtin_log2(x); }

// 2^x for x <= 0 (x < -126, -inf included, -> 0; x > 127 is out of contract).
// fp32: Cody-Waite split + degree-6 polynomial, ~2 ulp. fp64 (gradcheck path): exact libm per lane.
inline VecT<float>::V vexp2(VecT<float>::V x) {
  typedef VecT<float>::V V;
  typedef VecT<float>::I I;
  // No range clamps: callers pass x <= ~0 (s - rowmax, s - lse), and every x < -126
  // (including -inf, whose intermediate bits are garbage) is replaced by 0 at the end.
  const V xc = x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: rounds to nearest integer
  V t = xc + magic;
  V n = t - magic;
  V f = xc - n;  // [-0.5, 0.5]
  V p = vsplat<float>(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  I e = ((I)t - (int32_t)0x4B400000) << 23;
  V r = (V)((I)p + e);
  const V zero = {};
  return x < -126.0f ? zero : r;
}
inline VecT<double>::V vexp2(VecT<double>::V x) {
  VecT<double>::V r;
  for (int i = 0; i < VecT<double>::L; ++i) r[i] = __builtin_exp2(x[i]);
  return r;
}

// ---------------------------------------------------------------------------------------
// Micro-GEMM: C[MR x NV*L] (+)= sum_k A(m, k) * B[k, :]
//   A(m, k) = TA ? A[k * lda + m] : A[m * lda + k]   (scalar broadcasts)
//   B rows contiguous (vector loads), row stride ldb; C row stride ldc.
template <typename T, int MR, int NV, bool TA, bool ACC>
__attribute__((noinline)) void micro(int K, const T* __restrict A, int64_t lda,
                                     const T* __restrict B, int64_t ldb, T* __restrict C,
                                     int64_t ldc) {
  typedef typename VecT<T>::V V;
  constexpr int L = VecT<T>::L;
  V c[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) c[m][v] = ACC ? vload<T>(C + m * ldc + v * L) : V{};
  for (int k = 0; k < K; ++k) {
    V b[NV];
    const T* bk = B + (int64_t)k * ldb;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = vload<T>(bk + v * L);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const T a = TA ? A[(int64_t)k * lda + m] : A[(int64_t)m * lda + k];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) c[m][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vstore<T>(C + m * ldc + v * L, c[m][v]);
}

template <typename T, bool TA, bool ACC, int NV>
inline void micro_dispatch(int nb, int K, const T* A, int64_t lda, const T* B, int64_t ldb,
                           T* C, int64_t ldc) {
  if (nb == NV) {
    micro<T, HP_MR, NV, TA, ACC>(K, A, lda, B, ldb, C, ldc);
  } else if constexpr (NV > 1) {
    micro_dispatch<T, TA, ACC, NV - 1>(nb, K, A, lda, B, ldb, C, ldc);
  }
}

// C[M x N] (+)= op(A)[M x K] * B[K x N]; M % HP_MR == 0, N % L == 0.
template <typename T, bool TA, bool ACC>
void gemm(int M, int N, int K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
          int64_t ldc) {
  constexpr int L = VecT<T>::L;
  const int nvt = N / L;
  for (int n0 = 0; n0 < nvt;) {
    const int left = nvt - n0;
    const int nblk = (left + HP_NVMAX - 1) / HP_NVMAX;
    const int nb = (left + nblk - 1) / nblk;
    for (int m0 = 0; m0 < M; m0 += HP_MR) {
      const T* Am = TA ? A + m0 : A + (int64_t)m0 * lda;
      micro_dispatch<T, TA, ACC, HP_NVMAX>(nb, K, Am, lda, B + n0 * L, ldb,
                                           C + (int64_t)m0 * ldc + n0 * L, ldc);
    }
    n0 += nb;
  }
}

// ---------------------------------------------------------------------------------------
// Tile-pair class from the tile summaries. `window` > 0 adds the left sliding window
// k_pos > q_pos - window: the pair is skipped when every key is at or before every query's
// window start, and full only when every key is inside every query's window. `blocks`: block
// ids are given, so a pair past the causal frontier is skipped only when the two tiles' block
// ranges cannot meet (a key there may share a query's image block).
inline bool blocks_meet(const TileInfo& q, const TileInfo& k) {
  return q.bmin <= k.bmax && k.bmin <= q.bmax;
}
inline int classify(const TileInfo& q, const TileInfo& k, int causal, int64_t window, bool blocks) {
  if (!q.any || !k.any) return kTileSkip;
  if (causal && k.pmin > q.pmax && !(blocks && blocks_meet(q, k))) return kTileSkip;
  if (window > 0 && (int64_t)k.pmax + window <= (int64_t)q.pmin) return kTileSkip;
  if (k.dmax < q.dmin || q.dmax < k.dmin) return kTileSkip;
  const bool one_doc = q.dmin == q.dmax && k.dmin == k.dmax && q.dmin == k.dmin;
  if (q.all && k.all && one_doc && (!causal || k.pmax <= q.pmin) &&
      (window <= 0 || (int64_t)k.pmin + window > (int64_t)q.pmax))
    return kTileFull;
  return kTilePartial;
}

// Block-id pointer at an offset, or null when there are no block ids.
inline const int32_t* blk_at(const int32_t* base, int64_t off) { return base ? base + off : nullptr; }

// S[i, j] = -inf where key j is invisible to query i. qb / kb (null, or block ids, -1 = none):
// key j is also visible past the causal frontier when qb[i] == kb[j] >= 0 (same doc and window).
template <typename T>
inline void apply_mask(T* S, int Bq, int Bk, const int32_t* qp, const int32_t* qd,
                       const int32_t* kp, const int32_t* kd, int causal, int64_t window,
                       const int32_t* qb = nullptr, const int32_t* kb = nullptr) {
  const T ninf = neg_inf<T>();
  if (causal && qb) {
    for (int i = 0; i < Bq; ++i) {
      T* s = S + (int64_t)i * Bk;
      const int32_t p = qp[i], d = qd[i], blk = qb[i];
      const int64_t lo = window > 0 ? (int64_t)p - window : (int64_t)INT32_MIN - 1;
      if (blk < 0) {
        for (int j = 0; j < Bk; ++j)
          s[j] = (kd[j] == d && kp[j] <= p && (int64_t)kp[j] > lo) ? s[j] : ninf;
      } else {
        for (int j = 0; j < Bk; ++j)
          s[j] = (kd[j] == d && (kp[j] <= p || kb[j] == blk) && (int64_t)kp[j] > lo) ? s[j] : ninf;
      }
    }
    return;
  }
  for (int i = 0; i < Bq; ++i) {
    T* s = S + (int64_t)i * Bk;
    const int32_t p = qp[i], d = qd[i];
    if (window > 0) {
      const int64_t lo = (int64_t)p - window;  // visible iff k_pos > lo
      if (causal) {
        for (int j = 0; j < Bk; ++j)
          s[j] = (kd[j] == d && kp[j] <= p && (int64_t)kp[j] > lo) ? s[j] : ninf;
      } else {
        for (int j = 0; j < Bk; ++j) s[j] = (kd[j] == d && (int64_t)kp[j] > lo) ? s[j] : ninf;
      }
    } else if (causal) {
      for (int j = 0; j < Bk; ++j) s[j] = (kd[j] == d && kp[j] <= p) ? s[j] : ninf;
    } else {
      for (int j = 0; j < Bk; ++j) s[j] = (kd[j] == d) ? s[j] : ninf;
    }
  }
}

// tanh for the softcap. fp32: odd Taylor polynomial for |x| < 1/8, else
// sign(x) (1 - e) / (1 + e) with e = 2^(-2 |x| log2 e) in (0, 1] (no overflow; +-inf -> +-1).
// fp64 (gradcheck path): libm per lane.
inline VecT<float>::V vtanh(VecT<float>::V x) {
  typedef VecT<float>::V V;
  const V zero = {};
  const V ax = x < zero ? -x : x;
  const V e = vexp2(ax * -2.8853900817779268f);  // -2 log2(e)
  const V one = vsplat<float>(1.0f);
  V t = (one - e) / (one + e);
  const V x2 = x * x;
  V p = vsplat<float>(-17.0f / 315.0f);
  p = p * x2 + 2.0f / 15.0f;
  p = p * x2 - 1.0f / 3.0f;
  p = p * x2 * x + x;
  t = x < zero ? -t : t;
  return ax < 0.125f ? p : t;
}
inline VecT<double>::V vtanh(VecT<double>::V x) {
  VecT<double>::V r;
  for (int i = 0; i < VecT<double>::L; ++i) r[i] = __builtin_tanh(x[i]);
  return r;
}

// ALiBi, in place before the mask (log2 domain): S[i, j] += slope2 * (k_pos[j] - q_pos[i]).
// Padding rows / keys get a finite bias and are masked afterwards (never in a full tile).
template <typename T>
inline void add_alibi(T* __restrict S, int Bq, int Bk, const int32_t* qp, const int32_t* kp,
                      T slope2) {
  for (int i = 0; i < Bq; ++i) {
    T* s = S + (int64_t)i * Bk;
    const int64_t p = qp[i];
    for (int j = 0; j < Bk; ++j) s[j] += slope2 * (T)((int64_t)kp[j] - p);
  }
}

// Softcap of n scores (n % L == 0) in place, log2 domain: S <- c tanh(S / c). With G, also
// G <- 1 - tanh^2 (d capped / d raw, for the backward). Applied before the mask.
template <typename T>
inline void softcap_tile(T* __restrict S, int64_t n, T c, T* __restrict G) {
  typedef typename VecT<T>::V V;
  constexpr int L = VecT<T>::L;
  const V cv = vsplat<T>(c), ic = vsplat<T>((T)1 / c), one = vsplat<T>((T)1);
  for (int64_t j = 0; j < n; j += L) {
    const V th = vtanh(vload<T>(S + j) * ic);
    vstore<T>(S + j, th * cv);
    if (G) vstore<T>(G + j, one - th * th);
  }
}

template <typename T>
T* scratch_alloc(int64_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, (size_t)(n > 0 ? n : 1) * sizeof(T)) != 0) return nullptr;
  return static_cast<T*>(p);
}

template <typename T>
inline void zero_buf(T* p, int64_t n) {
  memset(p, 0, (size_t)n * sizeof(T));
}

// ---------------------------------------------------------------------------------------
// Online-softmax step for one [Bq x kTileK] score tile S (log2 domain; multiplied by `c` first
// when kScaled), in place: per row m' = max(m, rowmax(c S)), S <- 2^(c S - m'),
// l <- l 2^(m - m') + rowsum (l kept per lane), O row *= 2^(m - m') when m grows. Rows that
// have seen nothing visible (m' = -inf) get S = 0. Each row is processed in registers (kTileK
// is a compile-time constant) with independent exp chains. Returns whether any row is non-zero
// (if not, the P V product can be skipped).
template <typename T, bool kScaled>
bool softmax_tile(T* __restrict S, int Bq, T* __restrict mrow, typename VecT<T>::V* __restrict lvec,
                  T* __restrict O, int Dp, T c) {
  typedef typename VecT<T>::V V;
  constexpr int L = VecT<T>::L, NV = kTileK / L;
  static_assert(kTileK % L == 0 && NV >= 2 && NV % 2 == 0, "kTileK must be an even number of vectors");
  const T ninf = neg_inf<T>();
  const V cv = vsplat<T>(c);
  bool any = false;
  for (int i = 0; i < Bq; ++i) {
    T* s = S + (int64_t)i * kTileK;
    V x[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) x[v] = kScaled ? vload<T>(s + v * L) * cv : vload<T>(s + v * L);
    V mx[NV / 2];
#pragma GCC unroll 16
    for (int v = 0; v < NV / 2; ++v) mx[v] = vmax<T>(x[2 * v], x[2 * v + 1]);
#pragma GCC unroll 16
    for (int w = NV / 4; w >= 1; w /= 2)
      for (int v = 0; v < w; ++v) mx[v] = vmax<T>(mx[v], mx[v + w]);
    const T rmax = hmax<T>(mx[0]);
    const T mold = mrow[i];
    const T mnew = rmax > mold ? rmax : mold;
    if (mnew == ninf) {  // nothing visible yet for this row
      zero_buf(s, kTileK);
      continue;
    }
    any = true;
    const V mv = vsplat<T>(mnew);
    V sum0 = {}, sum1 = {};
#pragma GCC unroll 16
    for (int v = 0; v < NV; v += 2) {
      const V p0 = vexp2(x[v] - mv), p1 = vexp2(x[v + 1] - mv);
      vstore<T>(s + v * L, p0);
      vstore<T>(s + (v + 1) * L, p1);
      sum0 += p0;
      sum1 += p1;
    }
    if (mnew != mold) {
      const T alpha = sexp2(mold - mnew);  // 0 when mold == -inf
      lvec[i] = lvec[i] * alpha + (sum0 + sum1);
      T* o = O + (int64_t)i * Dp;
      const V av = vsplat<T>(alpha);
      for (int d = 0; d < Dp; d += L) vstore<T>(o + d, vload<T>(o + d) * av);
      mrow[i] = mnew;
    } else {
      lvec[i] += sum0 + sum1;
    }
  }
  return any;
}

// Final normalisation of one output row from the running max m (log2 domain) and sum l:
// out = O / l, lse = ln 2 (m + log2 l), out = 0 / lse = -inf for a row that saw nothing. With a
// sink logit (sink2 non-null, log2 domain, may be -inf) the denominator also holds 2^sink2 (a
// key with no value): out = O 2^(m - M) / (l 2^(m - M) + 2^(sink2 - M)), M = max(m, sink2), and
// lse includes the sink (a row that saw no key gets out = 0, lse = sink).
template <typename T>
inline void finish_row(T* __restrict orow, const T* __restrict o, int Dp, T m, T l,
                       const T* sink2, T& lse) {
  typedef typename VecT<T>::V V;
  constexpr int L = VecT<T>::L;
  const T ln2 = (T)0.69314718055994530942;
  const T ninf = neg_inf<T>();
  if (!(l > 0)) {
    zero_buf(orow, Dp);
    lse = sink2 ? *sink2 * ln2 : ninf;
    return;
  }
  T inv = (T)1 / l, lse2 = m + slog2(l);
  if (sink2 && *sink2 != ninf) {
    const T M = m > *sink2 ? m : *sink2;
    const T am = sexp2(m - M);
    const T tot = l * am + sexp2(*sink2 - M);
    inv = am / tot;
    lse2 = M + slog2(tot);
  }
  const V iv = vsplat<T>(inv);
  for (int d = 0; d < Dp; d += L) vstore<T>(orow + d, vload<T>(o + d) * iv);
  lse = lse2 * ln2;
}

template <typename T>
void fwd_worker(const FwdArgs& a) {
  typedef typename VecT<T>::V V;
  constexpr int L = VecT<T>::L;
  constexpr int Bk = kTileK;
  const int Bq = (int)a.Bq, Dp = (int)a.Dp, Dv = (int)a.Dv;
  T* S = scratch_alloc<T>((int64_t)Bq * Bk);
  T* O = scratch_alloc<T>((int64_t)Bq * Dv);
  T* mrow = scratch_alloc<T>(Bq);
  V* lvec = static_cast<V*>(static_cast<void*>(scratch_alloc<T>((int64_t)Bq * L)));
  if (!S || !O || !mrow || !lvec) __builtin_trap();
  const int64_t g = a.kv_group, goff = a.kv_offset;
  const T ninf = neg_inf<T>();
  const TileGemmFn xg = IsF32<T>::value ? a.ext_gemm : nullptr;
  for (;;) {
    const int64_t it = __atomic_fetch_add(a.counter, 1, __ATOMIC_RELAXED);
    if (it >= a.nitems) break;
    const int64_t item = a.order[it];
    const int64_t qt = item % a.nqt;
    const int64_t bh = item / a.nqt;
    const int64_t h = bh % a.Hq, b = bh / a.Hq, kvh = (h + goff) / g;
    const T* Q = static_cast<const T*>(a.q) + ((bh * a.Sqp) + qt * Bq) * Dp;
    const T* KT = static_cast<const T*>(a.kt) + (b * a.Hk + kvh) * Dp * a.Skp;
    const T* Vv = static_cast<const T*>(a.v) + (b * a.Hk + kvh) * a.Skp * Dv;
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
        xg(Bq, Bk, Dp, Q, Dp, KT + kt * Bk * Dp, Bk, reinterpret_cast<float*>(S), Bk, 0);
      else
        gemm<T, false, false>(Bq, Bk, Dp, Q, Dp, KT + kt * Bk * Dp, Bk, S, Bk);
      if (a.softcap2 > 0) softcap_tile<T>(S, (int64_t)Bq * Bk, (T)a.softcap2, nullptr);
      if (a.alibi2)
        add_alibi<T>(S, Bq, Bk, qp, kp + kt * Bk, static_cast<const T*>(a.alibi2)[h]);
      if (cls == kTilePartial)
        apply_mask(S, Bq, Bk, qp, qd, kp + kt * Bk, kd + kt * Bk, a.causal, a.window,
                   blk_at(a.qblk, b * a.Sqp + qt * Bq), blk_at(a.kblk, b * a.Skp + kt * Bk));
      const bool any = softmax_tile<T, false>(S, Bq, mrow, lvec, O, Dv, T(1));
      if (any && xg)
        xg(Bq, Dv, Bk, S, Bk, Vv + kt * Bk * Dv, Dv, reinterpret_cast<float*>(O), Dv, 1);
      else if (any)
        gemm<T, false, true>(Bq, Dv, Bk, S, Bk, Vv + kt * Bk * Dv, Dv, O, Dv);
    }
    T* out = static_cast<T*>(a.out) + ((bh * a.Sqp) + qt * Bq) * Dv;
    T* lse = static_cast<T*>(a.lse) + bh * a.Sqp + qt * Bq;
    const T* sink2 = a.sink2 ? static_cast<const T*>(a.sink2) + h : nullptr;
    for (int i = 0; i < Bq; ++i)
      finish_row<T>(out + (int64_t)i * Dv, O + (int64_t)i * Dv, Dv, mrow[i], hsum<T>(lvec[i]),
                    sink2, lse[i]);
  }
  if (xg && a.ext_release) a.ext_release();
  free(S);
  free(O);
  free(mrow);
  free(lvec);
}

// Write one key tile's dK * dk_scale / dV (private to the work item) to the outputs
// [B, Hk, Skp, Dp]; `transposed`: the buffers hold dK^T / dV^T [Dp x Bk] (tile-GEMM provider).
template <typename T>
inline void store_dkdv(const BwdArgs& a, int64_t bkv, int64_t kt, const T* dK, const T* dV,
                       bool transposed) {
  constexpr int Bk = kTileK;
  const int Dp = (int)a.Dp, Dv = (int)a.Dv;
  T* dko = static_cast<T*>(a.dk) + (bkv * a.Skp + kt * Bk) * Dp;
  T* dvo = static_cast<T*>(a.dv) + (bkv * a.Skp + kt * Bk) * Dv;
  const T ks = (T)a.dk_scale;
  if (transposed) {
    transpose_block<T>(dK, Dp, Bk, dko, Dp, ks);
    transpose_block<T>(dV, Dv, Bk, dvo, Dv, T(1));
  } else {
    for (int64_t i = 0; i < (int64_t)Bk * Dp; ++i) dko[i] = dK[i] * ks;
    memcpy(dvo, dV, sizeof(T) * Bk * Dv);
  }
}

// ---------------------------------------------------------------------------------------
template <typename T>
void bwd_worker(const BwdArgs& a) {
  typedef typename VecT<T>::V V;
  constexpr int L = VecT<T>::L;
  constexpr int Bk = kTileK;
  const int Bq = (int)a.Bq, Dp = (int)a.Dp, Dv = (int)a.Dv;
  T* P = scratch_alloc<T>((int64_t)Bq * Bk);
  T* dS = scratch_alloc<T>((int64_t)Bq * Bk);
  T* dK = scratch_alloc<T>((int64_t)Bk * Dp);
  T* dV = scratch_alloc<T>((int64_t)Bk * Dv);
  T* G = a.softcap2 > 0 ? scratch_alloc<T>((int64_t)Bq * Bk) : nullptr;  // 1 - tanh^2
  if (!P || !dS || !dK || !dV || (a.softcap2 > 0 && !G)) __builtin_trap();
  const int64_t g = a.kv_group, goff = a.kv_offset;
  // With a tile-GEMM provider dK / dV hold the transposes dK^T, dV^T [Dp x Bk] (accumulated
  // as Q^T dS and dO^T P from the host's per-tile transposed q / dout), transposed at the end.
  const TileGemmFn xg = IsF32<T>::value ? a.ext_gemm : nullptr;
  float* const dKf = reinterpret_cast<float*>(dK);
  float* const dVf = reinterpret_cast<float*>(dV);
  float* const Pf = reinterpret_cast<float*>(P);
  float* const dSf = reinterpret_cast<float*>(dS);
  for (;;) {
    const int64_t it = __atomic_fetch_add(a.counter, 1, __ATOMIC_RELAXED);
    if (it >= a.nitems) break;
    const int64_t c = it % a.nc;
    const int64_t bkv = it / a.nc;
    const int64_t kvh = bkv % a.Hk, b = bkv / a.Hk;
    int64_t h0, h_end;  // the query heads that read KV head kvh
    kv_query_heads(kvh, g, goff, a.Hq, &h0, &h_end);
    const T* KT = static_cast<const T*>(a.kt) + bkv * Dp * a.Skp;
    const T* VT = static_cast<const T*>(a.vt) + bkv * Dv * a.Skp;
    const T* Kr = static_cast<const T*>(a.k) + bkv * a.Skp * Dp;
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
          const T* Q = static_cast<const T*>(a.q) + row0 * Dp;
          const T* dO = static_cast<const T*>(a.dout) + row0 * Dv;
          const T* lse2 = static_cast<const T*>(a.lse2) + row0;
          const T* delta = static_cast<const T*>(a.delta) + row0;
          T* dQ = static_cast<T*>(a.dq_part) + (c * a.B * a.Hq * a.Sqp + row0) * Dp;
          const T* Qt = xg ? static_cast<const T*>(a.qt) + row0 * Dp : nullptr;
          const T* dOt = xg ? static_cast<const T*>(a.dot) + row0 * Dv : nullptr;
          // S = Q K^T (log2 domain), P = 2^(S - lse2)
          if (xg)
            xg(Bq, Bk, Dp, Q, Dp, KT + kt * Bk * Dp, Bk, Pf, Bk, 0);
          else
            gemm<T, false, false>(Bq, Bk, Dp, Q, Dp, KT + kt * Bk * Dp, Bk, P, Bk);
          if (G) softcap_tile<T>(P, (int64_t)Bq * Bk, (T)a.softcap2, G);
          if (a.alibi2)
            add_alibi<T>(P, Bq, Bk, qpb + qt * Bq, kp + kt * Bk, static_cast<const T*>(a.alibi2)[h]);
          if (cls == kTilePartial)
            apply_mask(P, Bq, Bk, qpb + qt * Bq, qdb + qt * Bq, kp + kt * Bk, kd + kt * Bk,
                       a.causal, a.window, blk_at(a.qblk, b * a.Sqp + qt * Bq),
                       blk_at(a.kblk, b * a.Skp + kt * Bk));
          for (int i = 0; i < Bq; ++i) {
            T* p = P + (int64_t)i * Bk;
            const V lv = vsplat<T>(lse2[i]);
            for (int j = 0; j < Bk; j += L) vstore<T>(p + j, vexp2(vload<T>(p + j) - lv));
          }
          // dV += P^T dO   (provider: dV^T += dO^T P)
          if (xg)
            xg(Dv, Bk, Bq, dOt, Bq, Pf, Bk, dVf, Bk, 1);
          else
            gemm<T, true, true>(Bk, Dv, Bq, P, Bk, dO, Dv, dV, Dv);
          // dP = dO V^T ; dS = P * (dP - delta)
          if (xg)
            xg(Bq, Bk, Dv, dO, Dv, VT + kt * Bk * Dv, Bk, dSf, Bk, 0);
          else
            gemm<T, false, false>(Bq, Bk, Dv, dO, Dv, VT + kt * Bk * Dv, Bk, dS, Bk);
          for (int i = 0; i < Bq; ++i) {
            T* ds = dS + (int64_t)i * Bk;
            const T* p = P + (int64_t)i * Bk;
            const V dv = vsplat<T>(delta[i]);
            for (int j = 0; j < Bk; j += L)
              vstore<T>(ds + j, vload<T>(p + j) * (vload<T>(ds + j) - dv));
            if (G) {  // through the softcap: d raw = d capped * (1 - tanh^2)
              const T* gr = G + (int64_t)i * Bk;
              for (int j = 0; j < Bk; j += L) vstore<T>(ds + j, vload<T>(ds + j) * vload<T>(gr + j));
            }
          }
          // dQ_part += dS K ; dK += dS^T Q   (provider: dK^T += Q^T dS)
          if (xg) {
            xg(Bq, Dp, Bk, dSf, Bk, Kr + kt * Bk * Dp, Dp, reinterpret_cast<float*>(dQ), Dp, 1);
            xg(Dp, Bk, Bq, Qt, Bq, dSf, Bk, dKf, Bk, 1);
          } else {
            gemm<T, false, true>(Bq, Dp, Bk, dS, Bk, Kr + kt * Bk * Dp, Dp, dQ, Dp);
            gemm<T, true, true>(Bk, Dp, Bq, dS, Bk, Q, Dp, dK, Dp);
          }
        }
      }
      store_dkdv<T>(a, bkv, kt, dK, dV, xg != nullptr);
    }
  }
  if (xg && a.ext_release) a.ext_release();
  free(P);
  free(dS);
  free(dK);
  free(dV);
  free(G);
}

void fwd_f32(const FwdArgs& a) { fwd_worker<float>(a); }
void fwd_f64(const FwdArgs& a) { fwd_worker<double>(a); }
void bwd_f32(const BwdArgs& a) { bwd_worker<float>(a); }
void bwd_f64(const BwdArgs& a) { bwd_worker<double>(a); }

}  // namespace
}  // namespace HP_NS
}  // namespace hp_attn
