// Pipeline schedules as data (NOTE [Pipeline schedules] in model/pipeline_schedule.h):
// every shape verifies (one forward and backward per stage and micro-batch, inputs received
// before they are read, every rank in every round, sends and receives in the same order),
// the bubbles are the textbook figures, and small cases are the lists written out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <tuple>

#include "expect_error.h"
#include "model/pipeline_schedule.h"

namespace forge {
namespace {

constexpr auto kOneFOneB = PipelineScheduleKind::OneFOneB;
constexpr auto kInterleaved = PipelineScheduleKind::Interleaved;

std::vector<std::string> described(const std::vector<PipelineAction>& actions, bool computes_only = false) {
  std::vector<std::string> out;
  for (const auto& a : actions)
    if (!computes_only || a.kind != PipelineAction::Kind::Exchange) out.push_back(describe_pipeline_action(a));
  return out;
}

// Every shape the tests build: 1F1B and interleaved with 2 and 3 chunks.
std::vector<std::pair<PipelineScheduleKind, PipelineShape>> all_shapes() {
  std::vector<std::pair<PipelineScheduleKind, PipelineShape>> shapes;
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 4, 8, 16}) {
      shapes.push_back({kOneFOneB, {p, 1, m}});
      for (int v : {2, 3})
        if (m % p == 0) shapes.push_back({kInterleaved, {p, v, m}});
    }
  }
  return shapes;
}

TEST(PipelineSchedule, NamesAreTorchtitans) {
  EXPECT_STREQ(pipeline_schedule_name(kOneFOneB), "1F1B");
  EXPECT_STREQ(pipeline_schedule_name(kInterleaved), "Interleaved1F1B");
  EXPECT_EQ(parse_pipeline_schedule("1F1B"), kOneFOneB);
  EXPECT_EQ(parse_pipeline_schedule("interleaved1f1b"), kInterleaved);  // torch's get_schedule_class ignores case
  expect_error([] { parse_pipeline_schedule("gpipe"); }, {"'gpipe'", "1F1B", "Interleaved1F1B"});
}

TEST(PipelineSchedule, BadShapesAreNamed) {
  expect_error([] { check_pipeline_shape(kOneFOneB, {0, 1, 4}); }, {"1F1B", "0 stages", "at least 1"});
  expect_error([] { check_pipeline_shape(kOneFOneB, {2, 0, 4}); }, {"0 virtual stages"});
  expect_error([] { check_pipeline_shape(kInterleaved, {2, 2, 0}); }, {"Interleaved1F1B", "0 micro-batches"});
  expect_error([] { check_pipeline_shape(kOneFOneB, {2, 2, 4}); }, {"1F1B", "2 virtual stages", "Interleaved1F1B"});
  expect_error([] { check_pipeline_shape(kInterleaved, {2, 1, 4}); }, {"Interleaved1F1B", "at least 2", "not 1"});
  expect_error([] { check_pipeline_shape(kInterleaved, {4, 2, 6}); }, {"6 micro-batches", "multiple of 4"});
  expect_error([] { make_pipeline_schedule(kInterleaved, {4, 2, 6}); }, {"multiple of 4"});
  EXPECT_THROW(make_pipeline_schedule(kOneFOneB, {2, 1, 4}, 0.0), Error);
}

TEST(PipelineSchedule, EveryShapeVerifies) {
  for (const auto& [kind, shape] : all_shapes()) {
    SCOPED_TRACE(describe_pipeline_schedule(kind, shape, {}));
    for (double backward_cost : {2.0, 1.0, 3.0, 1.7}) {
      const PipelineSchedule schedule = make_pipeline_schedule(kind, shape, backward_cost);
      EXPECT_NO_THROW(verify_pipeline_schedule(schedule, shape));
      if (shape.stages == 1) {
        EXPECT_EQ(described(schedule.ranks[0]), described(schedule.ranks[0], true)) << "no exchanges on one rank";
        EXPECT_NEAR(schedule.bubble_fraction, 0.0, 1e-12);
      }
    }
  }
}

