// Megatron-LM indexed datasets: <prefix>.bin holds the token ids of every sequence back to
// back; <prefix>.idx describes them. The .idx layout, as megatron-core writes it
// (megatron/core/datasets/indexed_dataset.py), all little-endian:
//
//   offset 0   9 bytes   magic "MMIDIDX\0\0"
//   offset 9   u64       version, always 1
//   offset 17  u8        token dtype code (IndexedDType)
//   offset 18  u64       sequence count N
//   offset 26  u64       document count D (= documents + 1: a leading 0 boundary)
//   offset 34  i32[N]    sequence lengths, in tokens
//              i64[N]    sequence pointers, byte offsets into .bin
//              i64[D]    document indices: sequence index where each document starts,
//                        ascending from 0 to N
//
// IndexedDataset maps both files and validates every field on open, so that a bad file
// fails at startup with the file, byte offset and expectation, never mid-run with a
// crash. Token values are validated against the model's vocabulary when read.
// IndexedDatasetWriter writes the same format (one document per call, or several
// sequences per document); megatron-core reads its output and vice versa.
//
// NOTE [Atomic dataset output]
// IndexedDatasetWriter writes <prefix>.bin and <prefix>.idx as two AtomicFiles (NOTE
// [Durable files] in core/durable_file.h), under temporary names beside them
// (<prefix>.bin.tmp-<host>-<pid>, <prefix>.idx.tmp-<host>-<pid>). Only after the last document is
// written and both files are complete does finalize() move any previous <prefix>.idx out
// of the way (to <prefix>.idx.tmp-<host>-<pid>.previous), then rename the new .bin into
// place and then the new .idx, and only then delete the previous index. A run that fails
// or is interrupted before that point leaves the previous dataset (if any) as it was; one
// whose .bin cannot be renamed into place (a directory in the way) moves the previous
// .idx back, so the previous dataset is whole again; one interrupted between those steps
// leaves a .bin without an .idx (and the previous index beside it, to restore by hand): no
// file at <prefix>.bin/.idx ever looks complete unless it is. A writer destroyed before
// finalize() (a failed run) removes its temporary files; a killed process leaves them
// (named by its host and pid). The files are not flushed to disk (NOTE [Durable files]
// says why).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/durable_file.h"
#include "data/mapped_file.h"

namespace forge {

// megatron-core's DType codes. Only integer types hold token ids.
enum class IndexedDType : uint8_t { U8 = 1, I8 = 2, I16 = 3, I32 = 4, I64 = 5, F64 = 6, F32 = 7, U16 = 8 };

size_t indexed_dtype_size(IndexedDType dtype);
std::string_view indexed_dtype_name(IndexedDType dtype);  // numpy's name: "uint16", ...
// Parses a numpy dtype name ("uint16", "int32", ...); throws naming the expected names.
IndexedDType indexed_dtype_from_name(std::string_view name);

class IndexedDataset {
 public:
  // Opens <prefix>.idx and <prefix>.bin and validates the index against the data file.
  explicit IndexedDataset(const std::string& prefix);

  const std::string& idx_path() const { return idx_.path(); }
  const std::string& bin_path() const { return bin_.path(); }
  IndexedDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  // Documents, i.e. document_indices().size() - 1 as megatron-core counts them.
  int64_t num_documents() const { return num_document_indices_ - 1; }
  int64_t sequence_length(int64_t sequence) const;
  int64_t sequence_pointer(int64_t sequence) const;
  // Entry i of the document index array, 0 <= i <= num_documents().
  int64_t document_index(int64_t i) const;
  // Token `position` of `sequence`, as stored.
  int64_t token(int64_t sequence, int64_t position) const;
  // Copies `count` tokens of `sequence` from token `offset` on into `out`, failing with
  // the .bin path and byte offset on the first id outside [0, vocab_size).
  void read_tokens(int64_t sequence, int64_t offset, int64_t count, int64_t vocab_size,
                   int32_t* out) const;

 private:
  void validate_header();
  void validate_sequences();
  void validate_document_indices();
  int64_t token_at_byte(size_t byte_offset) const;

  MappedFile idx_;
  MappedFile bin_;
  IndexedDType dtype_ = IndexedDType::I32;
  size_t token_size_ = 4;
  int64_t num_sequences_ = 0;
  int64_t num_document_indices_ = 0;
  size_t lengths_offset_ = 0, pointers_offset_ = 0, documents_offset_ = 0;
};

class IndexedDatasetWriter {
 public:
  // Creates the temporary .bin now; finalize() writes the .idx and moves both into place
  // (NOTE [Atomic dataset output]).
  IndexedDatasetWriter(std::string prefix, IndexedDType dtype);

  // Appends a document made of one sequence.
  void add_document(std::span<const int32_t> tokens);
  // Appends a sequence to the current document; end_document() closes the document.
  void add_sequence(std::span<const int32_t> tokens);
  void end_document();
  // Writes the rest of .bin and the .idx, and moves both into place. Sequences after the
  // last end_document() are closed into a final document.
  void finalize() {
    write_index();
    commit();
  }
  // finalize() in two steps, for a caller that promotes several datasets together (NOTE
  // [SFT dataset pair] in data/sft_dataset_writer.h): write_index() completes both
  // temporary files; commit() moves them into place as NOTE [Atomic dataset output] says.
  void write_index();
  void commit();

 private:
  void write_buffered_tokens();

  std::string prefix_;
  IndexedDType dtype_;
  AtomicFile bin_;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  std::vector<uint8_t> buffer_;  // encoded tokens not yet written to bin_
  std::unique_ptr<AtomicFile> idx_;  // written by write_index()
  bool finalized_ = false;
};

}  // namespace forge
