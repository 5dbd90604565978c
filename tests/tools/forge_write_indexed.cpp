// forge_write_indexed <prefix> <documents.json>: writes <prefix>.bin/.idx with forge's
// IndexedDatasetWriter from {"dtype": "uint16", "documents": [[[tokens of sequence 0],
// [tokens of sequence 1]], ...]}, so tests/python/test_indexed_dataset.py can read the
// result with megatron-core.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "data/indexed_dataset.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: forge_write_indexed <prefix> <documents.json>\n");
    return 2;
  }
  try {
    std::ifstream in(argv[2]);
    nlohmann::json spec = nlohmann::json::parse(in);
    forge::IndexedDatasetWriter writer(argv[1], forge::indexed_dtype_from_name(spec.at("dtype").get<std::string>()));
    for (const auto& document : spec.at("documents")) {
      for (const auto& sequence : document) writer.add_sequence(sequence.get<std::vector<int32_t>>());
      writer.end_document();
    }
    writer.finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
