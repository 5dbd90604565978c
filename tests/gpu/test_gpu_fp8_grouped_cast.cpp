// The grouped per-expert casts (NOTE [FP8 grouped expert casts] in
// kernels/cuda/fp8_grouped_cast.cu) against the per-group path they replace (fp8_amax,
// fp8_scale_from_amax and fp8_cast on each group's rows, as the expert-by-expert FP8 GEMMs
// quantize) and against the CPU reference (kernels/cpu/fp8_scaling.h): every amax, scale,
// inverse scale, `seen` fold and code bit for bit, on fresh random data with a NaN, an
// infinity and an all-zero group among ragged row counts (empty groups included, whose
// slots must stay untouched), columns that allow the vector path and columns that do not,
// both formats, offsets on the device and uniform groups (an expert stack), current scales
// and delayed ones (the cast folding each group's amax); each group's codes from its own
// 256-byte boundary (fp8_grouped_codes_at). Outputs start poisoned (0xff).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "gpu_testing.h"
#include "kernels/cpu/fp8_scaling.h"
#include "kernels/cuda/fp8_cast.h"
#include "kernels/cuda/fp8_grouped_cast.h"

namespace forge::gpu_test {
namespace {

constexpr int64_t kStride = 3;  // floats between two groups' statistics

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// The CPU's value and the GPU's: the same bits, or both NaN (a NaN's payload may differ).
bool same(float cpu, float gpu) { return bits_of(cpu) == bits_of(gpu) || (std::isnan(cpu) && std::isnan(gpu)); }

// An FP8 code that encodes NaN: E4M3 (fn) 0x7f and 0xff; E5M2 exponent 11111 with a
// non-zero mantissa.
bool is_nan_code(uint8_t code, Fp8Format format) {
  return format == Fp8Format::E4M3 ? (code & 0x7f) == 0x7f : (code & 0x7c) == 0x7c && (code & 0x03) != 0;
}

// The CPU's codes and the GPU's: the same bytes, but for NaNs, whose sign may differ. With
// an infinite amax the current scale is 0 and -inf x 0 is the invalid product, whose NaN is
// negative on x86 (the "indefinite") and positive on the GPU (the canonical NaN); the cast
// keeps each NaN's sign. (Training never casts with it: a non-finite amax stops the run.)
bool same_codes(const uint8_t* cpu, const uint8_t* gpu, int64_t n, Fp8Format format) {
  for (int64_t i = 0; i < n; ++i)
    if (cpu[i] != gpu[i] && !(is_nan_code(cpu[i], format) && is_nan_code(gpu[i], format))) return false;
  return true;
}

struct Case {
  std::vector<int64_t> rows;
  int64_t cols;
  bool uniform;  // offsets null: every group rows[0] rows
};

std::vector<int64_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> o{0};
  for (int64_t n : rows) o.push_back(o.back() + n);
  return o;
}

// A device F32 vector of n floats, each 0xff (NaN) but `seen` slots, which start at `start`.
Tensor seen_start(int64_t groups, float start) {
  Tensor host = Tensor::empty({groups * kStride});
  std::memset(host.raw(), 0xff, host.nbytes());
  for (int64_t g = 0; g < groups; ++g) host.data<float>()[g * kStride] = start;
  return host.to(Device::CUDA);
}

void run_case(const Case& c, Fp8Format format, bool delayed, Rng& rng) {
  const int64_t groups = static_cast<int64_t>(c.rows.size());
  const std::vector<int64_t> offsets = offsets_of(c.rows);
  const int64_t total = offsets.back(), cols = c.cols;
  int64_t most = 0;
  for (int64_t n : c.rows) most = std::max(most, n);
  SCOPED_TRACE(::testing::Message() << groups << " groups, " << total << " rows x " << cols << " cols, "
                                    << fp8_format_name(format) << (delayed ? ", delayed" : ", current")
                                    << (c.uniform ? ", uniform" : ""));
  Tensor x = random_bf16_values({std::max<int64_t>(total, 1), cols}, rng, 3.0);
  // Special values: a NaN in group 0's rows, an infinity in the last non-empty group's,
  // and a group whose rows are all zero.
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b = offsets[static_cast<size_t>(g)], end = offsets[static_cast<size_t>(g) + 1];
    if (b == end) continue;
    if (g == 0) x.data<float>()[b * cols] = std::numeric_limits<float>::quiet_NaN();
    if (g == 2)
      for (int64_t i = b * cols; i < end * cols; ++i) x.data<float>()[i] = 0.0f;
    if (g == groups - 1) x.data<float>()[end * cols - 1] = -std::numeric_limits<float>::infinity();
  }
  const Tensor xg = to_gpu(x, DType::BF16);
  Tensor device_offsets = Tensor::empty({groups + 1}, DType::I64);
  std::copy(offsets.begin(), offsets.end(), device_offsets.data<int64_t>());
  device_offsets = device_offsets.to(Device::CUDA);
  const cuda::Fp8RowGroups row_groups{c.uniform ? nullptr : device_offsets.data<int64_t>(), groups, cols, most,
                                      c.uniform ? c.rows.front() : 0};

