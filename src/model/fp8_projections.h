// FP8 training of a decoder's projections (precision.fp8): the ParamSource and GradSink
// that hand the decoder its weights and gradient buffers with FP8 settings attached.
//
// NOTE [FP8 projections]
// Where the per-layer FP8 state lives. Fp8Projections wraps the run's own ParamSource and
// GradSink (the flat parameters, or the bf16 compute copy and the fp32 gradients on CUDA):
// layer(i) and layer_grads(i) hand out the base block's descriptors with `fp8` set on
// every projection of the block (qkv, o, gate_up, down: the entries that are matrices,
// NOTE [Block weights]; MLA's projections, NOTE [FP8 latent attention] in
// model/latent_attention.h; a MoE block's shared experts, and its routed experts' stacks
// with a statistics block per expert, NOTE [FP8 routed experts] in ops/moe_fp8.h, unless
// precision.fp8_routed_experts is false, NOTE [FP8 routed experts switch]; but not its router), output() and output_grad() on the head only with
// precision.fp8_output_head; the embedding and the norm weights pass through untouched,
// as do the GradSink's done/fresh calls. With `tensorwise` scaling the state is the
// recipe's settings (the gradient format), on CUDA one scratch shared by every layer
// (NOTE [FP8 tensorwise linear] in ops/fp8_linear.h), and per projection the statistics
// of its last forward (NOTE [FP8 forward statistics]): one Fp8Linear per projection, whose
// weight and gradient descriptors point at the same one, with 1.5 KiB of device memory,
// made the first time a layer is handed out. Every projection also has a statistics block
// in one model-wide array (NOTE [FP8 projection statistics] in kernels/cpu/fp8_scaling.h),
// numbered in parameter order (the head last), where its casts fold the step's amaxes;
// `delayed` adds the amax histories, and its scales live in the same blocks. A pipeline
// rank, which is handed its stages' layers alone, keeps the whole model's array too: its
// stages' blocks see its casts, the others none until the trainer's step end reduces the
// arrays over the pipeline (NOTE [FP8 under context and pipeline parallelism] in
// train/trainer_fp8.cpp).
//
// NOTE [FP8 routed experts switch]
// precision.fp8_routed_experts (Fp8Settings::routed_experts, default true) chooses whether a
// MoE block's routed experts' stacks (gate_up and down of every routed expert) take the FP8
// path of NOTE [FP8 routed experts] in ops/moe_fp8.h. Why a choice: cuBLASLt 13.0 has no
// grouped FP8 GEMM on sm_90, so the FP8 experts run one GEMM per expert and matrix, while
// the compute dtype runs them grouped; with many small experts (DeepSeek-V2-Lite's 64 of
// width 1408) the launches and the small GEMMs cost more than FP8's rate gains (0.82x the
// BF16 run, docs/PERF.md), with few large ones (Mixtral's 8) FP8 wins (1.16x). torchtitan
// converts a MoE model's grouped experts to float8 only when its MoE module list names them;
// Transformer Engine and Megatron run them in FP8. The default keeps the experts in FP8 (the
// issue's "every block projection", and what runs faster on coarse experts).
// With false the stacks are not FP8 projections: layer() and layer_grads() hand them out
// without `fp8`, as the router, so moe_experts_forward / moe_experts_backward (ops/moe.h)
// run their compute-dtype path, grouped on CUDA, exactly as a run without precision.fp8
// does on the same rows; every other projection (attention and MLA's, the shared experts,
// the dense blocks' feed-forwards, the head with fp8_output_head) stays in FP8. The stacks
// then have no statistics blocks: the numbering (parameter order) skips them, and the
// statistics, histories, per-expert forward statistics, weight cache and grouped casts' row
// buffer hold none of theirs (fp8_scratch_bytes, fp8_weight_cache_bytes, and forge info's
// FP8 FLOP share, fp8_gemm_params). Under LoRA (NOTE [FP8 frozen base]) the frozen experts
// run in the compute dtype with their adapters likewise. Under FSDP's FP8 all-gather the
// stacks travel in the compute dtype with the router and the norms, the other projections as
// codes (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h). A delayed-scaling checkpoint
// records the setting (Fp8DelayedState::routed_experts; one without the record was saved
// with the experts in FP8): a state saved with the experts in FP8 restores under false, the
// experts' blocks dropped and every other projection's histories and scales kept as saved;
// a state saved with false is refused under true, naming the key, since its experts would
// quantize with no history and scale 1 once the delayed scales are in use (NOTE [FP8 step
// end] on why 1 is no starting scale).
//
// NOTE [FP8 step end]
// The trainer calls nonfinite_amax() once the step's micro-batches are done and counts a
// non-finite amax as a non-finite step (NOTE [Non-finite steps] in train/nonfinite.h),
// naming the projection and the tensor; then end_step(update): with `delayed` and a step
// that reached the optimizer, every history takes its seen amax and the scales are
// recomputed (TE's amax_and_scale_update), and from then on the projections quantize with
// them (NOTE [FP8 delayed scaling] in ops/fp8_linear.h); a skipped step drops its amaxes.
// The first step of a delayed run has no history yet and uses current scales, as
// `tensorwise` (Transformer Engine starts from scale 1 instead, which flushes the first
// step's small weights and gradients to zero). The histories and scales are saved in
// checkpoints (delayed_state / restore_delayed_state), so a resumed run quantizes as the
// uninterrupted one would.
//
// NOTE [FP8 frozen base]
// Under LoRA (lora.rank > 0; QLoRA's NF4 base too: NOTE [FP8 over an NF4 base] in model/nf4_base.cpp;
// Fp8Settings::frozen) the projections wrap the frozen base alone (set_base(weights)): LoraAdapters
// wraps them in turn and adds its adapters to the descriptors they hand out, and the gradient descriptors are
// LoraAdapters' (no base weight), so each projection runs its forward and its input
// gradient in FP8 (x, W and dy quantized as above) and no weight gradient, while the
// adapters run in the compute dtype (NOTE [Linear weight descriptor]). The CUDA scratch
// then needs no third code buffer (it holds dy's transpose for the weight gradient).
// The weights never change, so the weight cache is filled once for the run: end_step does
// not move the cache's clock (restore_delayed_state, which changes the scales, does). With
// `delayed` the cache is in use once the delayed scales are (from the end of the first
// step): a frozen W's amax is constant, so its delayed scale is constant from that first
// update on; a cached W folds no amax into its `seen`, its history then takes zeros, and
// TE's update keeps the previous scale for an amax of zero, the same value. Before that
// update W is cast in every micro-batch, so that the update that activates the scales has
// seen every W (an evaluation's amaxes are discarded and a skipped step's dropped, which
// would otherwise leave a W cached in them without an amax, and its scale 1).
// Over several data-parallel ranks the frozen base is FSDP's (NOTE [Frozen FSDP base]): the
// projections wrap the Fsdp, whose gathers hand out the bf16 weights, and each rank casts
// them as one device would (NOTE [FP8 under data parallelism] in train/trainer_fp8.cpp: the
// delayed amaxes max-reduced over the ranks at the step's end, a non-finite amax a step
// every rank skips or stops at). Under tensor parallelism the projections hold the rank's
// base shards: NOTE [FP8 under tensor parallelism]. Under ZeRO-3 a block's weights come in whichever of the
// rotating gather buffers is free; a cache entry is keyed by the weight's address, so a
// projection whose weight moved casts it again, and one whose weight came back to the
// cached address finds its own frozen values there.
//
// NOTE [FP8 under tensor parallelism]
// Under tensor parallelism (NOTE [Tensor parallelism] in model/tensor_parallel.h) a rank's
// projections hold weight shards, and each of a projection's three tensors is either the
// same on every rank of the group (gathered by sequence parallelism) or this rank's part of
// the tensor one device would quantize:
//   column-parallel qkv, gate/up (and the vocabulary-parallel head): x the gathered normed
//     rows (the same), W its rows (a shard), dy its output columns (a shard);
//   row-parallel o, down: x its input columns (its heads' attention output, its columns'
//     SwiGLU output: a shard), W its columns (a shard), dy the gathered dL/d(out) (the same).
// A tensorwise scale must be the one the whole tensor would get, as Transformer Engine's
// amax-reduction group holds the tensor-parallel ranks (Megatron-LM hands it one). So the
// current amax of every sharded role (sharded_roles, from the parameter's split) is
// max-reduced over the group between its amax pass and its scale (Fp8Linear::amax_group:
// the TensorParallel interface the decoder is handed is an Fp8AmaxGroup, implemented over
// the process group by distributed/; model/ and ops/ call no collective). The roles that
// are the same on every rank have equal amaxes already and are not reduced. Every rank then
// quantizes with one device's scales, its codes are one device's at its places, and the
// GEMMs are one device's up to the order of summation (the row-parallel partial sums are
// added over the ranks). On CUDA that is one all-reduce of one float per sharded tensor
// cast: x and W of o and down, W of qkv and gate/up in the forward, dy of qkv and gate/up
// in the backward (which takes x's and W's scales from the forward, NOTE [FP8 forward
// statistics]), fewer once the weight cache holds a step's W: 8 per layer and micro-batch
// (6 more for a recomputed forward), each a few microseconds of latency. Each rank folds its own amax into its
// `seen` before the reduction, so a NaN of its shard is recorded whatever the collective
// does with a NaN. delayed: the scales come from the histories, and the trainer
// max-reduces the step's statistics over the tensor-parallel group as it does over the
// data-parallel and pipeline ranks (NOTE [FP8 under data parallelism], train/trainer_fp8.cpp):
// a shard role's `seen` on a rank is its shard's amax, the maximum over the group the whole
// tensor's, so the histories and scales are one device's and the same on every rank (rank
// 0's checkpoint holds them); its first step, at current scales, reduces as tensorwise. A
// non-finite amax is a step every rank of the group skips or stops at (the ranks that saw
// one are counted over the group with the stop flag, and the first is named over it).
// Two things change in the blocks (SequenceParallelEdges, model/sequence_parallel.h):
//  - RMSNorm's fused FP8 epilogue (NOTE [FP8 fused producers] in ops/fp8_linear.h) would
//    see the rank's rows while qkv and gate/up read the gathered rows: under tensor
//    parallelism the norm gets no consumer (norm_consumer), the bf16 rows are gathered and
//    the projection casts them itself (one more read of its x, as without fusion).
//    Gathering FP8 codes instead (TE's FP8 all-gather of sequence-parallel inputs, half the
//    bytes) would need the scale agreed before the gather; not built. SwiGLU's producers
//    stay: its forward output is down's whole x on this rank and its backward output
//    gate/up's dy, whose amaxes are reduced before their scales like any other.
//  - The row-parallel projection's forward without FP8 runs three GEMMs (the rows before
//    the rank's, the rank's rows with the residual, the rows after); in FP8 each would
//    quantize its rows with their own amax, so it runs one GEMM over every row, x quantized
//    whole, and adds the residual to the rank's rows before the reduce-scatter.
// LoRA's frozen base (NOTE [FP8 frozen base]) takes the group the same way: the frozen
// projections wrap the rank's base shards (the flat compute weights, or the frozen FSDP
// base's gathers), LoraAdapters wraps them with its adapters' shards (NOTE [LoRA under
// context and tensor parallelism] in model/lora.h), and each rank runs the forward and the
// input gradient of its shard in FP8 with the sharded roles' amaxes max-reduced as above
// (no weight gradient, so a column-parallel dy is quantized once, for dx); the adapters
// run in the compute dtype. A frozen shard's amax is the same every step, and reduced over
// the group it is the whole weight's: the weight scales, and with `delayed` the W
// histories, are one device's exactly; the step-end reduction is full training's. The
// weight cache holds the rank's shards, filled once as on one device.
// FSDP's FP8 all-gather (NOTE [FP8 all-gather] in distributed/fsdp.h) gathers each rank's
// shard as E4M3 codes cast with the whole weight's scale: its gathers max-reduce their
// weight amaxes over the shard group and then over the tensor-parallel ranks, so the
// codes are the ones this rank's cast of its gathered bf16 shard writes here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/fp8_delayed_state.h"
#include "model/parameters.h"
#include "model/tensor_parallel.h"
#include "ops/fp8_linear.h"
#include "ops/moe_fp8.h"

