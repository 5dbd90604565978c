#include "core/op_profile.h"

#include "core/device.h"

namespace forge {
namespace {

bool g_enabled = false;
std::array<double, kOpClassCount> g_seconds{};
std::map<std::string, double> g_by_op;
thread_local int g_depth = 0;  // ops called from inside ops count once, in the outer class

}  // namespace

std::string_view op_class_name(OpClass c) {
  switch (c) {
    case OpClass::Gemm: return "gemm";
    case OpClass::Attention: return "attention";
    case OpClass::Elementwise: return "elementwise";
    case OpClass::Optimizer: return "optimizer";
  }
  return "?";
}

void set_op_profiling(bool enabled) { g_enabled = enabled; }
bool op_profiling() { return g_enabled; }
std::array<double, kOpClassCount> op_profile_seconds() { return g_seconds; }
std::map<std::string, double> op_profile_seconds_by_op() { return g_by_op; }
void reset_op_profile() {
  g_seconds.fill(0.0);
  g_by_op.clear();
}

OpProfileScope::OpProfileScope(OpClass op_class, const char* op_name)
    : class_(op_class), name_(op_name), active_(g_enabled && g_depth == 0) {
  if (!active_) return;
  ++g_depth;
  device_synchronize();
  start_ = std::chrono::steady_clock::now();
}

OpProfileScope::~OpProfileScope() {
  if (!active_) return;
  device_synchronize();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  g_seconds[static_cast<int>(class_)] += seconds;
  g_by_op[name_] += seconds;
  if (!detail_.empty()) g_by_op[std::string(name_) + " [" + detail_ + "]"] += seconds;
  --g_depth;
}

}  // namespace forge
