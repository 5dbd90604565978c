// The FLUX transformer's forward and backward; see flux_transformer.h and NOTE [FLUX
// architecture] in flux_config.h.
//
// Shapes: B samples, S image tokens, L text tokens, T = L + S joint tokens, D = hidden,
// M = MLP hidden, H heads of hd. Streams are kept [B, tokens, D] (2-D views [B tokens, D]
// for the linear ops); the joint attention's qkv is [B, T, 3H, hd], text first, each
// stream's rows written by qk_norm_rope at its offset (0 for text, L for image). A
// modulation projection's output [B, k D] is split into k contiguous [B, D] vectors
// (shift, scale, gate, ...) by column copies, and their gradients gathered back the same
// way: these are a few kilobytes per block.
#include "model/flux_transformer.h"

#include <cmath>
#include <memory>

#include "model/flux_embeddings.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/gated_residual.h"
#include "ops/linear.h"
#include "ops/modulated_layer_norm.h"
#include "ops/qk_norm_rope.h"
#include "ops/silu.h"

namespace forge {

namespace fu = flux_unit;

// One stream of a double block: its modulation (shift, scale, gate for attention, then for
// the MLP), the norm and projection outputs the backward reads, and the residual stream
// after attention (mid).
struct FluxStreamActivations {
  Tensor mod, chunk[6];
  Tensor mean1, rstd1, n1, qkv, rstd_qk, attn, o, mid, mean2, rstd2, n2, h, a, f;
};
struct FluxDoubleActivations {
  FluxStreamActivations stream[2];  // image, text
  Tensor jqkv, out, lse;
};
struct FluxSingleActivations {
  Tensor mod, chunk[3];  // shift, scale, gate
  Tensor mean, rstd, n, qkv, rstd_qk, jqkv, out, lse, h, a, y;  // out and a: the output projection's two
                                                                 // inputs (NOTE [Linear over concatenated inputs])
};

struct FluxTransformer::Activations {
  // Embedders: time / guidance / pooled-text MLPs (features, hidden, activated), the
  // conditioning vector and its SiLU, which every modulation reads.
  Tensor time_features, guidance_features, time_h, time_a, guidance_h, guidance_a, pooled_h, pooled_a, temb, stemb;
  // Block inputs: image_in[i], text_in[i] of double block i ([nd] the last one's outputs),
  // joint_in[j] of single block j ([ns] the last one's output).
  std::vector<Tensor> image_in, text_in, joint_in;
  std::vector<FluxDoubleActivations> doubles;
  std::vector<FluxSingleActivations> singles;
  // Head: its modulation (scale, shift), the image stream it reads, norm statistics and output.
  Tensor head_mod, head_chunk[2], image_out, head_mean, head_rstd, head_n;
  Tensor cos, sin;  // rotary tables [T, hd/2] fp32
  // Backward scratch (d_chunk: the modulation vectors' gradients, 6 per stream).
  Tensor d_image, d_text, d_joint, d_chunk[12], d_mod, d_stemb, d_stemb_part, d_temb, d_embed_a, d_embed_h;
  Tensor d_n, d_n2, d_qkv, d_jqkv, d_attn_joint, d_stream_attn, d_small, d_big, d_big2;
};

namespace {

constexpr int kImage = 0;  // stream 0 of a double block; stream 1 is the text

Tensor rows(const Tensor& t, int64_t cols) { return t.view({t.numel() / cols, cols}); }

struct Dims {
  int64_t b, s, l, t, d, m, h, hd, c;
  Dims(const FluxConfig& cf, const FluxShape& sh)
      : b(sh.batch), s(sh.image_tokens()), l(sh.text_tokens), t(sh.tokens()), d(cf.hidden()), m(cf.mlp_hidden()),
        h(cf.num_heads), hd(cf.head_dim), c(cf.resolved_out_channels()) {}
  int64_t stream_tokens(int stream) const { return stream == kImage ? s : l; }
  int64_t stream_offset(int stream) const { return stream == kImage ? l : 0; }
};

// Lays out every activation in `a` (ArenaLayout's counting pass when its base is null).
// NOTE [Recomputing some FLUX blocks]: of `recompute` blocks (-1: all) in forward order, how
// many are double blocks and how many single blocks.
std::pair<int, int> recomputed_blocks(const FluxConfig& cf, int64_t recompute) {
  const int64_t blocks = cf.num_double_blocks + cf.num_single_blocks;
  FORGE_CHECK(recompute >= -1 && recompute <= blocks,
              "{}: activation_checkpoint.recompute_blocks {}: -1 (every block) or 0 to the model's {} blocks", cf.name,
              recompute, blocks);
  const int64_t all = cf.num_double_blocks + cf.num_single_blocks;
  const int64_t r = recompute < 0 ? all : std::min(recompute, all);
  const int64_t doubles = std::min(r, cf.num_double_blocks);
  return {static_cast<int>(doubles), static_cast<int>(r - doubles)};
}

void lay_out(FluxTransformer::Activations& acts, ArenaLayout& a, const FluxConfig& cf, const FluxShape& sh,
             DType dt, ActivationCheckpoint mode, int64_t recompute) {
  const Dims n(cf, sh);
  const auto [recomputed_doubles, recomputed_singles] = recomputed_blocks(cf, recompute);
  const DType f32 = DType::F32;
  acts.time_features = a.take({n.b, cf.timestep_dim}, dt);
  acts.guidance_features = a.take({n.b, cf.timestep_dim}, dt);
  for (Tensor* t : {&acts.time_h, &acts.time_a, &acts.guidance_h, &acts.guidance_a, &acts.pooled_h, &acts.pooled_a,
                    &acts.temb, &acts.stemb})
    *t = a.take({n.b, n.d}, dt);
  for (int64_t i = 0; i <= cf.num_double_blocks; ++i) {
    acts.image_in.push_back(a.take({n.b * n.s, n.d}, dt));
    acts.text_in.push_back(a.take({n.b * n.l, n.d}, dt));
  }
  for (int64_t j = 0; j <= cf.num_single_blocks; ++j) acts.joint_in.push_back(a.take({n.b * n.t, n.d}, dt));
  auto attention = [&](Tensor& jqkv, Tensor& out, Tensor& lse) {
    jqkv = a.take({n.b, n.t, 3 * n.h, n.hd}, dt);
    out = a.take({n.b, n.t, n.h, n.hd}, dt);
    lse = a.take({n.b, n.h, n.t}, f32);
  };
  acts.doubles = lay_out_layers<FluxDoubleActivations>(
      static_cast<int>(cf.num_double_blocks), mode,
      [&](FluxDoubleActivations& x) {
        for (int s = 0; s < 2; ++s) {
          FluxStreamActivations& st = x.stream[s];
          const int64_t rows_ = n.b * n.stream_tokens(s);
          st.mod = a.take({n.b, 6 * n.d}, dt);
          for (Tensor& c : st.chunk) c = a.take({n.b, n.d}, dt);
          st.mean1 = a.take({n.b, n.stream_tokens(s)}, f32);
          st.rstd1 = a.take({n.b, n.stream_tokens(s)}, f32);
          st.n1 = a.take({rows_, n.d}, dt);
          st.qkv = a.take({rows_, 3 * n.d}, dt);
          st.rstd_qk = a.take({rows_, 2 * n.h}, f32);
          st.attn = a.take({rows_, n.d}, dt);
          st.o = a.take({rows_, n.d}, dt);
          st.mid = a.take({rows_, n.d}, dt);
          st.mean2 = a.take({n.b, n.stream_tokens(s)}, f32);
          st.rstd2 = a.take({n.b, n.stream_tokens(s)}, f32);
          st.n2 = a.take({rows_, n.d}, dt);
          st.h = a.take({rows_, n.m}, dt);
          st.a = a.take({rows_, n.m}, dt);
          st.f = a.take({rows_, n.d}, dt);
        }
        attention(x.jqkv, x.out, x.lse);
      },
      [](FluxDoubleActivations&) {}, recomputed_doubles);
  acts.singles = lay_out_layers<FluxSingleActivations>(
      static_cast<int>(cf.num_single_blocks), mode,
      [&](FluxSingleActivations& x) {
        const int64_t rows_ = n.b * n.t;
        x.mod = a.take({n.b, 3 * n.d}, dt);
        for (Tensor& c : x.chunk) c = a.take({n.b, n.d}, dt);
        x.mean = a.take({n.b, n.t}, f32);
        x.rstd = a.take({n.b, n.t}, f32);
        x.n = a.take({rows_, n.d}, dt);
        x.qkv = a.take({rows_, 3 * n.d}, dt);
        x.rstd_qk = a.take({rows_, 2 * n.h}, f32);
        attention(x.jqkv, x.out, x.lse);
        x.h = a.take({rows_, n.m}, dt);
        x.a = a.take({rows_, n.m}, dt);
        x.y = a.take({rows_, n.d}, dt);
      },
      [](FluxSingleActivations&) {}, recomputed_singles);
  acts.head_mod = a.take({n.b, 2 * n.d}, dt);
  for (Tensor& c : acts.head_chunk) c = a.take({n.b, n.d}, dt);
  acts.image_out = a.take({n.b * n.s, n.d}, dt);
  acts.head_mean = a.take({n.b, n.s}, f32);
  acts.head_rstd = a.take({n.b, n.s}, f32);
  acts.head_n = a.take({n.b * n.s, n.d}, dt);
  acts.cos = a.take({n.t, n.hd / 2}, f32);
  acts.sin = a.take({n.t, n.hd / 2}, f32);
  // Backward scratch, shared by every block.
  acts.d_image = a.take({n.b * n.s, n.d}, dt);
  acts.d_text = a.take({n.b * n.l, n.d}, dt);
  acts.d_joint = a.take({n.b * n.t, n.d}, dt);
  for (Tensor& c : acts.d_chunk) c = a.take({n.b, n.d}, dt);
  acts.d_mod = a.take({n.b, 6 * n.d}, dt);
  for (Tensor* t : {&acts.d_stemb, &acts.d_stemb_part, &acts.d_temb, &acts.d_embed_a, &acts.d_embed_h})
    *t = a.take({n.b, n.d}, dt);
  acts.d_n = a.take({n.b * n.t, n.d}, dt);
  acts.d_n2 = a.take({n.b * n.t, n.d}, dt);
  acts.d_qkv = a.take({n.b * n.t, 3 * n.d}, dt);
  acts.d_jqkv = a.take({n.b, n.t, 3 * n.h, n.hd}, dt);
  acts.d_attn_joint = a.take({n.b, n.t, n.h, n.hd}, dt);
  acts.d_stream_attn = a.take({n.b * n.t, n.d}, dt);
  acts.d_small = a.take({n.b * n.t, n.d}, dt);
  acts.d_big = a.take({n.b * n.t, n.m}, dt);
  acts.d_big2 = a.take({n.b * n.t, n.m}, dt);
}

// The k vectors [B, D] of a modulation projection's output [B, k D], and back.
void split_chunks(const Tensor& mod, const Tensor* chunks, int k, int64_t d) {
  for (int i = 0; i < k; ++i) copy_columns(chunks[i], 0, mod, i * d, d);
}
void gather_chunks(const Tensor& mod, const Tensor* chunks, int k, int64_t d) {
  for (int i = 0; i < k; ++i) copy_columns(mod, i * d, chunks[i], 0, d);
}

// A modulation projection's backward: its output gradient [B, k D] gathered from the k
// vectors' gradients `d_chunks`, the weight's gradient, and its input gradient added to
// d(silu(temb)).
void modulation_backward(FluxTransformer::Activations& acts, const Tensor* d_chunks, const LinearWeight& w,
                         const LinearWeight& g, int k, int64_t d, bool overwrite) {
  const int64_t b = acts.d_mod.dim(0);
  const Tensor dmod = acts.d_mod.view({acts.d_mod.numel()}).narrow(0, b * k * d).view({b, k * d});
  gather_chunks(dmod, d_chunks, k, d);
  linear_backward(acts.d_stemb_part, g, dmod, acts.stemb, w, overwrite);
  accumulate(acts.d_stemb, acts.d_stemb_part);
}

AttentionShape joint_attention(const Dims& n) {
  AttentionShape shape;
  shape.num_q_heads = n.h;
  shape.num_kv_heads = n.h;
  shape.head_dim = n.hd;
  shape.causal = false;
  shape.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n.hd)));
  return shape;
}

}  // namespace

