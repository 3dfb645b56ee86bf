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
#include "output_file.hpp"

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

/// Writes `text` to `path` whole or not at all (out::write_file_whole: a
/// full disk never leaves a truncated file nor loses an earlier result); an
/// error naming the path as given when it could not.
inline void write_file(const std::string& given, const std::string& text) {
  if (const int e = out::write_file_whole(given, text)) throw error(fmt::format("cannot write {} ({})", given, std::strerror(e)));
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
