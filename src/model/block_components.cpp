#include "model/block_components.h"

#include "model/moe_feed_forward.h"
#include "model/self_attention.h"
#include "model/swiglu_feed_forward.h"

namespace forge {

BlockComponents make_block_components(const ModelConfig& config) {
  BlockComponents components;
  components.push_back(std::make_unique<SelfAttention>(config));
  if (config.moe()) components.push_back(std::make_unique<MoeFeedForward>(config));
  else components.push_back(std::make_unique<SwiGluFeedForward>(config));
  return components;
}

}  // namespace forge
