#include "data/markov_source.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/parallel.h"

namespace forge {

namespace {

constexpr int64_t kMaxContexts = int64_t{1} << 20;
constexpr int64_t kMaxTableEntries = int64_t{1} << 24;
constexpr int kMaxPowerIterations = 20000;
constexpr double kStationaryTolerance = 1e-13;

// V^order, or -1 once it exceeds `limit`.
int64_t power_up_to(int64_t base, int64_t exponent, int64_t limit) {
  int64_t result = 1;
  for (int64_t i = 0; i < exponent; ++i) {
    if (result > limit / base) return -1;
    result *= base;
  }
  return result;
}

double entropy(const double* p, int64_t n) {
  double h = 0.0;
  for (int64_t i = 0; i < n; ++i)
    if (p[i] > 0.0) h -= p[i] * std::log(p[i]);
  return h;
}

std::vector<double> inclusive_sums(const std::vector<double>& values, int64_t row) {
  std::vector<double> sums(values.size());
  for (size_t begin = 0; begin < values.size(); begin += static_cast<size_t>(row)) {
    double total = 0.0;
    for (size_t i = begin; i < begin + static_cast<size_t>(row); ++i) sums[i] = total += values[i];
  }
  return sums;
}

}  // namespace

MarkovSource::MarkovSource(int64_t vocab_size, int64_t order, double concentration, uint64_t seed)
    : vocab_size_(vocab_size), order_(order) {
  FORGE_CHECK(vocab_size >= 1, "vocab_size {}", vocab_size);
  if (order < 0) FORGE_FAIL("data.synthetic_order is {}: expected a non-negative Markov order", order);
  if (!(concentration > 0.0) || !std::isfinite(concentration))
    FORGE_FAIL("data.synthetic_concentration is {}: expected a positive number (0.1 gives peaked transitions)",
               concentration);
  num_contexts_ = power_up_to(vocab_size, order, kMaxContexts);
  if (num_contexts_ < 0 || num_contexts_ * vocab_size > kMaxTableEntries)
    FORGE_FAIL("data.synthetic_order {} with vocabulary {} needs {}^{} contexts: expected at most {} contexts and "
               "{} transition entries; lower data.synthetic_order",
               order, vocab_size, vocab_size, order, kMaxContexts, kMaxTableEntries);
  transitions_.resize(static_cast<size_t>(num_contexts_ * vocab_size_));
  // One table of log-weights per lag: lag_logits[(lag - 1) * V * V + token * V + next].
  const size_t square = static_cast<size_t>(vocab_size_ * vocab_size_);
  std::vector<double> lag_logits(static_cast<size_t>(order_) * square);
  for (int64_t lag = 1; lag <= order_; ++lag) {
    Rng rng(derive_seed(seed, static_cast<uint64_t>(lag)));
    for (size_t i = 0; i < square; ++i)
      lag_logits[static_cast<size_t>(lag - 1) * square + i] = std::log(std::max(rng.uniform(), 1e-300)) / concentration;
  }
  parallel_for(num_contexts_, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> logits(static_cast<size_t>(vocab_size_));
    for (int64_t ctx = begin; ctx < end; ++ctx) {
      std::fill(logits.begin(), logits.end(), 0.0);
      int64_t rest = ctx;
      for (int64_t lag = 1; lag <= order_; ++lag, rest /= vocab_size_) {
        const double* table = &lag_logits[static_cast<size_t>(lag - 1) * square +
                                          static_cast<size_t>(rest % vocab_size_ * vocab_size_)];
        for (int64_t v = 0; v < vocab_size_; ++v) logits[v] += table[v];
      }
      double top = *std::max_element(logits.begin(), logits.end());
      double* row = &transitions_[static_cast<size_t>(ctx * vocab_size_)];
      double total = 0.0;
      for (int64_t v = 0; v < vocab_size_; ++v) total += row[v] = std::exp(logits[v] - top);
      for (int64_t v = 0; v < vocab_size_; ++v) row[v] /= total;
    }
  });
  analyze();
}

MarkovSource::MarkovSource(int64_t vocab_size, int64_t order, std::vector<double> transitions)
    : vocab_size_(vocab_size), order_(order), transitions_(std::move(transitions)) {
  num_contexts_ = power_up_to(vocab_size, order, kMaxContexts);
  FORGE_CHECK(num_contexts_ > 0 && transitions_.size() == static_cast<size_t>(num_contexts_ * vocab_size_),
              "table of {} entries for vocabulary {} and order {}", transitions_.size(), vocab_size, order);
  for (int64_t ctx = 0; ctx < num_contexts_; ++ctx) {
    double total = 0.0;
    for (int64_t v = 0; v < vocab_size_; ++v) total += transition(ctx, v);
    FORGE_CHECK(std::abs(total - 1.0) < 1e-9, "row {} sums to {}", ctx, total);
  }
  analyze();
}

