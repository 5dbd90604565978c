#include "model/block_components.h"

#include "model/latent_attention.h"
#include "model/moe_feed_forward.h"
#include "model/self_attention.h"
#include "model/split_by_layer.h"
#include "model/swiglu_feed_forward.h"

namespace forge {

BlockComponents make_block_components(const ModelConfig& config, const PipelineStage& stage) {
  BlockComponents components;
  if (config.mla()) components.push_back(std::make_unique<LatentAttention>(config));
  else components.push_back(std::make_unique<SelfAttention>(config));
  const int64_t end = stage.end_layer < 0 ? config.num_layers : stage.end_layer;
  if (!config.moe() || end <= config.first_dense_layers) {  // a stage of dense blocks alone too
    components.push_back(std::make_unique<SwiGluFeedForward>(config));
  } else if (config.first_dense_layers > stage.first_layer) {  // DeepSeek's dense first blocks
    components.push_back(std::make_unique<SplitByLayer>(static_cast<int>(config.first_dense_layers),
                                                        std::make_unique<SwiGluFeedForward>(config),
                                                        std::make_unique<MoeFeedForward>(config),
                                                        stage.first_layer));
  } else {
    components.push_back(std::make_unique<MoeFeedForward>(config));
  }
  return components;
}

}  // namespace forge
