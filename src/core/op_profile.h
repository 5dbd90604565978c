// Time spent per op class (GEMM, attention, elementwise, optimizer), for the kernel-class
// breakdown of a training step (logging.profile_ops).
//
// NOTE [Op profiling]
// When enabled, every op dispatcher opens an OpProfileScope, which synchronizes the device
// before and after the op and adds the host time between to its class. Synchronizing
// removes any overlap between ops (there is none on forge's single stream) and adds a few
// microseconds per op, so profiled steps run slightly slower than normal ones; the
// breakdown is for finding where time goes, not for reporting throughput. When disabled a
// scope costs one branch.
#pragma once

#include <array>
#include <chrono>
#include <map>
#include <string>
#include <string_view>

namespace forge {

enum class OpClass { Gemm, Attention, Elementwise, Optimizer };
constexpr int kOpClassCount = 4;
std::string_view op_class_name(OpClass c);

void set_op_profiling(bool enabled);
bool op_profiling();
// Seconds per class since the last reset.
std::array<double, kOpClassCount> op_profile_seconds();
// Seconds per op (by the name its dispatcher gives) since the last reset.
std::map<std::string, double> op_profile_seconds_by_op();
void reset_op_profile();

class OpProfileScope {
 public:
  OpProfileScope(OpClass op_class, const char* op_name);
  ~OpProfileScope();
  OpProfileScope(const OpProfileScope&) = delete;
  OpProfileScope& operator=(const OpProfileScope&) = delete;
  // Whether this scope is timing (profiling on, outermost op).
  bool active() const { return active_; }
  // Files the time under "name [detail]" as well (a GEMM's shape, say); call only when
  // active(), so that building the detail costs nothing otherwise.
  void set_detail(std::string detail) { detail_ = std::move(detail); }

 private:
  OpClass class_;
  const char* name_;
  std::string detail_;
  bool active_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace forge
