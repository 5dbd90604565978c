#include "ops/moe.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "core/op_profile.h"
#include "kernels/cpu/moe.h"
#include "ops/lora_experts.h"
#include "ops/matmul.h"
#include "ops/placement.h"
#include "ops/swiglu.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/moe.h"
#endif

namespace forge {
namespace {

// Token rows are fp32 on the CPU and bf16 on CUDA (NOTE [Op placement]).
DType row_dtype(Device device) { return device == Device::CUDA ? DType::BF16 : DType::F32; }


// NOTE [MoE expert GEMMs]: the rows every expert has when all have the same (padding to
// capacity, NOTE [MoE capacity]), so that their GEMMs run batched; 0 otherwise.
int64_t uniform_expert_rows(const MoeRouting& r) {
  if (r.experts < 2) return 0;
  const int64_t rows = r.rows(0);
  for (int64_t e = 1; e < r.experts; ++e)
    if (r.rows(e) != rows) return 0;
  return rows;
}

// The first experts x rows rows of a permuted buffer [rows, width] as [experts, rows, width].
Tensor by_expert(const Tensor& t, int64_t experts, int64_t rows) {
  return t.narrow(0, experts * rows).view({experts, rows, t.dim(1)});
}

void check_experts(const MoeExpertWeights& w, const MoeRouting& r, int64_t hidden, const char* op) {
  FORGE_CHECK(w.gate_up.ndim() == 3 && w.down.ndim() == 3 && w.gate_up.dim(0) == r.experts &&
                  w.down.dim(0) == r.experts && w.gate_up.dim(2) == hidden && w.down.dim(1) == hidden &&
                  w.gate_up.dim(1) == 2 * w.down.dim(2),
              "{}: expert weights gate_up {} and down {} must be [{}, 2F, {}] and [{}, {}, F]", op,
              shape_str(w.gate_up.shape()), shape_str(w.down.shape()), r.experts, hidden, r.experts, hidden);
}

// The expert ops read only the experts' row offsets, which must lie within the buffers'
// rows (a layer's routing, or expert parallelism's local one: NOTE [Expert parallelism]).
void check_expert_offsets(const MoeRouting& r, int64_t rows, const char* op) {
  FORGE_CHECK(r.experts >= 0 && r.offsets.size() == static_cast<size_t>(r.experts + 1) && r.offsets.front() == 0 &&
                  r.offsets.back() <= rows,
              "{}: {} expert offsets ending at {} for buffers of {} rows", op, r.offsets.size(),
              r.offsets.empty() ? 0 : r.offsets.back(), rows);
}

void check_routing(const MoeRouting& r, const char* op) {
  FORGE_CHECK(r.offsets.size() == static_cast<size_t>(r.experts + 1) && r.source.numel() == r.permuted_rows() &&
                  r.row_of.numel() == r.tokens * r.k,
              "{}: the routing is not from moe_route", op);
}

// Padding's offsets, e x capacity: known without the device (NOTE [MoE capacity]).
std::vector<int64_t> padded_offsets(int64_t experts, int64_t capacity) {
  std::vector<int64_t> offsets(static_cast<size_t>(experts + 1));
  for (int64_t e = 0; e <= experts; ++e) offsets[static_cast<size_t>(e)] = e * capacity;
  return offsets;
}

// The routing's sort by expert, from its expert_ids, then when dropping the drop by the
// policy (NOTE [MoE capacity]); on CUDA the offsets are copied to the host (the routing's one
// synchronization), except with padding, whose offsets the host knows.
void sort_by_expert(MoeRouting& r, bool by_position) {
  const size_t n = static_cast<size_t>(r.experts + 1);
  r.offsets.assign(n, 0);
  const bool drop = r.dropping;
  if (r.probs.device() == Device::CUDA) {
    int64_t* kept = r.device_offsets.data<int64_t>();
    [[maybe_unused]] int64_t* assigned = drop ? kept + n : kept;
    FORGE_CUDA_CALL("moe_route", cuda::moe_sort_by_expert(r.expert_ids.data<int32_t>(), r.tokens, r.k, r.experts,
                                                          assigned,
                                                          drop ? r.sorted.data<int32_t>() : r.source.data<int32_t>(),
                                                          r.row_of.data<int32_t>()));
    if (drop)
      FORGE_CUDA_CALL("moe_route",
                      cuda::moe_drop_to_capacity(r.sorted.data<int32_t>(), assigned, r.weights.data<float>(), r.tokens,
                                                 r.k, r.experts, r.capacity, by_position, r.pad, kept,
                                                 r.source.data<int32_t>(), r.row_of.data<int32_t>()));
    if (r.pad) {
      r.offsets = padded_offsets(r.experts, r.capacity);
      return;
    }
    std::vector<int64_t> both(drop ? 2 * n : n);
    copy_bytes(both.data(), Device::CPU, r.device_offsets.raw(), Device::CUDA, both.size() * sizeof(int64_t));
    r.offsets.assign(both.begin(), both.begin() + static_cast<std::ptrdiff_t>(n));
    if (drop) {
      r.kept_offsets = r.offsets;
      r.assigned_offsets.assign(both.begin() + static_cast<std::ptrdiff_t>(n), both.end());
    }
    return;
  }
  if (!drop) {
    cpu::moe_sort_by_expert(r.expert_ids.data<int32_t>(), r.tokens, r.k, r.experts, r.offsets.data(),
                            r.source.data<int32_t>(), r.row_of.data<int32_t>());
    return;
  }
  std::vector<int32_t> sorted(static_cast<size_t>(r.tokens * r.k));
  r.assigned_offsets.assign(n, 0);
  r.kept_offsets.assign(n, 0);
  cpu::moe_sort_by_expert(r.expert_ids.data<int32_t>(), r.tokens, r.k, r.experts, r.assigned_offsets.data(),
                          sorted.data(), r.row_of.data<int32_t>());
  cpu::moe_drop_to_capacity(sorted.data(), r.assigned_offsets.data(), r.weights.data<float>(), r.tokens, r.k,
                            r.experts, r.capacity, by_position, r.pad, r.kept_offsets.data(),
                            r.source.data<int32_t>(), r.row_of.data<int32_t>());
  r.offsets = r.pad ? padded_offsets(r.experts, r.capacity) : r.kept_offsets;
}

// The hidden width shared by a token tensor [tokens, hidden] and a row tensor [tokens * k,
// hidden] of the routing (permuted order), both on the routing's device in its row dtype;
// refused otherwise, naming each.
int64_t token_and_row_width(const MoeRouting& r, const char* op, const Tensor& by_token, const char* token_name,
                            const Tensor& by_row, const char* row_name) {
  check_routing(r, op);
  FORGE_CHECK(by_token.ndim() == 2 && by_token.dim(0) == r.tokens, "{}: {} {} must be [{}, hidden]", op, token_name,
              shape_str(by_token.shape()), r.tokens);
  const int64_t hidden = by_token.dim(1);
  check_shape(by_row, {r.permuted_rows(), hidden}, fmt::format("{} {}", op, row_name).c_str());
  const Device device = r.probs.device();
  expect_tensor(by_token, device, row_dtype(device), fmt::format("{} {}", op, token_name).c_str());
  expect_tensor(by_row, device, row_dtype(device), fmt::format("{} {}", op, row_name).c_str());
  FORGE_CHECK(device == Device::CPU || hidden % 8 == 0, "{}: hidden {} must be a multiple of 8 on CUDA", op, hidden);
  return hidden;
}

// A routing of logits [tokens, experts], its outputs in `buffers` (checked) or, on the CPU
// without them, allocated, before the router fills them.
MoeRouting new_routing(const Tensor& logits, int64_t k, bool normalize, const MoeRoutingBuffers& buffers,
                       const MoeCapacity& capacity, const char* op) {
  FORGE_CHECK(logits.ndim() == 2, "{}: logits {} must be [tokens, experts]", op, shape_str(logits.shape()));
  const Device device = logits.device();
  expect_tensor(logits, device, DType::F32, op);
  MoeRouting r;
  r.tokens = logits.dim(0);
  r.experts = logits.dim(1);
  r.k = k;
  r.normalize = normalize;
  FORGE_CHECK(capacity.factor >= 0 && std::isfinite(capacity.factor) && (capacity.factor > 0 || !capacity.pad),
              "{}: capacity factor {} (0: dropless) with padding {}", op, capacity.factor, capacity.pad);
  const int64_t kept = std::max<int64_t>(k, 0);
  r.dropping = capacity.factor > 0;
  r.capacity = r.experts > 0 ? capacity.capacity(r.tokens, kept, r.experts) : 0;
  r.pad = capacity.pad;
  const int64_t rows = r.permuted_rows();
  if (!buffers.defined()) {
    FORGE_CHECK(device == Device::CPU, "{}: a routing on CUDA is written into buffers laid out by the caller", op);
    r.probs = Tensor::empty({r.tokens, r.experts});
    r.lse = Tensor::empty({r.tokens});
    r.expert_ids = Tensor::empty({r.tokens, kept}, DType::I32);
    r.weights = Tensor::empty({r.tokens, kept});
    r.source = Tensor::empty({rows}, DType::I32);
    r.row_of = Tensor::empty({r.tokens * kept}, DType::I32);
    return r;
  }
  auto take = [&](const Tensor& t, Shape shape, DType dtype, const char* name) {
    check_shape(t, shape, fmt::format("{} buffer {}", op, name).c_str());
    expect_tensor(t, device, dtype, fmt::format("{} buffer {}", op, name).c_str());
    return t;
  };
  r.probs = take(buffers.probs, {r.tokens, r.experts}, DType::F32, "probs");
  r.expert_ids = take(buffers.expert_ids, {r.tokens, kept}, DType::I32, "expert_ids");
  r.weights = take(buffers.weights, {r.tokens, kept}, DType::F32, "weights");
  r.source = take(buffers.source, {rows}, DType::I32, "source");
  r.row_of = take(buffers.row_of, {r.tokens * kept}, DType::I32, "row_of");
  if (buffers.lse.defined()) r.lse = take(buffers.lse, {r.tokens}, DType::F32, "lse");
  if (device == Device::CUDA) {
    FORGE_CHECK(r.experts <= 1024, "{}: {} experts; the CUDA router takes at most 1024", op, r.experts);
    r.device_offsets = capacity.factor > 0 ? take(buffers.offsets, {2, r.experts + 1}, DType::I64, "offsets")
                                           : take(buffers.offsets, {r.experts + 1}, DType::I64, "offsets");
    if (capacity.factor > 0) r.sorted = take(buffers.sorted, {r.tokens * kept}, DType::I32, "sorted");
    r.prob_sums = take(buffers.prob_sums, {r.experts}, DType::F32, "prob_sums");
  }
  return r;
}

// Group-limited routing's shape: `groups` equal groups of experts, `topk_groups` of them kept,
// holding at least k experts.
void check_groups(const char* op, int64_t experts, int64_t k, int64_t groups, int64_t topk_groups) {
  FORGE_CHECK(groups >= 1 && experts % groups == 0 && topk_groups >= 1 && topk_groups <= groups,
              "{}: {} experts in {} groups keeping {}: the groups must divide the experts and keep between 1 and all "
              "of them",
              op, experts, groups, topk_groups);
  FORGE_CHECK(k >= 1 && k <= topk_groups * (experts / groups),
              "{}: top-k {} must be between 1 and the {} experts of the {} groups kept", op, k,
              topk_groups * (experts / groups), topk_groups);
}

// The sums over tokens [first, first + count) of each expert's probability, [experts]: a
// balancing loss's P (on CUDA summed on the device into the routing's scratch, then read).
std::vector<double> prob_column_sums(const MoeRouting& r, int64_t first, int64_t count, const char* op) {
  std::vector<double> sums(static_cast<size_t>(r.experts), 0.0);
  if (r.probs.device() == Device::CUDA) {
    FORGE_CUDA_CALL(op, cuda::moe_prob_column_sums(r.probs.data<float>() + first * r.experts, count, r.experts,
                                                   r.prob_sums.data<float>()));
    const Tensor host = r.prob_sums.to(Device::CPU);
    for (int64_t e = 0; e < r.experts; ++e) sums[static_cast<size_t>(e)] = host.data<float>()[e];
    return sums;
  }
  const float* p = r.probs.data<float>();
  for (int64_t t = first; t < first + count; ++t)
    for (int64_t e = 0; e < r.experts; ++e) sums[static_cast<size_t>(e)] += p[t * r.experts + e];
  return sums;
}

}  // namespace

int64_t MoeCapacity::capacity(int64_t tokens, int64_t k, int64_t experts) const {
  if (factor <= 0.0) return 0;
  FORGE_CHECK(experts > 0 && tokens >= 0 && k >= 0, "MoE capacity: {} tokens, top-k {}, {} experts", tokens, k,
              experts);
  // Megatron's get_capacity(num_tokens = tokens * k): ceil((num_tokens / num_experts) * factor), in double.
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(tokens * k) / static_cast<double>(experts) * factor));
}

