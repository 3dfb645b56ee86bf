// TOML → gossip::config, with errors that name the file, the key and what to do.
#include "gossip/config.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "gossip/did_you_mean.hpp"
#include "gossip/error.hpp"

namespace gossip {
namespace {

option_value to_value(const toml::node& n, const std::string& where, const std::string& key) {
  if (auto v = n.as_boolean()) return v->get();
  if (auto v = n.as_integer()) return static_cast<std::int64_t>(v->get());
  if (auto v = n.as_floating_point()) return v->get();
  if (auto v = n.as_string()) return v->get();
  if (auto a = n.as_array()) {
    int_list out;
    // Nested lists are pairs, and only [topology] edges takes them (edges =
    // [[0, 1], [1, 2]], kept flat): in another key, or mixed with plain
    // integers, they would be read as other values.
    const bool pairs = !a->empty() && a->front().is_array();
    for (const auto& e : *a) {
      if (e.is_array() != pairs || (pairs && key != "edges"))
        throw config_error(fmt::format("{}: key '{}' {}; only [topology] edges takes a list of pairs [[a, b], ...], and other lists hold "
                                       "integers only",
                                       where, key, pairs && key != "edges" ? "holds nested lists" : "mixes integers and nested lists"));
      if (auto i = e.as_integer()) {
        out.push_back(i->get());
      } else if (auto inner = e.as_array()) {
        if (inner->size() != 2)
          throw config_error(fmt::format("{}: key '{}' holds a nested list of {} values; a nested list is a pair of integers [a, b] "
                                         "([topology] edges), and other lists hold integers only",
                                         where, key, inner->size()));
        for (const auto& x : *inner) {
          auto j = x.as_integer();
          if (!j) throw config_error(fmt::format("{}: key '{}' is a list that holds other than integers; the only lists a setting takes hold integers or pairs of integers ([topology] edges); check the key's type (gossip-info)", where, key));
          out.push_back(j->get());
        }
      } else {
        throw config_error(fmt::format("{}: key '{}' is a list that holds other than integers; the only lists a setting takes hold integers or pairs of integers ([topology] edges); check the key's type (gossip-info)", where, key));
      }
    }
    return out;
  }
  throw config_error(fmt::format("{}: key '{}' has a type this config does not take (use a boolean, integer, number, string, or array of "
                                 "integers; a string that reads as a date or time goes in quotes: --set \"section.key='…'\")",
                                 where, key));
}

options to_options(const toml::table& t, const std::string& where, bool skip_name) {
  options o(where);
  for (const auto& [k, v] : t) {
    const std::string key(k.str());
    if (skip_name && key == "name") continue;
    if (v.is_table())
      throw config_error(fmt::format("{}: key '{}' is a table; nested tables are not used here", where, key));
    o.set(key, to_value(v, where, key));
  }
  return o;
}

component_config to_component(const toml::table& t, const std::string& where, const std::string& fallback) {
  component_config c{fallback, options(where)};
  if (auto n = t.get("name")) {
    auto s = n->as_string();
    if (!s) throw config_error(fmt::format("{}: key 'name' must be a string", where));
    c.name = s->get();
  }
  c.opts = to_options(t, where, true);
  return c;
}

}  // namespace

std::vector<std::string> config::known_sections() const {
  std::vector<std::string> known = {"policy", "topology", "protocol", "transport", "codec", "engine"};
  known.insert(known.end(), app_sections.begin(), app_sections.end());
  return known;
}

namespace {
// "unknown section [x] (did you mean [y]?); known sections: …", after "<where>: ".
std::string unknown_section(const config& c, std::string_view section) {
  const auto known = c.known_sections();
  return fmt::format("unknown section [{}]{}; known sections: {}", section, detail::did_you_mean(section, known, "[", "]"),
                     fmt::join(known, ", "));
}
}  // namespace

config config::parse(std::string_view text, const std::string& source, std::vector<std::string> app_sections) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    throw config_error(fmt::format("{}:{}:{}: {}", source, b.line, b.column, e.description()));
  }
  config c(std::move(app_sections));
  c.source = source;
  const auto where = [&](std::string_view section) { return fmt::format("{} [{}]", source, section); };
  // A section the text leaves out keeps its defaults; messages about them
  // name this source, and say the section was left out.
  const auto left_out = [&](std::string_view section) {
    return text.find_first_not_of(" \t\r\n") == std::string_view::npos ? where(section)
                                                                          : fmt::format("{} [{}] (left out: the defaults)", source, section);
  };
  c.policy.opts = options(left_out("policy"));
  c.topology.opts = options(left_out("topology"));
  c.protocol.opts = options(left_out("protocol"));
  c.transport.opts = options(left_out("transport"));
  c.codec.opts = options(left_out("codec"));
  c.engine = options(left_out("engine"));
  for (const auto& [k, v] : root) {
    const std::string section(k.str());
    auto* t = v.as_table();
    if (!t) {
      if (v.is_array_of_tables())
        throw config_error(fmt::format("{}: [[{}]] is a list of tables; write it once as [{}]", source, section, section));
      throw config_error(fmt::format("{}: top-level key '{}' must be inside a section; known sections: {}", source, section,
                                     fmt::join(c.known_sections(), ", ")));
    }
    if (section == "policy")
      c.policy = to_component(*t, where(section), c.policy.name);
    else if (section == "topology")
      c.topology = to_component(*t, where(section), c.topology.name);
    else if (section == "protocol")
      c.protocol = to_component(*t, where(section), c.protocol.name);
    else if (section == "transport")
      c.transport = to_component(*t, where(section), c.transport.name);
    else if (section == "codec")
      c.codec = to_component(*t, where(section), c.codec.name);
    else if (section == "engine")
      c.engine = to_options(*t, where(section), false);
    else if (std::find(c.app_sections.begin(), c.app_sections.end(), section) != c.app_sections.end())
      c.sections.emplace(section, to_options(*t, where(section), false));
    else
      throw config_error(fmt::format("{}: {}", source, unknown_section(c, section)));
  }
  return c;
}

