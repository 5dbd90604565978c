// forge_read_indexed <prefix>: prints, as JSON, everything forge's IndexedDataset reader
// sees in <prefix>.bin/.idx (dtype, lengths, pointers, document indices, tokens), so
// tests/python/test_indexed_dataset.py can compare it with megatron-core. Errors go to
// stderr with exit status 1.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/indexed_dataset.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: forge_read_indexed <prefix>\n");
    return 2;
  }
  try {
    forge::IndexedDataset dataset(argv[1]);
    nlohmann::json out;
    out["dtype"] = std::string(forge::indexed_dtype_name(dataset.dtype()));
    out["sequence_lengths"] = nlohmann::json::array();
    out["sequence_pointers"] = nlohmann::json::array();
    out["sequences"] = nlohmann::json::array();
    out["document_indices"] = nlohmann::json::array();
    for (int64_t s = 0; s < dataset.num_sequences(); ++s) {
      out["sequence_lengths"].push_back(dataset.sequence_length(s));
      out["sequence_pointers"].push_back(dataset.sequence_pointer(s));
      nlohmann::json tokens = nlohmann::json::array();
      for (int64_t i = 0; i < dataset.sequence_length(s); ++i) tokens.push_back(dataset.token(s, i));
      out["sequences"].push_back(std::move(tokens));
    }
    for (int64_t d = 0; d <= dataset.num_documents(); ++d) out["document_indices"].push_back(dataset.document_index(d));
    std::printf("%s\n", out.dump().c_str());
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
