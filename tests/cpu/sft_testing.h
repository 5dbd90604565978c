// Instruction-data fixtures for the tests (test_data_sft.cpp, test_model_packing.cpp): an
// SFT dataset (tokens and a parallel uint8 loss mask) written with IndexedDatasetWriter, as
// `forge prep --format sft` writes it.
#pragma once

#include <string>
#include <vector>

#include "data/indexed_dataset.h"

namespace forge::testing {

struct SftExample {
  std::vector<int32_t> tokens;
  std::vector<int32_t> mask;  // 1: response token
};

inline void write_sft(const std::string& prefix, const std::vector<SftExample>& examples) {
  IndexedDatasetWriter tokens(prefix, IndexedDType::I32), mask(prefix + ".mask", IndexedDType::U8);
  for (const SftExample& e : examples) {
    tokens.add_document(e.tokens);
    mask.add_document(e.mask);
  }
  tokens.finalize();
  mask.finalize();
}

}  // namespace forge::testing
