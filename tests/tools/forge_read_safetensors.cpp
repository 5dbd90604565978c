// Opens each safetensors file named on the command line with forge's reader and prints one
// line per file: "accept" or "reject: <message>". tests/python/test_safetensors_strictness.py
// compares the verdicts with the reference reader's.
#include <cstdio>

#include "ckpt/safetensors.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    try {
      forge::SafetensorsFile file(argv[i]);
      std::printf("accept\n");
    } catch (const std::exception& e) {
      std::printf("reject: %s\n", e.what());
    }
  }
  return 0;
}
