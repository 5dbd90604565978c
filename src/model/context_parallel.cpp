#include "model/context_parallel.h"

#include "core/error.h"

namespace forge {

void check_context_parallel(const ModelConfig& config, int64_t degree, int64_t seq_len) {
  FORGE_CHECK(degree >= 1, "context-parallel degree {} (at least 1)", degree);
  if (degree == 1) return;
  if (config.mla() || config.moe())
    FORGE_FAIL(
        "context parallelism over {} ranks: model '{}' has {}; context parallelism splits the sequences of "
        "the dense Llama-family blocks (grouped-query attention and a SwiGLU feed-forward)",
        degree, config.name,
        config.mla() ? "Multi-head Latent Attention (model.kv_lora_rank)" : "Mixture-of-Experts blocks");
  if (seq_len % (2 * degree) != 0)
    FORGE_FAIL(
        "context parallelism over {} ranks cuts each sequence into {} chunks (two per rank), which must divide "
        "training.seq_len = {}: choose a sequence length that is a multiple of {}",
        degree, 2 * degree, seq_len, 2 * degree);
}

ContextParallelRotate parse_context_parallel_rotate(const std::string& name) {
  if (name == "allgather") return ContextParallelRotate::AllGather;
  if (name == "p2p") return ContextParallelRotate::Ring;
  FORGE_FAIL("parallelism.context_parallel_rotate_method '{}': expected allgather (every rank's keys and values "
             "gathered) or p2p (ring attention)",
             name);
}

int64_t context_parallel_chunk(int rank, int size, int half) { return half == 0 ? rank : 2 * size - 1 - rank; }

namespace {

// Copies rank `rank`'s chunks between `sequences` [B, S, ...] and `local` [2B, L, ...], both
// viewed as matrices of rows of the batch, into `local` when `take`.
void move_chunks(const Tensor& local, const Tensor& sequences, int rank, int size, bool take) {
  FORGE_CHECK(size >= 1 && rank >= 0 && rank < size && sequences.ndim() >= 2 && sequences.numel() > 0 &&
                  sequences.dim(1) % (2 * size) == 0,
              "context parallelism: rank {} of {} cannot take chunks of sequences {}", rank, size,
              shape_str(sequences.shape()));
  const int64_t batch = sequences.dim(0), seq = sequences.dim(1);
  const int64_t chunk = seq / (2 * size), width = sequences.numel() / batch / seq * chunk;  // elements per chunk
  FORGE_CHECK(local.numel() == 2 * batch * width && local.dim(0) == 2 * batch,
              "context parallelism: the rank's chunks {} of sequences {} must be [{}, {}, ...]",
              shape_str(local.shape()), shape_str(sequences.shape()), 2 * batch, chunk);
  const Tensor rows = sequences.view({batch, 2 * size * width}), chunks = local.view({2 * batch, width});
  for (int half = 0; half < 2; ++half) {
    const Tensor part = chunks.narrow(half * batch, (half + 1) * batch);
    const int64_t begin = context_parallel_chunk(rank, size, half) * width;
    if (take)
      copy_columns(part, 0, rows, begin, width);
    else
      copy_columns(rows, begin, part, 0, width);
  }
}

}  // namespace

void take_chunks(const Tensor& local, const Tensor& sequences, int rank, int size) {
  move_chunks(local, sequences, rank, size, true);
}

void put_chunks(const Tensor& sequences, const Tensor& local, int rank, int size) {
  move_chunks(local, sequences, rank, size, false);
}

}  // namespace forge
