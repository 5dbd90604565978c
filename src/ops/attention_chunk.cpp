#include "ops/attention_chunk.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "core/op_profile.h"
#include "kernels/cpu/attention_chunk.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/attention.h"
#endif

namespace forge {
namespace {

// The chunk's dimensions from qkv and kv, checked against `shape` (NOTE [Chunk attention]).
cpu::AttentionChunkDims chunk_dims(const Tensor& qkv, const Tensor& kv, int64_t position, const AttentionShape& shape,
                                   const char* op) {
  AttentionShape checked = shape;  // a full chunk's window is checked below, not as bidirectional attention's
  if (!shape.causal && shape.sliding_window > 0) checked.sliding_window = 0;
  check_attention_shape(qkv, checked, op);
  FORGE_CHECK(shape.causal || (shape.sliding_window == 0 && position == 0) ||
                  (shape.sliding_window > 0 && position >= kv.dim(1)),
              "{}: a chunk against every key of kv (not causal, NOTE [Full chunk attention]) takes position 0 and "
              "no sliding window, or a sliding window with all of kv's {} keys before the chunk (position >= {}, "
              "NOTE [Full chunk attention with a sliding window]), got position {} and window {}",
              op, kv.dim(1), kv.dim(1), position, shape.sliding_window);
  FORGE_CHECK(!shape.distinct_v_head_dim(), "{}: values of a head dim of their own ({} against {}) are not taken", op,
              shape.v_head_dim, shape.head_dim);
  const int64_t b = qkv.dim(0), queries = qkv.dim(1), hkv = shape.num_kv_heads, d = qkv.dim(3);
  FORGE_CHECK(kv.ndim() == 4 && kv.dim(0) == b && kv.dim(2) == 2 * hkv && kv.dim(3) == d,
              "{}: kv {} must be [{}, S, 2 * {}, {}] for qkv {}", op, shape_str(kv.shape()), b, hkv, d,
              shape_str(qkv.shape()));
  FORGE_CHECK(position >= 0 && (!shape.causal || position + queries <= kv.dim(1)),
              "{}: the chunk's {} queries at position {} are not within kv's {} positions", op, queries, position,
              kv.dim(1));
  FORGE_CHECK(qkv.device() == kv.device(), "{}: qkv on {}, kv on {}", op, device_name(qkv.device()),
              device_name(kv.device()));
  return cpu::AttentionChunkDims{.batch = b,
                                 .queries = queries,
                                 .position = position,
                                 .kv_seq = kv.dim(1),
                                 .q_heads = shape.num_q_heads,
                                 .kv_heads = hkv,
                                 .head_dim = d,
                                 .window = shape.sliding_window,
                                 .scale = shape.scale,
                                 .causal = shape.causal};
}

// The segments must describe this chunk's rows, on its device.
void check_segments(const AttentionChunkSegments* segments, const cpu::AttentionChunkDims& d, Device device,
                    const char* op) {
  if (!segments) return;
  FORGE_CHECK(segments->causal == d.causal && (d.causal || (d.window == 0 && d.position == 0)),
              "{}: segments of a {} chunk for a {} one (packed examples take a full chunk at position 0 with no "
              "window, NOTE [Full chunk attention with packed examples])",
              op, segments->causal ? "causal" : "full", d.causal ? "causal" : "full");
  FORGE_CHECK(segments->device == device && segments->batch == d.batch && segments->queries == d.queries &&
                  segments->position == d.position && segments->kv_seq == d.kv_seq &&
                  segments->qkv_width == (d.q_heads + 2 * d.kv_heads) * d.head_dim,
              "{}: segments of {} queries at position {} of [{}, {}] rows ({} elements per token) on {}, not the "
              "chunk's {} queries at position {} of [{}, {}] ({} elements per token) on {}",
              op, segments->queries, segments->position, segments->batch, segments->kv_seq, segments->qkv_width,
              device_name(segments->device), d.queries, d.position, d.batch, d.kv_seq,
              (d.q_heads + 2 * d.kv_heads) * d.head_dim, device_name(device));
}

// The CPU kernel's view of the segments: each position's example start (causal) or each
// query's first key (a full chunk).
void set_cpu_segments(cpu::AttentionChunkDims& d, const AttentionChunkSegments& segments) {
  if (segments.causal)
    d.example_start = segments.example_start.data<int32_t>();
  else
    d.first_key = segments.first_key.data<int32_t>();
}

#ifdef FORGE_CUDA
cuda::AttentionProblem cuda_problem(const cpu::AttentionChunkDims& d, const AttentionChunkSegments* segments) {
  // cuDNN's fused attention rejects a single query; no chunk of a training run has one.
  if (d.queries < 2) FORGE_FAIL("chunk attention on CUDA needs at least 2 queries, got {}", d.queries);
  cuda::AttentionProblem p{d.batch, d.queries, d.q_heads, d.kv_heads, d.head_dim, d.head_dim, d.window, d.scale};
  p.chunk = {d.position, d.kv_seq};
  p.causal = d.causal;
  if (segments) {
    p.ragged = {segments->capacity, segments->q_lengths.data<int32_t>(), segments->q_offsets.data<int64_t>(),
                segments->out_offsets.data<int64_t>(), segments->lse_offsets.data<int64_t>()};
    p.chunk.kv_lengths = segments->kv_lengths.data<int32_t>();
    p.chunk.kv_offsets = segments->kv_offsets.data<int64_t>();
  }
  return p;
}
#endif

}  // namespace

namespace {

// The segments' dimensions, checked, and each position's example's first position [B, S].
AttentionChunkSegments chunk_segments_of(const Tensor& segment_ids, int64_t position, int64_t queries,
                                         const AttentionShape& shape, Device device, std::vector<int32_t>& start) {
  expect_tensor(segment_ids, Device::CPU, DType::I32, "attention_chunk_segments segment_ids");
  FORGE_CHECK(segment_ids.ndim() == 2 && segment_ids.numel() > 0,
              "attention_chunk_segments: segment ids {} must be [B, S]", shape_str(segment_ids.shape()));
  FORGE_CHECK(shape.head_dim > 0 && !shape.distinct_v_head_dim() && shape.num_q_heads > 0 && shape.num_kv_heads > 0,
              "attention_chunk_segments: the shape must set head_dim (one for queries, keys and values) and the "
              "heads, got head dims {} and {}, {} and {} heads",
              shape.head_dim, shape.v_head_dim, shape.num_q_heads, shape.num_kv_heads);
  AttentionChunkSegments s;
  s.device = device;
  s.batch = segment_ids.dim(0);
  s.kv_seq = segment_ids.dim(1);
  s.position = position;
  s.queries = queries;
  FORGE_CHECK(position >= 0 && queries > 0 && position + queries <= s.kv_seq,
              "attention_chunk_segments: a chunk of {} queries at position {} is not within rows of {} positions",
              queries, position, s.kv_seq);
  s.qkv_width = (shape.num_q_heads + 2 * shape.num_kv_heads) * shape.head_dim;
  const int32_t* ids = segment_ids.data<int32_t>();
  start.assign(static_cast<size_t>(s.batch * s.kv_seq), 0);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.kv_seq; ++t) {
      const int64_t i = b * s.kv_seq + t;
      start[static_cast<size_t>(i)] =
          t == 0 || ids[i] != ids[i - 1] ? static_cast<int32_t>(t) : start[static_cast<size_t>(i - 1)];
    }
  return s;
}

// One sequence of the ragged form: its row, its first query (of the chunk) and first key (of
// kv's row), and their counts.
struct RaggedSequence {
  int64_t row, first_query, queries, first_key, keys;
};

// The examples the causal chunk meets (NOTE [Chunk attention with packed examples]), row by
// row: each one's queries in the chunk and its keys from its first position to the chunk's end.
std::vector<RaggedSequence> chunk_examples(const AttentionChunkSegments& s, const std::vector<int32_t>& start) {
  std::vector<RaggedSequence> examples;
  const int64_t chunk_end = s.position + s.queries;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = s.position; t < chunk_end; ++t) {
      const int64_t first = start[static_cast<size_t>(b * s.kv_seq + t)];
      if (t == s.position || first == t) examples.push_back({b, t - s.position, 0, first, 0});
      examples.back().queries = t + 1 - s.position - examples.back().first_query;
      examples.back().keys = t + 1 - examples.back().first_key;
    }
  return examples;
}

