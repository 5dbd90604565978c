// FSDP: the model's parameters, gradients and optimizer state sharded across the
// data-parallel ranks (ZeRO-1, -2 or -3), behind the ParamSource / GradSink interfaces the
// decoder already computes through. The model never sees a collective.
//
// NOTE [FSDP]
// Every rank owns one chunk of every unit (NOTE [FSDP layout]): the fp32 master weights,
// the fp32 gradient and (kept by the trainer's AdamW over this rank's segments) the
// optimizer state of that chunk. What else exists in full depends on the ZeRO stage:
//   ZeRO-1  full bf16 compute weights and full fp32 gradients on every rank; each unit's
//           gradients are reduce-scattered once per step, on the last micro-batch, as
//           soon as the unit's backward is done.
//   ZeRO-2  full bf16 compute weights; a unit's gradients go to one of two rotating
//           full-size buffers and are reduce-scattered after every micro-batch's backward
//           of that unit, the result added to the fp32 gradient chunk. The head's are done
//           first (head_done), then each block's (layer_done), the embedding's last
//           (embedding_done): two buffers keep one reduction in flight behind the unit
//           being computed.
//   ZeRO-3  as ZeRO-2, and the bf16 weights of a block exist in full only around its use:
//           three rotating block buffers; asking for block i (ParamSource::layer) waits
//           for its all-gather and starts those of blocks i - 1 and i + 1 if they are not
//           there, so the forward pass prefetches one block ahead, the backward pass one
//           block behind, and the turn from forward to backward (and from one
//           micro-batch to the next) finds its blocks gathered. A buffer is reused only
//           after the compute stream has passed its last use. A gather casts this rank's
//           fp32 master chunk into its place in the buffer and all-gathers in place, so
//           no bf16 copy of the chunk is kept between uses.
// The embedding and head units keep their bf16 weights in full in every stage (they are
// used at both ends of a micro-batch, so sharding them would gather them twice per
// micro-batch); only the tied embedding of a model whose output projection is the
// embedding keeps full-size gradients across the whole step in ZeRO-2/3 (both ends of the
// backward write it), reduced once on the last micro-batch.
// Collectives run on one communication stream, ordered against the compute stream (the
// default stream the kernels use) by events (NOTE [Streams and events]): a gather waits
// for the compute stream to be done with the buffer it overwrites, the compute stream
// waits for the gather before using the block, a reduce-scatter waits for the unit's
// backward, and a gradient buffer is reused after its reduce-scatter, written over by the
// next unit's backward (NOTE [Fresh gradient buffers]; only its padding is zeroed). Gradients
// are summed, not averaged: the loss is already divided by the global batch's target count
// (NOTE [Loss normalization]). With fsdp reduce dtype bf16 the gradients are rounded to
// bf16 before the reduce-scatter (half the traffic) and added to the fp32 chunk after it.
// The first reduction of a unit in a step (fp32) writes the zeroed chunk directly; later
// ones go through a chunk-sized buffer allocated on first use (so one micro-batch per step
// in fp32 needs none).
// Hybrid sharding: with a replicate group, a chunk reduce-scattered within the shard group
// is then all-reduced across the replicas, which hold the same chunk.
// After the optimizer updated the fp32 chunk and wrote its bf16 copy where one is kept
// (compute_segments), refresh_compute_weights() all-gathers the compute weights that are
// kept in full (every unit in ZeRO-1/2, the embedding and head in ZeRO-3) on the
// communication stream, each unit awaited by the compute stream only at its first use, and
// forgets the gathered blocks of ZeRO-3.
// On the CPU the compute weights are fp32 and every collective is synchronous.
// Pipeline ranks (FsdpOptions::pipeline_stages, NOTE [Pipeline parallelism] in
// model/pipeline.h): FSDP shards a pipeline rank's stages' parameters over its
// data-parallel ranks (the ranks of a shard group hold the same stages); the units of other
// stages are empty (NOTE [FSDP layout]) and skipped by every buffer and collective, and
// asking for their weights or gradients fails. The PipelineModel runs a whole step's
// micro-batches in one call, interleaving forwards and backwards, and never calls
// begin_micro_batch / end_micro_batch. Under ZeRO-1 nothing is reduced in layer_done /
// head_done / embedding_done; instead, after the schedule, reduce_gradients()
// reduce-scatters every unit the step wrote, once, exactly as ZeRO-1's last-micro-batch
// reduction (same reduce dtype, hybrid all-reduce), and finish_gradients() waits for it
// (and fails if it was never called). The full fp32 gradients are fresh per unit from
// begin_step() until the unit's first *_done of the step (NOTE [Fresh gradient buffers]):
// the schedule's backwards of a unit come micro-batch after micro-batch, the first writing
// over the buffer, the others adding. ZeRO-2 and -3: NOTE [ZeRO-2 and -3 under pipeline
// parallelism]. The FP8 all-gather (NOTE [FP8 all-gather]) gathers the stages' blocks alone,
// into ZeRO-3's slots (as many as the stages hold blocks, where that is fewer) or one slot per
// held block under ZeRO-1/2, the same codes in the same order on every rank of a shard
// group. Expert parallelism works as without them: the stages' expert stacks are cut into expert parts
// over the stage's shard ranks that hold the same experts (NOTE [Expert parallelism under
// pipeline parallelism] in model/pipeline.h). A frozen base (NOTE [Frozen FSDP base]) over
// a pipeline rank's stages under ZeRO-1 (and -2) holds the stages' units in full, nothing
// reduced (reduce_gradients does nothing); under ZeRO-3 its blocks are gathered per use as
// below, its expert parts over their groups.
//
// NOTE [ZeRO-2 and -3 under pipeline parallelism]
// What torchtitan's FSDP2 does under its pipeline schedules: every unit of a rank's stages
// is handled per use exactly as without pipelining, since a stage's forward or backward of
// one micro-batch asks for its blocks in order (forward: first to last; backward: last to
// first) and finishes each block's gradients (layer_done) before asking for the next one's,
// whichever micro-batch or chunk the schedule runs next. ZeRO-2: each backward of a unit
// writes a fresh rotating gradient slot and reduce-scatters it at its *_done into the fp32
// chunk (the first of the step directly, the others added), so no full-size gradient of the
// stages lives across the step; the step's sum over micro-batches is the chunk's, as ZeRO-1's
// reduction of the summed full gradients, up to fp32's order of addition. ZeRO-3: a block's
// bf16 weights are all-gathered into the three rotating slots (as many as the rank's stages
// hold blocks, where that is fewer: a slot per block then costs what ZeRO-1 holds) around
// each forward and backward (and recomputation) of it, the neighbours prefetched only when
// this rank's stages hold them (a chunk's first and last blocks gather on demand: the next block the
// rank uses is another chunk's, or the same chunk's of another micro-batch); the embedding
// and head stay in full. reduce_gradients() then finds nothing left and is a no-op kept for
// the same step protocol. The ranks of a shard group run the same schedule (NOTE
// [Pipeline parallelism] in model/pipeline.h), so they issue the same gathers and
// reductions in the same order. FP8 projections wrap the Fsdp as without pipelining (NOTE
// [FP8 under ZeRO-2 and -3 pipeline ranks] in train/trainer_fp8.cpp: the gradients added in
// plain ZeRO-3's order, which a delayed run's scales carry). A tied embedding (reduced once
// per step, on the last micro-batch, which a schedule does not mark) is ZeRO-1's alone;
// pipelining refuses it anyway (NOTE [Pipeline stages]).
//
// NOTE [Frozen FSDP base]
// A LoRA run's base is frozen (NOTE [LoRA training]): FsdpOptions::frozen keeps each
// rank's chunk in the compute dtype (bf16 on CUDA, fp32 on the CPU) in place of the fp32
// master, with no gradient chunk, no gradient buffers, no reduction channels and no
// optimizer state. The weights reach the model exactly as above: in ZeRO-3 the blocks are
// all-gathered around their use through the three rotating buffers (a gather copies the
// chunk into place, nothing to cast), the embedding and head are held in full; in ZeRO-1/2
// every unit is held in full. Nothing is ever reduced for the base, so replicas (hybrid
// sharding) simply hold identical chunks. The GradSink side is not used: the LoRA adapters
// are the model's gradient sink, replicated on every rank, and their gradients are summed
// over every data-parallel rank with all_reduce_sum once per step.
//
// NOTE [FP8 all-gather of the head]
// With precision.fp8_output_head the head's GEMMs run in FP8, and the FP8 all-gather sends its
// weight as codes too (FsdpOptions::fp8_output_head): the head unit (the final norm and the
// untied output.weight, a vocabulary-parallel rank's rows under tensor parallelism) goes
// through steps 1-4 of NOTE [FP8 all-gather] as one piece with the head's statistics block,
// the final norm with the norms, into a slot of its own instead of a compute-dtype copy held in
// full: 1 byte per head weight (128256 x 4096 for Llama 3.1 8B: 0.5 GB instead of 1 GB). It is
// gathered once per weight generation, at the first use after an optimizer step (the last
// block's forward prefetches it), since the scales it casts with may change at the step's end;
// every later micro-batch uses the same codes. A tied head is the embedding, which the lookup
// needs in the compute dtype: it stays a compute-dtype gather, its GEMMs casting it.
//
// NOTE [FP8 all-gather of a frozen base]
// LoRA's frozen base with precision.fp8 and precision.fp8_fsdp_all_gather: the blocks travel
// as E4M3 codes exactly as in full training (NOTE [FP8 all-gather]: the same pieces, amax
// reductions, scales and byte gathers; every ZeRO stage gathers the blocks around their use,
// ZeRO-1/2 into one slot per held block), from the rank's compute-dtype chunk instead of an
// fp32 master: on CUDA the chunk is first copied to fp32 (exact) into a scratch of the
// largest block chunk, so the casts are the ones full training runs. The projections are
// frozen (NOTE [FP8 frozen base] in model/fp8_projections.h): their weight generation moves
// only when a delayed run's scales come into use (and at a restore), so a slot is cast again
// then and otherwise kept; the codes and scales are those each projection would cast from
// the gathered bf16 weight, so the losses are bitwise the bf16 gather's. One difference: a
// delayed run's W histories hold the weight's amax at every step (each use of gathered codes
// folds it), where the cached bf16 path folds none once the delayed scales are in use; the
// amax is constant, so the scales are the same.
//
// NOTE [FP8 all-gather]
// With precision.fp8 and precision.fp8_fsdp_all_gather (FsdpOptions::fp8_all_gather; full
// training, and LoRA's frozen base: NOTE [FP8 all-gather of a frozen base]) the blocks' FP8
// projections (routed experts too) travel as E4M3 codes, 1 byte an element, not bf16's 2, as
// torchao's enable_fsdp_float8_all_gather. With
// precision.fp8_routed_experts false (FsdpOptions::fp8_routed_experts) a MoE block's routed
// experts are no FP8 projections, and their stacks travel in the compute dtype with the
// norms (step 4), the block's other projections as codes. Every stage handles
// its blocks as ZeRO-3 does: gathered from the master chunk around their use (prefetched
// one block ahead or behind), into the three rotating slots under ZeRO-3 and into one slot
// per block, kept until the next optimizer step, under ZeRO-1/2; the embedding and head
// units are gathered in the compute dtype as before (the head's GEMMs, even with
// fp8_output_head, quantize its gathered bf16 weight). A block's gather, on the
// communication stream:
//   1. each FP8 piece's amax over this rank's chunk of it (NOTE [FP8 all-gather pieces]: a
//      weight, an expert's matrix, a kv_a row view), in the compute dtype (bf16 on CUDA);
//   2. tensorwise (and a delayed run's first step, which uses current scales): one
//      max-all-reduce of the block's amax vector over the shard group gives each whole
//      piece's amax (torchao's precompute_float8_dynamic_scale_for_fsdp), and the scale is
//      torchao's amax_to_scale of it, the function the linear ops use; delayed: the
//      projection's history scale, copied from its statistics block on the compute stream;
//   3. this rank's chunk cast to E4M3 with that scale into its place in the slot's byte
//      buffer (fp8_chunk_cast, through the compute dtype), and one all-gather of bytes;
//      with the routed experts in the compute dtype the chunk's codes are packed instead
//      (as the norms in step 4, the stacks leaving gaps that would travel as useless bytes:
//      most of a MoE block), gathered, and unpacked into the slot's codes, the FP8
//      parameters one after the other;
//   4. the unit's other parameters (the norms, a MoE router and bias: small; the routed
//      experts' stacks with fp8_routed_experts false: not small) cannot travel as bytes: each rank packs its elements of them into a small compute-dtype
//      buffer (as many elements as the most any rank holds), one all-gather of those, and
//      each rank unpacks every rank's pieces into the slot's norm buffer. Two collectives
//      of the right dtypes are simpler than one mixed-type buffer, and the second is tiny.
// The slot hands out each parameter of step 4 as a plain compute-dtype view of its norm
// buffer (the routed experts' stacks so run their compute-dtype GEMMs, grouped on CUDA), and
// each FP8 parameter's LinearWeight as its codes with one
// Fp8GatheredWeight per piece (NOTE [FP8 gathered weights] in ops/fp8_linear.h): the amax (the
// whole piece's; delayed: this rank's chunk's, which the step-end max-reduce of NOTE [FP8 under
// data parallelism] makes the whole piece's), the scale and its inverse. The codes are
// the bytes the bf16-gather path's cast of the gathered weight writes (same values, same
// amax, same scale function, same saturating cast), so a run is bitwise the bf16-gather
// run. A slot remembers the FP8 projections' weight generation it was cast in, and one
// from an older generation (the optimizer stepped, or a resume restored the delayed scales)
// is gathered again. Memory: a slot holds 1 byte per block element instead of 2 (with the
// routed experts in the compute dtype: 1 per FP8 element and 2 per stack element, and the
// code wire: at most a block's FP8 bytes).
// A non-finite amax: NCCL's max may not carry a NaN across ranks, but the NaN codes do, so
// the loss is non-finite on every rank.
// Under tensor parallelism (FsdpOptions::tensor_parallel; NOTE [FP8 under tensor
// parallelism] in model/fp8_projections.h) a rank's block weights are its tensor-parallel
// shards, and the scale one device would use is the whole weight's: step 2's amax vector
// is max-reduced over the shard group (this shard's amax) and then over the tensor-parallel
// group (set_fp8_tensor_parallel_group: the maximum over every shard of the whole weight),
// one more all-reduce of a few floats per block gather. Each rank's gathered codes are then
// its slice of one device's FP8 weight, the bytes its projections' own cast of the bf16
// shard writes (whose W amax is max-reduced over the same ranks), so the run is bitwise
// the bf16-gather run under tensor parallelism too. delayed: the history's scale is the
// same on every rank already (the step-end reduction spans the tensor-parallel group), and
// the W record's chunk amax becomes the whole weight's at the step's end as above. That
// all-reduce runs on FSDP's communication stream, so it goes over a group of its own (the
// trainer splits one of the same ranks), not the model's tensor-parallel group, whose
// collectives run on the compute stream.
// Under expert parallelism (FsdpOptions::expert_parallel; NOTE [FSDP layout]) a MoE block's
// unit has a dense part, split over the shard group, and an expert part, this rank's local
// experts' slices of the stacks split over the ranks holding the same experts. The dense
// part goes through steps 1-4 as above; the expert part is gathered as ZeRO-3 gathers it, in
// the compute dtype in place over its group (the master chunk's piece cast into the slot's
// expert buffer), whether or not the routed experts are FP8 projections: with
// fp8_routed_experts the local experts' GEMMs cast their gathered bf16 slices themselves, each
// expert with its own scale (NOTE [FP8 routed experts under expert parallelism] in
// ops/moe_fp8.h), exactly as under the bf16 gather, so the run is still bitwise that one; the
// stacks' bytes are those of the bf16 gather and the dense part's are halved.
//
// NOTE [FSDP of a model of units]
// FSDP knows the decoder only through its layout (which parameter is in which unit) and
// the views it hands out (BlockWeights, ModelWeights). A model whose parameters come in
// units (FLUX, NOTE [FLUX units] in model/flux_parameters.h) gives its specs, each naming
// its unit, to the FsdpLayout constructor that takes them; Fsdp then runs on that layout
// as on the decoder's (the same chunks, gathers, rotating buffers, reductions, ZeRO
// stages, segments and flat index space), its two end units playing the embedding's and
// the head's part (kept in full, the last reduced first and the first last), and hands out
// each unit as a BlockWeights of its parameters in layout order (unit_weights,
// unit_gradients, unit_gradients_done); the model's own adapter (FluxFsdp in
// distributed/flux_fsdp.h) puts those views into the model's weight structures. The
// decoder's entry points (embedding(), layer(), ...), initialize() (the decoder's seeded
// initialization) and the FP8 all-gather, expert, tensor and pipeline parallelism and the
// frozen base are the decoder's and are refused; the weights come in by load_master or
// set_parameter.

