// Hostname pinning's classifier and decision (src/pin/decide.h): which flows
// are TLS / HTTP / other, and the strict rule with its reason lines.
#include <doctest/doctest.h>

#include <map>

#include "dns/matcher.h"
#include "pin/decide.h"
#include "pin/http_head.h"
#include "pin/tls_hello.h"

using namespace egressd;
using namespace egressd::pin;

namespace {

TcpKind kind(std::string_view s) { return classify_tcp(as_bytes(s)); }

// What the datapath will supply: the phase's matcher and the learned names.
class FakeFacts : public PinFacts {
 public:
  FakeFacts(std::vector<std::string> entries, std::map<std::string, std::vector<std::string>> learned)
      : learned_(std::move(learned)) {
    std::vector<Entry> es;
    for (const auto& e : entries) es.push_back(parse_entry(e).value());
    matcher_ = dns::NameMatcher(es);
  }
  std::vector<std::string> names_for(const IpPrefix& addr) const override {
    auto it = learned_.find(addr.to_string());
    return it == learned_.end() ? std::vector<std::string>{} : it->second;
  }
  const Entry* allowed(std::string_view name) const override { return matcher_.match(name); }

 private:
  dns::NameMatcher matcher_;
  std::map<std::string, std::vector<std::string>> learned_;
};

const IpPrefix kAddr = *parse_ip("203.0.113.10");
const IpPrefix kAddr6 = *parse_ip("2001:db8::10");

FakeFacts facts() {
  return FakeFacts({"allowed.test", "other-allowed.test", "*.wild.test"},
                   {{"203.0.113.10", {"allowed.test", "a.wild.test"}}, {"2001:db8::10", {"allowed.test"}}});
}

Decision tls(std::optional<std::string> sni, const IpPrefix& dst = kAddr, std::uint16_t port = 443, bool ech = false) {
  return decide(PinProto::tls, Parse::complete_with(std::move(sni), ech), dst, port, facts());
}

}  // namespace