int64_t MoeCapacity::permuted_rows(int64_t tokens, int64_t k, int64_t experts) const {
  return pad ? experts * capacity(tokens, k, experts) : tokens * k;
}

MoeCounts moe_expert_counts(const MoeRouting& r) {
  check_routing(r, "moe_expert_counts");
  const size_t n = static_cast<size_t>(r.experts);
  MoeCounts c;
  c.assigned.resize(n);
  c.kept.resize(n);
  if (!r.dropping) {  // dropless: every assignment has its row
    for (int64_t e = 0; e < r.experts; ++e)
      c.assigned[static_cast<size_t>(e)] = c.kept[static_cast<size_t>(e)] = r.rows(e);
    return c;
  }
  std::vector<int64_t> kept = r.kept_offsets, assigned = r.assigned_offsets;
  if (assigned.empty()) {  // CUDA with padding: the running sums are on the device alone
    std::vector<int64_t> both(2 * (n + 1));
    copy_bytes(both.data(), Device::CPU, r.device_offsets.raw(), Device::CUDA, both.size() * sizeof(int64_t));
    kept.assign(both.begin(), both.begin() + static_cast<std::ptrdiff_t>(n + 1));
    assigned.assign(both.begin() + static_cast<std::ptrdiff_t>(n + 1), both.end());
  }
  for (size_t e = 0; e < n; ++e) {
    c.assigned[e] = assigned[e + 1] - assigned[e];
    c.kept[e] = kept[e + 1] - kept[e];
  }
  return c;
}

