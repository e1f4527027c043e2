// CPU implementation and registration of the position-masked attention ops.
//
//   hyper_parallel::attn_fwd(q, k, v, q_pos, k_pos, q_doc?, k_doc?, causal, scale, window?,
//                            softcap?, sinks?, alibi_slopes?, kv_group?, kv_offset, q_block?,
//                            k_block?)
//       -> (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32 (float64 for float64 q))
//   hyper_parallel::attn_bwd(dout, dlse?, q, k, v, out, lse, q_pos, k_pos, q_doc?, k_doc?,
//                            causal, scale, <the same options>) -> (dq, dk, dv, dsinks)
//
// q [B, Hq, Sq, D], k / v [B, Hk, Sk, D]; query head h reads kv head (h + kv_offset) / kv_group
// (default: Hq % Hk == 0, kv_group = Hq / Hk, kv_offset = 0 -- plain GQA; see kv_map_arg).
// Positions: integer [S] (shared over the batch) or [B, S]. Documents: same
// shapes, optional (both or neither); block ids likewise. Key j is visible to query i iff
// (!causal || k_pos[j] <= q_pos[i] || (blocks && q_block[i] == k_block[j] >= 0))
//   && (no window || k_pos[j] > q_pos[i] - window)
//   && (no docs || (q_doc[i] == k_doc[j] && k_doc[j] >= 0)).
// Block ids mark a bidirectional span (one image's tokens, Gemma 3): transformers' window AND
// (causal OR same block).
// Queries that see no key get out = 0, lse = -inf and zero gradients.
//
// The host side here converts / pads / transposes the inputs once (O(S * D) extra memory, never
// O(Sq * Sk)), summarises positions per tile, and runs the ISA-specific workers from
// kernel_impl.h under at::parallel_for with a shared work queue. The backward recomputes the
// probabilities from q, k and the saved lse (no stored probability matrix).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "attention/kernel_api.h"

namespace hp_attn {
namespace {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;
constexpr int64_t kBlockK = kTileK;  // compile-time in the kernels (kernel_api.h)
constexpr int64_t kBlockQMax = 64;

bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

bool cpu_has_avx512bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

// HYPER_PARALLEL_ATTN_ISA = auto (default) | avx512bf16 | avx512 | avx2 | base selects the
// kernel build (avx512bf16 adds bf16 dot-product kernels for bf16 inputs; the others convert
// bf16 / fp16 inputs to fp32).
const KernelTable* select_kernels() {
  const char* env = std::getenv("HYPER_PARALLEL_ATTN_ISA");
  const std::string want = (env && *env) ? env : "auto";
  if (want == "avx512bf16") {
    TORCH_CHECK_VALUE(cpu_has_avx512bf16() && kernels_avx512bf16(),
                      "HYPER_PARALLEL_ATTN_ISA=avx512bf16 but this CPU/build has no AVX512_BF16 "
                      "kernels");
    return kernels_avx512bf16();
  }
  if (want == "avx512") {
    TORCH_CHECK_VALUE(cpu_has_avx512() && kernels_avx512(),
                      "HYPER_PARALLEL_ATTN_ISA=avx512 but this CPU/build has no AVX-512 kernels");
    return kernels_avx512();
  }
  if (want == "avx2") {
    TORCH_CHECK_VALUE(cpu_has_avx2() && kernels_avx2(),
                      "HYPER_PARALLEL_ATTN_ISA=avx2 but this CPU/build has no AVX2 kernels");
    return kernels_avx2();
  }
  if (want == "base") return kernels_base();
  TORCH_CHECK_VALUE(want == "auto",
                    "HYPER_PARALLEL_ATTN_ISA must be auto, avx512bf16, avx512, avx2 or base, got '",
                    want, "'");
  if (cpu_has_avx512bf16() && kernels_avx512bf16()) return kernels_avx512bf16();
  if (cpu_has_avx512() && kernels_avx512()) return kernels_avx512();
  if (cpu_has_avx2() && kernels_avx2()) return kernels_avx2();
  return kernels_base();
}

// ---------------------------------------------------------------------------------------
// Tile-GEMM provider: oneDNN brgemm through ATen's cpublas (the micro-kernel PyTorch's own CPU
// flash attention uses). It JITs for the running CPU: AVX-512 fp32, and AMX tiles for bf16 on
// CPUs that have them, which the built-in register-tiled kernels cannot match. The softmax,
// masking, tile skipping and scheduling stay ours; only the tile products are delegated.
//
// HYPER_PARALLEL_ATTN_GEMM = auto (default) | brgemm | builtin.
//   auto:    fp32 -> brgemm with the AVX-512 kernel builds; bf16 -> brgemm where AMX-BF16 is
//            present (else the avx512bf16 vdpbf16ps kernels); fp64 always builtin.
//   brgemm:  require it (error if this CPU / torch build cannot run it).
//   builtin: never use it.
void ext_gemm_f32(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                  int64_t ldb, float* C, int64_t ldc, int acc) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, acc != 0, static_cast<const float*>(A),
                              static_cast<const float*>(B), C, false);
}
void ext_release_f32() { at::native::cpublas::brgemm_release(false); }
void ext_gemm_bf16(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                   int64_t ldb, float* C, int64_t ldc, int acc) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, acc != 0,
                              static_cast<const at::BFloat16*>(A),
                              static_cast<const at::BFloat16*>(B), C, true);
}
void ext_release_bf16() { at::native::cpublas::brgemm_release(true); }

