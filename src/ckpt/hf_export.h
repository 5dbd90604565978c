// Exporting forge weights as a Hugging Face model directory that transformers'
// from_pretrained loads: config.json (hf_config.h), the weights as safetensors split into
// the Hugging Face tensors (hf_layout.h), sharded with model.safetensors.index.json when
// they exceed max_shard_bytes, and, when the model came from a Hugging Face directory,
// that directory's tokenizer files and generation_config.json. DeepSeek's rotary rows go
// back to their interleaved order (hf_layout.h) unless the source stores them otherwise
// (rope_interleave false), V3's routing bias is written in fp32 whatever the dtype (as
// transformers' save_pretrained does), and MoE blocks without shared experts get the empty
// shared-expert tensors transformers writes (hf_empty_parts).
//
// NOTE [Export keeps the source's config]
// A model that came from a Hugging Face directory is exported as that directory's model:
// its config.json is the source's with every key forge writes (hf_config.h) updated to
// the trained model and the export's dtype, and every other key (special token ids,
// _name_or_path, pretraining_tp, keys of later transformers versions) carried over as it
// was; the architecture class is the source's (a Mistral with "sliding_window": null
// stays MistralForCausalLM rather than becoming the Llama it computes like).
//
// NOTE [Atomic export]
// Everything is written into a temporary sibling directory that is renamed into place
// only when complete (an AtomicDirectory: NOTE [Durable files] in core/durable_file.h),
// so a crash or a full disk never leaves a half-written model where a loader would find
// it. An existing non-empty target is refused before any work, never overwritten.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ckpt/hf_export_writer.h"
#include "ckpt/safetensors.h"
#include "model/parameters.h"

namespace forge {

class AtomicDirectory;

// checkpoint.export_dtype's resolved value (bf16, fp16 or fp32) as the stored dtype.
SafetensorsDType export_safetensors_dtype(const std::string& export_dtype);

// checkpoint.export_max_shard_size read as transformers reads save_pretrained's
// max_shard_size (convert_file_size_to_int): a whole number of bytes, or one with a unit:
// KB, MB, GB (powers of 10), KiB, MiB, GiB (powers of 2), or Kb, Mb, Gb (bits: an eighth
// of the bytes). The all-lowercase kb, mb and gb, which transformers takes as bits, are
// refused as ambiguous. Empty: `default_bytes` (5 GB for a language model, as
// save_pretrained's default; 10 GB for a diffusers FLUX folder). Fails naming `key` (the
// config key, or where it came from) unless the value is a positive size.
uint64_t export_max_shard_bytes(const std::string& text, uint64_t default_bytes,
                                const std::string& key = "checkpoint.export_max_shard_size");

struct HfExportOptions {
  SafetensorsDType dtype = SafetensorsDType::F32;  // F32, BF16 or F16
  // A Hugging Face model directory (usually the one training started from) whose
  // config.json, tokenizer files and generation_config.json go with the export (NOTE
  // [Export keeps the source's config]); empty for none.
  std::string source_dir;
  uint64_t max_shard_bytes = 5'000'000'000;  // as save_pretrained's default "5GB"
};

// Writes params (fp32 on the CPU; and params.config()) as a Hugging Face model directory
// at dir.
void save_hf_model(const std::string& dir, const FlatParameters& params, const HfExportOptions& options = {});

// The weight files an export of `config` with `options` writes (NOTE [Export written in
// pieces] in ckpt/hf_export_writer.h), the same on every rank.
HfExportPlan hf_export_plan(const ModelConfig& config, const HfExportOptions& options);

// An export in the making, for writers of their own (save_hf_model's one, or many
// processes at once: NOTE [Export written in pieces]): the target checked as save_hf_model
// checks it, a temporary directory beside it holding every weight file at its full size
// with its header, for HfExportWriters to fill; commit() adds the index, config.json and
// the source's files and renames it into place (NOTE [Atomic export]). Destroyed
// uncommitted, it removes the temporary directory.
class HfExportDirectory {
 public:
  // `temporary`: the temporary directory's path (hf_export_temporary_path, which other
  // processes can compute); empty: this process's own name for it.
  HfExportDirectory(const std::string& dir, const ModelConfig& config, const HfExportOptions& options,
                    const std::string& temporary = "");
  ~HfExportDirectory();

  const HfExportPlan& plan() const { return plan_; }
  const std::string& temporary_path() const;
  // The writers must have written every element and closed their files.
  void commit();

 private:
  ModelConfig config_;
  HfExportOptions options_;
  std::string target_;
  HfExportPlan plan_;
  std::unique_ptr<AtomicDirectory> staging_;
};

// The temporary directory of an export to `dir` whose processes agreed on `token` (the
// first rank's pid, say).
std::string hf_export_temporary_path(const std::string& dir, int64_t token);

// Fails, naming dir, when save_hf_model would refuse it (it exists and is not an empty
// directory), so a run can refuse before it trains rather than after.
void check_hf_export_target(const std::string& dir);

// Fails, saying why, when no Hugging Face class forge writes computes `config` (hf_config.h:
// shared experts without Multi-head Latent Attention, say), with the source directory's
// config.json, if any, for its class; for the same early refusal.
void check_hf_exportable(const ModelConfig& config, const std::string& source_dir);

}  // namespace forge
