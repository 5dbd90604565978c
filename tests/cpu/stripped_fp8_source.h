// A reference for runs that keep some projections out of FP8 (NOTE [FP8 routed experts
// switch], NOTE [FP8 filter] in model/fp8_projections.h): the descriptors an all-FP8
// Fp8Projections hands out, with the FP8 settings of the ones `strip` picks removed, so
// those projections take exactly the path without precision.fp8 and every other one its
// FP8 path with the same statistics. With `gradients_only` the weight descriptors keep their
// FP8 settings and only the gradient descriptors (the head's too) lose theirs: each weight
// gradient then runs without FP8 while the forward and input gradient stay in FP8, the
// reference for precision.fp8_weight_gradient false (NOTE [FP8 weight gradient switch] in
// ops/fp8_linear.h). Shared by the CPU and GPU tests.
#pragma once

#include <cstddef>
#include <functional>
#include <utility>

#include "model/fp8_projections.h"

namespace forge::testing {

class StrippedFp8Source : public ParamSource, public GradSink {
 public:
  // strip(layer, k, descriptor): whether block `layer`'s parameter k runs without FP8.
  using Strip = std::function<bool(int, size_t, const LinearWeight&)>;
  StrippedFp8Source(Fp8Projections& fp8, Strip strip, bool frozen = false, bool gradients_only = false)
      : fp8_(fp8), strip_(std::move(strip)), frozen_(frozen), gradients_only_(gradients_only) {}
  const Tensor& embedding() override { return fp8_.embedding(); }
  const BlockWeights& layer(int index) override {
    return gradients_only_ ? fp8_.layer(index) : stripped(fp8_.layer(index), index, layer_);
  }
  const Tensor& final_norm() override { return fp8_.final_norm(); }
  const LinearWeight& output() override { return fp8_.output(); }
  const BlockWeights& layer_grads(int index) override { return stripped(fp8_.layer_grads(index), index, grads_); }
  void layer_done(int index) override { fp8_.layer_done(index); }
  const Tensor& embedding_grad() override { return fp8_.embedding_grad(); }
  void embedding_done() override { fp8_.embedding_done(); }
  const Tensor& final_norm_grad() override { return fp8_.final_norm_grad(); }
  const LinearWeight& output_grad() override {
    if (!gradients_only_) return fp8_.output_grad();
    head_grad_ = fp8_.output_grad();
    head_grad_.fp8 = nullptr;
    return head_grad_;
  }
  void head_done() override { fp8_.head_done(); }
  bool layer_grads_fresh(int index) const override { return !frozen_ && fp8_.layer_grads_fresh(index); }
  bool head_grads_fresh() const override { return !frozen_ && fp8_.head_grads_fresh(); }
  bool embedding_grad_fresh() const override { return !frozen_ && fp8_.embedding_grad_fresh(); }

 private:
  const BlockWeights& stripped(const BlockWeights& block, int index, BlockWeights& out) const {
    out = block;
    for (size_t k = 0; k < out.params.size(); ++k)
      if (out.params[k].fp8 && strip_(index, k, out.params[k])) out.params[k].fp8 = nullptr;
    return out;
  }
  Fp8Projections& fp8_;
  Strip strip_;
  bool frozen_, gradients_only_;
  BlockWeights layer_, grads_;
  LinearWeight head_grad_;
};

// Every FP8 parameter (with gradients_only: every weight gradient).
inline StrippedFp8Source::Strip strip_all() {
  return [](int, size_t, const LinearWeight&) { return true; };
}

// The routed-expert stacks (precision.fp8_routed_experts false).
inline StrippedFp8Source::Strip strip_routed_experts() {
  return [](int, size_t, const LinearWeight& w) { return w.fp8->experts != nullptr; };
}

// The parameters whose names the filter of `settings` matches (precision.fp8_filter_fqns).
inline StrippedFp8Source::Strip strip_filtered(const ModelConfig& config, const Fp8Settings& settings) {
  std::vector<std::vector<bool>> filtered(static_cast<size_t>(config.num_layers));
  for (const ParamSpec& spec : parameter_specs(config))
    if (spec.layer >= 0) filtered[static_cast<size_t>(spec.layer)].push_back(fp8_filtered(spec.name, settings));
  return [filtered = std::move(filtered)](int layer, size_t k, const LinearWeight&) {
    return filtered.at(static_cast<size_t>(layer)).at(k);
  };
}

}  // namespace forge::testing