  // Delayed: each group's scale given (the block's), its amax folded into `seen` by the cast.
  std::vector<float> delayed_scales(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) delayed_scales[static_cast<size_t>(g)] = 0.5f + 0.25f * static_cast<float>(g % 5);

  // The per-group path: statistics [amax, scale, scale_inv] per group, seen apart.
  Tensor ref_stats = poisoned_gpu({groups * kStride}, DType::F32), ref_seen = seen_start(groups, 0.125f);
  Tensor ref_codes = poisoned_gpu({std::max<int64_t>(total, 1) * cols}, DType::U8);
  Tensor got_stats = poisoned_gpu({groups * kStride}, DType::F32), got_seen = seen_start(groups, 0.125f);
  Tensor got_codes = poisoned_gpu({cuda::fp8_grouped_codes_bytes(total, cols, groups)}, DType::U8);
  if (delayed) {
    Tensor scales = Tensor::zeros({groups * kStride});
    for (int64_t g = 0; g < groups; ++g) scales.data<float>()[g * kStride + 1] = delayed_scales[static_cast<size_t>(g)];
    ref_stats = scales.to(Device::CUDA);
    got_stats = scales.to(Device::CUDA);
  }
  float* rs = ref_stats.data<float>();
  float* gs = got_stats.data<float>();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b = offsets[static_cast<size_t>(g)], n = c.rows[static_cast<size_t>(g)] * cols;
    if (n == 0) continue;
    const cuda::bf16* xs = bf16_in(xg) + b * cols;
    uint8_t* out = ref_codes.data<uint8_t>() + b * cols;
    float* s = rs + g * kStride;
    if (delayed) {
      cuda::fp8_cast(xs, n, s + 1, format, out, ref_seen.data<float>() + g * kStride);
    } else {
      cuda::fp8_amax(xs, n, s);
      cuda::fp8_scale_from_amax(s, format, false, s + 1, s + 2, ref_seen.data<float>() + g * kStride);
      cuda::fp8_cast(xs, n, s + 1, format, out, nullptr);
    }
  }
  // The grouped path.
  const cuda::Fp8GroupStats seen{got_seen.data<float>(), kStride};
  if (delayed) {
    cuda::fp8_grouped_cast(bf16_in(xg), row_groups, {gs + 1, kStride}, format, got_codes.data<uint8_t>(), seen);
  } else {
    cuda::fp8_grouped_amax(bf16_in(xg), row_groups, {gs, kStride});
    cuda::fp8_grouped_scale_from_amax(row_groups, {gs, kStride}, format, {gs + 1, kStride}, {gs + 2, kStride}, seen);
    cuda::fp8_grouped_cast(bf16_in(xg), row_groups, {gs + 1, kStride}, format, got_codes.data<uint8_t>(), {});
  }
  const Tensor want_stats = ref_stats.to(Device::CPU), have_stats = got_stats.to(Device::CPU);
  const Tensor want_seen = ref_seen.to(Device::CPU), have_seen = got_seen.to(Device::CPU);
  const Tensor want_codes = ref_codes.to(Device::CPU), have_codes = got_codes.to(Device::CPU);
  int64_t stat_mismatches = 0, code_mismatches = 0, cpu_mismatches = 0;
  for (int64_t i = 0; i < groups * kStride; ++i) {
    stat_mismatches += bits_of(want_stats.data<float>()[i]) != bits_of(have_stats.data<float>()[i]);
    stat_mismatches += bits_of(want_seen.data<float>()[i]) != bits_of(have_seen.data<float>()[i]);
  }
  for (int64_t g = 0; g < groups; ++g) {  // each group's codes from its 256-byte boundary
    const int64_t b = offsets[static_cast<size_t>(g)], at = cuda::fp8_grouped_codes_at(b, cols, g);
    EXPECT_EQ(at % 256, 0);
    code_mismatches += std::memcmp(want_codes.data<uint8_t>() + b * cols, have_codes.data<uint8_t>() + at,
                                   static_cast<size_t>(c.rows[static_cast<size_t>(g)] * cols)) != 0;
  }
  // The CPU reference, group by group, on the same bf16 values.
  const Tensor rounded = to_cpu_f32(xg);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b = offsets[static_cast<size_t>(g)], rows = c.rows[static_cast<size_t>(g)];
    float* stats = have_stats.data<float>() + g * kStride;
    if (rows == 0) {  // untouched: the poison (current) or the given scale (delayed), seen as it started
      EXPECT_EQ(bits_of(stats[0]), delayed ? 0u : 0xffffffffu) << "group " << g;
      EXPECT_EQ(have_seen.data<float>()[g * kStride], 0.125f) << "group " << g;
      continue;
    }
    const cpu::Fp8Blocks whole{rows, cols};
    float amax = 0.0f;
    cpu::fp8_block_amax(rounded.data<float>() + b * cols, rows, cols, whole, &amax);
    const float scale = delayed ? delayed_scales[static_cast<size_t>(g)] : cpu::fp8_scale_torchao(amax, format, false);
    std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
    cpu::fp8_quantize(rounded.data<float>() + b * cols, rows, cols, whole, &scale, format, codes.data());
    if (!delayed) {
      cpu_mismatches += !same(amax, stats[0]);
      cpu_mismatches += !same(scale, stats[1]);
      cpu_mismatches += !same(1.0f / scale, stats[2]);
    }
    const float seen_want = std::isnan(amax) ? amax : std::max(amax, 0.125f);
    cpu_mismatches += !same(seen_want, have_seen.data<float>()[g * kStride]);
    cpu_mismatches += !same_codes(codes.data(), have_codes.data<uint8_t>() + cuda::fp8_grouped_codes_at(b, cols, g),
                                  static_cast<int64_t>(codes.size()), format);
  }
  std::printf("grouped cast %lld groups %lld x %lld %s %s: mismatches vs per-group stats %lld codes %lld, vs CPU %lld\n",
              static_cast<long long>(groups), static_cast<long long>(total), static_cast<long long>(cols),
              fp8_format_name(format), delayed ? "delayed" : "current", static_cast<long long>(stat_mismatches),
              static_cast<long long>(code_mismatches), static_cast<long long>(cpu_mismatches));
  EXPECT_EQ(stat_mismatches, 0);
  EXPECT_EQ(code_mismatches, 0);
  EXPECT_EQ(cpu_mismatches, 0);
}

