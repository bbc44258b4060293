// Kernel over NETLINK_NETFILTER: a Change becomes one nf_tables batch.
//
// Wire format: every message is byte-for-byte what nft(8) 1.0.6 sends for the
// text render.cc prints (checked with `strace -e write=all nft -f` and
// `nft --debug=netlink`), so `nft list ruleset` cannot tell the two apart.
// The only deliberate difference: egressd asks for an ack per message and
// uses NLM_F_EXCL on tables, chains and sets, so a stale object is an error
// naming it instead of a silent merge.
//
// Not thread-safe: one NetlinkKernel per network namespace, used from one
// thread (the daemon's event loop).
//
// Over 1,300 lines because it is the one translation of nft::model into
// libnftnl objects and back: tables, chains, sets, elements, every rule
// expression egressd uses, the batch with its per-message acks, and the dumps
// that read a table back (with interrupted-dump retries). Keeping the two
// directions together keeps them symmetric: what is written is read back by
// the code next to it.
#include "nft/netlink.h"
#include "nft/read_async.h"
#include "nft/transport.h"

#include <arpa/inet.h>
#include <endian.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nf_conntrack_common.h>
#include <linux/netfilter/nf_conntrack_tuple_common.h>
#include <linux/netfilter/nf_nat.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/xt_NFQUEUE.h>
#include <linux/netlink.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <sys/socket.h>
#include <time.h>

#include <libnftnl/common.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <new>
#include <functional>
#include <string_view>

#include "nft/nl_handles.h"

