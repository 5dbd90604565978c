#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace forge::cpu {

void moe_topk_softmax(const float* logits, int64_t tokens, int64_t experts, int64_t k, bool normalize, float* probs,
                      int32_t* expert_ids, float* weights, float* lse, int64_t groups, int64_t topk_groups,
                      float scaling) {
  const int64_t group_size = experts / groups;
  std::vector<int32_t> order(static_cast<size_t>(experts)), group_order(static_cast<size_t>(groups));
  std::vector<float> group_score(static_cast<size_t>(groups));
  std::vector<char> kept(static_cast<size_t>(groups));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    float* p = probs + t * experts;
    float top = l[0];
    for (int64_t e = 1; e < experts; ++e) top = std::max(top, l[e]);
    double sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) sum += std::exp(static_cast<double>(l[e]) - top);
    for (int64_t e = 0; e < experts; ++e) p[e] = static_cast<float>(std::exp(static_cast<double>(l[e]) - top) / sum);
    if (lse) lse[t] = static_cast<float>(top + std::log(sum));
    order.clear();
    if (topk_groups < groups) {  // DeepSeek-V2's group_limited_greedy: groups ranked by their best probability
      for (int64_t g = 0; g < groups; ++g)
        group_score[static_cast<size_t>(g)] = *std::max_element(p + g * group_size, p + (g + 1) * group_size);
      std::iota(group_order.begin(), group_order.end(), 0);
      std::partial_sort(group_order.begin(), group_order.begin() + topk_groups, group_order.end(),
                        [&](int32_t a, int32_t b) {
                          return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
                        });
      std::fill(kept.begin(), kept.end(), 0);
      for (int64_t g = 0; g < topk_groups; ++g) kept[static_cast<size_t>(group_order[static_cast<size_t>(g)])] = 1;
      for (int32_t e = 0; e < experts; ++e)
        if (kept[static_cast<size_t>(e / group_size)]) order.push_back(e);
    } else {
      for (int32_t e = 0; e < experts; ++e) order.push_back(e);
    }
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    double chosen = 0.0;
    for (int64_t j = 0; j < k; ++j) chosen += p[order[static_cast<size_t>(j)]];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = order[static_cast<size_t>(j)];
      expert_ids[t * k + j] = e;
      weights[t * k + j] = (normalize ? static_cast<float>(p[e] / chosen) : p[e]) * scaling;
    }
  }
}

void moe_topk_softmax_backward(const float* d_weights, const float* prob_gradient, int64_t group_tokens,
                               const float* probs, const int32_t* expert_ids, const float* weights, int64_t tokens,
                               int64_t experts, int64_t k, bool normalize, float* d_logits, const float* lse,
                               double z_scale, float scaling) {
  std::vector<double> dp(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* p = probs + t * experts;
    const float* dw = d_weights + t * k;
    const float* w = weights + t * k;
    const float* g = prob_gradient ? prob_gradient + (t / group_tokens) * experts : nullptr;
    for (int64_t e = 0; e < experts; ++e) dp[static_cast<size_t>(e)] = g ? g[e] : 0.0;
    if (normalize) {
      // w_j = s p_j / Z over the chosen (s: scaling): dL/dp_j = (s dw_j - sum_m dw_m w_m) / Z.
      double z = 0.0, dot = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        z += p[expert_ids[t * k + j]];
        dot += static_cast<double>(dw[j]) * w[j];
      }
      for (int64_t j = 0; j < k; ++j)
        dp[static_cast<size_t>(expert_ids[t * k + j])] += (static_cast<double>(scaling) * dw[j] - dot) / z;
    } else {
      for (int64_t j = 0; j < k; ++j)
        dp[static_cast<size_t>(expert_ids[t * k + j])] += static_cast<double>(scaling) * dw[j];
    }
    double dot = 0.0;  // softmax: dl = p (dp - <dp, p>); the z-loss's: + z_scale lse p
    for (int64_t e = 0; e < experts; ++e) dot += dp[static_cast<size_t>(e)] * p[e];
    const double z = lse ? z_scale * lse[t] : 0.0;
    for (int64_t e = 0; e < experts; ++e)
      d_logits[t * experts + e] = static_cast<float>(p[e] * (dp[static_cast<size_t>(e)] - dot + z));
  }
}

