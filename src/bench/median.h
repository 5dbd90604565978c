// The median the benchmark figures are reported as (step times, preflight timings, a
// run's throughput in forge report).
#pragma once

#include <optional>
#include <vector>

namespace forge {

// The median of the finite values (the mean of the middle two for an even count); unset
// when there are none.
std::optional<double> median(std::vector<double> values);

}  // namespace forge