// Within a round, rank a's sends to b are in the order of b's receives from a, and a rank
// sends at most one message.
TEST(PipelineSchedule, SendsAndReceivesPairUpInOrder) {
  for (const auto& [kind, shape] : all_shapes()) {
    const PipelineSchedule schedule = make_pipeline_schedule(kind, shape);
    const int P = shape.stages;
    std::vector<size_t> at(P, 0);
    for (;;) {
      // Advance every rank to its next exchange; all reach one or none does.
      std::vector<const PipelineAction*> round(P, nullptr);
      for (int r = 0; r < P; ++r) {
        auto& list = schedule.ranks[r];
        while (at[r] < list.size() && list[at[r]].kind != PipelineAction::Kind::Exchange) ++at[r];
        if (at[r] < list.size()) round[r] = &list[at[r]++];
      }
      const auto reached = std::count(round.begin(), round.end(), nullptr);
      ASSERT_TRUE(reached == 0 || reached == P);
      if (reached == P) break;
      // (gradient, micro-batch, stage at the receiving end) per (from, to), in list order.
      std::map<std::pair<int, int>, std::vector<std::tuple<bool, int, int>>> sent, got;
      std::vector<int> sends(P, 0);
      for (int r = 0; r < P; ++r) {
        for (const auto& t : round[r]->transfers) {
          const int stage = t.chunk * P + r;
          if (t.send) {
            EXPECT_EQ(++sends[r], 1) << "rank " << r << " ends one compute at a time";
            sent[{r, t.peer}].push_back({t.gradient, t.micro_batch, t.gradient ? stage - 1 : stage + 1});
          } else
            got[{t.peer, r}].push_back({t.gradient, t.micro_batch, stage});
        }
      }
      EXPECT_EQ(sent, got) << describe_pipeline_schedule(kind, shape, schedule);
    }
  }
}

// P = 2, M = 3: rank 0 warms up with one forward, rank 1 with none. Times (a backward is
// two forwards): rank 0 F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9] B2 [10,12]; rank 1
// F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10]. Transfers at 1, 2, 4, 7, 10.
TEST(PipelineSchedule, OneFOneBTwoStagesThreeMicroBatches) {
  const PipelineShape shape{2, 1, 3};
  const PipelineSchedule schedule = make_pipeline_schedule(kOneFOneB, shape);
  EXPECT_EQ(
      described(schedule.ranks[0]),
      (std::vector<std::string>{"F(c0,m0)", "X{>1 a c0 m0}", "F(c0,m1)", "X{>1 a c0 m1}", "X{<1 g c0 m0}", "B(c0,m0)",
                                "F(c0,m2)", "X{>1 a c0 m2, <1 g c0 m1}", "B(c0,m1)", "X{<1 g c0 m2}", "B(c0,m2)"}));
  EXPECT_EQ(
      described(schedule.ranks[1]),
      (std::vector<std::string>{"X{<0 a c0 m0}", "F(c0,m0)", "X{<0 a c0 m1}", "B(c0,m0)", "X{>0 g c0 m0}", "F(c0,m1)",
                                "B(c0,m1)", "X{>0 g c0 m1, <0 a c0 m2}", "F(c0,m2)", "B(c0,m2)", "X{>0 g c0 m2}"}));
  EXPECT_DOUBLE_EQ(schedule.makespan, 12.0);
  EXPECT_DOUBLE_EQ(schedule.busy_time, 9.0);
  EXPECT_DOUBLE_EQ(schedule.bubble_fraction, 0.25);
}

