// The trainer's side of Hugging Face models: starting from one
// (checkpoint.initial_load_in_hf) and exporting the final weights as one
// (checkpoint.last_save_in_hf, into <run_dir>/hf, in checkpoint.export_dtype). The ckpt layer reads and writes fp32
// weights in host memory; on CUDA the master weights pass through a host copy. Under tensor
// parallelism each rank reads only its shards of the imported tensors, under pipeline
// parallelism only its stages' tensors. Under pipeline, tensor or data parallelism every rank
// writes its own values into the export's files (NOTE [Export in pieces]), except LoRA's
// merged export and expert parallelism's without pipelining, which are gathered to rank 0:
// the same files as one rank's either way.
#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "ckpt/hf_layout.h"
#include "ckpt/peft_adapter.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>

#include "core/log.h"
#include "distributed/tensor_parallel_gather.h"
#include "ops/elementwise.h"
#include "train/export_in_pieces.h"
#include "train/trainer.h"

namespace forge {

void Trainer::load_initial_hf_weights(const std::string& dir) {
  if (fsdp_) {
    // Every rank reads the model one parameter at a time and keeps its segments (a LoRA
    // run's frozen base too: NOTE [Frozen FSDP base]): the host holds the largest
    // parameter in fp32, not the model. Under tensor parallelism each parameter is the
    // rank's shard of it, and only the shard is read.
    // A pipeline rank reads its stages' parameters alone (FSDP over a stage's parameters).
    for_each_hf_parameter(
        dir, config_.model, [&](size_t spec, const Tensor& values) { fsdp_->set_parameter(spec, values); },
        tensor_parallel_shard_, pipeline_stages_);
    fsdp_->refresh_compute_weights(false);
    return;
  }
  if (config_.lora.quantize_base == "nf4") {
    // NOTE [QLoRA base]: each parameter quantized (or cast) as it is read, so the host holds
    // one parameter in fp32 at a time (a resumed run imports and quantizes again, to
    // bitwise the same codes).
    nf4_base_.reset();
    // A pipeline rank imports and quantizes its stages' parameters alone (NOTE [LoRA under
    // pipeline parallelism]).
    // An expert-parallel rank keeps its experts' (NOTE [NF4 expert stacks under expert parallelism]).
    // A tensor-parallel rank reads and quantizes its shards alone (NOTE [NF4 base under tensor parallelism]).
    nf4_base_ = std::make_unique<Nf4FrozenBase>(config_.model, device_, device_ == Device::CUDA ? DType::BF16 : DType::F32,
                                                pipeline_stages_, expert_shard(), tensor_parallel_shard_);
    // NOTE [NF4 stored row order]: DeepSeek's rotary rows quantized in the published order.
    const bool interleaved = read_weight_layout(dir).interleaved_rotary;
    const std::vector<ParamSpec> specs = parameter_specs(config_.model);
    std::map<std::string, size_t> held;
    for (size_t k = 0; k < nf4_base_->specs().size(); ++k) held[nf4_base_->specs()[k].name] = k;
    for_each_hf_parameter(
        dir, config_.model,
        [&](size_t spec, const Tensor& values) {
          nf4_base_->set(held.at(specs[spec].name), values, hf_stored_rows(specs[spec], interleaved));
        },
        tensor_parallel_shard_, pipeline_stages_);
    nf4_base_->finish();
    if (fp8_) fp8_->set_base(*nf4_base_);  // NOTE [FP8 over an NF4 base] in model/nf4_base.cpp
    lora_->set_base(fp8_ ? static_cast<ParamSource&>(*fp8_) : *nf4_base_);
    return log_info("QLoRA: the base's projections quantized to NF4 at import (the frozen base holds {:.2f} MiB on {}: "
                    "NF4 codes and statistics {:.2f} MiB, the rest and the dequantization scratch in {})",
                    static_cast<double>(nf4_base_->nbytes()) / (1024.0 * 1024.0), device_name(device_),
                    static_cast<double>(nf4_base_->codes().nbytes()) / (1024.0 * 1024.0),
                    config_.precision.compute_dtype);
  }
  if (tensor_parallel_ || pipeline_) {
    // The rank's shards (NOTE [Tensor-parallel shards]) of its stages' parameters (NOTE
    // [Pipeline stages]), read one parameter at a time.
    const std::vector<ParamSpec> specs = parameter_specs(config_.model);
    std::map<std::string, size_t> held;
    for (size_t k = 0; k < params_->specs().size(); ++k) held[params_->specs()[k].name] = k;
    for_each_hf_parameter(
        dir, config_.model,
        [&](size_t spec, const Tensor& values) {
          const Tensor& into = params_->tensors()[held.at(specs[spec].name)];
          if (into.dtype() == values.dtype()) into.copy_from(values);
          else cast(into, values.to(into.device()));  // a LoRA run's frozen base in bf16 (NOTE [LoRA training])
        },
        tensor_parallel_shard_, pipeline_stages_);
  } else if (params_->flat().device() == Device::CPU) {
    load_hf_weights_checked(dir, *params_);
  } else {
    FlatParameters host(config_.model);
    load_hf_weights_checked(dir, host);
    params_->assign_from(host);
  }
  if (compute_weights_) compute_weights_->assign_from(*params_);
}

void Trainer::load_fsdp_chunks(const FlatParameters& host) {
  if (pipeline_) {  // the rank's stages' parameters (NOTE [LoRA under pipeline parallelism]), each to its segments
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < fsdp_->layout().specs().size(); ++i) index[fsdp_->layout().specs()[i].name] = i;
    for (size_t k = 0; k < host.specs().size(); ++k) fsdp_->set_parameter(index.at(host.specs()[k].name), host.tensors()[k]);
    return fsdp_->refresh_compute_weights(false);
  }
  const float* flat = host.flat().data<float>();
  fsdp_->load_master([&](int64_t offset, std::span<float> out) { std::copy_n(flat + offset, out.size(), out.data()); });
}

