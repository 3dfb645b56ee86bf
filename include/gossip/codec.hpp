#pragma once
/// Codecs: what a message carries, once the policy has decided to send.
///
///     [codec]
///     name = "int8"      # auto (default: int8 between processes, none in-process), none, fp16, int8, topk, randomk, lowrank
///     block = 256        # int8: values per scale
///
///     [codec]
///     name = "topk"
///     ratio = 0.01       # fraction of values kept per tensor
///     values = "fp32"    # or "fp16": 2 bytes a kept value
///     step = 0           # merge step towards the lag-corrected x̂; 0: measured
///     start = "shared"   # or "model": the first message on a stream carries the model
///     drift = "auto"     # the policy's drift from: "sent" (x at the last send), "held" (the target's x̂)
///
///     [codec]
///     name = "lowrank"
///     rank = 4           # rank of each matrix's change
///     fallback = "fp16"  # for 1-D tensors and matrices too small to gain
///
/// With a codec other than "none" the engine keeps, per outgoing stream
/// (sender → target), the model x̂ the target holds of this sender, and sends
/// C(x − x̂); both sides add exactly the decoded message to their x̂, so they
/// stay bit-identical (CHOCO, Koloskova et al. 2019). What C dropped stays in
/// x − x̂ and goes out with a later message: the error-feedback residual of
/// EF21 (Richtárik et al. 2021), one per stream. Ranks that started from the
/// same model (equal fingerprints of their values when the engine was built,
/// exchanged when the transport connects) start both ends of their streams
/// with x̂ = that model, so the first message is already a compressed change
/// (`start = "shared"`, the default). Otherwise a stream's first message
/// starts x̂ from nothing: a dense codec (fp16, int8) encodes x − 0, a sparse
/// one (topk, randomk) sends the tensor in fp32 (a fraction of it would
/// leave x̂ mostly zero), as does lowrank. The receiver merges its x̂ of the sender in
/// place of the sender's model (fp16, int8), or for the codecs that leave
/// most of a change for later (topk, randomk, lowrank) a lag-corrected
/// estimate, moved towards by a step γ (`step`; see corrects_merge and the
/// engine's decode_inbound). The push-sum weight travels uncompressed in the
/// wire header.
///
/// A payload is a codec_payload header followed by one segment per tensor,
/// in layout order; each segment is a codec_segment header and its bytes,
/// padded to 8. decode_payload() checks every size and index before it reads,
/// and reports what is wrong instead of reading past the end.
///
/// lowrank (PowerSGD, Vogels et al. 2019) sends a rows × cols change M as
/// P (rows × r, orthonormal columns) and Q (cols × r) with M ≈ P·Qᵀ: one
/// power-iteration step per send, warm-started from the Q the stream sent
/// last (`state`, kept by the caller per stream). A tensor is a matrix when
/// the model view declares its shape (model_view::matrix); others, and
/// matrices whose factors would not be smaller than the fallback's bytes, use
/// the fallback codec. Both sides rebuild x̂ with the same routine
/// (lowrank_apply) from the same fp32 factors, so their x̂ stay bit-identical.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gossip/config.hpp"
#include "gossip/options.hpp"
#include "gossip/registry.hpp"

