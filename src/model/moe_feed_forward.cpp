#include "model/moe_feed_forward.h"

#include <fmt/format.h>

#include "core/device.h"
#include "core/log.h"

#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/moe_fp8.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace forge {

MoeFeedForward::MoeFeedForward(const ModelConfig& config)
    : hidden_(config.hidden_size),
      ffn_(config.resolved_moe_ffn()),
      experts_(config.num_experts),
      top_k_(config.num_experts_per_tok),
      shared_ffn_(config.num_shared_experts * config.resolved_moe_ffn()),
      deepseek_names_(config.mla() || config.num_shared_experts > 0 || config.first_dense_layers > 0),
      sigmoid_(config.router_score_function == "sigmoid"),
      normalize_(config.router_normalize_topk),
      scaling_(static_cast<float>(config.router_scaling_factor)),
      groups_(config.router_num_groups),
      topk_groups_(config.router_topk_groups),
      bias_index_(config.num_shared_experts > 0 ? kSharedDown + 1 : kDown + 1),
      eps_(static_cast<float>(config.norm_eps)),
      aux_coefficient_(config.router_aux_loss_coef),
      aux_type_(config.router_aux_loss_type == "sequence"    ? AuxLoss::kSequence
                : config.router_aux_loss_type == "per_layer" ? AuxLoss::kPerLayer
                : config.router_aux_loss_type == "global"    ? AuxLoss::kGlobal
                                                             : AuxLoss::kPooled),
      z_coefficient_(config.router_z_loss_coef),
      capacity_{config.moe_capacity_factor, config.moe_token_drop_policy == "position", config.moe_pad_to_capacity} {}

// NOTE [MoE Hugging Face names] in moe_feed_forward.h.
std::vector<ParamSpec> MoeFeedForward::param_specs(int layer) const {
  const std::string p = fmt::format("layers.{}.", layer), hf = fmt::format("model.layers.{}.", layer);
  const std::string moe = hf + (deepseek_names_ ? "mlp." : "block_sparse_moe.");
  std::vector<HfTensor> gate_up, down;
  for (int64_t e = 0; e < experts_; ++e) {
    const std::string expert = fmt::format("{}experts.{}.", moe, e);
    gate_up.push_back({expert + (deepseek_names_ ? "gate_proj.weight" : "w1.weight"), ffn_});
    gate_up.push_back({expert + (deepseek_names_ ? "up_proj.weight" : "w3.weight"), ffn_});
    down.push_back({expert + (deepseek_names_ ? "down_proj.weight" : "w2.weight"), hidden_});
  }
  std::vector<ParamSpec> specs(bias_index_ + (sigmoid_ ? 1 : 0));
  specs[kNorm] = {p + "mlp_norm.weight", {hidden_}, {{hf + "post_attention_layernorm.weight", hidden_}}, false, layer};
  specs[kRouter] = {p + "moe.router.weight", {experts_, hidden_}, {{moe + "gate.weight", experts_}}, true, layer,
                    false, deepseek_names_ ? "" : hf + "mlp.gate.weight"};
  specs[kGateUp] = {p + "moe.experts.gate_up", {experts_, 2 * ffn_, hidden_}, std::move(gate_up), true, layer,
                    false, hf + "mlp.experts.gate_up_proj"};
  specs[kDown] = {p + "moe.experts.down", {experts_, hidden_, ffn_}, std::move(down), true, layer,
                  true, hf + "mlp.experts.down_proj"};
  specs[kGateUp].expert_stack = specs[kDown].expert_stack = true;
  if (shared_ffn_ > 0) {
    const std::string shared = moe + "shared_experts.";
    specs[kSharedGateUp] = {p + "moe.shared.gate_up.weight",
                            {2 * shared_ffn_, hidden_},
                            {{shared + "gate_proj.weight", shared_ffn_}, {shared + "up_proj.weight", shared_ffn_}},
                            true,
                            layer};
    specs[kSharedDown] = {p + "moe.shared.down.weight", {hidden_, shared_ffn_}, {{shared + "down_proj.weight", hidden_}},
                          true, layer, true};
  }
  if (sigmoid_) {
    specs[bias_index_] = {p + "moe.router.bias",
                          {experts_},
                          {{moe + "gate.e_score_correction_bias", experts_, {}, /*keep_fp32=*/true}},
                          false,
                          layer};
    specs[bias_index_].zero_init = true;
  }
  return specs;
}

