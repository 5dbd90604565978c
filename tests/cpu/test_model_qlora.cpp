// QLoRA at the model level (NOTE [QLoRA base] in model/nf4_base.h): LoRA adapters over the
// NF4 frozen base train exactly as over a base whose projections are the dequantized NF4
// values, in every activation-checkpointing mode; the codes never change; quantizing the
// same import (or seeded initialization) again gives the same codes (what a resumed run
// relies on); and the memory estimate counts what the frozen base really holds.
#include <gtest/gtest.h>

#include <algorithm>

#include "ckpt/hf_layout.h"
#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/memory_estimate.h"
#include "model/nf4_base.h"
#include "model/pipeline.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "optim/optimizer.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::tiny;

LoraConfig qlora() {
  LoraConfig c;
  c.rank = 3;
  c.alpha = 8.0;
  c.dropout = 0.2;
  c.target_modules = "all-linear";
  c.quantize_base = "nf4";
  return c;
}

// tiny() with 4 experts of which 2 per token, 24 x 20 matrices (NOTE [NF4 expert stacks]).
ModelConfig tiny_moe() {
  ModelConfig c = tiny();
  c.name = "tiny-moe";
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_ffn_hidden_size = 20;
  c.router_aux_loss_coef = 0.05;
  return c;
}

// tiny_moe() with DeepSeek's Multi-head Latent Attention (a compressed query, rotary rows
// reordered at import), a dense first block and a shared expert.
ModelConfig tiny_mla() {
  ModelConfig c = tiny_moe();
  c.name = "tiny-mla";
  c.num_kv_heads = c.num_heads;
  c.kv_lora_rank = 16;
  c.q_lora_rank = 12;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 6;
  c.first_dense_layers = 1;
  c.num_shared_experts = 1;
  return c;
}

// On a MoE model all-linear puts adapters on attention, the router and the routed experts'
// stacks (NOTE [LoRA on MoE and MLA models]; the experts' add to the GEMMs on the dequantized
// NF4 stacks, NOTE [LoRA on routed experts]), which take no dropout.
LoraConfig qlora_for(const ModelConfig& config) {
  LoraConfig c = qlora();
  if (config.moe()) {
    c.dropout = 0.0;
    c.target_modules = "all-linear";
  }
  return c;
}

// Adapters with a nonzero B (so A has gradients too), over `base`.
std::unique_ptr<LoraAdapters> adapters_over(ParamSource& base, const ModelConfig& config) {
  auto adapters = std::make_unique<LoraAdapters>(config, qlora_for(config), Device::CPU, 2 * 16);
  adapters->initialize(2);
  testing::set_nonzero_lora_b(*adapters);
  adapters->set_base(base);
  return adapters;
}

std::vector<Tensor> code_copies(const Nf4Base& base) {
  std::vector<Tensor> copies;
  for (const Nf4Weight& w : base.weights)
    for (const Nf4Tensor& part : w.parts) {
      copies.push_back(part.codes.clone());
      copies.push_back(part.absmax_codes.clone());
    }
  return copies;
}

