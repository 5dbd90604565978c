// Blends: training on several indexed datasets at once in fixed proportions, as
// Megatron-LM's --data-path "0.3 prefixA 0.7 prefixB" does. data.blend holds the same
// string: weight, prefix, weight, prefix, ... (whitespace-separated, so prefixes cannot
// contain spaces). Weights are positive numbers, normalized to sum to 1.
//
// Each component is its own PackedDataset: its sequences split by data.split, packed and
// shuffled with its own seed. BlendedDataset interleaves their samples with Megatron's
// greedy rule (megatron/core/datasets/helpers.cpp, build_blending_indices): sample g of
// the blend goes to the component whose count so far falls furthest below its share,
// argmax_i(w_i * max(g, 1) - c_i), ties to the first. Every prefix of the blend thus has
// each component within about one sample of its weight, and the interleave itself has no
// randomness: the seed changes which samples each component gives, not when.
//
// NOTE [Blend sizing]
// Megatron sizes a blend to the run: for N = train_iters x global_batch_size samples it
// asks component i for ceil(N * w_i) samples, and a component whose data is shorter
// wraps into further epochs of itself (reshuffled), while a longer one is only partly
// used. forge does the same without knowing N up front: the greedy rule runs over the
// whole sample stream g = epoch x num_samples() + index (never restarting), and the k-th
// sample the rule gives component i is sample k mod n_i of its epoch k / n_i (n_i: its
// samples per epoch, each epoch a fresh shuffle of them). A run of N samples thus sees
// each component exactly as Megatron's run of N samples would, and the proportions hold
// to within one sample at every point of the run. num_samples(), one blend "epoch", is
// n_1 + ... + n_k, the data of all components together; it only names positions, the
// stream continues across it. The loader must not reshuffle blend samples
// (shuffle_samples() is false), or the proportions would hold only on average.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace forge {

struct BlendComponent {
  double weight = 0;  // normalized: the weights of a blend sum to 1
  std::string prefix;
};

// Parses data.blend. Fails naming data.blend and the offending word: an odd number of
// words, a weight that is not a positive finite number, or an empty blend.
std::vector<BlendComponent> parse_blend(const std::string& blend);

class BlendedDataset : public TokenDataset {
 public:
  // `components` are the component datasets, in the order of `weights` (normalized);
  // each component's samples must be seq_len + 1 tokens of the same seq_len.
  BlendedDataset(std::vector<std::unique_ptr<TokenDataset>> components, std::vector<double> weights,
                 uint64_t seed);

  int64_t num_samples() const override { return num_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override;

  // The component that sample `index` of blend epoch `epoch` comes from.
  int component_of(int64_t epoch, int64_t index) const { return locate(epoch * num_samples_ + index).component; }
  int num_components() const { return static_cast<int>(components_.size()); }

 private:
  struct Location {
    int component;
    int64_t component_sample;  // how many samples the component gave before this one
  };
  // Where sample `global` of the stream comes from.
  Location locate(int64_t global) const;
  // The greedy choice for sample `global` given each component's count before it.
  int choose(int64_t global, const std::vector<int64_t>& counts) const;
  // The order in which `component` visits its samples in its epoch `epoch`.
  std::shared_ptr<const std::vector<int64_t>> component_order(int component, int64_t epoch) const;

  struct CachedOrder {
    int64_t epoch = -1;
    std::shared_ptr<const std::vector<int64_t>> order;
  };

  std::vector<std::unique_ptr<TokenDataset>> components_;
  std::vector<double> weights_;
  uint64_t seed_;
  int64_t seq_len_ = 0;
  int64_t num_samples_ = 0;
  mutable std::mutex mutex_;
  // Every component's count before samples 0, 256, 512, ... of the stream, grown on demand.
  mutable std::vector<int64_t> count_checkpoints_;
  mutable std::vector<CachedOrder> cached_orders_;
};

}  // namespace forge
