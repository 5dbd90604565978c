// Exit statuses with a meaning beyond "failed" (1), shared by the ranks and `forge launch`,
// which decides by them whether a job failed, and whether to restart it.
#pragma once

namespace forge {

// The run stopped on request (SIGTERM / SIGINT: the step finished and a checkpoint was
// saved), as EX_TEMPFAIL: a requeue continues it. `forge launch --max-restarts` does not
// restart after it.
inline constexpr int kExitStopped = 75;
// This rank stopped because another rank failed (its log names which, and why): the
// launcher reports a rank that failed on its own before ranks that exit with this.
inline constexpr int kExitPeerFailed = 76;

}  // namespace forge
