#include "ops/attention.h"

#include <bit>
#include <vector>

#include "kernels/cpu/attention.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/attention.h"
#endif

namespace forge {

namespace {

// Elements per token of qkv and of out under `shape` (head_dim set).
int64_t qkv_width(const AttentionShape& shape) {
  const int64_t v_head_dim = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
  return (shape.num_q_heads + shape.num_kv_heads) * shape.head_dim + shape.num_kv_heads * v_head_dim;
}
int64_t out_width(const AttentionShape& shape) {
  return shape.num_q_heads * (shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim);
}

}  // namespace

Shape AttentionShape::qkv_shape(int64_t batch, int64_t seq) const {
  FORGE_CHECK(head_dim > 0, "AttentionShape::qkv_shape needs head_dim, got {}", head_dim);
  if (distinct_v_head_dim()) return {batch, seq, qkv_width(*this)};
  return {batch, seq, num_q_heads + 2 * num_kv_heads, head_dim};
}

Shape AttentionShape::out_shape(int64_t batch, int64_t seq) const {
  FORGE_CHECK(head_dim > 0, "AttentionShape::out_shape needs head_dim, got {}", head_dim);
  return {batch, seq, num_q_heads, v_head_dim > 0 ? v_head_dim : head_dim};
}

void check_attention_shape(const Tensor& qkv, const AttentionShape& shape, const char* op) {
  FORGE_CHECK(shape.num_kv_heads > 0 && shape.num_q_heads > 0 && shape.num_q_heads % shape.num_kv_heads == 0,
              "{}: {} query heads do not split into groups over {} kv heads", op, shape.num_q_heads,
              shape.num_kv_heads);
  FORGE_CHECK(shape.sliding_window >= 0, "{}: sliding window {} is negative", op, shape.sliding_window);
  FORGE_CHECK(shape.causal || shape.sliding_window == 0,
              "{}: a sliding window ({}) needs causal attention (NOTE [Bidirectional attention])", op,
              shape.sliding_window);
  FORGE_CHECK(shape.scale > 0.0f, "{}: scale {} must be positive", op, shape.scale);
  FORGE_CHECK(shape.head_dim >= 0 && shape.v_head_dim >= 0, "{}: head_dim {} and v_head_dim {} must not be negative",
              op, shape.head_dim, shape.v_head_dim);
  const int64_t hq = shape.num_q_heads, hkv = shape.num_kv_heads;
  if (shape.distinct_v_head_dim()) {
    FORGE_CHECK(shape.head_dim > 0, "{}: v_head_dim {} needs head_dim, the query/key head dim, set too", op,
                shape.v_head_dim);
    FORGE_CHECK(qkv.ndim() == 3 && qkv.dim(2) == qkv_width(shape),
                "{}: qkv {} must be [B, T, ({} + {}) * {} + {} * {}] = [B, T, {}]: queries and keys of head dim {}, "
                "values of v_head_dim {}",
                op, shape_str(qkv.shape()), hq, hkv, shape.head_dim, hkv, shape.v_head_dim, qkv_width(shape),
                shape.head_dim, shape.v_head_dim);
    return;
  }
  FORGE_CHECK(qkv.ndim() == 4 && qkv.dim(2) == hq + 2 * hkv,
              "{}: qkv {} must be [B, T, {} + 2 * {}, D]{}", op, shape_str(qkv.shape()), hq, hkv,
              qkv.ndim() == 3 ? " (a 3-D qkv holds values of their own head dim: set v_head_dim and head_dim)" : "");
  FORGE_CHECK(shape.head_dim == 0 || qkv.dim(3) == shape.head_dim, "{}: qkv {} has head dim {}, the shape says {}",
              op, shape_str(qkv.shape()), qkv.dim(3), shape.head_dim);
}

namespace {

cpu::AttentionDims attention_dims(const Tensor& qkv, const AttentionShape& shape, const char* op) {
  check_attention_shape(qkv, shape, op);
  const bool distinct = shape.distinct_v_head_dim();
  return cpu::AttentionDims{.batch = qkv.dim(0),
                            .seq = qkv.dim(1),
                            .q_heads = shape.num_q_heads,
                            .kv_heads = shape.num_kv_heads,
                            .head_dim = distinct ? shape.head_dim : qkv.dim(3),
                            .v_head_dim = distinct ? shape.v_head_dim : qkv.dim(3),
                            .window = shape.sliding_window,
                            .scale = shape.scale,
                            .causal = shape.causal};
}

// The segments must describe this qkv's rows, on its device.
void check_segments(const AttentionSegments* segments, const cpu::AttentionDims& d, Device device, const char* op) {
  if (!segments) return;
  FORGE_CHECK(segments->device == device && segments->batch == d.batch && segments->seq == d.seq,
              "{}: segments for [{}, {}] on {}, qkv [{}, {}] on {}", op, segments->batch, segments->seq,
              device_name(segments->device), d.batch, d.seq, device_name(device));
  const int64_t width = (d.q_heads + d.kv_heads) * d.head_dim + d.kv_heads * d.v_head_dim;
  FORGE_CHECK(segments->qkv_width == width && segments->out_width == d.q_heads * d.v_head_dim,
              "{}: segments for tokens of {} qkv and {} out elements, these have {} and {}", op, segments->qkv_width,
              segments->out_width, width, d.q_heads * d.v_head_dim);
}

#ifdef FORGE_CUDA
cuda::AttentionProblem cuda_problem(const cpu::AttentionDims& d, const AttentionSegments* segments) {
  // cuDNN's fused attention rejects a single-token sequence; no training run has one.
  if (d.seq < 2) FORGE_FAIL("attention on CUDA needs a sequence of at least 2 tokens, got {}", d.seq);
  cuda::AttentionProblem p{d.batch, d.seq, d.q_heads, d.kv_heads, d.head_dim, d.v_head_dim, d.window, d.scale};
  p.causal = d.causal;
  if (segments)
    p.ragged = {segments->capacity, segments->lengths.data<int32_t>(), segments->qkv_offsets.data<int64_t>(),
                segments->out_offsets.data<int64_t>(), segments->lse_offsets.data<int64_t>()};
  return p;
}
#endif

}  // namespace

AttentionSegments attention_segments(const Tensor& segment_ids, const AttentionShape& shape, Device device) {
  expect_tensor(segment_ids, Device::CPU, DType::I32, "attention_segments segment_ids");
  FORGE_CHECK(segment_ids.ndim() == 2 && segment_ids.numel() > 0, "attention_segments: segment ids {} must be [B, T]",
              shape_str(segment_ids.shape()));
  FORGE_CHECK(shape.head_dim > 0 && shape.v_head_dim >= 0,
              "attention_segments: the shape must set head_dim (and v_head_dim >= 0), got {} and {}", shape.head_dim,
              shape.v_head_dim);
  AttentionSegments s;
  s.device = device;
  s.batch = segment_ids.dim(0);
  s.seq = segment_ids.dim(1);
  s.qkv_width = qkv_width(shape);
  s.out_width = out_width(shape);
  const int32_t* ids = segment_ids.data<int32_t>();
  std::vector<int32_t> start(static_cast<size_t>(s.batch * s.seq));
  std::vector<int64_t> first_tokens;  // of each example, in [0, B * T)
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.seq; ++t) {
      const int64_t i = b * s.seq + t;
      const bool begins = t == 0 || ids[i] != ids[i - 1];
      start[static_cast<size_t>(i)] = begins ? static_cast<int32_t>(t) : start[static_cast<size_t>(i - 1)];
      if (begins) first_tokens.push_back(i);
    }
  s.num_examples = static_cast<int64_t>(first_tokens.size());
  if (device == Device::CPU) {
    s.example_start = Tensor::empty({s.batch, s.seq}, DType::I32);
    std::copy(start.begin(), start.end(), s.example_start.data<int32_t>());
    return s;
  }
  s.capacity = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(s.num_examples)));
  const int64_t tokens = s.batch * s.seq;
  Tensor lengths = Tensor::empty({s.capacity}, DType::I32), qkv = Tensor::empty({s.capacity + 1}, DType::I64),
         out = Tensor::empty({s.capacity + 1}, DType::I64), lse = Tensor::empty({s.capacity + 1}, DType::I64);
  for (int64_t e = 0; e <= s.capacity; ++e) {
    const int64_t first = e < s.num_examples ? first_tokens[static_cast<size_t>(e)] : tokens;
    if (e < s.capacity) {
      const int64_t next = e + 1 < s.num_examples ? first_tokens[static_cast<size_t>(e + 1)] : tokens;
      lengths.data<int32_t>()[e] = static_cast<int32_t>(e < s.num_examples ? next - first : 0);
    }
    qkv.data<int64_t>()[e] = first * s.qkv_width;
    out.data<int64_t>()[e] = first * s.out_width;
    lse.data<int64_t>()[e] = first * shape.num_q_heads;
  }
  s.lengths = lengths.to(device);
  s.qkv_offsets = qkv.to(device);
  s.out_offsets = out.to(device);
  s.lse_offsets = lse.to(device);
  return s;
}

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& shape,
                       const AttentionSegments* segments) {
  OpProfileScope profile(OpClass::Attention, "attention_forward");
  cpu::AttentionDims dims = attention_dims(qkv, shape, "attention_forward");
  check_segments(segments, dims, qkv.device(), "attention_forward");
  check_shape(out, {dims.batch, dims.seq, dims.q_heads, dims.v_head_dim}, "attention_forward out");
  check_shape(lse, {dims.batch, dims.q_heads, dims.seq}, "attention_forward lse");
  if (qkv.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "attention_forward out");
    expect_tensor(lse, Device::CUDA, DType::F32, "attention_forward lse");
    expect_tensor(qkv, Device::CUDA, DType::BF16, "attention_forward qkv");
    FORGE_CUDA_CALL("attention_forward",
                    cuda::attention_forward(static_cast<cuda::bf16*>(out.raw()), lse.data<float>(),
                                            static_cast<const cuda::bf16*>(qkv.raw()), cuda_problem(dims, segments)));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "attention_forward out");
  expect_tensor(lse, Device::CPU, DType::F32, "attention_forward lse");
  expect_tensor(qkv, Device::CPU, DType::F32, "attention_forward qkv");
  if (segments) dims.example_start = segments->example_start.data<int32_t>();
  cpu::attention_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), dims);
}