namespace forge {

enum class Fp8Recipe : uint8_t { Tensorwise, Delayed };

struct Fp8Settings {
  Fp8Format grad_format = Fp8Format::E5M2;
  bool output_head = false;  // the head's GEMMs in FP8 as well
  // A MoE block's routed experts' stacks in FP8 (precision.fp8_routed_experts, NOTE [FP8
  // routed experts switch]); false keeps them in the compute dtype (the grouped bf16 GEMMs).
  bool routed_experts = true;
  Fp8Recipe recipe = Fp8Recipe::Tensorwise;
  // The weight gradients' GEMMs in FP8 (precision.fp8_weight_gradient, NOTE [FP8 weight
  // gradient switch] in ops/fp8_linear.h); false runs them in the compute dtype.
  bool weight_gradient = true;
  // CUDA: each projection's W and W^T codes cast once per optimizer step (NOTE [FP8 weight
  // cache] in ops/fp8_linear.h), 2 bytes per FP8 weight.
  bool weight_cache = false;
  // LoRA's frozen base (NOTE [FP8 frozen base]): no weight gradients, weights cast once.
  bool frozen = false;
  // CUDA: the kernels producing a projection's x and dy do its amax pass or cast (NOTE
  // [FP8 fused producers] in ops/fp8_linear.h); off only to compare against (same bits).
  bool fused_producers = true;
  // delayed: TE DelayedScaling's amax_history_len, amax_compute_algo and margin.
  int64_t amax_history_length = 1024;
  cpu::Fp8AmaxAlgorithm amax_algorithm = cpu::Fp8AmaxAlgorithm::Max;
  float margin = 0.0f;
  // precision.fp8_filter_fqns (NOTE [FP8 filter]): a block projection or routed-expert stack
  // whose parameter name contains one of these strings stays in the compute dtype.
  std::vector<std::string> filter_fqns;
  // parallelism.expert_parallel_degree: a local routed expert may receive that many times
  // a micro-batch's rows (NOTE [FP8 routed experts under expert parallelism] in
  // ops/moe_fp8.h), which the CUDA scratch holds.
  int64_t expert_parallel = 1;
};

// Whether the projections run FP8 weight-gradient GEMMs (and so need dy^T's code buffer): not
// over a frozen base, nor with precision.fp8_weight_gradient false (NOTE [FP8 weight
// gradient switch] in ops/fp8_linear.h).
inline bool fp8_weight_gradients(const Fp8Settings& settings) {
  return !settings.frozen && settings.weight_gradient;
}

// A Mixture-of-Experts block's router, which stays in the compute dtype (NOTE [FP8 routed
// experts] in ops/moe_fp8.h); MoeFeedForward names it so.
inline bool fp8_moe_router(const ParamSpec& spec) { return spec.name.ends_with(".moe.router.weight"); }
// NOTE [FP8 filter]
// precision.fp8_filter_fqns is torchtitan's float8.filter_fqns: a comma-separated list of
// strings, and a block projection (or a routed-expert stack) whose forge parameter name
// ("layers.0.attention.qkv.weight", "layers.31.mlp.down.weight", ...) contains any of them
// keeps its three GEMMs in the compute dtype, with no statistics block, no history and no
// cached codes, as a MoE router does. Megatron-LM's --first-last-layers-bf16 with one layer
// at each end is "layers.0.,layers.31." on a 32-layer model (the trailing dot keeps
// "layers.1." from matching layers 10-19). The filter is part of the run's FP8 layout: a
// delayed run's checkpoint records it, and a resume under another filter keeps the
// histories of the projections both runs train in FP8 (by name) and refuses one whose
// projection had none. The configuration check refuses a string that matches no FP8
// projection of the model. Under FSDP's FP8 all-gather a filtered projection travels in the
// compute dtype with the norms (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h).
bool fp8_filtered(const std::string& name, const Fp8Settings& settings);
// precision.fp8_filter_fqns's strings: split at commas, blanks around each trimmed; empty
// text gives none (an empty string between commas is kept, for the configuration check to
// refuse).
std::vector<std::string> fp8_filter_fqns_of(const std::string& text);
// The block projections and routed-expert stacks `settings` would train in FP8 without its
// filter: what precision.fp8_filter_fqns may name.
std::vector<ParamSpec> fp8_filter_candidates(const ModelConfig& config, const Fp8Settings& settings);
// "precision.fp8_filter_fqns 'layers.0.,mlp.down' keeps 7 of the 16 block projections in the
// compute dtype: layers.0.attention.qkv.weight, ..." (forge info, the training log).
std::string describe_fp8_filter(const ModelConfig& config, const Fp8Settings& settings);

// A block's matrix that may run in FP8: any other than a MoE router (whatever the filter).
inline bool fp8_block_matrix(const ParamSpec& spec) {
  return spec.layer >= 0 && spec.shape.size() == 2 && !fp8_moe_router(spec);
}
// Whether a parameter is a projection trained in FP8 (NOTE [FP8 projections]): a block's
// matrix other than a MoE router, unless the filter keeps it in the compute dtype (NOTE [FP8
// filter]); the head is one only with output_head.
inline bool fp8_block_projection(const ParamSpec& spec, const Fp8Settings& settings) {
  return fp8_block_matrix(spec) && !fp8_filtered(spec.name, settings);
}
// Whether a parameter is a stack of routed experts' matrices [E, out, in] trained in FP8,
// one projection (and statistics block) per expert (NOTE [FP8 routed experts]); none with
// settings.routed_experts false (NOTE [FP8 routed experts switch]), nor a filtered one.
inline bool fp8_expert_stack(const ParamSpec& spec, const Fp8Settings& settings) {
  return settings.routed_experts && spec.layer >= 0 && spec.expert_stack && spec.shape.size() == 3 &&
         !fp8_filtered(spec.name, settings);
}
// The names of the statistics blocks in Fp8Projections' numbering (NOTE [FP8 projections]):
// each FP8 block projection's parameter name, "<stack> (expert e)" for each expert of an FP8
// routed-expert stack, and the head's (output.weight, or embedding.weight when tied) with
// output_head.
std::vector<std::string> fp8_projection_names(const ModelConfig& config, const Fp8Settings& settings);

// Number of projections trained in FP8 (each has a statistics block; an expert stack one
// per expert).
int64_t fp8_projection_count(const ModelConfig& config, const Fp8Settings& settings);

// Bytes one code buffer of the CUDA scratch needs: max over the FP8 projections of
// tokens x in, tokens x out and out x in; for a routed expert the tokens are the most rows
// one expert can receive (the micro-batch's tokens, or the capacity with padding to it;
// settings.expert_parallel times that under expert parallelism), rounded up to a multiple
// of 16 (NOTE [FP8 padded token contraction] in ops/fp8_linear.h).
int64_t fp8_workspace_codes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens);

