// What the LoRA tests under the parallel layouts start from: adapters with B drawn too, as
// after some training, so that every adapter's gradient reaches A and B from the first step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/rng.h"
#include "model/lora.h"

namespace forge::testing {

// Adapters from seed 11 with B drawn too (as after some training), over `base`.
inline std::unique_ptr<LoraAdapters> trained_adapters(const ModelConfig& m, const LoraConfig& lora, int64_t tokens,
                                                      ParamSource& base, TensorParallelShard shard = {}) {
  auto adapters = std::make_unique<LoraAdapters>(m, lora, Device::CPU, tokens, shard);
  adapters->initialize(11);
  for (size_t k = 0; k < adapters->targets().size(); ++k)
    for (size_t p = 0; p < adapters->targets()[k].parts.size(); ++p) {
      Tensor b = adapters->part_matrix(k, p, 'b');
      Rng rng(derive_seed(12, k * 16 + p));
      for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = static_cast<float>(0.2 * (rng.uniform() - 0.5));
      adapters->set_part_matrix(k, p, 'b', b);
    }
  adapters->refresh_compute();
  adapters->set_base(base);
  return adapters;
}

}  // namespace forge::testing
