// Grouped-query attention on the GPU through cuDNN's fused flash attention
// (cudnn-frontend's SDPA graphs), forward and backward, causal or not.
//
// The packed QKV projection output [B, T, Hq + 2 Hkv, D] is handed to cuDNN as three
// strided 4-D views (dims b, h, s, d): Q at head offset 0, K at Hq, V at Hq + Hkv, each
// with strides (T (Hq + 2 Hkv) D, D, (Hq + 2 Hkv) D, 1). So nothing is split or copied,
// and K/V keep their Hkv heads: cuDNN's GQA support maps query head h to KV head
// h / (Hq / Hkv) itself. dQKV is written through the same three views, so the backward's
// output is already in the layout the QKV projection's backward GEMM reads.
//
// Values with a head dim Dv of their own (NOTE [Value head dim] in ops/attention.h, MLA's
// D = 192, Dv = 128) change only the views' numbers. A token's row of qkv is then
// R = (Hq + Hkv) D + Hkv Dv elements: Q [b, Hq, s, D] at element 0 and K [b, Hkv, s, D] at
// Hq D, both with strides (T R, D, R, 1); V [b, Hkv, s, Dv] at (Hq + Hkv) D with strides
// (T R, Dv, R, 1); O and dO [b, Hq, s, Dv] with strides (T Hq Dv, Dv, Hq Dv, 1). cuDNN's
// SDPA takes V's head dim from V itself, forward and backward; for fp16/bf16 on Hopper
// cudnn-frontend accepts head dims up to 256 that are multiples of 8, d_qk and d_v apart,
// and its support matrix names d_qk = 192 with d_v = 128 for prefill and backprop.
// With Dv = D these are the uniform form's views.
//
// Masking is causal with the diagonal at the top left; a sliding window W sets the band's
// left bound to W, which keeps key j for query i when j + W > i, i.e. i - j < W, the same
// rule as the CPU reference. Bidirectional attention (NOTE [Bidirectional attention] in
// ops/attention.h, p.causal false, never with a window or a chunk) sets neither the causal
// mask nor a band: every query sees every key of its sequence. The softmax statistics cuDNN
// saves are the log-sum-exp of the scaled scores, which is what the CPU reference calls lse.
//
// Packed examples (NOTE [Packed examples] in ops/attention.h) use cuDNN's ragged ("THD")
// layout: the graph's batch is the micro-batch's examples (rounded up to a power of two with
// empty sequences), each at most T tokens, found through per-sequence ragged offset tensors
// (element offsets of its first token in Q/K/V, which share qkv's rows and so one offset
// tensor, in O/dO and in the statistics) and lengths (seq_len_q = seq_len_kv) with the
// padding mask; the same causal mask (if any) and window then apply within each example. The
// statistics are ragged too: token-major [B * T, Hq].
//
// Chunk attention (NOTE [Chunk attention] in ops/attention_chunk.h, context parallelism's)
// reads the queries from the chunk's packed qkv as above, with seq = Lq, and the keys and
// values from a tensor of their own, kv [B, S, 2 Hkv, D]: K [b, Hkv, s_kv, D] at element 0
// and V at Hkv D, both with strides (S 2 Hkv D, D, 2 Hkv D, 1), where s_kv = p + Lq is the
// prefix of positions the chunk [p, p + Lq) sees (the batch stride still spans all S). The
// causal mask then has its diagonal at the bottom right (DiagonalAlignment_t::BOTTOM_RIGHT
// with a right bound of 0): query i keeps key j when j <= i + s_kv - Lq = p + i, and the
// window's left bound W keeps j + W > p + i, as on the CPU. cuDNN writes dK and dV for the
// s_kv positions it reads; the rows of dkv past them are zeroed with a 2-D memset, so the
// whole of dkv is the chunk's gradient. At position 0 (s_kv = Lq, not ragged: ring
// attention's diagonal pairs, the all-gather's first chunk) the two alignments agree, and the
// chunk takes the top-left causal mask of the whole-sequence attention, whose window
// cudnn-frontend takes on every backend (it refuses the bottom-right one with a window and
// s_q = s_kv on Hopper with cuDNN 9.9 and older). A full chunk (NOTE [Full chunk attention],
// p.causal false: position 0, no window, not ragged) reads all kv_seq positions with no mask.
// A full chunk with a window (NOTE [Full chunk attention with a sliding window]: kv wholly
// before the chunk, d = position >= S, t = W - d) is, by t: t >= Lq the full chunk; t >= 1 the
// band with the diagonal at the top left (TOP_LEFT, whose frontend checks do not take the
// bottom-right rules), the left bound t and a right bound of S, past every key, so query i
// keeps key j exactly when j > i - t; t <= 0 the trimmed band: the queries [0, n) against the
// keys [k0, S), k0 = 1 - t, n = S - k0, with the left bound 1, through views whose batch
// strides still span the chunk's Lq query rows and kv's S rows (KeyValueChunk::q_rows, the
// kv pointer moved k0 rows on); the rows the band leaves out get out 0 and lse -inf forward
// (a memset and attention_lse_none), dq 0 and dk/dv 0 backward (memsets). cuDNN takes no
// single query: a trimmed band with n = 1 (W - 2 a multiple of the chunk length, refused by
// the config's validation) fails here; n <= 0 sees no key and runs no graph.
//
// Chunk attention with packed examples (NOTE [Chunk attention with packed examples]) is the
// ragged form with the queries and the keys described apart: the query-side lengths and
// offsets (in qkv, out and statistics) give each example's rows inside the chunk, the
// key-side ones (seq_len_kv, and the offsets of K, V, dK and dV in kv) its rows from its first
// position to the chunk's end. The padding mask with the bottom-right diagonal then aligns
// each example's last query with its last key, per sequence (cudnn-frontend hands the
// sequence-length tensors to the diagonal band masks when the alignment is bottom right), and
// the window's left bound with it. The graph's key dim is still p + Lq, the longest an
// example's keys can be; max_total_seq_len_kv bounds the key offsets by kv's B S rows. kv's
// rows that belong to no sequence get no gradient from cuDNN, so dkv is zeroed first. A full
// chunk with packed examples (NOTE [Full chunk attention with packed examples], p.causal
// false, position 0, no window) is the same ragged form with no mask but the padding: at most
// one sequence per row, its queries at the row's start and its keys at an offset into kv; the
// queries of no sequence are not cuDNN's, so out is cleared and their lse set to -inf first,
// and the backward clears dq's query heads before cuDNN writes its sequences' rows.
//
// Built graphs are cached per problem shape (batch, seq, heads, both head dims, window,
// scale, ragged capacity, chunk, causal or not); building one takes tens of milliseconds, executing it
// microseconds to milliseconds.
#include "kernels/cuda/attention.h"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "core/device.h"
#include "kernels/cuda/attention_merge.h"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV,
  // ragged sequences: lengths and the offset tensor of each ragged input or output
  kSeqLenQ, kSeqLenKV, kQOffset, kKOffset, kVOffset, kOOffset, kStatsOffset, kdOOffset, kdQOffset, kdKOffset,
  kdVOffset
};

