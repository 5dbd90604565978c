// The Mixture-of-Experts feed-forward component of a block (NOTE [Composed blocks]), as
// Mixtral's (transformers' MixtralSparseMoeBlock) and DeepSeek's (DeepseekV2Moe /
// DeepseekV3MoE), in place of SwiGluFeedForward when model.num_experts > 0.
//
// NOTE [MoE feed-forward]
//   h = rmsnorm(x);  logits = h W_router^T;  out = x + sum_j w_j * expert_{e_j}(h) + shared(h)
// with e_j and w_j each token's num_experts_per_tok experts and their weights (NOTE [MoE
// routing] in ops/moe.h: softmax or sigmoid scores, renormalized or not, scaled, group-limited,
// as the config says), every routed expert a SwiGLU feed-forward of moe_ffn_hidden_size
// (gate/up fused, then down), and `shared` DeepSeek's shared experts: one SwiGLU of
// num_shared_experts x moe_ffn_hidden_size that every token goes through (absent when 0).
// It is composed from the MoE ops: route, permute the normalized tokens by expert, each
// expert's two GEMMs on its own rows (an expert with no tokens runs nothing; dropless unless
// model.moe_capacity_factor > 0, NOTE [MoE capacity] in ops/moe.h, which drops what exceeds
// an expert's capacity and may pad every expert to it), combine into the residual stream, which the shared experts' down
// projection has already added to. The routed weights are stacked per block: the router
// [E, hidden], the experts' gate/up [E, 2F, hidden] and down [E, hidden, F] (transformers'
// MixtralExperts layout; Hugging Face names: NOTE [MoE Hugging Face names]). Under
// selective checkpointing a layer keeps its GEMM outputs and routing and recomputes its
// normalized input, their permutation and the SwiGLUs; under full checkpointing the
// decoder reruns the whole forward before the backward, the routing included, which gives
// the same routing (lay_out says what is kept where). On CUDA the routing is written into
// per-layer buffers of the arena (MoeRoutingBuffers), the router's GEMMs read the logits'
// gradient in bf16, and the balancing loss's gradient is copied to the device once per
// micro-batch. DeepSeek's dense first blocks are SwiGluFeedForward (SplitByLayer).
// Sigmoid routing (DeepSeek-V3's) chooses on scores plus a per-expert bias, a parameter of
// the block (Hugging Face's e_score_correction_bias) that takes no gradient: its gradient is
// always zero, so AdamW (without weight decay, as every 1-D parameter) leaves it where
// import or initialization (zeros) put it, as transformers' training does, unless
// model.router_bias_update_rate moves it after each step (auxiliary-loss-free balancing:
// NOTE [Routing bias update] in train/trainer.cpp). Under expert parallelism (NOTE [Expert
// parallelism] in model/expert_dispatch.h) the block holds its local experts' slices of the
// stacked weights, and the permuted rows travel to the experts' ranks and back between the
// permutation and the combine (ExpertExchange); everything else is as on one rank. What is
// not built yet (issue 20): the z-loss with sigmoid routing; configs refuse it.
//
// NOTE [MoE balancing loss]
// With model.router_aux_loss_coef c > 0 the training loss is, as transformers' Mixtral's
// with output_router_logits: cross-entropy + c x L_aux, L_aux the Switch balancing loss over
// all the model's MoE layers pooled (moe_balancing_loss over every layer's routing: f and P
// over layers x tokens rows, every token of the micro-batch, masked targets included). The
// decoder adds c x L_aux x the micro-batch's targets to its loss sum and gives the component
// the weight of the micro-batch's mean (targets x grad_scale: 1 for a lone micro-batch), so
// over accumulated micro-batches the step's loss and gradient take each micro-batch's L_aux
// weighted by its share of the targets, as its cross-entropy. Its gradient enters each
// layer's router through the softmax's probabilities (moe_route_backward). Evaluation
// reports the cross-entropy alone.
// model.router_aux_loss_type picks the balancing loss (NOTE [MoE routing] in ops/moe.h has
// the formulas): "pooled" the above; "per_layer" Megatron-Core's aux_loss, each layer's
// (E/k) sum_e f_e P_e over that layer's N = batch x seq tokens, summed over the layers;
// "sequence" its seq_aux_loss (DeepSeek-V2/V3's sequence-wise balance loss), the same over
// each row of the micro-batch's [batch, seq] tokens, averaged over the rows, summed over the
// layers (moe_grouped_balancing_loss; its gradient is a [batch, E] probability gradient per
// layer); "global" its global_aux_loss (moe_switch_balancing_loss, NOTE [MoE routing]): per
// layer E / (k T^2) sum_e c_e P_e with P_e the sum of this rank's own probabilities over its
// N tokens, T = N x the data-parallel ranks, and c_e the layer's tokens per expert (before
// any drop) summed over those ranks, added to the optimizer step's earlier micro-batches'
// and divided by the step's micro-batches so far (MoeStepCounts: micro-batch 2's loss takes
// the average of micro-batches 1 and 2), summed over the layers. The sum over the ranks is
// one reduction of [layers, E] counts per micro-batch through DataParallelCounts (the
// trainer's data-parallel ranks; none on one rank), which synchronizes the host as the
// other forms already do (they read the counts and the probabilities' sums on the host).
// begin_step starts the step's counts over; the trainer calls it before each step's first
// micro-batch, as Megatron resets them (reset_global_aux_loss_tracker) once the step's
// gradients are done. The gradient flows through the rank's own probabilities only:
// E c_e / (k T^2) for each. On one rank a step's first micro-batch gives the per_layer loss;
// on P ranks the ranks' losses add up to the loss of their tokens together, so a balanced
// routing gives each rank about 1 / P of the per_layer value, and the step (which averages
// the ranks' micro-batches, as Megatron's gradient does) weighs it so.
// model.router_z_loss_coef c_z adds the router z-loss, Megatron's z_loss_func: per layer c_z
// x the mean over the N tokens of logsumexp(logits)^2, summed over layers; its
// gradient, c_z x 2 lse_t softmax(logits_t) / N, enters the router's logits in
// moe_route_backward from the logsumexp the routing kept (with sigmoid routing also the
// logits' softmax, which the routing then keeps: [N, E] fp32 per layer). Every one of them is computed over the micro-batch's
// tokens (masked targets included, as Megatron without a padding mask) and weighted in the
// step as the pooled loss: its value x the micro-batch's share of the step's targets, and
// the same factor on its gradient (gradient_weight). Megatron weights them per micro-batch
// differently: without calculate_per_token_loss MoEAuxLossAutoScaler scales each
// micro-batch's auxiliary-loss gradient by 1 / num_microbatches (the main loss's scale), so
// every micro-batch counts the same; with it, by the micro-batch's tokens over the step's.
// The two agree when every micro-batch has as many targets as the others (forge's share
// counts targets, not masked ones; Megatron's tokens every token). Within one micro-batch the
// values and gradients are Megatron's (tests/python/test_moe_vs_megatron.py). Megatron's
// coefficient of aux_loss is divided by top-k in the loss and applies per layer, so the same
// coefficient weighs differently from the pooled form's.
//
// NOTE [Pooled balancing loss across stages]
// The pooled loss is E sum_e f_e P_e with f_e = A_e / R and P_e = S_e / R: A_e the tokens
// routed to expert e (before any drop) and S_e the sum of its probabilities, both over every
// MoE block's tokens, R the blocks x the tokens. Its gradient with respect to each
// probability, E A_e / R^2, is the same for every token of every block and needs the whole
// model's A and R. Under pipeline parallelism no stage holds every block, so the statistics
// [A_0 .. A_E-1, S_0 .. S_E-1, R] (2 E + 1 doubles, moe_add_balancing_statistics) travel
// with the micro-batch: a stage's training forward adds its blocks' statistics, block after
// block, to the running sums that came with its input (zeros on the first stage) and sends
// them on with its output (DecoderLM::stage_output_statistics); the last stage so holds the
// whole model's, adds the coefficient x the loss x the micro-batch's targets to its loss sum
// and gives its routers the gradient, weighted as auxiliary_loss's, and sends the statistics
// back with its input gradient; every earlier stage receives them with its output gradient,
// gives its routers the gradient before its backward and passes them on with its own input
// gradient. No collective of its own: PipelineModel::exchange moves each statistics buffer
// as a second message to the same peer right after its tensor (pairs match by order, NOTE
// [Point-to-point] in distributed/process_group.h), an I64 buffer holding the doubles' bits,
// so nothing is rounded on the way; every (chunk, micro-batch) stage model has its own
// buffers, so the interleaved schedule's micro-batches never share them. One rank's
// moe_balancing_loss is the same additions in the same order (moe_add_balancing_statistics
// over the blocks from zeros, then the loss from the statistics): where the stages' routings
// are one rank's bit for bit (the CPU reference: the same ops on the same inputs), so are the
// statistics, the loss and each router's float gradient; the step's loss sum differs only in
// adding the pooled term to a stage's sum apart from the z-loss (double rounding). As without
// pipelining, the statistics are the rank's own tokens', never reduced: a data-parallel
// rank's pipeline carries its own, and under expert parallelism a rank's routing is its own
// tokens' before they are dispatched. Evaluation reports the cross-entropy alone and
// carries nothing.
//
// NOTE [Global balancing loss across stages]
// The global form (NOTE [MoE balancing loss]) needs nothing from other stages: each layer's
// loss takes that layer's counts alone, so a stage's blocks' losses are their share of the
// sum over the layers, as the per_layer form's. What a stage must see is its layers' counts
// of the step's micro-batches so far, summed over the data-parallel ranks, at each forward,
// where the loss and its gradient (the backward's, copied into the micro-batch's model) are
// made: one rank counts no pass ahead either (Megatron's micro-batch k takes the average of
// micro-batches 1 .. k, not the step's), so neither does a stage. Under pipelining a
// chunk's micro-batches in flight live in DecoderLMs of their own (NOTE [Pipeline
// parallelism] in model/pipeline.h), each of whose components would keep its own
// MoeStepCounts; PipelineModel makes them share the chunk's first model's
// (DecoderLM::share_step_state, one MoeStepCounts per MoE component of the chunk), starts
// it over at each forward_backward (a step), and checks that each chunk's forwards come in
// micro-batch order, which both schedules' do: micro-batch k's forward on a chunk then
// follows the chunk's forwards of micro-batches 0 .. k - 1 and averages exactly the counts
// one rank's k-th forward does, for the chunk's layers (the averages are sums of integers
// divided by k: bit for bit one rank's). The reduction over the data-parallel ranks
// (DataParallelCounts, PipelineModel::set_data_parallel_counts) is one per chunk and
// micro-batch, over the stage's data-parallel ranks (under expert parallelism the
// expert-parallel groups lie among them): they hold the same chunks and walk the same
// schedule, so their k-th reductions are the same chunk's forward of the same micro-batch,
// and they sit in the same place among the stage's other collectives (the all-to-alls of
// expert parallelism, FSDP's gathers and reductions) on every one of them. Backward,
// recomputation and evaluation count nothing.
//
// NOTE [MoE Hugging Face names]
// Mixtral's names are the published Mixtral checkpoints' (mistralai/Mixtral-8x7B-v0.1),
// which transformers 4 loads as they are and transformers 5 converts on load and writes back
// on save_pretrained: per block model.layers.N.block_sparse_moe.gate.weight [E, hidden] (the
// router), and per expert e .block_sparse_moe.experts.e.w1.weight (gate, [F, hidden]),
// .w3.weight (up, [F, hidden]) and .w2.weight (down, [hidden, F]). Row-major, gate/up
// [E, 2F, hidden] is E blocks of (w1, w3) and down [E, hidden, F] E blocks of w2, so each is
// a slice of the stack's rows (NOTE [Fused projections] in model/parameters.h). DeepSeek's
// (deepseek-ai/DeepSeek-V2-Lite, a model with Multi-head Latent Attention, shared experts or
// dense first blocks) are .mlp.gate.weight, .mlp.experts.e.gate_proj/up_proj/down_proj.weight
// and the shared experts' .mlp.shared_experts.gate_proj/up_proj/down_proj.weight. Import
// also accepts transformers 5's in-memory names, whole stacks in forge's own layout, which
// its save_pretrained(save_original_format=False) writes: .mlp.gate.weight,
// .mlp.experts.gate_up_proj and .mlp.experts.down_proj (ParamSpec::hf_alias). Export
// writes the published names, which both transformers 4 and 5 load.
#pragma once

