// Checking a checkpoint's data before a resume trusts it: every piece's CRC-32, each piece
// read once by one of the ranks (NOTE [Choosing the checkpoint to resume] in
// train/trainer_resume.cpp).
#include <memory>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_crc32.h"
#include "ckpt/file_reader.h"
#include "core/error.h"

namespace forge {

void verify_checkpoint_pieces(const Checkpoint& ck, int part, int parts) {
  FORGE_CHECK(parts >= 1 && part >= 0 && part < parts, "part {} of {}", part, parts);
  std::vector<std::unique_ptr<FileReader>> readers(static_cast<size_t>(ck.metadata.files()));
  std::vector<unsigned char> bytes;
  int64_t index = 0;
  for (const TensorRecord& rec : ck.metadata.tensors) {
    for (const TensorPiece& p : rec.pieces) {
      if (index++ % parts != part) continue;
      const std::string path = fmt::format("{}/rank-{}.bin", ck.dir, p.rank);
      auto& reader = readers[static_cast<size_t>(p.rank)];
      if (!reader) reader = std::make_unique<FileReader>(path);
      bytes.resize(static_cast<size_t>(p.byte_length));
      if (!reader->read_at(p.byte_offset, bytes.data(), bytes.size()))
        FORGE_FAIL("shard file '{}' ends inside tensor '{}' ({}) (bytes {} to {})", path, rec.name,
                   flat_state_name(rec.state), p.byte_offset, p.byte_offset + p.byte_length);
      const uint32_t actual = crc32(bytes.data(), bytes.size());
      if (actual != p.crc32)
        FORGE_FAIL("shard file '{}' is damaged: tensor '{}' ({}) (bytes {} to {}) has CRC-32 {:08x}, the metadata "
                   "recorded {:08x}",
                   path, rec.name, flat_state_name(rec.state), p.byte_offset, p.byte_offset + p.byte_length, actual,
                   p.crc32);
    }
  }
}

}  // namespace forge