config config::load(const std::string& path, std::vector<std::string> app_sections) {
  // An ifstream opens a directory without complaint on Linux and reads nothing.
  if (std::error_code ec; std::filesystem::is_directory(path, ec))
    throw config_error(fmt::format("{}: is a directory, not a config file; give the path of a .toml file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw config_error(fmt::format("{}: cannot open the config file (does it exist and is it readable?)", path));
  // A config is a page of settings: a read that goes on past 1 MiB (a device, a wrong file) stops there.
  constexpr std::size_t max_bytes = std::size_t{1} << 20;
  std::string text(max_bytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) throw config_error(fmt::format("{}: reading the config file failed", path));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > max_bytes)
    throw config_error(fmt::format("{}: more than {} bytes; a config file is a page of TOML settings: give the path of one", path, max_bytes));
  return parse(text, path, std::move(app_sections));
}

void check_switch_mode(std::string_view mode, std::string_view where) {
  if (mode != "auto" && mode != "sync" && mode != "async")
    throw config_error(fmt::format("{}: key 'mode' must be auto, sync or async, got '{}'", where, mode));
}

switch_mode_request requested_switch_mode(const config& cfg) {
  switch_mode_request proto{"auto", cfg.protocol.opts.where("mode")}, transport{"auto", cfg.transport.opts.where("mode")};
  if (cfg.protocol.opts.has("mode")) proto.mode = cfg.protocol.opts.string("mode");
  if (cfg.transport.name == "switch" && cfg.transport.opts.has("mode")) transport.mode = cfg.transport.opts.string("mode");
  check_switch_mode(proto.mode, proto.where);
  check_switch_mode(transport.mode, transport.where);
  if (proto.mode != "auto" && transport.mode != "auto" && proto.mode != transport.mode)
    throw config_error(fmt::format("{} and {}: [transport] mode '{}' and [protocol] mode '{}' disagree; set both to the same, or set one "
                                   "only (the other follows it)",
                                   transport.where, proto.where, transport.mode, proto.mode));
  return proto.mode != "auto" ? proto : transport;
}

config config::from_env(std::vector<std::string> app_sections) {
  if (const char* path = std::getenv("GOSSIP_CONFIG"); path && *path) {
    // gossip-run --config sets it; a user may have left it set by hand.
    if (std::error_code ec; !std::filesystem::exists(path, ec))
      throw config_error(fmt::format("GOSSIP_CONFIG={}: no such file; point it at a config file, or unset it for the defaults", path));
    if (std::error_code ec; std::filesystem::is_directory(path, ec))
      throw config_error(fmt::format("GOSSIP_CONFIG={}: is a directory, not a config file; point it at a .toml file, or unset it for the defaults",
                                     path));
    return load(path, std::move(app_sections));
  }
  return config(std::move(app_sections));
}

namespace {
// Spaces around the key and the value, as a TOML file has them ("policy.threshold = 0.2"), are not part of either.
std::string trimmed(std::string_view s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b, e - b + 1));
}
}  // namespace

