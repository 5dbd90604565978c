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
// elsewhere). Exits 1 with the error on stderr.
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
    std::vector<forge::Tensor> inputs{read(dir + "/x", {tokens, hidden})};
    std::vector<forge::testing::MoeActivations> acts(static_cast<size_t>(layers));
    double aux_loss = 0.0, z_loss = 0.0;
    for (size_t l = 0; l < block.size(); ++l) {
      inputs.push_back(forge::testing::moe_forward(block[l], inputs[l], acts[l]));
      if (!sigmoid) aux_loss += forge::testing::moe_layer_balance(block[l], acts[l]).loss;
      z_loss += forge::moe_z_loss(acts[l].routing);  // every routing keeps the logits' logsumexp on the CPU
    }
    write(dir + "/out", inputs.back());
    if (capacity.factor > 0) {
      std::ofstream kept_probs(dir + "/kept_probs", std::ios::binary), kept_map(dir + "/kept_map", std::ios::binary);
      for (const auto& a : acts) {
        forge::Tensor probs = forge::Tensor::zeros({tokens, experts}), map = forge::Tensor::zeros({tokens, experts});
        const forge::MoeRouting& r = a.routing;
        for (int64_t i = 0; i < tokens * k; ++i) {
          if (r.row_of.data<int32_t>()[i] < 0) continue;
          const int64_t at = i / k * experts + r.expert_ids.data<int32_t>()[i];
          probs.data<float>()[at] = r.weights.data<float>()[i];
          map.data<float>()[at] = 1.0f;
        }
        write(kept_probs, probs);
        write(kept_map, map);
      }
    }
    forge::Tensor d = read(dir + "/dout", {tokens, hidden});
    std::vector<forge::testing::MoeGrads> grads(block.size());
    for (size_t l = block.size(); l-- > 0;) {
      grads[l] = forge::testing::moe_backward(block[l], inputs[l], acts[l], d);
      d = grads[l].dx;
    }
    write(dir + "/dx", d);
    std::ofstream router(dir + "/d_router", std::ios::binary), gate_up(dir + "/d_gate_up", std::ios::binary),
        down(dir + "/d_down", std::ios::binary);
    for (const auto& g : grads) {
      write(router, g.router);
      write(gate_up, g.gate_up);
      write(down, g.down);
    }
    if (!sigmoid) std::ofstream(dir + "/aux") << fmt::format("{:.9g}\n", aux_loss);
    std::ofstream(dir + "/z") << fmt::format("{:.9g}\n", z_loss);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forge_moe_reference: %s\n", e.what());
    return 1;
  }
}