// One 16 x 32 x 32 product against a scalar reference; any exception or mismatch -> unusable.
bool probe_brgemm(bool bf16) {
  constexpr int M = 16, N = 32, K = 32;
  std::vector<float> a(M * K), b(K * N), c(M * N, 0.f), ref(M * N, 0.f);
  for (int i = 0; i < M * K; ++i) a[i] = (float)((i * 7) % 5 - 2);
  for (int i = 0; i < K * N; ++i) b[i] = (float)((i * 3) % 7 - 3);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) ref[m * N + n] += a[m * K + k] * b[k * N + n];
  try {
    if (bf16) {
      std::vector<at::BFloat16> ab(M * K), bv(K * N);  // bv: VNNI pairs [K/2][N][2]
      for (int i = 0; i < M * K; ++i) ab[i] = at::BFloat16(a[i]);
      for (int k = 0; k < K; ++k)
        for (int n = 0; n < N; ++n) bv[(k / 2) * N * 2 + n * 2 + (k % 2)] = at::BFloat16(b[k * N + n]);
      ext_gemm_bf16(M, N, K, ab.data(), K, bv.data(), N, c.data(), N, 0);
      ext_release_bf16();
    } else {
      ext_gemm_f32(M, N, K, a.data(), K, b.data(), N, c.data(), N, 0);
      ext_release_f32();
    }
  } catch (...) {
    return false;
  }
  for (int i = 0; i < M * N; ++i)
    if (c[i] != ref[i]) return false;  // small integers: exact in fp32 and bf16
  return true;
}

bool brgemm_f32_available() {
  static const bool ok = probe_brgemm(false);
  return ok;
}
bool brgemm_bf16_available() {
  static const bool ok = at::native::cpublas::could_pack(at::kBFloat16) && probe_brgemm(true);
  return ok;
}

// The provider for a call: `bf16` = the avx512bf16 bf16 kernels run (else fp32 / fp64 ones).
TileGemmFn select_gemm(const KernelTable* kt, at::ScalarType acc, bool bf16,
                       TileGemmReleaseFn* release) {
  *release = nullptr;
  const char* env = std::getenv("HYPER_PARALLEL_ATTN_GEMM");
  const std::string want = (env && *env) ? env : "auto";
  TORCH_CHECK_VALUE(want == "auto" || want == "brgemm" || want == "builtin",
                    "HYPER_PARALLEL_ATTN_GEMM must be auto, brgemm or builtin, got '", want, "'");
  if (want == "builtin" || acc == at::kDouble) return nullptr;
  const bool avail = bf16 ? brgemm_bf16_available() : brgemm_f32_available();
  if (want == "brgemm") {
    TORCH_CHECK_VALUE(avail, "HYPER_PARALLEL_ATTN_GEMM=brgemm but ATen's cpublas::brgemm is not usable "
                      "here for ", bf16 ? "bf16 (needs AMX-BF16)" : "fp32");
  } else {
    const std::string name = kt->name;
    if (!avail || name.rfind("avx512", 0) != 0) return nullptr;
  }
  *release = bf16 ? ext_release_bf16 : ext_release_f32;
  return bf16 ? ext_gemm_bf16 : ext_gemm_f32;
}

// Contiguous [B, H, S, D] (S a multiple of blk) -> [B, H, S/blk, D, blk]: transposed *per tile*,
// so each tile's transpose is one contiguous D x blk slab and the GEMMs read rows blk apart. (A
// plain [D, S] transpose puts consecutive rows S * elem bytes apart: at long S that is a
// power-of-two stride mapping every row to the same L1/L2 sets, and the kernels thrash.)
// Used for K^T / V^T per key tile and, with brgemm, Q^T / dO^T per query tile.
at::Tensor tile_transposed(const at::Tensor& x, int64_t blk) {
  return x.view({x.size(0), x.size(1), x.size(2) / blk, blk, x.size(3)}).transpose(3, 4).contiguous();
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------
// Argument checks (the Python front checks the same things first with nicer context; these
// protect direct torch.ops calls). TORCH_CHECK_VALUE raises ValueError in Python.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.dim() == 4, "attention: q must be [B, Hq, Sq, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, "attention: k must be [B, Hk, Sk, D], got ", k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4 && v.size(0) == k.size(0) && v.size(1) == k.size(1) &&
                        v.size(2) == k.size(2),
                    "attention: v must have k's shape [B, Hk, Sk] (any value head dim), got v ",
                    v.sizes(), " and k ", k.sizes());
  const auto st = q.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
                    "attention: q dtype must be float32, float64, bfloat16 or float16, got ", st);
  TORCH_CHECK_VALUE(k.scalar_type() == st && v.scalar_type() == st,
                    "attention: q, k, v must share a dtype, got ", st, ", ", k.scalar_type(), ", ",
                    v.scalar_type());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0), "attention: batch mismatch: q has ", q.size(0),
                    ", k has ", k.size(0));
  TORCH_CHECK_VALUE(q.size(3) == k.size(3), "attention: head dim mismatch: q has ", q.size(3),
                    ", k has ", k.size(3));
  TORCH_CHECK_VALUE(k.size(1) > 0, "attention: Hq=", q.size(1), " must be a multiple of Hk=0: k has no heads, got ",
                    k.sizes());
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                    "attention: the CPU engine got tensors on ", q.device());
}

// The query-head -> KV-head map: query head h reads KV head (h + kv_offset) / kv_group.
// Default (kv_group None): plain GQA, Hq % Hk == 0, kv_group = Hq / Hk, kv_offset = 0. Given: a
// contiguous run of query heads that starts kv_offset heads into a group of kv_group (a Ulysses
// rank's heads of an uneven layout) and reads exactly the Hk KV heads passed, each at least once.
std::pair<int64_t, int64_t> kv_map_arg(int64_t Hq, int64_t Hk, c10::optional<int64_t> kv_group,
                                       int64_t kv_offset) {
  if (!kv_group.has_value()) {
    TORCH_CHECK_VALUE(Hq % Hk == 0 && kv_offset == 0, "attention: Hq=", Hq, " must be a multiple of Hk=", Hk,
                      " (and kv_offset 0) unless kv_group is given, got kv_offset=", kv_offset);
    return {Hq / Hk, 0};
  }
  const int64_t g = *kv_group;
  TORCH_CHECK_VALUE(g >= 1 && kv_offset >= 0 && kv_offset < g,
                    "attention: need kv_group >= 1 and 0 <= kv_offset < kv_group, got kv_group=", g,
                    ", kv_offset=", kv_offset);
  TORCH_CHECK_VALUE(Hq == 0 || (Hq - 1 + kv_offset) / g == Hk - 1,
                    "attention: query heads 0..", Hq - 1, " at kv_offset ", kv_offset, " with kv_group ", g,
                    " read KV heads 0..", (Hq - 1 + kv_offset) / g, ", but k/v have Hk=", Hk,
                    " heads (each must be read by at least one query head)");
  return {g, kv_offset};
}

