#include "distributed/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "core/exit_status.h"
#include "core/log.h"
#include "core/stop_signal.h"
#include "distributed/rank_output.h"
#include "distributed/tcp_socket.h"
#include "distributed/tcp_store.h"

extern char** environ;

namespace forge {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kDefaultMultiNodePort = 29500;  // torchrun's
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};
// While only programs started by ranks remain, how often to look whether they are gone.
constexpr int kLeftoverPollMs = 50;
// How long the other ranks of a forge job have to notice a failed rank themselves (NOTE
// [Failure detection]: at once for a rank that exited) and exit naming it, before SIGTERM.
constexpr double kPeerNoticeSeconds = 5;

std::string signal_text(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("signal {} (SIG{})", sig, abbrev) : fmt::format("signal {}", sig);
}

// Signals reach the event loop through a pipe (the self-pipe trick): the handler only
// writes the signal number, and poll() wakes up on it along with the ranks' output.
int g_signal_pipe = -1;

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t ignored = write(g_signal_pipe, &byte, 1);
  errno = saved;
}

class SignalRelay {
 public:
  SignalRelay() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) FORGE_FAIL("forge launch: pipe: {}", std::strerror(errno));
    read_end_ = net::Fd(fds[0]);
    write_end_ = net::Fd(fds[1]);
    g_signal_pipe = fds[1];
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) sigaction(kForwardedSignals[i], &action, &saved_[i]);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &action, &saved_chld_);
    // A reader of the launcher's output that goes away must not kill the job.
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &saved_pipe_);
  }
  ~SignalRelay() {
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) sigaction(kForwardedSignals[i], &saved_[i], nullptr);
    sigaction(SIGCHLD, &saved_chld_, nullptr);
    sigaction(SIGPIPE, &saved_pipe_, nullptr);
    g_signal_pipe = -1;
  }
  SignalRelay(const SignalRelay&) = delete;
  SignalRelay& operator=(const SignalRelay&) = delete;

  int fd() const { return read_end_.get(); }
  // The signals received since the last call.
  std::vector<int> take() {
    std::vector<int> signals;
    unsigned char byte;
    while (read(read_end_.get(), &byte, 1) == 1) signals.push_back(byte);
    return signals;
  }

 private:
  net::Fd read_end_, write_end_;
  struct sigaction saved_[std::size(kForwardedSignals)] = {};
  struct sigaction saved_chld_ = {};
  struct sigaction saved_pipe_ = {};
};

struct Rank {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // from waitpid once it ended
  net::Fd out, err;
  std::optional<RankOutput> out_lines, err_lines;
};

// What every rank executes. argv and the environment are built before fork(), so the
// child only sets up its signals and file descriptors and calls exec.
struct Program {
  std::string path;
  std::vector<std::string> argv;
};

Program resolve_program(const std::vector<std::string>& command, const std::vector<std::string>& forge_subcommands) {
  if (std::find(forge_subcommands.begin(), forge_subcommands.end(), command[0]) == forge_subcommands.end())
    return {command[0], command};
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  Program program{"/proc/self/exe", {n > 0 ? std::string(self, static_cast<size_t>(n)) : "forge"}};
  program.argv.insert(program.argv.end(), command.begin(), command.end());
  return program;
}

std::vector<std::string> rank_environment(const std::vector<std::pair<std::string, std::string>>& set) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (std::none_of(set.begin(), set.end(), [&](const auto& kv) { return kv.first == name; })) env.emplace_back(entry);
  }
  for (const auto& [name, value] : set) env.push_back(name + "=" + value);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void make_pipe(int fds[2]) {
  if (pipe2(fds, O_CLOEXEC) != 0) FORGE_FAIL("forge launch: pipe: {}", std::strerror(errno));
}

