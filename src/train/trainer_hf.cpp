// The trainer's side of Hugging Face models: starting from one
// (checkpoint.initial_load_in_hf) and exporting the final weights as one
// (checkpoint.last_save_in_hf, into <run_dir>/hf). The ckpt layer reads and writes fp32
// weights in host memory; on CUDA the master weights pass through a host copy.
#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "train/trainer.h"

namespace forge {

void Trainer::load_initial_hf_weights(const std::string& dir) {
  if (params_->flat().device() == Device::CPU) {
    load_hf_weights_checked(dir, *params_);
  } else {
    FlatParameters host(config_.model);
    load_hf_weights_checked(dir, host);
    params_->assign_from(host);
  }
  if (compute_weights_) compute_weights_->assign_from(*params_);
}

void Trainer::export_hf_model() const {
  HfExportOptions options;
  options.dtype = config_.precision.compute_dtype == "bf16" ? SafetensorsDType::BF16 : SafetensorsDType::F32;
  if (config_.checkpoint.initial_load_in_hf) options.source_dir = config_.checkpoint.initial_load_path;
  const std::string dir = run_dir_ + "/hf";
  if (params_->flat().device() == Device::CPU) return save_hf_model(dir, *params_, options);
  FlatParameters host(config_.model);
  host.assign_from(*params_);
  save_hf_model(dir, host, options);
}

}  // namespace forge
