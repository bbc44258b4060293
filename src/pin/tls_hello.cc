#include "pin/tls_hello.h"

#include <algorithm>
#include <array>
#include <bitset>
#include <string>

namespace egressd::pin {
namespace {

constexpr std::uint8_t kRecordHandshake = 22;
constexpr std::uint8_t kHandshakeClientHello = 1;
constexpr std::uint16_t kExtServerName = 0;
constexpr std::size_t kRecordHeader = 5;
constexpr std::size_t kHandshakeHeader = 4;
// TLSPlaintext.length MUST NOT exceed 2^14 (RFC 8446 §5.1).
constexpr std::size_t kMaxRecord = 16384;

// server_name (RFC 6066 §3): a ServerNameList holding exactly one host_name,
// as OpenSSL and most servers require. Several names (a server might pick
// another one than we judged) or other name types are refused.
Parse server_name(Bytes data, std::optional<std::string>& name) {
  Reader r(data);
  std::uint16_t list_len = 0;
  if (!r.u16(list_len) || list_len != r.left() || list_len == 0) {
    return Parse::invalid("malformed server_name extension");
  }
  std::uint8_t type = 0;
  std::uint16_t len = 0;
  Bytes host;
  if (!r.u8(type) || !r.u16(len) || !r.bytes(len, host)) {
    return Parse::invalid("malformed server_name extension");
  }
  if (type != 0) return Parse::invalid("server_name of a type other than host_name");
  if (!r.empty()) return Parse::invalid("server_name with more than one name");
  auto n = normalize_name({reinterpret_cast<const char*>(host.data()), host.size()});
  if (!n) return Parse::invalid("server_name is not a valid host name");
  name = std::move(n);
  return Parse::complete_with(std::nullopt);
}

// The body of a ClientHello (RFC 8446 §4.1.2; RFC 5246 §7.4.1.2 for the
// optional extensions block of older hellos).
Parse client_hello_body(Bytes body) {
  Reader r(body);
  std::uint16_t legacy_version = 0;
  std::uint8_t sid_len = 0, comp_len = 0;
  std::uint16_t suites_len = 0;
  if (!r.u16(legacy_version) || !r.skip(32) || !r.u8(sid_len)) return Parse::invalid("truncated ClientHello");
  if ((legacy_version >> 8) != 3) return Parse::invalid("ClientHello version is not TLS");
  if (sid_len > 32) return Parse::invalid("ClientHello session id longer than 32 bytes");
  if (!r.skip(sid_len) || !r.u16(suites_len)) return Parse::invalid("truncated ClientHello");
  if (suites_len < 2 || suites_len % 2 != 0) return Parse::invalid("malformed ClientHello cipher suites");
  if (!r.skip(suites_len) || !r.u8(comp_len)) return Parse::invalid("truncated ClientHello");
  if (comp_len < 1) return Parse::invalid("ClientHello without compression methods");
  if (!r.skip(comp_len)) return Parse::invalid("truncated ClientHello");
  if (r.empty()) return Parse::complete_with(std::nullopt);  // no extensions: no server_name

  std::uint16_t ext_total = 0;
  if (!r.u16(ext_total) || ext_total != r.left()) return Parse::invalid("malformed ClientHello extensions length");
  // At most one extension of each type (RFC 8446 §4.2): a second server_name
  // could be the one a server uses. 8 KiB of bits, on the stack.
  std::bitset<65536> seen;
  std::optional<std::string> name;
  bool ech = false;
  while (!r.empty()) {
    std::uint16_t type = 0, len = 0;
    Bytes data;
    if (!r.u16(type) || !r.u16(len) || !r.bytes(len, data)) return Parse::invalid("malformed ClientHello extension");
    if (seen.test(type)) return Parse::invalid("duplicate ClientHello extension");
    seen.set(type);
    if (type == kExtServerName) {
      Parse p = server_name(data, name);
      if (p.verdict == Verdict::invalid) return p;
    } else if (type == kExtEch) {
      ech = true;
    }
  }
  Parse p = Parse::complete_with(std::move(name), ech);
  p.early_data = seen.test(kExtEarlyData);
  return p;
}

// Judges the handshake bytes gathered so far. `limit`: how many handshake
// bytes can ever be gathered before kMaxInspect is reached.
Parse judge_handshake(Bytes hs, std::size_t limit, std::size_t buffered) {
  if (hs.empty()) return Parse::more(buffered);
  if (hs[0] != kHandshakeClientHello) return Parse::invalid("first handshake message is not a ClientHello");
  if (hs.size() < kHandshakeHeader) return Parse::more(buffered);
  const std::size_t len = static_cast<std::size_t>(hs[1]) << 16 | static_cast<std::size_t>(hs[2]) << 8 | hs[3];
  if (kHandshakeHeader + len > limit) return Parse::invalid("ClientHello larger than 16384 bytes");
  if (hs.size() < kHandshakeHeader + len) return Parse::more(buffered);
  return client_hello_body(hs.subspan(kHandshakeHeader, len));
}

}  // namespace

Parse parse_client_hello_message(Bytes handshake) {
  const Bytes hs = handshake.first(std::min(handshake.size(), kMaxInspect));
  Parse p = judge_handshake(hs, kMaxInspect, hs.size());
  if (p.verdict == Verdict::need_more && handshake.size() >= kMaxInspect) {
    return Parse::invalid("ClientHello larger than 16384 bytes");
  }
  return p;
}

Parse parse_tls_client_hello(Bytes stream) {
  if (!stream.empty() && stream[0] != kRecordHandshake) {
    // SSLv2-format hellos (RFC 5246 appendix E.2) carry no extensions, so no
    // server name; some servers still take them.
    if ((stream[0] & 0x80) != 0) return Parse::invalid("SSLv2-format ClientHello");
    return Parse::invalid("not a TLS handshake record");
  }
  const Bytes in = stream.first(std::min(stream.size(), kMaxInspect));
  // The hello's handshake bytes, gathered from the records' fragments. Fixed
  // size: the stream looked at is at most kMaxInspect bytes.
  std::array<std::uint8_t, kMaxInspect> hs;
  std::size_t hs_len = 0;
  std::size_t pos = 0;
  Parse p = Parse::more(stream.size());
  while (true) {
    if (in.size() - pos < kRecordHeader) break;
    const std::uint8_t type = in[pos];
    const std::uint8_t major = in[pos + 1];
    const std::size_t len = static_cast<std::size_t>(in[pos + 3]) << 8 | in[pos + 4];
    // Anything but handshake records before the hello is whole (alerts,
    // change_cipher_spec, application data) is not a client we can judge.
    if (type != kRecordHandshake) return Parse::invalid("non-handshake record before the ClientHello was complete");
    if (major != 3) return Parse::invalid("TLS record version is not TLS");
    if (len == 0) return Parse::invalid("empty TLS handshake record");
    if (len > kMaxRecord) return Parse::invalid("TLS record longer than 16384 bytes");
    pos += kRecordHeader;
    // A record still arriving contributes what has arrived: the hello may
    // already be whole in it.
    const std::size_t take = std::min(len, in.size() - pos);
    std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(pos), take, hs.begin() + static_cast<std::ptrdiff_t>(hs_len));
    hs_len += take;
    pos += take;
    // Each record costs a 5-byte header from the same budget; the hello can
    // be at most what is left once this record's header is paid.
    p = judge_handshake(Bytes(hs.data(), hs_len), kMaxInspect - (pos - hs_len), stream.size());
    if (p.verdict != Verdict::need_more || take < len) break;
    // A whole record, and the hello goes on in the next one. TLS allows it,
    // and OpenSSL joins the fragments; a router that picks a backend by the
    // name (HAProxy's req.ssl_sni) walks the bytes as they come, the next
    // record's header inside the hello, and reads another name (an attack
    // review: a hello naming allowed.test reached same-ip.test's backend).
    // Clients send a hello up to 16 KiB in one record, and a larger one is
    // refused anyway: no hello is judged across records.
    return Parse::invalid("ClientHello split over TLS records");
  }
  if (p.verdict == Verdict::need_more && stream.size() >= kMaxInspect) {
    return Parse::invalid("ClientHello larger than 16384 bytes");
  }
  return p;
}

}  // namespace egressd::pin