void check_fe(fe::error_t status, const char* what) {
  if (status.is_bad()) FORGE_FAIL("cuDNN attention: {} failed: {}", what, status.get_message());
}

struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

using ProblemKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, bool, bool>;

struct Context {
  cudnnHandle_t handle = nullptr;
  std::map<ProblemKey, CachedGraph> graphs;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  std::mutex mu;

  Context() {
    cudnnStatus_t s = cudnnCreate(&handle);
    if (s != CUDNN_STATUS_SUCCESS) FORGE_FAIL("cudnnCreate failed: {}", cudnnGetErrorString(s));
  }

  float* stats = nullptr;  // a trimmed band's packed statistics (NOTE [Packed band statistics])
  int64_t stats_count = 0;

  float* stats_of(int64_t count) {
    if (count > stats_count) {
      device_synchronize();
      device_free(stats);
      stats = static_cast<float*>(device_malloc(static_cast<size_t>(count) * sizeof(float)));
      stats_count = count;
    }
    return stats;
  }

  void* workspace_of(int64_t bytes) {
    if (bytes > workspace_bytes) {
      device_synchronize();
      device_free(workspace);
      workspace = device_malloc(static_cast<size_t>(bytes));
      workspace_bytes = bytes;
    }
    return workspace;
  }
};

