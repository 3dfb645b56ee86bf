// The Python module `gossip`: an engine over a PyTorch model's parameters.
//
//     eng = gossip.Engine(model.named_parameters(), config="run.toml", optimizer=opt)
//     for x, y in batches:
//         ...; opt.step()
//         eng.step(lr=lr, loss=loss.item())
//     eng.finish()
//
// The module does not link libtorch: it reads a tensor's address, size, dtype,
// device and layout through the tensor's Python methods, so one build serves
// any torch. The model view points at the tensors' storage (no copy); step()
// checks that every tensor still has the storage it was registered with.
// Built with CUDA (libgossip_cuda), it also takes a model whose parameters all
// live on one CUDA device: the engine's passes then run on that device, on the
// torch stream that was current when the Engine was built.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gossip/gossip.hpp"
#include "gossip_build_config.hpp"
#if defined(GOSSIP_PYTHON_CUDA)
#include "gossip/cuda.hpp"
#endif
#if defined(GOSSIP_HAVE_UCX)
#include "gossip/transports/ucx/ucx.hpp"
#endif

namespace py = pybind11;

namespace gossip::python {

namespace {

std::string py_str(const py::handle& h) { return py::str(h).cast<std::string>(); }

// The thread the interpreter finalizes on (set when the module is imported).
unsigned long g_main_thread = 0;

// Whether this thread may no longer take the GIL: the interpreter is
// exiting and this is not the thread that finalizes it (a daemon thread).
// Python ends such a thread where it asks for the GIL, which would unwind
// through the engine's C++ frames and abort the process.
bool gil_is_gone() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing() != 0;
#else
  const bool finalizing = _Py_IsFinalizing() != 0;
#endif
  return finalizing && PyThread_get_thread_ident() != g_main_thread;
}

// A daemon thread still inside a call when the interpreter exits: it stays
// here until the process ends, as Python's own daemon threads do.
[[noreturn]] void park_until_exit() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// A call that may wait on the network: releases the GIL, and lets Python's
// signal handlers run during its waits (gossip::set_interrupt_check), so
// that Ctrl-C raises KeyboardInterrupt out of a wait on a peer instead of
// going unseen until the wait times out. The exception leaves the engine as
// a timeout would; the peers see this rank gone once it exits.
class waiting_call {
 public:
  waiting_call() : m_previous(set_interrupt_check(&run_signal_handlers)) {}
  ~waiting_call() {
    set_interrupt_check(m_previous);
    if (gil_is_gone()) park_until_exit();
  }
  waiting_call(const waiting_call&) = delete;
  waiting_call& operator=(const waiting_call&) = delete;

 private:
  static void run_signal_handlers() {
    if (gil_is_gone()) park_until_exit();
    py::gil_scoped_acquire held;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
  interrupt_check m_previous;
  py::gil_scoped_release m_unlocked;
};

std::optional<long long> env_int(const char* name) {
  const char* s = std::getenv(name);
  if (!s || !*s) return std::nullopt;
  long long v = 0;
  const char* end = s + std::strlen(s);
  auto [p, ec] = std::from_chars(s, end, v);
  if (ec != std::errc{} || p != end) throw config_error(fmt::format("gossip: {}='{}' is not an integer", name, s));
  return v;
}

const char* env_or(const char* name, const char* fallback) {
  const char* s = std::getenv(name);
  return s && *s ? s : fallback;
}

// Rank and world: torchrun's RANK/WORLD_SIZE win over a scheduler's variables
// (torchrun started under srun still sees SLURM_PROCID), GOSSIP_* over both.
rank_identity identity() {
  // torchrun's variables, unless either GOSSIP_ one is set (the bootstrap then wants both).
  if (!std::getenv("GOSSIP_RANK") && !std::getenv("GOSSIP_WORLD_SIZE") && std::getenv("RANK") && std::getenv("WORLD_SIZE")) {
    const auto rank = env_int("RANK"), world = env_int("WORLD_SIZE");
    if (!world || *world < 1 || *world > 1 << 20)
      throw config_error(fmt::format("gossip: WORLD_SIZE='{}' is not a valid world size (an integer in 1..{})", std::getenv("WORLD_SIZE"), 1 << 20));
    if (!rank || *rank < 0 || *rank >= *world)
      throw config_error(fmt::format("gossip: RANK='{}' is not a valid rank for WORLD_SIZE={} (an integer in 0..{})", std::getenv("RANK"),
                                     *world, *world - 1));
    return {static_cast<int>(*rank), static_cast<int>(*world), "RANK/WORLD_SIZE"};
  }
  return bootstrap::identity_from_env();
}

// The rendezvous: GOSSIP_MASTER_ADDR/PORT, else torchrun's MASTER_ADDR and
// MASTER_PORT + 1 (torchrun's own store, or torch.distributed's, may hold MASTER_PORT).
std::shared_ptr<bootstrap> make_bootstrap(const rank_identity& id, std::chrono::duration<double> timeout) {
  std::string addr = env_or("GOSSIP_MASTER_ADDR", env_or("MASTER_ADDR", "127.0.0.1"));
  // The same rule as env_or: an empty variable counts as unset.
  const auto set = [](const char* name) { const char* v = std::getenv(name); return v && *v; };
  const char* addr_from = set("GOSSIP_MASTER_ADDR") ? "GOSSIP_MASTER_ADDR" : set("MASTER_ADDR") ? "MASTER_ADDR" : "127.0.0.1";
  std::string port_from = "GOSSIP_MASTER_PORT";
  long long port = 0;
  if (const auto p = env_int("GOSSIP_MASTER_PORT")) {
    port = *p;
    if (port < 1 || port > 65535) throw config_error(fmt::format("gossip: GOSSIP_MASTER_PORT={} is not a TCP port (1..65535)", port));
  } else if (const auto m = env_int("MASTER_PORT")) {
    port = *m + 1;
    port_from = "MASTER_PORT + 1";
    if (*m < 1 || *m > 65535) throw config_error(fmt::format("gossip: MASTER_PORT={} is not a TCP port (1..65535)", *m));
    if (port > 65535)
      throw config_error(fmt::format("gossip: MASTER_PORT={} leaves no port above it for the gossip rendezvous (MASTER_PORT + 1); "
                                     "set GOSSIP_MASTER_PORT",
                                     *m));
  } else if (id.world > 1) {
    throw config_error(fmt::format("gossip: rank {} of {} ({}) has no rendezvous port: launch with torchrun (MASTER_ADDR/MASTER_PORT), "
                                   "or set GOSSIP_MASTER_PORT (and GOSSIP_MASTER_ADDR, default 127.0.0.1)",
                                   id.rank, id.world, id.source));
  }
  return std::make_shared<bootstrap>(id.rank, id.world, addr, static_cast<std::uint16_t>(port), timeout,
                                     fmt::format("{}:{}", addr_from, port_from));
}

// A string as a TOML basic string (also a quoted key: any key parses, and is
// then checked against the component's settings by name).
std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\')
      out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    else
      out += c;
  }
  return out + "\"";
}

// A str of a config dict (a section name, a key, a value) as UTF-8: a lone
// surrogate cannot be encoded, and a NUL would cut the messages that quote it.
// str(h) as UTF-8, or nothing when it cannot be encoded.
std::optional<std::string> utf8_text(const py::handle& h) {
  try {
    return py::str(h).cast<std::string>();
  } catch (const py::error_already_set&) {
  } catch (const py::cast_error&) {
  }
  return std::nullopt;
}

