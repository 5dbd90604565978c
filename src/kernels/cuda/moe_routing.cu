// MoE routing on the GPU (kernels/cuda/moe.h): the router's top-k (Mixtral's softmax,
// DeepSeek-V3's group-limited sigmoid) and its backward, the sort of the tokens*k assignments
// by expert, and the probabilities' column sums for the balancing loss. Each computes what
// its CPU reference in kernels/cpu/moe.cpp computes (NOTE [MoE routing] in ops/moe.h): the
// forwards in fp32 where the CPU sums in double, the backwards in double as the CPU.
// Measured on an H100 at DeepSeek-V3's scale (32768 tokens, 256 experts, k 8; 10 calls'
// mean): softmax top-k 105 us, its backward 39, sigmoid top-k (8 groups keeping 4) 120, its
// backward 24, sort 162, column sums 23; against 1.4 to 2.8 ms for each token kernel of
// moe_tokens.cu at hidden 7168 and far more for the experts' GEMMs.
//
// Top-k (softmax and sigmoid): one warp per token, four tokens to a block. Lane l holds the
// row's experts l, l + 32, l + 64, ... in registers, V of them (V = experts / 32 rounded up
// to a power of two, a template argument so the arrays stay in registers: up to 32, which
// is kMoeMaxExperts = 1024); loads and stores of a row are coalesced. The softmax subtracts
// the row's max and divides expf by the sum, as the CPU does. The k choices are k rounds of
// a warp argmax over (value, id), ties to the lower id: each lane offers its best slot not
// yet taken, five xor-shuffle steps leave every lane with the same winner (the order is
// total, ids are distinct), and the winner's lane marks its slot taken. A NaN ranks below
// everything, so the ids are valid and distinct whatever the logits. The chosen values are
// summed in j order; lane j % 32 writes choice j and, after the last round, divides its own
// writes by that sum (the same thread reads back what it wrote: no synchronization). Cost:
// k x (V compares + 11 shuffles) per token, a dependent chain: the forwards are bound by it
// (105 us where their 64 MB of traffic would take 21), and __reduce_max_sync /
// __reduce_min_sync on order-preserving integer keys could replace the shuffle argmax.
// Experts fewer than 32 leave lanes idle (Mixtral's 8 use a quarter of the warp).
// Group-limited routing (sigmoid, and softmax's DeepSeek-V2 group_limited_greedy) with
// topk_groups < groups first ranks the groups, through shared memory (per warp the row's
// choice values, then the group scores): lane g scans group g's choice values in expert
// order for the two largest (sigmoid: their sum; softmax: the largest alone), as the CPU
// does, so the group score is the same; a group is kept when fewer than topk_groups groups rank above it (score higher,
// or equal and a lower id): the CPU's partial_sort selects the same set. Cost per token:
// experts reads for the group scores and groups^2 compares for the ranks (DeepSeek-V3: 256
// and 64), spread over the lanes. Excluded experts never take part in the k rounds.
//
// The softmax's forward also writes each token's logsumexp (max + logf(sum), from the max
// and sum it computes anyway) when asked: the router z-loss's, with no other pass over the
// logits. The sigmoid's forward, asked for them, computes the logits' logsumexp and softmax
// the same way from the row it holds in registers (the z-loss of sigmoid routing), and its
// backward adds z_scale x lse x softmax where it writes each row.
//
// Backwards: one warp per token, the same lane layout, in double as on the CPU. A saturated
// router (one probability near 1) makes d_logits a difference of nearly equal terms: in
// fp32 that leaves rounding noise near 1e-7 x the gradient where the true value is far
// smaller (measured with every token routed to one expert: 10 to 98% relative L2 error
// against the CPU). The work is k + experts per token, so fp64 costs nothing that shows.
// The softmax's adds each choice's probability gradient to its expert's register: the k
// (id, gradient) pairs are broadcast by shuffles and the owning lane adds into the matching
// slot by an unrolled compare (a register array cannot be indexed at run time), in j
// order; then <dp, p> is a warp sum and d_logits = p (dp - <dp, p> + z_scale lse) (the last
// term the z-loss's, with lse). The added probability gradient is a row per group of
// group_tokens tokens (one row: a layer's balancing loss; one per sequence: the sequence-wise
// loss), read by each token's warp from its group's row. The sigmoid's writes
// zeros over the row, orders them before the k chosen entries with __syncwarp (which orders
// memory among the warp's lanes) and writes those (ids distinct per token, as the routers
// write them).
//
// Sort by expert (stable): four small kernels, O(tokens * k) work, no float anything. The
// assignments are cut into chunks of at least 1024 and at least 2 x experts, about 256 of
// them; one warp walks a chunk 32 assignments at a time. (1) Each warp counts its chunk's
// assignments per expert in shared memory: __match_any_sync groups the lanes with the same
// expert and the group's lowest lane adds the group's size, so no two lanes touch one
// counter in a step. The counts go to row_of, used as scratch ([experts][chunks], expert
// major; it fits because chunks are at least 2 x experts long). (2) One block turns them
// into an exclusive scan in place: entry (e, c) becomes the first row of expert e's
// assignments in chunk c, and entry (e, 0) is offsets[e]. (3) Each warp walks its chunk
// again from its bases: a lane's row is its expert's next row plus the number of lower
// lanes in its group, and the lowest lane advances the expert's next row; it writes source.
// (4) row_of[source[r]] = r, over the rows. A single chunk (tokens * k up to 1024 or 2 x
// experts) skips (1) and (2): its one warp counts and scans in shared memory and writes the
// offsets itself. Everything is integer, so the result is unique and exact. Each walk step
// waits for its load of 32 ids (the loop holds a __syncwarp), and the scan is one block:
// latency-bound, 162 us for 262144 assignments; loading a chunk's ids into registers before
// the walk and a wider scan would be the next steps.
//
// Drop to capacity (NOTE [MoE capacity] in ops/moe.h), after the sort: one block of 256
// threads per expert, on the expert's segment of the sorted assignments (in assignment
// order). The block first sums min(count, capacity) over the experts before it (a fixed-order
// integer sum over the sort's offsets), which is where its kept rows begin without padding.
// Then it walks its segment 256 assignments at a time: "position" keeps the first capacity;
// "probs", for an expert over its capacity, ranks each assignment by counting the segment's
// assignments that come before it (a larger weight key, or an equal key and an earlier
// assignment), with the keys staged through shared memory 256 at a time, and keeps those
// ranked below the capacity. The keys order every float (cpu::moe_weight_key), so exactly
// capacity are kept, as on the CPU. A block-wide count of the kept flags (ballots, per-warp
// counts in shared memory) places each kept assignment after the kept ones before it, so the
// kept rows stay in assignment order: the CPU's layout, bit for bit. Cost: an over-full
// expert's count squared compares over 256 threads (2048 assignments: 16k compares a thread);
// a segmented radix select would make it linear, should an expert's count reach the tens of
// thousands.
//
// Column sums: one block per 8 experts, 1024 threads: thread i sums column 8b + i % 8 over
// rows i / 8, i / 8 + 128, ... in order (a warp reads 4 rows x 32 bytes per load, 8 loads
// in flight), and 8 threads fold the block's 128 partial sums per column in a fixed order.
// No atomics and no scratch; 32k tokens x 256 experts (32 MB) take 32 blocks, 23 us.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kRouteWarps = 4;  // tokens per block of the routing kernels
constexpr int kSortWarps = 4;   // chunks per block of the sort kernels
constexpr int kScanThreads = 1024;
constexpr int kDropThreads = 256;  // threads per block (one expert) of the drop to capacity
constexpr int kSumColumns = 8;  // columns per block of the column sums
constexpr int kSumThreads = 1024;
constexpr int kSumUnroll = 8;  // loads in flight per thread