// What each layer keeps (NOTE [Activation checkpointing]): the routing always (small, and
// read after the forward: expert loads, the balancing loss); the router's logits never
// (the backward reads the probabilities). none: everything. selective: the GEMM outputs
// (gate/up, the experts' outputs) and the norm's statistics; the normalized input, its
// permutation and SwiGLU are recomputed (recompute_selective). full: one shared set, the
// block's forward rerun before its backward.
void MoeFeedForward::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode,
                             int num_layers) {
  // The permuted rows: N k, or with padding E x capacity (NOTE [MoE capacity]).
  const int64_t n = shape.tokens(), rows = capacity_.permuted_rows(n, top_k_, experts_);
  // Expert parallelism: a rank may receive every row of its group (NOTE [Expert parallelism]).
  expert_parallel_ = shape.expert_parallel;
  const int64_t received = mul_or_fail(rows, expert_parallel_, "the rows a rank's experts may receive");
  const bool ep = expert_parallel_ > 1;
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  auto stat = [&](Shape s) { return layout.take(std::move(s), DType::F32); };
  auto index = [&](Shape s) { return layout.take(std::move(s), DType::I32); };
  // Under expert parallelism the experts' GEMMs run on the received rows (a.local): their
  // input is kept (it came over the network), their SwiGLU recomputed under selective
  // checkpointing; the layer's own permuted rows are scratch, its expert outputs (returned)
  // kept for the combine's backward. What each layer keeps of its received rows is taken
  // from the received-row pool (NOTE [Received-row pool]), except under full checkpointing,
  // whose one shared set is laid out for the most a rank can receive.
  auto costly = [&](Activations& a) {
    a.rstd = stat({n});
    a.rows.expert_out = act({rows, hidden_});
    if (!ep) a.rows.gate_up = act({rows, 2 * ffn_});
    else if (mode == ActivationCheckpoint::Full) {
      a.local.permuted = act({received, hidden_});
      a.local.gate_up = act({received, 2 * ffn_});
    }
    if (shared_ffn_ > 0) a.shared_gate_up = act({n, 2 * shared_ffn_});
  };
  auto cheap = [&](Activations& a) {
    a.normed = act({n, hidden_});
    if (ep) {
      if (mode != ActivationCheckpoint::None) a.local.swiglu = act({received, ffn_});  // one shared set
    } else {
      a.rows.permuted = act({rows, hidden_});
      a.rows.swiglu = act({rows, ffn_});
    }
    if (shared_ffn_ > 0) a.shared_swiglu = act({n, shared_ffn_});
  };
  logits_ = stat({n, experts_});
  layers_ = lay_out_layers<Activations>(num_layers, mode, costly, cheap);
  for (Activations& a : layers_) {  // in every mode
    const bool dropping = capacity_.factor > 0;  // offsets: the kept and the assigned running sums
    a.routing_buffers = {stat({n, experts_}),
                         index({n, top_k_}),
                         stat({n, top_k_}),
                         index({rows}),
                         index({n * top_k_}),
                         layout.take(dropping ? Shape{2, experts_ + 1} : Shape{experts_ + 1}, DType::I64),
                         stat({experts_}),
                         !sigmoid_ || z_coefficient_ != 0.0 ? stat({n}) : Tensor(),  // lse: the z-loss's
                         dropping ? index({n * top_k_}) : Tensor(),
                         sigmoid_ && z_coefficient_ != 0.0 ? stat({n, experts_}) : Tensor()};  // and its softmax
  }
  sequences_ = shape.micro_batch;
  d_expert_out_ = act({rows, hidden_});
  d_swiglu_ = act({received, ffn_});
  d_gate_up_ = act({received, 2 * ffn_});
  d_permuted_ = act({rows, hidden_});
  pool_ = {};
  if (ep) {
    permuted_ = act({rows, hidden_});
    staging_ = act({received, hidden_});
    local_out_ = act({received, hidden_});  // the forward's; the backward's d_local_out_ reuses it
    d_local_out_ = local_out_;
    d_local_permuted_ = act({received, hidden_});
    for (Activations& a : layers_) {
      a.rows.permuted = permuted_;
      a.local.expert_out = local_out_;
    }
    if (mode != ActivationCheckpoint::Full) {  // NOTE [Received-row pool]
      pool_.rows = mul_or_fail(mul_or_fail(rows, num_layers, "the received-row pool"), kReceivedSlack,
                               "the received-row pool");
      pool_.permuted = act({pool_.rows, hidden_});
      pool_.gate_up = act({pool_.rows, 2 * ffn_});
      if (mode == ActivationCheckpoint::None) pool_.swiglu = act({pool_.rows, ffn_});
    }
  }
  d_weights_ = stat({n, top_k_});
  d_logits_ = stat({n, experts_});
  d_logits_compute_ = act({n, experts_});
  const int64_t layers = static_cast<int64_t>(layers_.size());
  aux_gradient_ = aux_type_ == AuxLoss::kPooled     ? stat({experts_})
                  : aux_type_ == AuxLoss::kSequence ? stat({layers, sequences_, experts_})
                                                    : stat({layers, experts_});  // per_layer, global
  if (sigmoid_) bias_ = stat({experts_});
  if (shared_ffn_ > 0) {
    d_shared_swiglu_ = act({n, shared_ffn_});
    d_shared_gate_up_ = act({n, 2 * shared_ffn_});
  }
}

