// DNS wire format (RFC 1035 and the parts of 6891 egressd needs): the
// bounds-checked reader for what the sandbox sends and the upstream answers,
// and the writers for what egressd sends.
//
// Over 500 lines because every parse of untrusted bytes is in this one file
// (fuzzed as a unit by tests/fuzz/dns_message_fuzz.cc): header, names with
// compression, questions, records, answers, TTL capping, 0x20 case handling
// and the learn guards. Each function checks its own offsets; nothing outside
// reads a raw packet.
#include "dns/message.h"

#include <algorithm>
#include <cstring>

namespace egressd::dns {

namespace {

std::uint16_t get16(Bytes msg, std::size_t off) {
  return static_cast<std::uint16_t>((msg[off] << 8) | msg[off + 1]);
}

std::uint32_t get32(Bytes msg, std::size_t off) {
  return (std::uint32_t{msg[off]} << 24) | (std::uint32_t{msg[off + 1]} << 16) | (std::uint32_t{msg[off + 2]} << 8) |
         std::uint32_t{msg[off + 3]};
}

void put16(std::vector<std::uint8_t>& out, std::uint16_t v) {
  out.push_back(static_cast<std::uint8_t>(v >> 8));
  out.push_back(static_cast<std::uint8_t>(v & 0xFF));
}

Error at(std::size_t offset, std::string_view what) {
  return Error::invalid("dns: " + std::string(what) + " at offset " + std::to_string(offset));
}

// One label byte in canonical text form.
void append_label_byte(std::string& out, std::uint8_t c) {
  if (c >= 'A' && c <= 'Z') c = static_cast<std::uint8_t>(c - 'A' + 'a');
  if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_') {
    out.push_back(static_cast<char>(c));
    return;
  }
  out.push_back('\\');
  out.push_back(static_cast<char>('0' + c / 100));
  out.push_back(static_cast<char>('0' + (c / 10) % 10));
  out.push_back(static_cast<char>('0' + c % 10));
}

// A resource record's fixed part, with the owner already read.
struct RecordHead {
  std::uint16_t type = 0, klass = 0;
  std::uint32_t ttl = 0;
  std::size_t rdata = 0, rdlen = 0, end = 0;
};

// Reads type/class/ttl/rdlength after an owner name ending at `off`, and
// checks the rdata fits.
Result<RecordHead> read_record_head(Bytes msg, std::size_t off) {
  if (msg.size() - off < 10) return at(off, "truncated record");
  RecordHead h;
  h.type = get16(msg, off);
  h.klass = get16(msg, off + 2);
  h.ttl = get32(msg, off + 4);
  h.rdlen = get16(msg, off + 8);
  h.rdata = off + 10;
  if (msg.size() - h.rdata < h.rdlen) return at(off, "record data runs past the end");
  h.end = h.rdata + h.rdlen;
  return h;
}

struct QuestionAt {
  Question question;
  std::size_t end = 0;  // offset just past the question
  bool compressed = false;
};

// Reads one question at `off` (name, type, class).
Result<QuestionAt> read_question(Bytes msg, std::size_t off) {
  auto name = read_name(msg, off);
  if (!name) return name.error();
  const std::size_t p = name->end;
  if (msg.size() - p < 4) return at(p, "truncated question");
  QuestionAt q;
  q.question.name = std::move(name->text);
  q.question.qtype = get16(msg, p);
  q.question.qclass = get16(msg, p + 2);
  q.end = p + 4;
  q.compressed = name->compressed;
  return q;
}

struct NameWalk {
  std::size_t end = 0;
  bool compressed = false;
};

// The walk of a name that read_name and skip_name share (the same checks,
// the same errors); `on_label` gets each label's bytes in order.
template <class OnLabel>
Result<NameWalk> walk_name(Bytes msg, std::size_t offset, OnLabel&& on_label) {
  NameWalk out;
  std::size_t pos = offset;
  // Start of the run of labels being read. A pointer must target strictly
  // before it, so each jump lands further back: no loop can form, and the
  // walk ends after at most `offset` jumps. The 255-byte limit below bounds
  // the text as well.
  std::size_t run_start = offset;
  std::size_t wire = 1;  // the root label
  bool jumped = false;
  for (;;) {
    if (pos >= msg.size()) return at(pos, "name runs past the end");
    const std::uint8_t len = msg[pos];
    const std::uint8_t kind = len & 0xC0;
    if (kind == 0xC0) {
      if (msg.size() - pos < 2) return at(pos, "truncated compression pointer");
      const std::size_t target = static_cast<std::size_t>(get16(msg, pos) & 0x3FFF);
      if (target >= run_start) return at(pos, "compression pointer does not point backwards");
      if (!jumped) out.end = pos + 2;
      jumped = true;
      run_start = target;
      pos = target;
      continue;
    }
    if (kind != 0) return at(pos, "unsupported label type");
    if (len == 0) {
      if (!jumped) out.end = pos + 1;
      break;
    }
    // len <= 63 here: the top two bits are clear.
    wire += std::size_t{len} + 1;
    if (wire > kMaxNameWire) return at(offset, "name longer than 255 bytes");
    if (msg.size() - pos - 1 < len) return at(pos, "label runs past the end");
    on_label(msg.subspan(pos + 1, len));
    pos += std::size_t{len} + 1;
  }
  out.compressed = jumped;
  return out;
}

// Where the name at `offset` ends, checked as read_name checks it, without
// building its text: the record walks that only need offsets (cap_ttls,
// strip_trailing_opt) run for every answer (issue 17's CPU per answer).
Result<std::size_t> skip_name(Bytes msg, std::size_t offset) {
  auto w = walk_name(msg, offset, [](Bytes) {});
  if (!w) return w.error();
  return w->end;
}

// Walks the records after the question of a message with qdcount 1 and
// calls fn(owner offset, head, section index 0..2) for each. Error (invalid)
// when a record cannot be read.
template <class Fn>
Status walk_records(Bytes msg, Fn&& fn) {
  auto h = read_header(msg);
  if (!h) return at(0, "shorter than a header");
  if (h->qdcount != 1) return at(4, "qdcount " + std::to_string(h->qdcount));
  auto qname_end = skip_name(msg, kHeaderSize);
  if (!qname_end) return qname_end.error();
  if (msg.size() - *qname_end < 4) return at(*qname_end, "truncated question");
  std::size_t pos = *qname_end + 4;
  const unsigned counts[3] = {h->ancount, h->nscount, h->arcount};
  for (int section = 0; section < 3; ++section) {
    for (unsigned i = 0; i < counts[section]; ++i) {
      auto owner_end = skip_name(msg, pos);
      if (!owner_end) return owner_end.error();
      auto rr = read_record_head(msg, *owner_end);
      if (!rr) return rr.error();
      fn(pos, *rr, section);
      pos = rr->end;
    }
  }
  return {};
}

struct V4Guard {
  std::uint8_t net[4];
  int len;
  std::string_view range;
  bool private_range;
};

// Every IPv4 range no answer may teach (DESIGN §1, issue 14 class 7), most
// specific first where they nest.
constexpr V4Guard kV4Guards[] = {
    {{0, 0, 0, 0}, 8, "0.0.0.0/8 (this network)", false},
    {{127, 0, 0, 0}, 8, "127.0.0.0/8 (loopback)", false},
    {{169, 254, 169, 254}, 32, "169.254.169.254 (cloud metadata)", false},
    {{169, 254, 0, 0}, 16, "169.254.0.0/16 (link-local)", false},
    {{224, 0, 0, 0}, 4, "224.0.0.0/4 (multicast)", false},
    {{255, 255, 255, 255}, 32, "255.255.255.255 (broadcast)", false},
    {{240, 0, 0, 0}, 4, "240.0.0.0/4 (reserved)", false},
    {{10, 0, 0, 0}, 8, "10.0.0.0/8 (private)", true},
    {{172, 16, 0, 0}, 12, "172.16.0.0/12 (private)", true},
    {{192, 168, 0, 0}, 16, "192.168.0.0/16 (private)", true},
    {{100, 64, 0, 0}, 10, "100.64.0.0/10 (shared, CGNAT)", true},
};

bool in_prefix(const std::uint8_t* addr, const std::uint8_t* net, int len) {
  for (int bit = 0; bit < len; ++bit) {
    const int byte = bit / 8, shift = 7 - bit % 8;
    if (((addr[byte] >> shift) & 1) != ((net[byte] >> shift) & 1)) return false;
  }
  return true;
}

std::optional<LearnGuard> v4_guard(const std::uint8_t* b, std::string_view embedded) {
  for (const V4Guard& g : kV4Guards) {
    if (in_prefix(b, g.net, g.len)) return LearnGuard{g.range, g.private_range, embedded};
  }
  return std::nullopt;
}

}  // namespace

