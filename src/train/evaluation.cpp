#include "train/evaluation.h"

#include <chrono>
#include <cmath>
#include <memory>

#include "core/log.h"
#include "model/decoder_lm.h"
#include "train/trainer.h"

namespace forge {

EvalSummary evaluate_weights(const ExperimentConfig& config, FlatParameters& weights, Split split, int64_t batches) {
  FORGE_CHECK(batches >= 1, "evaluating {} batches", batches);
  const TrainingConfig& t = config.training;
  const Device device = compute_device(config);
  const DType dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
  std::unique_ptr<FlatParameters> on_device;
  if (device == Device::CUDA) {
    on_device = std::make_unique<FlatParameters>(config.model, device, dtype);
    on_device->assign_from(weights);
  }
  ParamSource& source = on_device ? *on_device : weights;
  const std::unique_ptr<TokenDataset> data =
      make_dataset(config.data, split, t.seq_len, config.model.vocab_size, dataset_seed(t));
  EvalSummary summary;
  summary.samples_in_split = data->num_samples();
  summary.batches = batches;
  summary.sequences = batches * t.local_batch_size;
  if (summary.sequences > summary.samples_in_split)
    log_warn("{} batches of {} sequences read {} sequences, but the {} split holds {}: the loader wraps around and "
             "counts some of them twice",
             batches, t.local_batch_size, summary.sequences, split_name(split), summary.samples_in_split);
  DecoderLM model(config.model, t.local_batch_size, t.seq_len, device, dtype, ActivationCheckpoint::None);
  DataLoader loader(*data, t.local_batch_size, 0);
  const auto t0 = std::chrono::steady_clock::now();
  LossSum total;
  double batch_means = 0.0;  // eval.average micro_batches (NOTE [Evaluation mean] in trainer.cpp)
  int64_t counted_batches = 0;
  for (int64_t i = 0; i < batches; ++i) {
    Batch batch = loader.next();
    // Packed instruction data: attention stays inside each example, positions restart
    // (NOTE [Packed examples] in ops/attention.h), exactly as in training.
    const SequenceLayout layout = sequence_layout(batch);
    const LossSum l = model.forward_loss(batch.tokens.to(device), batch.targets.to(device), source,
                                         batch.has_examples() ? &layout : nullptr);
    total.sum += l.sum;
    total.tokens += l.tokens;
    if (l.tokens > 0) {
      batch_means += l.mean();
      ++counted_batches;
    }
  }
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (total.tokens == 0) FORGE_FAIL("the {} batches evaluated hold no target tokens (every target masked)", batches);
  summary.loss = config.eval.average == "micro_batches" ? batch_means / static_cast<double>(counted_batches) : total.mean();
  summary.perplexity = std::exp(summary.loss);
  summary.tokens = total.tokens;
  return summary;
}

}  // namespace forge
