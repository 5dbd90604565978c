// QLoRA's frozen base weights in NF4 (NOTE [NF4 storage] in ops/nf4.h).
//
// NOTE [NF4 base weights]
// As QLoRA, PEFT (BitsAndBytesConfig(load_in_4bit, nf4, double quant)) and torchtune do,
// only the seven projection weights of every block (q, k, v, o, gate, up and down) are
// quantized; the embedding, the norms and the output head stay in their dtype. forge
// fuses q/k/v and gate/up (NOTE [Fused projections]); their NF4 form keeps one tensor per
// Hugging Face weight, each exactly what bitsandbytes' quantize_4bit stores for that
// Linear4bit, so codes can be checked (and exchanged) tensor by tensor. Quantization runs
// once, on the CPU, from the fp32 values the Hugging Face import produced (bf16 weights
// convert to fp32 exactly, so this equals quantizing the bf16 tensors themselves).
// Nf4BaseSource then hands the decoder descriptors whose projections are these codes and
// a shared scratch buffer (NOTE [NF4 linear weights]), the rest taken from another source.
//
// NOTE [NF4 expert stacks]
// A Mixture-of-Experts block's routed experts (the stacks [E, 2F, H] and [E, H, F], NOTE
// [MoE feed-forward]) are quantized as well, one NF4 tensor per expert matrix (w1, w3, w2 of
// each expert: what bitsandbytes stores for the experts' Linear4bit modules on transformers
// 4, where they are nn.Linear; transformers 5 stacks them into 3-D parameters, which
// bitsandbytes leaves unquantized, so a PEFT QLoRA run there keeps Mixtral 8x7B's 45 B
// expert weights in bf16). The router stays in the compute dtype (as on transformers 5,
// where it is no nn.Linear either; a 4-bit router would move the routing). The experts'
// GEMMs read plain tensors, not descriptors, so Nf4BaseSource::layer(i) dequantizes block
// i's whole stacks into a scratch of their own (one block's experts in the compute dtype:
// 2.6 GiB for Mixtral 8x7B in bf16) when the decoder asks for the block, which it does just
// before the block's forward and again before its backward (and recomputation), each time
// using those weights before it asks for another block's.
//
// NOTE [NF4 expert stacks under expert parallelism]
// With parallelism.expert_parallel_degree P > 1 (NOTE [Expert parallelism] in
// model/expert_dispatch.h) a rank's MoE blocks compute with its E / P local experts alone,
// so its Nf4FrozenBase (ExpertShard) holds only their NF4 codes: each stack's spec is its
// local slice (expert_parallel_spec: [E/P, R, C] and those experts' Hugging Face tensors),
// quantized from the local experts' rows of the whole values that import or the seeded
// initialization hands it, tensor by tensor as above. Every expert matrix is its own NF4
// tensor, so a rank's codes are bitwise the one-rank base's codes of its experts, and the
// rank dequantizes only its local stacks into a scratch of E / P experts. The rest of the
// base (projections' codes, embedding, norms, router, head) is replicated as under data
// parallelism (NOTE [LoRA under data parallelism] in model/lora.h). The merged export
// dequantizes each rank's experts into its place in the whole model and the trainer
// gathers the other experts' from the ranks that hold them. Under pipelining too a rank
// holds its stages' blocks with their stacks' local slices (the specs are
// expert_parallel_specs of pipeline_stage_specs), and the merged export is written in
// pieces with no gather: NOTE [QLoRA under pipeline and expert parallelism] in model/lora.h.
//
// NOTE [NF4 base under tensor parallelism]
// With parallelism.tensor_parallel_degree T > 1 (NOTE [Tensor parallelism] in
// model/tensor_parallel.h) a rank's Nf4FrozenBase holds its shards (NOTE [Tensor-parallel
// shards] in model/parameters.h): specs() are parameter_specs(config, shard), the import
// hands it the rank's shard of every Hugging Face tensor alone (for_each_hf_parameter reads
// no more), the seeded initialization draws the shard's values alone, and each shard is
// quantized on its own, one NF4 tensor per Hugging Face part as above: a column-parallel
// projection's (qkv, gate_up) its R/T consecutive rows of each part, a row-parallel one's
// (o, down) its C/T columns of every row, a [R, C/T] matrix. No rank holds or quantizes
// more than its shards; the embedding and head (vocabulary rows) and the norms are held
// as under LoRA on a bf16 base. The codes are read through Nf4BaseSource as on one device
// (the scratch sized for the largest shard), so the decoder's tensor-parallel GEMMs and the
// adapters' shards (NOTE [LoRA under context and tensor parallelism] in model/lora.h) run
// over them unchanged.
// How that relates to one device's QLoRA: NF4's blocks of 64 run along the flattened rows
// (NOTE [NF4 storage] in ops/nf4.h). check_nf4_tensor_parallel asks that every shard's
// blocks be blocks of the whole tensor: a column-parallel part's R/T x C values a multiple
// of 64 (its first value then starts a block), a row-parallel shard's C/T columns a multiple
// of 64 (each row then a whole number of the whole row's blocks). Then every 4-bit code and
// every block's absmax (the fp32 maximum the codes were chosen with) is bitwise the one-device
// base's for the same weights. The second level is the shard's own: bitsandbytes'
// double quantization codes the blocks' absmax values in 8 bits around their mean, with one
// fp32 scale per 256 consecutive blocks, and a shard's mean and groups of 256 are of its own
// blocks, not the whole tensor's (a row-parallel shard's blocks are not even consecutive in
// it). So each dequantized block is the whole tensor's codes times an absmax that differs
// from the one device's by the 8-bit rounding of another offset and scale (up to 1.3% on
// the test model of test_model_qlora_tensor_parallel.cpp, whose every code is the same),
// and a shard's tensor is exactly what bitsandbytes' quantize_4bit stores for that shard as
// a Linear4bit of its own. A TP run is therefore the QLoRA run of a base quantized shard by
// shard: bitwise the same base on every degree-T layout (a resumed run quantizes again to
// the same codes), within fp32 reordering of one rank running LoRA on those dequantized
// shards, and close to, not bitwise, one device's QLoRA. The merged export dequantizes each
// rank's shards and gathers them into the whole model on rank 0, as LoRA's bf16 shards are.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "model/expert_shard.h"
#include "model/parameters.h"
#include "ops/nf4.h"