MoeRouting moe_route(const Tensor& logits, int64_t k, bool normalize, const MoeRoutingBuffers& buffers,
                     const MoeCapacity& capacity) {
  return moe_route_softmax(logits, k, 1, 1, normalize, 1.0f, buffers, capacity);
}

MoeRouting moe_route_softmax(const Tensor& logits, int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                             float scaling, const MoeRoutingBuffers& buffers, const MoeCapacity& capacity) {
  OpProfileScope profile(OpClass::Elementwise, "moe_route");
  MoeRouting r = new_routing(logits, k, normalize, buffers, capacity, "moe_route logits");
  r.scaling = scaling;
  FORGE_CHECK(k >= 1 && k <= r.experts, "moe_route: top-k {} must be between 1 and the {} experts", k, r.experts);
  check_groups("moe_route", r.experts, k, groups, topk_groups);
  float* lse = r.lse.defined() ? r.lse.data<float>() : nullptr;
  if (logits.device() == Device::CUDA)
    FORGE_CUDA_CALL("moe_route", cuda::moe_topk_softmax(logits.data<float>(), r.tokens, r.experts, k, normalize,
                                                        r.probs.data<float>(), r.expert_ids.data<int32_t>(),
                                                        r.weights.data<float>(), lse, groups, topk_groups, scaling));
  else
    cpu::moe_topk_softmax(logits.data<float>(), r.tokens, r.experts, k, normalize, r.probs.data<float>(),
                          r.expert_ids.data<int32_t>(), r.weights.data<float>(), lse, groups, topk_groups, scaling);
  sort_by_expert(r, capacity.by_position);
  return r;
}

