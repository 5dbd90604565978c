// The FLUX transformer's configuration, parameters, position and time features, and its CPU
// forward/backward against finite differences (the diffusers comparison is
// tests/python/test_flux_vs_diffusers.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/rng.h"
#include "expect_error.h"
#include "model/flux_embeddings.h"
#include "model/flux_parameters.h"
#include "model/flux_transformer.h"

namespace forge {
namespace {

TEST(FluxConfig, PublishedParameterCounts) {
  // diffusers' FluxTransformer2DModel's parameter counts for the two published configs.
  EXPECT_EQ(flux_preset("flux1-dev").total_params(), 11901408320);
  EXPECT_EQ(flux_preset("flux1-schnell").total_params(), 11891178560);
  for (const std::string& name : flux_preset_names()) {
    const FluxConfig c = flux_preset(name);
    int64_t sum = 0;
    for (const ParamSpec& s : flux_parameter_specs(c)) sum += shape_numel(s.shape);
    EXPECT_EQ(sum, c.total_params()) << name;
  }
}

TEST(FluxConfig, FlopsPerImageCountsEveryProduct) {
  // FLUX.1-dev at 1024x1024 (4096 image tokens) with 512 text tokens, counted by hand:
  // 57 blocks of (4D^2 + 2DM) per token and 2 T^2 D attention multiply-adds, plus the
  // once-per-image projections.
  const FluxConfig c = flux_preset("flux1-dev");
  const double d = 3072, m = 12288, s = 4096, l = 512, t = s + l;
  const double blocks = 57 * ((4 * d * d + 2 * d * m) * t + 2 * t * t * d);
  const double modulation = 19 * 12 * d * d + 38 * 3 * d * d + 2 * d * d;
  const double embed = s * 64 * d + l * 4096 * d + 2 * (256 * d + d * d) + 768 * d + d * d + s * d * 64;
  EXPECT_DOUBLE_EQ(c.training_flops_per_image(4096, 512), 6 * (blocks + modulation + embed));
}

TEST(FluxConfig, RejectsInconsistentShapes) {
  FluxConfig c = flux_preset("flux-debug");
  c.axes_dim = {4, 6, 8};
  expect_error([&] { c.validate("my.yaml"); }, {"my.yaml", "model.axes_dim", "sum to model.head_dim 16"});
  c = flux_preset("flux-debug");
  c.head_dim = 15;
  expect_error([&] { c.validate(); }, {"model.head_dim must be even"});
  c = flux_preset("flux-debug");
  c.num_double_blocks = c.num_single_blocks = 0;
  expect_error([&] { c.validate(); }, {"num_double_blocks", "not both 0"});
  expect_error([] { flux_preset("flux2-pro"); }, {"unknown FLUX model 'flux2-pro'", "flux1-dev"});
}

TEST(FluxEmbeddings, TimestepFeaturesAreDiffusersSinusoids) {
  const Tensor f = timestep_features({0.0f, 250.0f}, 8);
  for (int k = 0; k < 4; ++k) {
    const double freq = std::exp(-std::log(10000.0) * k / 4.0);
    EXPECT_FLOAT_EQ(f.data<float>()[k], 1.0f);  // cos(0), first half
    EXPECT_FLOAT_EQ(f.data<float>()[4 + k], 0.0f);
    EXPECT_NEAR(f.data<float>()[8 + k], std::cos(250.0 * freq), 1e-4);
    EXPECT_NEAR(f.data<float>()[12 + k], std::sin(250.0 * freq), 1e-4);
  }
}

TEST(FluxEmbeddings, RopeTablesTurnImageTokensByRowAndColumn) {
  const FluxConfig c = flux_preset("flux-debug");  // axes 4/6/6 of head dim 16: pairs 2/3/3
  Tensor cos, sin;
  flux_rope_tables(cos, sin, c, 2, 3, 4);
  ASSERT_EQ(cos.shape(), (Shape{2 + 12, 8}));
  for (int64_t p = 0; p < 8; ++p) {  // text tokens and axis 0: no turn
    EXPECT_FLOAT_EQ(cos.data<float>()[p], 1.0f);
    EXPECT_FLOAT_EQ(sin.data<float>()[8 + p], 0.0f);
  }
  // Image token (row 2, col 3) is joint token 2 + 2*4 + 3; pair 2 + k of axis 1 (dim 6)
  // turns by 2 * theta^(-2k/6), pair 5 + k of axis 2 by 3 * theta^(-2k/6).
  const int64_t t = 2 + 11;
  for (int k = 0; k < 3; ++k) {
    const double f = std::pow(10000.0, -2.0 * k / 6.0);
    EXPECT_NEAR(cos.data<float>()[t * 8 + 2 + k], std::cos(2 * f), 1e-6);
    EXPECT_NEAR(sin.data<float>()[t * 8 + 5 + k], std::sin(3 * f), 1e-6);
  }
  EXPECT_FLOAT_EQ(cos.data<float>()[t * 8 + 0], 1.0f);
}

// flux-debug with one block of each kind.
FluxConfig small_config() {
  FluxConfig c = flux_preset("flux-debug");
  c.num_double_blocks = 1;
  c.num_single_blocks = 1;
  return c;
}

// A small FLUX model, its weights and inputs drawn at random.
struct SmallFlux {
  FluxConfig config = small_config();
  FluxShape shape;
  FluxParameters params{config};
  FluxInputs inputs;
  Tensor dout;
  SmallFlux() {
    shape.batch = 2;
    shape.text_tokens = 3;
    shape.grid_h = 2;
    shape.grid_w = 2;
    Rng rng(11);
    for (size_t i = 0; i < params.specs().size(); ++i) {
      const Tensor& t = params.tensors()[i];
      const bool matrix = t.ndim() == 2;
      const double scale = matrix ? 0.7 / std::sqrt(static_cast<double>(t.dim(1))) : 0.2;
      for (int64_t j = 0; j < t.numel(); ++j)
        t.data<float>()[j] = static_cast<float>((matrix || params.specs()[i].name.ends_with(".bias") ? 0.0 : 1.0) +
                                                scale * rng.normal());
    }
    auto draw = [&](Shape s) {
      Tensor x = Tensor::empty(std::move(s));
      for (int64_t j = 0; j < x.numel(); ++j) x.data<float>()[j] = static_cast<float>(rng.normal());
      return x;
    };
    inputs.image = draw({shape.batch, shape.image_tokens(), config.in_channels});
    inputs.text = draw({shape.batch, shape.text_tokens, config.context_dim});
    inputs.pooled = draw({shape.batch, config.pooled_dim});
    inputs.timesteps = {0.3f, 0.8f};
    inputs.guidance = {3.5f, 1.0f};
    dout = draw({shape.batch, shape.image_tokens(), config.in_channels});
  }
  // sum(out * dout) in double.
  double loss(FluxTransformer& model) {
    Tensor out = Tensor::empty(dout.shape());
    model.forward(inputs, params, out);
    double sum = 0;
    for (int64_t j = 0; j < out.numel(); ++j) sum += double(out.data<float>()[j]) * dout.data<float>()[j];
    return sum;
  }
};

TEST(FluxWeightInit, TorchtitanRulesPerTensor) {
  // NOTE [FLUX weight init]: each tensor's law, checked on its values.
  FluxConfig config = small_config();
  FluxParameters params{config};
  params.initialize(5, FluxWeightInit::Torchtitan);
  const int64_t d = config.hidden(), m = config.mlp_hidden();
  const auto bound_of = [&](const std::string& name) -> double {
    if (name == "x_embedder.weight") return std::sqrt(6.0 / double(config.in_channels + d));
    if (name == "context_embedder.weight") return std::sqrt(6.0 / double(config.context_dim + d));
    if (name.ends_with("to_qkv.weight") && name.starts_with("single")) return std::sqrt(6.0 / double(d + 3 * d + m));
    if (name.ends_with("proj_mlp.weight")) return std::sqrt(6.0 / double(d + 3 * d + m));
    if (name.starts_with("single") && name.ends_with("proj_out.weight")) return std::sqrt(6.0 / double(d + d + m));
    if (name.ends_with("qkv.weight")) return std::sqrt(6.0 / double(d + 3 * d));
    if (name.ends_with("to_out.0.weight") || name.ends_with("to_add_out.weight")) return std::sqrt(6.0 / double(2 * d));
    if (name.ends_with("net.0.proj.weight") || name.ends_with("net.2.weight")) return std::sqrt(6.0 / double(d + m));
    return 0;
  };
  int uniform = 0, normal = 0, zero = 0;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const std::string& name = params.specs()[i].name;
    const Tensor& t = params.tensors()[i];
    const float* p = t.data<float>();
    double sum2 = 0, most = 0;
    for (int64_t j = 0; j < t.numel(); ++j) {
      sum2 += double(p[j]) * p[j];
      most = std::max(most, std::fabs(double(p[j])));
    }
    const double rms = std::sqrt(sum2 / double(t.numel()));
    if (t.ndim() == 1) {
      const float expected = name.ends_with(".bias") ? 0.0f : 1.0f;
      for (int64_t j = 0; j < t.numel(); ++j) ASSERT_EQ(p[j], expected) << name;
    } else if (name.find("linear.weight") != std::string::npos || name == "proj_out.weight") {
      EXPECT_EQ(most, 0.0) << name;  // adaLN modulations and the final projection: zero
      ++zero;
    } else if (name.find("embedder.linear_") != std::string::npos) {
      EXPECT_NEAR(rms, 0.02, 0.02 * 0.2) << name;
      ++normal;
    } else {
      const double b = bound_of(name);
      ASSERT_GT(b, 0) << name;
      EXPECT_LE(most, b) << name;
      EXPECT_GT(most, 0.8 * b) << name;
      EXPECT_NEAR(rms, b / std::sqrt(3.0), b / std::sqrt(3.0) * 0.2) << name;  // U(-b, b)'s rms
      ++uniform;
    }
  }
  EXPECT_EQ(zero, 2 * config.num_double_blocks + config.num_single_blocks + 2);
  EXPECT_EQ(normal, config.guidance_embeds ? 6 : 4);
  EXPECT_GT(uniform, 0);
  // The same seed gives the same weights; another seed others.
  FluxParameters again{config}, other{config};
  again.initialize(5, FluxWeightInit::Torchtitan);
  other.initialize(6, FluxWeightInit::Torchtitan);
  EXPECT_EQ(std::memcmp(again.flat().data<float>(), params.flat().data<float>(), params.flat().numel() * 4), 0);
  EXPECT_NE(std::memcmp(other.flat().data<float>(), params.flat().data<float>(), params.flat().numel() * 4), 0);
  expect_error([] { parse_flux_weight_init("xavier", "flux.weight_init"); },
               {"flux.weight_init 'xavier'", "normal or torchtitan"});
}

TEST(FluxWeightInit, TorchtitanModelPredictsZeroVelocityAndStillLearns) {
  // adaLN-Zero: at init every block is the identity on its stream and the head outputs 0,
  // yet the final projection's gradient is not 0, so training moves off the start.
  SmallFlux f;
  f.params.initialize(3, FluxWeightInit::Torchtitan);
  FluxTransformer model(f.config, f.shape, Device::CPU);
  Tensor out = Tensor::empty(f.dout.shape());
  model.forward(f.inputs, f.params, out);
  for (int64_t j = 0; j < out.numel(); ++j) ASSERT_EQ(out.data<float>()[j], 0.0f) << j;
  FluxParameters grads{f.config};
  grads.zero();
  model.backward(f.dout, f.params, grads);
  const int head_out = static_cast<int>(grads.specs().size()) - 2;  // proj_out.weight, then its bias
  ASSERT_EQ(grads.specs()[static_cast<size_t>(head_out)].name, "proj_out.weight");
  double norm = 0;
  const Tensor& g = grads.tensors()[static_cast<size_t>(head_out)];
  for (int64_t j = 0; j < g.numel(); ++j) norm += double(g.data<float>()[j]) * g.data<float>()[j];
  EXPECT_GT(norm, 0.0);
}

TEST(FluxTransformer, GradientsMatchFiniteDifferences) {
  SmallFlux f;
  FluxTransformer model(f.config, f.shape, Device::CPU);
  FluxParameters grads(f.config);
  grads.zero();
  f.loss(model);
  model.backward(f.dout, f.params, grads);
  // A few entries of every parameter: central differences of the loss.
  Rng rng(5);
  for (size_t i = 0; i < f.params.specs().size(); ++i) {
    const Tensor& w = f.params.tensors()[i];
    for (int probe = 0; probe < 2; ++probe) {
      const int64_t j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(w.numel())));
      const float saved = w.data<float>()[j];
      const float h = 1e-2f;
      w.data<float>()[j] = saved + h;
      const double up = f.loss(model);
      w.data<float>()[j] = saved - h;
      const double down = f.loss(model);
      w.data<float>()[j] = saved;
      const double numeric = (up - down) / (2.0 * h);
      const double analytic = grads.tensors()[i].data<float>()[j];
      EXPECT_NEAR(analytic, numeric, 2e-2 * std::max(1.0, std::abs(numeric)))
          << f.params.specs()[i].name << " [" << j << "]";
    }
  }
}

