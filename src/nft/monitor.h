// nf_tables change notifications (multicast group NFNLGRP_NFTABLES): who
// changed what, grouped per transaction, and whether it touched egressd's
// table. The socket (an nft::Transport subscribed to NFNLGRP_NFTABLES, see
// daemon/tamper_guard) is apart from the logic (ChangeTracker), so the logic
// is tested on hand-built messages without root.
//
// What the kernel sends (net/netfilter/nf_tables_api.c, checked on 6.1 and
// 6.18): at the commit of each transaction, one message per object changed
// (NEW/DEL TABLE, CHAIN, RULE, SET, SETELEM, OBJ, FLOWTABLE), each with
// nlmsg_pid = the netlink portid of the socket that sent the batch (0 when
// the kernel itself made the change), then one NEWGEN that ends the
// transaction and names the process (NFTA_GEN_PROC_PID / _PROC_NAME). Set
// elements that time out are removed without any notification.
//
// Not thread-safe: used from the daemon's event loop.
#pragma once

#include <linux/netlink.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "egressd/result.h"

namespace egressd::nft {

enum class ObjKind : std::uint8_t { table, chain, rule, set, element, object, flowtable };

// One notification about one object, or the NEWGEN that ends a transaction.
struct Event {
  bool is_gen = false;         // NEWGEN: only portid and the gen_* fields are set
  ObjKind kind = ObjKind::table;
  bool added = false;          // NEW* (added or changed) vs DEL*
  std::uint32_t portid = 0;    // nlmsg_pid: the socket that made the change; 0 = the kernel
  std::uint8_t family = 0;     // nfgen_family (NFPROTO_INET = 1)
  std::string table;
  std::string object;          // chain, set, object or flowtable name; "" for tables
  std::uint32_t elements = 0;  // set element messages: how many elements
  std::uint32_t gen_id = 0;
  std::uint32_t proc_pid = 0;
  std::string proc_name;
};

// Parses one nf_tables notification; nullopt for anything else (another
// subsystem, an unknown message type, a malformed message).
std::optional<Event> parse_event(const nlmsghdr* nlh);

// What a transaction did to one table: counts per (kind, added, object),
// bounded in size whatever the transaction's length.
struct TableChanges {
  bool table_deleted = false;
  bool table_added = false;  // (re)created or its flags changed
  bool netdev_table_deleted = false;  // table netdev <table> (egress chains)
  bool netdev_table_added = false;
  std::map<std::tuple<ObjKind, bool, std::string>, std::uint32_t> objects;  // at most kMaxObjects
  std::uint32_t more = 0;             // changed objects past kMaxObjects
  std::uint32_t other_tables_deleted = 0;
  static constexpr std::size_t kMaxObjects = 8;

  bool empty() const {
    return !table_deleted && !table_added && !netdev_table_deleted && !netdev_table_added && objects.empty() &&
           more == 0;
  }
  // "table inet egressd deleted", "rule added to chain active, 2 elements
  // deleted from set ph_agent_a4", "ruleset flushed (table inet egressd and 2
  // other tables deleted)". Object names are as the kernel gave them.
  std::string describe(const std::string& table) const;
};

// A transaction that changed one of egressd's tables (inet or netdev, both
// named `table`) and was not made by egressd.
struct Tamper {
  TableChanges changes;
  std::uint32_t portid = 0;
  std::uint32_t proc_pid = 0;  // 0 when unknown (no NEWGEN seen)
  std::string proc_name;
  std::uint32_t gen_id = 0;
};

// Groups events into transactions and keeps those that touched table inet
// `table` and came from a socket other than egressd's own.
class ChangeTracker {
 public:
  explicit ChangeTracker(std::string table, std::vector<std::uint32_t> own_portids = {})
      : table_(std::move(table)), own_(std::move(own_portids)) {}

  void add_own_portid(std::uint32_t portid) { own_.push_back(portid); }
  bool is_own(std::uint32_t portid) const;

  // Feeds one raw message. Returns the tamper when `nlh` is the NEWGEN ending
  // a foreign transaction that changed the table. Messages of egressd's own
  // sockets are skipped before they are parsed (learned-address inserts are
  // thousands a second under a DNS flood).
  std::optional<Tamper> feed(const nlmsghdr* nlh);
  // Same for a parsed event (tests).
  std::optional<Tamper> feed(const Event& ev);
  // Forgets a partly seen transaction (after messages were lost, ENOBUFS).
  void reset() { pending_ = {}; }

  // The last commit fed (its NEWGEN), cleared by taking it: the generation it
  // made and the socket that committed it.
  struct Commit {
    std::uint32_t gen = 0;
    std::uint32_t portid = 0;
  };
  std::optional<Commit> take_commit() { return std::exchange(commit_, std::nullopt); }

 private:
  std::string table_;
  std::vector<std::uint32_t> own_;
  TableChanges pending_;
  std::optional<Commit> commit_;
};

}  // namespace egressd::nft
