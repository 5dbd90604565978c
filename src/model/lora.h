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
// adapters stay whole on every rank (NOTE [LoRA under data parallelism] in train/trainer.cpp);
// under context and tensor parallelism, NOTE [LoRA under context and tensor parallelism];
// under pipeline parallelism, NOTE [LoRA under pipeline parallelism].
//
// NOTE [LoRA under context and tensor parallelism]
// Context parallelism (NOTE [Context parallelism] in model/context_parallel.h) splits the
// tokens, not the weights, so the adapters take it as the base weights do: every rank of a
// context-parallel group holds the same adapters whole, computes on its two chunks of every
// sequence, and writes its tokens' share of the adapter gradients (a partial sum, as each
// rank's weight gradients are under full training). The trainer counts a context-parallel
// group's ranks as data-parallel ones (NOTE [Context-parallel steps] in train/trainer.cpp):
// the frozen FSDP base shards over them too, and the adapters' one all-reduce after the
// step's backward (NOTE [LoRA under data parallelism]) sums the gradients over the data- and
// context-parallel ranks together, with the micro-batch's grad_scale of the whole batch's
// targets; the loss is the decoder's group sum. QLoRA's replicated NF4 base is the same on
// every rank of the world, context-parallel ones included. Dropout (NOTE [LoRA dropout] in
// ops/lora.h) draws its masks from each element's index in the rank's input, so every
// context-parallel rank takes a seed of its own (train/trainer.cpp, lora_dropout_seed):
// otherwise the ranks' chunks would be dropped alike. The masks are then not the ones one
// process draws for the same tokens (they are independent draws of the same probability),
// so a run with lora.dropout > 0 follows a one-process run in distribution only; without
// dropout it follows it within fp32 reordering. Checkpoints, the PEFT adapter and the merged
// export are written as under data parallelism, by rank 0, the same files as one process's.
// Tensor parallelism (NOTE [Tensor parallelism] in model/tensor_parallel.h) splits the
// weights, and the adapters follow their projections, as Megatron's and NeMo's do:
//   - a column-parallel projection (qkv, gate/up: W's rows split) keeps A whole and takes
//     the rows of B its shard of W has (each part's rows consecutive in the shard). Its
//     input is the gathered normed rows, the same on every rank, so u = A x is too, and the
//     rank's output rows get their scale u B_shard^T. In the backward, g = B_shard^T dy is
//     the rank's share of the low-rank gradient: dx's share (scale g A) joins the frozen
//     GEMM's partial sum, which the group reduce-scatters anyway, and A's gradient
//     (scale g^T x) is a partial sum over the ranks; B's rows' gradient is exact.
//   - a row-parallel projection (o, down: W's columns split) takes the columns of A its
//     shard of W has and keeps B whole. u = A_shard x_shard is a partial sum over the ranks,
//     and so is the rank's scale u B^T, which joins the frozen GEMM's partial rows that the
//     group reduce-scatters: the sum of the ranks' u is never formed, the reduce-scatter of
//     the output sums it. In the backward dy is gathered (every rank's rows), so g = B^T dy
//     is whole, A_shard's gradient and dx's columns are exact, and B's gradient
//     (scale dy^T u_shard) is a partial sum over the ranks.
// The masters, their gradients and AdamW's state stay whole on every rank; the split
// matrices' compute copies and gradients are the rank's shards (refresh_compute copies the
// shards out of the whole compute copy). After the step's backward, spread_shard_gradients
// writes each shard's gradient at its places in the whole with zeros elsewhere, and the
// trainer sums the whole flat gradient over the tensor-parallel group (the partial sums of
// the whole matrices and the disjoint shards together), then over the data- and
// context-parallel ranks: every rank then holds the whole gradient, whose norm is the
// global one, and runs the same AdamW step. So checkpoints (the whole adapters, rank 0),
// the PEFT adapter (rank 0) and the merged export (the base's shards gathered to rank 0,
// the whole adapters merged there) are the same files as one process's. Dropout: a
// column-parallel adapter's input is the same on every rank, and so are its masks (the same
// seed, the same element indices): one process's. A row-parallel adapter's input is the
// rank's columns, whose element indices are not the whole input's, so each rank draws its
// own masks (set_dropout_step mixes the tensor-parallel rank into its seed; independent
// draws of the same probability, not one process's masks); and its forward adds the
// adapter's share over every row in one call after the frozen GEMM's row pieces
// (SequenceParallelEdges::project_out), so that the backward, one call over every row,
// draws the same masks. With precision.fp8 the frozen base's shards run their GEMMs in FP8
// under the adapters, the sharded tensors' amaxes agreed over the group (NOTE [FP8 under
// tensor parallelism] in model/fp8_projections.h). Under QLoRA each rank's NF4 base holds
// its shards, each quantized on its own (NOTE [NF4 base under tensor parallelism] in
// model/nf4_base.h), and the adapters are split as above.
//
// NOTE [LoRA under expert parallelism]
// With parallelism.expert_parallel_degree P > 1 (NOTE [Expert parallelism] in
// model/expert_dispatch.h) each rank's MoE blocks run its E / P local experts on the rows
// every rank of its expert-parallel group sends them. The frozen FSDP base holds each rank's
// local experts' slices of the stacks, sharded over the ranks that hold the same experts
// (NOTE [Frozen FSDP base], FsdpOptions::expert_parallel), as it does under full training.
// The adapters stay whole on every rank, as under data parallelism: the routed experts'
// adapters are handed to the blocks as the local experts' slices (A's rows [e0 r, e1 r) and
// B's [e0 out, e1 out), contiguous in forge's layout, NOTE [LoRA on routed experts]), whose
// gradients the rank's backward writes (its local experts' share of every token of its
// group); the other experts' gradient rows stay zero on this rank (discard() zeroes them once
// per step, after the previous step's all-reduce filled them). The trainer's one all-reduce
// of the adapter gradients over every data-parallel rank (NOTE [LoRA under data
// parallelism]) then sums each expert's partial gradients over the ranks that hold it and
// the 2-D adapters' over every rank, which is the global gradient: every rank runs the same
// AdamW step on the whole adapters, so checkpoints, the PEFT adapter and the merged export
// are one process's (under pipelining too: NOTE [LoRA under pipeline and expert
// parallelism]). The expert workspace takes P times a rank's rows (what its experts may
// receive), which the memory estimate counts (lora_sizes' expert_parallel). QLoRA holds its
// NF4 base's local experts alone (NOTE [NF4 expert stacks under expert parallelism] in
// model/nf4_base.h) and the rest of the base replicated; its adapters are the same as LoRA's.
//
// NOTE [LoRA under pipeline parallelism]
// Pipeline parallelism (NOTE [Pipeline parallelism] in model/pipeline.h) cuts the blocks
// into stages; the adapters take it as tensor parallelism's whole matrices do. The frozen
// base is per stage: a pipeline rank holds its stages' parameters alone (FlatParameters or
// Nf4FrozenBase with the rank's stages), in the compute dtype or NF4, as full training's
// weights are. The adapters are small (rank r x (in + out) per projection; no adapter sits
// on the embedding or the head), so every pipeline rank holds all of them whole, with their
// masters, gradients and AdamW state: a rank's backward writes its stages' adapter
// gradients, zero_unwritten_gradients() writes zeros for the others' (their blocks' layers
// were never handed to this GradSink since discard()), and the trainer sums the flat gradient
// over the pipeline group once after the schedule. Every rank then holds the whole
// gradient, whose norm is the global one (not summed again over the stages, as full
// training's per-stage squares are), and runs the same AdamW step, so the adapters stay
// bitwise identical on every rank. Checkpoints (the whole adapters, rank 0) and the PEFT
// adapter (rank 0) are then one process's files, and a checkpoint resumes under any layout;
// the merged export is written in pieces (NOTE [Export in pieces] in train/trainer_hf.cpp):
// each stage merges its stages' adapters into its stages' base (merge_into skips the targets
// the parameters do not hold). Dropout masks are drawn per micro-batch (NOTE [LoRA
// dropout]); the schedule interleaves micro-batches, so the trainer sets each one's step
// before every forward and backward of it (PipelineModel::forward_backward's
// before_micro_batch): the masks are one process's, and a run with dropout follows one
// process within fp32 reordering too.
// The other degrees compose with it as they do without pipelining, within each stage (NOTE
// [Device mesh] in train/trainer.cpp: a stage's ranks are the data-, context- and
// tensor-parallel ranks of one pipeline rank):
//   - tensor parallelism: the rank's shards of its stages' base; the split adapter matrices'
//     gradients are spread (spread_shard_gradients, which leaves the other stages' zero)
//     and summed over the tensor-parallel group before the pipeline's sum;
//   - data and context parallelism: the bf16 base is a frozen FSDP of the stages (NOTE
//     [Frozen FSDP base]; ZeRO-1 or -2: the stages' units in full, the rank's chunk of them,
//     nothing reduced; ZeRO-3: the blocks gathered around each use, NOTE [ZeRO-2 and -3
//     under pipeline parallelism]), QLoRA's NF4 base is
//     replicated over the stage's ranks, whose DataParallelComm carries the collectives;
//     after the pipeline's sum the gradient is summed over the stage's data- and
//     context-parallel ranks (NOTE [LoRA under data parallelism]), as the loss and the
//     target count are;
//   - FP8 (NOTE [FP8 frozen base]): the projections wrap the stages' base (flat or FSDP's),
//     each rank casting its stages' weights; the delayed statistics are max-reduced over the
//     data-parallel ranks, then the pipeline, as full training's (NOTE [FP8 under context
//     and pipeline parallelism] in train/trainer_fp8.cpp).
// The sum of the three groups' sums is the sum over every rank, so every rank holds the
// whole gradient and takes the same step. The merged export: each stage's rank 0 of its
// first replica writes (FSDP's chunks gathered there by Trainer::gather_stage_base, an NF4
// base dequantized there one parameter at a time: NOTE [QLoRA under pipeline and expert
// parallelism]), or under tensor parallelism each tensor-parallel rank its shards,
// merge_into adding its shard of B A (the rows of B, or the columns of A, its shard of W
// has). The cost of the simple layout is the adapters' AdamW state on every rank (16 bytes
// per trainable value) and one all-reduce of the adapters' gradients per step; adapters
// split by stage would save the former. With expert parallelism too, NOTE [LoRA under
// pipeline and expert parallelism].
//
// NOTE [LoRA under pipeline and expert parallelism]
// Expert parallelism under pipelining (NOTE [Expert parallelism under pipeline parallelism]
// in model/pipeline.h) forms its groups from a stage's shard ranks. The two gradient sums
// above compose without a group of their own, because every rank holds every adapter whole
// and writes zeros wherever it computed nothing. Per adapter kind, what a rank's backward
// writes and where its sum completes:
//   - a 2-D adapter (attention's, MLA's, the dense blocks' and shared experts', the
//     router's `gate`) of a block of stage s: the ranks of s's pipeline rank write their
//     tokens' partial sums, every other rank zeros (zero_unwritten_gradients);
//   - a routed-expert adapter of expert e in a block of stage s: the ranks of s's pipeline
//     rank whose expert-parallel index holds e write its partial sum over every token their
//     group routed to e (the rows the all-to-all brought them); the stage's other ranks
//     leave e's rows zero (discard()), and every other pipeline rank the whole stack.
// The pipeline's sum, then the stage's (data- and context-parallel ranks, the
// expert-parallel group among them), is the sum over every rank of the world, which is each
// kind's global gradient: every rank takes one process's AdamW step, the adapters stay
// identical everywhere, and the local experts' adapters need no gathering for the PEFT
// adapter or a checkpoint (rank 0's, one process's files, resumable under any layout).
// The frozen base is a ZeRO-1 FSDP of the rank's stages split by experts (FsdpOptions'
// pipeline_stages and expert_parallel together, as under full training; ZeRO-2/3 are not
// built for LoRA under expert and pipeline parallelism together yet): each stack's
// local experts' slice sharded over the stage's ranks that hold the same experts, the rest
// over the stage's ranks. The merged export in pieces gathers each stage's base to its shard
// rank 0 (Trainer::gather_stage_base), every expert-parallel rank's slices at their experts'
// places, merges the whole adapters there and writes. QLoRA: NOTE [QLoRA under pipeline and
// expert parallelism].
//
// NOTE [QLoRA under pipeline and expert parallelism]
// QLoRA's NF4 base (NOTE [QLoRA base] in model/nf4_base.h) under both holds a rank's stages'
// parameters with each expert stack's local slice alone: its specs are expert_parallel_specs
// of pipeline_stage_specs, imported (or initialized) and quantized expert by expert as under
// expert parallelism alone (NOTE [NF4 expert stacks under expert parallelism]), so a rank's
// codes are bitwise one process's codes of its experts; the rest of its stages' base is
// replicated over the stage's ranks, whose DataParallelComm sums the adapters' gradients
// after the pipeline's sum, exactly as the bf16 base's FSDP does (above). Training is
// otherwise LoRA's: the same adapters, the same sums, the same checkpoints.
// The merged export is written in pieces with no gather (NOTE [Export in pieces] in
// train/trainer_hf.cpp; its writer takes any number of writers per stage, each writing
// element ranges of the parameters, as FSDP's chunks are written): the stage's ranks 0 to
// P - 1 (the first expert-parallel group of its first replica, which holds every expert
// once) write, one parameter at a time, each dequantizing its own experts' slice of a stack
// into an fp32 host tensor, adding its experts' B A (merge_into with the ExpertShard), and
// writing it at its experts' place in the stack; the stage's rank 0 writes the replicated
// rest (dequantized, merged) as well. A writer's host memory grows by one parameter in fp32
// (its slice of a stack at most), not by a copy of its stages; the files are one
// process's export of the same weights. Without experts the same path writes QLoRA under
// pipelining alone (P = 1: the stage's rank 0 writes everything).
//
// NOTE [LoRA on MoE and MLA models]
// On a Mixture-of-Experts or Multi-head Latent Attention model the adapters go on the
// projections that lora.target_modules names with their Hugging Face module names:
// attention's q_proj, k_proj, v_proj, o_proj, or MLA's q_proj (or q_a_proj, q_b_proj),
// kv_a_proj_with_mqa, kv_b_proj and o_proj; DeepSeek's dense first blocks' and shared
// experts' gate_proj, up_proj, down_proj; the router, `gate` ([experts, hidden]); and the
// routed experts' stacked weights, experts.gate_up_proj ([E, 2F, hidden]) and
// experts.down_proj ([E, hidden, F]), one low-rank update per expert as PEFT's ParamWrapper
// makes them (NOTE [LoRA on routed experts] in ops/lora_experts.h). The routing biases stay
// frozen (DeepSeek-V3's, which router_bias_update_rate would move: refused under LoRA, since
// they belong to the frozen base that checkpoints do not hold). The MoE block's backward
// carries dL/dx through the frozen router and experts, skipping their weight-gradient GEMMs
// (the gradient descriptors hold no tensor; an adapted stack's hold its adapters). The
// balancing losses and z-loss stay in the training loss, as transformers adds its aux_loss
// under PEFT with output_router_logits: their gradient reaches the router's adapter when it
// has one, and otherwise the adapters upstream through the router's input gradient.
// all-linear follows PEFT 0.21 on transformers 5, whose all-linear on a MoE model adapts
// attention's linear modules and, through target_parameters, the router (gate.weight) and
// both expert stacks; its v4-to-v5 conversion drops gate_proj, up_proj and down_proj from
// target_modules on DeepSeek models (it maps those names to the routed experts), so its
// all-linear leaves the dense blocks' and shared experts' feed-forward unadapted, and so
// does forge's (lora_modules_for_model). Named explicitly, gate_proj, up_proj and down_proj
// mean the dense blocks and shared experts in forge, and that conversion maps them to the
// routed experts: such an adapter loads into PEFT on transformers 4 only (forge, its merged
// export and transformers 4 read it). The router's adapter is what PEFT 5 makes of
// target_parameters ["gate.weight"] (a ParamWrapper on a 2-D parameter: B A added to the
// weight, PEFT's lora.Linear function), which takes no dropout; nor do the experts'
// (PEFT's ParamWrapper raises on lora_dropout > 0), so lora.dropout > 0 is refused with
// either. MLA's rotary rows (the queries' and kv_a's last qk_rope_head_dim rows) are
// reordered at import (NOTE [Multi-head Latent Attention]); an adapter's B rows are
// reordered alike when a PEFT adapter is read or written (LoraPart::rotary_rows). QLoRA on
// a MoE model quantizes the experts' stacks as well (NOTE [NF4 expert stacks] in
// model/nf4_base.h): their adapters add to the GEMMs on the dequantized stacks, as PEFT's
// ParamWrapper adds to transformers 5's unquantized 3-D parameters. With precision.fp8 the
// frozen base's GEMMs run in FP8, the routed experts' too, the adapters (the experts' among
// them) in the compute dtype (NOTE [FP8 frozen routed experts] in ops/moe_fp8.h); under
// expert parallelism, NOTE [LoRA under expert parallelism].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/expert_shard.h"
#include "model/lora_config.h"
#include "model/parameters.h"
#include "ops/lora.h"
#include "ops/lora_experts.h"