void Trainer::export_hf_model() {
  HfExportOptions options;
  options.dtype = export_safetensors_dtype(config_.checkpoint.export_dtype);  // checked before training
  options.max_shard_bytes = export_max_shard_bytes(config_.checkpoint.export_max_shard_size, options.max_shard_bytes);
  if (config_.checkpoint.initial_load_in_hf) options.source_dir = config_.checkpoint.initial_load_path;
  const std::string dir = run_dir_ + "/hf";
  // NOTE [Export in pieces]: no rank gathers the model when each holds a part of it.
  const bool parts = fsdp_ || tensor_parallel_;
  if (pipeline_ || (parts && !lora_ && config_.parallelism.expert_parallel_degree == 1))
    return export_hf_model_in_pieces(dir, options);
  if (tensor_parallel_) return export_tensor_parallel_hf_model(dir, options);
  if (fsdp_) {
    // LoRA (NOTE [LoRA under data parallelism]) merges into the whole base, and expert
    // parallelism's experts are gathered whole (the piecewise writer takes no expert slices).
    std::vector<float> flat;
    fsdp_->gather_to_host(fsdp_->master_segments(), flat);
    if (rank_ != 0) return;
    FlatParameters host(config_.model);
    std::copy(flat.begin(), flat.end(), host.flat().data<float>());
    if (!lora_) return save_hf_model(dir, host, options);
    lora_->merge_into(host);
    save_hf_model(dir, host, options);
    return log_info("exported the base model with the LoRA adapters merged to {}", dir);
  }
  if (nf4_base_ && nf4_base_->experts().size > 1) return export_expert_parallel_qlora_model(dir, options);
  if (rank_ != 0) return;  // QLoRA under data parallelism: every rank holds the same model
  if (lora_) {
    // The merged model: base + alpha / rank * B A for every adapted module. A QLoRA base
    // is dequantized first, as PEFT's merge_and_unload does on a bitsandbytes 4-bit model.
    FlatParameters host(config_.model);
    if (nf4_base_) nf4_base_->dequantize_into(host);
    else host.assign_from(*params_);
    lora_->merge_into(host);
    save_hf_model(dir, host, options);
    return log_info("exported the base model with the LoRA adapters merged to {}", dir);
  }
  if (params_->flat().device() == Device::CPU) return save_hf_model(dir, *params_, options);
  FlatParameters host(config_.model);
  host.assign_from(*params_);
  save_hf_model(dir, host, options);
}

