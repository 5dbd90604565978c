// Moving checkpoint tensors between memory (host or GPU, fp32 or bf16) and shard files
// through a bounded host buffer, so that saving or loading a model never stages its
// shard on the host.
//
// NOTE [Streaming checkpoints]
// A save hands the writer the state as segments: runs of consecutive flat elements (NOTE
// [Checkpoint format]) of one of the three vectors, each a contiguous tensor on any device,
// fp32 or bf16 (a world-1 run: every parameter and moment tensor; under FSDP: this rank's
// segments of its chunks). The writer copies a segment a chunk at a time into one of two
// halves of its staging buffer (pinned: NOTE [Pinned host buffers]), and a writer thread
// widens bf16 to fp32, computes CRC-32s and pwrites the chunk at its place in whichever
// shard file holds those flat elements, while the caller copies the next chunk into the
// other half. Host memory is the buffer, whatever the model's size.
// Segments may come in any order and from several processes (every FSDP rank writes its
// own segments into every shard file: no gather), so the writer cannot checksum a piece
// from its first byte to its last: it returns one PieceCrc per run of a piece it wrote,
// and combine_piece_crcs joins them (crc32_combine) into the CRC-32 of each piece's bytes,
// the checksum the metadata records. The files are byte for byte those an in-memory writer
// makes (tests/cpu/test_checkpoint_stream.cpp keeps one as an oracle).
// Under tensor parallelism the segments are in the rank's own index space and go to its
// files (NOTE [Tensor-parallel checkpoints] in ckpt/checkpoint_layout.h): the writer is the
// same, only the pieces differ.
// Loading is the reverse through one buffer. The destination is a tensor (any device,
// fp32 or bf16) and the whole model's elements it takes, as band ranges (NOTE [Column
// bands] in ckpt/checkpoint_bands.h: a consecutive flat range, or a tensor-parallel rank's
// shard of a tensor). Each piece that holds any of them is read once, a chunk at a time,
// checksummed as it goes, and the runs it shares with the destination (for_each_common_run:
// one run when the bands agree, one per row when they do not) are narrowed to the
// destination's dtype and copied to its device, the runs that follow each other in the
// destination joined into one copy: one copy per chunk when the destination's band lies
// within the piece's (the same layout, or more tensor-parallel ranks than saved), one per
// row of the piece when it is wider (fewer ranks than saved; asynchronous copies on the
// reader's stream, waited for once per chunk). Elements reach the destination before
// their piece's CRC-32 is complete: a damaged piece is an error after the destination was
// partly written, so a failed load leaves no usable state behind (the caller stops, as a
// resume does).
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_bands.h"
#include "ckpt/checkpoint_layout.h"
#include "core/device.h"
#include "core/tensor.h"

namespace forge {

// The default checkpoint.buffer_mb: the staging buffer of a save or load.
inline constexpr int64_t kDefaultCheckpointBufferMiB = 256;

// Elements [flat_offset, flat_offset + data.numel()) of one flat vector: a contiguous
// tensor, fp32 or bf16, on the CPU or the GPU.
struct FlatSegment {
  int64_t flat_offset = 0;
  Tensor data;
};

// The CRC-32 of bytes [byte_begin, byte_begin + byte_length) of piece `piece` (an index
// into the layout's pieces), counted from the piece's first byte.
struct PieceCrc {
  int64_t piece = 0;
  int64_t byte_begin = 0;
  int64_t byte_length = 0;
  uint32_t crc = 0;
};

// Makes the shard files rank-<r>.bin of a save in `temporary_dir`, each at its full size
// (3 * file_numel[r] fp32; format 1: 3 * range.size()), for the writers to fill.
void create_checkpoint_shard_files(const std::string& temporary_dir, const std::vector<int64_t>& file_numel);
void create_checkpoint_shard_files(const std::string& temporary_dir, const std::vector<ShardRange>& ranges);

// The CRC-32 of every piece of `pieces` (a layout's), in their order, from every writer's
// PieceCrcs; an error unless they cover each piece exactly once.
std::vector<uint32_t> combine_piece_crcs(const std::vector<PieceLayout>& pieces, std::vector<PieceCrc> parts);
// Format 1: the same by rank, in the order finish_checkpoint_save expects.
std::vector<std::vector<uint32_t>> combine_piece_crcs(const ModelConfig& model, const std::vector<ShardRange>& ranges,
                                                      std::vector<PieceCrc> parts);
std::vector<std::vector<uint32_t>> combine_piece_crcs(const std::vector<ParamSpec>& specs,
                                                      const std::vector<ShardRange>& ranges, std::vector<PieceCrc> parts);

// PieceCrcs in 32-bit words and back (the FSDP ranks exchange them by all-gather).
std::vector<uint32_t> encode_piece_crcs(const std::vector<PieceCrc>& parts);
std::vector<PieceCrc> decode_piece_crcs(const uint32_t* words, size_t count);
inline constexpr size_t kPieceCrcWords = 7;

// Writes segments into the shard files of a save in progress (created by
// create_checkpoint_shard_files), through a staging buffer of buffer_bytes (NOTE
// [Streaming checkpoints]). One thread calls write() and finish(); a writer thread of its
// own does the file I/O.
class ShardFileWriter {
 public:
  // Format 1: the segments' flat offsets are the whole model's (`model`'s parameters or `specs`).
  ShardFileWriter(std::string temporary_dir, const ModelConfig& model, std::vector<ShardRange> ranges,
                  size_t buffer_bytes);
  ShardFileWriter(std::string temporary_dir, const std::vector<ParamSpec>& specs, std::vector<ShardRange> ranges,
                  size_t buffer_bytes);
  // Any layout: the segments' flat offsets are in tensor-parallel rank `tensor_parallel_rank`'s
  // index space, and go to its files (NOTE [Tensor-parallel checkpoints]).
  ShardFileWriter(std::string temporary_dir, const CheckpointLayout& layout, int tensor_parallel_rank,
                  size_t buffer_bytes);
  // Waits for the writer thread; a save not finished is abandoned (its directory is the
  // caller's to remove).
  ~ShardFileWriter();
  ShardFileWriter(const ShardFileWriter&) = delete;
  ShardFileWriter& operator=(const ShardFileWriter&) = delete;

