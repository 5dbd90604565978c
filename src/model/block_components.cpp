#include "model/block_components.h"

#include "model/latent_attention.h"
#include "model/moe_feed_forward.h"
#include "model/self_attention.h"
#include "model/split_by_layer.h"
#include "model/swiglu_feed_forward.h"

namespace forge {

BlockComponents make_block_components(const ModelConfig& config) {
  BlockComponents components;
  if (config.mla()) components.push_back(std::make_unique<LatentAttention>(config));
  else components.push_back(std::make_unique<SelfAttention>(config));
  if (!config.moe()) {
    components.push_back(std::make_unique<SwiGluFeedForward>(config));
  } else if (config.first_dense_layers > 0) {  // DeepSeek's dense first blocks
    components.push_back(std::make_unique<SplitByLayer>(static_cast<int>(config.first_dense_layers),
                                                        std::make_unique<SwiGluFeedForward>(config),
                                                        std::make_unique<MoeFeedForward>(config)));
  } else {
    components.push_back(std::make_unique<MoeFeedForward>(config));
  }
  return components;
}

}  // namespace forge