namespace egressd::nft {

namespace {

// nftables src/mnl.c NFT_NLMSG_MAXSIZE: the largest nf_tables message is a set
// element message, whose NFTA_SET_ELEM_LIST_ELEMENTS nest has a 16-bit
// length, so no message may exceed 64 KiB (+ header slack).
constexpr std::size_t kMaxMsgSize = UINT16_MAX + 4096;
// Element messages are closed once they pass this size: half the nest limit,
// and one element (or start/end pair) adds at most ~100 bytes past the check.
constexpr std::uint32_t kElemMsgBytes = 32 * 1024;
// No exchange with the kernel waits longer than this.
constexpr int kReplyTimeoutMs = 5000;
// The batch buffer is reused between applies: it always has room for one
// more message of kMaxMsgSize, so a small batch's buffer is ~136 KiB (freeing
// it after every apply made each DNS answer's learn batch allocate it again:
// an ASan build answered 88 % of a flood instead of 100 %). A larger one (the
// start-up batch, a big inline policy) is freed afterwards. It is never
// zero-filled, so only the pages a batch wrote are resident: an idle daemon
// stays small (DESIGN §5), and an agent keeps no start-up batch per sandbox.
constexpr std::size_t kKeptBatchBytes = 160 * 1024;
// ... and kept only after a batch that wrote at most this much: the pages a
// large batch wrote (a start-up or a switch with many elements) would stay
// resident in an idle daemon, while the small batches that come often (one
// loop turn's learned addresses) write a page or two.
constexpr std::size_t kKeptWrittenBytes = 16 * 1024;
// Receive buffer per expected ack: acks are tiny but each is its own skb,
// accounted at its truesize (nftables' mnl_batch_talk uses the same 1 KiB).
constexpr int kAckTruesize = 1024;
// Room for one reply/dump datagram (dumps fill up to a page-sized skb; an
// error ack can carry extended-ack text).

// nft(8) datatypes (src/datatype.h TYPE_IPADDR, TYPE_IP6ADDR) and its
// BYTEORDER_BIG_ENDIAN, stored in set userdata: `nft list` needs them to print
// `type ipv4_addr` and the elements as addresses.
constexpr std::uint32_t kTypeIpAddr = 7;
constexpr std::uint32_t kTypeIp6Addr = 8;
constexpr std::uint32_t kByteorderBigEndian = 2;
constexpr std::size_t kUdataMax = 256;  // nftables NFT_USERDATA_MAXLEN

using Bytes = std::array<std::uint8_t, 16>;

std::size_t key_len(SetType t) { return t == SetType::ipv4_addr ? 4 : 16; }
int key_family(SetType t) { return t == SetType::ipv4_addr ? 4 : 6; }

bool is_zero(const Bytes& b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

// ---- what each message is about (for error text) ---------------------------

enum class Verb : std::uint8_t {
  add_table, delete_table, add_set, delete_set, add_elems, delete_elems,
  add_chain, delete_chain, flush_chain, add_rule,
};

struct MsgTag {
  Verb verb;
  std::string_view object;  // points into the Change being applied
  const Rule* rule = nullptr;
  Family family = Family::inet;
};

std::uint8_t nfproto(Family f) { return f == Family::netdev ? NFPROTO_NETDEV : NFPROTO_INET; }

// "add chain eg_eth0" names inet objects as before; netdev ones say so
// ("add chain netdev eg_eth0"), so an error names the table it concerns.
std::string describe(const MsgTag& t) {
  const std::string obj = (t.family == Family::netdev ? "netdev " : "") + std::string(t.object);
  switch (t.verb) {
    case Verb::add_table: return "add table " + obj;
    case Verb::delete_table: return "delete table " + obj;
    case Verb::add_set: return "add set " + obj;
    case Verb::delete_set: return "delete set " + obj;
    case Verb::add_elems: return "add elements to set " + obj;
    case Verb::delete_elems: return "delete elements from set " + obj;
    case Verb::add_chain: return "add chain " + obj;
    case Verb::delete_chain: return "delete chain " + obj;
    case Verb::flush_chain: return "flush chain " + obj;
    case Verb::add_rule: return "add rule to chain " + obj + " (" + render_rule(*t.rule) + ")";
  }
  return obj;
}

// ---- batch writer ------------------------------------------------------------

// The batch's bytes: grows without zero-filling (see kKeptBatchBytes).
class BatchBuffer {
 public:
  char* data() { return data_.get(); }
  std::size_t capacity() const { return cap_; }
  // Room for `need` bytes; the first `keep` are kept.
  void reserve(std::size_t need, std::size_t keep) {
    if (need <= cap_) return;
    const std::size_t cap = std::max(cap_ * 2, need);
    std::unique_ptr<char[]> d(new char[cap]);
    if (keep != 0) std::memcpy(d.get(), data_.get(), keep);
    data_ = std::move(d);
    cap_ = cap;
  }
  void release() {
    data_.reset();
    cap_ = 0;
  }

 private:
  std::unique_ptr<char[]> data_;
  std::size_t cap_ = 0;
};

// Appends nf_tables messages to one contiguous buffer. The whole batch must go
// to the kernel in ONE sendmsg: nfnetlink handles BEGIN..END per skb and
// aborts a batch whose END is not in the same skb (after acking each message
// of it as if it had worked), so sending in chunks can never be atomic.
class BatchWriter {
 public:
  BatchWriter(BatchBuffer& buf, std::vector<MsgTag>& tags, std::uint32_t seq)
      : buf_(buf), tags_(tags), first_seq_(seq), seq_(seq) {}

  void begin() {
    nlmsghdr* nlh = nftnl_batch_begin(room(kMaxMsgSize), seq_++);
    len_ += NLMSG_ALIGN(nlh->nlmsg_len);
  }
  // Only the last message asks for an ack: the kernel reports every failed
  // message whether asked or not, and acks the last one however the messages
  // before it went (read_acks). An ack per message was one more datagram to
  // queue and one more recv for every message of every batch.
  void end() {
    if (last_msg_ != kNoMessage) {
      reinterpret_cast<nlmsghdr*>(buf_.data() + last_msg_)->nlmsg_flags |= NLM_F_ACK;
    }
    nlmsghdr* nlh = nftnl_batch_end(room(kMaxMsgSize), seq_++);
    len_ += NLMSG_ALIGN(nlh->nlmsg_len);
  }

  // Starts an nf_tables message (end() adds the ack request to the last
  // one). The pointer is valid until finish(); no other message may be
  // started in between.
  nlmsghdr* start(std::uint16_t type, std::uint16_t flags, Verb verb, std::string_view object,
                  const Rule* rule = nullptr, Family family = Family::inet) {
    last_msg_ = len_;
    nlmsghdr* nlh = nftnl_nlmsg_build_hdr(room(kMaxMsgSize), type, nfproto(family), flags, seq_++);
    tags_.push_back({verb, object, rule, family});
    return nlh;
  }
  void finish(const nlmsghdr* nlh) { len_ += NLMSG_ALIGN(nlh->nlmsg_len); }

  // Set ids tie NEWSETELEM and lookup expressions to a set created in the
  // same batch (what nft does; the kernel also resolves the name).
  std::uint32_t new_set_id(std::string_view name) {
    const std::uint32_t id = static_cast<std::uint32_t>(set_ids_.size()) + 1;
    set_ids_.emplace_back(name, id);
    return id;
  }
  std::uint32_t set_id(std::string_view name) const {
    for (const auto& [n, id] : set_ids_) {
      if (n == name) return id;
    }
    return 0;
  }

  std::size_t len() const { return len_; }
  std::uint32_t first_seq() const { return first_seq_; }
  std::uint32_t next_seq() const { return seq_; }

 private:
  char* room(std::size_t n) {
    buf_.reserve(len_ + n, len_);
    return buf_.data() + len_;
  }

  static constexpr std::size_t kNoMessage = ~std::size_t{0};

  BatchBuffer& buf_;
  std::vector<MsgTag>& tags_;
  std::vector<std::pair<std::string_view, std::uint32_t>> set_ids_;
  std::size_t len_ = 0;
  std::size_t last_msg_ = kNoMessage;  // offset of the last message started
  std::uint32_t first_seq_;
  std::uint32_t seq_;
};

// ---- userdata (nft's TLV encoding: type u8, len u8, value) -----------------

NftUdata comment_udata(std::uint8_t type, const std::string& comment) {
  auto ud = checked<NftUdata>(nftnl_udata_buf_alloc(kUdataMax));
  // Length was validated (<= 127 bytes) before anything was built.
  (void)nftnl_udata_put_strz(ud.get(), type, comment.c_str());
  return ud;
}

// ---- tables, chains, sets ----------------------------------------------------

void put_table(BatchWriter& w, const std::string& name, Family family, const std::string& comment,
               bool exclusive = true) {
  auto t = checked<NftTable>(nftnl_table_alloc());
  nftnl_table_set_str(t.get(), NFTNL_TABLE_NAME, name.c_str());
  nftnl_table_set_u32(t.get(), NFTNL_TABLE_FLAGS, 0);
  if (!comment.empty()) {
    NftUdata ud = comment_udata(NFTNL_UDATA_TABLE_COMMENT, comment);
    nftnl_table_set_data(t.get(), NFTNL_TABLE_USERDATA, nftnl_udata_buf_data(ud.get()),
                         nftnl_udata_buf_len(ud.get()));
  }
  nlmsghdr* nlh = w.start(NFT_MSG_NEWTABLE, static_cast<std::uint16_t>(NLM_F_CREATE | (exclusive ? NLM_F_EXCL : 0)),
                          Verb::add_table, name, nullptr, family);
  nftnl_table_nlmsg_build_payload(nlh, t.get());
  w.finish(nlh);
}

std::uint32_t hooknum(Hook h) {
  switch (h) {
    case Hook::output: return NF_INET_LOCAL_OUT;
    case Hook::input: return NF_INET_LOCAL_IN;
    case Hook::forward: return NF_INET_FORWARD;
    case Hook::egress: return NF_NETDEV_EGRESS;
    case Hook::prerouting: return NF_INET_PRE_ROUTING;
  }
  return NF_INET_LOCAL_OUT;
}

// Attribute order as nft's mnl_nft_chain_add: table, name, type, policy, then
// the hook nest (number, priority, and for netdev chains the device).
void put_chain(BatchWriter& w, const std::string& table, const Chain& c, Family family) {
  nlmsghdr* nlh = w.start(NFT_MSG_NEWCHAIN, NLM_F_CREATE | NLM_F_EXCL, Verb::add_chain, c.name, nullptr, family);
  mnl_attr_put_strz(nlh, NFTA_CHAIN_TABLE, table.c_str());
  mnl_attr_put_strz(nlh, NFTA_CHAIN_NAME, c.name.c_str());
  if (c.base) {
    mnl_attr_put_strz(nlh, NFTA_CHAIN_TYPE, c.base->type == HookType::filter ? "filter" : "nat");
    mnl_attr_put_u32(nlh, NFTA_CHAIN_POLICY, htonl(c.base->policy_drop ? NF_DROP : NF_ACCEPT));
    nlattr* hook = mnl_attr_nest_start(nlh, NFTA_CHAIN_HOOK);
    mnl_attr_put_u32(nlh, NFTA_HOOK_HOOKNUM, htonl(hooknum(c.base->hook)));
    mnl_attr_put_u32(nlh, NFTA_HOOK_PRIORITY, htonl(static_cast<std::uint32_t>(c.base->priority)));
    if (c.base->hook == Hook::egress) mnl_attr_put_strz(nlh, NFTA_HOOK_DEV, c.base->device.c_str());
    mnl_attr_nest_end(nlh, hook);
  }
  w.finish(nlh);
}

// A table/chain/set addressed by name only (delete, flush).
void put_named(BatchWriter& w, std::uint16_t type, Verb verb, const std::string& table, const std::string& name,
               Family family = Family::inet) {
  nlmsghdr* nlh = w.start(type, 0, verb, name, nullptr, family);
  switch (type) {
    case NFT_MSG_DELTABLE:
      mnl_attr_put_strz(nlh, NFTA_TABLE_NAME, name.c_str());
      break;
    case NFT_MSG_DELCHAIN:
      mnl_attr_put_strz(nlh, NFTA_CHAIN_TABLE, table.c_str());
      mnl_attr_put_strz(nlh, NFTA_CHAIN_NAME, name.c_str());
      break;
    case NFT_MSG_DELRULE:  // table + chain and no handle: every rule of the chain
      mnl_attr_put_strz(nlh, NFTA_RULE_TABLE, table.c_str());
      mnl_attr_put_strz(nlh, NFTA_RULE_CHAIN, name.c_str());
      break;
    case NFT_MSG_DELSET:
      mnl_attr_put_strz(nlh, NFTA_SET_TABLE, table.c_str());
      mnl_attr_put_strz(nlh, NFTA_SET_NAME, name.c_str());
      break;
    default:
      break;
  }
  w.finish(nlh);
}

void put_set(BatchWriter& w, const std::string& table, const Set& set) {
  auto s = checked<NftSet>(nftnl_set_alloc());
  nftnl_set_set_str(s.get(), NFTNL_SET_TABLE, table.c_str());
  nftnl_set_set_str(s.get(), NFTNL_SET_NAME, set.name.c_str());
  std::uint32_t flags = 0;
  if (set.interval) flags |= NFT_SET_INTERVAL;
  if (set.timeout) flags |= NFT_SET_TIMEOUT;
  nftnl_set_set_u32(s.get(), NFTNL_SET_FLAGS, flags);
  nftnl_set_set_u32(s.get(), NFTNL_SET_KEY_TYPE, set.type == SetType::ipv4_addr ? kTypeIpAddr : kTypeIp6Addr);
  nftnl_set_set_u32(s.get(), NFTNL_SET_KEY_LEN, static_cast<std::uint32_t>(key_len(set.type)));
  nftnl_set_set_u32(s.get(), NFTNL_SET_ID, w.new_set_id(set.name));
  if (set.size != 0) nftnl_set_set_u32(s.get(), NFTNL_SET_DESC_SIZE, set.size);
  auto ud = checked<NftUdata>(nftnl_udata_buf_alloc(kUdataMax));
  (void)nftnl_udata_put_u32(ud.get(), NFTNL_UDATA_SET_KEYBYTEORDER, kByteorderBigEndian);
  nftnl_set_set_data(s.get(), NFTNL_SET_USERDATA, nftnl_udata_buf_data(ud.get()), nftnl_udata_buf_len(ud.get()));
  nlmsghdr* nlh = w.start(NFT_MSG_NEWSET, NLM_F_CREATE | NLM_F_EXCL, Verb::add_set, set.name);
  nftnl_set_nlmsg_build_payload(nlh, s.get());
  w.finish(nlh);
}

// ---- set elements ------------------------------------------------------------
//
// Written straight into the message with libmnl: one nftnl_set_elem per
// element would cost a heap allocation each (100k of them for a big set).
// Attribute order is libnftnl's, so the bytes equal nft's.

void put_elem(nlmsghdr* nlh, std::uint16_t index, const std::uint8_t* key, std::size_t len, std::uint32_t flags,
              std::uint64_t timeout_ms, bool open_interval, std::string_view comment = {}) {
  // libnftnl numbers the list entries 1, 2, ... (the kernel ignores the type).
  nlattr* elem = mnl_attr_nest_start(nlh, index);
  if (flags != 0) mnl_attr_put_u32(nlh, NFTA_SET_ELEM_FLAGS, htonl(flags));
  if (timeout_ms != 0) mnl_attr_put_u64(nlh, NFTA_SET_ELEM_TIMEOUT, htobe64(timeout_ms));
  nlattr* key_nest = mnl_attr_nest_start(nlh, NFTA_SET_ELEM_KEY);
  mnl_attr_put(nlh, NFTA_DATA_VALUE, len, key);
  mnl_attr_nest_end(nlh, key_nest);
  if (open_interval || !comment.empty()) {
    const std::string ud = elem_userdata(comment, open_interval);
    mnl_attr_put(nlh, NFTA_SET_ELEM_USERDATA, ud.size(), ud.data());
  }
  mnl_attr_nest_end(nlh, elem);
}

enum class ElemOp { fill_new_set, add, remove };

// Elements of one set, split over as many messages as needed. Interval
// elements [from, to] become a start element `from` and an end element `to+1`
// flagged NFT_SET_ELEM_INTERVAL_END (none when `to` is the top of the space).
void put_elems(BatchWriter& w, const std::string& table, std::string_view set, SetType type, bool interval,
               const std::vector<SetElem>& elems, ElemOp op) {
  if (elems.empty()) return;
  const std::size_t n = key_len(type);
  const std::uint16_t msg_type = op == ElemOp::remove ? NFT_MSG_DELSETELEM : NFT_MSG_NEWSETELEM;
  const std::uint16_t flags = op == ElemOp::remove ? 0 : NLM_F_CREATE;
  const Verb verb = op == ElemOp::remove ? Verb::delete_elems : Verb::add_elems;
  const std::uint32_t set_id = w.set_id(set);
  const std::string set_name(set);

  nlmsghdr* nlh = nullptr;
  nlattr* list = nullptr;
  std::uint16_t index = 0;  // per message; at most ~2k elements fit in one
  auto open_msg = [&] {
    index = 0;
    nlh = w.start(msg_type, flags, verb, set);
    mnl_attr_put_strz(nlh, NFTA_SET_ELEM_LIST_TABLE, table.c_str());
    mnl_attr_put_strz(nlh, NFTA_SET_ELEM_LIST_SET, set_name.c_str());
    if (set_id != 0) mnl_attr_put_u32(nlh, NFTA_SET_ELEM_LIST_SET_ID, htonl(set_id));
    list = mnl_attr_nest_start(nlh, NFTA_SET_ELEM_LIST_ELEMENTS);
  };
  auto close_msg = [&] {
    mnl_attr_nest_end(nlh, list);
    w.finish(nlh);
  };

  open_msg();
  // nft 1.0.6 fills a new interval set starting with an end element at
  // address zero unless the first range starts there. Measured on 6.18: the
  // listing and packet lookups are the same without it (a legacy of older
  // rbtree code), but it costs one element, so it is sent and the kernel
  // holds exactly what `nft -f` creates. Not sent when adding to an existing
  // set (nft does not either once the set has elements).
  if (interval && op == ElemOp::fill_new_set && !is_zero(elems.front().from.bytes, n)) {
    static constexpr Bytes zero{};
    put_elem(nlh, ++index, zero.data(), n, NFT_SET_ELEM_INTERVAL_END, 0, false);
  }
  for (const SetElem& e : elems) {
    if (nlh->nlmsg_len > kElemMsgBytes) {
      close_msg();
      open_msg();
    }
    if (!interval) {
      put_elem(nlh, ++index, e.from.bytes.data(), n, 0, op == ElemOp::remove ? 0 : e.timeout_ms, false,
               op == ElemOp::remove ? std::string_view{} : std::string_view{e.comment});
      continue;
    }
    Bytes end = e.to.bytes;
    const bool open = !increment(end, n);
    put_elem(nlh, ++index, e.from.bytes.data(), n, 0, op == ElemOp::remove ? 0 : e.timeout_ms,
             open && op != ElemOp::remove, op == ElemOp::remove ? std::string_view{} : std::string_view{e.comment});
    if (!open) put_elem(nlh, ++index, end.data(), n, NFT_SET_ELEM_INTERVAL_END, 0, false);
  }
  close_msg();
}

// ---- rules -------------------------------------------------------------------

// Builds the expression list nft 1.0.6 generates for each statement's text
// (render.cc), as `nft --debug=netlink` shows it, e.g. for `ip daddr @s`:
//   [ meta load nfproto => reg 1 ] [ cmp eq reg 1 0x00000002 ]
//   [ payload load 4b @ network header + 16 => reg 1 ] [ lookup reg 1 set s ]
class RuleBuilder {
 public:
  RuleBuilder(nftnl_rule* rule, const BatchWriter& w) : rule_(rule), w_(w) {}

  void operator()(const MatchOifLoopback&) {
    meta(NFT_META_OIF);
    cmp_u32(NFT_CMP_EQ, 1);  // loopback is ifindex 1 in every namespace
  }
  void operator()(const MatchIifLoopback& m) {
    meta(NFT_META_IIF);
    cmp_u32(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, 1);
  }
  void operator()(const MatchMetaMark& m) {
    meta(NFT_META_MARK);
    cmp_u32(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, m.value);
  }
  void operator()(const MatchMetaPriority& m) {
    meta(NFT_META_PRIORITY);
    cmp_u32(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, m.value);
  }
  void operator()(const MatchMetaHasSocket&) {
    meta(NFT_META_SKUID);
    cmp_u32(NFT_CMP_NEQ, 0xffffffffu);
  }
  void operator()(const MatchMetaProtocolArp&) {
    meta(NFT_META_PROTOCOL);
    const std::uint16_t arp = htons(0x0806);  // ETH_P_ARP, in the frame's byte order
    cmp(NFT_CMP_EQ, &arp, sizeof arp);
  }
  // The same two expressions as the dependency nft puts before `ip daddr`,
  // and like it they stand for the family for the rest of the rule.
  void operator()(const MatchMetaNfproto& m) { nfproto(m.family); }
  void operator()(const MatchCtDirectionReply&) {
    ct_load(NFT_CT_DIRECTION);
    cmp_u8(IP_CT_DIR_REPLY);
  }
  void operator()(const MatchCtDirectionOriginal&) {
    ct_load(NFT_CT_DIRECTION);
    cmp_u8(IP_CT_DIR_ORIGINAL);
  }
  // `ct state new` and `ct status dnat` are bit tests: nft masks the loaded
  // word and compares it with zero.
  void operator()(const MatchCtStateNew&) {
    ct_load(NFT_CT_STATE);
    bit_test(NF_CT_STATE_BIT(IP_CT_NEW));
  }
  void operator()(const MatchCtStateNewOrEstablished&) {
    ct_load(NFT_CT_STATE);
    bit_test(NF_CT_STATE_BIT(IP_CT_NEW) | NF_CT_STATE_BIT(IP_CT_ESTABLISHED));
  }
  void operator()(const MatchCtStateRelated&) {
    ct_load(NFT_CT_STATE);
    bit_test(NF_CT_STATE_BIT(IP_CT_RELATED));
  }
  void operator()(const MatchCtStateInvalid&) {
    ct_load(NFT_CT_STATE);
    bit_test(NF_CT_STATE_INVALID_BIT);
  }
  void operator()(const MatchCtStatus& m) {
    ct_load(NFT_CT_STATUS);
    bit_test(static_cast<std::uint32_t>(m.bit), m.negate);
  }
  void operator()(const MatchCtMark& m) {
    ct_load(NFT_CT_MARK);
    cmp_u32(NFT_CMP_EQ, m.value);
  }
  // `ct mark & mask != value`: [ bitwise reg 1 = (reg 1 & mask) ^ 0 ] before
  // the cmp, as nft; a full mask is a plain `ct mark != value`.
  void operator()(const MatchCtMarkNot& m) {
    ct_load(NFT_CT_MARK);
    if (m.mask != ~std::uint32_t{0}) mask_u32(m.mask);
    cmp_u32(NFT_CMP_NEQ, m.value);
  }
  void operator()(const MatchTcpFlagSyn&) { tcp_flag(0x02); }  // SYN
  void operator()(const MatchTcpFlagUrg&) { tcp_flag(0x20); }  // URG
  void operator()(const MatchTcpFlagRst&) { tcp_flag(0x04); }  // RST
  // [ payload load 1b @ transport header + 13 ] [ bitwise & 0x12 ] [ cmp eq 0x02 ], as nft.
  void operator()(const MatchTcpSynOnly&) {
    meta(NFT_META_L4PROTO);
    cmp_u8(IPPROTO_TCP);
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 13, 1);  // tcp flags
    mask_u8(0x12);                                 // SYN | ACK
    cmp_u8(0x02);                                  // SYN
  }
  void operator()(const MatchL4Proto& m) {
    meta(NFT_META_L4PROTO);
    const std::uint8_t proto = m.proto;
    cmp(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, &proto, sizeof proto);
  }
  void operator()(const MatchDport& m) {
    meta(NFT_META_L4PROTO);
    cmp_u8(m.proto);
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
    const std::uint16_t port = htons(m.port);
    cmp(NFT_CMP_EQ, &port, sizeof port);
  }
  void operator()(const MatchSport& m) {
    meta(NFT_META_L4PROTO);
    cmp_u8(m.proto);
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2);
    const std::uint16_t port = htons(m.port);
    cmp(NFT_CMP_EQ, &port, sizeof port);
  }
  void operator()(const MatchLinkIcmpv6& m) {
    nfproto(6);
    if (m.bare) {
      // ip6 nexthdr ipv6-icmp ip6 hoplimit H: one 2-byte load, as nft.
      payload(NFT_PAYLOAD_NETWORK_HEADER, 6, 2);
      const std::uint8_t nh_hl[2] = {IPPROTO_ICMPV6, m.hoplimit};
      cmp(NFT_CMP_EQ, nh_hl, sizeof nh_hl);
      payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1);  // icmpv6 type
      cmp_u8(m.type);
      return;
    }
    meta(NFT_META_L4PROTO);
    cmp_u8(IPPROTO_ICMPV6);
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1);  // icmpv6 type
    cmp_u8(m.type);
    payload(NFT_PAYLOAD_NETWORK_HEADER, 7, 1);  // ip6 hoplimit
    cmp_u8(m.hoplimit);
  }
  void operator()(const MatchDaddrSet& m) {
    daddr(key_family(m.type));
    lookup(m.set);
  }
  void operator()(const MatchDaddr& m) { addr_match(m.addr, true); }
  void operator()(const MatchSaddr& m) { addr_match(m.addr, false); }
  void operator()(const MatchFibAddrType& m) {
    auto e = expr("fib");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_FIB_DREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_FIB_FLAGS, m.daddr ? NFTA_FIB_F_DADDR : NFTA_FIB_F_SADDR);
    add(std::move(e));
    cmp_u32(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, static_cast<std::uint32_t>(m.type));
  }
  void operator()(const MatchSocketMark& m) {
    auto e = expr("socket");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_SOCKET_KEY, NFT_SOCKET_MARK);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_SOCKET_DREG, NFT_REG_1);
    add(std::move(e));
    cmp_u32(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, m.value);
  }
  void operator()(const MatchSocketCgroupv2& m) {
    auto e = expr("socket");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_SOCKET_KEY, NFT_SOCKET_CGROUPV2);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_SOCKET_LEVEL, m.level);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_SOCKET_DREG, NFT_REG_1);
    add(std::move(e));
    // The id in host byte order, as the kernel stores it in the register.
    cmp(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, &m.id, sizeof m.id);
  }
  void operator()(const MatchSaddrSet& m) {
    const int family = key_family(m.type);
    nfproto(family);
    payload(NFT_PAYLOAD_NETWORK_HEADER, family == 4 ? 12 : 8, family == 4 ? 4 : 16);
    lookup(m.set);
  }
  void operator()(const MatchCtOriginalDaddrSet& m) {
    auto e = expr("ct");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CT_KEY, key_family(m.type) == 4 ? NFT_CT_DST_IP : NFT_CT_DST_IP6);
    nftnl_expr_set_u8(e.get(), NFTNL_EXPR_CT_DIR, IP_CT_DIR_ORIGINAL);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CT_DREG, NFT_REG_1);
    add(std::move(e));
    lookup(m.set);
  }
  void operator()(const MatchFrameSaddr& m) {
    const bool v4 = m.addr.family == 4;
    const std::uint16_t type = htons(v4 ? 0x0800 : 0x86dd);
    payload(NFT_PAYLOAD_LL_HEADER, 12, 2);
    cmp(NFT_CMP_EQ, &type, sizeof type);
    payload(NFT_PAYLOAD_LL_HEADER, v4 ? 14 + 12 : 14 + 8, static_cast<std::uint32_t>(m.addr.size()));
    cmp(NFT_CMP_EQ, m.addr.bytes.data(), m.addr.size());
  }
  void operator()(const MatchFrameBytes& m) {
    payload(NFT_PAYLOAD_LL_HEADER, m.offset, static_cast<std::uint32_t>(m.value.size()));
    cmp(m.negate ? NFT_CMP_NEQ : NFT_CMP_EQ, m.value.data(), m.value.size());
  }
  void operator()(const MatchIpv6RoutingHeader&) {
    nfproto(6);
    exthdr_present(IPPROTO_ROUTING, NFT_EXTHDR_OP_IPV6);
  }
  void operator()(const MatchIpv4Options&) {
    nfproto(4);
    // [ payload load 1b @ network header + 0 ] [ bitwise & 0x0f ] [ cmp neq 5 ], as nft.
    payload(NFT_PAYLOAD_NETWORK_HEADER, 0, 1);
    mask_u8(0x0f);
    const std::uint8_t five = 5;
    cmp(NFT_CMP_NEQ, &five, sizeof five);
  }
  void operator()(const MatchTcpOption& m) { exthdr_present(m.kind, NFT_EXTHDR_OP_TCPOPT); }
  void operator()(const MatchUdpLongHeader&) {
    // [ payload load 1b @ transport header + 8 ] [ bitwise & 0x80 ] [ cmp eq 0x80 ], as nft.
    const std::uint8_t bit = 0x80;
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 8, 1);
    mask_u8(bit);
    cmp(NFT_CMP_EQ, &bit, sizeof bit);
  }
  void operator()(const MatchMetaLengthOver& m) {
    // [ meta load len ] [ byteorder reg 1 = hton(reg 1, 4, 4) ] [ cmp gt ], as nft:
    // cmp compares bytes, so the host-order length is made big-endian first.
    meta(NFT_META_LEN);
    auto e = expr("byteorder");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BYTEORDER_SREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BYTEORDER_DREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BYTEORDER_OP, NFT_BYTEORDER_HTON);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BYTEORDER_LEN, 4);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BYTEORDER_SIZE, 4);
    add(std::move(e));
    cmp_u32(NFT_CMP_GT, htonl(m.bytes));
  }
  void operator()(const MatchTcpHeaderOnly& m) {
    // As nft: IPv4 [ hdrlength & 0x0f == 5 ] [ length ] [ meta l4proto tcp ];
    // IPv6 [ 3 bytes @ 4: payload length and next header ]; then the data offset.
    nfproto(m.family);
    if (m.family == 4) {
      payload(NFT_PAYLOAD_NETWORK_HEADER, 0, 1);
      mask_u8(0x0f);
      cmp_u8(5);
      const std::uint16_t len = htons(static_cast<std::uint16_t>(20 + 4 * m.doff));
      payload(NFT_PAYLOAD_NETWORK_HEADER, 2, 2);
      cmp(NFT_CMP_EQ, &len, sizeof len);
      meta(NFT_META_L4PROTO);
      cmp_u8(IPPROTO_TCP);
    } else {
      const std::uint8_t v[3] = {0, static_cast<std::uint8_t>(4 * m.doff), IPPROTO_TCP};
      payload(NFT_PAYLOAD_NETWORK_HEADER, 4, 3);
      cmp(NFT_CMP_EQ, v, sizeof v);
    }
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 12, 1);  // tcp data offset, high nibble
    mask_u8(0xf0);
    cmp_u8(static_cast<std::uint8_t>(m.doff << 4));
  }
  void operator()(const StmtCounter&) { add(expr("counter")); }
  void operator()(const StmtLimit& s) {
    auto e = expr("limit");
    nftnl_expr_set_u64(e.get(), NFTNL_EXPR_LIMIT_RATE, s.per_second);
    nftnl_expr_set_u64(e.get(), NFTNL_EXPR_LIMIT_UNIT, 1);  // seconds
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_LIMIT_BURST, s.burst);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_LIMIT_TYPE, NFT_LIMIT_PKTS);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_LIMIT_FLAGS, 0);
    add(std::move(e));
  }
  void operator()(const StmtLog& s) {
    auto e = expr("log");
    nftnl_expr_set_u16(e.get(), NFTNL_EXPR_LOG_GROUP, s.group);
    add(std::move(e));
  }
  void operator()(const StmtCtMarkSet& s) {
    immediate(&s.value, sizeof s.value);
    auto e = expr("ct");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CT_KEY, NFT_CT_MARK);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CT_SREG, NFT_REG_1);
    add(std::move(e));
  }
  void operator()(const StmtMetaMarkSet& s) { meta_set(NFT_META_MARK, s.value); }
  void operator()(const StmtMetaPrioritySet& s) { meta_set(NFT_META_PRIORITY, s.value); }
  void operator()(const StmtMetaMarkSetCtId&) {
    ct_load(NFT_CT_ID);
    auto e = expr("meta");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_META_KEY, NFT_META_MARK);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_META_SREG, NFT_REG_1);
    add(std::move(e));
  }
  void operator()(const StmtRedirect& s) {
    const std::uint16_t port = htons(s.port);
    immediate(&port, sizeof port);
    auto e = expr("redir");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_REDIR_REG_PROTO_MIN, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_REDIR_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
    add(std::move(e));
  }
  void operator()(const StmtRejectTcpReset&) { reject(NFT_REJECT_TCP_RST, 0); }
  void operator()(const StmtRejectAdminProhibited&) {
    reject(NFT_REJECT_ICMPX_UNREACH, NFT_REJECT_ICMPX_ADMIN_PROHIBITED);
  }
  // The xtables NFQUEUE target, revision 3 (queue number, no flags: no
  // bypass), through nft_compat: the kernel needs xt_NFQUEUE, not nft_queue
  // (which some kernels lack; nft lists both as `queue num N`).
  void operator()(const StmtQueue& q) {
    xt_NFQ_info_v3 info{};
    info.queuenum = q.num;
    info.queues_total = 1;
    auto e = expr("target");
    nftnl_expr_set_str(e.get(), NFTNL_EXPR_TG_NAME, "NFQUEUE");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_TG_REV, 3);
    // libnftnl takes ownership of the info blob and frees it with the expression.
    void* blob = std::malloc(sizeof info);
    if (blob == nullptr) throw std::bad_alloc();
    std::memcpy(blob, &info, sizeof info);
    nftnl_expr_set(e.get(), NFTNL_EXPR_TG_INFO, blob, sizeof info);
    add(std::move(e));
  }
  void operator()(const StmtVerdict& v) {
    auto e = expr("immediate");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_IMM_DREG, NFT_REG_VERDICT);
    int code = NF_ACCEPT;
    switch (v.kind) {
      case VerdictKind::accept: code = NF_ACCEPT; break;
      case VerdictKind::drop: code = NF_DROP; break;
      case VerdictKind::jump: code = NFT_JUMP; break;
      case VerdictKind::goto_: code = NFT_GOTO; break;
      case VerdictKind::return_: code = NFT_RETURN; break;
    }
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_IMM_VERDICT, static_cast<std::uint32_t>(code));
    if (v.kind == VerdictKind::jump || v.kind == VerdictKind::goto_) {
      nftnl_expr_set_str(e.get(), NFTNL_EXPR_IMM_CHAIN, v.chain.c_str());
    }
    add(std::move(e));
  }

 private:
  static NftExpr expr(const char* name) { return checked<NftExpr>(nftnl_expr_alloc(name)); }
  void add(NftExpr e) { nftnl_rule_add_expr(rule_, e.release()); }  // the rule owns it now

  void meta(std::uint32_t key) {
    auto e = expr("meta");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_META_KEY, key);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_META_DREG, NFT_REG_1);
    add(std::move(e));
  }
  void meta_set(std::uint32_t key, std::uint32_t value) {
    immediate(&value, sizeof value);
    auto e = expr("meta");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_META_KEY, key);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_META_SREG, NFT_REG_1);
    add(std::move(e));
  }
  // [ bitwise reg 1 = (reg 1 & bit) ^ 0 ] [ cmp neq reg 1 0 ] on a host-order
  // word; negated (`! bit`): cmp eq 0.
  void bit_test(std::uint32_t bit, bool negate = false) {
    mask_u32(bit);
    cmp_u32(negate ? NFT_CMP_EQ : NFT_CMP_NEQ, 0);
  }
  // [ bitwise reg 1 = (reg 1 & mask) ^ 0 ] on a host-order word.
  void mask_u32(std::uint32_t mask) {
    const std::uint32_t zero = 0;
    auto e = expr("bitwise");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_SREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_DREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_LEN, sizeof mask);
    nftnl_expr_set(e.get(), NFTNL_EXPR_BITWISE_MASK, &mask, sizeof mask);
    nftnl_expr_set(e.get(), NFTNL_EXPR_BITWISE_XOR, &zero, sizeof zero);
    add(std::move(e));
  }
  // [ bitwise reg 1 = (reg 1 & mask) ^ 0 ] on one byte.
  void mask_u8(std::uint8_t mask) {
    const std::uint8_t zero = 0;
    auto e = expr("bitwise");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_SREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_DREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_LEN, sizeof mask);
    nftnl_expr_set(e.get(), NFTNL_EXPR_BITWISE_MASK, &mask, sizeof mask);
    nftnl_expr_set(e.get(), NFTNL_EXPR_BITWISE_XOR, &zero, sizeof zero);
    add(std::move(e));
  }
  // `tcp flags <flag>`: meta l4proto tcp, then the flags byte masked with
  // `bit`, compared with zero.
  void tcp_flag(std::uint8_t bit) {
    meta(NFT_META_L4PROTO);
    cmp_u8(IPPROTO_TCP);
    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 13, 1);  // tcp flags
    bit_test_u8(bit);
  }
  // [ bitwise reg 1 = (reg 1 & bit) ^ 0 ] [ cmp neq reg 1 0 ] on one byte.
  void bit_test_u8(std::uint8_t bit) {
    const std::uint8_t zero = 0;
    mask_u8(bit);
    cmp(NFT_CMP_NEQ, &zero, sizeof zero);
  }
  // `exthdr rt exists`, `ip option lsrr exists`: a present-flag load of one
  // byte, compared with 1.
  void exthdr_present(std::uint8_t type, std::uint32_t op) {
    auto e = expr("exthdr");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_EXTHDR_DREG, NFT_REG_1);
    nftnl_expr_set_u8(e.get(), NFTNL_EXPR_EXTHDR_TYPE, type);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_EXTHDR_OFFSET, 0);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_EXTHDR_LEN, 1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_EXTHDR_OP, op);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_EXTHDR_FLAGS, NFT_EXTHDR_F_PRESENT);
    add(std::move(e));
    cmp_u8(1);
  }
  // `ip daddr 127.0.0.0/8`, `ip6 saddr ::`, `ip6 daddr fe80::/10`. nft loads
  // only the bytes a byte-aligned prefix covers and compares them; for any
  // other prefix it loads the whole address, masks it, and compares it with
  // the masked prefix.
  void addr_match(const IpPrefix& p, bool dst) {
    const std::size_t full = p.size();
    const std::uint32_t offset = p.family == 4 ? (dst ? 16 : 12) : (dst ? 24 : 8);
    nfproto(p.family);
    if (p.prefix_len % 8 == 0) {
      const std::size_t len = p.prefix_len / 8;
      payload(NFT_PAYLOAD_NETWORK_HEADER, offset, static_cast<std::uint32_t>(len));
      cmp(NFT_CMP_EQ, p.bytes.data(), len);
      return;
    }
    payload(NFT_PAYLOAD_NETWORK_HEADER, offset, static_cast<std::uint32_t>(full));
    std::array<std::uint8_t, 16> mask{}, zero{}, masked{};
    for (std::size_t bit = 0; bit < p.prefix_len; ++bit) mask[bit / 8] |= static_cast<std::uint8_t>(0x80u >> (bit % 8));
    for (std::size_t i = 0; i < full; ++i) masked[i] = p.bytes[i] & mask[i];
    auto e = expr("bitwise");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_SREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_DREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_BITWISE_LEN, static_cast<std::uint32_t>(full));
    nftnl_expr_set(e.get(), NFTNL_EXPR_BITWISE_MASK, mask.data(), static_cast<std::uint32_t>(full));
    nftnl_expr_set(e.get(), NFTNL_EXPR_BITWISE_XOR, zero.data(), static_cast<std::uint32_t>(full));
    add(std::move(e));
    cmp(NFT_CMP_EQ, masked.data(), full);
  }
  // Register 1 looked up in `set` (by name, and by id while the set is new in this batch).
  void lookup(const std::string& set) {
    auto e = expr("lookup");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_LOOKUP_SREG, NFT_REG_1);
    nftnl_expr_set_str(e.get(), NFTNL_EXPR_LOOKUP_SET, set.c_str());
    if (const std::uint32_t id = w_.set_id(set); id != 0) nftnl_expr_set_u32(e.get(), NFTNL_EXPR_LOOKUP_SET_ID, id);
    add(std::move(e));
  }
  void ct_load(std::uint32_t key) {
    auto e = expr("ct");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CT_KEY, key);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CT_DREG, NFT_REG_1);
    add(std::move(e));
  }
  void payload(std::uint32_t base, std::uint32_t offset, std::uint32_t len) {
    auto e = expr("payload");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_PAYLOAD_DREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_PAYLOAD_BASE, base);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_PAYLOAD_OFFSET, offset);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_PAYLOAD_LEN, len);
    add(std::move(e));
  }
  // Data compared in the register's byte order as nft does: marks and ifindex
  // in host order, ports and addresses in network order.
  void cmp(std::uint32_t op, const void* data, std::size_t len) {
    auto e = expr("cmp");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CMP_SREG, NFT_REG_1);
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_CMP_OP, op);
    nftnl_expr_set(e.get(), NFTNL_EXPR_CMP_DATA, data, static_cast<std::uint32_t>(len));
    add(std::move(e));
  }
  void cmp_u32(std::uint32_t op, std::uint32_t v) { cmp(op, &v, sizeof v); }
  void cmp_u8(std::uint8_t v) { cmp(NFT_CMP_EQ, &v, sizeof v); }
  // `ip daddr` / `ip6 daddr` in an inet table: nft's meta nfproto dependency
  // then the address from the network header.
  // Loads the destination address, or its first `len` bytes (a byte-aligned
  // prefix: nft compares only those).
  void daddr(int family, std::size_t len = 0) {
    nfproto(family);
    if (family == 4) {
      payload(NFT_PAYLOAD_NETWORK_HEADER, 16, len != 0 ? len : 4);
    } else {
      payload(NFT_PAYLOAD_NETWORK_HEADER, 24, len != 0 ? len : 16);
    }
  }
  // The `meta nfproto` dependency of a network-header match in an inet
  // table. nft emits it once per rule: a later match of the same family
  // (`ip6 saddr :: icmpv6 type ... ip6 daddr ff02::/16`) relies on the first.
  void nfproto(int family) {
    if (nfproto_ == family) return;
    meta(NFT_META_NFPROTO);
    cmp_u8(family == 4 ? NFPROTO_IPV4 : NFPROTO_IPV6);
    nfproto_ = family;
  }
  void immediate(const void* data, std::size_t len) {
    auto e = expr("immediate");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_IMM_DREG, NFT_REG_1);
    nftnl_expr_set(e.get(), NFTNL_EXPR_IMM_DATA, data, static_cast<std::uint32_t>(len));
    add(std::move(e));
  }
  void reject(std::uint32_t type, std::uint8_t code) {
    auto e = expr("reject");
    nftnl_expr_set_u32(e.get(), NFTNL_EXPR_REJECT_TYPE, type);
    nftnl_expr_set_u8(e.get(), NFTNL_EXPR_REJECT_CODE, code);
    add(std::move(e));
  }

  nftnl_rule* rule_;
  const BatchWriter& w_;
  int nfproto_ = 0;  // the family this rule's nfproto dependency established (0 = none yet)
};