// Parameters of the matrices whose GEMMs run in FP8 per token (the block projections, of
// the routed experts the k of E each token runs through, and the head with output_head):
// 6 x this is their share of the FLOPs per token (forge info), 4 x under LoRA (no weight
// gradient) or without FP8 weight gradients (precision.fp8_weight_gradient false).
int64_t fp8_gemm_params(const ModelConfig& config, const Fp8Settings& settings);

// Every byte of the CUDA scratch Fp8Projections allocates (Fp8LinearWorkspace): three code
// buffers of fp8_workspace_codes bytes (two for a frozen base or without FP8 weight
// gradients), the shared statistics and every projection's forward statistics
// (kFp8WorkspaceStats floats each; a routed expert stack's for each of the rank's local
// experts too), the grouped casts' row codes (fp8_expert_row_codes), the statistics
// blocks and, with `delayed`, the amax histories. The memory estimate counts this (model/memory_estimate.h);
// the CPU path allocates only the blocks and histories.
int64_t fp8_scratch_bytes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens);
// The CUDA weight cache's bytes (NOTE [FP8 weight cache]): 2 per FP8 weight, of the routed
// experts those of a rank's E / settings.expert_parallel local experts (NOTE [FP8 expert
// stack state] in ops/moe_fp8.h), 0 without it.
int64_t fp8_weight_cache_bytes(const ModelConfig& config, const Fp8Settings& settings);
// Bytes of the CUDA buffer the grouped casts write every local expert's rows' codes into
// (NOTE [FP8 grouped expert casts] in kernels/cuda/fp8_grouped_cast.cu): the most permuted
// rows a rank's experts receive (tokens x k, or E x capacity padded to capacity; times
// settings.expert_parallel under expert parallelism) times the widest expert input; 0
// without routed experts. Part of fp8_scratch_bytes.
int64_t fp8_expert_row_codes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens);