std::string to_string(Rcode rcode) {
  switch (rcode) {
    case Rcode::noerror: return "NOERROR";
    case Rcode::formerr: return "FORMERR";
    case Rcode::servfail: return "SERVFAIL";
    case Rcode::nxdomain: return "NXDOMAIN";
    case Rcode::notimp: return "NOTIMP";
    case Rcode::refused: return "REFUSED";
  }
  return "RCODE" + std::to_string(static_cast<unsigned>(rcode));
}

std::optional<Header> read_header(Bytes msg) {
  if (msg.size() < kHeaderSize) return std::nullopt;
  Header h;
  h.id = get16(msg, 0);
  h.flags = get16(msg, 2);
  h.qdcount = get16(msg, 4);
  h.ancount = get16(msg, 6);
  h.nscount = get16(msg, 8);
  h.arcount = get16(msg, 10);
  return h;
}

Result<Name> read_name(Bytes msg, std::size_t offset) {
  Name out;
  out.text.reserve(64);
  auto w = walk_name(msg, offset, [&](Bytes label) {
    if (!out.text.empty()) out.text.push_back('.');  // labels are never empty
    for (const std::uint8_t c : label) append_label_byte(out.text, c);
  });
  if (!w) return w.error();
  out.end = w->end;
  out.compressed = w->compressed;
  return out;
}

