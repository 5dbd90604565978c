// The attention component of a DeepSeek-V2/V3 block (NOTE [Composed blocks]): Multi-head
// Latent Attention, in place of SelfAttention when model.kv_lora_rank > 0.
//
// NOTE [Multi-head Latent Attention]
// With H heads, a no-rotary query/key part of dn dims, a rotary part of dr, values of dv,
// and h = rmsnorm(x):
//   q      = h W_q^T                                   [N, H (dn + dr)]
//            (or with q_lora_rank: rmsnorm(h W_qa^T) W_qb^T, the compressed query)
//   c_kv   = rmsnorm(h W_kva[:r]^T)                    [N, r]  (r = kv_lora_rank)
//   k_pe   = h W_kva[r:]^T                             [N, dr] one rotary key for every head
//   kv     = c_kv W_kvb^T                              [N, H (dn + dv)] per head k_nope, v
//   q_h = [q_nope_h | rope(q_pe_h)],  k_h = [k_nope_h | rope(k_pe)],  v_h
//   out    = x + attention(q, k, v) W_o^T              causal, softmax scale (dn + dr)^-1/2
//                                                      times YaRN's mscale^2 (ops/rope.h)
// which is transformers' DeepseekV2Attention / DeepseekV3Attention. The rows of W_kva are
// Hugging Face's kv_a_proj_with_mqa in one parameter; its two parts run as two GEMMs on
// row views of it, so the compressed part lands contiguous for its norm. The queries, k_pe
// and kv are assembled with rotary embedding into one packed row per token (mla_pack_qkv, ops/latent_attention.h)
// that the attention op reads with a value head dim of its own (dv, where queries and keys
// have dn + dr: ops/attention.h); nothing is padded. DeepSeek rotates interleaved pairs
// (x[2i], x[2i+1]) where forge rotates halves (x[i], x[i + dr/2]); the two agree once the
// rotary rows of the query and k_pe projections are reordered, which import and export do
// (HfTensor::rotary_rows in parameters.h), and the attention scores do not change since
// queries and keys are reordered alike.
// Under selective checkpointing a layer keeps its GEMM outputs that the backward reads (the
// compressed projections before their norms, the packed rotary q/k/v, the attention output
// and its statistics) and recomputes the three norms' outputs; q, k_pe and kv themselves are
// only read by the packing and live in scratch shared by every layer.
//
// NOTE [FP8 latent attention]
// With precision.fp8 every projection here (q, or q_a and q_b; kv_a; kv_b; o) is an FP8
// projection of Fp8Projections like a dense block's (NOTE [FP8 projections] in
// model/fp8_projections.h): its three GEMMs quantized as NOTE [FP8 tensorwise linear] in
// ops/fp8_linear.h says, with one statistics block per parameter. kv_a's two row views (the
// compressed rows and k_pe's rotary rows) share that parameter's settings and block: each
// GEMM takes its own view's amax under `tensorwise` (a finer scale for each part), and
// under `delayed` both take the block's scales, whose histories hold the larger amax of the
// two (one scale for the whole matrix, as a single GEMM would have). Their input gradients
// add into dh (fp8_linear_backward_input_add). The two views take turns in the parameter's
// one weight-cache entry (NOTE [FP8 weight cache], keyed by the weight's data pointer), so
// neither ever finds its codes there: kv_a's W is cast in every micro-batch, correctly. Under
// FSDP's FP8 all-gather kv_a travels as two pieces, one per row view, each cast with the
// scale its GEMMs take (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h). The norms, the rotary packing and the
// attention stay in the compute dtype, as a dense block's. On CUDA every width a GEMM
// contracts over must be a multiple of 16 (configs check: hidden_size, q_lora_rank, the
// query width, kv_lora_rank, qk_rope_head_dim, kv_b's and o's widths).
#pragma once

#include <vector>

#include "model/block_component.h"
#include "model/config.h"
#include "model/rotary_positions.h"
#include "ops/attention.h"
#include "ops/latent_attention.h"
#include "ops/lora.h"

namespace forge {

class LatentAttention final : public BlockComponent {
 public:
  explicit LatentAttention(const ModelConfig& config);

  std::vector<ParamSpec> param_specs(int layer) const override;
  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) override;
  void prepare(const StepShape& shape, Device device) override;
  void set_sequence_layout(const SequenceLayout* layout) override;
  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override;
  void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) override;
  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_hidden) override;

 private:
  // ComponentWeights numbering, param_specs order: attn_norm, then the query projection
  // (q, or q_a, q_a_norm, q_b), then kv_a, kv_a_norm, kv_b, o.
  struct Params {
    size_t norm = 0, q = 0, q_a = 0, q_a_norm = 0, q_b = 0, kv_a = 0, kv_a_norm = 0, kv_b = 0, out = 0, count = 0;
  };
  struct Activations {
    Tensor rstd;                      // [N] fp32
    Tensor normed;                    // [N, hidden]
    Tensor q_a, q_rstd, q_compressed; // with q_lora_rank: [N, rq], [N] fp32, its norm's output [N, rq]
    Tensor kv_a, kv_rstd, kv_compressed;  // [N, r], [N] fp32, its norm's output [N, r]
    Tensor qkv;                       // packed rotary queries, keys and values [B, T, W]
    Tensor out;                       // [B, T, H, dv]
    Tensor lse;                       // [B, H, T] fp32
  };

  // Rows [begin, end) of a [r + dr, hidden] kv_a weight (or gradient) as a projection, its
  // adapter's rows in `view` (NOTE [LoRA row views] in ops/lora.h; `later`: not the first
  // range in backward order; the rotary rows). An NF4 weight is dequantized into its scratch,
  // which the rows then view: nothing may dequantize into it before they are used. FP8-gathered
  // codes (FSDP's FP8 all-gather) come as two pieces, the rotary rows' second (NOTE [FP8
  // all-gather pieces] in distributed/fsdp_fp8_pieces.h).
  static LinearWeight rows(const LinearWeight& w, int64_t begin, int64_t end, LoraAdapter& view, bool later);
  void project_queries(Activations& a, const ComponentWeights& w);
  // Packed rows [B, T, W] in the form the attention op takes (NOTE [Value head dim]): as
  // they are, or [B, T, 3H, D] when the values' head dim equals the queries'.
  Tensor attention_rows(const Tensor& packed) const;

  int64_t hidden_, heads_, q_rank_, kv_rank_;
  MlaDims dims_;  // kv_rank 0: k_pe is handed to the packing on its own
  float eps_;
  RotaryPositions rotary_;
  AttentionShape attention_;
  Params p_;
  StepShape shape_;
  std::vector<Activations> layers_;
  // Shared by every layer: the forward's projections, read once by the packing, and the
  // backward's scratch.
  Tensor q_, k_pe_, kv_;
  Tensor d_out_, d_qkv_, d_q_, d_k_pe_, d_kv_, d_kv_compressed_, d_kv_a_, d_q_compressed_, d_q_a_;
  // kv_a's adapter restricted to its two row ranges, for the weights and the gradients.
  LoraAdapter kv_a_rows_[2], kv_a_grad_rows_[2];
};

}  // namespace forge
