// The inline state file's text (daemon/inline_state.h): what a switch to an
// inline policy writes, and what a restart adopts from it or refuses, with
// the reason it logs.
#include <doctest/doctest.h>

#include "daemon/inline_state.h"

using namespace egressd;
using namespace egressd::daemon;

namespace {

Phase inline_phase(Mode mode, std::vector<std::string> entries) {
  auto p = make_inline_phase("inline", mode, entries);
  REQUIRE(p.ok());
  return *p;
}

std::vector<std::string> texts(const Phase& p) {
  std::vector<std::string> out;
  for (const auto& e : p.entries) out.push_back(e.text);
  return out;
}

}  // namespace

TEST_CASE("inline state: the text written, and the phase read back for its generation") {
  const Phase written = inline_phase(Mode::allowlist, {"PyPI.org", "198.51.100.7", "*.example.org", "2001:db8::/32"});
  const std::string text = encode_inline_state(12, written, "t1");
  // Normalized entries, in the phase's order; keys sorted; one line.
  CHECK(text == "{\"allow\":[\"pypi.org\",\"198.51.100.7\",\"*.example.org\",\"2001:db8::/32\"],"
                "\"generation\":12,\"mode\":\"allowlist\",\"table\":\"t1\"}\n");

  auto read = decode_inline_state(text, 12, "t1");
  REQUIRE(read.ok());
  CHECK(read->name == "inline");
  CHECK(read->mode == Mode::allowlist);
  CHECK(texts(*read) == std::vector<std::string>{"pypi.org", "198.51.100.7", "*.example.org", "2001:db8::/32"});
  CHECK(read->entries[1].kind == EntryKind::ipv4);
  CHECK(read->entries[3].kind == EntryKind::ipv6_cidr);

  for (Mode m : {Mode::public_, Mode::no_network}) {
    const std::string t = encode_inline_state(3, inline_phase(m, {}), "t1");
    CHECK(t.find("\"allow\":[]") != std::string::npos);
    auto back = decode_inline_state(t, 3, "t1");
    REQUIRE(back.ok());
    CHECK(back->mode == m);
    CHECK(back->entries.empty());
  }
}

TEST_CASE("inline state: a file of another generation is not adopted") {
  const std::string text = encode_inline_state(4, inline_phase(Mode::allowlist, {"pypi.org"}), "t1");
  auto r = decode_inline_state(text, 5, "t1");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "not adopted: saved for generation 4, the table's is 5");
  // What follows the generation is not looked at: a stale file is stale, not broken.
  auto stale = decode_inline_state(R"({"generation":4,"table":"t1"})", 5, "t1");
  REQUIRE_FALSE(stale.ok());
  CHECK(stale.error().message == "not adopted: saved for generation 4, the table's is 5");
}

TEST_CASE("inline state: an unknown mode or an entry the inline rules refuse is not adopted") {
  auto mode = decode_inline_state(R"({"generation":2,"table":"t1","mode":"Allowlist\n","allow":[]})", 2, "t1");
  REQUIRE_FALSE(mode.ok());
  CHECK(mode.error().message == "not adopted: unknown mode \"Allowlist\\n\"");

  auto entry = decode_inline_state(R"({"generation":2,"table":"t1","mode":"allowlist","allow":["pypi.org","*"]})", 2, "t1");
  REQUIRE_FALSE(entry.ok());
  CHECK(entry.error().message.rfind("not adopted: ", 0) == 0);
  CHECK(entry.error().message.find("\"*\"") != std::string::npos);

  // Entries with a mode that takes none.
  auto mixed = decode_inline_state(R"({"generation":2,"table":"t1","mode":"public","allow":["pypi.org"]})", 2, "t1");
  REQUIRE_FALSE(mixed.ok());
  CHECK(mixed.error().message ==
        "not adopted: allowlist entries are only valid with mode allowlist, not public");
}

TEST_CASE("inline state: garbage and missing or mistyped fields are unreadable") {
  for (const char* text : {"", "{", "not json", "{\"generation\":2,\"mode\":\"public\",\"allow\":[]} trailing",
                           "{\"mode\":\"public\",\"allow\":[]}", "{\"generation\":\"2\",\"mode\":\"public\",\"allow\":[]}",
                           "{\"generation\":2,\"table\":\"t1\",\"allow\":[]}", "{\"generation\":2,\"table\":\"t1\",\"mode\":\"allowlist\"}",
                           "{\"generation\":2,\"table\":\"t1\",\"mode\":\"allowlist\",\"allow\":[1]}", "[2,\"public\",[]]"}) {
    CAPTURE(text);
    auto r = decode_inline_state(text, 2, "t1");
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message.rfind("unreadable: [json.exception.", 0) == 0);
  }
}

TEST_CASE("inline state: a file of another table is not adopted, whatever its generation") {
  // Generations start again at 1 in a new table: a file a removed table left
  // can carry the generation in force (found by an attack review).
  const std::string text = encode_inline_state(2, inline_phase(Mode::allowlist, {"198.51.100.11"}), "old");
  auto r = decode_inline_state(text, 2, "new");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "not adopted: saved for another table (one removed since, or an older egressd's)");
  // A file written before files named their table.
  auto unnamed = decode_inline_state(R"({"generation":2,"mode":"allowlist","allow":["198.51.100.11"]})", 2, "new");
  REQUIRE_FALSE(unnamed.ok());
  CHECK(unnamed.error().message.find("another table") != std::string::npos);
  CHECK(decode_inline_state(text, 2, "old").ok());
}