// NOTE [Exposed communication]
// The communication that is not hidden behind compute is the time the compute stream
// stands still for it: every place where it waits for the communication stream (a block
// not yet gathered, a gradient buffer whose reduce-scatter is not done, the end of the
// step's reductions) and every collective it runs itself (the all-gathers after the
// optimizer step, the loss and norm all-reduces) is bracketed by a pair of timing events
// on the compute stream, and take_exposed_comm_seconds() adds up the gaps. On the CPU,
// where collectives block, it is their host time. What this cannot see is compute that
// runs slower because communication kernels share the GPU with it.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/device.h"
#include "distributed/data_parallel_comm.h"
#include "distributed/fsdp_fp8_pieces.h"
#include "distributed/fsdp_layout.h"
#include "distributed/process_group.h"
#include "model/fp8_projections.h"
#include "model/parameters.h"

namespace forge {

struct FsdpOptions {
  int zero_stage = 3;                // 1, 2 or 3
  DType reduce_dtype = DType::F32;   // F32 | BF16: the gradients' dtype in the reduce-scatter
  int64_t host_window = int64_t{1} << 26;  // fp32 elements staged on the host at a time (fill_master)
  bool frozen = false;  // NOTE [Frozen FSDP base]: a compute-dtype chunk, nothing trainable
  // NOTE [Expert parallelism] in model/expert_dispatch.h: each rank holds its local experts
  // only, sharded over the ranks that hold the same ones (NOTE [FSDP layout]).
  int expert_parallel = 1;
  // NOTE [FP8 all-gather]: the blocks' FP8 projections gathered as E4M3 codes; needs
  // set_fp8_projections before the first layer().
  bool fp8_all_gather = false;
  // precision.fp8_routed_experts (NOTE [FP8 routed experts switch] in
  // model/fp8_projections.h): whether the FP8 all-gather sends the routed-expert stacks as
  // codes; false: in the compute dtype, with the norms (NOTE [FP8 all-gather pieces]).
  bool fp8_routed_experts = true;
  // precision.fp8_filter_fqns (NOTE [FP8 filter] in model/fp8_projections.h): the projections
  // it keeps in the compute dtype travel with the norms.
  std::vector<std::string> fp8_filter_fqns;
  // precision.fp8_output_head: with fp8_all_gather the head's weight travels as codes too
  // (NOTE [FP8 all-gather of the head]; not a tied head, which is the embedding).
  bool fp8_output_head = false;
  // NOTE [Tensor-parallel shards] in model/parameters.h: the parameters this rank holds are
  // its tensor-parallel shards, sharded by FSDP over its data-parallel ranks.
  TensorParallelShard tensor_parallel = {};
  // NOTE [FSDP] (pipeline ranks): the parameters this rank holds are those of its pipeline
  // stages (pipeline_stage_specs; every rank of the shard group holds the same stages).
  // ZeRO-1: gradients are reduced by reduce_gradients() after the step's schedule; ZeRO-2/3:
  // per backward (NOTE [ZeRO-2 and -3 under pipeline parallelism]).
  // Empty: the whole model.
  std::vector<PipelineStage> pipeline_stages = {};
};

// Bytes this rank holds, by component (the memory report).
struct FsdpMemory {
  int64_t master_weights = 0;      // fp32 chunk (frozen: none; its chunk is a compute weight)
  int64_t gradient_shard = 0;      // fp32 chunk
  int64_t compute_weights = 0;     // bf16 (fp32 on the CPU): full, chunk and gather buffers
  int64_t full_gradients = 0;      // fp32 full-size gradient buffers
  int64_t reduce_buffers = 0;      // staging for bf16 reduction and the reduced chunks
};

// The step's scalar collectives (sum_over_ranks, count_over_ranks, all_reduce_sum,
// all_gather_words, take_exposed_comm_seconds) come from DataParallelComm.
class Fsdp final : public DataParallelComm, public ParamSource, public GradSink {
 public:
  // shard_group: the ranks that split the parameters; replicate_group (may be null): the
  // ranks that hold the same chunk (hybrid sharding); expert_group (with
  // options.expert_parallel > 1, else null): the shard ranks that hold the same experts,
  // which split the expert parts (ranks r with equal r % expert_parallel, ranked by r).
  // All outlive this object.
  Fsdp(const ModelConfig& config, Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group,
       const FsdpOptions& options, ProcessGroup* expert_group = nullptr);
  // NOTE [FSDP of a model of units]: a model other than the decoder (FLUX), laid out from its
  // specs (the FsdpLayout constructor taking them, for shard_group's world and rank); ZeRO
  // 1-3, reduce dtype and hybrid sharding as above, nothing else of FsdpOptions.
  Fsdp(FsdpLayout layout, Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group,
       const FsdpOptions& options);
  ~Fsdp() override;

