#include "model/memory_estimate.h"

#include <fmt/format.h>

#include <algorithm>

#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/nf4_base.h"
#include "model/pipeline.h"

namespace forge {

namespace {

// The values of FSDP's units (NOTE [FSDP layout]), padding left out; `block` is the largest
// block's (a MoE model's dense first blocks are smaller), which sizes the buffers.
// Under expert parallelism P a MoE block's unit holds 1/P of its routed experts; `held` is
// every unit's values in full on one rank.
struct FsdpUnitSizes {
  double block, embedding, head, held;
};
FsdpUnitSizes fsdp_unit_sizes(const ModelConfig& config, int64_t expert_parallel, int64_t tensor_parallel) {
  if (tensor_parallel > 1) {  // a rank's shards (NOTE [Tensor-parallel shards]); no MoE blocks
    FsdpUnitSizes u{0, 0, 0, 0};
    for (const ParamSpec& spec : parameter_specs(config, {0, static_cast<int>(tensor_parallel)})) {
      const double n = static_cast<double>(shape_numel(spec.shape));
      u.held += n;
      if (spec.layer == 0) u.block += n;
      else if (spec.layer < 0 && spec.name == "embedding.weight") u.embedding += n;
      else if (spec.layer < 0) u.head += n;
    }
    return u;
  }
  const double p = static_cast<double>(expert_parallel);
  const double routed = config.moe() ? static_cast<double>(config.num_experts) * 3.0 *
                                           static_cast<double>(config.hidden_size * config.resolved_moe_ffn())
                                     : 0.0;
  auto block_of = [&](int64_t layer) {
    return static_cast<double>(config.layer_params(layer)) - (config.moe_layer(layer) ? routed * (p - 1) / p : 0.0);
  };
  const double block = std::max(block_of(0), block_of(config.num_layers - 1));
  const double embedding = static_cast<double>(config.embedding_params());
  const double head = static_cast<double>(config.hidden_size) + (config.tie_word_embeddings ? 0.0 : embedding);
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < config.num_layers; ++i) moe_layers += config.moe_layer(i) ? 1 : 0;
  const double held = static_cast<double>(config.total_params()) - static_cast<double>(moe_layers) * routed * (p - 1) / p;
  return {block, embedding, head, held};
}

// ZeRO-3's gathered block slots: three, or the model's blocks where it has fewer (NOTE
// [FSDP]).
double zero3_slots(const ModelConfig& config) {
  return static_cast<double>(std::clamp<int64_t>(config.num_layers, 1, 3));
}

// NOTE [FP8 all-gather]: the compute weights of a rank that gathers its blocks as codes, of
// the blocks in `specs` (the model's, or a pipeline rank's stages'): the embedding and head
// it holds in full (`ends` elements); `slots` gathered blocks (three under ZeRO-3, or one per
// held block under ZeRO-1/2) of 1 byte per element, their norms in the compute dtype, and
// the norms' wire (at most every norm element of a block, per rank). The largest block's:
// a MoE block's router and bias travel with its norms (NOTE [FP8 all-gather pieces] in
// distributed/fsdp_fp8_pieces.h), and so do its routed experts' stacks with
// precision.fp8_routed_experts false; the codes are then packed: a slot holds the block's
// FP8 elements alone, and their wire takes at most those of a block. Under expert
// parallelism the rank's 1/P of the stacks travel in the compute dtype in an expert buffer
// of each slot, and the codes are in place again. `block` is the largest block's elements.
// NOTE [FP8 all-gather of the head] in distributed/fsdp.h: with the FP8 head an untied
// output.weight among `specs` is held as codes (1 byte each) in a slot of its own.
double fp8_gather_compute_weights(const ModelConfig& config, const std::vector<ParamSpec>& specs,
                                  const MemoryPlan& plan, double block, double ends, double slots) {
  const double n = static_cast<double>(plan.shard_ranks), compute_bytes = plan.cuda ? 2.0 : 4.0;
  double head_codes = 0;
  if (plan.fp8->output_head && !config.tie_word_embeddings)
    for (const ParamSpec& spec : specs)
      if (spec.layer < 0 && spec.name == "output.weight") head_codes += static_cast<double>(shape_numel(spec.shape));
  const size_t layers = static_cast<size_t>(std::max<int64_t>(config.num_layers, 1));
  std::vector<double> layer_norms(layers, 0.0), layer_codes(layers, 0.0), layer_experts(layers, 0.0);
  bool packed_codes = false;
  const bool expert_parts = plan.expert_parallel > 1;
  for (const ParamSpec& spec : specs) {
    if (spec.layer < 0) continue;
    const double numel = static_cast<double>(shape_numel(spec.shape));
    const size_t layer = static_cast<size_t>(spec.layer);
    if (expert_parts && spec.expert_stack) {
      layer_experts.at(layer) += numel / static_cast<double>(plan.expert_parallel);
      continue;
    }
    const bool codes = fp8_block_projection(spec, *plan.fp8) || fp8_expert_stack(spec, *plan.fp8);
    // NOTE [FP8 all-gather pieces]: a stack or a filtered projection with the norms packs the codes.
    packed_codes = packed_codes || (!codes && (spec.expert_stack || fp8_block_matrix(spec)));
    (codes ? layer_codes : layer_norms).at(layer) += numel;
  }
  const double norms = *std::max_element(layer_norms.begin(), layer_norms.end());
  const double experts = *std::max_element(layer_experts.begin(), layer_experts.end());
  const double codes =
      packed_codes || expert_parts ? *std::max_element(layer_codes.begin(), layer_codes.end()) : block;
  return (ends - head_codes) * compute_bytes + head_codes +
         slots * ((expert_parts ? block - experts : codes) + (norms + experts) * compute_bytes) +
         std::min(norms, block / n) * n * compute_bytes + (packed_codes ? std::min(codes, block / n) * n : 0.0);
}

}  // namespace

