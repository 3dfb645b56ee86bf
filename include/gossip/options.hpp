#pragma once
/// Typed settings shared by every pluggable component.
///
/// Each component (policy, topology, protocol, transport) declares one table of
/// option_spec {key, default, help}. The config parser, the `gossip-info` tool
/// and `--help` texts all read that one table, so a setting is declared once.
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
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

}  // namespace gossip
