// forge_cpu_group <scenario> [collective_timeout_ms]: one rank of a job on the CPU process
// group (NOTE [CPU process group]), for tests/python/test_cpu_process_group.py. It reads
// its place in the job from the environment (forge launch, torchrun, Slurm, Open MPI).
//  - collectives: all_reduce (sum, avg), reduce_scatter and all_gather on f32 and bf16,
//    on the world and on groups split from it (color = rank % 2; color = rank / 2 with the
//    key reversing the order; a split of a split), barriers, a 32 MiB all-reduce, and a
//    group used after the world was destroyed. Every rank computes every rank's inputs
//    (a pure function of rank and index) and so the exact expected result: sums in rank
//    order in fp32, divided by the group size for avg, rounded to bf16 once. Prints
//    "digest NAME HEX" per result that must be the same on every rank, and last
//    "rank R of W: collectives ok".
//  - all-to-all: all_to_all (NOTE [All-to-all]) on the world, on the halves of a split
//    (both at once) and on pairs: random row counts with zeros, every rank sending all its
//    rows to one rank, only self-sends, nothing at all, in f32, bf16 and int32 rows of
//    several widths, into outputs with spare rows (which must stay as they were); every
//    rank checks the exact bytes of its rows from every rank; bad arguments are refused
//    on the calling rank. Prints last "rank R of W: all_to_all ok".
//  - mismatch-size: the last rank all-reduces one element more than the others.
//  - mismatch-counts: in an all_to_all, the last rank expects one row more from rank 0
//    than rank 0 sends it.
//  - mismatch-kind: the last rank all-gathers while the others all-reduce.
//  - early-exit: the last rank leaves right after the group is made; the others
//    all-reduce. rank0-exit: the same with rank 0 leaving.
//  - stall: the last rank stays connected but calls nothing for 3 s, then leaves; the
//    others all-reduce.
// A failure prints "error: MESSAGE" (or "FAIL: ..." for a wrong value) to stderr and
// exits with status 1.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "distributed/launch_env.h"
#include "distributed/process_group.h"

namespace forge {
namespace {

int g_rank = 0;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: rank %d: %s\n", g_rank, what.c_str());
  std::exit(1);
}

// Rank r's input element i of the test `tag`: magnitudes spread over 2^-8 .. 2^7, so that
// the order of additions changes the rounded sums.
float input_value(int r, int64_t i, uint32_t tag) {
  uint32_t h = static_cast<uint32_t>(r) * 0x9E3779B1u ^ static_cast<uint32_t>(i) * 0x85EBCA77u ^ tag * 0xC2B2AE3Du;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  const float mantissa = static_cast<float>(h & 0xFFFFFF) / 16777216.0f - 0.5f;
  return std::ldexp(mantissa, static_cast<int>(h >> 24) % 16 - 8);
}

// The value as the tensor of `dtype` holds it.
float stored(float v, DType dtype) { return dtype == DType::BF16 ? to_float(to_bf16(v)) : v; }

Tensor make(int64_t n, DType dtype, const std::function<float(int64_t)>& value) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == DType::BF16) {
      t.data<BFloat16>()[i] = to_bf16(value(i));
    } else {
      t.data<float>()[i] = value(i);
    }
  }
  return t;
}

// The result the group must produce: the members' values summed in group rank order in
// fp32, averaged, rounded to the dtype once.
float reduced(const std::vector<int>& members, ReduceOp op, DType dtype, const std::function<float(int)>& value_of) {
  float sum = stored(value_of(members[0]), dtype);
  for (size_t k = 1; k < members.size(); ++k) sum += stored(value_of(members[k]), dtype);
  if (op == ReduceOp::Avg) sum /= static_cast<float>(members.size());
  return stored(sum, dtype);
}

uint32_t bits_of(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::BF16) return t.data<BFloat16>()[i].bits;
  uint32_t u;
  std::memcpy(&u, &t.data<float>()[i], 4);
  return u;
}

uint32_t expected_bits(float v, DType dtype) {
  if (dtype == DType::BF16) return to_bf16(v).bits;
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

void expect_exact(const Tensor& got, const std::function<float(int64_t)>& expected, const std::string& what) {
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float want = expected(i);
    if (bits_of(got, i) != expected_bits(want, got.dtype())) {
      const float have = got.dtype() == DType::BF16 ? to_float(got.data<BFloat16>()[i]) : got.data<float>()[i];
      fail(fmt::format("{} ({}): element {} of {} is {:.9g}, expected {:.9g}", what, dtype_name(got.dtype()), i,
                       got.numel(), have, want));
    }
  }
}