// Butterfly sums: every lane ends with the same bits (each step adds the same two values).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// A top-k candidate: its ranking value and its expert id (INT_MAX: none).
struct Candidate {
  float value;
  int id;
};

__device__ __forceinline__ bool ranks_above(float v, int id, const Candidate& c) {
  return v > c.value || (v == c.value && id < c.id);
}

// NaN ranks below every number, so every comparison is a total order.
__device__ __forceinline__ float rank_value(float v) { return v != v ? -INFINITY : v; }

// The best candidate of the warp, the same on every lane.
__device__ __forceinline__ Candidate warp_best(Candidate c) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, c.value, o);
    const int id = __shfl_xor_sync(kFullMask, c.id, o);
    if (ranks_above(v, id, c)) c = {v, id};
  }
  return c;
}

// k rounds of the warp argmax over each lane's V slots (expert i * 32 + lane in slot i) not
// excluded, ranked by value[] (NaN last); weight[] is what the choice's weight starts from.
// Lane j % 32 writes choice j; the return is the sum of the chosen weights in j order (on
// every lane).
template <int V>
__device__ __forceinline__ float choose_top_k(const float (&value)[V], const float (&weight)[V], unsigned excluded,
                                              int k, int lane, int32_t* expert_ids, float* weights) {
  float chosen = 0.f;
  for (int j = 0; j < k; ++j) {
    Candidate best{-INFINITY, INT_MAX};
    float best_weight = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int e = i * kWarp + lane;
      const float v = rank_value(value[i]);
      if (!(excluded >> i & 1u) && ranks_above(v, e, best)) {
        best = {v, e};
        best_weight = weight[i];
      }
    }
    best = warp_best(best);
    const int owner = best.id % kWarp;  // the host checks leave at least k candidates: best.id is an expert
    const float w = __shfl_sync(kFullMask, best_weight, owner);
    if (lane == owner) excluded |= 1u << (best.id / kWarp);
    if (lane == j % kWarp) {
      expert_ids[j] = best.id;
      weights[j] = w;
    }
    chosen += w;
  }
  return chosen;
}

