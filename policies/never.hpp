#pragma once
#include <string_view>
#include <vector>

#include "gossip/options.hpp"
#include "gossip/policy.hpp"
#include "gossip/signal.hpp"

namespace gossip::policies {

/// Never sends: local SGD only.
///
///     gossip::policies::never p;
///     p.decide(s).send;  // always false, reason::never
///
/// A lower bound for traffic and a control for accuracy: an adaptive policy
/// that does no better than this has not shown that communication helped.
struct never {
  static constexpr std::string_view config_name = "never";
  static constexpr std::string_view help = "never send (local SGD only; a control for traffic and accuracy)";

  decision decide(const signal&) const noexcept { return decision::skip(reason::never); }

  static std::vector<option_spec> specs() { return {}; }
  static never from_options(const options&) { return {}; }
};
static_assert(gossip::policy<never>);

}  // namespace gossip::policies