TEST(FluxTransformer, FullCheckpointingGivesTheSameGradients) {
  SmallFlux f;
  FluxParameters plain(f.config), recomputed(f.config);
  plain.zero();
  recomputed.zero();
  FluxTransformer none(f.config, f.shape, Device::CPU, ActivationCheckpoint::None);
  FluxTransformer full(f.config, f.shape, Device::CPU, ActivationCheckpoint::Full);
  f.loss(none);
  none.backward(f.dout, f.params, plain);
  f.loss(full);
  full.backward(f.dout, f.params, recomputed);
  for (int64_t j = 0; j < plain.flat().numel(); ++j)
    ASSERT_EQ(plain.flat().data<float>()[j], recomputed.flat().data<float>()[j]) << j;
  // With more than one block of a kind, full checkpointing keeps one set of intermediates.
  const FluxConfig debug = flux_preset("flux-debug");
  EXPECT_LT(FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::Full),
            FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::None));
}

// NOTE [Recomputing some FLUX blocks]: recomputing the first N blocks (none, some double
// ones, all double ones and some single ones, every one) gives none's gradients bit for bit,
// in an arena between full's and none's that never shrinks as N falls (0: none's exactly).
TEST(FluxTransformer, RecomputingSomeBlocksGivesTheSameGradients) {
  SmallFlux f;
  const int64_t blocks = f.config.num_double_blocks + f.config.num_single_blocks;
  ASSERT_GE(f.config.num_double_blocks, 1);
  ASSERT_GE(f.config.num_single_blocks, 1);
  FluxParameters plain(f.config);
  plain.zero();
  FluxTransformer none(f.config, f.shape, Device::CPU, ActivationCheckpoint::None);
  f.loss(none);
  none.backward(f.dout, f.params, plain);
  for (int64_t r = blocks; r >= 0; --r) {
    FluxParameters grads(f.config);
    grads.zero();
    FluxTransformer some(f.config, f.shape, Device::CPU, ActivationCheckpoint::Full, r);
    f.loss(some);
    some.backward(f.dout, f.params, grads);
    for (int64_t j = 0; j < plain.flat().numel(); ++j)
      ASSERT_EQ(plain.flat().data<float>()[j], grads.flat().data<float>()[j]) << "recompute " << r << ", " << j;
  }
  // flux-debug has two blocks of each kind: a kind with r of its n blocks recomputed holds
  // 1 + n - r sets of activations (n when r is 0), never fewer as r falls.
  const FluxConfig debug = flux_preset("flux-debug");
  const int64_t debug_blocks = debug.num_double_blocks + debug.num_single_blocks;
  int64_t previous = FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::Full);
  EXPECT_EQ(FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::Full, debug_blocks),
            previous);
  for (int64_t r = debug_blocks - 1; r >= 0; --r) {
    const int64_t bytes = FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::Full, r);
    EXPECT_GE(bytes, previous) << r;
    previous = bytes;
  }
  EXPECT_GT(previous, FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::Full));
  EXPECT_EQ(previous, FluxTransformer::activation_bytes(debug, f.shape, DType::F32, ActivationCheckpoint::None));
  expect_error([&] { FluxTransformer(f.config, f.shape, Device::CPU, ActivationCheckpoint::Full, blocks + 1); },
               {"recompute_blocks", std::to_string(blocks + 1)});
  expect_error([&] { FluxTransformer(f.config, f.shape, Device::CPU, ActivationCheckpoint::None, 1); },
               {"recompute_blocks", "none"});
}

