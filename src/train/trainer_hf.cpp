// The trainer's side of Hugging Face models: starting from one
// (checkpoint.initial_load_in_hf) and exporting the final weights as one
// (checkpoint.last_save_in_hf, into <run_dir>/hf, in checkpoint.export_dtype). The ckpt layer reads and writes fp32
// weights in host memory; on CUDA the master weights pass through a host copy. Under tensor
// parallelism each rank reads only its shards of the imported tensors, and the export
// gathers the shards into whole tensors first: the same files as one rank's.
#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "ckpt/peft_adapter.h"

#include <algorithm>
#include <optional>
#include <span>

#include "core/log.h"
#include "distributed/tensor_parallel_gather.h"
#include "train/trainer.h"

namespace forge {

void Trainer::load_initial_hf_weights(const std::string& dir) {
  if (fsdp_) {
    // Every rank reads the model one parameter at a time and keeps its segments (a LoRA
    // run's frozen base too: NOTE [Frozen FSDP base]): the host holds the largest
    // parameter in fp32, not the model. Under tensor parallelism each parameter is the
    // rank's shard of it, and only the shard is read.
    for_each_hf_parameter(
        dir, config_.model, [&](size_t spec, const Tensor& values) { fsdp_->set_parameter(spec, values); },
        tensor_parallel_shard_);
    fsdp_->refresh_compute_weights(false);
    return;
  }
  if (config_.lora.quantize_base == "nf4") {
    // NOTE [QLoRA base]: each parameter quantized (or cast) as it is read, so the host holds
    // one parameter in fp32 at a time (a resumed run imports and quantizes again, to
    // bitwise the same codes).
    nf4_base_.reset();
    nf4_base_ = std::make_unique<Nf4FrozenBase>(config_.model, device_, device_ == Device::CUDA ? DType::BF16 : DType::F32);
    for_each_hf_parameter(dir, config_.model, [&](size_t spec, const Tensor& values) { nf4_base_->set(spec, values); });
    nf4_base_->finish();
    lora_->set_base(*nf4_base_);
    return log_info("QLoRA: the base's projections quantized to NF4 at import (the frozen base holds {:.2f} MiB on {}: "
                    "NF4 codes and statistics {:.2f} MiB, the rest and the dequantization scratch in {})",
                    static_cast<double>(nf4_base_->nbytes()) / (1024.0 * 1024.0), device_name(device_),
                    static_cast<double>(nf4_base_->codes().nbytes()) / (1024.0 * 1024.0),
                    config_.precision.compute_dtype);
  }
  if (tensor_parallel_) {
    // The rank's shards (NOTE [Tensor-parallel shards]), read one parameter at a time.
    for_each_hf_parameter(
        dir, config_.model, [&](size_t spec, const Tensor& values) { params_->tensors()[spec].copy_from(values); },
        tensor_parallel_shard_);
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
  const float* flat = host.flat().data<float>();
  fsdp_->load_master([&](int64_t offset, std::span<float> out) { std::copy_n(flat + offset, out.size(), out.data()); });
}

void Trainer::export_hf_model() {
  HfExportOptions options;
  options.dtype = export_safetensors_dtype(config_.checkpoint.export_dtype);  // checked before training
  if (config_.checkpoint.initial_load_in_hf) options.source_dir = config_.checkpoint.initial_load_path;
  const std::string dir = run_dir_ + "/hf";
  if (tensor_parallel_) return export_tensor_parallel_hf_model(dir, options);
  if (fsdp_) {
    std::vector<float> flat;
    fsdp_->gather_to_host(fsdp_->master_segments(), flat);
    if (rank_ != 0) return;
    FlatParameters host(config_.model);
    std::copy(flat.begin(), flat.end(), host.flat().data<float>());
    if (!lora_) return save_hf_model(dir, host, options);
    // NOTE [LoRA under data parallelism]: the gathered frozen base with the adapters merged.
    lora_->merge_into(host);
    save_hf_model(dir, host, options);
    return log_info("exported the base model with the LoRA adapters merged to {}", dir);
  }
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
  } else {
    local.resize(static_cast<size_t>(params_->flat().numel()));
    copy_bytes(local.data(), Device::CPU, params_->flat().raw(), params_->flat().device(), local.size() * sizeof(float));
  }
  std::optional<FlatParameters> host;
  if (rank_ == 0) host.emplace(config_.model);
  const std::span<float> whole =
      host ? std::span<float>(host->flat().data<float>(), static_cast<size_t>(host->flat().numel())) : std::span<float>();
  gather_tensor_parallel_shards(*tensor_parallel_group_, device_, config_.model, local, whole);
  if (host) save_hf_model(dir, *host, options);
}

void Trainer::save_peft_adapter_to_run_dir() {
  if (rank_ != 0) return;  // the adapters are the same on every rank (NOTE [LoRA under data parallelism])
  const CheckpointConfig& ckpt = config_.checkpoint;
  const std::string base = ckpt.initial_load_in_hf ? ckpt.initial_load_path : config_.model.name;
  save_peft_adapter(run_dir_ + "/adapter", *lora_, base);
}

}  // namespace forge