std::string dict_text(const py::handle& h, const std::string& what) {
  const auto text = utf8_text(h);
  if (!text) throw config_error(fmt::format("config dict: {} is not text that UTF-8 can encode (a lone surrogate?)", what));
  if (text->find('\0') != std::string::npos) throw config_error(fmt::format("config dict: {} holds a NUL character", what));
  return *text;
}

// A Python value as TOML (for a config given as a dict).
std::string toml_value(const py::handle& v, const std::string& where, int depth = 0) {
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? "true" : "false";
  if (py::isinstance<py::int_>(v)) {
    try {
      return std::to_string(v.cast<long long>());
    } catch (const py::cast_error&) {
      throw config_error(fmt::format("config dict: {} = {} does not fit a 64-bit integer", where, py_str(v)));
    }
  }
  if (py::isinstance<py::float_>(v)) {
    const double d = v.cast<double>();
    if (!std::isfinite(d)) return std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf");
    std::string s = fmt::format("{}", d);
    if (s.find_first_of(".e") == std::string::npos) s += ".0";
    return s;
  }
  if (py::isinstance<py::str>(v)) return toml_string(dict_text(v, where));
  // Numbers of other types (numpy's int64 and float32, a 0-d tensor): as the
  // Python int or float they stand for.
  for (const char* as : {"__index__", "__float__"})
    if (py::hasattr(v, as) && !py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v)) {
      py::object plain;
      try {
        plain = std::string_view(as) == "__index__" ? py::module_::import("operator").attr("index")(v) : py::module_::import("builtins").attr("float")(v);
      } catch (const py::error_already_set&) {
        continue;  // e.g. a tensor of more than one value
      }
      return toml_value(plain, where, depth);
    }
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    // No setting takes more than a list of pairs (topology edges).
    if (depth >= 2)
      throw config_error(fmt::format("config dict: {} holds lists nested more than two deep; values are bool, int, float, str or a list "
                                     "of them (a list of pairs for topology edges)",
                                     where));
    std::string out = "[";
    for (const auto& x : v) out += (out.size() > 1 ? ", " : "") + toml_value(x, where, depth + 1);
    return out + "]";
  }
  throw config_error(fmt::format("config dict: {} is a {}; values are bool, int, float, str or a list of them", where,
                                 py_str(py::type::of(v).attr("__name__"))));
}

config config_from(const py::handle& cfg, const std::vector<std::string>& app_sections) {
  if (cfg.is_none()) return config::from_env(app_sections);  // gossip-run --config sets GOSSIP_CONFIG
  if (py::isinstance<py::dict>(cfg)) {
    std::string text;
    for (const auto& [section, body] : cfg.cast<py::dict>()) {
      const std::string name = dict_text(section, "a section name");
      if (!py::isinstance<py::dict>(body))
        throw config_error(fmt::format("config dict: ['{}'] must be a dict of settings (a section), got a {}", name,
                                       py_str(py::type::of(body).attr("__name__"))));
      text += fmt::format("[{}]\n", toml_string(name));
      for (const auto& [key, value] : body.cast<py::dict>()) {
        const std::string k = dict_text(key, fmt::format("a key of ['{}']", name));
        text += fmt::format("{} = {}\n", toml_string(k), toml_value(value, fmt::format("['{}']['{}']", name, k)));
      }
    }
    return config::parse(text, "config dict", app_sections);
  }
  // A path: str, bytes or os.PathLike.
  if (!py::isinstance<py::str>(cfg) && !py::isinstance<py::bytes>(cfg) && !py::hasattr(cfg, "__fspath__"))
    throw py::type_error(fmt::format("config= takes the path of a TOML file (str or os.PathLike) or a dict of sections, got a {}{}",
                                     py_str(py::type::of(cfg).attr("__name__")),
                                     py::hasattr(cfg, "items") ? " (a mapping that is not a dict: pass dict(config))" : ""));
  const auto os = py::module_::import("os");
  return config::load(os.attr("fsdecode")(cfg).cast<std::string>(), app_sections);
}

struct registered_tensor {
  std::string name;
  py::object tensor;     // the registered tensor
  py::object storage;    // an alias of its memory (detach()): kept alive if .data is replaced while a step runs
  py::object data_ptr;   // its bound data_ptr method (a reassigned .data shows up here)
  std::uintptr_t address = 0;
  py::object numel;      // its bound numel method (resize_ to fewer values keeps data_ptr)
  std::size_t count = 0;
  py::object momentum;   // the optimizer's momentum buffer, or None
  py::object optimizer;  // its optimizer: optimizer.state[param] is looked up again at each step
  std::uintptr_t momentum_address = 0;
};

std::uintptr_t address_of(const py::handle& data_ptr) { return data_ptr().cast<std::uintptr_t>(); }

// Where a tensor lives: torch's device type and index (-1: none, as for "cpu").
struct tensor_place {
  std::string type = "cpu";
  int index = -1;
  bool operator==(const tensor_place&) const = default;
  std::string str() const { return index < 0 ? type : fmt::format("{}:{}", type, index); }
};

// Checks that `t` is a contiguous float32 tensor on the CPU (or, in a CUDA
// build, on a CUDA device) and returns its element count and device.
std::pair<std::size_t, tensor_place> check_tensor(const std::string& what, const py::handle& t) {
  for (const char* attr : {"data_ptr", "is_contiguous", "dtype", "device", "numel"})
    if (!py::hasattr(t, attr))
      throw py::type_error(fmt::format("gossip.Engine: {} is a {}, not a torch tensor (no .{})", what,
                                       py_str(py::type::of(t).attr("__name__")), attr));
  // A parameter whose shape is not known yet (torch.nn.Lazy* modules) has no storage to point at.
  if (const auto torch_nn = py::module_::import("torch.nn.parameter");
      py::hasattr(torch_nn, "UninitializedParameter") && py::isinstance(t, torch_nn.attr("UninitializedParameter")))
    throw py::value_error(fmt::format("gossip.Engine: {} is not initialized yet (a lazy module's); run one forward pass before "
                                      "building the engine",
                                      what));
  if (py::hasattr(t, "layout") && py_str(t.attr("layout")) != "torch.strided")
    throw py::type_error(fmt::format("gossip.Engine: {} has layout {}; the engine exchanges dense tensors (torch.strided: e.g. "
                                     "t.to_dense())",
                                     what, py_str(t.attr("layout"))));
  const std::string dtype = py_str(t.attr("dtype"));
  if (dtype != "torch.float32")
    throw py::type_error(fmt::format("gossip.Engine: {} is {}; the engine exchanges torch.float32 tensors (convert the model with "
                                     "model.float())",
                                     what, dtype));
  const py::object device = t.attr("device");
  tensor_place place{py_str(device.attr("type")), -1};
  if (!device.attr("index").is_none()) place.index = device.attr("index").cast<int>();
#if defined(GOSSIP_PYTHON_CUDA)
  if (place.type != "cpu" && place.type != "cuda")
    throw py::value_error(fmt::format("gossip.Engine: {} is on device '{}'; this module takes CPU or CUDA tensors (move the model "
                                      "with model.cpu() or model.cuda())",
                                      what, place.str()));
#else
  if (place.type != "cpu")
    throw py::value_error(fmt::format("gossip.Engine: {} is on device '{}'; this build of the module takes CPU tensors (move the model "
                                      "with model.cpu(), or rebuild libgossip with nvcc on PATH for CUDA tensors)",
                                      what, place.str()));
#endif
  if (!t.attr("is_contiguous")().cast<bool>())
    throw py::value_error(fmt::format("gossip.Engine: {} is not contiguous; the engine reads a tensor's storage as one block (make it "
                                      "contiguous before registering, e.g. p.data = p.data.contiguous())",
                                      what));
  return {t.attr("numel")().cast<std::size_t>(), place};
}

