// The last collectives of this process, as NCCL's flight recorder keeps them for PyTorch:
// for each, the group, its text (name, sequence number on its group, sizes), when it
// started and when it ended (or that it has not). The process groups record every
// collective; what failed prints the record (heartbeat.h, NOTE [Failure detection]), so a
// hung job says which collective each rank was in and which one a rank never joined.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace forge {

// Records the start of a collective; returns its id for flight_record_end. Thread-safe.
uint64_t flight_record_start(std::string_view group, std::string call);
void flight_record_end(uint64_t id);
// The record, oldest first, one line per collective (at most the last 16), e.g.
// "  all_reduce #12 (f32, 3 elements, sum) on the world: started 6.1 s ago, still running".
std::string flight_record_text();

}  // namespace forge
