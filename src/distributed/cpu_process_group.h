// ProcessGroup on the CPU for several ranks: every collective goes through rank 0 over the
// TCP connections of the rendezvous (tcp_store.h). For tests and the CPU reference path,
// so that multi-rank code (FSDP) runs, and is tested, on machines without GPUs; it makes
// no attempt at speed beyond not copying what it need not.
//
// NOTE [CPU process group]
// A collective is a round: every rank sends rank 0 one message (what it calls: group,
// collective, dtype, element counts, the how-many-th call on that group; then its input),
// rank 0 checks that the calls match, computes each rank's result and sends it back.
//  - Results are bit-identical on every rank, and the same from run to run: rank 0 adds
//    the ranks' tensors in rank order 0..N-1, in fp32 (bf16 inputs are widened, and the
//    result rounded to bf16 once at the end); Avg is that sum divided by the group size
//    in fp32 (NCCL adds in another order and averages its own way, so NCCL results agree
//    to rounding, not to the bit).
//  - Groups from split() have no connections of their own: their collectives go through
//    the world's star as well, and a round always involves every rank of the world. So
//    every rank of the world makes every call at the same time, each on its own group (as
//    SPMD code like FSDP does: with color = rank % 2 both halves all-reduce at once, each
//    within its half). Rank 0 keeps the members of every group, and computes each group's
//    result from its members' messages, summed in the group's rank order.
//  - Calls that do not match (a rank in all_gather while another is in all_reduce, other
//    sizes or dtypes, another group, one call more on a group) fail the round on every
//    rank, with a message listing which (world) ranks called what.
//  - all_to_all (NOTE [All-to-all] in process_group.h): each rank sends its send and
//    receive counts ahead of the rows it sends; rank 0 checks that every rank's
//    send_counts[j] equals rank j's recv_counts[that rank] (a mismatch fails the round on
//    every rank, naming the pairs) and answers each rank with its rows from every member
//    in group rank order (its own rows to itself included). The rows must have the same
//    dtype and width on every rank (part of the call that must match); their numbers not.
//  - send_recv (NOTE [Point-to-point] in process_group.h): each rank sends its ops (kind,
//    peer, bytes) ahead of its send payloads; rank 0 pairs every member's sends with its
//    peers' receives (a mismatch fails the round on every rank, naming the ranks and op
//    indices) and answers each rank with the bytes of its receives, in its op order.
//  - Every wait is bounded by collective_timeout; rank 0 names the ranks that did not
//    arrive, and a rank whose process died ends the wait at once, named. Rank 0 sends its
//    verdict to every other rank before throwing it, so every rank throws the same cause
//    (after on_failure, when one is set); the group, and every group of its world, stays
//    failed. Ranks whose rank 0 died fail at once too, naming it. With a heartbeat
//    (options.heartbeat_timeout, NOTE [Failure detection]) a failed round instead ends
//    the process, after rank 0 has told every rank, stuck ones included; each round is
//    in the flight record (flight_recorder.h) as "all_reduce #N ... on <group>" (or
//    "send_recv #N on <group>").
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