namespace gossip {

enum class codec_kind : std::uint8_t { none = 0, fp16 = 1, int8 = 2, topk = 3, randomk = 4, lowrank = 5 };
constexpr std::size_t codec_kind_count = 6;
std::string_view to_string(codec_kind k) noexcept;

/// Payload header. `magic` also tells a codec payload from a raw fp32 model.
struct codec_payload {
  static constexpr std::uint32_t magic_value = 0x43445347;  // "GSDC"
  std::uint32_t magic = magic_value;
  std::uint32_t tensors = 0;
  std::uint64_t elements = 0;
};
static_assert(sizeof(codec_payload) == 16);

/// One tensor's segment header. `kind` none: `count` values in fp32, which
/// replace x̂ (a sparse codec's first message on a stream, or a tensor below
/// min_elements). Any other kind: a change added to x̂, after setting x̂ to
/// zero when `flags` has `reset` (a dense codec's first message); a sparse
/// segment's values are fp16 rather than fp32 when `flags` has
/// `half_values`. `param`:
/// int8 block size, the number of values a sparse segment keeps, or a lowrank
/// segment's rank (its body: u32 rows, u32 cols, then P and Q, row-major fp32). `bytes`:
/// the whole segment.
struct codec_segment {
  static constexpr std::uint16_t reset = 1;
  static constexpr std::uint16_t half_values = 2;
  std::uint8_t kind = 0;
  std::uint8_t index_mode = 0;  ///< sparse: 0 bitmap, 1 gaps as LEB128 varints
  std::uint16_t flags = 0;
  std::uint32_t param = 0;
  std::uint64_t bytes = 0;
};
static_assert(sizeof(codec_segment) == 16);

struct codec_settings {
  codec_kind kind = codec_kind::none;
  std::size_t block = 256;         ///< int8: values sharing one scale
  double ratio = 0.01;             ///< topk/randomk: fraction of values kept
  bool half_values = false;        ///< topk/randomk: kept values in fp16 rather than fp32
  std::size_t min_elements = 0;    ///< tensors with fewer values are sent in fp32
  std::uint64_t seed = 1;          ///< randomk: seed of the kept positions (with rank and round)
  std::size_t rank = 4;            ///< lowrank: rank of each matrix's change
  codec_kind fallback = codec_kind::fp16;  ///< lowrank: none, fp16 or int8, for what is not a matrix worth factoring
  double step = 0;                 ///< merge step towards a sender's corrected x̂ (0: auto, see codec::corrects_merge)
  /// Streams between ranks that started from the same model (the transport
  /// compares fingerprints at connection) start x̂ from that model instead of
  /// with a message carrying it. False: every stream's first message carries
  /// the model.
  bool shared_start = true;
  /// What the policy's drift is measured from: x at the last send (`sent`),
  /// or the x̂ this rank's freshest target holds (`held`), so that what the
  /// codec has not delivered yet counts as drift. `automatic`: held for topk
  /// and randomk, sent for the others (codec::drift_from_held).
  enum class drift_reference : std::uint8_t { automatic, sent, held };
  drift_reference drift = drift_reference::automatic;
  /// The `auto` codec: int8 (with these settings) where messages cross a
  /// network between processes, none elsewhere; the engine resolves it when
  /// it sees the transport (codec::resolve).
  bool automatic = false;
};

/// One codec with its preallocated scratch. Not thread-safe; one per engine.
class codec {
 public:
  codec() = default;
  explicit codec(codec_settings s, std::string name = {});

  const codec_settings& settings() const noexcept { return m_settings; }
  const std::string& name() const noexcept { return m_name; }
  /// False for "none": the engine then ships the model exactly as without a codec.
  bool compresses() const noexcept { return m_settings.kind != codec_kind::none; }
  /// The `auto` codec (the default) before the engine resolved it.
  bool automatic() const noexcept { return m_settings.automatic; }
  /// What `auto` becomes: int8 with its settings when `network` (the engine
  /// says where: messages cross a network between processes), none
  /// otherwise. Any other codec returns itself.
  codec resolve(bool network) const;
  /// Whether each message carries the whole change but rounding (none, fp16,
  /// int8), rather than leaving most of it for later messages (topk,
  /// randomk, lowrank).
  bool sends_whole_change() const noexcept;
  /// Whether a receiver merges a lag-corrected estimate of the sender's model
  /// rather than its x̂ alone: for the codecs that do not send the whole
  /// change, and for any codec given a `step`.
  bool corrects_merge() const noexcept { return compresses() && (!sends_whole_change() || m_settings.step > 0); }
  /// Whether the policy's drift is measured from the x̂ a target holds rather
  /// than from x at the last send (codec_settings::drift; automatic: topk
  /// and randomk, whose messages carry a few percent of a change's energy).
  bool drift_from_held() const noexcept;
  /// ‖change encode() added to x̂‖² for the last tensor it encoded, or a
  /// negative value when it did not measure it (fp32, fp16 and int8 keep
  /// all of a change but their rounding: count the whole change as kept).
  double last_change_energy() const noexcept { return m_change_energy; }
  /// The kind used for a tensor of `count` values, `rows` of them when it is
  /// a matrix (0: not one): none below min_elements; lowrank's fallback for
  /// what it cannot factor with fewer bytes.
  codec_kind kind_for(std::size_t count, std::size_t rows = 0) const noexcept;
  /// Floats of per-stream state encode() keeps for such a tensor (lowrank: Q, cols × rank).
  std::size_t state_floats(std::size_t count, std::size_t rows = 0) const noexcept;
  /// Values a sparse codec keeps of `count`.
  std::size_t kept(std::size_t count) const noexcept;

