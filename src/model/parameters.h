// The model's parameters: their names, shapes and Hugging Face names, and the weight
// containers the decoder reads through ParamSource and writes gradients to through
// GradSink.
//
// NOTE [Fused projections]
// Q, K and V are one [ (Hq + 2 Hkv) * D, hidden ] matrix and gate/up one [2F, hidden]
// matrix, as Megatron's linear_qkv / linear_fc1: one GEMM each instead of three or two.
// Hugging Face keeps them separate (q_proj, k_proj, v_proj; gate_proj, up_proj); each
// ParamSpec lists the Hugging Face tensors it is made of and their rows, stacked in that
// order along the first dimension, so import/export is a split or a concatenation. A stack
// of matrices [E, R, C] (a MoE block's experts) counts its rows across the stack: its
// E x R rows of C, matrix after matrix, so that per-expert Hugging Face tensors ([rows, C]
// each) are slices of it in the same way (NOTE [MoE Hugging Face names] in
// model/moe_feed_forward.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/pipeline_stage.h"
#include "ops/linear.h"

namespace forge {

// Rows of a Hugging Face tensor that hold rotary features in interleaved pairs (DeepSeek's
// Multi-head Latent Attention), which forge keeps in its rotate-half order (NOTE
// [Multi-head Latent Attention] in model/latent_attention.h): in every block of `period`
// rows, the `count` rows from `first` on are reordered, forge's row first + j being the
// tensor's row first + 2j and forge's row first + count/2 + j its row first + 2j + 1.
// Import applies it, export undoes it. period 0: none.
struct HfRotaryRows {
  int64_t period = 0, first = 0, count = 0;
};

// A Hugging Face tensor a forge parameter is made of, and its rows (its first dimension)
// inside the parameter (for a stack of matrices, rows of the stack: NOTE [Fused projections]).
struct HfTensor {
  std::string name;
  int64_t rows = 0;
  HfRotaryRows rotary_rows = {};
  // Stored in fp32 whatever the export's dtype, as transformers keeps it
  // (_keep_in_fp32_modules_strict: DeepSeek-V3's routing bias, e_score_correction_bias).
  bool keep_fp32 = false;
};

// NOTE [Tensor-parallel shards]
// Under tensor parallelism of degree T (NOTE [Tensor parallelism] in
// model/tensor_parallel.h) rank r of a tensor-parallel group holds a shard of every
// parameter, by the parameter's split:
//   Rows        each Hugging Face tensor stacked in it is split along its rows into T
//               equal chunks and the rank holds chunk r of each, stacked in the same order:
//               the column-parallel projections (qkv: its heads' q, k and v rows; gate_up:
//               its F/T gate and up rows) and the vocabulary-parallel embedding and output
//               (vocabulary rows [r V/T, (r + 1) V/T));
//   Columns     the columns (dim 1) split into T equal chunks, the rank holding chunk r:
//               the row-parallel projections (o, down);
//   Replicated  every rank holds all of it (the norm weights).
// A shard is a parameter of its own to everything that holds weights (FlatParameters,
// FSDP, the optimizer): the same name, its own shape (parameter_specs(config, shard)).
// Its values are the whole parameter's at the same places (tensor_parallel_runs), so a
// model initialized from a seed is the same model under any degree.
enum class TensorParallelSplit { Replicated, Rows, Columns };

// A rank's place in its tensor-parallel group; {0, 1}: no tensor parallelism.
struct TensorParallelShard {
  int rank = 0, size = 1;
};

struct ParamSpec {
  std::string name;                   // forge's name, e.g. "layers.3.attention.qkv.weight"
  Shape shape;
  // Stacked along dim 0 in this order; their rows add up to shape[0] (for a stack of
  // matrices [E, R, C], to E x R). What export writes and import reads.
  std::vector<HfTensor> hf_tensors;
  bool weight_decay = true;           // false for norm weights
  int layer = -1;                     // block index, -1 for embedding / final norm / output
  // A projection into the residual stream (attention's o, the feed-forward's down): its
  // initialization is scaled by 1/sqrt(2 * layers), as GPT-2 and Megatron do.
  bool residual_projection = false;
  // Another Hugging Face name import accepts instead of hf_tensors: one tensor holding the
  // whole parameter in its own shape (transformers 5's in-memory MoE tensors, which its
  // save_pretrained(save_original_format=False) writes). Empty: none.
  std::string hf_alias = {};
  // A vector that starts at zero instead of one (a routing bias, not a norm weight).
  bool zero_init = false;
  // A stack of the routed experts' matrices, the expert along the first dim: under expert
  // parallelism a rank holds its local experts' slice (NOTE [Expert parallelism]).
  bool expert_stack = false;
  // How tensor parallelism splits it (NOTE [Tensor-parallel shards]).
  TensorParallelSplit tensor_parallel = TensorParallelSplit::Replicated;
};

// Every parameter of the model, in a fixed order: embedding, then each block's parameters
// (its components' in order, NOTE [Composed blocks]: for the Llama family attn_norm, qkv,
// o, mlp_norm, gate_up, down), then the final norm and (untied) output.
std::vector<ParamSpec> parameter_specs(const ModelConfig& config);
// The parameters tensor-parallel rank `shard` holds: the same names and order, each shaped
// as its shard (NOTE [Tensor-parallel shards]); parameter_specs(config) for shard {0, 1}.
std::vector<ParamSpec> parameter_specs(const ModelConfig& config, TensorParallelShard shard);
// The parameters of `specs` (parameter_specs order) that pipeline stages `stages` hold:
// their blocks', the embedding with the first stage, the final norm and output projection
// with the last (NOTE [Pipeline stages]); all of them for no stages.
std::vector<ParamSpec> pipeline_stage_specs(std::vector<ParamSpec> specs, const std::vector<PipelineStage>& stages);
// One parameter's shard spec; fails naming the parameter when T does not divide the split.
ParamSpec tensor_parallel_spec(const ParamSpec& full, TensorParallelShard shard);

// Values of a shard that are consecutive in the whole parameter too: shard values
// [local_begin, local_begin + count) are the whole's [full_begin, full_begin + count).
struct ShardRun {
  int64_t local_begin = 0, full_begin = 0, count = 0;
};
// The runs that make up rank `shard`'s shard of `full`, in shard order (one run for a
// replicated parameter, one per stacked tensor for Rows, one per row for Columns).
std::vector<ShardRun> tensor_parallel_runs(const ParamSpec& full, TensorParallelShard shard);

// Writes values [begin, begin + count) of one parameter's initialization (count -1: to
// the end) to `out`: the values FlatParameters::initialize gives it, computed from the
// seed, the name and the index alone, so a rank that holds a shard draws only its part.
void initialize_parameter(const ModelConfig& config, const ParamSpec& spec, uint64_t seed, float* out,
                          int64_t begin = 0, int64_t count = -1);

// Values [begin, begin + count) of specs[spec]'s initialization, to be written to out.
struct ParameterRange {
  size_t spec = 0;
  int64_t begin = 0, count = 0;
  float* out = nullptr;
};
// initialize_parameter for every range, in parallel pieces of 1M values (the values do
// not depend on how the work is split).
// Under tensor parallelism (`shard`) `specs` are the shard's and the ranges count within
// each shard: the values are the whole parameter's at the same places.
void initialize_parameter_ranges(const ModelConfig& config, const std::vector<ParamSpec>& specs, uint64_t seed,
                                 const std::vector<ParameterRange>& ranges, TensorParallelShard shard = {});

// NOTE [Block weights]
// One block's parameters (or their gradients), as a ParamSource hands them out: one entry
// per ParamSpec of the block, in parameter_specs order, each a LinearWeight descriptor
// (NOTE [Linear weight descriptor]) whose compute tensor is the parameter. Holders of
// weights (FlatParameters, FSDP) fill them from the specs alone, knowing nothing of what
// a block is made of; each component of the block reads its own consecutive entries
// through ComponentWeights, by its own numbering. A parameter that is not a projection (a
// norm weight) is read as a plain tensor; only projections are ever passed to the linear
// ops, so only they will carry more than the tensor.
struct BlockWeights {
  std::vector<LinearWeight> params;
};

// A component's entries of a block's weights: [first, first + count), numbered from 0.
class ComponentWeights {
 public:
  ComponentWeights(const BlockWeights& block, size_t first, size_t count);
  const LinearWeight& linear(size_t k) const { return at(k); }        // a projection
  const Tensor& tensor(size_t k) const { return at(k).weight; }      // any parameter's tensor

