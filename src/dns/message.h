// DNS messages (RFC 1035, RFC 6891 for OPT): a bounds-checked reader for the
// parts egressd acts on and a writer for the few messages it builds itself.
//
// Every byte parsed here may come from the untrusted sandbox (queries) or
// from an answer shaped by a name server the sandbox controls (answers to an
// allowed wildcard name). Nothing throws; every read is bounds-checked;
// failures are values naming the offset.
//
// Names are returned in one canonical text form: labels joined by '.',
// ASCII lower-cased, no trailing dot ("" is the root). Bytes outside
// [a-z0-9_-] are written as \DDD (decimal), so a label that contains a dot
// ("a.b" in one label) can never pose as two labels to the matcher, and a
// name can never inject spaces, '=' or newlines into a log line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::dns {

using Bytes = std::span<const std::uint8_t>;

inline constexpr std::size_t kHeaderSize = 12;
// RFC 1035 §2.3.4: a name is at most 255 octets on the wire, labels 63.
inline constexpr std::size_t kMaxNameWire = 255;
inline constexpr std::size_t kMaxLabel = 63;
// Longest CNAME chain followed from the query name; longer chains (and
// loops) are not followed and nothing from them is learned.
inline constexpr std::size_t kMaxChain = 16;
// Classic UDP limit without EDNS (RFC 1035 §4.2.1), and the largest UDP
// answer egressd relays (what c-ares can receive, and beyond the usual
// 1232-byte recommendation anyway).
inline constexpr std::size_t kClassicUdpSize = 512;
inline constexpr std::size_t kMaxUdpSize = 4096;
inline constexpr std::size_t kMaxMessage = 65535;

namespace qtype {
inline constexpr std::uint16_t A = 1, NS = 2, CNAME = 5, SOA = 6, PTR = 12, MX = 15, TXT = 16, AAAA = 28,
                               OPT = 41, IXFR = 251, AXFR = 252, ANY = 255;
}  // namespace qtype
inline constexpr std::uint16_t kClassIN = 1;

enum class Rcode : std::uint8_t { noerror = 0, formerr = 1, servfail = 2, nxdomain = 3, notimp = 4, refused = 5 };
// "NOERROR", "FORMERR", ...; "RCODE<n>" for others.
std::string to_string(Rcode rcode);

struct Header {
  std::uint16_t id = 0;
  std::uint16_t flags = 0;
  std::uint16_t qdcount = 0, ancount = 0, nscount = 0, arcount = 0;

  bool qr() const { return (flags & 0x8000) != 0; }
  std::uint8_t opcode() const { return static_cast<std::uint8_t>((flags >> 11) & 0xF); }
  bool tc() const { return (flags & 0x0200) != 0; }
  bool rd() const { return (flags & 0x0100) != 0; }
  Rcode rcode() const { return static_cast<Rcode>(flags & 0xF); }
};

// The 12-byte header; nullopt when the message is shorter.
std::optional<Header> read_header(Bytes msg);

// A name read from a message: canonical text (see above) and the offset just
// past the name where it was found (after the first compression pointer).
struct Name {
  std::string text;
  std::size_t end = 0;
  bool compressed = false;  // a compression pointer was followed
};

// Reads the name at `offset`. Compression pointers must point strictly before
// the start of the part of the name being read (so every jump goes further
// back and loops are impossible); at most 255 wire bytes, labels <= 63, label
// types 0x40/0x80 rejected. Error (invalid) names the offset and the reason.
Result<Name> read_name(Bytes msg, std::size_t offset);

struct Question {
  std::string name;  // canonical text
  std::uint16_t qtype = 0;
  std::uint16_t qclass = 0;
};

// What parse_query found, and what the proxy must do about it.
enum class QueryStatus {
  ok,       // one well-formed question: decide and forward or answer
  drop,     // shorter than a header, a response (QR set), or no readable question: no answer at all
  formerr,  // header readable but the query is malformed: answer FORMERR
  notimp,   // an opcode other than QUERY, or a zone transfer: answer NOTIMP
};

struct ParsedQuery {
  QueryStatus status = QueryStatus::drop;
  std::string reason;  // why, when status != ok (for logs)
  Header header;       // valid unless the message was shorter than a header
  // Valid when question_end != 0: the question, and the offset just past it
  // (the raw question is bytes [kHeaderSize, question_end)). Echoed in every
  // local answer.
  Question question;
  std::size_t question_end = 0;
  // The requester's UDP payload size from its OPT record, clamped to
  // [512, kMaxUdpSize]; 512 without EDNS.
  std::size_t udp_size = kClassicUdpSize;
  bool edns = false;       // the query carried an OPT record
  bool dnssec_ok = false;  // ... with the DO bit set
};

