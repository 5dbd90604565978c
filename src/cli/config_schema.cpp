// The table of config keys; see config_schema.h. Adding a field to ExperimentConfig means
// adding one row here, and nothing else in the config system (but for a model or
// optimizer key with bounds: those go beside its owner's rules, which the row points at).
#include "cli/config_schema.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <type_traits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/config_suggest.h"
#include "core/error.h"
#include "model/config_rules.h"
#include "model/lora_config.h"
#include "optim/config_rules.h"

namespace forge {
namespace {

// The field reached from an ExperimentConfig through a chain of member pointers, e.g.
// field_at<&ExperimentConfig::model, &ModelConfig::rope_scaling, &RopeScaling::factor>.
template <auto... Path>
ConfigField field_at(ExperimentConfig& config) {
  return &(config .* ... .* Path);
}

template <auto... Path>
ConfigKey key(std::string name, std::string description, ValueRange range = {},
              std::vector<std::string> choices = {}) {
  using Field = std::remove_reference_t<decltype((std::declval<ExperimentConfig&>() .* ... .* Path))>;
  ConfigValueType type;
  if constexpr (std::is_same_v<Field, int64_t> || std::is_same_v<Field, uint64_t>) {
    type = ConfigValueType::Integer;
  } else if constexpr (std::is_same_v<Field, double>) {
    type = ConfigValueType::Float;
  } else if constexpr (std::is_same_v<Field, bool>) {
    type = ConfigValueType::Bool;
  } else {
    static_assert(std::is_same_v<Field, std::string>, "config fields are int64_t, uint64_t, double, bool or string");
    type = choices.empty() ? ConfigValueType::String : ConfigValueType::Enum;
  }
  return ConfigKey{std::move(name), type, std::move(description), range, std::move(choices), &field_at<Path...>};
}

using E = ExperimentConfig;
using M = ModelConfig;
using R = RopeScaling;
using T = TrainingConfig;
using O = OptimizerConfig;
using S = LRSchedulerConfig;
using D = DataConfig;

std::vector<ConfigKey> build_schema() {
  return {
      key<&E::model, &M::name>("model.name",
                               "architecture name; selects configs/models/<name>.yaml (only names the run when "
                               "checkpoint.initial_load_path is a Hugging Face model)"),
      key<&E::model, &M::vocab_size>("model.vocab_size", "number of token ids", model_bounds::vocab_size),
      key<&E::model, &M::hidden_size>("model.hidden_size", "width of the residual stream (d_model)",
                                      model_bounds::hidden_size),
      key<&E::model, &M::num_layers>("model.num_layers", "number of transformer blocks", model_bounds::num_layers),
      key<&E::model, &M::num_heads>("model.num_heads", "query heads per block", model_bounds::num_heads),
      key<&E::model, &M::num_kv_heads>("model.num_kv_heads", "key/value heads (GQA); equal to num_heads for MHA",
                                       model_bounds::num_kv_heads),
      key<&E::model, &M::head_dim>("model.head_dim", "size of one head; 0: hidden_size / num_heads",
                                   model_bounds::head_dim),
      key<&E::model, &M::ffn_hidden_size>("model.ffn_hidden_size", "SwiGLU intermediate size",
                                          model_bounds::ffn_hidden_size),
      key<&E::model, &M::num_experts>("model.num_experts",
                                      "Mixture-of-Experts: routed SwiGLU experts per block (Mixtral's "
                                      "num_local_experts, DeepSeek's n_routed_experts); 0: a dense model",
                                      model_bounds::num_experts),
      key<&E::model, &M::num_experts_per_tok>("model.num_experts_per_tok",
                                              "Mixture-of-Experts: experts each token is routed to (top-k); 0 for a "
                                              "dense model",
                                              model_bounds::num_experts_per_tok),
      key<&E::model, &M::router_aux_loss_coef>(
          "model.router_aux_loss_coef",
          "Mixture-of-Experts: weight of the load-balancing loss in the training loss (transformers' "
          "router_aux_loss_coef); 0: none",
          model_bounds::router_aux_loss_coef),
      key<&E::model, &M::router_aux_loss_type>(
          "model.router_aux_loss_type",
          "Mixture-of-Experts: which balancing loss router_aux_loss_coef weighs: pooled (transformers' Mixtral "
          "form, over all layers), per_layer (Megatron's aux_loss), sequence (Megatron's seq_aux_loss, "
          "DeepSeek's sequence-wise loss) or global (Megatron's global_aux_loss: tokens per expert summed over the "
          "data-parallel ranks and averaged over the step's micro-batches)",
          {}, model_bounds::router_aux_loss_types),
      key<&E::model, &M::router_z_loss_coef>(
          "model.router_z_loss_coef",
          "Mixture-of-Experts: weight of the router z-loss (mean logsumexp(logits)^2 per layer, summed; "
          "Megatron's moe_z_loss_coeff) in the training loss; 0: none",
          model_bounds::router_z_loss_coef),
      key<&E::model, &M::moe_capacity_factor>(
          "model.moe_capacity_factor",
          "Mixture-of-Experts: token dropping (Megatron's moe_expert_capacity_factor): each expert keeps at most "
          "ceil(tokens x top-k / num_experts x factor) of a micro-batch's assignments; 0: dropless",
          model_bounds::moe_capacity_factor),
      key<&E::model, &M::moe_token_drop_policy>(
          "model.moe_token_drop_policy",
          "Mixture-of-Experts: which assignments an expert over its capacity keeps: probs (the largest routing "
          "weights) or position (the first in token order); Megatron's moe_token_drop_policy",
          {}, model_bounds::moe_token_drop_policies),
      key<&E::model, &M::moe_pad_to_capacity>(
          "model.moe_pad_to_capacity",
          "Mixture-of-Experts: every expert runs exactly its capacity of rows, padded with zero rows, so the "
          "experts' row offsets are known without reading the GPU (Megatron's moe_pad_expert_input_to_capacity)"),
      key<&E::model, &M::moe_ffn_hidden_size>("model.moe_ffn_hidden_size",
                                              "Mixture-of-Experts: SwiGLU intermediate size of each routed and shared "
                                              "expert (DeepSeek's moe_intermediate_size); 0: ffn_hidden_size",
                                              model_bounds::moe_ffn_hidden_size),
      key<&E::model, &M::num_shared_experts>("model.num_shared_experts",
                                             "Mixture-of-Experts: experts every token goes through beside the "
                                             "routed ones (DeepSeek's n_shared_experts)",
                                             model_bounds::num_shared_experts),
      key<&E::model, &M::first_dense_layers>("model.first_dense_layers",
                                             "Mixture-of-Experts: the first blocks keep a dense SwiGLU of "
                                             "ffn_hidden_size (DeepSeek's first_k_dense_replace)",
                                             model_bounds::first_dense_layers),
      key<&E::model, &M::router_score_function>("model.router_score_function",
                                                "Mixture-of-Experts: router scores, softmax (Mixtral, DeepSeek-V2) "
                                                "or sigmoid (DeepSeek-V3)",
                                                {}, model_bounds::router_score_functions),
      key<&E::model, &M::router_normalize_topk>("model.router_normalize_topk",
                                                "Mixture-of-Experts: renormalize each token's chosen weights to sum "
                                                "to 1 (norm_topk_prob)"),
      key<&E::model, &M::router_scaling_factor>("model.router_scaling_factor",
                                                "Mixture-of-Experts: the chosen weights are multiplied by this "
                                                "(routed_scaling_factor)",
                                                model_bounds::router_scaling_factor),
      key<&E::model, &M::router_bias_update_rate>("model.router_bias_update_rate",
                                                  "Mixture-of-Experts, sigmoid routing: auxiliary-loss-free "
                                                  "balancing, each step every routing bias moves this much towards "
                                                  "the experts' mean load (Megatron's moe_router_bias_update_rate, "
                                                  "DeepSeek-V3's 0.001); 0: the biases stay",
                                                  model_bounds::router_bias_update_rate),
      key<&E::model, &M::router_num_groups>("model.router_num_groups",
                                            "Mixture-of-Experts: expert groups of group-limited routing (n_group); "
                                            "1: not limited",
                                            model_bounds::router_num_groups),
      key<&E::model, &M::router_topk_groups>("model.router_topk_groups",
                                             "Mixture-of-Experts: groups each token may choose from (topk_group)",
                                             model_bounds::router_topk_groups),
      key<&E::model, &M::q_lora_rank>("model.q_lora_rank",
                                      "Multi-head Latent Attention: rank of the compressed query projection; 0: "
                                      "queries projected directly",
                                      model_bounds::q_lora_rank),
      key<&E::model, &M::kv_lora_rank>("model.kv_lora_rank",
                                       "Multi-head Latent Attention (DeepSeek-V2/V3) when > 0: rank of the "
                                       "compressed key/value projection; 0: grouped-query attention",
                                       model_bounds::kv_lora_rank),
      key<&E::model, &M::qk_nope_head_dim>("model.qk_nope_head_dim",
                                           "Multi-head Latent Attention: query/key head dims without rotary "
                                           "embedding",
                                           model_bounds::qk_nope_head_dim),
      key<&E::model, &M::qk_rope_head_dim>("model.qk_rope_head_dim",
                                           "Multi-head Latent Attention: query/key head dims with rotary "
                                           "embedding (the key's shared by all heads)",
                                           model_bounds::qk_rope_head_dim),
      key<&E::model, &M::v_head_dim>("model.v_head_dim", "Multi-head Latent Attention: value head dims",
                                     model_bounds::v_head_dim),
      key<&E::model, &M::norm_eps>("model.norm_eps", "RMSNorm epsilon", model_bounds::norm_eps),
      key<&E::model, &M::rope_theta>("model.rope_theta", "RoPE base frequency", model_bounds::rope_theta),
      key<&E::model, &M::rope_scaling, &R::enabled>("model.rope_scaling.enabled",
                                                    "apply RoPE frequency scaling of model.rope_scaling.type"),
      key<&E::model, &M::rope_scaling, &R::type>("model.rope_scaling.type",
                                                 "llama3 (Llama 3.1's rope_type) or yarn (YaRN, DeepSeek-V2/V3)", {},
                                                 model_bounds::rope_scaling_types),
      key<&E::model, &M::rope_scaling, &R::factor>("model.rope_scaling.factor", "context extension factor",
                                                   model_bounds::rope_scaling_factor),
      key<&E::model, &M::rope_scaling, &R::low_freq_factor>("model.rope_scaling.low_freq_factor",
                                                            "wavelengths above original / this are scaled",
                                                            model_bounds::rope_scaling_low_freq_factor),
      key<&E::model, &M::rope_scaling, &R::high_freq_factor>("model.rope_scaling.high_freq_factor",
                                                             "wavelengths below original / this are kept",
                                                             model_bounds::rope_scaling_high_freq_factor),
      key<&E::model, &M::rope_scaling, &R::original_max_position>(
          "model.rope_scaling.original_max_position", "context length the model was pre-trained with",
          model_bounds::rope_scaling_original_max_position),
      key<&E::model, &M::rope_scaling, &R::beta_fast>("model.rope_scaling.beta_fast",
                                                      "yarn: rotations where the ramp to interpolation starts",
                                                      model_bounds::rope_scaling_beta),
      key<&E::model, &M::rope_scaling, &R::beta_slow>("model.rope_scaling.beta_slow",
                                                      "yarn: rotations where the ramp to interpolation ends",
                                                      model_bounds::rope_scaling_beta),
      key<&E::model, &M::rope_scaling, &R::mscale>("model.rope_scaling.mscale",
                                                   "yarn: mscale of the attention factor; 0: not set",
                                                   model_bounds::rope_scaling_mscale),
      key<&E::model, &M::rope_scaling, &R::mscale_all_dim>(
          "model.rope_scaling.mscale_all_dim",
          "yarn: mscale_all_dim of the attention factor and of MLA's softmax scale; 0: not set",
          model_bounds::rope_scaling_mscale),
      key<&E::model, &M::max_seq_len>("model.max_seq_len", "longest supported sequence (max_position_embeddings)",
                                      model_bounds::max_seq_len),
      key<&E::model, &M::sliding_window>("model.sliding_window", "attention window in tokens; 0: full causal",
                                         model_bounds::sliding_window),
      key<&E::model, &M::tie_word_embeddings>("model.tie_word_embeddings",
                                              "output projection shares the input embedding"),
      key<&E::model, &M::init_std>("model.init_std", "standard deviation of the normal weight init",
                                   model_bounds::init_std),

      key<&E::training, &T::local_batch_size>("training.local_batch_size", "micro-batch size per device",
                                              at_least(1)),
      key<&E::training, &T::global_batch_size>(
          "training.global_batch_size", "samples per optimizer step; 0: local × accumulation × dp", at_least(0)),
      key<&E::training, &T::gradient_accumulation_steps>(
          "training.gradient_accumulation_steps", "micro-batches per optimizer step; 0: from global_batch_size",
          at_least(0)),
      key<&E::training, &T::seq_len>("training.seq_len", "tokens per sample", at_least(1)),
      key<&E::training, &T::allow_longer_seq_len>(
          "training.allow_longer_seq_len",
          "allow seq_len beyond model.max_seq_len (max_position_embeddings), for long-context fine-tuning"),
      key<&E::training, &T::steps>("training.steps", "optimizer steps to run", optim_bounds::total_steps),
      key<&E::training, &T::seed>("training.seed", "seed of weight init and data order"),
      key<&E::training, &T::max_norm>("training.max_norm", "global gradient-norm clipping; 0 disables", at_least(0)),
      key<&E::training, &T::device>("training.device", "where the step runs", {}, {"cpu", "cuda"}),
      key<&E::training, &T::gemm_tuning>("training.gemm_tuning",
                                         "CUDA: time cuBLASLt's candidate algorithms per GEMM shape (bf16 and FP8) on "
                                         "first use and keep the fastest (Megatron's GEMM_TUNING)"),
      key<&E::training, &T::gemm_tuning_cache>(
          "training.gemm_tuning_cache",
          "with gemm_tuning: directory that keeps the measured choices for later runs (one file per GPU model and "
          "cuBLASLt version); empty: $FORGE_CACHE_DIR, else $XDG_CACHE_HOME/forge, else ~/.cache/forge; off: "
          "measure in every run"),
      key<&E::training, &T::on_nonfinite>("training.on_nonfinite",
                                          "a step whose loss or global gradient norm is NaN/Inf: stop the run naming "
                                          "the step, micro-batch and first non-finite tensor, or skip its optimizer "
                                          "step (Megatron's --check-for-nan-in-loss-and-grad)",
                                          {}, {"stop", "skip"}),
      key<&E::training, &T::max_skipped_steps>("training.max_skipped_steps",
                                               "with on_nonfinite or on_loss_spike skip: this many skipped steps in "
                                               "a row stop the run",
                                               at_least(1)),
      key<&E::training, &T::loss_spike_factor>(
          "training.loss_spike_factor",
          "0: off; a step whose loss exceeds this factor (above 1) × the mean of the last loss_spike_window "
          "non-spike losses is a loss spike (detection starts once min(loss_spike_window, 10) are known)",
          ValueRange{0, 1e6}),
      key<&E::training, &T::loss_spike_window>("training.loss_spike_window",
                                               "how many recent non-spike losses form the loss-spike mean",
                                               ValueRange{1, 1e6}),
      key<&E::training, &T::on_loss_spike>("training.on_loss_spike",
                                           "a loss spike: warn, skip its optimizer step (as on_nonfinite skip), or "
                                           "stop the run naming the step, its loss and the running mean",
                                           {}, {"warn", "skip", "stop"}),

      key<&E::optimizer, &O::name>("optimizer.name", "optimizer", {}, optim_bounds::optimizer_names),
      key<&E::optimizer, &O::lr>("optimizer.lr", "peak learning rate", optim_bounds::lr),
      key<&E::optimizer, &O::beta1>("optimizer.beta1", "AdamW first-moment decay", optim_bounds::beta),
      key<&E::optimizer, &O::beta2>("optimizer.beta2", "AdamW second-moment decay", optim_bounds::beta),
      key<&E::optimizer, &O::eps>("optimizer.eps", "AdamW denominator epsilon", optim_bounds::eps),
      key<&E::optimizer, &O::weight_decay>("optimizer.weight_decay", "decoupled weight decay",
                                           optim_bounds::weight_decay),
      key<&E::optimizer, &O::state_dtype>("optimizer.state_dtype",
                                          "storage of AdamW's moments (bf16: CUDA only, half the memory)", {},
                                          optim_bounds::state_dtypes),
      key<&E::optimizer, &O::master_dtype>("optimizer.master_dtype",
                                           "the weights' one copy (bf16: no fp32 master, stochastic rounding; FLUX "
                                           "on one device)",
                                           {}, optim_bounds::master_dtypes),

      key<&E::lr_scheduler, &S::warmup_steps>("lr_scheduler.warmup_steps", "linear warm-up steps",
                                              optim_bounds::warmup_steps),
      key<&E::lr_scheduler, &S::decay_style>("lr_scheduler.decay_style", "shape of the decay after warm-up", {},
                                             optim_bounds::decay_styles),
      key<&E::lr_scheduler, &S::decay_steps>("lr_scheduler.decay_steps",
                                             "steps of decay after warm-up; 0: until training ends",
                                             optim_bounds::decay_steps),
      key<&E::lr_scheduler, &S::min_lr>("lr_scheduler.min_lr", "learning rate at the end of decay",
                                        optim_bounds::min_lr),

      key<&E::data, &D::source>("data.source", "where samples come from", {},
                                {"synthetic", "mock", "indexed", "sft", "govreport_npy"}),
      key<&E::data, &D::path>("data.path",
                              "indexed/sft: path prefix of <path>.bin and <path>.idx (sft: and <path>.mask.*); "
                              "govreport_npy: the folder of train.npy and validation.npy"),
      key<&E::data, &D::blend>("data.blend",
                               "indexed: \"W1 PREFIX1 W2 PREFIX2 ...\" weighted blend instead of data.path "
                               "(Megatron --data-path)"),
      key<&E::data, &D::validation_path>("data.validation_path",
                                         "indexed: prefix of a separate validation/test dataset, read whole in file "
                                         "order, unshuffled; data.split then unused (Megatron --valid-data-path)"),
      key<&E::data, &D::split>("data.split",
                               "indexed/sft: train,validation,test weights (Megatron --split); unused with "
                               "data.validation_path"),
      key<&E::data, &D::packing>("data.packing", "sft: several examples per sample, or one padded", {},
                                 {"packed", "padded"}),
      key<&E::data, &D::overlong>("data.overlong", "sft: examples over training.seq_len + 1 tokens", {},
                                  {"truncate", "drop"}),
      key<&E::data, &D::synthetic_order>("data.synthetic_order", "synthetic: Markov order (tokens of context)",
                                         at_least(0)),
      key<&E::data, &D::synthetic_concentration>("data.synthetic_concentration",
                                                 "synthetic: sharpness of the transitions", above(0)),
      key<&E::data, &D::num_samples>("data.num_samples", "mock/synthetic: samples per epoch; 0: unbounded",
                                     at_least(0)),

      key<&E::eval, &EvalConfig::interval>("eval.interval", "evaluate every N steps and after the last; 0 disables",
                                           at_least(0)),
      key<&E::eval, &EvalConfig::steps>("eval.steps", "validation micro-batches per evaluation", at_least(1)),
      key<&E::eval, &EvalConfig::average>(
          "eval.average",
          "tokens: the loss is the mean over every counted target; micro_batches: the mean of each micro-batch's "
          "mean, as Hugging Face Trainer's eval_loss (with micro-batch 1: every sequence weighs the same)",
          {}, {"tokens", "micro_batches"}),

      key<&E::logging, &LoggingConfig::log_interval>("logging.log_interval", "console line every N steps",
                                                     at_least(1)),
      key<&E::logging, &LoggingConfig::run_dir>("logging.run_dir",
                                                "where metrics.jsonl and config.yaml go; {model} and {time} expand"),
      key<&E::logging, &LoggingConfig::profile_ops>(
          "logging.profile_ops", "time GEMM / attention / elementwise / optimizer per step (syncs the device)"),
      key<&E::logging, &LoggingConfig::enable_tensorboard>(
          "logging.enable_tensorboard", "write TensorBoard event files into run_dir (tensorboard --logdir runs)"),

      key<&E::precision, &PrecisionConfig::compute_dtype>("precision.compute_dtype", "dtype of weights and activations",
                                                          {}, {"fp32", "bf16"}),

      key<&E::precision, &PrecisionConfig::reduce_dtype>(
          "precision.reduce_dtype", "dtype of gradients in FSDP's reduce-scatter", {}, {"fp32", "bf16"}),
      key<&E::precision, &PrecisionConfig::fp8>(
          "precision.fp8",
          "FP8 GEMMs of the block projections (qkv, o, gate/up, down; under LoRA the frozen base's): none, "
          "tensorwise (current per-tensor scales, as torchao's tensorwise and Transformer Engine's "
          "Float8CurrentScaling) or delayed (scales from an amax history updated once per step, as Transformer "
          "Engine's DelayedScaling)",
          {}, {"none", "tensorwise", "delayed"}),
      key<&E::precision, &PrecisionConfig::fp8_grad_format>(
          "precision.fp8_grad_format",
          "FP8 format of the gradients in the backward GEMMs: e5m2 (default, as torchao tensorwise: gradients "
          "span a wider range than activations and weights, e5m2 reaches 57344 and down to 2^-16 where e4m3 stops "
          "at 448 and 2^-9; Transformer Engine's HYBRID does the same) or e4m3 (one more mantissa bit, less range)",
          {}, {"e5m2", "e4m3"}),
      key<&E::precision, &PrecisionConfig::fp8_output_head>(
          "precision.fp8_output_head", "with precision.fp8: the output head's GEMMs in FP8 too (default bf16, as "
          "torchtitan and Transformer Engine keep it)"),
      key<&E::precision, &PrecisionConfig::fp8_routed_experts>(
          "precision.fp8_routed_experts",
          "with precision.fp8 on a Mixture-of-Experts model: the routed experts' GEMMs in FP8 too (default true, "
          "as Transformer Engine and Megatron-LM; one GEMM per expert, since cuBLASLt has no grouped FP8 GEMM on "
          "Hopper); false keeps them in the compute dtype with the grouped GEMMs, faster for many small experts "
          "(DeepSeek-V2-Lite's 64), while every other projection stays in FP8"),
      key<&E::precision, &PrecisionConfig::fp8_weight_gradient>(
          "precision.fp8_weight_gradient",
          "with precision.fp8 in full training: the weight-gradient GEMMs (dW = dy^T x) in FP8 too (default true, "
          "as torchao tensorwise and Transformer Engine); false runs them in the compute dtype from the unquantized "
          "dy and x, the forward and input-gradient GEMMs staying in FP8 (Megatron-LM's --no-fp8-wgrad): a "
          "third of the FP8 GEMM work back at the bf16 rate, for weight gradients without FP8 rounding"),
      key<&E::precision, &PrecisionConfig::fp8_filter_fqns>(
          "precision.fp8_filter_fqns",
          "with precision.fp8: comma-separated strings; a block projection (or routed-expert stack) whose name "
          "contains one keeps its GEMMs in the compute dtype (torchtitan's float8.filter_fqns), e.g. "
          "\"layers.0.,layers.31.\" for the first and last blocks (Megatron-LM's --first-last-layers-bf16) or "
          "\"mlp.down\"; forge's parameter names: layers.N.attention.qkv.weight, layers.N.attention.o.weight, "
          "layers.N.mlp.gate_up.weight, layers.N.mlp.down.weight (a string that matches none is refused, naming "
          "the model's); empty: every block projection in FP8"),
      key<&E::precision, &PrecisionConfig::fp8_amax_history_len>(
          "precision.fp8_amax_history_len",
          "with precision.fp8 delayed: steps of amax history per tensor (Transformer Engine's amax_history_len)",
          ValueRange{1, 1 << 16}),
      key<&E::precision, &PrecisionConfig::fp8_amax_compute_algo>(
          "precision.fp8_amax_compute_algo",
          "with precision.fp8 delayed: the scale's amax, max (of the whole history) or most_recent "
          "(Transformer Engine's amax_compute_algo)",
          {}, {"max", "most_recent"}),
      key<&E::precision, &PrecisionConfig::fp8_weight_cache>(
          "precision.fp8_weight_cache",
          "with precision.fp8 on CUDA: each FP8 weight and its transpose cast once per optimizer step (under "
          "LoRA once for the run) and kept for every micro-batch (2 bytes per weight, under FSDP every weight in "
          "full; false casts them in every micro-batch)"),
      key<&E::precision, &PrecisionConfig::fp8_fsdp_all_gather>(
          "precision.fp8_fsdp_all_gather",
          "with precision.fp8 under FSDP (full training, or LoRA's frozen bf16 base): each rank casts its chunk of every block projection's "
          "weight to E4M3 and the ranks all-gather 1-byte codes instead of bf16 (torchao's "
          "enable_fsdp_float8_all_gather), bitwise the same results"),
      key<&E::precision, &PrecisionConfig::fp8_margin>(
          "precision.fp8_margin",
          "with precision.fp8 delayed: scales are fp8_max × 2^-margin / amax (Transformer Engine's margin)",
          ValueRange{0, 32}),

      key<&E::parallelism, &ParallelismConfig::data_parallel_shard_degree>(
          "parallelism.data_parallel_shard_degree",
          "ranks that shard the model (FSDP); -1: every rank the launcher started, over the replicate, "
          "tensor-parallel and context-parallel degrees",
          at_least(-1)),
      key<&E::parallelism, &ParallelismConfig::data_parallel_replicate_degree>(
          "parallelism.data_parallel_replicate_degree",
          "replicas of each shard group (hybrid sharding: shard within a node, replicate across)", at_least(1)),
      key<&E::parallelism, &ParallelismConfig::zero_stage>(
          "parallelism.zero_stage",
          "what FSDP shards: 1 optimizer state, 2 + gradients, 3 + parameters; default 3, or 1 under pipeline "
          "parallelism (the only stage it takes)",
          ValueRange{1, 3}),
      key<&E::parallelism, &ParallelismConfig::expert_parallel_degree>(
          "parallelism.expert_parallel_degree",
          "consecutive ranks that split a Mixture-of-Experts model's routed experts, tokens dispatched to them "
          "by all-to-all (1: every rank runs every expert)",
          at_least(1)),
      key<&E::parallelism, &ParallelismConfig::tensor_parallel_degree>(
          "parallelism.tensor_parallel_degree",
          "consecutive ranks that split every layer (Megatron's tensor parallelism with sequence parallelism: heads, "
          "feed-forward columns and vocabulary split, the residual stream split by tokens); 1: none",
          at_least(1)),
      key<&E::parallelism, &ParallelismConfig::enable_async_tensor_parallel>(
          "parallelism.enable_async_tensor_parallel",
          "async tensor parallelism (needs tensor_parallel_degree > 1): the blocks' all-gathers and reduce-scatters "
          "pass around a ring, one rank's rows per step, under the GEMMs of the rows already there (a collective "
          "matmul); not with precision.fp8 or LoRA"),
      key<&E::parallelism, &ParallelismConfig::context_parallel_degree>(
          "parallelism.context_parallel_degree",
          "ranks that split every sequence (load-balanced causal chunks, keys and values all-gathered for "
          "attention or passed around a ring: context_parallel_rotate_method), for long sequences; 1: none",
          at_least(1)),
      key<&E::parallelism, &ParallelismConfig::context_parallel_rotate_method>(
          "parallelism.context_parallel_rotate_method",
          "how context-parallel attention reaches the other ranks' keys and values: allgather (gather them all) "
          "or p2p (ring attention: one rank's block per step, passed to the next rank, partial attentions merged "
          "by log-sum-exp; torchtitan's alltoall ring)",
          {}, {"allgather", "p2p"}),
      key<&E::parallelism, &ParallelismConfig::pipeline_parallel_degree>(
          "parallelism.pipeline_parallel_degree",
          "ranks that hold consecutive stages of the blocks (the first also the embedding, the last the head), "
          "the step's micro-batches flowing through them; 1: none",
          at_least(1)),
      key<&E::parallelism, &ParallelismConfig::pipeline_parallel_schedule>(
          "parallelism.pipeline_parallel_schedule",
          "the pipeline schedule: 1F1B, or Interleaved1F1B (several smaller stages per rank, a smaller bubble)", {},
          {"1F1B", "Interleaved1F1B"}),
      key<&E::parallelism, &ParallelismConfig::pipeline_parallel_layers_per_stage>(
          "parallelism.pipeline_parallel_layers_per_stage",
          "blocks per pipeline stage; 0: the blocks / pipeline_parallel_degree for 1F1B, half that for "
          "Interleaved1F1B",
          at_least(0)),
      key<&E::parallelism, &ParallelismConfig::nccl_timeout_s>(
          "parallelism.nccl_timeout_s", "seconds a collective may take before the job stops, naming the rank",
          at_least(1)),
      key<&E::parallelism, &ParallelismConfig::heartbeat_timeout_s>(
          "parallelism.heartbeat_timeout_s",
          "seconds without a heartbeat after which a rank counts as failed (a rank that exits is noticed at once)",
          at_least(1)),
      key<&E::parallelism, &ParallelismConfig::rendezvous_timeout_s>(
          "parallelism.rendezvous_timeout_s", "seconds ranks wait for each other at start", at_least(1)),
      key<&E::activation_checkpoint, &ActivationCheckpointConfig::mode>(
          "activation_checkpoint.mode",
          "recompute in the backward instead of keeping: selective (norms, SwiGLU) or full (whole blocks)", {},
          {"none", "selective", "full"}),
      key<&E::activation_checkpoint, &ActivationCheckpointConfig::recompute_blocks>(
          "activation_checkpoint.recompute_blocks",
          "FLUX under full: recompute only the first N blocks, keep the rest (-1: every block)", at_least(-1)),

      key<&E::checkpoint, &CheckpointConfig::enable>("checkpoint.enable", "save checkpoints every interval steps"),
      key<&E::checkpoint, &CheckpointConfig::folder>("checkpoint.folder",
                                                     "checkpoint directory; relative to logging.run_dir"),
      key<&E::checkpoint, &CheckpointConfig::interval>("checkpoint.interval", "save every N steps", at_least(1)),
      key<&E::checkpoint, &CheckpointConfig::keep_latest_k>("checkpoint.keep_latest_k",
                                                            "keep only the newest k checkpoints; 0 keeps all",
                                                            at_least(0)),
      key<&E::checkpoint, &CheckpointConfig::load_step>("checkpoint.load_step",
                                                        "resume from this step; -1: the latest, if any",
                                                        at_least(-1)),
      key<&E::checkpoint, &CheckpointConfig::initial_load_path>(
          "checkpoint.initial_load_path",
          "start from these weights: a forge checkpoint, or a Hugging Face model directory, whose config.json then "
          "sets the model keys and model.name"),
      key<&E::checkpoint, &CheckpointConfig::initial_load_in_hf>(
          "checkpoint.initial_load_in_hf",
          "initial_load_path is a Hugging Face model directory (implied when it holds config.json)"),
      key<&E::checkpoint, &CheckpointConfig::last_save_in_hf>(
          "checkpoint.last_save_in_hf", "also export the final weights as a Hugging Face model directory"),
      key<&E::checkpoint, &CheckpointConfig::export_dtype>(
          "checkpoint.export_dtype",
          "dtype of the Hugging Face export; auto: the source model's (config.json's dtype), bf16 from scratch", {},
          {"auto", "bf16", "fp16", "fp32"}),
      key<&E::checkpoint, &CheckpointConfig::export_max_shard_size>(
          "checkpoint.export_max_shard_size",
          "largest weight file of an export (Hugging Face or diffusers), as save_pretrained's max_shard_size: 5GB, "
          "500MB, 4GiB or bytes; empty: 5GB for a language model, 10GB for FLUX (each library's default)"),
      key<&E::checkpoint, &CheckpointConfig::buffer_mb>(
          "checkpoint.buffer_mb", "host memory (MiB) a checkpoint save or load stages its data through",
          ValueRange{1, 1 << 20}),
      key<&E::checkpoint, &CheckpointConfig::async_mode>(
          "checkpoint.async_mode", "async: snapshot the state and write it while training goes on", {},
          {"disabled", "async"}),

      key<&E::lora, &LoraConfig::rank>("lora.rank", "LoRA rank r: train adapters on the frozen model; 0: off",
                                       lora_bounds::rank),
      key<&E::lora, &LoraConfig::alpha>("lora.alpha", "LoRA scaling: the update is alpha / rank * B A",
                                        lora_bounds::alpha),
      key<&E::lora, &LoraConfig::dropout>("lora.dropout", "dropout probability on the adapters' input",
                                          lora_bounds::dropout),
      key<&E::lora, &LoraConfig::target_modules>(
          "lora.target_modules",
          "adapted modules, comma-separated: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (MLA: "
          "q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj; a MoE block's router: gate), or all-linear (not on "
          "a MoE model); qkv_proj and gate_up_proj adapt the fused projection with one adapter (MLPerf's LoRA)"),
      key<&E::lora, &LoraConfig::adapter_path>(
          "lora.adapter_path", "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start "
                               "the adapters from"),
      key<&E::lora, &LoraConfig::quantize_base>(
          "lora.quantize_base", "nf4: store the frozen base projections in 4-bit NF4 (QLoRA, bitsandbytes' format)",
          {}, {"none", "nf4"}),

      key<&E::flux, &FluxRunConfig::model>(
          "flux.model",
          "train a FLUX transformer instead of a language model: flux1-dev, flux1-schnell, flux-small or flux-debug; empty: not "
          "a FLUX run"),
      key<&E::flux, &FluxRunConfig::num_double_blocks>(
          "flux.num_double_blocks", "double-stream blocks; -1: the model's (fewer for a proxy)", at_least(-1)),
      key<&E::flux, &FluxRunConfig::num_single_blocks>(
          "flux.num_single_blocks", "single-stream blocks; -1: the model's (fewer for a proxy)", at_least(-1)),
      key<&E::flux, &FluxRunConfig::resolution>("flux.resolution",
                                                "image side in pixels (a multiple of 16: the VAE's 8x, 2x2 patches)",
                                                ValueRange{16, 8192}),
      key<&E::flux, &FluxRunConfig::text_tokens>("flux.text_tokens", "T5 tokens per caption",
                                                 ValueRange{1, 4096}),
      key<&E::flux, &FluxRunConfig::guidance>(
          "flux.guidance", "guidance scale fed to a guidance-embedding model (FLUX.1-dev) in training",
          ValueRange{0, 100}),
      key<&E::flux, &FluxRunConfig::timestep_sampling>(
          "flux.timestep_sampling", "how training draws t: logit_normal (sigmoid of a normal) or uniform", {},
          {"logit_normal", "uniform"}),
      key<&E::flux, &FluxRunConfig::logit_mean>("flux.logit_mean", "mean of logit_normal's normal"),
      key<&E::flux, &FluxRunConfig::logit_std>("flux.logit_std", "standard deviation of logit_normal's normal",
                                               ValueRange{1e-6, 100}),
      key<&E::flux, &FluxRunConfig::timestep_shift>(
          "flux.timestep_shift",
          "shift of t toward noise: resolution (FLUX's, by image tokens), fixed (flux.shift) or none", {},
          {"resolution", "fixed", "none"}),
      key<&E::flux, &FluxRunConfig::shift>("flux.shift", "the fixed shift s: t' = s t / (1 + (s - 1) t)",
                                           ValueRange{1e-3, 1000}),
      key<&E::flux, &FluxRunConfig::initial_load_path>(
          "flux.initial_load_path",
          "start from these FLUX weights: a diffusers folder (or a pipeline's, with transformer/) or BFL's "
          ".safetensors file"),
      key<&E::flux, &FluxRunConfig::last_save_in_diffusers>(
          "flux.last_save_in_diffusers",
          "write the final weights as a diffusers folder to <run_dir>/diffusers, in checkpoint.export_dtype"),
      key<&E::flux, &FluxRunConfig::data_path>(
          "flux.data_path",
          "train on this latent cache (a folder forge prep --images wrote); empty: synthetic latents and text "
          "features (benchmarks)"),
      key<&E::flux, &FluxRunConfig::eval_data_path>(
          "flux.eval_data_path",
          "a validation latent cache: every eval.interval steps, the loss at the 8 fixed times t = i/8 (MLPerf "
          "Flux.1's validation loss) over eval.steps micro-batches (at most the whole cache)"),
      key<&E::flux, &FluxRunConfig::weight_init>(
          "flux.weight_init",
          "how a run that loads no weights starts: normal (every matrix N(0, 0.02)) or torchtitan (MLPerf Flux.1's "
          "reference: Xavier-uniform projections, zero modulations and output)",
          {}, {"normal", "torchtitan"}),
      // torchtitan's training.classifer_free_guidance_prob (MLPerf Flux.1: 0.1).
      key<&E::flux, &FluxRunConfig::caption_dropout_prob>(
          "flux.caption_dropout_prob",
          "probability that a training sample's caption is replaced by the empty one (classifier-free guidance); "
          "needs flux.data_path with the empty caption's encodings (forge prep --images writes them)",
          ValueRange{0, 1}),
  };
}

// " >= 1" after "an integer", or nothing for an unbounded number.
std::string describe_range(const ValueRange& range) {
  const std::string bounds = range.describe();
  return bounds.empty() ? "" : " " + bounds;
}

template <typename Number>
std::optional<Number> parse_number(const std::string& text) {
  Number value{};
  const char* end = text.data() + text.size();
  auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc() || stop != end) return std::nullopt;
  if constexpr (std::is_floating_point_v<Number>) {
    if (!std::isfinite(value)) return std::nullopt;
  }
  return value;
}

std::optional<bool> parse_bool(const std::string& text) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "true") return true;
  if (lower == "false") return false;
  return std::nullopt;
}

