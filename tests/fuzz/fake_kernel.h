// A fake nft::Kernel for the control fuzz targets, after FakeKernel in
// tests/unit/sandbox_test.cc: it keeps the parts of the table the Sandbox
// reads back (table comment, rule comments per chain) and counts accepted
// batches, so a target can assert "an invalid request changes nothing".
// `fail_next` makes the next batch fail like a kernel refusal.
#pragma once

#include <optional>
#include <string>
#include <variant>

#include "nft/netlink.h"

namespace egressd::fuzz {

class FakeKernel : public nft::Kernel {
 public:
  std::size_t accepted = 0;  // batches applied (failed ones excluded)
  std::optional<nft::TableInfo> table;
  bool fail_next = false;

  Status apply(const nft::Change& ch) override {
    if (fail_next) {
      fail_next = false;
      return Error::runtime("add rule active: No buffer space available (injected)");
    }
    // Apply to a copy: a batch is all or nothing, like the kernel's.
    std::optional<nft::TableInfo> t = table;
    for (const auto& op : ch.ops) {
      if (auto* add = std::get_if<nft::OpAddTable>(&op)) {
        if (add->table.name != ch.table || ch.table != "egressd") continue;  // capability probes
        if (add->table.family == nft::Family::netdev) continue;  // the egress chains: not read back
        nft::TableInfo info;
        info.comment = add->table.comment;
        for (const auto& s : add->table.sets) info.sets.push_back(s.name);
        for (const auto& c : add->table.chains) {
          info.chains.push_back(c.name);
          for (const auto& r : c.rules) info.rules.push_back({c.name, 0, r.comment, 0, 0});
        }
        t = info;
        continue;
      }
      if (auto* del = std::get_if<nft::OpDeleteTable>(&op)) {
        if (del->name != "egressd" || del->family == nft::Family::netdev) continue;
        if (!t) return Error::runtime("delete table " + del->name + ": No such file or directory");
        t.reset();
        continue;
      }
      if (std::holds_alternative<nft::OpEnsureTable>(op)) continue;
      if (auto* fl = std::get_if<nft::OpFlushChain>(&op); fl && fl->family == nft::Family::netdev) continue;
      if (auto* ar = std::get_if<nft::OpAddRule>(&op); ar && ar->family == nft::Family::netdev) continue;
      if (auto* ac = std::get_if<nft::OpAddChain>(&op); ac && ac->family == nft::Family::netdev) continue;
      if (auto* dc = std::get_if<nft::OpDeleteChain>(&op); dc && dc->family == nft::Family::netdev) continue;
      if (!t) return Error::runtime("operation on table egressd, which does not exist");
      if (auto* fl = std::get_if<nft::OpFlushChain>(&op)) {
        std::erase_if(t->rules, [&](const nft::RuleInfo& r) { return r.chain == fl->name; });
      } else if (auto* ar = std::get_if<nft::OpAddRule>(&op)) {
        t->rules.push_back({ar->chain, 0, ar->rule.comment, 0, 0});
      } else if (auto* ac = std::get_if<nft::OpAddChain>(&op)) {
        t->chains.push_back(ac->chain.name);
        for (const auto& r : ac->chain.rules) t->rules.push_back({ac->chain.name, 0, r.comment, 0, 0});
      } else if (auto* dc = std::get_if<nft::OpDeleteChain>(&op)) {
        std::erase(t->chains, dc->name);
        std::erase_if(t->rules, [&](const nft::RuleInfo& r) { return r.chain == dc->name; });
      } else if (auto* as = std::get_if<nft::OpAddSet>(&op)) {
        t->sets.push_back(as->set.name);
      } else if (auto* ds = std::get_if<nft::OpDeleteSet>(&op)) {
        std::erase(t->sets, ds->name);
      }
    }
    table = std::move(t);
    ++accepted;
    return {};
  }

  Result<std::optional<nft::TableInfo>> read_table(const std::string&, nft::Family f) override {
    return f == nft::Family::inet ? table : std::nullopt;
  }
};

}  // namespace egressd::fuzz
