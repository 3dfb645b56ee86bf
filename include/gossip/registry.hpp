#pragma once
/// Name → factory tables, so a config file can pick a component by name.
///
///     gossip::policy_registry().add({"my-policy", "what it does",
///         {{"threshold", 0.1, "fire above this"}},
///         [](const gossip::options& o) { return gossip::any_policy(my_policy{o.real("threshold")}); }});
///
/// Every entry carries its option table; the config parser checks a section
/// against it, and `gossip-info` prints it.
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gossip/did_you_mean.hpp"
#include "gossip/error.hpp"
#include "gossip/options.hpp"

namespace gossip {

template <class Product, class... Args>
class registry {
 public:
  struct entry {
    std::string name;
    std::string help;
    std::vector<option_spec> specs;
    std::function<Product(const options&, Args...)> make;
  };

  explicit registry(std::string kind) : m_kind(std::move(kind)) {}

  /// Adds an entry; a second entry with the same name replaces the first, so a
  /// user can override a shipped component.
  void add(entry e) {
    for (auto& x : m_entries)
      if (x.name == e.name) {
        x = std::move(e);
        return;
      }
    m_entries.push_back(std::move(e));
  }

  bool contains(std::string_view name) const noexcept {
    for (const auto& x : m_entries)
      if (x.name == name) return true;
    return false;
  }

  /// Looks a name up; an unknown name is a config_error that lists the known ones.
  const entry& find(std::string_view name, std::string_view where) const {
    for (const auto& x : m_entries)
      if (x.name == name) return x;
    std::vector<std::string_view> known;
    for (const auto& x : m_entries) known.push_back(x.name);
    throw config_error(
        fmt::format("{}: unknown {} '{}'{}; known {}: {}", where, m_kind, name, detail::did_you_mean(name, known), plural(), names_joined()));
  }

  /// Builds the named component from raw options (checked against its specs).
  Product make(std::string_view name, const options& raw, Args... args) const {
    const entry& e = find(name, raw.where());
    return e.make(raw.resolved(e.specs, fmt::format("{} '{}'", m_kind, name)), std::forward<Args>(args)...);
  }

  std::span<const entry> entries() const noexcept { return m_entries; }
  const std::string& kind() const noexcept { return m_kind; }

  std::string plural() const { return m_kind.ends_with('y') ? m_kind.substr(0, m_kind.size() - 1) + "ies" : m_kind + "s"; }

  std::string names_joined() const {
    std::string s;
    for (const auto& x : m_entries) s += (s.empty() ? "" : ", ") + x.name;
    return s;
  }

 private:
  std::string m_kind;
  std::vector<entry> m_entries;
};

}  // namespace gossip
