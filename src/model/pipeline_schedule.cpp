#include "model/pipeline_schedule.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include <cctype>

#include "core/error.h"

namespace forge {

const char* pipeline_schedule_name(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::OneFOneB ? "1F1B" : "Interleaved1F1B";
}

PipelineScheduleKind parse_pipeline_schedule(const std::string& name) {
  auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  for (auto kind : {PipelineScheduleKind::OneFOneB, PipelineScheduleKind::Interleaved})
    if (lower(name) == lower(pipeline_schedule_name(kind))) return kind;
  FORGE_FAIL("unknown pipeline schedule '{}': expected 1F1B or Interleaved1F1B", name);
}

void check_pipeline_shape(PipelineScheduleKind kind, const PipelineShape& shape) {
  const char* name = pipeline_schedule_name(kind);
  if (shape.stages < 1) FORGE_FAIL("pipeline schedule {}: {} stages (at least 1)", name, shape.stages);
  if (shape.virtual_stages < 1)
    FORGE_FAIL("pipeline schedule {}: {} virtual stages per rank (at least 1)", name, shape.virtual_stages);
  if (shape.micro_batches < 1)
    FORGE_FAIL("pipeline schedule {}: {} micro-batches (at least 1)", name, shape.micro_batches);
  if (kind == PipelineScheduleKind::OneFOneB && shape.virtual_stages != 1)
    FORGE_FAIL(
        "pipeline schedule 1F1B runs one model chunk per rank, not {} virtual stages: use Interleaved1F1B for "
        "more",
        shape.virtual_stages);
  if (kind == PipelineScheduleKind::Interleaved && shape.virtual_stages < 2)
    FORGE_FAIL("pipeline schedule Interleaved1F1B needs at least 2 virtual stages per rank, not {}: use 1F1B for 1",
               shape.virtual_stages);
  if (kind == PipelineScheduleKind::Interleaved && shape.micro_batches % shape.stages != 0)
    FORGE_FAIL(
        "pipeline schedule Interleaved1F1B runs micro-batches in groups of the {} stages: {} micro-batches is not "
        "a multiple of {}",
        shape.stages, shape.micro_batches, shape.stages);
}

namespace {

struct Compute {
  bool forward;
  int chunk, micro_batch;
  double start = -1, end = -1;
};

// Each rank's forwards and backwards, in order (NOTE [Pipeline schedules]).
std::vector<std::vector<Compute>> compute_orders(PipelineScheduleKind kind, const PipelineShape& shape) {
  const int P = shape.stages, V = shape.virtual_stages, M = shape.micro_batches, total = M * V;
  const bool interleaved = kind == PipelineScheduleKind::Interleaved;
  auto forward = [&](int k) {
    return interleaved ? Compute{true, (k / P) % V, (k / (P * V)) * P + k % P} : Compute{true, 0, k};
  };
  auto backward = [&](int k) {
    return interleaved ? Compute{false, V - 1 - (k / P) % V, (k / (P * V)) * P + k % P} : Compute{false, 0, k};
  };
  std::vector<std::vector<Compute>> orders(P);
  for (int r = 0; r < P; ++r) {
    const int warmup = interleaved ? std::min(2 * (P - r - 1) + (V - 1) * P, total) : std::min(P - r - 1, total);
    int forwards = 0, backwards = 0;
    while (forwards < warmup) orders[r].push_back(forward(forwards++));
    while (forwards < total) {
      orders[r].push_back(forward(forwards++));
      orders[r].push_back(backward(backwards++));
    }
    while (backwards < total) orders[r].push_back(backward(backwards++));
  }
  return orders;
}

// Fills every compute's start and end: each rank runs its order, an action starting when
// the rank is free and its input has arrived.
void simulate(std::vector<std::vector<Compute>>& orders, const PipelineShape& shape, double backward_cost) {
  const int P = shape.stages, S = P * shape.virtual_stages, M = shape.micro_batches;
  std::vector<double> forward_end(S * M, -1), backward_end(S * M, -1), free(P, 0);
  std::vector<size_t> next(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      for (; next[r] < orders[r].size(); ++next[r]) {
        Compute& c = orders[r][next[r]];
        const int s = c.chunk * P + r;
        double ready;
        if (c.forward) {
          ready = s == 0 ? 0 : forward_end[(s - 1) * M + c.micro_batch];
        } else {
          if (forward_end[s * M + c.micro_batch] < 0) break;
          ready = s == S - 1 ? 0 : backward_end[(s + 1) * M + c.micro_batch];
        }
        if (ready < 0) break;
        c.start = std::max(free[r], ready);
        c.end = free[r] = c.start + (c.forward ? 1.0 : backward_cost);
        (c.forward ? forward_end : backward_end)[s * M + c.micro_batch] = c.end;
        progress = true;
      }
    }
  }
  for (int r = 0; r < P; ++r)
    FORGE_CHECK(next[r] == orders[r].size(), "pipeline schedule: rank {} waits forever at its action {}", r, next[r]);
}

bool canonical_order(const PipelineTransfer& a, const PipelineTransfer& b) {
  return std::tuple(!a.send, a.peer, a.gradient, a.chunk, a.micro_batch) <
         std::tuple(!b.send, b.peer, b.gradient, b.chunk, b.micro_batch);
}

}  // namespace