TEST(GpuFp8GroupedCast, MatchesThePerGroupCastsAndTheCpuBitwise) {
  Rng rng(seed_for_current_test());
  const std::vector<Case> cases = {
      {{5, 0, 37, 3, 0, 0, 200, 11}, 64, false},     // ragged, empty groups, vector path
      {{5, 0, 37, 3, 0, 0, 200, 11}, 67, false},     // rows not 16-byte aligned: the scalar path
      {{0, 0, 0, 64, 0, 0, 0, 0}, 128, false},       // every row to one group
      {{1, 2, 3, 1000, 0, 7}, 24, false},            // one long group: blocks stride through it
      {{0, 0, 0}, 64, false},                        // no rows at all
      {{48, 48, 48, 48}, 96, true},                  // uniform groups (an expert stack)
  };
  for (const Case& c : cases)
    for (const Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2})
      for (const bool delayed : {false, true}) run_case(c, format, delayed, rng);
}

// 64 groups of ragged rows, as the DeepSeek-V2-Lite proxy's experts see them.
TEST(GpuFp8GroupedCast, SixtyFourExperts) {
  Rng rng(seed_for_current_test());
  std::vector<int64_t> rows;
  for (int g = 0; g < 64; ++g) rows.push_back(g % 9 == 4 ? 0 : static_cast<int64_t>(rng.below(700)));
  for (const bool delayed : {false, true}) run_case({rows, 256, false}, Fp8Format::E4M3, delayed, rng);
}

}  // namespace
}  // namespace forge::gpu_test