namespace forge {

// A block's projection (a matrix with layer >= 0, not a MoE router): dequantized per GEMM.
bool is_base_projection(const ParamSpec& spec);
// A block's stack of routed experts' matrices [E, R, C] (NOTE [NF4 expert stacks]).
bool is_quantized_expert_stack(const ParamSpec& spec);
// Either: what QLoRA quantizes.
bool is_quantized_base_weight(const ParamSpec& spec);
// The matrix its NF4 parts stack into: the spec's shape, or [E x R, C] for an expert stack.
Shape nf4_matrix_shape(const ParamSpec& spec);

struct Nf4Base {
  std::vector<Nf4Weight> weights;  // per ParamSpec, in parameter_specs order; no parts when not quantized

  bool quantized(size_t spec) const { return !weights.at(spec).parts.empty(); }
  size_t nbytes() const;  // codes and statistics of every quantized weight
  Nf4Base to(Device device) const;
};

// Device bytes of the NF4 base of `config` (codes and statistics of every quantized weight,
// exactly what quantize_base_nf4 produces: about 0.516 byte per weight) and of the
// Nf4BaseSource scratch buffers (the largest projection, and one block's expert stacks, in
// `compute_dtype`), for the memory estimate of a QLoRA run.
// stored_row_order: with the staging buffer of the weights quantized in their Hugging Face
// row order (NOTE [NF4 stored row order]), which an import of DeepSeek's published
// checkpoints (interleaved rotary rows) holds.
// `specs`: of these parameters only (a pipeline rank's stages'); empty: the whole model's.
double nf4_base_bytes(const ModelConfig& config, const std::vector<ParamSpec>& specs = {});
double nf4_scratch_bytes(const ModelConfig& config, DType compute_dtype, bool stored_row_order = true,
                         const std::vector<ParamSpec>& specs = {});

// NOTE [NF4 base under tensor parallelism]: fails, naming the projection and the model key
// whose share is at fault, unless every rank's shard of every quantized weight is made of
// whole NF4 blocks of the whole tensor under `degree` ranks.
void check_nf4_tensor_parallel(const ModelConfig& config, int64_t degree);

// Quantizes every base projection and expert stack of `params` (fp32 on the CPU), one NF4
// tensor per Hugging Face weight it is made of.
Nf4Base quantize_base_nf4(const FlatParameters& params);

// The decoder's weights with the base projections read from NF4 codes: embedding, norms
// and output from `rest` (whose projection tensors are never read), projections as NF4
// descriptors over one scratch buffer of `dtype` on `device`, sized for the largest.
class Nf4BaseSource : public ParamSource {
 public:
  Nf4BaseSource(ParamSource& rest, const std::vector<ParamSpec>& specs, const Nf4Base& base, Device device,
                DType dtype);

  const Tensor& embedding() override { return rest_.embedding(); }
  const BlockWeights& layer(int index) override;
  const Tensor& final_norm() override { return rest_.final_norm(); }
  const LinearWeight& output() override { return rest_.output(); }

