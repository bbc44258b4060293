// HTTP/1.x request head parser (src/pin/http_head.h): Host rules, leading
// empty lines, absolute-form, h2c preface, splits and the size cap.
#include <doctest/doctest.h>

#include "pin/http_head.h"

using namespace egressd::pin;

namespace {

Parse parse(std::string_view s) { return parse_http_head(as_bytes(s)); }

std::string name_of(std::string_view s) {
  const Parse p = parse(s);
  if (p.verdict == Verdict::invalid) return "invalid: " + p.reason;
  if (p.verdict == Verdict::need_more) return "need more";
  return p.name ? *p.name : "no name";
}

}  // namespace

TEST_CASE("the Host header names the host; port, case and trailing dot dropped") {
  CHECK(name_of("GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "allowed.test");
  CHECK(name_of("GET /x?y HTTP/1.1\r\nUser-Agent: t\r\nhOsT:Allowed.Test.:8080  \r\nAccept: */*\r\n\r\n") ==
        "allowed.test");
  CHECK(name_of("GET / HTTP/1.0\nHost: allowed.test\n\n") == "allowed.test");  // bare LF endings
  CHECK(name_of("OPTIONS * HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "allowed.test");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: [2001:DB8::1]:80\r\n\r\n") == "2001:db8::1");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: 203.0.113.10\r\n\r\n") == "203.0.113.10");
  // The body that may follow the head is not looked at.
  CHECK(name_of("POST / HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n\r\nHost:") == "allowed.test");
}

TEST_CASE("leading empty lines are tolerated, as servers do") {
  CHECK(name_of("\r\n\r\nGET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "allowed.test");
  CHECK(name_of("\n\r\n\nGET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "allowed.test");
  CHECK(name_of("\r\n") == "need more");
  CHECK(name_of(" GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "invalid: whitespace before the request line");
  CHECK(name_of("\rGET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "invalid: bare CR before the request line");
}

TEST_CASE("absolute-form and CONNECT: the target's authority names the host") {
  CHECK(name_of("GET http://allowed.test:8080/p HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n") == "allowed.test");
  CHECK(name_of("GET HTTP://Allowed.Test HTTP/1.1\r\n\r\n") == "allowed.test");
  CHECK(name_of("GET https://allowed.test?q HTTP/1.1\r\n\r\n") == "allowed.test");
  CHECK(name_of("CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n") == "allowed.test");
  CHECK(name_of("GET http://allowed.test/ HTTP/1.1\r\nHost: same-ip.test\r\n\r\n") ==
        "invalid: Host differs from the request target authority");
  CHECK(name_of("GET http://allowed.test@same-ip.test/ HTTP/1.1\r\nHost: same-ip.test\r\n\r\n") ==
        "invalid: '@' in an absolute-form request target");
  // After the authority's end it is query or path to RFC 3986, and userinfo to a reader that
  // looks for '@' first (HAProxy read same-ip.test: an attack review).
  for (const char* target : {"http://allowed.test?@same-ip.test/", "http://allowed.test/x@same-ip.test",
                             "http://allowed.test#@same-ip.test"}) {
    INFO(target);
    CHECK(name_of(std::string("GET ") + target + " HTTP/1.1\r\nHost: allowed.test\r\n\r\n") ==
          "invalid: '@' in an absolute-form request target");
  }
  CHECK(name_of("CONNECT allowed.test@same-ip.test:443 HTTP/1.1\r\n\r\n") == "invalid: userinfo in the request target");
  CHECK(name_of("GET ftp://allowed.test/ HTTP/1.1\r\n\r\n") == "invalid: request target scheme is not http or https");
  CHECK(name_of("GET http:/// HTTP/1.1\r\n\r\n") == "invalid: malformed request target authority");
}

TEST_CASE("a missing or empty Host is complete with no name; a duplicate or folded one is invalid") {
  CHECK(name_of("GET / HTTP/1.1\r\nAccept: */*\r\n\r\n") == "no name");
  CHECK(name_of("GET / HTTP/1.1\r\nHost:\r\n\r\n") == "no name");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: allowed.test\r\nHOST: same-ip.test\r\n\r\n") ==
        "invalid: duplicate Host header");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: allowed.test\r\n\r\n") ==
        "invalid: duplicate Host header");
  CHECK(name_of("GET / HTTP/1.1\r\nHost:\r\n allowed.test\r\n\r\n") == "invalid: obs-fold line in the request head");
  CHECK(name_of("GET / HTTP/1.1\r\nX-A: 1\r\n\tHost: same-ip.test\r\nHost: allowed.test\r\n\r\n") ==
        "invalid: obs-fold line in the request head");
  CHECK(name_of("GET / HTTP/1.1\r\nHost : allowed.test\r\n\r\n") == "invalid: malformed header field name");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: allowed.test same-ip.test\r\n\r\n") == "invalid: malformed Host header");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: allowed.test:80x\r\n\r\n") == "invalid: malformed Host header");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: [allowed.test]\r\n\r\n") == "invalid: malformed Host header");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: allowed%2etest\r\n\r\n") == "invalid: malformed Host header");
  CHECK(name_of("GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n") == "invalid: bare CR in the request head");
  CHECK(name_of("GET / HTTP/1.1\r\nno colon here\r\n\r\n") == "invalid: header line without a colon");
}

TEST_CASE("the HTTP/2 cleartext preface and non-HTTP/1.x versions are invalid") {
  CHECK(name_of("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") == "invalid: h2c preface");
  CHECK(name_of("PRI * HTTP/2.0") == "invalid: h2c preface");
  CHECK(name_of("\r\nPRI * HTTP/2.0\r\n") == "invalid: h2c preface");
  CHECK(name_of("PRI * HT") == "need more");
  CHECK(name_of("GET /\r\n\r\n") == "invalid: request line without a version (HTTP/0.9)");
  CHECK(name_of("GET / HTTP/2.0\r\nHost: allowed.test\r\n\r\n") == "invalid: request version is not HTTP/1.x");
  CHECK(name_of("GET / RTSP/1.0\r\nHost: allowed.test\r\n\r\n") == "invalid: request version is not HTTP/1.x");
  CHECK(name_of("GET  / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "invalid: malformed request target");
  CHECK(name_of("G(T / HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "invalid: malformed request method");
}

TEST_CASE("the head is waited for until its empty line, at every split") {
  const std::string req = "\r\nGET /index.html HTTP/1.1\r\nHost: allowed.test\r\nUser-Agent: curl/7.88\r\n\r\n";
  for (std::size_t k = 0; k < req.size(); ++k) {
    const Parse p = parse(std::string_view(req).substr(0, k));
    REQUIRE_MESSAGE(p.verdict == Verdict::need_more, "prefix " << k);
    CHECK(p.buffered == k);
  }
  CHECK(name_of(req) == "allowed.test");
}

TEST_CASE("a head of 16 KiB without its end is invalid") {
  std::string req = "GET / HTTP/1.1\r\nHost: allowed.test\r\n";
  while (req.size() < kMaxInspect - 100) req += "X-Filler: " + std::string(80, 'a') + "\r\n";
  CHECK(name_of(req) == "need more");
  while (req.size() < kMaxInspect + 100) req += "X-Filler: " + std::string(80, 'a') + "\r\n";
  CHECK(name_of(req) == "invalid: request head larger than 16384 bytes");
  CHECK(name_of(std::string(kMaxInspect, '\n')) == "invalid: request head larger than 16384 bytes");
}

// ---- Where a request ends: the requests after the first (pin/http_follow.h) ---------------

#include "pin/http_follow.h"

namespace {

// Heads (names, "-" for none) of a stream fed whole, then cut after every byte; "invalid: why"
// last if refused. Both cuts must agree.
std::vector<std::string> follow(std::string_view s) {
  auto run = [&](std::size_t piece) {
    HttpRequestStream st;
    std::vector<std::string> out;
    for (std::size_t off = 0; off < s.size(); off += piece) {
      const auto step = st.feed(as_bytes(s.substr(off, piece)));
      for (const auto& h : step.heads) out.push_back(h ? *h : "-");
      if (step.invalid) {
        out.push_back("invalid: " + *step.invalid);
        break;
      }
    }
    return out;
  };
  const auto whole = run(s.size() + 1);
  CHECK(run(1) == whole);
  return whole;
}

using V = std::vector<std::string>;

}  // namespace

TEST_CASE("a head says where its body ends: Content-Length, chunked, or no body") {
  auto head = [](std::string_view s) { return read_http_head(as_bytes(s)); };
  const auto none = head("GET / HTTP/1.1\r\nHost: a.test\r\n\r\nrest");
  CHECK(none.parse.verdict == Verdict::complete);
  CHECK(none.size == 32);
  CHECK(none.body == HttpHead::Body::none);
  const auto len = head("\r\nPOST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 12\r\n\r\n");
  CHECK(len.size == 55);
  CHECK(len.body == HttpHead::Body::length);
  CHECK(len.length == 12);
  CHECK(head("POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n").body == HttpHead::Body::chunked);
  CHECK(head("GET / HTTP/1.1\r\nContent-Length: 0\r\n\r\n").body == HttpHead::Body::none);
  // Framing two servers could read two ways is refused.
  auto why = [&](std::string_view s) { return head(s).parse.reason; };
  CHECK(why("POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n") ==
        "more than one Transfer-Encoding or Content-Length");
  CHECK(why("POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n") ==
        "more than one Transfer-Encoding or Content-Length");
  CHECK(why("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n") == "Transfer-Encoding other than chunked");
  CHECK(why("POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n") == "malformed Content-Length");
  CHECK(why("POST / HTTP/1.1\r\nContent-Length: 1234567890123456789\r\n\r\n") == "malformed Content-Length");
  CHECK(why("GET / HTTP/1.1\r\nContent-Length: 3\r\n\r\n") == "a body on a GET, HEAD, TRACE or CONNECT request");
  CHECK(why("HEAD / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") ==
        "a body on a GET, HEAD, TRACE or CONNECT request");
}

TEST_CASE("later requests: each head is found after the body before it, at every cut") {
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n") ==
        V{"a.test", "b.test"});
  // A body that looks like a request is a body.
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 33\r\n\r\n"
               "GET / HTTP/1.1\r\nHost: b.test\r\n\r\n"
               "GET / HTTP/1.1\r\nHost: c.test\r\n\r\n") == V{"a.test", "c.test"});
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n"
               "5;ext=1\r\nGET /\r\n1B\r\n HTTP/1.1\r\nHost: b.test\r\n\r\n\r\n0\r\nX-T: 1\r\n\r\n"
               "GET http://c.test/ HTTP/1.1\r\n\r\n"
               "GET / HTTP/1.1\r\n\r\n") == V{"a.test", "c.test", "-"});
  // A head still incomplete is no head yet.
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n") == V{"a.test"});
}

// The stream with every byte that is not framing (body, chunk data) replaced by '.', fed in
// pieces of `piece` bytes.
std::string framing_of(std::string_view s, std::size_t piece) {
  HttpRequestStream st;
  std::string out(s.size(), '.');
  for (std::size_t off = 0; off < s.size(); off += piece) {
    const auto step = st.feed(as_bytes(s.substr(off, piece)));
    REQUIRE(!step.invalid);
    for (std::size_t i = 1; i < step.framing.size(); ++i) CHECK(step.framing[i - 1].second < step.framing[i].first);
    for (const auto& [from, to] : step.framing) {
      for (std::size_t i = from; i < to; ++i) out[off + i] = s[off + i];
    }
  }
  return out;
}

TEST_CASE("later requests: the framing (heads, chunk lines, trailers) is told from body bytes, at every cut") {
  const std::string head = "POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\n";
  const std::string chunked = "POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string get = "GET / HTTP/1.1\r\nHost: b.test\r\n\r\n";
  const std::string s = head + "HELLO" + chunked + "3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n" + get;
  const std::string want = head + "....." + chunked + "3\r\n...\r\n0\r\nX-T: 1\r\n\r\n" + get;
  for (std::size_t piece : {s.size(), std::size_t{1}, std::size_t{7}}) CHECK(framing_of(s, piece) == want);
}

TEST_CASE("later requests: what cannot be read as requests is refused, naming why") {
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n\x81\x85junk\r\n\r\n") ==
        V{"a.test", "invalid: a later request on the connection: malformed request line"});
  // HTTP/0.9 has no head to end: a server answers its request line alone.
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\nGET http://b.test/\r\n") ==
        V{"a.test", "invalid: a later request on the connection: request line without a version (HTTP/0.9)"});
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: b") == V{"a.test"});
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\nPRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") ==
        V{"a.test", "invalid: a later request on the connection: h2c preface"});
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n") ==
        V{"a.test", "invalid: malformed http chunk size"});
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc") ==
        V{"a.test", "invalid: http chunk line without CRLF"});
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n") ==
        V{"a.test", "invalid: no CRLF after an http chunk"});
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nno colon\r\n") ==
        V{"a.test", "invalid: malformed http trailer line"});
  CHECK(follow("POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n1000000000000000\r\n") ==
        V{"a.test", "invalid: malformed http chunk size"});
  CHECK(follow("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n" + std::string(kMaxInspect + 1, 'x')) ==
        V{"a.test", "invalid: a later request on the connection: request head larger than 16384 bytes"});
}

TEST_CASE("later requests: bytes let through unread are fine only inside a body of known length") {
  HttpRequestStream s;
  CHECK(s.feed(as_bytes("POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 100\r\n\r\nab")).heads.size() == 1);
  CHECK(!s.skip(90));
  CHECK(s.skip(9).has_value());  // 8 left
  HttpRequestStream t;
  (void)t.feed(as_bytes("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"));
  CHECK(t.skip(1).has_value());
  CHECK(!t.skip(0));
}
