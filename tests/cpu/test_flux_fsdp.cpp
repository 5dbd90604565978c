// FLUX under FSDP in one process (NOTE [FLUX FSDP], NOTE [FSDP of a model of units]): the
// layout of FLUX's units tiles every parameter exactly once at any world size, in the flat
// index space of a FLUX checkpoint; over the one-rank group, in every ZeRO stage, FluxFsdp
// hands the transformer the weights it was loaded with and collects the gradients of two
// micro-batches that single-device training collects; the decoder's entry points are refused.
// The multi-rank runs, through forge launch, are in tests/python/test_flux_fsdp.py.
#include <gtest/gtest.h>

#include <map>

#include "core/rng.h"
#include "distributed/flux_fsdp.h"
#include "distributed/launch_env.h"
#include "expect_error.h"
#include "model/flux_transformer.h"

namespace forge {
namespace {

// flux-debug: 2 double and 2 single blocks, so ZeRO-3's three gather buffers all turn over.
FluxConfig debug_config() { return flux_preset("flux-debug"); }

TEST(FluxFsdpLayout, UnitsTileEveryParameterOnceInTheCheckpointsFlatSpace) {
  const FluxConfig config = debug_config();
  const std::vector<ParamSpec> specs = flux_parameter_specs(config);
  std::vector<int64_t> flat_offsets;  // flux_parameter_specs end to end: a FLUX checkpoint's
  int64_t total = 0;
  for (const ParamSpec& s : specs) {
    flat_offsets.push_back(total);
    total += shape_numel(s.shape);
  }
  for (int world = 1; world <= 5; ++world) {
    std::map<int, std::vector<std::pair<int64_t, int64_t>>> covered;  // spec -> [begin, end)
    for (int rank = 0; rank < world; ++rank) {
      const FsdpLayout layout = flux_fsdp_layout(config, world, rank);
      ASSERT_EQ(layout.num_units(), flux_num_units(config));
      EXPECT_EQ(layout.head_unit(), flux_head_unit(config));
      EXPECT_FALSE(layout.is_block(0));
      EXPECT_TRUE(layout.is_block(flux_double_unit(0)));
      EXPECT_TRUE(layout.is_block(flux_single_unit(config, static_cast<int>(config.num_single_blocks) - 1)));
      EXPECT_EQ(layout.flat_numel(), total);
      EXPECT_EQ(layout.parameter_count(), config.total_params());
      for (const FsdpUnit& unit : layout.units()) {
        EXPECT_EQ(unit.numel, unit.shard_numel * world);
        for (const FsdpParam& p : unit.params)
          EXPECT_EQ(layout.specs()[static_cast<size_t>(p.spec)].layer, &unit - layout.units().data());
      }
      for (const FsdpSegment& s : layout.segments()) {
        EXPECT_EQ(s.flat_offset, flat_offsets[static_cast<size_t>(s.spec)] + s.param_begin);
        EXPECT_EQ(s.weight_decay, specs[static_cast<size_t>(s.spec)].weight_decay);
        covered[s.spec].push_back({s.param_begin, s.param_begin + s.numel});
      }
    }
    ASSERT_EQ(covered.size(), specs.size()) << "world " << world;
    for (auto& [spec, ranges] : covered) {
      std::sort(ranges.begin(), ranges.end());
      int64_t next = 0;
      for (auto [begin, end] : ranges) {
        EXPECT_EQ(begin, next) << specs[static_cast<size_t>(spec)].name << " world " << world;
        next = end;
      }
      EXPECT_EQ(next, shape_numel(specs[static_cast<size_t>(spec)].shape));
    }
  }
  std::vector<ParamSpec> bad = specs;
  bad.back().layer = flux_num_units(config);
  expect_error([&] { FsdpLayout(bad, flux_num_units(config), 2, 0); }, {"FSDP layout", "names unit"});
}

Tensor random_tensor(Shape shape, Rng& rng) {
  Tensor x = Tensor::empty(std::move(shape));
  for (int64_t j = 0; j < x.numel(); ++j) x.data<float>()[j] = static_cast<float>(rng.normal());
  return x;
}

struct MicroBatch {
  FluxInputs inputs;
  Tensor dout;
};

class FluxFsdpOneRank : public ::testing::TestWithParam<int> {};

TEST_P(FluxFsdpOneRank, TrainsTheStepSingleDeviceTrainingDoes) {
  const FluxConfig config = debug_config();
  FluxShape shape{2, 3, 2, 2};
  FluxParameters params(config), grads(config);
  params.initialize(5);
  Rng rng(17);
  std::vector<MicroBatch> micro(2);
  for (MicroBatch& m : micro) {
    m.inputs.image = random_tensor({shape.batch, shape.image_tokens(), config.in_channels}, rng);
    m.inputs.text = random_tensor({shape.batch, shape.text_tokens, config.context_dim}, rng);
    m.inputs.pooled = random_tensor({shape.batch, config.pooled_dim}, rng);
    m.inputs.timesteps = {0.25f, 0.75f};
    m.inputs.guidance = {3.5f, 2.0f};
    m.dout = random_tensor({shape.batch, shape.image_tokens(), config.in_channels}, rng);
  }
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  FsdpOptions options;
  options.zero_stage = GetParam();
  FluxFsdp sharded(config, Device::CPU, *group, nullptr, options);
  Fsdp& fsdp = sharded.fsdp();
  std::vector<float> flat;  // the checkpoint's flat index space
  for (const Tensor& t : params.tensors()) flat.insert(flat.end(), t.data<float>(), t.data<float>() + t.numel());
  fsdp.load_master([&](int64_t offset, std::span<float> out) {
    std::copy_n(flat.data() + offset, out.size(), out.data());
  });

  FluxTransformer model(config, shape, Device::CPU, ActivationCheckpoint::Full);
  fsdp.begin_step();
  for (size_t k = 0; k < micro.size(); ++k) {
    Tensor expected = Tensor::empty(micro[k].dout.shape()), got = Tensor::empty(micro[k].dout.shape());
    model.forward(micro[k].inputs, params, expected);
    model.backward(micro[k].dout, params, grads, k == 0);
    fsdp.begin_micro_batch(k + 1 == micro.size());
    model.forward(micro[k].inputs, sharded, got);
    model.backward(micro[k].dout, sharded, sharded, sharded.overwrite_gradients(static_cast<int64_t>(k)));
    fsdp.end_micro_batch();
    for (int64_t j = 0; j < got.numel(); ++j)
      ASSERT_EQ(got.data<float>()[j], expected.data<float>()[j]) << "micro-batch " << k << " [" << j << "]";
  }
  fsdp.finish_gradients();
  std::vector<float> expected_grads;
  for (const Tensor& t : grads.tensors())
    expected_grads.insert(expected_grads.end(), t.data<float>(), t.data<float>() + t.numel());
  double sum_of_squares = 0;
  for (size_t i = 0; i < fsdp.layout().segments().size(); ++i) {
    const FsdpSegment& s = fsdp.layout().segments()[i];
    const float* g = fsdp.grad_segments()[i].data<float>();
    for (int64_t j = 0; j < s.numel; ++j) {
      const float want = expected_grads[static_cast<size_t>(s.flat_offset + j)];
      // The second micro-batch's gradients are added in another order (a fresh buffer,
      // then added to the chunk, under ZeRO-2/3): fp32 rounding.
      ASSERT_NEAR(g[j], want, 1e-6f * std::max(1.0f, std::abs(want)))
          << fsdp.layout().specs()[static_cast<size_t>(s.spec)].name << " [" << s.param_begin + j << "]";
    }
  }
  for (float g : expected_grads) sum_of_squares += static_cast<double>(g) * g;
  EXPECT_NEAR(fsdp.global_grad_sum_of_squares(), sum_of_squares, 1e-6 * sum_of_squares);

  // The decoder's entry points and initialization are not a model of units'.
  expect_error([&] { fsdp.embedding(); }, {"embedding", "model of units"});
  expect_error([&] { fsdp.initialize(1); }, {"initialize", "model of units"});
}

INSTANTIATE_TEST_SUITE_P(Stages, FluxFsdpOneRank, ::testing::Values(1, 2, 3));

}  // namespace
}  // namespace forge
