// precision.fp8_filter_fqns on CUDA (NOTE [FP8 filter] in model/fp8_projections.h): a
// filtered projection's descriptor carries no FP8, so its GEMMs take the bf16 path, and the
// kernels that would produce its FP8 operand (RMSNorm's x for qkv and gate/up, SwiGLU's
// backward dy for gate/up: NOTE [FP8 fused producers] in ops/fp8_linear.h) see no consumer
// and write plain bf16. The check: the filtered run (fused producers and the weight cache
// on) is bit for bit the unfiltered FP8 run with the filtered descriptors stripped, over two
// micro-batches (the second on the delayed scales), tensorwise and delayed, with the filter
// taking a whole block and the gate/up projections (whose producers are fused) of the rest.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "stripped_fp8_runs.h"

namespace forge {
namespace {

using namespace gpu_test;
using testing::strip_filtered;

TEST(GpuFp8Filter, FilteredRunIsTheStrippedFp8Run) {
  ModelConfig c = small_model("gpu-fp8-filter");
  c.num_layers = 3;
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    SCOPED_TRACE(recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise");
    Rng rng(seed_for_current_test());
    FlatParameters params(c);
    params.initialize(29);
    round_to_bf16(params.flat());
    Fp8Settings all;
    all.recipe = recipe;
    all.amax_history_length = 16;
    all.weight_cache = true;
    Fp8Settings some = all;
    some.filter_fqns = {"layers.1.", "mlp.gate_up"};
    expect_stripped_fp8_run(c, params, rng, some, all, strip_filtered(c, some));
  }
}

}  // namespace
}  // namespace forge