Context& context() {
  static Context* ctx = new Context();  // lives for the process, like the cuBLASLt context
  return *ctx;
}

// Elements per token of qkv: the query heads, the key heads, the value heads.
int64_t qkv_width(const AttentionProblem& p) {
  return (p.q_heads + p.kv_heads) * p.head_dim + p.kv_heads * p.v_head_dim;
}

bool is_chunk(const AttentionProblem& p) { return p.chunk.kv_seq > 0; }

// Where K and V start: in a token's row of qkv (Q starts at 0), or of kv for a chunk.
int64_t k_offset(const AttentionProblem& p) { return is_chunk(p) ? 0 : p.q_heads * p.head_dim; }
int64_t v_offset(const AttentionProblem& p) {
  return is_chunk(p) ? p.kv_heads * p.head_dim : (p.q_heads + p.kv_heads) * p.head_dim;
}

struct Views {
  std::vector<int64_t> q_dim, k_dim, v_dim, o_dim, q_stride, k_stride, v_stride, o_stride, stats_dim, stats_stride;
};

// With ragged sequences the batch is their capacity, and the statistics are token-major.
// A chunk's keys and values are the first position + seq tokens of kv's rows.
Views views_of(const AttentionProblem& p) {
  const int64_t width = qkv_width(p);
  const bool ragged = p.ragged.capacity > 0;
  const int64_t batch = ragged ? p.ragged.capacity : p.batch;
  // with ragged chunks, the longest; a full chunk (not causal) sees all of kv
  const int64_t kv_seq = is_chunk(p) ? (p.chunk.band_left > 0 ? p.chunk.keys
                                       : p.causal          ? p.chunk.position + p.seq
                                                           : p.chunk.kv_seq)
                                    : p.seq;
  const int64_t q_rows = p.chunk.q_rows > 0 ? p.chunk.q_rows : p.seq;  // per batch, in qkv and out
  const int64_t kv_width = is_chunk(p) ? p.kv_heads * (p.head_dim + p.v_head_dim) : width;
  const int64_t kv_batch_stride = is_chunk(p) ? p.chunk.kv_seq * kv_width : p.seq * width;
  return {
      {batch, p.q_heads, p.seq, p.head_dim},
      {batch, p.kv_heads, kv_seq, p.head_dim},
      {batch, p.kv_heads, kv_seq, p.v_head_dim},
      {batch, p.q_heads, p.seq, p.v_head_dim},
      {q_rows * width, p.head_dim, width, 1},
      {kv_batch_stride, p.head_dim, kv_width, 1},
      {kv_batch_stride, p.v_head_dim, kv_width, 1},
      {q_rows * p.q_heads * p.v_head_dim, p.v_head_dim, p.q_heads * p.v_head_dim, 1},
      {batch, p.q_heads, p.seq, 1},
      ragged ? std::vector<int64_t>{p.q_heads * p.seq, 1, p.q_heads, 1}
             : std::vector<int64_t>{p.q_heads * p.seq, p.seq, 1, 1},  // packed: NOTE [Packed band statistics]
  };
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, Uid uid,
                                                     const std::vector<int64_t>& dim,
                                                     const std::vector<int64_t>& stride) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
}

