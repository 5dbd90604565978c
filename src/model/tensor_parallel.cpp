#include "model/tensor_parallel.h"

#include "core/error.h"
#include "model/parameters.h"

namespace forge {

void check_tensor_parallel(const ModelConfig& config, int64_t degree) {
  FORGE_CHECK(degree >= 1, "tensor-parallel degree {} (at least 1)", degree);
  if (degree == 1) return;
  if (config.mla() || config.moe())
    FORGE_FAIL("tensor parallelism over {} ranks: model '{}' has {}; tensor parallelism splits the dense "
               "Llama-family blocks (grouped-query attention and a SwiGLU feed-forward); use expert parallelism "
               "(parallelism.expert_parallel_degree) and FSDP for it",
               degree, config.name,
               config.mla() ? "Multi-head Latent Attention (model.kv_lora_rank)" : "Mixture-of-Experts blocks");
  auto divides = [&](int64_t value, const char* key, const char* what) {
    if (value % degree != 0)
      FORGE_FAIL("tensor parallelism over {} ranks splits the {} of model {} ({} = {}), which {} does not divide: "
                 "choose a degree that divides it",
                 degree, what, config.name, key, value, degree);
  };
  divides(config.num_heads, "model.num_heads", "query heads");
  divides(config.num_kv_heads, "model.num_kv_heads", "key/value heads");
  divides(config.ffn_hidden_size, "model.ffn_hidden_size", "feed-forward width");
  divides(config.vocab_size, "model.vocab_size", "vocabulary (the vocabulary-parallel embedding and head)");
}

int64_t tensor_parallel_rank_parameters(const ModelConfig& config, int64_t degree) {
  int64_t n = 0;
  for (const ParamSpec& spec : parameter_specs(config, {0, static_cast<int>(degree)})) n += shape_numel(spec.shape);
  return n;
}

}  // namespace forge