FluxTransformer::FluxTransformer(const FluxConfig& config, const FluxShape& shape, Device device,
                                 ActivationCheckpoint checkpoint, int64_t recompute_blocks)
    : config_(config), shape_(shape), device_(device), dtype_(device == Device::CUDA ? DType::BF16 : DType::F32),
      checkpoint_(checkpoint), recompute_blocks_(recompute_blocks), acts_(std::make_unique<Activations>()) {
  config_.validate(config_.name);
  FORGE_CHECK(shape_.batch > 0 && shape_.text_tokens > 0 && shape_.grid_h > 0 && shape_.grid_w > 0,
              "{}: a micro-batch needs samples, text tokens and a latent grid, got batch {}, {} text tokens, a {}x{} "
              "grid",
              config_.name, shape_.batch, shape_.text_tokens, shape_.grid_h, shape_.grid_w);
  FORGE_CHECK(checkpoint_ != ActivationCheckpoint::Selective,
              "{}: activation_checkpoint.mode selective is the language models'; a FLUX model takes none or full",
              config_.name);
  plan();
}

void FluxTransformer::plan() {
  const int64_t bytes = activation_bytes(config_, shape_, dtype_, checkpoint_, recompute_blocks_);
  if (!arena_.defined() || arena_.numel() < bytes) {
    arena_ = Tensor();  // the old arena goes before the new one is allocated
    arena_ = Tensor::empty({bytes}, DType::U8, device_);
  }
  *acts_ = Activations();
  ArenaLayout layout(arena_.raw(), device_);
  lay_out(*acts_, layout, config_, shape_, dtype_, checkpoint_, recompute_blocks_);
  Tensor cos, sin;
  flux_rope_tables(cos, sin, config_, shape_.text_tokens, shape_.grid_h, shape_.grid_w);
  acts_->cos.copy_from(cos);
  acts_->sin.copy_from(sin);
}

