// forge_read_npy array FILE | records FILE | govreport FILE SEQ_LEN VOCAB: prints, as JSON,
// what forge reads from a .npy file: an integer array's descr, shape and values (C order);
// an object array's records; or GovReportDataset's samples (tokens, example ids, response
// flags). tests/python/test_npy_array.py compares them with numpy. Errors go to stderr
// with exit status 1.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/govreport_dataset.h"
#include "data/npy_array.h"
#include "data/npy_records.h"

namespace {

nlohmann::json read_array(const std::string& path) {
  forge::NpyArray array(path);
  std::vector<int64_t> values(static_cast<size_t>(array.count()));
  array.read(0, array.count(), values.data());
  return {{"descr", array.header().descr}, {"shape", array.shape()}, {"values", values},
          {"version", array.header().major_version}};
}

nlohmann::json read_records(const std::string& path) {
  nlohmann::json out = nlohmann::json::array();
  forge::read_npy_records(path, [&](int64_t, const forge::NpyRecord& record) {
    nlohmann::json fields = nlohmann::json::object();
    for (const auto& [key, values] : record) fields[key] = values;
    out.push_back(std::move(fields));
  });
  return out;
}

nlohmann::json read_govreport(const std::string& path, int64_t seq_len, int64_t vocab) {
  forge::GovReportDataset dataset(path, seq_len, vocab, false);
  nlohmann::json out = nlohmann::json::array();
  const size_t width = static_cast<size_t>(seq_len + 1);
  for (int64_t i = 0; i < dataset.num_samples(); ++i) {
    std::vector<int32_t> tokens(width), example(width);
    std::vector<uint8_t> response(width);
    dataset.sample_examples(0, i, tokens.data(), example.data(), response.data());
    out.push_back({{"tokens", tokens}, {"example", example}, {"response", response}});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "array" || mode == "records") && argc == 3) && !(mode == "govreport" && argc == 5)) {
    std::fprintf(stderr, "usage: forge_read_npy array FILE | records FILE | govreport FILE SEQ_LEN VOCAB\n");
    return 2;
  }
  try {
    nlohmann::json out = mode == "array"     ? read_array(argv[2])
                         : mode == "records" ? read_records(argv[2])
                                             : read_govreport(argv[2], std::stoll(argv[3]), std::stoll(argv[4]));
    std::printf("%s\n", out.dump().c_str());
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
