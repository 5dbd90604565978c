// Runs forge's MoE feed-forward ops (ops/moe.h, composed as tests/cpu/moe_testing.h) on
// inputs written by tests/python/test_moe_vs_transformers.py and test_moe_vs_megatron.py and
// writes what it computes, for comparison with transformers' MixtralSparseMoeBlock and
// load_balancing_loss_func, and with Megatron-Core's balancing losses and z-loss:
//   forge_moe_reference DIR
// DIR/shape holds "tokens hidden ffn experts k normalize aux_coefficient", then for
// DeepSeek-V3's sigmoid routing "groups topk_groups scaling" (and DIR/bias, fp32 [experts]),
// or for DeepSeek-V2's group-limited, scaled softmax routing "groups topk_groups scaling
// softmax";
// DIR/x, router, gate_up, down and dout are raw little-endian fp32 ([tokens, hidden],
// [experts, hidden], [experts, 2 ffn, hidden], [experts, hidden, ffn], [tokens, hidden]).
// With DIR/losses ("layers aux_type z_coefficient sequences"; aux_type pooled, per_layer or
// sequence) the block is `layers` such layers applied in turn (router, gate_up and down hold
// the layers' weights one after the other), each with that balancing loss (pooled: over its
// own tokens) and the z-loss, and the tokens are `sequences` sequences of equal length, one
// after the other. Writes DIR/out, dx, d_router, d_gate_up, d_down (fp32, every layer's;
// the gradients of sum(out * dout) + the losses times their coefficients), DIR/aux (the
// balancing losses summed over layers, without the coefficient, text) and DIR/z (the
// z-losses, mean logsumexp^2, summed, without the coefficient; with sigmoid routing too). With DIR/capacity ("factor
// policy pad": a capacity factor, probs or position, 0 or 1) every layer drops tokens (NOTE
// [MoE capacity]), and the tool also writes DIR/kept_probs and DIR/kept_map (fp32 [layers,
// tokens, experts]: each kept assignment's weight, and 1, at its token and expert; 0
// elsewhere). With aux_type global (Megatron's global_aux_loss, moe_switch_balancing_loss)
// and DIR/global ("ranks micro_batches steps"; without it 1 1 1) x and dout hold that many
// inputs of [tokens, hidden], step by step, micro-batch by micro-batch, rank by rank: each
// micro-batch's tokens per expert are summed over the simulated ranks and averaged over the
// step's micro-batches so far (MoeStepCounts, reset at each step), each rank's losses take
// them over tokens x ranks tokens, and every output holds one entry per input in that order
// (aux and z a line each). Exits 1 with the error on stderr.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../cpu/moe_testing.h"
#include "core/error.h"

namespace {

forge::Tensor read(const std::string& path, forge::Shape shape, int64_t part = 0, int64_t parts = 1) {
  forge::Tensor t = forge::Tensor::empty(std::move(shape));
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(part * t.nbytes()));
  in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(in, "{}: expected {} x {} bytes of fp32", path, parts, t.nbytes());
  if (part == parts - 1) FORGE_CHECK(in.peek() == EOF, "{}: expected exactly {} x {} bytes of fp32", path, parts,
                                     t.nbytes());
  return t;
}