// The heavy-ball settings of an SGD optimizer's group, or an error naming it.
double group_momentum(const py::handle& optimizer, const py::handle& group, std::size_t index) {
  const auto type = py_str(py::type::of(optimizer).attr("__name__"));
  if (!group.contains("momentum"))
    throw py::value_error(fmt::format("gossip.Engine: optimizer= takes torch.optim.SGD (heavy-ball momentum buffers); a {} has none. "
                                      "Leave optimizer= out: its state stays local",
                                      type));
  const double m = group["momentum"].cast<double>();
  if (m > 0 && group.contains("nesterov") && group["nesterov"].cast<bool>())
    throw py::value_error(fmt::format("gossip.Engine: optimizer param_groups[{}] uses nesterov=True; quasi-global momentum is heavy-ball "
                                      "(v = m*v + g; p -= lr*v): use nesterov=False, or leave optimizer= out",
                                      index));
  if (m > 0 && group.contains("dampening") && group["dampening"].cast<double>() != 0)
    throw py::value_error(fmt::format("gossip.Engine: optimizer param_groups[{}] has dampening={}; quasi-global momentum needs "
                                      "dampening=0, or leave optimizer= out",
                                      index, group["dampening"].cast<double>()));
  return m;
}

// A config written for N workers ([train] workers) must run on N ranks.
void check_world(const config& cfg, const rank_identity& id) {
  const auto it = cfg.sections.find("train");
  if (it == cfg.sections.end() || !it->second.has("workers")) return;
  const auto& v = it->second.values().at("workers");
  if (!std::holds_alternative<std::int64_t>(v))
    throw config_error(fmt::format("{}: key 'workers' must be an integer", it->second.where("workers")));
  const auto workers = std::get<std::int64_t>(v);
  if (workers != id.world)
    throw config_error(fmt::format("{}: workers = {} but the world has {} ranks ({}, this is rank {}); start as many processes as "
                                   "workers (torchrun --nproc_per_node {}) or change workers",
                                   it->second.where("workers"), workers, id.world, id.source, id.rank, workers));
}

/// The [transport] checks that need no peer: loopback only for a world of
/// one, otherwise UCX (the default here), which takes no keys.
// [transport] left at its default (loopback, no settings) means UCX between
// processes: say so in the config, so that every check and message names it.
void default_to_ucx(config& cfg, const rank_identity& id) {
  if (id.world > 1 && cfg.transport.name == "loopback" && cfg.transport.opts.values().empty()) cfg.transport.name = "ucx";
}

void check_transport(const config& cfg, const rank_identity& id) {
  const auto& t = cfg.transport;
  // [transport] left at its default (loopback, no settings) means UCX here: ranks are processes.
  const bool default_transport = t.name == "loopback" && t.opts.values().empty();
  if (t.name == "loopback" && !default_transport && id.world > 1)
    throw config_error(fmt::format("{}: transport 'loopback' connects threads of one process, but this is rank {} of {} processes; "
                                   "use name = \"ucx\" or leave [transport] out",
                                   t.opts.where(), id.rank, id.world));
  if (t.name == "loopback") {
    (void)link_emulation::from(t);  // keys and ranges
    return;
  }
  if (t.name != "ucx")  // (engine_spec::from refuses keys for UCX)
    throw config_error(fmt::format("{}: transport '{}' is not available from Python; use \"ucx\" (the default here)", t.opts.where(), t.name));
}

}  // namespace

class py_engine {
 public:
  py_engine(const py::iterable& named_parameters, const py::object& cfg_arg, const py::object& optimizer,
            const std::vector<std::string>& app_sections) {
    config cfg = config_from(cfg_arg, app_sections);
    model_view view;
    py::iterable items = named_parameters;
    if (py::isinstance<py::dict>(named_parameters) || py::hasattr(named_parameters, "items"))
      items = named_parameters.attr("items")();
    for (const auto& item : items) {
      if (!py::isinstance<py::tuple>(item) || py::len(item) != 2)
        throw py::type_error("gossip.Engine: expected (name, tensor) pairs, as model.named_parameters() yields");
      const auto pair = item.cast<py::tuple>();
      registered_tensor r;
      const auto name = utf8_text(pair[0]);
      if (!name)
        throw py::value_error(fmt::format("gossip.Engine: parameter {} has a name that UTF-8 cannot encode (a lone surrogate?); give it "
                                          "a name of plain text",
                                          py::repr(pair[0]).cast<std::string>()));
      r.name = *name;
      r.tensor = pair[1];
      const auto [n, place] = check_tensor(fmt::format("parameter '{}'", r.name), r.tensor);
      r.storage = r.tensor.attr("detach")();
      if (m_tensors.empty()) {
        m_place = place;
      } else if (place != m_place) {
        throw py::value_error(fmt::format("gossip.Engine: parameter '{}' is on device '{}' but parameter '{}' is on '{}'; the engine "
                                          "exchanges one model, kept on one device (move the whole model with model.to(device))",
                                          r.name, place.str(), m_tensors.front().name, m_place.str()));
      }
      r.data_ptr = r.tensor.attr("data_ptr");
      r.address = address_of(r.data_ptr);
      r.numel = r.tensor.attr("numel");
      r.count = n;
      view.add(r.name, {reinterpret_cast<float*>(r.address), n}, on_cuda() ? memory_kind::cuda : memory_kind::host);
      // A weight (dim >= 2) is a matrix of size(0) rows, for codecs that factor them (lowrank).
      if (r.tensor.attr("dim")().cast<int>() >= 2 && n > 0) {
        const auto rows = r.tensor.attr("size")(0).cast<std::size_t>();
        view.matrix(r.name, rows, n / rows);
      }
      m_tensors.push_back(std::move(r));
    }
    if (m_tensors.empty()) throw py::value_error("gossip.Engine: no parameters were given (model.named_parameters() was empty or consumed)");
    if (on_cuda()) attach_cuda(view);

    if (!optimizer.is_none()) register_momentum(optimizer, cfg, view);

    const rank_identity id = identity();
    m_rank = id.rank;
    m_world = id.world;
    check_world(cfg, id);
    default_to_ucx(cfg, id);
    engine_spec spec = engine_spec::from(cfg);
    m_timeout = spec.settings.timeout;
    waiting_call unlocked;  // the rendezvous and connecting wait for peers
    try {
      any_transport transport = make_transport(cfg, id, spec.settings.timeout);
      m_engine = std::make_unique<engine>(view, id.rank, id.world, std::move(spec), std::move(transport));
    } catch (...) {
      // Left a mark in rank 0's store, so that this rank's next Engine does not take it for its own.
      if (m_boot && m_rank != 0) {
        try {
          m_boot->pass(finish_barrier);
        } catch (const std::exception&) {
        }
      }
      throw;
    }
    {
      py::gil_scoped_acquire held;
      for (auto& [state, buf] : m_new_buffers) state["momentum_buffer"] = buf;
      m_new_buffers.clear();
    }
    // [engine] momentum = auto keeps the buffers local over UCX: lr is then optional.
    m_has_momentum = m_has_momentum && m_engine->stats().momentum == "quasi-global";
    // Local momentum: the engine never touches the buffers, so the optimizer
    // may replace them (a checkpoint's load_state_dict) as it likes.
    if (!m_has_momentum)
      for (auto& t : m_tensors) t.momentum_address = 0;
  }

