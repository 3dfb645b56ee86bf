// bench/drift — is the drift pass as fast as copying the model?
//
// For model sizes from 64 KiB to 256 MiB: the host drift pass
// (gossip::drift_pass: ‖x − x̂‖² and ‖x̂‖² in one pass) against std::memcpy of
// the same model bytes and, when built with CUDA and a GPU is present, the
// device drift kernel against a device-to-device copy of the same bytes —
// measured in the same run. Bandwidth is model bytes per second (see
// drift_bench.hpp); every size's drift values are checked against a
// double-precision reference before its timings count.
//
//   drift                      # table on stdout, drift.json in the current directory
//   drift --quick --json out.json --max-mib 64
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "drift/drift_bench.hpp"
#include "cli_checks.hpp"
#include "output.hpp"
#include "gossip/drift.hpp"
#include "gossip/error.hpp"

#ifdef GOSSIP_BENCH_DEVICE
#include "drift/device.hpp"
#endif

namespace {

using namespace gossip;
using clock_type = std::chrono::steady_clock;

struct aligned_floats {
  explicit aligned_floats(std::size_t n)
      : m_n(n), m_p(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64))) {
    if (!m_p) throw error(fmt::format("bench/drift: cannot allocate {} MiB; lower --max-mib", n * sizeof(float) >> 20));
  }
  float* data() noexcept { return m_p.get(); }
  std::size_t size() const noexcept { return m_n; }

 private:
  struct free_deleter {
    void operator()(float* p) const noexcept { std::free(p); }
  };
  std::size_t m_n;
  std::unique_ptr<float, free_deleter> m_p;
};

bool close(double got, double want, double tol) { return std::abs(got - want) <= tol * std::max(std::abs(want), 1e-30); }

// Evicts the caches by writing one float per line of a buffer twice the
// last-level cache (at least 64 MiB): a "cold" timing then reads the model
// from memory, as a step does after forward and backward passed over
// activations and gradients.
class cache_flusher {
 public:
  cache_flusher() {
    long llc = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
    llc = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    m_n = std::clamp<std::size_t>(2 * static_cast<std::size_t>(std::max(llc, 0L)), 64u << 20, 1u << 30) / sizeof(float);
  }
  std::size_t bytes() const noexcept { return m_n * sizeof(float); }
  void operator()() {
    if (!m_buf) m_buf = std::make_unique<aligned_floats>(m_n);
    float* p = m_buf->data();
    for (std::size_t i = 0; i < m_n; i += 16) p[i] += 1.0f;
  }

 private:
  std::size_t m_n = 0;
  std::unique_ptr<aligned_floats> m_buf;
};

// Times f repeatedly for about `seconds` (at least 3 runs) and returns the
// best run in seconds; `before` runs untimed ahead of each run.
template <class F, class B>
std::pair<double, int> best_time(double seconds, F&& f, B&& before) {
  double best = 1e300;
  int reps = 0;
  const auto stop = clock_type::now() + std::chrono::duration<double>(seconds);
  do {
    before();
    const auto t0 = clock_type::now();
    f();
    best = std::min(best, std::chrono::duration<double>(clock_type::now() - t0).count());
    ++reps;
  } while (reps < 3 || clock_type::now() < stop);
  return {best, reps};
}

