// FLUX's parameters: their names (diffusers' FluxTransformer2DModel names, with the q, k, v
// projections of each stream fused as diffusers' fuse_projections() names them: to_qkv,
// to_added_qkv), shapes and the diffusers tensors each is made of (NOTE [Fused
// projections] in parameters.h), grouped in units the model reads in turn.
//
// NOTE [FLUX units]
// The parameters come in units, the pieces a holder of weights hands out one at a time
// (FSDP gathers and reduces per unit): unit 0 the embedders, then each double-stream
// block, then each single-stream block, then the head. A unit is a list of projections
// (weight and bias together in one LinearWeight, NOTE [Linear bias]) and a list of vectors
// (the QK RMSNorm scales), numbered as the constants below say.
//
// NOTE [FLUX weight init]
// flux.weight_init picks how a run that loads no weights starts. Either way biases start at
// 0 and the QK norm scales at 1, and each tensor draws from its own stream of the seed.
//   normal      every matrix draws Normal(0, init_std) (0.02): forge's first FLUX init.
//   torchtitan  torchtitan's FluxModel.init_weights (experiments/flux, the MLPerf Flux.1
//               reference), after DiT's: the image and text input projections, the
//               attention's q/k/v and output projections, the MLPs, and the single blocks'
//               linear1/linear2 Xavier-uniform, U(-b, b) with b = sqrt(6 / (in + out)) of
//               the torchtitan Linear (BFL's layout: a single block's q, k, v and MLP input
//               are one [3d + m, d] Linear, so both of forge's pieces take its bound); the
//               time and pooled-text MLPs (and FLUX.1-dev's guidance MLP, which torchtitan's
//               model lacks: treated as the time MLP) Normal(0, 0.02); every modulation
//               (adaLN) projection and the final projection 0, so the model starts as the
//               identity on its residual streams and predicts a velocity of 0 (adaLN-Zero).
// Uniform draws are forge's Rng (2u - 1) b, not torch's generator: the same law, other
// numbers.
//
// NOTE [FLUX parameter regions]
// The flat buffer holds the weight-decayed tensors (the matrices) first and the others
// (biases, norm scales) after them, each tensor on a multiple of 64 values, so the
// optimizer updates the whole model in two calls (with and without weight decay) instead
// of one per tensor: on the FLUX.1-dev proxy (1.3 B parameters) a call per tensor cost
// 12 ms of a 62 ms step (profiled, H200). The padding between tensors stays 0: gradients
// never write it, so AdamW leaves it 0.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "model/flux_config.h"
#include "model/parameters.h"
#include "ops/linear.h"