// Parses a query from the sandbox. Only QUERY with exactly one question, no
// answer/authority records, well-formed additional records (at most one OPT)
// and no trailing bytes is `ok`; qdcount != 1 is formerr; a question that
// cannot be read is drop (there is nothing to echo).
ParsedQuery parse_query(Bytes msg);

// One address at the end of a CNAME chain, with its TTL as answered (RFC 2181
// §8: a TTL with the top bit set counts as 0).
struct ChainAddress {
  IpPrefix addr;
  std::uint32_t ttl = 0;
};

struct ParsedAnswer {
  Header header;
  Question question;  // the answer's question (qdcount must be 1)
  std::size_t question_end = 0;  // offset just past it
  // The names followed: qname first, then each CNAME target in order.
  std::vector<std::string> chain;
  // A/AAAA (class IN) owned by the last name of the chain. Empty when the
  // chain was longer than kMaxChain (or looped).
  std::vector<ChainAddress> addresses;
  // Answer records that chain from qname (CNAMEs followed + addresses); the
  // rest of the answer section is ignored for learning.
  std::size_t chained_records = 0;
  bool chain_too_long = false;
};

// Parses an answer to a query for `qname` (canonical text) and walks its
// answer section: starting at qname, follows CNAMEs (case-insensitively, any
// record order) up to kMaxChain, and collects the A/AAAA of the final name.
// Records that do not chain from qname are ignored. Error (invalid) when the
// header, question or answer section is malformed, qdcount != 1, or QR is
// not set.
Result<ParsedAnswer> parse_answer(Bytes msg, std::string_view qname);

// A locally built answer to a query: ID, opcode, RD and CD echoed, QR and RA
// set, `rcode`, and the query's raw question (bytes [12, question_end) of
// `query`) echoed when question_end != 0, else no question.
std::vector<std::uint8_t> make_local_answer(Bytes query, const Header& header, std::size_t question_end, Rcode rcode);

// Header plus question of `answer` with TC set and no records: what a UDP
// client gets when the full answer does not fit its payload size (it retries
// over TCP). `question` are the raw question bytes to echo.
std::vector<std::uint8_t> make_truncated(Bytes answer, Bytes question);

// Rewrites the ID (first two bytes) in place. No-op on a message shorter than 2 bytes.
void set_id(std::span<std::uint8_t> msg, std::uint16_t id);

// Restores what the client sent in an upstream answer: its ID and, when the
// answer's question has the same wire length and matches case-insensitively,
// its exact question bytes (so 0x20-style mixed case is echoed back).
// `answer_question_end` is the offset just past the answer's question.
void restore_client_view(std::span<std::uint8_t> answer, std::size_t answer_question_end, std::uint16_t id,
                         Bytes client_question);

// Offset just past the question of a message with qdcount == 1; 0 when not readable.
std::size_t question_end(Bytes msg);

// Builds a recursive query (RD set) for `name` (canonical text, \DDD escapes
// allowed) with the given ID. Error (invalid) when the name is not valid
// (empty label, label > 63, > 255 wire bytes, bad escape).
Result<std::vector<std::uint8_t>> build_query(std::uint16_t id, std::string_view name, std::uint16_t type);

// ---- the query egressd forwards (issue 14, class 8) ----------------------

// The UDP payload size egressd advertises upstream in its OPT record.
inline constexpr std::uint16_t kUpstreamPayload = kMaxUdpSize;
// Random bytes build_forward_query consumes for 0x20: one bit per byte of a
// name of up to 255 bytes.
inline constexpr std::size_t kCaseBits = 32;

// The query egressd sends upstream for a client's query `q` (status ok, read
// from `client`): a new message built from the parsed question only. ID `id`;
// RD and CD copied from the client, every other flag clear; the question name
// with each letter's case taken from one bit of `case_bits` (0x20, so an
// answer must echo bytes the sandbox never saw); type and class as asked; one
// OPT record with kUpstreamPayload and the client's DO bit, no options. Nothing
// else of the client's message (its ID, other flags, additional records, EDNS
// options) reaches the upstream. `question_end` is the offset just past the
// question in the result.
struct ForwardQuery {
  std::vector<std::uint8_t> wire;
  std::size_t question_end = 0;
};
ForwardQuery build_forward_query(const ParsedQuery& q, Bytes client, std::uint16_t id,
                                 std::span<const std::uint8_t, kCaseBits> case_bits);