// Group-limited routing: marks in `excluded` every expert outside the `topk_groups` best
// of `groups` equal groups (a group is kept when fewer than topk_groups groups rank above
// it: score higher, or equal with a lower index). A group's score is the sum of its two
// largest values (DeepSeek-V3, `top_two`; its one value for groups of one) or its largest
// (DeepSeek-V2's group_limited_greedy). `row` is the warp's shared scratch of experts +
// groups floats.
template <int V>
__device__ __forceinline__ void exclude_groups(const float (&value)[V], int experts, int groups, int topk_groups,
                                               bool top_two, int lane, float* row, unsigned& excluded) {
  float* group_score = row + experts;
  const int group_size = experts / groups;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (i * kWarp + lane < experts) row[i * kWarp + lane] = value[i];
  __syncwarp();
  for (int g = lane; g < groups; g += kWarp) {
    float first = -INFINITY, second = -INFINITY;
    for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
      const float c = row[e];
      if (c > first) second = first, first = c;
      else if (c > second) second = c;
    }
    group_score[g] = top_two && group_size > 1 ? first + second : first;
  }
  __syncwarp();
  for (int g = lane; g < groups; g += kWarp) {
    const float mine = group_score[g];
    int above = 0;
    for (int h = 0; h < groups; ++h) {
      const float other = group_score[h];
      above += other > mine || (other == mine && h < g);
    }
    row[g] = above < topk_groups ? 1.f : 0.f;  // row's values are no longer read
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = i * kWarp + lane;
    if (e < experts && row[e / group_size] == 0.f) excluded |= 1u << i;
  }
}

template <int V>
__global__ void __launch_bounds__(kRouteWarps* kWarp)
    topk_softmax_kernel(const float* __restrict__ logits, int64_t tokens, int experts, int k, bool normalize,
                        int groups, int topk_groups, float scaling, float* __restrict__ probs,
                        int32_t* __restrict__ expert_ids, float* __restrict__ weights, float* __restrict__ lse) {
  extern __shared__ float group_smem[];  // per warp, when group-limited: probabilities [experts], group scores [groups]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= tokens) return;  // the whole warp
  const float* l = logits + t * experts;
  float p[V];
  float top = -INFINITY;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = i * kWarp + lane;
    p[i] = e < experts ? l[e] : -INFINITY;
    top = fmaxf(top, p[i]);
  }
  top = warp_max(top);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    p[i] = i * kWarp + lane < experts ? expf(p[i] - top) : 0.f;
    sum += p[i];
  }
  sum = warp_sum(sum);
  if (lse && lane == 0) lse[t] = top + logf(sum);  // the z-loss's logsumexp, from the softmax's own max and sum
  unsigned excluded = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = i * kWarp + lane;
    p[i] = p[i] / sum;
    if (e < experts) probs[t * experts + e] = p[i];
    else excluded |= 1u << i;
  }
  if (topk_groups < groups)  // DeepSeek-V2's group_limited_greedy: groups ranked by their best probability
    exclude_groups<V>(p, experts, groups, topk_groups, /*top_two=*/false, lane,
                      group_smem + warp * (experts + groups), excluded);
  int32_t* ids = expert_ids + t * k;
  float* w = weights + t * k;
  const float chosen = choose_top_k<V>(p, p, excluded, k, lane, ids, w);
  for (int j = lane; j < k; j += kWarp) w[j] = (normalize ? w[j] / chosen : w[j]) * scaling;  // this lane wrote w[j]
}

template <int V>
__global__ void __launch_bounds__(kRouteWarps* kWarp)
    topk_softmax_backward_kernel(const float* __restrict__ d_weights, const float* __restrict__ prob_gradient,
                                 int64_t group_tokens, const float* __restrict__ probs,
                                 const int32_t* __restrict__ expert_ids, const float* __restrict__ weights,
                                 int64_t tokens, int experts, int k, bool normalize, float* __restrict__ d_logits,
                                 const float* __restrict__ lse, double z_scale, float scaling) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + threadIdx.x / kWarp;
  if (t >= tokens) return;
  const float* p_row = probs + t * experts;
  const int32_t* ids = expert_ids + t * k;
  const float* dw = d_weights + t * k;
  const float* w = weights + t * k;
  const float* g = prob_gradient ? prob_gradient + (t / group_tokens) * experts : nullptr;  // this token's group's
  float p[V];
  double dp[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = i * kWarp + lane;
    p[i] = e < experts ? p_row[e] : 0.f;
    dp[i] = e < experts && g ? g[e] : 0.0;
  }
  // w_j = s p_j / Z over the chosen (s: scaling): dL/dp_j = (s dw_j - sum_m dw_m w_m) / Z.
  double z = 0.0, dot = 0.0;
  if (normalize) {
    for (int j = lane; j < k; j += kWarp) {
      z += p_row[ids[j]];
      dot += static_cast<double>(dw[j]) * w[j];
    }
    z = warp_sum(z);
    dot = warp_sum(dot);
  }
  for (int j0 = 0; j0 < k; j0 += kWarp) {
    const int j = j0 + lane;
    int id = 0;
    double delta = 0.0;
    if (j < k) {
      id = ids[j];
      const double scaled = static_cast<double>(scaling) * dw[j];
      delta = normalize ? (scaled - dot) / z : scaled;
    }
    const int n = min(kWarp, k - j0);
    for (int s = 0; s < n; ++s) {
      const int e = __shfl_sync(kFullMask, id, s);
      const double d = __shfl_sync(kFullMask, delta, s);
      const int slot = e % kWarp == lane ? e / kWarp : -1;
#pragma unroll
      for (int i = 0; i < V; ++i) dp[i] = i == slot ? dp[i] + d : dp[i];
    }
  }
  double pdot = 0.0;  // softmax: dl = p (dp - <dp, p>); the z-loss's: + z_scale lse p