// Under tensor parallelism each rank holds its shards (NOTE [Tensor-parallel shards]): the
// data-parallel rank 0 of each tensor-parallel rank gets them whole on the host (FSDP
// gathers its chunks), and the tensor-parallel group of world rank 0 gathers them into the
// whole model there, which is exported as one rank's would be (the same files).
void Trainer::export_tensor_parallel_hf_model(const std::string& dir, const HfExportOptions& options) {
  std::vector<float> local;
  if (fsdp_) {
    fsdp_->gather_to_host(fsdp_->master_segments(), local);
  } else if (nf4_base_) {
    // NOTE [NF4 base under tensor parallelism]: the rank's shards dequantized, as PEFT's
    // merge_and_unload dequantizes a 4-bit base, then gathered as LoRA's bf16 shards are.
    FlatParameters shards(config_.model, Device::CPU, DType::F32, tensor_parallel_shard_);
    nf4_base_->dequantize_into(shards);
    local.assign(shards.flat().data<float>(), shards.flat().data<float>() + shards.flat().numel());
  } else {
    // A LoRA run's frozen base is in the compute dtype (NOTE [LoRA training]).
    Tensor values = params_->flat();
    if (values.dtype() != DType::F32) {
      values = Tensor::empty(params_->flat().shape(), DType::F32, params_->flat().device());
      cast(values, params_->flat());
    }
    local.resize(static_cast<size_t>(values.numel()));
    copy_bytes(local.data(), Device::CPU, values.raw(), values.device(), local.size() * sizeof(float));
  }
  std::optional<FlatParameters> host;
  if (rank_ == 0) host.emplace(config_.model);
  const std::span<float> whole =
      host ? std::span<float>(host->flat().data<float>(), static_cast<size_t>(host->flat().numel())) : std::span<float>();
  gather_tensor_parallel_shards(*tensor_parallel_group_, device_, config_.model, local, whole);
  if (!host) return;
  if (lora_) lora_->merge_into(*host);  // NOTE [LoRA under context and tensor parallelism]: the whole adapters
  save_hf_model(dir, *host, options);
  if (lora_) log_info("exported the base model with the LoRA adapters merged to {}", dir);
}