  /// Most bytes encode() writes for a tensor of `count` values, segment header included.
  std::size_t segment_capacity(std::size_t count) const noexcept;
  /// Most bytes of a payload for tensors of these sizes, payload header included.
  std::size_t payload_capacity(std::span<const std::size_t> counts) const noexcept;

  /// Allocates scratch for tensors of up to `max_count` values, and matrices
  /// of up to `max_side` rows + cols (by default as many as max_count
  /// allows); the step path then allocates nothing.
  static constexpr std::size_t any_side = static_cast<std::size_t>(-1);
  void prepare(std::size_t max_count, std::size_t max_side = any_side);

  /// Encodes one tensor as a segment at `out` (8-byte aligned, segment_capacity
  /// bytes free): C(x − x̂), and x̂ += exactly what a receiver decodes. A tensor
  /// below min_elements: x in fp32, and x̂ ← x. `absolute` (a stream's first
  /// message): x̂ starts from zero for a dense codec, x in fp32 for the others.
  /// `seed` varies per stream and send (randomk positions, topk sampling,
  /// lowrank's starting directions). `rows`: as for kind_for(); `state`:
  /// state_floats() floats this stream keeps between calls (lowrank).
  /// Returns the segment's bytes.
  std::size_t encode(const float* x, float* hat, std::size_t count, std::byte* out, bool absolute, std::uint64_t seed, std::size_t rows = 0,
                     float* state = nullptr) noexcept;

 private:
  codec_settings m_settings;
  std::string m_name = "none";
  std::vector<float> m_sample;           // topk: sampled magnitudes, then the candidates'
  std::vector<std::uint32_t> m_indices;  // topk: sample blocks, then candidates; randomk: kept positions
  std::vector<double> m_factors;         // lowrank: P and Q while they are computed
  double m_change_energy = -1;

  std::size_t encode_lowrank(const float* x, float* hat, std::size_t rows, std::size_t cols, std::byte* out, std::uint64_t seed,
                             float* state) noexcept;
};

/// hat (rows × cols, row-major) += P·Qᵀ, P rows × r and Q cols × r, both
/// row-major: the one routine both ends of a lowrank stream use.
void lowrank_apply(const float* p, const float* q, std::size_t rows, std::size_t cols, std::size_t r, float* hat) noexcept;

/// What decode_payload() found wrong; ok() when nothing.
struct decode_status {
  const char* problem = nullptr;  ///< static text, null when ok
  std::size_t tensor = 0;         ///< index of the offending tensor, when it concerns one
  /// The payload is well formed but a change against an x̂ this end does not
  /// hold yet (`primed` false): it needs the stream's next full message.
  bool before_full = false;
  bool ok() const noexcept { return problem == nullptr; }
};

/// Checks and applies one payload to x̂ (tensors of `counts` values,
/// contiguous in layout order). `primed`: whether this x̂ already holds a
/// full message; a change before that is refused. Never reads outside
/// `payload`; on error x̂ may be partly updated (the message is refused).
[[nodiscard]] decode_status decode_payload(std::span<const std::byte> payload, std::span<const std::size_t> counts, float* hat,
                                           bool primed) noexcept;

/// One segment, as decode_payload() applies it (exposed for tests and the bench).
[[nodiscard]] decode_status decode_segment(std::span<const std::byte> segment, float* hat, std::size_t count, bool primed) noexcept;

using codec_registry_t = registry<codec>;
/// Codecs by config name: none, fp16, int8, topk, randomk, lowrank.
codec_registry_t& codec_registry();

/// Builds the codec a [codec] section names; an unknown name is a
/// config_error with the closest known one.
codec make_codec(const component_config& c);

}  // namespace gossip
