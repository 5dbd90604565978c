// forge-native checkpoints: save a training state atomically, find the latest complete
// one, and read back any flat range of it, whatever the world size it was saved with.
//
// NOTE [Checkpoint format]
// A checkpoint is a directory <folder>/step-<N> holding
//   metadata.json   format_version, step, the model config (every ModelConfig field), the
//                   resolved experiment YAML, the data loader position, the seed, the LR
//                   scheduler state (step, total steps), the optimizer hyperparameters and
//                   step count, the world size (the number of shard files) with what each
//                   holds, and a record per tensor (see below).
//   rank-<r>.bin    three flat fp32 vectors' elements, one vector after the other:
//                   parameters, AdamW exp_avg (m), AdamW exp_avg_sq (v), little-endian,
//                   3 * n * 4 bytes in all for the file's n elements of each.
// The flat index space is the whole model's (every parameter in parameter_specs order, as
// FlatParameters of one rank lays it out), whatever layout saved it, and m and v follow the
// parameters in it. A tensor record names the parameter and which of the three vectors
// ("param", "exp_avg", "exp_avg_sq") it belongs to, its dtype ("fp32"), full shape and flat
// offset, and its pieces: one per part of it a shard file holds, each with the file, the
// byte offset and length in it, the flat index of its first element, and the CRC-32 of its
// bytes. Reading any set of flat elements walks the pieces that hold them, so a checkpoint
// loads under any other layout (resharding is reading other pieces).
// Format 1 (format_version 1; every save without tensor parallelism): file r holds the
// contiguous range [flat_begin, flat_end) of the flat index space, the natural FSDP shard
// unit: rank r of world w owns shard_ranges(numel, w)[r] (the metadata lists each file's
// range); a piece is the part of one tensor inside it, consecutive flat elements.
// Format 2 (format_version 2; NOTE [Tensor-parallel checkpoints] in
// ckpt/checkpoint_layout.h): each file holds the elements of its tensor-parallel rank's
// shards, so the metadata lists each file's element count (and the saving run's
// tensor_parallel_degree), and a piece may be a band of columns of its tensor (NOTE
// [Column bands] in ckpt/checkpoint_bands.h: "band_begin" and "band_width", absent for
// consecutive flat elements) holding its elements row by row. The pieces of a tensor tile
// it exactly once, and the pieces of a file tile its bytes. This forge reads both formats;
// format 1 files are written as before, so forge builds that read only format 1 still read
// every checkpoint of a run without tensor parallelism, and refuse format 2 by its version.
//
// NOTE [Atomic checkpoints]
// A save writes everything into <folder>/.tmp-step-<N>-<pid>, fsyncs each file and the
// directory, renames it to step-<N> (exchanging it with an existing step-<N> in one
// step) and fsyncs the folder: a step-<N> directory is always complete. This is an
// AtomicDirectory of AtomicFiles, with sync (NOTE [Durable files] in core/durable_file.h).
// Only then are checkpoints beyond keep_latest_k removed (renamed away first, so none is
// ever visible half deleted). .tmp-* directories, left by crashes, are ignored by loading
// and removed by the next save.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/durable_directory.h"
#include "model/config.h"
#include "model/flux_config.h"
#include "model/fp8_delayed_state.h"
#include "model/parameters.h"
#include "optim/optimizer.h"