// Three optimizer steps of QLoRA and of LoRA on the dequantized base: the same losses and
// adapter gradients, bitwise (the GEMMs read the same fp32 weight values; only where they
// come from differs), so the same adapters after every AdamW step.
// A MoE model's routed experts are NF4 too, dequantized per block (NOTE [NF4 expert stacks]).
TEST(ModelQlora, TrainingEqualsLoraOnTheDequantizedBase) {
  for (int model = 0; model < 4; ++model)
    for (ActivationCheckpoint mode :
         {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
      const bool tied = model == 1;
      const ModelConfig c = model == 3 ? tiny_mla() : model == 2 ? tiny_moe() : tiny(tied);
      FlatParameters imported(c), dequantized(c);
      imported.initialize(11);
      // MLA: the rotary rows stored in the published (interleaved) order, gathered per use.
      Nf4FrozenBase frozen(imported, Device::CPU, DType::F32,
                           [&](size_t k) { return hf_stored_rows(imported.specs()[k], true); });
      frozen.dequantize_into(dequantized);
      const std::vector<Tensor> codes_before = code_copies(frozen.codes());

      auto q = adapters_over(frozen, c);
      auto l = adapters_over(dequantized, c);
      OptimizerConfig oc;
      oc.lr = 1e-2;
      AdamW q_opt(oc, q->masters(), std::vector<bool>(q->masters().size(), true));
      AdamW l_opt(oc, l->masters(), std::vector<bool>(l->masters().size(), true));
      DecoderLM model(c, 2, 16, Device::CPU, DType::F32, mode);
      for (int step = 0; step < 3; ++step) {
        const Tensor tokens = testing::random_tokens(2, 16, c.vocab_size, 1 + static_cast<uint64_t>(step));
        const Tensor targets = testing::random_tokens(2, 16, c.vocab_size, 9 + static_cast<uint64_t>(step));
        q->set_dropout_step(7, static_cast<uint64_t>(step));
        l->set_dropout_step(7, static_cast<uint64_t>(step));
        q->discard();
        l->discard();
        const LossSum a = model.forward_backward(tokens, targets, *q, *q, 1.0f / 32);
        const LossSum b = model.forward_backward(tokens, targets, *l, *l, 1.0f / 32);
        ASSERT_EQ(a.sum, b.sum) << "tied " << tied << ", step " << step;
        ASSERT_TRUE(bitwise_equal(q->gradient_flat(), l->gradient_flat())) << "tied " << tied << ", step " << step;
        q_opt.step(q->gradients(), 1e-2);
        l_opt.step(l->gradients(), 1e-2);
        q->refresh_compute();
        l->refresh_compute();
      }
      EXPECT_TRUE(bitwise_equal(q->master_flat(), l->master_flat()));
      const std::vector<Tensor> codes_after = code_copies(frozen.codes());
      ASSERT_EQ(codes_after.size(), codes_before.size());
      for (size_t k = 0; k < codes_after.size(); ++k)
        EXPECT_TRUE(bitwise_equal(codes_after[k], codes_before[k])) << "the frozen NF4 codes changed";
    }
}

// The base keeps no full-precision projection: what it holds is the codes, the rest in the
// compute dtype and the scratch; dequantize_into gives the embedding, norms and head back
// as imported and the projections as NF4 dequantizes them. A second import quantizes to
// the same codes.
void expect_frozen_base_holds_codes_and_the_rest(const ModelConfig& c);

TEST(ModelQlora, FrozenBaseHoldsCodesAndTheRestAndQuantizesDeterministically) {
  for (const ModelConfig& c : {tiny(), tiny_moe()}) expect_frozen_base_holds_codes_and_the_rest(c);
}

void expect_frozen_base_holds_codes_and_the_rest(const ModelConfig& c) {
  SCOPED_TRACE(c.name);
  FlatParameters imported(c), back(c);
  imported.initialize(4);
  Nf4FrozenBase frozen(imported, Device::CPU, DType::F32);
  frozen.dequantize_into(back);
  const Nf4Base reference = quantize_base_nf4(imported);
  int64_t experts = 0;
  for (size_t k = 0; k < imported.specs().size(); ++k) {
    const ParamSpec& spec = imported.specs()[k];
    if (!is_quantized_base_weight(spec)) {
      EXPECT_TRUE(bitwise_equal(back.tensors()[k], imported.tensors()[k])) << spec.name;
      continue;
    }
    Tensor expected = Tensor::empty(nf4_matrix_shape(spec));
    nf4_dequantize(expected, reference.weights[k]);
    EXPECT_TRUE(bitwise_equal(back.tensors()[k].view(nf4_matrix_shape(spec)), expected)) << spec.name;
    if (!is_quantized_expert_stack(spec)) continue;
    // One NF4 tensor per expert matrix, as bitsandbytes quantizes each expert's Linear4bit.
    ++experts;
    ASSERT_EQ(reference.weights[k].parts.size(), spec.hf_tensors.size()) << spec.name;
    const Tensor matrix = imported.tensors()[k].view(nf4_matrix_shape(spec));
    for (size_t p = 0, row = 0; p < spec.hf_tensors.size(); row += static_cast<size_t>(spec.hf_tensors[p].rows), ++p) {
      const Nf4Tensor alone = nf4_quantize(matrix.narrow(static_cast<int64_t>(row),
                                                         static_cast<int64_t>(row) + spec.hf_tensors[p].rows));
      EXPECT_TRUE(bitwise_equal(reference.weights[k].parts[p].codes, alone.codes)) << spec.hf_tensors[p].name;
    }
  }
  EXPECT_EQ(experts, c.moe() ? 2 * c.num_layers : 0);
  const Nf4FrozenBase again(imported, Device::CPU, DType::F32);
  const std::vector<Tensor> first = code_copies(frozen.codes()), second = code_copies(again.codes());
  ASSERT_EQ(first.size(), second.size());
  for (size_t k = 0; k < first.size(); ++k) EXPECT_TRUE(bitwise_equal(first[k], second[k]));

  double projections = 0;
  for (const ParamSpec& spec : imported.specs())
    if (is_quantized_base_weight(spec)) projections += static_cast<double>(shape_numel(spec.shape));
  const double rest = static_cast<double>(c.total_params()) - projections;
  EXPECT_EQ(static_cast<double>(frozen.nbytes()),
            nf4_base_bytes(c) + rest * 4 + nf4_scratch_bytes(c, DType::F32));

  // Filled one parameter at a time (the Hugging Face import's way): every one, once, in fp32.
  Nf4FrozenBase partial(c, Device::CPU, DType::F32);
  for (size_t k = 1; k < imported.specs().size(); ++k) partial.set(k, imported.tensors()[k]);
  expect_error([&] { partial.finish(); }, {"embedding.weight was never set"});
  expect_error([&] { partial.set(0, imported.tensors()[1]); }, {"embedding.weight expects fp32 host values of shape"});
}

// NOTE [NF4 stored row order]: an MLA model's query and kv_a projections are quantized in
// their Hugging Face row order (their codes are those of the published tensors: the rows
// that order lists, quantized as they stand) and dequantize back into forge's order.
TEST(ModelQlora, RotaryRowsAreQuantizedInThePublishedOrder) {
  const ModelConfig c = tiny_mla();
  FlatParameters imported(c), back(c);
  imported.initialize(5);
  auto stored_rows = [&](size_t k) { return hf_stored_rows(imported.specs()[k], true); };
  const Nf4FrozenBase frozen(imported, Device::CPU, DType::F32, stored_rows);
  frozen.dequantize_into(back);
  int reordered = 0;
  for (size_t k = 0; k < imported.specs().size(); ++k) {
    const ParamSpec& spec = imported.specs()[k];
    const std::vector<int64_t> rows = stored_rows(k);
    if (!is_quantized_base_weight(spec)) continue;
    const Shape matrix = nf4_matrix_shape(spec);
    const Tensor values = imported.tensors()[k].view(matrix);
    Tensor published = values.clone();
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t i = 0; i < matrix[1]; ++i)
        published.data<float>()[static_cast<int64_t>(r) * matrix[1] + i] = values.data<float>()[rows[r] * matrix[1] + i];
    if (!rows.empty()) ++reordered;
    const Nf4Weight& w = frozen.codes().weights[k];
    EXPECT_EQ(w.row_order.defined(), !rows.empty()) << spec.name;
    for (size_t p = 0, row = 0; p < w.parts.size(); row += static_cast<size_t>(w.parts[p].shape[0]), ++p) {
      const Nf4Tensor alone = nf4_quantize(published.narrow(static_cast<int64_t>(row),
                                                            static_cast<int64_t>(row) + w.parts[p].shape[0]));
      EXPECT_TRUE(bitwise_equal(w.parts[p].codes, alone.codes)) << spec.name << " part " << p;
      EXPECT_TRUE(bitwise_equal(w.parts[p].absmax_codes, alone.absmax_codes)) << spec.name << " part " << p;
    }
    // Dequantized back in forge's row order: row f is the published row holding it.
    Tensor expected = Tensor::empty(matrix), dequantized_published = Tensor::empty(matrix);
    Nf4Weight plain;
    plain.parts = w.parts;
    nf4_dequantize(dequantized_published, plain);
    for (size_t r = 0; r < (rows.empty() ? static_cast<size_t>(matrix[0]) : rows.size()); ++r)
      for (int64_t i = 0; i < matrix[1]; ++i)
        expected.data<float>()[(rows.empty() ? static_cast<int64_t>(r) : rows[r]) * matrix[1] + i] =
            dequantized_published.data<float>()[static_cast<int64_t>(r) * matrix[1] + i];
    EXPECT_TRUE(bitwise_equal(back.tensors()[k].view(matrix), expected)) << spec.name;
  }
  EXPECT_EQ(reordered, 2 * c.num_layers);  // q_b and kv_a of every block
}

