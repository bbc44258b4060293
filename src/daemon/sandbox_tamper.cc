// Sandbox: putting table inet egressd back after someone else changed it, and
// comparing the kernel's table with the phase in force (tamper_guard.h).
#include <linux/netfilter/nf_tables.h>

#include <algorithm>
#include <map>

#include "daemon/sandbox.h"
#include "nft/read_async.h"

namespace egressd::daemon {

Status Sandbox::restore_table() {
  const Phase& phase = active_phase();
  nft::Change ch;
  ch.table = nft::kTableName;
  // Ensure + delete + add: one transaction whether or not the table (or
  // any of its contents) is still there, so there is no moment without it.
  // Both tables, in the same batch: the netdev one for the interfaces the
  // namespace has now (one that vanished is not put back). The relay targets
  // and on-link prefixes are part of the build (opts_.compile).
  ch.ops.push_back(nft::OpEnsureTable{nft::kTableName});
  ch.ops.push_back(nft::OpDeleteTable{nft::kTableName});
  ch.ops.push_back(
      nft::OpAddTable{nft::build_table(opts_.policy, state_.is_inline ? &phase : nullptr, state_, opts_.compile)});
  rebuild_netdev(ch);
  for (auto& op : carried_learned(phase, *active_facts_, active_chain())) ch.ops.push_back(std::move(op));
  return kernel_->apply(ch);
}

namespace {

// Differences between the kernel's table `info` and `want`, by chain and set
// names and by rule comments per chain, as "<what> ..." lines.
[[gnu::cold]] void compare_table(const std::string& what, const nft::TableInfo& info, const nft::Table& want,
                   std::vector<std::string>& diffs) {
  if (info.flags & NFT_TABLE_F_DORMANT) diffs.push_back(what + " dormant");
  if (info.comment != want.comment) diffs.push_back(what + ": comment changed");
  auto compare_names = [&](const char* kind, std::vector<std::string> have, std::vector<std::string> expect) {
    std::sort(have.begin(), have.end());
    std::sort(expect.begin(), expect.end());
    std::vector<std::string> extra, missing;
    std::set_difference(have.begin(), have.end(), expect.begin(), expect.end(), std::back_inserter(extra));
    std::set_difference(expect.begin(), expect.end(), have.begin(), have.end(), std::back_inserter(missing));
    const std::string in = want.family == nft::Family::netdev ? " (" + what + ")" : "";
    for (const auto& n : extra) diffs.push_back(std::string(kind) + " " + n + in + " added");
    for (const auto& n : missing) diffs.push_back(std::string(kind) + " " + n + in + " missing");
  };
  std::vector<std::string> want_chains, want_sets;
  for (const auto& c : want.chains) want_chains.push_back(c.name);
  for (const auto& s : want.sets) want_sets.push_back(s.name);
  compare_names("chain", info.chains, want_chains);
  compare_names("set", info.sets, want_sets);

  std::map<std::string, std::vector<std::string>> have_rules;
  for (const auto& r : info.rules) have_rules[r.chain].push_back(r.comment);
  for (const auto& c : want.chains) {
    std::vector<std::string> expect;
    for (const auto& r : c.rules) expect.push_back(r.comment);
    const auto it = have_rules.find(c.name);
    const std::vector<std::string> none;
    const auto& have = it == have_rules.end() ? none : it->second;
    if (have == expect) continue;
    if (it == have_rules.end() && std::find(info.chains.begin(), info.chains.end(), c.name) == info.chains.end()) {
      continue;  // reported as a missing chain
    }
    diffs.push_back("chain " + c.name + (want.family == nft::Family::netdev ? " (" + what + ")" : "") + ": " +
                    std::to_string(have.size()) + " rules, " + std::to_string(expect.size()) + " expected" +
                    (have.size() == expect.size() ? " (changed)" : ""));
  }
}

}  // namespace

std::vector<std::string> Sandbox::compare_inet(const std::optional<nft::TableInfo>& read) {
  std::vector<std::string> diffs;
  if (!read.has_value()) {
    diffs.push_back("table inet egressd missing");
  } else {
    const Phase& phase = active_phase();
    const nft::Table want = nft::build_table(opts_.policy, state_.is_inline ? &phase : nullptr, state_, opts_.compile);
    compare_table("table inet egressd", *read, want, diffs);
  }
  return diffs;
}

void Sandbox::compare_netdev(const std::optional<nft::TableInfo>& read, const nft::Table& want,
                             std::vector<std::string>& diffs) {
  if (!read.has_value()) {
    diffs.push_back("table netdev egressd missing");
  } else {
    compare_table("table netdev egressd", *read, want, diffs);
  }
}

// Each table is compared with the phase in force right after its read (the
// async form may pause between the two reads, and a switch may run then).
// The netdev table is compared with the interfaces the watcher last
// reported: one that vanished since is dropped from the table by the
// watcher's update (never a difference here), one that appeared is added
// by it.
Result<std::vector<std::string>> Sandbox::verify_table() {
  auto read = kernel_->read_table(nft::kTableName, nft::Family::inet);
  if (!read) return read.error();
  std::vector<std::string> diffs = compare_inet(*read);
  if (const auto want = nft::build_netdev_table(state_, opts_.compile)) {
    auto nd = kernel_->read_table(nft::kTableName, nft::Family::netdev);
    if (!nd) return nd.error();
    compare_netdev(*nd, *want, diffs);
  }
  return diffs;
}

boost::asio::awaitable<Result<std::vector<std::string>>> Sandbox::verify_table_async() {
  auto read = co_await nft::read_table_async(*kernel_, nft::kTableName, nft::Family::inet);
  if (!read) co_return read.error();
  std::vector<std::string> diffs = compare_inet(*read);
  if (nft::build_netdev_table(state_, opts_.compile)) {
    auto nd = co_await nft::read_table_async(*kernel_, nft::kTableName, nft::Family::netdev);
    if (!nd) co_return nd.error();
    if (const auto want = nft::build_netdev_table(state_, opts_.compile)) compare_netdev(*nd, *want, diffs);
  }
  co_return diffs;
}

}  // namespace egressd::daemon