void FluxTransformer::reshape(const FluxShape& shape) {
  if (shape.batch == shape_.batch && shape.text_tokens == shape_.text_tokens && shape.grid_h == shape_.grid_h &&
      shape.grid_w == shape_.grid_w)
    return;
  FORGE_CHECK(shape.batch > 0 && shape.text_tokens > 0 && shape.grid_h > 0 && shape.grid_w > 0,
              "{}: a micro-batch needs samples, text tokens and a latent grid, got batch {}, {} text tokens, a {}x{} "
              "grid",
              config_.name, shape.batch, shape.text_tokens, shape.grid_h, shape.grid_w);
  shape_ = shape;
  inputs_ = FluxInputs();
  plan();
}

FluxTransformer::~FluxTransformer() = default;

int64_t FluxTransformer::activation_bytes(const FluxConfig& config, const FluxShape& shape, DType dtype,
                                          ActivationCheckpoint checkpoint, int64_t recompute_blocks) {
  FORGE_CHECK(recompute_blocks == -1 || checkpoint == ActivationCheckpoint::Full,
              "{}: activation_checkpoint.recompute_blocks {} picks the blocks full checkpointing recomputes; "
              "activation_checkpoint.mode is none",
              config.name, recompute_blocks);
  ArenaLayout counting(nullptr, Device::CPU);
  Activations sizes;
  lay_out(sizes, counting, config, shape, dtype, checkpoint, recompute_blocks);
  return counting.bytes();
}