// Starts one rank. Returns the errno of a failed exec (the child is reaped then), else 0.
int spawn(Rank& r, Program& program, std::vector<std::string>& env) {
  int out[2], err[2], exec_status[2];
  make_pipe(out);
  make_pipe(err);
  make_pipe(exec_status);
  std::vector<char*> argv = c_strings(program.argv);
  std::vector<char*> envp = c_strings(env);
  const int dev_null = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t launcher = getpid();

  // Signals stay blocked across fork() so that none reaches the child while it still
  // has the launcher's handlers; the child resets them to the defaults, then unblocks.
  sigset_t all, previous;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &previous);
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != launcher) _exit(1);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (dev_null >= 0) dup2(dev_null, STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execvpe(program.path.c_str(), argv.data(), envp.data());
    const int error = errno;
    [[maybe_unused]] ssize_t ignored = write(exec_status[1], &error, sizeof(error));
    _exit(127);
  }
  const int fork_error = errno;
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (dev_null >= 0) close(dev_null);
  close(out[1]);
  close(err[1]);
  close(exec_status[1]);
  r.out = net::Fd(out[0]);
  r.err = net::Fd(err[0]);
  net::Fd status_pipe(exec_status[0]);
  if (pid < 0) FORGE_FAIL("forge launch: fork: {}", std::strerror(fork_error));
  setpgid(pid, pid);  // also here, so the group exists before any signal is sent to it
  r.pid = pid;
  r.running = true;
  // The status pipe closes on a successful exec (O_CLOEXEC) or carries exec's errno.
  int exec_error = 0;
  ssize_t n;
  do {
    n = read(status_pipe.get(), &exec_error, sizeof(exec_error));
  } while (n < 0 && errno == EINTR);
  fcntl(r.out.get(), F_SETFL, O_NONBLOCK);
  fcntl(r.err.get(), F_SETFL, O_NONBLOCK);
  if (n != static_cast<ssize_t>(sizeof(exec_error))) return 0;
  waitpid(pid, nullptr, 0);
  r.running = false;
  return exec_error;
}

class Job {
 public:
  Job(std::vector<Rank>& ranks, double grace_period_s, double notice_s)
      : ranks_(ranks), grace_(grace_period_s), notice_(notice_s) {}

  // After run(): how the rank whose failure ended the job ended ("rank 2 was killed by
  // signal 9 (SIGKILL)"), empty when none failed; and whether the launcher was signalled.
  const std::string& failure() const { return failure_text_; }
  bool signalled() const { return received_signal_ != 0; }

