// The one fake nft::Kernel of the unit tests and fuzz targets. It keeps what
// the Sandbox reads back of tables inet and netdev egressd (comment, flags,
// chains, sets, rule comments per chain) and answers like the kernel where
// egressd's batches depend on it:
//  - a batch is all or nothing: applied to a copy, kept only when every
//    operation succeeded;
//  - add table is exclusive ("File exists"), delete table of a missing table
//    fails, ensure table creates an empty one or keeps the existing one
//    (clearing its flags, e.g. dormant);
//  - operations on objects of a missing table fail.
// Tables other than "egressd" (capability probes) are accepted and ignored.
// Set elements are not tracked: read_set_elems answers from `elems`, which a
// test fills. `fail_next` makes the next batch fail like a kernel refusal.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "nft/netlink.h"

namespace egressd::testing {

class FakeKernel : public nft::Kernel {
 public:
  std::optional<nft::TableInfo> table;   // inet egressd
  std::optional<nft::TableInfo> netdev;  // netdev egressd
  std::vector<nft::Change> applied;      // the batches accepted, in order
  std::size_t accepted = 0;              // applied.size(), for callers that only count
  std::optional<Error> fail_next;        // the next batch fails with this, changing nothing
  std::map<std::string, std::vector<nft::SetElem>> elems;  // by set name, for read_set_elems

  std::optional<nft::TableInfo>& of(nft::Family f) { return f == nft::Family::netdev ? netdev : table; }

  Status apply(const nft::Change& ch) override {
    if (fail_next) {
      Error e = *fail_next;
      fail_next.reset();
      return e;
    }
    std::optional<nft::TableInfo> t = table, n = netdev;
    auto in = [&](nft::Family f) -> std::optional<nft::TableInfo>& { return f == nft::Family::netdev ? n : t; };
    for (const auto& op : ch.ops) {
      if (auto st = apply_op(op, in); !st) return st;
    }
    table = std::move(t);
    netdev = std::move(n);
    applied.push_back(ch);
    ++accepted;
    return {};
  }

  Result<std::optional<nft::TableInfo>> read_table(const std::string&, nft::Family f) override { return of(f); }

  Result<std::vector<nft::SetElem>> read_set_elems(const std::string&, const std::string& set, nft::SetType) override {
    return elems[set];
  }

 private:
  static Error missing(const std::string& what) {
    return Error::runtime(what + ": table egressd does not exist (No such file or directory)");
  }

  template <class In>
  static Status apply_op(const nft::Op& op, In& in) {
    if (auto* add = std::get_if<nft::OpAddTable>(&op)) {
      if (add->table.name != "egressd") return {};  // capability probes
      auto& x = in(add->table.family);
      if (x) return Error::runtime("add table egressd: File exists");
      x.emplace();
      x->comment = add->table.comment;
      for (const auto& s : add->table.sets) x->sets.push_back(s.name);
      for (const auto& c : add->table.chains) {
        x->chains.push_back(c.name);
        for (const auto& r : c.rules) x->rules.push_back({c.name, 0, r.comment, 0, 0});
      }
      return {};
    }
    if (auto* del = std::get_if<nft::OpDeleteTable>(&op)) {
      if (del->name != "egressd") return {};
      auto& x = in(del->family);
      if (!x) return Error::runtime("delete table egressd: No such file or directory");
      x.reset();
      return {};
    }
    if (auto* en = std::get_if<nft::OpEnsureTable>(&op)) {
      if (en->name != "egressd") return {};
      auto& x = in(en->family);
      if (!x) x.emplace();
      x->flags = 0;
      return {};
    }
    if (auto* as = std::get_if<nft::OpAddSet>(&op)) {
      auto& x = in(nft::Family::inet);
      if (!x) return missing("add set " + as->set.name);
      x->sets.push_back(as->set.name);
    } else if (auto* ds = std::get_if<nft::OpDeleteSet>(&op)) {
      auto& x = in(nft::Family::inet);
      if (!x) return missing("delete set " + ds->name);
      std::erase(x->sets, ds->name);
    } else if (auto* ae = std::get_if<nft::OpAddElems>(&op)) {
      if (!in(nft::Family::inet)) return missing("add elements to set " + ae->set);
    } else if (auto* de = std::get_if<nft::OpDeleteElems>(&op)) {
      if (!in(nft::Family::inet)) return missing("delete elements from set " + de->set);
    } else if (auto* ac = std::get_if<nft::OpAddChain>(&op)) {
      auto& x = in(ac->family);
      if (!x) return missing("add chain " + ac->chain.name);
      x->chains.push_back(ac->chain.name);
      for (const auto& r : ac->chain.rules) x->rules.push_back({ac->chain.name, 0, r.comment, 0, 0});
    } else if (auto* dc = std::get_if<nft::OpDeleteChain>(&op)) {
      auto& x = in(dc->family);
      if (!x) return missing("delete chain " + dc->name);
      std::erase(x->chains, dc->name);
      std::erase_if(x->rules, [&](const nft::RuleInfo& r) { return r.chain == dc->name; });
    } else if (auto* fl = std::get_if<nft::OpFlushChain>(&op)) {
      auto& x = in(fl->family);
      if (!x) return missing("flush chain " + fl->name);
      std::erase_if(x->rules, [&](const nft::RuleInfo& r) { return r.chain == fl->name; });
    } else if (auto* ar = std::get_if<nft::OpAddRule>(&op)) {
      auto& x = in(ar->family);
      if (!x) return missing("add rule " + ar->chain);
      x->rules.push_back({ar->chain, 0, ar->rule.comment, 0, 0});
    }
    return {};
  }
};

}  // namespace egressd::testing