std::string config::override_target(std::string_view text) {
  const auto eq = text.find('=');
  const auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) return {};
  const std::string section = trimmed(text.substr(0, dot)), key = trimmed(text.substr(dot + 1, eq - dot - 1));
  return section.empty() || key.empty() ? std::string() : section + "." + key;
}

void config::apply_override(std::string_view assignment, std::string_view origin) {
  const std::string text(assignment);
  const auto eq = text.find('=');
  const auto dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq)
    throw config_error(fmt::format("--set {}: expected section.key=value, e.g. policy.threshold=0.05 or train.epochs=2", text));
  const std::string section = trimmed(text.substr(0, dot)), key = trimmed(text.substr(dot + 1, eq - dot - 1)), value = trimmed(text.substr(eq + 1));
  if (section.empty() || key.empty())
    throw config_error(fmt::format("--set {}: expected section.key=value, e.g. policy.threshold=0.05 or train.epochs=2", text));
  const std::string where = origin.empty() ? fmt::format("--set {}", text) : std::string(origin);
  if (const auto known = known_sections(); std::find(known.begin(), known.end(), section) == known.end())
    throw config_error(fmt::format("{}: {}", where, unknown_section(*this, section)));
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value, where);
  } catch (const toml::parse_error& e) {
    // A number TOML does not take (1e400, .5, an integer past 64 bits), or an
    // array or table left open, is a mistake in the value, not a word.
    // Digits, signs, points, exponents and TOML's underscores only (strtod would take words such as "infinity" too).
    char* end = nullptr;
    if (!value.empty() && value.find_first_not_of("0123456789+-._eE") == std::string::npos) (void)std::strtod(value.c_str(), &end);
    const bool number = end && *end == '\0';
    if (number || value.starts_with('[') || value.starts_with('{'))
      throw config_error(fmt::format("{}: the value is not valid TOML ({}){}", where, e.description(),
                                     number ? "; a TOML integer fits 64 bits, a float a double, with a digit on both sides of its point" : ""));
    // A bare word is taken as a string, so policy.name=drift works without
    // quotes; as written (a TOML literal string), so that a backslash in a
    // path stays a backslash.
    try {
      if (!value.empty() && (value.front() == '"' || value.front() == '\'')) throw;  // a quoted string left open: not a bare word
      std::string basic;  // with a ' inside: a basic string, its \ and " escaped so that it still reads as written
      for (const char ch : value) basic += ch == '\\' || ch == '"' ? std::string{'\\', ch} : std::string(1, ch);
      parsed = toml::parse(value.find('\'') == std::string::npos ? "v = '" + value + "'" : "v = \"" + basic + "\"", where);
    } catch (const toml::parse_error& e) {
      throw config_error(fmt::format("{}: the value is not valid TOML ({}); a string with such characters goes in single quotes, "
                                     "which TOML takes as written: --set \"{}.{}='…'\"",
                                     where, e.description(), section, key));
    }
  }
  // "v = 3\nw = 4" parses too: a value must be one TOML value, not more lines of a file.
  if (parsed.size() != 1)
    throw config_error(fmt::format("{}: the value must be a single TOML value (it spans several lines or keys); give each key its own --set", where));
  component_config* comp = section == "policy" ? &policy : section == "topology" ? &topology : section == "protocol" ? &protocol
                         : section == "transport" ? &transport : section == "codec" ? &codec : nullptr;
  const toml::node& v = *parsed.get("v");
  if (comp && key == "name") {
    auto str = v.as_string();
    if (!str) throw config_error(fmt::format("{}: a component name must be a string", where));
    if (str->get() != comp->name) {
      // The same key twice on the command line: neither silently wins.
      if (const auto it = name_overrides.find(section); it != name_overrides.end())
        throw config_error(fmt::format("{}: {}.name was set already by {}; give it once", where, section, it->second));
      name_overrides.emplace(section, where);
      // The file's settings for the old component go with it; a key set by
      // --set stays, whatever the order of the --set options, and the new
      // component takes it or refuses it by name when the config is resolved
      // (--set policy.threshold=0.5 --set policy.name=drift keeps it;
      // ... --set policy.name=periodic refuses it, as the other order does).
      // The new component's section is the override's: its errors ("unknown
      // policy") name the --set, not a file that never chose it.
      options kept(where);
      for (const auto& entry : comp->opts.values())
        if (const auto& origin = comp->opts.where(entry.first); origin != comp->opts.where()) kept.set(entry.first, entry.second, origin);
      *comp = {str->get(), std::move(kept)};
    }
    return;
  }
  options& target = comp ? comp->opts : section == "engine" ? engine
                  : sections.try_emplace(section, options(fmt::format("{} [{}]", source, section))).first->second;
  option_value parsed_value = to_value(v, where, key);
  // 1 and 1.0 are one value.
  const auto same = [](const option_value& a, const option_value& b) {
    const auto number = [](const option_value& x) -> std::optional<double> {
      if (const auto* i = std::get_if<std::int64_t>(&x)) return static_cast<double>(*i);
      if (const auto* d = std::get_if<double>(&x)) return *d;
      return std::nullopt;
    };
    return a == b || (number(a) && number(b) && *number(a) == *number(b));
  };
  if (target.has(key) && target.where(key) != target.where() && !same(target.values().at(key), parsed_value))
    throw config_error(fmt::format("{}: {}.{} was set already by {}; give it once", where, section, key, target.where(key)));
  target.set(key, std::move(parsed_value), where);
}