ParsedQuery parse_query(Bytes msg) {
  ParsedQuery q;
  auto h = read_header(msg);
  if (!h) {
    q.reason = "shorter than a header";
    return q;
  }
  q.header = *h;
  if (h->qr()) {
    // Never answer an answer: that is how reflection loops start.
    q.reason = "response bit set";
    return q;
  }
  if (h->qdcount != 1) {
    q.status = QueryStatus::formerr;
    q.reason = "qdcount " + std::to_string(h->qdcount);
    return q;
  }
  auto question = read_question(msg, kHeaderSize);
  if (!question) {
    q.reason = question.error().message;
    return q;
  }
  q.question = std::move(question->question);
  std::size_t pos = question->end;
  // In a query nothing precedes the question but the header, so a pointer in
  // it can only point into the header: garbage, and it would point at our
  // own header once echoed in an answer.
  if (question->compressed) {
    q.reason = "compression pointer in the question";
    return q;
  }
  q.question_end = pos;

  if (h->opcode() != 0) {
    q.status = QueryStatus::notimp;
    q.reason = "opcode " + std::to_string(h->opcode());
    return q;
  }
  if (h->ancount != 0 || h->nscount != 0) {
    q.status = QueryStatus::formerr;
    q.reason = "records in the answer/authority section of a query";
    return q;
  }
  bool seen_opt = false;
  for (unsigned i = 0; i < h->arcount; ++i) {
    auto owner = read_name(msg, pos);
    if (!owner) {
      q.status = QueryStatus::formerr;
      q.reason = owner.error().message;
      return q;
    }
    auto rr = read_record_head(msg, owner->end);
    if (!rr) {
      q.status = QueryStatus::formerr;
      q.reason = rr.error().message;
      return q;
    }
    if (rr->type == qtype::OPT) {
      // RFC 6891 §6.1.1: one OPT, owned by the root.
      if (seen_opt || !owner->text.empty()) {
        q.status = QueryStatus::formerr;
        q.reason = "bad OPT record";
        return q;
      }
      // Options must tile the data exactly. A name server answers a broken
      // OPT with FORMERR, and c-ares 1.18 reacts to a FORMERR without OPT by
      // cutting 11 bytes off the query and turning EDNS off for the whole
      // channel: such queries stop here.
      std::size_t o = rr->rdata;
      while (rr->end - o >= 4) {
        const std::size_t olen = get16(msg, o + 2);
        if (rr->end - o - 4 < olen) break;
        o += 4 + olen;
      }
      if (o != rr->end) {
        q.status = QueryStatus::formerr;
        q.reason = "bad EDNS option framing";
        return q;
      }
      seen_opt = true;
      q.edns = true;
      // The TTL field of an OPT: extended rcode, version, then the DO bit.
      q.dnssec_ok = (rr->ttl & 0x8000u) != 0;
      q.udp_size = std::clamp<std::size_t>(rr->klass, kClassicUdpSize, kMaxUdpSize);
    }
    pos = rr->end;
  }
  if (pos != msg.size()) {
    q.status = QueryStatus::formerr;
    q.reason = std::to_string(msg.size() - pos) + " trailing bytes";
    return q;
  }
  if (q.question.qclass != 1) {
    // Only the Internet class: any other (CH, HS, ANY, 0x1234) names nothing
    // the sets hold, and copied to the upstream it would carry 16 bits the
    // sandbox chose in every query for an allowed name (an attack review).
    q.status = QueryStatus::notimp;
    q.reason = "class " + std::to_string(q.question.qclass) + " (only IN is answered)";
    return q;
  }
  if (q.question.qtype == qtype::AXFR || q.question.qtype == qtype::IXFR) {
    // Zone transfers are multi-message streams c-ares cannot relay.
    q.status = QueryStatus::notimp;
    q.reason = "zone transfer";
    return q;
  }
  q.status = QueryStatus::ok;
  return q;
}

