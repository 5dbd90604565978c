// FLUX's diffusers export (NOTE [FLUX weight files] in ckpt/flux_weights.h) planned from
// the model alone, so that one process (save_flux_weights) or every FSDP rank at once can
// write it: the counterpart of read_flux_weights, which reads it a parameter at a time.
//
// NOTE [FLUX export in pieces]
// A diffusers export's files follow from the FLUX config and the stored dtype alone: every
// parameter's diffusers tensors (its hf_tensors: to_q, to_k and to_v of a fused to_qkv
// stacked, NOTE [Fused projections]) in the order of their names, cut into shards of at
// most max_shard_bytes as diffusers' save_pretrained cuts them (its default "10GB":
// FLUX.1-dev's 11.9 B parameters are 3 files in bf16, 5 in fp32), named
// diffusion_pytorch_model.safetensors or diffusion_pytorch_model-0000k-of-0000n.safetensors
// with diffusion_pytorch_model.safetensors.index.json beside them. That is the language
// models' HfExportPlan with another naming (NOTE [Export written in pieces] in
// ckpt/hf_export_writer.h), so its HfExportWriter writes any run of any parameter's
// elements at its places: under FSDP every rank of the first replica writes its own chunks
// of the master weights (NOTE [Export in pieces] in train/export_in_pieces.h), and no rank
// gathers the model, which for FLUX.1-dev is 48 GB of fp32. FluxWeightsExport is the
// directory in the making: a temporary sibling of the target holding every weight file at
// its full size with its header; commit() adds the index (when sharded) and config.json and
// renames it into place, exchanging it with an existing target (a re-run's export), so a
// failure at any point leaves what was on disk as it was (NOTE [Atomic export] in
// ckpt/hf_export.h). Like the language models' exports, it is not flushed to disk (NOTE
// [Durable files] in core/durable_file.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ckpt/hf_export_writer.h"
#include "ckpt/safetensors.h"
#include "model/flux_config.h"

namespace forge {

class AtomicDirectory;

inline constexpr const char* kFluxDiffusersStem = "diffusion_pytorch_model";
inline constexpr uint64_t kDiffusersMaxShardBytes = 10'000'000'000;  // save_pretrained's "10GB"

// The files of a diffusers export of `config` stored as `stored` (F32, BF16 or F16).
HfExportPlan flux_weights_plan(const FluxConfig& config, SafetensorsDType stored,
                               uint64_t max_shard_bytes = kDiffusersMaxShardBytes);

class FluxWeightsExport {
 public:
  // `temporary`: the temporary directory's path (hf_export_temporary_path(dir, token), which
  // the other ranks compute too); empty: this process's own name for it.
  FluxWeightsExport(const std::string& dir, const FluxConfig& config, SafetensorsDType stored,
                    const std::string& temporary = "", uint64_t max_shard_bytes = kDiffusersMaxShardBytes);
  ~FluxWeightsExport();
  FluxWeightsExport(const FluxWeightsExport&) = delete;
  FluxWeightsExport& operator=(const FluxWeightsExport&) = delete;

  const HfExportPlan& plan() const { return plan_; }
  const std::string& temporary_path() const;
  // The writers must have written every element and closed their files.
  void commit();

 private:
  FluxConfig config_;
  HfExportPlan plan_;
  std::unique_ptr<AtomicDirectory> staging_;
};

}  // namespace forge
