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
  RopeScaling rope_scaling;        // Llama 3.1 frequency scaling
  int64_t max_seq_len = 4096;      // max_position_embeddings
  int64_t sliding_window = 0;      // 0: full causal attention
  bool tie_word_embeddings = false;
  double init_std = 0.02;          // normal init of weights when training from scratch
  // Mixture-of-Experts feed-forward (NOTE [MoE feed-forward] in model/moe_feed_forward.h):
  // every block's SwiGLU is num_experts routed experts of ffn_hidden_size each, of which
  // each token uses num_experts_per_tok (Mixtral's routing). 0 and 0: a dense model.
  int64_t num_experts = 0;          // Hugging Face num_local_experts
  int64_t num_experts_per_tok = 0;  // top-k
  // The balancing loss's weight in the training loss (NOTE [MoE balancing loss] in
  // model/moe_feed_forward.h; transformers' router_aux_loss_coef); 0: none.
  double router_aux_loss_coef = 0.0;

  bool moe() const { return num_experts > 0; }

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
  int64_t params_per_layer() const;
  int64_t embedding_params() const;
  int64_t total_params() const;
  // The parameters one token uses: all but the experts it is not routed to (total_params()
  // for a dense model).
  int64_t active_params() const;
  std::optional<int64_t> checked_params_per_layer() const;
  std::optional<int64_t> checked_total_params() const;

  // Model FLOPs per token for a training step (forward + backward) at sequence length
  // seq_len, as ../shared/PERF.md defines it:
  //   6 * (parameters - input embedding) + 6 * layers * hidden * seq_len
  // with a MoE's active parameters (active_params()) in place of its parameters.
  double flops_per_token(int64_t seq_len) const;
};

}  // namespace forge