PipelineSchedule make_pipeline_schedule(PipelineScheduleKind kind, const PipelineShape& shape, double backward_cost) {
  check_pipeline_shape(kind, shape);
  FORGE_CHECK(std::isfinite(backward_cost) && backward_cost > 0, "backward cost {} (a positive number of forwards)",
              backward_cost);
  const int P = shape.stages, S = P * shape.virtual_stages;
  auto orders = compute_orders(kind, shape);
  simulate(orders, shape, backward_cost);

  // Every output that crosses ranks, at its producer's end: the rounds, and each rank's
  // transfers per round.
  struct Timed {
    double time;
    int rank;
    PipelineTransfer transfer;
  };
  std::vector<Timed> transfers;
  if (P > 1) {
    for (int r = 0; r < P; ++r) {
      for (const Compute& c : orders[r]) {
        const int s = c.chunk * P + r, to = c.forward ? s + 1 : s - 1;
        if (to < 0 || to >= S) continue;
        transfers.push_back({c.end, r, {true, !c.forward, c.chunk, c.micro_batch, to % P}});
        transfers.push_back({c.end, to % P, {false, !c.forward, to / P, c.micro_batch, r}});
      }
    }
  }
  // Times compare exactly: a compute's start is max(its rank free, its input's arrival),
  // one of the two bitwise, so it ties with its input's round where it should.
  std::vector<double> rounds;
  for (const Timed& t : transfers) rounds.push_back(t.time);
  std::sort(rounds.begin(), rounds.end());
  rounds.erase(std::unique(rounds.begin(), rounds.end()), rounds.end());
  auto round_of = [&](double time) { return std::lower_bound(rounds.begin(), rounds.end(), time) - rounds.begin(); };

  PipelineSchedule schedule;
  schedule.ranks.resize(P);
  for (int r = 0; r < P; ++r) {
    std::vector<PipelineAction> exchanges(rounds.size(), PipelineAction{PipelineAction::Kind::Exchange, 0, 0, {}});
    for (const Timed& t : transfers)
      if (t.rank == r) exchanges[round_of(t.time)].transfers.push_back(t.transfer);
    for (auto& exchange : exchanges) std::sort(exchange.transfers.begin(), exchange.transfers.end(), canonical_order);
    // Merge by time, an exchange before a compute that starts at its round's time.
    auto& list = schedule.ranks[r];
    size_t round = 0;
    for (const Compute& c : orders[r]) {
      for (; round < rounds.size() && rounds[round] <= c.start; ++round) list.push_back(std::move(exchanges[round]));
      list.push_back(
          {c.forward ? PipelineAction::Kind::Forward : PipelineAction::Kind::Backward, c.chunk, c.micro_batch, {}});
      schedule.makespan = std::max(schedule.makespan, c.end);
    }
    for (; round < rounds.size(); ++round) list.push_back(std::move(exchanges[round]));
  }
  schedule.busy_time = shape.micro_batches * shape.virtual_stages * (1.0 + backward_cost);
  schedule.bubble_fraction = 1.0 - schedule.busy_time / schedule.makespan;
  return schedule;
}

std::string describe_pipeline_action(const PipelineAction& action) {
  if (action.kind != PipelineAction::Kind::Exchange)
    return fmt::format("{}(c{},m{})", action.kind == PipelineAction::Kind::Forward ? 'F' : 'B', action.chunk,
                       action.micro_batch);
  std::string text = "X{";
  for (size_t i = 0; i < action.transfers.size(); ++i) {
    const PipelineTransfer& t = action.transfers[i];
    text += fmt::format("{}{}{} {} c{} m{}", i ? ", " : "", t.send ? '>' : '<', t.peer, t.gradient ? 'g' : 'a', t.chunk,
                        t.micro_batch);
  }
  return text + "}";
}

