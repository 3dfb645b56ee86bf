#include "gossip/options.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <system_error>

#include <fmt/ranges.h>

#include "gossip/did_you_mean.hpp"

namespace gossip {

std::string to_string(const option_value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>)
          return x ? "true" : "false";
        else if constexpr (std::is_same_v<T, int_list>)
          return fmt::format("[{}]", fmt::join(x, ", "));
        else if constexpr (std::is_same_v<T, std::string>)
          return fmt::format("\"{}\"", x);
        else
          return fmt::format("{}", x);
      },
      v);
}

const std::string& options::where(std::string_view key) const {
  auto it = m_origins.find(key);
  return it == m_origins.end() ? m_where : it->second;
}

std::string options::where(std::string_view key, std::string_view other) const {
  const auto& a = where(key);
  const auto& b = where(other);
  return a == b ? a : fmt::format("{} (and '{}' from {})", a, other, b);
}

const option_value& options::at(std::string_view key) const {
  auto it = m_values.find(std::string(key));
  if (it == m_values.end())
    throw config_error(fmt::format("{}: missing key '{}' (was the option table resolved against its specs?)", m_where, key));
  return it->second;
}

double options::real(std::string_view key) const {
  const auto& v = at(key);
  if (auto* d = std::get_if<double>(&v)) return *d;
  if (auto* i = std::get_if<std::int64_t>(&v)) return static_cast<double>(*i);
  throw config_error(fmt::format("{}: key '{}' must be a number, got {} {}", where(key), key, option_type_name(v), to_string(v)));
}

namespace {
// A float with nothing after the point (4.0), as the integer it spells, for
// the message that says to write it without the point.
std::optional<std::int64_t> whole_float(const option_value& v) {
  const auto* d = std::get_if<double>(&v);
  if (!d || !std::isfinite(*d) || *d != std::trunc(*d) || std::abs(*d) >= 1e15) return std::nullopt;
  return static_cast<std::int64_t>(*d);
}
}  // namespace

std::int64_t options::integer(std::string_view key) const {
  const auto& v = at(key);
  if (auto* i = std::get_if<std::int64_t>(&v)) return *i;
  if (const auto n = whole_float(v))
    throw config_error(fmt::format("{}: key '{}' must be an integer, got the float {}.0; write it without the point ({})", where(key), key, *n, *n));
  throw config_error(fmt::format("{}: key '{}' must be an integer, got {} {}", where(key), key, option_type_name(v), to_string(v)));
}

bool options::boolean(std::string_view key) const {
  const auto& v = at(key);
  if (auto* b = std::get_if<bool>(&v)) return *b;
  throw config_error(fmt::format("{}: key '{}' must be true or false, got {} {}", where(key), key, option_type_name(v), to_string(v)));
}

const std::string& options::string(std::string_view key) const {
  const auto& v = at(key);
  if (auto* s = std::get_if<std::string>(&v)) return *s;
  throw config_error(fmt::format("{}: key '{}' must be a string, got {} {}", where(key), key, option_type_name(v), to_string(v)));
}

const int_list& options::integers(std::string_view key) const {
  const auto& v = at(key);
  if (auto* s = std::get_if<int_list>(&v)) return *s;
  throw config_error(fmt::format("{}: key '{}' must be an array of integers, got {} {}", where(key), key, option_type_name(v), to_string(v)));
}

namespace {
option_value parse_env(const option_spec& s, const char* text) {
  const std::string t(text);
  // A number in decimal, as TOML writes it: spaces around it are not part of
  // it (on either side), and neither is a leading '+'; hex and words are refused.
  const auto number = [&]<class T>(T& v) {
    std::string_view n(t);
    n.remove_prefix(std::min(n.find_first_not_of(" \t"), n.size()));
    n.remove_suffix(n.size() - (n.find_last_not_of(" \t") + 1));
    if (n.starts_with('+')) n.remove_prefix(1);
    const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), v);
    return !n.empty() && ec == std::errc{} && end == n.data() + n.size();
  };
  const auto bad = [&] {
    const std::string_view type = option_type_name(s.default_value);
    return config_error(fmt::format("environment variable {}={} (for key '{}'): expected {} {}", s.env, t, s.key,
                                    std::string_view("aeiou").find(type[0]) != std::string_view::npos ? "an" : "a", type));
  };
  try {
    switch (s.default_value.index()) {
      case 0:
        if (t == "1" || t == "true") return true;
        if (t == "0" || t == "false") return false;
        throw bad();
      case 1: {
        std::int64_t v = 0;
        if (!number(v)) throw bad();
        return v;
      }
      case 2: {
        double v = 0;
        if (!number(v)) throw bad();
        return v;
      }
      case 3: return t;
      default: throw bad();
    }
  } catch (const std::logic_error&) {
    throw bad();
  }
}
}  // namespace

options options::resolved(std::span<const option_spec> specs, std::string_view component) const {
  options out(m_where);
  for (const auto& entry : m_values) {
    const std::string& key = entry.first;
    const option_value& value = entry.second;
    auto spec = std::find_if(specs.begin(), specs.end(), [&](const option_spec& s) { return s.key == key; });
    if (spec == specs.end()) {
      std::vector<std::string> known;
      for (const auto& s : specs) known.push_back(s.key);
      throw config_error(fmt::format("{}: unknown key '{}' for {}{}; known keys: {}", where(key), key, component,
                                     detail::did_you_mean(key, known), known.empty() ? "(none)" : fmt::format("{}", fmt::join(known, ", "))));
    }
    const bool widen = std::holds_alternative<double>(spec->default_value) && std::holds_alternative<std::int64_t>(value);
    if (const auto n = whole_float(value); n && std::holds_alternative<std::int64_t>(spec->default_value))
      throw config_error(fmt::format("{}: key '{}' of {} must be an integer (default {}), got the float {}.0; write it without the point ({})",
                                     where(key), key, component, to_string(spec->default_value), *n, *n));
    if (value.index() != spec->default_value.index() && !widen)
      throw config_error(fmt::format("{}: key '{}' of {} must be {} {} (default {}), got {} {}", where(key), key, component,
                                     std::string_view("aeiou").find(option_type_name(spec->default_value)[0]) != std::string_view::npos ? "an" : "a",
                                     option_type_name(spec->default_value), to_string(spec->default_value),
                                     option_type_name(value), to_string(value)));
    out.set(key, widen ? option_value(static_cast<double>(std::get<std::int64_t>(value))) : value);
    if (auto o = m_origins.find(key); o != m_origins.end()) out.m_origins.insert(*o);
  }
  for (const auto& s : specs) {
    if (!s.env.empty())
      if (const char* e = std::getenv(s.env.c_str()); e && *e) {
        option_value v = parse_env(s, e);
        // The variable overrides the file; an override given on the command
        // line (--set, or a flag) that says otherwise is refused: neither wins silently.
        const auto o = m_origins.find(s.key);
        const bool overridden = o != m_origins.end() && o->second != m_where && out.has(s.key);
        if (!overridden)
          out.set(s.key, std::move(v), fmt::format("environment variable {}={}", s.env, e));
        else if (to_string(out.values().at(s.key)) != to_string(v))
          throw config_error(fmt::format("{} and environment variable {}={} both set key '{}' of {}, to different values; neither wins "
                                         "silently: unset the variable or drop the override",
                                         o->second, s.env, e, s.key, component));
      }
    if (!out.has(s.key)) out.set(s.key, s.default_value);
  }
  return out;
}

}  // namespace gossip