bench::drift_run host_run(std::size_t n, const bench::drift_bench_settings& s, cache_flusher* cold) {
  aligned_floats x(n), ref(n), dst(n);
  std::mt19937_64 g(n);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    x.data()[i] = u(g);
    ref.data()[i] = x.data()[i] + 0.01f * u(g);
  }
  std::memset(dst.data(), 0, n * sizeof(float));

  double want_diff = 0, want_ref = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(x.data()[i]) - static_cast<double>(ref.data()[i]);
    want_diff += d * d;
    want_ref += static_cast<double>(ref.data()[i]) * static_cast<double>(ref.data()[i]);
  }
  const drift_sums got = drift_pass(x.data(), ref.data(), nullptr, n);
  if (!close(got.diff_sq, want_diff, s.tolerance) || !close(got.ref_sq, want_ref, s.tolerance))
    throw error(fmt::format("bench/drift: host drift pass is wrong at {} elements: ‖x − x̂‖² = {} (reference {}), ‖x̂‖² = {} "
                            "(reference {}), tolerance {} relative",
                            n, got.diff_sq, want_diff, got.ref_sq, want_ref, s.tolerance));

  volatile double sink = 0;
  auto before = [&] {
    if (cold) (*cold)();
  };
  const double seconds = cold ? 4 * s.seconds_per_size : s.seconds_per_size;
  const auto [t_drift, reps] = best_time(seconds, [&] { sink = sink + drift_pass(x.data(), ref.data(), nullptr, n).diff_sq; }, before);
  const auto [t_copy, copy_reps] = best_time(seconds, [&] {
    std::memcpy(dst.data(), x.data(), n * sizeof(float));
    sink = sink + dst.data()[n / 2];
  }, before);
  const double bytes = static_cast<double>(n * sizeof(float));
  bench::drift_run r{"host", cold ? "cold" : "warm", n, bytes / t_drift / 1e9, bytes / t_copy / 1e9, 0, std::min(reps, copy_reps)};
  r.ratio = r.drift_gbps / r.copy_gbps;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Drift pass bandwidth against a copy of the same model bytes, on the host and (with CUDA) on the device."};
  std::string json_path = "drift.json";
  double max_mib = 256, min_kib = 64, seconds = 0.3;
  bool quick = false, host_only = false, device_only = false;
  std::size_t cold_from_mib = 16;
  app.add_option("--json", json_path, "write the runs here (empty: no file)")->capture_default_str();
  app.add_option("--max-mib", max_mib, "largest model in MiB (sizes go up by 4x from --min-kib)")->capture_default_str()->check(gossip::cli::number_range(0.0625, 4096.0));
  app.add_option("--min-kib", min_kib, "smallest model in KiB")->capture_default_str()->check(gossip::cli::number_range(4.0, 1048576.0));
  auto* seconds_opt = app.add_option("--seconds", seconds, "time spent per method and size")->capture_default_str()->check(gossip::cli::number_range(0.01, 60.0));
  app.add_flag("--quick", quick, "0.05 s per method and size (a smoke run)")->excludes(seconds_opt);
  app.add_option("--cold-from-mib", cold_from_mib, "also time host sizes from this many MiB with evicted caches (0: never)")->capture_default_str()
      ->check(gossip::cli::integer_range(std::size_t{0}, std::size_t{1} << 20));
  auto* host_only_flag = app.add_flag("--host-only", host_only, "skip the device part");
  app.add_flag("--device-only", device_only, "skip the host part")->excludes(host_only_flag);
  CLI11_PARSE(app, argc, argv);

  try {
    bench::drift_bench_settings s;
    s.seconds_per_size = quick ? 0.05 : seconds;
    for (double kib = min_kib; kib <= max_mib * 1024 + 1e-9; kib *= 4)
      s.sizes.push_back(static_cast<std::size_t>(kib * 1024 / sizeof(float)));
    if (s.sizes.empty())
      throw config_error(fmt::format("--min-kib {} is above --max-mib {} ({} KiB): no model size to time", min_kib, max_mib, max_mib * 1024));
    if (!json_path.empty()) bench::check_out_file(json_path, "--json");

    fmt::print("bench/drift: bandwidth = model bytes (4 x elements) / best time of {:.2f} s of repeats.\n"
               "  drift: one pass reading x and x-hat (||x - x-hat||^2, ||x-hat||^2); copy: one copy of the model "
               "(host: memcpy; device: cudaMemcpyAsync device-to-device).\n"
               "  ratio = drift / copy; drift values checked against a double reference (relative {:g}) first.\n\n",
               s.seconds_per_size, s.tolerance);
    cache_flusher flusher;
    fmt::print("  warm: repeats back to back (the model may sit in cache); cold: caches evicted before each repeat by writing "
               "{} MiB (host only, sizes >= {} MiB).\n\n",
               flusher.bytes() >> 20, cold_from_mib);
    fmt::print("{:<7} {:<5} {:>12} {:>10} {:>12} {:>12} {:>7} {:>6}\n", "where", "cache", "elements", "MiB", "drift GB/s", "copy GB/s",
               "ratio", "reps");
    std::vector<bench::drift_run> runs;
    auto print = [](const bench::drift_run& r) {
      fmt::print("{:<7} {:<5} {:>12} {:>10.3f} {:>12.2f} {:>12.2f} {:>7.3f} {:>6}\n", r.where, r.cache, r.elements,
                 static_cast<double>(r.elements * sizeof(float)) / (1 << 20), r.drift_gbps, r.copy_gbps, r.ratio, r.repeats);
      std::fflush(stdout);
    };
    if (device_only) {
      fmt::print("host: skipped (--device-only)\n");
    } else {
      for (std::size_t n : s.sizes) print(runs.emplace_back(host_run(n, s, nullptr)));
      for (std::size_t n : s.sizes)
        if (cold_from_mib > 0 && n * sizeof(float) >= cold_from_mib << 20) print(runs.emplace_back(host_run(n, s, &flusher)));
    }

    if (host_only) {
      fmt::print("device: skipped (--host-only)\n");
    } else {
#ifdef GOSSIP_BENCH_DEVICE
      const std::string why = bench::device_unavailable();
      if (!why.empty()) {
        fmt::print("device: skipped ({})\n", why);
      } else {
        for (std::size_t n : s.sizes) print(runs.emplace_back(bench::device_run(n, s)));
      }
#else
      fmt::print("device: skipped (this build has no CUDA: configure with nvcc on PATH and -Dcuda=enabled)\n");
#endif
    }
    if (runs.empty()) {  // --device-only without a usable device: nothing measured, and no file overwritten
      fmt::print(stderr, "bench/drift: nothing was measured (--device-only, and the device part was skipped); {} left as it was\n",
                 json_path.empty() ? std::string("no JSON") : json_path);
      return 77;
    }

    for (const char* where : {"host", "device"})
      for (const char* cache : {"warm", "cold"}) {
        double worst = 1e300;
        for (const auto& r : runs)
          if (r.where == where && r.cache == cache && r.elements * sizeof(float) >= (16u << 20)) worst = std::min(worst, r.ratio);
        if (worst < 1e300) fmt::print("{}, {}: lowest drift/copy ratio at >= 16 MiB: {:.3f}\n", where, cache, worst);
      }

    if (!json_path.empty()) {
      nlohmann::json j;
      j["bandwidth"] = "model bytes (4 x elements) per second; drift reads x and x-hat, copy reads and writes the model once";
      j["runs"] = nlohmann::json::array();
      for (const auto& r : runs)
        j["runs"].push_back({{"where", r.where}, {"cache", r.cache}, {"elements", r.elements}, {"drift_gbps", r.drift_gbps}, {"copy_gbps", r.copy_gbps},
                             {"ratio", r.ratio}, {"repeats", r.repeats}});
      bench::write_file(json_path, j.dump(2));
    }
  } catch (const std::exception&) {  // gossip::error and anything else (out of memory among them)
    return gossip::bench::report_error("the largest size needs a few copies of the model; lower --max-mib");
  }
  return 0;
}