namespace forge {

// Format 1 is what every save without tensor parallelism writes; format 2 what saves under
// it write (NOTE [Checkpoint format]). Both are read.
inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr int kTensorParallelCheckpointFormatVersion = 2;

// The three flat vectors a shard file holds, in file order.
enum class FlatState { Param = 0, ExpAvg = 1, ExpAvgSq = 2 };
inline constexpr FlatState kFlatStates[] = {FlatState::Param, FlatState::ExpAvg, FlatState::ExpAvgSq};
const char* flat_state_name(FlatState state);  // "param", "exp_avg", "exp_avg_sq"

// A rank's share of the flat index space, [begin, end) in elements.
struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// numel split over `world` ranks as evenly as possible; the first numel % world ranks get
// one element more.
std::vector<ShardRange> shard_ranges(int64_t numel, int world);

// Everything a resume restores besides the tensors.
struct TrainingState {
  int64_t step = 0;                 // optimizer steps completed
  int64_t data_position = 0;        // DataLoader::position()
  uint64_t seed = 0;                // training.seed: every random stream derives from it
  int64_t lr_schedule_steps = 0;    // the LR schedule's total steps (training.steps)
  OptimizerConfig optimizer;
  int64_t optimizer_step = 0;       // AdamW::step_count()
  // NOTE [Loss spikes] (train/loss_spike.h): the detector's window, oldest first. Optional
  // in metadata.json ("loss_spike"); a checkpoint without it loads with an empty window.
  std::vector<double> recent_losses;
  // precision.fp8 delayed's histories and scales ("fp8_delayed"; absent for other runs).
  std::optional<Fp8DelayedState> fp8_delayed;
};

struct TensorPiece {
  int rank = 0;
  int64_t flat_begin = 0;    // first flat element of the piece
  int64_t byte_offset = 0;   // in rank-<rank>.bin
  int64_t byte_length = 0;
  uint32_t crc32 = 0;
  // Format 2: a band of the tensor's columns (NOTE [Column bands]); width 0: consecutive
  // flat elements.
  int64_t band_begin = 0, band_width = 0;
};

struct TensorRecord {
  std::string name;          // the parameter's name, e.g. "layers.0.attention.qkv.weight"
  FlatState state = FlatState::Param;
  Shape shape;
  int64_t flat_offset = 0;
  std::vector<TensorPiece> pieces;
};

struct CheckpointMetadata {
  int format_version = kCheckpointFormatVersion;
  ModelConfig model;
  std::string experiment_yaml;
  TrainingState training;
  int64_t flat_numel = 0;
  int tensor_parallel = 1;             // format 2: the saving run's tensor_parallel_degree
  std::vector<ShardRange> shards;      // format 1: the flat range file r holds; index = rank
  std::vector<int64_t> file_numel;     // every format: the elements of each vector file r holds
  std::vector<TensorRecord> tensors;
  int files() const { return static_cast<int>(file_numel.size()); }
  // A FLUX transformer's checkpoint (NOTE [FLUX checkpoints] in train/flux_checkpoint.h):
  // its config, written as "flux_model" in place of "model" (`model` is then unused).
  std::optional<FluxConfig> flux;
};

// One rank's data for a save: its range and pointers to range.size() floats of each vector.
struct ShardData {
  ShardRange range;
  const float* params = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
};

// Saves step `state.step` to <folder>/step-<N> (NOTE [Atomic checkpoints]) from host
// memory, through a staging buffer of buffer_bytes (NOTE [Streaming checkpoints] in
// ckpt/checkpoint_stream.h); `shards`, one per rank, must tile [0, numel of model's
// parameters). keep_latest_k > 0 then keeps the one just written and the newest k - 1 older
// ones that open whole, removing the other older ones (later steps are left alone).
// Returns the directory.
std::string save_checkpoint(const std::string& folder, const ModelConfig& model, const std::string& experiment_yaml,
                            const TrainingState& state, const std::vector<ShardData>& shards, int64_t keep_latest_k,
                            size_t buffer_bytes = size_t{1} << 28);

// The same save in steps, for a trainer whose state is on a GPU, or spread over ranks that
// write in parallel (NOTE [Parallel checkpoint saves] in train/trainer_checkpoint.cpp):
//   1. one process: begin_checkpoint_save creates the folder, clears leftovers and makes
//      the temporary directory <folder>/.tmp-step-<N>-<token> (token: the same on every
//      rank, e.g. rank 0's pid), whose path checkpoint_temporary_dir gives every rank; the
//      AtomicDirectory it returns removes that directory again unless the save finishes;
//      then create_checkpoint_shard_files (ckpt/checkpoint_stream.h) makes the shard files;
//   2. every writer: a ShardFileWriter writes its segments into the shard files, wherever
//      their flat elements belong, and returns CRC-32s of what it wrote;
//   3. the same process as 1, once every writer is done: finish_checkpoint_save writes the
//      metadata with the pieces' CRC-32s (combine_piece_crcs of every writer's), renames
//      the directory into place and prunes.
// Each step has a form for any CheckpointLayout (ckpt/checkpoint_layout.h: format 1's
// ranges, or the files of tensor-parallel ranks, NOTE [Tensor-parallel checkpoints]) and
// one for format 1's ranges of `model`'s parameters or `specs`.
std::string checkpoint_temporary_dir(const std::string& folder, int64_t step, int64_t token);
AtomicDirectory begin_checkpoint_save(const std::string& folder, int64_t step, int64_t token);
std::string finish_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const ModelConfig& model,
                                   const std::string& experiment_yaml, const TrainingState& state,
                                   const std::vector<ShardRange>& ranges,
                                   const std::vector<std::vector<uint32_t>>& crcs_by_rank, int64_t keep_latest_k);