MoeRouting moe_route_sigmoid(const Tensor& logits, const Tensor& bias, int64_t k, int64_t groups, int64_t topk_groups,
                             bool normalize, float scaling, const MoeRoutingBuffers& buffers,
                             const MoeCapacity& capacity) {
  OpProfileScope profile(OpClass::Elementwise, "moe_route");
  MoeRouting r = new_routing(logits, k, normalize, buffers, capacity, "moe_route_sigmoid logits");
  r.sigmoid = true;
  r.scaling = scaling;
  // The z-loss's logsumexp and softmax of the logits: kept on the CPU without buffers, and
  // where the buffers have both.
  if (!buffers.defined()) {
    r.softmax = Tensor::empty({r.tokens, r.experts});
  } else if (buffers.lse.defined() && buffers.softmax.defined()) {
    check_shape(buffers.softmax, {r.tokens, r.experts}, "moe_route_sigmoid buffer softmax");
    expect_tensor(buffers.softmax, logits.device(), DType::F32, "moe_route_sigmoid buffer softmax");
    r.softmax = buffers.softmax;
  } else {
    r.lse = Tensor();
  }
  float* lse = r.softmax.defined() ? r.lse.data<float>() : nullptr;
  float* softmax = r.softmax.defined() ? r.softmax.data<float>() : nullptr;
  check_groups("moe_route_sigmoid", r.experts, k, groups, topk_groups);
  if (bias.defined()) {
    check_shape(bias, {r.experts}, "moe_route_sigmoid bias");
    expect_tensor(bias, logits.device(), DType::F32, "moe_route_sigmoid bias");
  }
  const float* b = bias.defined() ? bias.data<float>() : nullptr;
  if (logits.device() == Device::CUDA)
    FORGE_CUDA_CALL("moe_route_sigmoid",
                    cuda::moe_topk_sigmoid(logits.data<float>(), b, r.tokens, r.experts, k, groups, topk_groups,
                                           normalize, scaling, r.probs.data<float>(), r.expert_ids.data<int32_t>(),
                                           r.weights.data<float>(), lse, softmax));
  else
    cpu::moe_topk_sigmoid(logits.data<float>(), b, r.tokens, r.experts, k, groups, topk_groups, normalize, scaling,
                          r.probs.data<float>(), r.expert_ids.data<int32_t>(), r.weights.data<float>(), lse, softmax);
  sort_by_expert(r, capacity.by_position);
  return r;
}

std::vector<double> moe_balancing_statistics_zero(int64_t experts) {
  FORGE_CHECK(experts >= 1, "moe_balancing_statistics_zero: {} experts", experts);
  return std::vector<double>(static_cast<size_t>(2 * experts + 1), 0.0);
}

void moe_add_balancing_statistics(std::vector<double>& statistics, const MoeRouting& r) {
  check_routing(r, "moe_balancing_loss");
  FORGE_CHECK(!r.sigmoid, "moe_balancing_loss: the Switch/Mixtral balancing loss is for softmax routing");
  const size_t experts = static_cast<size_t>(r.experts);
  FORGE_CHECK(statistics.size() == 2 * experts + 1, "moe_balancing_loss: statistics of {} values for routings over {} experts",
              statistics.size(), experts);
  const std::vector<int64_t> counts = moe_expert_counts(r).assigned;  // before any drop (NOTE [MoE capacity])
  for (size_t e = 0; e < experts; ++e) statistics[e] += static_cast<double>(counts[e]);
  const std::vector<double> sums = prob_column_sums(r, 0, r.tokens, "moe_balancing_loss");
  for (size_t e = 0; e < experts; ++e) statistics[experts + e] += sums[e];
  statistics[2 * experts] += static_cast<double>(r.tokens);
}

MoeBalance moe_statistics_balancing_loss(const std::vector<double>& statistics) {
  FORGE_CHECK(statistics.size() >= 3 && statistics.size() % 2 == 1,
              "moe_statistics_balancing_loss: {} statistics (2 experts + 1 expected)", statistics.size());
  const size_t experts = statistics.size() / 2;
  const double rows = statistics[2 * experts];
  MoeBalance b;
  b.prob_gradient.assign(experts, 0.0);
  if (rows == 0.0) return b;
  for (size_t e = 0; e < experts; ++e) {
    const double f = statistics[e] / rows;
    b.loss += static_cast<double>(experts) * f * statistics[experts + e] / rows;
    b.prob_gradient[e] = static_cast<double>(experts) * f / rows;
  }
  return b;
}

MoeBalance moe_balancing_loss(const std::vector<const MoeRouting*>& routings) {
  FORGE_CHECK(!routings.empty(), "moe_balancing_loss: no routing given");
  const int64_t experts = routings.front()->experts;
  std::vector<double> statistics = moe_balancing_statistics_zero(experts);
  for (const MoeRouting* r : routings) {
    FORGE_CHECK(r->experts == experts, "moe_balancing_loss: routings over {} and {} experts", experts, r->experts);
    moe_add_balancing_statistics(statistics, *r);
  }
  return moe_statistics_balancing_loss(statistics);
}

