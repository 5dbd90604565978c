// Ranks of a CPU process group as threads of one test process: the launch environment of
// each, a free rendezvous port, and a runner that collects each rank's error; and the small
// fp32 tensors the process-group tests move. Used by the process-group tests and by the
// parallel model tests.
#pragma once

#include <algorithm>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "distributed/launch_env.h"
#include "distributed/tcp_socket.h"

namespace forge::testing {

inline LaunchEnv env_of(int rank, int world, int port) {
  LaunchEnv env;
  env.rank = rank;
  env.world_size = world;
  env.local_world_size = world;
  env.local_rank = rank;
  env.master_addr = "localhost";
  env.master_port = port;
  env.launcher = Launcher::Torchrun;
  return env;
}

inline int free_port() { return net::bound_port(net::listen_tcp(0)); }

// Runs `body(rank)` for every rank of a world of `world` on its own thread; returns each
// rank's error message, or "" for a rank that finished without one.
inline std::vector<std::string> run_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::async(std::launch::async, [&body, r]() -> std::string {
      try {
        body(r);
        return "";
      } catch (const Error& e) {
        return e.what();
      }
    }));
  }
  std::vector<std::string> out;
  for (auto& rank : ranks) out.push_back(rank.get());
  return out;
}

// A host fp32 tensor of `v`, and the values of one.
inline Tensor floats(std::vector<float> v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}
inline std::vector<float> values(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

}  // namespace forge::testing