  // NOTE [FSDP of a model of units]: unit `unit`'s weights (compute dtype) and gradient
  // buffers (fp32), one LinearWeight per parameter of the unit (its `weight`, shaped as its
  // spec), in the layout's order; unit_gradients_done(unit) says the micro-batch's
  // gradients of the unit are complete. Units 0 and the last are kept in full, the blocks
  // between them gathered around their use under ZeRO-3, exactly as the decoder's.
  const BlockWeights& unit_weights(int unit);
  const BlockWeights& unit_gradients(int unit);
  void unit_gradients_done(int unit);

  const FsdpLayout& layout() const { return layout_; }
  const FsdpOptions& options() const { return options_; }
  // NOTE [FP8 all-gather of the head]: whether this rank gathers the head's weight as codes.
  bool gathers_fp8_head() const { return fp8_head_; }

  // The fp32 master chunk, the fp32 gradient chunk and the compute-dtype copy of the
  // chunk, one view per segment (layout().segments() order); the optimizer's parameters.
  // A segment of a ZeRO-3 block has no compute copy (an undefined tensor): its gather
  // casts the master chunk. Frozen (NOTE [Frozen FSDP base]): the master segments are the
  // compute-dtype chunk and there are no gradient segments.
  const std::vector<Tensor>& master_segments() const { return master_segments_; }
  const std::vector<Tensor>& grad_segments() const { return grad_segments_; }
  const std::vector<Tensor>& compute_segments() const { return compute_segments_; }
  // The whole fp32 master chunk, padding included.
  const Tensor& master_shard() const { return master_; }

