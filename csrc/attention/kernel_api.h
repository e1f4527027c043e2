// Interface between the torch-facing host code (attention_cpu.cpp) and the ISA-specific
// attention kernels (kernel_{avx512,avx2,base}.cpp, all built from kernel_impl.h).
//
// This header is deliberately torch-free and template-free: the kernel translation units are
// compiled with `#pragma GCC target(...)`, and must not share inline code (ODR) with the rest
// of the extension, or the linker could pick an AVX-512 copy of a function for a machine that
// lacks AVX-512.
//
// Layouts (all buffers contiguous, T = float or double, padded with zeros):
//   q      [B, Hq, Sqp, Dp]  queries pre-multiplied by scale * log2(e)
//   kt     [B, Hk, nkt, Dp, Bk]  keys, transposed per key tile (for S = Q K^T; each tile's
//                                 K^T is one contiguous slab, rows Bk apart)
//   k      [B, Hk, Skp, Dp]  keys (for dQ = dS K)
//   v      [B, Hk, Skp, Dv]  values (for O = P V); Dv = padded value head dim (MLA: may
//                             differ from the qk head dim Dp). out / dout / dv use Dv too.
//   vt     [B, Hk, nkt, Dv, Bk]  values, transposed per key tile (for dP = dO V^T)
//   qblk [B, Sqp], kblk [B, Skp] (optional, causal only): int32 block ids, -1 = none; key j is
//     also visible to query i past the causal frontier when qblk[i] == kblk[j] >= 0 (same doc,
//     inside the window): transformers' window AND (causal OR same block)
//   qpos/qdoc [B, Sqp], kpos/kdoc [B, Skp]: int32 positions and mapped document ids
//     (kDocKeyNone for keys that are never attended, kDocQueryNone for queries that see
//     nothing); padding rows/columns carry the "none" ids, so they are always masked.
//   Sqp is a multiple of Bq, Skp a multiple of Bk (= kTileK), Dp and Dv multiples of 16.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>  // std::index_sequence (kernel_impl.h)

