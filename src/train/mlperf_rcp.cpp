// The RCP tables and the RCP checker's arithmetic: NOTE [RCP normalization] in mlperf_rcp.h.
#include "train/mlperf_rcp.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "core/error.h"

namespace forge::mlperf {
namespace {

// Copied from mlperf-logging 4.1.68, mlperf_logging/rcp_checker/training_5.1.0/
// rcps_llama31_8b.json ("Epochs to converge", in samples) and rcps_llama2_70b_lora.json
// ("samples to converge"), and rcps_flux1.json, in the files' order. tests/python/test_mlperf_logging.py checks
// that they equal the package's. The targets: closed_llama31_8b.yaml and
// closed_llama2_70b_lora.yaml (eval_accuracy <= 3.3 and <= 0.925).
RcpBenchmark embedded(const std::string& name) {
  if (name == "llama31_8b")
    return {"llama31_8b", 10, 3.3, {
      {"llama31_8b_ref_16", 16, {159744, 159744, 159744, 159744, 159744, 159744, 172032, 159744, 172032, 159744, 172032, 159744, 159744, 159744, 159744, 159744, 159744, 159744, 159744, 159744}},
      {"llama31_8b_ref_32", 32, {196608, 172032, 184320, 184320, 172032, 172032, 184320, 184320, 184320, 172032, 172032, 172032, 184320, 184320, 184320, 172032, 172032, 172032, 184320, 184320}},
      {"llama31_8b_ref_64", 64, {233472, 208896, 208896, 233472, 233472, 233472, 233472, 233472, 208896, 233472, 233472, 233472, 245760, 221184, 208896, 233472, 233472, 221184, 221184, 221184}},
      {"llama31_8b_ref_96", 96, {297216, 284832, 272448, 272448, 272448, 272448, 297216, 272448, 297216, 272448, 297216, 260064, 272448, 272448, 272448, 284832, 260064, 284832, 284832, 272448}},
      {"llama31_8b_ref_128", 128, {368640, 344064, 356352, 344064, 368640, 368640, 405504, 344064, 331776, 307200, 331776, 380928, 307200, 344064, 319488, 356352, 331776, 319488, 356352, 331776}},
    }};
  if (name == "llama2_70b_lora")
    return {"llama2_70b_lora", 10, 0.925, {
      {"llama2_70b_lora_ref_8", 8, {3072, 2688, 3456, 3072, 3072, 3072, 3456, 3456, 3072, 2688, 3456, 3072, 3072, 3072, 3840, 3456, 2688, 3072, 3456, 3456}},
      {"llama2_70b_lora_ref_16", 16, {3840, 3840, 4224, 3840, 3840, 3840, 4608, 3840, 4608, 3840, 4992, 3840, 3840, 3840, 4992, 3840, 3840, 4224, 3840, 3456}},
      {"llama2_70b_lora_ref_32", 32, {5760, 6528, 6144, 6528, 5376, 6528, 5760, 6144, 6144, 6528, 6144, 6144, 6144, 5760, 5760, 5760, 5760, 5760, 6144, 5760}},
      {"llama2_70b_lora_ref_128", 128, {11520, 13056, 10752, 12672, 12288, 11136, 10752, 13056, 10752, 9984, 11136, 11136, 11136, 10752, 11520, 11136, 11136, 10752, 11136, 9984}},
    }};
  if (name == "flux1")  // rcps_flux1.json ("samples to converge"); closed_flux1.yaml: eval_accuracy <= 0.586
    return {"flux1", 10, 0.586, {
      {"flux_ref_512", 512, {8388608, 8388608, 8388608, 8126464, 7864320, 8126464, 7864320, 7602176, 8650752, 8126464, 8650752, 8126464, 8388608, 8126464, 8126464, 8126464, 8126464, 8126464, 8126464, 7864320}},
      {"flux_ref_1024", 1024, {8912896, 8650752, 9437184, 8126464, 8388608, 9175040, 8650752, 8126464, 8388608, 9961472, 7864320, 8126464, 9699328, 8650752, 9437184, 8912896, 8388608, 9175040, 8126464, 9175040}},
      {"flux_ref_2048", 2048, {11272192, 10223616, 11534336, 10747904, 9699328, 10485760, 11010048, 10223616, 11796480, 10485760, 10747904, 11272192, 9699328, 10485760, 11534336, 9961472, 10485760, 10485760, 11272192, 11272192}},
      {"flux_ref_4096", 4096, {15466496, 15728640, 15990784, 15466496, 15728640, 15466496, 14942208, 14680064, 15728640, 15990784, 15990784, 15728640, 15728640, 16252928, 14942208, 15728640, 16252928, 15204352, 16515072, 14942208}},
    }};
  FORGE_FAIL("MLPerf benchmark '{}': forge knows the RCPs of llama31_8b, llama2_70b_lora and flux1", name);
}

// Numerical Recipes' continued fraction for the regularized incomplete beta function.
double beta_continued_fraction(double a, double b, double x) {
  const double tiny = 1e-300;
  double c = 1.0, d = 1.0 - (a + b) * x / (a + 1.0);
  if (std::fabs(d) < tiny) d = tiny;
  d = 1.0 / d;
  double h = d;
  for (int m = 1; m <= 1000; ++m) {
    const double m2 = 2.0 * m;
    double aa = m * (b - m) * x / ((a + m2 - 1.0) * (a + m2));
    d = 1.0 + aa * d;
    if (std::fabs(d) < tiny) d = tiny;
    c = 1.0 + aa / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    h *= d * c;
    aa = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0));
    d = 1.0 + aa * d;
    if (std::fabs(d) < tiny) d = tiny;
    c = 1.0 + aa / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1.0) < 1e-16) break;
  }
  return h;
}

