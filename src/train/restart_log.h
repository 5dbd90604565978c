// RUN_DIR/restarts.log: one line for each time `forge launch --max-restarts` started the
// ranks again after a failure (NOTE [Launcher restarts] in distributed/launcher.h), e.g.
//   2026-11-24T04:12:09Z restart 1 of 2 after rank 2 was killed by signal 9 (SIGKILL); resuming from .../step_4
#pragma once

#include <optional>
#include <string>

namespace forge {

// Appends the line when this process is a restart (FORGE_RESTART_COUNT above 0) and logs
// it; does nothing otherwise. `resume_from`: the checkpoint the run continues, if any.
void record_restart(const std::string& run_dir, const std::optional<std::string>& resume_from);

}  // namespace forge
