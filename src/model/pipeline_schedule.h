// Pipeline-parallel schedules as data: for P pipeline ranks, V model chunks per rank and M
// micro-batches, the list of what each rank does in a step, in order: forwards and
// backwards of its chunks, and the exchanges that move activations and input gradients
// between ranks. No tensors and no communication here; an executor walks a rank's list,
// and the tests check the lists on every shape (verify_pipeline_schedule) and measure the
// bubble a schedule leaves.
//
// NOTE [Pipeline schedules]
// The model's layers are cut into S = P V consecutive virtual stages. Virtual stage
// s = v P + r lives on rank r as its chunk v (Megatron-LM's interleaved layout): rank r
// holds stages r, P + r, 2P + r, ...; stage 0 holds the embedding, stage S - 1 the head and
// the loss. F(s, m), the forward of stage s on micro-batch m, needs F(s - 1, m)'s output
// (the activation) unless s = 0; B(s, m) needs B(s + 1, m)'s input gradient unless
// s = S - 1, and F(s, m) done on its own rank.
// Compute order of a rank (the k-th forward / backward, k = 0 .. M V - 1):
//   - 1F1B (V = 1; "1F1B", Megatron's and torchtitan's): forward k and backward k are
//     micro-batch k; rank r first runs min(P - r - 1, M) forwards (warmup), then one
//     forward and one backward while forwards remain, then the remaining backwards.
//   - Interleaved 1F1B (V >= 2, M a multiple of P; "Interleaved1F1B", Megatron's): forward
//     k is chunk (k / P) % V, backward k is chunk V - 1 - (k / P) % V, both of micro-batch
//     (k / (P V)) P + k % P (groups of P micro-batches go through the chunks in turn);
//     warmup min(2 (P - r - 1) + (V - 1) P, M V) forwards, then the same alternation.
// Timing by simulation, in units of one chunk's forward of one micro-batch: F takes 1 and
// B backward_cost; an action starts when its rank is free and its input has arrived, and
// an output arrives at the consuming rank when the action that made it ends (transfers
// take no time). A rank's busy time is M V (1 + backward_cost), the same on every rank; the
// bubble is the idle share, 1 - busy / makespan.
// Exchanges make the lists deadlock-free on any transport. Every transfer happens at the
// time T its producer ends, in an Exchange both its sender and its receiver hold at T's
// place in their lists. The distinct times of all transfers are the step's rounds, and
// every rank holds exactly one Exchange per round, empty where it has nothing to move, so
// every rank makes the same exchange calls in the same order (a CPU process group needs
// every rank in every round). A rank's list is ordered by time: a compute at its start,
// an exchange at its round's time; an exchange comes before a compute that starts at the
// same time, and a compute that starts before T and ends after it comes before the
// exchange at T. Executing the rounds as barriers cannot deadlock: a compute that starts
// at t needs only outputs of actions that ended by t, received in rounds at or before t,
// which its rank's list holds before it.
// A transfer names, as its rank sees it: `chunk`, for an activation sent, the chunk whose
// forward made it; received, the chunk whose forward will read it; for a gradient sent,
// the chunk whose backward made it; received, the chunk whose backward will read it. With
// P = 1 every handoff stays on the rank and a schedule has no transfers and no rounds.
// A round's transfers are posted together (isend/irecv, or one NCCL group), sends first,
// then receives, each sorted by (peer, gradient, chunk, micro_batch). A rank ends one
// compute at a time, so it sends at most one message per round; were there more (a
// schedule written by hand), the order of a's sends to b would still be the order of b's
// receives from a, since between two ranks the chunk numbers of one kind of transfer
// differ by a constant (0, or 1 where a stage's neighbour wraps from rank P - 1 to rank 0).
// verify_pipeline_schedule checks that order: messages between a pair match by position.
#pragma once

#include <string>
#include <vector>

namespace forge {

enum class PipelineScheduleKind { OneFOneB, Interleaved };

// "1F1B" / "Interleaved1F1B" (torchtitan's names, read ignoring case), and back; an unknown name fails,
// listing the known ones.
const char* pipeline_schedule_name(PipelineScheduleKind kind);
PipelineScheduleKind parse_pipeline_schedule(const std::string& name);

struct PipelineShape {
  int stages;          // P, pipeline ranks
  int virtual_stages;  // V, chunks per rank: 1 for 1F1B
  int micro_batches;   // M, per step
};

// Fails with a message naming the value unless P, V, M >= 1 and the kind takes the shape:
// 1F1B needs V = 1; interleaved needs V >= 2 and M a multiple of P (as Megatron's does).
void check_pipeline_shape(PipelineScheduleKind kind, const PipelineShape& shape);

// One transfer of an exchange, as the rank that makes it sees it (NOTE [Pipeline
// schedules] says which chunk it names).
struct PipelineTransfer {
  bool send;      // false: a receive
  bool gradient;  // false: an activation (forward); true: an input gradient (backward)
  int chunk;
  int micro_batch;
  int peer;  // the other pipeline rank
  bool operator==(const PipelineTransfer&) const = default;
};

struct PipelineAction {
  enum class Kind { Forward, Backward, Exchange };
  Kind kind = Kind::Forward;
  int chunk = 0, micro_batch = 0;           // Forward, Backward
  std::vector<PipelineTransfer> transfers;  // Exchange: may be empty (the rank takes part in the round)
  bool operator==(const PipelineAction&) const = default;
};

struct PipelineSchedule {
  std::vector<std::vector<PipelineAction>> ranks;  // per pipeline rank, in execution order
  double busy_time = 0;                            // per rank, in units of one chunk's forward
  double makespan = 0;                             // the step, from the first forward to the last backward
  double bubble_fraction = 0;                      // 1 - busy_time / makespan
};

// The schedule of `kind` for `shape` (checked by check_pipeline_shape), a backward taking
// `backward_cost` (> 0) forwards.
PipelineSchedule make_pipeline_schedule(PipelineScheduleKind kind, const PipelineShape& shape,
                                        double backward_cost = 2.0);

// Throws, naming the rank, the action's index and the action, unless: every (stage,
// micro-batch) has one forward and one backward, on its rank; every rank has as many
// exchanges; every send has its receive in the same round, and between two ranks the
// sends and receives of a round are in the same order; and running the lists with every
// exchange a barrier of all ranks, each compute finds its inputs there (so no rank waits
// for an input that comes later: no deadlock).
void verify_pipeline_schedule(const PipelineSchedule& schedule, const PipelineShape& shape);

// The most micro-batches of `chunk` on `rank` whose forward is done and backward not yet,
// over the rank's list: the activations the executor keeps for that chunk.
int max_in_flight(const PipelineSchedule& schedule, int rank, int chunk);

// "F(c0,m1)", "B(c1,m0)", "X{>1 a c0 m2, <1 g c0 m1}" (send to / receive from rank 1, an
// activation / a gradient, chunk, micro-batch), "X{}" for an empty exchange.
std::string describe_pipeline_action(const PipelineAction& action);
// "1F1B, 4 stages x 8 micro-batches: bubble 27.3%".
std::string describe_pipeline_schedule(PipelineScheduleKind kind, const PipelineShape& shape,
                                       const PipelineSchedule& schedule);

}  // namespace forge
