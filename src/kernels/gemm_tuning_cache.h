// Measured GEMM algorithm choices kept on disk, so that training.gemm_tuning times each
// shape once per machine instead of once per run. Plain C++ (no CUDA): the algorithms are
// opaque blobs here; kernels/cuda/gemm_tuner.cpp turns them into cuBLASLt's and checks them.
//
// NOTE [GEMM tuning cache]
// Where: one directory, training.gemm_tuning_cache when it names one, else forge's cache
// directory ($FORGE_CACHE_DIR, else $XDG_CACHE_HOME/forge, else $HOME/.cache/forge);
// "off" keeps no cache. In it, one file per target (GPU name, SM count, cuBLASLt version,
// file format), the target spelled in the file name (gemm_tuning_file_name), so another
// GPU's or library's choices are never opened, never overwritten, never deleted.
//
// What: a text file, one line per choice, readable with cat:
//   forge gemm tuning 2
//   device NVIDIA H100 80GB HBM3
//   multiprocessors 132
//   cublaslt 130100
//   gemm m=4096 n=14336 k=4096 a=N b=T in=bf16 out=bf16 beta=zero compute=68 workspace=33554432 algo=<128 hex>
//   fp8gemm m=4096 n=14336 k=4096 a=N b=T in=e4m3,e4m3 scale=0,0 accumulate=fast out=bf16 beta=zero
//     compute=68 workspace=33554432 algo=<128 hex>   (one line)
//   gemm m=4096 n=12288 k=3072 a=N b=T in=bf16 out=bf16 beta=zero compute=68 workspace=33554432
//     epilogue=36 algo=<128 hex>   (one line: a GEMM with a fused epilogue, NOTE [GEMM epilogues])
//   gemm m=4608 n=3072 k=12288 a=N b=T in=bf16 out=bf16 beta=nonzero compute=68
//     workspace=33554432 ld=15360,0 algo=<128 hex>   (one line: a column-block GEMM)
//   checksum <FNV-1a 64 of every byte above, 16 hex>
// The key is everything that decides the choice: forge's row-major problem (m, n, k,
// transposes), the input and output dtypes, whether beta is zero, the library's compute
// type and the workspace the algorithm may use; for an FP8 GEMM (kernels/cuda/fp8_matmul.h)
// also each operand's format (a's, then b's), each operand's scale mode as cuBLASLt numbers
// them (cublasLtMatmulMatrixScale_t; like compute, fixed within the file's cuBLASLt
// version) and whether accumulation is fast or full; for a GEMM with a fused epilogue the
// epilogue (cublasLtEpilogue_t, written only when there is one, so the lines of plain GEMMs
// are as they were); for a GEMM whose b or out is a column block of a wider matrix the
// leading dimensions of b and out (0: dense; NOTE [Column-block GEMMs] in
// kernels/cuda/matmul.cpp), written "ld=B,OUT" after any epilogue only when either is set.
// The algorithm is cuBLASLt's
// cublasLtMatmulAlgo_t, 8 words that the library documents as serializable for use with
// the same library version.
//
// Versions: format 1 had only gemm lines; format 2 adds fp8gemm lines. A format-1 file of
// the same target (its name says v1) is read when there is no format-2 file yet, its
// choices taken over into the format-2 file by the first save and the v1 file left as it
// is (for forge builds that read only format 1, which never open a v2 file).
//
// Trust: a file that lacks the magic line, has a format version other than 1 or 2, fails its
// checksum (a truncated or flipped byte), names another target in its header, or has a
// line that does not parse is ignored whole, with one warning naming the file and the
// fault, and the first save replaces it. A file that cannot be read (permissions) is one
// warning too, and left alone: that run saves nothing. Even a valid choice is only a
// candidate: the CUDA side runs it past cublasLtMatmulAlgoCheck for its problem and
// tunes again when the library rejects it.
//
// Writes: after each newly tuned shape, so a run killed mid-way keeps what it measured;
// a save reads and writes a few KiB, little beside timing the shape (the 8B proxy's
// first step spends 10.8 s timing its shapes). A save re-reads the file, lays this
// process's choices over what is there (so ranks and runs tuning at once keep each
// other's shapes) and replaces it with one rename (write_file_atomic). Two savers racing
// may drop the other's newest shapes, which the next run measures again and adds; the
// file is always whole, also in a directory several hosts share (each writer's
// temporary is named by its host and pid, NOTE [Durable files]). No fsync: a cache lost
// to a power cut costs one tuning. A directory that cannot be written is one warning; the
// choices then live in the process only.
#pragma once

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "kernels/cpu/fp8.h"