void moe_topk_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t experts, int64_t k,
                      int64_t groups, int64_t topk_groups, bool normalize, float scaling, float* scores,
                      int32_t* expert_ids, float* weights, float* lse, float* softmax) {
  const int64_t group_size = experts / groups;
  std::vector<float> choice(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts)), group_order(static_cast<size_t>(groups));
  std::vector<float> group_score(static_cast<size_t>(groups));
  std::vector<char> kept(static_cast<size_t>(groups));
  for (int64_t t = 0; t < tokens; ++t) {
    float* s = scores + t * experts;
    for (int64_t e = 0; e < experts; ++e) {
      s[e] = 1.0f / (1.0f + std::exp(-logits[t * experts + e]));
      choice[static_cast<size_t>(e)] = s[e] + (bias ? bias[e] : 0.0f);
    }
    if (lse) {  // the router z-loss's: the logits' logsumexp and softmax, beside the sigmoid scores
      const float* l = logits + t * experts;
      float top = l[0];
      for (int64_t e = 1; e < experts; ++e) top = std::max(top, l[e]);
      double sum = 0.0;
      for (int64_t e = 0; e < experts; ++e) sum += std::exp(static_cast<double>(l[e]) - top);
      lse[t] = static_cast<float>(top + std::log(sum));
      for (int64_t e = 0; e < experts; ++e)
        softmax[t * experts + e] = static_cast<float>(std::exp(static_cast<double>(l[e]) - top) / sum);
    }
    for (int64_t g = 0; g < groups; ++g) {  // the sum of the group's two largest choice values
      float first = -INFINITY, second = -INFINITY;
      for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float c = choice[static_cast<size_t>(e)];
        if (c > first) second = first, first = c;
        else if (c > second) second = c;
      }
      group_score[static_cast<size_t>(g)] = group_size > 1 ? first + second : first;
    }
    std::iota(group_order.begin(), group_order.end(), 0);
    std::partial_sort(group_order.begin(), group_order.begin() + topk_groups, group_order.end(), [&](int32_t a, int32_t b) {
      return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
    });
    std::fill(kept.begin(), kept.end(), 0);
    for (int64_t g = 0; g < topk_groups; ++g) kept[static_cast<size_t>(group_order[static_cast<size_t>(g)])] = 1;
    order.clear();
    for (int32_t e = 0; e < experts; ++e)
      if (kept[static_cast<size_t>(e / group_size)]) order.push_back(e);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    double chosen = 0.0;
    for (int64_t j = 0; j < k; ++j) chosen += s[order[static_cast<size_t>(j)]];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = order[static_cast<size_t>(j)];
      expert_ids[t * k + j] = e;
      weights[t * k + j] = static_cast<float>((normalize ? s[e] / (chosen + 1e-20) : s[e]) * scaling);
    }
  }
}

void moe_topk_sigmoid_backward(const float* d_weights, const float* scores, const int32_t* expert_ids,
                               int64_t tokens, int64_t experts, int64_t k, bool normalize, float scaling,
                               float* d_logits, const float* lse, const float* softmax, double z_scale) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* s = scores + t * experts;
    const float* dw = d_weights + t * k;
    float* dl = d_logits + t * experts;
    std::fill(dl, dl + experts, 0.0f);
    const double zl = lse ? z_scale * lse[t] : 0.0;  // the z-loss's: z_scale lse softmax(logits)
    // w_j = scaling * s_j / Z (Z = sum of the chosen + 1e-20): dL/ds_j = scaling (dw_j - sum_m dw_m s_m / Z) / Z.
    double z = 1e-20, dot = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      z += s[expert_ids[t * k + j]];
      dot += static_cast<double>(dw[j]) * s[expert_ids[t * k + j]];
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = expert_ids[t * k + j];
      const double ds = normalize ? scaling * (dw[j] - dot / z) / z : static_cast<double>(scaling) * dw[j];
      dl[e] = static_cast<float>(ds * s[e] * (1.0 - s[e]));
    }
    if (lse)
      for (int64_t e = 0; e < experts; ++e) dl[e] = static_cast<float>(dl[e] + zl * softmax[t * experts + e]);
  }
}

void moe_sort_by_expert(const int32_t* expert_ids, int64_t tokens, int64_t k, int64_t experts, int64_t* offsets,
                        int32_t* source, int32_t* row_of) {
  const int64_t n = tokens * k;
  std::fill(offsets, offsets + experts + 1, 0);
  for (int64_t a = 0; a < n; ++a) ++offsets[expert_ids[a] + 1];
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets, offsets + experts);
  for (int64_t a = 0; a < n; ++a) {
    const int64_t row = next[static_cast<size_t>(expert_ids[a])]++;
    source[row] = static_cast<int32_t>(a);
    row_of[a] = static_cast<int32_t>(row);
  }
}

void moe_drop_to_capacity(const int32_t* sorted, const int64_t* sorted_offsets, const float* weights, int64_t tokens,
                          int64_t k, int64_t experts, int64_t capacity, bool by_position, bool pad,
                          int64_t* kept_offsets, int32_t* source, int32_t* row_of) {
  const int64_t rows = pad ? experts * capacity : tokens * k;
  std::fill(source, source + rows, -1);
  kept_offsets[0] = 0;
  std::vector<int64_t> order;
  std::vector<char> kept;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = sorted_offsets[e], n = sorted_offsets[e + 1] - begin;
    kept.assign(static_cast<size_t>(n), 1);
    if (n > capacity) {
      if (by_position) {
        std::fill(kept.begin() + capacity, kept.end(), 0);
      } else {  // the capacity largest weights, ties to the lower assignment (the earlier in the segment)
        order.resize(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        auto key = [&](int64_t i) { return moe_weight_key(weights[sorted[begin + i]]); };
        std::nth_element(order.begin(), order.begin() + capacity, order.end(), [&](int64_t a, int64_t b) {
          return key(a) > key(b) || (key(a) == key(b) && a < b);
        });
        for (int64_t i = capacity; i < n; ++i) kept[static_cast<size_t>(order[static_cast<size_t>(i)])] = 0;
      }
    }
    int64_t row = pad ? e * capacity : kept_offsets[e];
    for (int64_t i = 0; i < n; ++i) {
      const int32_t a = sorted[begin + i];
      if (kept[static_cast<size_t>(i)]) {
        source[row] = a;
        row_of[a] = static_cast<int32_t>(row++);
      } else {
        row_of[a] = -1;
      }
    }
    kept_offsets[e + 1] = kept_offsets[e] + std::min(n, capacity);
  }
}

}  // namespace forge::cpu
