// An export written by every rank; see export_in_pieces.h (NOTE [Piecewise export protocol]).
#include "train/export_in_pieces.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "ckpt/hf_export.h"
#include "core/error.h"

namespace forge {

void export_in_pieces(DataParallelComm& comm, int rank, bool writer, const PiecewiseExport& e) {
  const int64_t token = std::llround(comm.sum_over_ranks(rank == 0 ? static_cast<double>(::getpid()) : 0.0));
  const std::string temporary = hf_export_temporary_path(e.dir, token);
  std::string failure;
  if (rank == 0) {
    try {
      e.begin(temporary);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  // The files are there before any rank writes (an all-reduce holds every rank until rank 0's part).
  if (comm.sum_over_ranks(failure.empty() ? 0.0 : 1.0) > 0)
    FORGE_FAIL("the {} export to '{}' could not be started: {}", e.what, e.dir,
               failure.empty() ? std::string("rank 0 could not create its files (its log says why)") : failure);
  int64_t written = 0;
  if (writer) {
    try {
      written = e.write(temporary);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  // Exact however large the model (an fp32 sum of the counts is not past 2^24).
  const std::vector<int64_t> sums = comm.counts_over_ranks({failure.empty() ? 0 : 1, written});
  if (!failure.empty()) FORGE_FAIL("the {} export to '{}' could not be written by rank {}: {}", e.what, e.dir, rank, failure);
  if (sums[0] > 0)
    FORGE_FAIL("the {} export to '{}' could not be written: {} rank(s) failed to write their part (their logs say why)",
               e.what, e.dir, sums[0]);
  FORGE_CHECK(sums[1] == e.numel, "the {} export to '{}': the ranks wrote {} elements, the model has {}", e.what, e.dir,
              sums[1], e.numel);
  if (rank == 0) {
    try {
      e.commit();
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  // The export is in place before any rank goes on.
  if (comm.sum_over_ranks(failure.empty() ? 0.0 : 1.0) > 0)
    FORGE_FAIL("the {} export to '{}' could not be completed: {}", e.what, e.dir,
               failure.empty() ? std::string("rank 0 could not finish it (its log says why)") : failure);
}

size_t write_through_host(const Tensor& t, int64_t window,
                          const std::function<void(int64_t, std::span<const float>)>& write) {
  FORGE_CHECK(t.dtype() == DType::F32, "export: {} weights, fp32 expected", dtype_name(t.dtype()));
  const int64_t n = t.numel();
  if (t.device() == Device::CPU) {
    write(0, std::span<const float>(t.data<float>(), static_cast<size_t>(n)));
    return 0;
  }
  std::vector<float> host(static_cast<size_t>(std::min(window, n)));
  const Tensor flat = t.view({n});
  for (int64_t k = 0; k < n; k += window) {
    const int64_t count = std::min(window, n - k);
    copy_bytes(host.data(), Device::CPU, flat.narrow(k, k + count).raw(), t.device(),
               static_cast<size_t>(count) * sizeof(float));
    write(k, std::span<const float>(host.data(), static_cast<size_t>(count)));
  }
  return host.size() * sizeof(float);
}

}  // namespace forge