// ---------------------------------------------------------------------------------------
// Positions / documents -> int32 [B, Sp] arrays (padding entries carry the "none" doc id) and
// per-tile summaries.
struct PosPack {
  std::vector<int32_t> pos, doc;
  std::vector<int32_t> blk;  // block ids (-1 = none; padding -1), empty when none were given
  std::vector<TileInfo> tiles;
};

PosPack pack_positions(const at::Tensor& pos, const c10::optional<at::Tensor>& doc, int64_t B,
                       int64_t S, int64_t Sp, int64_t tile, bool is_key, const char* pname,
                       const char* dname, const c10::optional<at::Tensor>& blk = c10::nullopt,
                       const char* bname = "block") {
  auto check_shape = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type()) &&
                          t.scalar_type() != at::kBool,
                      "attention: ", name, " must be an integer tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE((t.dim() == 1 && t.size(0) == S) ||
                          (t.dim() == 2 && (t.size(0) == B || t.size(0) == 1) && t.size(1) == S),
                      "attention: ", name, " must have shape [", S, "] or [", B, ", ", S,
                      "], got ", t.sizes());
    TORCH_CHECK_VALUE(t.device().is_cpu(), "attention: ", name, " must be on the CPU like q, got ",
                      t.device());
  };
  check_shape(pos, pname);
  if (doc.has_value()) check_shape(*doc, dname);
  if (blk.has_value()) check_shape(*blk, bname);
  const int32_t none = is_key ? kDocKeyNone : kDocQueryNone;
  PosPack pk;
  pk.pos.assign(B * Sp, 0);
  pk.doc.assign(B * Sp, none);
  const at::Tensor p64 = pos.to(at::kLong).contiguous();
  const int64_t* pp = p64.data_ptr<int64_t>();
  const bool pb = p64.dim() == 2 && p64.size(0) == B && B > 1;
  at::Tensor d64;
  const int64_t* dp = nullptr;
  bool db = false;
  if (doc.has_value()) {
    d64 = doc->to(at::kLong).contiguous();
    dp = d64.data_ptr<int64_t>();
    db = d64.dim() == 2 && d64.size(0) == B && B > 1;
  }
  if (blk.has_value()) {  // block ids: -1 for none (negative ids) and for padding entries
    pk.blk.assign(B * Sp, -1);
    const at::Tensor b64 = blk->to(at::kLong).contiguous();
    const int64_t* bp = b64.data_ptr<int64_t>();
    const bool bb = b64.dim() == 2 && b64.size(0) == B && B > 1;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t v = bp[(bb ? b * S : 0) + i];
        TORCH_CHECK_VALUE(v <= std::numeric_limits<int32_t>::max(), "attention: ", bname,
                          " values must fit in int32, got ", v);
        pk.blk[b * Sp + i] = v < 0 ? -1 : (int32_t)v;
      }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* prow = pp + (pb ? b * S : 0);
    const int64_t* drow = dp ? dp + (db ? b * S : 0) : nullptr;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = prow[i];
      TORCH_CHECK_VALUE(p >= std::numeric_limits<int32_t>::min() &&
                            p <= std::numeric_limits<int32_t>::max(),
                        "attention: ", pname, " values must fit in int32, got ", p);
      pk.pos[b * Sp + i] = (int32_t)p;
      int32_t d = 0;
      if (drow) {
        const int64_t dv = drow[i];
        TORCH_CHECK_VALUE(dv <= std::numeric_limits<int32_t>::max(), "attention: ", dname,
                          " values must fit in int32, got ", dv);
        d = dv < 0 ? none : (int32_t)dv;
      }
      pk.doc[b * Sp + i] = d;
    }
  }
  const int64_t nt = Sp / tile;
  pk.tiles.resize(B * nt);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < nt; ++t) {
      TileInfo ti{std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
                  std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(), 0, 1,
                  std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
      for (int64_t i = t * tile; i < (t + 1) * tile; ++i) {
        const int32_t d = pk.doc[b * Sp + i];
        if (d == none) {
          ti.all = 0;
          continue;
        }
        const int32_t p = pk.pos[b * Sp + i];
        ti.any = 1;
        ti.pmin = std::min(ti.pmin, p);
        ti.pmax = std::max(ti.pmax, p);
        ti.dmin = std::min(ti.dmin, d);
        ti.dmax = std::max(ti.dmax, d);
        const int32_t bl = pk.blk.empty() ? -1 : pk.blk[b * Sp + i];
        if (bl >= 0) {
          ti.bmin = std::min(ti.bmin, bl);
          ti.bmax = std::max(ti.bmax, bl);
        }
      }
      pk.tiles[b * nt + t] = ti;
    }
  }
  return pk;
}

// `blocks`: block ids given (a pair past the causal frontier may still hold visible block keys).
int classify_host(const TileInfo& q, const TileInfo& k, bool causal, int64_t window, bool blocks) {
  if (!q.any || !k.any) return kTileSkip;
  if (causal && k.pmin > q.pmax && !(blocks && q.bmin <= k.bmax && k.bmin <= q.bmax)) return kTileSkip;
  if (window > 0 && (int64_t)k.pmax + window <= (int64_t)q.pmin) return kTileSkip;
  if (k.dmax < q.dmin || q.dmax < k.dmin) return kTileSkip;
  return kTilePartial;
}

