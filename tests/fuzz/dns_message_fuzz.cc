// libFuzzer target for the DNS message reader (src/dns/message.h): every
// entry point the proxy feeds with untrusted bytes, plus properties that
// must hold for any input:
//  - nothing reads out of bounds (run with ASan/UBSan);
//  - a parsed question name re-encodes with build_query and parses back to
//    the same canonical text (escaping is lossless and unambiguous);
//  - a chain walk starts at the asked name, never exceeds its cap, and
//    only addresses at its end are reported, with TTLs below 2^31.
// Both parse paths run on every input: parse_query (what the sandbox sends)
// and parse_answer (what an upstream, possibly one the sandbox controls
// through an allowed wildcard name, sends back), including CNAME chains and
// compression pointers; see corpus/dns_message/ for seeds of each.
// Issue 14 adds, for any input:
//  - the query egressd forwards (build_forward_query) parses back to the
//    same question, carries one bare OPT and nothing else of the client's,
//    and only an answer with the exact case echoes it (0x20);
//  - cap_ttls leaves no TTL above the cap (and is idempotent), and
//    strip_trailing_opt leaves a message that still walks;
//  - every learned address gets a consistent learn-guard verdict;
//  - the same bytes read as a resolv.conf: nameserver and "# ExtServers:"
//    parsing (Docker's comment) yields addresses only.
// Build and run: see tests/fuzz/build.sh.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "dns/message.h"
#include "dns/proxy.h"

using namespace egressd::dns;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Bytes msg(data, size);

  const ParsedQuery q = parse_query(msg);
  if (q.question_end > size) std::abort();
  if (q.status == QueryStatus::ok) {
    auto rebuilt = build_query(q.header.id, q.question.name, q.question.qtype);
    if (!rebuilt.ok()) std::abort();
    const ParsedQuery again = parse_query(rebuilt.value());
    if (again.status != QueryStatus::ok || again.question.name != q.question.name) std::abort();
  }
  if (q.status == QueryStatus::ok) {
    // The case bits come from the input too, so the fuzzer explores them.
    std::array<std::uint8_t, kCaseBits> bits{};
    for (std::size_t i = 0; i < bits.size() && i < size; ++i) bits[i] = data[size - 1 - i];
    const ForwardQuery f = build_forward_query(q, msg, 0x5A5A, bits);
    const ParsedQuery back = parse_query(f.wire);
    if (back.status != QueryStatus::ok || back.question.name != q.question.name ||
        back.question.qtype != q.question.qtype || back.question_end != f.question_end) {
      std::abort();
    }
    const auto h = read_header(f.wire);
    if (!h || h->id != 0x5A5A || (h->flags & ~0x0110) != 0 || h->arcount != 1 || h->ancount != 0 ||
        h->nscount != 0 || f.wire.size() != f.question_end + 11 || back.dnssec_ok != q.dnssec_ok || !back.edns) {
      std::abort();
    }
    // As an answer (QR set) it echoes itself; with one letter's case flipped it does not.
    std::vector<std::uint8_t> ans = f.wire;
    ans[2] |= 0x80;
    const Bytes question = Bytes(f.wire).subspan(kHeaderSize, f.question_end - kHeaderSize);
    if (!echoes_query(ans, 0x5A5A, question)) std::abort();
    for (std::size_t i = kHeaderSize; i < f.question_end - 4; ++i) {
      const std::uint8_t c = ans[i];
      if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') {
        ans[i] ^= 0x20;
        if (echoes_query(ans, 0x5A5A, question)) std::abort();
        break;
      }
    }
  }
  {
    std::vector<std::uint8_t> capped(data, data + size);
    if (cap_ttls(capped, 3600).ok()) {
      std::vector<std::uint8_t> twice = capped;
      if (!cap_ttls(twice, 3600).ok() || twice != capped) std::abort();
    }
    std::vector<std::uint8_t> stripped(data, data + size);
    if (strip_trailing_opt(stripped)) {
      if (stripped.size() + 11 > size || !cap_ttls(stripped, 3600).ok()) std::abort();
    }
  }
  if (q.question_end != 0) {
    const auto local = make_local_answer(msg, q.header, q.question_end, Rcode::refused);
    if (local.size() != q.question_end) std::abort();
    const auto t = make_truncated(msg, msg.subspan(kHeaderSize, q.question_end - kHeaderSize));
    (void)t;
  }

  // Answers: the proxy walks the chain from the name the client asked, which
  // is the answer's own question when the upstream is honest. A response
  // (QR set) is not a query, so take the name from its question; fall back
  // to a fixed name so a chain that does not start there is also walked.
  std::string qname = "www.example.org";
  if (q.question_end != 0) {
    qname = q.question.name;
  } else if (auto n = read_name(msg, kHeaderSize); n.ok()) {
    qname = n->text;
  }
  auto a = parse_answer(msg, qname);
  if (a.ok()) {
    if (a->chain.empty() || a->chain.front() != qname) std::abort();
    if (a->chain.size() > kMaxChain + 1) std::abort();
    if (a->chain_too_long && !a->addresses.empty()) std::abort();
    if (a->addresses.size() > a->header.ancount) std::abort();
    // A chain that ends on its own follows each record at most once; a loop
    // revisits records until the cap and is flagged instead.
    if (!a->chain_too_long && a->chained_records > a->header.ancount) std::abort();
    if (a->question_end > size) std::abort();
    for (const auto& ad : a->addresses) {
      if (ad.addr.family != 4 && ad.addr.family != 6) std::abort();
      if (ad.ttl & 0x80000000u) std::abort();
      const auto g = learn_guard(ad.addr);
      if (is_rebinding_target(ad.addr) != (g && !g->private_range)) std::abort();
      if (guard_for(ad.addr, true, egressd::PrivateAnswers::exact).has_value() != is_rebinding_target(ad.addr)) {
        std::abort();
      }
      if (guard_for(ad.addr, false, egressd::PrivateAnswers::exact).has_value() != g.has_value()) std::abort();
    }
    std::vector<std::uint8_t> copy(data, data + size);
    restore_client_view(copy, a->question_end, 0x1234, msg.subspan(kHeaderSize, a->question_end - kHeaderSize));
  }

  // Names at a few offsets, as record owners and CNAME targets are read.
  for (std::size_t off = 0; off < size && off < 64; off += 7) (void)read_name(msg, off);
  (void)question_end(msg);

  // The same bytes as a resolv.conf.
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const auto& ns : nameservers_from_resolv_conf(text)) {
    if (!egressd::parse_ip(ns)) std::abort();
  }
  const ExtServers ext = ext_servers_from_resolv_conf(text);
  for (const auto& t : ext.targets) {
    if (!egressd::parse_ip(t)) std::abort();
  }
  for (const auto& t : ext.host_side) {
    if (!egressd::parse_ip(t)) std::abort();
  }
  if (!ext.present && (!ext.targets.empty() || !ext.host_side.empty())) std::abort();
  return 0;
}
