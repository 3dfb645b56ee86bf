#pragma once
// engine_settings and engine_spec from a config: [engine] keys checked and
// narrowed, the policy built through its registry, the codec checked against
// the transport (included by engine-inl.hpp).
#include <cstdint>
#include <string_view>

#include "gossip/engine.hpp"

namespace gossip {

inline engine_settings engine_settings::from(const options& o) {
  // Integers are checked before they are narrowed, so 2^32 + 2 is refused rather than read as 2.
  const auto in_range = [&](std::string_view key, std::int64_t lo, std::int64_t hi, std::string_view expected) {
    const std::int64_t v = o.integer(key);
    if (v < lo || v > hi) throw config_error(fmt::format("{}: key '{}' must be {}, got {}", o.where(), key, expected, v));
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
  const std::string momentum = o.string("momentum");
  if (momentum == "auto")
    s.momentum = engine_settings::momentum_mode::automatic;
  else if (momentum == "quasi-global")
    s.momentum = engine_settings::momentum_mode::quasi_global;
  else if (momentum == "local")
    s.momentum = engine_settings::momentum_mode::local;
  else
    throw config_error(fmt::format("{}: key 'momentum' must be \"auto\", \"quasi-global\" or \"local\", got \"{}\"", o.where(), momentum));
  const double beta = o.real("momentum_beta");
  if (!(beta >= 0 && beta < 1))
    throw config_error(fmt::format("{}: key 'momentum_beta' must be in [0, 1), got {}", o.where(), beta));
  s.momentum_beta = static_cast<float>(beta);
  const std::string merge = o.string("momentum_merge");
  if (merge == "auto")
    s.momentum_merge = engine_settings::merge_momentum::automatic;
  else if (merge == "full")
    s.momentum_merge = engine_settings::merge_momentum::full;
  else if (merge == "spread")
    s.momentum_merge = engine_settings::merge_momentum::spread;
  else
    throw config_error(fmt::format("{}: key 'momentum_merge' must be \"auto\", \"full\" or \"spread\", got \"{}\"", o.where(), merge));
  if (!(s.timeout.count() > 0))
    throw config_error(fmt::format("{}: key 'timeout_s' must be > 0 seconds, got {}", o.where(), s.timeout.count()));
  if (!(s.timeout.count() <= max_timeout_s))
    throw config_error(fmt::format("{}: key 'timeout_s' must be at most {} seconds (a year), got {}", o.where(), max_timeout_s,
                                   s.timeout.count()));
  return s;
}

inline engine_spec engine_spec::from(const config& cfg) {
  engine_spec s;
  s.policy = policy_registry().make(cfg.policy.name, cfg.policy.opts);
  s.topology = cfg.topology;
  s.protocol = cfg.protocol;
  s.codec = cfg.codec;
  const gossip::codec c = make_codec(cfg.codec);  // an unknown name or key is refused here, with the file and key
  if (c.compresses() && cfg.transport.name == "switch")
    throw config_error(fmt::format("{}: codec '{}' cannot be used with transport 'switch': the switch adds fp32 values and cannot sum "
                                   "compressed messages; set [codec] name = \"none\"",
                                   cfg.codec.opts.where(), cfg.codec.name));
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
  s.config_fingerprint = cfg.fingerprint();
  return s;
}

}  // namespace gossip
