#include "model/activations.h"

#include <algorithm>

#include "core/error.h"

namespace forge {
namespace {

constexpr int64_t kArenaAlignment = 256;

// NOTE [Chunked output head] in decoder_lm.cpp.
constexpr int64_t kHeadChunkBytes = int64_t{2} << 30;
constexpr int64_t kMinHeadChunkRows = 256;

}  // namespace

ActivationCheckpoint activation_checkpoint_from_name(const std::string& name) {
  if (name == "none") return ActivationCheckpoint::None;
  if (name == "selective") return ActivationCheckpoint::Selective;
  if (name == "full") return ActivationCheckpoint::Full;
  FORGE_FAIL("activation_checkpoint.mode must be none, selective or full, got '{}'", name);
}

std::string_view activation_checkpoint_name(ActivationCheckpoint mode) {
  switch (mode) {
    case ActivationCheckpoint::None: return "none";
    case ActivationCheckpoint::Selective: return "selective";
    case ActivationCheckpoint::Full: return "full";
  }
  return "?";
}

Tensor ArenaLayout::take(Shape shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(dtype));
  const int64_t at = offset_;
  offset_ += (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
  if (!base_) return Tensor();
  return Tensor::wrap(base_ + at, std::move(shape), dtype, device_);
}

int64_t head_chunk_rows(int64_t tokens, int64_t vocab, DType dtype) {
  int64_t rows = kMinHeadChunkRows;
  while (rows * 2 * vocab * static_cast<int64_t>(dtype_size(dtype)) <= kHeadChunkBytes) rows *= 2;
  return std::min(tokens, rows);
}

}  // namespace forge
