// FP8 training of a decoder's projections (precision.fp8): the ParamSource and GradSink
// that hand the decoder its weights and gradient buffers with FP8 settings attached.
//
// NOTE [FP8 projections]
// Where the per-layer FP8 state lives. Fp8Projections wraps the run's own ParamSource and
// GradSink (the flat parameters, or the bf16 compute copy and the fp32 gradients on CUDA):
// layer(i) and layer_grads(i) hand out the base block's descriptors with `fp8` set on
// every projection of the block (qkv, o, gate_up, down: the entries that are matrices,
// NOTE [Block weights]), output() and output_grad() on the head only with
// precision.fp8_output_head; the embedding and the norm weights pass through untouched,
// as do the GradSink's done/fresh calls. With `tensorwise` scaling the state is the
// recipe's settings (the gradient format), on CUDA one scratch shared by every layer
// (NOTE [FP8 tensorwise linear] in ops/fp8_linear.h), and per projection the statistics
// of its last forward (NOTE [FP8 forward statistics]): one Fp8Linear per projection, whose
// weight and gradient descriptors point at the same one, with 1.5 KiB of device memory,
// made the first time a layer is handed out. The recipes to come keep their state here
// too, per projection: `delayed` its amax histories and scales, and the weight cast once
// per optimizer step (reused by every micro-batch, not yet done) its codes.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/parameters.h"
#include "ops/fp8_linear.h"

namespace forge {

struct Fp8Settings {
  Fp8Format grad_format = Fp8Format::E5M2;
  bool output_head = false;  // the head's GEMMs in FP8 as well
};

// Bytes one code buffer of the CUDA scratch needs: max over the FP8 projections of
// tokens x in, tokens x out and out x in.
int64_t fp8_workspace_codes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens);

// Parameters of the matrices whose GEMMs run in FP8 (the block projections, and the head
// with output_head): 6 x this is their share of the FLOPs per token (forge info).
int64_t fp8_gemm_params(const ModelConfig& config, const Fp8Settings& settings);

// Every byte of the CUDA scratch Fp8Projections allocates (Fp8LinearWorkspace): three code
// buffers of fp8_workspace_codes bytes, the shared statistics and every projection's
// forward statistics (kFp8WorkspaceStats floats each). The memory estimate counts
// this (model/memory_estimate.h); the CPU path allocates none.
int64_t fp8_scratch_bytes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens);

class Fp8Projections : public ParamSource, public GradSink {
 public:
  // `tokens`: the most tokens one linear call sees (micro_batch × seq_len), for the CUDA
  // scratch (none is allocated on the CPU).
  Fp8Projections(const ModelConfig& config, const Fp8Settings& settings, Device device, int64_t tokens);
  Fp8Projections(const Fp8Projections&) = delete;
  Fp8Projections& operator=(const Fp8Projections&) = delete;

  // What the FP8 settings are attached to; both must outlive this object's use.
  void set_base(ParamSource& weights, GradSink& gradients);

  const Tensor& embedding() override { return weights().embedding(); }
  const BlockWeights& layer(int index) override;
  const Tensor& final_norm() override { return weights().final_norm(); }
  const LinearWeight& output() override;

  const BlockWeights& layer_grads(int index) override;
  void layer_done(int index) override { gradients().layer_done(index); }
  const Tensor& embedding_grad() override { return gradients().embedding_grad(); }
  void embedding_done() override { gradients().embedding_done(); }
  const Tensor& final_norm_grad() override { return gradients().final_norm_grad(); }
  const LinearWeight& output_grad() override;
  void head_done() override { gradients().head_done(); }
  bool layer_grads_fresh(int index) const override { return gradients().layer_grads_fresh(index); }
  bool head_grads_fresh() const override { return gradients().head_grads_fresh(); }
  bool embedding_grad_fresh() const override { return gradients().embedding_grad_fresh(); }

 private:
  ParamSource& weights() const;
  GradSink& gradients() const;
  const BlockWeights& with_fp8(const BlockWeights& base, int index, std::vector<BlockWeights>& out);
  const LinearWeight& head(const LinearWeight& base, LinearWeight& out);

  // The FP8 descriptors of one layer's (or the head's) projections, by parameter index.
  struct Projections {
    Tensor stats;                           // CUDA: kFp8WorkspaceStats floats per parameter
    std::vector<Fp8ForwardStats> forward;   // sized once: Fp8Linears point into it
    std::vector<Fp8Linear> linears;
  };
  Projections& projections(std::vector<Projections>& all, size_t index, size_t params);

  ModelConfig config_;
  Fp8Settings settings_;
  Device device_;
  Fp8LinearWorkspace workspace_;
  Fp8Linear fp8_;
  std::vector<Projections> layer_projections_, head_projections_;
  ParamSource* weights_ = nullptr;
  GradSink* gradients_ = nullptr;
  std::vector<BlockWeights> layers_, grad_layers_;
  LinearWeight output_, output_grad_;
};

}  // namespace forge