class Fp8Projections : public ParamSource, public GradSink {
 public:
  // `tokens`: the most tokens one linear call sees (micro_batch × seq_len), for the CUDA
  // scratch (none is allocated on the CPU).
  Fp8Projections(const ModelConfig& config, const Fp8Settings& settings, Device device, int64_t tokens);
  Fp8Projections(const Fp8Projections&) = delete;
  Fp8Projections& operator=(const Fp8Projections&) = delete;

  // What the FP8 settings are attached to; both must outlive this object's use.
  void set_base(ParamSource& weights, GradSink& gradients);
  // A frozen base (Fp8Settings::frozen, NOTE [FP8 frozen base]): weights only, no gradients.
  void set_base(ParamSource& weights);
  // NOTE [FP8 under tensor parallelism]: the base holds this rank's tensor-parallel shards,
  // and the current amaxes of what differs between the group's ranks are max-reduced over
  // `group` (which must outlive this object's use); the weight cache holds the shards.
  // Before any layer is handed out.
  void set_tensor_parallel_group(TensorParallel& group);

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

  // NOTE [FP8 step end]. The first non-finite amax since the last end_step, in parameter
  // order: its slot (projection x kFp8Roles + role) and value; slot -1 when all were finite.
  struct NonfiniteAmax {
    int64_t slot = -1;
    float amax = 0.0f;
  };
  NonfiniteAmax first_nonfinite_amax() const;
  // That amax named: "'layers.3.mlp.down.weight' output gradient dy: amax nan".
  std::string describe(const NonfiniteAmax& found) const;
  // "" when every amax since the last end_step was finite, else the first one described.
  std::string nonfinite_amax() const;
  // Every projection's statistics block (NOTE [FP8 projection statistics] in
  // kernels/cpu/fp8_scaling.h) on the run's device: under data, context and pipeline
  // parallelism the trainer max-reduces it over the ranks before a delayed end_step (NOTE
  // [FP8 under data parallelism], NOTE [FP8 under context and pipeline parallelism] in
  // train/trainer_fp8.cpp).
  const Tensor& statistics() const { return stats_; }
  bool delayed() const { return settings_.recipe == Fp8Recipe::Delayed; }
  // Whether the projections quantize with their delayed scales now (from the end of a
  // delayed run's first step), and the clock that moves whenever the weights or those
  // scales change (NOTE [FP8 weight cache]): FSDP's FP8 all-gather casts with them.
  bool delayed_active() const { return delayed_active_; }
  uint64_t weight_generation() const { return generation_; }
  // The statistics block of the projection whose weight is `name` (in parameter order), or -1.
  int64_t projection_index(const std::string& name) const;
  void end_step(bool update);
  // Drops the amaxes recorded since the last end_step (an evaluation's forwards, which must
  // not reach a delayed history).
  void discard_amaxes();
  // Delayed scaling's state for checkpoints; restore checks it against this model.
  Fp8DelayedState delayed_state() const;
  void restore_delayed_state(const Fp8DelayedState& state);
  bool layer_grads_fresh(int index) const override { return gradients().layer_grads_fresh(index); }
  bool head_grads_fresh() const override { return gradients().head_grads_fresh(); }
  bool embedding_grad_fresh() const override { return gradients().embedding_grad_fresh(); }

