// Bus bandwidth of NCCL collectives, as nccl-tests defines it (its doc/PERFORMANCE.md).
//
// Algorithm bandwidth is the collective's size over its time: for all-reduce the buffer
// each rank holds, for all-gather the gathered buffer each rank ends up with. It depends
// on the rank count, so it cannot be compared with what the links carry. Bus bandwidth
// scales it by the share of the data that must cross links on an optimal ring, making it
// comparable with the hardware's link bandwidth whatever the rank count:
//   all-reduce  busbw = algbw * 2(n-1)/n   (a reduce-scatter, then an all-gather)
//   all-gather  busbw = algbw * (n-1)/n    (each rank receives the n-1 shards it lacks)
#pragma once

namespace forge {

inline double algorithm_bandwidth(double bytes, double seconds) { return bytes / seconds; }

inline double allreduce_bus_bandwidth(double bytes, double seconds, int ranks) {
  return algorithm_bandwidth(bytes, seconds) * 2.0 * (ranks - 1) / ranks;
}

inline double allgather_bus_bandwidth(double gathered_bytes, double seconds, int ranks) {
  return algorithm_bandwidth(gathered_bytes, seconds) * (ranks - 1) / ranks;
}

}  // namespace forge