  // Runs the loop until every rank has ended; returns the launcher's exit code.
  int run(SignalRelay& signals) {
    // Once stopping, the programs a rank started (its process group) must end too, even
    // when the rank itself already has: they are waited for until the grace period ends.
    while (running() > 0 || (stopping_ && !killed_ && leftovers())) {
      std::vector<pollfd> fds{{signals.fd(), POLLIN, 0}};
      std::vector<std::pair<Rank*, bool>> owners;  // (rank, is stderr) per fd after the first
      for (Rank& r : ranks_) {
        for (bool is_err : {false, true}) {
          const net::Fd& fd = is_err ? r.err : r.out;
          if (!fd.valid()) continue;
          fds.push_back({fd.get(), POLLIN, 0});
          owners.emplace_back(&r, is_err);
        }
      }
      int timeout_ms = -1;
      if (kill_at_) timeout_ms = net::milliseconds_until(*kill_at_);
      if (stop_at_) {
        const int until_stop = net::milliseconds_until(*stop_at_);
        timeout_ms = timeout_ms < 0 ? until_stop : std::min(timeout_ms, until_stop);
      }
      if (running() == 0) timeout_ms = timeout_ms < 0 ? kLeftoverPollMs : std::min(timeout_ms, kLeftoverPollMs);
      poll(fds.data(), fds.size(), timeout_ms);
      for (int sig : signals.take())
        if (sig != SIGCHLD) on_launcher_signal(sig);
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents != 0) pass_on(*owners[i - 1].first, owners[i - 1].second);
      reap();
      if (stop_at_ && Clock::now() >= *stop_at_) {
        stop_at_.reset();
        if (running() > 0) {
          log_error("forge launch: ranks still running {:g} s after rank {} failed; stopping them (SIGTERM, SIGKILL "
                    "after {:g} s)",
                    notice_, first_failure_->rank, grace_);
          stop_all(SIGTERM);
        }
      }
      if (kill_at_ && Clock::now() >= *kill_at_) kill_remaining();
    }
    for (Rank& r : ranks_) {
      for (bool is_err : {false, true}) {
        // What the rank wrote before it ended; bounded, as a program it left running
        // in the background may hold the pipe open and keep writing.
        for (int i = 0; i < 64 && (is_err ? r.err : r.out).valid(); ++i)
          if (!pass_on(r, is_err)) break;
        (is_err ? r.err_lines : r.out_lines)->flush();
      }
    }
    if (first_failure_) {
      const int status = first_failure_->status;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    // Every rank stopped by the signal after saving (NOTE [Stop signals]): the job may be requeued.
    if (received_signal_ && std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
          return WIFEXITED(r.status) && WEXITSTATUS(r.status) == kExitStopped;
        }))
      return kExitStopped;
    if (received_signal_) return 128 + received_signal_;
    return 0;
  }

  // Stops every running rank (SIGTERM to its group now, SIGKILL after the grace period).
  void stop_all(int sig) {
    stopping_ = true;
    stop_at_.reset();
    for (Rank& r : ranks_)
      if (r.running || group_alive(r)) kill(-r.pid, sig);
    if (!kill_at_)
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_));
  }

 private:
  static bool group_alive(const Rank& r) { return r.pid > 0 && kill(-r.pid, 0) == 0; }
  bool leftovers() const { return std::any_of(ranks_.begin(), ranks_.end(), group_alive); }

  int running() const {
    return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; }));
  }

  void on_launcher_signal(int sig) {
    if (received_signal_ != 0) {
      log_warn("forge launch: {} again: killing every rank now", signal_text(sig));
      kill_remaining();
      return;
    }
    received_signal_ = sig;
    log_warn("forge launch: received {}: passing it to every rank (SIGKILL after {:g} s)", signal_text(sig), grace_);
    stop_all(sig);
  }

  // Passes on what a rank's stdout or stderr pipe holds now, up to a budget so that one
  // chatty rank cannot starve the others; closes the pipe at end of file. True when the
  // budget ran out first (more may be waiting).
  bool pass_on(Rank& r, bool is_err) {
    net::Fd& fd = is_err ? r.err : r.out;
    RankOutput& lines = is_err ? *r.err_lines : *r.out_lines;
    char chunk[16384];
    for (int reads = 0; reads < 4;) {
      const ssize_t n = read(fd.get(), chunk, sizeof(chunk));
      if (n > 0) {
        lines.feed({chunk, static_cast<size_t>(n)});
        ++reads;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) fd = net::Fd();
      return false;
    }
    return true;
  }

  // A rank that exits kExitPeerFailed stopped because another failed (its log names which):
  // the first rank that failed on its own is the one reported, whenever it is reaped.
  void reap() {
    for (Rank& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      if (waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      r.status = status;
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (!failed || stopping_) continue;
      const auto secondary = [](const Rank* f) {
        return WIFEXITED(f->status) && WEXITSTATUS(f->status) == kExitPeerFailed;
      };
      if (first_failure_ && !(secondary(first_failure_) && !secondary(&r))) continue;
      const bool first = first_failure_ == nullptr;
      first_failure_ = &r;
      const std::string how = WIFEXITED(status) ? fmt::format("exited with code {}", WEXITSTATUS(status))
                                                : fmt::format("was killed by {}", signal_text(WTERMSIG(status)));
      failure_text_ = fmt::format("rank {} {}", r.rank, how);
      if (running() == 0 || !first) {
        log_error("forge launch: {}", failure_text_);
      } else if (notice_ > 0) {
        log_error("forge launch: {}; the other ranks have {:g} s to notice and exit before SIGTERM", failure_text_,
                  notice_);
        stop_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(notice_));
      } else {
        log_error("forge launch: {}; stopping the other ranks (SIGTERM, SIGKILL after {:g} s)", failure_text_, grace_);
        stop_all(SIGTERM);
      }
    }
  }

  void kill_remaining() {
    std::vector<int> stubborn;
    for (Rank& r : ranks_) {
      if (!r.running && !group_alive(r)) continue;
      kill(-r.pid, SIGKILL);
      stubborn.push_back(r.rank);
    }
    if (!stubborn.empty())
      log_warn("forge launch: rank{} {} (or programs {} started) still running after {:g} s: sent SIGKILL",
               stubborn.size() > 1 ? "s" : "", format_ranks(stubborn), stubborn.size() > 1 ? "they" : "it", grace_);
    kill_at_.reset();
    killed_ = true;
  }

  std::vector<Rank>& ranks_;
  double grace_;
  double notice_;  // seconds the others have to notice a failed rank before SIGTERM
  std::optional<Clock::time_point> stop_at_;  // when they get SIGTERM
  std::optional<Clock::time_point> kill_at_;
  std::string failure_text_;
  const Rank* first_failure_ = nullptr;
  int received_signal_ = 0;
  bool stopping_ = false;  // ranks that end from here on were stopped, not failed
  bool killed_ = false;    // SIGKILL went out: what is left of the process groups is not waited for
};