// FNV-1a of the tensor's bytes, printed for the test to compare across ranks.
void print_digest(const std::string& name, const Tensor& t) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  std::printf("digest %s %016llx\n", name.c_str(), static_cast<unsigned long long>(h));
}

const char* op_name(ReduceOp op) { return op == ReduceOp::Avg ? "avg" : "sum"; }

// The collectives of one group whose members (world ranks, in group rank order) are
// `members`; `tag` makes the inputs differ from those of other groups' checks.
void check_group(ProcessGroup& g, const std::vector<int>& members, uint32_t tag, const std::string& name,
                 bool digests) {
  const int me = members[g.rank()];
  if (g.world_size() != static_cast<int>(members.size()))
    fail(fmt::format("{}: world_size {}, expected {}", name, g.world_size(), members.size()));
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{65537}}) {
        const uint32_t t = tag + static_cast<uint32_t>(n);
        Tensor x = make(n, dtype, [&](int64_t i) { return input_value(me, i, t); });
        g.all_reduce(x, op);
        const std::string what = fmt::format("{} all_reduce {} of {}", name, op_name(op), n);
        expect_exact(
            x, [&](int64_t i) { return reduced(members, op, dtype, [&](int r) { return input_value(r, i, t); }); },
            what);
        if (digests) print_digest(fmt::format("{}-all_reduce-{}-{}-{}", name, dtype_name(dtype), op_name(op), n), x);
      }
      const int64_t chunk = 1003;
      const int64_t world = g.world_size();
      const uint32_t t = tag + 77;
      Tensor input = make(chunk * world, dtype, [&](int64_t j) { return input_value(me, j, t); });
      Tensor output = make(chunk, dtype, [](int64_t) { return -1.0f; });
      g.reduce_scatter(output, input, op);
      expect_exact(output,
                   [&](int64_t i) {
                     return reduced(members, op, dtype, [&](int r) { return input_value(r, g.rank() * chunk + i, t); });
                   },
                   fmt::format("{} reduce_scatter {} (chunk {} of {})", name, op_name(op), g.rank(), world));
    }
    const int64_t chunk = 517;
    const uint32_t t = tag + 99;
    Tensor input = make(chunk, dtype, [&](int64_t i) { return input_value(me, i, t); });
    Tensor output = make(chunk * g.world_size(), dtype, [](int64_t) { return -1.0f; });
    g.all_gather(output, input);
    expect_exact(output, [&](int64_t j) { return stored(input_value(members[j / chunk], j % chunk, t), dtype); },
                 name + " all_gather");
    if (digests) print_digest(fmt::format("{}-all_gather-{}", name, dtype_name(dtype)), output);
  }
  g.barrier();
}

// The group's members, in its rank order, as every member sees them (an all_gather of
// the world ranks): checks that split ordered them as `expected`.
void check_members(ProcessGroup& g, const std::vector<int>& expected, const std::string& name) {
  Tensor mine = make(1, DType::F32, [](int64_t) { return static_cast<float>(g_rank); });
  Tensor all = Tensor::zeros({g.world_size()});
  g.all_gather(all, mine);
  std::string got;
  for (int64_t i = 0; i < all.numel(); ++i) got += fmt::format("{} ", all.data<float>()[i]);
  std::string want;
  for (int r : expected) want += fmt::format("{} ", r);
  const auto position = std::find(expected.begin(), expected.end(), g_rank) - expected.begin();
  if (got != want || g.rank() != position)
    fail(fmt::format("{}: members (in rank order) are {}, expected {}; this rank is {} of them", name, got, want,
                     g.rank()));
}

std::vector<int> ranks_where(int world, const std::function<bool(int)>& keep) {
  std::vector<int> out;
  for (int r = 0; r < world; ++r)
    if (keep(r)) out.push_back(r);
  return out;
}