// CUDA's ragged description of the sequences into s, on the host.
void describe_ragged(AttentionChunkSegments& s, const std::vector<RaggedSequence>& sequences,
                     const AttentionShape& shape) {
  s.num_examples = static_cast<int64_t>(sequences.size());
  s.capacity = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(s.num_examples)));
  const int64_t d = shape.head_dim, kv_width = 2 * shape.num_kv_heads * d, out_width = shape.num_q_heads * d;
  s.q_lengths = Tensor::empty({s.capacity}, DType::I32);
  s.kv_lengths = Tensor::empty({s.capacity}, DType::I32);
  for (Tensor* t : {&s.q_offsets, &s.out_offsets, &s.lse_offsets, &s.kv_offsets})
    *t = Tensor::empty({s.capacity + 1}, DType::I64);
  for (int64_t e = 0; e <= s.capacity; ++e) {
    // The chunk's token (of [0, B Lq)) and the row's token (of [0, B S)) the sequence starts
    // at; the empty ones past the examples start at the ends.
    int64_t chunk_token = s.batch * s.queries, row_token = s.batch * s.kv_seq, q_length = 0, kv_length = 0;
    if (e < s.num_examples) {
      const RaggedSequence& x = sequences[static_cast<size_t>(e)];
      chunk_token = x.row * s.queries + x.first_query;
      row_token = x.row * s.kv_seq + x.first_key;
      q_length = x.queries;
      kv_length = x.keys;
    }
    if (e < s.capacity) {
      s.q_lengths.data<int32_t>()[e] = static_cast<int32_t>(q_length);
      s.kv_lengths.data<int32_t>()[e] = static_cast<int32_t>(kv_length);
    }
    s.q_offsets.data<int64_t>()[e] = chunk_token * s.qkv_width;
    s.out_offsets.data<int64_t>()[e] = chunk_token * out_width;
    s.lse_offsets.data<int64_t>()[e] = chunk_token * shape.num_q_heads;
    s.kv_offsets.data<int64_t>()[e] = row_token * kv_width;
  }
}

