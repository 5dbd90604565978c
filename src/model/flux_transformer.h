// FluxTransformer: the FLUX.1 transformer's forward and backward (NOTE [FLUX architecture]
// in flux_config.h), explicit per block as DecoderLM's, on whatever device its tensors are
// (the CPU reference in fp32, CUDA in bf16), with its activations planned once in one
// arena for a (batch, text tokens, latent grid) shape (NOTE [Activation arena]).
//
// The model reads weights unit by unit from a FluxParamSource and adds gradients to a
// FluxGradSink (NOTE [FLUX units]); the loss is the caller's: forward writes the predicted
// velocity, backward takes its gradient.
//
// NOTE [FLUX activation checkpointing]
// none keeps every block's intermediates for the backward; full keeps only each block's
// input streams and recomputes the block's forward just before its backward (one set of
// intermediates shared by all blocks), torchtitan's and diffusers' gradient checkpointing
// per block. selective is the decoder's (NOTE [Activation checkpointing]) and is refused.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/flux_config.h"
#include "model/flux_parameters.h"

namespace forge {

// What a micro-batch's shapes are: latent tokens on a grid_h x grid_w grid (the latent's
// height and width over the 2x2 patch), text_tokens T5 tokens.
struct FluxShape {
  int64_t batch = 1, text_tokens = 0, grid_h = 0, grid_w = 0;
  int64_t image_tokens() const { return grid_h * grid_w; }
  int64_t tokens() const { return text_tokens + image_tokens(); }
};

// A micro-batch, in the compute dtype on the model's device: the noisy latent tokens
// [B, image_tokens, in_channels], the text encoder's features [B, text_tokens,
// context_dim], the pooled text vector [B, pooled_dim]; each sample's time in [0, 1] and,
// for a guidance-distilled model, its guidance scale (host values; the model scales both by
// 1000 as diffusers does). The tensors must stay alive until the backward.
struct FluxInputs {
  Tensor image, text, pooled;
  std::vector<float> timesteps, guidance;
};

// NOTE [Recomputing some FLUX blocks]
// Full checkpointing keeps each block's input and recomputes the block's forward in the
// backward: about a third more FLOPs. Where memory is left over (the 12B on one GPU at a
// small micro-batch), `recompute_blocks` N recomputes only the first N blocks in forward
// order (the double blocks, then the single blocks) and keeps every activation of the rest,
// as Megatron-LM's --recompute-method block --recompute-num-layers N does; -1 recomputes
// every block (full), 0 none (as activation_checkpoint.mode none, in the arena of none).
// The results are those of full checkpointing (and of none): the recomputed forward is the
// same forward. forge info counts the arena for a given N, so a user picks the smallest N
// that fits (activation_checkpoint.recompute_blocks).
class FluxTransformer {
 public:
  FluxTransformer(const FluxConfig& config, const FluxShape& shape, Device device,
                  ActivationCheckpoint checkpoint = ActivationCheckpoint::None, int64_t recompute_blocks = -1);
  ~FluxTransformer();
  FluxTransformer(const FluxTransformer&) = delete;
  FluxTransformer& operator=(const FluxTransformer&) = delete;

  // Bytes of the activation arena for this shape, mode and compute dtype.
  static int64_t activation_bytes(const FluxConfig& config, const FluxShape& shape, DType dtype,
                                  ActivationCheckpoint checkpoint, int64_t recompute_blocks = -1);

  // Plans the activations for another micro-batch shape (another bucket's latent grid):
  // in the same arena when it fits, else in a new one. The rotary tables follow the grid.
  void reshape(const FluxShape& shape);

  const FluxConfig& config() const { return config_; }
  const FluxShape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }

  // out: the predicted velocity [B, image_tokens, out_channels], compute dtype.
  void forward(const FluxInputs& inputs, FluxParamSource& params, const Tensor& out);
  // dout: the loss's gradient with respect to out. Adds every parameter's gradient to
  // `grads`, or with `overwrite` writes it over what they hold (the first micro-batch of a
  // step, NOTE [Fresh gradient buffers] in model/parameters.h: no zeroing pass first),
  // calling unit_done as each unit's are complete.
  void backward(const Tensor& dout, FluxParamSource& params, FluxGradSink& grads, bool overwrite = false);

  struct Activations;  // flux_transformer.cpp

 private:
  void plan();  // lays the activations out for shape_ in the arena (grown when it is too small)

  FluxConfig config_;
  FluxShape shape_;
  Device device_;
  DType dtype_;
  ActivationCheckpoint checkpoint_;
  int64_t recompute_blocks_;  // NOTE [Recomputing some FLUX blocks]: -1 every block under full
  Tensor arena_;
  std::unique_ptr<Activations> acts_;
  FluxInputs inputs_;  // the micro-batch of the last forward
};

}  // namespace forge
