// Slurm's compressed lists, as srun exports them to every task.
//
// A hostlist (SLURM_JOB_NODELIST) is comma-separated names where a bracket holds ranges
// and single numbers: "gpu[01-04,07],login1" is gpu01 gpu02 gpu03 gpu04 gpu07 login1.
// Numbers keep the zero padding of the range's first bound; a name with several brackets
// ("rack[1-2]-n[1-2]") is every combination, the last bracket varying fastest.
// A task count list (SLURM_TASKS_PER_NODE) is comma-separated counts, "N(xM)" meaning
// N on each of M consecutive nodes: "4(x2),3" is 4 4 3.
// Both throw forge::Error naming `variable` on malformed input.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace forge {

std::vector<std::string> expand_hostlist(std::string_view list, std::string_view variable);
std::vector<int> expand_tasks_per_node(std::string_view list, std::string_view variable);

}  // namespace forge
