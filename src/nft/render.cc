// nft(8) text rendering of the model. Output follows `nft list ruleset`
// formatting closely so a golden and a listing are easy to compare by eye.
#include <bit>
#include <cinttypes>
#include <cstdio>
#include <sstream>

#include "nft/model.h"

namespace egressd::nft {

namespace {

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08" PRIx32, v);
  return buf;
}

std::string proto_name(std::uint8_t proto) {
  switch (proto) {
    case 6: return "tcp";
    case 17: return "udp";
    case 1: return "icmp";
    case 58: return "ipv6-icmp";
    default: return std::to_string(proto);
  }
}

std::string icmpv6_type_name(std::uint8_t type) {
  switch (type) {
    case 131: return "mld-listener-report";
    case 132: return "mld-listener-done";
    case 133: return "nd-router-solicit";
    case 134: return "nd-router-advert";
    case 135: return "nd-neighbor-solicit";
    case 136: return "nd-neighbor-advert";
    case 143: return "mld2-listener-report";
    default: return std::to_string(type);
  }
}

// The prefix length when [from, to] is exactly one CIDR block, else -1.
int cidr_len(const IpPrefix& from, const IpPrefix& to) {
  const std::size_t bits = from.size() * 8;
  std::size_t len = bits;
  // Count trailing bits where from has 0 and to has 1.
  while (len > 0) {
    const std::size_t bit = len - 1;
    const std::uint8_t mask = static_cast<std::uint8_t>(0x80u >> (bit % 8));
    const bool f = from.bytes[bit / 8] & mask, t = to.bytes[bit / 8] & mask;
    if (f || !t) break;
    --len;
  }
  for (std::size_t bit = 0; bit < len; ++bit) {
    const std::uint8_t mask = static_cast<std::uint8_t>(0x80u >> (bit % 8));
    if ((from.bytes[bit / 8] & mask) != (to.bytes[bit / 8] & mask)) return -1;
  }
  return static_cast<int>(len);
}

std::string addr_text(const IpPrefix& a) {
  IpPrefix p = a;
  p.prefix_len = static_cast<std::uint8_t>(p.size() * 8);
  return p.to_string();
}

// A duration as nft(8) lists it: days, hours, minutes, seconds and
// milliseconds, the zero ones left out ("1m10s", "40s", "1s500ms").
std::string duration_text(std::uint64_t ms) {
  std::string s;
  const std::pair<std::uint64_t, const char*> units[] = {
      {86'400'000, "d"}, {3'600'000, "h"}, {60'000, "m"}, {1'000, "s"}, {1, "ms"}};
  for (const auto& [size, name] : units) {
    if (ms >= size) {
      s += std::to_string(ms / size) + name;
      ms %= size;
    }
  }
  return s;
}

std::string elem_text(const Set& set, const SetElem& e) {
  std::string s;
  if (!set.interval) {
    s = addr_text(e.from);
  } else {
    const int len = cidr_len(e.from, e.to);
    if (len == static_cast<int>(e.from.size() * 8)) {
      s = addr_text(e.from);
    } else if (len >= 0) {
      s = addr_text(e.from) + "/" + std::to_string(len);
    } else {
      s = addr_text(e.from) + "-" + addr_text(e.to);
    }
  }
  if (e.timeout_ms != 0) s += " timeout " + duration_text(e.timeout_ms);
  // After the timeout (and nft's `expires`, which egressd does not print).
  // Comments egressd writes are learned names: no quote or backslash to escape.
  if (!e.comment.empty()) s += " comment \"" + e.comment + "\"";
  return s;
}

std::string family_kw(SetType t) { return t == SetType::ipv4_addr ? "ip" : "ip6"; }

const char* addr_type_name(AddrType t) {
  switch (t) {
    case AddrType::unicast: return "unicast";
    case AddrType::local: return "local";
    case AddrType::broadcast: return "broadcast";
    case AddrType::anycast: return "anycast";
    case AddrType::multicast: return "multicast";
  }
  return "unspec";
}

// A prefix as nft lists it: the address alone when it is a single address,
// else address/len.
std::string prefix_text(const IpPrefix& p) {
  if (p.prefix_len == p.size() * 8) return addr_text(p);
  return addr_text(p) + "/" + std::to_string(p.prefix_len);
}

struct StmtText {
  std::string operator()(const MatchOifLoopback&) const { return "oif \"lo\""; }
  std::string operator()(const MatchIifLoopback& m) const { return m.negate ? "iif != \"lo\"" : "iif \"lo\""; }
  std::string operator()(const MatchMetaMark& m) const {
    return std::string("meta mark ") + (m.negate ? "!= " : "") + hex32(m.value);
  }
  std::string operator()(const MatchMetaHasSocket&) const { return "meta skuid != 4294967295"; }
  std::string operator()(const MatchMetaPriority& m) const {
    return std::string("meta priority ") + (m.negate ? "!= " : "") + priority_text(m.value);
  }
  std::string operator()(const MatchMetaProtocolArp&) const { return "meta protocol arp"; }
  std::string operator()(const MatchMetaNfproto& m) const {
    return m.family == 4 ? "meta nfproto ipv4" : "meta nfproto ipv6";
  }
  std::string operator()(const MatchCtDirectionReply&) const { return "ct direction reply"; }
  std::string operator()(const MatchCtDirectionOriginal&) const { return "ct direction original"; }
  std::string operator()(const MatchCtStateNew&) const { return "ct state new"; }
  std::string operator()(const MatchCtStateNewOrEstablished&) const { return "ct state established,new"; }
  std::string operator()(const MatchCtStateRelated&) const { return "ct state related"; }
  std::string operator()(const MatchCtStateInvalid&) const { return "ct state invalid"; }
  std::string operator()(const MatchCtStatus& m) const {
    return std::string("ct status ") + (m.negate ? "! " : "") + (m.bit == CtStatusBit::dnat ? "dnat" : "confirmed");
  }
  std::string operator()(const MatchCtMark& m) const { return "ct mark " + hex32(m.value); }
  std::string operator()(const MatchCtMarkNot& m) const {
    if (m.mask == ~std::uint32_t{0}) return "ct mark != " + hex32(m.value);
    // nft lists a mask of leading ones as a prefix length (`ct mark != 0x7ffffffc/30`).
    const int ones = std::countl_one(m.mask);
    if (ones + std::countr_zero(m.mask) == 32) return "ct mark != " + hex32(m.value) + "/" + std::to_string(ones);
    return "ct mark & " + hex32(m.mask) + " != " + hex32(m.value);
  }
  std::string operator()(const MatchTcpFlagSyn&) const { return "tcp flags syn"; }
  std::string operator()(const MatchTcpFlagUrg&) const { return "tcp flags urg"; }
  std::string operator()(const MatchTcpFlagRst&) const { return "tcp flags rst"; }
  std::string operator()(const MatchTcpSynOnly&) const { return "tcp flags syn / syn,ack"; }
  std::string operator()(const MatchL4Proto& m) const {
    return std::string("meta l4proto ") + (m.negate ? "!= " : "") + proto_name(m.proto);
  }
  std::string operator()(const MatchDport& m) const {
    return proto_name(m.proto) + " dport " + std::to_string(m.port);
  }
  std::string operator()(const MatchSport& m) const {
    return proto_name(m.proto) + " sport " + std::to_string(m.port);
  }
  std::string operator()(const MatchLinkIcmpv6& m) const {
    if (m.bare) {
      return "ip6 nexthdr ipv6-icmp ip6 hoplimit " + std::to_string(m.hoplimit) + " icmpv6 type " +
             icmpv6_type_name(m.type);
    }
    return "icmpv6 type " + icmpv6_type_name(m.type) + " ip6 hoplimit " + std::to_string(m.hoplimit);
  }
  std::string operator()(const MatchDaddrSet& m) const { return family_kw(m.type) + " daddr @" + m.set; }
  std::string operator()(const MatchDaddr& m) const {
    return std::string(m.addr.family == 4 ? "ip" : "ip6") + " daddr " + prefix_text(m.addr);
  }
  std::string operator()(const MatchSaddr& m) const {
    return std::string(m.addr.family == 4 ? "ip" : "ip6") + " saddr " + prefix_text(m.addr);
  }
  std::string operator()(const MatchFibAddrType& m) const {
    return std::string("fib ") + (m.daddr ? "daddr" : "saddr") + " type " + (m.negate ? "!= " : "") +
           addr_type_name(m.type);
  }
  std::string operator()(const MatchSocketMark& m) const {
    return std::string("socket mark ") + (m.negate ? "!= " : "") + hex32(m.value);
  }
  // nft shows the cgroup's path, which depends on the reader's mounts: the id
  // is what the kernel holds.
  std::string operator()(const MatchSocketCgroupv2& m) const {
    return "socket cgroupv2 level " + std::to_string(m.level) + (m.negate ? " != " : " ") + std::to_string(m.id);
  }
  std::string operator()(const MatchSaddrSet& m) const { return family_kw(m.type) + " saddr @" + m.set; }
  std::string operator()(const MatchCtOriginalDaddrSet& m) const {
    return "ct original " + family_kw(m.type) + " daddr @" + m.set;
  }
  // As nft lists raw payload matches (a netdev chain has no ip dependency).
  std::string operator()(const MatchFrameSaddr& m) const {
    std::string hex = "0x";
    for (std::size_t i = 0; i < m.addr.size(); ++i) {
      char b[3];
      std::snprintf(b, sizeof b, "%02x", m.addr.bytes[i]);
      hex += b;
    }
    // nft prints the value without leading zeros (::1 is 0x1).
    const auto first = hex.find_first_not_of('0', 2);
    hex = "0x" + (first == std::string::npos ? std::string("0") : hex.substr(first));
    return m.addr.family == 4 ? "@ll,96,16 0x800 @ll,208,32 " + hex : "@ll,96,16 0x86dd @ll,176,128 " + hex;
  }
  // As nft lists a raw payload match: the value in hex, no leading zeros.
  std::string operator()(const MatchFrameBytes& m) const {
    std::string hex;
    for (std::uint8_t b : m.value) {
      char d[3];
      std::snprintf(d, sizeof d, "%02x", b);
      hex += d;
    }
    const auto first = hex.find_first_not_of('0');
    hex = first == std::string::npos ? "0" : hex.substr(first);
    return "@ll," + std::to_string(m.offset * 8) + "," + std::to_string(m.value.size() * 8) +
           (m.negate ? " != 0x" : " 0x") + hex;
  }
  std::string operator()(const MatchIpv6RoutingHeader&) const { return "exthdr rt exists"; }
  std::string operator()(const MatchTcpOption& m) const {
    return m.kind == 34 ? "tcp option fastopen exists" : "tcp option " + std::to_string(m.kind) + " exists";
  }
  std::string operator()(const MatchUdpLongHeader&) const { return "@th,64,8 & 0x80 == 0x80"; }
  std::string operator()(const MatchMetaLengthOver& m) const { return "meta length > " + std::to_string(m.bytes); }
  std::string operator()(const MatchTcpHeaderOnly& m) const {
    const std::string doff = " tcp doff " + std::to_string(m.doff);
    if (m.family == 4) return "ip hdrlength 5 ip length " + std::to_string(20 + 4 * m.doff) + doff;
    return "ip6 length " + std::to_string(4 * m.doff) + " ip6 nexthdr tcp" + doff;
  }
  std::string operator()(const MatchIpv4Options&) const { return "ip hdrlength != 5"; }
  std::string operator()(const StmtCounter& c) const {
    if (!c.listed) return "counter";
    return "counter packets " + std::to_string(c.packets) + " bytes " + std::to_string(c.bytes);
  }
  std::string operator()(const StmtLimit& s) const {
    std::string t = "limit rate " + std::to_string(s.per_second) + "/second";
    if (s.burst != 5) t += " burst " + std::to_string(s.burst) + " packets";
    return t;
  }
  std::string operator()(const StmtLog& s) const { return "log group " + std::to_string(s.group); }
  std::string operator()(const StmtCtMarkSet& s) const { return "ct mark set " + hex32(s.value); }
  std::string operator()(const StmtMetaMarkSet& s) const { return "meta mark set " + hex32(s.value); }
  std::string operator()(const StmtMetaPrioritySet& s) const { return "meta priority set " + priority_text(s.value); }
  std::string operator()(const StmtMetaMarkSetCtId&) const { return "meta mark set ct id"; }
  std::string operator()(const StmtRedirect& s) const { return "redirect to :" + std::to_string(s.port); }
  std::string operator()(const StmtRejectTcpReset&) const { return "reject with tcp reset"; }
  std::string operator()(const StmtRejectAdminProhibited&) const { return "reject with icmpx admin-prohibited"; }
  std::string operator()(const StmtQueue& q) const { return "queue num " + std::to_string(q.num); }
  std::string operator()(const StmtVerdict& v) const {
    switch (v.kind) {
      case VerdictKind::accept: return "accept";
      case VerdictKind::drop: return "drop";
      case VerdictKind::jump: return "jump " + v.chain;
      case VerdictKind::goto_: return "goto " + v.chain;
      case VerdictKind::return_: return "return";
    }
    return "";
  }
};

void render_set(std::ostringstream& out, const Set& set) {
  out << "\tset " << set.name << " {\n";
  out << "\t\ttype " << (set.type == SetType::ipv4_addr ? "ipv4_addr" : "ipv6_addr") << "\n";
  if (set.interval || set.timeout) {
    out << "\t\tflags ";
    if (set.interval) out << "interval";
    if (set.interval && set.timeout) out << ",";
    if (set.timeout) out << "timeout";
    out << "\n";
  }
  if (set.size != 0) out << "\t\tsize " << set.size << "\n";
  if (!set.elems.empty()) {
    out << "\t\telements = { ";
    for (std::size_t i = 0; i < set.elems.size(); ++i) {
      if (i != 0) out << (i % 4 == 0 ? ",\n\t\t\t     " : ", ");
      out << elem_text(set, set.elems[i]);
    }
    out << " }\n";
  }
  out << "\t}\n";
}

void render_chain(std::ostringstream& out, const Chain& chain) {
  out << "\tchain " << chain.name << " {\n";
  if (chain.base) {
    const BaseChain& b = *chain.base;
    out << "\t\ttype " << (b.type == HookType::filter ? "filter" : "nat") << " hook ";
    switch (b.hook) {
      case Hook::output: out << "output"; break;
      case Hook::input: out << "input"; break;
      case Hook::forward: out << "forward"; break;
      case Hook::egress: out << "egress device \"" << b.device << "\""; break;
      case Hook::prerouting: out << "prerouting"; break;
    }
    out << " priority ";
    // As nft names them (an inet table's filter chains: raw -300, filter 0).
    if (b.type == HookType::filter && b.priority == 0) {
      out << "filter";
    } else if (b.type == HookType::filter && b.priority == -300 && b.hook != Hook::egress) {
      out << "raw";
    } else {
      out << b.priority;
    }
    out << "; policy " << (b.policy_drop ? "drop" : "accept") << ";\n";
  }
  for (const auto& r : chain.rules) out << "\t\t" << render_rule(r) << "\n";
  out << "\t}\n";
}

}  // namespace

std::string priority_text(std::uint32_t value) {
  if (value == 0) return "none";
  if (value == 0xffffffffu) return "root";
  char buf[24];
  std::snprintf(buf, sizeof buf, "%x:%x", value >> 16, value & 0xffffu);
  return buf;
}

std::string render_rule(const Rule& rule) {
  std::string s;
  for (const auto& st : rule.stmts) {
    if (!s.empty()) s += ' ';
    s += std::visit(StmtText{}, st);
  }
  if (!rule.comment.empty()) s += " comment \"" + rule.comment + "\"";
  return s;
}

std::string render_table(const Table& table) {
  std::ostringstream out;
  out << "table " << to_string(table.family) << " " << table.name << " {\n";
  if (!table.comment.empty()) out << "\tcomment \"" << table.comment << "\"\n";
  bool first = true;
  for (const auto& s : table.sets) {
    if (!first) out << "\n";
    first = false;
    render_set(out, s);
  }
  for (const auto& c : table.chains) {
    if (!first) out << "\n";
    first = false;
    render_chain(out, c);
  }
  out << "}\n";
  return out.str();
}

}  // namespace egressd::nft