void put_rule(BatchWriter& w, const std::string& table, const std::string& chain, const Rule& rule,
              Family family = Family::inet) {
  auto r = checked<NftRule>(nftnl_rule_alloc());
  nftnl_rule_set_str(r.get(), NFTNL_RULE_TABLE, table.c_str());
  nftnl_rule_set_str(r.get(), NFTNL_RULE_CHAIN, chain.c_str());
  RuleBuilder b(r.get(), w);
  for (const Stmt& s : rule.stmts) std::visit(b, s);
  nlmsghdr* nlh = w.start(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, Verb::add_rule, chain, &rule, family);
  nftnl_rule_nlmsg_build_payload(nlh, r.get());
  // After the expressions, where nft puts it (libnftnl would put it before).
  if (!rule.comment.empty()) {
    NftUdata ud = comment_udata(NFTNL_UDATA_RULE_COMMENT, rule.comment);
    mnl_attr_put(nlh, NFTA_RULE_USERDATA, nftnl_udata_buf_len(ud.get()), nftnl_udata_buf_data(ud.get()));
  }
  w.finish(nlh);
}

// ---- ops -----------------------------------------------------------------------

struct OpWriter {
  BatchWriter& w;
  const std::string& table;

  void operator()(const OpAddTable& op) {
    // nft's order: table, chains, sets with their elements, then rules, so
    // every set and jump/goto target exists before a rule refers to it (and
    // handles come out as they would from `nft -f`).
    const Family f = op.table.family;
    put_table(w, table, f, op.table.comment);
    for (const Chain& c : op.table.chains) put_chain(w, table, c, f);
    for (const Set& s : op.table.sets) add_set(s);
    for (const Chain& c : op.table.chains) {
      for (const Rule& r : c.rules) put_rule(w, table, c.name, r, f);
    }
  }
  void operator()(const OpDeleteTable& op) {
    put_named(w, NFT_MSG_DELTABLE, Verb::delete_table, table, op.name, op.family);
  }
  void operator()(const OpEnsureTable& op) { put_table(w, op.name, op.family, "", false); }
  void operator()(const OpAddSet& op) { add_set(op.set); }
  void operator()(const OpDeleteSet& op) { put_named(w, NFT_MSG_DELSET, Verb::delete_set, table, op.name); }
  void operator()(const OpAddElems& op) { put_elems(w, table, op.set, op.type, op.interval, op.elems, ElemOp::add); }
  void operator()(const OpDeleteElems& op) {
    put_elems(w, table, op.set, op.type, op.interval, op.elems, ElemOp::remove);
  }
  void operator()(const OpAddChain& op) {
    put_chain(w, table, op.chain, op.family);
    for (const Rule& r : op.chain.rules) put_rule(w, table, op.chain.name, r, op.family);
  }
  void operator()(const OpDeleteChain& op) {
    put_named(w, NFT_MSG_DELCHAIN, Verb::delete_chain, table, op.name, op.family);
  }
  void operator()(const OpFlushChain& op) {
    put_named(w, NFT_MSG_DELRULE, Verb::flush_chain, table, op.name, op.family);
  }
  void operator()(const OpAddRule& op) { put_rule(w, table, op.chain, op.rule, op.family); }