// A [capacity, 1, 1, 1] int tensor of the ragged description (lengths or offsets).
std::shared_ptr<fe::graph::Tensor_attributes> ragged_input(fe::graph::Graph& g, const char* name, Uid uid,
                                                            const AttentionProblem& p, fe::DataType_t type) {
  const int64_t n = p.ragged.capacity + (type == fe::DataType_t::INT64 ? 1 : 0);
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({n, 1, 1, 1}).set_stride(
      {1, 1, 1, 1}).set_data_type(type));
}

void make_ragged(fe::graph::Graph& g, fe::graph::Tensor_attributes& tensor, const char* name, Uid uid,
                 const AttentionProblem& p) {
  if (p.ragged.capacity > 0) tensor.set_ragged_offset(ragged_input(g, name, uid, p, fe::DataType_t::INT64));
}

template <typename Attributes>
void set_mask(fe::graph::Graph& g, Attributes& attributes, const AttentionProblem& p) {
  attributes.set_attn_scale(p.scale);
  if (is_chunk(p) && p.chunk.band_left > 0)
    attributes.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
        .set_diagonal_band_left_bound(static_cast<int>(p.chunk.band_left))
        .set_diagonal_band_right_bound(static_cast<int>(p.chunk.keys));
  else if (is_chunk(p) && p.causal && (p.chunk.position > 0 || p.ragged.capacity > 0))
    attributes.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT).set_diagonal_band_right_bound(0);
  else if (p.causal)
    attributes.set_causal_mask(true);
  if (p.sliding_window > 0) attributes.set_diagonal_band_left_bound(static_cast<int>(p.sliding_window));
  if (p.ragged.capacity == 0) return;
  attributes.set_padding_mask(true)
      .set_seq_len_q(ragged_input(g, "seq_len_q", kSeqLenQ, p, fe::DataType_t::INT32))
      .set_seq_len_kv(ragged_input(g, "seq_len_kv", kSeqLenKV, p, fe::DataType_t::INT32))
      .set_max_total_seq_len_q(p.batch * p.seq)
      .set_max_total_seq_len_kv(p.batch * (is_chunk(p) ? p.chunk.kv_seq : p.seq));
}

