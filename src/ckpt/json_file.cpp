#include "ckpt/json_file.h"

#include <fstream>
#include <sstream>

#include "core/error.h"

namespace forge {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) FORGE_FAIL("{}: cannot open", path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    FORGE_FAIL("{}: not valid JSON: {}", path, e.what());
  }
}

}  // namespace forge