namespace forge {

// One adapted module inside a projection: its Hugging Face name without ".weight"
// ("model.layers.3.self_attn.q_proj") and its output rows.
struct LoraPart {
  std::string module;     // q_proj, ...
  std::string hf_prefix;
  int64_t row_begin = 0, row_end = 0;
  // Another prefix a PEFT adapter may name it by: transformers 5's in-memory name of
  // Mixtral's router, model.layers.N.mlp.gate (ParamSpec::hf_alias); empty: none.
  std::string hf_alias_prefix = {};
  // Rows of the Hugging Face tensor in DeepSeek's interleaved rotary order, which B's
  // rows follow in a PEFT adapter (HfTensor::rotary_rows).
  HfRotaryRows rotary_rows = {};
};

// One adapted projection of a block.
struct LoraTarget {
  int layer = 0;
  size_t param = 0;       // its entry in the block's weights (NOTE [Block weights])
  std::string name;       // forge's parameter name, e.g. layers.3.attention.qkv.weight
  int64_t in = 0, out = 0;
  std::vector<LoraPart> parts;
  // A stack of routed experts' matrices [experts, out, in] (one part; NOTE [LoRA on routed
  // experts] in ops/lora_experts.h): a [experts * rank, in], b [experts * out, rank]. 0: a
  // 2-D projection.
  int64_t experts = 0;
  // Its rank is lora.rank times this (its alpha too, so the scale stays alpha / rank): 2 for
  // the experts' gate_up_proj under all-linear on a MoE model, as PEFT 0.21's rank_pattern
  // and alpha_pattern {".*\\.gate_up_proj": 2 r, 2 alpha} (NOTE [LoRA on routed experts]).
  int64_t rank_multiple = 1;
};

// The projections `modules` (lora_target_modules) adapt, in parameter order.
std::vector<LoraTarget> lora_targets(const ModelConfig& config, const std::vector<std::string>& modules);

// The targets of a run's lora settings: lora_targets of lora_modules_for_model, with PEFT's
// doubled rank on the experts' gate_up_proj under all-linear (LoraTarget::rank_multiple).
std::vector<LoraTarget> lora_targets(const ModelConfig& config, const LoraConfig& lora);

// The module names this model has a projection of (what lora_targets can adapt).
std::vector<std::string> lora_model_modules(const ModelConfig& config);

// lora_target_modules(target_modules) for this model: all-linear on a Mixture-of-Experts
// model as PEFT 0.21 on transformers 5 reads it, attention's projections, the router and
// the routed experts, without gate_proj, up_proj and down_proj (NOTE [LoRA on MoE and MLA
// models]).
std::vector<std::string> lora_modules_for_model(const ModelConfig& config, const std::string& target_modules,
                                                const KeyDescriber& keys = {});

// Throws, naming the lora.* key, where the settings do not fit the model (NOTE [LoRA on
// MoE and MLA models]): the router or the routed experts named on a model without them or
// adapted with dropout.
void check_lora_for_model(const ModelConfig& config, const LoraConfig& lora, const KeyDescriber& keys = {});

// What LoRA adds to a model, in values: the adapters as stored (masters(), b's zeros
// included), what PEFT counts as trainable, and the workspace for `tokens` tokens (under
// expert parallelism of degree `expert_parallel` the routed experts' share is that many
// times a rank's rows: NOTE [LoRA under expert parallelism]).
struct LoraSizes {
  int64_t stored = 0, trainable = 0, workspace = 0;
  // Of trainable, the values one token's GEMMs run through: a routed expert's adapters
  // count only for the top-k experts a token goes to (k / experts of them).
  double active_trainable = 0.0;
};
LoraSizes lora_sizes(const ModelConfig& config, const LoraConfig& lora, int64_t tokens, int64_t expert_parallel = 1);

// NOTE [LoRA FLOPs]
// The work of one trained token under LoRA, as the PEFT peer counts it (shared/PERF.md):
// the frozen weights (every projection and the head, not the input embedding; of a MoE
// block's routed experts the active ones, as ModelConfig::active_params counts them) do a
// forward and an input-gradient GEMM, 4 FLOPs per parameter, and no weight gradient; the
// adapters do all three, 6 per trainable parameter; attention does its forward and
// backward as in full training (ModelConfig::flops_per_token's attention term: 6 x layers
// x hidden x seq, MLA's width instead of hidden). The routed experts' adapters count as the
// frozen experts do, for the token's top-k experts only (LoraSizes::active_trainable). Full
// training's count (ModelConfig::flops_per_token, 6 per parameter) would credit a LoRA run
// with a third more work than it does. Without LoRA this is ModelConfig::flops_per_token.
double training_flops_per_token(const ModelConfig& config, const LoraConfig& lora, int64_t seq_len);

// PEFT's name of a part's A or B: base_model.model.<hf_prefix>.lora_A.weight.
std::string peft_tensor_name(const LoraPart& part, char matrix);

class LoraAdapters : public ParamSource, public GradSink {
 public:
  // `tokens`: the most tokens one linear call sees (micro_batch × seq_len), for the
  // workspace. Compute dtype: bf16 on CUDA, fp32 on the CPU. `shard`: this rank's place in
  // its tensor-parallel group, whose base weights are its shards (NOTE [LoRA under context
  // and tensor parallelism]); the masters stay whole.
  LoraAdapters(const ModelConfig& config, const LoraConfig& lora, Device device, int64_t tokens,
               TensorParallelShard shard = {});

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
  // Values of the workspaces (the 2-D adapters' and the routed experts'): what
  // lora_sizes(..).workspace estimates.
  int64_t workspace_values() const;
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
  // As a gradient sink: the next gradients are written over the buffers (under expert
  // parallelism the other ranks' experts' adapter gradients are zeroed here, once per step).
  void discard();
  // Expert parallelism (NOTE [LoRA under expert parallelism]): this rank is `index` of
  // `degree` ranks that split the routed experts; the experts' adapters handed to the MoE
  // blocks are its local experts' slices. Once, before the first step.
  void set_expert_parallel(int64_t index, int64_t degree);
  // Under tensor parallelism, after the step's backward: each split matrix's gradient, which
  // the linear ops wrote to the rank's shard, at its places in gradients() with zeros
  // elsewhere, so that the sum over the tensor-parallel group is the whole gradient (NOTE
  // [LoRA under context and tensor parallelism]). Nothing without tensor parallelism.
  void spread_shard_gradients();
  // After the step's backward: zeros for the gradients of the adapters whose layers were
  // not written since discard() (under pipeline parallelism, the other ranks' stages'), so
  // that the sum over the pipeline group is the whole gradient (NOTE [LoRA under pipeline
  // parallelism]). Call before spread_shard_gradients.
  void zero_unwritten_gradients();
  // Dropout on (training) or off (evaluation, as PEFT's model.eval()).
  void set_training(bool training);