  // Fills the master chunk from the seeded initialization (the values single-device
  // training starts from) and refreshes the compute weights.
  void initialize(uint64_t seed);
  // Fills the master chunk segment by segment: read(flat_offset, out) must write the
  // elements [flat_offset, flat_offset + out.size()) of the flat parameter vector. Then
  // refreshes the compute weights.
  void load_master(const std::function<void(int64_t, std::span<float>)>& read);
  // Writes this rank's segments of parameter `spec` (parameter_specs order) from its whole
  // fp32 host values, so an import holds one parameter at a time; after the last one,
  // refresh_compute_weights(false).
  void set_parameter(size_t spec, const Tensor& values);

  // The step's protocol, called identically on every rank:
  //   begin_step(); for each micro-batch k of n: begin_micro_batch(k == n - 1);
  //   model forward/backward through *this; end_micro_batch(); finish_gradients();
  //   optimizer on the segments; refresh_compute_weights().
  // With pipeline_stages (NOTE [FSDP], pipeline ranks):
  //   begin_step(); the PipelineModel's schedule through *this; reduce_gradients();
  //   finish_gradients(); optimizer on the segments; refresh_compute_weights().
  void begin_step();
  void begin_micro_batch(bool last);
  void end_micro_batch();
  // ZeRO-1: reduce-scatters (on the communication stream) the full gradients of every
  // unit the step's backwards wrote and that is not reduced yet, into the gradient chunk.
  // Required once per step with pipeline_stages, after the schedule; elsewhere it reduces
  // what begin_micro_batch(false) held back. Nothing for a frozen base, nor for ZeRO-2/3
  // over pipeline stages (each backward was reduced as it was done).
  void reduce_gradients();
  // Waits (on the compute stream) for every reduction of the step.
  void finish_gradients();
  // Sum of squares of the whole (global) gradient: this rank's chunk, all-reduced.
  // `replicated_weight`: the weight of the parameters tensor parallelism replicates (NOTE
  // [Tensor-parallel gradient norm] in train/trainer.cpp), 1 otherwise.
  double global_grad_sum_of_squares(double replicated_weight = 1.0);
  // chunk_written: the optimizer already wrote compute_segments (AdamW's bf16 copies on
  // CUDA); otherwise they are cast from the master chunk first.
  void refresh_compute_weights(bool chunk_written);

