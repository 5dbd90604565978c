// ModelConfig: every architecture knob of the Llama-family decoder, with the parameter,
// FLOP and memory accounting that forge info and the benchmark reports use.
#pragma once

#include <cstdint>
#include <string>

#include "ops/rope.h"

namespace forge {

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

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_heads; }
  int64_t q_size() const { return num_heads * resolved_head_dim(); }
  int64_t kv_size() const { return num_kv_heads * resolved_head_dim(); }

  // Throws forge::Error naming the offending key when the architecture is inconsistent.
  void validate() const;

  // Parameter counts.
  int64_t params_per_layer() const;
  int64_t embedding_params() const { return vocab_size * hidden_size; }
  int64_t total_params() const;

  // Model FLOPs per token for a training step (forward + backward) at sequence length
  // seq_len, as ../shared/PERF.md defines it:
  //   6 * (parameters - input embedding) + 6 * layers * hidden * seq_len
  double flops_per_token(int64_t seq_len) const;
};

// Memory needed for one training step on one device, in bytes, by component.
struct MemoryEstimate {
  double weights = 0;           // compute copy of the weights
  double master_weights = 0;    // fp32 master weights (0 when compute is fp32)
  double gradients = 0;
  double optimizer_state = 0;   // AdamW m and v
  double activations = 0;       // saved for backward, whole micro-batch
  double total() const { return weights + master_weights + gradients + optimizer_state + activations; }
};

// compute_bytes: bytes per element of weights/activations (4 for fp32, 2 for bf16).
MemoryEstimate estimate_memory(const ModelConfig& config, int64_t micro_batch, int64_t seq_len,
                               int compute_bytes);

}  // namespace forge
