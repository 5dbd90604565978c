#include "core/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace forge {
namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "read and written in a signal handler");

void on_stop_signal(int sig) {
  int expected = 0;
  if (!g_stop_signal.compare_exchange_strong(expected, sig)) {
    if (sig == SIGINT) {  // a second Ctrl-C: stop now, as SIGINT normally does
      signal(SIGINT, SIG_DFL);
      raise(SIGINT);
    }
    return;
  }
  static const char kMessage[] =
      "forge: stop requested by signal: finishing the current step, then saving a checkpoint and exiting (SIGINT "
      "again aborts at once)\n";
  [[maybe_unused]] ssize_t ignored = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

int stop_signal() { return g_stop_signal.load(); }

}  // namespace forge