// The same with the question's case kept as the client wrote it (a relayed
// copy of egressd's own query, whose case egressd chose).
ForwardQuery build_forward_query(const ParsedQuery& q, Bytes client, std::uint16_t id);

// Rewrites the letters of the uncompressed name at the start of `name_wire`
// (length-prefixed labels up to the root label) to the case given by
// successive bits of `case_bits`: 1 upper, 0 lower. Non-letters are untouched.
void apply_0x20(std::span<std::uint8_t> name_wire, std::span<const std::uint8_t, kCaseBits> case_bits);

// True when `answer` is an answer (QR set) with `id`, qdcount 1, and question
// bytes exactly `question` (the bytes [12, question_end) of the query sent):
// same name byte for byte, case included, same type and class. This is the
// 0x20 check: a forger who did not see the query cannot echo its case.
bool echoes_query(Bytes answer, std::uint16_t id, Bytes question);

// ---- answers relayed to the sandbox --------------------------------------

// Caps every TTL of the answer, authority and additional sections at
// `max_ttl` in place; a TTL with the top bit set becomes 0 (RFC 2181 §8). OPT
// records (whose TTL field holds EDNS flags) are left alone. Error (invalid)
// when the message cannot be walked, or when a compression pointer points
// into a TTL that had to change (a record's owner or a CNAME target would
// read differently); then nothing is guaranteed about it and it must not be
// relayed.
Status cap_ttls(std::span<std::uint8_t> msg, std::uint32_t max_ttl);

// Removes an OPT record that is the last record of `msg` (where name servers
// put it), adjusting arcount: for a client that sent no OPT (RFC 6891 §7: no
// OPT in answers to queries without one). Returns whether one was removed.
// An OPT elsewhere is left (nothing after it could be moved safely).
bool strip_trailing_opt(std::vector<std::uint8_t>& msg);

// ---- learn guards (DESIGN §1 rebinding guard; issue 14, class 7) ----------

// Why an address from a DNS answer is not learned.
struct LearnGuard {
  // The guarded range the address (or the IPv4 address embedded in it) is
  // in: "127.0.0.0/8 (loopback)", "10.0.0.0/8 (private)", ...
  std::string_view range;
  // 10/8, 172.16/12, 192.168/16, 100.64/10 (CGNAT), fc00::/7 and their
  // embedded forms: addresses a wildcard's zone must not point into (they
  // reach the host's network), which exact names may (Compose service names
  // resolve to private addresses). Every other guard applies to every name.
  bool private_range = false;
  // How an IPv4 address was embedded in an IPv6 one, or "": "IPv4-mapped
  // ::ffff:0:0/96", "NAT64 64:ff9b::/96", "6to4 2002::/16", ...
  std::string_view embedded;
  // "127.0.0.0/8 (loopback)", or "127.0.0.0/8 (loopback) in NAT64 64:ff9b::/96".
  std::string to_string() const;
};

// The guard `addr` falls under, if any: 0.0.0.0/8, 127.0.0.0/8,
// 169.254.0.0/16 (cloud metadata 169.254.169.254 included), 224.0.0.0/4
// (multicast), 240.0.0.0/4 (reserved, 255.255.255.255 included), and the
// private ranges 10/8, 172.16/12, 192.168/16, 100.64/10; ::, ::1, fe80::/10,
// ff00::/8, fd00:ec2::254 (AWS IMDS), fc00::/7 (private); and every guarded
// IPv4 range embedded in IPv6 as IPv4-mapped (::ffff:0:0/96),
// IPv4-translated (::ffff:0:0:0/96), IPv4-compatible (::/96), NAT64
// (64:ff9b::/96), 6to4 (2002::/16) or a Teredo client (2001::/32).
std::optional<LearnGuard> learn_guard(const IpPrefix& addr);

// The guard that stops `addr` from being learned for a name matched by an
// exact entry (`exact_match`) or only by a wildcard; nullopt when it may be
// learned. Private ranges stop only wildcard matches, unless `private_answers`
// is allow.
std::optional<LearnGuard> guard_for(const IpPrefix& addr, bool exact_match, PrivateAnswers private_answers);

// True for addresses no answer may add for any name: learn_guard() but not
// a private range.
bool is_rebinding_target(const IpPrefix& addr);

}  // namespace egressd::dns