TEST_CASE("classify: TLS, HTTP, and everything else by address") {
  CHECK(kind("") == TcpKind::need_more);
  CHECK(kind("\x16\x03\x01") == TcpKind::tls);
  // Every TLS record type is TLS, then refused unless a handshake record: Go's crypto/tls
  // skips a warning alert ahead of the hello, which as "other" bytes passed unread.
  for (const char type : {'\x14', '\x15', '\x17', '\x18', '\x19'}) {
    const std::string alert = std::string(1, type) + "\x03\x01\x00\x02\x01\x5a";
    CHECK(kind(alert) == TcpKind::tls);
    CHECK(parse_tls_client_hello(as_bytes(alert)).verdict == Verdict::invalid);
  }
  CHECK(kind(std::string_view("\x13\x03", 2)) == TcpKind::other);
  CHECK(kind(std::string_view("\x1a\x03", 2)) == TcpKind::other);
  CHECK(kind(std::string_view("\x80\x2e\x01\x03\x01", 5)) == TcpKind::tls);  // SSLv2 hello
  CHECK(kind(std::string_view("\x80\x2e", 2)) == TcpKind::need_more);
  CHECK(kind("GET / HTTP/1.1\r\n") == TcpKind::http);
  CHECK(kind("GET ") == TcpKind::http);  // a known method: no need to wait
  CHECK(kind("\r\n\r\nPOST /x HTTP/1.1\r\n") == TcpKind::http);
  CHECK(kind("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") == TcpKind::http);
  CHECK(kind("BREW /pot HTTP/1.1\r\n") == TcpKind::http);   // unknown method, HTTP/ on the line
  CHECK(kind("brew /pot http/1.1\r\n") == TcpKind::http);
  CHECK(kind("BREW /pot HTT") == TcpKind::need_more);       // may still become a request line
  CHECK(kind("GE") == TcpKind::need_more);
  CHECK(kind("\r\n") == TcpKind::need_more);
  // Client-speaks-first protocols that are not HTTP: the address decides.
  CHECK(kind("SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n") == TcpKind::other);
  CHECK(kind("SSH-2.0-OpenSSH_9.2p1\r\n") == TcpKind::other);
  CHECK(kind(std::string_view("\x00\x00\x00\x08\x04\xd2\x16\x2f", 8)) == TcpKind::other);  // PostgreSQL SSLRequest
  CHECK(kind("*1\r\n$4\r\nPING\r\n") == TcpKind::other);  // Redis
  CHECK(kind("SET k v\r\n") == TcpKind::other);
  CHECK(kind("EHLO x\r\n") == TcpKind::other);
  // RFC 9112 §3's lenient whitespace (CPython's http.server, Flask's and Django's development
  // servers answer these): a request line, refused by the head parser, never "other" bytes
  // let through by the address (attack review 8).
  for (const std::string_view line : {std::string_view("\x0cGET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                                      std::string_view("GET\x0b/ HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                                      std::string_view("GET\x1f/\x1fHTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                                      std::string_view("GET\r/\rHTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                                      std::string_view("GET\x0c/\x0cHTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                                      std::string_view("\xa0GET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n"),
                                      std::string_view("\x85\x1c\x0b" "BREW\xa0/\x85HTTP/1.1\r\n\r\n")}) {
    CAPTURE(line);
    CHECK(kind(line) == TcpKind::http);
    CHECK(parse_http_head(as_bytes(line)).verdict == Verdict::invalid);
  }
  // Whitespace alone decides nothing (a lone \x0c, then a plain request, was let through).
  CHECK(kind("\x0c") == TcpKind::need_more);
  CHECK(kind("\x0b\x1c\x1d\x1e\x1f \t\r\n") == TcpKind::need_more);
  CHECK(kind("\xa0") == TcpKind::need_more);
  CHECK(kind("\xa0\x0c") == TcpKind::need_more);
  CHECK(kind("\xa0\x0c\x01") == TcpKind::tls);  // an SSLv2 hello's header all the same
  CHECK(kind("GET\r") == TcpKind::need_more);     // `GET\r/\rHTTP/1.1` may follow
  CHECK(kind("GET\r\n") == TcpKind::other);      // an inline command of one word
  CHECK(kind("PING\r\n") == TcpKind::other);
  CHECK(kind("\xa1GET /") == TcpKind::other);     // not whitespace to anyone
  CHECK(classify_tcp(as_bytes(std::string(kMaxInspect, '\x0c'))) == TcpKind::http);
  // A first line that never ends within the cap and looks like a request.
  CHECK(classify_tcp(as_bytes("FOO " + std::string(kMaxInspect, 'a'))) == TcpKind::http);
  CHECK(classify_tcp(as_bytes(std::string(kMaxInspect + 1, 'a'))) == TcpKind::other);
  CHECK(to_string(TcpKind::need_more) == "need-more");
}

TEST_CASE("admit only a name the phase allows that was learned for this address") {
  Decision d = tls("allowed.test");
  CHECK(d.kind == Decision::Kind::admit);
  CHECK(d.entry == "allowed.test");
  CHECK(d.reason == "tls sni allowed.test to 203.0.113.10:443; allowed by allowed.test");
  d = tls("a.wild.test");
  CHECK(d.kind == Decision::Kind::admit);
  CHECK(d.entry == "*.wild.test");

  // Another site on the same address.
  d = tls("same-ip.test");
  CHECK(d.kind == Decision::Kind::reset);
  CHECK(d.name == "same-ip.test");
  CHECK(d.reason == "tls sni same-ip.test to 203.0.113.10:443; address learned for allowed.test, a.wild.test");
  // Strict pinning: allowed by the phase, but it did not resolve here.
  CHECK(tls("other-allowed.test").kind == Decision::Kind::reset);
  CHECK(tls("b.wild.test").kind == Decision::Kind::reset);
  // Learned here, no longer allowed (a switch): not admitted.
  CHECK(decide(PinProto::tls, Parse::complete_with("allowed.test"), kAddr, 443,
               FakeFacts({"other-allowed.test"}, {{"203.0.113.10", {"allowed.test"}}}))
            .kind == Decision::Kind::reset);
  // Whatever the port.
  CHECK(tls("same-ip.test", kAddr, 8443).reason ==
        "tls sni same-ip.test to 203.0.113.10:8443; address learned for allowed.test, a.wild.test");
}

TEST_CASE("no name, an unparseable start, and ECH outer names are judged like any other") {
  CHECK(tls(std::nullopt).reason == "tls without sni to 203.0.113.10:443; address learned for allowed.test, a.wild.test");
  CHECK(tls(std::nullopt).kind == Decision::Kind::reset);
  const Decision inv = decide(PinProto::http, Parse::invalid("h2c preface"), kAddr6, 80, facts());
  CHECK(inv.kind == Decision::Kind::reset);
  CHECK(inv.reason == "http unparseable (h2c preface) to [2001:db8::10]:80; address learned for allowed.test");
  const Decision ech = tls("public.example", kAddr, 443, true);
  CHECK(ech.kind == Decision::Kind::reset);
  CHECK(ech.reason ==
        "tls sni public.example (ech outer) to 203.0.113.10:443; address learned for allowed.test, a.wild.test");
  CHECK(tls("allowed.test", kAddr, 443, true).kind == Decision::Kind::admit);
  // An address nobody resolved (the datapath should not ask, but the answer is no).
  CHECK(tls("allowed.test", *parse_ip("198.51.100.1")).reason ==
        "tls sni allowed.test to 198.51.100.1:443; address learned for no name");
  CHECK(decide(PinProto::quic, Parse::complete_with("allowed.test"), kAddr6, 443, facts()).reason ==
        "quic sni allowed.test to [2001:db8::10]:443; allowed by allowed.test");
  CHECK(decide(PinProto::tls, Parse::more(10), kAddr, 443, facts()).kind == Decision::Kind::need_more);
}

TEST_CASE("end to end: first bytes, classifier, parser, decision") {
  auto judge = [](std::string_view first) {
    const Bytes b = as_bytes(first);
    switch (classify_tcp(b)) {
      case TcpKind::http: return decide(PinProto::http, parse_http_head(b), kAddr, 80, facts()).reason;
      case TcpKind::tls: return decide(PinProto::tls, parse_tls_client_hello(b), kAddr, 443, facts()).reason;
      case TcpKind::other: return std::string("other");
      case TcpKind::need_more: return std::string("need more");
    }
    return std::string();
  };
  CHECK(judge("GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") ==
        "http host allowed.test to 203.0.113.10:80; allowed by allowed.test");
  CHECK(judge("\r\nGET / HTTP/1.1\r\nHost: same-ip.test\r\n\r\n") ==
        "http host same-ip.test to 203.0.113.10:80; address learned for allowed.test, a.wild.test");
  CHECK(judge("GET / HTTP/1.1\r\n\r\n") ==
        "http without host to 203.0.113.10:80; address learned for allowed.test, a.wild.test");
  CHECK(judge("GET / HTTP/1.1\r\nHost: allowed.test\r\n") == "");  // need_more: empty reason
  CHECK(judge(std::string_view("\x16\x03\x01\x00\x01\x02", 6)) ==
        "tls unparseable (first handshake message is not a ClientHello) to 203.0.113.10:443; address learned for "
        "allowed.test, a.wild.test");
  CHECK(judge("SSH-2.0-OpenSSH_9.2p1\r\n") == "other");
}

TEST_CASE("reason lines stay short when many names share an address") {
  std::vector<std::string> many;
  for (int i = 0; i < 10; ++i) many.push_back("n" + std::to_string(i) + ".test");
  const FakeFacts f({"allowed.test"}, {{"203.0.113.10", many}});
  CHECK(decide(PinProto::tls, Parse::complete_with("x.test"), kAddr, 443, f).reason ==
        "tls sni x.test to 203.0.113.10:443; address learned for n0.test, n1.test, n2.test, n3.test (+6 more)");
}

TEST_CASE("normalize_name: the one form presented names are matched in") {
  CHECK(normalize_name("Allowed.TEST.") == "allowed.test");
  CHECK(normalize_name("_acme-challenge.x.test") == "_acme-challenge.x.test");
  CHECK(normalize_name("localhost") == "localhost");
  CHECK(normalize_name(std::string(63, 'a') + ".test") == std::string(63, 'a') + ".test");
  CHECK_FALSE(normalize_name(std::string(64, 'a') + ".test"));
  std::string long_name;
  while (long_name.size() < 250) long_name += "abcdefghi.";
  long_name += "abc";  // 253 characters
  CHECK(normalize_name(long_name).has_value());
  CHECK_FALSE(normalize_name(long_name + "x"));
  for (std::string_view bad : {"", ".", "..", ".a.test", "a..test", "a .test", "a*.test", "a/b", "ä.test", "a.test.."}) {
    CHECK_MESSAGE(!normalize_name(bad), bad);
  }
}

TEST_CASE("requests to upgrade a connection to TLS, whose next write is judged as a first hello") {
  auto up = [](std::string_view s) { return tls_upgrade_request(as_bytes(s)); };
  CHECK(up(std::string_view("\0\0\0\x08\x04\xd2\x16\x2f", 8)) == 8u);  // PostgreSQL SSLRequest
  CHECK(up(std::string_view("\0\0\0\x08\x04\xd2\x16\x30", 8)) == 8u);  // GSSENCRequest
  CHECK(up(std::string_view("\0\0\0\x08\x04\xd2\x16\x2e", 8)) == std::nullopt);  // CancelRequest's cousin
  CHECK(up(std::string_view("\0\0\0\x09\x00\x03\x00\x00\x00", 9)) == std::nullopt);  // a startup message
  // MySQL's SSL request: 32 bytes, sequence 1, CLIENT_SSL and CLIENT_PROTOCOL_41.
  std::string mysql("\x20\0\0\x01\x05\xaa\x3f\x00", 8);
  mysql.resize(36, '\0');
  CHECK(up(mysql) == 36u);
  mysql[5] = '\xa2';  // no CLIENT_SSL: a login in the clear
  CHECK(up(mysql) == std::nullopt);
  // LDAP's StartTLS extended request.
  CHECK(up(std::string_view("\x30\x1d\x02\x01\x01\x77\x18\x80\x16" "1.3.6.1.4.1.1466.20037", 31)) == 31u);
  // Command lines, any case, IMAP's tag included.
  CHECK(up("STARTTLS\r\n") == 10u);
  CHECK(up("a1 starttls\r\n") == 13u);
  CHECK(up("STLS\r\n") == 6u);
  CHECK(up("AUTH TLS\r\n") == 10u);
  CHECK(up("auth ssl\n") == 9u);
  CHECK(up("STARTTLS\r\n\x16\x03\x01") == 10u);  // the caller refuses what follows in one write
  CHECK(up("STARTTLS") == std::nullopt);          // not yet a line
  CHECK(up("EHLO lab\r\n") == std::nullopt);
  CHECK(up("MAIL FROM:<starttls@x>\r\n") == std::nullopt);
  CHECK(up(std::string_view("SSH-2.0-OpenSSH_9.2p1\r\n")) == std::nullopt);
}
