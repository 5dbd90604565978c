#include "distributed/flight_recorder.h"

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <mutex>
#include <optional>

namespace forge {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kEntries = 16;

struct Entry {
  uint64_t id = 0;  // 0: never used
  std::string group;
  std::string call;
  Clock::time_point start;
  std::optional<Clock::time_point> end;
};

struct Recorder {
  std::mutex mu;
  std::array<Entry, kEntries> ring;
  uint64_t next_id = 1;
};

Recorder& recorder() {
  static Recorder* r = new Recorder;  // never destroyed: a watchdog may read it during exit
  return *r;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

uint64_t flight_record_start(std::string_view group, std::string call) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  const uint64_t id = r.next_id++;
  r.ring[id % kEntries] = Entry{id, std::string(group), std::move(call), Clock::now(), std::nullopt};
  return id;
}

void flight_record_end(uint64_t id) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  Entry& e = r.ring[id % kEntries];
  if (e.id == id) e.end = Clock::now();
}

std::string flight_record_text() {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  const Clock::time_point now = Clock::now();
  std::string text;
  const uint64_t first = r.next_id > kEntries ? r.next_id - kEntries : 1;
  for (uint64_t id = first; id < r.next_id; ++id) {
    const Entry& e = r.ring[id % kEntries];
    if (e.id != id) continue;
    const std::string state = e.end ? fmt::format("took {:.3f} s", seconds(*e.end - e.start))
                                    : fmt::format("still running after {:.1f} s", seconds(now - e.start));
    text += fmt::format("\n  {} on {}: started {:.1f} s ago, {}", e.call, e.group, seconds(now - e.start), state);
  }
  if (text.empty()) return " no collective yet";
  return fmt::format(" the last {} of {} collectives:{}", r.next_id - first, r.next_id - 1, text);
}

}  // namespace forge