#pragma unroll
  for (int i = 0; i < V; ++i) pdot += dp[i] * p[i];
  pdot = warp_sum(pdot);
  if (lse) pdot -= z_scale * lse[t];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = i * kWarp + lane;
    if (e < experts) d_logits[t * experts + e] = static_cast<float>(p[i] * (dp[i] - pdot));
  }
}

template <int V>
__global__ void __launch_bounds__(kRouteWarps* kWarp)
    topk_sigmoid_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int64_t tokens,
                        int experts, int k, int groups, int topk_groups, bool normalize, float scaling,
                        float* __restrict__ scores, int32_t* __restrict__ expert_ids, float* __restrict__ weights,
                        float* __restrict__ lse, float* __restrict__ softmax) {
  extern __shared__ float group_smem[];  // per warp: choice [experts], then group scores [groups]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= tokens) return;
  const float* l = logits + t * experts;
  float s[V], choice[V];
  unsigned excluded = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = i * kWarp + lane;
    if (e < experts) {
      s[i] = 1.0f / (1.0f + expf(-l[e]));
      choice[i] = s[i] + (bias ? bias[e] : 0.0f);
      scores[t * experts + e] = s[i];
    } else {
      s[i] = choice[i] = 0.f;
      excluded |= 1u << i;
    }
  }
  if (lse) {  // the router z-loss's logsumexp and softmax of the logits, as the softmax router's
    float top = -INFINITY;
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (i * kWarp + lane < experts) top = fmaxf(top, l[i * kWarp + lane]);
    top = warp_max(top);
    float ex[V], sum = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      ex[i] = i * kWarp + lane < experts ? expf(l[i * kWarp + lane] - top) : 0.f;
      sum += ex[i];
    }
    sum = warp_sum(sum);
    if (lane == 0) lse[t] = top + logf(sum);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (i * kWarp + lane < experts) softmax[t * experts + i * kWarp + lane] = ex[i] / sum;
  }
  if (topk_groups < groups)  // group-limited: only the best topk_groups groups take part
    exclude_groups<V>(choice, experts, groups, topk_groups, /*top_two=*/true, lane,
                      group_smem + warp * (experts + groups), excluded);
  int32_t* ids = expert_ids + t * k;
  float* w = weights + t * k;
  const float chosen = choose_top_k<V>(choice, s, excluded, k, lane, ids, w);
  for (int j = lane; j < k; j += kWarp)  // this lane wrote w[j]
    w[j] = (normalize ? w[j] / (chosen + 1e-20f) : w[j]) * scaling;
}

__global__ void __launch_bounds__(kRouteWarps* kWarp)
    topk_sigmoid_backward_kernel(const float* __restrict__ d_weights, const float* __restrict__ scores,
                                 const int32_t* __restrict__ expert_ids, int64_t tokens, int experts, int k,
                                 bool normalize, float scaling, float* __restrict__ d_logits,
                                 const float* __restrict__ lse, const float* __restrict__ softmax, double z_scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + threadIdx.x / kWarp;
  if (t >= tokens) return;
  const float* s = scores + t * experts;
  const int32_t* ids = expert_ids + t * k;
  const float* dw = d_weights + t * k;
  float* dl = d_logits + t * experts;
  // The z-loss's z_scale lse softmax(logits) where it is asked for, else zeros; the chosen
  // experts' sigmoid gradients are added below, in double as on the CPU.
  const double zl = lse ? z_scale * lse[t] : 0.0;
  for (int e = lane; e < experts; e += kWarp) dl[e] = lse ? static_cast<float>(zl * softmax[t * experts + e]) : 0.f;
  // w_j = scaling * s_j / Z (Z = sum of the chosen + 1e-20): dL/ds_j = scaling (dw_j - sum_m dw_m s_m / Z) / Z.
  double z = 0.0, dot = 0.0;
  for (int j = lane; j < k; j += kWarp) {
    const double v = s[ids[j]];
    z += v;
    dot += dw[j] * v;
  }
  z = warp_sum(z) + 1e-20;
  dot = warp_sum(dot);
  __syncwarp();  // the zeros land before the chosen experts' values
  for (int j = lane; j < k; j += kWarp) {
    const int e = ids[j];
    const double v = s[e];
    const double ds = normalize ? scaling * (dw[j] - dot / z) / z : static_cast<double>(scaling) * dw[j];
    dl[e] = lse ? static_cast<float>(ds * v * (1.0 - v) + zl * softmax[t * experts + e])
                : static_cast<float>(ds * v * (1.0 - v));
  }
}

// ---- sort by expert ----

__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }

// Counts [begin, end)'s assignments per expert into count (shared, zeroed by the caller).
// An id outside [0, experts) is skipped (the contract excludes it).
__device__ void count_chunk(const int32_t* __restrict__ expert_ids, int64_t begin, int64_t end, int experts,
                            int lane, int32_t* count) {
  for (int64_t a0 = begin; a0 < end; a0 += kWarp) {
    const int64_t a = a0 + lane;
    int id = a < end ? expert_ids[a] : -1;
    if (id >= experts) id = -1;
    const unsigned peers = __match_any_sync(kFullMask, id);
    if (id >= 0 && lane == __ffs(peers) - 1) count[id] += __popc(peers);
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kSortWarps* kWarp)
    sort_count_kernel(const int32_t* __restrict__ expert_ids, int64_t n, int experts, int64_t chunk, int64_t chunks,
                      int32_t* __restrict__ counts) {
  extern __shared__ int32_t sort_smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSortWarps + warp;
  if (c >= chunks) return;
  int32_t* count = sort_smem + warp * experts;
  for (int e = lane; e < experts; e += kWarp) count[e] = 0;
  __syncwarp();
  count_chunk(expert_ids, c * chunk, min(n, (c + 1) * chunk), experts, lane, count);
  for (int e = lane; e < experts; e += kWarp) counts[e * chunks + c] = count[e];
}

// The exclusive sum of v over the block (blockDim.x a multiple of 32, at most 1024).
__device__ int64_t block_exclusive_scan(int64_t v) {
  __shared__ int64_t warp_totals[kScanThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int64_t inclusive = v;
  for (int o = 1; o < kWarp; o <<= 1) {
    const int64_t up = __shfl_up_sync(kFullMask, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == kWarp - 1) warp_totals[warp] = inclusive;
  __syncthreads();
  int64_t before = 0;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  return before + inclusive - v;
}

// counts [experts][chunks] (in place) -> each entry's first row; offsets [experts + 1].
__global__ void __launch_bounds__(kScanThreads)
    sort_scan_kernel(int32_t* counts, int64_t chunks, int experts, int64_t n, int64_t* __restrict__ offsets) {
  const int64_t entries = experts * chunks;
  const int64_t per = (entries + blockDim.x - 1) / blockDim.x;
  const int64_t begin = min(entries, threadIdx.x * per), end = min(entries, begin + per);
  int64_t local = 0;
  for (int64_t i = begin; i < end; ++i) local += counts[i];
  int64_t running = block_exclusive_scan(local);
  for (int64_t i = begin; i < end; ++i) {
    const int32_t v = counts[i];
    counts[i] = static_cast<int32_t>(running);
    if (i % chunks == 0) offsets[i / chunks] = running;
    running += v;
  }
  if (threadIdx.x == 0) offsets[experts] = n;
}

// Writes source for each chunk from its bases ([experts][chunks], from sort_scan_kernel), or
// with a single chunk from its own count and scan (then it writes the offsets too).
__global__ void __launch_bounds__(kSortWarps* kWarp)
    sort_place_kernel(const int32_t* __restrict__ expert_ids, int64_t n, int experts, int64_t chunk, int64_t chunks,
                      const int32_t* __restrict__ bases, int64_t* __restrict__ offsets, int32_t* __restrict__ source) {
  extern __shared__ int32_t sort_smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSortWarps + warp;
  if (c >= chunks) return;
  int32_t* next = sort_smem + warp * experts;  // each expert's next row
  const int64_t begin = c * chunk, end = min(n, (c + 1) * chunk);
  if (chunks == 1) {
    for (int e = lane; e < experts; e += kWarp) next[e] = 0;
    __syncwarp();
    count_chunk(expert_ids, begin, end, experts, lane, next);
    // Exclusive scan over the experts: lane l takes a contiguous slice of them.
    const int per = (experts + kWarp - 1) / kWarp;
    const int e0 = min(experts, lane * per), e1 = min(experts, e0 + per);
    int32_t local = 0;
    for (int e = e0; e < e1; ++e) local += next[e];
    int32_t inclusive = local;
    for (int o = 1; o < kWarp; o <<= 1) {
      const int32_t up = __shfl_up_sync(kFullMask, inclusive, o);
      if (lane >= o) inclusive += up;
    }
    int32_t running = inclusive - local;
    for (int e = e0; e < e1; ++e) {
      const int32_t v = next[e];
      next[e] = running;
      offsets[e] = running;
      running += v;
    }
    if (lane == 0) offsets[experts] = n;
  } else {
    for (int e = lane; e < experts; e += kWarp) next[e] = bases[e * chunks + c];
  }
  __syncwarp();
  for (int64_t a0 = begin; a0 < end; a0 += kWarp) {
    const int64_t a = a0 + lane;
    int id = a < end ? expert_ids[a] : -1;
    if (id >= experts) id = -1;
    const unsigned peers = __match_any_sync(kFullMask, id);
    if (id >= 0) source[next[id] + __popc(peers & lanes_below(lane))] = static_cast<int32_t>(a);
    __syncwarp();  // every lane has read next[id] before it moves
    if (id >= 0 && lane == __ffs(peers) - 1) next[id] += __popc(peers);
    __syncwarp();
  }
}

__global__ void sort_row_of_kernel(const int32_t* __restrict__ source, int64_t n, int32_t* __restrict__ row_of) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int32_t a = source[r];
  if (a >= 0 && a < n) row_of[a] = static_cast<int32_t>(r);  // a bad expert id leaves rows unwritten
}

__global__ void fill_zero_kernel(int64_t* out, int64_t count) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = 0;
}

// ---- column sums ----

__global__ void __launch_bounds__(kSumThreads)
    prob_column_sums_kernel(const float* __restrict__ probs, int64_t tokens, int experts, float* __restrict__ sums) {
  constexpr int kRowStep = kSumThreads / kSumColumns;
  __shared__ float partial[kSumThreads];
  const int col = blockIdx.x * kSumColumns + threadIdx.x % kSumColumns;
  float acc = 0.f;
  if (col < experts) {
    const float* p = probs + col;
    int64_t r = threadIdx.x / kSumColumns;
    for (; r + (kSumUnroll - 1) * kRowStep < tokens; r += kSumUnroll * kRowStep) {
      float v[kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) v[u] = p[(r + u * kRowStep) * experts];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) acc += v[u];
    }
    for (; r < tokens; r += kRowStep) acc += p[r * experts];
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < kSumColumns && col < experts) {
    float s = 0.f;
    for (int q = 0; q < kRowStep; ++q) s += partial[q * kSumColumns + threadIdx.x];
    sums[col] = s;
  }
}