namespace {

// Host features [B, dim] fp32 into a compute-dtype tensor on the model's device.
void upload(const Tensor& dst, const Tensor& host) {
  cast(dst, dst.device() == Device::CPU ? host : host.to(dst.device()));
}

// y = x W^T + b, then silu(y) into a: an embedder MLP's first layer.
void mlp_embedder_forward(const Tensor& h, const Tensor& a, const Tensor& x, const LinearWeight& w1) {
  linear_forward(h, x, w1);
  silu_forward(a, h);
}

class Blocks {
 public:
  // `overwrite`: the backward writes the parameters' gradients over their buffers instead
  // of adding to them (NOTE [Fresh gradient buffers] in model/parameters.h).
  Blocks(const FluxConfig& cf, const FluxShape& sh, FluxTransformer::Activations& acts, bool overwrite = false)
      : cf_(cf), n_(cf, sh), acts_(acts), attention_(joint_attention(n_)), overwrite_(overwrite) {}

  void double_forward(int i, FluxDoubleActivations& x, const FluxUnitWeights& w) {
    const Tensor* in[2] = {&acts_.image_in[static_cast<size_t>(i)], &acts_.text_in[static_cast<size_t>(i)]};
    const Tensor* next[2] = {&acts_.image_in[static_cast<size_t>(i) + 1], &acts_.text_in[static_cast<size_t>(i) + 1]};
    for (int s = 0; s < 2; ++s) {
      FluxStreamActivations& st = x.stream[s];
      const int base = s * fu::kStreamLinears, vbase = s * fu::kStreamVectors;
      const int64_t ts = n_.stream_tokens(s);
      linear_forward(st.mod, acts_.stemb, w.linears[base + fu::kModulation]);
      split_chunks(st.mod, st.chunk, 6, n_.d);
      modulated_layer_norm_forward(st.n1.view({n_.b, ts, n_.d}), st.mean1, st.rstd1, in[s]->view({n_.b, ts, n_.d}),
                                   st.chunk[0], st.chunk[1], cf_.norm_eps);
      linear_forward(st.qkv, st.n1, w.linears[base + fu::kQkv]);
      qk_norm_rope_forward(x.jqkv, st.rstd_qk.view({n_.b, ts, 2 * n_.h}), st.qkv.view({n_.b, ts, 3 * n_.h, n_.hd}),
                           w.vectors[vbase + fu::kQNorm], w.vectors[vbase + fu::kKNorm], cf_.norm_eps, acts_.cos,
                           acts_.sin, n_.stream_offset(s));
    }
    attention_forward(x.out, x.lse, x.jqkv, attention_);
    const Tensor joint_out = x.out.view({n_.b, n_.t * n_.d});
    for (int s = 0; s < 2; ++s) {
      FluxStreamActivations& st = x.stream[s];
      const int base = s * fu::kStreamLinears;
      const int64_t ts = n_.stream_tokens(s);
      copy_columns(st.attn.view({n_.b, ts * n_.d}), 0, joint_out, n_.stream_offset(s) * n_.d, ts * n_.d);
      linear_forward(st.o, st.attn, w.linears[base + fu::kOut]);
      gated_residual_forward(st.mid.view({n_.b, ts, n_.d}), in[s]->view({n_.b, ts, n_.d}),
                             st.o.view({n_.b, ts, n_.d}), st.chunk[2]);
      modulated_layer_norm_forward(st.n2.view({n_.b, ts, n_.d}), st.mean2, st.rstd2, st.mid.view({n_.b, ts, n_.d}),
                                   st.chunk[3], st.chunk[4], cf_.norm_eps);
      linear_gelu_forward(st.a, st.h, st.n2, w.linears[base + fu::kMlpIn]);
      linear_forward(st.f, st.a, w.linears[base + fu::kMlpOut]);
      gated_residual_forward(next[s]->view({n_.b, ts, n_.d}), st.mid.view({n_.b, ts, n_.d}),
                             st.f.view({n_.b, ts, n_.d}), st.chunk[5]);
    }
  }