  FsdpMemory memory() const;

  // NOTE [FP8 all-gather]: the projections whose scales, statistics and clock the FP8
  // gathers use (outlives this object's use).
  void set_fp8_projections(const Fp8Projections& fp8);
  // NOTE [FP8 all-gather] under tensor parallelism: the ranks whose shards make up each
  // block weight (FsdpOptions::tensor_parallel), over which the gathers' weight amaxes are
  // max-reduced after the shard group's. A group of its own, not the model's
  // tensor-parallel one: its collectives run on the communication stream. Needed with the
  // FP8 all-gather under tensor parallelism, before the first layer(); outlives this object's use.
  void set_fp8_tensor_parallel_group(ProcessGroup& group);

  // Redistributes per-segment tensors (layout().segments() order, fp32 or bf16: the master
  // segments, or the optimizer's moments) from the FSDP layout to the flat index space
  // (parameter_specs order, no padding): this rank receives elements [begin, end) into
  // `out` (end - begin floats; an empty range is fine). Every shard rank calls it; a unit's
  // chunk at a time is cast to fp32 and travels by all-gathers of slices, so the device
  // holds one unit chunk plus world x 16M floats at most. Under pipeline_stages only the
  // stages' parameters' elements of [begin, end) are written, the rest left as they are.
  void gather_flat_range(const std::vector<Tensor>& segments, int64_t begin, int64_t end, std::span<float> out);
  // The whole flat vector on shard rank 0 (`flat` resized there, layout().flat_numel();
  // under pipeline_stages zero outside the stages' parameters), nothing elsewhere.
  void gather_to_host(const std::vector<Tensor>& segments, std::vector<float>& flat);