 private:
  const LinearWeight& at(size_t k) const;
  const BlockWeights* block_;
  size_t first_, count_;
};

struct ModelWeights {
  Tensor embedding;   // [V, H]
  std::vector<BlockWeights> layers;
  Tensor final_norm;  // [H]
  LinearWeight output;  // [V, H]; the embedding tensor itself when tied
};

// Where the decoder gets its weights. Single-device training hands out views of one
// flat buffer; FSDP will all-gather each block just before it is needed.
class ParamSource {
 public:
  virtual ~ParamSource() = default;
  virtual const Tensor& embedding() = 0;
  virtual const BlockWeights& layer(int index) = 0;
  virtual const Tensor& final_norm() = 0;
  virtual const LinearWeight& output() = 0;
};

// Where the decoder accumulates weight gradients (+=). head_done() is called as soon
// as the final norm's and output projection's gradients for this micro-batch are
// complete, layer_done(i) as soon as block i's are, embedding_done() when the embedding's
// are, so a distributed sink can start reducing each while the rest of the backward runs.
//
// NOTE [Fresh gradient buffers]
// A sink may hand out buffers whose contents are to be overwritten rather than added to:
// the first micro-batch of a step, or a buffer reused from another unit. The *_fresh()
// calls say so per unit (asked after the unit's buffers were handed out); the model then
// writes that unit's gradients with beta = 0 GEMMs and zeroes the few tensors it can
// only add to (norm weights, the embedding's scatter-add) instead of the sink zeroing
// every buffer first: per step that saves a write of every gradient and the first
// micro-batch's read of it. With a tied output projection the output's gradient is the
// embedding's: the head asks embedding_grad_fresh(), and after head_done() a sink must
// report the embedding as no longer fresh. Anything in a fresh buffer that is not a
// parameter (padding) is the sink's to keep zero. The defaults say "add".
class GradSink {
 public:
  virtual ~GradSink() = default;
  virtual const BlockWeights& layer_grads(int index) = 0;
  virtual void layer_done(int index) = 0;
  virtual const Tensor& embedding_grad() = 0;
  virtual void embedding_done() {}
  virtual const Tensor& final_norm_grad() = 0;
  virtual const LinearWeight& output_grad() = 0;
  virtual void head_done() {}
  virtual bool layer_grads_fresh(int /*index*/) const { return false; }
  virtual bool head_grads_fresh() const { return false; }  // final norm and untied output
  virtual bool embedding_grad_fresh() const { return false; }
};

// All parameters (or all gradients) in one contiguous buffer, viewed per tensor in
// parameter_specs order. Serves as ParamSource for the weights and GradSink for the grads
// of single-device training. fp32 on the CPU; on CUDA fp32 (master weights, gradients)
// or bf16 (the compute copy of the weights).
class FlatParameters : public ParamSource, public GradSink {
 public:
  // `shard`: a tensor-parallel rank's shards instead of the whole parameters (NOTE
  // [Tensor-parallel shards]). `stages`: a pipeline rank's stages (NOTE [Pipeline stages]),
  // whose parameters alone it holds (pipeline_stage_specs); empty: every parameter.
  explicit FlatParameters(const ModelConfig& config, Device device = Device::CPU, DType dtype = DType::F32,
                          TensorParallelShard shard = {}, std::vector<PipelineStage> stages = {});