 private:
  ParamSource& rest_;
  const Nf4Base& base_;
  std::vector<std::vector<size_t>> layer_specs_;  // per block: the spec index of each entry
  Tensor scratch_;         // the projection at hand (NOTE [NF4 linear weights])
  Tensor expert_scratch_;  // a block's expert stacks (NOTE [NF4 expert stacks])
  std::vector<BlockWeights> layers_;
  std::vector<std::vector<std::pair<size_t, size_t>>> expert_stacks_;  // per block: (entry, spec)
};

// NOTE [QLoRA base]
// The frozen base of a QLoRA run (lora.quantize_base: nf4, NOTE [LoRA training]). It keeps
// the seven projections of every block as NF4 codes only (each quantized on the host as
// quantize_base_nf4 does, then moved to `device`) and the rest (embedding, norms, output
// head) in the compute dtype in a buffer of its own. It is filled one parameter at a time
// (set, then finish) so that the Hugging Face import can hand it each parameter as it is
// read: no full-precision copy of the model exists at any time, only of the parameter at
// hand. The decoder reads it through Nf4BaseSource (each projection dequantized into the
// one shared scratch just before its GEMM, forward and backward alike); LoraAdapters
// attach the adapters on top. Quantization is a pure function of the imported values, so
// a resumed run that imports and quantizes again holds bitwise the same base.
class Nf4FrozenBase : public ParamSource {
 public:
  // Empty: every parameter is set() once, then finish(). `stages`: a pipeline rank's stages,
  // whose parameters alone it holds (pipeline_stage_specs; NOTE [LoRA under pipeline
  // parallelism] in model/lora.h); empty: every parameter. `experts`: an expert-parallel
  // rank's place, whose local experts' stacks alone it holds (NOTE [NF4 expert stacks under
  // expert parallelism]), of its stages' blocks with `stages` too. `shard`: a
  // tensor-parallel rank's place, whose shards alone it holds (NOTE [NF4 base under tensor
  // parallelism]; not with experts).
  Nf4FrozenBase(const ModelConfig& config, Device device, DType dtype, const std::vector<PipelineStage>& stages = {},
                ExpertShard experts = {}, TensorParallelShard shard = {});
  // From fp32 host parameters (the whole model's), finished; stored_rows(spec): set()'s for
  // each (none: {}).
  Nf4FrozenBase(const FlatParameters& host, Device device, DType dtype,
                const std::function<std::vector<int64_t>(size_t spec)>& stored_rows = {}, ExpertShard experts = {});
  ~Nf4FrozenBase() override;

  // The parameters it holds: parameter_specs(config), or the pipeline stages' of them, or
  // with the expert stacks' local slices (expert_parallel_specs).
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const ExpertShard& experts() const { return experts_; }
  const TensorParallelShard& tensor_parallel() const { return shard_; }
  // specs()[spec]'s values, fp32 on the host, in its shape (a sliced expert stack's may be
  // the whole stack's, whose local experts are taken). stored_rows
  // (NOTE [NF4 stored row order]): for a quantized weight whose Hugging Face tensor orders
  // its rows otherwise, the weight's row (of its matrix, nf4_matrix_shape) at each stored row.
  void set(size_t spec, const Tensor& values, std::span<const int64_t> stored_rows = {});
  void finish();
  // Sets every parameter from the seeded initialization (FlatParameters::initialize's
  // values), one parameter in fp32 on the host at a time, then finish(): a QLoRA run
  // from random weights (a benchmark, or a model too large to initialize whole).
  void initialize(uint64_t seed);

  const Nf4Base& codes() const { return codes_; }
  // Device bytes: codes and statistics, the rest in the compute dtype, the scratch.
  size_t nbytes() const;
  // The base as fp32 host parameters (same model), projections dequantized: what
  // bitsandbytes' dequantize_4bit gives, the starting point of a merged export. With
  // ExpertShard the stacks' local experts alone are written (the rest of each stack is left
  // as it is: the other ranks' to fill). Under tensor parallelism `host` holds the rank's
  // shards (FlatParameters of the same TensorParallelShard).
  void dequantize_into(FlatParameters& host) const;
  // specs()[spec]'s values into `out` (fp32 on the host, that spec's shape), dequantized
  // when the spec is quantized.
  void dequantize(size_t spec, const Tensor& out) const;

  const Tensor& embedding() override;
  const BlockWeights& layer(int index) override;
  const Tensor& final_norm() override;
  const LinearWeight& output() override;

 private:
  class Rest;
  ModelConfig config_;
  std::vector<ParamSpec> specs_;
  ExpertShard experts_;
  TensorParallelShard shard_;
  Device device_;
  DType dtype_;
  Nf4Base codes_;
  std::vector<char> filled_;
  std::unique_ptr<Rest> rest_;
  std::unique_ptr<Nf4BaseSource> source_;
  Tensor staging_;  // NOTE [NF4 stored row order]
  size_t scratch_bytes_ = 0;
};

}  // namespace forge
