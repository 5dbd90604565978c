// The diffusers export at the end of a FLUX run under FSDP: every rank of the first replica
// writes its chunks of the master weights into the export's files, no rank gathers the model
// (NOTE [FLUX export in pieces] in ckpt/flux_weights_export.h) — the writing counterpart of
// read_flux_weights, through which every rank reads the starting weights a parameter at a
// time and keeps its segments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ckpt/safetensors.h"
#include "distributed/flux_fsdp.h"

namespace forge {

// Every rank of the run calls it (NOTE [Piecewise export protocol] in
// train/export_in_pieces.h); `rank`: its world rank; `writer`: it is in the first replica
// (its chunks are not another rank's copy); `buffer_bytes`: the host window its chunks pass
// through from the GPU (checkpoint.buffer_mb); `max_shard_bytes`: where the files are cut
// (checkpoint.export_max_shard_size). Returns what rank 0 logs of it.
std::string write_flux_weights_in_pieces(const std::string& dir, const FluxConfig& config, SafetensorsDType stored,
                                         FluxFsdp& fsdp, int rank, bool writer, size_t buffer_bytes,
                                         uint64_t max_shard_bytes);

}  // namespace forge