  const ModelConfig& config() const { return config_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const Tensor& flat() const { return flat_; }
  // One view per spec, same order.
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const Tensor& find(const std::string& name) const;

  void zero() { flat_.fill_zero(); }
  // As a gradient sink: forgets what the buffers hold without touching them; the next
  // gradients of each unit are written over them (NOTE [Fresh gradient buffers]). Every
  // value is rewritten by one forward_backward, at no cost, where zero() writes them all.
  void discard();
  // Copies every value of `other` (same model), converting device and dtype as needed.
  void assign_from(const FlatParameters& other);
  // Normal(0, init_std) matrices, with the two projections that feed the residual stream
  // (o, down) scaled by 1/sqrt(2 * layers); norm weights 1, routing biases 0 (zero_init).
  // Each tensor draws from its own seeded stream, so initialization does not depend on
  // anything but the seed and name.
  // Values are drawn on the CPU in fp32 and then moved here.
  void initialize(uint64_t seed);

  const Tensor& embedding() override { return weights_.embedding; }
  const BlockWeights& layer(int index) override { return weights_.layers.at(index); }
  const Tensor& final_norm() override { return weights_.final_norm; }
  const LinearWeight& output() override { return weights_.output; }

  const BlockWeights& layer_grads(int index) override { return weights_.layers.at(index); }
  void layer_done(int index) override;
  const Tensor& embedding_grad() override { return weights_.embedding; }
  void embedding_done() override { embedding_fresh_ = false; }
  const Tensor& final_norm_grad() override { return weights_.final_norm; }
  const LinearWeight& output_grad() override { return weights_.output; }
  void head_done() override;
  bool layer_grads_fresh(int index) const override { return layers_fresh_.at(static_cast<size_t>(index)) != 0; }
  bool head_grads_fresh() const override { return head_fresh_; }
  bool embedding_grad_fresh() const override { return embedding_fresh_; }

 private:
  ModelConfig config_;
  TensorParallelShard shard_;
  std::vector<PipelineStage> stages_;
  std::vector<ParamSpec> specs_;
  Tensor flat_;
  std::vector<Tensor> tensors_;
  ModelWeights weights_;
  std::vector<char> layers_fresh_;  // NOTE [Fresh gradient buffers], per block
  bool head_fresh_ = false, embedding_fresh_ = false;
};

}  // namespace forge
