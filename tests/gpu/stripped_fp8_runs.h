// The GPU check of a run that keeps some projections out of FP8 against the all-FP8
// projections with those descriptors stripped (testing::StrippedFp8Source): the bf16 weights
// of `params` on the GPU twice, one random micro-batch of 2 x `seq` tokens, and two passes over
// it, the second on the scales the first set (delayed): the same loss and bit for bit the
// same gradients. With `gradients_only` the reference strips the gradient descriptors alone
// (precision.fp8_weight_gradient false's reference).
#pragma once

#include "../cpu/stripped_fp8_source.h"
#include "gpu_testing.h"
#include "model/decoder_lm.h"

namespace forge::gpu_test {

// `params`: host fp32 values already rounded to bf16. `settings` runs the subject,
// `reference` the all-FP8 projections that `strip` strips.
inline void expect_stripped_fp8_run(const ModelConfig& c, const FlatParameters& params, Rng& rng,
                                    const Fp8Settings& settings, const Fp8Settings& reference,
                                    testing::StrippedFp8Source::Strip strip, bool gradients_only = false,
                                    int64_t seq = 64) {
  const int64_t batch = 2;
  FlatParameters weights(c, Device::CUDA, DType::BF16), grads(c, Device::CUDA, DType::F32);
  FlatParameters ref_weights(c, Device::CUDA, DType::BF16), ref_grads(c, Device::CUDA, DType::F32);
  weights.assign_from(params);
  ref_weights.assign_from(params);
  const Tensor tokens = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  const Tensor targets = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  DecoderLM model(c, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::None);
  Fp8Projections subject(c, settings, Device::CUDA, batch * seq);
  subject.set_base(weights, grads);
  Fp8Projections all(c, reference, Device::CUDA, batch * seq);
  all.set_base(ref_weights, ref_grads);
  testing::StrippedFp8Source stripped(all, std::move(strip), false, gradients_only);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  for (int micro = 0; micro < 2; ++micro) {
    grads.discard();
    ref_grads.discard();
    const double loss = model.forward_backward(tokens, targets, subject, subject, scale).mean();
    const double want = model.forward_backward(tokens, targets, stripped, stripped, scale).mean();
    EXPECT_EQ(loss, want) << "micro-batch " << micro;
    for (size_t k = 0; k < grads.specs().size(); ++k)
      EXPECT_EQ(relative_l2(to_cpu_f32(grads.tensors()[k]), to_cpu_f32(ref_grads.tensors()[k])), 0.0)
          << grads.specs()[k].name << ", micro-batch " << micro;
    EXPECT_EQ(subject.nonfinite_amax(), "");
    subject.end_step(true);
    all.end_step(true);
  }
}

}  // namespace forge::gpu_test
