// Progress of `forge prep` on stderr. On a terminal: one line redrawn in place at most
// ten times a second, with a bar of input bytes read out of the inputs' total size,
// documents per second, MB/s of input and the estimated time left. Elsewhere (a log file,
// a CI job): a plain line every 10 seconds, so logs stay readable.
#pragma once

#include <string>

#include "data/dataset_prep.h"

namespace forge {

class PrepProgressPrinter {
 public:
  // `terminal`: stderr is a terminal (isatty).
  explicit PrepProgressPrinter(bool terminal);
  void update(const PrepProgress& progress);
  // Ends the in-place line, if one was drawn.
  void finish();

 private:
  std::string describe(const PrepProgress& progress) const;

  bool terminal_;
  double next_print_seconds_;
  bool line_open_ = false;
};

// "12.3 MB", "1.20 GB": decimal units, as throughput is quoted.
std::string format_bytes(double bytes);
// "1:02:03" or "2:03".
std::string format_duration(double seconds);

}  // namespace forge