MoeRouting MoeFeedForward::route(const ComponentWeights& w, const MoeRoutingBuffers& buffers) {
  if (!sigmoid_)
    return moe_route_softmax(logits_, top_k_, groups_, topk_groups_, normalize_, scaling_, buffers, capacity_);
  const Tensor& bias = w.tensor(bias_index_);
  if (bias.dtype() != DType::F32) cast(bias_, bias);  // the routing reads it in fp32
  return moe_route_sigmoid(logits_, bias.dtype() == DType::F32 ? bias : bias_, top_k_, groups_, topk_groups_, normalize_,
                           scaling_, buffers, capacity_);
}

void MoeFeedForward::set_expert_dispatch(ExpertDispatch* dispatch) {
  exchange_ = dispatch && dispatch->size() > 1 ? std::make_unique<ExpertExchange>(*dispatch, experts_) : nullptr;
}

void MoeFeedForward::set_data_parallel_counts(DataParallelCounts* counts) { data_parallel_ = counts; }

void MoeFeedForward::begin_step() { step_counts_->reset(); }

void MoeFeedForward::share_step_state(BlockComponent& owner) {
  auto* other = dynamic_cast<MoeFeedForward*>(&owner);
  FORGE_CHECK(other && other->experts_ == experts_ && other->layers_.size() == layers_.size(),
              "MoeFeedForward: step state shared with another kind of component or another number of blocks");
  step_counts_ = other->step_counts_;
}