  // d_image, d_text hold the gradients of the block's outputs; left holding its inputs'.
  void double_backward(int i, FluxDoubleActivations& x, const FluxUnitWeights& w, const FluxUnitWeights& g) {
    const Tensor* in[2] = {&acts_.image_in[static_cast<size_t>(i)], &acts_.text_in[static_cast<size_t>(i)]};
    const Tensor* d[2] = {&acts_.d_image, &acts_.d_text};
    const Tensor d_joint_out = acts_.d_attn_joint.view({n_.b, n_.t * n_.d});
    for (int s = 0; s < 2; ++s) {
      FluxStreamActivations& st = x.stream[s];
      const int base = s * fu::kStreamLinears;
      const int64_t ts = n_.stream_tokens(s), r = n_.b * ts;
      const Tensor d3 = d[s]->view({n_.b, ts, n_.d});
      const Tensor* dc = acts_.d_chunk + 6 * s;
      const Tensor df = acts_.d_small.narrow(0, r), da = acts_.d_big.narrow(0, r), dh = acts_.d_big2.narrow(0, r);
      const Tensor dn = acts_.d_n.narrow(0, r);
      gated_residual_backward(df.view({n_.b, ts, n_.d}), dc[5], d3, st.f.view({n_.b, ts, n_.d}),
                              st.chunk[5]);
      linear_gelu_backward(dh, da, g.linears[base + fu::kMlpOut], df, st.a, w.linears[base + fu::kMlpOut], st.h,
                           overwrite_);  // NOTE [GELU after a linear layer]
      linear_backward(dn, g.linears[base + fu::kMlpIn], dh, st.n2, w.linears[base + fu::kMlpIn], overwrite_);
      modulated_layer_norm_backward(d3, dc[3], dc[4], dn.view({n_.b, ts, n_.d}),
                                    st.mid.view({n_.b, ts, n_.d}), st.chunk[4], st.mean2, st.rstd2);
      const Tensor dout = acts_.d_small.narrow(0, r);
      gated_residual_backward(dout.view({n_.b, ts, n_.d}), dc[2], d3, st.o.view({n_.b, ts, n_.d}),
                              st.chunk[2]);
      const Tensor dattn = acts_.d_stream_attn.narrow(0, r);
      linear_backward(dattn, g.linears[base + fu::kOut], dout, st.attn, w.linears[base + fu::kOut], overwrite_);
      copy_columns(d_joint_out, n_.stream_offset(s) * n_.d, dattn.view({n_.b, ts * n_.d}), 0, ts * n_.d);
    }
    attention_backward(acts_.d_jqkv, acts_.d_attn_joint, x.jqkv, x.out, x.lse, attention_);
    for (int s = 0; s < 2; ++s) {
      FluxStreamActivations& st = x.stream[s];
      const int base = s * fu::kStreamLinears, vbase = s * fu::kStreamVectors;
      const int64_t ts = n_.stream_tokens(s), r = n_.b * ts;
      const Tensor dqkv = acts_.d_qkv.narrow(0, r), dn = acts_.d_n.narrow(0, r);
      const Tensor* dc = acts_.d_chunk + 6 * s;
      if (overwrite_) zero_norm_grads(g, vbase);
      qk_norm_rope_backward(dqkv.view({n_.b, ts, 3 * n_.h, n_.hd}), g.vectors[vbase + fu::kQNorm],
                            g.vectors[vbase + fu::kKNorm], acts_.d_jqkv, st.qkv.view({n_.b, ts, 3 * n_.h, n_.hd}),
                            w.vectors[vbase + fu::kQNorm], w.vectors[vbase + fu::kKNorm],
                            st.rstd_qk.view({n_.b, ts, 2 * n_.h}), acts_.cos, acts_.sin, n_.stream_offset(s));
      linear_backward(dn, g.linears[base + fu::kQkv], dqkv, st.n1, w.linears[base + fu::kQkv], overwrite_);
      modulated_layer_norm_backward(d[s]->view({n_.b, ts, n_.d}), dc[0], dc[1],
                                    dn.view({n_.b, ts, n_.d}), in[s]->view({n_.b, ts, n_.d}), st.chunk[1], st.mean1,
                                    st.rstd1);
      modulation_backward(acts_, dc, w.linears[base + fu::kModulation], g.linears[base + fu::kModulation], 6, n_.d,
                          overwrite_);
    }
  }