#include <memory>
#include <vector>

#include "model/block_component.h"
#include "model/config.h"
#include "model/expert_exchange.h"
#include "ops/moe.h"

namespace forge {

class MoeFeedForward final : public BlockComponent {
 public:
  explicit MoeFeedForward(const ModelConfig& config);

  std::vector<ParamSpec> param_specs(int layer) const override;
  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) override;
  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override;
  void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) override;
  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_hidden) override;
  // Dropless routing reads each token alone; with a capacity an expert's kept tokens depend
  // on the whole micro-batch.
  bool position_wise() const override { return capacity_.factor == 0.0; }
  std::vector<int64_t> expert_load(int layer) const override;
  double auxiliary_loss(double gradient_weight) override;
  // NOTE [Pooled balancing loss across stages].
  void pool_balancing_across_stages() override;
  void add_pooled_statistics(std::vector<double>& statistics) const override;
  void set_pooled_balance(const std::vector<double>& statistics, double gradient_weight) override;
  void set_expert_dispatch(ExpertDispatch* dispatch) override;
  void set_data_parallel_counts(DataParallelCounts* counts) override;
  void begin_step() override;
  // NOTE [Global balancing loss across stages]: the step's counts kept in `owner`'s.
  void share_step_state(BlockComponent& owner) override;

 private:
  // ComponentWeights numbering, param_specs order: the shared experts' two only with them,
  // then with sigmoid routing the router's per-expert bias (bias_index_).
  enum Param : size_t { kNorm, kRouter, kGateUp, kDown, kSharedGateUp, kSharedDown };

  struct Activations {
    Tensor rstd;            // [N] fp32
    Tensor normed;          // [N, H]
    MoeRoutingBuffers routing_buffers;
    MoeRouting routing;     // this micro-batch's, in routing_buffers
    MoeExpertBuffers rows;  // [N * k, ...] in expert order; [E x capacity, ...] with padding
    // Expert parallelism: the rows this rank's experts received, [P N k, ...] sorted by
    // local expert (their expert_out is the shared scratch local_out_), and the traffic.
    MoeExpertBuffers local;
    ExpertExchange::Plan plan;
    Tensor shared_gate_up;  // [N, 2 Fs]: the shared experts' (with them)
    Tensor shared_swiglu;   // [N, Fs]
  };

  std::vector<const MoeRouting*> routings() const;  // every layer's, from the last forward

  MoeRouting route(const ComponentWeights& w, const MoeRoutingBuffers& buffers);
  // The experts' buffers and routing of a layer's own GEMMs: the layer's rows, or under
  // expert parallelism its received rows (narrowed to what arrived) and the local routing.
  MoeExpertBuffers expert_rows(const Activations& a) const;
  const MoeRouting& expert_routing(const Activations& a) const { return exchange_ ? a.plan.local : a.routing; }
  MoeExpertWeights expert_weights(const ComponentWeights& w) const;
  // Expert parallelism: where layer `layer` keeps its received rows this micro-batch (NOTE
  // [Received-row pool] in moe_feed_forward.cpp).
  void take_received(int layer, Activations& a);

  int64_t hidden_, ffn_, experts_, top_k_;
  int64_t shared_ffn_;  // the shared experts' SwiGLU size; 0: none
  bool deepseek_names_;  // NOTE [MoE Hugging Face names]
  bool sigmoid_, normalize_;
  float scaling_;
  int64_t groups_, topk_groups_;
  size_t bias_index_;  // sigmoid routing: where the router's bias is among the parameters
  float eps_;
  double aux_coefficient_;
  enum class AuxLoss { kPooled, kPerLayer, kSequence, kGlobal } aux_type_;  // NOTE [MoE balancing loss]
  bool pooled_across_stages_ = false;  // NOTE [Pooled balancing loss across stages]
  double z_coefficient_;
  MoeCapacity capacity_;   // NOTE [MoE capacity]: factor 0, dropless
  int64_t sequences_ = 1;  // the micro-batch's rows (the sequence-wise loss's groups)
  std::unique_ptr<ExpertExchange> exchange_;  // expert parallelism (degree > 1) only
  // The global balancing loss: the data-parallel ranks' counts (null: one rank), and every
  // layer's tokens per expert over the optimizer step's micro-batches ([layers x experts]),
  // which the models of one pipeline stage share (share_step_state).
  DataParallelCounts* data_parallel_ = nullptr;
  std::shared_ptr<MoeStepCounts> step_counts_ = std::make_shared<MoeStepCounts>();
  int64_t expert_parallel_ = 1;               // the degree the buffers were laid out for
  std::vector<Activations> layers_;
  Tensor logits_;  // [N, E] fp32, the router's output: read only by the routing
  Tensor bias_;    // [E] fp32: sigmoid routing's bias, cast from the compute weights on CUDA
  // The balancing loss's probability gradient, weighted, F32: pooled [E] (every layer's),
  // per_layer and global [layers, E], sequence [layers, sequences, E]; used in the backward when
  // auxiliary_loss gave it. z_scale_: the z-loss's 2 c_z / N, weighted (0: none).
  Tensor aux_gradient_;
  bool aux_gradient_used_ = false;
  double z_scale_ = 0.0;
  Tensor layer_aux_gradient(int layer) const;  // this layer's rows of aux_gradient_
  // aux_gradient_ = gradient x the coefficient x gradient_weight (F32), when the weight is not 0.
  void set_aux_gradient(const std::vector<double>& gradient, double gradient_weight);
  // Backward scratch.
  Tensor d_expert_out_, d_swiglu_, d_gate_up_, d_permuted_, d_weights_, d_logits_, d_logits_compute_;
  Tensor d_shared_swiglu_, d_shared_gate_up_;
  // Expert parallelism's scratch, [P N k, H]: arrivals before the sort, the local experts'
  // outputs, and the backward's local gradients.
  // permuted_: the layer's own permuted rows before they leave, [N k, H].
  Tensor permuted_, staging_, local_out_, d_local_out_, d_local_permuted_;
  // The kept received rows of every layer, kReceivedSlack x N k rows per layer (NOTE
  // [Received-row pool]); swiglu only without checkpointing. rows 0: no pool.
  static constexpr int64_t kReceivedSlack = 2;
  struct ReceivedPool {
    Tensor permuted, gate_up, swiglu;
    int64_t rows = 0, top = 0;
    bool overflowed = false;
  } pool_;
};

}  // namespace forge