// NOTE [Quoting config strings]
// Strings are written plain when every YAML reader (yaml-cpp here, PyYAML for people's
// scripts) reads them back as the same string: identifier-like text that starts with a
// letter, '_', '.' or '/' and is not a YAML 1.1 boolean or null word. Anything else is
// double-quoted with escapes.
bool is_plain_safe(const std::string& text) {
  if (text.empty()) return false;
  const unsigned char first = static_cast<unsigned char>(text.front());
  if (!(std::isalpha(first) || first == '_' || first == '.' || first == '/')) return false;
  for (unsigned char c : text) {
    if (!(std::isalnum(c) || std::string_view("_.,/+-{}()=@%").find(static_cast<char>(c)) != std::string_view::npos)) {
      return false;
    }
  }
  static const std::vector<std::string> special_words = {"true", "false", "yes", "no", "on", "off", "y", "n", "null"};
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return std::find(special_words.begin(), special_words.end(), lower) == special_words.end();
}

std::string yaml_string(const std::string& text) {
  if (is_plain_safe(text)) return text;
  std::string quoted = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': quoted += "\\\""; break;
      case '\\': quoted += "\\\\"; break;
      case '\n': quoted += "\\n"; break;
      case '\t': quoted += "\\t"; break;
      default:
        if (c < 0x20) {
          quoted += fmt::format("\\x{:02x}", c);
        } else {
          quoted += static_cast<char>(c);
        }
    }
  }
  return quoted + "\"";
}