void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const AttentionShape& shape, const AttentionSegments* segments) {
  OpProfileScope profile(OpClass::Attention, "attention_backward");
  cpu::AttentionDims dims = attention_dims(qkv, shape, "attention_backward");
  check_segments(segments, dims, qkv.device(), "attention_backward");
  check_shape(dqkv, qkv.shape(), "attention_backward dqkv");
  check_shape(dout, {dims.batch, dims.seq, dims.q_heads, dims.v_head_dim}, "attention_backward dout");
  check_shape(out, dout.shape(), "attention_backward out");
  check_shape(lse, {dims.batch, dims.q_heads, dims.seq}, "attention_backward lse");
  FORGE_CHECK(dqkv.raw() != qkv.raw(), "attention_backward: dqkv must not alias qkv");
  if (qkv.device() == Device::CUDA) {
    expect_tensor(dqkv, Device::CUDA, DType::BF16, "attention_backward dqkv");
    expect_tensor(dout, Device::CUDA, DType::BF16, "attention_backward dout");
    expect_tensor(qkv, Device::CUDA, DType::BF16, "attention_backward qkv");
    expect_tensor(out, Device::CUDA, DType::BF16, "attention_backward out");
    expect_tensor(lse, Device::CUDA, DType::F32, "attention_backward lse");
    FORGE_CUDA_CALL("attention_backward",
                    cuda::attention_backward(static_cast<cuda::bf16*>(dqkv.raw()),
                                             static_cast<const cuda::bf16*>(dout.raw()),
                                             static_cast<const cuda::bf16*>(qkv.raw()),
                                             static_cast<const cuda::bf16*>(out.raw()), lse.data<float>(),
                                             cuda_problem(dims, segments)));
    return;
  }
  expect_tensor(dqkv, Device::CPU, DType::F32, "attention_backward dqkv");
  expect_tensor(dout, Device::CPU, DType::F32, "attention_backward dout");
  expect_tensor(qkv, Device::CPU, DType::F32, "attention_backward qkv");
  expect_tensor(out, Device::CPU, DType::F32, "attention_backward out");
  expect_tensor(lse, Device::CPU, DType::F32, "attention_backward lse");
  if (segments) dims.example_start = segments->example_start.data<int32_t>();
  cpu::attention_backward(dqkv.data<float>(), dout.data<float>(), qkv.data<float>(), out.data<float>(),
                          lse.data<float>(), dims);
}

}  // namespace forge