void verify_pipeline_schedule(const PipelineSchedule& schedule, const PipelineShape& shape) {
  const int P = shape.stages, V = shape.virtual_stages, M = shape.micro_batches, S = P * V;
  if (int(schedule.ranks.size()) != P)
    FORGE_FAIL("pipeline schedule: {} ranks' lists for {} stages", schedule.ranks.size(), P);
  auto is_exchange = [](const PipelineAction& a) { return a.kind == PipelineAction::Kind::Exchange; };
  const auto rounds = std::count_if(schedule.ranks[0].begin(), schedule.ranks[0].end(), is_exchange);
  for (int r = 1; r < P; ++r) {
    const auto own = std::count_if(schedule.ranks[r].begin(), schedule.ranks[r].end(), is_exchange);
    if (own != rounds) FORGE_FAIL("pipeline schedule: rank {} has {} exchanges, rank 0 has {}", r, own, rounds);
  }

  // Run the lists with every exchange a barrier. A message is (gradient, producing stage,
  // micro-batch); `received[r]` holds those that reached rank r.
  using Message = std::tuple<bool, int, int>;
  std::vector<std::set<Message>> received(P);
  std::vector<char> forward_done(S * M, 0), backward_done(S * M, 0);
  std::vector<size_t> next(P, 0);
  auto fail = [&](int r, const std::string& what) {
    const auto& action = schedule.ranks[r][next[r]];
    FORGE_FAIL("pipeline schedule: rank {} action {} {}: {}", r, next[r], describe_pipeline_action(action), what);
  };
  for (long round = 0; round <= rounds; ++round) {
    for (int r = 0; r < P; ++r) {
      for (; next[r] < schedule.ranks[r].size() && !is_exchange(schedule.ranks[r][next[r]]); ++next[r]) {
        const PipelineAction& a = schedule.ranks[r][next[r]];
        if (a.chunk < 0 || a.chunk >= V || a.micro_batch < 0 || a.micro_batch >= M)
          fail(r, "no such chunk or micro-batch");
        const int s = a.chunk * P + r, m = a.micro_batch;
        if (a.kind == PipelineAction::Kind::Forward) {
          if (forward_done[s * M + m]) fail(r, "a second forward");
          if (s > 0 && !(P == 1 ? forward_done[(s - 1) * M + m] : received[r].count({false, s - 1, m})))
            fail(r, fmt::format("runs before the activation of stage {} has reached it", s - 1));
          forward_done[s * M + m] = 1;
        } else {
          if (backward_done[s * M + m]) fail(r, "a second backward");
          if (!forward_done[s * M + m]) fail(r, "runs before its forward");
          if (s < S - 1 && !(P == 1 ? backward_done[(s + 1) * M + m] : received[r].count({true, s + 1, m})))
            fail(r, fmt::format("runs before the gradient of stage {} has reached it", s + 1));
          backward_done[s * M + m] = 1;
        }
      }
    }
    if (round == rounds) break;
    // The round: every rank is at its exchange. Sends and receives per (from, to) pair.
    std::map<std::pair<int, int>, std::vector<Message>> sent, got;
    for (int r = 0; r < P; ++r) {
      for (const PipelineTransfer& t : schedule.ranks[r][next[r]].transfers) {
        const int s = t.chunk * P + r, m = t.micro_batch;
        if (t.chunk < 0 || t.chunk >= V || m < 0 || m >= M) fail(r, "a transfer of no such chunk or micro-batch");
        const int other = t.gradient == t.send ? s - 1 : s + 1;  // the stage at the other end
        if (other < 0 || other >= S || t.peer != other % P || t.peer == r)
          fail(r, fmt::format("a transfer with rank {} that stage {} does not make", t.peer, s));
        if (t.send) {
          if (!(t.gradient ? backward_done : forward_done)[s * M + m]) fail(r, "sends what it has not computed");
          sent[{r, t.peer}].push_back({t.gradient, s, m});
        } else {
          got[{t.peer, r}].push_back({t.gradient, other, m});
        }
      }
    }
    for (const auto& [pair, messages] : got)
      if (sent[pair] != messages)
        fail(pair.second,
             fmt::format("receives from rank {} other than, or in another order than, it sends in round {}", pair.first,
                         round));
    for (const auto& [pair, messages] : sent) {
      if (got[pair] != messages)
        fail(pair.first, fmt::format("sends to rank {} what it does not receive in round {}", pair.second, round));
      for (const Message& message : messages)
        if (!received[pair.second].insert(message).second)
          fail(pair.first, fmt::format("sends to rank {} a second time", pair.second));
    }
    for (int r = 0; r < P; ++r) ++next[r];
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m)
      if (!forward_done[s * M + m] || !backward_done[s * M + m])
        FORGE_FAIL("pipeline schedule: rank {} never runs the {} of chunk {} micro-batch {}", s % P,
                   forward_done[s * M + m] ? "backward" : "forward", s / P, m);
}

int max_in_flight(const PipelineSchedule& schedule, int rank, int chunk) {
  FORGE_CHECK(rank >= 0 && rank < int(schedule.ranks.size()), "rank {} of {}", rank, schedule.ranks.size());
  int in_flight = 0, most = 0;
  for (const PipelineAction& a : schedule.ranks[rank]) {
    if (a.kind == PipelineAction::Kind::Exchange || a.chunk != chunk) continue;
    in_flight += a.kind == PipelineAction::Kind::Forward ? 1 : -1;
    most = std::max(most, in_flight);
  }
  return most;
}

std::string describe_pipeline_schedule(PipelineScheduleKind kind, const PipelineShape& shape,
                                       const PipelineSchedule& schedule) {
  const std::string chunks =
      kind == PipelineScheduleKind::Interleaved ? fmt::format(" x {} chunks", shape.virtual_stages) : "";
  return fmt::format("{}, {} stages{} x {} micro-batches: bubble {:.1f}%",
                     kind == PipelineScheduleKind::Interleaved ? "interleaved 1F1B" : "1F1B", shape.stages, chunks,
                     shape.micro_batches, 100.0 * schedule.bubble_fraction);
}

}  // namespace forge
