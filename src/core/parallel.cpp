#include "core/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace forge {
namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { worker(i); });
    size_ = n;
  }
  ~ThreadPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int size() const { return size_; }

  // Runs task(i) for i in [0, size) with the caller as participant 0; rethrows the first error.
  void run(const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> run_lock(run_mu_);  // one parallel region at a time
    {
      std::lock_guard lock(mu_);
      task_ = &task;
      pending_ = size_ - 1;
      ++generation_;
      error_ = nullptr;
    }
    cv_.notify_all();
    try {
      task(0);
    } catch (...) {
      std::lock_guard lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void worker(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        task = task_;
      }
      try {
        (*task)(index);
      } catch (...) {
        std::lock_guard lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      {
        std::lock_guard lock(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  int size_ = 1;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* task_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool p(num_threads());
  return p;
}

thread_local bool in_parallel_region = false;

}  // namespace

int num_threads() {
  static int n = [] {
    if (const char* env = std::getenv("FORGE_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t max_chunks = (n + grain - 1) / grain;
  int threads = static_cast<int>(std::min<int64_t>(pool().size(), max_chunks));
  if (threads <= 1 || in_parallel_region) {
    fn(0, n);
    return;
  }
  int64_t chunk = (n + threads - 1) / threads;
  pool().run([&](int t) {
    int64_t begin = t * chunk, end = std::min(n, begin + chunk);
    if (begin >= end) return;
    in_parallel_region = true;
    try {
      fn(begin, end);
    } catch (...) {
      in_parallel_region = false;
      throw;
    }
    in_parallel_region = false;
  });
}

}  // namespace forge
