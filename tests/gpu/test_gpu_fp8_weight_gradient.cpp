// precision.fp8_weight_gradient false on CUDA (NOTE [FP8 weight gradient switch] in
// ops/fp8_linear.h): each projection's forward and input gradient run Hopper's FP8 GEMMs and
// its weight gradient the bf16 GEMM into fp32, from the unquantized dy and x, with no dy^T or
// x^T cast and no third code buffer. The check: the run (fused producers and the weight cache
// on) is bit for bit the all-FP8 run with its gradient descriptors alone stripped of their FP8
// settings, over two micro-batches (the second on the delayed scales), tensorwise and delayed,
// with and without the FP8 head, at 128 tokens and at 120 (no multiple of 16: no FP8 GEMM
// contracts the tokens any more).
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "stripped_fp8_runs.h"

namespace forge {
namespace {

using namespace gpu_test;

TEST(GpuFp8WeightGradient, RunIsTheFp8RunWithItsWeightGradientsStripped) {
  ModelConfig c = small_model("gpu-fp8-weight-gradient");
  c.num_layers = 2;
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed})
    for (const bool head : {false, true})
      for (const int64_t seq : {64, 60}) {
        SCOPED_TRACE(fmt::format("{}{}, 2 x {} tokens", recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise",
                                 head ? ", FP8 head" : "", seq));
        Rng rng(seed_for_current_test());
        FlatParameters params(c);
        params.initialize(31);
        round_to_bf16(params.flat());
        Fp8Settings all;
        all.recipe = recipe;
        all.amax_history_length = 16;
        all.weight_cache = true;
        all.output_head = head;
        Fp8Settings subject = all;
        subject.weight_gradient = false;
        expect_stripped_fp8_run(c, params, rng, subject, all, testing::strip_all(), /*gradients_only=*/true, seq);
      }
}

}  // namespace
}  // namespace forge