// NOTE [LoRA checkpoints]
// A LoRA run's checkpoint holds its adapters (LoraAdapters::checkpoint_specs: each fused
// projection's a and b, fp32) with their AdamW moments instead of the model's parameters,
// in the same format; the frozen base comes from the run's initial load every time. The
// overloads taking `specs` save and check such a checkpoint; `model` is still recorded
// (and compared on resume).
std::string finish_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const ModelConfig& model,
                                   const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                                   const TrainingState& state, const std::vector<ShardRange>& ranges,
                                   const std::vector<std::vector<uint32_t>>& crcs_by_rank, int64_t keep_latest_k);
// `specs`: the whole tensors `layout` places (the model's parameters, or a LoRA run's);
// `crcs`: the CRC-32 of each of its pieces, in its order.
struct CheckpointLayout;
std::string finish_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const ModelConfig& model,
                                   const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                                   const TrainingState& state, const CheckpointLayout& layout,
                                   const std::vector<uint32_t>& crcs, int64_t keep_latest_k);

// The same for a FLUX transformer (NOTE [FLUX checkpoints] in train/flux_checkpoint.h):
// `specs` are flux_parameter_specs(flux), laid end to end in the flat index space.
std::string finish_flux_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const FluxConfig& flux,
                                        const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                                        const TrainingState& state, const CheckpointLayout& layout,
                                        const std::vector<uint32_t>& crcs, int64_t keep_latest_k);

// Steps of the complete checkpoints in folder, ascending (empty when there is none or the
// folder does not exist).
std::vector<int64_t> checkpoint_steps(const std::string& folder);
std::string checkpoint_dir(const std::string& folder, int64_t step);

// The checkpoint to resume from: step `load_step`, or the latest when load_step is -1.
// None when load_step is -1 and the folder holds no checkpoint; a missing load_step is an
// error listing the steps there are.
std::optional<std::string> find_checkpoint(const std::string& folder, int64_t load_step);

// A checkpoint opened for reading: its metadata, checked for consistency, and shard files
// that exist with the sizes the metadata implies.
struct Checkpoint {
  std::string dir;
  CheckpointMetadata metadata;
};
Checkpoint open_checkpoint(const std::string& dir);

// Errors, naming the checkpoint and the tensor, unless the checkpoint holds exactly the
// tensors (names, shapes, flat offsets) of `model` (a FLUX checkpoint is refused as such). With `same_architecture`, every
// architecture field of the saved model config must also equal model's (a resume);
// without, matching tensors suffice (weights to start a fine-tuning run from).
void check_checkpoint_model(const Checkpoint& checkpoint, const ModelConfig& model, bool same_architecture);
// The same against `specs` instead of the model's parameters (NOTE [LoRA checkpoints]).
void check_checkpoint_model(const Checkpoint& checkpoint, const ModelConfig& model, const std::vector<ParamSpec>& specs,
                            bool same_architecture);

// Reads pieces part, part + parts, part + 2 × parts, ... (metadata order) of the shard files
// and checks their CRC-32s; an error names the file, the tensor and the bytes. `parts`
// ranks calling it with parts = world size read every piece once between them.
void verify_checkpoint_pieces(const Checkpoint& checkpoint, int part, int parts);

// Fills out with elements [begin, begin + out.size()) of one flat vector, from whichever
// shard files hold them, checking each piece's CRC-32 (a ShardFileReader of
// ckpt/checkpoint_stream.h with a default buffer).
void read_flat_range(const Checkpoint& checkpoint, FlatState state, int64_t begin, std::span<float> out);

}  // namespace forge