void collectives(ProcessGroup& world_group, int world) {
  const std::vector<int> everyone = ranks_where(world, [](int) { return true; });
  check_group(world_group, everyone, 1000, "world", true);
  world_group.barrier();

  // Two halves by parity, both busy at once, each within itself.
  auto parity = world_group.split(g_rank % 2, g_rank);
  const std::vector<int> same_parity = ranks_where(world, [](int r) { return r % 2 == g_rank % 2; });
  check_members(*parity, same_parity, "parity group");
  check_group(*parity, same_parity, 2000 + g_rank % 2 * 100, "parity", false);

  // Pairs (0, 1), (2, 3), ..., the key reversing each pair's rank order.
  auto pair = world_group.split(g_rank / 2, world - g_rank);
  std::vector<int> same_pair = ranks_where(world, [](int r) { return r / 2 == g_rank / 2; });
  std::reverse(same_pair.begin(), same_pair.end());
  check_members(*pair, same_pair, "pair group");
  check_group(*pair, same_pair, 3000 + g_rank / 2 * 100, "pair", false);

  // A split of a split: the whole parity group again.
  auto again = parity->split(7, 0);
  check_members(*again, same_parity, "split of the parity group");

  // Large buffers: 32 MiB all-reduced, 8 MiB per rank all-gathered.
  const int64_t big = int64_t{8} << 20;
  Tensor x =
      make(big, DType::F32, [](int64_t i) { return static_cast<float>(g_rank + 1) * static_cast<float>(i % 1024); });
  const auto start = std::chrono::steady_clock::now();
  world_group.all_reduce(x, ReduceOp::Sum);
  const double reduce_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const float factor = static_cast<float>(world * (world + 1) / 2);
  expect_exact(x, [&](int64_t i) { return factor * static_cast<float>(i % 1024); }, "32 MiB all_reduce");
  const int64_t piece = int64_t{2} << 20;
  Tensor mine = make(piece, DType::F32, [](int64_t i) { return static_cast<float>(g_rank * 4096 + i % 4096); });
  Tensor gathered = Tensor::empty({piece * world});
  const auto gather_start = std::chrono::steady_clock::now();
  world_group.all_gather(gathered, mine);
  const double gather_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - gather_start).count();
  expect_exact(gathered, [&](int64_t j) { return static_cast<float>(j / piece * 4096 + j % piece % 4096); },
               "8 MiB per rank all_gather");
  std::printf("timing 32 MiB all_reduce %.3f s, all_gather of 8 MiB per rank %.3f s\n", reduce_s, gather_s);

  // A group outlives the world it was split from.
  pair->destroy();
  world_group.destroy();
  Tensor after = make(5, DType::F32, [](int64_t i) { return static_cast<float>(i + g_rank); });
  parity->all_reduce(after, ReduceOp::Sum);
  expect_exact(after,
               [&](int64_t i) {
                 float sum = 0;
                 for (int r : same_parity) sum += static_cast<float>(i + r);
                 return sum;
               },
               "parity group after the world's destroy()");
  bool refused = false;
  try {
    world_group.barrier();
  } catch (const Error&) {
    refused = true;
  }
  if (!refused) fail("a barrier on the destroyed world did not throw");
  parity->barrier();
}

// Element e of the k-th row that world rank `from` sends world rank `to` in the all_to_all
// test `tag`, written into t's element `index`.
void put_element(const Tensor& t, int64_t index, int from, int to, int64_t k, int64_t e, uint32_t tag) {
  const int64_t where = (static_cast<int64_t>(to) * 4096 + k) * 64 + e;
  switch (t.dtype()) {
    case DType::F32:
      t.data<float>()[index] = input_value(from, where, tag);
      break;
    case DType::BF16:
      t.data<BFloat16>()[index] = to_bf16(input_value(from, where, tag));
      break;
    case DType::I32:
      t.data<int32_t>()[index] = static_cast<int32_t>(tag * 7919u + static_cast<uint32_t>(from) * 1000003u +
                                                      static_cast<uint32_t>(where));
      break;
    default:
      fail("put_element: unexpected dtype");
  }
}