Result<ParsedAnswer> parse_answer(Bytes msg, std::string_view qname) {
  auto h = read_header(msg);
  if (!h) return at(0, "answer shorter than a header");
  if (!h->qr()) return at(2, "answer without the response bit");
  if (h->qdcount != 1) return at(4, "answer with qdcount " + std::to_string(h->qdcount));
  ParsedAnswer out;
  out.header = *h;
  auto question = read_question(msg, kHeaderSize);
  if (!question) return question.error();
  out.question = std::move(question->question);
  out.question_end = question->end;
  std::size_t pos = question->end;

  // Read the whole answer section first: records may come in any order, and
  // a malformed section is rejected as a whole rather than half-learned.
  struct Rec {
    std::string owner;
    RecordHead head;
  };
  std::vector<Rec> recs;
  recs.reserve(std::min<std::size_t>(h->ancount, 64));
  for (unsigned i = 0; i < h->ancount; ++i) {
    auto owner = read_name(msg, pos);
    if (!owner) return owner.error();
    auto rr = read_record_head(msg, owner->end);
    if (!rr) return rr.error();
    pos = rr->end;
    // Only class IN CNAME/A/AAAA can take part in the chain.
    if (rr->klass != kClassIN) continue;
    if (rr->type != qtype::CNAME && rr->type != qtype::A && rr->type != qtype::AAAA) continue;
    recs.push_back({std::move(owner->text), *rr});
  }

  std::string current(qname);
  out.chain.push_back(current);
  for (;;) {
    const Rec* cname = nullptr;
    for (const Rec& r : recs) {
      if (r.head.type == qtype::CNAME && r.owner == current) {
        cname = &r;
        break;
      }
    }
    if (cname == nullptr) break;
    if (out.chain.size() > kMaxChain) {
      // Too long, or a loop (a -> b -> a): learn nothing from it.
      out.chain_too_long = true;
      out.addresses.clear();
      return out;
    }
    auto target = read_name(msg, cname->head.rdata);
    if (!target) return target.error();
    if (target->end != cname->head.end) return at(cname->head.rdata, "CNAME data length mismatch");
    ++out.chained_records;
    current = std::move(target->text);
    out.chain.push_back(current);
  }
  for (const Rec& r : recs) {
    if (r.owner != current) continue;
    ChainAddress a;
    if (r.head.type == qtype::A) {
      if (r.head.rdlen != 4) return at(r.head.rdata, "A record with " + std::to_string(r.head.rdlen) + " bytes");
      a.addr.family = 4;
      a.addr.prefix_len = 32;
      std::memcpy(a.addr.bytes.data(), msg.data() + r.head.rdata, 4);
    } else if (r.head.type == qtype::AAAA) {
      if (r.head.rdlen != 16) return at(r.head.rdata, "AAAA record with " + std::to_string(r.head.rdlen) + " bytes");
      a.addr.family = 6;
      a.addr.prefix_len = 128;
      std::memcpy(a.addr.bytes.data(), msg.data() + r.head.rdata, 16);
    } else {
      continue;
    }
    a.ttl = (r.head.ttl & 0x80000000u) != 0 ? 0 : r.head.ttl;
    out.addresses.push_back(a);
    ++out.chained_records;
  }
  return out;
}