// A QLoRA run without a Hugging Face import quantizes the seeded initialization one
// parameter at a time: the same codes and rest as quantizing the whole initialized model.
TEST(ModelQlora, SeededInitializationEqualsQuantizingTheInitializedModel) {
  const ModelConfig c = tiny();
  FlatParameters whole(c), back(c), expected(c);
  whole.initialize(7);
  const Nf4FrozenBase reference(whole, Device::CPU, DType::F32);
  Nf4FrozenBase streamed(c, Device::CPU, DType::F32);
  streamed.initialize(7);
  const std::vector<Tensor> a = code_copies(reference.codes()), b = code_copies(streamed.codes());
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(bitwise_equal(a[k], b[k]));
  reference.dequantize_into(expected);
  streamed.dequantize_into(back);
  EXPECT_TRUE(bitwise_equal(back.flat(), expected.flat()));
}

// NOTE [NF4 expert stacks under expert parallelism]: rank i of P holds its experts' codes
// alone, bitwise the one-rank base's (each expert matrix is an NF4 tensor of its own), from an
// import or the seeded initialization alike; dequantize_into writes its experts' places (the
// P ranks' together: the one-rank base's values); the memory estimate is what it allocates.
TEST(ModelQlora, ExpertParallelRankHoldsItsExpertsCodes) {
  const ModelConfig c = tiny_moe();
  FlatParameters imported(c), reference(c);
  imported.initialize(4);
  const Nf4FrozenBase whole(imported, Device::CPU, DType::F32);
  whole.dequantize_into(reference);
  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.lora = qlora_for(c);
  const double one_rank = estimate_memory(c, plan).nf4_base;
  for (const int64_t p : {2, 4}) {
    FlatParameters gathered(c);
    for (int64_t i = 0; i < p; ++i) {
      SCOPED_TRACE("rank " + std::to_string(i) + " of " + std::to_string(p));
      const Nf4FrozenBase mine(imported, Device::CPU, DType::F32, {}, {i, p});
      Nf4FrozenBase seeded(c, Device::CPU, DType::F32, {}, {i, p});
      seeded.initialize(4);
      int64_t stacks = 0;
      for (size_t k = 0; k < mine.specs().size(); ++k) {
        const ParamSpec& spec = mine.specs()[k];
        if (!is_quantized_base_weight(spec)) continue;
        const std::vector<Nf4Tensor>& parts = mine.codes().weights[k].parts;
        size_t first = 0;  // the whole stack's part of the rank's first expert's first matrix
        if (spec.expert_stack) {
          ++stacks;
          EXPECT_EQ(spec.shape[0], c.num_experts / p) << spec.name;
          first = static_cast<size_t>(i) * parts.size();
        }
        const std::vector<Nf4Tensor>& expected = whole.codes().weights[k].parts;
        ASSERT_LE(first + parts.size(), expected.size()) << spec.name;
        for (size_t q = 0; q < parts.size(); ++q) {
          EXPECT_TRUE(bitwise_equal(parts[q].codes, expected[first + q].codes)) << spec.name << " part " << q;
          EXPECT_TRUE(bitwise_equal(parts[q].absmax_codes, expected[first + q].absmax_codes)) << spec.name;
          EXPECT_TRUE(bitwise_equal(seeded.codes().weights[k].parts[q].codes, parts[q].codes)) << spec.name;
        }
      }
      EXPECT_EQ(stacks, 2 * c.num_layers);
      mine.dequantize_into(gathered);
      MemoryPlan ranks = plan;
      ranks.fsdp = true;
      ranks.shard_ranks = ranks.expert_parallel = p;
      const MemoryEstimate e = estimate_memory(c, ranks);
      EXPECT_EQ(e.frozen_weights + e.nf4_base, static_cast<double>(mine.nbytes()));
      EXPECT_LT(e.nf4_base, one_rank);
    }
    EXPECT_TRUE(bitwise_equal(gathered.flat(), reference.flat())) << p << " ranks";
  }
  expect_error([&] { Nf4FrozenBase(c, Device::CPU, DType::F32, {}, {0, 3}); },
               {"expert parallelism over 3 ranks splits 'layers.0.moe.experts.gate_up'"});
}