  py_engine(const py_engine&) = delete;
  py_engine& operator=(const py_engine&) = delete;

  ~py_engine() {
    // In a process forked from the one that built it (os.fork(), a fork
    // DataLoader worker that exits normally), the engine's transport is the
    // parent's: tearing it down here would close the parent's connections.
    // The child leaves it as it is.
    if (forked()) {
      (void)m_engine.release();
      (void)new std::shared_ptr<bootstrap>(std::move(m_boot));
      return;
    }
    py::gil_scoped_release unlocked;  // leaving the fabric may wait (bounded) on peers
    release(false);
  }

  // A `with` block left by an exception: the engine leaves its peers now
  // (they count this rank as failed) and frees the rendezvous, so that a
  // retry can build a new Engine; stats() and the properties still answer.
  void abandon() {
    if (!m_engine || m_finished || forked()) return;
    m_closing = true;  // a step() that starts now is refused
    py::gil_scoped_release unlocked;
    // Another thread may be inside step() or finish() (a worker that trains
    // while this one left its `with` block by an exception): the engine goes
    // once that call has returned, which its own waits bound.
    const auto deadline = std::chrono::steady_clock::now() + 2 * std::chrono::duration_cast<std::chrono::steady_clock::duration>(m_timeout) +
                          std::chrono::seconds(1);
    while (m_busy.exchange(true)) {
      if (std::chrono::steady_clock::now() > deadline)
        throw error(fmt::format("gossip.Engine: the `with` block ended by an exception, but another thread is still inside the engine "
                                "after {:.0f} s; the engine was not released",
                                std::chrono::duration<double>(2 * m_timeout).count() + 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    m_busy_owner = std::this_thread::get_id();
    release(true);
    m_dropped = true;
    m_busy_owner = std::thread::id{};
    m_busy = false;
  }

  // __exit__ without an exception: finish(), and if that fails (a peer that
  // never drained), leave as an exception would, so that a retry can build a
  // new Engine; the error goes on.
  void exit_normally() {
    try {
      finish(-2);
    } catch (...) {
      abandon();
      throw;
    }
  }

  step_result step(double lr, double loss) {
    (void)running("step");
    if (!(lr >= 0) || !std::isfinite(lr))
      throw py::value_error(fmt::format("gossip.Engine.step: lr={}; pass the learning rate the optimizer used at this step (finite, "
                                        ">= 0; 0 or leaving it out: not known)",
                                        lr));
    if (m_has_momentum && !(lr > 0))
      throw py::value_error(fmt::format("gossip.Engine.step: lr={} but the engine keeps quasi-global momentum, which needs the step's "
                                        "learning rate (> 0): pass lr=",
                                        lr));
    // One lr rebuilds every buffer: a group that steps with another would get its momentum scaled by the ratio.
    // A scheduler stepped between optimizer.step() and this call has moved the group to the next step's lr
    // already: the lr the group had when the last step() returned is the one the optimizer just used.
    if (m_has_momentum) {
      const auto differs = [](double a, double b) { return !(std::abs(a - b) <= 1e-9 * std::abs(b)); };
      for (std::size_t g = 0; g < m_momentum_groups.size(); ++g) {
        const auto& [index, group] = m_momentum_groups[g];
        const double group_lr = group["lr"].cast<double>(), before = m_group_lr[g];
        if (differs(group_lr, lr) && differs(before, lr))
          throw py::value_error(fmt::format(
              "gossip.Engine.step: lr={} but optimizer param_groups[{}] has lr={} (and had lr={} when the last step() returned or the "
              "engine was built); pass the lr the optimizer used at this step (read before a scheduler's step()): quasi-global momentum "
              "rebuilds every buffer with it{}; or set [engine] momentum = \"local\"",
              lr, index, group_lr, before, m_momentum_groups.size() > 1 ? ", so the groups with momentum need one lr" : ""));
        // The buffers are rebuilt with the β the engine was built with; a scheduler that moves the
        // group's momentum (OneCycleLR and CyclicLR do by default) would train with another one.
        const double group_m = group["momentum"].cast<double>(), m_before = m_group_momentum[g];
        if (differs(group_m, m_beta) && differs(m_before, m_beta))
          throw py::value_error(fmt::format(
              "gossip.Engine.step: optimizer param_groups[{}] has momentum={} (and had momentum={} when the last step() returned) but "
              "the engine rebuilds the momentum buffers with the momentum it was built with, {}; a scheduler that changes momentum "
              "(OneCycleLR and CyclicLR do, unless cycle_momentum=False) needs [engine] momentum = \"local\"",
              index, group_m, m_before, m_beta));
      }
    }
    check_storage();
    busy_guard guard(m_busy, m_busy_owner, "step");
    engine& held = running("step");  // again, now that no other thread can release it
    step_result r;
    {
      waiting_call unlocked;  // max_lead, busy send buffers, the receive backlog
      r = held.step({.lr = lr, .loss = loss});
    }
    for (std::size_t g = 0; g < m_momentum_groups.size(); ++g) {
      m_group_lr[g] = m_momentum_groups[g].second["lr"].cast<double>();
      m_group_momentum[g] = m_momentum_groups[g].second["momentum"].cast<double>();
    }
    return r;
  }

  std::size_t poll() {
    (void)running("poll");
    check_storage();
    busy_guard guard(m_busy, m_busy_owner, "poll");
    engine& e = running("poll");  // again, now that no other thread can release it
    waiting_call unlocked;
    return e.poll();
  }

  void finish(int rounds) {
    if (!m_engine || m_finished) return;  // idempotent: a model moved or reloaded after finish() is no longer ours to check
    (void)live("finish");  // not in a forked child
    if (rounds < -2)
      throw py::value_error(fmt::format("gossip.Engine.finish: rounds={}; give rounds >= 0, -1 (automatic) or leave it out ([engine] "
                                        "finish_rounds)",
                                        rounds));
    check_storage();
    busy_guard guard(m_busy, m_busy_owner, "finish");
    if (!m_engine || m_finished || m_dropped) return;  // another thread finished or released it meanwhile
    std::string gone;
    {
      waiting_call unlocked;  // final rounds, the drain handshake, the finish barrier
      m_engine->finish(rounds);
      // Rank 0 serves the rendezvous: it stays until every rank is through.
      // Not waiting for a rank that died: a peer of it that got through says so.
      // Rank 0 found dead (it dropped its Engine, or its process died) serves no
      // rendezvous any more: nobody is left to wait for, or to wait on. Nor
      // when rank 0 turns out to have exited meanwhile (its own finish() timed
      // out): this rank's engine has finished, and only the barrier is left.
      const auto& dead = m_engine->stats().dead_peers;
      if (m_boot && !m_finished && std::find(dead.begin(), dead.end(), 0) == dead.end()) {
        try {
          m_boot->barrier(finish_barrier, dead);
        } catch (const gossip::rendezvous_gone& e) {
          gone = e.what();
        }
      }
    }
    m_finished = true;
    if (!gone.empty()) {
      const std::string text = fmt::format(
          "gossip.Engine.finish (rank {}): this rank has finished, but rank 0 exited before every rank was through, so the others "
          "are not waited for ({})",
          m_rank, gone);
      if (PyErr_WarnEx(PyExc_RuntimeWarning, text.c_str(), 1) != 0) {
        release(true);
        throw py::error_already_set();
      }
    }
    // Every rank is through: nothing needs the rendezvous (rank 0's port) any
    // more, and a next Engine may be built while this one is still referenced.
    release(true);
  }

  // After finish() (or a `with` left by an exception) the engine is gone:
  // stats() and the properties answer with its last counters.
  py::object stats() {
    std::string json;
    {
      busy_guard guard(m_busy, m_busy_owner, "stats");  // step() runs without the GIL: another thread may be inside it
      json = m_final ? m_final->stats_json : live("stats").stats().to_json(-1);
    }  // not held while json.loads runs Python code, which may hand the GIL to a thread about to step()
    return py::module_::import("json").attr("loads")(json);
  }

  double weight() {
    busy_guard guard(m_busy, m_busy_owner, "weight");
    if (m_final) return m_final->weight;
    return live("weight").weight();
  }
  std::uint64_t steps() {
    busy_guard guard(m_busy, m_busy_owner, "steps");
    if (m_final) return m_final->steps;
    return live("steps").steps();
  }
  double consensus() {
    busy_guard guard(m_busy, m_busy_owner, "consensus");
    if (m_final) return m_final->consensus;
    return live("consensus").consensus();
  }
  int rank() const noexcept { return m_rank; }
  int world() const noexcept { return m_world; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& t : m_tensors) out.push_back(t.name);
    return out;
  }

 private:
  // One call at a time. The same thread found inside already is a signal
  // handler (or a callback) that Python ran during one of the engine's waits.
  struct busy_guard {
    std::atomic<bool>& flag;
    std::atomic<std::thread::id>& owner;
    busy_guard(std::atomic<bool>& f, std::atomic<std::thread::id>& o, const char* what) : flag(f), owner(o) {
      if (flag.exchange(true)) {
        if (owner.load() == std::this_thread::get_id())
          throw error(fmt::format("gossip.Engine.{}: called while this same thread is inside the engine: from a signal handler (or a "
                                  "callback) that Python ran during the engine's wait for its peers; set a flag there, and call the "
                                  "engine once that call has returned",
                                  what));
        throw error(fmt::format("gossip.Engine.{}: the engine is in use by another thread; call it from one thread", what));
      }
      owner = std::this_thread::get_id();
    }
    ~busy_guard() {
      owner = std::thread::id{};
      flag = false;
    }
  };

  bool forked() const noexcept { return ::getpid() != m_pid; }

  engine& live(const char* what) {
    if (forked())
      throw error(fmt::format("gossip.Engine.{}: this process was forked from the one that built the Engine (pid {}), whose engine it "
                              "is (rank {}); a process that trains as a rank of its own needs its own RANK, WORLD_SIZE and "
                              "MASTER_PORT before it builds an Engine (as a process that torchrun starts has)",
                              what, m_pid, m_rank));
    if (!m_engine) throw error(fmt::format("gossip.Engine.{}: the engine was not constructed", what));
    return *m_engine;
  }
  // step() and poll() after finish(): the engine has left its peers.
  engine& running(const char* what) {
    if (m_dropped || m_closing)
      throw error(fmt::format("gossip.Engine.{}: the engine left its peers when its `with` block ended by an exception (build a new Engine)",
                              what));
    if (m_finished) throw error(fmt::format("gossip.Engine.{}: finish() was called; this rank has left its peers (build a new Engine)", what));
    return live(what);
  }

  // Destroys the engine (leaving the fabric; `keep`: its last counters kept
  // for stats() and the properties) and frees the rendezvous. Without
  // finish(), the peers count this rank as failed at once (its transport
  // said so), and it passes the finish barrier so that theirs does not wait
  // for it. Called without the GIL.
  void release(bool keep) {
    if (m_engine && keep) {
      const auto s = m_engine->stats();
      m_final = final_state{s.to_json(-1), m_engine->weight(), m_engine->steps(), m_engine->consensus()};
    }
    m_engine.reset();
    if (m_boot && !m_finished && m_rank != 0) {
      try {
        m_boot->pass(finish_barrier);
      } catch (const transport_error&) {
        // rank 0 is gone already: nobody is left to wait
      } catch (const std::exception& e) {
        // Rank 0 is there but refused the mark (its store is full): its
        // finish barrier waits for this rank until its timeout. Said, as
        // this runs where nothing may be thrown.
        std::fprintf(stderr, "gossip.Engine (rank %d): could not tell rank 0 that this rank left, so its finish waits for it until it "
                     "times out: %s\n", m_rank, e.what());
      }
    }
    m_boot.reset();
    m_rendezvous_count.release();
  }

  // A parameter whose storage moved (p.data = …, resize_, a reloaded state
  // dict) would leave the engine writing freed memory, and one resized in
  // place (resize_ to fewer values keeps data_ptr) past its values: refuse,
  // naming it.
  void check_storage() {
    for (const auto& t : m_tensors) {
      const auto now = address_of(t.data_ptr);
      if (now != t.address)
        throw error(fmt::format("gossip.Engine: the storage of parameter '{}' was reallocated after registration (data_ptr "
                                             "{:#x}, registered {:#x}); update parameters in place (optimizer.step(), p.data.copy_(…)) "
                                             "or build a new Engine",
                                             t.name, now, t.address));
      if (const auto n = t.numel().cast<std::size_t>(); n != t.count)
        throw error(fmt::format("gossip.Engine: parameter '{}' was resized after registration ({} values, registered {}); "
                                "the engine exchanges the shapes it was built with: build a new Engine for the new shapes",
                                t.name, n, t.count));
      if (t.momentum_address) {
        // optimizer.state is looked up afresh: load_state_dict replaces it, entries and all.
        const py::object entry = t.optimizer.attr("state").attr("get")(t.tensor);
        const py::object buf = entry.is_none() ? py::object(py::none()) : entry.attr("get")("momentum_buffer");
        const std::uintptr_t m = buf.is_none() ? 0 : address_of(buf.attr("data_ptr"));
        if (m != t.momentum_address)
          throw error(fmt::format("gossip.Engine: the optimizer's momentum buffer of parameter '{}' was replaced after "
                                               "registration (optimizer.load_state_dict or a new optimizer?); build a new Engine "
                                               "with optimizer= after that",
                                               t.name));
      }
    }
  }

  // torch.optim.SGD creates momentum_buffer at its first step; creating it
  // now as zeros gives the same first step (m·0 + g) and a stable address.
  void register_momentum(const py::object& optimizer, config& cfg, model_view& view) {
    if (!py::hasattr(optimizer, "param_groups") || !py::hasattr(optimizer, "state"))
      throw py::type_error(fmt::format("gossip.Engine: optimizer= must be a torch.optim optimizer (param_groups, state), got a {}",
                                       py_str(py::type::of(optimizer).attr("__name__"))));
    // RMSprop has a "momentum" too, and a momentum_buffer it did not create
    // would skip its own set-up (KeyError: 'square_avg' at its first step).
    if (!py::isinstance(optimizer, py::module_::import("torch.optim").attr("SGD")))
      throw py::value_error(fmt::format("gossip.Engine: optimizer= takes torch.optim.SGD (heavy-ball momentum buffers), got a {}. "
                                        "Leave optimizer= out: its state stays local",
                                        py_str(py::type::of(optimizer).attr("__name__"))));
    const auto engine_opts = cfg.engine.resolved(engine_option_specs(), "[engine]");
    if (engine_opts.string("momentum") == "local") return;
    py::dict group_of;  // param → its group's momentum
    std::optional<double> beta;
    std::size_t gi = 0;
    py::set registered;
    for (const auto& t : m_tensors) registered.add(t.tensor);
    for (const auto& group : optimizer.attr("param_groups")) {
      const double m = group_momentum(optimizer, group, gi);
      // Only groups that step registered tensors: the engine rebuilds no other buffers, so their lr and momentum are theirs alone.
      bool ours = false;
      for (const auto& p : group["params"]) ours = ours || registered.contains(p);
      if (m > 0 && ours) {
        m_momentum_groups.emplace_back(gi, py::reinterpret_borrow<py::object>(group));
        m_group_lr.push_back(py::reinterpret_borrow<py::object>(group)["lr"].cast<double>());
        m_group_momentum.push_back(m);
        if (beta && *beta != m)
          throw py::value_error(fmt::format("gossip.Engine: optimizer param groups use momentum {} and {}; quasi-global momentum takes one "
                                            "β for all: use one momentum, or set [engine] momentum = \"local\"",
                                            *beta, m));
        beta = m;
      }
      for (const auto& p : group["params"]) group_of[p] = m;
      ++gi;
    }
    // optimizer= asks for its buffers: an optimizer that steps none of the registered tensors is another model's.
    if (std::none_of(m_tensors.begin(), m_tensors.end(), [&](const auto& t) { return group_of.contains(t.tensor); }))
      throw py::value_error(
          "gossip.Engine: optimizer= steps none of the registered tensors (an optimizer of another model, or tensors that are not its "
          "parameter objects, e.g. a state_dict's); register model.named_parameters() with that model's optimizer, or leave optimizer= out");
    if (!beta) return;  // plain SGD: no buffers
    m_beta = *beta;
    try {
      cfg.follow_momentum(*beta, "the optimizer's momentum");
    } catch (const config_error& e) {
      throw py::value_error(fmt::format("gossip.Engine: {}", e.what()));
    }
    const py::object state = optimizer.attr("state");
    for (auto& t : m_tensors) {
      if (!group_of.contains(t.tensor) || group_of[t.tensor].cast<double>() <= 0) continue;
      py::object s = state.attr("__getitem__")(t.tensor);  // state is a defaultdict(dict)
      py::object buf = s.attr("get")("momentum_buffer");
      if (buf.is_none()) {  // given to the optimizer once the engine is built: a failed Engine() leaves it as it was
        buf = t.tensor.attr("detach")().attr("new_zeros")(t.tensor.attr("shape"));
        m_new_buffers.emplace_back(s, buf);
      }
      const auto [n, place] = check_tensor(fmt::format("the momentum buffer of parameter '{}'", t.name), buf);
      if (place != m_place)
        throw py::value_error(fmt::format("gossip.Engine: the momentum buffer of parameter '{}' is on device '{}' but the parameter is on "
                                          "'{}'; move the model before building the optimizer",
                                          t.name, place.str(), m_place.str()));
      t.momentum = buf;
      t.optimizer = optimizer;
      t.momentum_address = address_of(buf.attr("data_ptr"));
      view.momentum(t.name, {reinterpret_cast<float*>(t.momentum_address), n});
      m_has_momentum = true;
    }
  }

  any_transport make_transport(const config& cfg, const rank_identity& id, std::chrono::duration<double> timeout) {
    check_transport(cfg, id);
    if (cfg.transport.name == "loopback" && id.world == 1) {
      m_fabric.emplace(1);
      return m_fabric->endpoint(0);
    }
#if defined(GOSSIP_HAVE_UCX)
    // One Engine over the network per process at a time: a second one would
    // listen on rank 0's port again, or publish under the first one's keys.
    if (!m_rendezvous_count.reserve())
      throw config_error(fmt::format("gossip.Engine (rank {}): another Engine of this process has not finished and still holds the "
                                     "rendezvous; finish() it (or drop it: `del eng`) before building a new one",
                                     id.rank));
    m_boot = fresh_rendezvous(id, timeout);
    had_engine = true;
    return ucx_transport(m_boot);
#else
    (void)timeout;
    throw config_error(fmt::format("gossip: rank {} of {} needs the UCX transport, which this build of the module lacks (rebuild with "
                                   "libucx-dev installed)",
                                   id.rank, id.world));
#endif
  }

  bool on_cuda() const { return m_place.type == "cuda"; }

  // A model on a CUDA device: the engine's drift, snapshot and merge passes
  // run there, ordered on the stream torch has current for that device now
  // (the one the training loop's optimizer.step() runs on, unless it selects
  // another). The backend is given the device by number and keeps it for
  // every call, from any thread.
  void attach_cuda(model_view& view) {
#if defined(GOSSIP_PYTHON_CUDA)
    const py::object torch_cuda = py::module_::import("torch").attr("cuda");
    const int index = m_place.index >= 0 ? m_place.index : torch_cuda.attr("current_device")().cast<int>();
    const py::object stream = torch_cuda.attr("current_stream")(index);
    m_stream = stream;  // kept alive with the engine
    const auto handle = stream.attr("cuda_stream").cast<std::uintptr_t>();
    view.on_device(cuda::device(reinterpret_cast<void*>(handle), {.device = index}));
#else
    (void)view;
    throw py::value_error("gossip.Engine: CUDA tensors need a build of the module with CUDA");  // check_tensor refused them already
#endif
  }

  std::vector<registered_tensor> m_tensors;
  tensor_place m_place;
  py::object m_stream;  // the torch.cuda.Stream a CUDA model's passes are ordered on
  std::optional<loopback_fabric> m_fabric;
  static constexpr const char* finish_barrier = "gossip/python/finish";
  // Engines of this process whose rendezvous is alive (at most one); counted
  // down after m_boot is gone, also when the constructor throws.
  static inline std::atomic<int> live_rendezvous{0};
  struct rendezvous_count {
    bool held = false;
    bool reserve() noexcept {
      int none = 0;
      return held = live_rendezvous.compare_exchange_strong(none, 1);
    }
    void release() noexcept {
      if (held) --live_rendezvous, held = false;
    }
    ~rendezvous_count() { release(); }
  } m_rendezvous_count;
  static inline std::atomic<bool> had_engine{false};  // this process built one over the network before
  struct final_state {
    std::string stats_json;
    double weight = 0;
    std::uint64_t steps = 0;
    double consensus = 0;
  };
  std::optional<final_state> m_final;  // after the engine is destroyed
  bool m_dropped = false;
  std::shared_ptr<bootstrap> m_boot;

  // The rendezvous of a new Engine. Rank 0's store of the previous one lives
  // until rank 0 drops that Engine: a store in which this rank has already
  // finished or left is that one, and the new keys go to rank 0's next store,
  // not there. Waits (bounded) for it to go.
  static std::shared_ptr<bootstrap> fresh_rendezvous(const rank_identity& id, std::chrono::duration<double> timeout) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
    std::string cut;  // the last connection rank 0 closed unanswered, while it was replacing its store
    for (;;) {
      auto boot = make_bootstrap(id, timeout);
      try {
        if (id.rank == 0 || (!boot->try_get(fmt::format("{}/done", finish_barrier)) &&
                             !boot->try_get(fmt::format("{}/arrive/{}", finish_barrier, id.rank))))
          return boot;
      } catch (const rendezvous_replaced&) {
        // Rank 0 replaced the store between the two looks: the next client joins the new one.
      } catch (const timeout_error&) {
        throw;
      } catch (const transport_error& e) {
        // Rank 0 closing the previous Engine's store resets the connections
        // it has not served yet: after an Engine of its own, this rank asks
        // the next store. (Before one, a port that closes unanswered is not
        // a gossip rendezvous, which the error says at once.)
        if (!had_engine) throw;
        cut = e.what();
      }
      if (std::chrono::steady_clock::now() >= deadline)
        throw timeout_error(
            had_engine ? fmt::format("gossip.Engine (rank {}): rank 0's rendezvous at {} still serves the previous Engine, which this rank "
                                     "has left, after {:.1f} s; rank 0 must finish or drop it and build its new Engine too{}",
                                     id.rank, boot->where(), timeout.count(), cut.empty() ? "" : fmt::format(" (last: {})", cut))
                       : fmt::format("gossip.Engine (rank {}): the rendezvous at {} serves a job in which this rank has finished or left "
                                     "(another job, or an earlier run's rank 0 still running, on that port); after {:.1f} s it still "
                                     "does: check GOSSIP_MASTER_PORT / MASTER_PORT",
                                     id.rank, boot->where(), timeout.count()));
      detail::check_interrupt();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  std::unique_ptr<engine> m_engine;  // destroyed before the tensors it points at
  std::atomic<bool> m_busy{false};
  pid_t m_pid = ::getpid();  // the process that built the engine
  std::atomic<std::thread::id> m_busy_owner{};
  std::atomic<bool> m_closing{false};  // abandon() has begun: no new step()
  std::chrono::duration<double> m_timeout{60.0};
  std::vector<std::pair<py::object, py::object>> m_new_buffers;  // (optimizer state entry, buffer) until the engine is built
  std::vector<std::pair<std::size_t, py::object>> m_momentum_groups;  // (index, group) of the optimizer's groups with momentum
  std::vector<double> m_group_lr;  // each such group's lr when the last step() returned, or when the engine was built
  std::vector<double> m_group_momentum;  // and its momentum
  double m_beta = 0;                     // the momentum the engine rebuilds the buffers with
  bool m_has_momentum = false, m_finished = false;
  int m_rank = 0, m_world = 1;
};

// Engine.__new__(Engine) without __init__ leaves a Python object whose
// py_engine was never constructed (pybind11 hands such a method raw memory
// for self): every method and property checks that it was, first.
py_engine& constructed(py::handle self) {
  if (!py::isinstance<py_engine>(self))
    throw py::type_error(fmt::format("gossip.Engine: a method was called on a {}, not on a gossip.Engine",
                                     py::str(py::type::handle_of(self).attr("__name__")).cast<std::string>()));
  auto* inst = reinterpret_cast<py::detail::instance*>(self.ptr());
  auto vh = inst->get_value_and_holder(py::detail::get_type_info(typeid(py_engine)));
  if (!vh.holder_constructed())
    throw py::type_error("gossip.Engine: this object was made by Engine.__new__ without __init__ and holds no engine; construct it "
                         "with gossip.Engine(named_parameters, config=..., optimizer=...)");
  return *vh.value_ptr<py_engine>();
}
template <typename R, typename... A>
auto checked(R (py_engine::*f)(A...)) {
  return [f](py::handle self, A... a) -> R { return (constructed(self).*f)(std::forward<A>(a)...); };
}
template <typename R, typename... A>
auto checked(R (py_engine::*f)(A...) const noexcept) {
  return [f](py::handle self, A... a) -> R { return (constructed(self).*f)(std::forward<A>(a)...); };
}
template <typename R, typename... A>
auto checked(R (py_engine::*f)(A...) const) {
  return [f](py::handle self, A... a) -> R { return (constructed(self).*f)(std::forward<A>(a)...); };
}

// A setting's default as the Python value a config dict takes for it (not
// its TOML text: "auto", not '"auto"').
py::object default_of(const option_value& v) {
  return std::visit([](const auto& x) -> py::object { return py::cast(x); }, v);
}

template <class Registry>
py::list describe(const Registry& r) {
  py::list out;
  for (const auto& e : r.entries()) {
    py::list opts;
    for (const auto& s : e.specs) {
      py::dict o;
      o["key"] = s.key;
      o["default"] = default_of(s.default_value);
      o["help"] = s.help;
      if (!s.env.empty()) o["env"] = s.env;
      opts.append(o);
    }
    py::dict d;
    d["name"] = e.name;
    d["help"] = e.help;
    d["options"] = opts;
    out.append(d);
  }
  return out;
}

// gossip.check_config: what gossip.Engine checks before it needs a model or peers.
void check_config(const py::object& cfg_arg, std::optional<int> world, const std::vector<std::string>& app_sections) {
  config cfg = config_from(cfg_arg, app_sections);
  rank_identity id;
  if (world) {
    if (*world < 1 || *world > 1 << 20)
      throw py::value_error(fmt::format("gossip.check_config: world = {}; give a world size in 1..{}", *world, 1 << 20));
    id = {0, *world, fmt::format("world={}", *world)};
  } else {
    try {
      id = identity();
    } catch (const config_error& e) {
      throw config_error(fmt::format("gossip.check_config: give world= (the number of ranks), or run it under torchrun: {}", e.what()));
    }
  }
  check_world(cfg, id);
  default_to_ucx(cfg, id);
  const engine_spec spec = engine_spec::from(cfg);
  check_transport(cfg, id);
  // What the engine checks against its transport: loopback for one rank, UCX between processes.
  const bool loopback = cfg.transport.name == "loopback" && id.world == 1;
  spec.settings.check_with(loopback ? "loopback" : "ucx", loopback, "gossip.check_config");
  // Given world=, every rank's paths ("out/{rank}/stats.json" names a
  // directory per rank); under torchrun each rank checks its own.
  if (world)
    for (int r = 0; r < id.world; ++r) spec.settings.check_outputs(r, id.world);
  else
    spec.settings.check_outputs(id.rank, id.world);
  // The topology against the world size, as the engine builds it (the switch builds none).
  if (cfg.transport.name != "switch") (void)topology_registry().make(spec.topology.name, spec.topology.opts, id.rank, id.world);
}

}  // namespace gossip::python

PYBIND11_MODULE(gossip, m) {
  using gossip::python::py_engine;
  namespace gp = gossip::python;
  m.doc() = "libgossip: drift-triggered gossip between training processes (one Engine per rank)";
  gp::g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

  static py::exception<gossip::error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<gossip::config_error> config_error(m, "ConfigError", error.ptr());
  // Ranks whose models differ: a setup mistake like settings that differ, so a ConfigError too.
  static py::exception<gossip::layout_error> layout_error(m, "LayoutError", config_error.ptr());
  // Also a builtin TimeoutError, so that `except TimeoutError:` catches a peer that never came.
  // (py::exception takes one base; the type is the module's for as long as the process runs.)
  static PyObject* const timeout_error =
      PyErr_NewException("gossip.TimeoutError", py::make_tuple(error, py::handle(PyExc_TimeoutError)).ptr(), nullptr);
  if (!timeout_error) throw py::error_already_set();
  m.attr("TimeoutError") = py::handle(timeout_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const gossip::config_error& e) {
      PyErr_SetString(config_error.ptr(), e.what());
    } catch (const gossip::layout_error& e) {
      PyErr_SetString(layout_error.ptr(), e.what());
    } catch (const gossip::timeout_error& e) {
      PyErr_SetString(timeout_error, e.what());
    } catch (const gossip::error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  py::class_<gossip::step_result>(m, "StepResult", "What one Engine.step did")
      .def_readonly("sent", &gossip::step_result::sent, "the policy fired and the model was posted to peers")
      .def_property_readonly("reason", [](const gossip::step_result& r) { return std::string(gossip::to_string(r.why)); })
      .def_readonly("relative_drift", &gossip::step_result::relative_drift)
      .def_readonly("merged", &gossip::step_result::merged, "messages from peers merged at this step")
      .def("__repr__", [](const gossip::step_result& r) {
        return fmt::format("StepResult(sent={}, reason='{}', relative_drift={:.4g}, merged={})", r.sent ? "True" : "False",
                           gossip::to_string(r.why), r.relative_drift, r.merged);
      });

  py::class_<py_engine>(m, "Engine", R"(One rank's gossip engine over a model's parameters.

    eng = gossip.Engine(model.named_parameters(), config="run.toml", optimizer=opt)

named_parameters: (name, tensor) pairs or a dict; contiguous float32 tensors, all
  on the CPU or (has_cuda) all on one CUDA device, used in place (no copy):
  update them in place (optimizer.step()). A CUDA model's passes run on the
  torch stream current at construction.
config: a TOML file path, a dict {section: {key: value}} in the same format, or None
  (the file in GOSSIP_CONFIG, which gossip-run --config sets, else all defaults).
optimizer: a torch.optim.SGD with momentum whose buffers may become quasi-global
  ([engine] momentum: auto, the default, keeps them local over UCX between
  processes; "quasi-global" forces it); leave it out to keep them local.
app_sections: sections of the program's own that the config file may hold; a
  [train] workers key must equal the world size.
Rank and world come from torchrun (RANK, WORLD_SIZE) or GOSSIP_RANK/GOSSIP_WORLD_SIZE;
the rendezvous is MASTER_ADDR:MASTER_PORT+1 (or GOSSIP_MASTER_ADDR/GOSSIP_MASTER_PORT).
One unfinished Engine over the network per process at a time: finish() (or drop)
the old one first. step() and poll() write the parameters in place (torch's version counter
does not see it): call them after optimizer.step(), not between forward and backward.)")
      .def(py::init<const py::iterable&, const py::object&, const py::object&, const std::vector<std::string>&>(), py::arg("named_parameters"),
           py::kw_only(), py::arg("config") = py::none(), py::arg("optimizer") = py::none(),
           py::arg("app_sections") = std::vector<std::string>{"train"})
      .def("step", gp::checked(&gp::py_engine::step), py::kw_only(), py::arg("lr") = 0.0, py::arg("loss") = std::numeric_limits<double>::quiet_NaN(),
           "After optimizer.step(): merge what peers sent, measure drift, let the policy decide, send. Releases the GIL.")
      .def("poll", gp::checked(&gp::py_engine::poll), "Merge what peers sent without deciding or sending; returns the count merged.")
      .def("finish", gp::checked(&gp::py_engine::finish), py::arg("rounds") = -2,
           "Final averaging rounds (default: [engine] finish_rounds), then leave the fabric. Idempotent.")
      .def("stats", gp::checked(&gp::py_engine::stats), "The engine's counters as a dict (the JSON report).")
      .def_property_readonly("rank", gp::checked(&gp::py_engine::rank))
      .def_property_readonly("world", gp::checked(&gp::py_engine::world))
      .def_property_readonly("weight", gp::checked(&gp::py_engine::weight), "push-sum weight: the average model is sum(w_i x_i) / sum(w_i)")
      .def_property_readonly("steps", gp::checked(&gp::py_engine::steps), "steps taken, finish()'s averaging rounds included (stats()[\"steps\"] counts the training's only)")
      .def_property_readonly("consensus", gp::checked(&gp::py_engine::consensus), "the consensus-distance estimate policies see (NaN until a model arrived)")
      .def_property_readonly("names", gp::checked(&gp::py_engine::names), "registered parameter names, in order")
      .def("__enter__", [](py::handle self) { gp::constructed(self); return self; })
      .def("__exit__", [](py::handle self, const py::object& type, const py::object&, const py::object&) {
        if (type.is_none())
          gp::constructed(self).exit_normally();
        else
          gp::constructed(self).abandon();
      });

  m.def("check_config", &gp::check_config, py::arg("config"), py::kw_only(), py::arg("world") = py::none(),
        py::arg("app_sections") = std::vector<std::string>{"train"},
        "Checks a config (a TOML path or a dict) as gossip.Engine would, without a model or peers: every component and key, the "
        "codec against the transport, [train] workers and the topology against the world (default: from the torchrun or GOSSIP_* environment). "
        "Raises gossip.ConfigError naming the file or dict key; returns None.");
  m.def("policies", [] { return gp::describe(gossip::policy_registry()); }, "Policies a config's [policy] name may choose, with their settings.");
  m.def("components", [] {
    py::dict d;
    d["policy"] = gp::describe(gossip::policy_registry());
    d["topology"] = gp::describe(gossip::topology_registry());
    d["protocol"] = gp::describe(gossip::protocol_registry());
    d["codec"] = gp::describe(gossip::codec_registry());
    py::list engine;
    for (const auto& s : gossip::engine_option_specs()) {
      py::dict o;
      o["key"] = s.key;
      o["default"] = gp::default_of(s.default_value);
      o["help"] = s.help;
      engine.append(o);
    }
    d["engine"] = engine;
    return d;
  }, "Every component a config may name ([policy], [topology], [protocol], [codec]) and the [engine] settings.");
#if defined(GOSSIP_PYTHON_CUDA)
  m.attr("has_cuda") = true;
  m.def("cuda_unavailable_reason", &gossip::cuda::unavailable_reason,
        "Empty when libgossip_cuda can use a CUDA device here; otherwise why not (for skips and messages).");
#else
  m.attr("has_cuda") = false;
  m.def("cuda_unavailable_reason", [] { return std::string("this build of the module has no CUDA (libgossip_cuda was not built)"); },
        "Empty when libgossip_cuda can use a CUDA device here; otherwise why not (for skips and messages).");
#endif
#if defined(GOSSIP_HAVE_UCX)
  m.attr("has_ucx") = true;
#else
  m.attr("has_ucx") = false;
#endif
  m.attr("__version__") = GOSSIP_VERSION;
}