options config::section(std::string_view name, std::span<const option_spec> specs) const {
  if (std::find(app_sections.begin(), app_sections.end(), name) == app_sections.end())
    throw config_error(fmt::format("{}: section [{}] is read but was not declared; load the config with config::load(path, {{\"{}\"}}) "
                                   "(or config({{\"{}\"}})) so that a file or --set may set it",
                                   source, name, name, name));
  auto it = sections.find(name);
  if (it == sections.end()) return options(fmt::format("{} [{}]", source, name)).resolved(specs, fmt::format("[{}]", name));
  return it->second.resolved(specs, fmt::format("[{}]", name));
}

void config::follow_momentum(double beta, std::string_view origin) {
  if (!engine.has("momentum_beta")) {
    engine.set("momentum_beta", beta, std::string(origin));
    return;
  }
  const double set = engine.resolved(engine_option_specs(), "[engine]").real("momentum_beta");
  if (std::abs(set - beta) > 1e-12)
    throw config_error(fmt::format("{}: momentum_beta = {} but {} is {}; make them equal or leave momentum_beta out (it then follows {})",
                                   engine.where("momentum_beta"), set, origin, beta, origin));
}

std::string config::shared_settings() const {
  std::string s;
  const auto add = [&](std::string_view section, const component_config& c) {
    s += fmt::format("{}.name=\"{}\"\n", section, c.name);
    for (const auto& [k, v] : c.opts.values()) s += fmt::format("{}.{}={}\n", section, k, to_string(v));
  };
  add("topology", topology);
  add("protocol", protocol);
  add("transport", transport);
  // The codec joins only when set, so configs without one share theirs with configs that say "auto".
  if (codec.name != "auto" || !codec.opts.values().empty()) add("codec", codec);
  s += fmt::format("policy.name=\"{}\"\n", policy.name);
  return s;
}

