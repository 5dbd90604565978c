// FLUX's diffusers export written by every FSDP rank; see flux_export.h.
#include "train/flux_export.h"

#include <algorithm>
#include <memory>
#include <span>

#include <fmt/format.h>

#include "ckpt/flux_weights_export.h"
#include "core/device.h"
#include "train/export_in_pieces.h"

namespace forge {

std::string write_flux_weights_in_pieces(const std::string& dir, const FluxConfig& config, SafetensorsDType stored,
                                         FluxFsdp& flux, int rank, bool writer, size_t buffer_bytes,
                                         uint64_t max_shard_bytes) {
  Fsdp& fsdp = flux.fsdp();
  const HfExportPlan plan = flux_weights_plan(config, stored, max_shard_bytes);
  // The layout's flat index space is flux_parameter_specs end to end (NOTE [FLUX FSDP]),
  // the plan's parameters.
  FORGE_CHECK(fsdp.layout().specs().size() == plan.specs().size(),
              "FLUX export: the FSDP layout has {} parameters, the export {}", fsdp.layout().specs().size(),
              plan.specs().size());
  const int64_t window = std::max<int64_t>(static_cast<int64_t>(buffer_bytes / sizeof(float)), 1);
  std::unique_ptr<FluxWeightsExport> out;  // rank 0's; destroyed uncommitted, it removes its files
  size_t staged = 0;
  PiecewiseExport e;
  e.what = "FLUX diffusers";
  e.dir = dir;
  e.numel = plan.numel();
  e.begin = [&](const std::string& temporary) {
    out = std::make_unique<FluxWeightsExport>(dir, config, stored, temporary, max_shard_bytes);
  };
  e.commit = [&] { out->commit(); };
  e.write = [&](const std::string& temporary) {
    if (!fsdp.master_segments().empty() && fsdp.master_segments()[0].device() == Device::CUDA)
      device_synchronize();  // the optimizer's last writes
    HfExportWriter files(plan, temporary);
    const std::vector<FsdpSegment>& segments = fsdp.layout().segments();
    for (size_t i = 0; i < segments.size(); ++i) {
      const auto spec = static_cast<size_t>(segments[i].spec);
      staged = std::max(staged, write_through_host(fsdp.master_segments()[i], window,
                                                   [&](int64_t at, std::span<const float> values) {
                                                     files.write(spec, values, segments[i].param_begin + at);
                                                   }));
    }
    files.close();
    return files.written();
  };
  export_in_pieces(fsdp, rank, writer, e);
  return fmt::format("written by every rank, each its own chunks: nothing gathered; {}",
                     staged == 0 ? std::string("written from where they are")
                                 : fmt::format("rank 0 staged {:.1f} MiB from the GPU",
                                               static_cast<double>(staged) / 1048576.0));
}

}  // namespace forge