CachedGraph finish(Context& ctx, std::shared_ptr<fe::graph::Graph> g) {
  check_fe(g->validate(), "validate");
  check_fe(g->build_operation_graph(ctx.handle), "build_operation_graph");
  check_fe(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check_fe(g->check_support(ctx.handle), "check_support");
  check_fe(g->build_plans(ctx.handle), "build_plans");
  CachedGraph cached{g, 0};
  check_fe(g->get_workspace_size(cached.workspace_bytes), "get_workspace_size");
  return cached;
}

CachedGraph build_forward(Context& ctx, const AttentionProblem& p) {
  Views v = views_of(p);
  auto g = new_graph();
  auto q = input(*g, "Q", kQ, v.q_dim, v.q_stride);
  auto k = input(*g, "K", kK, v.k_dim, v.k_stride);
  auto val = input(*g, "V", kV, v.v_dim, v.v_stride);
  make_ragged(*g, *q, "Q_offset", kQOffset, p);
  make_ragged(*g, *k, "K_offset", kKOffset, p);
  make_ragged(*g, *val, "V_offset", kVOffset, p);
  auto attributes = fe::graph::SDPA_attributes().set_name("attention_forward").set_generate_stats(true);
  set_mask(*g, attributes, p);
  auto [o, stats] = g->sdpa(q, k, val, attributes);
  o->set_output(true).set_uid(kO).set_dim(v.o_dim).set_stride(v.o_stride);
  stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(v.stats_dim).set_stride(
      v.stats_stride);
  make_ragged(*g, *o, "O_offset", kOOffset, p);
  make_ragged(*g, *stats, "Stats_offset", kStatsOffset, p);
  return finish(ctx, g);
}

CachedGraph build_backward(Context& ctx, const AttentionProblem& p) {
  Views v = views_of(p);
  auto g = new_graph();
  auto q = input(*g, "Q", kQ, v.q_dim, v.q_stride);
  auto k = input(*g, "K", kK, v.k_dim, v.k_stride);
  auto val = input(*g, "V", kV, v.v_dim, v.v_stride);
  auto o = input(*g, "O", kO, v.o_dim, v.o_stride);
  auto d_o = input(*g, "dO", kdO, v.o_dim, v.o_stride);
  auto stats = input(*g, "Stats", kStats, v.stats_dim, v.stats_stride);
  stats->set_data_type(fe::DataType_t::FLOAT);
  make_ragged(*g, *q, "Q_offset", kQOffset, p);
  make_ragged(*g, *k, "K_offset", kKOffset, p);
  make_ragged(*g, *val, "V_offset", kVOffset, p);
  make_ragged(*g, *o, "O_offset", kOOffset, p);
  make_ragged(*g, *d_o, "dO_offset", kdOOffset, p);
  make_ragged(*g, *stats, "Stats_offset", kStatsOffset, p);
  auto attributes = fe::graph::SDPA_backward_attributes().set_name("attention_backward");
  set_mask(*g, attributes, p);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, val, o, d_o, stats, attributes);
  dq->set_output(true).set_uid(kdQ).set_dim(v.q_dim).set_stride(v.q_stride);
  dk->set_output(true).set_uid(kdK).set_dim(v.k_dim).set_stride(v.k_stride);
  dv->set_output(true).set_uid(kdV).set_dim(v.v_dim).set_stride(v.v_stride);
  make_ragged(*g, *dq, "dQ_offset", kdQOffset, p);
  make_ragged(*g, *dk, "dK_offset", kdKOffset, p);
  make_ragged(*g, *dv, "dV_offset", kdVOffset, p);
  return finish(ctx, g);
}

const CachedGraph& cached_graph(Context& ctx, const AttentionProblem& p, bool backward) {
  ProblemKey key{p.batch,          p.seq,   p.q_heads,          p.kv_heads,       p.head_dim,     p.v_head_dim,
                 p.sliding_window, p.scale, p.ragged.capacity, p.chunk.position, p.chunk.kv_seq, p.chunk.band_left,
                 p.chunk.keys,     p.chunk.q_rows, p.causal,         backward};
  auto it = ctx.graphs.find(key);
  if (it == ctx.graphs.end())
    it = ctx.graphs.emplace(key, backward ? build_backward(ctx, p) : build_forward(ctx, p)).first;
  return it->second;
}

// The ragged description's device arrays, for the uids the graph declared: the keys' lengths
// and offsets are the queries' but for a chunk, whose keys are in kv.
void add_ragged(std::unordered_map<int64_t, void*>& pack, const AttentionProblem& p, bool backward) {
  const RaggedSequences& r = p.ragged;
  if (r.capacity == 0) return;
  auto arg = [](const auto* pointer) { return const_cast<void*>(static_cast<const void*>(pointer)); };
  void* kv_lengths = is_chunk(p) ? arg(p.chunk.kv_lengths) : arg(r.lengths);
  void* kv_offsets = is_chunk(p) ? arg(p.chunk.kv_offsets) : arg(r.qkv_offsets);
  pack[kSeqLenQ] = arg(r.lengths);
  pack[kSeqLenKV] = kv_lengths;
  pack[kQOffset] = arg(r.qkv_offsets);
  pack[kKOffset] = pack[kVOffset] = kv_offsets;
  pack[kOOffset] = arg(r.out_offsets);
  pack[kStatsOffset] = arg(r.lse_offsets);
  if (!backward) return;
  pack[kdOOffset] = arg(r.out_offsets);
  pack[kdQOffset] = arg(r.qkv_offsets);
  pack[kdKOffset] = pack[kdVOffset] = kv_offsets;
}