 private:
  ParamSource& weights() const;
  GradSink& gradients() const;
  const BlockWeights& with_fp8(const BlockWeights& base, int index, std::vector<BlockWeights>& out);
  const LinearWeight& head(const LinearWeight& base, LinearWeight& out);
  void set_delayed_active(bool active);
  // A checkpoint's state in this run's numbering (NOTE [FP8 routed experts switch], NOTE
  // [FP8 filter]).
  Fp8DelayedState saved_as_this_run(const Fp8DelayedState& saved) const;
  // Whether weight caches are used now (NOTE [FP8 frozen base]: a frozen W is cached with
  // its delayed scale only), for the projections' and the expert stacks' alike; the cache a
  // projection uses now, or null.
  bool caches_usable() const;
  Fp8WeightCache* cache_in_use(Fp8WeightCache& cache) const;

  // The FP8 descriptors of one layer's (or the head's) projections, by parameter index.
  struct Projections {
    Tensor stats;                           // CUDA: kFp8WorkspaceStats floats per parameter
    std::vector<Fp8ForwardStats> forward;   // sized once: Fp8Linears point into it
    std::vector<Fp8WeightCache> caches;     // likewise (NOTE [FP8 weight cache])
    std::vector<Fp8Produced> produced;      // likewise (NOTE [FP8 fused producers])
    std::vector<Fp8ExpertStack> experts;    // likewise, made for expert stacks (NOTE [FP8 expert stack state])
    std::vector<Fp8Linear> linears;
  };
  Projections& projections(std::vector<Projections>& all, size_t index, size_t params);

