// The inline state file (SandboxOptions::state_file): the inline policy in
// force, kept beside the table so that a restart adopting the table knows
// its entries (the table's state comment carries only phase, mode and
// generation). Encoding and decoding only; the Sandbox reads and writes the
// file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd::daemon {

// {"allow":[entry texts],"generation":G,"mode":"...","table":"..."} and a
// newline: inline phase `phase` in force at `generation` of the table
// `table` (Sandbox::table_id: derived from the table's random secrets).
std::string encode_inline_state(std::uint64_t generation, const Phase& phase, std::string_view table);

// The inline phase (named "inline") `text` saved for `generation` of `table`.
// Error, the message a reason to log after the file's name, when there is
// none to adopt: "unreadable: ..." (not JSON, or a field missing or of the
// wrong type), or "not adopted: ..." (saved for another table, or another
// generation, an unknown mode, an entry or mode the inline policy rules
// refuse). Generations start again at 1 in every new table, so a file left
// by a removed table can carry the generation of the one in force: the
// table is what tells them apart.
Result<Phase> decode_inline_state(std::string_view text, std::uint64_t generation, std::string_view table);

}  // namespace egressd::daemon
