// The GPU check of a run that keeps some projections out of FP8 against the all-FP8
// projections with those descriptors stripped (testing::StrippedFp8Source): two micro-batches,
// the second on the scales the first set (delayed), the same loss and bit for bit the same
// gradients.
#pragma once

#include "../cpu/stripped_fp8_source.h"
#include "gpu_testing.h"
#include "model/decoder_lm.h"

namespace forge::gpu_test {

inline void expect_stripped_micro_batches(DecoderLM& model, const Tensor& tokens, const Tensor& targets,
                                          Fp8Projections& subject, FlatParameters& grads, Fp8Projections& reference,
                                          testing::StrippedFp8Source& stripped, FlatParameters& ref_grads) {
  const float scale = 1.0f / static_cast<float>(tokens.numel());
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
    reference.end_step(true);
  }
}

}  // namespace forge::gpu_test