[[noreturn]] void fail_expected(const ConfigKey& key, const std::string& text, const std::string& where,
                                const std::string& hint = "") {
  FORGE_FAIL("{}: {} expects {}, got '{}'{}", where, key.name, describe_expected(key), text, hint);
}

// One accessor per key serves reads and writes alike; callers of this one only read.
ConfigField field_for_reading(const ConfigKey& key, const ExperimentConfig& config) {
  return key.field(const_cast<ExperimentConfig&>(config));
}

}  // namespace

const std::vector<ConfigKey>& config_schema() {
  static const std::vector<ConfigKey> schema = build_schema();
  return schema;
}

const std::vector<std::string>& config_sections() {
  static const std::vector<std::string> sections = {"model", "training", "optimizer", "lr_scheduler", "data",
                                                    "eval",  "logging",  "precision", "parallelism",
                                                    "activation_checkpoint", "checkpoint", "lora", "flux"};
  return sections;
}

bool is_comma_list_key(std::string_view name) {
  return name == "data.split" || name == "lora.target_modules" || name == "precision.fp8_filter_fqns";
}

const ConfigKey* find_config_key(std::string_view name) {
  for (const auto& key : config_schema()) {
    if (key.name == name) return &key;
  }
  return nullptr;
}

bool is_config_group(std::string_view prefix) {
  for (const auto& key : config_schema()) {
    if (key.name.size() > prefix.size() && key.name.starts_with(prefix) && key.name[prefix.size()] == '.') return true;
  }
  return false;
}