// The arrays of CUDA's ragged description (none for a chunk never described).
std::vector<Tensor*> ragged_arrays(AttentionChunkSegments& s) {
  return s.capacity == 0 ? std::vector<Tensor*>{}
                         : std::vector<Tensor*>{&s.q_lengths, &s.kv_lengths, &s.q_offsets, &s.out_offsets,
                                                &s.lse_offsets, &s.kv_offsets};
}

void upload(AttentionChunkSegments& s, Device device) {
  for (Tensor* t : ragged_arrays(s)) *t = t->to(device);
}

// A pair's segments (NOTE [Full chunk attention with packed examples]): the causal chunk of
// the query chunk's own positions, or the full chunk of a key chunk wholly in its past; on the
// host, the CPU's form, or CUDA's when `ragged`.
AttentionChunkSegments pair_segments(const Tensor& segment_ids, int64_t query_position, int64_t key_position,
                                     int64_t length, const AttentionShape& shape, bool ragged) {
  FORGE_CHECK(key_position == query_position || (key_position >= 0 && key_position + length <= query_position),
              "attention_chunk_pair_segments: the key chunk [{}, {}) must be the query chunk [{}, {}) or lie wholly "
              "before it",
              key_position, key_position + length, query_position, query_position + length);
  std::vector<int32_t> start;
  AttentionChunkSegments row = chunk_segments_of(segment_ids, query_position, length, shape, Device::CPU, start);
  AttentionChunkSegments s = row;
  s.position = 0;
  s.kv_seq = length;
  std::vector<RaggedSequence> sequences;
  if (key_position == query_position) {  // each example from its first position in the chunk
    for (RaggedSequence x : chunk_examples(row, start)) {
      x.first_key = std::max<int64_t>(x.first_key - query_position, 0);
      x.keys = x.first_query + x.queries - x.first_key;
      sequences.push_back(x);
    }
    if (!ragged) {
      s.example_start = Tensor::empty({s.batch, length}, DType::I32);
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t j = 0; j < length; ++j)
          s.example_start.data<int32_t>()[b * length + j] = static_cast<int32_t>(
              std::max<int64_t>(start[static_cast<size_t>(b * row.kv_seq + query_position + j)] - query_position, 0));
    }
  } else {
    s.causal = false;
    s.first_key = Tensor::empty({s.batch, length}, DType::I32);
    for (int64_t b = 0; b < s.batch; ++b) {
      RaggedSequence x{b, 0, 0, length, 0};
      for (int64_t i = 0; i < length; ++i) {
        const int64_t first = start[static_cast<size_t>(b * row.kv_seq + query_position + i)] - key_position;
        const int64_t key = std::clamp<int64_t>(first, 0, length);  // length: the example began after the keys
        s.first_key.data<int32_t>()[b * length + i] = static_cast<int32_t>(key);
        if (key < length) {
          x.first_key = key;
          x.queries = i + 1;
        }
      }
      x.keys = length - x.first_key;
      if (x.queries > 0) sequences.push_back(x);
    }
  }
  if (ragged) {
    s.first_key = Tensor();
    describe_ragged(s, sequences, shape);
  } else {
    s.num_examples = static_cast<int64_t>(sequences.size());
  }
  return s;
}

}  // namespace