// NOTE [NF4 expert stacks under expert parallelism]: world rank 0's expert-parallel group
// (ranks 0 to P - 1) holds every expert once. Rank 0 dequantizes its base into the whole
// model; the others dequantize their experts' stacks, one at a time, and send them to rank 0,
// which puts each at its experts' places (P - 1 slices of one stack in flight, on the device).
// Rank 0 then merges the whole adapters and writes the model as one rank's export.
void Trainer::export_expert_parallel_qlora_model(const std::string& dir, const HfExportOptions& options) {
  const ExpertShard experts = nf4_base_->experts();
  if (rank_ >= experts.size) return;  // another group's ranks: rank 0's (ranks 0 to P - 1) holds every expert
  std::optional<FlatParameters> host;
  if (rank_ == 0) {
    host.emplace(config_.model);
    nf4_base_->dequantize_into(*host);
  }
  const std::vector<ParamSpec>& specs = nf4_base_->specs();
  for (size_t k = 0; k < specs.size(); ++k) {
    if (!specs[k].expert_stack) continue;
    const int64_t held = specs[k].shape[0];
    std::vector<PointToPoint> ops;
    Tensor received;
    if (rank_ == 0) {
      Shape whole = specs[k].shape;
      whole[0] *= experts.size;
      received = Tensor::empty(whole, DType::F32, device_);
      for (int q = 1; q < experts.size; ++q)
        ops.push_back(PointToPoint::recv(q, received.narrow(q * held, (q + 1) * held)));
    } else {
      Tensor mine = Tensor::empty(specs[k].shape);
      nf4_base_->dequantize(k, mine);
      ops.push_back(PointToPoint::send(0, device_ == Device::CPU ? mine : mine.to(device_)));
    }
    expert_parallel_group_->send_recv(ops);
    if (rank_ != 0) continue;
    const Tensor& into = host->tensors()[k];
    const Tensor others = received.narrow(held, experts.size * held);
    into.narrow(held, experts.size * held).copy_from(device_ == Device::CPU ? others : others.to(Device::CPU));
  }
  if (!host) return;
  lora_->merge_into(*host);
  save_hf_model(dir, *host, options);
  log_info("exported the base model with the LoRA adapters merged to {} (the routed experts gathered from the {} "
           "expert-parallel ranks)",
           dir, experts.size);
}