std::vector<std::uint8_t> make_local_answer(Bytes query, const Header& header, std::size_t question_end, Rcode rcode) {
  const bool with_question = question_end > kHeaderSize && question_end <= query.size();
  std::vector<std::uint8_t> out;
  out.reserve(with_question ? question_end : kHeaderSize);
  put16(out, header.id);
  // QR, opcode echoed, RD and CD echoed, RA set (egressd is a recursive
  // service to the sandbox), AA/TC/AD clear.
  const std::uint16_t flags = static_cast<std::uint16_t>(0x8000 | (header.flags & 0x7800) | (header.flags & 0x0100) |
                                                         0x0080 | (header.flags & 0x0010) |
                                                         static_cast<std::uint16_t>(rcode));
  put16(out, flags);
  put16(out, with_question ? 1 : 0);
  put16(out, 0);
  put16(out, 0);
  put16(out, 0);
  if (with_question) out.insert(out.end(), query.begin() + kHeaderSize, query.begin() + static_cast<std::ptrdiff_t>(question_end));
  return out;
}

std::vector<std::uint8_t> make_truncated(Bytes answer, Bytes question) {
  std::vector<std::uint8_t> out;
  out.reserve(kHeaderSize + question.size());
  auto h = read_header(answer).value_or(Header{});
  put16(out, h.id);
  put16(out, static_cast<std::uint16_t>(h.flags | 0x0200));
  put16(out, question.empty() ? 0 : 1);
  put16(out, 0);
  put16(out, 0);
  put16(out, 0);
  out.insert(out.end(), question.begin(), question.end());
  return out;
}

void set_id(std::span<std::uint8_t> msg, std::uint16_t id) {
  if (msg.size() < 2) return;
  msg[0] = static_cast<std::uint8_t>(id >> 8);
  msg[1] = static_cast<std::uint8_t>(id & 0xFF);
}

void restore_client_view(std::span<std::uint8_t> answer, std::size_t answer_question_end, std::uint16_t id,
                         Bytes client_question) {
  set_id(answer, id);
  if (answer_question_end > answer.size() || answer_question_end < kHeaderSize) return;
  if (answer_question_end - kHeaderSize != client_question.size()) return;
  auto lower = [](std::uint8_t c) { return (c >= 'A' && c <= 'Z') ? static_cast<std::uint8_t>(c + 32) : c; };
  const std::uint8_t* a = answer.data() + kHeaderSize;
  for (std::size_t i = 0; i < client_question.size(); ++i) {
    if (lower(a[i]) != lower(client_question[i])) return;
  }
  std::memcpy(answer.data() + kHeaderSize, client_question.data(), client_question.size());
}

std::size_t question_end(Bytes msg) {
  auto h = read_header(msg);
  if (!h || h->qdcount != 1) return 0;
  auto q = read_question(msg, kHeaderSize);
  return q ? q->end : 0;
}

