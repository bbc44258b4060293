#include "pin/http_head.h"

#include <algorithm>

#include "egressd/policy.h"

namespace egressd::pin {
namespace {

constexpr std::string_view kH2Preface = "PRI * HTTP/2.0";

bool is_tchar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool is_token(std::string_view s) { return !s.empty() && std::all_of(s.begin(), s.end(), is_tchar); }

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           auto low = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
           return low(x) == low(y);
         });
}

// host [":" port] as in a Host header or a URI authority (no userinfo).
// Empty text: nullopt name, no error. An IPv6 literal comes back without
// brackets, compressed.
struct Host {
  bool ok = false;
  std::optional<std::string> name;
};

Host parse_host(std::string_view v) {
  Host h;
  if (v.empty()) {
    h.ok = true;
    return h;
  }
  std::string_view host = v, port;
  if (v.front() == '[') {
    const auto close = v.find(']');
    if (close == std::string_view::npos) return h;
    host = v.substr(1, close - 1);
    std::string_view rest = v.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return h;
      port = rest.substr(1);
    }
    const auto ip = parse_ip(host);
    if (!ip || ip->family != 6) return h;
    h.name = ip->to_string();
  } else {
    if (const auto colon = v.find(':'); colon != std::string_view::npos) {
      host = v.substr(0, colon);
      port = v.substr(colon + 1);
    }
    h.name = normalize_name(host);
    if (!h.name) return h;
  }
  if (port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return h;
  }
  h.ok = true;
  return h;
}

}  // namespace

Parse parse_http_head(Bytes stream) { return read_http_head(stream).parse; }

