// Sandbox: the `rules` request, the live ruleset as nft text (docs/protocol.md).
//
// Rendered by render_table, the renderer of `egressd render`, from the model
// of the state in force (what the kernel was given, as restore_table would
// give it again) after checking that the kernel's tables still have that
// shape (verify_table), with what changes in the kernel by itself read back:
// every rule's counter, and the elements of the learned (timeout) sets. The
// other sets' elements are egressd's own (policy entries, upstreams, on-link
// prefixes) and change only through egressd.
#include <algorithm>
#include <map>

#include "control/protocol.h"
#include "daemon/sandbox.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

bool elem_less(const nft::SetElem& a, const nft::SetElem& b) { return a.from.bytes < b.from.bytes; }

// Puts the kernel's counter values into `table`'s counters, rule by rule in
// each chain (same shape: verify_table found no difference), and orders sets
// and chains as the kernel lists them.
void fill_from_kernel(nft::Table& table, const nft::TableInfo& info) {
  std::map<std::string, std::vector<const nft::RuleInfo*>> rules;
  for (const auto& r : info.rules) rules[r.chain].push_back(&r);
  for (auto& chain : table.chains) {
    const auto& have = rules[chain.name];
    for (std::size_t i = 0; i < chain.rules.size() && i < have.size(); ++i) {
      bool first = true;  // RuleInfo sums a rule's counters; egressd's rules have one
      for (auto& st : chain.rules[i].stmts) {
        if (auto* c = std::get_if<nft::StmtCounter>(&st)) {
          *c = nft::StmtCounter{true, first ? have[i]->packets : 0, first ? have[i]->bytes : 0};
          first = false;
        }
      }
    }
  }
  auto rank = [](const std::vector<std::string>& order, const std::string& name) {
    return std::find(order.begin(), order.end(), name) - order.begin();
  };
  std::stable_sort(table.sets.begin(), table.sets.end(),
                   [&](const nft::Set& a, const nft::Set& b) { return rank(info.sets, a.name) < rank(info.sets, b.name); });
  std::stable_sort(table.chains.begin(), table.chains.end(), [&](const nft::Chain& a, const nft::Chain& b) {
    return rank(info.chains, a.name) < rank(info.chains, b.name);
  });
}

}  // namespace

Result<std::string> Sandbox::ruleset_text() {
  auto diffs = verify_table();
  if (!diffs) return diffs.error().wrap("cannot read egressd's tables");
  if (!diffs->empty()) {
    std::string what;
    for (const auto& d : *diffs) what += (what.empty() ? "" : "; ") + d;
    return Error::runtime("the kernel's tables differ from the phase in force (" + what +
                          "); egressd restores them when it notices (tamper detection): ask again");
  }
  const Phase& phase = active_phase();
  nft::Table inet = nft::build_table(opts_.policy, state_.is_inline ? &phase : nullptr, state_, opts_.compile);
  auto info = kernel_->read_table(nft::kTableName, nft::Family::inet);
  if (!info) return info.error();
  if (!info->has_value()) return Error::runtime("table inet egressd vanished while being read: ask again");
  for (auto& set : inet.sets) {
    if (!set.timeout) continue;
    auto elems = kernel_->read_set_elems(nft::kTableName, set.name, set.type);
    if (!elems) return elems.error();
    std::sort(elems->begin(), elems->end(), elem_less);  // nft lists hash sets sorted too
    set.elems = std::move(*elems);
  }
  fill_from_kernel(inet, **info);
  std::string text = nft::render_table(inet);
  if (auto netdev = nft::build_netdev_table(state_, opts_.compile)) {
    auto nd = kernel_->read_table(nft::kTableName, nft::Family::netdev);
    if (!nd) return nd.error();
    if (!nd->has_value()) return Error::runtime("table netdev egressd vanished while being read: ask again");
    fill_from_kernel(*netdev, **nd);
    text += nft::render_table(*netdev);
  }
  return text;
}

json Sandbox::rules_reply() {
  auto text = ruleset_text();
  if (!text) return control::error_reply(text.error(), "kernel_error");
  return control::ok_reply({{"ruleset", *text}});
}

}  // namespace egressd::daemon