void execute(Context& ctx, const CachedGraph& cached, std::unordered_map<int64_t, void*>& pack) {
  void* workspace = ctx.workspace_of(cached.workspace_bytes);
  check_fe(cached.graph->execute(ctx.handle, pack, workspace), "execute");
}

// NOTE [Packed band statistics]
// A trimmed band (NOTE [Full chunk attention with a sliding window]) computes the first n of
// the chunk's Lq query rows, whose statistics are the first n of every (batch, head) row of
// Lq in the chunk's lse. cuDNN before 9.26 takes only packed BHSD statistics in
// sdpa_backward (the device's 9.14 refuses the strided view at validation), so the graphs
// read and write packed [B, Hq, n] statistics in the context's scratch, copied from and to
// the strided rows with one 2-D copy, inside the context's lock (the scratch is shared by
// the threads that share the context, and they queue on the one default stream).
bool trimmed(const AttentionProblem& p) { return !(p.ragged.capacity > 0) && p.chunk.q_rows > p.seq; }

void copy_band_statistics(float* to, int64_t to_row, const float* from, int64_t from_row, const AttentionProblem& p) {
  CUDA_CHECK(cudaMemcpy2DAsync(to, static_cast<size_t>(to_row) * sizeof(float), from,
                               static_cast<size_t>(from_row) * sizeof(float),
                               static_cast<size_t>(p.seq) * sizeof(float),
                               static_cast<size_t>(p.batch * p.q_heads), cudaMemcpyDeviceToDevice, nullptr));
}

// The pointers of one graph execution: Q in qkv; K and V in qkv, or in kv for a chunk.
void run_forward(bf16* out, float* lse, const bf16* qkv, const bf16* kv, const AttentionProblem& p) {
  Context& ctx = context();
  std::lock_guard lock(ctx.mu);
  const CachedGraph& g = cached_graph(ctx, p, false);
  bf16* q = const_cast<bf16*>(qkv);
  bf16* keys = const_cast<bf16*>(kv);
  float* stats = trimmed(p) ? ctx.stats_of(p.batch * p.q_heads * p.seq) : lse;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q}, {kK, keys + k_offset(p)}, {kV, keys + v_offset(p)}, {kO, out}, {kStats, stats}};
  add_ragged(pack, p, false);
  execute(ctx, g, pack);
  if (stats != lse) copy_band_statistics(lse, p.chunk.q_rows, stats, p.seq, p);
}

void run_backward(bf16* dqkv, bf16* dkv, const bf16* dout, const bf16* qkv, const bf16* kv, const bf16* out,
                  const float* lse, const AttentionProblem& p) {
  Context& ctx = context();
  std::lock_guard lock(ctx.mu);
  const CachedGraph& g = cached_graph(ctx, p, true);
  bf16* q = const_cast<bf16*>(qkv);
  bf16* keys = const_cast<bf16*>(kv);
  const float* stats = lse;
  if (trimmed(p)) {
    float* packed = ctx.stats_of(p.batch * p.q_heads * p.seq);
    copy_band_statistics(packed, p.seq, lse, p.chunk.q_rows, p);
    stats = packed;
  }
  std::unordered_map<int64_t, void*> pack = {{kQ, q},
                                             {kK, keys + k_offset(p)},
                                             {kV, keys + v_offset(p)},
                                             {kO, const_cast<bf16*>(out)},
                                             {kdO, const_cast<bf16*>(dout)},
                                             {kStats, const_cast<float*>(stats)},
                                             {kdQ, dqkv},
                                             {kdK, dkv + k_offset(p)},
                                             {kdV, dkv + v_offset(p)}};
  add_ragged(pack, p, true);
  execute(ctx, g, pack);
}