// x [B, H, S, D] -> contiguous acc-dtype [B, H, Sp, Dp] zero padded (a view when nothing to do).
at::Tensor pad_rows(const at::Tensor& x, int64_t Sp, int64_t Dp, at::ScalarType acc) {
  const int64_t S = x.size(2), D = x.size(3);
  if (S == Sp && D == Dp && x.scalar_type() == acc && x.is_contiguous()) return x;
  at::Tensor buf = (S == Sp && D == Dp)
                       ? at::empty({x.size(0), x.size(1), Sp, Dp}, x.options().dtype(acc))
                       : at::zeros({x.size(0), x.size(1), Sp, Dp}, x.options().dtype(acc));
  buf.narrow(2, 0, S).narrow(3, 0, D).copy_(x);
  return buf;
}

at::Tensor scaled_queries(const at::Tensor& q, int64_t Sqp, int64_t Dp, at::ScalarType acc,
                          double scale) {
  const int64_t Sq = q.size(2), D = q.size(3);
  at::Tensor buf = (Sq == Sqp && D == Dp)
                       ? at::empty({q.size(0), q.size(1), Sqp, Dp}, q.options().dtype(acc))
                       : at::zeros({q.size(0), q.size(1), Sqp, Dp}, q.options().dtype(acc));
  at::Tensor view = buf.narrow(2, 0, Sq).narrow(3, 0, D);
  view.copy_(q);
  view.mul_(scale * kLog2e);
  return buf;
}

// Below this many multiply-adds a call runs on the calling thread: waking a thread team costs
// more than the work, and on a loaded machine an OpenMP barrier can wait for a whole
// scheduler time slice.
constexpr int64_t kSerialWork = int64_t(1) << 22;

// bf16 operand layouts for the avx512bf16 kernels (see kernel_avx512bf16.cpp).
// xb [B, H, Sp, Dp] bf16 -> [B, H, Sp/Bk, Dp/2, Bk] 32-bit pairs along D, transposed per key tile.
at::Tensor bf16_pairs_transposed(const at::Tensor& xb, int64_t Bk) {
  return tile_transposed(xb.view(at::kInt), Bk);
}
// xb [B, H, Sp, Dp] bf16 -> [B, H, Sp/2, Dp, 2]: pairs along S.
at::Tensor bf16_pairs_rows(const at::Tensor& xb) {
  return xb.view({xb.size(0), xb.size(1), xb.size(2) / 2, 2, xb.size(3)}).transpose(3, 4).contiguous();
}

template <typename Args, typename Fn>
void run_workers(Fn fn, Args& args, int64_t work) {
  int64_t counter = 0;
  args.counter = &counter;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), args.nitems);
  if (nt <= 1 || work < kSerialWork || at::in_parallel_region()) {
    fn(args);
    return;
  }
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) fn(args);
  });
}

struct Geometry {
  int64_t B, Hq, Hk, Sq, Sk, D, Dv, Bq, Bk, Sqp, Skp, Dp, Dvp, nqt, nkt;
};

Geometry geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  Geometry g{};
  g.B = q.size(0);
  g.Hq = q.size(1);
  g.Sq = q.size(2);
  g.D = q.size(3);
  g.Hk = k.size(1);
  g.Sk = k.size(2);
  g.Bq = std::min<int64_t>(kBlockQMax, round_up(std::max<int64_t>(g.Sq, 1), 4));
  g.Bk = kBlockK;
  g.Sqp = round_up(g.Sq, g.Bq);
  g.Skp = round_up(g.Sk, g.Bk);
  g.Dp = round_up(g.D, 16);
  g.Dv = v.size(3);
  g.Dvp = round_up(g.Dv, 16);
  g.nqt = g.Sqp / g.Bq;
  g.nkt = g.Skp / g.Bk;
  return g;
}

// Backward row statistics, written into [B, Hq, Sqp] buffers (T = the accumulation dtype):
//   delta_i = sum_d dout_i[d] out_i[d] - dlse_i  (the lse gradient enters dS like -delta),
//   lse2_i  = lse_i * log2(e).
// Rows that see no key (lse = -inf) and padding rows get delta = 0 and lse2 = +inf, so that the
// kernels' P = 2^(S - lse2) is exactly 0 there. One pass, no [B, Hq, Sq, D] temporaries.
template <typename T>
void softmax_stats(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                   const c10::optional<at::Tensor>& dlse, int64_t Sqp, at::Tensor& delta_p,
                   at::Tensor& lse2_p) {
  const auto acc = c10::CppTypeToScalarType<T>::value;
  const at::Tensor d = dout.to(acc).contiguous(), o = out.to(acc).contiguous();
  const at::Tensor l = lse.to(acc).contiguous();
  at::Tensor dl;
  if (dlse.has_value()) dl = dlse->to(acc).contiguous();
  const int64_t rows = lse.size(0) * lse.size(1), Sq = lse.size(2), D = dout.size(3);
  const T* dp = d.data_ptr<T>();
  const T* op = o.data_ptr<T>();
  const T* lp = l.data_ptr<T>();
  const T* dlp = dl.defined() ? dl.data_ptr<T>() : nullptr;
  T* delta = delta_p.data_ptr<T>();
  T* lse2 = lse2_p.data_ptr<T>();
  const T inf = std::numeric_limits<T>::infinity();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, Sq * D)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < Sqp; ++i) {
        const int64_t row = r * Sq + i;
        T& dlt = delta[r * Sqp + i];
        T& l2 = lse2[r * Sqp + i];
        if (i >= Sq || !std::isfinite(lp[row])) {
          dlt = 0;
          l2 = inf;
          continue;
        }
        T s = 0;
        for (int64_t j = 0; j < D; ++j) s += dp[row * D + j] * op[row * D + j];
        dlt = dlp ? s - dlp[row] : s;
        l2 = lp[row] * (T)kLog2e;
      }
    }
  });
}