  void single_forward(int j, FluxSingleActivations& x, const FluxUnitWeights& w) {
    const Tensor& in = acts_.joint_in[static_cast<size_t>(j)];
    const Tensor& next = acts_.joint_in[static_cast<size_t>(j) + 1];
    linear_forward(x.mod, acts_.stemb, w.linears[fu::kSingleModulation]);
    split_chunks(x.mod, x.chunk, 3, n_.d);
    modulated_layer_norm_forward(x.n.view({n_.b, n_.t, n_.d}), x.mean, x.rstd, in.view({n_.b, n_.t, n_.d}),
                                 x.chunk[0], x.chunk[1], cf_.norm_eps);
    linear_forward(x.qkv, x.n, w.linears[fu::kSingleQkv]);
    qk_norm_rope_forward(x.jqkv, x.rstd_qk.view({n_.b, n_.t, 2 * n_.h}), x.qkv.view({n_.b, n_.t, 3 * n_.h, n_.hd}),
                         w.vectors[fu::kQNorm], w.vectors[fu::kKNorm], cf_.norm_eps, acts_.cos, acts_.sin, 0);
    attention_forward(x.out, x.lse, x.jqkv, attention_);
    linear_gelu_forward(x.a, x.h, x.n, w.linears[fu::kSingleMlpIn]);
    // proj_out([attention, MLP]) without the concatenation (NOTE [Linear over concatenated inputs]).
    linear_concat_forward(x.y, rows(x.out, n_.d), x.a, w.linears[fu::kSingleOut]);
    gated_residual_forward(next.view({n_.b, n_.t, n_.d}), in.view({n_.b, n_.t, n_.d}), x.y.view({n_.b, n_.t, n_.d}),
                           x.chunk[2]);
  }

  // d_joint holds the gradient of the block's output; left holding its input's.
  void single_backward(int j, FluxSingleActivations& x, const FluxUnitWeights& w, const FluxUnitWeights& g) {
    const Tensor& in = acts_.joint_in[static_cast<size_t>(j)];
    const Tensor d3 = acts_.d_joint.view({n_.b, n_.t, n_.d});
    gated_residual_backward(acts_.d_small.view({n_.b, n_.t, n_.d}), acts_.d_chunk[2], d3,
                            x.y.view({n_.b, n_.t, n_.d}), x.chunk[2]);
    // The attention output's gradient, and the MLP's at its pre-activation through the GELU
    // (d_big: scratch where the GELU does not fuse); NOTE [Linear over concatenated inputs].
    linear_concat_gelu_backward(acts_.d_stream_attn, acts_.d_big2, acts_.d_big, g.linears[fu::kSingleOut],
                                acts_.d_small, rows(x.out, n_.d), x.a, w.linears[fu::kSingleOut], x.h, overwrite_);
    linear_backward(acts_.d_n, g.linears[fu::kSingleMlpIn], acts_.d_big2, x.n, w.linears[fu::kSingleMlpIn],
                    overwrite_);
    attention_backward(acts_.d_jqkv, acts_.d_stream_attn.view({n_.b, n_.t, n_.h, n_.hd}), x.jqkv, x.out, x.lse,
                       attention_);
    if (overwrite_) zero_norm_grads(g, 0);
    qk_norm_rope_backward(acts_.d_qkv.view({n_.b, n_.t, 3 * n_.h, n_.hd}), g.vectors[fu::kQNorm],
                          g.vectors[fu::kKNorm], acts_.d_jqkv, x.qkv.view({n_.b, n_.t, 3 * n_.h, n_.hd}),
                          w.vectors[fu::kQNorm], w.vectors[fu::kKNorm], x.rstd_qk.view({n_.b, n_.t, 2 * n_.h}),
                          acts_.cos, acts_.sin, 0);
    linear_backward(acts_.d_n2, g.linears[fu::kSingleQkv], acts_.d_qkv, x.n, w.linears[fu::kSingleQkv], overwrite_);
    accumulate(acts_.d_n, acts_.d_n2);
    modulated_layer_norm_backward(d3, acts_.d_chunk[0], acts_.d_chunk[1], acts_.d_n.view({n_.b, n_.t, n_.d}),
                                  in.view({n_.b, n_.t, n_.d}), x.chunk[1], x.mean, x.rstd);
    modulation_backward(acts_, acts_.d_chunk, w.linears[fu::kSingleModulation], g.linears[fu::kSingleModulation], 3,
                        n_.d, overwrite_);
  }

 private:
  const FluxConfig& cf_;
  Dims n_;
  FluxTransformer::Activations& acts_;
  AttentionShape attention_;
  bool overwrite_;