// One all_to_all on `g` (members: world ranks in group rank order): group rank i sends
// count(i, j) rows of `width` elements to group rank j. Checks this rank's output byte for
// byte, spare rows included.
void check_all_to_all_case(ProcessGroup& g, const std::vector<int>& members, DType dtype, int64_t width,
                           const std::function<int64_t(int, int)>& count, uint32_t tag, const std::string& name) {
  const int n = g.world_size();
  const int me = g.rank();
  std::vector<int64_t> send(n);
  std::vector<int64_t> recv(n);
  int64_t sent = 0;
  int64_t received = 0;
  for (int j = 0; j < n; ++j) {
    send[j] = count(me, j);
    recv[j] = count(j, me);
    sent += send[j];
    received += recv[j];
  }
  const int64_t spare = 2;  // rows past the counts: not sent, and left as they were
  Tensor input = Tensor::empty({sent + spare, width}, dtype);
  Tensor output = Tensor::empty({received + spare, width}, dtype);
  Tensor expected = Tensor::empty({received + spare, width}, dtype);
  std::memset(input.raw(), 0x5A, input.nbytes());
  std::memset(output.raw(), 0xA5, output.nbytes());
  std::memset(expected.raw(), 0xA5, expected.nbytes());
  int64_t row = 0;
  for (int j = 0; j < n; ++j)
    for (int64_t k = 0; k < send[j]; ++k, ++row)
      for (int64_t e = 0; e < width; ++e) put_element(input, row * width + e, members[me], members[j], k, e, tag);
  row = 0;
  for (int i = 0; i < n; ++i)
    for (int64_t k = 0; k < recv[i]; ++k, ++row)
      for (int64_t e = 0; e < width; ++e) put_element(expected, row * width + e, members[i], members[me], k, e, tag);
  g.all_to_all(output, recv, input, send);
  const size_t row_bytes = static_cast<size_t>(width) * dtype_size(dtype);
  for (int64_t r = 0; r < received + spare; ++r) {
    if (std::memcmp(static_cast<const uint8_t*>(output.raw()) + r * row_bytes,
                    static_cast<const uint8_t*>(expected.raw()) + r * row_bytes, row_bytes) != 0)
      fail(fmt::format("{} all_to_all ({}, rows of {}): output row {} of {} ({} received, {} spare) is wrong", name,
                       dtype_name(dtype), width, r, received + spare, received, spare));
  }
}

uint32_t mix(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t h = a * 0x9E3779B1u ^ b * 0x85EBCA77u ^ c * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}

// `world`: the world's size. Every rank of the world makes as many calls (NOTE [CPU process
// group]), whatever the size of its group.
void check_all_to_all_group(ProcessGroup& g, const std::vector<int>& members, int world, uint32_t tag,
                            const std::string& name) {
  const int n = g.world_size();
  struct Kind {
    DType dtype;
    int64_t width;
  };
  for (const Kind kind : {Kind{DType::F32, 5}, Kind{DType::BF16, 8}, Kind{DType::I32, 2}, Kind{DType::I32, 1}}) {
    const std::string what = fmt::format("{} {}", name, dtype_name(kind.dtype));
    // Random counts 0..6, about a third of them zero.
    for (uint32_t seed = 1; seed <= 3; ++seed) {
      const uint32_t t = tag + seed * 10;
      check_all_to_all_case(
          g, members, kind.dtype, kind.width,
          [&](int i, int j) {
            const uint32_t h = mix(static_cast<uint32_t>(i), static_cast<uint32_t>(j), t);
            return h % 3 == 0 ? int64_t{0} : static_cast<int64_t>(h % 7);
          },
          t, what + fmt::format(" random counts (seed {})", seed));
    }
    // Every rank sends all its rows to one rank (itself included), for each rank.
    for (int h = 0; h < world; ++h) {
      const int hot = h % n;
      check_all_to_all_case(
          g, members, kind.dtype, kind.width, [&](int i, int j) { return j == hot ? int64_t{3 + i} : int64_t{0}; },
          tag + 50 + static_cast<uint32_t>(hot), what + fmt::format(" everything to rank {}", hot));
    }
    // Only self-sends: a local copy on every rank.
    check_all_to_all_case(
        g, members, kind.dtype, kind.width, [](int i, int j) { return i == j ? int64_t{4} : int64_t{0}; }, tag + 70,
        what + " self-sends only");
    // Nothing at all.
    check_all_to_all_case(g, members, kind.dtype, kind.width, [](int, int) { return int64_t{0}; }, tag + 80,
                          what + " all counts zero");
  }
  // A large exchange: 1000 rows of 1024 f32 (4 MiB) from every rank to every rank.
  check_all_to_all_case(g, members, DType::F32, 1024, [](int, int) { return int64_t{1000}; }, tag + 90,
                        name + " 4 MiB per pair");
}

