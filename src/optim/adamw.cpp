// The AdamW optimizer object: owns the moment buffers and the step count, and hands each
// parameter to ops/adamw with its own weight decay (0 for the params the model exempts).
#include "ops/adamw.h"

#include <utility>

#include "optim/optimizer.h"

namespace forge {

AdamW::AdamW(const OptimizerConfig& config, std::vector<Tensor> params, std::vector<bool> decay)
    : config_(config), params_(std::move(params)), decay_(std::move(decay)) {
  FORGE_CHECK(params_.size() == decay_.size(), "AdamW: {} params but {} decay flags", params_.size(), decay_.size());
  FORGE_CHECK(config_.state_dtype == "fp32" || config_.state_dtype == "bf16",
              "optimizer.state_dtype must be fp32 or bf16, got '{}'", config_.state_dtype);
  const DType state = config_.state_dtype == "bf16" ? DType::BF16 : DType::F32;
  m_.reserve(params_.size());
  v_.reserve(params_.size());
  for (const Tensor& p : params_) {
    FORGE_CHECK(state == DType::F32 || p.device() == Device::CUDA,
                "optimizer.state_dtype bf16 needs training.device cuda (the CPU reference keeps fp32 moments)");
    m_.push_back(Tensor::zeros(p.shape(), state, p.device()));
    v_.push_back(Tensor::zeros(p.shape(), state, p.device()));
  }
}

void AdamW::step(const std::vector<Tensor>& grads, double lr, float grad_scale,
                 const std::vector<Tensor>& compute_copies) {
  FORGE_CHECK(grads.size() == params_.size(), "AdamW::step: {} grads for {} params", grads.size(), params_.size());
  FORGE_CHECK(compute_copies.empty() || compute_copies.size() == params_.size(),
              "AdamW::step: {} compute copies for {} params", compute_copies.size(), params_.size());
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    AdamWHyper hyper{.lr = lr,
                     .beta1 = config_.beta1,
                     .beta2 = config_.beta2,
                     .eps = config_.eps,
                     .weight_decay = decay_[i] ? config_.weight_decay : 0.0,
                     .step = step_,
                     .grad_scale = grad_scale};
    adamw_update(params_[i], grads[i], m_[i], v_[i], hyper, compute_copies.empty() ? Tensor() : compute_copies[i]);
  }
}

}  // namespace forge
