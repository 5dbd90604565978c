#include "model/activations.h"

#include <algorithm>

#include "core/checked_math.h"
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

// Shapes come from training.local_batch_size, training.seq_len and the model's keys, which
// may be absurd: the counting pass fails here, before the memory check would see a
// wrapped size (NOTE [Model sizes are checked before use] in config_rules.cpp).
Tensor ArenaLayout::take(Shape shape, DType dtype) {
  std::optional<int64_t> bytes = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape) bytes = bytes ? checked_mul(*bytes, d) : std::nullopt;
  const std::optional<int64_t> aligned = bytes ? checked_add(*bytes, kArenaAlignment - 1) : std::nullopt;
  const std::optional<int64_t> end = aligned ? checked_add(offset_, *aligned / kArenaAlignment * kArenaAlignment)
                                             : std::nullopt;
  if (!end)
    FORGE_FAIL("the activation memory overflows 64-bit integers at a {} buffer: training.local_batch_size, "
               "training.seq_len or the model's sizes are far too large",
               shape_str(shape));
  const int64_t at = offset_;
  offset_ = *end;
  if (!base_) return Tensor();
  return Tensor::wrap(base_ + at, std::move(shape), dtype, device_);
}

int64_t head_chunk_rows(int64_t tokens, int64_t vocab, DType dtype) {
  int64_t rows = kMinHeadChunkRows;
  const int64_t row_bytes = 2 * vocab * static_cast<int64_t>(dtype_size(dtype));  // vocab < 2^31
  while (rows < tokens && rows * row_bytes <= kHeadChunkBytes) rows *= 2;
  return std::min(tokens, rows);
}

}  // namespace forge