Result<std::vector<std::uint8_t>> build_query(std::uint16_t id, std::string_view name, std::uint16_t type) {
  std::vector<std::uint8_t> out;
  out.reserve(kHeaderSize + name.size() + 6);
  put16(out, id);
  put16(out, 0x0100);  // RD
  put16(out, 1);
  put16(out, 0);
  put16(out, 0);
  put16(out, 0);
  auto bad = [&](std::string_view why) {
    return Error::invalid("dns: name \"" + std::string(name) + "\": " + std::string(why));
  };
  std::size_t wire = 1;
  std::size_t i = 0;
  while (i < name.size()) {
    const std::size_t len_at = out.size();
    out.push_back(0);
    std::size_t len = 0;
    while (i < name.size() && name[i] != '.') {
      std::uint8_t c = static_cast<std::uint8_t>(name[i]);
      if (c == '\\') {
        if (name.size() - i < 4) return bad("truncated escape");
        unsigned v = 0;
        for (std::size_t k = 1; k <= 3; ++k) {
          const char d = name[i + k];
          if (d < '0' || d > '9') return bad("bad escape");
          v = v * 10 + static_cast<unsigned>(d - '0');
        }
        if (v > 255) return bad("bad escape");
        c = static_cast<std::uint8_t>(v);
        i += 4;
      } else {
        ++i;
      }
      out.push_back(c);
      if (++len > kMaxLabel) return bad("label longer than 63 bytes");
    }
    if (len == 0) return bad("empty label");
    out[len_at] = static_cast<std::uint8_t>(len);
    wire += len + 1;
    if (wire > kMaxNameWire) return bad("longer than 255 bytes");
    if (i < name.size()) {
      ++i;  // the dot
      if (i == name.size()) return bad("trailing dot");
    }
  }
  out.push_back(0);
  put16(out, type);
  put16(out, kClassIN);
  return out;
}

ForwardQuery build_forward_query(const ParsedQuery& q, Bytes client, std::uint16_t id,
                                 std::span<const std::uint8_t, kCaseBits> case_bits) {
  ForwardQuery out = build_forward_query(q, client, id);
  apply_0x20(std::span(out.wire).subspan(kHeaderSize, out.question_end - kHeaderSize), case_bits);
  return out;
}

ForwardQuery build_forward_query(const ParsedQuery& q, Bytes client, std::uint16_t id) {
  ForwardQuery out;
  auto& w = out.wire;
  const std::size_t qlen = q.question_end > kHeaderSize && q.question_end <= client.size()
                               ? q.question_end - kHeaderSize
                               : 0;
  w.reserve(kHeaderSize + qlen + 11);
  put16(w, id);
  // RD always: the upstream recurses (a client's RD=0 would ask what its
  // cache holds, someone else's lookups, and be one more bit it chose). CD:
  // the client validates DNSSEC itself. Every other bit is egressd's: QR,
  // opcode (QUERY), AA, TC, AD, Z.
  put16(w, static_cast<std::uint16_t>((q.header.flags & 0x0010) | 0x0100));
  put16(w, 1);
  put16(w, 0);
  put16(w, 0);
  put16(w, 1);
  // parse_query accepted the question only uncompressed: the client's bytes
  // are labels, the root label, type and class.
  w.insert(w.end(), client.begin() + kHeaderSize, client.begin() + static_cast<std::ptrdiff_t>(kHeaderSize + qlen));
  out.question_end = w.size();
  // OPT (RFC 6891): root owner, our payload size, extended rcode 0, version
  // 0, the client's DO bit, no options.
  w.push_back(0);
  put16(w, qtype::OPT);
  put16(w, kUpstreamPayload);
  put16(w, 0);
  put16(w, q.dnssec_ok ? 0x8000 : 0);
  put16(w, 0);
  return out;
}

