// Properties of an accepted policy, shared by the policy readers' fuzz targets
// (policy_fuzz: egressd YAML/JSON and AgentCompass env-params; harbor_task_fuzz:
// Harbor task.toml). Every reader must hand the daemon the same kind of Policy:
//  - at least one phase, valid unique phase names, initial_phase names one of them,
//    entries only in allowlist phases, every entry a normalized fixed point of
//    parse_entry, no duplicate entries in a phase, min_ttl <= 24h, upstreams valid;
//  - one origin per phase (what `egressd check` prints);
//  - every phase compiles: the whole table builds and renders, its active-state comment
//    parses back to the same state, and the staged digest is found again in the table
//    comment; the first phase also compiles as an inline policy.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>

#include "egressd/policy.h"
#include "egressd/policy_input.h"
#include "fuzz_check.h"
#include "nft/compile.h"
#include "nft/model.h"

namespace fuzz_policy {

inline void check_compiles(const egressd::Policy& p) {
  using namespace egressd;
  const nft::CompileOptions opts;
  const std::string digest = nft::staged_digest(p, opts);
  FUZZ_CHECK(digest.size() == 16);
  std::uint64_t gen = 1;
  for (const Phase& ph : p.phases) {
    const nft::ActiveState st = nft::make_state(p, ph, gen++, false);
    FUZZ_CHECK(st.phase == ph.name && st.mode == ph.mode && st.mark == nft::phase_mark(p, ph.name));
    const auto back = nft::ActiveState::parse_comment(st.to_comment());
    FUZZ_CHECK(back.ok());
    FUZZ_CHECK(back->generation == st.generation && back->phase == st.phase && back->mode == st.mode &&
               back->mark == st.mark && !back->is_inline);
    FUZZ_CHECK(st.to_comment().size() <= 127);  // NFTNL_UDATA_COMMENT_MAXLEN - 1
    const nft::Table t = nft::build_table(p, nullptr, st, opts);
    FUZZ_CHECK(nft::digest_from_table_comment(t.comment) == digest);
    FUZZ_CHECK(t.comment.size() <= 127);
    FUZZ_CHECK(!nft::render_table(t).empty());
  }
  // The first phase as an inline policy too (the other compile path).
  const Phase& ph = p.phases.front();
  const nft::ActiveState st = nft::make_state(p, ph, 7, true);
  const nft::Table t = nft::build_table(p, &ph, st, opts);
  FUZZ_CHECK(!nft::render_table(t).empty());
}

inline void check_policy(const egressd::Policy& p) {
  using namespace egressd;
  FUZZ_CHECK(!p.phases.empty());
  FUZZ_CHECK(p.find(p.initial_phase) != nullptr);
  FUZZ_CHECK(p.dns.min_ttl_s <= 24 * 3600);
  FUZZ_CHECK(!p.dns.upstream.empty());
  for (const auto& u : p.dns.upstream) FUZZ_CHECK(u == "resolv.conf" || parse_ip(u).has_value());
  std::unordered_set<std::string> names;
  for (const Phase& ph : p.phases) {
    FUZZ_CHECK(valid_phase_name(ph.name));
    FUZZ_CHECK(names.insert(ph.name).second);
    FUZZ_CHECK(ph.mode == Mode::allowlist || ph.entries.empty());
    std::unordered_set<std::string> seen;
    for (const Entry& e : ph.entries) {
      FUZZ_CHECK(seen.insert(e.text).second);
      const auto again = parse_entry(e.text);
      FUZZ_CHECK(again.ok() && *again == e);
    }
  }
  check_compiles(p);
}

// A reader's result for `file`: an invalid-kind error starting "<file>:", or a document
// whose policy passes check_policy.
inline void check_document(const egressd::Result<egressd::PolicyDocument>& r, std::string_view file) {
  using namespace egressd;
  if (!r.ok()) {
    FUZZ_CHECK(r.error().kind == ErrorKind::invalid);
    FUZZ_CHECK(r.error().message.rfind(std::string(file) + ":", 0) == 0);
    return;
  }
  FUZZ_CHECK(r->origins.size() == r->policy.phases.size());
  check_policy(r->policy);
}

}  // namespace fuzz_policy