namespace hp_attn {

// Key-tile width, fixed at compile time so that the score-row loops unroll into registers
// (FwdArgs::Bk / BwdArgs::Bk must equal it). Query tiles are sized by the host (<= 64).
constexpr int kTileK = 64;

constexpr int32_t kDocKeyNone = INT32_MIN;        // key never attended (doc < 0 or padding)
constexpr int32_t kDocQueryNone = INT32_MIN + 1;  // query sees no key (doc < 0 or padding)

// Per-tile summary over the tile's *valid* entries (doc id not "none").
struct TileInfo {
  int32_t pmin, pmax;  // min / max position
  int32_t dmin, dmax;  // min / max mapped doc id
  int32_t any;         // at least one valid entry
  int32_t all;         // every entry valid
  int32_t bmin, bmax;  // min / max block id over valid entries with a block (>= 0);
                       //   INT32_MAX / INT32_MIN when the tile holds none (or no block ids given)
};

enum TileClass : int { kTileSkip = 0, kTileFull = 1, kTilePartial = 2 };

// Optional tile GEMM supplied by the host (oneDNN brgemm through ATen's cpublas, which JITs
// AVX-512 / AMX micro-kernels for the running CPU; see attention_cpu.cpp). Row-major:
//   C[M x N] = (acc ? C : 0) + A[M x K] B[K x N], leading dimensions in elements.
// fp32 provider: A, B float. bf16 provider: A bf16 row-major (lda in bf16 elements), B in
// VNNI pairs [K/2][ldb][2] (ldb = columns per pair row), C float.
// Workers that use a provider call `ext_release` before returning (frees per-thread AMX state).
typedef void (*TileGemmFn)(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                           const void* B, int64_t ldb, float* C, int64_t ldc, int acc);
typedef void (*TileGemmReleaseFn)();

// One attention problem for the kernels: the forward's arguments, filled once by the host
// (fill_problem in attention_cpu.cpp); the backward's BwdArgs extends it (as flash-attention's
// backward params extend the forward's), leaving the forward-only fields (v, out, lse, sink2,
// order) null.
struct FwdArgs {
  const void* q;
  const void* kt;
  const void* v;
  void* out;  // [B, Hq, Sqp, Dv]
  void* lse;  // [B, Hq, Sqp], natural log, -inf for queries that see no key
  const int32_t *qpos, *qdoc, *kpos, *kdoc;
  const int32_t *qblk, *kblk;  // null (no block ids, or not causal), else [B, Sqp] / [B, Skp]
  const TileInfo *qti, *kti;  // [B, nqt], [B, nkt]
  int64_t B, Hq, Hk, Sqp, Skp, Dp, Dv, Bq, Bk, nqt, nkt;
  int64_t kv_group, kv_offset;  // query head h reads KV head (h + kv_offset) / kv_group
                                //   (plain GQA: kv_group = Hq / Hk, kv_offset = 0); the backward
                                //   sums into KV head j the query heads kv_query_heads(j, ...)
  int causal;
  int64_t window;        // > 0: left sliding window, key visible only if k_pos > q_pos - window
  double softcap2;       // > 0: softcap * log2(e); scores S (log2 domain) -> c tanh(S / c)
                         //   (the backward multiplies dS by 1 - tanh^2)
  const void* sink2;     // null, or [Hq] sink logits * log2(e) (float; double for fp64): one
                         //   extra softmax-denominator term per head with no value; lse includes it
  const void* alibi2;    // null, or [Hq] ALiBi slopes * log2(e) (float; double for fp64):
                         //   S[i, j] += slope * (k_pos[j] - q_pos[i]) before the mask (a constant
                         //   bias: no gradient)
  double sscale;         // bf16 kernels only: scale * log2(e) applied to S (q is unscaled)
  const int64_t* order;  // forward work items (b * Hq + h) * nqt + qt, heaviest first
  int64_t nitems;        // forward: items in `order`; backward: B * Hk * nc
  int64_t* counter;      // shared work-queue cursor (atomic)
  TileGemmFn ext_gemm;   // null: built-in micro-kernels (always null for fp64)
  TileGemmReleaseFn ext_release;
};

struct BwdArgs : FwdArgs {
  const void *k, *vt, *dout;  // dout [B, Hq, Sqp, Dv]
  const void *qv, *dov;  // bf16 kernels without ext_gemm: q / dout as pairs along queries
  const void *qt, *dot;  // with ext_gemm only: q / dout transposed per query tile,
                         //   [B, Hq, nqt, Dp|Dv, Bq] (fp32, or bf16 for the bf16 kernels); the
                         //   kernel then accumulates dK^T = Q^T dS and dV^T = dO^T P (no
                         //   per-tile transposes) and transposes once per key tile
  const void* lse2;   // [B, Hq, Sqp] lse * log2(e); +inf for queries that see nothing
  const void* delta;  // [B, Hq, Sqp] rowsum(dout * out) - dlse
  void* dq_part;      // [nc, B, Hq, Sqp, Dp] zero-initialised; += dS K (unscaled; for nc = 1
                      //   with nothing padded this is the caller's dq itself)
  void *dk, *dv;      // [B, Hk, Skp, Dp] / [B, Hk, Skp, Dv] fully written: sum over the KV head's query heads of
                      //   dk_scale * dS^T Qs and P^T dO (with nothing padded, the outputs)
  double dk_scale;    // ln 2 for the fp32/fp64 kernels (q pre-scaled by scale * log2 e),
                      //   `scale` for the bf16 kernels (unscaled q)
  int64_t nc;         // key-tile chunks per (b, kv head): chunk c owns key tiles c, c+nc, ...
                      //   (item = (b * Hk + kvh) * nc + c)
};

// The query heads [*lo, *hi) that read KV head kvh under the map h -> (h + kv_offset) / kv_group
// (FwdArgs::kv_group): the heads whose gradients the backward sums into that KV head.
inline void kv_query_heads(int64_t kvh, int64_t kv_group, int64_t kv_offset, int64_t Hq, int64_t* lo,
                           int64_t* hi) {
  const int64_t a = kvh * kv_group - kv_offset, b = a + kv_group;
  *lo = a > 0 ? a : 0;
  *hi = b < Hq ? b : Hq;
}

using FwdFn = void (*)(const FwdArgs&);
using BwdFn = void (*)(const BwdArgs&);

// One worker: pulls items from the shared counter until the queue is empty.
// fwd_bf16 / bwd_bf16 (bf16 inputs, bf16 dot products) are null except for avx512bf16; their
// operand layouts are documented in kernel_avx512bf16.cpp.
struct KernelTable {
  const char* name;
  FwdFn fwd_f32, fwd_f64;
  BwdFn bwd_f32, bwd_f64;
  FwdFn fwd_bf16;
  BwdFn bwd_bf16;
};

const KernelTable* kernels_avx512bf16();
const KernelTable* kernels_avx512();
const KernelTable* kernels_avx2();
const KernelTable* kernels_base();

}  // namespace hp_attn