// NOTE [Received-row pool]
// Under expert parallelism a rank's experts receive a different number of rows in every
// layer and micro-batch: N k on average (each rank sends its N k rows, which the group's
// ranks share), up to P N k when the whole group chooses its experts. Laying out every
// layer's kept rows for P N k would multiply those activations by P, so under no and
// selective checkpointing the layers take what they keep (the received rows, their gate/up
// GEMM output, and without checkpointing their SwiGLU) from one pool, in forward order: the
// first MoE layer of a micro-batch's forward starts it over, each layer takes exactly its
// received rows. The pool holds kReceivedSlack x N k rows per layer. A micro-batch whose
// layers receive more than that in all (a routing far from balanced on this rank) gets
// the rest of its layers' rows from fresh device allocations, logged once per run: slower
// (an allocation synchronizes) but never wrong. Full checkpointing keeps one set for every
// layer, laid out for P N k rows; the scratch shared by all layers is laid out for P N k
// too.
void MoeFeedForward::take_received(int layer, Activations& a) {
  if (pool_.rows == 0) return;  // full checkpointing: the shared set
  if (layer == 0) pool_.top = 0;
  const int64_t r = a.plan.received;
  if (pool_.top + r <= pool_.rows) {
    a.local.permuted = pool_.permuted.narrow(pool_.top, pool_.top + r);
    a.local.gate_up = pool_.gate_up.narrow(pool_.top, pool_.top + r);
    if (pool_.swiglu.defined()) a.local.swiglu = pool_.swiglu.narrow(pool_.top, pool_.top + r);
    pool_.top += r;
    return;
  }
  if (!pool_.overflowed)
    log_warn("expert parallelism: MoE layer {} received {} rows, past the received-row pool ({} of its {} rows "
             "taken by the layers before it): its rows and those of later layers that do not fit are allocated "
             "on the device (NOTE [Received-row pool]; logged once)",
             layer, r, pool_.top, pool_.rows);
  pool_.overflowed = true;
  const Device device = pool_.permuted.device();
  const DType dtype = pool_.permuted.dtype();
  a.local.permuted = Tensor::empty({r, hidden_}, dtype, device);
  a.local.gate_up = Tensor::empty({r, 2 * ffn_}, dtype, device);
  if (pool_.swiglu.defined()) a.local.swiglu = Tensor::empty({r, ffn_}, dtype, device);
}

namespace {

// NOTE [FP8 routed experts] in ops/moe_fp8.h: the expert stacks' FP8 settings, when they have them.
// Under FSDP's FP8 all-gather with the stacks' per-expert gathered scales (NOTE [FP8
// all-gather pieces] in distributed/fsdp_fp8_pieces.h).
MoeExpertFp8 expert_fp8(const LinearWeight& gate_up, const LinearWeight& down) {
  return {gate_up.fp8, down.fp8, 0, gate_up.fp8_gathered, down.fp8_gathered};
}

// Under expert parallelism: with the statistics blocks of the rank's local experts, from
// `first` on (NOTE [FP8 routed experts under expert parallelism] in ops/moe_fp8.h).
MoeExpertFp8 local_experts_fp8(MoeExpertFp8 fp8, int64_t first) {
  fp8.first_expert = first;
  return fp8;
}

}  // namespace

MoeExpertBuffers MoeFeedForward::expert_rows(const Activations& a) const {
  if (!exchange_) return a.rows;
  const int64_t r = a.plan.received;
  return {a.local.permuted.narrow(0, r), a.local.gate_up.narrow(0, r), a.local.swiglu.narrow(0, r),
          a.local.expert_out.narrow(0, r)};
}

// The stacked experts' weights (or gradients) of this rank: all E, or under expert
// parallelism its local experts' slices (the ParamSource hands out those alone).
MoeExpertWeights MoeFeedForward::expert_weights(const ComponentWeights& w) const {
  // With LoRA on the routed experts, their adapters too (NOTE [LoRA on routed experts]).
  const MoeExpertWeights e{w.tensor(kGateUp), w.tensor(kDown), w.linear(kGateUp).experts_lora,
                           w.linear(kDown).experts_lora};
  if (!e.gate_up.defined() && !e.down.defined()) return e;  // frozen experts' gradients (LoRA): none
  const int64_t held = exchange_ ? exchange_->local_experts() : experts_;
  FORGE_CHECK(e.gate_up.dim(0) == held && e.down.dim(0) == held,
              "MoE block: the weights hold {} experts, this rank computes with {} (expert parallelism {} of {})",
              e.gate_up.dim(0), held, exchange_ ? exchange_->size() : 1, experts_);
  FORGE_CHECK((exchange_ ? exchange_->size() : 1) == expert_parallel_,
              "MoE block: laid out for expert parallelism {}, dispatching over {} ranks", expert_parallel_,
              exchange_ ? exchange_->size() : 1);
  return e;
}

