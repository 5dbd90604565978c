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
// Blocks whose kind depends on the layer index (DeepSeek's first dense layers before the
// Mixture-of-Experts ones, SplitByLayer) are not cut into stages: a stage numbers its
// components' layers from 0.
#pragma once

namespace forge {

struct PipelineStage {
  int first_layer = 0;   // the stage's blocks are [first_layer, end_layer)
  int end_layer = -1;    // -1: to the model's last block
  bool embedding = true;  // the first stage: looks the tokens up
  bool head = true;       // the last stage: final norm, output projection and loss
};

}  // namespace forge
