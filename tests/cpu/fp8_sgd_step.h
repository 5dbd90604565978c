// The CPU FP8 training tests' step (the filter, the routed-experts switch, the weight-gradient
// switch): one micro-batch of seeded random tokens whose targets are the next token id, the
// whole model's forward and backward through a ParamSource / GradSink pair, the FP8 step end,
// and plain SGD (lr 0.1) on the fp32 parameters.
#pragma once

#include <cstdint>

#include <gtest/gtest.h>

#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model_testing.h"

namespace forge::testing {

struct Fp8TestBatch {
  Tensor tokens, targets;
};

inline Fp8TestBatch fp8_test_batch(const ModelConfig& m, int64_t batch, int64_t seq) {
  Fp8TestBatch b{random_tokens(batch, seq, m.vocab_size, 11), Tensor::empty({batch, seq}, DType::I32)};
  for (int64_t i = 0; i < batch * seq; ++i)
    b.targets.data<int32_t>()[i] = static_cast<int32_t>((b.tokens.data<int32_t>()[i] + 1) % m.vocab_size);
  return b;
}

// `fp8` (null for a run without FP8) ends the step: no non-finite amax, the scales updated.
// Returns the loss.
inline double fp8_sgd_step(const ModelConfig& m, DecoderLM& model, FlatParameters& params, FlatParameters& grads,
                           Fp8Projections* fp8, ParamSource& weights, GradSink& gradients, int64_t batch,
                           int64_t seq) {
  const Fp8TestBatch b = fp8_test_batch(m, batch, seq);
  grads.discard();
  const float scale = 1.0f / static_cast<float>(batch * seq);
  const double loss = model.forward_backward(b.tokens, b.targets, weights, gradients, scale).mean();
  if (fp8) {
    EXPECT_EQ(fp8->nonfinite_amax(), "");
    fp8->end_step(true);
  }
  float* p = params.flat().data<float>();
  const float* d = grads.flat().data<float>();
  for (int64_t i = 0; i < params.flat().numel(); ++i) p[i] -= 0.1f * d[i];
  return loss;
}

}  // namespace forge::testing
