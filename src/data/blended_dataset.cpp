// parse_blend and BlendedDataset; see blended_dataset.h. The greedy assignment depends
// on the whole stream before a sample, so every component's running count is kept at
// every 256th sample of the stream, computed forward as far as a sample has been asked
// for: sequential reads extend it step by step, a resume at sample g computes it once
// (g x components steps), and any sample is then at most 255 greedy steps away.
#include "data/blended_dataset.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"

namespace forge {

namespace {

constexpr int64_t kCheckpointStride = 256;
constexpr uint64_t kComponentOrderStream = 0xB1E4D0;

}  // namespace

std::vector<BlendComponent> parse_blend(const std::string& blend) {
  std::istringstream stream(blend);
  std::vector<std::string> words;
  for (std::string word; stream >> word;) words.push_back(word);
  if (words.empty())
    FORGE_FAIL("data.blend is empty: expected weight/prefix pairs such as \"0.3 /data/a_text_document 0.7 "
               "/data/b_text_document\"");
  if (words.size() % 2 != 0)
    FORGE_FAIL("data.blend '{}' has {} words: expected pairs of a weight and a dataset prefix (\"W1 PREFIX1 W2 "
               "PREFIX2 ...\")",
               blend, words.size());
  std::vector<BlendComponent> components;
  double total = 0;
  for (size_t i = 0; i < words.size(); i += 2) {
    const std::string& word = words[i];
    double weight = 0;
    auto [end, error] = std::from_chars(word.data(), word.data() + word.size(), weight);
    if (error != std::errc() || end != word.data() + word.size() || !std::isfinite(weight) || weight <= 0)
      FORGE_FAIL("data.blend: weight {} of '{}' is '{}': expected a positive number before the prefix '{}'",
                 i / 2 + 1, blend, word, words[i + 1]);
    components.push_back({weight, words[i + 1]});
    total += weight;
  }
  if (components.size() > std::numeric_limits<uint16_t>::max())
    FORGE_FAIL("data.blend has {} datasets: at most {} are supported", components.size(),
               std::numeric_limits<uint16_t>::max());
  if (!std::isfinite(total))
    FORGE_FAIL("data.blend '{}': the weights add up to more than the largest number (they overflow); scale them down",
               blend);
  for (size_t i = 0; i < components.size(); ++i) {
    components[i].weight /= total;
    if (!(components[i].weight > 0))
      FORGE_FAIL("data.blend: weight {} ('{}' for '{}') is too small next to the others' total {} to ever be drawn",
                 i + 1, words[2 * i], components[i].prefix, total);
  }
  return components;
}

BlendedDataset::BlendedDataset(std::vector<std::unique_ptr<TokenDataset>> components, std::vector<double> weights,
                               uint64_t seed)
    : components_(std::move(components)), weights_(std::move(weights)), seed_(seed) {
  const size_t count = components_.size();
  FORGE_CHECK(count >= 1 && count == weights_.size() && count <= std::numeric_limits<uint16_t>::max(),
              "{} components, {} weights", count, weights_.size());
  seq_len_ = components_[0]->seq_len();
  for (const auto& component : components_) {
    FORGE_CHECK(component->seq_len() == seq_len_ && component->num_samples() >= 1, "component of {} samples of {}",
                component->num_samples(), component->seq_len());
    num_samples_ += component->num_samples();
  }
  cached_orders_.resize(count);
  count_checkpoints_.assign(count, 0);
}

int BlendedDataset::choose(int64_t global, const std::vector<int64_t>& counts) const {
  const double position = std::max(static_cast<double>(global), 1.0);
  int best = 0;
  double best_error = weights_[0] * position - static_cast<double>(counts[0]);
  for (size_t i = 1; i < counts.size(); ++i) {
    const double error = weights_[i] * position - static_cast<double>(counts[i]);
    if (error > best_error) {
      best_error = error;
      best = static_cast<int>(i);
    }
  }
  return best;
}

BlendedDataset::Location BlendedDataset::locate(int64_t global) const {
  const size_t count = components_.size();
  const int64_t checkpoint = global / kCheckpointStride;
  std::vector<int64_t> counts(count);
  {
    std::lock_guard lock(mutex_);
    while (static_cast<int64_t>(count_checkpoints_.size() / count) <= checkpoint) {
      const int64_t last = static_cast<int64_t>(count_checkpoints_.size() / count) - 1;
      counts.assign(count_checkpoints_.end() - static_cast<std::ptrdiff_t>(count), count_checkpoints_.end());
      for (int64_t g = last * kCheckpointStride; g < (last + 1) * kCheckpointStride; ++g) ++counts[choose(g, counts)];
      count_checkpoints_.insert(count_checkpoints_.end(), counts.begin(), counts.end());
    }
    const auto first = count_checkpoints_.begin() + static_cast<std::ptrdiff_t>(checkpoint) * static_cast<std::ptrdiff_t>(count);
    counts.assign(first, first + static_cast<std::ptrdiff_t>(count));
  }
  for (int64_t g = checkpoint * kCheckpointStride; g < global; ++g) ++counts[choose(g, counts)];
  const int component = choose(global, counts);
  return {component, counts[static_cast<size_t>(component)]};
}

std::shared_ptr<const std::vector<int64_t>> BlendedDataset::component_order(int component, int64_t epoch) const {
  std::lock_guard lock(mutex_);
  CachedOrder& cached = cached_orders_[static_cast<size_t>(component)];
  if (cached.epoch == epoch) return cached.order;
  auto order = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(components_[static_cast<size_t>(component)]->num_samples()));
  std::iota(order->begin(), order->end(), int64_t{0});
  Rng rng(derive_seed(derive_seed(seed_, kComponentOrderStream + static_cast<uint64_t>(component)),
                      static_cast<uint64_t>(epoch)));
  for (size_t i = order->size(); i > 1; --i) std::swap((*order)[i - 1], (*order)[rng.below(i)]);
  cached = {epoch, order};
  return order;
}

void BlendedDataset::sample(int64_t epoch, int64_t index, int32_t* out) const {
  FORGE_CHECK(index >= 0 && index < num_samples_ && epoch >= 0, "sample {} of {} in epoch {}", index, num_samples_,
              epoch);
  const Location location = locate(epoch * num_samples_ + index);
  const TokenDataset& dataset = *components_[static_cast<size_t>(location.component)];
  const int64_t component_epoch = location.component_sample / dataset.num_samples();
  int64_t component_index = location.component_sample % dataset.num_samples();
  if (dataset.shuffle_samples())
    component_index = (*component_order(location.component, component_epoch))[static_cast<size_t>(component_index)];
  dataset.sample(component_epoch, component_index, out);
}

}  // namespace forge