// NOTE [QLoRA under pipeline and expert parallelism]: pipeline rank s of 2 with expert rank i
// of P holds its stage's parameters, each stack's local experts alone, bitwise the one-rank
// codes; each rank's pieces of the merged export (every parameter dequantized and merged one at
// a time, a stack's slice with its experts' adapters, written at its experts' place), put
// together, are bitwise the one-rank merged model; the memory estimate is a rank's allocation.
TEST(ModelQlora, PipelineExpertParallelRanksWriteTheMergedModelInPieces) {
  const ModelConfig c = tiny_moe();
  const Nf4FrozenBase whole(c, Device::CPU, DType::F32);
  const_cast<Nf4FrozenBase&>(whole).initialize(4);
  auto adapters = std::make_unique<LoraAdapters>(c, qlora_for(c), Device::CPU, 2 * 16);
  adapters->initialize(2);
  testing::set_nonzero_lora_b(*adapters);
  FlatParameters expected(c);
  whole.dequantize_into(expected);
  adapters->merge_into(expected);
  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.lora = qlora_for(c);
  plan.pipeline_parallel = 2;
  const double pipeline_only = estimate_memory(c, plan).nf4_base;
  for (const int64_t p : {2, 4}) {
    FlatParameters pieces(c);
    std::vector<char> written(static_cast<size_t>(pieces.flat().numel()), 0);
    std::vector<double> held;
    for (int s = 0; s < 2; ++s)
      for (int64_t i = 0; i < p; ++i) {
        SCOPED_TRACE(fmt::format("pipeline rank {} of 2, expert rank {} of {}", s, i, p));
        Nf4FrozenBase mine(c, Device::CPU, DType::F32, {pipeline_stage(c, 2, 1, s, 0)}, {i, p});
        mine.initialize(4);
        held.push_back(static_cast<double>(mine.nbytes()));
        for (size_t k = 0; k < mine.specs().size(); ++k) {
          const ParamSpec& spec = mine.specs()[k];
          EXPECT_TRUE(spec.layer < 0 || spec.layer == s) << spec.name;
          if (spec.expert_stack) EXPECT_EQ(spec.shape[0], c.num_experts / p) << spec.name;
          // The export's writers: the stage's rank 0 everything, the others their experts.
          if (i != 0 && !spec.expert_stack) continue;
          Tensor values = Tensor::empty(spec.shape);
          mine.dequantize(k, values);
          adapters->merge_into(spec.name, values, spec.expert_stack ? ExpertShard{i, p} : ExpertShard{});
          const Tensor& into = pieces.find(spec.name);
          const int64_t begin = spec.expert_stack ? i * values.numel() : 0;
          into.view({into.numel()}).narrow(begin, begin + values.numel()).copy_from(values.view({values.numel()}));
          const int64_t at = into.data<float>() - pieces.flat().data<float>() + begin;
          for (int64_t e = 0; e < values.numel(); ++e) ++written[static_cast<size_t>(at + e)];
        }
      }
    EXPECT_TRUE(std::all_of(written.begin(), written.end(), [](char n) { return n == 1; })) << "each value once";
    EXPECT_TRUE(bitwise_equal(pieces.flat(), expected.flat())) << p << " expert ranks";
    MemoryPlan ranks = plan;
    ranks.fsdp = true;
    ranks.shard_ranks = ranks.expert_parallel = p;
    const MemoryEstimate e = estimate_memory(c, ranks);
    EXPECT_NE(std::find(held.begin(), held.end(), e.frozen_weights + e.nf4_base), held.end())
        << "the estimate " << e.frozen_weights + e.nf4_base << " is no rank's allocation";
    EXPECT_LT(e.nf4_base, pipeline_only);
  }
  // A stack's merge takes the experts the slice holds.
  Tensor slice = Tensor::zeros({c.num_experts / 2, 2 * c.moe_ffn_hidden_size, c.hidden_size});
  expect_error([&] { adapters->merge_into("layers.0.moe.experts.gate_up", slice, {0, 3}); },
               {"expert shard 0 of 3 does not split its 4 experts"});
}

