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
struct periodic {
  static constexpr std::string_view config_name = "periodic";
  static constexpr std::string_view help = "send every `every` steps, whatever the drift (the gossip-SGD baseline)";

  std::uint64_t every = 1;

  decision decide(const signal& s) const noexcept {
    const auto since = static_cast<double>(s.steps_since_send);
    const auto period = static_cast<double>(every);
    return s.steps_since_send >= every ? decision::fire(reason::period, since, period)
                                       : decision::skip(reason::not_due, since, period);
  }

  static std::vector<option_spec> specs() {
    return {{"every", std::int64_t{1}, "send on every `every`-th step (integer >= 1; 1 = every step)"}};
  }

  static periodic from_options(const options& o) {
    const std::int64_t every = o.integer("every");
    if (every < 1)
      throw config_error(fmt::format("{}: key 'every' of policy 'periodic' must be an integer >= 1, got {}", o.where(),
                                     every));
    return periodic{.every = static_cast<std::uint64_t>(every)};
  }
};
static_assert(gossip::policy<periodic>);

}  // namespace gossip::policies
