// tokenize_in_order; see prep_pipeline.h. One mutex guards the three stages' shared
// state: the queue of batches waiting for a worker, the finished batches keyed by number,
// and the stop flag with the first error. Tokenizing, the expensive part, runs outside
// the lock.
#include "data/prep_pipeline.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace forge {

namespace {

constexpr uint64_t kBatchTextBytes = uint64_t{1} << 20;
constexpr size_t kBatchDocuments = 4096;

class OrderedPipeline {
 public:
  OrderedPipeline(DocumentReader& reader, std::function<void(TokenizedBatch&)> work, int workers)
      : reader_(reader), work_(std::move(work)), workers_(workers), max_in_flight_(2 * static_cast<int64_t>(workers)) {}

  void run(const std::function<void(const TokenizedBatch&)>& consume) {
    std::vector<std::thread> threads;
    threads.emplace_back([this] { guarded([this] { read_batches(); }); });
    for (int i = 0; i < workers_; ++i) threads.emplace_back([this] { guarded([this] { tokenize_batches(); }); });
    guarded([&] { consume_in_order(consume); });
    stop();
    for (auto& thread : threads) thread.join();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Runs a stage; on an exception records it (the first one wins) and stops everything.
  template <typename Stage> void guarded(Stage&& stage) {
    try {
      stage();
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
      stopped_ = true;
      changed_.notify_all();
    }
  }

  void stop() {
    std::lock_guard lock(mutex_);
    stopped_ = true;
    changed_.notify_all();
  }

  void read_batches() {
    int64_t number = 0;
    bool more = true;
    while (more) {
      TokenizedBatch batch;
      std::string text;
      while (batch.texts.size() < kBatchDocuments && batch.text_bytes < kBatchTextBytes && (more = reader_.next(text))) {
        batch.text_bytes += text.size();
        batch.texts.push_back(std::move(text));
        if (reader_.raw_lines()) batch.locations.push_back(reader_.location());
      }
      batch.file_bytes_read = reader_.file_bytes_read();
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopped_ || number - next_to_consume_ < max_in_flight_; });
      if (stopped_) return;
      if (!batch.texts.empty()) waiting_.emplace_back(number++, std::move(batch));
      if (!more) total_batches_ = number;
      changed_.notify_all();
    }
  }

  void tokenize_batches() {
    while (true) {
      std::pair<int64_t, TokenizedBatch> job;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopped_ || !waiting_.empty() || total_batches_ >= 0; });
        if (stopped_ || waiting_.empty()) return;
        job = std::move(waiting_.front());
        waiting_.pop_front();
      }
      work_(job.second);
      std::lock_guard lock(mutex_);
      finished_.emplace(job.first, std::move(job.second));
      changed_.notify_all();
    }
  }

  void consume_in_order(const std::function<void(const TokenizedBatch&)>& consume) {
    while (true) {
      TokenizedBatch batch;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] {
          return stopped_ || finished_.count(next_to_consume_) || next_to_consume_ == total_batches_;
        });
        if (stopped_ || next_to_consume_ == total_batches_) return;
        auto it = finished_.find(next_to_consume_);
        batch = std::move(it->second);
        finished_.erase(it);
      }
      consume(batch);
      std::lock_guard lock(mutex_);
      ++next_to_consume_;
      changed_.notify_all();
    }
  }

  DocumentReader& reader_;
  const std::function<void(TokenizedBatch&)> work_;
  const int workers_;
  const int64_t max_in_flight_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::pair<int64_t, TokenizedBatch>> waiting_;
  std::map<int64_t, TokenizedBatch> finished_;
  int64_t next_to_consume_ = 0;
  int64_t total_batches_ = -1;  // known once the reader has seen the end
  bool stopped_ = false;
  std::exception_ptr error_;
};

}  // namespace

void process_in_order(DocumentReader& reader, int workers, const std::function<void(TokenizedBatch&)>& work,
                      const std::function<void(const TokenizedBatch&)>& consume) {
  FORGE_CHECK(workers >= 1, "{} workers", workers);
  OrderedPipeline(reader, work, workers).run(consume);
}

void tokenize_in_order(DocumentReader& reader, const Tokenizer& tokenizer, int workers,
                       const std::function<void(const TokenizedBatch&)>& consume) {
  process_in_order(
      reader, workers,
      [&](TokenizedBatch& batch) {
        batch.ids.reserve(batch.texts.size());
        for (const auto& text : batch.texts) batch.ids.push_back(tokenizer.encode(text));
      },
      consume);
}

}  // namespace forge