void check_chunk(const AttentionProblem& p) {
  const bool ragged_keys = p.chunk.kv_lengths != nullptr && p.chunk.kv_offsets != nullptr;
  const bool full_ok = p.causal || (p.sliding_window == 0 && p.chunk.position == 0) ||
                       (p.ragged.capacity == 0 && p.sliding_window > 0 && p.chunk.position >= p.chunk.kv_seq);
  if (!is_chunk(p) || !full_ok || (p.ragged.capacity > 0) != ragged_keys || p.v_head_dim != p.head_dim ||
      p.chunk.position < 0 || (p.causal && p.chunk.position + p.seq > p.chunk.kv_seq))
    FORGE_FAIL("cuDNN chunk attention: {} queries at position {} of {} keys (head dims {} and {}{}{})", p.seq,
               p.chunk.position, p.chunk.kv_seq, p.head_dim, p.v_head_dim, p.ragged.capacity > 0 ? ", ragged" : "",
               p.causal ? "" : ", not causal");
}

// A full chunk with a window as the cuDNN problem that computes it (NOTE above): the band's
// problem, its first key in kv, and the number of queries it computes (the rows [0, n) of the
// chunk; 0: no query sees a key, no graph).
struct Band {
  AttentionProblem problem;
  int64_t first_key = 0, queries = 0;
};

bool is_band(const AttentionProblem& p) { return is_chunk(p) && !p.causal && p.sliding_window > 0; }

Band band_of(const AttentionProblem& p) {
  const int64_t lq = p.seq, s = p.chunk.kv_seq, t = p.sliding_window - p.chunk.position;
  Band b{p, 0, lq};
  b.problem.sliding_window = 0;
  b.problem.chunk.position = 0;
  if (t >= lq) return b;  // every query sees every key: the full chunk
  if (lq > s)
    FORGE_FAIL("cuDNN chunk attention: a band of {} queries against {} keys (window {}, {} positions apart) needs "
               "no more queries than keys",
               lq, s, p.sliding_window, p.chunk.position);
  b.problem.chunk.q_rows = lq;
  if (t >= 1) {
    b.problem.chunk.band_left = t;
    b.problem.chunk.keys = s;
    return b;
  }
  b.first_key = 1 - t;
  b.queries = std::max<int64_t>(0, s - b.first_key);
  if (b.queries == 1)
    FORGE_FAIL("cuDNN chunk attention: the window {} leaves one query of {} seeing one key of {} at distance {}; "
               "cuDNN takes no single query (model.sliding_window - 2 must not be a multiple of the chunk length)",
               p.sliding_window, lq, s, p.chunk.position);
  b.problem.seq = b.queries;
  b.problem.chunk.band_left = 1;
  b.problem.chunk.keys = b.queries;
  return b;
}

void band_forward(bf16* out, float* lse, const bf16* qkv, const bf16* kv, const AttentionProblem& p) {
  const Band b = band_of(p);
  const int64_t lq = p.seq, out_row = p.q_heads * p.v_head_dim;
  if (b.queries < lq) {  // the rows that see no key: out 0, lse -inf
    const size_t pitch = static_cast<size_t>(lq * out_row) * sizeof(bf16);
    CUDA_CHECK(cudaMemset2DAsync(out + b.queries * out_row, pitch, 0,
                                 static_cast<size_t>((lq - b.queries) * out_row) * sizeof(bf16),
                                 static_cast<size_t>(p.batch), nullptr));
    attention_lse_none(lse, p.batch * p.q_heads, lq, b.queries);
  }
  if (b.queries > 0) run_forward(out, lse, qkv, kv + b.first_key * 2 * p.kv_heads * p.head_dim, b.problem);
}

