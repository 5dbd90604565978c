// The weight files of a Hugging Face export, planned from the model alone, and the writer
// that puts any run of a parameter's values at its places in them.
//
// NOTE [Export written in pieces]
// What an export's weight files hold follows from the model's architecture and the
// export's dtype alone: the Hugging Face tensors of every parameter in parameter_specs
// order (hf_parts; then the empty ones transformers writes, hf_empty_parts), cut into
// consecutive shards of at most max_shard_bytes as save_pretrained cuts them, each shard's
// header (whose offsets follow from the shapes), and so each tensor's byte range in its
// file. HfExportPlan computes that on any rank without communication; create_files makes
// the files at their full size with their headers; an HfExportWriter then writes any run
// of any parameter's elements, or of a tensor-parallel rank's shard of it (NOTE
// [Tensor-parallel shards] in model/parameters.h), at its places, converted to the stored
// dtype a chunk at a time (a part whose rows are stored in another order, DeepSeek's
// rotary rows, row by row). One process writing every parameter whole (save_hf_model) and
// many processes each writing its own pieces at once (every pipeline rank its stages'
// parameters, every FSDP rank its chunks of them: the trainer's export under pipeline,
// tensor and data parallelism, NOTE [Export in pieces] in train/trainer_hf.cpp) write the same bytes, and
// no writer holds more than its own values and a conversion buffer. The writers must see
// one file system, as for checkpoints. Between them they write every element once: their
// counts (HfExportWriter::written) add up to HfExportPlan::numel().
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/hf_layout.h"
#include "ckpt/safetensors.h"
#include "model/parameters.h"

namespace forge {

// One Hugging Face tensor of the export and where its bytes go.
struct HfExportTensor {
  HfPart part;                                     // its name, shape, place in its parameter and row order
  size_t spec = 0;                                 // its parameter (parameter_specs index); an empty part has none
  SafetensorsDType dtype = SafetensorsDType::F32;  // as stored
  size_t file = 0;                                 // which of the plan's files holds it
  uint64_t begin = 0;                              // the file offset of its first byte
  // Row r of the part (counted from part.offset) is the stored tensor's row file_row[r]:
  // part.row_order inverted; empty: the same row.
  std::vector<int64_t> file_row = {};
};

struct HfExportFile {
  std::string name;    // model.safetensors, or model-0000k-of-0000n.safetensors when sharded (the plan's stem)
  std::string header;  // the header after its 8-byte length (safetensors_header)
  uint64_t bytes = 0;  // the whole file
};

class HfExportPlan {
 public:
  // A language model's export: `dtype`: F32, BF16 or F16; `interleaved_rotary` as hf_parts
  // takes it; files model.safetensors or model-0000k-of-0000n.safetensors.
  HfExportPlan(const ModelConfig& config, SafetensorsDType dtype, uint64_t max_shard_bytes, bool interleaved_rotary);
  // Any other model's (FLUX's diffusers export, NOTE [FLUX export in pieces] in
  // ckpt/flux_weights_export.h): `specs` in their flat order, each parameter's hf_tensors
  // stored as hf_parts lays them out, the tensors in the order of their names (as a
  // std::map holds them); files <stem>.safetensors or <stem>-0000k-of-0000n.safetensors.
  HfExportPlan(std::vector<ParamSpec> specs, SafetensorsDType dtype, uint64_t max_shard_bytes,
               const std::string& stem);

  const std::vector<ParamSpec>& specs() const { return specs_; }  // parameter_specs(config), or the specs given
  const std::vector<HfExportFile>& files() const { return files_; }
  // Every tensor, in the files' order (file after file, each in data-section order).
  const std::vector<HfExportTensor>& tensors() const { return tensors_; }
  // tensors() indices of parameter `spec`'s parts, in their order.
  const std::vector<size_t>& tensors_of(size_t spec) const { return tensors_of_.at(spec); }
  // The model's parameter elements: what the writers write between them.
  int64_t numel() const { return numel_; }
  // The index a sharded export has beside its files: <stem>.safetensors.index.json.
  std::string index_name() const { return stem_ + ".safetensors.index.json"; }
  // That index, as save_pretrained writes it: {"metadata": `metadata` with "total_size" (the
  // stored bytes) added, "weight_map": every tensor's file}, indented by 2, a newline after.
  std::string index_json(nlohmann::json metadata = nlohmann::json::object()) const;
  // Creates every file in `dir` at its full size with its header (the data section left
  // for the writers).
  void create_files(const std::string& dir) const;

 private:
  // Adds every parameter's hf_parts to tensors_ (not yet placed in files).
  void add_parts(bool interleaved_rotary, SafetensorsDType dtype);
  // Cuts tensors_ (in their order) into files and places every tensor in its file.
  void lay_out(SafetensorsDType dtype, uint64_t max_shard_bytes);

  std::vector<ParamSpec> specs_;
  std::string stem_ = "model";
  std::vector<HfExportFile> files_;
  std::vector<HfExportTensor> tensors_;
  std::vector<std::vector<size_t>> tensors_of_;
  int64_t numel_ = 0;
};

// Writes parameter values into the files create_files made in `dir` (NOTE [Export written
// in pieces]). Not thread-safe; several writers (processes) may write one directory at once.
class HfExportWriter {
 public:
  HfExportWriter(const HfExportPlan& plan, const std::string& dir);
  ~HfExportWriter();
  HfExportWriter(const HfExportWriter&) = delete;
  HfExportWriter& operator=(const HfExportWriter&) = delete;

  // Values [begin, begin + values.size()) of parameter `spec` (parameter_specs order), or
  // with `shard` of tensor-parallel rank shard.rank's shard of it (parameter_specs(config,
  // shard)'s shape), fp32, stored at their places.
  void write(size_t spec, std::span<const float> values, int64_t begin = 0, TensorParallelShard shard = {});
  // Elements written so far (each counted once).
  int64_t written() const { return written_; }
  // Closes the files, failing on an error the file system reports only then.
  void close();

 private:
  void write_whole(size_t spec, int64_t first, const float* values, int64_t count);
  void store(const HfExportTensor& tensor, int64_t element, const float* values, int64_t count);
  int file(size_t index);

  const HfExportPlan& plan_;
  std::vector<std::string> paths_;  // of plan.files(), in `dir`
  std::vector<int> fds_;
  std::vector<uint16_t> converted_;
  int64_t written_ = 0;
};

}  // namespace forge