void validate(const LaunchOptions& o) {
  if (o.nproc_per_node < 1) FORGE_FAIL("forge launch: --nproc-per-node {} must be at least 1", o.nproc_per_node);
  if (o.nnodes < 1) FORGE_FAIL("forge launch: --nnodes {} must be at least 1", o.nnodes);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    FORGE_FAIL("forge launch: --node-rank {} must be in 0..{} (--nnodes {})", o.node_rank, o.nnodes - 1, o.nnodes);
  if (o.nnodes > 1 && o.master_addr.empty())
    FORGE_FAIL("forge launch: --nnodes {} needs --master-addr, the host of node 0 that every node can reach", o.nnodes);
  if (o.master_port < 0 || o.master_port > 65535)
    FORGE_FAIL("forge launch: --master-port {} is not a TCP port (1 to 65535)", o.master_port);
  if (!(o.grace_period_s >= 0)) FORGE_FAIL("forge launch: --grace-period {} must be >= 0 seconds", o.grace_period_s);
  if (o.max_restarts < 0) FORGE_FAIL("forge launch: --max-restarts {} must be >= 0", o.max_restarts);
  if (o.command.empty() || o.command[0].empty())
    FORGE_FAIL("forge launch: give the command after --, e.g. forge launch --nproc-per-node 2 -- train");
}

}  // namespace

int run_launch(const LaunchOptions& options, const std::vector<std::string>& forge_subcommands) {
  validate(options);
  const int world = options.nnodes * options.nproc_per_node;
  const std::string master_addr = options.master_addr.empty() ? "127.0.0.1" : options.master_addr;
  Program program = resolve_program(options.command, forge_subcommands);
  // Ranks of forge itself notice a failed peer on their own (NOTE [Failure detection]).
  const double notice_s = program.path == "/proc/self/exe" ? kPeerNoticeSeconds : 0;
  const int first = options.node_rank * options.nproc_per_node;
  const int last = first + options.nproc_per_node - 1;
  SignalRelay signals;
  std::string last_failure;
  for (int attempt = 0;; ++attempt) {
    int master_port = options.master_port;
    if (master_port == 0)
      master_port = options.nnodes == 1 ? net::bound_port(net::listen_tcp(0)) : kDefaultMultiNodePort;
    log_info("forge launch: {} of {} (node {} of {}), master {}:{}{}",
             first == last ? fmt::format("rank {}", first) : fmt::format("ranks {}-{}", first, last), world,
             options.node_rank, options.nnodes, master_addr, master_port,
             attempt > 0 ? fmt::format(", restart {} of {}", attempt, options.max_restarts) : "");
    std::vector<Rank> ranks(options.nproc_per_node);
    Job job(ranks, options.grace_period_s, notice_s);
    for (int local = 0; local < options.nproc_per_node; ++local) {
      Rank& r = ranks[local];
      r.local_rank = local;
      r.rank = options.node_rank * options.nproc_per_node + local;
      r.out_lines.emplace(r.rank, STDOUT_FILENO);
      r.err_lines.emplace(r.rank, STDERR_FILENO);
      std::vector<std::pair<std::string, std::string>> vars = {
          {"RANK", std::to_string(r.rank)},
          {"LOCAL_RANK", std::to_string(local)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
          {"GROUP_RANK", std::to_string(options.node_rank)},
          {"MASTER_ADDR", master_addr},
          {"MASTER_PORT", std::to_string(master_port)},
          {"FORGE_LAUNCHED", "1"},
          {"FORGE_RESTART_COUNT", std::to_string(attempt)},
          {"FORGE_MAX_RESTARTS", std::to_string(options.max_restarts)}};
      if (attempt > 0) vars.push_back({"FORGE_RESTART_REASON", last_failure});
      std::vector<std::string> env = rank_environment(vars);
      if (const int error = spawn(r, program, env)) {
        job.stop_all(SIGTERM);
        job.run(signals);
        FORGE_FAIL("forge launch: cannot run '{}': {}", program.path, std::strerror(error));
      }
    }
    const int code = job.run(signals);
    // NOTE [Launcher restarts]: only a failure restarts; a stop on request does not.
    if (code == 0 || job.signalled() || code == kExitStopped || job.failure().empty()) return code;
    if (attempt >= options.max_restarts) {
      if (options.max_restarts > 0)
        log_error("forge launch: {} after {} restart{}: giving up", job.failure(), options.max_restarts,
                  options.max_restarts > 1 ? "s" : "");
      return code;
    }
    last_failure = job.failure();
    log_warn("forge launch: restart {} of {} after {}: starting this node's ranks again", attempt + 1,
             options.max_restarts, last_failure);
  }
}

}  // namespace forge