  // Whether the base's Hugging Face weights keep DeepSeek's rotary rows interleaved
  // (HfWeightLayout::interleaved_rotary; true unless rope_interleave is false), which a PEFT
  // adapter's B rows then follow (LoraPart::rotary_rows).
  bool interleaved_rotary() const { return interleaved_rotary_; }
  void set_interleaved_rotary(bool interleaved) { interleaved_rotary_ = interleaved; }

  // A part's A [rank, in] or B [rows, rank] on the host, fp32; and the reverse.
  Tensor part_matrix(size_t target, size_t part, char matrix) const;
  void set_part_matrix(size_t target, size_t part, char matrix, const Tensor& values);
  // weight += scale * b a for each target: the merged weights (fp32 host parameters). The
  // targets `params` does not hold (a pipeline rank's other stages') are left out; a split
  // target whose weight in `params` is this tensor-parallel rank's shard gets its shard of b a.
  void merge_into(FlatParameters& params) const;
  // weight += scale * b a for the one parameter `name` (fp32 on the host, whole: the
  // unsplit case), when it is a target (nothing otherwise). For an expert stack `experts`
  // says which experts `weight` holds: [E / size, out, in], shard `index`'s slice (NOTE
  // [QLoRA under pipeline and expert parallelism]); {0, 1}: the whole stack.
  void merge_into(const std::string& name, const Tensor& weight, ExpertShard experts = {}) const;

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
  // merge_into's step for targets_[k]: w += scale b a, a and b the masters on the host (a
  // split one's shards when w is a shard of W); an expert stack's `experts` experts alone.
  void merge_target(size_t k, const Tensor& w, const Tensor& a, const Tensor& b, ExpertShard experts) const;
  // A matrix that tensor parallelism splits: the rank's shard of its compute copy and of
  // its gradient, and where they are in the whole: B's rows (runs of rows, shard row, whole
  // row, count) of a column-parallel projection, A's columns of a row-parallel one.
  struct ShardedMatrix {
    size_t target = 0;
    Tensor whole_compute, whole_grad, compute, grad;
    char matrix = 'a';
    std::vector<ShardRun> rows;
    int64_t column_begin = 0, columns = 0;
  };
  ParamSource& base();
  Tensor& master_of(size_t target, char matrix);
  // Under tensor parallelism: the split matrices' shard buffers, which the adapters then use.
  void split_over_tensor_parallel_ranks(const std::vector<ParamSpec>& specs, DType compute);
  // Copies a split matrix's shard out of the whole (take) or into it.
  static void move_shard(const ShardedMatrix& s, const Tensor& shard, const Tensor& whole, bool take);

