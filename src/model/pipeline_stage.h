// A pipeline stage: the part of the decoder one pipeline rank (or one of its model chunks)
// computes.
//
// NOTE [Pipeline stages]
// Pipeline parallelism (NOTE [Pipeline parallelism] in model/pipeline.h) cuts the decoder
// into stages of consecutive blocks: the first stage also looks the tokens up (the
// embedding), the last also runs the final norm, the output projection and the loss. A
// DecoderLM built for a stage lays out activations for its blocks only and walks them
// with the model's layer indices (weights.layer(first_layer + i)), so a ParamSource and
// GradSink of the rank's parameters serve it unchanged. Between stages the residual
// stream crosses as one tensor each way:
//  - forward: a stage that is not the first takes its input in stage_input() (the
//    previous stage's stage_output(), [R, H]: the stream's rows the rank holds, so under
//    tensor or context parallelism each rank passes its own rows to its peer);
//  - backward: a stage that is not the last takes the gradient of its output in
//    stage_output_grad() before stage_backward(), which leaves the gradient of its input
//    in stage_input_grad() (the same buffer) for the previous stage.
// The last stage's stage_forward() returns the micro-batch's loss and, in training, also
// runs the head's backward (the chunked head makes its gradient while computing the loss,
// NOTE [Chunked output head]); every other stage's returns an empty LossSum.
// A stage's components number its blocks from 0 (their parameters by the model's index):
// make_block_components gives a stage of DeepSeek's dense first blocks alone the dense
// feed-forward, one of Mixture-of-Experts blocks alone the MoE one, and one that holds the
// boundary a SplitByLayer told where the stage starts. Multi-head Latent Attention blocks
// are cut as any other. A Mixture-of-Experts stage's auxiliary losses (NOTE [MoE balancing
// loss] in model/moe_feed_forward.h: the per_layer and sequence balancing losses and the
// z-loss, sums over the layers) are its blocks' share: every stage's stage_forward in
// training counts the micro-batch's targets and adds its components' auxiliary_loss,
// weighted as on one rank, to the loss sum it returns (with no tokens off the last stage),
// and its gradient enters the stage's routers in its backward; the sum over the stages is
// one rank's. The pooled loss (its f and P pool every layer's routing) is the last stage's:
// its statistics cross the stages with the activations and come back with the gradients
// (NOTE [Pooled balancing loss across stages] in model/moe_feed_forward.h). The global one
// is a sum over the layers too, each layer's counts averaged over the step's micro-batches,
// which a stage's models of its micro-batches in flight count together (NOTE [Global
// balancing loss across stages] in model/moe_feed_forward.h). Each rank sums its
// stages' expert loads over the step's micro-batches into a list of every MoE block of the
// model (PipelineModel::expert_load, zeros for the other ranks' blocks); the trainer sums it
// over the data-parallel ranks and then the pipeline group, so every rank logs the whole
// model's loads and moves the routing biases of its own blocks by them (NOTE [Routing bias
// update] in train/trainer.cpp): the biases follow one rank's.
#pragma once

namespace forge {

struct PipelineStage {
  int first_layer = 0;   // the stage's blocks are [first_layer, end_layer)
  int end_layer = -1;    // -1: to the model's last block
  bool embedding = true;  // the first stage: looks the tokens up
  bool head = true;       // the last stage: final norm, output projection and loss
};

}  // namespace forge