// NOTE [Expert exchange overlap]
// Under expert parallelism a layer's rows cross the group twice in the forward (the
// dispatch to the experts' ranks, the combine back) and twice in the backward (the output
// gradients out, the input gradients back), and on CUDA each all-to-all runs on the
// dispatch's communication stream (ExpertDispatch::exchange_rows_start), after the compute
// stream's work so far, while the compute stream goes on with work that neither writes the
// rows being sent nor touches the rows being received, and waits for the exchange
// (exchange_wait) only right before it reads them. That work is the shared experts' (the
// SwiGLU every token goes through, DeepSeek's), which reads the normalized input and the
// stream's gradient only, as Megatron-LM's moe_shared_expert_overlap and DeepSeek-V3 place
// it. Which part goes beside which exchange:
//  - forward: the gate/up GEMM and the SwiGLU beside the dispatch, the down GEMM (out =
//    x + shared(h)) beside the combine, Megatron's split (linear_fc1 during the dispatch,
//    linear_fc2 during the combine). The two exchanges move the same rows, so they take
//    about as long; the gate/up GEMM is twice the down GEMM's work, but the dispatch is the
//    only place it can go (the combine comes after the routed experts, and nothing of
//    theirs needs it), and the down GEMM needs the SwiGLU, so it cannot go before the
//    dispatch's wait; the whole shared forward beside the dispatch would leave the combine
//    bare. The count exchange before the dispatch (dropless routing) is a few bytes whose
//    answer the host waits for, since it sizes the received rows: it runs on the same stream
//    and so overlaps the permutation, not the shared experts.
//  - backward: the down GEMM's backward (the weight gradient and the SwiGLU's gradient)
//    and the SwiGLU's backward beside the gradients' dispatch, the gate/up weight gradient
//    beside their combine; the gate/up input gradient is added to dL/dh after the
//    permutation's and the router's gradients, as before, since the order of those three
//    additions fixes dL/dh's rounding.
// Nothing changes what is computed or the order in which anything is added into a buffer:
// each shared-expert op writes buffers of its own (or `out`, which the combine then adds
// the routed experts' share to, as without the overlap), so the results are bit for bit the
// sequential ones, which the CPU process group still computes (each exchange done when
// exchange_rows_start returns). Without shared experts there is nothing to put beside the
// exchanges, and the compute stream waits for each right after starting it. The buffers:
// the dispatch reads the layer's permuted rows (or the outputs' gradient) and writes the
// staging rows, which the compute stream reads (sorts) only after the wait; the combine
// reads the staging rows and writes the permuted outputs (or the inputs' gradient), which the
// compute stream touches only after its wait; every exchange is waited for within the
// layer's call, so the next layer (or micro-batch, or pipeline stage's model sharing the
// dispatch) never writes a buffer an exchange still reads. Recomputation reruns this forward
// (full checkpointing) or only SwiGLUs (selective), so both keep working as they are.
void MoeFeedForward::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_);
  linear_forward(logits_, a.normed, w.linear(kRouter));
  a.routing = route(w, a.routing_buffers);
  moe_permute(a.rows.permuted, a.normed, a.routing);
  const MoeExpertFp8 fp8 = expert_fp8(w.linear(kGateUp), w.linear(kDown));
  const bool shared_down = shared_ffn_ > 0 && out;  // out = x + shared(h), before the routed experts' share
  auto shared_up = [&] {
    linear_forward(a.shared_gate_up, a.normed, w.linear(kSharedGateUp));
    swiglu_forward(a.shared_swiglu, a.shared_gate_up);
  };
  if (exchange_) {  // NOTE [Expert parallelism]: to the experts' ranks, through them, and back
    a.plan = exchange_->plan(a.routing);
    take_received(layer, a);
    exchange_->dispatch_start(a.plan, a.rows.permuted, staging_);
    if (shared_ffn_ > 0) shared_up();  // NOTE [Expert exchange overlap]: beside the dispatch
    exchange_->dispatch_finish(a.plan, a.local.permuted, staging_);
    if (fp8.enabled())  // NOTE [FP8 routed experts under expert parallelism]
      moe_experts_forward_fp8(expert_rows(a), expert_weights(w), a.plan.local,
                              local_experts_fp8(fp8, exchange_->first_expert()));
    else
      moe_experts_forward(expert_rows(a), expert_weights(w), a.plan.local);
    exchange_->combine_start(a.plan, a.rows.expert_out, a.local.expert_out, staging_);
    if (shared_down) linear_forward(*out, a.shared_swiglu, w.linear(kSharedDown), &x);  // beside the combine
    exchange_->combine_finish();
  } else {
    if (fp8.enabled()) moe_experts_forward_fp8(a.rows, expert_weights(w), a.routing, fp8);
    else moe_experts_forward(a.rows, expert_weights(w), a.routing);
    if (shared_ffn_ > 0) shared_up();
    if (shared_down) linear_forward(*out, a.shared_swiglu, w.linear(kSharedDown), &x);
  }
  if (!out) return;
  // The routed experts' share added to out = x + shared(h), or to x.
  moe_combine(*out, a.rows.expert_out, a.routing, shared_ffn_ > 0 ? out : &x);
}