  ModelConfig config_;
  LoraConfig lora_;
  Device device_;
  std::vector<LoraTarget> targets_;
  std::vector<std::vector<int>> target_of_;  // per layer, per block entry: target index or -1
  Tensor master_flat_, grad_flat_, compute_flat_;
  std::vector<Tensor> masters_, grads_;
  std::vector<LoraAdapter> adapters_;
  LoraWorkspace workspace_;
  // Per target, the routed experts' adapters (LoraTarget::experts > 0; unused otherwise), and
  // their scratch.
  std::vector<LoraExpertAdapter> expert_adapters_;
  LoraExpertWorkspace expert_workspace_;
  int64_t expert_rows_ = 0;                     // the workspace's rows (one rank's, before expert parallelism)
  int64_t expert_index_ = 0, expert_degree_ = 1;  // NOTE [LoRA under expert parallelism]
  ParamSource* base_ = nullptr;
  std::vector<BlockWeights> layers_, grad_layers_;
  Tensor norm_scratch_, no_gradient_;
  Tensor vector_scratch_;  // the widest vector parameter's; norm_scratch_ is its first hidden_size
  LinearWeight frozen_output_;
  std::vector<char> fresh_;
  bool interleaved_rotary_ = true;
  TensorParallelShard shard_;
  std::vector<ShardedMatrix> sharded_;
  Tensor shard_compute_flat_, shard_grad_flat_;
};

}  // namespace forge
