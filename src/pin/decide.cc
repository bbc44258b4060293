#include "pin/decide.h"

#include <algorithm>
#include <array>

namespace egressd::pin {
namespace {

bool is_tchar(std::uint8_t c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(static_cast<char>(c)) != std::string_view::npos;
}

// RFC 9110 §9, RFC 4918 (WebDAV), RFC 5789 (PATCH), RFC 3253: methods a
// server may take without an "HTTP/" on the line (HTTP/0.9 style).
constexpr std::array<std::string_view, 24> kMethods = {
    "GET",       "HEAD",   "POST",       "PUT",       "DELETE", "CONNECT", "OPTIONS", "TRACE",
    "PATCH",     "PROPFIND", "PROPPATCH", "MKCOL",   "COPY",   "MOVE",    "LOCK",    "UNLOCK",
    "REPORT",    "SEARCH", "MKCALENDAR", "CHECKOUT", "MERGE",  "UPDATE",  "LABEL",   "PRI"};

// Whitespace to a lenient HTTP/1 server (RFC 9112 §3: SP, HTAB, VT, FF, bare
// CR; CPython's str.split() adds LF, 0x1c-0x1f, and 0x85 and 0xa0 of a line
// decoded as Latin-1).
bool is_lenient_space(std::uint8_t c) {
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0;
}

bool has_http_slash(std::string_view line) {
  for (std::size_t i = 0; i + 5 <= line.size(); ++i) {
    auto up = [&](std::size_t j) {
      char c = line[i + j];
      return c >= 'a' && c <= 'z' ? static_cast<char>(c - 'a' + 'A') : c;
    };
    if (up(0) == 'H' && up(1) == 'T' && up(2) == 'T' && up(3) == 'P' && line[i + 4] == '/') return true;
  }
  return false;
}

std::string endpoint(const IpPrefix& dst, std::uint16_t port) {
  const std::string a = dst.to_string();
  return (dst.family == 6 ? "[" + a + "]" : a) + ":" + std::to_string(port);
}

std::string learned_list(const std::vector<std::string>& names) {
  if (names.empty()) return "no name";
  // Bounded: an address shared by many names must not make a huge line.
  constexpr std::size_t kShown = 4;
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i) out += ", ";
    out += names[i];
  }
  if (names.size() > kShown) out += " (+" + std::to_string(names.size() - kShown) + " more)";
  return out;
}

}  // namespace

std::string_view to_string(TcpKind kind) {
  switch (kind) {
    case TcpKind::tls: return "tls";
    case TcpKind::http: return "http";
    case TcpKind::other: return "other";
    case TcpKind::need_more: return "need-more";
  }
  return "?";
}

TcpKind classify_tcp(Bytes stream) {
  const Bytes in = stream.first(std::min(stream.size(), kMaxInspect));
  const bool capped = stream.size() >= kMaxInspect;
  if (in.empty()) return TcpKind::need_more;
  // Any TLS record type (change_cipher_spec 20, alert 21, handshake 22,
  // application_data 23, heartbeat 24, tls12_cid 25) is TLS, judged as a
  // hello: only a handshake record can be one. Go's crypto/tls skips warning
  // alerts ahead of the ClientHello, so a hello for another name behind a
  // 7-byte alert, taken for "other" bytes, reached it unread (an attack
  // review, 2026-12-07, no capability needed).
  if (in[0] >= 20 && in[0] <= 25) return TcpKind::tls;
  if ((in[0] & 0x80) != 0) {
    // SSLv2-format ClientHello: 2-byte length with the top bit, then type 1.
    if (in.size() < 3) return TcpKind::need_more;
    if (in[2] == 1) return TcpKind::tls;
    if (!is_lenient_space(in[0])) return TcpKind::other;  // 0x85 and 0xa0 may start a request line
  }
  // A request line as a lenient server reads it (RFC 9112 §3 lets it split on
  // any whitespace and skip leading whitespace; CPython's http.server, and the
  // Flask and Django development servers on it, skip and split on
  // is_lenient_space's every byte). Deciding "other" on such a line, or on a
  // prefix of whitespace, let a request for another name through by its
  // address (attack review 8: `\x0cGET ...`, `GET\x0b/ ...`, `GET\r/\rHTTP/1.1`,
  // and a lone `\x0c` before a plain request). Called http, the head parser
  // refuses every such shape.
  std::size_t pos = 0;
  while (pos < in.size() && is_lenient_space(in[pos])) ++pos;
  if (pos == in.size()) return capped ? TcpKind::http : TcpKind::need_more;
  const std::size_t start = pos;
  while (pos < in.size() && is_tchar(in[pos])) ++pos;
  if (pos == start) return TcpKind::other;
  if (pos == in.size()) return capped ? TcpKind::other : TcpKind::need_more;
  if (!is_lenient_space(in[pos])) return TcpKind::other;
  const std::string_view text(reinterpret_cast<const char*>(in.data()), in.size());
  const std::string_view method = text.substr(start, pos - start);
  // A known method and a separator: a request line. Not CR or LF, which end
  // a line of one word (an inline command, `GET\r\n`): that is judged below.
  if (std::find(kMethods.begin(), kMethods.end(), method) != kMethods.end() && in[pos] != '\r' && in[pos] != '\n') {
    return TcpKind::http;
  }
  const auto lf = text.find('\n', pos);
  if (lf == std::string_view::npos) return capped ? TcpKind::http : TcpKind::need_more;
  return has_http_slash(text.substr(pos, lf - pos)) ? TcpKind::http : TcpKind::other;
}