void MoeFeedForward::recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) {
  Activations& a = layers_.at(static_cast<size_t>(layer));  // routing, gate/up and expert outputs kept
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_);
  if (exchange_) {  // the received rows were kept: only their SwiGLU
    const MoeExpertBuffers local = expert_rows(a);
    if (a.plan.received > 0) swiglu_forward(local.swiglu, local.gate_up);
  } else {
    moe_permute(a.rows.permuted, a.normed, a.routing);
    swiglu_forward(a.rows.swiglu, a.rows.gate_up);
  }
  if (shared_ffn_ > 0) swiglu_forward(a.shared_swiglu, a.shared_gate_up);
}

// The assignments each expert kept (NOTE [MoE capacity]: after the drop, without padding;
// Megatron's routing map after dropping, which its bias update counts too; with padding
// Megatron's map also holds its padding tokens, every expert at capacity, so that its bias
// update stands still where forge's still sees the kept loads).
std::vector<int64_t> MoeFeedForward::expert_load(int layer) const {
  const MoeRouting& r = layers_.at(static_cast<size_t>(layer)).routing;
  if (r.offsets.empty()) return std::vector<int64_t>(static_cast<size_t>(experts_), 0);  // no forward yet
  return moe_expert_counts(r).kept;
}

std::vector<const MoeRouting*> MoeFeedForward::routings() const {
  std::vector<const MoeRouting*> all;
  for (const Activations& a : layers_) all.push_back(&a.routing);
  return all;
}