  void add_set(const Set& s) {
    put_set(w, table, s);
    put_elems(w, table, s.name, s.type, s.interval, s.elems, ElemOp::fill_new_set);
  }
};

// ---- validation before anything is sent -----------------------------------

// The context strings are built only on failure: these run on every apply.
Status check_comment(std::string_view verb, std::string_view object, const std::string& comment) {
  if (comment.size() >= NFTNL_UDATA_COMMENT_MAXLEN) {
    return Error::invalid(std::string(verb) + std::string(object) + ": comment longer than " +
                          std::to_string(NFTNL_UDATA_COMMENT_MAXLEN - 1) + " bytes");
  }
  return {};
}

Status check_elems(std::string_view verb, std::string_view set, SetType type, const std::vector<SetElem>& elems) {
  const int family = key_family(type);
  for (const SetElem& e : elems) {
    if (e.from.family != family || e.to.family != family) {
      return Error::invalid(std::string(verb) + std::string(set) + ": element " + e.from.to_string() +
                            " is not of type " + (type == SetType::ipv4_addr ? "ipv4_addr" : "ipv6_addr"));
    }
    if (e.comment.size() > kElemCommentMax || e.comment.find('\0') != std::string::npos) {
      return Error::invalid(std::string(verb) + std::string(set) + ": element " + e.from.to_string() +
                            ": comment longer than " + std::to_string(kElemCommentMax) + " bytes or with a NUL");
    }
  }
  return {};
}