void band_backward(bf16* dqkv, bf16* dkv, const bf16* dout, const bf16* qkv, const bf16* kv, const bf16* out,
                   const float* lse, const AttentionProblem& p) {
  const Band b = band_of(p);
  const int64_t lq = p.seq, s = p.chunk.kv_seq, kv_width = 2 * p.kv_heads * p.head_dim, width = qkv_width(p);
  const size_t kv_row_bytes = static_cast<size_t>(kv_width) * sizeof(bf16);
  if (b.queries > 0)
    run_backward(dqkv, dkv + b.first_key * kv_width, dout, qkv, kv + b.first_key * kv_width, out, lse, b.problem);
  const int64_t unseen = b.queries > 0 ? b.first_key : s;  // kv's first rows, no gradient
  if (unseen > 0)
    CUDA_CHECK(cudaMemset2DAsync(dkv, static_cast<size_t>(s) * kv_row_bytes, 0, static_cast<size_t>(unseen) *
                                 kv_row_bytes, static_cast<size_t>(p.batch), nullptr));
  if (b.queries < lq)  // the query rows that see no key: dq 0 in their query heads
    for (int64_t i = 0; i < p.batch; ++i)
      CUDA_CHECK(cudaMemset2DAsync(dqkv + (i * lq + b.queries) * width, static_cast<size_t>(width) * sizeof(bf16),
                                   0, static_cast<size_t>(p.q_heads * p.head_dim) * sizeof(bf16),
                                   static_cast<size_t>(lq - b.queries), nullptr));
}

}  // namespace

void attention_forward(bf16* out, float* lse, const bf16* qkv, const AttentionProblem& p) {
  run_forward(out, lse, qkv, qkv, p);
}

void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        const AttentionProblem& p) {
  run_backward(dqkv, dqkv, dout, qkv, qkv, out, lse, p);
}

void attention_chunk_forward(bf16* out, float* lse, const bf16* qkv, const bf16* kv, const AttentionProblem& p) {
  check_chunk(p);
  if (is_band(p)) return band_forward(out, lse, qkv, kv, p);
  if (!p.causal && p.ragged.capacity > 0) {  // the queries of no sequence: out 0, lse -inf
    CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(p.batch * p.seq * p.q_heads * p.v_head_dim) * sizeof(bf16),
                               nullptr));
    attention_lse_none(lse, 1, p.batch * p.seq * p.q_heads, 0);
  }
  run_forward(out, lse, qkv, kv, p);
}

void attention_chunk_backward(bf16* dqkv, bf16* dkv, const bf16* dout, const bf16* qkv, const bf16* kv,
                              const bf16* out, const float* lse, const AttentionProblem& p) {
  check_chunk(p);
  if (is_band(p)) return band_backward(dqkv, dkv, dout, qkv, kv, out, lse, p);
  const int64_t width = 2 * p.kv_heads * p.head_dim;
  const int64_t seen = p.causal ? p.chunk.position + p.seq : p.chunk.kv_seq;
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(bf16);
  if (p.ragged.capacity > 0) {  // the rows of no example's keys: no gradient
    CUDA_CHECK(cudaMemsetAsync(dkv, 0, static_cast<size_t>(p.batch * p.chunk.kv_seq) * row_bytes, nullptr));
    if (!p.causal)  // a full chunk's queries of no sequence: dq 0 in their query heads
      CUDA_CHECK(cudaMemset2DAsync(dqkv, static_cast<size_t>(qkv_width(p)) * sizeof(bf16), 0,
                                   static_cast<size_t>(p.q_heads * p.head_dim) * sizeof(bf16),
                                   static_cast<size_t>(p.batch * p.seq), nullptr));
    run_backward(dqkv, dkv, dout, qkv, kv, out, lse, p);
    return;
  }
  run_backward(dqkv, dkv, dout, qkv, kv, out, lse, p);
  if (seen < p.chunk.kv_seq)  // the positions the chunk does not see: no gradient
    CUDA_CHECK(cudaMemset2DAsync(dkv + seen * width, static_cast<size_t>(p.chunk.kv_seq) * row_bytes, 0,
                                 static_cast<size_t>(p.chunk.kv_seq - seen) * row_bytes, static_cast<size_t>(p.batch),
                                 nullptr));
}

}  // namespace forge::cuda
