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
//   kt     [B, Hk, Dp, Skp]  keys, transposed (for S = Q K^T)
//   k      [B, Hk, Skp, Dp]  keys (for dQ = dS K)
//   v      [B, Hk, Skp, Dp]  values (for O = P V)
//   vt     [B, Hk, Dp, Skp]  values, transposed (for dP = dO V^T)
//   qpos/qdoc [B, Sqp], kpos/kdoc [B, Skp]: int32 positions and mapped document ids
//     (kDocKeyNone for keys that are never attended, kDocQueryNone for queries that see
//     nothing); padding rows/columns carry the "none" ids, so they are always masked.
//   Sqp is a multiple of Bq, Skp a multiple of Bk, Dp a multiple of 16.
#pragma once
#include <cstdint>

namespace hp_attn {

constexpr int32_t kDocKeyNone = INT32_MIN;        // key never attended (doc < 0 or padding)
constexpr int32_t kDocQueryNone = INT32_MIN + 1;  // query sees no key (doc < 0 or padding)

// Per-tile summary over the tile's *valid* entries (doc id not "none").
struct TileInfo {
  int32_t pmin, pmax;  // min / max position
  int32_t dmin, dmax;  // min / max mapped doc id
  int32_t any;         // at least one valid entry
  int32_t all;         // every entry valid
};

enum TileClass : int { kTileSkip = 0, kTileFull = 1, kTilePartial = 2 };

struct FwdArgs {
  const void* q;
  const void* kt;
  const void* v;
  void* out;  // [B, Hq, Sqp, Dp]
  void* lse;  // [B, Hq, Sqp], natural log, -inf for queries that see no key
  const int32_t *qpos, *qdoc, *kpos, *kdoc;
  const TileInfo *qti, *kti;  // [B, nqt], [B, nkt]
  int64_t B, Hq, Hk, Sqp, Skp, Dp, Bq, Bk, nqt, nkt;
  int causal;
  double sscale;         // bf16 kernels only: scale * log2(e) applied to S (q is unscaled)
  const int64_t* order;  // work items (b * Hq + h) * nqt + qt, heaviest first
  int64_t nitems;
  int64_t* counter;      // shared work-queue cursor (atomic)
};

struct BwdArgs {
  const void *q, *kt, *k, *vt, *dout;  // dout [B, Hq, Sqp, Dp]
  const void *qv, *dov;  // bf16 kernels only: q / dout as pairs along queries
  const void* lse2;   // [B, Hq, Sqp] lse * log2(e); +inf for queries that see nothing
  const void* delta;  // [B, Hq, Sqp] rowsum(dout * out) - dlse
  void* dq_part;      // [nc, B, Hq, Sqp, Dp] zero-initialised; += dS K (unscaled)
  void *dk, *dv;      // [B, Hk, Skp, Dp] fully written: sum over the GQA group of
                      //   dS^T Qs (unscaled) and P^T dO
  const int32_t *qpos, *qdoc, *kpos, *kdoc;
  const TileInfo *qti, *kti;
  int64_t B, Hq, Hk, Sqp, Skp, Dp, Bq, Bk, nqt, nkt;
  int causal;
  double sscale;     // bf16 kernels only (see FwdArgs)
  int64_t nc;        // key-tile chunks per (b, kv head): chunk c owns key tiles c, c+nc, ...
  int64_t nitems;    // B * Hk * nc, item = (b * Hk + kvh) * nc + c
  int64_t* counter;
};

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