  // ParamSource
  const Tensor& embedding() override;
  const BlockWeights& layer(int index) override;
  const Tensor& final_norm() override;
  const LinearWeight& output() override;
  // GradSink
  const BlockWeights& layer_grads(int index) override;
  void layer_done(int index) override;
  const Tensor& embedding_grad() override;
  void embedding_done() override;
  const Tensor& final_norm_grad() override;
  const LinearWeight& output_grad() override;
  void head_done() override;
  bool layer_grads_fresh(int index) const override;
  bool head_grads_fresh() const override;
  bool embedding_grad_fresh() const override;

 private:
  // A reduction in flight: staging for bf16, the reduced chunk, and the events that order
  // it against the compute stream.
  struct ReduceChannel {
    Tensor staging;  // bf16 full unit (bf16 reduction only)
    Tensor reduced;  // the reduce-scatter's output (reduce dtype), one chunk; made on first use
    std::unique_ptr<DeviceEvent> ready, done;
  };
  // A full-size unit buffer (gathered block weights in ZeRO-3, a unit's gradients in
  // ZeRO-2/3) and its views.
  struct UnitSlot {
    int unit = -1;
    Tensor buffer;
    BlockWeights block;  // a block unit's tensors
    ModelWeights root;   // the embedding or head unit's tensors (the fields it holds)
    std::unique_ptr<DeviceEvent> ready;     // ZeRO-3 weights: the gather is done
    std::unique_ptr<DeviceEvent> released;  // ZeRO-3 weights: compute is done with it
    int channel = -1;                       // gradients: the reduce channel it uses
    // NOTE [FP8 all-gather]: the codes (U8, the unit's layout; packed codes: the FP8
    // parameters one after the other), the norms (compute dtype, one after the other), each piece's amax (F32, contiguous: all-reduced at once; NOTE
    // [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h) and scales (scale, inverse,
    // kFp8StatStride apart), the descriptors' statistics (one per piece), and the weight
    // generation the codes are from. Under expert parallelism `experts`: the expert part
    // (compute dtype, the part's layout).
    Tensor codes, norms, amax, scales, experts;
    std::vector<Fp8GatheredWeight> gathered;
    uint64_t generation = 0;
  };