MoeBalance moe_grouped_balancing_loss(const MoeRouting& r, int64_t groups) {
  check_routing(r, "moe_grouped_balancing_loss");
  FORGE_CHECK(!r.sigmoid, "moe_grouped_balancing_loss: the Switch balancing loss is for softmax routing");
  FORGE_CHECK(groups >= 1 && r.tokens % groups == 0, "moe_grouped_balancing_loss: {} groups must divide the {} tokens",
              groups, r.tokens);
  const int64_t experts = r.experts, per_group = r.tokens / groups;
  std::vector<double> assigned(static_cast<size_t>(groups * experts), 0.0), probs(assigned.size(), 0.0);
  if (groups == 1) {  // before any drop (NOTE [MoE capacity])
    const std::vector<int64_t> counts = moe_expert_counts(r).assigned;
    for (int64_t e = 0; e < experts; ++e)
      assigned[static_cast<size_t>(e)] = static_cast<double>(counts[static_cast<size_t>(e)]);
  } else {  // counted per group from the expert ids (on CUDA copied to the host)
    const Tensor ids = r.expert_ids.device() == Device::CPU ? r.expert_ids : r.expert_ids.to(Device::CPU);
    const int32_t* id = ids.data<int32_t>();
    for (int64_t a = 0; a < r.tokens * r.k; ++a)
      assigned[static_cast<size_t>((a / r.k / per_group) * experts + id[a])] += 1.0;
  }
  for (int64_t g = 0; g < groups; ++g) {  // on CUDA each group's column sums on the device, one group at a time
    const std::vector<double> sums = prob_column_sums(r, g * per_group, per_group, "moe_grouped_balancing_loss");
    std::copy(sums.begin(), sums.end(), probs.begin() + static_cast<std::ptrdiff_t>(g * experts));
  }
  MoeBalance b;
  b.prob_gradient.assign(assigned.size(), 0.0);
  if (per_group == 0) return b;
  const double s = static_cast<double>(per_group), scale = static_cast<double>(experts) / static_cast<double>(r.k) /
                                                           static_cast<double>(groups);
  for (size_t i = 0; i < assigned.size(); ++i) {
    const double f = assigned[i] / s;
    b.loss += scale * f * probs[i] / s;
    b.prob_gradient[i] = scale * f / s;
  }
  return b;
}

MoeBalance moe_switch_balancing_loss(const MoeRouting& r, const std::vector<double>& tokens_per_expert,
                                     double total_tokens) {
  check_routing(r, "moe_switch_balancing_loss");
  FORGE_CHECK(!r.sigmoid, "moe_switch_balancing_loss: the Switch balancing loss is for softmax routing");
  FORGE_CHECK(static_cast<int64_t>(tokens_per_expert.size()) == r.experts,
              "moe_switch_balancing_loss: {} counts for {} experts", tokens_per_expert.size(), r.experts);
  FORGE_CHECK(total_tokens >= static_cast<double>(r.tokens) && std::isfinite(total_tokens),
              "moe_switch_balancing_loss: {} tokens counted, fewer than the routing's {}", total_tokens, r.tokens);
  MoeBalance b;
  b.prob_gradient.assign(static_cast<size_t>(r.experts), 0.0);
  if (r.tokens == 0) return b;
  const std::vector<double> probs = prob_column_sums(r, 0, r.tokens, "moe_switch_balancing_loss");
  // Megatron's switch_load_balancing_loss_func: sum_e P_e c_e x E / (k T^2).
  const double scale = static_cast<double>(r.experts) / (static_cast<double>(r.k) * total_tokens * total_tokens);
  for (size_t e = 0; e < probs.size(); ++e) {
    b.prob_gradient[e] = scale * tokens_per_expert[e];
    b.loss += b.prob_gradient[e] * probs[e];
  }
  return b;
}

void MoeStepCounts::reset() {
  sums_.clear();
  micro_batches_ = 0;
}

std::vector<double> MoeStepCounts::add(const std::vector<int64_t>& counts) {
  FORGE_CHECK(micro_batches_ == 0 || counts.size() == sums_.size(),
              "MoeStepCounts: {} counts after micro-batches of {}", counts.size(), sums_.size());
  if (micro_batches_ == 0) sums_.assign(counts.size(), 0.0);
  ++micro_batches_;
  std::vector<double> average(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    sums_[i] += static_cast<double>(counts[i]);
    average[i] = sums_[i] / static_cast<double>(micro_batches_);
  }
  return average;
}

double moe_z_loss(const MoeRouting& r) {
  check_routing(r, "moe_z_loss");
  FORGE_CHECK(r.lse.defined(), "moe_z_loss: the routing kept no logsumexp (MoeRoutingBuffers::lse, and softmax for "
                               "sigmoid routing)");
  if (r.tokens == 0) return 0.0;
  const Tensor lse = r.lse.device() == Device::CPU ? r.lse : r.lse.to(Device::CPU);
  double sum = 0.0;
  for (int64_t t = 0; t < r.tokens; ++t) sum += static_cast<double>(lse.data<float>()[t]) * lse.data<float>()[t];
  return sum / static_cast<double>(r.tokens);
}