std::string describe_expected(const ConfigKey& key) {
  switch (key.type) {
    case ConfigValueType::Integer: return "an integer" + describe_range(key.range);
    case ConfigValueType::Float: return "a number" + describe_range(key.range);
    case ConfigValueType::Bool: return "true or false";
    case ConfigValueType::String: return "a string";
    case ConfigValueType::Enum: return fmt::format("one of {}", fmt::join(key.choices, ", "));
  }
  return "";
}

void set_config_value(const ConfigKey& key, ExperimentConfig& config, const std::string& text,
                      const std::string& where) {
  std::visit(
      [&](auto* field) {
        using Field = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<Field, bool>) {
          auto value = parse_bool(text);
          if (!value) fail_expected(key, text, where);
          *field = *value;
        } else if constexpr (std::is_same_v<Field, std::string>) {
          *field = text;
        } else {
          auto value = parse_number<Field>(text);
          if (!value) fail_expected(key, text, where);
          *field = *value;
        }
      },
      key.field(config));
  check_config_value(key, config, where);
}

void check_config_value(const ConfigKey& key, const ExperimentConfig& config, const std::string& where) {
  std::visit(
      [&](auto* field) {
        using Field = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<Field, std::string>) {
          if (key.type == ConfigValueType::Enum &&
              std::find(key.choices.begin(), key.choices.end(), *field) == key.choices.end()) {
            fail_expected(key, *field, where, did_you_mean(closest_match(*field, key.choices)));
          }
        } else if constexpr (!std::is_same_v<Field, bool>) {
          if (!key.range.contains(static_cast<double>(*field))) fail_expected(key, fmt::format("{}", *field), where);
        }
      },
      field_for_reading(key, config));
}

std::string format_config_value(const ConfigKey& key, const ExperimentConfig& config) {
  return std::visit(
      [](auto* field) -> std::string {
        using Field = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<Field, bool>) {
          return *field ? "true" : "false";
        } else if constexpr (std::is_same_v<Field, std::string>) {
          return yaml_string(*field);
        } else {
          return fmt::format("{}", *field);
        }
      },
      field_for_reading(key, config));
}

}  // namespace forge
