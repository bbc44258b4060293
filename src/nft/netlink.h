// The kernel side of src/nft: sends a Change as ONE nftables batch over
// NETLINK_NETFILTER (libmnl + libnftnl) and reads egressd's table back.
// Everything here acts on the network namespace the calling thread is in when
// the object is created (the netlink socket binds to it).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "egressd/result.h"
#include "nft/model.h"

namespace egressd::nft {

struct RuleInfo {
  std::string chain;
  std::uint64_t handle = 0;
  std::string comment;          // userdata comment, "" if none
  std::uint64_t packets = 0;    // summed over counter expressions in the rule
  std::uint64_t bytes = 0;
};

struct TableInfo {
  std::string comment;
  std::uint32_t flags = 0;          // NFT_TABLE_F_* (dormant: the table does nothing)
  std::vector<std::string> chains;  // kernel order
  std::vector<std::string> sets;
  std::vector<RuleInfo> rules;      // every rule of every chain, kernel order
};

// The narrow interface the daemon uses; fakes implement it in unit tests.
class Kernel {
 public:
  virtual ~Kernel() = default;
  // Sends `change` as one batch (BEGIN ... END) and reads every ack. The kernel
  // applies all of it or nothing. On failure the error names the operation and
  // object that failed (e.g. `add set ph_agent_v4: File exists`) and nothing
  // changed. Large element lists are split across messages under the netlink
  // size limit but stay in the same batch.
  virtual Status apply(const Change& change) = 0;
  // Reads table `family` `name` (chains, sets, rules with comments and
  // counters); nullopt when it does not exist.
  virtual Result<std::optional<TableInfo>> read_table(const std::string& name, Family family) = 0;
  // One attempt of read_table, never waiting: sets `interfered` (and returns
  // nothing useful) when commits by anyone spoiled it; the caller tries again
  // after a pause (nft/read_async.h).
  virtual Result<std::optional<TableInfo>> read_table_once(const std::string& name, Family family, bool& interfered) {
    interfered = false;
    return read_table(name, family);
  }
  // The rules of chain `chain` of table `family` `name`, one dump (cheaper
  // than read_table when only counters matter): empty when the table or the
  // chain does not exist; `interfered` when a commit by anyone spoiled it.
  virtual Result<std::vector<RuleInfo>> read_chain_once(const std::string& name, Family family,
                                                        const std::string& chain, bool& interfered) {
    auto table = read_table_once(name, family, interfered);
    if (!table) return table.error();
    std::vector<RuleInfo> out;
    if (*table) {
      for (auto& r : (*table)->rules) {
        if (r.chain == chain) out.push_back(std::move(r));
      }
    }
    return out;
  }
  // The elements of set `set` of table inet `table` (hash sets: from == to,
  // timeout_ms as added, 0 for none). Error when the set does not exist.
  virtual Result<std::vector<SetElem>> read_set_elems(const std::string& table, const std::string& set, SetType type) {
    (void)table, (void)set, (void)type;
    return Error::runtime("reading set elements: not supported");
  }
  // The netlink portid of the socket changes are sent from (0 = none): the
  // kernel's change notifications carry it, which tells egressd's own changes
  // from everyone else's (nft/monitor.h).
  virtual std::uint32_t portid() const { return 0; }
  // The namespace's ruleset generation (NFT_MSG_GETGEN): every committed
  // batch, anyone's, moves it by one.
  virtual Result<std::uint32_t> generation() { return Error::runtime("ruleset generation: not supported"); }
};

// The userdata of a set element as nft(8) writes it (TLV: type u8, length
// u8, value): `comment` NUL-terminated when not empty (at most
// kElemCommentMax bytes, no NUL: the caller checks), then the open-interval
// flag when `open_interval`. "" when neither.
std::string elem_userdata(std::string_view comment, bool open_interval);
// The comment in a set element's userdata `data`/`len` (what
// NFTNL_SET_ELEM_USERDATA holds); "" when there is none or the TLVs are
// malformed (truncated, not NUL-terminated).
std::string elem_comment(const void* data, std::size_t len);

// Opens a netlink socket in the current network namespace.
Result<std::unique_ptr<Kernel>> open_kernel();

}  // namespace egressd::nft
