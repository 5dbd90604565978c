// The compiled-in debug-tiny architecture; see config_defaults.h. Keep in step with
// configs/models/debug-tiny.yaml (ConfigDefaults.CompiledInTinyModelMatchesYaml).
#include "cli/config_defaults.h"

namespace forge {

ModelConfig debug_tiny_model() {
  ModelConfig model;
  model.name = kDefaultModelName;
  model.vocab_size = 32;
  model.hidden_size = 64;
  model.num_layers = 2;
  model.num_heads = 4;
  model.num_kv_heads = 2;
  model.head_dim = 0;
  model.ffn_hidden_size = 192;
  model.norm_eps = 1e-5;
  model.rope_theta = 10000.0;
  model.rope_scaling = RopeScaling{};
  model.max_seq_len = 256;
  model.sliding_window = 0;
  model.tie_word_embeddings = false;
  model.init_std = 0.02;
  return model;
}

}  // namespace forge