// NOTE [Fresh gradient buffers]: a backward with `overwrite` writes every parameter's
// gradient over whatever the buffer held (here garbage) and gives what a backward adding to
// zeroed buffers gives; without it, a second backward adds the same gradients again.
TEST(FluxTransformer, OverwritingBackwardWritesEveryGradientFresh) {
  SmallFlux f;
  FluxParameters added(f.config), fresh(f.config);
  added.zero();
  fresh.zero();
  for (const Tensor& t : fresh.tensors())
    for (int64_t j = 0; j < t.numel(); ++j) t.data<float>()[j] = 1e3f + static_cast<float>(j);
  FluxTransformer model(f.config, f.shape, Device::CPU);
  f.loss(model);
  model.backward(f.dout, f.params, added);
  model.backward(f.dout, f.params, fresh, true);
  for (size_t i = 0; i < added.tensors().size(); ++i)
    for (int64_t j = 0; j < added.tensors()[i].numel(); ++j)
      ASSERT_EQ(added.tensors()[i].data<float>()[j], fresh.tensors()[i].data<float>()[j])
          << f.params.specs()[i].name << " [" << j << "]";
  model.backward(f.dout, f.params, fresh);  // adds: twice the gradient
  for (size_t i = 0; i < added.tensors().size(); ++i) {
    const float once = added.tensors()[i].data<float>()[0], twice = fresh.tensors()[i].data<float>()[0];
    EXPECT_NEAR(twice, 2.0f * once, 1e-5f * std::max(1.0f, std::abs(once))) << f.params.specs()[i].name;
  }
}