void moe_route_backward(const Tensor& d_logits, const Tensor& d_weights, const MoeRouting& r,
                        const Tensor* prob_gradient, double z_scale) {
  OpProfileScope profile(OpClass::Elementwise, "moe_route_backward");
  check_routing(r, "moe_route_backward");
  const Device device = r.probs.device();
  check_shape(d_logits, {r.tokens, r.experts}, "moe_route_backward d_logits");
  check_shape(d_weights, {r.tokens, r.k}, "moe_route_backward d_weights");
  expect_tensor(d_logits, device, DType::F32, "moe_route_backward d_logits");
  expect_tensor(d_weights, device, DType::F32, "moe_route_backward d_weights");
  int64_t group_tokens = std::max<int64_t>(r.tokens, 1);
  if (prob_gradient) {
    FORGE_CHECK(!r.sigmoid, "moe_route_backward: the Switch/Mixtral balancing loss is for softmax routing");
    const int64_t groups = prob_gradient->ndim() == 2 ? prob_gradient->dim(0) : 1;
    FORGE_CHECK(groups >= 1 && r.tokens % groups == 0,
                "moe_route_backward: prob_gradient {}'s {} groups must divide the {} tokens",
                shape_str(prob_gradient->shape()), groups, r.tokens);
    if (prob_gradient->ndim() == 2) check_shape(*prob_gradient, {groups, r.experts}, "moe_route_backward prob_gradient");
    else check_shape(*prob_gradient, {r.experts}, "moe_route_backward prob_gradient");
    expect_tensor(*prob_gradient, device, DType::F32, "moe_route_backward prob_gradient");
    if (r.tokens > 0) group_tokens = r.tokens / groups;
  }
  const bool z = z_scale != 0.0;
  if (z)
    FORGE_CHECK(r.lse.defined() && (!r.sigmoid || r.softmax.defined()),
                "moe_route_backward: the z-loss's gradient needs a routing that kept the logits' logsumexp (and, "
                "routing on sigmoid scores, their softmax)");
  const float* pg = prob_gradient ? prob_gradient->data<float>() : nullptr;
  const float* lse = z ? r.lse.data<float>() : nullptr;
  const float* softmax = z && r.sigmoid ? r.softmax.data<float>() : nullptr;
  if (device == Device::CUDA) {
    if (r.sigmoid)
      FORGE_CUDA_CALL("moe_route_backward",
                      cuda::moe_topk_sigmoid_backward(d_weights.data<float>(), r.probs.data<float>(),
                                                      r.expert_ids.data<int32_t>(), r.tokens, r.experts, r.k,
                                                      r.normalize, r.scaling, d_logits.data<float>(), lse, softmax,
                                                      z_scale));
    else
      FORGE_CUDA_CALL("moe_route_backward",
                      cuda::moe_topk_softmax_backward(d_weights.data<float>(), pg, group_tokens, r.probs.data<float>(),
                                                      r.expert_ids.data<int32_t>(), r.weights.data<float>(), r.tokens,
                                                      r.experts, r.k, r.normalize, d_logits.data<float>(), lse,
                                                      z_scale, r.scaling));
    return;
  }
  if (r.sigmoid) {
    cpu::moe_topk_sigmoid_backward(d_weights.data<float>(), r.probs.data<float>(), r.expert_ids.data<int32_t>(),
                                   r.tokens, r.experts, r.k, r.normalize, r.scaling, d_logits.data<float>(), lse,
                                   softmax, z_scale);
    return;
  }
  cpu::moe_topk_softmax_backward(d_weights.data<float>(), pg, group_tokens, r.probs.data<float>(),
                                 r.expert_ids.data<int32_t>(), r.weights.data<float>(), r.tokens, r.experts, r.k,
                                 r.normalize, d_logits.data<float>(), lse, z_scale, r.scaling);
}

void moe_update_routing_bias(const Tensor& bias, const std::vector<int64_t>& load, double rate,
                             int64_t first_expert) {
  expect_tensor(bias, Device::CPU, DType::F32, "moe_update_routing_bias bias");
  const auto experts = static_cast<int64_t>(load.size());
  FORGE_CHECK(bias.ndim() == 1 && first_expert >= 0 && first_expert + bias.numel() <= experts,
              "moe_update_routing_bias: biases {} from expert {} of {}", shape_str(bias.shape()), first_expert,
              experts);
  FORGE_CHECK(!load.empty() && rate >= 0, "moe_update_routing_bias: {} experts, rate {}", load.size(), rate);
  double mean = 0.0;
  for (int64_t n : load) mean += static_cast<double>(n);
  mean /= static_cast<double>(experts);
  float* b = bias.data<float>();
  for (int64_t i = 0; i < bias.numel(); ++i) {
    const double offset = mean - static_cast<double>(load[static_cast<size_t>(first_expert + i)]);
    b[i] = static_cast<float>(b[i] + rate * static_cast<double>((offset > 0) - (offset < 0)));
  }
}