void all_to_all_scenario(ProcessGroup& world_group, int world) {
  const std::vector<int> everyone = ranks_where(world, [](int) { return true; });
  check_all_to_all_group(world_group, everyone, world, 5000, "world");

  // Bad arguments fail on the calling rank, before anything is sent (every rank makes the
  // same mistakes, so they stay in step).
  const auto refused = [&](const std::function<void()>& call, const std::string& fragment) {
    try {
      call();
    } catch (const Error& e) {
      if (std::string(e.what()).find(fragment) == std::string::npos)
        fail(fmt::format("a bad all_to_all failed with '{}', expected '{}'", e.what(), fragment));
      return;
    }
    fail("a bad all_to_all was accepted: expected " + fragment);
  };
  Tensor rows = Tensor::zeros({4, 2});
  Tensor out = Tensor::zeros({4, 2});
  std::vector<int64_t> ones(world, 1);
  refused([&] { world_group.all_to_all(out, ones, rows, std::vector<int64_t>(world + 1, 0)); },
          fmt::format("send_counts has {} entries, expected one per rank of the group ({})", world + 1, world));
  std::vector<int64_t> negative(world, 0);
  negative[world - 1] = -2;
  refused([&] { world_group.all_to_all(out, negative, rows, std::vector<int64_t>(world, 0)); },
          fmt::format("recv_counts[{}] is -2", world - 1));
  refused([&] { world_group.all_to_all(out, ones, rows, std::vector<int64_t>(world, 5)); },
          fmt::format("send_counts add up to {} rows, but input [4, 2] has 4", 5 * world));
  refused([&] { world_group.all_to_all(Tensor::zeros({4, 2}, DType::I32), ones, rows, ones); },
          "output is i32, input f32");
  world_group.barrier();

  // The halves by parity at once, each within itself; then pairs, with the order reversed.
  auto parity = world_group.split(g_rank % 2, g_rank);
  const std::vector<int> same_parity = ranks_where(world, [](int r) { return r % 2 == g_rank % 2; });
  check_all_to_all_group(*parity, same_parity, world, 6000 + g_rank % 2 * 1000, "parity group");
  auto pair = world_group.split(g_rank / 2, world - g_rank);
  std::vector<int> same_pair = ranks_where(world, [](int r) { return r / 2 == g_rank / 2; });
  std::reverse(same_pair.begin(), same_pair.end());
  check_all_to_all_group(*pair, same_pair, world, 8000 + g_rank / 2 * 1000, "pair group");
  world_group.barrier();
}

}  // namespace
}  // namespace forge

int main(int argc, char** argv) {
  using namespace forge;
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: forge_cpu_group <scenario> [collective_timeout_ms]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  try {
    const LaunchEnv env = read_launch_env();
    g_rank = env.rank;
    ProcessGroupOptions options;
    options.rendezvous_timeout = std::chrono::seconds(30);
    options.collective_timeout = std::chrono::milliseconds(argc == 3 ? std::atoll(argv[2]) : 30000);
    auto group = create_process_group(env, options);
    if (group->rank() != env.rank || group->world_size() != env.world_size)
      fail(fmt::format("the world group says rank {} of {}", group->rank(), group->world_size()));
    const bool last = env.rank == env.world_size - 1;
    if (scenario == "collectives") {
      collectives(*group, env.world_size);
      std::printf("rank %d of %d: collectives ok\n", env.rank, env.world_size);
      return 0;
    }
    if (scenario == "all-to-all") {
      all_to_all_scenario(*group, env.world_size);
      std::printf("rank %d of %d: all_to_all ok\n", env.rank, env.world_size);
      return 0;
    }
    if (scenario == "mismatch-counts") {
      // Two rows to every rank; the last rank expects three from rank 0.
      std::vector<int64_t> send(env.world_size, 2);
      std::vector<int64_t> recv(env.world_size, 2);
      if (last) recv[0] = 3;
      group->all_to_all(Tensor::zeros({2 * env.world_size + 1, 4}), recv, Tensor::zeros({2 * env.world_size, 4}),
                        send);
      std::printf("rank %d: no error\n", env.rank);
      return 0;
    }
    if ((scenario == "early-exit" && last) || (scenario == "rank0-exit" && env.rank == 0)) return 0;
    if (scenario == "stall" && last) {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      return 0;
    }
    Tensor x = Tensor::zeros({last && scenario == "mismatch-size" ? 1001 : 1000});
    if (scenario == "mismatch-kind" && last) {
      Tensor all = Tensor::zeros({1000 * env.world_size});
      group->all_gather(all, x);
    } else if (scenario == "mismatch-size" || scenario == "mismatch-kind" || scenario == "early-exit" ||
               scenario == "rank0-exit" || scenario == "stall") {
      group->all_reduce(x, ReduceOp::Sum);
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
      return 2;
    }
    std::printf("rank %d: no error\n", env.rank);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
