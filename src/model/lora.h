// LoRA adapters of a decoder model: which projections carry one, their parameters (fp32
// masters, gradients, the compute copy), and the ParamSource / GradSink that hand the
// decoder its frozen weights with the adapters attached.
//
// NOTE [LoRA training]
// With lora.rank > 0 the model's own parameters are frozen: they are held once, in the
// compute dtype (bf16 on the GPU, fp32 on the CPU reference), with no fp32 master, no
// gradient and no optimizer state. The trainable parameters are the adapters alone, fp32
// masters under the ordinary AdamW (weight decay on all of them, as PEFT's Trainer does
// for A and B), their bf16 compute copy refreshed after each step. LoraAdapters wraps the
// frozen weights' ParamSource: layer(i) hands out the base block's descriptors with each
// targeted projection's adapter attached (NOTE [Linear weight descriptor]); as GradSink it
// hands out gradient descriptors with no base weight (the linear op then skips dW) and
// the adapter's gradient buffers, a scratch buffer for the norm weights' gradients the
// components compute anyway, and no embedding gradient (the decoder skips its
// backward). So the decoder and its components are the same code with or without LoRA.
// Adapters follow NOTE [LoRA linear]: one per fused projection, one part per targeted
// module; PEFT's tensors are the parts (peft_tensor_name). A is initialized
// kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)), and B with zeros, as
// PEFT does, so training starts from the base model's function.
// Under data parallelism the base is a frozen FSDP (sharded, NOTE [Frozen FSDP base]) and the
// adapters stay whole on every rank (NOTE [LoRA under data parallelism] in train/trainer.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/lora_config.h"
#include "model/parameters.h"
#include "ops/lora.h"

namespace forge {

// One adapted module inside a projection: its Hugging Face name without ".weight"
// ("model.layers.3.self_attn.q_proj") and its output rows.
struct LoraPart {
  std::string module;     // q_proj, ...
  std::string hf_prefix;
  int64_t row_begin = 0, row_end = 0;
};

// One adapted projection of a block.
struct LoraTarget {
  int layer = 0;
  size_t param = 0;       // its entry in the block's weights (NOTE [Block weights])
  std::string name;       // forge's parameter name, e.g. layers.3.attention.qkv.weight
  int64_t in = 0, out = 0;
  std::vector<LoraPart> parts;
};

// The projections `modules` (lora_target_modules) adapt, in parameter order.
std::vector<LoraTarget> lora_targets(const ModelConfig& config, const std::vector<std::string>& modules);

// What LoRA adds to a model, in values: the adapters as stored (masters(), b's zeros
// included), what PEFT counts as trainable, and the workspace for `tokens` tokens.
struct LoraSizes {
  int64_t stored = 0, trainable = 0, workspace = 0;
};
LoraSizes lora_sizes(const ModelConfig& config, const LoraConfig& lora, int64_t tokens);

// NOTE [LoRA FLOPs]
// The work of one trained token under LoRA, as the PEFT peer counts it (shared/PERF.md):
// the frozen weights (every projection and the head, not the input embedding) do a
// forward and an input-gradient GEMM, 4 FLOPs per parameter, and no weight gradient; the
// adapters do all three, 6 per trainable parameter; attention does its forward and
// backward as in full training, 6 x layers x hidden x seq. Full training's count
// (ModelConfig::flops_per_token, 6 per parameter) would credit a LoRA run with a third
// more work than it does. Without LoRA this is ModelConfig::flops_per_token.
double training_flops_per_token(const ModelConfig& config, const LoraConfig& lora, int64_t seq_len);

// PEFT's name of a part's A or B: base_model.model.<hf_prefix>.lora_A.weight.
std::string peft_tensor_name(const LoraPart& part, char matrix);

class LoraAdapters : public ParamSource, public GradSink {
 public:
  // `tokens`: the most tokens one linear call sees (micro_batch × seq_len), for the
  // workspace. Compute dtype: bf16 on CUDA, fp32 on the CPU.
  LoraAdapters(const ModelConfig& config, const LoraConfig& lora, Device device, int64_t tokens);