HttpHead read_http_head(Bytes stream) {
  HttpHead out;
  auto done = [&](Parse p) {
    out.parse = std::move(p);
    return out;
  };
  const Bytes in = stream.first(std::min(stream.size(), kMaxInspect));
  const std::string_view s(reinterpret_cast<const char*>(in.data()), in.size());
  auto more_or_too_large = [&] {
    if (stream.size() >= kMaxInspect) return done(Parse::invalid("request head larger than 16384 bytes"));
    return done(Parse::more(stream.size()));
  };

  // RFC 9112 §2.2: servers SHOULD ignore at least one empty line before the
  // request line; they ignore any number, so do we.
  std::size_t pos = 0;
  while (pos < s.size()) {
    if (s[pos] == '\n') {
      ++pos;
    } else if (s[pos] == '\r') {
      if (pos + 1 == s.size()) return more_or_too_large();
      if (s[pos + 1] != '\n') return done(Parse::invalid("bare CR before the request line"));
      pos += 2;
    } else {
      break;
    }
  }
  const std::string_view rest = s.substr(pos);
  // The HTTP/2 prior-knowledge preface: its frames name the host in
  // HPACK-coded :authority, which is not parsed; refused as a whole.
  if (rest.starts_with(kH2Preface.substr(0, std::min(rest.size(), kH2Preface.size())))) {
    if (rest.size() >= kH2Preface.size()) return done(Parse::invalid("h2c preface"));
    return more_or_too_large();
  }

  // The end of the head: an empty line, CRLF or bare LF terminated.
  std::size_t end = std::string_view::npos;
  for (std::size_t i = s.find('\n', pos); i != std::string_view::npos; i = s.find('\n', i + 1)) {
    if (i + 1 < s.size() && s[i + 1] == '\n') {
      end = i + 1;
      break;
    }
    if (i + 2 < s.size() && s[i + 1] == '\r' && s[i + 2] == '\n') {
      end = i + 2;
      break;
    }
  }
  if (end == std::string_view::npos) return more_or_too_large();
  out.size = end + 1;

  // Lines of the head, each without its LF and one CR before it; any other
  // CR is refused (servers disagree on bare CRs, so they could disagree with
  // us on where a Host line starts).
  std::string_view head = s.substr(pos, end - pos);
  std::optional<std::string> authority_name;
  bool have_authority = false;
  std::optional<std::string> host_name;
  bool have_host = false;
  bool first = true;
  std::string_view method;
  int te_count = 0, cl_count = 0;
  bool chunked = false;
  std::uint64_t length = 0;
  while (!head.empty()) {
    const auto lf = head.find('\n');
    std::string_view line = head.substr(0, lf);
    head = lf == std::string_view::npos ? std::string_view{} : head.substr(lf + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find('\r') != std::string_view::npos) return done(Parse::invalid("bare CR in the request head"));
    if (line.empty()) break;  // the empty line ending the head
    if (first) {
      first = false;
      if (line.front() == ' ' || line.front() == '\t') return done(Parse::invalid("whitespace before the request line"));
      const auto sp1 = line.find(' ');
      if (sp1 == std::string_view::npos) return done(Parse::invalid("malformed request line"));
      const auto sp2 = line.find(' ', sp1 + 1);
      if (sp2 == std::string_view::npos) return done(Parse::invalid("request line without a version (HTTP/0.9)"));
      method = line.substr(0, sp1);
      const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
      const std::string_view version = line.substr(sp2 + 1);
      if (!is_token(method)) return done(Parse::invalid("malformed request method"));
      if (target.empty() || !std::all_of(target.begin(), target.end(), [](char c) { return c > 0x20 && c < 0x7f; })) {
        return done(Parse::invalid("malformed request target"));
      }
      if (version.size() != 8 || !version.starts_with("HTTP/1.") || version[7] < '0' || version[7] > '9') {
        return done(Parse::invalid("request version is not HTTP/1.x"));
      }
      std::string_view authority;
      if (method == "CONNECT") {
        authority = target;  // authority-form, RFC 9112 §3.2.3
        have_authority = true;
      } else if (const auto scheme_end = target.find("://"); target.front() != '/' && target != "*" &&
                                                             scheme_end != std::string_view::npos) {
        // absolute-form, RFC 9112 §3.2.2: the authority, not Host, names the
        // host to the origin server.
        const std::string_view scheme = target.substr(0, scheme_end);
        if (!iequals(scheme, "http") && !iequals(scheme, "https")) {
          return done(Parse::invalid("request target scheme is not http or https"));
        }
        authority = target.substr(scheme_end + 3);
        // An '@' after the authority's end ("http://allowed.test?@other.test/")
        // is path or query to RFC 3986, and userinfo to a reader that looks
        // for it first (HAProxy's host from the URI read other.test: an
        // attack review). Read one way by egressd and another by a server,
        // it is refused wherever it is.
        if (authority.find('@') != std::string_view::npos) return done(Parse::invalid("'@' in an absolute-form request target"));
        authority = authority.substr(0, authority.find_first_of("/?#"));
        have_authority = true;
      } else if (target.front() != '/' && target != "*") {
        return done(Parse::invalid("malformed request target"));
      }
      if (have_authority) {
        // userinfo ("http://allowed.test@other.test/") hides the host from
        // a reader that stops at the first name.
        if (authority.find('@') != std::string_view::npos) return done(Parse::invalid("userinfo in the request target"));
        Host h = parse_host(authority);
        if (!h.ok || !h.name) return done(Parse::invalid("malformed request target authority"));
        authority_name = std::move(h.name);
      }
      continue;
    }
    // RFC 9112 §5.2: obs-fold is obsolete; a server may join the line to the
    // one before or refuse it, so its meaning is not ours to guess.
    if (line.front() == ' ' || line.front() == '\t') return done(Parse::invalid("obs-fold line in the request head"));
    const auto colon = line.find(':');
    if (colon == std::string_view::npos) return done(Parse::invalid("header line without a colon"));
    const std::string_view field = line.substr(0, colon);
    // RFC 9112 §5.1: whitespace between name and colon MUST be rejected.
    if (!is_token(field)) return done(Parse::invalid("malformed header field name"));
    if (iequals(field, "transfer-encoding") || iequals(field, "content-length")) {
      std::string_view value = line.substr(colon + 1);
      while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
      while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
      if (iequals(field, "transfer-encoding")) {
        ++te_count;
        chunked = iequals(value, "chunked");
        if (!chunked) return done(Parse::invalid("Transfer-Encoding other than chunked"));
      } else {
        ++cl_count;
        if (value.empty() || value.size() > 18 ||
            !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
          return done(Parse::invalid("malformed Content-Length"));
        }
        length = 0;
        for (char c : value) length = length * 10 + static_cast<std::uint64_t>(c - '0');
      }
      continue;
    }
    if (!iequals(field, "host")) continue;
    if (have_host) return done(Parse::invalid("duplicate Host header"));
    have_host = true;
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
    while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
    Host h = parse_host(value);
    if (!h.ok) return done(Parse::invalid("malformed Host header"));
    host_name = std::move(h.name);
  }
  // Where the body ends: the next request starts there.
  if (te_count + cl_count > 1) return done(Parse::invalid("more than one Transfer-Encoding or Content-Length"));
  if (chunked) {
    out.body = HttpHead::Body::chunked;
  } else if (cl_count == 1 && length > 0) {
    out.body = HttpHead::Body::length;
    out.length = length;
  }
  if (out.body != HttpHead::Body::none &&
      (method == "GET" || method == "HEAD" || method == "TRACE" || method == "CONNECT")) {
    return done(Parse::invalid("a body on a GET, HEAD, TRACE or CONNECT request"));
  }
  if (have_authority) {
    // A client MUST send Host equal to the authority (RFC 9112 §3.2.2); a
    // server behind a proxy-ish front might route by either.
    if (have_host && host_name != authority_name) return done(Parse::invalid("Host differs from the request target authority"));
    return done(Parse::complete_with(std::move(authority_name)));
  }
  return done(Parse::complete_with(std::move(host_name)));
}

}  // namespace egressd::pin