// window (None or >= 1) -> 0 (none) or the window; softcap (None or > 0) -> 0 or
// softcap * log2(e) (the kernels work in the log2 domain).
int64_t window_arg(const c10::optional<int64_t>& window) {
  if (!window.has_value()) return 0;
  TORCH_CHECK_VALUE(*window >= 1, "attention: window must be >= 1 (or None), got ", *window);
  return *window;
}
// sinks (None or a floating [Hq] tensor on the CPU) -> [Hq] acc-dtype sink * log2(e), or undefined.
at::Tensor sinks_arg(const c10::optional<at::Tensor>& sinks, int64_t Hq, at::ScalarType acc) {
  if (!sinks.has_value()) return at::Tensor();
  const at::Tensor& s = *sinks;
  TORCH_CHECK_VALUE(at::isFloatingType(s.scalar_type()),
                    "attention: sinks must be a floating tensor, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == Hq, "attention: sinks must have shape [Hq] = [",
                    Hq, "], got ", s.sizes());
  TORCH_CHECK_VALUE(s.device().is_cpu(), "attention: sinks must be on the CPU like q, got ",
                    s.device());
  return (s.to(acc) * kLog2e).contiguous();
}

// alibi_slopes (None or a floating [Hq] tensor on the CPU) -> [Hq] acc-dtype slope * log2(e).
at::Tensor alibi_arg(const c10::optional<at::Tensor>& slopes, int64_t Hq, at::ScalarType acc,
                     double softcap2) {
  if (!slopes.has_value()) return at::Tensor();
  const at::Tensor& s = *slopes;
  TORCH_CHECK_VALUE(at::isFloatingType(s.scalar_type()),
                    "attention: alibi_slopes must be a floating tensor, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == Hq,
                    "attention: alibi_slopes must have shape [Hq] = [", Hq, "], got ", s.sizes());
  TORCH_CHECK_VALUE(s.device().is_cpu(), "attention: alibi_slopes must be on the CPU like q, got ",
                    s.device());
  TORCH_CHECK_VALUE(softcap2 == 0, "attention: alibi_slopes and softcap together are not supported");
  return (s.to(acc) * kLog2e).contiguous();
}

double softcap_arg(const c10::optional<double>& softcap) {
  if (!softcap.has_value()) return 0.0;
  TORCH_CHECK_VALUE(std::isfinite(*softcap) && *softcap > 0,
                    "attention: softcap must be a finite number > 0 (or None), got ", *softcap);
  return *softcap * kLog2e;
}

// The fields both passes share: Q and K^T, the geometry, positions / documents / tile summaries,
// the KV-head map and the mask and score options. Each pass fills its own fields after it.
void fill_problem(FwdArgs& a, const at::Tensor& Qs, const at::Tensor& KT, const Geometry& g,
                  const PosPack& qp, const PosPack& kp, const std::pair<int64_t, int64_t>& kvmap,
                  bool causal, int64_t win, double softcap2, const at::Tensor& alibi2, double scale) {
  a.q = Qs.data_ptr();
  a.kt = KT.data_ptr();
  a.qpos = qp.pos.data();
  a.qdoc = qp.doc.data();
  a.kpos = kp.pos.data();
  a.kdoc = kp.doc.data();
  // Block ids only matter for the causal rule (without it every key of the document is visible).
  const bool blocks = causal && !qp.blk.empty() && !kp.blk.empty();
  a.qblk = blocks ? qp.blk.data() : nullptr;
  a.kblk = blocks ? kp.blk.data() : nullptr;
  a.qti = qp.tiles.data();
  a.kti = kp.tiles.data();
  a.B = g.B;
  a.Hq = g.Hq;
  a.Hk = g.Hk;
  a.kv_group = kvmap.first;
  a.kv_offset = kvmap.second;
  a.Sqp = g.Sqp;
  a.Skp = g.Skp;
  a.Dp = g.Dp;
  a.Dv = g.Dvp;
  a.Bq = g.Bq;
  a.Bk = g.Bk;
  a.nqt = g.nqt;
  a.nkt = g.nkt;
  a.causal = causal ? 1 : 0;
  a.window = win;
  a.softcap2 = softcap2;
  a.alibi2 = alibi2.defined() ? alibi2.data_ptr() : nullptr;
  a.sscale = scale * kLog2e;
}

// ---------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> attn_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& q_pos,
                                                const at::Tensor& k_pos,
                                                const c10::optional<at::Tensor>& q_doc,
                                                const c10::optional<at::Tensor>& k_doc,
                                                bool causal, double scale,
                                                c10::optional<int64_t> window,
                                                c10::optional<double> softcap,
                                                const c10::optional<at::Tensor>& sinks,
                                                const c10::optional<at::Tensor>& alibi_slopes,
                                                c10::optional<int64_t> kv_group, int64_t kv_offset,
                                                const c10::optional<at::Tensor>& q_block,
                                                const c10::optional<at::Tensor>& k_block) {
  check_qkv(q, k, v);
  const auto kvmap = kv_map_arg(q.size(1), k.size(1), kv_group, kv_offset);
  const int64_t win = window_arg(window);
  const double softcap2 = softcap_arg(softcap);
  TORCH_CHECK_VALUE(q_doc.has_value() == k_doc.has_value(),
                    "attention: q_doc and k_doc must be given together");
  TORCH_CHECK_VALUE(q_block.has_value() == k_block.has_value(),
                    "attention: q_block and k_block must be given together");
  const bool blocks = causal && q_block.has_value();
  const Geometry g = geometry(q, k, v);
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({g.B, g.Hq, g.Sq, g.Dv}, q.options());
  at::Tensor lse = at::empty({g.B, g.Hq, g.Sq}, q.options().dtype(acc));
  PosPack qp = pack_positions(q_pos, q_doc, g.B, g.Sq, g.Sqp, g.Bq, false, "q_pos", "q_doc",
                              q_block, "q_block");
  PosPack kp = pack_positions(k_pos, k_doc, g.B, g.Sk, g.Skp, g.Bk, true, "k_pos", "k_doc",
                              k_block, "k_block");
  const at::Tensor sink2 = sinks_arg(sinks, g.Hq, acc);
  const at::Tensor alibi2 = alibi_arg(alibi_slopes, g.Hq, acc, softcap2);
  if (out.numel() == 0 || g.Sk == 0) {
    out.zero_();
    if (sink2.defined())  // nothing but the sink in the denominator: lse = sink
      lse.copy_((sink2 * kLn2).view({1, g.Hq, 1}).expand_as(lse));
    else
      lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  const KernelTable* kt = select_kernels();
  const bool bf16 = q.scalar_type() == at::kBFloat16 && kt->fwd_bf16 != nullptr;
  at::Tensor Qs, KT, Vp;
  if (bf16) {
    Qs = pad_rows(q, g.Sqp, g.Dp, at::kBFloat16);
    const at::Tensor Kb = pad_rows(k, g.Skp, g.Dp, at::kBFloat16);
    KT = bf16_pairs_transposed(Kb, g.Bk);
    Vp = bf16_pairs_rows(pad_rows(v, g.Skp, g.Dvp, at::kBFloat16));
  } else {
    Qs = scaled_queries(q, g.Sqp, g.Dp, acc, scale);
    KT = tile_transposed(pad_rows(k, g.Skp, g.Dp, acc), g.Bk);
    Vp = pad_rows(v, g.Skp, g.Dvp, acc);
  }
  const bool direct = g.Sq == g.Sqp && g.Dv == g.Dvp && q.scalar_type() == acc;
  at::Tensor obuf = direct ? out : at::empty({g.B, g.Hq, g.Sqp, g.Dvp}, q.options().dtype(acc));
  at::Tensor lbuf = g.Sq == g.Sqp ? lse : at::empty({g.B, g.Hq, g.Sqp}, q.options().dtype(acc));

  // Work items (b, h, q tile), heaviest first (longest-processing-time scheduling).
  std::vector<int64_t> cost(g.B * g.nqt, 0);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t qt = 0; qt < g.nqt; ++qt)
      for (int64_t kt = 0; kt < g.nkt; ++kt)
        cost[b * g.nqt + qt] +=
            classify_host(qp.tiles[b * g.nqt + qt], kp.tiles[b * g.nkt + kt], causal, win, blocks) !=
            kTileSkip;
  std::vector<int64_t> order(g.B * g.Hq * g.nqt);
  std::iota(order.begin(), order.end(), 0);
  auto item_cost = [&](int64_t it) {
    const int64_t qt = it % g.nqt, b = it / g.nqt / g.Hq;
    return cost[b * g.nqt + qt];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return item_cost(x) > item_cost(y); });

  FwdArgs a{};
  fill_problem(a, Qs, KT, g, qp, kp, kvmap, causal, win, softcap2, alibi2, scale);
  a.v = Vp.data_ptr();
  a.out = obuf.data_ptr();
  a.lse = lbuf.data_ptr();
  a.sink2 = sink2.defined() ? sink2.data_ptr() : nullptr;
  a.order = order.data();
  a.nitems = (int64_t)order.size();
  a.ext_gemm = select_gemm(kt, acc, bf16, &a.ext_release);
  const int64_t pairs = std::accumulate(cost.begin(), cost.end(), int64_t(0)) * g.Hq;
  run_workers(bf16 ? kt->fwd_bf16 : acc == at::kDouble ? kt->fwd_f64 : kt->fwd_f32, a,
              pairs * g.Bq * g.Bk * (g.Dp + g.Dvp));

  if (!direct) out.copy_(obuf.narrow(2, 0, g.Sq).narrow(3, 0, g.Dv));
  if (g.Sq != g.Sqp) lse.copy_(lbuf.narrow(2, 0, g.Sq));
  return {out, lse};
}

