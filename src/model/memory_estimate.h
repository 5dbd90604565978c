// How much device memory a training step needs, by component, before anything is
// allocated: forge info prints it, the trainer checks it against the GPU's free memory
// and refuses a config that cannot fit with this breakdown instead of failing mid-step.
//
// Per parameter: the fp32 master weights (4 bytes) and fp32 gradients (4), AdamW's two
// moments (8, or 4 with optimizer.state_dtype bf16), and on CUDA the bf16 compute copy
// (2). Activations are the exact size of the decoder's arena (NOTE [Activation
// arena]) for the micro-batch, sequence length and checkpointing mode. Library
// workspaces (cuBLASLt's 32 MiB, cuDNN's attention workspace) and the CUDA context are
// outside the estimate; kReserveBytes stands for them when checking against free memory.
// Under FSDP (NOTE [FSDP] in distributed/fsdp.h) the estimate is one rank's: 1/N of the master
// weights, the gradient chunk and the optimizer state, plus the full-size buffers the ZeRO
// stage keeps (ZeRO-1: all gradients and weights; ZeRO-2: all weights and two gradient
// buffers of the largest unit, plus a tied embedding's gradients; ZeRO-3: as ZeRO-2 but of
// the weights only the embedding and head and three gathered blocks) and the reduction
// buffers. LoRA under FSDP (NOTE [Frozen FSDP base]): the frozen base's chunk in the
// compute dtype plus what the ZeRO stage holds in full; the adapters whole on every rank.
// QLoRA under data parallelism replicates its NF4 base: a rank holds what one device does,
// but under expert parallelism only its local experts' NF4 codes and their scratch (NOTE [NF4
// expert stacks under expert parallelism] in model/nf4_base.h).
// precision.fp8 on CUDA adds the FP8 GEMMs' scratch (fp8_scratch_bytes, the function
// Fp8Projections allocates by, for a rank's tokens: 1/C of the micro-batch's under context
// parallelism) and the weight cache (a pipeline rank's: its stages' FP8 weights); the CPU
// path allocates none.
// Pipeline parallelism: the fullest rank's stages, as above (ZeRO-2/3: NOTE [ZeRO-2 and -3
// under pipeline parallelism] in distributed/fsdp.h; the two gradient slots and three
// gathered blocks of the rank's stages' units).
// Expert parallelism of degree P (NOTE [Expert parallelism] in model/expert_dispatch.h):
// the units' full-size buffers hold 1/P of each MoE block's routed experts (under pipeline
// parallelism, of the rank's stages' blocks), and a rank's received rows (in the
// activations, and LoRA's routed-expert workspace) may be P times a micro-batch's
// assignments.
// Tensor parallelism of degree T (NOTE [Tensor parallelism] in model/tensor_parallel.h):
// everything above counts the rank's shards (parameter_specs(config, shard)), FSDP's
// units too, and the activations are the rank's arena. Context parallelism of degree C
// (NOTE [Context parallelism] in model/context_parallel.h): the activations are the rank's
// arena (its 1/C of the tokens and the gathered keys and values); shard_ranks counts the
// context-parallel ranks FSDP shards over.
#pragma once

#include <cstdint>
#include <optional>

#include "core/dtype.h"
#include "model/activations.h"
#include "model/config.h"
#include "model/context_parallel.h"
#include "model/fp8_projections.h"
#include "model/lora_config.h"

namespace forge {

struct MemoryEstimate {
  double master_weights = 0;   // fp32 weights the optimizer updates
  double compute_weights = 0;  // bf16 copy the model computes with (CUDA); 0 on the CPU
  double gradients = 0;        // fp32
  double optimizer_state = 0;  // AdamW m and v
  double activations = 0;      // the activation arena of one micro-batch
  double comm_buffers = 0;     // FSDP: bf16 staging and reduced chunks of the reduce-scatters
  // LoRA (NOTE [LoRA training]): the model's weights, frozen in the compute dtype; the
  // fields above are then the adapters' (their workspace counted with the activations).
  double frozen_weights = 0;
  // QLoRA (NOTE [QLoRA base]): the projections' NF4 codes and statistics and the
  // dequantization scratch; frozen_weights is then the rest (embedding, norms, head).
  double nf4_base = 0;
  double fp8_scratch = 0;  // precision.fp8 on CUDA: the FP8 GEMMs' code buffers (NOTE [FP8 projections])
  double fp8_weight_cache = 0;  // precision.fp8_weight_cache on CUDA (NOTE [FP8 weight cache])
  double total() const {
    return master_weights + compute_weights + gradients + optimizer_state + activations + comm_buffers +
           frozen_weights + nf4_base + fp8_scratch + fp8_weight_cache;
  }
};

struct MemoryPlan {
  int64_t micro_batch = 1;
  int64_t seq_len = 1;
  bool cuda = false;                   // bf16 compute copy and activations; fp32 on the CPU
  DType optimizer_state = DType::F32;  // F32 | BF16
  ActivationCheckpoint checkpoint = ActivationCheckpoint::None;
  bool fsdp = false;         // more than one data-parallel rank
  int64_t shard_ranks = 1;   // parallelism.data_parallel_shard_degree
  int64_t zero_stage = 3;
  int64_t expert_parallel = 1;  // parallelism.expert_parallel_degree
  int64_t tensor_parallel = 1;  // parallelism.tensor_parallel_degree: a rank's shards and activations
  int64_t context_parallel = 1;  // parallelism.context_parallel_degree: a rank's activations
  // parallelism.context_parallel_rotate_method: the ring's scratch or the all-gather's
  ContextParallelRotate context_parallel_rotate = ContextParallelRotate::AllGather;
  // parallelism.pipeline_parallel_degree and the stages per rank: a rank's stages' parameters
  // and the micro-batches its schedule holds (the estimate is the fullest rank's)
  int64_t pipeline_parallel = 1, pipeline_virtual_stages = 1;
  bool bf16_reduce = false;
  int64_t micro_batches = 1;  // gradient accumulation steps
  LoraConfig lora;            // rank > 0: LoRA training (the base sharded under fsdp)
  std::optional<Fp8Settings> fp8;  // precision.fp8 set
  bool fp8_all_gather = false;     // precision.fp8_fsdp_all_gather (NOTE [FP8 all-gather] in distributed/fsdp.h)
};

MemoryEstimate estimate_memory(const ModelConfig& config, const MemoryPlan& plan);

// Headroom kept free for what the estimate leaves out (CUDA context, library workspaces).
constexpr double kReserveBytes = 2.0 * 1024 * 1024 * 1024;

// "master 32.1 GiB + compute copy 16.1 GiB + ... = 150.3 GiB"
// bf16_compute: the compute copy is bf16 (CUDA) rather than fp32 (CPU FSDP).
std::string describe(const MemoryEstimate& e, bool bf16_compute = true);

}  // namespace forge