  // The copies of later write()s start after `event` (recorded on the stream that produced
  // the data: the compute stream, or a snapshot's copies).
  void after(const DeviceEvent& event);
  // Copies the segment through the buffer (waits only for a free half); an error the
  // writer thread met is thrown here or by finish().
  void write(FlatState state, const FlatSegment& segment);
  // Waits for every write, flushes the files to stable storage (fsync) and returns the
  // CRC-32s of what this writer wrote.
  std::vector<PieceCrc> finish();
  // Host bytes staged (the buffer).
  size_t staging_bytes() const { return buffer_.size(); }

 private:
  struct Chunk {
    FlatState state = FlatState::Param;
    int64_t flat_begin = 0, count = 0;
    DType dtype = DType::F32;
    bool full = false;
  };
  void writer_loop();
  void store(const Chunk& chunk, float* data);
  int file(int rank);

  std::string dir_;
  std::vector<PieceLayout> pieces_;
  std::vector<std::vector<size_t>> pieces_by_state_;  // indices into pieces_ this rank writes, ascending flat_begin
  PinnedHostBuffer buffer_;
  int64_t chunk_elements_ = 0;  // fp32 elements per half of the buffer
  DeviceStream stream_;
  std::vector<int> fds_;
  std::vector<PieceCrc> crcs_;

  std::mutex mu_;
  std::condition_variable changed_;
  Chunk chunks_[2];
  int next_fill_ = 0;   // the half write() fills next
  int next_store_ = 0;  // the half the writer thread stores next
  bool closing_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// Reads tensors from a checkpoint a chunk at a time (NOTE [Streaming checkpoints]).
class ShardFileReader {
 public:
  ShardFileReader(const Checkpoint& checkpoint, size_t buffer_bytes);
  ~ShardFileReader();
  // Fills segment.data (fp32 or bf16, any device) with its elements of vector `state`,
  // checking the CRC-32 of every piece it reads.
  void read(FlatState state, const FlatSegment& segment);
  // Fills `out` with the elements of vector `state` that `image` names, one after the
  // other (their sizes add up to out.numel()): a tensor-parallel rank's segment
  // (ShardPlacement::image).
  void read(FlatState state, const Tensor& out, const std::vector<BandRange>& image);
  size_t staging_bytes() const { return buffer_.size(); }

 private:
  const TensorRecord* record_at(FlatState state, int64_t flat_offset) const;  // null: none starts there

  const Checkpoint& checkpoint_;
  PinnedHostBuffer buffer_;
  DeviceStream stream_;  // the copies to the destination
  std::vector<std::unique_ptr<class FileReader>> readers_;
  // Each vector's tensor records by flat offset.
  std::array<std::vector<const TensorRecord*>, 3> records_;
};

}  // namespace forge