// Gradient of the sink logits: a sink is a key with no value, so dS_sink = P_sink (0 - delta)
// with P_sink = exp(sink - lse) and delta = rowsum(dout * out) - dlse (the delta the kernels use):
// dsink[h] = -sum_{b, i} P_sink[b, h, i] delta[b, h, i]. Rows with lse = -inf contribute 0.
at::Tensor sink_grad(const at::Tensor& sinks, const at::Tensor& lse, const at::Tensor& delta) {
  const at::Tensor l = lse.to(delta.scalar_type());
  const at::Tensor s = sinks.to(delta.scalar_type()).view({1, -1, 1});
  at::Tensor p = at::exp(s - l);
  p = at::where(at::isfinite(l), p, at::zeros_like(p));
  return (p * delta).sum({0, 2}).neg_().to(sinks.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_bwd_cpu(
    const at::Tensor& dout, const c10::optional<at::Tensor>& dlse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& q_pos, const at::Tensor& k_pos, const c10::optional<at::Tensor>& q_doc,
    const c10::optional<at::Tensor>& k_doc, bool causal, double scale,
    c10::optional<int64_t> window, c10::optional<double> softcap,
    const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& alibi_slopes,
    c10::optional<int64_t> kv_group, int64_t kv_offset, const c10::optional<at::Tensor>& q_block,
    const c10::optional<at::Tensor>& k_block) {
  check_qkv(q, k, v);
  const auto kvmap = kv_map_arg(q.size(1), k.size(1), kv_group, kv_offset);
  const int64_t win = window_arg(window);
  const double softcap2 = softcap_arg(softcap);
  TORCH_CHECK_VALUE(q_doc.has_value() == k_doc.has_value(),
                    "attention: q_doc and k_doc must be given together");
  TORCH_CHECK_VALUE(q_block.has_value() == k_block.has_value(),
                    "attention: q_block and k_block must be given together");
  const bool blocks = causal && q_block.has_value();
  const Geometry g = geometry(q, k, v);
  TORCH_CHECK_VALUE(dout.dim() == 4 && out.dim() == 4 && dout.sizes() == out.sizes() &&
                        out.size(0) == g.B && out.size(1) == g.Hq && out.size(2) == g.Sq &&
                        out.size(3) == g.Dv,
                    "attn_bwd: dout and out must be [B, Hq, Sq, Dv] = [", g.B, ", ", g.Hq, ", ",
                    g.Sq, ", ", g.Dv, "], got ", dout.sizes(), " and ", out.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == g.B && lse.size(1) == g.Hq && lse.size(2) == g.Sq,
                    "attn_bwd: lse must be [B, Hq, Sq], got ", lse.sizes());
  if (dlse.has_value())
    TORCH_CHECK_VALUE(dlse->sizes() == lse.sizes(), "attn_bwd: dlse must have lse's shape");
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  PosPack qp = pack_positions(q_pos, q_doc, g.B, g.Sq, g.Sqp, g.Bq, false, "q_pos", "q_doc",
                              q_block, "q_block");
  PosPack kp = pack_positions(k_pos, k_doc, g.B, g.Sk, g.Skp, g.Bk, true, "k_pos", "k_doc",
                              k_block, "k_block");
  // dsinks: [Hq] in the sinks' dtype, or an empty tensor without sinks.
  const bool has_sinks = sinks_arg(sinks, g.Hq, acc).defined();
  const at::Tensor alibi2 = alibi_arg(alibi_slopes, g.Hq, acc, softcap2);
  at::Tensor dsinks = has_sinks ? at::zeros({g.Hq}, sinks->options()) : at::empty({0}, q.options());
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (has_sinks && q.numel() > 0) {  // out = 0: delta = -dlse
      at::Tensor delta = dlse.has_value() ? dlse->to(acc).neg() : at::zeros(lse.sizes(), lse.options().dtype(acc));
      dsinks = sink_grad(*sinks, lse, delta);
    }
    return {dq, dk, dv, dsinks};
  }
  const KernelTable* kt = select_kernels();
  const bool bf16 = q.scalar_type() == at::kBFloat16 && kt->bwd_bf16 != nullptr;
  TileGemmReleaseFn ext_release = nullptr;
  const TileGemmFn ext_gemm = select_gemm(kt, acc, bf16, &ext_release);
  at::Tensor Qs, KT, Kp, VT, dOp, Qv, dOv, Qt, dOt;
  if (bf16) {
    Qs = pad_rows(q, g.Sqp, g.Dp, at::kBFloat16);
    if (!ext_gemm) Qv = bf16_pairs_rows(Qs);
    const at::Tensor Kb = pad_rows(k, g.Skp, g.Dp, at::kBFloat16);
    KT = bf16_pairs_transposed(Kb, g.Bk);
    Kp = bf16_pairs_rows(Kb);
    VT = bf16_pairs_transposed(pad_rows(v, g.Skp, g.Dvp, at::kBFloat16), g.Bk);
    dOp = pad_rows(dout, g.Sqp, g.Dvp, at::kBFloat16);
    if (!ext_gemm) dOv = bf16_pairs_rows(dOp);
  } else {
    Qs = scaled_queries(q, g.Sqp, g.Dp, acc, scale);
    Kp = pad_rows(k, g.Skp, g.Dp, acc);
    KT = tile_transposed(Kp, g.Bk);
    VT = tile_transposed(pad_rows(v, g.Skp, g.Dvp, acc), g.Bk);
    dOp = pad_rows(dout, g.Sqp, g.Dvp, acc);
  }
  if (ext_gemm) {
    Qt = tile_transposed(Qs, g.Bq);
    dOt = tile_transposed(dOp, g.Bq);
  }

  // Per-row softmax statistics, padded to Sqp (see softmax_stats).
  at::Tensor delta_p = at::empty({g.B, g.Hq, g.Sqp}, q.options().dtype(acc));
  at::Tensor lse2_p = at::empty({g.B, g.Hq, g.Sqp}, q.options().dtype(acc));
  if (acc == at::kDouble)
    softmax_stats<double>(dout, out, lse, dlse, g.Sqp, delta_p, lse2_p);
  else
    softmax_stats<float>(dout, out, lse, dlse, g.Sqp, delta_p, lse2_p);

  // Key-tile chunks per (b, kv head): enough items to keep every thread busy. Each chunk has
  // its own dQ partial buffer, summed in a fixed order afterwards (deterministic).
  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t units = g.B * g.Hk;
  int64_t nc = 1;
  while (nc < g.nkt && (units * nc) % nthreads != 0 && units * nc < 4 * nthreads) ++nc;
  // With nothing padded (and one chunk for dQ) the kernels accumulate / store straight into the
  // outputs: fewer fresh O(S * D) buffers, each of which costs page faults on first touch.
  const bool direct_q = nc == 1 && g.Sq == g.Sqp && g.D == g.Dp && q.scalar_type() == acc;
  const bool direct_kv = g.Sk == g.Skp && g.D == g.Dp && g.Dv == g.Dvp && k.scalar_type() == acc;
  at::Tensor dq_part = direct_q ? dq.zero_()
                                : at::zeros({nc, g.B, g.Hq, g.Sqp, g.Dp}, q.options().dtype(acc));
  at::Tensor dk_buf = direct_kv ? dk : at::empty({g.B, g.Hk, g.Skp, g.Dp}, q.options().dtype(acc));
  at::Tensor dv_buf = direct_kv ? dv : at::empty({g.B, g.Hk, g.Skp, g.Dvp}, q.options().dtype(acc));

  BwdArgs a{};
  fill_problem(a, Qs, KT, g, qp, kp, kvmap, causal, win, softcap2, alibi2, scale);
  a.k = Kp.data_ptr();
  a.vt = VT.data_ptr();
  a.dout = dOp.data_ptr();
  a.qv = Qv.defined() ? Qv.data_ptr() : nullptr;
  a.dov = dOv.defined() ? dOv.data_ptr() : nullptr;
  a.qt = Qt.defined() ? Qt.data_ptr() : nullptr;
  a.dot = dOt.defined() ? dOt.data_ptr() : nullptr;
  a.ext_gemm = ext_gemm;
  a.ext_release = ext_release;
  a.lse2 = lse2_p.data_ptr();
  a.delta = delta_p.data_ptr();
  a.dq_part = dq_part.data_ptr();
  a.dk = dk_buf.data_ptr();
  a.dv = dv_buf.data_ptr();
  // fp32/fp64 kernels accumulate dS^T (q * scale * log2 e), the bf16 kernels dS^T q.
  a.dk_scale = bf16 ? scale : kLn2;
  a.nc = nc;
  a.nitems = units * nc;
  int64_t pairs = 0;
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t qt = 0; qt < g.nqt; ++qt)
      for (int64_t kt2 = 0; kt2 < g.nkt; ++kt2)
        pairs += classify_host(qp.tiles[b * g.nqt + qt], kp.tiles[b * g.nkt + kt2], causal,
                               win, blocks) != kTileSkip;
  run_workers(bf16 ? kt->bwd_bf16 : acc == at::kDouble ? kt->bwd_f64 : kt->bwd_f32, a,
              pairs * g.Hq * g.Bq * g.Bk * (3 * g.Dp + 2 * g.Dvp));

  if (direct_q) {
    dq.mul_(scale);
  } else {
    at::Tensor dq_sum = nc > 1 ? dq_part.sum(0) : dq_part.select(0, 0);
    dq.copy_(dq_sum.narrow(2, 0, g.Sq).narrow(3, 0, g.D).mul_(scale));
  }
  if (!direct_kv) {
    dk.copy_(dk_buf.narrow(2, 0, g.Sk).narrow(3, 0, g.D));
    dv.copy_(dv_buf.narrow(2, 0, g.Sk).narrow(3, 0, g.Dv));
  }
  if (has_sinks) dsinks = sink_grad(*sinks, lse, delta_p.narrow(2, 0, g.Sq));
  return {dq, dk, dv, dsinks};
}

}  // namespace

