#pragma once
// engine_settings and engine_spec from a config: [engine] keys checked and
// narrowed, the policy built through its registry, the codec checked against
// the transport (included by engine-inl.hpp).
#include <array>
#include <cstdint>
#include <utility>
#include <string_view>

#include "gossip/engine.hpp"

namespace gossip {

inline engine_settings engine_settings::from(const options& o) {
  // Integers are checked before they are narrowed, so 2^32 + 2 is refused rather than read as 2.
  const auto in_range = [&](std::string_view key, std::int64_t lo, std::int64_t hi, std::string_view expected) {
    const std::int64_t v = o.integer(key);
    if (v < lo || v > hi) throw config_error(fmt::format("{}: key '{}' must be {}, got {}", o.where(key), key, expected, v));
    return v;
  };
  // A deadline is steady_clock::now() + timeout in nanoseconds: bounded so that it cannot overflow.
  constexpr double max_timeout_s = 365.0 * 24 * 3600;
  engine_settings s;
  s.timeout = std::chrono::duration<double>(o.real("timeout_s"));
  s.send_buffers = static_cast<int>(in_range("send_buffers", 1, 16, "in 1..16"));
  s.trace_path = o.string("trace");
  s.trace_capacity = static_cast<std::size_t>(in_range("trace_capacity", 0, std::numeric_limits<std::int64_t>::max(), ">= 0"));
  s.trace_skips_every = static_cast<int>(in_range("trace_skips_every", 1, std::numeric_limits<int>::max(), ">= 1"));
  s.stats_path = o.string("stats");
  s.finish_rounds =
      static_cast<int>(in_range("finish_rounds", -1, std::numeric_limits<int>::max(), ">= 0, or -1 for automatic"));
  s.wait_when_busy = o.boolean("wait_when_busy");
  s.max_lead = static_cast<std::uint64_t>(in_range("max_lead", 0, std::int64_t{1} << 40, ">= 0 (0: off)"));
  // A key that names one of three choices, or an error that lists them.
  const auto choice = [&]<class E>(std::string_view key, const std::array<std::pair<std::string_view, E>, 3>& choices) {
    const std::string v = o.string(key);
    for (const auto& [name, value] : choices)
      if (v == name) return value;
    throw config_error(fmt::format("{}: key '{}' must be \"{}\", \"{}\" or \"{}\", got \"{}\"", o.where(key), key, choices[0].first,
                                   choices[1].first, choices[2].first, v));
  };
  using mode = engine_settings::momentum_mode;
  s.momentum = choice("momentum", std::array<std::pair<std::string_view, mode>, 3>{
                                      {{"auto", mode::automatic}, {"quasi-global", mode::quasi_global}, {"local", mode::local}}});
  const double beta = o.real("momentum_beta");
  if (!(beta >= 0 && beta < 1))
    throw config_error(fmt::format("{}: key 'momentum_beta' must be in [0, 1), got {}", o.where("momentum_beta"), beta));
  s.momentum_beta = static_cast<float>(beta);
  using merge = engine_settings::merge_momentum;
  s.momentum_merge = choice("momentum_merge", std::array<std::pair<std::string_view, merge>, 3>{
                                                  {{"auto", merge::automatic}, {"full", merge::full}, {"spread", merge::spread}}});
  if (!(s.timeout.count() > 0))
    throw config_error(fmt::format("{}: key 'timeout_s' must be > 0 seconds, got {}", o.where("timeout_s"), s.timeout.count()));
  if (!(s.timeout.count() <= max_timeout_s))
    throw config_error(fmt::format("{}: key 'timeout_s' must be at most {} seconds (a year), got {}", o.where("timeout_s"), max_timeout_s,
                                   s.timeout.count()));
  return s;
}

inline void engine_settings::check() const {
  const auto bad = [](std::string_view field, std::string_view expected, const auto& got) {
    return config_error(fmt::format("engine_settings::{} must be {}, got {} (the config key [engine] {})", field, expected, got,
                                    field == "timeout" ? "timeout_s" : field));
  };
  if (!(timeout.count() > 0) || !(timeout.count() <= 365.0 * 24 * 3600)) throw bad("timeout", "in (0, a year] seconds", timeout.count());
  if (send_buffers < 1 || send_buffers > 16) throw bad("send_buffers", "in 1..16", send_buffers);
  if (trace_skips_every < 1) throw bad("trace_skips_every", ">= 1", trace_skips_every);
  if (finish_rounds < -1) throw bad("finish_rounds", ">= 0, or -1 for automatic", finish_rounds);
  if (!(momentum_beta >= 0 && momentum_beta < 1)) throw bad("momentum_beta", "in [0, 1)", momentum_beta);
  if (max_lead > (std::uint64_t{1} << 40)) throw bad("max_lead", "at most 2^40 (0: off)", max_lead);
}

inline engine_spec engine_spec::from(const config& cfg) {
  engine_spec s;
  s.policy = policy_registry().make(cfg.policy.name, cfg.policy.opts);
  s.topology = cfg.topology;
  s.protocol = cfg.protocol;
  s.codec = cfg.codec;
  const gossip::codec c = make_codec(cfg.codec);  // an unknown name or key is refused here, with the file and key
  if (c.compresses() && !c.automatic() && cfg.transport.name == "switch")
    throw config_error(fmt::format("{}: codec '{}' cannot be used with transport 'switch': the switch adds fp32 values and cannot sum "
                                   "compressed messages; set [codec] name = \"none\"",
                                   cfg.codec.opts.where(), cfg.codec.name));
  // The switch's protocol and topology mean nothing without the switch in the path.
  if (cfg.transport.name != "switch") {
    if (cfg.protocol.name == "switch-aggregate")
      throw config_error(fmt::format("{}: protocol 'switch-aggregate' needs transport 'switch' (the aggregation switch), but [transport] "
                                     "name is '{}'; over it use push-sum, pairwise or stale-copy",
                                     cfg.protocol.opts.where("name"), cfg.transport.name));
    if (cfg.topology.name == "switch")
      throw config_error(fmt::format("{}: topology 'switch' (every member of a switch group) needs transport 'switch', but [transport] "
                                     "name is '{}'; over it use e.g. exponential, ring or complete",
                                     cfg.topology.opts.where("name"), cfg.transport.name));
  }
  // The switch protocol's mode follows the policy unless the config names one.
  if (s.protocol.name == "switch-aggregate") {
    const std::string requested = s.protocol.opts.has("mode") ? s.protocol.opts.string("mode") : "auto";
    const bool staggered = staggered_policy(cfg.policy);
    if (staggered && requested == "sync")
      throw config_error(fmt::format("{}: mode 'sync' needs every member to send at the same steps, but policy 'periodic' has stagger = true; "
                                     "use mode = \"async\" or \"auto\", or stagger = false", s.protocol.opts.where()));
    s.protocol.opts.set("mode", switch_mode(requested, cfg.policy.name, staggered));
  }
  s.settings = engine_settings::from(cfg.engine.resolved(engine_option_specs(), "[engine]"));
  s.config_settings = cfg.shared_settings();
  s.config_fingerprint = cfg.fingerprint();
  return s;
}

}  // namespace gossip