std::uint64_t settings_fingerprint(std::string_view settings) noexcept {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : settings) h = (h ^ ch) * 1099511628211ull;
  return h;
}

std::uint64_t config::fingerprint() const { return settings_fingerprint(shared_settings()); }

namespace {

std::string settings_difference(std::string_view mine, std::string_view theirs, std::string_view their_name) {
  if (mine.empty() || theirs.empty()) return {};
  // key -> value, in order of first appearance on either side
  const auto entries = [](std::string_view text) {
    std::vector<std::pair<std::string_view, std::string_view>> out;
    while (!text.empty()) {
      const auto nl = text.find('\n');
      const auto line = text.substr(0, nl);
      text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
      const auto eq = line.find('=');
      if (eq != std::string_view::npos) out.emplace_back(line.substr(0, eq), line.substr(eq + 1));
    }
    return out;
  };
  const auto a = entries(mine), b = entries(theirs);
  // Looked up by key (a key's first line counts): a peer's text need not be short.
  const auto index = [](const auto& list) {
    std::map<std::string_view, std::string_view> m;
    for (const auto& [k, v] : list) m.emplace(k, v);
    return m;
  };
  const auto ia = index(a), ib = index(b);
  const auto find = [](const auto& m, std::string_view key) -> std::optional<std::string_view> {
    if (const auto it = m.find(key); it != m.end()) return it->second;
    return std::nullopt;
  };
  const auto show = [](const std::optional<std::string_view>& v) { return v ? std::string(*v) : std::string("not set"); };
  // A setting that differs first: the codec each rank resolved follows from
  // its settings, so that difference is named only when nothing else differs.
  for (const bool resolved : {false, true})
    for (const auto* list : {&a, &b})
      for (const auto& [k, v] : *list) {
        if ((k == "codec.in_use") != resolved) continue;
        const auto va = find(ia, k), vb = find(ib, k);
        if (va != vb) return fmt::format("{} is {} here but {} on {}", k, show(va), show(vb), their_name);
      }
  return {};
}

}  // namespace

config_error settings_mismatch(std::string_view my_name, std::string_view their_name, std::uint64_t my_fingerprint,
                               std::uint64_t their_fingerprint, std::string_view mine, std::string_view theirs) {
  std::string what = settings_difference(mine, theirs, their_name);
  if (what.empty()) what = fmt::format("fingerprints {:016x} vs {:016x}", my_fingerprint, their_fingerprint);
  if (what.starts_with("codec.in_use "))
    return config_error(fmt::format("{} and {} would encode their messages differently ({}); {}", my_name, their_name, what,
                                    what.find("(from auto)") != std::string::npos
                                        ? "[codec] name = \"auto\" resolves on each rank from its [engine] max_lead (GOSSIP_MAX_LEAD) and "
                                          "where its model lives: give every rank the same max_lead and device, or set [codec] name"
                                        : "give every rank the same [codec] settings"));
  return config_error(fmt::format("{} and {} were built from different gossip settings ({}); give every rank the same config file and --set "
                                  "options",
                                  my_name, their_name, what));
}

}  // namespace gossip
