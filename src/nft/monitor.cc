#include "nft/monitor.h"

#include <arpa/inet.h>
#include <libmnl/libmnl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace egressd::nft {

namespace {

// Every nf_tables object message carries its table name as attribute 1
// (NFTA_TABLE_NAME, NFTA_CHAIN_TABLE, NFTA_RULE_TABLE, NFTA_SET_TABLE,
// NFTA_SET_ELEM_LIST_TABLE, NFTA_OBJ_TABLE, NFTA_FLOWTABLE_TABLE). The object
// name attribute differs per type.
struct TypeInfo {
  ObjKind kind;
  bool added;
  std::uint16_t name_attr;  // 0 = none
};

std::optional<TypeInfo> type_info(std::uint16_t msg) {
  switch (msg) {
    case NFT_MSG_NEWTABLE: return TypeInfo{ObjKind::table, true, 0};
    case NFT_MSG_DELTABLE: return TypeInfo{ObjKind::table, false, 0};
    case NFT_MSG_NEWCHAIN: return TypeInfo{ObjKind::chain, true, NFTA_CHAIN_NAME};
    case NFT_MSG_DELCHAIN: return TypeInfo{ObjKind::chain, false, NFTA_CHAIN_NAME};
    case NFT_MSG_NEWRULE: return TypeInfo{ObjKind::rule, true, NFTA_RULE_CHAIN};
    case NFT_MSG_DELRULE: return TypeInfo{ObjKind::rule, false, NFTA_RULE_CHAIN};
    case NFT_MSG_NEWSET: return TypeInfo{ObjKind::set, true, NFTA_SET_NAME};
    case NFT_MSG_DELSET: return TypeInfo{ObjKind::set, false, NFTA_SET_NAME};
    case NFT_MSG_NEWSETELEM: return TypeInfo{ObjKind::element, true, NFTA_SET_ELEM_LIST_SET};
    case NFT_MSG_DELSETELEM: return TypeInfo{ObjKind::element, false, NFTA_SET_ELEM_LIST_SET};
    case NFT_MSG_NEWOBJ: return TypeInfo{ObjKind::object, true, NFTA_OBJ_NAME};
    case NFT_MSG_DELOBJ: return TypeInfo{ObjKind::object, false, NFTA_OBJ_NAME};
    case NFT_MSG_NEWFLOWTABLE: return TypeInfo{ObjKind::flowtable, true, NFTA_FLOWTABLE_NAME};
    case NFT_MSG_DELFLOWTABLE: return TypeInfo{ObjKind::flowtable, false, NFTA_FLOWTABLE_NAME};
    default: return std::nullopt;
  }
}

// A NUL-terminated string attribute as std::string; "" if malformed.
std::string attr_str(const nlattr* a) {
  if (mnl_attr_validate(a, MNL_TYPE_NUL_STRING) < 0) return "";
  return mnl_attr_get_str(a);
}

std::uint32_t attr_be32(const nlattr* a) {
  if (mnl_attr_validate(a, MNL_TYPE_U32) < 0) return 0;
  return ntohl(mnl_attr_get_u32(a));
}

const char* kind_name(ObjKind k) {
  switch (k) {
    case ObjKind::table: return "table";
    case ObjKind::chain: return "chain";
    case ObjKind::rule: return "rule";
    case ObjKind::set: return "set";
    case ObjKind::element: return "element";
    case ObjKind::object: return "object";
    case ObjKind::flowtable: return "flowtable";
  }
  return "object";
}

}  // namespace

std::optional<Event> parse_event(const nlmsghdr* nlh) {
  if (NFNL_SUBSYS_ID(nlh->nlmsg_type) != NFNL_SUBSYS_NFTABLES) return std::nullopt;
  if (nlh->nlmsg_len < NLMSG_LENGTH(sizeof(nfgenmsg))) return std::nullopt;
  const std::uint16_t msg = NFNL_MSG_TYPE(nlh->nlmsg_type);
  const auto* gen = static_cast<const nfgenmsg*>(mnl_nlmsg_get_payload(nlh));
  Event ev;
  ev.portid = nlh->nlmsg_pid;
  ev.family = gen->nfgen_family;
  if (msg == NFT_MSG_NEWGEN) {
    ev.is_gen = true;
    mnl_attr_parse(nlh, sizeof(nfgenmsg), [](const nlattr* a, void* p) -> int {
      auto* e = static_cast<Event*>(p);
      switch (mnl_attr_get_type(a)) {
        case NFTA_GEN_ID: e->gen_id = attr_be32(a); break;
        case NFTA_GEN_PROC_PID: e->proc_pid = attr_be32(a); break;
        case NFTA_GEN_PROC_NAME: e->proc_name = attr_str(a); break;
        default: break;
      }
      return MNL_CB_OK;
    }, &ev);
    return ev;
  }
  const auto info = type_info(msg);
  if (!info) return std::nullopt;
  ev.kind = info->kind;
  ev.added = info->added;
  struct Ctx {
    Event* ev;
    std::uint16_t name_attr;
    bool has_table = false;
  } ctx{&ev, info->name_attr};
  const int rc = mnl_attr_parse(nlh, sizeof(nfgenmsg), [](const nlattr* a, void* p) -> int {
    auto* c = static_cast<Ctx*>(p);
    const std::uint16_t type = mnl_attr_get_type(a);
    if (type == 1) {  // the table name, see above
      c->ev->table = attr_str(a);
      c->has_table = true;
    } else if (c->name_attr != 0 && type == c->name_attr) {
      c->ev->object = attr_str(a);
    }
    if (c->ev->kind == ObjKind::element && type == NFTA_SET_ELEM_LIST_ELEMENTS) {
      // mnl_attr_for_each_nested is C (void* to nlattr*); the same walk by hand.
      int rest = static_cast<int>(mnl_attr_get_payload_len(a));
      for (auto* e = static_cast<const nlattr*>(mnl_attr_get_payload(a)); mnl_attr_ok(e, rest);
           e = mnl_attr_next(e)) {
        rest -= static_cast<int>(MNL_ALIGN(e->nla_len));
        ++c->ev->elements;
      }
    }
    return MNL_CB_OK;
  }, &ctx);
  if (rc < 0 || !ctx.has_table) return std::nullopt;
  return ev;
}

