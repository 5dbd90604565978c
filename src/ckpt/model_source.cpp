#include "ckpt/model_source.h"

#include <filesystem>
#include <span>

#include "ckpt/checkpoint.h"
#include "ckpt/hf_import.h"
#include "ckpt/peft_adapter.h"
#include "core/log.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

LoadedModel from_checkpoint(const std::string& dir) {
  const Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, ck.metadata.model, /*same_architecture=*/true);
  LoadedModel model;
  model.config = ck.metadata.model;
  model.params = std::make_unique<FlatParameters>(model.config);
  const Tensor& flat = model.params->flat();
  read_flat_range(ck, FlatState::Param, 0, std::span<float>(flat.data<float>(), static_cast<size_t>(flat.numel())));
  model.description = fmt::format("forge checkpoint '{}' (step {})", dir, ck.metadata.training.step);
  return model;
}

// The newest checkpoint of `folder` that loads whole.
LoadedModel from_checkpoint_folder(const std::string& folder, const std::vector<int64_t>& steps) {
  std::vector<std::string> rejected;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string dir = checkpoint_dir(folder, *it);
    try {
      LoadedModel model = from_checkpoint(dir);
      if (!rejected.empty())
        log_warn("loaded '{}', the newest whole checkpoint of '{}' ({} newer one{} damaged)", dir, folder,
                 rejected.size(), rejected.size() == 1 ? " is" : "s are");
      return model;
    } catch (const Error& e) {
      log_warn("checkpoint '{}' cannot be loaded: {}; trying the one before it", dir, e.what());
      rejected.push_back(dir);
    }
  }
  FORGE_FAIL("no checkpoint in '{}' can be loaded: all {} are damaged (see the warnings above)", folder,
             rejected.size());
}

}  // namespace

LoadedModel load_model(const std::string& path) {
  std::error_code error;
  if (path.empty()) FORGE_FAIL("no model given: name a checkpoint, a run directory or a Hugging Face folder");
  if (!fs::is_directory(path, error))
    FORGE_FAIL("model '{}' is not a directory (expected a Hugging Face folder with config.json, a forge checkpoint "
               "step-<N> with metadata.json, a folder of checkpoints, or a run directory)",
               path);
  if (fs::exists(fs::path(path) / "metadata.json", error)) return from_checkpoint(path);
  if (fs::exists(fs::path(path) / "config.json", error)) {
    HfModel hf = load_hf_model(path);
    LoadedModel model;
    model.config = hf.config;
    model.params = std::move(hf.params);
    model.description = fmt::format("Hugging Face model '{}'", path);
    model.hf_dir = path;
    return model;
  }
  for (const std::string& folder : {path, (fs::path(path) / "checkpoints").string()}) {
    const std::vector<int64_t> steps = checkpoint_steps(folder);
    if (!steps.empty()) return from_checkpoint_folder(folder, steps);
  }
  FORGE_FAIL("model '{}' holds no config.json (Hugging Face), no metadata.json (forge checkpoint) and no step-<N> "
             "checkpoints, in itself or in checkpoints/",
             path);
}

void merge_adapter(LoadedModel& model, const std::string& dir, const LoraConfig* expected) {
  LoraConfig lora = expected ? *expected : read_peft_adapter_settings(dir);
  lora.adapter_path = dir;
  LoraAdapters adapters(model.config, lora, Device::CPU, /*tokens=*/1);
  if (!model.hf_dir.empty()) adapters.set_interleaved_rotary(read_weight_layout(model.hf_dir).interleaved_rotary);
  load_peft_adapter(dir, adapters);
  adapters.merge_into(*model.params);
  model.adapter_dir = dir;
  model.description += fmt::format(" with the LoRA adapter '{}' merged (r {}, alpha {}, {})", dir, lora.rank,
                                   lora.alpha, lora.target_modules);
}

}  // namespace forge