Status check_rules(const std::string& chain, const std::vector<Rule>& rules) {
  for (const Rule& r : rules) {
    if (Status st = check_comment("add rule to chain ", chain, r.comment); !st) return st;
  }
  return {};
}

Status check_set(const Set& s) { return check_elems("add set ", s.name, s.type, s.elems); }

struct OpChecker {
  const std::string& table;
  Status operator()(const OpAddTable& op) const {
    if (op.table.name != table) {
      return Error::invalid("add table " + op.table.name + ": change is for table " + table);
    }
    if (Status st = check_comment("add table ", table, op.table.comment); !st) return st;
    for (const Set& s : op.table.sets) {
      if (Status st = check_set(s); !st) return st;
    }
    for (const Chain& c : op.table.chains) {
      if (Status st = check_rules(c.name, c.rules); !st) return st;
    }
    return {};
  }
  Status operator()(const OpAddSet& op) const { return check_set(op.set); }
  Status operator()(const OpAddElems& op) const { return check_elems("add elements to set ", op.set, op.type, op.elems); }
  Status operator()(const OpDeleteElems& op) const {
    return check_elems("delete elements from set ", op.set, op.type, op.elems);
  }
  Status operator()(const OpAddChain& op) const { return check_rules(op.chain.name, op.chain.rules); }
  Status operator()(const OpAddRule& op) const { return check_comment("add rule to chain ", op.chain, op.rule.comment); }
  template <class T>
  Status operator()(const T&) const { return {}; }
};

