// Blocks are composed of components behind one interface (NOTE [Composed blocks]): a tiny
// decoder whose feed-forward is swapped for a second SwiGLU implementation computes the
// same losses and gradients, bit for bit, in every activation-checkpointing mode and
// across accumulated micro-batches.
//
// The second implementation shares no code with SwiGluFeedForward beyond the ops: it runs
// gate and up as two projections over the two halves of the fused weight (two descriptors
// of row views), keeps them in separate buffers, computes SwiGLU and its derivative in its
// own loops, and keeps every activation of every layer whatever the checkpointing mode
// (so it never recomputes). Only the input gradient goes through the fused weight at once:
// two GEMMs over the halves would sum in another order.
#include <gtest/gtest.h>

#include <cmath>

#include "model/block_components.h"
#include "model/decoder_lm.h"
#include "model/self_attention.h"
#include "model/swiglu_feed_forward.h"
#include "model_testing.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tokens;
using testing::tiny;

class TwoProjectionSwiGlu final : public BlockComponent {
 public:
  explicit TwoProjectionSwiGlu(const ModelConfig& config)
      : config_(config), ffn_(config.ffn_hidden_size), eps_(static_cast<float>(config.norm_eps)) {}

  // The same parameters as the Llama feed-forward: that is the interface's contract.
  std::vector<ParamSpec> param_specs(int layer) const override {
    return SwiGluFeedForward(config_).param_specs(layer);
  }

  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint, int num_layers) override {
    const int64_t n = shape.tokens(), h = config_.hidden_size;
    layers_.assign(static_cast<size_t>(num_layers), Activations{});
    for (Activations& a : layers_) {
      a.rstd = layout.take({n}, DType::F32);
      a.normed = layout.take({n, h}, shape.dtype);
      a.gate = layout.take({n, ffn_}, shape.dtype);
      a.up = layout.take({n, ffn_}, shape.dtype);
      a.hidden = layout.take({n, ffn_}, shape.dtype);
    }
    d_hidden_ = layout.take({n, ffn_}, shape.dtype);
    d_gate_up_ = layout.take({n, 2 * ffn_}, shape.dtype);
  }

  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override {
    Activations& a = layers_[static_cast<size_t>(layer)];
    rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_);
    const Tensor& gate_up = w.tensor(kGateUp);
    linear_forward(a.gate, a.normed, LinearWeight{gate_up.narrow(0, ffn_)});
    linear_forward(a.up, a.normed, LinearWeight{gate_up.narrow(ffn_, 2 * ffn_)});
    const float* g = a.gate.data<float>();
    const float* u = a.up.data<float>();
    float* o = a.hidden.data<float>();
    for (int64_t i = 0; i < a.hidden.numel(); ++i) o[i] = g[i] * sigmoid(g[i]) * u[i];
    if (out) linear_forward(*out, a.hidden, w.linear(kDown), &x);
  }

  void recompute_selective(int, const ComponentWeights&, const Tensor&) override {}  // keeps everything

  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_normed) override {
    Activations& a = layers_[static_cast<size_t>(layer)];
    if (overwrite) grads.tensor(kNorm).fill_zero();
    linear_backward_input(d_hidden_, d_stream, w.linear(kDown));
    linear_backward_weight(grads.linear(kDown), d_stream, a.hidden, overwrite);
    const int64_t rows = a.gate.dim(0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = a.gate.data<float>() + r * ffn_;
      const float* u = a.up.data<float>() + r * ffn_;
      const float* d = d_hidden_.data<float>() + r * ffn_;
      float* dg = d_gate_up_.data<float>() + r * 2 * ffn_;
      float* du = dg + ffn_;
      for (int64_t f = 0; f < ffn_; ++f) {
        const float s = sigmoid(g[f]);
        du[f] = d[f] * g[f] * s;
        dg[f] = d[f] * u[f] * s * (1.0f + g[f] * (1.0f - s));
      }
    }
    linear_backward_input(d_normed, d_gate_up_, LinearWeight{w.tensor(kGateUp)});
    Tensor d_gate = Tensor::empty({rows, ffn_}), d_up = Tensor::empty({rows, ffn_});
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t f = 0; f < ffn_; ++f) {
        d_gate.data<float>()[r * ffn_ + f] = d_gate_up_.data<float>()[r * 2 * ffn_ + f];
        d_up.data<float>()[r * ffn_ + f] = d_gate_up_.data<float>()[r * 2 * ffn_ + ffn_ + f];
      }
    const Tensor& g_gate_up = grads.tensor(kGateUp);
    linear_backward_weight(LinearWeight{g_gate_up.narrow(0, ffn_)}, d_gate, a.normed, overwrite);
    linear_backward_weight(LinearWeight{g_gate_up.narrow(ffn_, 2 * ffn_)}, d_up, a.normed, overwrite);
    rmsnorm_backward(d_stream, grads.tensor(kNorm), d_normed, x, w.tensor(kNorm), a.rstd);
  }

 private:
  enum : size_t { kNorm, kGateUp, kDown };
  struct Activations {
    Tensor rstd, normed, gate, up, hidden;
  };
  static float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

  ModelConfig config_;
  int64_t ffn_;
  float eps_;
  std::vector<Activations> layers_;
  Tensor d_hidden_, d_gate_up_;
};