double regularized_incomplete_beta(double a, double b, double x) {
  if (x <= 0) return 0;
  if (x >= 1) return 1;
  const double front =
      std::exp(std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) + a * std::log(x) + b * std::log1p(-x));
  if (x < (a + 1.0) / (a + b + 2.0)) return front * beta_continued_fraction(a, b, x) / a;
  return 1.0 - front * beta_continued_fraction(b, a, 1.0 - x) / b;
}

// rcp_checker's _find_p_value: scipy's two-sided equal-variance t-test turned one-sided,
// which is the t CDF at the statistic.
double one_sided_p(double mean1, double stdev1, double n1, double mean2, double stdev2, double n2) {
  const double df = n1 + n2 - 2.0;
  const double pooled = ((n1 - 1.0) * stdev1 * stdev1 + (n2 - 1.0) * stdev2 * stdev2) / df;
  const double t = (mean1 - mean2) / std::sqrt(pooled * (1.0 / n1 + 1.0 / n2));
  return student_t_cdf(t, df);
}

// rcp_checker's _find_min_acceptable_mean.
double min_acceptable_mean(double mean, double stdev, double num_samples_ref, int submission_runs) {
  if (stdev == 0) return mean;
  const double num_samples_subm = submission_runs - 2;
  const double alpha = 0.05, tolerance = 0.0001;
  double lo = 0.0, hi = mean, mid = (lo + hi) / 2;
  while (hi - lo > tolerance) {
    if (one_sided_p(mid, stdev, num_samples_ref, mean, stdev, num_samples_subm) > alpha)
      hi = mid;
    else
      lo = mid;
    mid = (lo + hi) / 2;
  }
  return mid;
}

double olympic_mean(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  if (values.size() < 3) return std::nan("");
  return std::accumulate(values.begin() + 1, values.end() - 1, 0.0) / static_cast<double>(values.size() - 2);
}

void compute_stats(RcpRecord& r, int submission_runs) {
  r.mean = olympic_mean(r.samples_to_converge);
  const double n = static_cast<double>(r.samples_to_converge.size());
  const double full_mean = std::accumulate(r.samples_to_converge.begin(), r.samples_to_converge.end(), 0.0) / n;
  double sq = 0;
  for (double s : r.samples_to_converge) sq += (s - full_mean) * (s - full_mean);
  r.stdev = std::sqrt(sq / n);  // numpy.std: the population stdev
  r.min_mean = min_acceptable_mean(r.mean, r.stdev, n - 2, submission_runs);
  r.max_speedup = r.mean / r.min_mean;
}

