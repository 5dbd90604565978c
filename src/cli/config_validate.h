// Validation of a whole experiment config: every key's own range (for values that came
// from defaults), then the model's and the optimizer's own rules (model/config_rules.cpp,
// optim/config_rules.cpp: heads divisible by KV heads, min_lr within lr, ...) told where
// each value came from, then the relations no single section owns (sequence length within
// the model's, data and checkpoint keys that need each other, batch sizes that agree).
// Finally the derived batch values are resolved so that the trainer reads both
// gradient_accumulation_steps and global_batch_size, never a 0 that means "derive me".
#pragma once

#include <map>
#include <string>

#include "train/experiment.h"

namespace forge {

// Where each key's value came from: "exp.yaml:4", "llama3.1-8b.yaml:7", "command line".
// Keys not present kept their default. Error messages quote these origins.
using ConfigOrigins = std::map<std::string, std::string>;

// Throws forge::Error naming the key(s), their values and origins, and what was expected.
// On success training.gradient_accumulation_steps and training.global_batch_size are set:
//   global = local × accumulation × dp (dp = parallelism.data_parallel_shard_degree),
// the missing one derived from the other, accumulation 1 when neither is given.
void validate_experiment(ExperimentConfig& config, const ConfigOrigins& origins = {});

}  // namespace forge