// NOTE [Export in pieces]
// When no rank holds the whole model (pipeline stages, FSDP chunks, tensor-parallel shards),
// none gathers it: every rank writes what it holds into the export's files (NOTE [Export
// written in pieces] in ckpt/hf_export_writer.h). A gather would hold the whole model in fp32
// on rank 0's host: 1.6 TB for Llama 3.1 405B, 280 GB for 70B. Rank 0 makes the temporary
// directory (named with its pid, which every rank learns through an all-reduce) with every
// weight file at its full size and its header; after an all-reduce that says whether it
// could, every rank of the first data-parallel replica of its stage writes its values at
// their places: its stages' parameters whole, or its chunks of them under FSDP (the chunks
// of the stage's ranks, context-parallel ones included), of its shards of them under tensor
// parallelism (the norm weights, which every tensor-parallel rank holds, by tensor-parallel
// rank 0 alone), from the GPU through a host window of checkpoint.buffer_mb. The ranks then
// sum whether each wrote and how many elements, which must be the model's (every element
// written once), and rank 0 writes the index, config.json and the source's files and
// renames the directory into place; a last all-reduce holds every rank until it is there
// (or says it is not): NOTE [Piecewise export protocol] in train/export_in_pieces.h, which
// FLUX's diffusers export shares (NOTE [FLUX export in pieces]). The files are byte for byte one rank's export of the same weights; a
// rank adds to its memory at most the window and a 128 KiB conversion buffer. Two exports
// still gather to rank 0: LoRA's merged model (the adapters merge into the whole base) and
// expert parallelism's without pipelining (each rank holds a slice of the experts). Under
// pipelining the FSDP segments of a rank's expert slices are written at their experts'
// places like any other (NOTE [Expert parallelism under pipeline parallelism]), and LoRA's
// merged model is written in pieces too: each rank merges its stages' adapters into an fp32
// host copy of its stages' base (NOTE [LoRA under pipeline parallelism] in model/lora.h) and
// writes that, its host memory growing by the copy; QLoRA's NF4 base is dequantized and
// merged one parameter at a time, several ranks of a stage writing under expert
// parallelism, each its own experts' slices at their places (NOTE [QLoRA under pipeline and
// expert parallelism]), its host memory growing by one parameter.
void Trainer::export_hf_model_in_pieces(const std::string& dir, const HfExportOptions& options) {
  bool writer = !replicate_group_ || replicate_group_->rank() == 0;
  // NOTE [LoRA under pipeline parallelism]: the rank's stages' base (its shards of them under
  // tensor parallelism), fp32 on the host (FSDP's chunks gathered to the stage's shard rank 0,
  // which alone writes them), with its stages' adapters merged. An NF4 base (replicated over
  // the stage's ranks, no tensor parallelism) is dequantized and merged one parameter at a
  // time as it is written (NOTE [QLoRA under pipeline and expert parallelism] in model/lora.h):
  // by the stage's rank 0, and under expert parallelism its stacks' slices by the stage's first
  // expert-parallel group, each rank its own experts'. Under tensor parallelism (NOTE [NF4
  // base under tensor parallelism]; no expert parallelism there) each rank's shards are
  // dequantized into an fp32 host copy of its stages' shards, as LoRA's bf16 base.
  const int stage_rank = stage_group_ ? stage_group_->rank() : 0;
  const ExpertShard experts = nf4_base_ ? nf4_base_->experts() : ExpertShard{};
  const bool nf4_pieces = lora_ && nf4_base_ && tensor_parallel_shard_.size == 1;
  std::optional<FlatParameters> merged;
  if (nf4_pieces) {
    writer = stage_rank < experts.size;  // the stage's ranks 0 to P - 1 hold every expert once
  } else if (lora_) {
    merged.emplace(config_.model, Device::CPU, DType::F32, tensor_parallel_shard_, pipeline_stages_);
    if (fsdp_) {
      if (writer) gather_stage_base(*merged);  // over the shard group, whose ranks share `writer`
      writer = writer && fsdp_->layout().rank() == 0;
    } else if (nf4_base_) {
      nf4_base_->dequantize_into(*merged);
      // Replicated over the stage's ranks, or (NOTE [NF4 base under tensor parallelism]) over
      // its ranks with the same shards: the first of them writes.
      writer = data_parallel_group_ ? data_parallel_group_->rank() == 0 : !stage_group_ || stage_group_->rank() == 0;
    } else {
      merged->assign_from(*params_);
    }
    if (writer) lora_->merge_into(*merged);
  }
  const HfExportPlan plan = hf_export_plan(config_.model, options);
  const int64_t window = std::max<int64_t>(static_cast<int64_t>(checkpoint_buffer_bytes() / sizeof(float)), 1);
  const TensorParallelShard shard = tensor_parallel_shard_;
  // The norm weights are whole on every tensor-parallel rank: rank 0's to write.
  auto mine = [&](size_t spec) {
    return shard.rank == 0 || plan.specs()[spec].tensor_parallel != TensorParallelSplit::Replicated;
  };
  std::unique_ptr<HfExportDirectory> out;  // rank 0's; destroyed uncommitted, it removes its files
  size_t staged = 0;
  PiecewiseExport e;
  e.what = "Hugging Face";
  e.dir = dir;
  e.numel = plan.numel();
  e.begin = [&](const std::string& temporary) {
    out = std::make_unique<HfExportDirectory>(dir, config_.model, options, temporary);
  };
  e.commit = [&] { out->commit(); };
  e.write = [&](const std::string& temporary) {
    if (device_ == Device::CUDA) device_synchronize();  // the optimizer's last writes
    HfExportWriter files(plan, temporary);
    std::map<std::string, size_t> index;
    for (size_t k = 0; k < plan.specs().size(); ++k) index[plan.specs()[k].name] = k;
    if (nf4_pieces) {
      const std::vector<ParamSpec>& specs = nf4_base_->specs();
      for (size_t k = 0; k < specs.size(); ++k) {
        const bool sliced = specs[k].expert_stack && experts.size > 1;
        if (!sliced && stage_rank != 0) continue;  // the replicated rest: the stage's rank 0's
        Tensor values = Tensor::empty(specs[k].shape);
        nf4_base_->dequantize(k, values);
        lora_->merge_into(specs[k].name, values, specs[k].expert_stack ? experts : ExpertShard{});
        const int64_t begin = sliced ? experts.index * values.numel() : 0;  // its experts' place in the stack
        write_through_host(values, window, [&](int64_t at, std::span<const float> run) {
          files.write(index.at(specs[k].name), run, begin + at);
        });
      }
    } else if (fsdp_ && !lora_) {
      const std::vector<FsdpSegment>& segments = fsdp_->layout().segments();
      for (size_t i = 0; i < segments.size(); ++i) {
        const auto spec = static_cast<size_t>(segments[i].spec);
        if (!mine(spec)) continue;
        staged = std::max(staged, write_through_host(fsdp_->master_segments()[i], window,
                                                     [&](int64_t at, std::span<const float> values) {
                                                       files.write(spec, values, segments[i].param_begin + at, shard);
                                                     }));
      }
    } else {
      const FlatParameters& values = merged ? *merged : *params_;
      for (size_t k = 0; k < values.specs().size(); ++k) {
        const size_t spec = index.at(values.specs()[k].name);
        if (!mine(spec)) continue;
        staged = std::max(staged, write_through_host(values.tensors()[k], window,
                                                     [&](int64_t at, std::span<const float> values) {
                                                       files.write(spec, values, at, shard);
                                                     }));
      }
    }
    files.close();
    return files.written();
  };
  export_in_pieces(*checkpoint_comm(), rank_, writer, e);  // every rank
  if (out)
    log_info("the Hugging Face export was written by every rank, each its own parameters (nothing gathered; {})",
             staged == 0
                 ? std::string("written from where they are")
                 : fmt::format("rank 0 staged {:.1f} MiB from the GPU", static_cast<double>(staged) / 1048576.0));
}