TEST(ModelQlora, MemoryEstimateCountsNf4ProjectionsAndScratch) {
  const ModelConfig c = tiny();
  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.cuda = true;
  LoraConfig l = qlora();
  l.quantize_base = "none";
  plan.lora = l;
  const MemoryEstimate lora = estimate_memory(c, plan);
  plan.lora.quantize_base = "nf4";
  const MemoryEstimate q = estimate_memory(c, plan);
  double projections = 0;
  for (const ParamSpec& spec : parameter_specs(c))
    if (is_quantized_base_weight(spec)) projections += static_cast<double>(shape_numel(spec.shape));
  EXPECT_EQ(q.frozen_weights, (static_cast<double>(c.total_params()) - projections) * 2);
  EXPECT_EQ(q.nf4_base, nf4_base_bytes(c) + nf4_scratch_bytes(c, DType::BF16));
  EXPECT_EQ(q.total(), lora.total() - projections * 2 + q.nf4_base);  // adapters, activations: as LoRA
  EXPECT_NE(describe(q).find("frozen NF4 projections with their scratch"), std::string::npos);

  // On the CPU the estimate is what Nf4FrozenBase allocates.
  plan.cuda = false;
  const MemoryEstimate cpu = estimate_memory(c, plan);
  FlatParameters imported(c);
  imported.initialize(1);
  EXPECT_EQ(cpu.frozen_weights + cpu.nf4_base,
            static_cast<double>(Nf4FrozenBase(imported, Device::CPU, DType::F32).nbytes()));
}

}  // namespace
}  // namespace forge