AttentionChunkSegments attention_chunk_segments(const Tensor& segment_ids, int64_t position, int64_t queries,
                                                const AttentionShape& shape, Device device) {
  std::vector<int32_t> start;
  AttentionChunkSegments s = chunk_segments_of(segment_ids, position, queries, shape, device, start);
  if (device == Device::CPU) {
    s.example_start = Tensor::empty({s.batch, s.kv_seq}, DType::I32);
    std::copy(start.begin(), start.end(), s.example_start.data<int32_t>());
    return s;
  }
  describe_ragged(s, chunk_examples(s, start), shape);
  upload(s, device);
  return s;
}

AttentionChunkSegments attention_chunk_ragged_on_host(const Tensor& segment_ids, int64_t position, int64_t queries,
                                                      const AttentionShape& shape) {
  std::vector<int32_t> start;
  AttentionChunkSegments s = chunk_segments_of(segment_ids, position, queries, shape, Device::CPU, start);
  describe_ragged(s, chunk_examples(s, start), shape);
  return s;
}

AttentionChunkSegments attention_chunk_pair_segments(const Tensor& segment_ids, int64_t query_position,
                                                     int64_t key_position, int64_t length,
                                                     const AttentionShape& shape, Device device) {
  AttentionChunkSegments s =
      pair_segments(segment_ids, query_position, key_position, length, shape, device != Device::CPU);
  s.device = device;
  if (device != Device::CPU) upload(s, device);
  return s;
}

AttentionChunkSegments attention_chunk_pair_ragged_on_host(const Tensor& segment_ids, int64_t query_position,
                                                           int64_t key_position, int64_t length,
                                                           const AttentionShape& shape) {
  return pair_segments(segment_ids, query_position, key_position, length, shape, true);
}

Tensor upload_chunk_segments(std::vector<AttentionChunkSegments>& segments, Device device) {
  auto aligned = [](size_t bytes) { return (bytes + 7) / 8 * 8; };  // every array at 8 bytes
  size_t total = 0;
  for (AttentionChunkSegments& s : segments)
    for (Tensor* t : ragged_arrays(s)) total += aligned(t->nbytes());
  Tensor host = Tensor::zeros({static_cast<int64_t>(std::max<size_t>(total, 1))}, DType::U8);
  size_t at = 0;
  for (AttentionChunkSegments& s : segments)
    for (Tensor* t : ragged_arrays(s)) {
      if (t->nbytes() > 0) std::memcpy(host.data<uint8_t>() + at, t->raw(), t->nbytes());
      at += aligned(t->nbytes());
    }
  Tensor buffer = host.to(device);
  at = 0;
  for (AttentionChunkSegments& s : segments) {
    if (s.capacity > 0) s.device = device;
    for (Tensor* t : ragged_arrays(s)) {
      const size_t bytes = t->nbytes();
      *t = Tensor::wrap(buffer.data<uint8_t>() + at, t->shape(), t->dtype(), device);
      at += aligned(bytes);
    }
  }
  return buffer;
}