// NOTE [MoE balancing loss].
double MoeFeedForward::auxiliary_loss(double gradient_weight) {
  aux_gradient_used_ = false;
  z_scale_ = 0.0;
  double loss = 0.0;
  if (z_coefficient_ != 0.0) {
    for (const MoeRouting* r : routings()) loss += z_coefficient_ * moe_z_loss(*r);
    const int64_t n = layers_.front().routing.tokens;
    if (n > 0) z_scale_ = 2.0 * z_coefficient_ / static_cast<double>(n) * gradient_weight;
  }
  if (aux_coefficient_ == 0.0) return loss;
  if (aux_type_ == AuxLoss::kPooled && pooled_across_stages_) return loss;  // set_pooled_balance's
  std::vector<double> gradient;  // aux_gradient_'s values, unweighted: copied to the device once
  if (aux_type_ == AuxLoss::kPooled) {
    const MoeBalance balance = moe_balancing_loss(routings());
    loss += aux_coefficient_ * balance.loss;
    gradient = balance.prob_gradient;
  } else if (aux_type_ == AuxLoss::kGlobal) {
    // Every layer's tokens per expert (before any drop), summed over the data-parallel ranks
    // in one reduction, added to the step's and averaged over its micro-batches so far; each
    // layer's loss takes them with its own probabilities, over every rank's tokens.
    std::vector<int64_t> counts;
    for (const MoeRouting* r : routings()) {
      const std::vector<int64_t> layer = moe_expert_counts(*r).assigned;
      counts.insert(counts.end(), layer.begin(), layer.end());
    }
    const int64_t ranks = data_parallel_ ? data_parallel_->data_parallel_ranks() : 1;
    if (ranks > 1) counts = data_parallel_->counts_over_ranks(counts);
    const std::vector<double> average = step_counts_->add(counts);
    const std::vector<const MoeRouting*> all = routings();
    for (size_t layer = 0; layer < all.size(); ++layer) {
      const auto first = average.begin() + static_cast<std::ptrdiff_t>(layer * static_cast<size_t>(experts_));
      const MoeBalance balance = moe_switch_balancing_loss(
          *all[layer], std::vector<double>(first, first + experts_),
          static_cast<double>(all[layer]->tokens) * static_cast<double>(ranks));
      loss += aux_coefficient_ * balance.loss;
      gradient.insert(gradient.end(), balance.prob_gradient.begin(), balance.prob_gradient.end());
    }
  } else {
    for (const MoeRouting* r : routings()) {
      const MoeBalance balance = moe_grouped_balancing_loss(*r, aux_type_ == AuxLoss::kSequence ? sequences_ : 1);
      loss += aux_coefficient_ * balance.loss;
      gradient.insert(gradient.end(), balance.prob_gradient.begin(), balance.prob_gradient.end());
    }
  }
  set_aux_gradient(gradient, gradient_weight);
  return loss;
}