// rcp_checker's _create_interp_rcp.
RcpRecord interpolate(const RcpBenchmark& b, int64_t batch, const RcpRecord& low, const RcpRecord& high) {
  const double w = static_cast<double>(batch - low.batch) / static_cast<double>(high.batch - low.batch);
  RcpRecord r;
  r.name = b.name + "_interp_" + std::to_string(batch);
  r.batch = batch;
  r.mean = low.mean + w * (high.mean - low.mean);
  r.stdev = low.stdev + w * (high.stdev - low.stdev);
  r.min_mean = min_acceptable_mean(r.mean, r.stdev, b.submission_runs * 2, b.submission_runs);
  r.max_speedup = r.mean / r.min_mean;
  return r;
}

// rcp_checker's _eval_submission_record.
void evaluate(RcpCheck& check, const RcpRecord& record, const std::vector<double>& samples) {
  check.have_record = true;
  check.record = record;
  check.submission_mean = olympic_mean(samples);
  const double factor = record.mean / check.submission_mean;
  check.norm_factor = factor < 1 ? 1.0 : factor;
  check.passed = check.submission_mean >= record.mean / record.max_speedup;
}

}  // namespace

double student_t_cdf(double t, double degrees_of_freedom) {
  const double x = degrees_of_freedom / (degrees_of_freedom + t * t);
  const double tail = 0.5 * regularized_incomplete_beta(degrees_of_freedom / 2.0, 0.5, x);
  return t < 0 ? tail : 1.0 - tail;
}

std::vector<std::string> rcp_benchmark_names() { return {"llama31_8b", "llama2_70b_lora", "flux1"}; }

const RcpBenchmark& rcp_benchmark(const std::string& name) {
  static const std::map<std::string, RcpBenchmark> tables = [] {
    std::map<std::string, RcpBenchmark> t;
    for (const auto& n : rcp_benchmark_names()) {
      RcpBenchmark b = embedded(n);
      for (auto& r : b.records) compute_stats(r, b.submission_runs);
      std::sort(b.records.begin(), b.records.end(), [](const auto& x, const auto& y) { return x.batch < y.batch; });
      t.emplace(n, std::move(b));
    }
    return t;
  }();
  const auto it = tables.find(name);
  if (it == tables.end()) embedded(name);  // throws the error naming the known ones
  return it->second;
}

std::vector<RcpRecord> pruned_rcps(const RcpBenchmark& benchmark) {
  std::vector<RcpRecord> kept = benchmark.records;
  // Step 1: nothing below the batch size of fastest convergence (the first such, as min()).
  const auto fastest =
      std::min_element(kept.begin(), kept.end(), [](const auto& x, const auto& y) { return x.mean < y.mean; });
  const int64_t fastest_batch = fastest->batch;
  std::erase_if(kept, [&](const RcpRecord& r) { return r.batch < fastest_batch; });
  // Step 2: drop a point slower than the interpolation of its neighbours.
  for (size_t i = 1; i + 1 < kept.size(); ++i) {
    const RcpRecord line = interpolate(benchmark, kept[i].batch, kept[i - 1], kept[i + 1]);
    if (kept[i].mean > line.mean) {
      kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
      --i;
    }
  }
  return kept;
}

RcpCheck check_rcp(const RcpBenchmark& benchmark, int64_t batch, std::vector<double> samples, int not_converged) {
  RcpCheck check;
  if (not_converged > 1) {
    check.message = "Insufficient convergence";
    return check;
  }
  const std::vector<RcpRecord> rcps = pruned_rcps(benchmark);
  const RcpRecord *low = nullptr, *high = nullptr;
  for (const auto& r : rcps) {
    if (r.batch == batch) {
      check.message = "RCP found";
      evaluate(check, r, samples);
      return check;
    }
    if (r.batch < batch) low = &r;
    if (r.batch > batch && !high) high = &r;
  }
  if (low && high) {
    check.message = "RCP Interpolation";
    evaluate(check, interpolate(benchmark, batch, *low, *high), samples);
  } else if (low) {
    check.message = "Missing RCP, please submit RCP with BS = " + std::to_string(batch);
  } else if (high) {
    evaluate(check, rcps.front(), samples);
    check.message = check.passed ? "RCP not found but slower convergence on smaller batch size"
                                 : "Missing RCP, please submit RCP with BS = " + std::to_string(batch);
  } else {
    check.message = "Cannot find any RCPs";
  }
  return check;
}

}  // namespace forge::mlperf