// ---- launchers ----

unsigned blocks_for(int64_t n, int64_t per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// Calls launch(std::integral_constant<int, V>) with V, the expert slots per lane: experts /
// 32 rounded up to a power of two.
template <typename F>
void with_slots(int64_t experts, F&& launch) {
  const int64_t per_lane = (experts + kWarp - 1) / kWarp;
  if (per_lane <= 1) launch(std::integral_constant<int, 1>{});
  else if (per_lane <= 2) launch(std::integral_constant<int, 2>{});
  else if (per_lane <= 4) launch(std::integral_constant<int, 4>{});
  else if (per_lane <= 8) launch(std::integral_constant<int, 8>{});
  else if (per_lane <= 16) launch(std::integral_constant<int, 16>{});
  else launch(std::integral_constant<int, 32>{});
}

// cpu::moe_weight_key: a float's bits as an unsigned key ordering every value.
__device__ __forceinline__ uint32_t weight_key(float w) {
  const uint32_t u = __float_as_uint(w);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Each thread's number of set flags in the threads below it; *total the block's. Every
// thread of the block calls it.
__device__ int block_exclusive_count(bool flag, int* warp_counts, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const unsigned ballot = __ballot_sync(kFullMask, flag);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kDropThreads / kWarp; ++w) {
    if (w < warp) before += warp_counts[w];
    all += warp_counts[w];
  }
  __syncthreads();  // warp_counts is read before the next call writes it
  *total = all;
  return before + __popc(ballot & ((1u << lane) - 1u));
}

// One block per expert: its kept assignments' rows, the others' -1 (see the essay above).
__global__ void __launch_bounds__(kDropThreads)
    drop_to_capacity_kernel(const int32_t* __restrict__ sorted, const int64_t* __restrict__ sorted_offsets,
                            const float* __restrict__ weights, int64_t assignments, int experts, int64_t capacity,
                            bool by_position, bool pad, int64_t* __restrict__ kept_offsets,
                            int32_t* __restrict__ source, int32_t* __restrict__ row_of) {
  __shared__ uint32_t keys[kDropThreads];
  __shared__ int warp_counts[kDropThreads / kWarp];
  __shared__ long long warp_sums[kDropThreads / kWarp];
  const int e = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  long long before = 0;  // the kept rows of the experts before e
  for (int i = threadIdx.x; i < e; i += kDropThreads) {
    const long long count = sorted_offsets[i + 1] - sorted_offsets[i];
    before += count < capacity ? count : capacity;
  }
  before = warp_sum(before);
  if (lane == 0) warp_sums[warp] = before;
  __syncthreads();
  int64_t base = 0;
  for (int w = 0; w < kDropThreads / kWarp; ++w) base += warp_sums[w];
  const int64_t begin = sorted_offsets[e], n = sorted_offsets[e + 1] - begin;
  const int64_t keep = n < capacity ? n : capacity;
  if (threadIdx.x == 0) {
    kept_offsets[e + 1] = base + keep;
    if (e == 0) kept_offsets[0] = 0;
  }
  const int64_t first = pad ? e * capacity : base;
  const bool rank = !by_position && n > capacity;  // the same for the whole block
  int64_t taken = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kDropThreads) {
    const int64_t i = c0 + threadIdx.x;
    const int32_t a = i < n ? sorted[begin + i] : -1;
    bool kept = i < n && i < capacity;  // by position, and every one of an expert within its capacity
    if (rank) {
      const uint32_t key = i < n ? weight_key(weights[a]) : 0u;
      int64_t above = 0;  // the segment's assignments ranked before this one
      for (int64_t t0 = 0; t0 < n; t0 += kDropThreads) {
        __syncthreads();  // the previous tile is read before this one is written
        if (t0 + threadIdx.x < n) keys[threadIdx.x] = weight_key(weights[sorted[begin + t0 + threadIdx.x]]);
        __syncthreads();
        const int tile = static_cast<int>(n - t0 < kDropThreads ? n - t0 : kDropThreads);
        if (i < n)
          for (int m = 0; m < tile; ++m) above += keys[m] > key || (keys[m] == key && t0 + m < i);
      }
      kept = i < n && above < capacity;
    }
    int total = 0;
    const int64_t row = first + taken + block_exclusive_count(kept, warp_counts, &total);
    if (i < n) {
      if (kept) {
        source[row] = a;
        row_of[a] = static_cast<int32_t>(row);
      } else {
        row_of[a] = -1;
      }
    }
    taken += total;
  }
  // Rows without an assignment: the expert's padding, or without padding the rows after the
  // last kept one (marked by the last expert's block).
  if (pad)
    for (int64_t r = keep + threadIdx.x; r < capacity; r += kDropThreads) source[first + r] = -1;
  else if (e == experts - 1)
    for (int64_t r = base + keep + threadIdx.x; r < assignments; r += kDropThreads) source[r] = -1;
}

