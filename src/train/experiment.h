// ExperimentConfig: everything a run is made of, one struct per YAML section. The cli
// layer fills it from an experiment file, the model file it names, and --section.key
// overrides; the trainer only ever sees the resolved, validated struct.
#pragma once

#include <cstdint>
#include <string>

#include "data/dataset.h"
#include "model/config.h"
#include "model/lora_config.h"
#include "optim/optimizer.h"

namespace forge {

struct TrainingConfig {
  int64_t local_batch_size = 8;      // micro-batch size per device (Megatron --micro-batch-size)
  int64_t global_batch_size = 0;     // 0: local_batch_size * gradient_accumulation_steps * dp
  int64_t gradient_accumulation_steps = 0;  // 0: derived from global_batch_size (or 1)
  int64_t seq_len = 128;
  bool allow_longer_seq_len = false; // seq_len may exceed model.max_seq_len (a warning instead of an error)
  int64_t steps = 300;
  uint64_t seed = 42;
  double max_norm = 1.0;             // global grad-norm clipping; 0 disables
  std::string device = "cpu";        // cpu | cuda
  bool gemm_tuning = false;          // time cuBLASLt's candidates per GEMM shape (NOTE [GEMM algorithm choice])
  std::string gemm_tuning_cache;     // where measured choices are kept: a directory, "" forge's cache dir, "off" none
  std::string on_nonfinite = "stop"; // stop | skip: a step whose loss or gradient norm is NaN/Inf (NOTE [Non-finite steps])
  int64_t max_skipped_steps = 5;     // skip: this many skipped steps (non-finite or loss spike) in a row stop the run
  // NOTE [Loss spikes] (train/loss_spike.h)
  double loss_spike_factor = 0;      // 0: off; a loss above factor × the recent non-spike mean is a spike
  int64_t loss_spike_window = 100;   // how many recent non-spike losses form the mean
  std::string on_loss_spike = "warn";  // warn | skip | stop
};

struct EvalConfig {
  int64_t interval = 100;            // evaluate every N steps (and after the last); 0 disables
  int64_t steps = 8;                 // validation micro-batches per evaluation
  std::string average = "tokens";    // tokens | micro_batches: how the loss is averaged (NOTE [Evaluation mean])
};

struct LoggingConfig {
  int64_t log_interval = 10;         // console line every N steps
  std::string run_dir = "runs/{model}-{time}";  // metrics.jsonl and config.yaml go here
  bool profile_ops = false;          // time per op class each step (NOTE [Op profiling])
  bool enable_tensorboard = true;    // TensorBoard event file in run_dir (tensorboard_writer.h)
};

struct PrecisionConfig {
  std::string compute_dtype = "fp32";  // fp32 (CPU reference) | bf16 (CUDA)
  std::string reduce_dtype = "fp32";   // fp32 | bf16: gradients in FSDP's reduce-scatter (torchtitan's mixed_precision_reduce)
  // FP8 GEMMs of the block projections (NOTE [FP8 projections] in model/fp8_projections.h).
  // none | tensorwise (torchao tensorwise, TE Float8CurrentScaling) | delayed (TE DelayedScaling)
  std::string fp8 = "none";
  std::string fp8_grad_format = "e5m2";  // e5m2 | e4m3: gradients' FP8 format in the backward GEMMs
  bool fp8_output_head = false;        // the output head's GEMMs in FP8 too
  // A MoE model's routed experts' GEMMs in FP8 too; false keeps them in the compute dtype
  // (NOTE [FP8 routed experts switch] in model/fp8_projections.h).
  bool fp8_routed_experts = true;
  // The block projections' weight-gradient GEMMs in FP8 too; false runs them in the compute
  // dtype (Megatron-LM's --no-fp8-wgrad; NOTE [FP8 weight gradient switch] in ops/fp8_linear.h).
  bool fp8_weight_gradient = true;
  // Comma-separated strings: a block projection whose parameter name contains one stays in
  // the compute dtype (torchtitan's float8.filter_fqns; NOTE [FP8 filter] in model/fp8_projections.h).
  std::string fp8_filter_fqns;
  // delayed (TE DelayedScaling's defaults): amax history length, max | most_recent, margin (scale × 2^-margin).
  int64_t fp8_amax_history_len = 1024;
  std::string fp8_amax_compute_algo = "max";
  int64_t fp8_margin = 0;
  // CUDA: each FP8 weight (and its transpose) cast once per optimizer step, not per micro-batch.
  bool fp8_weight_cache = true;
  // FSDP: the blocks' FP8 weights all-gathered as E4M3 codes (NOTE [FP8 all-gather] in distributed/fsdp.h).
  bool fp8_fsdp_all_gather = false;
};

// torchtitan's [activation_checkpoint] section (NOTE [Activation checkpointing]).
struct ActivationCheckpointConfig {
  std::string mode = "none";         // none | selective | full
  // A FLUX run's blocks recomputed under full, first in forward order; -1: every block
  // (NOTE [Recomputing some FLUX blocks] in model/flux_transformer.h).
  int64_t recompute_blocks = -1;
};

// Data parallelism (NOTE [FSDP] in distributed/fsdp.h), tensor parallelism (NOTE [Tensor
// parallelism] in model/tensor_parallel.h) and context parallelism (NOTE [Context
// parallelism] in model/context_parallel.h) and pipeline parallelism (NOTE [Pipeline
// parallelism] in model/pipeline.h). The launcher's world size must equal
// tensor_parallel_degree × context_parallel_degree × pipeline_parallel_degree ×
// data_parallel_replicate_degree × data_parallel_shard_degree.
struct ParallelismConfig {
  int64_t data_parallel_shard_degree = 1;      // ranks that shard parameters, gradients, optimizer state
  int64_t data_parallel_replicate_degree = 1;  // hybrid sharding: replicas of each shard group
  int64_t zero_stage = 3;                      // 1: optimizer state, 2: + gradients, 3: + parameters
  int64_t expert_parallel_degree = 1;          // ranks that split a MoE model's routed experts (NOTE [Expert parallelism])
  int64_t tensor_parallel_degree = 1;          // consecutive ranks that split every layer (NOTE [Tensor parallelism])
  int64_t context_parallel_degree = 1;         // ranks that split every sequence (NOTE [Context parallelism])
  // torchtitan's key: the blocks' tensor-parallel all-gathers and reduce-scatters run as ring
  // steps under their GEMMs' row chunks (NOTE [Async tensor parallelism] in model/sequence_parallel.h).
  bool enable_async_tensor_parallel = false;
  // torchtitan's key: "allgather" gathers every rank's keys and values, "p2p" passes them
  // around the ring (NOTE [Ring attention] in model/context_parallel_ring.h).
  std::string context_parallel_rotate_method = "allgather";
  // NOTE [Pipeline parallelism]: ranks that hold consecutive stages of the blocks, a step's
  // micro-batches (gradient_accumulation_steps) flowing through them by the schedule
  // (torchtitan's names: "1F1B", "Interleaved1F1B"); layers_per_stage 0: the blocks / the
  // degree for 1F1B, half that for Interleaved1F1B (two virtual stages per rank).
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_parallel_schedule = "1F1B";
  int64_t pipeline_parallel_layers_per_stage = 0;
  double nccl_timeout_s = 600;                 // a collective that takes longer ends the job, naming the rank
  double rendezvous_timeout_s = 300;           // how long ranks wait for each other at start
  double heartbeat_timeout_s = 60;             // a rank silent this long failed (NOTE [Failure detection])
};

// Checkpoints, named as torchtitan's [checkpoint] section.
struct CheckpointConfig {
  bool enable = false;               // periodic saves every `interval` steps plus a final one
  std::string folder = "checkpoints";  // relative to logging.run_dir unless absolute
  int64_t interval = 500;
  int64_t keep_latest_k = 0;         // keep only the newest k checkpoints; 0 keeps all
  int64_t load_step = -1;            // resume from this step; -1: the latest in folder, if any
  std::string initial_load_path;     // start from these weights (a forge checkpoint or a Hugging Face dir)
  bool initial_load_in_hf = false;   // initial_load_path is a Hugging Face model directory
  bool last_save_in_hf = false;      // also export the final weights as a Hugging Face model directory
  std::string export_dtype = "auto"; // auto | bf16 | fp16 | fp32; auto is resolved by the cli (the source's, else bf16)
  std::string export_max_shard_size;  // where exported weight files are cut, as save_pretrained's max_shard_size
                                     // ("5GB", "500MB", "4GiB", bytes); empty: the format's default (5GB, diffusers 10GB)
  int64_t buffer_mb = 256;           // host staging of a save or load, MiB (NOTE [Streaming checkpoints])
  std::string async_mode = "disabled";  // disabled | async: write while training goes on (NOTE [Async checkpoints])
};

// A FLUX run (NOTE [FLUX runs] in train/flux_trainer.h): flux.model names the
// transformer; empty for a language model's run. Proxies keep the model's dimensions with
// fewer blocks.
struct FluxRunConfig {
  std::string model;                    // "" | flux1-dev | flux1-schnell | flux-small | flux-debug
  int64_t num_double_blocks = -1;       // -1: the model's
  int64_t num_single_blocks = -1;       // -1: the model's
  int64_t resolution = 1024;            // image side in pixels, a multiple of 16
  int64_t text_tokens = 512;            // T5 tokens per caption
  double guidance = 1.0;                // guidance scale fed to a guidance-embedding model in training
  std::string timestep_sampling = "logit_normal";  // logit_normal | uniform
  double logit_mean = 0.0;
  double logit_std = 1.0;
  std::string timestep_shift = "resolution";       // resolution | fixed | none
  double shift = 3.0;                   // the fixed shift
  std::string initial_load_path;        // start from these weights: a diffusers folder or BFL's file
  bool last_save_in_diffusers = false;  // write the final weights to <run_dir>/diffusers
  std::string data_path;                // a latent cache (forge prep --images); empty: synthetic batches
  std::string eval_data_path;           // a validation latent cache: the loss at 8 fixed times (NOTE [FLUX validation loss])
  std::string weight_init = "normal";   // normal | torchtitan (NOTE [FLUX weight init])
  double caption_dropout_prob = 0.0;    // per sample, train on the empty caption (NOTE [FLUX caption dropout])
};

struct ExperimentConfig {
  ModelConfig model;
  TrainingConfig training;
  OptimizerConfig optimizer;
  LRSchedulerConfig lr_scheduler;
  DataConfig data;
  EvalConfig eval;
  LoggingConfig logging;
  PrecisionConfig precision;
  ParallelismConfig parallelism;
  ActivationCheckpointConfig activation_checkpoint;
  CheckpointConfig checkpoint;
  LoraConfig lora;
  FluxRunConfig flux;
};

}  // namespace forge
