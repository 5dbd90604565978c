// An export written by many ranks at once, none of them holding the whole model: the
// language models' Hugging Face export (NOTE [Export in pieces] in train/trainer_hf.cpp)
// and FLUX's diffusers export (NOTE [FLUX export in pieces] in ckpt/flux_weights_export.h)
// share it.
//
// NOTE [Piecewise export protocol]
// Rank 0 names the temporary directory with its pid, which every rank learns through an
// all-reduce (hf_export_temporary_path(dir, pid)), and makes it, every weight file at its
// full size with its header (`begin`); an all-reduce then says whether it could, so no rank
// writes into files that are not there. Every writing rank writes its values at their
// places (`write`), and the ranks sum, exactly (count_over_ranks), how many failed and how
// many elements they wrote, which must be the model's: every element written once. Rank 0
// then writes what else the export holds and renames the directory into place (`commit`),
// and a last all-reduce holds every rank until it is there, or says it is not. A failure
// anywhere fails every rank with the same message and leaves no directory at the target:
// rank 0's staging object, destroyed by the failure, removes the temporary directory, and
// what was at the target stays as it was. The writers must see one file system, as for
// checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "core/tensor.h"
#include "distributed/data_parallel_comm.h"

namespace forge {

struct PiecewiseExport {
  std::string what;  // "Hugging Face", "FLUX diffusers": the messages say "the <what> export to '<dir>'"
  std::string dir;
  int64_t numel = 0;  // the elements the writers write between them
  // Rank 0: makes the temporary directory `temporary` with every file at its full size.
  std::function<void(const std::string& temporary)> begin;
  // Each writing rank: its values into the files in `temporary`; returns the elements written.
  std::function<int64_t(const std::string& temporary)> write;
  // Rank 0, once every element is written: the other files, and the rename into place.
  std::function<void()> commit;
};

// NOTE [Piecewise export protocol], over every rank of `comm`; `writer`: whether this rank
// writes (its values are not another's copy).
void export_in_pieces(DataParallelComm& comm, int rank, bool writer, const PiecewiseExport& e);

// Values [0, t.numel()) of an fp32 tensor handed to `write` in runs of at most `window`
// elements, through a host buffer of that size when t is on the GPU (in place on the CPU).
// Returns the host bytes staged.
size_t write_through_host(const Tensor& t, int64_t window,
                          const std::function<void(int64_t, std::span<const float>)>& write);

}  // namespace forge