namespace forge {

// What a choice was measured on: it is only used on the same.
struct GemmTuningTarget {
  std::string device_name;       // cudaDeviceProp::name, e.g. "NVIDIA H100 80GB HBM3"
  int64_t multiprocessors = 0;   // a GPU partition (MIG) keeps the device name but has fewer SMs
  uint64_t cublaslt_version = 0;  // cublasLtGetVersion()
};

// What an FP8 GEMM adds to its problem's key (kernels/cuda/fp8_matmul.h).
struct GemmFp8Inputs {
  cpu::Fp8Format a_format = cpu::Fp8Format::E4M3, b_format = cpu::Fp8Format::E4M3;
  int32_t a_scale_mode = 0, b_scale_mode = 0;  // cublasLtMatmulMatrixScale_t of forge's a and b
  bool fast_accumulation = false;
  auto operator<=>(const GemmFp8Inputs&) const = default;
};

// One GEMM problem as the algorithm choice sees it (NOTE [GEMM algorithm choice]).
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;  // forge's row-major out[m, n] = op(a)[m, k] op(b)[k, n]
  bool transpose_a = false, transpose_b = false;
  DType input_dtype = DType::BF16;  // U8 for FP8 codes, whose formats are in fp8
  DType out_dtype = DType::BF16;
  bool beta_zero = true;
  int64_t compute_type = 0;      // cublasComputeType_t
  uint64_t workspace_bytes = 0;  // the most workspace the algorithm may use
  std::optional<GemmFp8Inputs> fp8;  // set for FP8 GEMMs only
  int32_t epilogue = 0;  // cublasLtEpilogue_t of a fused GEMM (NOTE [GEMM epilogues]), 0 for none
  // A column-block GEMM's leading dimensions of b and out (NOTE [Column-block GEMMs] in
  // kernels/cuda/matmul.cpp), 0 for dense operands; written "ld=B,OUT" when either is set.
  int64_t ld_b = 0, ld_out = 0;
  auto operator<=>(const GemmProblem&) const = default;
};

// cublasLtMatmulAlgo_t, byte for byte.
using GemmAlgorithm = std::array<uint64_t, 8>;
using GemmChoices = std::map<GemmProblem, GemmAlgorithm>;

// The directory tuned choices are kept in (NOTE [GEMM tuning cache]), given the value of
// training.gemm_tuning_cache: that value when it names a directory, "" (no cache) when it
// is "off", and when it is empty forge's cache directory from the environment, or "" when
// none of its variables is set.
std::string gemm_tuning_cache_dir(const std::string& setting);

// e.g. "gemm-tuning-v2-nvidia-h100-80gb-hbm3-132sm-cublaslt130100.txt"; format_version 1
// names the file of forge builds before FP8 choices (NOTE [GEMM tuning cache], Versions).
std::string gemm_tuning_file_name(const GemmTuningTarget& target, int format_version = 2);

std::string serialize_gemm_choices(const GemmTuningTarget& target, const GemmChoices& choices);

// The choices in a file's contents, or why they are not usable for `target`.
struct ParsedGemmChoices {
  GemmChoices choices;
  std::string error;  // empty when the contents are a valid cache for target
};
ParsedGemmChoices parse_gemm_choices(std::string_view contents, const GemmTuningTarget& target);

// The choices of one target in one directory, as this process knows them. Not
// thread-safe: its owner (one GPU's GEMM context) serializes calls; saves from several
// caches of one process are serialized inside.
class GemmTuningCache {
 public:
  // Reads the target's file in `directory`: a missing file is an empty cache (or the
  // choices of the target's format-1 file, when there is a valid one); an invalid one is
  // ignored with one warning and replaced by the first save; one that cannot be read is
  // one warning and left alone (nothing is saved).
  GemmTuningCache(std::string directory, GemmTuningTarget target);

  const std::string& directory() const { return directory_; }
  const std::string& path() const { return path_; }
  size_t loaded() const { return loaded_; }  // choices read when the cache was opened

  std::optional<GemmAlgorithm> find(const GemmProblem& problem) const;

  // Records a choice this process measured and saves the file: what is on disk now with
  // this process's choices laid over it, which this cache then holds too (so another
  // rank's choices serve this one's next shapes). A failed save is one warning; later
  // adds then only record.
  void add(const GemmProblem& problem, const GemmAlgorithm& algorithm);

 private:
  void save();
  void read_first_format_file();  // when the target has no current-format file

  std::string directory_, path_;
  GemmTuningTarget target_;
  GemmChoices choices_;
  size_t loaded_ = 0;
  bool saving_ = true;
};

// How this process chose its GEMM algorithms on one GPU, for the run's log and for tests.
struct GemmTuningStats {
  std::string cache_file;          // empty when choices are not kept on disk
  int64_t choices_loaded = 0;      // read from cache_file when it was opened
  int64_t shapes_from_cache = 0;   // plans that took a loaded choice
  int64_t cached_rejected = 0;     // loaded choices cuBLASLt rejected for their problem, tuned again
  int64_t shapes_tuned = 0;        // plans chosen by timing (and added to cache_file)
};

// One log line: where the cache is and what came from it.
std::string describe_gemm_tuning(const GemmTuningStats& stats);

}  // namespace forge
