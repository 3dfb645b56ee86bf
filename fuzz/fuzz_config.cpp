// Config text → gossip::config → everything the engine builds from it.
//
// Input: TOML text, optionally followed by a NUL byte and `section.key=value`
// overrides, one per line (what --set passes). Every rejection must be a
// gossip::error; any other exception, a crash or a sanitizer report is a bug.
// What the engine then does with accepted settings (bounded waits, topology
// rounds, policy decisions) is exercised too, so a value that passes the
// checks but cannot be used is found here rather than in a training run.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "gossip/gossip.hpp"

namespace {

// An accepted setting is the value the file gave (not a narrowed one) and is usable.
void exercise_settings(const gossip::engine_settings& s, const gossip::options& o) {
  // The engine's waits compute a deadline from the timeout (gossip/wait.hpp).
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(s.timeout);
  (void)deadline;
  if (s.send_buffers < 1 || s.send_buffers > 16 || s.trace_skips_every < 1 || s.finish_rounds < -1) std::abort();
  if (s.send_buffers != o.integer("send_buffers") || s.trace_skips_every != o.integer("trace_skips_every") ||
      s.finish_rounds != o.integer("finish_rounds") || o.integer("trace_capacity") < 0 ||
      s.trace_capacity != static_cast<std::size_t>(o.integer("trace_capacity")))
    std::abort();
}

void exercise_topology(gossip::topology& t, const gossip::component_config& c) {
  for (std::uint64_t r = 0; r < 8; ++r)
    for (const auto& p : t.peers(r))
      if (p.rank < 0 || p.rank >= t.world() || p.rank == t.rank()) std::abort();
  // An edge list that was accepted names ranks of this world only.
  if (c.name == "edges")
    for (auto v : c.opts.integers("edges"))
      if (v < 0 || v >= t.world()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const auto nul = input.find('\0');
  const std::string_view text = input.substr(0, nul);
  std::string_view overrides = nul == std::string_view::npos ? std::string_view{} : input.substr(nul + 1);
  try {
    auto cfg = gossip::config::parse(text, "fuzz.toml");
    while (!overrides.empty()) {
      const auto nl = overrides.find('\n');
      cfg.apply_override(overrides.substr(0, nl));
      overrides = nl == std::string_view::npos ? std::string_view{} : overrides.substr(nl + 1);
    }
    (void)cfg.fingerprint();
    static const std::vector<gossip::option_spec> app_specs = {
        {"epochs", std::int64_t{1}, "epochs"}, {"lr", 0.1, "learning rate"}, {"data_dir", std::string{}, "where"},
        {"shuffle", true, "shuffle"}, {"layers", gossip::int_list{128}, "hidden sizes"}};
    for (const auto& [name, opts] : cfg.sections) {
      const auto resolved = cfg.section(name, app_specs);
      for (const auto& [k, v] : resolved.values()) (void)gossip::to_string(v);
    }

    auto spec = gossip::engine_spec::from(cfg);
    exercise_settings(spec.settings, cfg.engine.resolved(gossip::engine_option_specs(), "[engine]"));
    gossip::signal sig;
    sig.diff_sq = 1, sig.ref_sq = 4, sig.lr = 0.1, sig.loss = 1;
    for (std::uint64_t step = 0; step < 4; ++step) {
      sig.step = step, sig.steps_since_send = step + 1;
      (void)spec.policy.decide(sig);
    }
    (void)gossip::protocol_registry().make(spec.protocol.name, spec.protocol.opts);
    // The world size and rank come from the input too, so edge lists meet small and large worlds.
    const int world = 1 + static_cast<int>(size % 9);
    const int rank = static_cast<int>(size / 9 % static_cast<std::size_t>(world));
    auto t = gossip::topology_registry().make(spec.topology.name, spec.topology.opts, rank, world);
    const auto& e = gossip::topology_registry().find(spec.topology.name, "fuzz");
    exercise_topology(t, {spec.topology.name, spec.topology.opts.resolved(e.specs, "topology")});
  } catch (const gossip::error&) {
    // a refusal with a message: what bad input must get
  }
  return 0;
}