std::optional<std::size_t> tls_upgrade_request(Bytes first) {
  const std::string_view text(reinterpret_cast<const char*>(first.data()), first.size());
  // PostgreSQL: length 8, then 80877103 (SSLRequest) or 80877104 (GSSENCRequest).
  if (text.size() >= 8 && text.substr(0, 7) == std::string_view("\0\0\0\x08\x04\xd2\x16", 7) &&
      (first[7] == 0x2f || first[7] == 0x30)) {
    return 8;
  }
  // MySQL: a 32-byte packet, sequence 1, whose capability flags ask for SSL
  // (CLIENT_SSL 0x800) in protocol 4.1 (0x200).
  if (first.size() >= 36 && first[0] == 32 && first[1] == 0 && first[2] == 0 && first[3] == 1 &&
      (first[5] & 0x08) != 0 && (first[5] & 0x02) != 0) {
    return 36;
  }
  // LDAP: an ExtendedRequest naming StartTLS's OID, within its first 64 bytes.
  constexpr std::string_view kLdapStartTls = "1.3.6.1.4.1.1466.20037";
  if (!first.empty() && first[0] == 0x30) {
    const auto at = text.substr(0, 64).find(kLdapStartTls);
    if (at != std::string_view::npos) return std::min<std::size_t>(first.size(), at + kLdapStartTls.size());
  }
  // A command line: its last word STARTTLS or STLS, or AUTH TLS / AUTH SSL.
  const auto lf = text.find('\n');
  if (lf == std::string_view::npos || lf > 256) return std::nullopt;
  std::string line;
  for (const char c : text.substr(0, lf)) {
    if (c != '\r') line += static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  }
  while (!line.empty() && (line.back() == ' ' || line.back() == '\t')) line.pop_back();
  const auto sp = line.find_last_of(" \t");
  const std::string_view last = sp == std::string::npos ? std::string_view(line) : std::string_view(line).substr(sp + 1);
  if (last == "STARTTLS" || last == "STLS" || line.rfind("AUTH TLS", 0) == 0 || line.rfind("AUTH SSL", 0) == 0) {
    return lf + 1;
  }
  return std::nullopt;
}

Decision decide(PinProto proto, const Parse& parse, const IpPrefix& dst, std::uint16_t port, const PinFacts& facts) {
  Decision d;
  if (parse.verdict == Verdict::need_more) return d;
  const std::string_view p = proto == PinProto::tls ? "tls" : proto == PinProto::quic ? "quic" : "http";
  const std::string_view what = proto == PinProto::http ? "host" : "sni";
  std::string head;
  if (parse.verdict == Verdict::invalid) {
    head = std::string(p) + " unparseable (" + parse.reason + ")";
  } else if (!parse.name) {
    head = std::string(p) + " without " + std::string(what);
  } else {
    d.name = *parse.name;
    head = std::string(p) + " " + std::string(what) + " " + d.name + (parse.ech ? " (ech outer)" : "");
  }
  head += " to " + endpoint(dst, port);
  const std::vector<std::string> learned = facts.names_for(dst);
  if (parse.verdict == Verdict::complete && parse.name) {
    const Entry* e = facts.allowed(d.name);
    const bool pinned = std::find(learned.begin(), learned.end(), d.name) != learned.end();
    if (e && pinned) {
      d.kind = Decision::Kind::admit;
      d.entry = e->text;
      d.reason = head + "; allowed by " + e->text;
      return d;
    }
  }
  d.kind = Decision::Kind::reset;
  d.reason = head + "; address learned for " + learned_list(learned);
  return d;
}

}  // namespace egressd::pin
