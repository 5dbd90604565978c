// NOTE [Stop signals]
// Clusters stop jobs with SIGTERM (Slurm's preemption, and its time limit with --signal
// giving lead time; Kubernetes) and people with SIGINT (Ctrl-C). forge train installs
// handlers that only record the first such signal; the trainer looks at it once per step,
// finishes the step, saves a checkpoint (with checkpoint.enable) and exits with
// kExitStopped, as Megatron's --exit-signal-handler does, so a requeued job resumes where
// this one stopped. Under data parallelism every rank must stop after the same step although
// the signal may reach them at different times: the flag travels in the all-reduce that
// already sums the step's loss, so all ranks see it in the same step at no extra
// collective. A second SIGINT while stopping kills the process at once (default action);
// further SIGTERMs are ignored (the launcher escalates to SIGKILL after its grace period).
#pragma once

#include "core/exit_status.h"  // kExitStopped

namespace forge {

void install_stop_signal_handlers();
// The first SIGTERM or SIGINT received since install_stop_signal_handlers, 0 when none.
int stop_signal();

}  // namespace forge
