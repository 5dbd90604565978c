// Runs forge's MoE feed-forward ops (ops/moe.h, composed as tests/cpu/moe_testing.h) on
// inputs written by tests/python/test_moe_vs_transformers.py and writes what it computes,
// for comparison with transformers' MixtralSparseMoeBlock and load_balancing_loss_func:
//   forge_moe_reference DIR
// DIR/shape holds "tokens hidden ffn experts k normalize aux_coefficient", then for
// DeepSeek-V3's sigmoid routing "groups topk_groups scaling" (and DIR/bias, fp32 [experts]);
// DIR/x, router,
// gate_up, down and dout are raw little-endian fp32 ([tokens, hidden], [experts, hidden],
// [experts, 2 ffn, hidden], [experts, hidden, ffn], [tokens, hidden]). Writes DIR/out, dx,
// d_router, d_gate_up, d_down (fp32; the gradients of sum(out * dout) + aux_coefficient x
// the balancing loss) and DIR/aux (the balancing loss, text). Exits 1 with the error on stderr.
#include <cstdio>
#include <fstream>
#include <string>

#include "../cpu/moe_testing.h"
#include "core/error.h"

namespace {

forge::Tensor read(const std::string& path, forge::Shape shape) {
  forge::Tensor t = forge::Tensor::empty(std::move(shape));
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(in && in.peek() == EOF, "{}: expected exactly {} bytes of fp32", path, t.nbytes());
  return t;
}

void write(const std::string& path, const forge::Tensor& t) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(out.good(), "cannot write {}", path);
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
    const bool sigmoid = static_cast<bool>(shape >> groups >> topk_groups >> scaling);
    forge::testing::MoeLayer m{hidden,
                               ffn,
                               experts,
                               k,
                               normalize != 0,
                               read(dir + "/router", {experts, hidden}),
                               read(dir + "/gate_up", {experts, 2 * ffn, hidden}),
                               read(dir + "/down", {experts, hidden, ffn}),
                               aux};
    if (sigmoid) {
      m.sigmoid = true;
      m.bias = read(dir + "/bias", {experts});
      m.groups = groups;
      m.topk_groups = topk_groups;
      m.scaling = scaling;
    }
    const forge::Tensor x = read(dir + "/x", {tokens, hidden}), dout = read(dir + "/dout", {tokens, hidden});
    forge::testing::MoeActivations a;
    write(dir + "/out", forge::testing::moe_forward(m, x, a));
    const forge::testing::MoeGrads g = forge::testing::moe_backward(m, x, a, dout);
    write(dir + "/dx", g.dx);
    write(dir + "/d_router", g.router);
    write(dir + "/d_gate_up", g.gate_up);
    write(dir + "/d_down", g.down);
    if (!sigmoid) std::ofstream(dir + "/aux") << fmt::format("{:.9g}\n", forge::moe_balancing_loss({&a.routing}).loss);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forge_moe_reference: %s\n", e.what());
    return 1;
  }
}
