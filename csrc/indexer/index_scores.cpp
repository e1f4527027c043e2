// The lightning indexer's scores (DeepSeek V3.2 sparse attention) with one fixed reduction order.
//
// index_scores(q [B, L, H, D], w [B, L, H], k [B, n, D], scale) -> [B, L, n] float32:
//   out[b, l, j] = sum_{h = 0..H-1} w[b, l, h] * relu(scale * sum_{t = 0..D-1} q[b, l, h, t] * k[b, j, t])
// accumulated in float32 in exactly that order (t, then h) for every (query, key) pair, scalar code
// compiled without FMA or reassociation: a pair's score is the same bits whatever the batch, the
// number of queries or keys in the call (hence the CP size: CP=1 and every CP rank call this on the
// same global key blocks) and the CPU. Forward only (the indexer selects under no_grad). Inputs of
// any floating dtype are read as float32 (bf16 -> float32 is exact). docs/wrappers.md, DSA.
#pragma GCC optimize("fp-contract=off")  // every product rounded before its sum, on every CPU and flag set

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace hp_indexer {

at::Tensor index_scores_cpu(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, double scale) {
  TORCH_CHECK(q.dim() == 4 && w.dim() == 3 && k.dim() == 3,
              "index_scores: expected q [B, L, H, D], w [B, L, H], k [B, n, D], got ", q.sizes(), ", ", w.sizes(),
              ", ", k.sizes());
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), n = k.size(1);
  TORCH_CHECK(w.size(0) == B && w.size(1) == L && w.size(2) == H && k.size(0) == B && k.size(2) == D,
              "index_scores: shapes disagree: q ", q.sizes(), ", w ", w.sizes(), ", k ", k.sizes());
  TORCH_CHECK(q.is_floating_point() && w.is_floating_point() && k.is_floating_point(),
              "index_scores: floating-point inputs expected");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor wf = w.to(at::kFloat).contiguous();
  const at::Tensor kf = k.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, L, n}, qf.options());
  const float* qp = qf.data_ptr<float>();
  const float* wp = wf.data_ptr<float>();
  const float* kp = kf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * L, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bl = begin; bl < end; ++bl) {
      const float* qrow = qp + bl * H * D;
      const float* wrow = wp + bl * H;
      const float* keys = kp + (bl / L) * n * D;
      float* orow = op + bl * n;
      for (int64_t j = 0; j < n; ++j) {
        const float* key = keys + j * D;
        float acc = 0.f;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qrow + h * D;
          float dot = 0.f;
          for (int64_t t = 0; t < D; ++t) {
            const float prod = qh[t] * key[t];  // rounded on its own: no fused multiply-add
            dot += prod;
          }
          const float r = s * dot;
          const float relu = r > 0.f ? r : (r == r ? 0.f : r);  // NaN stays NaN, as torch.relu
          const float term = wrow[h] * relu;
          acc += term;
        }
        orow[j] = acc;
      }
    }
  });
  return out;
}

}  // namespace hp_indexer

TORCH_LIBRARY_FRAGMENT(hyper_parallel, m) {
  m.def("index_scores(Tensor q, Tensor w, Tensor k, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyper_parallel, CPU, m) {
  m.impl("index_scores", &hp_indexer::index_scores_cpu);
}
