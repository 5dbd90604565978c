// NOTE [FP8 all-gather pieces] (distributed/fsdp_fp8_pieces.h): how FSDP's FP8 all-gather
// cuts a block's FP8 weights into pieces of one scale each: a dense projection whole, a
// routed-expert stack one piece per expert (each naming its expert's statistics block, in
// order), MLA's kv_a its two row views (one statistics block); the router and the norms no
// piece. Every piece names a statistics block Fp8Projections has. The end-to-end runs (the
// FP8 gather bitwise the bf16 gather on 2 CPU ranks) are in
// tests/python/test_fp8_fsdp_all_gather_moe.py.
#include <gtest/gtest.h>

#include <string>

#include "cli/config.h"
#include "distributed/fsdp_fp8_pieces.h"
#include "expect_error.h"
#include "model/fp8_projections.h"

namespace forge {
namespace {

ModelConfig model(const char* name) { return load_experiment("", {{"model.name", name}}).model; }

// The pieces of block `layer`'s unit on rank `rank` of `world`, checked to tile each FP8
// parameter in order and to name statistics blocks the model's Fp8Projections has.
std::vector<Fp8GatherPiece> checked_pieces(const ModelConfig& config, int layer, int world = 2, int rank = 0) {
  const FsdpLayout layout(config, world, rank);
  const FsdpUnit& unit = layout.units().at(static_cast<size_t>(FsdpLayout::unit_of_layer(layer)));
  const std::vector<Fp8GatherPiece> pieces = fp8_unit_pieces(config, layout.specs(), unit);
  const Fp8Projections fp8(config, Fp8Settings{}, Device::CPU, 64);
  size_t at = 0;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const FsdpParam& p = unit.params[k];
    const ParamSpec& spec = layout.specs().at(static_cast<size_t>(p.spec));
    if (!fp8_gathered_param(spec)) {
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
  for (const FsdpParam& p : unit.params) projections += fp8_block_projection(layout.specs()[static_cast<size_t>(p.spec)]);
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

TEST(FsdpFp8Pieces, AnExpertSliceIsRefused) {
  const ModelConfig config = model("debug-tiny-moe");
  const FsdpLayout layout(config, 2, 0, /*expert_parallel=*/2);
  expect_error([&] { fp8_unit_pieces(config, layout.specs(), layout.units().at(1)); },
               {"FSDP's FP8 all-gather", "layers.0.moe.experts.gate_up", "held in part"});
}

}  // namespace
}  // namespace forge
