// SftDatasetWriter and finalize_replacing_mask; see sft_dataset_writer.h and NOTE [SFT
// dataset pair] there.
#include "data/sft_dataset_writer.h"

#include <unistd.h>

#include <filesystem>
#include <system_error>
#include <vector>

#include "core/durable_file.h"
#include "core/error.h"

namespace forge {

namespace {

namespace fs = std::filesystem;

std::vector<std::string> dataset_files(const std::string& prefix) { return {prefix + ".bin", prefix + ".idx"}; }

// The existing files among `paths`, renamed aside until restore() or discard().
class SetAside {
 public:
  explicit SetAside(std::vector<std::string> paths) : paths_(std::move(paths)) {
    std::error_code error;
    for (const auto& path : paths_)
      if (fs::is_directory(path, error)) FORGE_FAIL("{}: is a directory, cannot write the dataset there", path);
    for (const auto& path : paths_) {
      if (!fs::exists(fs::symlink_status(path, error))) continue;
      const std::string aside = temporary_path_for(path, ::getpid()) + ".previous";
      fs::rename(path, aside, error);
      if (error) {
        const std::string reason = error.message();
        put_back();
        FORGE_FAIL("{}: cannot replace: {}", path, reason);
      }
      moved_.emplace_back(path, aside);
    }
  }

  // Removes what is now at the paths (new files put there: every old one is aside) and
  // renames the old ones back.
  void restore() {
    std::error_code error;
    for (const auto& path : paths_) fs::remove(path, error);
    put_back();
  }

  void put_back() {
    std::error_code error;
    for (const auto& [path, aside] : moved_) fs::rename(aside, path, error);
    moved_.clear();
  }

  void discard() {
    std::error_code error;
    for (const auto& [path, aside] : moved_) fs::remove(aside, error);
    moved_.clear();
  }

 private:
  std::vector<std::string> paths_;
  std::vector<std::pair<std::string, std::string>> moved_;
};

}  // namespace

std::string mask_prefix(const std::string& prefix) { return prefix + ".mask"; }

SftDatasetWriter::SftDatasetWriter(const std::string& prefix, IndexedDType token_dtype)
    : prefix_(prefix), tokens_(prefix, token_dtype), mask_(mask_prefix(prefix), IndexedDType::U8) {}

void SftDatasetWriter::add_example(const SftTokens& example) {
  FORGE_CHECK(example.ids.size() == example.mask.size(), "{} ids, {} mask values", example.ids.size(),
              example.mask.size());
  std::vector<int32_t> mask(example.mask.begin(), example.mask.end());
  tokens_.add_document(example.ids);
  mask_.add_document(mask);
}

void SftDatasetWriter::finalize() {
  tokens_.write_index();
  mask_.write_index();
  // Index files first: without <prefix>.idx nothing looks like a dataset (NOTE [SFT dataset pair]).
  const std::string mask = mask_prefix(prefix_);
  SetAside previous({prefix_ + ".idx", mask + ".idx", prefix_ + ".bin", mask + ".bin"});
  try {
    mask_.commit();
    tokens_.commit();  // <prefix>.idx last: NOTE [SFT dataset pair]
  } catch (...) {
    previous.restore();
    throw;
  }
  previous.discard();
}

uint64_t SftDatasetWriter::output_bytes() const {
  uint64_t total = 0;
  for (const std::string& prefix : {prefix_, mask_prefix(prefix_)})
    for (const auto& file : dataset_files(prefix)) total += fs::file_size(file);
  return total;
}

void finalize_replacing_mask(IndexedDatasetWriter& writer, const std::string& prefix) {
  writer.write_index();
  SetAside stale_mask(dataset_files(mask_prefix(prefix)));
  try {
    writer.commit();
  } catch (...) {
    stale_mask.restore();
    throw;
  }
  stale_mask.discard();
}

}  // namespace forge
