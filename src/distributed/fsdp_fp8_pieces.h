// The pieces FSDP's FP8 all-gather casts a block's weights in (NOTE [FP8 all-gather] in
// distributed/fsdp.h), each with a scale of its own.
//
// NOTE [FP8 all-gather pieces]
// The codes a gather hands out must be the bytes the projections' own cast of the gathered
// compute weight would write, and a projection does not always cast its parameter as one
// tensor. So a block's FP8 parameters are cut into pieces, each cast with the scale its
// GEMMs use, and a piece is what steps 1-3 of the gather work on (its amax over this rank's
// chunk of it, max-reduced over the shard group under `tensorwise`, or its projection's
// history scale under `delayed`; its elements cast with that scale):
//  - a dense projection (qkv, o, gate/up, down, a MoE block's shared experts, MLA's q, q_a,
//    q_b, kv_b): one piece, the whole matrix, statistics block the parameter's own;
//  - a routed-expert stack [E, out, in] (NOTE [FP8 routed experts] in ops/moe_fp8.h): E
//    pieces, expert e's matrix with expert e's statistics block ("<name> (expert e)" in
//    Fp8Projections' numbering), as each expert's GEMMs quantize its own slice with its
//    own scale;
//  - MLA's kv_a [r + dr, hidden] (NOTE [FP8 latent attention] in model/latent_attention.h):
//    two pieces, its compressed rows [0, r) and its rotary rows [r, r + dr), both with the
//    parameter's one statistics block: under `tensorwise` each row view's GEMMs take its own
//    amax, under `delayed` both take the block's scale (each piece copies the same one).
// A MoE router stays in the compute dtype (fp8_moe_router) and travels with the norms, and so
// do the routed-expert stacks of a run with precision.fp8_routed_experts false (NOTE [FP8
// routed experts switch] in model/fp8_projections.h: its experts' GEMMs run in the compute
// dtype, and no statistics block of theirs exists to cast them with): they are no pieces,
// and the block's other projections are pieces as above. So do the projections
// precision.fp8_filter_fqns keeps in the compute dtype (NOTE [FP8 filter] in
// model/fp8_projections.h). The gather then packs the codes as it packs the norms (NOTE [FP8
// all-gather] in distributed/fsdp.h, step 3), so that the stacks, most of a MoE block, or a
// filtered projection travel as 2 bytes an element and not 1 + 2.
// Under expert parallelism a rank's slices of the stacks lie in its unit's expert part (NOTE
// [FSDP layout]), which is gathered over the ranks holding the same experts in the compute
// dtype (NOTE [FP8 all-gather] in distributed/fsdp.h): no pieces either.
// The pieces of a parameter are consecutive, in its element order, and the descriptor the
// gather hands out points at the first piece's Fp8GatheredWeight, the others following it:
// expert e's at [e], kv_a's rotary rows at [1].
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "distributed/fsdp_layout.h"
#include "model/config.h"
#include "model/fp8_projections.h"
#include "model/parameters.h"

namespace forge {

struct Fp8GatherPiece {
  int param = 0;           // index into the unit's params
  int64_t offset = 0;      // first element, in unit offsets
  int64_t numel = 0;
  std::string projection;  // the name of its statistics block in Fp8Projections
};

// Whether FSDP's FP8 all-gather sends a block parameter as E4M3 codes: an FP8 block
// projection, or a routed-expert stack in FP8 (fp8_block_projection, fp8_expert_stack; of
// `settings` only routed_experts and filter_fqns matter); the router, the norms and biases
// (and the stacks with settings.routed_experts false, and the projections NOTE [FP8 filter]
// keeps in the compute dtype) travel in the compute dtype.
bool fp8_gathered_param(const ParamSpec& spec, const Fp8Settings& settings);

// The pieces of one parameter at unit offset `offset`, `param` its index in the unit
// (NOTE [FP8 all-gather pieces]); empty for one fp8_gathered_param rejects.
std::vector<Fp8GatherPiece> fp8_param_pieces(const ModelConfig& config, const ParamSpec& spec, int param,
                                             int64_t offset, const Fp8Settings& settings);

// Every piece of a block unit, in parameter order (specs: FsdpLayout::specs()); none of its
// expert part (expert parallelism).
std::vector<Fp8GatherPiece> fp8_unit_pieces(const ModelConfig& config, const std::vector<ParamSpec>& specs,
                                            const FsdpUnit& unit, const Fp8Settings& settings);

// NOTE [FP8 all-gather of the head] in distributed/fsdp.h: the untied output head's weight
// (output.weight), one piece with the head's statistics block; the final norm travels with
// the norms.
bool fp8_head_param(const ParamSpec& spec);
std::vector<Fp8GatherPiece> fp8_head_pieces(const std::vector<ParamSpec>& specs, const FsdpUnit& unit);

// The elements [lo, hi) of a piece inside [begin, end) (unit offsets); lo == hi when none.
std::pair<int64_t, int64_t> fp8_piece_overlap(const Fp8GatherPiece& piece, int64_t begin, int64_t end);

}  // namespace forge