// Part of hyper_parallel::engine_info() (csrc/module.cpp). Reports; never raises because of
// an environment variable: a HYPER_PARALLEL_ATTN_ISA / _GEMM choice that cannot run here is
// reported as such ("kernels=unavailable(...)", "fp32=unavailable(...)"), and the error is
// raised by the first attention call instead.
std::string cpu_engine_info() {
  const KernelTable* kt = nullptr;
  std::string kerr;
  try {
    kt = select_kernels();
  } catch (const std::exception& e) {
    kerr = e.what();
    const auto nl = kerr.find('\n');
    if (nl != std::string::npos) kerr.resize(nl);
  }
  std::string s = "attention cpu kernels=";
  s += kt ? std::string(kt->name) : "unavailable(" + kerr + ")";
  s += " (avx512bf16 cpu=";
  s += cpu_has_avx512bf16() ? "yes" : "no";
  s += ", avx512 cpu=";
  s += cpu_has_avx512() ? "yes" : "no";
  s += ", avx2 cpu=";
  s += cpu_has_avx2() ? "yes" : "no";
  s += "), threads=" + std::to_string(at::get_num_threads());
  s += ", tiles q<=" + std::to_string(kBlockQMax) + " k=" + std::to_string(kBlockK);
  auto provider = [&](bool bf16) -> std::string {
    TileGemmReleaseFn rel = nullptr;
    try {
      return select_gemm(kt, at::kFloat, bf16, &rel) != nullptr ? "brgemm" : "builtin";
    } catch (const std::exception& e) {
      std::string m = e.what();
      const auto nl = m.find('\n');
      if (nl != std::string::npos) m.resize(nl);
      return "unavailable(" + m + ")";
    }
  };
  if (kt) {
    const std::string f32 = provider(false);
    std::string bf = "via fp32";
    if (kt->fwd_bf16) {
      bf = provider(true);
      if (bf == "brgemm") bf = "brgemm(amx)";
      else if (bf == "builtin") bf = "builtin(vdpbf16ps)";
    }
    s += ", tile gemm fp32=" + f32 + " bf16=" + bf;
  }
  s += std::string(" (brgemm usable: fp32=") + (brgemm_f32_available() ? "yes" : "no") +
       " bf16-amx=" + (brgemm_bf16_available() ? "yes" : "no") + ")";
  return s;
}

}  // namespace hp_attn

// A fragment, like every other registration in csrc/ (engine_info lives in module.cpp).
TORCH_LIBRARY_FRAGMENT(hyper_parallel, m) {
  m.def(
      "attn_fwd(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor k_pos, Tensor? q_doc, "
      "Tensor? k_doc, bool causal, float scale, int? window=None, float? softcap=None, "
      "Tensor? sinks=None, Tensor? alibi_slopes=None, int? kv_group=None, int kv_offset=0, "
      "Tensor? q_block=None, Tensor? k_block=None) -> (Tensor, Tensor)");
  m.def(
      "attn_bwd(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor q_pos, Tensor k_pos, Tensor? q_doc, Tensor? k_doc, bool causal, float scale, "
      "int? window=None, float? softcap=None, Tensor? sinks=None, Tensor? alibi_slopes=None, "
      "int? kv_group=None, int kv_offset=0, Tensor? q_block=None, Tensor? k_block=None) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hyper_parallel, CPU, m) {
  m.impl("attn_fwd", &hp_attn::attn_fwd_cpu);
  m.impl("attn_bwd", &hp_attn::attn_bwd_cpu);
}