namespace forge {

struct FluxUnitWeights {
  std::vector<LinearWeight> linears;
  std::vector<Tensor> vectors;
};

// Projection and vector numbers within each kind of unit.
namespace flux_unit {
// Embedders: latent tokens in, text tokens in, the time MLP, the pooled-text MLP, and with
// guidance_embeds the guidance MLP.
enum Embedder { kImageIn, kContextIn, kTime1, kTime2, kPooled1, kPooled2, kGuidance1, kGuidance2 };
// A double block: per stream (image: 0, text: kStreamLinears), these projections ...
enum StreamLinear { kModulation, kQkv, kOut, kMlpIn, kMlpOut, kStreamLinears };
// ... and (image: 0, text: kStreamVectors) these norm scales.
enum StreamVector { kQNorm, kKNorm, kStreamVectors };
// A single block.
enum SingleLinear { kSingleModulation, kSingleQkv, kSingleMlpIn, kSingleOut };
// The head: the final layer norm's modulation, the projection to patch features.
enum HeadLinear { kHeadModulation, kHeadOut };
}  // namespace flux_unit

// Unit indices (NOTE [FLUX units]).
inline int flux_num_units(const FluxConfig& c) {
  return static_cast<int>(2 + c.num_double_blocks + c.num_single_blocks);
}
inline int flux_double_unit(int block) { return 1 + block; }
inline int flux_single_unit(const FluxConfig& c, int block) { return static_cast<int>(1 + c.num_double_blocks) + block; }
inline int flux_head_unit(const FluxConfig& c) { return flux_num_units(c) - 1; }

// Every parameter in unit order; ParamSpec::layer is the unit index.
std::vector<ParamSpec> flux_parameter_specs(const FluxConfig& config);

// NOTE [FLUX weight init].
enum class FluxWeightInit { Normal, Torchtitan };
// "normal" | "torchtitan"; anything else throws naming `what`.
FluxWeightInit parse_flux_weight_init(std::string_view name, std::string_view what);
struct FluxTensorInit {
  enum class Kind { Constant, Normal, Uniform } kind;
  double value;  // the constant, the standard deviation, or the bound b of U(-b, b)
};
// torchtitan's rule for each of flux_parameter_specs(config), in the same order.
std::vector<FluxTensorInit> flux_torchtitan_inits(const FluxConfig& config);

// NOTE [FLUX weight init]'s standard deviation of "normal".
inline constexpr float kFluxInitStd = 0.02f;

// NOTE [FLUX weight init], one tensor at a time: calls each(spec index, values) for every
// parameter of flux_parameter_specs(config) in order with its initial fp32 values (one host
// buffer, the largest tensor's, reused), exactly what FluxParameters::initialize writes.
void initialize_flux_tensors(const FluxConfig& config, uint64_t seed, FluxWeightInit init, float init_std,
                             const std::function<void(size_t, std::span<const float>)>& each);

// Where the model gets each unit's weights, and where it puts their gradients (added to,
// NOTE [Fresh gradient buffers] does not apply: a sink zeroes its buffers per step).
// unit_done(i) says unit i's gradients of this micro-batch are complete.
class FluxParamSource {
 public:
  virtual ~FluxParamSource() = default;
  virtual const FluxUnitWeights& unit(int index) = 0;
};
class FluxGradSink {
 public:
  virtual ~FluxGradSink() = default;
  virtual const FluxUnitWeights& unit_grads(int index) = 0;
  virtual void unit_done(int /*index*/) {}
};

// A unit's tensors, `specs` (the unit's, in flux_parameter_specs order) viewed by `tensors`,
// as its projections and vectors (NOTE [FLUX units]): a 2-D spec is a projection's weight,
// the 1-D ".bias" spec after it its bias, any other 1-D spec a vector.
FluxUnitWeights flux_unit_weights(const std::vector<const ParamSpec*>& specs, const std::vector<Tensor>& tensors);

// All parameters (or gradients) in one buffer, viewed per spec and per unit; the source and
// sink of single-device training. fp32 on the CPU; fp32 or bf16 on CUDA.
class FluxParameters : public FluxParamSource, public FluxGradSink {
 public:
  explicit FluxParameters(const FluxConfig& config, Device device = Device::CPU, DType dtype = DType::F32,
                          float init_std = kFluxInitStd);

  const FluxConfig& config() const { return config_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const Tensor& flat() const { return flat_; }
  // NOTE [FLUX parameter regions]: the flat buffer's weight-decayed part and the rest.
  Tensor decayed() const { return flat_.narrow(0, decayed_values_); }
  Tensor not_decayed() const { return flat_.narrow(decayed_values_, flat_.numel()); }

  void zero() { flat_.fill_zero(); }
  // Copies every value of `other` (same config), converting device and dtype.
  void assign_from(const FluxParameters& other);
  // NOTE [FLUX weight init]: each tensor from its own stream of the seed and its name.
  void initialize(uint64_t seed, FluxWeightInit init = FluxWeightInit::Normal);

  const FluxUnitWeights& unit(int index) override { return units_.at(static_cast<size_t>(index)); }
  const FluxUnitWeights& unit_grads(int index) override { return units_.at(static_cast<size_t>(index)); }

 private:
  FluxConfig config_;
  float init_std_;
  std::vector<ParamSpec> specs_;
  Tensor flat_;
  int64_t decayed_values_ = 0;
  std::vector<Tensor> tensors_;
  std::vector<FluxUnitWeights> units_;
};

}  // namespace forge