void MarkovSource::analyze() {
  compute_stationary();
  cumulative_transitions_ = inclusive_sums(transitions_, vocab_size_);
  cumulative_stationary_ = inclusive_sums(stationary_, num_contexts_);
  entropy_rate_ = 0.0;
  for (int64_t ctx = 0; ctx < num_contexts_; ++ctx)
    entropy_rate_ += stationary_[ctx] * entropy(&transitions_[static_cast<size_t>(ctx * vocab_size_)], vocab_size_);
}

// Power iteration pi <- pi P. The contexts that can precede context r * V + v are
// a * V^(k-1) + r for every token a, so each block of V successors is computed by one
// task in a fixed order (NOTE [Deterministic CPU parallelism]).
void MarkovSource::compute_stationary() {
  stationary_.assign(static_cast<size_t>(num_contexts_), 1.0 / static_cast<double>(num_contexts_));
  if (order_ == 0) return;
  const int64_t blocks = num_contexts_ / vocab_size_;
  std::vector<double> next(stationary_.size());
  for (int iteration = 0; iteration < kMaxPowerIterations; ++iteration) {
    parallel_for(blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        double* out = &next[static_cast<size_t>(r * vocab_size_)];
        std::fill(out, out + vocab_size_, 0.0);
        for (int64_t a = 0; a < vocab_size_; ++a) {
          int64_t ctx = a * blocks + r;
          double mass = stationary_[static_cast<size_t>(ctx)];
          const double* row = &transitions_[static_cast<size_t>(ctx * vocab_size_)];
          for (int64_t v = 0; v < vocab_size_; ++v) out[v] += mass * row[v];
        }
      }
    });
    double total = 0.0, change = 0.0;
    for (double p : next) total += p;
    for (size_t i = 0; i < next.size(); ++i) {
      next[i] /= total;
      change += std::abs(next[i] - stationary_[i]);
    }
    stationary_.swap(next);
    if (change < kStationaryTolerance) return;
  }
  FORGE_FAIL("data.synthetic_concentration: the synthetic Markov chain (vocabulary {}, order {}) did not reach its "
             "stationary distribution in {} iterations; raise data.synthetic_concentration",
             vocab_size_, order_, kMaxPowerIterations);
}

double MarkovSource::prefix_entropy(int64_t m) const {
  if (m > order_) return prefix_entropy(order_) + static_cast<double>(m - order_) * entropy_rate_;
  int64_t block = num_contexts_;
  for (int64_t i = 0; i < m; ++i) block /= vocab_size_;
  double h = 0.0;
  for (int64_t begin = 0; begin < num_contexts_; begin += block) {
    double p = 0.0;
    for (int64_t ctx = begin; ctx < begin + block; ++ctx) p += stationary_[static_cast<size_t>(ctx)];
    if (p > 0.0) h -= p * std::log(p);
  }
  return h;
}

double MarkovSource::sample_entropy_floor(int64_t seq_len) const {
  FORGE_CHECK(seq_len >= 1, "seq_len {}", seq_len);
  return (prefix_entropy(seq_len + 1) - prefix_entropy(1)) / static_cast<double>(seq_len);
}

int64_t MarkovSource::draw(const std::vector<double>& cumulative, size_t begin, size_t count, double u) {
  auto first = cumulative.begin() + static_cast<std::ptrdiff_t>(begin);
  auto last = first + static_cast<std::ptrdiff_t>(count);
  double target = u * *(last - 1);
  auto it = std::upper_bound(first, last, target);
  return std::min<int64_t>(it - first, static_cast<int64_t>(count) - 1);
}

void MarkovSource::generate(Rng& rng, int64_t length, int32_t* out) const {
  int64_t ctx = draw(cumulative_stationary_, 0, static_cast<size_t>(num_contexts_), rng.uniform());
  int64_t divisor = num_contexts_;
  for (int64_t i = 0; i < std::min(order_, length); ++i) {
    divisor /= vocab_size_;
    out[i] = static_cast<int32_t>(ctx / divisor % vocab_size_);
  }
  for (int64_t i = order_; i < length; ++i) {
    int64_t token = draw(cumulative_transitions_, static_cast<size_t>(ctx * vocab_size_),
                         static_cast<size_t>(vocab_size_), rng.uniform());
    out[i] = static_cast<int32_t>(token);
    ctx = (ctx * vocab_size_ + token) % num_contexts_;
  }
}

}  // namespace forge