// A model reshaped to another latent grid (a smaller one reuses the arena, a larger one
// grows it) computes what a model built for that grid computes, gradients included.
TEST(FluxTransformer, ReshapedModelMatchesOneBuiltForTheShape) {
  SmallFlux big;  // 2x2 grid
  FluxParameters want(big.config), got(big.config);
  want.zero();
  got.zero();
  FluxShape wide = big.shape;
  wide.grid_w = 3;
  wide.text_tokens = 2;
  Rng rng(3);
  auto draw = [&](Shape s) {
    Tensor x = Tensor::empty(std::move(s));
    for (int64_t j = 0; j < x.numel(); ++j) x.data<float>()[j] = static_cast<float>(rng.normal());
    return x;
  };
  for (const auto& [shape, checkpoint] : {std::pair{wide, ActivationCheckpoint::None},
                                          std::pair{FluxShape{2, 3, 1, 2}, ActivationCheckpoint::Full}}) {
    FluxInputs in = big.inputs;
    in.image = draw({shape.batch, shape.image_tokens(), big.config.in_channels});
    in.text = draw({shape.batch, shape.text_tokens, big.config.context_dim});
    const Tensor dout = draw({shape.batch, shape.image_tokens(), big.config.in_channels});
    FluxTransformer fresh(big.config, shape, Device::CPU, checkpoint);
    FluxTransformer reshaped(big.config, big.shape, Device::CPU, checkpoint);
    Tensor a = Tensor::empty(dout.shape()), b = Tensor::empty(dout.shape());
    Tensor first = Tensor::empty({big.shape.batch, big.shape.image_tokens(), big.config.in_channels});
    reshaped.forward(big.inputs, big.params, first);  // planned for the first shape, used once
    reshaped.reshape(shape);
    EXPECT_EQ(reshaped.shape().grid_w, shape.grid_w);
    fresh.forward(in, big.params, a);
    reshaped.forward(in, big.params, b);
    for (int64_t j = 0; j < a.numel(); ++j) ASSERT_EQ(a.data<float>()[j], b.data<float>()[j]) << j;
    fresh.backward(dout, big.params, want, true);
    reshaped.backward(dout, big.params, got, true);
    for (int64_t j = 0; j < want.flat().numel(); ++j)
      ASSERT_EQ(want.flat().data<float>()[j], got.flat().data<float>()[j]) << j;
  }
}

TEST(FluxTransformer, RefusesSelectiveCheckpointingAndBadInputs) {
  SmallFlux f;
  expect_error([&] { FluxTransformer(f.config, f.shape, Device::CPU, ActivationCheckpoint::Selective); },
               {"selective", "none or full"});
  FluxTransformer model(f.config, f.shape, Device::CPU);
  Tensor out = Tensor::empty(f.dout.shape());
  f.inputs.timesteps = {0.5f};
  expect_error([&] { model.forward(f.inputs, f.params, out); }, {"1 timesteps for 2 samples"});
}

}  // namespace
}  // namespace forge