void write(std::ofstream& out, const forge::Tensor& t) {
  out.write(static_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(out.good(), "cannot write");
}

void write(const std::string& path, const forge::Tensor& t) {
  std::ofstream out(path, std::ios::binary);
  write(out, t);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    FORGE_CHECK(argc == 2, "usage: forge_moe_reference DIR");
    const std::string dir = argv[1];
    std::ifstream shape(dir + "/shape");
    int64_t tokens = 0, hidden = 0, ffn = 0, experts = 0, k = 0, normalize = 1;
    float aux = 0.0f;
    shape >> tokens >> hidden >> ffn >> experts >> k >> normalize >> aux;
    FORGE_CHECK(shape && tokens > 0 && hidden > 0 && ffn > 0 && experts > 0 && k > 0,
                "{}/shape: expected 'tokens hidden ffn experts k normalize aux'", dir);
    int64_t groups = 0, topk_groups = 0;
    float scaling = 1.0f;
    const bool grouped = static_cast<bool>(shape >> groups >> topk_groups >> scaling);
    std::string score_function = "sigmoid";
    if (grouped) shape >> score_function;
    const bool sigmoid = grouped && score_function != "softmax";
    int64_t layers = 1, sequences = 1;
    std::string aux_type = "pooled";
    float z = 0.0f;
    if (std::ifstream losses(dir + "/losses"); losses) {
      losses >> layers >> aux_type >> z >> sequences;
      FORGE_CHECK(losses && layers >= 1 && sequences >= 1, "{}/losses: expected 'layers aux_type z sequences'", dir);
    }
    forge::MoeCapacity capacity;
    if (std::ifstream in(dir + "/capacity"); in) {
      std::string policy;
      int pad = 0;
      in >> capacity.factor >> policy >> pad;
      FORGE_CHECK(in && capacity.factor > 0 && (policy == "probs" || policy == "position"),
                  "{}/capacity: expected 'factor probs|position pad'", dir);
      capacity.by_position = policy == "position";
      capacity.pad = pad != 0;
    }
    std::vector<forge::testing::MoeLayer> block;
    for (int64_t l = 0; l < layers; ++l) {
      forge::testing::MoeLayer m{hidden,
                                 ffn,
                                 experts,
                                 k,
                                 normalize != 0,
                                 read(dir + "/router", {experts, hidden}, l, layers),
                                 read(dir + "/gate_up", {experts, 2 * ffn, hidden}, l, layers),
                                 read(dir + "/down", {experts, hidden, ffn}, l, layers),
                                 aux};
      m.aux_type = aux_type;
      m.sequences = sequences;
      m.z = z;
      m.capacity = capacity;
      if (grouped) {
        m.sigmoid = sigmoid;
        if (sigmoid) m.bias = read(dir + "/bias", {experts});
        m.groups = groups;
        m.topk_groups = topk_groups;
        m.scaling = scaling;
      }
      block.push_back(std::move(m));
    }
    // Megatron's global form over simulated data-parallel ranks, micro-batches and steps.
    int64_t ranks = 1, micro_batches = 1, steps = 1;
    if (std::ifstream in(dir + "/global"); in) {
      in >> ranks >> micro_batches >> steps;
      FORGE_CHECK(in && ranks >= 1 && micro_batches >= 1 && steps >= 1 && aux_type == "global",
                  "{}/global: expected 'ranks micro_batches steps' with the global balancing loss", dir);
    }
    const int64_t passes = steps * micro_batches * ranks;
    std::ofstream out(dir + "/out", std::ios::binary), dx(dir + "/dx", std::ios::binary);
    std::ofstream router(dir + "/d_router", std::ios::binary), gate_up(dir + "/d_gate_up", std::ios::binary),
        down(dir + "/d_down", std::ios::binary);
    std::ofstream kept_probs, kept_map, aux_out, z_out(dir + "/z");
    if (capacity.factor > 0) {
      kept_probs.open(dir + "/kept_probs", std::ios::binary);
      kept_map.open(dir + "/kept_map", std::ios::binary);
    }
    if (!sigmoid) aux_out.open(dir + "/aux");
    forge::MoeStepCounts step_counts;  // every layer's, [layers x experts], as MoeFeedForward keeps them
    for (int64_t step = 0; step < steps; ++step) {
      step_counts.reset();
      for (int64_t micro = 0; micro < micro_batches; ++micro) {
        // Every rank's forward, then the tokens per expert summed over the ranks, then each
        // rank's losses and backward.
        std::vector<std::vector<forge::Tensor>> inputs(static_cast<size_t>(ranks));
        std::vector<std::vector<forge::testing::MoeActivations>> acts(
            static_cast<size_t>(ranks), std::vector<forge::testing::MoeActivations>(static_cast<size_t>(layers)));
        std::vector<int64_t> counts(static_cast<size_t>(layers * experts), 0);
        for (int64_t r = 0; r < ranks; ++r) {
          const int64_t pass = (step * micro_batches + micro) * ranks + r;
          auto& in = inputs[static_cast<size_t>(r)];
          in.push_back(read(dir + "/x", {tokens, hidden}, pass, passes));
          for (size_t l = 0; l < block.size(); ++l) {
            auto& a = acts[static_cast<size_t>(r)][l];
            in.push_back(forge::testing::moe_forward(block[l], in[l], a));
            const std::vector<int64_t> c = forge::moe_expert_counts(a.routing).assigned;
            for (int64_t e = 0; e < experts; ++e)
              counts[l * static_cast<size_t>(experts) + static_cast<size_t>(e)] += c[static_cast<size_t>(e)];
          }
        }
        if (aux_type == "global") {
          const std::vector<double> average = step_counts.add(counts);
          for (size_t l = 0; l < block.size(); ++l) {
            const auto first = average.begin() + static_cast<std::ptrdiff_t>(l * static_cast<size_t>(experts));
            block[l].tokens_per_expert.assign(first, first + experts);
            block[l].total_tokens = static_cast<double>(tokens * ranks);
          }
        }
        for (int64_t r = 0; r < ranks; ++r) {
          const int64_t pass = (step * micro_batches + micro) * ranks + r;
          const auto& in = inputs[static_cast<size_t>(r)];
          const auto& rank_acts = acts[static_cast<size_t>(r)];
          double aux_loss = 0.0, z_loss = 0.0;
          for (size_t l = 0; l < block.size(); ++l) {
            if (!sigmoid) aux_loss += forge::testing::moe_layer_balance(block[l], rank_acts[l]).loss;
            z_loss += forge::moe_z_loss(rank_acts[l].routing);  // every routing keeps the logits' logsumexp on the CPU
          }
          write(out, in.back());
          if (capacity.factor > 0) {
            for (const auto& a : rank_acts) {
              forge::Tensor probs = forge::Tensor::zeros({tokens, experts});
              forge::Tensor map = forge::Tensor::zeros({tokens, experts});
              const forge::MoeRouting& routing = a.routing;
              for (int64_t i = 0; i < tokens * k; ++i) {
                if (routing.row_of.data<int32_t>()[i] < 0) continue;
                const int64_t at = i / k * experts + routing.expert_ids.data<int32_t>()[i];
                probs.data<float>()[at] = routing.weights.data<float>()[i];
                map.data<float>()[at] = 1.0f;
              }
              write(kept_probs, probs);
              write(kept_map, map);
            }
          }
          forge::Tensor d = read(dir + "/dout", {tokens, hidden}, pass, passes);
          std::vector<forge::testing::MoeGrads> grads(block.size());
          for (size_t l = block.size(); l-- > 0;) {
            grads[l] = forge::testing::moe_backward(block[l], in[l], rank_acts[l], d);
            d = grads[l].dx;
          }
          write(dx, d);
          for (const auto& g : grads) {
            write(router, g.router);
            write(gate_up, g.gate_up);
            write(down, g.down);
          }
          if (!sigmoid) aux_out << fmt::format("{:.9g}\n", aux_loss);
          z_out << fmt::format("{:.9g}\n", z_loss);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forge_moe_reference: %s\n", e.what());
    return 1;
  }
}
