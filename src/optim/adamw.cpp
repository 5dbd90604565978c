// The AdamW optimizer object: owns the moment buffers and the step count, and hands each
// parameter to ops/adamw with its own weight decay (0 for the params the model exempts).
#include "ops/adamw.h"

#include <utility>

#include "optim/optimizer.h"

namespace forge {

AdamW::AdamW(const OptimizerConfig& config, std::vector<Tensor> params, std::vector<bool> decay)
    : config_(config), params_(std::move(params)), decay_(std::move(decay)) {
  FORGE_CHECK(params_.size() == decay_.size(), "AdamW: {} params but {} decay flags", params_.size(), decay_.size());
  m_.reserve(params_.size());
  v_.reserve(params_.size());
  for (const Tensor& p : params_) {
    m_.push_back(Tensor::zeros(p.shape(), DType::F32, p.device()));
    v_.push_back(Tensor::zeros(p.shape(), DType::F32, p.device()));
  }
}

void AdamW::step(const std::vector<Tensor>& grads, double lr) {
  FORGE_CHECK(grads.size() == params_.size(), "AdamW::step: {} grads for {} params", grads.size(), params_.size());
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    AdamWHyper hyper{.lr = lr,
                     .beta1 = config_.beta1,
                     .beta2 = config_.beta2,
                     .eps = config_.eps,
                     .weight_decay = decay_[i] ? config_.weight_decay : 0.0,
                     .step = step_};
    adamw_update(params_[i], grads[i], m_[i], v_[i], hyper);
  }
}

}  // namespace forge
