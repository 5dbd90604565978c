// ModelConfig: every architecture knob of the Llama-family decoder, with the parameter and
// FLOP accounting that forge info and the benchmark reports use (memory estimates live in
// model/memory_estimate.h, the rules a config must satisfy in model/config_rules.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/config_check.h"
#include "ops/rope.h"

namespace forge {

// The most parameters a model may have: about 1000 times the largest models trained today,
// and small enough that every byte count derived from it (16 bytes a parameter for
// weights, gradients and AdamW state) fits in int64_t with room to spare.
inline constexpr int64_t kMaxParams = int64_t{1} << 50;

struct ModelConfig {
  std::string name = "custom";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;         // d_model
  int64_t num_layers = 0;
  int64_t num_heads = 0;           // query heads
  int64_t num_kv_heads = 0;        // key/value heads (GQA); == num_heads for MHA
  int64_t head_dim = 0;            // 0: hidden_size / num_heads
  int64_t ffn_hidden_size = 0;     // SwiGLU intermediate size
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;        // Llama 3.1's or YaRN's frequency scaling (ops/rope.h)
  int64_t max_seq_len = 4096;      // max_position_embeddings
  int64_t sliding_window = 0;      // 0: full causal attention
  bool tie_word_embeddings = false;
  double init_std = 0.02;          // normal init of weights when training from scratch
  // Mixture-of-Experts feed-forward (NOTE [MoE feed-forward] in model/moe_feed_forward.h):
  // a block's SwiGLU is num_experts routed experts of moe_ffn_hidden_size each, of which
  // each token uses num_experts_per_tok, plus num_shared_experts every token uses (one
  // SwiGLU of num_shared_experts x moe_ffn_hidden_size, as DeepSeek's); the first
  // first_dense_layers blocks keep a dense SwiGLU of ffn_hidden_size (DeepSeek's
  // first_k_dense_replace). 0 experts: a dense model.
  int64_t num_experts = 0;          // Hugging Face num_local_experts / n_routed_experts
  int64_t num_experts_per_tok = 0;  // top-k
  int64_t moe_ffn_hidden_size = 0;  // Hugging Face moe_intermediate_size; 0: ffn_hidden_size
  int64_t num_shared_experts = 0;   // Hugging Face n_shared_experts
  int64_t first_dense_layers = 0;   // Hugging Face first_k_dense_replace
  // The routing (NOTE [MoE routing] in ops/moe.h): "softmax" (Mixtral, DeepSeek-V2) or
  // "sigmoid" (DeepSeek-V3) scores; the chosen weights renormalized to sum to 1
  // (norm_topk_prob) and multiplied by router_scaling_factor (routed_scaling_factor);
  // group-limited to the best router_topk_groups of router_num_groups expert groups
  // (n_group, topk_group; 1 and 1: not limited).
  std::string router_score_function = "softmax";
  bool router_normalize_topk = true;
  double router_scaling_factor = 1.0;
  int64_t router_num_groups = 1;
  int64_t router_topk_groups = 1;
  // The balancing loss's weight in the training loss (NOTE [MoE balancing loss] in
  // model/moe_feed_forward.h; transformers' router_aux_loss_coef); 0: none.
  double router_aux_loss_coef = 0.0;
  // Auxiliary-loss-free balancing (DeepSeek-V3; Megatron's moe_router_bias_update_rate):
  // after every optimizer step each sigmoid-routing bias moves by this much towards balance
  // (NOTE [Routing bias update] in train/trainer.cpp); 0: the biases stay as they are.
  double router_bias_update_rate = 0.0;
  // Which balancing loss (NOTE [MoE balancing loss]): "pooled" (transformers' Mixtral form,
  // over all layers' tokens), "per_layer" (Megatron's aux_loss: each layer's, E/k, summed),
  // "sequence" (Megatron's seq_aux_loss, DeepSeek's sequence-wise balance loss) or "global"
  // (Megatron's global_aux_loss: tokens per expert over the data-parallel ranks and the
  // step's micro-batches). Softmax routing only.
  std::string router_aux_loss_type = "pooled";
  // The router z-loss's weight (Megatron's moe_z_loss_coeff; NOTE [MoE balancing loss]); 0: none.
  double router_z_loss_coef = 0.0;
  // Token dropping (Megatron's --moe-expert-capacity-factor, --moe-token-drop-policy and
  // --moe-pad-expert-input-to-capacity; NOTE [MoE capacity] in ops/moe.h): with a factor
  // > 0 each expert keeps at most ceil(tokens x top-k / num_experts x factor) of a
  // micro-batch's assignments, those with the largest routing weights ("probs") or the first
  // in token order ("position"), and with moe_pad_to_capacity every expert runs exactly that
  // many rows. 0: dropless.
  double moe_capacity_factor = 0.0;
  std::string moe_token_drop_policy = "probs";
  bool moe_pad_to_capacity = false;
  // Multi-head Latent Attention (DeepSeek-V2/V3; NOTE [Multi-head Latent Attention] in
  // model/latent_attention.h) in place of grouped-query attention when kv_lora_rank > 0:
  // keys and values come from a kv_lora_rank-wide compressed projection, queries directly
  // or (q_lora_rank > 0) through one of q_lora_rank; each query/key head is
  // qk_nope_head_dim + qk_rope_head_dim wide (the rotary part shared by the key heads),
  // each value head v_head_dim. num_kv_heads equals num_heads and head_dim is unused.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  bool moe() const { return num_experts > 0; }
  bool mla() const { return kv_lora_rank > 0; }
  // Whether block `layer` has the Mixture-of-Experts feed-forward (the rest are dense).
  bool moe_layer(int64_t layer) const { return moe() && layer >= first_dense_layers; }
  int64_t resolved_moe_ffn() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn_hidden_size; }
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }  // MLA

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_heads; }
  int64_t q_size() const { return num_heads * resolved_head_dim(); }
  int64_t kv_size() const { return num_kv_heads * resolved_head_dim(); }

  // Throws forge::Error naming the offending keys, their values and what is expected when
  // the architecture is inconsistent; `keys` adds where each value came from (the cli's).
  // The rules are in model/config_rules.cpp.
  void validate(const KeyDescriber& keys = {}) const;

  // Parameter counts. validate() guarantees they fit (at most kMaxParams); on a config
  // that was not validated they throw instead of overflowing. The checked_ forms give
  // nothing when a product or sum overflows int64_t.
  int64_t layer_params(int64_t layer) const;  // block `layer`'s
  int64_t largest_layer_params() const;       // the largest block's
  int64_t embedding_params() const;
  int64_t total_params() const;
  // The parameters one token uses: all but the experts it is not routed to (total_params()
  // for a dense model).
  int64_t active_params() const;
  std::optional<int64_t> checked_layer_params(int64_t layer) const;
  std::optional<int64_t> checked_total_params() const;

  // Model FLOPs per token for a training step (forward + backward) at sequence length
  // seq_len, as ../shared/PERF.md defines it:
  //   6 * (parameters - input embedding) + 6 * layers * hidden * seq_len
  // with a MoE's active parameters (active_params()) in place of its parameters, and with
  // Multi-head Latent Attention heads x (qk head dim + v head dim) / 2 in place of hidden
  // (its score and value products are that wide).
  double flops_per_token(int64_t seq_len) const;

 private:
  void check_moe_rules(const KeyDescriber& keys) const;
  void check_mla_rules(const KeyDescriber& keys) const;
};

}  // namespace forge
