// Dense attention on the GPU (ops/dense_attention.h): the scores written out,
// two batched cuBLASLt GEMMs around forge's softmax kernel
// (dense_attention_softmax.cu).
//
// NOTE [Dense attention on the GPU]
// The inputs are token-major ([B, L, H, D], a projection's output viewed per
// head), while a batched GEMM wants each (sample, head) pair's matrix
// contiguous. So a chunk of pairs is first gathered head-major into scratch,
// zero-padded on the way: head dims to Dp = round_up(D, 8) (and Dv to Dvp), key
// rows to Lkp = round_up(Lk, 8). Zero columns add nothing to q.k, zero key rows
// give scores the softmax never reads, zero value rows meet probabilities of 0;
// and every leading dimension and matrix stride is then a multiple of 8
// elements (16 bytes), which cuBLASLt's tensor-core kernels want, whatever D,
// Dv and Lk are (T5's 64, the VAE's 512, a test's 6). Per chunk of n pairs:
//   K [n, Lkp, Dp], V [n, Lkp, Dvp]  gathered once;
//   per chunk of r query rows:
//   Q [n, r, Dp]                      gathered;
//   S = scale Q K^T                   one batched GEMM, fp32 out [n, r, Lkp]
//   (fp32 accumulation); P = softmax(S + bias)             softmax_bias_rows,
//   fp32 inside, bf16 out [n, r, Lkp]; O = P V                           one
//   batched GEMM, bf16 out [n, r, Dvp]; out[b, i, h, :Dv] = O scattered back
//   token-major.
//
// Memory: n and r are chosen so that a chunk's K, V, Q, S, P and O fit
// kScratchBudget (all pairs' whole rows when they fit, else fewer pairs, else
// one pair and fewer rows), in one grow-only scratch slot
// (kernels/cuda/scratch.h) that the process keeps. T5-XXL's 64 heads of 512 x
// 512 take 1.8 MB per pair, so a chunk holds 146 pairs; a 1024 x 1024 image's
// VAE attention (16384 x 16384, head dim 512) goes through in chunks of about
// 2300 query rows.
//
// Cost beyond the GEMMs: the gathers and the scatter move q, k, v and out once
// more each (T5-XXL: 4 MB per caption and layer), and each score is written (4
// bytes), read twice (8) and its probability written and read by the second
// GEMM (4): about 16 bytes per score, against 2 (D + Dv) flops per score in the
// GEMMs (256 for T5).
#include "kernels/cuda/dense_attention.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/dense_attention_softmax.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int64_t kScratchBudget = int64_t{256} << 20;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

void dense_attention_forward(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* bias, int64_t batch,
                             int64_t q_len, int64_t kv_len, int64_t heads, int64_t head_dim, int64_t v_head_dim,
                             float scale) {
  const int64_t pairs = batch * heads;
  if (pairs == 0 || q_len == 0 || v_head_dim == 0) return;
  FORGE_CHECK(kv_len >= 1, "dense_attention_forward: no keys to attend to");
  const int64_t dp = std::max<int64_t>(8, round_up(head_dim, 8)), dvp = round_up(v_head_dim, 8);
  const int64_t lkp = round_up(kv_len, 8);

  // The chunk: n pairs of r query rows.
  const int64_t kv_pair_bytes = lkp * (dp + dvp) * 2;
  const int64_t row_bytes = lkp * 6 + (dp + dvp) * 2;  // S (fp32) and P, Q and O (bf16)
  int64_t n = 1, r = q_len;
  if (kv_pair_bytes + q_len * row_bytes <= kScratchBudget)
    n = std::clamp<int64_t>(kScratchBudget / (kv_pair_bytes + q_len * row_bytes), 1, pairs);
  else
    r = std::clamp<int64_t>((kScratchBudget - std::min(kv_pair_bytes, kScratchBudget / 2)) / row_bytes, 1, q_len);

  auto segment = [](int64_t bytes) { return round_up(bytes, 256); };
  const int64_t k_bytes = segment(n * lkp * dp * 2), v_bytes = segment(n * lkp * dvp * 2);
  const int64_t q_bytes = segment(n * r * dp * 2), s_bytes = segment(n * r * lkp * 4);
  const int64_t p_bytes = segment(n * r * lkp * 2), o_bytes = segment(n * r * dvp * 2);
  char* base = static_cast<char*>(scratch_buffer(
      ScratchSlot::DenseAttention, static_cast<size_t>(k_bytes + v_bytes + q_bytes + s_bytes + p_bytes + o_bytes)));
  bf16* kh = reinterpret_cast<bf16*>(base);
  bf16* vh = reinterpret_cast<bf16*>(base + k_bytes);
  bf16* qh = reinterpret_cast<bf16*>(base + k_bytes + v_bytes);
  float* s = reinterpret_cast<float*>(base + k_bytes + v_bytes + q_bytes);
  bf16* ph = reinterpret_cast<bf16*>(base + k_bytes + v_bytes + q_bytes + s_bytes);
  bf16* oh = reinterpret_cast<bf16*>(base + k_bytes + v_bytes + q_bytes + s_bytes + p_bytes);

  for (int64_t p0 = 0; p0 < pairs; p0 += n) {
    const int64_t np = std::min(n, pairs - p0);
    gather_heads(kh, k, p0, np, heads, kv_len, 0, kv_len, lkp, head_dim, dp);
    gather_heads(vh, v, p0, np, heads, kv_len, 0, kv_len, lkp, v_head_dim, dvp);
    for (int64_t r0 = 0; r0 < q_len; r0 += r) {
      const int64_t nr = std::min(r, q_len - r0);
      gather_heads(qh, q, p0, np, heads, q_len, r0, nr, nr, head_dim, dp);
      matmul_batched(s, DType::F32, qh, false, kh, true, nr, lkp, dp, np, scale, 0.f);
      softmax_bias_rows(ph, s, bias, np, nr, p0, heads, q_len, r0, kv_len, lkp);
      matmul_batched(oh, DType::BF16, ph, false, vh, false, nr, dvp, lkp, np, 1.f, 0.f);
      scatter_heads(out, oh, p0, np, heads, q_len, r0, nr, v_head_dim, dvp);
    }
  }
}

}  // namespace forge::cuda
