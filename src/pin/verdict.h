// What every parser of src/pin/ returns for the first bytes a sandbox sends on
// a flow (DESIGN §1 "Hostname pinning"): the name it presents, "not yet", or
// "cannot be judged". Also the one normalization of presented names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace egressd::pin {

using Bytes = std::span<const std::uint8_t>;

// Bytes held per flow before a decision: a ClientHello (post-quantum key
// shares make them ~1.8 KB today), an HTTP request head, the CRYPTO stream of
// QUIC Initials. Past this the flow is judged unparseable.
inline constexpr std::size_t kMaxInspect = 16384;

enum class Verdict { complete, need_more, invalid };

struct Parse {
  Verdict verdict = Verdict::need_more;
  // complete: the name presented (normalized by normalize_name), or nullopt
  // when the hello has no server_name / the request no Host.
  std::optional<std::string> name;
  // complete (TLS, QUIC): the hello carries encrypted_client_hello; `name` is
  // then the outer (public) name, which is what is judged.
  bool ech = false;
  // complete (TLS): the hello offers early data (the early_data extension,
  // TLS 1.3 0-RTT).
  bool early_data = false;
  // need_more: how many bytes of the flow are held so far.
  std::size_t buffered = 0;
  // invalid: why, in a few words ("h2c preface", "truncated ClientHello").
  // Built only from fixed text and numbers: never echoes sandbox bytes.
  std::string reason;

  static Parse complete_with(std::optional<std::string> n, bool ech = false) {
    Parse p;
    p.verdict = Verdict::complete;
    p.name = std::move(n);
    p.ech = ech;
    return p;
  }
  static Parse more(std::size_t buffered) {
    Parse p;
    p.buffered = buffered;
    return p;
  }
  static Parse invalid(std::string why) {
    Parse p;
    p.verdict = Verdict::invalid;
    p.reason = std::move(why);
    return p;
  }
};

// A host name as a sandbox presents it (SNI, Host, hosts file) in the form
// names are matched and learned in: lower-case, one trailing dot removed.
// nullopt unless it is 1-253 characters of labels of [A-Za-z0-9_-], each
// 1-63 long (no empty label, so no leading dot or ".."). Underscores are
// kept (they occur in real names); such names simply match no entry.
std::optional<std::string> normalize_name(std::string_view raw);

// Bounds-checked big-endian reader over a byte span: every read checks the
// remaining length first and fails (returns false) without moving.
class Reader {
 public:
  explicit Reader(Bytes b) : b_(b) {}
  std::size_t left() const { return b_.size() - pos_; }
  std::size_t pos() const { return pos_; }
  bool empty() const { return left() == 0; }
  bool u8(std::uint8_t& v) {
    if (left() < 1) return false;
    v = b_[pos_++];
    return true;
  }
  bool u16(std::uint16_t& v) {
    if (left() < 2) return false;
    v = static_cast<std::uint16_t>(b_[pos_] << 8 | b_[pos_ + 1]);
    pos_ += 2;
    return true;
  }
  bool u24(std::uint32_t& v) {
    if (left() < 3) return false;
    v = static_cast<std::uint32_t>(b_[pos_]) << 16 | static_cast<std::uint32_t>(b_[pos_ + 1]) << 8 | b_[pos_ + 2];
    pos_ += 3;
    return true;
  }
  bool u32(std::uint32_t& v) {
    if (left() < 4) return false;
    v = static_cast<std::uint32_t>(b_[pos_]) << 24 | static_cast<std::uint32_t>(b_[pos_ + 1]) << 16 |
        static_cast<std::uint32_t>(b_[pos_ + 2]) << 8 | b_[pos_ + 3];
    pos_ += 4;
    return true;
  }
  bool bytes(std::size_t n, Bytes& out) {
    if (left() < n) return false;
    out = b_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  bool skip(std::size_t n) {
    if (left() < n) return false;
    pos_ += n;
    return true;
  }
  // QUIC variable-length integer (RFC 9000 §16).
  bool varint(std::uint64_t& v) {
    if (left() < 1) return false;
    const std::size_t len = std::size_t{1} << (b_[pos_] >> 6);
    if (left() < len) return false;
    v = b_[pos_] & 0x3f;
    for (std::size_t i = 1; i < len; ++i) v = v << 8 | b_[pos_ + i];
    pos_ += len;
    return true;
  }

 private:
  Bytes b_;
  std::size_t pos_ = 0;
};

inline Bytes as_bytes(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

}  // namespace egressd::pin