void check_routing(const char* op, int64_t tokens, int64_t experts, int64_t k) {
  FORGE_CHECK(tokens >= 0 && tokens <= INT32_MAX, "{}: {} tokens (0 to {} on CUDA)", op, tokens, INT32_MAX);
  FORGE_CHECK(experts >= 1 && experts <= kMoeMaxExperts, "{}: {} experts (1 to {} on CUDA)", op, experts,
              kMoeMaxExperts);
  FORGE_CHECK(k >= 1 && k <= experts, "{}: top-k {} must be between 1 and the {} experts", op, k, experts);
  FORGE_CHECK(tokens * k <= INT32_MAX, "{}: {} tokens x top-k {} assignments do not fit int32 indices", op, tokens, k);
}

void check_groups(const char* op, int64_t experts, int64_t k, int64_t groups, int64_t topk_groups) {
  FORGE_CHECK(groups >= 1 && experts % groups == 0 && topk_groups >= 1 && topk_groups <= groups,
              "{}: {} experts in {} groups keeping {}: the groups must divide the experts and keep between 1 and all "
              "of them",
              op, experts, groups, topk_groups);
  FORGE_CHECK(k <= topk_groups * (experts / groups), "{}: top-k {} must be at most the {} experts of the {} groups kept",
              op, k, topk_groups * (experts / groups), topk_groups);
}

// Shared memory only for group-limited routing: at most 4 warps x 2048 floats = 32 KB.
size_t group_smem_bytes(int64_t experts, int64_t groups, int64_t topk_groups) {
  return topk_groups < groups ? sizeof(float) * kRouteWarps * static_cast<size_t>(experts + groups) : 0;
}

}  // namespace

