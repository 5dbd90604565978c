// Maps draws to rectified-flow times with forge's settings (NOTE [Flow timesteps] in
// train/flow_timesteps.h), for tests/python/test_flux_timesteps_vs_diffusers.py:
//   forge_flow_timesteps KEY=VALUE... DRAW...
// KEY is a field of FlowTimestepSampling (weighting, logit_mean, logit_std, shift,
// shift_value, base_shift, max_shift, base_seq_len, max_seq_len) or seq_len (the image's
// tokens, default 4096); each DRAW (z under logit_normal, u under uniform) prints its t on
// a line of its own, with 17 significant digits. Exits 1 with the error on stderr.
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "train/flow_timesteps.h"

namespace {

void set(forge::FlowTimestepSampling& s, int64_t& seq_len, const std::string& key, const std::string& value) {
  if (key == "weighting") s.weighting = value;
  else if (key == "logit_mean") s.logit_mean = std::stod(value);
  else if (key == "logit_std") s.logit_std = std::stod(value);
  else if (key == "shift") s.shift = value;
  else if (key == "shift_value") s.shift_value = std::stod(value);
  else if (key == "base_shift") s.base_shift = std::stod(value);
  else if (key == "max_shift") s.max_shift = std::stod(value);
  else if (key == "base_seq_len") s.base_seq_len = std::stoll(value);
  else if (key == "max_seq_len") s.max_seq_len = std::stoll(value);
  else if (key == "seq_len") seq_len = std::stoll(value);
  else throw std::invalid_argument("unknown setting " + key);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    forge::FlowTimestepSampling s;
    int64_t seq_len = 4096;
    int first_draw = 1;
    for (; first_draw < argc; ++first_draw) {
      const std::string arg = argv[first_draw];
      const size_t eq = arg.find('=');
      if (eq == std::string::npos) break;
      set(s, seq_len, arg.substr(0, eq), arg.substr(eq + 1));
    }
    s.validate();
    for (int i = first_draw; i < argc; ++i) std::printf("%.17g\n", forge::flow_timestep(s, std::stod(argv[i]), seq_len));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
