// An order-k Markov source over a vocabulary: the generator behind forge's synthetic
// corpus, whose achievable loss is known exactly.
//
// NOTE [Synthetic entropy floor]
// A context is the last k tokens, encoded base-V with the oldest token most significant,
// so there are V^k contexts and the context after emitting v is (context * V + v) mod V^k.
// The next-token distribution of a context is a product of experts, one per lag:
//     P(v | x_{t-k} .. x_{t-1})  proportional to  prod_j  u_j[x_{t-j}][v] ^ (1 / concentration)
// with seeded uniform u_j (each factor is the dominant term of a Dirichlet(concentration)
// draw). Small concentrations give peaked, sparse-ish rows, yet no row is deterministic.
// The structure is what makes the corpus learnable in a few hundred steps: a model needs
// k tables of V x V (a bigram table and "previous-token" attention), not a separate
// distribution for each of the V^k contexts, while the exact order-k dependence keeps
// the floor out of reach of a bigram model. The full V^k x V table is still built; the
// stationary distribution pi over contexts is found by power iteration, and every sample
// starts from a context drawn from pi, so the token process is stationary from its first
// token. Its entropy rate is
//     H = sum_ctx pi(ctx) * H(P(. | ctx))          (nats per token),
// the best loss at target positions t >= k. At t < k the model has seen fewer than k
// tokens and the best it can do is the conditional of the stationary marginal, which is
// a little harder. With J(m) the entropy of the first m tokens (J(m) = entropy of pi's
// marginal over its first m digits for m <= k, and H(pi) + (m - k) * H beyond), target t
// costs J(t + 1) - J(t), so the exact mean floor over the seq_len targets of a sample is
//     (J(seq_len + 1) - J(1)) / seq_len.
// sample_entropy_floor() returns that; entropy_rate() returns H.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.h"

namespace forge {

class MarkovSource {
 public:
  // Seeded product-of-experts transition rows (NOTE [Synthetic entropy floor]). Fails naming data.synthetic_order
  // when V^order contexts (or their V^(order+1) transition table) are too many.
  MarkovSource(int64_t vocab_size, int64_t order, double concentration, uint64_t seed);
  // An explicit table: transitions[context * vocab_size + token], rows summing to 1.
  MarkovSource(int64_t vocab_size, int64_t order, std::vector<double> transitions);

  int64_t vocab_size() const { return vocab_size_; }
  int64_t order() const { return order_; }
  int64_t num_contexts() const { return num_contexts_; }
  double transition(int64_t context, int64_t token) const {
    return transitions_[static_cast<size_t>(context * vocab_size_ + token)];
  }
  double stationary(int64_t context) const { return stationary_[static_cast<size_t>(context)]; }

  double entropy_rate() const { return entropy_rate_; }
  double sample_entropy_floor(int64_t seq_len) const;

  // Writes `length` tokens of the stationary process, driven by rng.
  void generate(Rng& rng, int64_t length, int32_t* out) const;

 private:
  void analyze();
  void compute_stationary();
  // Entropy of the joint distribution of the first m tokens (NOTE [Synthetic entropy floor]).
  double prefix_entropy(int64_t m) const;
  static int64_t draw(const std::vector<double>& cumulative, size_t begin, size_t count, double u);

  int64_t vocab_size_, order_, num_contexts_;
  std::vector<double> transitions_;
  std::vector<double> cumulative_transitions_;
  std::vector<double> stationary_;
  std::vector<double> cumulative_stationary_;
  double entropy_rate_ = 0.0;
};

}  // namespace forge