void moe_topk_softmax(const float* logits, int64_t tokens, int64_t experts, int64_t k, bool normalize, float* probs,
                      int32_t* expert_ids, float* weights, float* lse, int64_t groups, int64_t topk_groups,
                      float scaling) {
  check_routing("moe_topk_softmax", tokens, experts, k);
  check_groups("moe_topk_softmax", experts, k, groups, topk_groups);
  if (tokens == 0) return;
  const size_t smem = group_smem_bytes(experts, groups, topk_groups);
  with_slots(experts, [&](auto slots) {
    topk_softmax_kernel<decltype(slots)::value><<<blocks_for(tokens, kRouteWarps), kRouteWarps * kWarp, smem>>>(
        logits, tokens, static_cast<int>(experts), static_cast<int>(k), normalize, static_cast<int>(groups),
        static_cast<int>(topk_groups), scaling, probs, expert_ids, weights, lse);
  });
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_topk_softmax_backward(const float* d_weights, const float* prob_gradient, int64_t group_tokens,
                               const float* probs, const int32_t* expert_ids, const float* weights, int64_t tokens,
                               int64_t experts, int64_t k, bool normalize, float* d_logits, const float* lse,
                               double z_scale, float scaling) {
  check_routing("moe_topk_softmax_backward", tokens, experts, k);
  FORGE_CHECK(!prob_gradient || (group_tokens >= 1 && tokens % group_tokens == 0),
              "moe_topk_softmax_backward: groups of {} tokens must divide the {} tokens", group_tokens, tokens);
  if (tokens == 0) return;
  with_slots(experts, [&](auto slots) {
    topk_softmax_backward_kernel<decltype(slots)::value><<<blocks_for(tokens, kRouteWarps), kRouteWarps * kWarp>>>(
        d_weights, prob_gradient, group_tokens, probs, expert_ids, weights, tokens, static_cast<int>(experts),
        static_cast<int>(k), normalize, d_logits, lse, z_scale, scaling);
  });
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_topk_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t experts, int64_t k,
                      int64_t groups, int64_t topk_groups, bool normalize, float scaling, float* scores,
                      int32_t* expert_ids, float* weights, float* lse, float* softmax) {
  check_routing("moe_topk_sigmoid", tokens, experts, k);
  FORGE_CHECK((lse == nullptr) == (softmax == nullptr), "moe_topk_sigmoid: lse and softmax come together");
  check_groups("moe_topk_sigmoid", experts, k, groups, topk_groups);
  if (tokens == 0) return;
  const size_t smem = group_smem_bytes(experts, groups, topk_groups);
  with_slots(experts, [&](auto slots) {
    topk_sigmoid_kernel<decltype(slots)::value><<<blocks_for(tokens, kRouteWarps), kRouteWarps * kWarp, smem>>>(
        logits, bias, tokens, static_cast<int>(experts), static_cast<int>(k), static_cast<int>(groups),
        static_cast<int>(topk_groups), normalize, scaling, scores, expert_ids, weights, lse, softmax);
  });
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_topk_sigmoid_backward(const float* d_weights, const float* scores, const int32_t* expert_ids,
                               int64_t tokens, int64_t experts, int64_t k, bool normalize, float scaling,
                               float* d_logits, const float* lse, const float* softmax, double z_scale) {
  check_routing("moe_topk_sigmoid_backward", tokens, experts, k);
  FORGE_CHECK((lse == nullptr) == (softmax == nullptr), "moe_topk_sigmoid_backward: lse and softmax come together");
  if (tokens == 0) return;
  topk_sigmoid_backward_kernel<<<blocks_for(tokens, kRouteWarps), kRouteWarps * kWarp>>>(
      d_weights, scores, expert_ids, tokens, static_cast<int>(experts), static_cast<int>(k), normalize, scaling,
      d_logits, lse, softmax, z_scale);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_sort_by_expert(const int32_t* expert_ids, int64_t tokens, int64_t k, int64_t experts, int64_t* offsets,
                        int32_t* source, int32_t* row_of) {
  check_routing("moe_sort_by_expert", tokens, experts, k);
  const int64_t n = tokens * k;
  const int e = static_cast<int>(experts);
  if (n == 0) {  // no assignments: every expert owns no rows
    fill_zero_kernel<<<1, 256>>>(offsets, experts + 1);
    FORGE_CUDA_LAUNCH_CHECK();
    return;
  }
  // Chunks of at least 1024 and 2 x experts assignments (so [experts][chunks] counts fit in
  // row_of's n entries), about 256 of them, a multiple of 32.
  int64_t chunk = std::max<int64_t>({1024, 2 * experts, (n + 255) / 256});
  chunk = (chunk + kWarp - 1) / kWarp * kWarp;
  const int64_t chunks = (n + chunk - 1) / chunk;
  const size_t smem = sizeof(int32_t) * kSortWarps * experts;  // at most 16 KB
  const unsigned grid = blocks_for(chunks, kSortWarps);
  if (chunks > 1) {
    sort_count_kernel<<<grid, kSortWarps * kWarp, smem>>>(expert_ids, n, e, chunk, chunks, row_of);
    FORGE_CUDA_LAUNCH_CHECK();
    sort_scan_kernel<<<1, kScanThreads>>>(row_of, chunks, e, n, offsets);
    FORGE_CUDA_LAUNCH_CHECK();
  }
  sort_place_kernel<<<grid, kSortWarps * kWarp, smem>>>(expert_ids, n, e, chunk, chunks, row_of, offsets, source);
  FORGE_CUDA_LAUNCH_CHECK();
  sort_row_of_kernel<<<blocks_for(n, 256), 256>>>(source, n, row_of);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_drop_to_capacity(const int32_t* sorted, const int64_t* sorted_offsets, const float* weights, int64_t tokens,
                          int64_t k, int64_t experts, int64_t capacity, bool by_position, bool pad,
                          int64_t* kept_offsets, int32_t* source, int32_t* row_of) {
  check_routing("moe_drop_to_capacity", tokens, experts, k);
  FORGE_CHECK(capacity >= 0 && (!pad || experts * capacity <= INT32_MAX),
              "moe_drop_to_capacity: capacity {} for {} experts (padded rows within int32 indices)", capacity, experts);
  FORGE_CHECK(kept_offsets != sorted_offsets, "moe_drop_to_capacity: kept_offsets must not alias sorted_offsets");
  // Launched with no assignments too: the offsets and the padding are still written.
  drop_to_capacity_kernel<<<static_cast<unsigned>(experts), kDropThreads>>>(
      sorted, sorted_offsets, weights, tokens * k, static_cast<int>(experts), capacity, by_position, pad, kept_offsets,
      source, row_of);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_prob_column_sums(const float* probs, int64_t tokens, int64_t experts, float* sums) {
  FORGE_CHECK(tokens >= 0 && experts >= 1 && experts <= INT32_MAX, "moe_prob_column_sums: {} tokens x {} experts",
              tokens, experts);
  // Launched with no tokens too: the sums are then written as zeros.
  prob_column_sums_kernel<<<blocks_for(experts, kSumColumns), kSumThreads>>>(probs, tokens, static_cast<int>(experts),
                                                                             sums);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
