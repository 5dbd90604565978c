// A checkpoint save between its start and its completion: what this rank writes, where it
// writes from (the live state, or a snapshot of it), and the thread that writes it when
// the save is asynchronous (NOTE [Async checkpoints] in train/trainer_checkpoint.cpp).
#pragma once

#include <array>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_stream.h"
#include "core/device.h"

namespace forge {

// This rank's segments of the three flat vectors (NOTE [Streaming checkpoints]).
using StateSegments = std::array<std::vector<FlatSegment>, 3>;

struct CheckpointSaveJob {
  TrainingState state;
  std::string dir;                         // <folder>/step-<N>, once complete
  CheckpointLayout layout;                 // the checkpoint's files and pieces
  std::optional<AtomicDirectory> staging;  // the process that finishes the save (rank 0)
  std::chrono::steady_clock::time_point started;
  double stall_seconds = 0;                // the step loop's share: the snapshot copy
  std::string snapshot_place;              // "device memory", "host memory"; empty: the live state
  size_t snapshot_bytes = 0;
  int64_t host_resident_before = -1;       // VmRSS as a synchronous save started (its peak was reset)
  std::array<Tensor, 3> snapshot;          // the copies the segments view (async)
  std::unique_ptr<DeviceEvent> snapshot_ready;
  std::unique_ptr<ShardFileWriter> writer;  // this rank's, when it writes
  std::thread thread;                       // the asynchronous writer of `writer`
  std::vector<PieceCrc> crcs;
  std::exception_ptr error;

  // Writes `segments` through `writer`, on a thread of its own when `background`.
  void start(StateSegments segments, bool background);
  // Waits for the writing; its CRC-32s, or the error it met, are then in crcs / error.
  void wait();
  // A save abandoned (an error elsewhere) waits for its thread; the staging directory is
  // then removed.
  ~CheckpointSaveJob();
};

}  // namespace forge