void attention_chunk_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             int64_t position, const AttentionShape& shape, const AttentionChunkSegments* segments) {
  OpProfileScope profile(OpClass::Attention, "attention_chunk_forward");
  cpu::AttentionChunkDims d = chunk_dims(qkv, kv, position, shape, "attention_chunk_forward");
  check_segments(segments, d, qkv.device(), "attention_chunk_forward");
  check_shape(out, {d.batch, d.queries, d.q_heads, d.head_dim}, "attention_chunk_forward out");
  check_shape(lse, {d.batch, d.q_heads, d.queries}, "attention_chunk_forward lse");
  const bool cuda = qkv.device() == Device::CUDA;
  const DType act = cuda ? DType::BF16 : DType::F32;
  expect_tensor(out, qkv.device(), act, "attention_chunk_forward out");
  expect_tensor(lse, qkv.device(), DType::F32, "attention_chunk_forward lse");
  expect_tensor(qkv, qkv.device(), act, "attention_chunk_forward qkv");
  expect_tensor(kv, qkv.device(), act, "attention_chunk_forward kv");
  if (cuda) {
    FORGE_CUDA_CALL(
        "attention_chunk_forward",
        cuda::attention_chunk_forward(bf16_ptr(out), lse.data<float>(), bf16_ptr(qkv), bf16_ptr(kv),
                                      cuda_problem(d, segments)));
    return;
  }
  if (segments) set_cpu_segments(d, *segments);
  cpu::attention_chunk_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), kv.data<float>(), d);
}

void attention_chunk_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& kv, const Tensor& out, const Tensor& lse, int64_t position,
                              const AttentionShape& shape, const AttentionChunkSegments* segments) {
  OpProfileScope profile(OpClass::Attention, "attention_chunk_backward");
  cpu::AttentionChunkDims d = chunk_dims(qkv, kv, position, shape, "attention_chunk_backward");
  check_segments(segments, d, qkv.device(), "attention_chunk_backward");
  check_shape(dqkv, qkv.shape(), "attention_chunk_backward dqkv");
  check_shape(dkv, kv.shape(), "attention_chunk_backward dkv");
  check_shape(dout, {d.batch, d.queries, d.q_heads, d.head_dim}, "attention_chunk_backward dout");
  check_shape(out, dout.shape(), "attention_chunk_backward out");
  check_shape(lse, {d.batch, d.q_heads, d.queries}, "attention_chunk_backward lse");
  FORGE_CHECK(dqkv.raw() != qkv.raw() && dkv.raw() != kv.raw(),
              "attention_chunk_backward: dqkv and dkv must not alias qkv and kv");
  const bool cuda = qkv.device() == Device::CUDA;
  const DType act = cuda ? DType::BF16 : DType::F32;
  expect_tensor(dqkv, qkv.device(), act, "attention_chunk_backward dqkv");
  expect_tensor(dkv, qkv.device(), act, "attention_chunk_backward dkv");
  expect_tensor(dout, qkv.device(), act, "attention_chunk_backward dout");
  expect_tensor(qkv, qkv.device(), act, "attention_chunk_backward qkv");
  expect_tensor(kv, qkv.device(), act, "attention_chunk_backward kv");
  expect_tensor(out, qkv.device(), act, "attention_chunk_backward out");
  expect_tensor(lse, qkv.device(), DType::F32, "attention_chunk_backward lse");
  if (cuda) {
    FORGE_CUDA_CALL("attention_chunk_backward",
                    cuda::attention_chunk_backward(bf16_ptr(dqkv), bf16_ptr(dkv), bf16_ptr(dout), bf16_ptr(qkv),
                                                   bf16_ptr(kv), bf16_ptr(out), lse.data<float>(),
                                                   cuda_problem(d, segments)));
    return;
  }
  if (segments) set_cpu_segments(d, *segments);
  cpu::attention_chunk_backward(dqkv.data<float>(), dkv.data<float>(), dout.data<float>(), qkv.data<float>(),
                                kv.data<float>(), out.data<float>(), lse.data<float>(), d);
}

}  // namespace forge