// NOTE [Pipeline parallelism]: each rank's own parameters and in-flight activations; the
// fullest rank's (the first holds the most micro-batches, the last the head).
namespace {

MemoryEstimate estimate_pipeline_memory(const ModelConfig& config, const MemoryPlan& plan) {
  const int p = static_cast<int>(plan.pipeline_parallel), v = static_cast<int>(plan.pipeline_virtual_stages);
  const PipelineScheduleKind kind = v > 1 ? PipelineScheduleKind::Interleaved : PipelineScheduleKind::OneFOneB;
  const PipelineSchedule schedule =
      make_pipeline_schedule(kind, {p, v, static_cast<int>(plan.micro_batches)});
  const DType compute = plan.cuda ? DType::BF16 : DType::F32;
  const std::vector<ParamSpec> specs = parameter_specs(config, {0, static_cast<int>(plan.tensor_parallel)});
  MemoryEstimate worst;
  for (int r = 0; r < p; ++r) {
    std::vector<PipelineStage> stages;
    double activations = 0;
    for (int c = 0; c < v; ++c) {
      stages.push_back(pipeline_stage(config, p, v, r, c));
      activations += static_cast<double>(pipeline_chunk_in_flight(schedule, r, c)) *
                     static_cast<double>(activation_bytes(config, plan.micro_batch, plan.seq_len, compute,
                                                          plan.checkpoint, plan.expert_parallel, plan.tensor_parallel,
                                                          plan.context_parallel, stages.back(),
                                                          plan.context_parallel_rotate));
    }
    double params = 0, held = 0;
    for (const ParamSpec& spec : pipeline_stage_specs(specs, stages)) params += static_cast<double>(shape_numel(spec.shape));
    // NOTE [Expert parallelism under pipeline parallelism]: the full-size buffers hold the
    // rank's experts of its stages; each expert part is sharded over the ranks holding it,
    // so the chunks are 1/n of the stages' parameters either way.
    for (const ParamSpec& spec :
         expert_parallel_specs(pipeline_stage_specs(specs, stages), {0, plan.expert_parallel}))
      held += static_cast<double>(shape_numel(spec.shape));
    // Under FSDP over the stage's data-parallel ranks: the masters, AdamW state and gradient
    // chunk sharded; ZeRO-1 keeps the stages' full fp32 gradients and compute weights. NOTE
    // [ZeRO-2 and -3 under pipeline parallelism]: ZeRO-2 two rotating gradient slots of the
    // stages' largest unit instead (and the chunks a reduction adds, from the step's second
    // micro-batch or in bf16); ZeRO-3 also the compute weights of the embedding and head it
    // holds and three gathered blocks alone (fewer where the stages hold fewer).
    const double n = plan.fsdp ? static_cast<double>(plan.shard_ranks) : 1.0;
    const int zero = plan.fsdp ? static_cast<int>(plan.zero_stage) : 1;
    double block = 0, ends = 0;  // the stages' largest block; their embedding and head
    double held_blocks = 0;      // the stages' blocks
    double gathered_blocks = 0;  // ZeRO-3's slots: three, or the stages' blocks where fewer
    {
      std::vector<double> blocks(static_cast<size_t>(config.num_layers), 0.0);
      for (const ParamSpec& spec :
           expert_parallel_specs(pipeline_stage_specs(specs, stages), {0, plan.expert_parallel})) {
        const double numel = static_cast<double>(shape_numel(spec.shape));
        if (spec.layer >= 0) blocks[static_cast<size_t>(spec.layer)] += numel;
        else ends += numel;
      }
      for (double b : blocks) {
        block = std::max(block, b);
        held_blocks += b > 0 ? 1 : 0;
      }
      gathered_blocks = std::min(held_blocks, 3.0);
    }
    const double largest_unit = std::max(block, ends);  // a bound on the larger of the embedding and head
    const double compute_bytes = plan.cuda ? 2.0 : 4.0;
    MemoryEstimate e;
    e.master_weights = params * 4 / n;
    e.compute_weights = plan.cuda ? held * 2 : plan.fsdp ? held * 4 : 0.0;
    if (zero == 3) e.compute_weights = (ends + gathered_blocks * block) * compute_bytes;
    // NOTE [FP8 all-gather] over the stages' blocks: ZeRO-3's slots, or one per held block.
    if (plan.fsdp && plan.fp8_all_gather && plan.fp8)
      e.compute_weights = fp8_gather_compute_weights(config, pipeline_stage_specs(specs, stages), plan, block, ends,
                                                     zero == 3 ? gathered_blocks : held_blocks);
    e.gradients = (zero == 1 ? held * 4 : 2 * largest_unit * 4) + (plan.fsdp ? params * 4 / n : 0.0);
    e.optimizer_state = params * 2 * static_cast<double>(dtype_size(plan.optimizer_state)) / n;
    e.activations = activations;
    if (zero >= 2 && (plan.bf16_reduce || plan.micro_batches > 1))
      e.comm_buffers = 2 * largest_unit / n * (plan.bf16_reduce ? 2 : 4) + (plan.bf16_reduce ? 2 * largest_unit * 2 : 0);
    if (plan.fp8 && plan.cuda) {
      // NOTE [FP8 under context and pipeline parallelism]: the whole model's statistics and
      // histories on every rank, the weight cache of its stages' FP8 weights alone.
      e.fp8_scratch = static_cast<double>(
          fp8_scratch_bytes(config, *plan.fp8, plan.micro_batch * plan.seq_len / plan.context_parallel));
      double cached = 0;
      for (const ParamSpec& spec : pipeline_stage_specs(specs, stages))
        if (fp8_block_projection(spec, *plan.fp8) || (plan.fp8->output_head && spec.name == "output.weight"))
          cached += static_cast<double>(shape_numel(spec.shape));
        else if (fp8_expert_stack(spec, *plan.fp8))  // NOTE [FP8 expert stack state]: the local experts'
          cached += static_cast<double>(shape_numel(spec.shape)) / static_cast<double>(plan.expert_parallel);
      e.fp8_weight_cache = plan.fp8->weight_cache ? 2 * cached : 0.0;
    }
    if (plan.lora.enabled()) {
      // NOTE [LoRA under pipeline parallelism]: the stages' frozen base (NF4 projections under
      // QLoRA), every adapter whole with its master, gradient and AdamW state. Under FSDP the
      // frozen base is the rank's chunk of the stages' units and what the ZeRO stage holds in
      // full (ZeRO-1/2: every unit; ZeRO-3: the embedding, head and gathered blocks); under
      // expert parallelism the units hold the rank's experts alone (`held`: NOTE [LoRA under
      // pipeline and expert parallelism]), the chunk 1/n of the stages' parameters either way;
      // the experts' workspace takes P times a rank's rows (NOTE [LoRA under expert parallelism]).
      const LoraSizes lora = lora_sizes(config, plan.lora, plan.micro_batch * plan.seq_len, plan.expert_parallel);
      const double adapters = static_cast<double>(lora.stored);
      const double compute_bytes = static_cast<double>(dtype_size(compute));
      const double full = zero == 3 ? ends + gathered_blocks * block : held;
      e.frozen_weights = (plan.fsdp ? full + params / n : params) * compute_bytes;
      // NOTE [FP8 all-gather of a frozen base]: the stages' blocks gathered as codes.
      if (plan.fsdp && plan.fp8_all_gather && plan.fp8)
        e.frozen_weights = params / n * compute_bytes +
                           fp8_gather_compute_weights(config, pipeline_stage_specs(specs, stages), plan, block, ends,
                                                      zero == 3 ? gathered_blocks : held_blocks) +
                           (plan.cuda ? block / n * 4 : 0.0);
      if (plan.lora.quantize_base == "nf4") {
        // NOTE [QLoRA under pipeline and expert parallelism]: the codes and the scratch of the
        // stages' blocks, their stacks' local experts alone; the rest replicated.
        const std::vector<ParamSpec> held =
            expert_parallel_specs(pipeline_stage_specs(specs, stages), {0, plan.expert_parallel});
        double rest = 0;
        for (const ParamSpec& spec : held)
          if (!is_quantized_base_weight(spec)) rest += static_cast<double>(shape_numel(spec.shape));
        e.frozen_weights = rest * compute_bytes;
        e.nf4_base = nf4_base_bytes(config, held) + nf4_scratch_bytes(config, compute, true, held);
      }
      e.master_weights = adapters * 4;
      e.compute_weights = plan.cuda ? adapters * 2 : 0.0;
      e.gradients = adapters * 4;
      e.optimizer_state = adapters * 2 * static_cast<double>(dtype_size(plan.optimizer_state));
      e.activations += static_cast<double>(lora.workspace) * compute_bytes;
    }
    if (e.total() > worst.total()) worst = e;
  }
  return worst;
}

}  // namespace

