// NOTE [FP8 all-gather pieces] (distributed/fsdp_fp8_pieces.h): how FSDP's FP8 all-gather
// cuts a block's FP8 weights into pieces of one scale each: a dense projection whole, a
// routed-expert stack one piece per expert (each naming its expert's statistics block, in
// order), MLA's kv_a its two row views (one statistics block); the router and the norms no
// piece, nor the stacks with precision.fp8_routed_experts false, whose gathered bytes (FSDP's
// buffers and the memory estimate) count them in the compute dtype. Every piece names a statistics block Fp8Projections has. The end-to-end runs (the
// FP8 gather bitwise the bf16 gather on 2 CPU ranks) are in
// tests/python/test_fp8_fsdp_all_gather_moe.py.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "cli/config.h"
#include "distributed/fsdp.h"
#include "distributed/fsdp_fp8_pieces.h"
#include "distributed/launch_env.h"
#include "expect_error.h"
#include "model/fp8_projections.h"
#include "model/memory_estimate.h"
#include "rank_threads.h"

namespace forge {
namespace {

ModelConfig model(const char* name) { return load_experiment("", {{"model.name", name}}).model; }

// FP8 settings of which only the routed-experts switch matters to the pieces.
Fp8Settings experts_in_fp8(bool routed_experts) {
  Fp8Settings settings;
  settings.routed_experts = routed_experts;
  return settings;
}

// The pieces of block `layer`'s unit on rank `rank` of `world`, checked to tile each FP8
// parameter in order and to name statistics blocks the model's Fp8Projections has.
std::vector<Fp8GatherPiece> checked_pieces(const ModelConfig& config, int layer, int world = 2, int rank = 0,
                                           bool routed_experts = true) {
  const FsdpLayout layout(config, world, rank);
  const FsdpUnit& unit = layout.units().at(static_cast<size_t>(FsdpLayout::unit_of_layer(layer)));
  const std::vector<Fp8GatherPiece> pieces = fp8_unit_pieces(config, layout.specs(), unit, experts_in_fp8(routed_experts));
  Fp8Settings settings;
  settings.routed_experts = routed_experts;
  const Fp8Projections fp8(config, settings, Device::CPU, 64);
  size_t at = 0;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const FsdpParam& p = unit.params[k];
    const ParamSpec& spec = layout.specs().at(static_cast<size_t>(p.spec));
    if (!fp8_gathered_param(spec, experts_in_fp8(routed_experts))) {
      EXPECT_TRUE(at == pieces.size() || pieces[at].param != static_cast<int>(k)) << spec.name;
      continue;
    }
    int64_t next = p.offset;
    for (; at < pieces.size() && pieces[at].param == static_cast<int>(k); ++at) {
      EXPECT_EQ(pieces[at].offset, next) << spec.name;
      EXPECT_GT(pieces[at].numel, 0) << spec.name;
      EXPECT_GE(fp8.projection_index(pieces[at].projection), 0) << pieces[at].projection;
      next += pieces[at].numel;
    }
    EXPECT_EQ(next, p.offset + p.numel) << spec.name << ": the pieces tile it";
  }
  EXPECT_EQ(at, pieces.size());
  return pieces;
}

TEST(FsdpFp8Pieces, DenseProjectionsAreOnePieceEach) {
  const ModelConfig config = model("debug-tiny");
  const std::vector<Fp8GatherPiece> pieces = checked_pieces(config, 1);
  const FsdpLayout layout(config, 2, 0);
  const FsdpUnit& unit = layout.units().at(2);
  int projections = 0;
  for (const FsdpParam& p : unit.params) projections += fp8_block_matrix(layout.specs()[static_cast<size_t>(p.spec)]);
  EXPECT_EQ(projections, 4);  // qkv, o, gate/up, down
  ASSERT_EQ(pieces.size(), 4u);
  for (const Fp8GatherPiece& piece : pieces) {
    const FsdpParam& p = unit.params.at(static_cast<size_t>(piece.param));
    EXPECT_EQ(piece.projection, layout.specs()[static_cast<size_t>(p.spec)].name);
    EXPECT_EQ(piece.numel, p.numel);
  }
}

TEST(FsdpFp8Pieces, RoutedExpertsArePiecesOfTheirOwnAndTheRouterNone) {
  const ModelConfig config = model("debug-tiny-moe");  // 4 experts of 96 over hidden 64
  const std::vector<Fp8GatherPiece> pieces = checked_pieces(config, 0);
  const Fp8Projections fp8(config, Fp8Settings{}, Device::CPU, 64);
  int gate_up = 0, down = 0;
  for (const Fp8GatherPiece& piece : pieces) {
    EXPECT_EQ(piece.projection.find("router"), std::string::npos) << piece.projection;
    if (piece.projection.starts_with("layers.0.moe.experts.gate_up (expert ")) {
      EXPECT_EQ(piece.projection, "layers.0.moe.experts.gate_up (expert " + std::to_string(gate_up) + ")");
      EXPECT_EQ(piece.numel, 2 * 96 * 64);
      ++gate_up;
    } else if (piece.projection.starts_with("layers.0.moe.experts.down (expert ")) {
      EXPECT_EQ(piece.numel, 64 * 96);
      ++down;
    }
  }
  EXPECT_EQ(gate_up, 4);
  EXPECT_EQ(down, 4);
  // Expert e's statistics block is the stack's first expert's + e (Fp8Projections' order).
  const int64_t first = fp8.projection_index("layers.0.moe.experts.gate_up (expert 0)");
  for (int64_t e = 1; e < 4; ++e)
    EXPECT_EQ(fp8.projection_index("layers.0.moe.experts.gate_up (expert " + std::to_string(e) + ")"),
              first + e);
}

// NOTE [FP8 routed experts switch]: with the experts in the compute dtype their stacks are no
// pieces (they travel with the router and the norms), every other projection's are as before.
TEST(FsdpFp8Pieces, RoutedExpertsOutOfFp8AreNoPieces) {
  for (const char* name : {"debug-tiny-moe", "debug-tiny-mla"}) {
    SCOPED_TRACE(name);
    const ModelConfig config = model(name);
    const int layer = config.num_layers - 1;  // a MoE block
    const std::vector<Fp8GatherPiece> off = checked_pieces(config, layer, 2, 1, /*routed_experts=*/false);
    const std::vector<Fp8GatherPiece> on = checked_pieces(config, layer, 2, 1);
    const FsdpLayout layout(config, 2, 1);
    const FsdpUnit& unit = layout.units().at(static_cast<size_t>(FsdpLayout::unit_of_layer(layer)));
    size_t expert_pieces = 0;
    int stacks = 0;
    for (const FsdpParam& p : unit.params) {
      const ParamSpec& spec = layout.specs()[static_cast<size_t>(p.spec)];
      if (!spec.expert_stack) continue;
      ++stacks;
      EXPECT_TRUE(fp8_gathered_param(spec, experts_in_fp8(true))) << spec.name;
      EXPECT_FALSE(fp8_gathered_param(spec, experts_in_fp8(false))) << spec.name;
      expert_pieces += static_cast<size_t>(spec.shape[0]);
    }
    EXPECT_EQ(stacks, 2);  // gate_up and down
    for (const Fp8GatherPiece& piece : off) EXPECT_EQ(piece.projection.find("(expert "), std::string::npos);
    EXPECT_EQ(off.size() + expert_pieces, on.size());
    size_t k = 0;  // the others unchanged, in order
    for (const Fp8GatherPiece& piece : on) {
      if (piece.projection.find("(expert ") != std::string::npos) continue;
      ASSERT_LT(k, off.size());
      EXPECT_EQ(off[k].projection, piece.projection);
      EXPECT_EQ(off[k].offset, piece.offset);
      EXPECT_EQ(off[k].numel, piece.numel);
      ++k;
    }
    EXPECT_EQ(k, off.size());
  }
}

// NOTE [FP8 all-gather]: with the routed experts in the compute dtype a block slot holds the
// FP8 projections' codes (1 byte each, packed) and the stacks with the norms (the compute
// dtype: fp32 on the CPU), and the wires carry each rank's codes and its norms and stacks.
// Fsdp's buffers and the memory estimate agree, up to the layout's padding.
TEST(FsdpFp8Pieces, MemoryCountsTheStacksInTheComputeDtype) {
  ModelConfig config = model("debug-tiny-moe");  // MoE blocks of 4 experts of 96 over hidden 64
  config.num_layers = 4;  // more blocks than ZeRO-3's three slots, which the estimate counts
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const FsdpLayout layout(config, 1, 0);
  const FsdpUnit& unit = layout.units().at(1);
  int64_t stacks = 0, projections = 0, norms = 0;
  for (const FsdpParam& p : unit.params) {
    const ParamSpec& spec = layout.specs()[static_cast<size_t>(p.spec)];
    (spec.expert_stack ? stacks : fp8_block_matrix(spec) ? projections : norms) += p.numel;
  }
  EXPECT_EQ(stacks, 4 * 3 * 96 * 64);  // gate_up and down of 4 experts
  const int64_t ends = layout.units().front().numel + layout.units().back().numel;
  const int64_t block = layout.max_block_numel();
  std::vector<double> estimated;
  for (bool routed_experts : {true, false}) {
    SCOPED_TRACE(routed_experts);
    FsdpOptions options;
    options.fp8_all_gather = true;
    options.fp8_routed_experts = routed_experts;
    const FsdpMemory m = Fsdp(config, Device::CPU, *group, nullptr, options).memory();
    // Three slots: codes, norms (fp32 here), each piece's amax and two scales; the wires.
    const int64_t pieces = static_cast<int64_t>(fp8_unit_pieces(config, layout.specs(), unit, experts_in_fp8(routed_experts)).size());
    const int64_t statistics = 3 * (pieces * 4 + 2 * pieces * cpu::kFp8StatStride * 4);
    if (routed_experts)
      EXPECT_EQ(m.compute_weights, ends * 4 + 3 * (block + norms * 4) + norms * 4 + statistics);
    else  // the stacks with the norms, the codes packed, and the code wire
      EXPECT_EQ(m.compute_weights, ends * 4 + 3 * (projections + (norms + stacks) * 4) + (norms + stacks) * 4 +
                                       projections + statistics);
    MemoryPlan plan;
    plan.fsdp = true;
    plan.fp8_all_gather = true;
    Fp8Settings settings;
    settings.routed_experts = routed_experts;
    plan.fp8 = settings;
    const double estimate = estimate_memory(config, plan).compute_weights;
    EXPECT_NEAR(estimate, static_cast<double>(m.compute_weights - statistics), 8.0 * 4 * kFsdpAlign);
    estimated.push_back(estimate);
  }
  // The stacks take 4 bytes (fp32 on the CPU; bf16's 2 on CUDA) in each slot and the wire
  // rather than 1 byte of codes, and the codes' wire is added.
  EXPECT_NEAR(estimated[1] - estimated[0], 3.0 * stacks * 3 + stacks * 4 + projections, 8.0 * 4 * kFsdpAlign);
}

// NOTE [FP8 all-gather] under expert parallelism 2 on 4 ranks: a slot holds the dense part's
// codes in place, its norms, and the expert part (the rank's 2 of 4 experts' slices) in the
// compute dtype; the memory estimate agrees up to the padding, with the switch on and off
// (the same bytes: the slices travel in the compute dtype either way).
TEST(FsdpFp8Pieces, MemoryUnderExpertParallelismCountsTheSlicesInTheComputeDtype) {
  using namespace std::chrono_literals;
  ModelConfig config = model("debug-tiny-moe");
  config.num_layers = 4;
  for (bool routed_experts : {true, false}) {
    SCOPED_TRACE(routed_experts);
    const int port = testing::free_port();
    std::vector<int64_t> compute(4, 0);
    const std::vector<std::string> errors = testing::run_ranks(4, [&](int r) {
      ProcessGroupOptions group_options;
      group_options.rendezvous_timeout = 20s;
      group_options.collective_timeout = 20s;
      auto group = create_process_group(testing::env_of(r, 4, port), group_options);
      auto experts = group->split(r % 2, r);  // the ranks holding the same experts
      FsdpOptions options;
      options.fp8_all_gather = true;
      options.fp8_routed_experts = routed_experts;
      options.expert_parallel = 2;
      compute[static_cast<size_t>(r)] =
          Fsdp(config, Device::CPU, *group, nullptr, options, experts.get()).memory().compute_weights;
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "");
    const FsdpLayout layout(config, 4, 0, 2);
    const FsdpUnit& unit = layout.units().at(1);
    int64_t stack_slices = 0;
    for (const FsdpParam& p : unit.params) stack_slices += p.expert ? p.numel : 0;
    EXPECT_EQ(stack_slices, 2 * 3 * 96 * 64);  // 2 of 4 experts, gate_up and down
    EXPECT_EQ(unit.parts.size(), 2u);
    const int64_t pieces = static_cast<int64_t>(fp8_unit_pieces(config, layout.specs(), unit, experts_in_fp8(routed_experts)).size());
    const int64_t statistics = 3 * (pieces * 4 + 2 * pieces * cpu::kFp8StatStride * 4);
    MemoryPlan plan;
    plan.fsdp = true;
    plan.shard_ranks = 4;
    plan.expert_parallel = 2;
    plan.fp8_all_gather = true;
    Fp8Settings settings;
    settings.routed_experts = routed_experts;
    plan.fp8 = settings;
    const double estimate = estimate_memory(config, plan).compute_weights;
    for (int64_t c : compute) {
      EXPECT_EQ(c, compute[0]);  // every rank the same buffers
      EXPECT_NEAR(estimate, static_cast<double>(c - statistics), 3.0 * 4 * 4 * kFsdpAlign * 4);
    }
    // The slots' expert buffers: 3 x the expert part, 4 bytes an element on the CPU.
    EXPECT_GE(compute[0], 3 * unit.parts.back().numel * 4);
  }
}

TEST(FsdpFp8Pieces, LatentKvAIsItsTwoRowViews) {
  const ModelConfig config = model("debug-tiny-mla");  // kv_lora_rank 32, qk_rope_head_dim 16, hidden 64
  for (int layer : {0, 1}) {  // the dense first block, then a MoE block
    SCOPED_TRACE(layer);
    const std::vector<Fp8GatherPiece> pieces = checked_pieces(config, layer, 4, 3);
    const std::string kv_a = "layers." + std::to_string(layer) + ".attention.kv_a.weight";
    std::vector<Fp8GatherPiece> views;
    for (const Fp8GatherPiece& piece : pieces)
      if (piece.projection == kv_a) views.push_back(piece);
    ASSERT_EQ(views.size(), 2u);
    EXPECT_EQ(views[0].numel, 32 * 64);  // the compressed rows
    EXPECT_EQ(views[1].numel, 16 * 64);  // the rotary rows
    EXPECT_EQ(views[1].offset, views[0].offset + views[0].numel);
    EXPECT_EQ(views[0].param, views[1].param);
  }
}

TEST(FsdpFp8Pieces, OverlapIsThePieceInsideTheRange) {
  const Fp8GatherPiece piece{0, 100, 50, "p"};
  EXPECT_EQ(fp8_piece_overlap(piece, 0, 64), (std::pair<int64_t, int64_t>{64, 64}));  // none
  EXPECT_EQ(fp8_piece_overlap(piece, 64, 128), (std::pair<int64_t, int64_t>{100, 128}));
  EXPECT_EQ(fp8_piece_overlap(piece, 128, 192), (std::pair<int64_t, int64_t>{128, 150}));
  EXPECT_EQ(fp8_piece_overlap(piece, 90, 200), (std::pair<int64_t, int64_t>{100, 150}));
  EXPECT_EQ(fp8_piece_overlap(piece, 192, 256), (std::pair<int64_t, int64_t>{192, 192}));  // none
}

// NOTE [FP8 all-gather] under expert parallelism: the expert part's slices travel in the
// compute dtype over their group, so they are no pieces; the dense part's are as without it.
TEST(FsdpFp8Pieces, AnExpertPartHasNoPieces) {
  const ModelConfig config = model("debug-tiny-moe");
  const FsdpLayout whole(config, 4, 1), sliced(config, 4, 1, /*expert_parallel=*/2);
  for (bool routed_experts : {true, false}) {
    const std::vector<Fp8GatherPiece> pieces = fp8_unit_pieces(config, sliced.specs(), sliced.units().at(1), experts_in_fp8(routed_experts));
    const std::vector<Fp8GatherPiece> dense = fp8_unit_pieces(config, whole.specs(), whole.units().at(1), experts_in_fp8(false));
    ASSERT_EQ(pieces.size(), dense.size());
    for (size_t k = 0; k < pieces.size(); ++k) {
      EXPECT_EQ(pieces[k].projection, dense[k].projection);
      EXPECT_EQ(pieces[k].numel, dense[k].numel);
      EXPECT_EQ(pieces[k].projection.find("(expert "), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace forge

namespace forge {
namespace {

// NOTE [FP8 all-gather of a frozen base]: LoRA's frozen base holds its chunk in the compute
// dtype (fp32 on the CPU) and the FP8 all-gather's slots (three under ZeRO-3, one per block
// under ZeRO-1), no bf16 copy of the blocks; the memory estimate's frozen weights agree up
// to the padding and the slots' statistics.
TEST(FsdpFp8Pieces, FrozenBaseHoldsTheChunkAndTheCodeSlots) {
  ModelConfig config = model("debug-tiny");
  config.num_layers = 4;
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const FsdpLayout layout(config, 1, 0);
  const auto pieces =
      static_cast<int64_t>(fp8_unit_pieces(config, layout.specs(), layout.units().at(1), Fp8Settings{}).size());
  for (int zero : {3, 1}) {
    SCOPED_TRACE(zero);
    FsdpOptions options;
    options.zero_stage = zero;
    options.frozen = true;
    options.fp8_all_gather = true;
    const FsdpMemory m = Fsdp(config, Device::CPU, *group, nullptr, options).memory();
    options.fp8_all_gather = false;
    const FsdpMemory bf16 = Fsdp(config, Device::CPU, *group, nullptr, options).memory();
    const int64_t slots = zero == 3 ? 3 : 4, statistics = slots * (pieces * 4 + 2 * pieces * cpu::kFp8StatStride * 4);
    EXPECT_EQ(m.master_weights, 0);
    EXPECT_LT(m.compute_weights - statistics, bf16.compute_weights);  // 1-byte codes for the blocks
    MemoryPlan plan;
    plan.fsdp = true;
    plan.zero_stage = zero;
    plan.fp8_all_gather = true;
    plan.fp8 = Fp8Settings{};
    plan.lora.rank = 4;
    const MemoryEstimate e = estimate_memory(config, plan);
    EXPECT_NEAR(e.frozen_weights, static_cast<double>(m.compute_weights - statistics), 8.0 * 4 * kFsdpAlign);
    plan.fp8_all_gather = false;
    EXPECT_NEAR(estimate_memory(config, plan).frozen_weights, static_cast<double>(bf16.compute_weights),
                8.0 * 4 * kFsdpAlign);
  }
}

}  // namespace
}  // namespace forge

namespace forge {
namespace {

// NOTE [FP8 all-gather of the head]: with the FP8 head the head unit is no compute-dtype copy
// but a slot of codes (1 byte per output.weight element, in place), its final norm and the
// piece's statistics; a tied head stays a compute-dtype copy. The estimate agrees up to the
// padding and the statistics.
TEST(FsdpFp8Pieces, HeadGatheredAsCodesHoldsOneByteAWeight) {
  ModelConfig config = model("debug-tiny");
  config.num_layers = 4;  // more blocks than ZeRO-3's three slots, which the estimate counts
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const FsdpLayout layout(config, 1, 0);
  const FsdpUnit& head = layout.units().back();
  const int64_t pieces = static_cast<int64_t>(
      fp8_unit_pieces(config, layout.specs(), layout.units().at(1), Fp8Settings{}).size());
  for (int zero : {3, 1}) {
    SCOPED_TRACE(zero);
    FsdpOptions options;
    options.zero_stage = zero;
    options.fp8_all_gather = true;
    const FsdpMemory bf16_head = Fsdp(config, Device::CPU, *group, nullptr, options).memory();
    options.fp8_output_head = true;
    Fsdp fsdp(config, Device::CPU, *group, nullptr, options);
    EXPECT_TRUE(fsdp.gathers_fp8_head());
    const int64_t head_slot = head.numel + config.hidden_size * 4 + 4 + 2 * cpu::kFp8StatStride * 4;
    EXPECT_EQ(fsdp.memory().compute_weights, bf16_head.compute_weights - head.numel * 4 + head_slot);
    MemoryPlan plan;
    plan.fsdp = true;
    plan.zero_stage = zero;
    plan.fp8_all_gather = true;
    Fp8Settings settings;
    settings.output_head = true;
    plan.fp8 = settings;
    const int64_t slots = zero == 3 ? 3 : config.num_layers;
    const int64_t statistics = slots * (pieces * 4 + 2 * pieces * cpu::kFp8StatStride * 4) + 4 +
                               2 * cpu::kFp8StatStride * 4;
    EXPECT_NEAR(estimate_memory(config, plan).compute_weights,
                static_cast<double>(fsdp.memory().compute_weights - statistics), 8.0 * 4 * kFsdpAlign);
  }
  ModelConfig tied = config;
  tied.tie_word_embeddings = true;
  FsdpOptions options;
  options.fp8_all_gather = options.fp8_output_head = true;
  EXPECT_FALSE(Fsdp(tied, Device::CPU, *group, nullptr, options).gathers_fp8_head());
}

}  // namespace
}  // namespace forge
