#include "distributed/fsdp.h"

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "ops/elementwise.h"
#include "ops/fp8_weight_chunk.h"

namespace forge {
namespace {

constexpr CudaStream kCompute = nullptr;  // the stream forge's kernels run on

std::unique_ptr<DeviceEvent> make_event(Device device) { return std::make_unique<DeviceEvent>(device); }

}  // namespace

Fsdp::Fsdp(const ModelConfig& config, Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group,
           const FsdpOptions& options, ProcessGroup* expert_group)
    : Fsdp(config,
           FsdpLayout(config, shard_group.world_size(), shard_group.rank(), options.expert_parallel,
                      options.tensor_parallel, options.pipeline_stages),
           false, device, shard_group, replicate_group, options, expert_group) {}

namespace {

// NOTE [FSDP of a model of units]: the decoder's config as far as Fsdp reads it: the blocks
// between the two end units, nothing tied, no experts.
ModelConfig units_model_config(const FsdpLayout& layout) {
  ModelConfig c;
  c.num_layers = layout.num_units() - 2;
  c.tie_word_embeddings = false;
  return c;
}

}  // namespace

Fsdp::Fsdp(FsdpLayout layout, Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group,
           const FsdpOptions& options)
    : Fsdp(units_model_config(layout), std::move(layout), true, device, shard_group, replicate_group, options,
           nullptr) {}  // the layout is moved from only in the member initializers, after the config is read

Fsdp::Fsdp(const ModelConfig& config, FsdpLayout&& layout, bool units_model, Device device, ProcessGroup& shard_group,
           ProcessGroup* replicate_group, const FsdpOptions& options, ProcessGroup* expert_group)
    : DataParallelComm(device, shard_group, replicate_group),
      config_(config),
      options_(options),
      expert_group_(expert_group),
      layout_(std::move(layout)),
      compute_dtype_(device == Device::CUDA ? DType::BF16 : DType::F32),
      units_model_(units_model) {
  FORGE_CHECK(layout_.world_size() == shard_group.world_size() && layout_.rank() == shard_group.rank(),
              "FSDP: a layout for rank {} of {} given to rank {} of {}", layout_.rank(), layout_.world_size(),
              shard_group.rank(), shard_group.world_size());
  if (units_model_)  // NOTE [FSDP of a model of units]
    FORGE_CHECK(!options.frozen && !options.fp8_all_gather && options.expert_parallel == 1 &&
                    options.tensor_parallel.size == 1 && options.pipeline_stages.empty(),
                "FSDP of a model of units (FLUX) shards trainable weights only: no frozen base, FP8 all-gather, "
                "expert, tensor or pipeline parallelism");
  if (pipelined()) {  // NOTE [FSDP]: a pipeline rank's stages; NOTE [ZeRO-2 and -3 under pipeline parallelism]
    FORGE_CHECK(!config.tie_word_embeddings ||
                    (layout_.holds(FsdpLayout::kEmbeddingUnit) && layout_.holds(layout_.head_unit())),
                "FSDP over a pipeline rank's stages (pipeline_stages): a tied embedding (tie_word_embeddings) needs "
                "the first and the last stage on the same rank");
    // ZeRO-2/3 reduce the tied embedding's full gradients on the last micro-batch, which a
    // schedule's interleaved backwards do not mark.
    FORGE_CHECK(options.zero_stage == 1 || !config.tie_word_embeddings,
                "FSDP over a pipeline rank's stages (pipeline_stages) under ZeRO-{}: a tied embedding "
                "(tie_word_embeddings) is reduced once per step, which ZeRO-1 alone does there",
                options.zero_stage);
  }
  if (options.expert_parallel > 1) {
    const int holders = shard_group.world_size() / options.expert_parallel;
    FORGE_CHECK(expert_group && expert_group->world_size() == holders &&
                    expert_group->rank() == shard_group.rank() / options.expert_parallel,
                "FSDP with expert parallelism {}: needs the group of the {} shard ranks holding the same experts "
                "(NOTE [Expert parallelism under hybrid sharding]: within this rank's replica)",
                options.expert_parallel, holders);
  }
  FORGE_CHECK(options.zero_stage >= 1 && options.zero_stage <= 3, "FSDP ZeRO stage {}", options.zero_stage);
  FORGE_CHECK(options.reduce_dtype == DType::F32 || options.reduce_dtype == DType::BF16, "FSDP reduce dtype {}",
              dtype_name(options.reduce_dtype));
  const int units = layout_.num_units();
  const int embedding = FsdpLayout::kEmbeddingUnit, head = layout_.head_unit();
  reduced_this_step_.assign(static_cast<size_t>(units), false);
  unit_fresh_.assign(static_cast<size_t>(units), false);
  unit_pending_.assign(static_cast<size_t>(units), false);
  for (int u = 0; u < units; ++u) unit_ready_.push_back(make_event(device));
  updated_ = make_event(device);

  // NOTE [Frozen FSDP base]: a frozen chunk is held in the compute dtype, with no gradient.
  master_ = Tensor::zeros({layout_.shard_numel()}, options.frozen ? compute_dtype_ : DType::F32, device);
  if (!options.frozen) grad_shard_ = Tensor::zeros({layout_.shard_numel()}, DType::F32, device);

  fp8_pieces_settings_.routed_experts = options.fp8_routed_experts;  // NOTE [FP8 all-gather pieces]
  fp8_pieces_settings_.filter_fqns = options.fp8_filter_fqns;
  // Compute weights.
  if (!gathers_blocks()) {
    full_compute_ = Tensor::zeros({std::max<int64_t>(layout_.full_numel(), 1)}, compute_dtype_, device);
    for (int u : {embedding, head})
      if (layout_.holds(u)) end_views(unit_full(full_compute_, u), u, root_weights_, root_units_);
    for (int i = 0; i < config.num_layers; ++i) {  // empty for a block of another pipeline rank
      const int u = FsdpLayout::unit_of_layer(i);
      static_layers_.push_back(layout_.holds(u) ? block_views(unit_full(full_compute_, u), u) : BlockWeights{});
    }
  } else {
    // NOTE [FP8 all-gather of the head]: its weight as codes in a slot of its own, no
    // compute-dtype copy of the head unit.
    fp8_head_ = options.fp8_all_gather && options.fp8_output_head && !tied() && layout_.holds(head);
    const int64_t root_numel = layout_.units()[static_cast<size_t>(embedding)].numel +
                               (fp8_head_ ? 0 : layout_.units()[static_cast<size_t>(head)].numel);
    root_compute_ = Tensor::zeros({root_numel}, compute_dtype_, device);
    for (int u : {embedding, head})
      if (!(fp8_head_ && u == head)) end_views(root_unit(u), u, root_weights_, root_units_);
    // ZeRO-3: three rotating slots, or one per block where a pipeline rank's stages hold fewer
    // (NOTE [ZeRO-2 and -3 under pipeline parallelism]).
    int held_blocks = 0;
    for (int u = 0; u < units; ++u) held_blocks += layout_.is_block(u) && layout_.holds(u) ? 1 : 0;
    // The FP8 all-gather under ZeRO-1/2: one slot per block the rank holds (a pipeline rank's
    // stages' blocks alone), block_slot_ naming each held block's.
    weight_slots_.resize(static_cast<size_t>(options.zero_stage == 3 ? std::clamp(held_blocks, 1, 3)
                                                                     : std::max(held_blocks, 1)));
    block_slot_.assign(static_cast<size_t>(units), -1);
    for (int u = 0, next = 0; u < units; ++u)
      if (layout_.is_block(u) && layout_.holds(u)) block_slot_[static_cast<size_t>(u)] = next++;
    // NOTE [FP8 all-gather]: the largest block's FP8 pieces (NOTE [FP8 all-gather pieces]),
    // FP8 elements and norms, and what any rank holds of its codes and of its norms. The
    // codes are packed where a routed-expert stack travels with the norms.
    int64_t fp8_weights = 0, fp8_numel = 0, norms = 0, experts = 0, dense = 0;
    if (options.fp8_all_gather) fp8_pieces_.resize(static_cast<size_t>(units));
    for (int u = 0; u < units; ++u) {
      if (!layout_.is_block(u) || !layout_.holds(u) || !options.fp8_all_gather) continue;  // another pipeline rank's
      const FsdpUnit& unit = layout_.units()[static_cast<size_t>(u)];
      fp8_pieces_[static_cast<size_t>(u)] = fp8_unit_pieces(config, layout_.specs(), unit, fp8_pieces_settings_);
      int64_t unit_norms = 0, unit_fp8 = 0;
      for (const FsdpParam& p : unit.params) {
        if (p.expert) continue;  // the expert part (expert parallelism)
        (is_fp8(p) ? unit_fp8 : unit_norms) += p.numel;
        // A stack or a filtered projection with the norms (NOTE [FP8 all-gather pieces]).
        const ParamSpec& spec = layout_.specs()[static_cast<size_t>(p.spec)];
        if (in_norms(p) && (spec.expert_stack || fp8_block_matrix(spec))) packed_codes_ = true;
      }
      for (const FsdpPart& part : unit.parts) {  // the dense part, and under expert parallelism the expert part
        int64_t& most = part.expert ? experts : dense;
        most = std::max(most, part.numel);
      }
      fp8_weights = std::max(fp8_weights, static_cast<int64_t>(fp8_pieces_[static_cast<size_t>(u)].size()));
      fp8_numel = std::max(fp8_numel, unit_fp8);
      norms = std::max(norms, unit_norms);
      const FsdpPart& part = unit.parts.front();
      for (int r = 0; r < part.ranks; ++r) {
        const int64_t lo = part.begin + r * part.shard_numel, hi = lo + part.shard_numel;
        int64_t held_norms = 0, held_codes = 0;
        for (const FsdpParam& p : unit.params)
          if (!p.expert)
            (is_fp8(p) ? held_codes : held_norms) +=
              std::max<int64_t>(0, std::min(hi, p.offset + p.numel) - std::max(lo, p.offset));
        norm_wire_numel_ = std::max(norm_wire_numel_, held_norms);
        code_wire_numel_ = std::max(code_wire_numel_, held_codes);
      }
    }
    // NOTE [FP8 all-gather of a frozen base]: the casts read fp32; a bf16 chunk goes through
    // an fp32 copy of the largest block unit's chunk.
    if (options.fp8_all_gather && options.frozen && compute_dtype_ != DType::F32) {
      int64_t largest = 1;
      for (int u = 0; u < units; ++u)
        if ((layout_.is_block(u) || (fp8_head_ && u == head)) && layout_.holds(u))
          largest = std::max(largest, layout_.units()[static_cast<size_t>(u)].shard_numel);
      frozen_chunk_f32_ = Tensor::zeros({largest}, DType::F32, device);
    }
    if (options.fp8_all_gather)
      norm_wire_ = Tensor::zeros({std::max<int64_t>(norm_wire_numel_ * layout_.world_size(), 1)}, compute_dtype_, device);
    if (packed_codes_)
      code_wire_ = Tensor::zeros({std::max<int64_t>(code_wire_numel_ * layout_.world_size(), 1)}, DType::U8, device);
    for (UnitSlot& slot : weight_slots_) {
      const int64_t numel = std::max<int64_t>(layout_.max_block_numel(), 1);
      if (options.fp8_all_gather) {  // the codes: packed, or in the dense part's layout
        slot.codes = Tensor::zeros({std::max<int64_t>(packed_codes_ ? fp8_numel : dense, 1)}, DType::U8, device);
        slot.norms = Tensor::zeros({std::max<int64_t>(norms, 1)}, compute_dtype_, device);
        slot.amax = Tensor::zeros({std::max<int64_t>(fp8_weights, 1)}, DType::F32, device);
        slot.scales = Tensor::zeros({std::max<int64_t>(2 * fp8_weights, 1) * cpu::kFp8StatStride}, DType::F32, device);
        slot.gathered.resize(static_cast<size_t>(fp8_weights));
        if (experts > 0) slot.experts = Tensor::zeros({experts}, compute_dtype_, device);
      } else {
        slot.buffer = Tensor::zeros({numel}, compute_dtype_, device);
      }
      slot.ready = make_event(device);
      slot.released = make_event(device);
    }
    if (fp8_head_) {  // NOTE [FP8 all-gather of the head]: the codes in place, the final norm with the norms
      const FsdpUnit& unit = layout_.units()[static_cast<size_t>(head)];
      fp8_pieces_[static_cast<size_t>(head)] = fp8_head_pieces(layout_.specs(), unit);
      int64_t head_norms = 0;
      for (const FsdpParam& p : unit.params)
        if (!is_fp8(p)) head_norms += p.numel;
      const FsdpPart& part = unit.parts.front();
      int64_t most = 0;
      for (int r = 0; r < part.ranks; ++r) {
        const int64_t lo = part.begin + r * part.shard_numel, hi = lo + part.shard_numel;
        int64_t held = 0;
        for (const FsdpParam& p : unit.params)
          if (!is_fp8(p)) held += std::max<int64_t>(0, std::min(hi, p.offset + p.numel) - std::max(lo, p.offset));
        most = std::max(most, held);
      }
      if (most > norm_wire_numel_) {
        norm_wire_numel_ = most;
        norm_wire_ = Tensor::zeros({std::max<int64_t>(norm_wire_numel_ * layout_.world_size(), 1)}, compute_dtype_,
                                   device);
      }
      head_slot_.codes = Tensor::zeros({std::max<int64_t>(part.numel, 1)}, DType::U8, device);
      head_slot_.norms = Tensor::zeros({std::max<int64_t>(head_norms, 1)}, compute_dtype_, device);
      head_slot_.amax = Tensor::zeros({1}, DType::F32, device);
      head_slot_.scales = Tensor::zeros({2 * cpu::kFp8StatStride}, DType::F32, device);
      head_slot_.gathered.resize(1);
      head_slot_.ready = make_event(device);
      head_slot_.released = make_event(device);
    }
  }
  for (const FsdpSegment& s : layout_.segments()) {
    master_segments_.push_back(master_.narrow(s.shard_offset, s.shard_offset + s.numel));
    if (!options.frozen) grad_segments_.push_back(grad_shard_.narrow(s.shard_offset, s.shard_offset + s.numel));
    const int64_t local = s.shard_offset - layout_.units()[static_cast<size_t>(s.unit)].shard_offset;
    Tensor unit;  // a gathered block (ZeRO-3, FP8 all-gather) keeps no compute copy of its chunk
    if (!gathers_blocks()) unit = unit_full(full_compute_, s.unit);
    else if (!layout_.is_block(s.unit) && !(fp8_head_ && s.unit == layout_.head_unit())) unit = root_unit(s.unit);
    compute_segments_.push_back(unit.defined() ? chunk_in_unit(unit, s.unit, local, s.numel) : Tensor());
  }
  if (options.frozen) return;

  // Full-size gradients: every unit's in ZeRO-1; in ZeRO-2/3 two rotating slots as large as
  // the largest unit that goes through them, and the tied embedding's own buffer.
  int64_t slot_numel = 1;
  if (options.zero_stage == 1) {
    full_grads_ = Tensor::zeros({std::max<int64_t>(layout_.full_numel(), 1)}, DType::F32, device);
    for (int u : {embedding, head})
      if (layout_.holds(u)) end_views(unit_full(full_grads_, u), u, root_grads_, root_unit_grads_);
    for (int i = 0; i < config.num_layers; ++i) {
      const int u = FsdpLayout::unit_of_layer(i);
      static_layer_grads_.push_back(layout_.holds(u) ? block_views(unit_full(full_grads_, u), u) : BlockWeights{});
    }
    slot_numel = std::max<int64_t>(layout_.max_unit_numel(), 1);
  } else {
    for (int u = 0; u < units; ++u)
      if (!(u == embedding && tied())) slot_numel = std::max(slot_numel, layout_.units()[static_cast<size_t>(u)].numel);
    if (tied()) {
      full_grads_ = Tensor::zeros({layout_.units()[static_cast<size_t>(embedding)].numel}, DType::F32, device);
      root_views(full_grads_, embedding, root_grads_);
    }
    for (size_t k = 0; k < grad_slots_.size(); ++k) {
      grad_slots_[k].buffer = Tensor::zeros({slot_numel}, DType::F32, device);
      grad_slots_[k].channel = static_cast<int>(k);
    }
  }

  // Reduction channels.
  const bool bf16_reduce = options.reduce_dtype == DType::BF16;
  auto make_channel = [&](ReduceChannel& ch, int64_t full_numel) {
    if (bf16_reduce) ch.staging = Tensor::zeros({full_numel}, DType::BF16, device);
    ch.ready = make_event(device);
    ch.done = make_event(device);
  };
  for (ReduceChannel& ch : channels_) make_channel(ch, slot_numel);
  if (options.zero_stage >= 2 && tied())
    make_channel(embedding_channel_, layout_.units()[static_cast<size_t>(embedding)].numel);
}

Fsdp::~Fsdp() {
  // Nothing may still write into buffers that are about to be freed.
  try {
    comm_.synchronize();
  } catch (...) {
  }
}

Tensor Fsdp::unit_full(const Tensor& all_units, int unit) const {
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  return all_units.narrow(u.full_offset, u.full_offset + u.numel);
}

Tensor Fsdp::own_piece(const Tensor& unit_buffer, const FsdpPart& part) {
  const int64_t begin = part.begin + part.index * part.shard_numel;
  return unit_buffer.narrow(begin, begin + part.shard_numel);
}

Tensor Fsdp::chunk_piece(const Tensor& unit_chunk, const FsdpPart& part) {
  return unit_chunk.narrow(part.shard_begin, part.shard_begin + part.shard_numel);
}

Tensor Fsdp::chunk_in_unit(const Tensor& unit_buffer, int unit, int64_t local, int64_t numel) const {
  for (const FsdpPart& part : layout_.units()[static_cast<size_t>(unit)].parts)
    if (local >= part.shard_begin && local + numel <= part.shard_begin + part.shard_numel) {
      const int64_t begin = part.begin + part.index * part.shard_numel + (local - part.shard_begin);
      return unit_buffer.narrow(begin, begin + numel);
    }
  FORGE_FAIL("FSDP: elements [{}, {}) of unit {}'s chunk are not within one part", local, local + numel, unit);
}

void Fsdp::gather_unit(const Tensor& full, int unit, CudaStream stream) {
  for (const FsdpPart& part : layout_.units()[static_cast<size_t>(unit)].parts)
    group_of(part).all_gather(full.narrow(part.begin, part.begin + part.numel), own_piece(full, part), stream);
}

Tensor Fsdp::shard_of(const Tensor& shard, int unit) const {
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  return shard.narrow(u.shard_offset, u.shard_offset + u.shard_numel);
}

Tensor Fsdp::root_unit(int unit) const {
  const int64_t embedding_numel = layout_.units()[FsdpLayout::kEmbeddingUnit].numel;
  if (unit == FsdpLayout::kEmbeddingUnit) return root_compute_.narrow(0, embedding_numel);
  FORGE_CHECK(unit == layout_.head_unit(), "FSDP: unit {} is neither the embedding nor the head", unit);
  return root_compute_.narrow(embedding_numel, embedding_numel + layout_.units()[static_cast<size_t>(unit)].numel);
}

BlockWeights Fsdp::block_views(const Tensor& unit_buffer, int unit) const {
  BlockWeights w;
  for (const FsdpParam& p : layout_.units()[static_cast<size_t>(unit)].params)
    w.params.push_back({unit_buffer.narrow(p.offset, p.offset + p.numel).view(p.shape)});
  return w;
}

void Fsdp::end_views(const Tensor& unit_buffer, int unit, ModelWeights& w, std::array<BlockWeights, 2>& units) const {
  if (units_model_) units[end_index(unit)] = block_views(unit_buffer, unit);
  else root_views(unit_buffer, unit, w);
}

void Fsdp::check_decoder(const char* what) const {
  FORGE_CHECK(!units_model_, "FSDP: {} is the decoder's; this FSDP holds a model of units (NOTE [FSDP of a model of "
                             "units]: unit_weights, unit_gradients)",
              what);
}

const BlockWeights& Fsdp::unit_weights(int unit) {
  FORGE_CHECK(unit >= 0 && unit < layout_.num_units(), "FSDP: unit {} of {}", unit, layout_.num_units());
  if (layout_.is_block(unit)) return layer(unit - 1);
  await_unit(unit);
  return root_units_[end_index(unit)];
}

const BlockWeights& Fsdp::unit_gradients(int unit) {
  check_trainable("unit_gradients");
  FORGE_CHECK(unit >= 0 && unit < layout_.num_units(), "FSDP: unit {} of {}", unit, layout_.num_units());
  if (layout_.is_block(unit)) return layer_grads(unit - 1);
  if (options_.zero_stage == 1) return root_unit_grads_[end_index(unit)];
  return grad_slot(unit).block;
}

void Fsdp::unit_gradients_done(int unit) {
  FORGE_CHECK(unit >= 0 && unit < layout_.num_units(), "FSDP: unit {} of {}", unit, layout_.num_units());
  unit_done(unit);
}

void Fsdp::root_views(const Tensor& unit_buffer, int unit, ModelWeights& w) const {
  for (const FsdpParam& p : layout_.units()[static_cast<size_t>(unit)].params) {
    const ParamSpec& spec = layout_.specs()[static_cast<size_t>(p.spec)];
    Tensor t = unit_buffer.narrow(p.offset, p.offset + p.numel).view(spec.shape);
    if (spec.name == "embedding.weight") w.embedding = t;
    else if (spec.name == "final_norm.weight") w.final_norm = t;
    else if (spec.name == "output.weight") w.output = {t};
    else FORGE_FAIL("FSDP unit {}: unexpected parameter '{}'", unit, spec.name);
  }
  if (tied() && unit == FsdpLayout::kEmbeddingUnit) w.output = {w.embedding};
}

void Fsdp::fill_master(const std::function<void(const std::vector<MasterPiece>&)>& fill) {
  // Through a bounded host window: a 70B model's shard is 35 GB per rank, and eight ranks
  // staging whole shards at once would take (and wait for) a quarter of a TB of host memory.
  const int64_t kWindow = std::max<int64_t>(options_.host_window, 1);  // 256 MiB of fp32 by default
  const int64_t total = layout_.shard_numel();
  Tensor host = Tensor::empty({std::max<int64_t>(std::min(kWindow, total), 1)}, DType::F32);
  std::vector<MasterPiece> pieces;
  for (int64_t w = 0; w < total; w += kWindow) {
    const int64_t n = std::min(kWindow, total - w);
    float* window = host.data<float>();
    std::fill_n(window, n, 0.0f);  // the padding between segments stays zero
    pieces.clear();
    for (const FsdpSegment& s : layout_.segments()) {
      const int64_t a = std::max(w, s.shard_offset), b = std::min(w + n, s.shard_offset + s.numel);
      if (a < b) pieces.push_back({&s, a - s.shard_offset, b - a, window + (a - w)});
    }
    fill(pieces);
    const Tensor window_out = master_.narrow(w, w + n);
    if (window_out.dtype() == DType::F32) window_out.copy_from(host.narrow(0, n));
    else cast(window_out, host.narrow(0, n).to(device_));  // a frozen bf16 chunk (NOTE [Frozen FSDP base])
  }
  refresh_compute_weights(false);
}

void Fsdp::initialize(uint64_t seed) {
  check_decoder("initialize");
  // Each rank draws only its segments (a value depends on the seed, the name and its
  // index alone), a window at a time, each window's pieces in parallel.
  fill_master([&](const std::vector<MasterPiece>& pieces) {
    std::vector<ParameterRange> ranges;
    for (const MasterPiece& p : pieces)
      ranges.push_back({static_cast<size_t>(p.segment->spec), p.segment->param_begin + p.begin, p.count, p.out});
    initialize_parameter_ranges(config_, layout_.specs(), seed, ranges, options_.tensor_parallel);
  });
}

void Fsdp::load_master(const std::function<void(int64_t, std::span<float>)>& read) {
  fill_master([&](const std::vector<MasterPiece>& pieces) {
    for (const MasterPiece& p : pieces)
      read(p.segment->flat_offset + p.begin, std::span<float>(p.out, static_cast<size_t>(p.count)));
  });
}

void Fsdp::set_parameter(size_t spec, const Tensor& values) {
  FORGE_CHECK(spec < layout_.specs().size() && values.numel() == shape_numel(layout_.specs()[spec].shape) &&
                  values.dtype() == DType::F32 && values.device() == Device::CPU,
              "FSDP set_parameter: {} fp32 host values for parameter {}", values.numel(), spec);
  const Tensor flat = values.view({values.numel()});
  for (size_t i = 0; i < layout_.segments().size(); ++i) {
    const FsdpSegment& s = layout_.segments()[i];
    if (s.spec != static_cast<int>(spec)) continue;
    // A host window at a time: on the GPU the fp32 staging stays within options_.host_window.
    const int64_t window = std::max<int64_t>(options_.host_window, 1);
    for (int64_t k = 0; k < s.numel; k += window) {
      const int64_t n = std::min(window, s.numel - k);
      cast(master_segments_[i].narrow(k, k + n), flat.narrow(s.param_begin + k, s.param_begin + k + n).to(device_));
    }
  }
}

void Fsdp::refresh_compute_weights(bool chunk_written) {
  if (!chunk_written)
    for (size_t i = 0; i < master_segments_.size(); ++i)
      if (compute_segments_[i].defined()) cast(compute_segments_[i], master_segments_[i]);
  // The units kept in full are all-gathered on the communication stream once the
  // optimizer's writes are done, each marking its own event: the forward pass waits for
  // each unit only where it first uses it, so the gathers of later blocks run behind the
  // compute of earlier ones.
  begin_exposed();  // on the CPU the collectives below block; on CUDA nothing here waits
  updated_->record(kCompute);
  updated_->make_wait(comm_.get());
  for (int u = 0; u < layout_.num_units(); ++u) {
    if (!layout_.holds(u) || (gathers_blocks() && layout_.is_block(u)) || (fp8_head_ && u == layout_.head_unit()))
      continue;
    const Tensor full = gathers_blocks() ? root_unit(u) : unit_full(full_compute_, u);
    gather_unit(full, u, comm_.get());
    unit_ready_[static_cast<size_t>(u)]->record(comm_.get());
    unit_pending_[static_cast<size_t>(u)] = true;
  }
  end_exposed();
  // Gathered blocks (ZeRO-3, FP8 all-gather) hold the old weights: forget them. The next gather into a
  // slot waits for `released`, recorded here after everything enqueued so far: the last
  // uses of the old block and the optimizer's update of the master chunk it casts from.
  for (UnitSlot* slot : all_weight_slots()) {
    if (!slot->released) continue;
    slot->released->record(kCompute);
    slot->unit = -1;
  }
}

void Fsdp::await_unit(int unit) {
  if (!unit_pending_[static_cast<size_t>(unit)]) return;
  begin_exposed();
  unit_ready_[static_cast<size_t>(unit)]->make_wait(kCompute);
  end_exposed();
  unit_pending_[static_cast<size_t>(unit)] = false;
}

void Fsdp::check_held(int unit, const char* what) const {
  if (layout_.holds(unit)) return;
  std::string held;
  for (const PipelineStage& s : options_.pipeline_stages)
    held += fmt::format("{}blocks [{}, {}){}{}", held.empty() ? "" : "; ", s.first_layer,
                        s.end_layer < 0 ? config_.num_layers : s.end_layer, s.embedding ? " + embedding" : "",
                        s.head ? " + head" : "");
  FORGE_FAIL("FSDP: {} asked for, but this pipeline rank's stages ({}) do not hold {}", what, held,
             unit == FsdpLayout::kEmbeddingUnit ? std::string("the embedding")
             : unit == layout_.head_unit()     ? std::string("the head (final norm, output projection)")
                                               : fmt::format("block {}", unit - 1));
}

const Tensor& Fsdp::embedding() {
  check_decoder("embedding");
  check_held(FsdpLayout::kEmbeddingUnit, "embedding");
  await_unit(FsdpLayout::kEmbeddingUnit);
  return root_weights_.embedding;
}

const Tensor& Fsdp::final_norm() {
  check_decoder("final_norm");
  check_held(layout_.head_unit(), "final_norm");
  if (fp8_head_) return fp8_head().block.params.at(head_param("final_norm.weight")).weight;
  await_unit(layout_.head_unit());
  return root_weights_.final_norm;
}

const LinearWeight& Fsdp::output() {
  check_decoder("output");
  check_held(layout_.head_unit(), "output");
  if (fp8_head_) return fp8_head().block.params.at(head_param("output.weight"));
  await_unit(tied() ? FsdpLayout::kEmbeddingUnit : layout_.head_unit());
  return root_weights_.output;
}

void Fsdp::begin_step() {
  reset_exposed_comm();  // what evaluation waited for is not the step's
  if (options_.frozen) return;  // nothing to reduce (NOTE [Frozen FSDP base])
  grad_shard_.fill_zero();
  // The full-size gradients (ZeRO-1, a tied embedding) are written over by the step's
  // first micro-batch; their padding is never written and stays zero.
  std::fill(unit_fresh_.begin(), unit_fresh_.end(), true);
  std::fill(reduced_this_step_.begin(), reduced_this_step_.end(), false);
  pending_reduction_ = false;
}

void Fsdp::begin_micro_batch(bool last) { last_micro_batch_ = last; }

void Fsdp::end_micro_batch() {
  for (const UnitSlot& s : grad_slots_)
    FORGE_CHECK(s.unit < 0, "FSDP: the gradients of unit {} were never reduced (no *_done call)", s.unit);
}

void Fsdp::reduce_unit(int unit, const Tensor& grads, ReduceChannel& ch) {
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  const bool bf16 = options_.reduce_dtype == DType::BF16;
  Tensor source = grads;
  if (bf16) {
    source = ch.staging.narrow(0, u.numel);
    cast(source, grads);  // compute stream, after the unit's backward
  }
  // The step's first reduction of a unit may write the (zeroed) chunk directly.
  const bool direct = !bf16 && !reduced_this_step_[static_cast<size_t>(unit)];
  if (!direct && !ch.reduced.defined())
    ch.reduced = Tensor::zeros({layout_.max_shard_numel()}, options_.reduce_dtype, device_);
  begin_exposed();  // on the CPU the collectives below block; on CUDA nothing here waits
  ch.ready->record(kCompute);
  ch.ready->make_wait(comm_.get());
  const Tensor chunk = shard_of(grad_shard_, unit);
  const Tensor out = direct ? chunk : ch.reduced.narrow(0, u.shard_numel);
  for (const FsdpPart& part : u.parts)
    group_of(part).reduce_scatter(chunk_piece(out, part), source.narrow(part.begin, part.begin + part.numel),
                                  ReduceOp::Sum, comm_.get());
  if (replicate_group_) replicate_group_->all_reduce(out, ReduceOp::Sum, comm_.get());
  if (!direct) accumulate(chunk, out, comm_.get());
  ch.done->record(comm_.get());
  reduced_this_step_[static_cast<size_t>(unit)] = true;
  end_exposed();
}

void Fsdp::reduce_gradients() {
  if (options_.frozen) return;  // nothing to reduce (NOTE [Frozen FSDP base]): the adapters are reduced
  check_trainable("reduce_gradients");
  // NOTE [ZeRO-2 and -3 under pipeline parallelism]: every backward of a unit was reduced as it was done.
  if (options_.zero_stage >= 2) {
    FORGE_CHECK(pipelined(), "FSDP reduce_gradients: ZeRO-{} reduces each unit as its backward is done; only "
                             "over a pipeline rank's stages is it called (and then there is nothing left)",
                options_.zero_stage);
    pending_reduction_ = false;
    return;
  }
  // Every unit whose gradients the step wrote and that is not reduced yet, in unit order:
  // the ranks of a shard group ran the same backwards, so they issue the same collectives.
  for (int u = 0; u < layout_.num_units(); ++u) {
    const size_t k = static_cast<size_t>(u);
    if (!layout_.holds(u) || unit_fresh_[k] || reduced_this_step_[k]) continue;
    reduce_full_unit(u);
  }
  pending_reduction_ = false;
}

void Fsdp::finish_gradients() {
  FORGE_CHECK(!pending_reduction_, "FSDP over a pipeline rank's stages: the step's gradients were never reduced "
                                   "(call reduce_gradients() after the pipeline schedule, before finish_gradients())");
  join_comm();
}

double Fsdp::global_grad_sum_of_squares(double replicated_weight) {
  check_trainable("global_grad_sum_of_squares");
  double sum = sum_of_squares(grad_shard_);
  if (replicated_weight != 1.0)
    for (size_t i = 0; i < grad_segments_.size(); ++i)
      if (layout_.specs()[static_cast<size_t>(layout_.segments()[i].spec)].tensor_parallel ==
          TensorParallelSplit::Replicated)
        sum -= (1.0 - replicated_weight) * sum_of_squares(grad_segments_[i]);
  // After the reductions every replica holds the same chunk: the shard group covers the model once.
  return all_reduce_scalar(shard_group_, sum);
}

const BlockWeights& Fsdp::layer(int index) {
  FORGE_CHECK(index >= 0 && index < config_.num_layers, "FSDP: block {} of {}", index, config_.num_layers);
  check_held(FsdpLayout::unit_of_layer(index), "layer");
  if (!gathers_blocks()) {
    await_unit(FsdpLayout::unit_of_layer(index));
    return static_layers_[static_cast<size_t>(index)];
  }
  const int unit = FsdpLayout::unit_of_layer(index);
  if (options_.fp8_all_gather) {
    FORGE_CHECK(fp8_, "FSDP's FP8 all-gather needs the FP8 projections (set_fp8_projections)");
    FORGE_CHECK(options_.tensor_parallel.size == 1 || fp8_tensor_parallel_,
                "FSDP's FP8 all-gather under tensor parallelism needs the tensor-parallel group "
                "(set_fp8_tensor_parallel_group)");
    // NOTE [FP8 all-gather]: codes of an older weight generation are gathered again.
    for (UnitSlot& s : weight_slots_)
      if (s.unit >= 0 && s.generation != fp8_->weight_generation()) {
        s.released->record(kCompute);
        s.unit = -1;
      }
  }
  auto slot_of = [&](int u) -> UnitSlot* {
    for (UnitSlot& s : weight_slots_)
      if (s.unit == u) return &s;
    return nullptr;
  };
  begin_exposed();
  if (!slot_of(unit)) gather_block(unit, unit);
  UnitSlot& slot = *slot_of(unit);
  // Prefetch the neighbours: the next block in a forward pass, the previous one in a
  // backward pass (whichever is already there costs nothing).
  for (int neighbour : {unit + 1, unit - 1})
    if (layout_.is_block(neighbour) && layout_.holds(neighbour) && !slot_of(neighbour)) gather_block(neighbour, unit);
  // NOTE [FP8 all-gather of the head]: the last block's forward prefetches the head.
  if (fp8_head_ && unit + 1 == layout_.head_unit() && !fp8_head_current())
    gather_fp8_slot(head_slot_, layout_.head_unit());
  slot.ready->make_wait(kCompute);
  end_exposed();
  return slot.block;
}

void Fsdp::gather_block(int unit, int requested) {
  UnitSlot* target = nullptr;
  if (options_.zero_stage == 3) {  // three rotating slots
    for (UnitSlot& s : weight_slots_)
      if (s.unit < 0 || std::abs(s.unit - requested) > 1) {
        target = &s;
        break;
      }
  } else {
    // One slot per held block (FP8 all-gather, ZeRO-1/2).
    target = &weight_slots_.at(static_cast<size_t>(block_slot_.at(static_cast<size_t>(unit))));
  }
  FORGE_CHECK(target, "FSDP: no free gather buffer for block {}", unit - 1);
  if (options_.fp8_all_gather) return gather_fp8_slot(*target, unit);
  if (target->unit >= 0) target->released->record(kCompute);  // every use of the old block is enqueued
  target->released->make_wait(comm_.get());
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  const Tensor full = target->buffer.narrow(0, u.numel);
  // This rank's part comes from its master chunk, the others' from theirs, in place.
  for (const FsdpPart& part : u.parts) cast(own_piece(full, part), chunk_piece(shard_of(master_, unit), part), comm_.get());
  gather_unit(full, unit, comm_.get());
  target->ready->record(comm_.get());
  target->unit = unit;
  target->block = block_views(full, unit);
}

void Fsdp::gather_fp8_slot(UnitSlot& slot, int unit) {
  copy_delayed_scales(slot, unit);  // after every use of the old unit, on the compute stream
  slot.released->record(kCompute);
  slot.released->make_wait(comm_.get());
  gather_fp8_block(slot, unit);
  slot.ready->record(comm_.get());
  slot.unit = unit;
  slot.generation = fp8_->weight_generation();
  fp8_block_views(slot, unit);
}

bool Fsdp::fp8_head_current() const {
  return head_slot_.unit >= 0 && fp8_ && head_slot_.generation == fp8_->weight_generation();
}

const Fsdp::UnitSlot& Fsdp::fp8_head() {
  FORGE_CHECK(fp8_, "FSDP's FP8 all-gather needs the FP8 projections (set_fp8_projections)");
  begin_exposed();
  if (!fp8_head_current()) gather_fp8_slot(head_slot_, layout_.head_unit());
  head_slot_.ready->make_wait(kCompute);
  end_exposed();
  return head_slot_;
}

size_t Fsdp::head_param(const std::string& name) const {
  const FsdpUnit& unit = layout_.units()[static_cast<size_t>(layout_.head_unit())];
  for (size_t k = 0; k < unit.params.size(); ++k)
    if (layout_.specs()[static_cast<size_t>(unit.params[k].spec)].name == name) return k;
  FORGE_FAIL("FSDP: the head unit holds no '{}'", name);
}

std::vector<Fsdp::UnitSlot*> Fsdp::all_weight_slots() {
  std::vector<UnitSlot*> slots;
  for (UnitSlot& s : weight_slots_) slots.push_back(&s);
  if (fp8_head_) slots.push_back(&head_slot_);
  return slots;
}

void Fsdp::set_fp8_projections(const Fp8Projections& fp8) {
  FORGE_CHECK(options_.fp8_all_gather, "FSDP: FP8 projections given without the FP8 all-gather");
  fp8_ = &fp8;
  fp8_piece_projection_.assign(fp8_pieces_.size(), {});
  for (size_t u = 0; u < fp8_pieces_.size(); ++u)
    for (const Fp8GatherPiece& piece : fp8_pieces_[u]) {
      const int64_t projection = fp8.projection_index(piece.projection);
      FORGE_CHECK(projection >= 0, "FSDP's FP8 all-gather: '{}' has no FP8 projection", piece.projection);
      fp8_piece_projection_[u].push_back(projection);
    }
}

void Fsdp::set_fp8_tensor_parallel_group(ProcessGroup& group) {
  FORGE_CHECK(options_.fp8_all_gather, "FSDP: a tensor-parallel group for the FP8 all-gather given without it");
  FORGE_CHECK(group.world_size() == options_.tensor_parallel.size && group.rank() == options_.tensor_parallel.rank,
              "FSDP's FP8 all-gather: a tensor-parallel group of rank {} of {} given to tensor-parallel rank {} of {}",
              group.rank(), group.world_size(), options_.tensor_parallel.rank, options_.tensor_parallel.size);
  fp8_tensor_parallel_ = &group;
}

void Fsdp::copy_delayed_scales(UnitSlot& slot, int unit) {
  FORGE_CHECK(fp8_, "FSDP's FP8 all-gather needs the FP8 projections (set_fp8_projections)");
  if (!fp8_->delayed_active()) return;
  constexpr int64_t kStride = cpu::kFp8StatStride;
  // NOTE [FP8 all-gather pieces]: each piece takes its statistics block's W scale (kv_a's
  // two pieces the same one).
  const std::vector<int64_t>& projections = fp8_piece_projection_.at(static_cast<size_t>(unit));
  for (size_t k = 0; k < projections.size(); ++k) {
    const auto j = static_cast<int64_t>(k);
    const int64_t scale = cpu::fp8_scale_offset(projections[k], cpu::Fp8Role::W);
    const int64_t scale_inv = cpu::fp8_scale_inv_offset(projections[k], cpu::Fp8Role::W);
    cast(slot.scales.narrow(2 * j * kStride, 2 * j * kStride + 1), fp8_->statistics().narrow(scale, scale + 1), kCompute);
    cast(slot.scales.narrow((2 * j + 1) * kStride, (2 * j + 1) * kStride + 1),
         fp8_->statistics().narrow(scale_inv, scale_inv + 1), kCompute);
  }
}

void Fsdp::gather_fp8_block(UnitSlot& slot, int unit) {
  constexpr int64_t kStride = cpu::kFp8StatStride;
  const CudaStream stream = comm_.get();
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  const FsdpPart& part = u.parts.front();  // the dense part, over every shard rank
  const int64_t own = part.begin + part.index * part.shard_numel, own_end = own + part.shard_numel;
  Tensor chunk = shard_of(master_, unit);
  if (chunk.dtype() != DType::F32) {  // NOTE [FP8 all-gather of a frozen base]: exact, bf16 -> fp32
    const Tensor f32 = frozen_chunk_f32_.narrow(0, chunk.numel());
    cast(f32, chunk, stream);
    chunk = f32;
  }
  // This rank's elements [lo, hi) of parameter p (unit offsets), empty when it holds none.
  auto overlap = [&](const FsdpParam& p, int64_t begin, int64_t end) {
    const int64_t lo = std::min(std::max(begin, p.offset), end), hi = std::min(end, p.offset + p.numel);
    return std::pair{lo, std::max(lo, hi)};
  };
  // 1-2. Each FP8 piece's amax over this rank's chunk (NOTE [FP8 all-gather pieces]: a
  // weight, an expert's matrix, one of kv_a's row views); tensorwise: max-reduced over the
  // shard group (this tensor-parallel shard's amax), then over the tensor-parallel group
  // (the whole weight's), then the scales.
  const std::vector<Fp8GatherPiece>& pieces = fp8_pieces_.at(static_cast<size_t>(unit));
  const auto weights = static_cast<int64_t>(pieces.size());
  for (int64_t j = 0; j < weights; ++j) {
    const auto [lo, hi] = fp8_piece_overlap(pieces[static_cast<size_t>(j)], own, own_end);
    fp8_chunk_amax(slot.amax.narrow(j, j + 1), chunk.narrow(lo - own, hi - own), stream);
  }
  const Tensor amax = slot.amax.narrow(0, std::max<int64_t>(weights, 1));
  if (!fp8_->delayed_active()) {
    shard_group_.all_reduce(amax, ReduceOp::Max, stream);
    if (fp8_tensor_parallel_) fp8_tensor_parallel_->all_reduce(amax, ReduceOp::Max, stream);
    fp8_chunk_scales(slot.scales, amax, stream);
  }
  // 3. This rank's codes into its place (packed: one after the other, in piece order,
  // which is the parameters' element order), and the byte all-gather.
  if (packs_codes(unit)) {
    const int64_t m = code_wire_numel_;
    const Tensor mine = code_wire_.narrow(part.index * m, (part.index + 1) * m);
    int64_t packed = 0;
    for (int64_t j = 0; j < weights; ++j) {
      const auto [lo, hi] = fp8_piece_overlap(pieces[static_cast<size_t>(j)], own, own_end);
      if (hi > lo)
        fp8_chunk_cast(mine.narrow(packed, packed + (hi - lo)), chunk.narrow(lo - own, hi - own),
                       slot.scales.narrow(2 * j * kStride, 2 * j * kStride + 1), Tensor(), stream);
      packed += hi - lo;
    }
    if (m > 0) {
      shard_group_.all_gather(code_wire_.narrow(0, part.ranks * m), mine, stream);
      unpack_wire(slot.codes, code_wire_, m, unit, true, stream);
    }
  } else {
    const Tensor codes = slot.codes.narrow(0, part.numel);  // the dense part, from 0
    for (int64_t j = 0; j < weights; ++j) {
      const auto [lo, hi] = fp8_piece_overlap(pieces[static_cast<size_t>(j)], own, own_end);
      if (hi > lo)
        fp8_chunk_cast(codes.narrow(lo, hi), chunk.narrow(lo - own, hi - own),
                       slot.scales.narrow(2 * j * kStride, 2 * j * kStride + 1), Tensor(), stream);
    }
    shard_group_.all_gather(codes.narrow(part.begin, part.begin + part.numel), codes.narrow(own, own_end), stream);
  }
  // Expert parallelism: the expert part in the compute dtype, in place over its group.
  for (const FsdpPart& expert_part : u.parts) {
    if (!expert_part.expert) continue;
    const Tensor experts = slot.experts.narrow(0, expert_part.numel);
    const int64_t begin = expert_part.index * expert_part.shard_numel;
    const Tensor mine = experts.narrow(begin, begin + expert_part.shard_numel);
    cast(mine, chunk_piece(chunk, expert_part), stream);
    group_of(expert_part).all_gather(experts, mine, stream);
  }
  // 4. The norms: packed by each rank, gathered, unpacked from every rank's pieces.
  if (norm_wire_numel_ == 0) return;
  const int64_t m = norm_wire_numel_;
  int64_t packed = 0;
  const Tensor mine = norm_wire_.narrow(part.index * m, (part.index + 1) * m);
  for (const FsdpParam& p : u.params) {
    if (!in_norms(p)) continue;
    const auto [lo, hi] = overlap(p, own, own_end);
    if (hi > lo) cast(mine.narrow(packed, packed + (hi - lo)), chunk.narrow(lo - own, hi - own), stream);
    packed += hi - lo;
  }
  shard_group_.all_gather(norm_wire_.narrow(0, part.ranks * m), mine, stream);
  unpack_wire(slot.norms, norm_wire_, m, unit, false, stream);
}

void Fsdp::unpack_wire(const Tensor& dst, const Tensor& wire, int64_t m, int unit, bool codes, CudaStream stream) {
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  const FsdpPart& part = u.parts.front();
  for (int r = 0; r < part.ranks; ++r) {
    const int64_t begin = part.begin + r * part.shard_numel, end = begin + part.shard_numel;
    int64_t at = r * m, into_param = 0;  // in the wire; the parameter's first element in dst
    for (const FsdpParam& p : u.params) {
      if (codes ? !is_fp8(p) : !in_norms(p)) continue;
      const int64_t lo = std::min(std::max(begin, p.offset), end), hi = std::max(lo, std::min(end, p.offset + p.numel));
      const int64_t into = into_param + (lo - p.offset);
      if (hi > lo) cast(dst.narrow(into, into + (hi - lo)), wire.narrow(at, at + (hi - lo)), stream);
      at += hi - lo;
      into_param += p.numel;
    }
  }
}

void Fsdp::fp8_block_views(UnitSlot& slot, int unit) {
  constexpr int64_t kStride = cpu::kFp8StatStride;
  slot.block.params.clear();
  // NOTE [FP8 all-gather pieces]: one descriptor per piece; a parameter's points at its
  // first piece's, the others (experts, kv_a's rotary rows) following it.
  const std::vector<Fp8GatherPiece>& pieces = fp8_pieces_.at(static_cast<size_t>(unit));
  float* scales = slot.scales.data<float>();
  for (size_t k = 0; k < pieces.size(); ++k) {
    const auto j = static_cast<int64_t>(k);
    slot.gathered.at(k) = {slot.amax.data<float>() + j, scales + 2 * j * kStride, scales + (2 * j + 1) * kStride};
  }
  const std::vector<FsdpParam>& params = layout_.units()[static_cast<size_t>(unit)].params;
  size_t first = 0;  // the next parameter's first piece
  int64_t norms = 0, codes = 0;  // packed codes: the next FP8 parameter's first element
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  const int64_t expert_begin = u.parts.back().expert ? u.parts.back().begin : 0;  // the expert part's
  for (size_t k = 0; k < params.size(); ++k) {
    const FsdpParam& p = params[k];
    if (p.expert) {  // expert parallelism: in the expert part's compute-dtype buffer
      const int64_t at = p.offset - expert_begin;
      slot.block.params.push_back({slot.experts.narrow(at, at + p.numel).view(p.shape)});
      continue;
    }
    if (!is_fp8(p)) {
      slot.block.params.push_back({slot.norms.narrow(norms, norms + p.numel).view(p.shape)});
      norms += p.numel;
      continue;
    }
    FORGE_CHECK(first < pieces.size() && pieces[first].param == static_cast<int>(k),
                "FSDP's FP8 all-gather: parameter {} of block unit {} has no piece", k, unit);
    const int64_t at = packs_codes(unit) ? codes : p.offset;
    codes += p.numel;
    LinearWeight w{slot.codes.narrow(at, at + p.numel).view(p.shape)};
    w.fp8_gathered = &slot.gathered[first];
    slot.block.params.push_back(w);
    while (first < pieces.size() && pieces[first].param == static_cast<int>(k)) ++first;
  }
}

Fsdp::UnitSlot& Fsdp::grad_slot(int unit) {
  for (UnitSlot& s : grad_slots_)
    if (s.unit == unit) return s;
  UnitSlot& slot = grad_slots_[static_cast<size_t>(next_channel_)];
  FORGE_CHECK(slot.unit < 0, "FSDP: gradients of unit {} asked for while units {} and {} are not reduced", unit,
              grad_slots_[0].unit, grad_slots_[1].unit);
  next_channel_ = (next_channel_ + 1) % static_cast<int>(grad_slots_.size());
  // Its previous reduce-scatter must be done before the buffer is reused.
  begin_exposed();
  channels_[static_cast<size_t>(slot.channel)].done->make_wait(kCompute);
  end_exposed();
  const Tensor full = slot.buffer.narrow(0, layout_.units()[static_cast<size_t>(unit)].numel);
  zero_padding(full, unit);  // the model writes the rest (NOTE [Fresh gradient buffers])
  unit_fresh_[static_cast<size_t>(unit)] = true;
  slot.unit = unit;
  if (layout_.is_block(unit) || units_model_) slot.block = block_views(full, unit);
  else root_views(full, unit, slot.root);
  return slot;
}

void Fsdp::zero_padding(const Tensor& unit_buffer, int unit) const {
  const FsdpUnit& u = layout_.units()[static_cast<size_t>(unit)];
  std::vector<std::pair<int64_t, int64_t>> ranges;  // the parameters' [offset, end), in unit order
  for (const FsdpParam& p : u.params) ranges.emplace_back(p.offset, p.offset + p.numel);
  std::sort(ranges.begin(), ranges.end());  // an expert part's parameters follow the dense part's
  int64_t end = 0;  // of the previous parameter
  for (const auto& [begin, stop] : ranges) {
    if (begin > end) unit_buffer.narrow(end, begin).fill_zero();
    end = stop;
  }
  if (u.numel > end) unit_buffer.narrow(end, u.numel).fill_zero();
}

void Fsdp::reduce_full_unit(int unit) {
  ReduceChannel& ch = channels_[static_cast<size_t>(next_channel_)];
  next_channel_ = (next_channel_ + 1) % static_cast<int>(channels_.size());
  begin_exposed();
  ch.done->make_wait(kCompute);
  end_exposed();
  reduce_unit(unit, unit_full(full_grads_, unit), ch);
}

void Fsdp::unit_done(int unit) {
  unit_fresh_[static_cast<size_t>(unit)] = false;
  if (pipelined() && options_.zero_stage == 1) {  // reduced once after the whole schedule (reduce_gradients)
    FORGE_CHECK(!reduced_this_step_[static_cast<size_t>(unit)],
                "FSDP: a backward of unit {} after the step's reduce_gradients() (call begin_step() first)", unit);
    pending_reduction_ = true;
    return;
  }
  if (options_.zero_stage == 1) {
    if (!last_micro_batch_) return;
    reduce_full_unit(unit);
    return;
  }
  if (unit == FsdpLayout::kEmbeddingUnit && tied()) {
    if (!last_micro_batch_) return;
    begin_exposed();
    embedding_channel_.done->make_wait(kCompute);
    end_exposed();
    reduce_unit(unit, full_grads_, embedding_channel_);
    return;
  }
  for (UnitSlot& s : grad_slots_) {
    if (s.unit != unit) continue;
    reduce_unit(unit, s.buffer.narrow(0, layout_.units()[static_cast<size_t>(unit)].numel),
                channels_[static_cast<size_t>(s.channel)]);
    s.unit = -1;  // the next request for this unit's gradients starts a fresh buffer
    return;
  }
  FORGE_FAIL("FSDP: unit {} done before its gradients were asked for", unit);
}

void Fsdp::check_trainable(const char* what) const {
  FORGE_CHECK(!options_.frozen, "FSDP: {} of a frozen base (NOTE [Frozen FSDP base]: it has no gradients)", what);
}

const BlockWeights& Fsdp::layer_grads(int index) {
  check_trainable("layer_grads");
  FORGE_CHECK(index >= 0 && index < config_.num_layers, "FSDP: block {} of {}", index, config_.num_layers);
  check_held(FsdpLayout::unit_of_layer(index), "layer_grads");
  if (options_.zero_stage == 1) return static_layer_grads_[static_cast<size_t>(index)];
  return grad_slot(FsdpLayout::unit_of_layer(index)).block;
}

void Fsdp::layer_done(int index) {
  FORGE_CHECK(index >= 0 && index < config_.num_layers, "FSDP: block {} of {}", index, config_.num_layers);
  check_held(FsdpLayout::unit_of_layer(index), "layer_done");
  unit_done(FsdpLayout::unit_of_layer(index));
}

const Tensor& Fsdp::embedding_grad() {
  check_decoder("embedding_grad");
  check_trainable("embedding_grad");
  check_held(FsdpLayout::kEmbeddingUnit, "embedding_grad");
  if (options_.zero_stage == 1 || tied()) return root_grads_.embedding;
  return grad_slot(FsdpLayout::kEmbeddingUnit).root.embedding;
}

void Fsdp::embedding_done() {
  check_held(FsdpLayout::kEmbeddingUnit, "embedding_done");
  unit_done(FsdpLayout::kEmbeddingUnit);
}

const Tensor& Fsdp::final_norm_grad() {
  check_decoder("final_norm_grad");
  check_trainable("final_norm_grad");
  check_held(layout_.head_unit(), "final_norm_grad");
  if (options_.zero_stage == 1) return root_grads_.final_norm;
  return grad_slot(layout_.head_unit()).root.final_norm;
}

const LinearWeight& Fsdp::output_grad() {
  check_decoder("output_grad");
  check_trainable("output_grad");
  check_held(layout_.head_unit(), "output_grad");
  if (options_.zero_stage == 1 || tied()) return root_grads_.output;
  return grad_slot(layout_.head_unit()).root.output;
}

void Fsdp::head_done() {
  check_held(layout_.head_unit(), "head_done");
  if (tied()) unit_fresh_[FsdpLayout::kEmbeddingUnit] = false;  // the head wrote into the embedding's gradients
  unit_done(layout_.head_unit());
}

bool Fsdp::layer_grads_fresh(int index) const {
  return unit_fresh_[static_cast<size_t>(FsdpLayout::unit_of_layer(index))];
}
bool Fsdp::head_grads_fresh() const { return unit_fresh_[static_cast<size_t>(layout_.head_unit())]; }
bool Fsdp::embedding_grad_fresh() const { return unit_fresh_[FsdpLayout::kEmbeddingUnit]; }

FsdpMemory Fsdp::memory() const {
  FsdpMemory m;
  (options_.frozen ? m.compute_weights : m.master_weights) = static_cast<int64_t>(master_.nbytes());
  if (grad_shard_.defined()) m.gradient_shard = static_cast<int64_t>(grad_shard_.nbytes());
  for (const Tensor* t : {&full_compute_, &root_compute_})
    if (t->defined()) m.compute_weights += static_cast<int64_t>(t->nbytes());
  std::vector<const UnitSlot*> slots;
  for (const UnitSlot& s : weight_slots_) slots.push_back(&s);
  if (fp8_head_) slots.push_back(&head_slot_);  // NOTE [FP8 all-gather of the head]
  for (const UnitSlot* s : slots)
    for (const Tensor* t : {&s->buffer, &s->codes, &s->norms, &s->amax, &s->scales, &s->experts})
      if (t->defined()) m.compute_weights += static_cast<int64_t>(t->nbytes());
  for (const Tensor* t : {&norm_wire_, &code_wire_, &frozen_chunk_f32_})
    if (t->defined()) m.compute_weights += static_cast<int64_t>(t->nbytes());
  if (full_grads_.defined()) m.full_gradients = static_cast<int64_t>(full_grads_.nbytes());
  for (const UnitSlot& s : grad_slots_)
    if (s.buffer.defined()) m.full_gradients += static_cast<int64_t>(s.buffer.nbytes());
  for (const ReduceChannel* ch : {&channels_[0], &channels_[1], &embedding_channel_})
    for (const Tensor* t : {&ch->staging, &ch->reduced})
      if (t->defined()) m.reduce_buffers += static_cast<int64_t>(t->nbytes());
  return m;
}

void Fsdp::gather_flat_range(const std::vector<Tensor>& segments, int64_t begin, int64_t end, std::span<float> out) {
  FORGE_CHECK(segments.size() == layout_.segments().size(), "FSDP gather_flat_range: {} tensors for {} segments",
              segments.size(), layout_.segments().size());
  FORGE_CHECK(begin <= end && static_cast<int64_t>(out.size()) == end - begin, "FSDP gather_flat_range: [{}, {}) into {}",
              begin, end, out.size());
  const int world = layout_.world_size();
  join_comm();
  constexpr int64_t kSlice = int64_t{1} << 24;
  Tensor gathered = Tensor::empty({world * std::min(kSlice, layout_.max_shard_numel())}, DType::F32, device_);
  // One unit's chunk at a time, in fp32 (the moments may be bf16): never the whole shard.
  Tensor unit_chunk = Tensor::empty({std::max<int64_t>(layout_.max_shard_numel(), 1)}, DType::F32, device_);
  for (int u = 0; u < layout_.num_units(); ++u) {
    if (!layout_.holds(u)) continue;  // another pipeline rank's: no collective
    const FsdpUnit& unit = layout_.units()[static_cast<size_t>(u)];
    const Tensor chunk = unit_chunk.narrow(0, unit.shard_numel);
    chunk.fill_zero();
    for (size_t i = 0; i < segments.size(); ++i) {
      const FsdpSegment& s = layout_.segments()[i];
      if (s.unit != u) continue;
      const int64_t local = s.shard_offset - unit.shard_offset;
      cast(chunk.narrow(local, local + s.numel), segments[i].view({s.numel}));
    }
    // Every part is gathered over all the shard ranks, so that rank 0 sees every expert:
    // rank r's piece of the dense part is its chunk r, of an expert part the chunk r / P of
    // expert-parallel rank r % P's experts (NOTE [FSDP layout]).
    const int p = layout_.expert_parallel();
    for (const FsdpPart& part : unit.parts) {
      const Tensor piece = chunk_piece(chunk, part);
      for (int64_t k = 0; k < part.shard_numel; k += kSlice) {
        const int64_t n = std::min(kSlice, part.shard_numel - k);
        const Tensor slices = gathered.narrow(0, world * n);
        shard_group_.all_gather(slices, piece.narrow(k, k + n), kCompute);
        std::optional<Tensor> host;
        for (int r = 0; r < world; ++r) {
          const int64_t a = part.begin + (part.expert ? r / p : r) * part.shard_numel + k, b = a + n;
          for (const FsdpParam& param : unit.params) {
            if (param.expert != part.expert) continue;
            const int64_t lo = std::max(a, param.offset), hi = std::min(b, param.offset + param.numel);
            if (lo >= hi) continue;
            const int64_t slice_shift = param.expert ? (r % p - layout_.rank() % p) * param.numel : 0;
            const int64_t flat_lo = param.flat_offset + slice_shift + (lo - param.offset);
            const int64_t want_lo = std::max(flat_lo, begin), want_hi = std::min(flat_lo + (hi - lo), end);
            if (want_lo >= want_hi) continue;
            if (!host) host = slices.to(Device::CPU);
            std::copy_n(host->data<float>() + r * n + (lo - a) + (want_lo - flat_lo), want_hi - want_lo,
                        out.data() + (want_lo - begin));
          }
        }
      }
    }
  }
}

void Fsdp::gather_to_host(const std::vector<Tensor>& segments, std::vector<float>& flat) {
  const int64_t total = layout_.flat_numel();
  const bool root = layout_.rank() == 0;
  if (root) flat.assign(static_cast<size_t>(total), 0.0f);
  gather_flat_range(segments, 0, root ? total : 0, root ? std::span<float>(flat) : std::span<float>());
}

}  // namespace forge
