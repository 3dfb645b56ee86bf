#pragma once
/// Typed settings shared by every pluggable component.
///
/// Each component (policy, topology, protocol, transport) declares one table of
/// option_spec {key, default, help}. The config parser, the `gossip-info` tool
/// and `--help` texts all read that one table, so a setting is declared once.
#include <concepts>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "gossip/error.hpp"

namespace gossip {

using int_list = std::vector<std::int64_t>;
using option_value = std::variant<bool, std::int64_t, double, std::string, int_list>;

constexpr std::string_view option_type_name(const option_value& v) noexcept {
  switch (v.index()) {
    case 0: return "boolean";
    case 1: return "integer";
    case 2: return "number";
    case 3: return "string";
    default: return "array of integers";
  }
}

std::string to_string(const option_value& v);

struct option_spec {
  std::string key;
  option_value default_value;
  std::string help;
  std::string env = {};  ///< environment variable that overrides the file, if any
};

/// Values for one component, already checked against its specs.
class options {
 public:
  options() = default;
  /// `where` names the origin for messages, e.g. "run.toml [policy]".
  explicit options(std::string where) : m_where(std::move(where)) {}

  options& set(std::string key, option_value v) {
    m_origins.erase(key);
    m_values[std::move(key)] = std::move(v);
    return *this;
  }
  /// Sets a value that came from somewhere other than where(), e.g. "--set
  /// policy.threshold=0.1": messages about this key name that origin instead.
  options& set(std::string key, option_value v, std::string origin) {
    m_origins[key] = std::move(origin);
    m_values[std::move(key)] = std::move(v);
    return *this;
  }
  bool has(std::string_view key) const { return m_values.find(std::string(key)) != m_values.end(); }
  const std::map<std::string, option_value>& values() const noexcept { return m_values; }
  const std::string& where() const noexcept { return m_where; }
  /// Where `key` was set: its origin if it has one, else where().
  const std::string& where(std::string_view key) const;
  /// Where `key` was set, and where `other` was when that differs: for a
  /// check of one key against another ("tau_max >= tau0").
  std::string where(std::string_view key, std::string_view other) const;

  double real(std::string_view key) const;
  std::int64_t integer(std::string_view key) const;
  bool boolean(std::string_view key) const;
  const std::string& string(std::string_view key) const;
  const int_list& integers(std::string_view key) const;

  /// Checks keys and types against `specs` and fills in defaults. An integer
  /// given where a number is expected is widened; anything else that differs is
  /// a config_error naming where the key was set, the key, and the expected
  /// type or the known keys (with the closest one when it looks misspelt).
  /// A spec's environment variable, when set, overrides the given value.
  options resolved(std::span<const option_spec> specs, std::string_view component) const;

 private:
  const option_value& at(std::string_view key) const;
  std::string m_where = "options";
  std::map<std::string, option_value> m_values;
  std::map<std::string, std::string, std::less<>> m_origins;  ///< keys set from elsewhere than m_where
};

/// States a component's setting ranges once, for a component built in code
/// and for one read from a config. With the config's options the error names
/// where the key was set, else the component alone:
///
///     template <class Int>
///     static void validate(const setting_check& c, double threshold, Int max_interval) {
///       c(std::isfinite(threshold) && threshold > 0, "threshold", "a finite number > 0", threshold);
///       c.at_least(max_interval, 0, "max_interval", " (0 = no limit)");
///     }
///
/// "run.toml [policy]: key 'threshold' of policy 'drift' must be a finite
/// number > 0, got 0" from a config, "policy 'drift': threshold must be …"
/// from code. Counts are signed when read from a config (a negative one is
/// refused before it is converted) and unsigned in code; at_least takes both.
class setting_check {
 public:
  /// `component` as messages name it, e.g. "policy 'drift'".
  explicit setting_check(std::string component, const options* from = nullptr) : m_component(std::move(component)), m_from(from) {}

  /// Refuses `value` of `key` unless `ok`; `range` is what it must be. `other`
  /// names a second key the range depends on (named with where it was set).
  template <class T>
  void operator()(bool ok, std::string_view key, std::string_view range, const T& value, std::string_view other = {}) const {
    if (!ok) fail(key, other, range, fmt::format("{}", value));
  }

  /// An integer >= lo (`note` follows the range, e.g. " (0 = no limit)").
  template <std::integral I>
  void at_least(I value, std::int64_t lo, std::string_view key, std::string_view note = {}) const {
    if (std::cmp_less(value, lo)) fail(key, {}, fmt::format("an integer >= {}{}", lo, note), fmt::format("{}", value));
  }

 private:
  [[noreturn]] void fail(std::string_view key, std::string_view other, std::string_view range, const std::string& got) const {
    if (m_from)
      throw config_error(fmt::format("{}: key '{}' of {} must be {}, got {}", other.empty() ? m_from->where(key) : m_from->where(key, other),
                                     key, m_component, range, got));
    throw config_error(fmt::format("{}: {} must be {}, got {}", m_component, key, range, got));
  }

  std::string m_component;
  const options* m_from;
};

}  // namespace gossip