void MoeFeedForward::set_aux_gradient(const std::vector<double>& gradient, double gradient_weight) {
  if (gradient_weight == 0.0) return;
  FORGE_CHECK(static_cast<int64_t>(gradient.size()) == aux_gradient_.numel(),
              "MoeFeedForward: {} balancing-loss gradients for a buffer of {}", gradient.size(), aux_gradient_.numel());
  std::vector<float> g(gradient.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(gradient[i] * aux_coefficient_ * gradient_weight);
  copy_bytes(aux_gradient_.raw(), aux_gradient_.device(), g.data(), Device::CPU, g.size() * sizeof(float));
  aux_gradient_used_ = true;
}

// NOTE [Pooled balancing loss across stages].
void MoeFeedForward::pool_balancing_across_stages() {
  pooled_across_stages_ = aux_type_ == AuxLoss::kPooled && aux_coefficient_ != 0.0;
}

void MoeFeedForward::add_pooled_statistics(std::vector<double>& statistics) const {
  if (!pooled_across_stages_) return;
  for (const MoeRouting* r : routings()) moe_add_balancing_statistics(statistics, *r);
}

void MoeFeedForward::set_pooled_balance(const std::vector<double>& statistics, double gradient_weight) {
  if (!pooled_across_stages_) return;
  set_aux_gradient(moe_statistics_balancing_loss(statistics).prob_gradient, gradient_weight);
}

Tensor MoeFeedForward::layer_aux_gradient(int layer) const {
  if (aux_type_ == AuxLoss::kPooled) return aux_gradient_;
  const Tensor rows = aux_gradient_.narrow(layer, layer + 1);
  return aux_type_ == AuxLoss::kSequence ? rows.view({sequences_, experts_}) : rows.view({experts_});
}

void MoeFeedForward::backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                              const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  if (overwrite) {
    grads.tensor(kNorm).fill_zero();  // the norm's backward adds
    if (sigmoid_) grads.tensor(bias_index_).fill_zero();  // the bias takes no gradient
  }
  // out = x + combine(experts(permute(h)), routing(h W_router^T)) + shared(h)
  moe_combine_backward(d_expert_out_, d_weights_, d_stream, a.rows.expert_out, a.routing);
  // The shared experts' weights' gradients, and dL/d(their gate/up output): everything of
  // theirs but dL/dh, which is added last.
  auto shared_down_backward = [&] {
    linear_backward(d_shared_swiglu_, grads.linear(kSharedDown), d_stream, a.shared_swiglu, w.linear(kSharedDown),
                    overwrite);
    swiglu_backward(d_shared_gate_up_, d_shared_swiglu_, a.shared_gate_up);
  };
  auto shared_up_weight_backward = [&] {
    linear_backward_weight(grads.linear(kSharedGateUp), d_shared_gate_up_, a.normed, overwrite);
  };
  if (exchange_) {  // the outputs' gradients to the experts' ranks, the inputs' back
    const int64_t r = a.plan.received;
    exchange_->dispatch_start(a.plan, d_expert_out_, staging_);
    if (shared_ffn_ > 0) shared_down_backward();  // NOTE [Expert exchange overlap]: beside the dispatch
    exchange_->dispatch_finish(a.plan, d_local_out_, staging_);
    if (const MoeExpertFp8 fp8 = expert_fp8(w.linear(kGateUp), w.linear(kDown)); fp8.enabled())
      moe_experts_backward_fp8(d_local_permuted_.narrow(0, r), expert_weights(grads), overwrite,
                               d_local_out_.narrow(0, r), expert_rows(a), expert_weights(w), a.plan.local,
                               d_swiglu_.narrow(0, r), d_gate_up_.narrow(0, r),
                               local_experts_fp8(fp8, exchange_->first_expert()));
    else
      moe_experts_backward(d_local_permuted_.narrow(0, r), expert_weights(grads), overwrite, d_local_out_.narrow(0, r),
                           expert_rows(a), expert_weights(w), a.plan.local, d_swiglu_.narrow(0, r),
                           d_gate_up_.narrow(0, r));
    exchange_->combine_start(a.plan, d_permuted_, d_local_permuted_, staging_);
    if (shared_ffn_ > 0) shared_up_weight_backward();  // beside the combine
    exchange_->combine_finish();
  } else if (const MoeExpertFp8 fp8 = expert_fp8(w.linear(kGateUp), w.linear(kDown)); fp8.enabled()) {
    moe_experts_backward_fp8(d_permuted_, expert_weights(grads), overwrite, d_expert_out_, a.rows, expert_weights(w),
                             a.routing, d_swiglu_, d_gate_up_, fp8);
  } else {
    moe_experts_backward(d_permuted_, expert_weights(grads), overwrite, d_expert_out_, a.rows, expert_weights(w),
                         a.routing, d_swiglu_, d_gate_up_);
  }
  moe_permute_backward(d_hidden, d_permuted_, a.routing);  // dL/dh through the experts
  const Tensor aux_gradient = aux_gradient_used_ ? layer_aux_gradient(layer) : Tensor();
  moe_route_backward(d_logits_, d_weights_, a.routing, aux_gradient_used_ ? &aux_gradient : nullptr, z_scale_);
  // The router's GEMMs read the logits' gradient in the compute dtype (bf16 on CUDA, as
  // its forward reads h); dL/dh through the router is added to d_hidden by the GEMM.
  cast(d_logits_compute_, d_logits_);
  linear_backward_weight(grads.linear(kRouter), d_logits_compute_, a.normed, overwrite);
  linear_backward_input_add(d_hidden, d_logits_compute_, w.linear(kRouter));
  if (shared_ffn_ > 0) {  // out += shared(h): its weights' gradients (under expert parallelism done beside the
                          // exchanges), and dL/dh through it added last
    if (!exchange_) {
      shared_down_backward();
      shared_up_weight_backward();
    }
    linear_backward_input_add(d_hidden, d_shared_gate_up_, w.linear(kSharedGateUp));
  }
  rmsnorm_backward(d_stream, grads.tensor(kNorm), d_hidden, x, w.tensor(kNorm), a.rstd);
}

}  // namespace forge