void apply_0x20(std::span<std::uint8_t> name, std::span<const std::uint8_t, kCaseBits> case_bits) {
  std::size_t pos = 0, bit = 0;
  while (pos < name.size()) {
    const std::uint8_t len = name[pos];
    if (len == 0 || (len & 0xC0) != 0) return;
    for (std::size_t i = pos + 1; i <= pos + len && i < name.size(); ++i, ++bit) {
      std::uint8_t c = name[i];
      const bool upper = ((case_bits[(bit / 8) % kCaseBits] >> (bit % 8)) & 1) != 0;
      if (c >= 'a' && c <= 'z' && upper) c = static_cast<std::uint8_t>(c - 32);
      if (c >= 'A' && c <= 'Z' && !upper) c = static_cast<std::uint8_t>(c + 32);
      name[i] = c;
    }
    pos += std::size_t{len} + 1;
  }
}

bool echoes_query(Bytes answer, std::uint16_t id, Bytes question) {
  auto h = read_header(answer);
  if (!h || !h->qr() || h->id != id || h->qdcount != 1) return false;
  if (question.empty() || answer.size() - kHeaderSize < question.size()) return false;
  return std::memcmp(answer.data() + kHeaderSize, question.data(), question.size()) == 0;
}

Status cap_ttls(std::span<std::uint8_t> msg, std::uint32_t max_ttl) {
  struct Write {
    std::size_t at;  // offset of the TTL field
    std::uint32_t ttl;
  };
  std::vector<Write> writes;
  Status st = walk_records(msg, [&](std::size_t, const RecordHead& rr, int) {
    if (rr.type == qtype::OPT) return;
    std::uint32_t ttl = rr.ttl;
    if ((ttl & 0x80000000u) != 0) ttl = 0;
    ttl = std::min(ttl, max_ttl);
    if (ttl != rr.ttl) writes.push_back({rr.rdata - 6, ttl});
  });
  if (!st.ok() || writes.empty()) return st;
  // A compression pointer may point into a TTL field (found by
  // dns_message_fuzz): rewriting the TTL would then rewrite a name. The
  // names that carry meaning (owners, CNAME targets) must read the same
  // after as before, or the message is not relayed at all.
  auto names = [&]() -> Result<std::string> {
    std::string all;
    Status walked = walk_records(msg, [&](std::size_t owner, const RecordHead& rr, int) {
      if (auto n = read_name(msg, owner)) all += n->text;
      all += '|';
      if (rr.type == qtype::CNAME) {
        if (auto n = read_name(msg, rr.rdata)) all += n->text;
      }
      all += '\n';
    });
    if (!walked.ok()) return walked.error();
    return all;
  };
  auto before = names();
  if (!before) return before.error();
  for (const Write& w : writes) {
    std::uint8_t* p = msg.data() + w.at;
    p[0] = static_cast<std::uint8_t>(w.ttl >> 24);
    p[1] = static_cast<std::uint8_t>(w.ttl >> 16);
    p[2] = static_cast<std::uint8_t>(w.ttl >> 8);
    p[3] = static_cast<std::uint8_t>(w.ttl);
  }
  auto after = names();
  if (!after || *after != *before) return at(writes.front().at, "a name points into a TTL field");
  return {};
}

bool strip_trailing_opt(std::vector<std::uint8_t>& msg) {
  std::size_t opt_at = 0, last_end = 0;
  bool last_is_opt = false;
  const Status st = walk_records(msg, [&](std::size_t owner, const RecordHead& rr, int section) {
    last_is_opt = section == 2 && rr.type == qtype::OPT;
    if (last_is_opt) opt_at = owner;
    last_end = rr.end;
  });
  if (!st.ok() || !last_is_opt || last_end != msg.size()) return false;
  msg.resize(opt_at);
  const std::uint16_t ar = static_cast<std::uint16_t>(get16(msg, 10) - 1);
  msg[10] = static_cast<std::uint8_t>(ar >> 8);
  msg[11] = static_cast<std::uint8_t>(ar & 0xFF);
  return true;
}

std::string LearnGuard::to_string() const {
  std::string s(range);
  if (!embedded.empty()) s += " in " + std::string(embedded);
  return s;
}

