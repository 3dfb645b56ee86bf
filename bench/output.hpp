#pragma once
// Where a bench writes its results: checked before the first run, so that a
// bad --out or --json path fails at once with the flag named instead of after
// minutes of measuring (or not at all).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <exception>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "gossip/error.hpp"

namespace gossip::bench {

/// Creates directory `dir` (and its parents) for a bench's output; a
/// config_error naming `flag` when it is a file or cannot be written.
inline void prepare_out_dir(const std::string& dir, std::string_view flag = "--out") {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw config_error(fmt::format("{} {}: is a file, not a directory; give a directory for the results", flag, dir));
  fs::create_directories(dir, ec);
  if (ec) throw config_error(fmt::format("{} {}: cannot create the directory ({})", flag, dir, ec.message()));
  if (::access(dir.c_str(), W_OK) != 0)
    throw config_error(fmt::format("{} {}: the directory is not writable ({})", flag, dir, std::strerror(errno)));
}

/// Checks that file `path` can be written: not a directory, in a writable
/// directory, which is created (with its parents) when missing, as --out's is.
inline void check_out_file(const std::string& path, std::string_view flag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw config_error(fmt::format("{} {}: is a directory; give the path of a file", flag, path));
  const fs::path parent = fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
  if (!fs::exists(parent, ec)) fs::create_directories(parent, ec);
  if (!fs::is_directory(parent, ec) || ::access(parent.c_str(), W_OK) != 0)
    throw config_error(fmt::format("{} {}: {} is not a writable directory", flag, path, parent.string()));
}

/// Writes `text` to `path`; an error naming the path when it could not. The
/// text goes to a temporary file beside it, renamed over `path` once whole:
/// a full disk never leaves a truncated file nor loses an earlier result.
/// A symbolic link is written through (its target is replaced), and a path
/// that is not a regular file (/dev/stdout, a pipe) is written to directly.
inline void write_file(const std::string& given, const std::string& text) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(given, ec);
  const std::string path = ec ? given : canonical.string();
  if (const auto st = fs::status(path, ec); !ec && fs::exists(st) && !fs::is_regular_file(st)) {
    std::ofstream direct(path);
    direct << text << '\n';
    direct.close();
    if (!direct) throw error(fmt::format("cannot write {} ({})", given, std::strerror(errno)));
    return;
  }
  const std::string partial = fmt::format("{}.partial-{}", path, ::getpid());
  std::ofstream out(partial);
  out << text << '\n';
  out.close();
  if (!out) {
    const int saved = errno;
    std::error_code ec;
    std::filesystem::remove(partial, ec);
    throw error(fmt::format("cannot write {} ({})", path, std::strerror(saved)));
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    std::error_code ec;
    std::filesystem::remove(partial, ec);
    throw error(fmt::format("cannot write {} ({})", path, std::strerror(saved)));
  }
}

/// A bench's last word on what went wrong (call inside a catch block): one
/// "error: …" line, and exit status 1; out of memory says `oom_hint`.
inline int report_error(std::string_view oom_hint) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "error: out of memory ({})\n", oom_hint);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
  }
  return 1;
}

}  // namespace gossip::bench