void moe_permute(const Tensor& permuted, const Tensor& x, const MoeRouting& r) {
  OpProfileScope profile(OpClass::Elementwise, "moe_permute");
  const int64_t hidden = token_and_row_width(r, "moe_permute", x, "x", permuted, "permuted");
  const int64_t rows = r.offsets.back();  // the kept rows, or with padding every row
  if (x.device() == Device::CUDA) {
    FORGE_CUDA_CALL("moe_permute", cuda::moe_permute(bf16_ptr(permuted), bf16_ptr(x), r.source.data<int32_t>(), rows,
                                                     r.k, hidden));
    return;
  }
  const int32_t* source = r.source.data<int32_t>();
  for (int64_t row = 0; row < rows; ++row) {
    float* to = permuted.data<float>() + row * hidden;
    if (source[row] < 0) {  // padding
      std::fill(to, to + hidden, 0.0f);
      continue;
    }
    const float* from = x.data<float>() + source[row] / r.k * hidden;
    std::copy(from, from + hidden, to);
  }
}

void moe_permute_backward(const Tensor& dx, const Tensor& d_permuted, const MoeRouting& r) {
  OpProfileScope profile(OpClass::Elementwise, "moe_permute_backward");
  const int64_t hidden = token_and_row_width(r, "moe_permute_backward", dx, "dx", d_permuted, "d_permuted");
  if (dx.device() == Device::CUDA) {
    FORGE_CUDA_CALL("moe_permute_backward",
                    cuda::moe_permute_backward(bf16_ptr(dx), bf16_ptr(d_permuted), r.row_of.data<int32_t>(), r.tokens,
                                               r.k, hidden));
    return;
  }
  const int32_t* row_of = r.row_of.data<int32_t>();
  for (int64_t t = 0; t < r.tokens; ++t) {
    float* to = dx.data<float>() + t * hidden;
    std::fill(to, to + hidden, 0.0f);
    for (int64_t j = 0; j < r.k; ++j) {
      if (row_of[t * r.k + j] < 0) continue;  // dropped
      const float* from = d_permuted.data<float>() + static_cast<int64_t>(row_of[t * r.k + j]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) to[h] += from[h];
    }
  }
}

void moe_combine(const Tensor& out, const Tensor& expert_out, const MoeRouting& r, const Tensor* residual) {
  OpProfileScope profile(OpClass::Elementwise, "moe_combine");
  const int64_t hidden = token_and_row_width(r, "moe_combine", out, "out", expert_out, "expert_out");
  if (residual) {
    check_shape(*residual, out.shape(), "moe_combine residual");
    expect_tensor(*residual, out.device(), out.dtype(), "moe_combine residual");
  }
  if (out.device() == Device::CUDA) {
    FORGE_CUDA_CALL("moe_combine",
                    cuda::moe_combine(bf16_ptr(out), bf16_ptr(expert_out), r.row_of.data<int32_t>(),
                                      r.weights.data<float>(), residual ? bf16_ptr(*residual) : nullptr, r.tokens, r.k,
                                      hidden));
    return;
  }
  const int32_t* row_of = r.row_of.data<int32_t>();
  const float* w = r.weights.data<float>();
  std::vector<double> sum(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < r.tokens; ++t) {
    float* to = out.data<float>() + t * hidden;
    for (int64_t h = 0; h < hidden; ++h)
      sum[static_cast<size_t>(h)] = residual ? residual->data<float>()[t * hidden + h] : 0.0;
    for (int64_t j = 0; j < r.k; ++j) {
      if (row_of[t * r.k + j] < 0) continue;  // dropped
      const float* y = expert_out.data<float>() + static_cast<int64_t>(row_of[t * r.k + j]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) sum[static_cast<size_t>(h)] += static_cast<double>(w[t * r.k + j]) * y[h];
    }
    for (int64_t h = 0; h < hidden; ++h) to[h] = static_cast<float>(sum[static_cast<size_t>(h)]);
  }
}

void moe_combine_backward(const Tensor& d_expert_out, const Tensor& d_weights, const Tensor& dout,
                          const Tensor& expert_out, const MoeRouting& r) {
  OpProfileScope profile(OpClass::Elementwise, "moe_combine_backward");
  const int64_t hidden = token_and_row_width(r, "moe_combine_backward", dout, "dout", expert_out, "expert_out");
  check_shape(d_expert_out, {r.permuted_rows(), hidden}, "moe_combine_backward d_expert_out");
  check_shape(d_weights, {r.tokens, r.k}, "moe_combine_backward d_weights");
  expect_tensor(d_expert_out, dout.device(), dout.dtype(), "moe_combine_backward d_expert_out");
  expect_tensor(d_weights, dout.device(), DType::F32, "moe_combine_backward d_weights");
  if (dout.device() == Device::CUDA) {
    if (r.pad)  // the experts' GEMMs read every padded row's gradient (NOTE [MoE capacity])
      FORGE_CUDA_CALL("moe_combine_backward", cuda::moe_zero_padding(bf16_ptr(d_expert_out), r.source.data<int32_t>(),
                                                                     r.permuted_rows(), hidden));
    FORGE_CUDA_CALL("moe_combine_backward",
                    cuda::moe_combine_backward(bf16_ptr(d_expert_out), d_weights.data<float>(), bf16_ptr(dout),
                                               bf16_ptr(expert_out), r.row_of.data<int32_t>(),
                                               r.weights.data<float>(), r.tokens, r.k, hidden));
    return;
  }
  const int32_t* row_of = r.row_of.data<int32_t>();
  const float* w = r.weights.data<float>();
  if (r.pad) {
    const int32_t* source = r.source.data<int32_t>();
    for (int64_t row = 0; row < r.permuted_rows(); ++row)
      if (source[row] < 0) std::fill_n(d_expert_out.data<float>() + row * hidden, hidden, 0.0f);
  }
  for (int64_t t = 0; t < r.tokens; ++t) {
    const float* g = dout.data<float>() + t * hidden;
    for (int64_t j = 0; j < r.k; ++j) {
      const int64_t row = row_of[t * r.k + j];
      if (row < 0) {  // dropped: no row, no gradient
        d_weights.data<float>()[t * r.k + j] = 0.0f;
        continue;
      }
      const float* y = expert_out.data<float>() + row * hidden;
      float* dy = d_expert_out.data<float>() + row * hidden;
      double dot = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        dy[h] = w[t * r.k + j] * g[h];
        dot += static_cast<double>(g[h]) * y[h];
      }
      d_weights.data<float>()[t * r.k + j] = static_cast<float>(dot);
    }
  }
}