// ---- reading back ------------------------------------------------------------

std::string udata_comment(const void* data, std::uint32_t len, std::uint8_t type) {
  struct Ctx {
    std::uint8_t type;
    std::string out;
  } ctx{type, {}};
  nftnl_udata_parse(
      data, len,
      [](const nftnl_udata* attr, void* p) -> int {
        auto* c = static_cast<Ctx*>(p);
        if (nftnl_udata_type(attr) == c->type && nftnl_udata_len(attr) > 0) {
          const char* s = static_cast<const char*>(nftnl_udata_get(attr));
          c->out.assign(s, strnlen(s, nftnl_udata_len(attr)));
        }
        return 0;
      },
      &ctx);
  return ctx.out;
}

// A dump that a commit interrupted (NLM_F_DUMP_INTR) or that lost replies:
// thrown away and started over, at most kReadAttempts times.
constexpr int kDumpInterrupted = EINTR;
constexpr int kReadAttempts = 32;

// read_table's whole-table attempts are bounded in time instead (see
// nft/read_async.h): another process committing switch after switch back to
// back (measured: up to 31 retries on an idle 2-core machine) can keep a fixed
// number of immediate retries failing, because each retry starts right
// behind the commit that spoiled the last one. Within one attempt, each dump
// is tried this often before the attempt counts as spoiled.
constexpr int kDumpTriesPerAttempt = 2;