  // The QK norm scales' gradients, which qk_norm_rope_backward only adds to: zeroed before
  // a backward that writes its gradients fresh.
  static void zero_norm_grads(const FluxUnitWeights& g, int vbase) {
    g.vectors[static_cast<size_t>(vbase + fu::kQNorm)].fill_zero();
    g.vectors[static_cast<size_t>(vbase + fu::kKNorm)].fill_zero();
  }
};

}  // namespace

void FluxTransformer::forward(const FluxInputs& inputs, FluxParamSource& params, const Tensor& out) {
  Activations& acts = *acts_;
  const Dims n(config_, shape_);
  check_shape(inputs.image, {n.b, n.s, config_.in_channels}, "flux forward image");
  check_shape(inputs.text, {n.b, n.l, config_.context_dim}, "flux forward text");
  check_shape(inputs.pooled, {n.b, config_.pooled_dim}, "flux forward pooled");
  check_shape(out, {n.b, n.s, n.c}, "flux forward out");
  FORGE_CHECK(static_cast<int64_t>(inputs.timesteps.size()) == n.b, "flux forward: {} timesteps for {} samples",
              inputs.timesteps.size(), n.b);
  FORGE_CHECK(!config_.guidance_embeds || static_cast<int64_t>(inputs.guidance.size()) == n.b,
              "flux forward: {} guidance scales for {} samples ({} embeds the guidance)", inputs.guidance.size(), n.b,
              config_.name);
  inputs_ = inputs;

  // Conditioning: temb = time MLP + [guidance MLP] + pooled-text MLP; every modulation reads silu(temb).
  const FluxUnitWeights& e = params.unit(0);
  // Scaled by 1000 as diffusers does, in double then rounded (its float64 reference's order).
  auto scaled_by_1000 = [](std::vector<float> values) {
    for (float& v : values) v = static_cast<float>(static_cast<double>(v) * 1000.0);
    return values;
  };
  const std::vector<float> scaled = scaled_by_1000(inputs.timesteps);
  upload(acts.time_features, timestep_features(scaled, config_.timestep_dim));
  mlp_embedder_forward(acts.time_h, acts.time_a, acts.time_features, e.linears[fu::kTime1]);
  linear_forward(acts.temb, acts.time_a, e.linears[fu::kTime2]);
  if (config_.guidance_embeds) {
    upload(acts.guidance_features, timestep_features(scaled_by_1000(inputs.guidance), config_.timestep_dim));
    mlp_embedder_forward(acts.guidance_h, acts.guidance_a, acts.guidance_features, e.linears[fu::kGuidance1]);
    linear_forward(acts.temb, acts.guidance_a, e.linears[fu::kGuidance2], &acts.temb);
  }
  mlp_embedder_forward(acts.pooled_h, acts.pooled_a, inputs.pooled, e.linears[fu::kPooled1]);
  linear_forward(acts.temb, acts.pooled_a, e.linears[fu::kPooled2], &acts.temb);
  silu_forward(acts.stemb, acts.temb);
  linear_forward(acts.image_in[0], rows(inputs.image, config_.in_channels), e.linears[fu::kImageIn]);
  linear_forward(acts.text_in[0], rows(inputs.text, config_.context_dim), e.linears[fu::kContextIn]);

  Blocks blocks(config_, shape_, acts);
  for (int i = 0; i < config_.num_double_blocks; ++i)
    blocks.double_forward(i, acts.doubles[static_cast<size_t>(i)], params.unit(flux_double_unit(i)));
  // The joint stream [text, image] of each sample.
  const size_t last_double = static_cast<size_t>(config_.num_double_blocks);
  const Tensor joint = acts.joint_in[0].view({n.b, n.t * n.d});
  copy_columns(joint, 0, acts.text_in[last_double].view({n.b, n.l * n.d}), 0, n.l * n.d);
  copy_columns(joint, n.l * n.d, acts.image_in[last_double].view({n.b, n.s * n.d}), 0, n.s * n.d);
  for (int j = 0; j < config_.num_single_blocks; ++j)
    blocks.single_forward(j, acts.singles[static_cast<size_t>(j)], params.unit(flux_single_unit(config_, j)));

  // Head: the image tokens through a modulated layer norm (scale, then shift, as diffusers'
  // AdaLayerNormContinuous chunks them) and the projection to patch features.
  const FluxUnitWeights& hw = params.unit(flux_head_unit(config_));
  copy_columns(acts.image_out.view({n.b, n.s * n.d}), 0,
               acts.joint_in[static_cast<size_t>(config_.num_single_blocks)].view({n.b, n.t * n.d}), n.l * n.d,
               n.s * n.d);
  linear_forward(acts.head_mod, acts.stemb, hw.linears[fu::kHeadModulation]);
  split_chunks(acts.head_mod, acts.head_chunk, 2, n.d);
  modulated_layer_norm_forward(acts.head_n.view({n.b, n.s, n.d}), acts.head_mean, acts.head_rstd,
                               acts.image_out.view({n.b, n.s, n.d}), acts.head_chunk[1], acts.head_chunk[0],
                               config_.norm_eps);
  linear_forward(rows(out, n.c), acts.head_n, hw.linears[fu::kHeadOut]);
}

