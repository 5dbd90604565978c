#include "cli/inference_model.h"

#include <filesystem>

#include "cli/config.h"
#include "core/error.h"
#include "core/log.h"

namespace forge {

LoadedModel load_inference_model(const std::string& model, const std::string& adapter) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path run_config = fs::path(model) / "config.yaml";
  if (fs::is_regular_file(run_config, error)) {
    const ExperimentConfig run = load_experiment(run_config.string(), {});
    if (run.lora.enabled()) {  // NOTE [A LoRA run as a model]
      if (!adapter.empty())
        FORGE_FAIL("--model '{}' is a LoRA run (lora.rank {} in {}), which brings its own adapter: give its base "
                   "model as --model to apply --adapter '{}' instead",
                   model, run.lora.rank, run_config.string(), adapter);
      const std::string& base = run.checkpoint.initial_load_path;
      if (base.empty())
        FORGE_FAIL("{}: a LoRA run with no checkpoint.initial_load_path: its base model is unknown", run_config.string());
      const std::string run_adapter = (fs::path(model) / "adapter").string();
      if (!fs::is_directory(run_adapter, error))
        FORGE_FAIL("LoRA run '{}' has no adapter/ yet (forge writes it at each checkpoint save and at the end of "
                   "training)",
                   model);
      LoadedModel loaded;
      try {
        loaded = load_model(base);
      } catch (const Error& e) {
        FORGE_FAIL("{} (the base model of the LoRA run '{}': checkpoint.initial_load_path in {})", e.what(), model,
                   run_config.string());
      }
      if (run.lora.quantize_base != "none")
        log_warn("the LoRA run '{}' trained on its base quantized to {} (lora.quantize_base); its adapter is merged "
                 "into the base's unquantized weights, as PEFT merges a QLoRA adapter, so results differ slightly "
                 "from the quantized model it trained with",
                 model, run.lora.quantize_base);
      merge_adapter(loaded, run_adapter, &run.lora);
      return loaded;
    }
  }
  LoadedModel loaded = load_model(model);
  if (!adapter.empty()) merge_adapter(loaded, adapter);
  return loaded;
}

}  // namespace forge