  ModelConfig config_;
  Fp8Settings settings_;
  Device device_;
  std::vector<std::vector<int64_t>> projection_of_;  // [layer][parameter]: (first) block number or -1
  std::vector<std::vector<bool>> expert_stack_;      // [layer][parameter]: E blocks, one per expert
  std::vector<std::string> names_;                   // per block: its parameter's name
  std::vector<int64_t> numels_;                      // per block: its weight's elements
  std::vector<uint8_t> sharded_roles_;               // per block: the roles that differ between tensor-parallel ranks
  TensorParallel* tensor_parallel_ = nullptr;        // NOTE [FP8 under tensor parallelism]
  Tensor stats_, history_;                           // every block; delayed's histories
  bool delayed_active_ = false;
  uint64_t generation_ = 0;  // optimizer steps ended: the weight cache's clock
  // The routed experts' caches' clock: generation_'s, and under a frozen base with `delayed`
  // each update's too (NOTE [FP8 frozen routed experts]).
  uint64_t expert_generation_ = 0;
  Fp8LinearWorkspace workspace_;
  Tensor expert_row_codes_;  // CUDA: NOTE [FP8 grouped expert casts], shared by every expert stack
  Fp8Linear fp8_;
  std::vector<Projections> layer_projections_, head_projections_;
  ParamSource* weights_ = nullptr;
  GradSink* gradients_ = nullptr;
  std::vector<BlockWeights> layers_, grad_layers_;
  LinearWeight output_, output_grad_;
};

}  // namespace forge