class NetlinkKernel final : public Kernel {
 public:
  explicit NetlinkKernel(std::unique_ptr<Transport> t) : t_(std::move(t)), fd_(t_->fd()) {
    socklen_t len = sizeof sndbuf_;
    if (getsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &sndbuf_, &len) < 0) sndbuf_ = 0;
    len = sizeof rcvbuf_;
    if (getsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf_, &len) < 0) rcvbuf_ = 0;
  }

  Status apply(const Change& change) override {
    for (const Op& op : change.ops) {
      if (Status st = std::visit(OpChecker{change.table}, op); !st) return st;
    }
    tags_.clear();
    BatchWriter w(batch_, tags_, t_->reserve_seq(0));
    w.begin();
    OpWriter ow{w, change.table};
    for (const Op& op : change.ops) std::visit(ow, op);
    w.end();
    t_->reserve_seq(w.next_seq() - w.first_seq());
    Status st = tags_.empty() ? Status{} : send_batch(w.len(), w.first_seq());
    if (batch_.capacity() > kKeptBatchBytes || w.len() > kKeptWrittenBytes) batch_.release();
    return st;
  }

  // Several requests are not one snapshot. Each dump is restarted when a
  // commit interrupts it (NLM_F_DUMP_INTR). Across requests, the chains and
  // sets (by name and handle: handles are never reused, so a chain deleted
  // and re-created is noticed) and the table handle must be the same before
  // and after the rules were read, and every rule's chain must be among
  // them; else the read starts over. The ruleset generation is not compared:
  // DNS-learned elements move it many thousand times a second without
  // changing anything read here.
  Result<std::optional<TableInfo>> read_table(const std::string& name, Family family) override {
    const auto deadline = std::chrono::steady_clock::now() + kReadDeadline;
    for (int attempt = 0; attempt == 0 || std::chrono::steady_clock::now() < deadline; ++attempt) {
      if (const auto pause = read_retry_pause(attempt); pause.count() > 0) {
        timespec ts{0, static_cast<long>(pause.count()) * 1000L};
        nanosleep(&ts, nullptr);
      }
      bool interfered = false;
      auto read = read_table_once(name, family, interfered);
      if (!interfered) return read;
    }
    return read_table_gave_up(name, family);
  }

  Result<std::optional<TableInfo>> read_table_once(const std::string& name, Family family, bool& interfered) override {
    interfered = false;
    family_ = nfproto(family);
    const std::string what = "table " + std::string(to_string(family)) + " " + name;
    auto spoiled = [&]() -> Result<std::optional<TableInfo>> {
      interfered = true;
      return std::optional<TableInfo>{};
    };
    TableInfo info;
    std::uint64_t table_before = 0, table_after = 0;
    int err = get_table(name, table_before, &info.comment, &info.flags);
    if (err == ENOENT) return std::optional<TableInfo>{};
    if (err != 0) return errno_error("get " + what, err);
    if ((err = dump_objects(NFT_MSG_GETCHAIN, name, chains_)) == kDumpInterrupted) return spoiled();
    if (err != 0) return errno_error("list chains of " + what, err);
    if ((err = dump_objects(NFT_MSG_GETSET, name, sets_)) == kDumpInterrupted) return spoiled();
    if (err != 0) return errno_error("list sets of " + what, err);
    if ((err = dump_rules(name, info.rules)) == kDumpInterrupted) {
      // The table's rules span several datagrams, and a commit fell between
      // two of them: read them chain by chain. Each of egressd's chains fits
      // one datagram (up to 32 KiB), and one datagram is one fill, which no
      // commit splits (a longer chain is retried like the whole table).
      // Rules of different chains may then come from different commits, as
      // they would from reads one after the other; the chains and sets are
      // still checked unchanged around them below.
      info.rules.clear();
      std::vector<RuleInfo> part;
      for (const Object& c : chains_) {
        if ((err = dump_rules(name, part, &c.name)) == kDumpInterrupted || err == ENOENT) return spoiled();
        if (err != 0) return errno_error("list rules of " + what, err);
        std::move(part.begin(), part.end(), std::back_inserter(info.rules));
      }
    }
    if (err != 0) return errno_error("list rules of " + what, err);
    if ((err = dump_objects(NFT_MSG_GETCHAIN, name, chains_after_)) == kDumpInterrupted) return spoiled();
    if (err != 0) return errno_error("list chains of " + what, err);
    if ((err = dump_objects(NFT_MSG_GETSET, name, sets_after_)) == kDumpInterrupted) return spoiled();
    if (err != 0) return errno_error("list sets of " + what, err);
    err = get_table(name, table_after, nullptr);
    if (err == ENOENT) return spoiled();  // deleted meanwhile: the next attempt says so
    if (err != 0) return errno_error("get " + what, err);
    if (table_before != table_after || chains_ != chains_after_ || sets_ != sets_after_) return spoiled();
    // A chain that came and went between the two chain dumps (an inline
    // policy switched to and away from) can still show up in the rules.
    const bool rules_match_chains = std::all_of(info.rules.begin(), info.rules.end(), [&](const RuleInfo& r) {
      return std::any_of(chains_.begin(), chains_.end(), [&](const Object& c) { return c.name == r.chain; });
    });
    if (!rules_match_chains) return spoiled();
    for (const auto& c : chains_) info.chains.push_back(c.name);
    for (const auto& s : sets_) info.sets.push_back(s.name);
    return std::optional<TableInfo>{std::move(info)};
  }

  Result<std::vector<RuleInfo>> read_chain_once(const std::string& name, Family family, const std::string& chain,
                                                bool& interfered) override {
    interfered = false;
    family_ = nfproto(family);
    std::vector<RuleInfo> rules;
    const int err = dump_rules(name, rules, &chain);
    if (err == kDumpInterrupted) {
      interfered = true;
      return rules;
    }
    // A missing table or chain: the kernel's filtered dump has nothing (or
    // says ENOENT).
    if (err == ENOENT) return std::vector<RuleInfo>{};
    if (err != 0) return errno_error("list rules of chain " + chain + " of table " + std::string(to_string(family)) +
                                         " " + name, err);
    return rules;
  }

  Result<std::vector<SetElem>> read_set_elems(const std::string& table, const std::string& set, SetType type) override {
    family_ = NFPROTO_INET;
    std::vector<SetElem> out;
    const std::size_t n = key_len(type);
    int err = kDumpInterrupted;
    for (int attempt = 0; attempt < kReadAttempts && err == kDumpInterrupted; ++attempt) {
      out.clear();
      nlmsghdr* req = request(NFT_MSG_GETSETELEM, NFPROTO_INET, NLM_F_DUMP);
      mnl_attr_put_strz(req, NFTA_SET_ELEM_LIST_TABLE, table.c_str());
      mnl_attr_put_strz(req, NFTA_SET_ELEM_LIST_SET, set.c_str());
      err = talk(req, [&](const nlmsghdr* nlh) {
        auto s = checked<NftSet>(nftnl_set_alloc());
        if (nftnl_set_elems_nlmsg_parse(nlh, s.get()) < 0) return;
        nftnl_set_elems_iter* it = nftnl_set_elems_iter_create(s.get());
        if (it == nullptr) throw std::bad_alloc();
        for (nftnl_set_elem* e = nftnl_set_elems_iter_next(it); e != nullptr; e = nftnl_set_elems_iter_next(it)) {
          std::uint32_t len = 0;
          const void* key = nftnl_set_elem_get(e, NFTNL_SET_ELEM_KEY, &len);
          if (key == nullptr || len != n) continue;
          IpPrefix a;
          a.family = key_family(type);
          a.prefix_len = static_cast<std::uint8_t>(n * 8);
          std::memcpy(a.bytes.data(), key, n);
          // The timeout the element was added with (ms), as `nft list` shows it.
          const std::uint64_t timeout =
              nftnl_set_elem_is_set(e, NFTNL_SET_ELEM_TIMEOUT) ? nftnl_set_elem_get_u64(e, NFTNL_SET_ELEM_TIMEOUT) : 0;
          SetElem elem{a, a, timeout};
          // What is left of it (ms), as `nft list` shows after `expires`.
          if (nftnl_set_elem_is_set(e, NFTNL_SET_ELEM_EXPIRATION))
            elem.expires_ms = nftnl_set_elem_get_u64(e, NFTNL_SET_ELEM_EXPIRATION);
          std::uint32_t ud_len = 0;
          if (const void* ud = nftnl_set_elem_get(e, NFTNL_SET_ELEM_USERDATA, &ud_len); ud != nullptr)
            elem.comment = elem_comment(ud, ud_len);
          out.push_back(std::move(elem));
        }
        nftnl_set_elems_iter_destroy(it);
      });
    }
    if (err != 0) return errno_error("list elements of set " + set + " of table inet " + table, err);
    return out;
  }

 private:
  // ---- batches ----

  void size_buffers(std::size_t len, std::size_t acks) {
    // netlink_sendmsg refuses a datagram larger than sk_sndbuf - 32 and the
    // whole batch is one datagram. SO_*BUFFORCE (CAP_NET_ADMIN) passes the
    // sysctl caps like nft does; the kernel doubles what is set.
    const std::size_t want_snd = len + 4096;
    if (want_snd > static_cast<std::size_t>(sndbuf_)) {
      int v = static_cast<int>(want_snd);
      if (setsockopt(fd_, SOL_SOCKET, SO_SNDBUFFORCE, &v, sizeof v) < 0) {
        (void)setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
      }
      socklen_t l = sizeof sndbuf_;
      (void)getsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &sndbuf_, &l);
    }
    const std::size_t want_rcv = acks * kAckTruesize;
    if (want_rcv > static_cast<std::size_t>(rcvbuf_)) {
      int v = static_cast<int>(want_rcv);
      if (setsockopt(fd_, SOL_SOCKET, SO_RCVBUFFORCE, &v, sizeof v) < 0) {
        (void)setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
      }
      socklen_t l = sizeof rcvbuf_;
      (void)getsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf_, &l);
    }
  }

  Status send_batch(std::size_t len, std::uint32_t first_seq) {
    size_buffers(len, tags_.size());
    // Whatever an earlier, abandoned exchange left queued (a timeout, lost
    // acks, a failed commit's late reports). After a clean one nothing is
    // (its last ack was the kernel's last word), and a read that would find
    // the socket empty is a system call per commit saved.
    if (!settled_) t_->drain();
    settled_ = false;
    if (const int err = t_->send(batch_.data(), len); err != 0) {
      Error e = errno_error("send batch of " + std::to_string(tags_.size()) + " messages (" + std::to_string(len) +
                                " bytes, first: " + describe(tags_.front()) + ")",
                            err);
      if (err == EMSGSIZE) {
        // SO_SNDBUFFORCE needs CAP_NET_ADMIN in the initial user namespace
        // (not the case under rootless Podman); SO_SNDBUF is capped by sysctl.
        e.message += "; the socket send buffer is " + std::to_string(sndbuf_) +
                     " bytes: raise net.core.wmem_max or run with CAP_NET_ADMIN in the initial user namespace";
      }
      return e;
    }
    return read_acks(first_seq);
  }

  // Reads the error of every failed message and the ack of the last one
  // (the only one with NLM_F_ACK). The kernel runs the whole batch inside
  // sendmsg and queues them, so normally they are all here already; the
  // poll bounds the wait anyway. A failed message makes the kernel abort the
  // batch, but it goes on through the rest of it (to report every error) and
  // acks the last message all the same; a failed commit, or a batch refused
  // as a whole, is reported against the BEGIN message.
  Status read_acks(std::uint32_t first_seq) {
    const std::uint32_t begin_seq = first_seq;
    const std::uint32_t msg_seq0 = first_seq + 1;
    const std::size_t expected = tags_.size();
    bool last_acked = false;
    std::size_t err_index = expected;  // first failed message, in batch order
    int err_code = 0;
    std::string err_ext;
    int commit_err = 0;
    auto on_msg = [&](const nlmsghdr* nlh) {
      if (nlh->nlmsg_type != NLMSG_ERROR || nlh->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) return;
      const auto* e = static_cast<const nlmsgerr*>(mnl_nlmsg_get_payload(nlh));
      if (nlh->nlmsg_seq == begin_seq) {
        if (e->error != 0) commit_err = -e->error;
        return;
      }
      const std::uint32_t idx = nlh->nlmsg_seq - msg_seq0;
      if (idx >= expected) return;  // not ours: stale
      if (idx == expected - 1) last_acked = true;
      if (e->error != 0 && idx < err_index) {
        err_index = idx;
        err_code = -e->error;
        err_ext = ext_ack_msg(nlh);
      }
    };
    // Everything the kernel queued is read; with acks lost or the batch
    // already failed as a whole, no more are coming.
    const auto got = t_->collect(
        on_msg, [&] { return last_acked; },
        [&](bool overrun) { return overrun || commit_err != 0; }, std::chrono::milliseconds(kReplyTimeoutMs));
    const bool lost = got.overrun;
    if (got.error != 0 && got.error != ETIMEDOUT) return errno_error("receive acks", got.error);

    if (err_index < expected) {
      Error err = errno_error(describe(tags_[err_index]), err_code);
      if (!err_ext.empty()) err.message += " (" + err_ext + ")";
      return err;
    }
    if (commit_err != 0) {
      return errno_error("commit batch of " + std::to_string(expected) + " messages", commit_err);
    }
    if (lost) {
      return Error::runtime("batch of " + std::to_string(expected) +
                            " messages: acks lost (netlink receive buffer overrun); outcome unknown");
    }
    if (!last_acked) {
      return Error::runtime("batch of " + std::to_string(expected) + " messages: not acked by the kernel within " +
                            std::to_string(kReplyTimeoutMs) + " ms");
    }
    settled_ = true;
    return {};
  }

  // The kernel's extended-ack text (NLMSGERR_ATTR_MSG), or "".
  static std::string ext_ack_msg(const nlmsghdr* nlh) {
    if (!(nlh->nlmsg_flags & NLM_F_ACK_TLVS)) return "";
    const auto* e = static_cast<const nlmsgerr*>(mnl_nlmsg_get_payload(nlh));
    std::size_t off = sizeof(nlmsgerr);
    if (!(nlh->nlmsg_flags & NLM_F_CAPPED)) off += mnl_nlmsg_get_payload_len(&e->msg);
    std::string msg;
    mnl_attr_parse(
        nlh, static_cast<unsigned>(off),
        [](const nlattr* a, void* p) -> int {
          if (mnl_attr_get_type(a) == NLMSGERR_ATTR_MSG && mnl_attr_validate(a, MNL_TYPE_NUL_STRING) == 0) {
            *static_cast<std::string*>(p) = mnl_attr_get_str(a);
          }
          return MNL_CB_OK;
        },
        &msg);
    return msg;
  }

  // ---- requests (read side) ----

  using OnMsg = std::function<void(const nlmsghdr*)>;

  // Sends one request and hands every reply message to on_msg until the
  // request is complete (NLMSG_DONE for dumps, the ack otherwise). Returns 0
  // or a positive errno: the kernel's, ETIMEDOUT, or kDumpInterrupted when a
  // dump was interrupted by a commit or replies were lost (ENOBUFS).
  int talk(nlmsghdr* req, const OnMsg& on_msg) {
    settled_ = false;  // request() drains first; what it leaves behind on failure is not known
    return t_->request(req, on_msg, std::chrono::milliseconds(kReplyTimeoutMs));
  }

  nlmsghdr* request(std::uint16_t type, std::uint16_t family, std::uint16_t flags) {
    if (req_.size() < 4096) req_.resize(4096);
    return nftnl_nlmsg_build_hdr(req_.data(), type, family, flags, 0);  // the transport numbers it
  }

  // A dump of one kind of object of table inet `table`, restarted (with
  // `reset` first) while commits interrupt it.
  //
  // The replies are copied as they come and parsed once the dump is whole.
  // The kernel fills a dump's next datagram inside our next recvmsg, and any
  // commit between two fills (an element the DNS proxy learned is one)
  // interrupts the dump (NLM_F_DUMP_INTR): parsing a datagram of rules with
  // libnftnl between two reads took longer than a busy writer's gap between
  // commits, so a rules dump of more than one datagram never came through
  // (tests/integration/netlink_test.cc "read_table ...": 0 reads in 2 s).
  int dump(std::uint16_t type, std::uint16_t table_attr, const std::string& table, const std::function<void()>& reset,
           const OnMsg& on_msg, const std::string* chain = nullptr) {
    int err = kDumpInterrupted;
    for (int attempt = 0; attempt < kDumpTriesPerAttempt && err == kDumpInterrupted; ++attempt) {
      reset();
      nlmsghdr* req = request(type, family_, NLM_F_DUMP);
      mnl_attr_put_strz(req, table_attr, table.c_str());  // the kernel may filter by it; we filter too
      if (chain != nullptr) mnl_attr_put_strz(req, NFTA_RULE_CHAIN, chain->c_str());
      dumped_.clear();
      err = talk(req, [this](const nlmsghdr* nlh) {
        const auto* p = reinterpret_cast<const char*>(nlh);
        dumped_.insert(dumped_.end(), p, p + NLMSG_ALIGN(nlh->nlmsg_len));
      });
    }
    if (err == 0) {
      int rest = static_cast<int>(dumped_.size());
      for (auto* nlh = reinterpret_cast<const nlmsghdr*>(dumped_.data()); mnl_nlmsg_ok(nlh, rest);
           nlh = mnl_nlmsg_next(nlh, &rest)) {
        on_msg(nlh);
      }
    }
    if (dumped_.capacity() > kKeptDumpBytes) dumped_ = {};
    return err;
  }

  // The table's handle (unique for the namespace's lifetime) and comment.
  int get_table(const std::string& name, std::uint64_t& handle, std::string* comment, std::uint32_t* flags = nullptr) {
    nlmsghdr* req = request(NFT_MSG_GETTABLE, family_, NLM_F_ACK);
    mnl_attr_put_strz(req, NFTA_TABLE_NAME, name.c_str());
    return talk(req, [&](const nlmsghdr* nlh) {
      auto t = checked<NftTable>(nftnl_table_alloc());
      if (nftnl_table_nlmsg_parse(nlh, t.get()) < 0) return;
      handle = nftnl_table_get_u64(t.get(), NFTNL_TABLE_HANDLE);
      if (flags != nullptr) *flags = nftnl_table_get_u32(t.get(), NFTNL_TABLE_FLAGS);
      std::uint32_t len = 0;
      const void* ud = nftnl_table_get_data(t.get(), NFTNL_TABLE_USERDATA, &len);
      if (comment != nullptr && ud != nullptr) *comment = udata_comment(ud, len, NFTNL_UDATA_TABLE_COMMENT);
    });
  }

  struct Object {
    std::string name;
    std::uint64_t handle = 0;
    friend bool operator==(const Object&, const Object&) = default;
  };

  // Chains (NFT_MSG_GETCHAIN) or named sets (NFT_MSG_GETSET) of the table, in
  // kernel order. Anonymous sets (`{ a, b }` inside a rule) belong to their rule.
  int dump_objects(std::uint16_t type, const std::string& name, std::vector<Object>& out) {
    const bool chains = type == NFT_MSG_GETCHAIN;
    const std::uint16_t table_attr = chains ? std::uint16_t{NFTA_CHAIN_TABLE} : std::uint16_t{NFTA_SET_TABLE};
    return dump(type, table_attr, name, [&] { out.clear(); },
                [&](const nlmsghdr* nlh) {
      if (chains) {
        auto c = checked<NftChain>(nftnl_chain_alloc());
        if (nftnl_chain_nlmsg_parse(nlh, c.get()) < 0) return;
        const char* table = nftnl_chain_get_str(c.get(), NFTNL_CHAIN_TABLE);
        if (table == nullptr || name != table) return;
        out.push_back({nftnl_chain_get_str(c.get(), NFTNL_CHAIN_NAME), nftnl_chain_get_u64(c.get(), NFTNL_CHAIN_HANDLE)});
      } else {
        auto s = checked<NftSet>(nftnl_set_alloc());
        if (nftnl_set_nlmsg_parse(nlh, s.get()) < 0) return;
        const char* table = nftnl_set_get_str(s.get(), NFTNL_SET_TABLE);
        if (table == nullptr || name != table) return;
        if (nftnl_set_get_u32(s.get(), NFTNL_SET_FLAGS) & NFT_SET_ANONYMOUS) return;
        out.push_back({nftnl_set_get_str(s.get(), NFTNL_SET_NAME), nftnl_set_get_u64(s.get(), NFTNL_SET_HANDLE)});
      }
    });
  }

  // Every rule of the table, or (`chain` given) of that chain only: the
  // kernel filters the dump by it.
  int dump_rules(const std::string& name, std::vector<RuleInfo>& out, const std::string* chain = nullptr) {
    return dump(NFT_MSG_GETRULE, NFTA_RULE_TABLE, name, [&] { out.clear(); }, [&](const nlmsghdr* nlh) {
      auto r = checked<NftRule>(nftnl_rule_alloc());
      if (nftnl_rule_nlmsg_parse(nlh, r.get()) < 0) return;
      const char* table = nftnl_rule_get_str(r.get(), NFTNL_RULE_TABLE);
      if (table == nullptr || name != table) return;
      RuleInfo ri;
      ri.chain = nftnl_rule_get_str(r.get(), NFTNL_RULE_CHAIN);
      if (chain != nullptr && ri.chain != *chain) return;
      ri.handle = nftnl_rule_get_u64(r.get(), NFTNL_RULE_HANDLE);
      std::uint32_t len = 0;
      const void* ud = nftnl_rule_get_data(r.get(), NFTNL_RULE_USERDATA, &len);
      if (ud != nullptr) ri.comment = udata_comment(ud, len, NFTNL_UDATA_RULE_COMMENT);
      nftnl_expr_foreach(r.get(), [](nftnl_expr* e, void* p) -> int {
        auto* info = static_cast<RuleInfo*>(p);
        if (std::strcmp(nftnl_expr_get_str(e, NFTNL_EXPR_NAME), "counter") == 0) {
          info->packets += nftnl_expr_get_u64(e, NFTNL_EXPR_CTR_PACKETS);
          info->bytes += nftnl_expr_get_u64(e, NFTNL_EXPR_CTR_BYTES);
        }
        return 0;
      }, &ri);
      out.push_back(std::move(ri));
    }, chain);
  }

  std::uint32_t portid() const override { return t_->portid(); }

  Result<std::uint32_t> generation() override {
    nlmsghdr* req = request(NFT_MSG_GETGEN, AF_UNSPEC, NLM_F_ACK);
    std::optional<std::uint32_t> gen;
    const int err = talk(req, [&](const nlmsghdr* nlh) {
      if ((nlh->nlmsg_type & 0xff) != NFT_MSG_NEWGEN) return;
      mnl_attr_parse(
          nlh, sizeof(nfgenmsg),
          [](const nlattr* a, void* p) -> int {
            if (mnl_attr_get_type(a) == NFTA_GEN_ID && mnl_attr_validate(a, MNL_TYPE_U32) >= 0) {
              *static_cast<std::optional<std::uint32_t>*>(p) = ntohl(mnl_attr_get_u32(a));
            }
            return MNL_CB_OK;
          },
          &gen);
    });
    if (err != 0) return errno_error("get ruleset generation", err);
    if (!gen) return Error::runtime("get ruleset generation: the kernel's reply had no NFTA_GEN_ID");
    return *gen;
  }

  std::unique_ptr<Transport> t_;
  int fd_;  // t_'s, for the buffer sizes
  int sndbuf_ = 0;
  int rcvbuf_ = 0;
  // The last exchange on the socket ended with everything it was sent read
  // (a batch's last ack): nothing stale can be queued.
  bool settled_ = false;
  BatchBuffer batch_;         // reused between applies (see kKeptBatchBytes)
  std::vector<MsgTag> tags_;  // one per message of the batch being applied
  std::vector<char> req_;
  // A dump's replies, copied as they come (dump).
  std::vector<char> dumped_;
  static constexpr std::size_t kKeptDumpBytes = 256 * 1024;
  // read_table's scratch, reused.
  std::vector<Object> chains_, sets_, chains_after_, sets_after_;
  // The family read_table's requests are for (NFPROTO_INET or NFPROTO_NETDEV).
  std::uint16_t family_ = NFPROTO_INET;
};

}  // namespace