// NOTE [MoE expert GEMMs] in moe.h.
void moe_experts_forward(const MoeExpertBuffers& a, const MoeExpertWeights& w, const MoeRouting& r) {
  check_expert_offsets(r, a.permuted.dim(0), "moe_experts_forward");
  check_experts(w, r, a.permuted.dim(1), "moe_experts_forward");
  // y_e = x_e W_e^T on each expert's rows; batched when every expert has the same rows.
  const int64_t uniform = uniform_expert_rows(r);
  auto per_expert = [&](const Tensor& y, const Tensor& x, const Tensor& weight) {
    if (uniform > 0)
      return matmul_batched(by_expert(y, r.experts, uniform), by_expert(x, r.experts, uniform), false, weight, true);
    for (int64_t e = 0; e < r.experts; ++e) {
      const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
      if (b != end)
        matmul_varying(GemmVarying::M, y.narrow(b, end), x.narrow(b, end), false, moe_expert_matrix(weight, e), true);
    }
  };
  per_expert(a.gate_up, a.permuted, w.gate_up);
  if (w.gate_up_lora) lora_experts_forward_add(a.gate_up, a.permuted, *w.gate_up_lora, r);
  // Every row at once: SwiGLU works on each row alone (none: a rank's experts received nothing).
  if (a.gate_up.dim(0) > 0) swiglu_forward(a.swiglu, a.gate_up);
  per_expert(a.expert_out, a.swiglu, w.down);
  if (w.down_lora) lora_experts_forward_add(a.expert_out, a.swiglu, *w.down_lora, r);
}

void moe_experts_backward(const Tensor& d_permuted, const MoeExpertWeights& grads, bool overwrite,
                          const Tensor& d_expert_out, const MoeExpertBuffers& a, const MoeExpertWeights& w,
                          const MoeRouting& r, const Tensor& d_swiglu, const Tensor& d_gate_up) {
  check_expert_offsets(r, a.permuted.dim(0), "moe_experts_backward");
  check_experts(w, r, a.permuted.dim(1), "moe_experts_backward");
  // Frozen experts (LoRA's base, NOTE [LoRA on MoE and MLA models] in model/lora.h) have
  // gradient tensors undefined: dx alone.
  const bool frozen = !grads.gate_up.defined() && !grads.down.defined();
  if (!frozen) check_experts(grads, r, a.permuted.dim(1), "moe_experts_backward gradients");
  // Each expert's dx_e = dy_e W_e and dW_e (+)= dy_e^T x_e on its rows; no rows: a zero
  // gradient when written over, nothing to add otherwise. Batched when every expert has the
  // same rows.
  const int64_t uniform = uniform_expert_rows(r);
  auto per_expert = [&](const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& weight) {
    if (uniform > 0) {
      const Tensor dy_e = by_expert(dy, r.experts, uniform);
      matmul_batched(by_expert(dx, r.experts, uniform), dy_e, false, weight, false);
      if (!frozen)
        matmul_batched(dw, dy_e, true, by_expert(x, r.experts, uniform), false, 1.0f, overwrite ? 0.0f : 1.0f);
      return;
    }
    for (int64_t e = 0; e < r.experts; ++e) {
      const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
      if (b != end) {
        matmul_varying(GemmVarying::M, dx.narrow(b, end), dy.narrow(b, end), false, moe_expert_matrix(weight, e),
                       false);
        if (!frozen)
          matmul_varying(GemmVarying::K, moe_expert_matrix(dw, e), dy.narrow(b, end), true, x.narrow(b, end), false,
                         1.0f, overwrite ? 0.0f : 1.0f);
      } else if (overwrite && !frozen) {
        moe_expert_matrix(dw, e).fill_zero();
      }
    }
  };
  per_expert(d_swiglu, grads.down, d_expert_out, a.swiglu, w.down);
  lora_experts_backward(d_swiglu, d_expert_out, a.swiglu, w.down_lora, grads.down_lora, r, overwrite);
  if (a.gate_up.dim(0) > 0) swiglu_backward(d_gate_up, d_swiglu, a.gate_up);
  per_expert(d_permuted, grads.gate_up, d_gate_up, a.permuted, w.gate_up);
  lora_experts_backward(d_permuted, d_gate_up, a.permuted, w.gate_up_lora, grads.gate_up_lora, r, overwrite);
}

}  // namespace forge
