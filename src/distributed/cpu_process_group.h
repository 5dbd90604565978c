// ProcessGroup on the CPU for several ranks: every collective goes through the group's
// rank 0 over TCP connections of the group's own (tcp_store.h). For tests and the CPU
// reference path, so that multi-rank code (FSDP, pipeline parallelism) runs, and is
// tested, on machines without GPUs; it makes no attempt at speed beyond not copying what
// it need not.
//
// NOTE [CPU process group]
// A collective is a round: every rank of the group sends the group's rank 0 one message
// (what it calls: collective, dtype, element counts, the how-many-th call on the group
// this is; then its input), rank 0 checks that the calls match, computes each rank's
// result and sends it back.
//  - Results are bit-identical on every rank, and the same from run to run: rank 0 adds
//    the ranks' tensors in group rank order 0..N-1, in fp32 (bf16 inputs are widened, and
//    the result rounded to bf16 once at the end); Avg is that sum divided by the group
//    size in fp32 (NCCL adds in another order and averages its own way, so NCCL results
//    agree to rounding, not to the bit).
//  - Every group has its own star of connections, rooted at its rank 0: the world's is
//    the rendezvous (MASTER_ADDR:MASTER_PORT); a group from split() meets within the split
//    call. Every rank listens on a port of the system's choosing and sends it with its
//    split call; the parent's rank 0 answers each rank with its new group's members and
//    where the new group's rank 0 listens (its port, at the host the parent's rank 0 sees
//    that rank's connection come from, or the host the others reach the parent's rank 0
//    at when it is that rank itself); the members connect to it (waiting at most
//    collective_timeout) and the others' listeners close. So a group's rounds involve its
//    members only, and groups run independently: the stages of a pipeline make different
//    calls on their own groups at different moments (each group has its own lock, one
//    round at a time). A group of one rank has no connections: its rank answers its
//    rounds alone.
//  - Calls that do not match (a rank in all_gather while another is in all_reduce, other
//    sizes or dtypes, one call more on the group) fail the round on every rank of the
//    group, with a message listing which ranks called what. Messages name world ranks,
//    and groups by their number among the groups of their parent's splits (given by the
//    parent's rank 0, in color order) after their parent's: "group 2 (world ranks 1, 3)",
//    "group 2.1 (world ranks 3)".
//  - all_to_all (NOTE [All-to-all] in process_group.h): each rank sends its send and
//    receive counts ahead of the rows it sends; rank 0 checks that every rank's
//    send_counts[j] equals rank j's recv_counts[that rank] (a mismatch fails the round on
//    every rank, naming the pairs) and answers each rank with its rows from every rank in
//    group rank order (its own rows to itself included). The rows must have the same
//    dtype and width on every rank (part of the call that must match); their numbers not.
//  - send_recv (NOTE [Point-to-point] in process_group.h): each rank sends its ops (kind,
//    peer, bytes) ahead of its send payloads; rank 0 pairs every rank's sends with its
//    peers' receives (a mismatch fails the round on every rank, naming the ranks and op
//    indices) and answers each rank with the bytes of its receives, in its op order.
//  - Every wait is bounded by collective_timeout; rank 0 names the ranks that did not
//    arrive, and a rank whose process died ends the wait at once, named. Rank 0 sends its
//    verdict to every other rank of the group before throwing it, so all of them throw
//    the same cause (after on_failure, when one is set). Ranks whose rank 0 died fail at
//    once too, naming it. A failed round fails every group of its world on the ranks
//    that took part: later calls on any of their groups throw that first failure at
//    once. The ranks outside the failed group are not told: they learn of it when they
//    next wait for one of its ranks (a collective timeout naming it, or at once when the
//    failure closed that rank's connections). With a heartbeat
//    (options.heartbeat_timeout, NOTE [Failure detection]) a failed round instead ends
//    the process, after the group's rank 0 has told the ranks in the round; the
//    heartbeat's rank 0 (the world's) hears of it (at once, or within 2 s when it was not
//    in the group) and ends every other rank of the world, stuck ones included. Each
//    round is in the flight record (flight_recorder.h) as "all_reduce #N ... on <group>"
//    (or "send_recv #N on <group>").
// Argument checks (the shared check_* of process_group.h) fail on the calling rank alone,
// before anything is sent, as on NCCL: the others then wait out the timeout.
#pragma once

#include <memory>

#include "distributed/process_group.h"

namespace forge {

// The world of env.world_size (> 1) ranks: meets them over the TCP rendezvous, waiting
// options.rendezvous_timeout. NOTE [CPU process group].
std::unique_ptr<ProcessGroup> create_cpu_process_group(const LaunchEnv& env, const ProcessGroupOptions& options);

}  // namespace forge