MemoryEstimate estimate_memory(const ModelConfig& config, const MemoryPlan& plan) {
  if (plan.pipeline_parallel > 1) return estimate_pipeline_memory(config, plan);
  // Under tensor parallelism a rank holds its shards (NOTE [Tensor-parallel shards]).
  const double params = plan.tensor_parallel > 1 ? fsdp_unit_sizes(config, 1, plan.tensor_parallel).held
                                                 : static_cast<double>(config.total_params());
  const DType compute = plan.cuda ? DType::BF16 : DType::F32;
  MemoryEstimate e;
  e.master_weights = params * 4;
  e.compute_weights = plan.cuda ? params * 2 : 0.0;
  e.gradients = params * 4;
  e.optimizer_state = params * 2 * static_cast<double>(dtype_size(plan.optimizer_state));
  e.activations =
      static_cast<double>(activation_bytes(config, plan.micro_batch, plan.seq_len, compute, plan.checkpoint,
                                           plan.expert_parallel, plan.tensor_parallel, plan.context_parallel, {},
                                           plan.context_parallel_rotate));
  if (plan.fp8 && plan.cuda) {
    e.fp8_scratch = static_cast<double>(
        fp8_scratch_bytes(config, *plan.fp8, plan.micro_batch * plan.seq_len / plan.context_parallel));
    // NOTE [FP8 under tensor parallelism]: the cache holds the rank's shards (every FP8
    // projection is split then).
    e.fp8_weight_cache = static_cast<double>(fp8_weight_cache_bytes(config, *plan.fp8)) /
                         static_cast<double>(plan.tensor_parallel);
  }
  if (plan.lora.enabled()) {
    // NOTE [LoRA training]: only the adapters have masters, gradients and AdamW state.
    // NOTE [LoRA under expert parallelism]: the experts' workspace takes P times a rank's rows.
    const LoraSizes lora = lora_sizes(config, plan.lora, plan.micro_batch * plan.seq_len, plan.expert_parallel);
    const double adapters = static_cast<double>(lora.stored), compute_bytes = static_cast<double>(dtype_size(compute));
    e.frozen_weights = params * compute_bytes;
    if (plan.fsdp && plan.lora.quantize_base != "nf4") {
      // NOTE [Frozen FSDP base]: this rank's chunk in the compute dtype, and what the ZeRO
      // stage holds in full (ZeRO-3: the embedding, the head and three gathered blocks).
      // Of the rank's shards; under expert parallelism the units hold the rank's experts alone.
      const FsdpUnitSizes u = fsdp_unit_sizes(config, plan.expert_parallel, plan.tensor_parallel);
      e.frozen_weights = (params / static_cast<double>(plan.shard_ranks) +
                          (plan.zero_stage <= 2 ? u.held : u.embedding + u.head + zero3_slots(config) * u.block)) *
                         compute_bytes;
      // NOTE [FP8 all-gather of a frozen base]: the blocks gathered as codes (three slots, or
      // one per block under ZeRO-1/2) and, on CUDA, the fp32 copy of a block chunk.
      if (plan.fp8_all_gather && plan.fp8)
        e.frozen_weights =
            params / static_cast<double>(plan.shard_ranks) * compute_bytes +
            fp8_gather_compute_weights(config, parameter_specs(config, {0, static_cast<int>(plan.tensor_parallel)}),
                                       plan, u.block, u.embedding + u.head,
                                       plan.zero_stage == 3 ? zero3_slots(config)
                                                            : static_cast<double>(config.num_layers)) +
            (plan.cuda ? u.block / static_cast<double>(plan.shard_ranks) * 4 : 0.0);
    }
    if (plan.lora.quantize_base == "nf4") {
      // NOTE [NF4 base under tensor parallelism]: a rank's codes and scratch of its shards.
      const std::vector<ParamSpec> shards = parameter_specs(config, {0, static_cast<int>(plan.tensor_parallel)});
      double projections = 0;
      for (const ParamSpec& spec : shards)
        if (is_quantized_base_weight(spec)) projections += static_cast<double>(shape_numel(spec.shape));
      e.frozen_weights = (params - projections) * compute_bytes;
      // NOTE [NF4 expert stacks under expert parallelism]: a rank's codes and scratch of its experts.
      const std::vector<ParamSpec> held = expert_parallel_specs(shards, {0, plan.expert_parallel});
      e.nf4_base = nf4_base_bytes(config, held) + nf4_scratch_bytes(config, compute, true, held);
    }
    e.master_weights = adapters * 4;
    e.compute_weights = plan.cuda ? adapters * 2 : 0.0;
    e.gradients = adapters * 4;
    e.optimizer_state = adapters * 2 * static_cast<double>(dtype_size(plan.optimizer_state));
    e.activations += static_cast<double>(lora.workspace) * compute_bytes;
    return e;
  }
  if (!plan.fsdp) return e;

  // The layout of NOTE [FSDP layout] and the buffers of NOTE [FSDP] (padding left out).
  const double n = static_cast<double>(plan.shard_ranks);
  const auto [block, embedding, head, held] = fsdp_unit_sizes(config, plan.expert_parallel, plan.tensor_parallel);
  const bool tied = config.tie_word_embeddings;
  const double compute_bytes = static_cast<double>(dtype_size(compute));
  const double largest_unit = std::max({embedding, head, block});
  // ZeRO-2/3's two rotating gradient buffers fit the largest unit that goes through them.
  const double slot = plan.zero_stage == 1 ? largest_unit : tied ? std::max(head, block) : largest_unit;
  e.master_weights = params * 4 / n;
  e.optimizer_state /= n;
  e.gradients = params * 4 / n + (plan.zero_stage == 1 ? held * 4 : (2 * slot + (tied ? embedding : 0)) * 4);
  e.compute_weights =
      plan.zero_stage <= 2 ? held * compute_bytes : (embedding + head + zero3_slots(config) * block) * compute_bytes;
  if (plan.fp8_all_gather && plan.fp8)
    e.compute_weights = fp8_gather_compute_weights(
        config, parameter_specs(config, {0, static_cast<int>(plan.tensor_parallel)}), plan, block, embedding + head,
        plan.zero_stage == 3 ? zero3_slots(config) : static_cast<double>(config.num_layers));
  // Reduction buffers: bf16 staging of a whole unit per channel, and a reduced chunk per
  // channel wherever a unit is reduced more than once per step (or in bf16).
  const double channels = plan.zero_stage >= 2 && tied ? 3 : 2;
  const bool reduced_chunks = plan.bf16_reduce || (plan.zero_stage >= 2 && plan.micro_batches > 1);
  e.comm_buffers = (reduced_chunks ? channels * largest_unit / n * (plan.bf16_reduce ? 2 : 4) : 0) +
                   (plan.bf16_reduce ? (2 * slot + (plan.zero_stage >= 2 && tied ? embedding : 0)) * 2 : 0);
  return e;
}