[[gnu::cold]] std::string TableChanges::describe(const std::string& table) const {  // tampering only: for size
  const std::string name = "table inet " + table;
  if (table_deleted) {
    if (other_tables_deleted > 0) {
      return "ruleset flushed (" + name + " and " + std::to_string(other_tables_deleted) + " other table" +
             (other_tables_deleted == 1 ? "" : "s") + " deleted)";
    }
    return name + " deleted";
  }
  std::string out;
  auto add = [&](const std::string& s) { out += (out.empty() ? "" : ", ") + s; };
  if (table_added) add(name + " changed");
  if (netdev_table_deleted) add("table netdev " + table + " deleted");
  if (netdev_table_added) add("table netdev " + table + " changed");
  const std::string in_netdev = " of table netdev " + table;
  for (const auto& [key, n] : objects) {
    const auto& [kind, added, obj] = key;
    // The deleted netdev table's chains and rules went with it: said once, above.
    if (netdev_table_deleted && obj.size() > in_netdev.size() &&
        obj.compare(obj.size() - in_netdev.size(), in_netdev.size(), in_netdev) == 0) {
      continue;
    }
    const char* verb = added ? "added" : "deleted";
    switch (kind) {
      case ObjKind::rule:
        add((n == 1 ? std::string("rule ") : std::to_string(n) + " rules ") + verb + (added ? " to" : " from") +
            " chain " + obj);
        break;
      case ObjKind::element:
        add((n == 1 ? std::string("element ") : std::to_string(n) + " elements ") + verb +
            (added ? " to" : " from") + " set " + obj);
        break;
      case ObjKind::chain:
      case ObjKind::set:
        // NEW on an existing chain or set is a change (policy, hook, flags).
        add(std::string(kind_name(kind)) + " " + obj + " " + (added ? "added or changed" : "deleted"));
        break;
      default:
        add(std::string(kind_name(kind)) + " " + obj + " " + verb);
        break;
    }
  }
  if (more > 0) add(std::to_string(more) + " more change" + (more == 1 ? "" : "s"));
  return out.empty() ? name + " changed" : out;
}

bool ChangeTracker::is_own(std::uint32_t portid) const {
  return portid != 0 && std::find(own_.begin(), own_.end(), portid) != own_.end();
}

std::optional<Tamper> ChangeTracker::feed(const nlmsghdr* nlh) {
  if (NFNL_SUBSYS_ID(nlh->nlmsg_type) != NFNL_SUBSYS_NFTABLES) return std::nullopt;
  // egressd's own changes: only their NEWGEN matters (it ends the transaction).
  if (is_own(nlh->nlmsg_pid) && NFNL_MSG_TYPE(nlh->nlmsg_type) != NFT_MSG_NEWGEN) return std::nullopt;
  auto ev = parse_event(nlh);
  if (!ev) return std::nullopt;
  return feed(*ev);
}

std::optional<Tamper> ChangeTracker::feed(const Event& ev) {
  if (ev.is_gen) {
    commit_ = Commit{ev.gen_id, ev.portid};
    std::optional<Tamper> out;
    if (!pending_.empty() && !is_own(ev.portid)) {
      out = Tamper{std::move(pending_), ev.portid, ev.proc_pid, ev.proc_name, ev.gen_id};
    }
    pending_ = {};
    return out;
  }
  if (is_own(ev.portid)) return std::nullopt;
  // egressd has two tables of the same name: inet (the policy) and netdev
  // (the egress chains that hold raw frames to it).
  const bool netdev = ev.family == NFPROTO_NETDEV;
  if ((ev.family != NFPROTO_INET && !netdev) || ev.table != table_) {
    if (ev.kind == ObjKind::table && !ev.added) ++pending_.other_tables_deleted;
    return std::nullopt;
  }
  // Kernels before 6.10 delete a netdev base chain themselves (portid 0)
  // when its interface goes away: an interface that disappears is not
  // tampering. (Newer kernels keep the chain; egressd deletes it.)
  if (netdev && ev.portid == 0 && ev.kind == ObjKind::chain && !ev.added) return std::nullopt;
  if (ev.kind == ObjKind::table) {
    if (netdev) {
      (ev.added ? pending_.netdev_table_added : pending_.netdev_table_deleted) = true;
    } else {
      (ev.added ? pending_.table_added : pending_.table_deleted) = true;
    }
    return std::nullopt;
  }
  // Anonymous sets (`{ a, b }` inside a rule) come and go with their rule,
  // which is reported.
  if ((ev.kind == ObjKind::set || ev.kind == ObjKind::element) && ev.object.rfind("__set", 0) == 0) {
    return std::nullopt;
  }
  const std::uint32_t n = ev.kind == ObjKind::element ? std::max<std::uint32_t>(ev.elements, 1) : 1;
  auto key = std::make_tuple(ev.kind, ev.added, netdev ? ev.object + " of table netdev " + table_ : ev.object);
  if (auto it = pending_.objects.find(key); it != pending_.objects.end()) {
    it->second += n;
  } else if (pending_.objects.size() < TableChanges::kMaxObjects) {
    pending_.objects.emplace(std::move(key), n);
  } else {
    pending_.more += n;
  }
  return std::nullopt;
}

}  // namespace egressd::nft