  // The body of both public constructors.
  Fsdp(const ModelConfig& config, FsdpLayout&& layout, bool units_model, Device device, ProcessGroup& shard_group,
       ProcessGroup* replicate_group, const FsdpOptions& options, ProcessGroup* expert_group);
  BlockWeights block_views(const Tensor& unit_buffer, int unit) const;
  // An end unit's views: into `w` (the decoder's) or `units` (NOTE [FSDP of a model of units]).
  void end_views(const Tensor& unit_buffer, int unit, ModelWeights& w, std::array<BlockWeights, 2>& units) const;
  // Fills the fields of `w` that unit (embedding or head) holds with views of its buffer.
  void root_views(const Tensor& unit_buffer, int unit, ModelWeights& w) const;
  Tensor unit_full(const Tensor& all_units, int unit) const;  // a unit inside a buffer of every unit
  Tensor shard_of(const Tensor& shard, int unit) const;       // a unit's chunk inside a rank's shard
  // A part's group, this rank's piece of the part inside a unit buffer, and the part's
  // piece of this rank's chunk of the unit (NOTE [FSDP layout]).
  ProcessGroup& group_of(const FsdpPart& part) const { return part.expert ? *expert_group_ : shard_group_; }
  static Tensor own_piece(const Tensor& unit_buffer, const FsdpPart& part);
  static Tensor chunk_piece(const Tensor& unit_chunk, const FsdpPart& part);
  // Elements [local, local + numel) of this rank's chunk of `unit`, where they sit in a
  // buffer holding the whole unit.
  Tensor chunk_in_unit(const Tensor& unit_buffer, int unit, int64_t local, int64_t numel) const;
  // Every part of the unit all-gathered in place in `full`, each over its group.
  void gather_unit(const Tensor& full, int unit, CudaStream stream);
  // ZeRO-3: the embedding or head unit inside root_compute_.
  Tensor root_unit(int unit) const;
  // Writes the master chunk a host window at a time: fill(pieces) writes each piece's
  // elements [begin, begin + count) of its segment to its `out`. Then refreshes the
  // compute weights.
  struct MasterPiece {
    const FsdpSegment* segment;
    int64_t begin, count;
    float* out;
  };
  void fill_master(const std::function<void(const std::vector<MasterPiece>&)>& fill);
  // Makes the compute stream wait for a unit kept in full, once after each refresh.
  void await_unit(int unit);
  // Issues the all-gather of block unit `unit` into a free slot (ZeRO-3, FP8 all-gather).
  void gather_block(int unit, int requested);
  // Whether block units are gathered around their use (ZeRO-3, or NOTE [FP8 all-gather]).
  bool gathers_blocks() const { return options_.zero_stage == 3 || options_.fp8_all_gather; }
  // NOTE [FP8 all-gather]: the delayed scales into the slot (compute stream), then its
  // gather (communication stream); the slot's block views.
  void copy_delayed_scales(UnitSlot& slot, int unit);
  void gather_fp8_block(UnitSlot& slot, int unit);
  void fp8_block_views(UnitSlot& slot, int unit);
  // Whether the FP8 all-gather sends p as codes (NOTE [FP8 all-gather pieces]), or with the
  // norms (step 4); neither: a slice of an expert part (NOTE [FP8 all-gather] under expert
  // parallelism).
  bool is_fp8(const FsdpParam& p) const {
    const ParamSpec& spec = layout_.specs()[static_cast<size_t>(p.spec)];
    return !p.expert && (fp8_gathered_param(spec, fp8_pieces_settings_) || (fp8_head_ && fp8_head_param(spec)));
  }
  // Whether a gather of `unit` packs its codes (a block's, when stacks or filtered
  // projections travel with the norms); the head's are in place.
  bool packs_codes(int unit) const { return packed_codes_ && layout_.is_block(unit); }
  // NOTE [FP8 all-gather of the head]: a slot's FP8 gather (the delayed scales, the gather,
  // the views); the head's slot, gathered if it is not current, awaited by the compute
  // stream; the index of a head parameter in its unit; every weight slot, the head's too.
  void gather_fp8_slot(UnitSlot& slot, int unit);
  bool fp8_head_current() const;
  const UnitSlot& fp8_head();
  size_t head_param(const std::string& name) const;
  std::vector<UnitSlot*> all_weight_slots();
  bool in_norms(const FsdpParam& p) const { return !p.expert && !is_fp8(p); }
  // NOTE [FP8 all-gather], step 4: rank r's elements of the unit's parameters that travel as
  // codes (`codes`) or with the norms (the others), packed in parameter order at r x m
  // of `wire`, into `dst`, where those parameters lie one after the other.
  void unpack_wire(const Tensor& dst, const Tensor& wire, int64_t m, int unit, bool codes, CudaStream stream);
  // ZeRO-2/3: the gradient slot of `unit`, taken on the unit's first request: fresh (NOTE
  // [Fresh gradient buffers]), its padding zeroed, the rest left for the model to write.
  UnitSlot& grad_slot(int unit);
  void zero_padding(const Tensor& unit_buffer, int unit) const;
  // The unit's gradients are complete: reduce them (ZeRO-1: on the last micro-batch).
  void unit_done(int unit);
  // Reduces `grads` (the full unit) into the gradient chunk through `channel`.
  void reduce_unit(int unit, const Tensor& grads, ReduceChannel& channel);
  // ZeRO-1: reduces the unit's full gradients through the next channel.
  void reduce_full_unit(int unit);
  bool pipelined() const { return !options_.pipeline_stages.empty(); }
  // Fails naming the unit when this pipeline rank's stages do not hold it.
  void check_held(int unit, const char* what) const;
  bool tied() const { return config_.tie_word_embeddings; }
  void check_decoder(const char* what) const;  // fails for a model of units
  // The end unit's index in root_units_ / root_unit_grads_ (0: unit 0, 1: the last).
  size_t end_index(int unit) const { return unit == FsdpLayout::kEmbeddingUnit ? 0 : 1; }
  void check_trainable(const char* what) const;  // a frozen base has no gradients