// P = 2, V = 2, M = 4: forwards go through micro-batches 0, 1 on chunk 0, then chunk 1,
// then 2, 3 on chunk 0 and chunk 1; backwards the same with the chunks reversed. Rank 0
// warms up with 2 (P - 1) + (V - 1) P = 4 forwards, rank 1 with 2.
TEST(PipelineSchedule, InterleavedComputeOrder) {
  const PipelineShape shape{2, 2, 4};
  const PipelineSchedule schedule = make_pipeline_schedule(kInterleaved, shape);
  EXPECT_EQ(described(schedule.ranks[0], true),
            (std::vector<std::string>{"F(c0,m0)", "F(c0,m1)", "F(c1,m0)", "F(c1,m1)", "F(c0,m2)", "B(c1,m0)",
                                      "F(c0,m3)", "B(c1,m1)", "F(c1,m2)", "B(c0,m0)", "F(c1,m3)", "B(c0,m1)",
                                      "B(c1,m2)", "B(c1,m3)", "B(c0,m2)", "B(c0,m3)"}));
  EXPECT_EQ(described(schedule.ranks[1], true),
            (std::vector<std::string>{"F(c0,m0)", "F(c0,m1)", "F(c1,m0)", "B(c1,m0)", "F(c1,m1)", "B(c1,m1)",
                                      "F(c0,m2)", "B(c0,m0)", "F(c0,m3)", "B(c0,m1)", "F(c1,m2)", "B(c1,m2)",
                                      "F(c1,m3)", "B(c1,m3)", "B(c0,m2)", "B(c0,m3)"}));
  // Stage 1 (rank 1's chunk 0) hands its activation to stage 2 (rank 0's chunk 1), and
  // stage 2 its gradient back to stage 1.
  bool activation = false, gradient = false;
  for (const auto& a : schedule.ranks[1])
    for (const auto& t : a.transfers) {
      activation |= t.send && !t.gradient && t.chunk == 0 && t.peer == 0;
      gradient |= !t.send && t.gradient && t.chunk == 0 && t.peer == 0;
    }
  EXPECT_TRUE(activation && gradient);
}

// 1F1B's bubble is (P - 1) / (M + P - 1), whatever a backward costs (the textbook figure
// is for two forwards).
TEST(PipelineSchedule, OneFOneBBubble) {
  for (double backward_cost : {2.0, 1.0, 3.0, 1.7})
    for (int p : {1, 2, 3, 4, 8})
      for (int m : {1, 2, 4, 8, 16}) {
        const PipelineSchedule schedule = make_pipeline_schedule(kOneFOneB, {p, 1, m}, backward_cost);
        EXPECT_NEAR(schedule.bubble_fraction, double(p - 1) / (m + p - 1), 1e-12)
            << p << " stages, " << m << " micro-batches, backward " << backward_cost;
      }
  const PipelineShape shape{4, 1, 8};
  const PipelineSchedule schedule = make_pipeline_schedule(kOneFOneB, shape);
  EXPECT_NEAR(schedule.bubble_fraction, 3.0 / 11.0, 1e-12);
  EXPECT_DOUBLE_EQ(schedule.makespan, 33.0);  // (M + P - 1) (1 + 2)
  EXPECT_EQ(describe_pipeline_schedule(kOneFOneB, shape, schedule), "1F1B, 4 stages x 8 micro-batches: bubble 27.3%");
}

// Interleaving V chunks cuts the bubble to (P - 1) / (V M + P - 1) exactly, here too for
// any backward cost; M = P included (Megatron runs that case as all forwards, then all
// backwards; the warmup formula gives the same bubble).
TEST(PipelineSchedule, InterleavedBubble) {
  for (double backward_cost : {2.0, 1.0, 3.0, 1.7})
    for (int p : {2, 3, 4, 8})
      for (int m : {p, 2 * p, 4 * p})
        for (int v : {2, 3}) {
          const double one = make_pipeline_schedule(kOneFOneB, {p, 1, m}, backward_cost).bubble_fraction;
          const double bubble = make_pipeline_schedule(kInterleaved, {p, v, m}, backward_cost).bubble_fraction;
          EXPECT_LT(bubble, one);
          EXPECT_NEAR(bubble, double(p - 1) / (v * m + p - 1), 1e-12)
              << p << " stages, " << v << " chunks, " << m << " micro-batches, backward " << backward_cost;
        }
  const PipelineShape shape{4, 2, 8};
  EXPECT_EQ(describe_pipeline_schedule(kInterleaved, shape, make_pipeline_schedule(kInterleaved, shape)),
            "interleaved 1F1B, 4 stages x 2 chunks x 8 micro-batches: bubble 15.8%");  // 3 / 19
}

