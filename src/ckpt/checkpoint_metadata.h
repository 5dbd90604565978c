// metadata.json of a checkpoint (NOTE [Checkpoint format] in ckpt/checkpoint.h): written
// from and parsed into CheckpointMetadata. Parsing checks every key's presence and type
// and names the file and key when one is missing or wrong; consistency between keys (do
// the pieces tile the shards?) is open_checkpoint's job.
#pragma once

#include <string>

#include "ckpt/checkpoint.h"

namespace forge {

inline constexpr const char* kCheckpointMetadataFile = "metadata.json";

std::string metadata_to_json(const CheckpointMetadata& metadata);
// `file` names the source in error messages.
CheckpointMetadata metadata_from_json(const std::string& text, const std::string& file);

}  // namespace forge