void FluxTransformer::backward(const Tensor& dout, FluxParamSource& params, FluxGradSink& grads, bool overwrite) {
  Activations& acts = *acts_;
  const Dims n(config_, shape_);
  check_shape(dout, {n.b, n.s, n.c}, "flux backward dout");
  // NOTE [Recomputing some FLUX blocks]: the first recomputed_doubles double blocks and
  // recomputed_singles single blocks share one set of activations and are recomputed.
  const auto [recomputed_doubles, recomputed_singles] =
      checkpoint_ == ActivationCheckpoint::Full ? recomputed_blocks(config_, recompute_blocks_) : std::pair{0, 0};
  Blocks blocks(config_, shape_, acts, overwrite);
  acts.d_stemb.fill_zero();

  // Head.
  {
    const int unit = flux_head_unit(config_);
    const FluxUnitWeights& w = params.unit(unit);
    const FluxUnitWeights& g = grads.unit_grads(unit);
    const Tensor dn = acts.d_n.narrow(0, n.b * n.s);
    linear_backward(dn, g.linears[fu::kHeadOut], rows(dout, n.c), acts.head_n, w.linears[fu::kHeadOut], overwrite);
    acts.d_image.fill_zero();
    modulated_layer_norm_backward(acts.d_image.view({n.b, n.s, n.d}), acts.d_chunk[1], acts.d_chunk[0],
                                  dn.view({n.b, n.s, n.d}), acts.image_out.view({n.b, n.s, n.d}), acts.head_chunk[0],
                                  acts.head_mean, acts.head_rstd);
    modulation_backward(acts, acts.d_chunk, w.linears[fu::kHeadModulation], g.linears[fu::kHeadModulation], 2, n.d,
                        overwrite);
    grads.unit_done(unit);
  }
  // Single blocks: the joint stream's gradient is the image part's; the text part's is 0.
  acts.d_joint.fill_zero();
  copy_columns(acts.d_joint.view({n.b, n.t * n.d}), n.l * n.d, acts.d_image.view({n.b, n.s * n.d}), 0, n.s * n.d);
  for (int j = static_cast<int>(config_.num_single_blocks) - 1; j >= 0; --j) {
    const int unit = flux_single_unit(config_, j);
    FluxSingleActivations& x = acts.singles[static_cast<size_t>(j)];
    if (j < recomputed_singles) blocks.single_forward(j, x, params.unit(unit));
    blocks.single_backward(j, x, params.unit(unit), grads.unit_grads(unit));
    grads.unit_done(unit);
  }
  copy_columns(acts.d_text.view({n.b, n.l * n.d}), 0, acts.d_joint.view({n.b, n.t * n.d}), 0, n.l * n.d);
  copy_columns(acts.d_image.view({n.b, n.s * n.d}), 0, acts.d_joint.view({n.b, n.t * n.d}), n.l * n.d, n.s * n.d);
  for (int i = static_cast<int>(config_.num_double_blocks) - 1; i >= 0; --i) {
    const int unit = flux_double_unit(i);
    FluxDoubleActivations& x = acts.doubles[static_cast<size_t>(i)];
    if (i < recomputed_doubles) blocks.double_forward(i, x, params.unit(unit));
    blocks.double_backward(i, x, params.unit(unit), grads.unit_grads(unit));
    grads.unit_done(unit);
  }

  // Embedders: the input projections' weights, then temb's gradient through each MLP.
  const FluxUnitWeights& w = params.unit(0);
  const FluxUnitWeights& g = grads.unit_grads(0);
  linear_backward_weight(g.linears[fu::kImageIn], acts.d_image, rows(inputs_.image, config_.in_channels), overwrite);
  linear_backward_weight(g.linears[fu::kContextIn], acts.d_text, rows(inputs_.text, config_.context_dim), overwrite);
  silu_backward(acts.d_temb, acts.d_stemb, acts.temb);
  auto mlp_backward = [&](int first, const Tensor& features, const Tensor& h, const Tensor& a) {
    linear_backward(acts.d_embed_a, g.linears[first + 1], acts.d_temb, a, w.linears[first + 1], overwrite);
    silu_backward(acts.d_embed_h, acts.d_embed_a, h);
    linear_backward_weight(g.linears[first], acts.d_embed_h, features, overwrite);
  };
  mlp_backward(fu::kTime1, acts.time_features, acts.time_h, acts.time_a);
  mlp_backward(fu::kPooled1, inputs_.pooled, acts.pooled_h, acts.pooled_a);
  if (config_.guidance_embeds) mlp_backward(fu::kGuidance1, acts.guidance_features, acts.guidance_h, acts.guidance_a);
  grads.unit_done(0);
}

}  // namespace forge