// 1F1B rank r keeps min(P - r, M) micro-batches' activations.
TEST(PipelineSchedule, MaxInFlight) {
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 4, 8, 16}) {
      const PipelineSchedule schedule = make_pipeline_schedule(kOneFOneB, {p, 1, m});
      for (int r = 0; r < p; ++r) EXPECT_EQ(max_in_flight(schedule, r, 0), std::min(p - r, m));
    }
}

TEST(PipelineSchedule, VerifyNamesTheBrokenAction) {
  const PipelineShape shape{2, 1, 3};
  const PipelineSchedule good = make_pipeline_schedule(kOneFOneB, shape);
  {
    PipelineSchedule bad = good;  // rank 1 runs F(c0,m0) before the exchange that brings its input
    std::swap(bad.ranks[1][0], bad.ranks[1][1]);
    expect_error([&] { verify_pipeline_schedule(bad, shape); }, {"rank 1 action 0 F(c0,m0)", "activation of stage 0"});
  }
  {
    PipelineSchedule bad = good;  // rank 1 skips a round
    bad.ranks[1].erase(bad.ranks[1].begin() + 2);
    expect_error([&] { verify_pipeline_schedule(bad, shape); }, {"rank 1 has 4 exchanges, rank 0 has 5"});
  }
  {
    PipelineSchedule bad = good;  // the round at 7 receives on rank 0 only
    bad.ranks[1][7].transfers.pop_back();
    expect_error([&] { verify_pipeline_schedule(bad, shape); }, {"rank 0 action 7", "sends to rank 1"});
  }
  {
    PipelineSchedule bad = good;  // a second forward of micro-batch 1 instead of micro-batch 2
    bad.ranks[0][6].micro_batch = 1;
    expect_error([&] { verify_pipeline_schedule(bad, shape); }, {"rank 0 action 6 F(c0,m1)", "a second forward"});
  }
  {
    // A simulated schedule sends at most one message per rank and round (a rank ends one
    // compute at a time), so order between a pair is tested on a GPipe schedule written by
    // hand: both activations in one round, then both gradients.
    const PipelineShape two{2, 1, 2};
    using K = PipelineAction::Kind;
    auto exchange = [](std::vector<PipelineTransfer> transfers) {
      return PipelineAction{K::Exchange, 0, 0, transfers};
    };
    PipelineSchedule gpipe;
    gpipe.ranks = {{{K::Forward, 0, 0, {}},
                    {K::Forward, 0, 1, {}},
                    exchange({{true, false, 0, 0, 1}, {true, false, 0, 1, 1}}),
                    exchange({{false, true, 0, 0, 1}, {false, true, 0, 1, 1}}),
                    {K::Backward, 0, 0, {}},
                    {K::Backward, 0, 1, {}}},
                   {exchange({{false, false, 0, 0, 0}, {false, false, 0, 1, 0}}),
                    {K::Forward, 0, 0, {}},
                    {K::Forward, 0, 1, {}},
                    {K::Backward, 0, 0, {}},
                    {K::Backward, 0, 1, {}},
                    exchange({{true, true, 0, 0, 0}, {true, true, 0, 1, 0}})}};
    EXPECT_NO_THROW(verify_pipeline_schedule(gpipe, two));
    std::swap(gpipe.ranks[1][0].transfers[0], gpipe.ranks[1][0].transfers[1]);
    expect_error([&] { verify_pipeline_schedule(gpipe, two); },
                 {"rank 1 action 0", "receives from rank 0", "in another order", "round 0"});
  }
}

}  // namespace
}  // namespace forge