// The stages' frozen base from FSDP's chunks (NOTE [Frozen FSDP base]) into `stages` (the
// rank's stages' parameters, fp32 on the host) on shard rank 0: one gather of the flat range
// its stages span (under the interleaved schedule the other ranks' stages between them too).
void Trainer::gather_stage_base(FlatParameters& stages) {
  const FsdpLayout& layout = fsdp_->layout();
  std::map<std::string, const FsdpParam*> held;
  int64_t begin = std::numeric_limits<int64_t>::max(), end = 0;
  for (const FsdpUnit& unit : layout.units())
    for (const FsdpParam& p : unit.params) {
      held[layout.specs()[static_cast<size_t>(p.spec)].name] = &p;
      // Under expert parallelism a stack's FsdpParam is the rank's experts' slice (param_begin
      // into the whole): the range spans the whole stack, which gather_flat_range fills with
      // every expert-parallel rank's slices (NOTE [LoRA under pipeline and expert parallelism]).
      const int64_t whole = p.flat_offset - p.param_begin;
      begin = std::min(begin, whole);
      end = std::max(end, whole + shape_numel(layout.specs()[static_cast<size_t>(p.spec)].shape));
    }
  const bool root = layout.rank() == 0;
  if (!root || begin >= end) begin = end = 0;
  std::vector<float> flat(static_cast<size_t>(end - begin));
  fsdp_->gather_flat_range(fsdp_->master_segments(), begin, end, flat);
  if (!root) return;
  for (size_t k = 0; k < stages.specs().size(); ++k) {
    const FsdpParam& p = *held.at(stages.specs()[k].name);
    const Tensor& into = stages.tensors()[k];
    const int64_t numel = shape_numel(layout.specs()[static_cast<size_t>(p.spec)].shape);
    FORGE_CHECK(into.numel() == numel, "{}: {} values in the FSDP layout, {} in the stages' parameters",
                stages.specs()[k].name, numel, into.numel());
    std::copy_n(flat.data() + (p.flat_offset - p.param_begin - begin), numel, into.data<float>());
  }
}

void Trainer::save_peft_adapter_to_run_dir() {
  if (rank_ != 0) return;  // the adapters are the same on every rank (NOTE [LoRA under data parallelism])
  const CheckpointConfig& ckpt = config_.checkpoint;
  const std::string base = ckpt.initial_load_in_hf ? ckpt.initial_load_path : config_.model.name;
  save_peft_adapter(run_dir_ + "/adapter", *lora_, base);
}

}  // namespace forge