  ModelConfig config_;
  FsdpOptions options_;
  ProcessGroup* expert_group_;
  FsdpLayout layout_;
  DType compute_dtype_;

  Tensor master_, grad_shard_;
  std::vector<Tensor> master_segments_, grad_segments_, compute_segments_;
  // ZeRO-1/2: every unit in full. ZeRO-3: the embedding and head units in full (root_compute_).
  Tensor full_compute_, root_compute_;
  // ZeRO-1: every unit's gradients in full. ZeRO-2/3 with a tied embedding: its gradients.
  Tensor full_grads_;
  ModelWeights root_weights_, root_grads_;  // root_grads_: ZeRO-1, and the tied embedding's
  // NOTE [FSDP of a model of units]: a model of units instead of the decoder; its end units'
  // weights and (ZeRO-1) full gradients as unit views.
  bool units_model_ = false;
  std::array<BlockWeights, 2> root_units_, root_unit_grads_;
  std::vector<BlockWeights> static_layers_, static_layer_grads_;  // ZeRO-1/2 weights, ZeRO-1 grads
  std::vector<UnitSlot> weight_slots_;  // ZeRO-3: three; FP8 all-gather under ZeRO-1/2: one per held block
  // Which block parameters are FP8 pieces (fp8_gathered_param): fp8_routed_experts and
  // fp8_filter_fqns of the options.
  Fp8Settings fp8_pieces_settings_;
  Tensor frozen_chunk_f32_;  // NOTE [FP8 all-gather of a frozen base]: CUDA, a block chunk in fp32
  // NOTE [FP8 all-gather of the head]: the head's weight gathered as codes (fp8_output_head).
  bool fp8_head_ = false;
  UnitSlot head_slot_;
  std::vector<int> block_slot_;          // per unit: its slot under ZeRO-1/2 (FP8 all-gather), -1 if not held
  std::array<UnitSlot, 2> grad_slots_;    // ZeRO-2/3
  std::array<ReduceChannel, 2> channels_;  // one per gradient slot (ZeRO-1: alternating)
  ReduceChannel embedding_channel_;       // the tied embedding's (ZeRO-2/3)
  int next_channel_ = 0;
  bool last_micro_batch_ = true;
  bool pending_reduction_ = false;       // pipeline_stages, ZeRO-1: a unit's gradients written, reduce_gradients() not yet
  std::vector<bool> reduced_this_step_;  // per unit
  std::vector<bool> unit_fresh_;         // per unit: its gradient buffers are to be overwritten
  // Units kept in full: gathered after each optimizer step on the communication stream.
  std::vector<std::unique_ptr<DeviceEvent>> unit_ready_;
  std::vector<bool> unit_pending_;
  std::unique_ptr<DeviceEvent> updated_;  // the optimizer's writes are done
  // NOTE [FP8 all-gather]
  const Fp8Projections* fp8_ = nullptr;
  ProcessGroup* fp8_tensor_parallel_ = nullptr;  // NOTE [FP8 all-gather] under tensor parallelism
  // Per unit: its FP8 pieces (NOTE [FP8 all-gather pieces]; empty but for blocks) and, once
  // set_fp8_projections is called, each piece's statistics block.
  std::vector<std::vector<Fp8GatherPiece>> fp8_pieces_;
  std::vector<std::vector<int64_t>> fp8_piece_projection_;
  Tensor norm_wire_;            // world x norm_wire_numel_ elements of the compute dtype
  int64_t norm_wire_numel_ = 0;  // the most norm elements any rank holds of any block
  // NOTE [FP8 all-gather] step 3 with packed codes (the routed experts in the compute dtype,
  // FsdpOptions::fp8_routed_experts false, in a MoE model): world x code_wire_numel_ bytes,
  // the most code elements any rank holds of any block; the slots' codes then hold a block's
  // FP8 parameters one after the other.
  bool packed_codes_ = false;
  Tensor code_wire_;
  int64_t code_wire_numel_ = 0;
};

}  // namespace forge