  const ModelConfig& config() const { return config_; }
  const LoraConfig& lora_config() const { return lora_; }
  const std::vector<LoraTarget>& targets() const { return targets_; }
  // The trainable tensors, fp32: per target its a [parts * rank, in], then its b
  // [out, parts * rank] (NOTE [LoRA linear]); and their gradients, the same shapes.
  const std::vector<Tensor>& masters() const { return masters_; }
  const std::vector<Tensor>& gradients() const { return grads_; }
  // All masters (gradients) in one buffer, each tensor 256-byte aligned: the padding
  // between them is zero and stays zero.
  const Tensor& master_flat() const { return master_flat_; }
  const Tensor& gradient_flat() const { return grad_flat_; }
  // Values of masters() together (b's zeros included, padding not).
  int64_t stored_values() const;
  // Names of masters(), in order: "<target name without .weight>.lora_a" / ".lora_b".
  std::vector<std::string> master_names() const;
  // masters() as checkpoint tensors (NOTE [LoRA checkpoints] in ckpt/checkpoint.h).
  std::vector<ParamSpec> checkpoint_specs() const;
  // A and B values of every part: what PEFT counts as trainable (b's zeros excluded).
  int64_t trainable_params() const;

  // A kaiming-uniform(a = sqrt(5)) from the seed and each target's name, B zero.
  void initialize(uint64_t seed);
  // Copies the masters into the compute copy (after an optimizer step or a load).
  void refresh_compute();
  // The frozen weights the adapters are added to (compute dtype, the model's device).
  void set_base(ParamSource& base) { base_ = &base; }
  // Dropout masks for the micro-batch at `index` in the run (NOTE [LoRA dropout]).
  void set_dropout_step(uint64_t seed, uint64_t index);
  // As a gradient sink: the next gradients are written over the buffers.
  void discard();
  // Dropout on (training) or off (evaluation, as PEFT's model.eval()).
  void set_training(bool training);

  // A part's A [rank, in] or B [rows, rank] on the host, fp32; and the reverse.
  Tensor part_matrix(size_t target, size_t part, char matrix) const;
  void set_part_matrix(size_t target, size_t part, char matrix, const Tensor& values);
  // weight += scale * b a for each target: the merged weights (fp32 host parameters).
  void merge_into(FlatParameters& params) const;

  const Tensor& embedding() override { return base().embedding(); }
  const BlockWeights& layer(int index) override;
  const Tensor& final_norm() override { return base().final_norm(); }
  const LinearWeight& output() override { return base().output(); }

  const BlockWeights& layer_grads(int index) override { return grad_layers_.at(static_cast<size_t>(index)); }
  void layer_done(int index) override { fresh_.at(static_cast<size_t>(index)) = 0; }
  const Tensor& embedding_grad() override { return no_gradient_; }
  const Tensor& final_norm_grad() override { return norm_scratch_; }
  const LinearWeight& output_grad() override { return frozen_output_; }
  bool layer_grads_fresh(int index) const override { return fresh_.at(static_cast<size_t>(index)) != 0; }
  bool head_grads_fresh() const override { return true; }
  bool embedding_grad_fresh() const override { return true; }

 private:
  ParamSource& base();
  Tensor& master_of(size_t target, char matrix);

  ModelConfig config_;
  LoraConfig lora_;
  Device device_;
  std::vector<LoraTarget> targets_;
  std::vector<std::vector<int>> target_of_;  // per layer, per block entry: target index or -1
  Tensor master_flat_, grad_flat_, compute_flat_;
  std::vector<Tensor> masters_, grads_;
  std::vector<LoraAdapter> adapters_;
  LoraWorkspace workspace_;
  ParamSource* base_ = nullptr;
  std::vector<BlockWeights> layers_, grad_layers_;
  Tensor norm_scratch_, no_gradient_;
  LinearWeight frozen_output_;
  std::vector<char> fresh_;
};

}  // namespace forge
