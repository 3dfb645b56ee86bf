#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"
#include "gossip/options.hpp"
#include "gossip/policy.hpp"
#include "gossip/signal.hpp"

namespace gossip::policies {

/// Sends every `every` steps, whatever the drift: the gossip-SGD baseline.
///
///     gossip::policies::periodic p{.every = 4};
///     auto d = p.decide(s);  // fires when s.steps_since_send >= 4
///
/// The engine counts the current step in steps_since_send (it is 1 on the first
/// step after a send), so every = 1 sends at every step and every = k sends on
/// every k-th step.
///
/// With `stagger`, rank r sends at the steps t with (t + 1 + ⌊r·every/world⌋)
/// mod every = 0: the ranks take turns instead of all sending (and merging) at
/// the same step. Not for the switch's sync mode, whose all-reduce needs every
/// member at the same step.
struct periodic {
  static constexpr std::string_view config_name = "periodic";
  static constexpr std::string_view help = "send every `every` steps, whatever the drift (the gossip-SGD baseline)";

  std::uint64_t every = 1;
  bool stagger = false;

  decision decide(const signal& s) const noexcept {
    const auto since = static_cast<double>(s.steps_since_send);
    const auto period = static_cast<double>(every);
    bool due = s.steps_since_send >= every;
    if (stagger && s.world > 0) {
      const std::uint64_t offset = static_cast<std::uint64_t>(s.rank) * every / static_cast<std::uint64_t>(s.world);
      due = (s.step + 1 + offset) % every == 0;
    }
    return due ? decision::fire(reason::period, since, period) : decision::skip(reason::not_due, since, period);
  }

  constexpr std::uint64_t fixed_period() const noexcept { return every; }

  /// A policy built in code is checked as a config's is (any_policy calls this).
  void check() const { setting_check("policy 'periodic'").at_least(every, 1, "every"); }

  static std::vector<option_spec> specs() {
    return {{"every", std::int64_t{1}, "send on every `every`-th step (integer >= 1; 1 = every step)"},
            {"stagger", false, "ranks take turns: rank r sends `r·every/world` steps earlier in each period than rank 0"}};
  }

  static periodic from_options(const options& o) {
    const std::int64_t every = o.integer("every");
    setting_check("policy 'periodic'", &o).at_least(every, 1, "every");
    return periodic{.every = static_cast<std::uint64_t>(every), .stagger = o.boolean("stagger")};
  }
};
static_assert(gossip::policy<periodic>);

}  // namespace gossip::policies