BlockComponents with_second_swiglu(const ModelConfig& config) {
  BlockComponents components;
  components.push_back(std::make_unique<SelfAttention>(config));
  components.push_back(std::make_unique<TwoProjectionSwiGlu>(config));
  return components;
}

TEST(ModelComponents, SecondSwiGluImplementationGivesIdenticalResults) {
  for (bool tied : {false, true}) {
    for (ActivationCheckpoint mode :
         {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
      ModelConfig c = tiny(tied, 3);
      FlatParameters params(c), expected(c), got(c);
      params.initialize(21);
      DecoderLM standard(c, 1, 12, Device::CPU, DType::F32, mode);
      DecoderLM swapped(c, 1, 12, Device::CPU, DType::F32, mode, with_second_swiglu(c));
      Tensor tokens = random_tokens(2, 12, c.vocab_size, 8), targets = random_tokens(2, 12, c.vocab_size, 9);
      // Two micro-batches into fresh buffers: the first writes the gradients, the second adds.
      testing::fill_nan(expected.flat());
      testing::fill_nan(got.flat());
      expected.discard();
      got.discard();
      for (int64_t m = 0; m < 2; ++m) {
        const Tensor tk = tokens.narrow(m, m + 1), tg = targets.narrow(m, m + 1);
        LossSum a = standard.forward_backward(tk, tg, params, expected, 1.0f / 24);
        LossSum b = swapped.forward_backward(tk, tg, params, got, 1.0f / 24);
        EXPECT_EQ(a.sum, b.sum) << "tied=" << tied << " " << activation_checkpoint_name(mode) << " micro-batch " << m;
      }
      EXPECT_TRUE(testing::bitwise_equal(expected.flat(), got.flat()))
          << "tied=" << tied << " " << activation_checkpoint_name(mode);
    }
  }
}

// A component that declares other parameters than the model's is refused when the model
// is built, naming the parameter, not when the weights are first read.
TEST(ModelComponents, ComponentsMustDeclareTheModelsParameters) {
  ModelConfig c = tiny();
  ModelConfig wider = c;
  wider.ffn_hidden_size = c.ffn_hidden_size + 8;
  BlockComponents components;
  components.push_back(std::make_unique<SelfAttention>(c));
  components.push_back(std::make_unique<SwiGluFeedForward>(wider));
  try {
    DecoderLM model(c, 1, 8, Device::CPU, DType::F32, ActivationCheckpoint::None, std::move(components));
    FAIL() << "a feed-forward of another width was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.mlp.gate_up.weight"), std::string::npos) << e.what();
  }
}

// The config chooses the components; their parameters, in order, are the model's.
TEST(ModelComponents, ParameterSpecsAreTheComponentsInBlockOrder) {
  ModelConfig c = tiny();
  std::vector<std::string> block;
  for (const ParamSpec& spec : parameter_specs(c))
    if (spec.layer == 1) block.push_back(spec.name);
  EXPECT_EQ(block, (std::vector<std::string>{"layers.1.attn_norm.weight", "layers.1.attention.qkv.weight",
                                             "layers.1.attention.o.weight", "layers.1.mlp_norm.weight",
                                             "layers.1.mlp.gate_up.weight", "layers.1.mlp.down.weight"}));
  for (const ParamSpec& spec : parameter_specs(c))
    EXPECT_EQ(spec.residual_projection, spec.name.ends_with(".o.weight") || spec.name.ends_with(".down.weight"))
        << spec.name;
}

}  // namespace
}  // namespace forge