std::optional<LearnGuard> learn_guard(const IpPrefix& addr) {
  const auto& b = addr.bytes;
  if (addr.family == 4) return v4_guard(b.data(), "");
  if (addr.family != 6) return std::nullopt;
  static constexpr std::uint8_t kZero[16] = {};
  auto prefix = [&](std::initializer_list<std::uint8_t> p) {
    return std::equal(p.begin(), p.end(), b.begin());
  };
  // :: and ::1 before the IPv4-compatible form they also look like.
  if (std::memcmp(b.data(), kZero, 15) == 0 && b[15] == 0) return LearnGuard{":: (unspecified)", false, ""};
  if (std::memcmp(b.data(), kZero, 15) == 0 && b[15] == 1) return LearnGuard{"::1 (loopback)", false, ""};
  // Forms that carry an IPv4 address a translator, relay or dual stack
  // delivers to: judged by that IPv4 address.
  if (std::memcmp(b.data(), kZero, 10) == 0 && b[10] == 0xFF && b[11] == 0xFF) {
    return v4_guard(b.data() + 12, "IPv4-mapped ::ffff:0:0/96");
  }
  if (std::memcmp(b.data(), kZero, 8) == 0 && b[8] == 0xFF && b[9] == 0xFF && b[10] == 0 && b[11] == 0) {
    return v4_guard(b.data() + 12, "IPv4-translated ::ffff:0:0:0/96");
  }
  if (std::memcmp(b.data(), kZero, 12) == 0) return v4_guard(b.data() + 12, "IPv4-compatible ::/96");
  if (prefix({0x00, 0x64, 0xFF, 0x9B, 0, 0, 0, 0, 0, 0, 0, 0})) return v4_guard(b.data() + 12, "NAT64 64:ff9b::/96");
  // The local-use NAT64 prefix (RFC 8215): where its IPv4 address sits
  // depends on the prefix length its operator chose (RFC 6052: /48 ... /96),
  // and a /96 address read as a /48 one holds 0.0.0.0; no layout can be
  // trusted, so none of it is learned, for any name (an attack review found
  // 169.254.169.254 in two layouts learned).
  if (prefix({0x00, 0x64, 0xFF, 0x9B, 0x00, 0x01})) {
    return LearnGuard{"64:ff9b:1::/48 (local-use NAT64: the IPv4 address it carries cannot be told)", false, ""};
  }
  if (prefix({0x20, 0x02})) return v4_guard(b.data() + 2, "6to4 2002::/16");
  if (prefix({0x20, 0x01, 0x00, 0x00})) {
    // Teredo (RFC 4380): the client's IPv4 address, inverted, in the last 32 bits.
    const std::uint8_t client[4] = {static_cast<std::uint8_t>(~b[12]), static_cast<std::uint8_t>(~b[13]),
                                    static_cast<std::uint8_t>(~b[14]), static_cast<std::uint8_t>(~b[15])};
    return v4_guard(client, "Teredo 2001::/32");
  }
  if (b[0] == 0xFE && (b[1] & 0xC0) == 0x80) return LearnGuard{"fe80::/10 (link-local)", false, ""};
  if (b[0] == 0xFF) return LearnGuard{"ff00::/8 (multicast)", false, ""};
  // fd00:ec2::254, the AWS IMDS IPv6 endpoint, inside fc00::/7 but guarded for every name.
  static constexpr std::uint8_t kImds6[16] = {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54};
  if (std::memcmp(b.data(), kImds6, 16) == 0) return LearnGuard{"fd00:ec2::254 (cloud metadata)", false, ""};
  if ((b[0] & 0xFE) == 0xFC) return LearnGuard{"fc00::/7 (private, unique local)", true, ""};
  return std::nullopt;
}

std::optional<LearnGuard> guard_for(const IpPrefix& addr, bool exact_match, PrivateAnswers private_answers) {
  auto g = learn_guard(addr);
  if (!g) return std::nullopt;
  if (g->private_range && (exact_match || private_answers == PrivateAnswers::allow)) return std::nullopt;
  return g;
}

bool is_rebinding_target(const IpPrefix& addr) {
  auto g = learn_guard(addr);
  return g && !g->private_range;
}

}  // namespace egressd::dns