std::string elem_userdata(std::string_view comment, bool open_interval) {
  // nft's order: the comment, then the flags. Each TLV value is at most 255
  // bytes; check_elems bounds comments at kElemCommentMax before this runs.
  std::string out;
  if (!comment.empty()) {
    out.push_back(static_cast<char>(NFTNL_UDATA_SET_ELEM_COMMENT));
    out.push_back(static_cast<char>(comment.size() + 1));
    out.append(comment);
    out.push_back('\0');  // nft prints no comment that is not NUL-terminated
  }
  if (open_interval) {
    // NFTNL_SET_ELEM_F_INTERVAL_OPEN marks the start of a range that runs to
    // the top of the address space (no end element can follow it): a
    // host-order u32. Without it `nft list` prints the range as open-ended
    // instead of as the CIDR.
    const std::uint32_t v = NFTNL_SET_ELEM_F_INTERVAL_OPEN;
    out.push_back(static_cast<char>(NFTNL_UDATA_SET_ELEM_FLAGS));
    out.push_back(static_cast<char>(sizeof v));
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  return out;
}

std::string elem_comment(const void* data, std::size_t len) {
  // Bounds first: the kernel stores whatever userdata anyone sent.
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::size_t at = 0;
  while (at + 2 <= len) {
    const std::uint8_t type = p[at];
    const std::size_t n = p[at + 1];
    if (at + 2 + n > len) return {};
    if (type == NFTNL_UDATA_SET_ELEM_COMMENT) {
      // nft's rule: a comment ends with its NUL; anything else is no comment.
      if (n == 0 || p[at + 2 + n - 1] != 0) return {};
      const char* s = reinterpret_cast<const char*>(p + at + 2);
      return std::string(s, strnlen(s, n - 1));
    }
    at += 2 + n;
  }
  return {};
}

Result<std::unique_ptr<Kernel>> open_kernel() {
  auto t = Transport::open(TransportOptions{NETLINK_NETFILTER, {}, 0, "nf_tables"});
  if (!t) return t.error();
  const int fd = (*t)->fd();
  int one = 1;
  // Error acks without the echoed request (small, cannot overrun the queue),
  // with the kernel's extended-ack text when it gives one. Both are optional:
  // old kernels lack them and the acks still work.
  (void)setsockopt(fd, SOL_NETLINK, NETLINK_CAP_ACK, &one, sizeof one);
  (void)setsockopt(fd, SOL_NETLINK, NETLINK_EXT_ACK, &one, sizeof one);
  return std::unique_ptr<Kernel>(std::make_unique<NetlinkKernel>(std::move(*t)));
}

}  // namespace egressd::nft
