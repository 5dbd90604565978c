// forge_rendezvous <timeout_ms> [absent_rank]: one rank of a job that meets over the TCP
// rendezvous, for tests/python/test_launch.py. It reads its place in the job from the
// environment (RANK, WORLD_SIZE, ... or Slurm's or Open MPI's variables), rank 0
// broadcasts a 128-byte id as it would NCCL's, every rank checks it and meets the others
// at a barrier, then prints "rank R of W (launcher): id ok". The rank named absent_rank
// exits at once without joining, to show what a missing rank does to the others.
// Errors go to stderr with exit status 1.
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "distributed/launch_env.h"
#include "distributed/tcp_store.h"

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: forge_rendezvous <timeout_ms> [absent_rank]\n");
    return 2;
  }
  try {
    const forge::LaunchEnv env = forge::read_launch_env();
    if (argc == 3 && env.rank == std::atoi(argv[2])) return 0;
    forge::TcpStore store(env, std::chrono::milliseconds(std::atoll(argv[1])));
    std::array<uint8_t, 128> id{};
    if (env.rank == 0)
      for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(255 - i);
    store.broadcast(id);
    for (size_t i = 0; i < id.size(); ++i)
      if (id[i] != static_cast<uint8_t>(255 - i))
        throw forge::Error("received id differs at byte " + std::to_string(i));
    store.barrier();
    std::printf("rank %d of %d (%s): id ok\n", env.rank, env.world_size,
                std::string(forge::launcher_name(env.launcher)).c_str());
    return 0;
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
