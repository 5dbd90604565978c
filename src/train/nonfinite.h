// NOTE [Non-finite steps]
// Every step checks its loss and its global gradient norm, which the trainer has on the
// host anyway (the norm feeds clipping), so a finite step costs no extra work and no extra
// synchronization; under FSDP both are already summed over the ranks, so every rank takes
// the same decision. A non-finite step never reaches the optimizer: weights, AdamW moments
// and AdamW's step count stay bitwise as they were. training.on_nonfinite then says what
// happens:
//   stop (default): the run ends (exit 1) with an error naming the step, the micro-batch
//     and the first non-finite tensor. Only now is the cost paid to find them: the weights
//     are scanned, then each micro-batch's loss, then the gradients in parameter order
//     (model/parameters.h); to name the micro-batch whose gradients are non-finite, the
//     step's micro-batches are run again one at a time (forward and backward, the same
//     batches) until one produces a non-finite gradient. Under FSDP every rank re-runs its
//     own slice in step (the reduction mixes the ranks' micro-batches, so the error names the
//     accumulation step: one micro-batch per rank).
//   skip: the step is logged as skipped (metrics.jsonl: "skipped": true and the running
//     "skipped_steps"), with the first non-finite tensor of the summed gradients, and the run
//     goes on with the next batch; training.max_skipped_steps skipped steps in a row stop it.
// Tests inject a NaN through FORGE_TEST_INJECT_NAN=STEP:TENSOR[:MICRO_BATCH] (1-based
// step, a parameter name, micro-batch 0 by default): after that micro-batch's backward (under
// FSDP, after the step's reduction) the first element of the tensor's gradient is set to
// NaN. A TENSOR written NAME@fp8_amax instead sets the weight amax that projection NAME's FP8
// casts recorded this step to NaN, after that micro-batch on this rank alone (tests start it
// on one rank of several: NOTE [FP8 under data parallelism] in train/trainer_fp8.cpp). It is a
// test hook only; forge warns when it is set.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace forge {

struct NanInjection {
  int64_t step = 0;         // 1-based optimizer step
  std::string tensor;       // parameter name
  int64_t micro_batch = 0;  // local accumulation index
  bool fp8_amax = false;    // NAME@fp8_amax: the projection's recorded weight amax, not a gradient
};

// FORGE_TEST_INJECT_NAN, parsed (an error names the variable when it is malformed).
std::optional<NanInjection> nan_injection_from_env();

// The index of the first tensor holding a NaN or an infinity (fp32 or bf16, any device), or
// -1 when all are finite. Copies device tensors to the host: for the failure path only.
int64_t first_nonfinite_tensor(const std::vector<Tensor>& tensors);

// Sets the first element of `t` (fp32) to NaN.
void poison_first_element(const Tensor& t);

}  // namespace forge