std::string describe(const MemoryEstimate& e, bool bf16_compute) {
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / (1024.0 * 1024.0 * 1024.0)); };
  std::string s;
  if (e.nf4_base > 0)
    s = fmt::format("frozen NF4 projections with their scratch {} + ", gib(e.nf4_base));
  if (e.frozen_weights > 0)
    s += fmt::format("frozen {} {} {} + LoRA adapters: ", bf16_compute ? "bf16" : "fp32",
                     e.nf4_base > 0 ? "embedding, norms and head" : "weights", gib(e.frozen_weights));
  s += fmt::format("master weights {} + ", gib(e.master_weights));
  if (e.compute_weights > 0) s += fmt::format("{} weights {} + ", bf16_compute ? "bf16" : "fp32", gib(e.compute_weights));
  s += fmt::format("gradients {} + AdamW state {} + activations {}", gib(e.gradients), gib(e.optimizer_state),
                   gib(e.activations));
  if (e.fp8_scratch > 0) s += fmt::format(" + FP8 GEMM scratch {}", gib(e.fp8_scratch));
  if (e.fp8_weight_cache > 0) s += fmt::format(" + FP8 weight cache {}", gib(e.fp8_weight_cache));
  if (e.comm_buffers > 0) s += fmt::format(" + FSDP reduction buffers {}", gib(e.comm_buffers));
  s += fmt::format(" = {}", gib(e.total()));
  return s;
}

}  // namespace forge
