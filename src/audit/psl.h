// The Public Suffix List for `egressctl hosts --suggest --wildcards`, read
// with libpsl. libpsl is opened at run time (dlopen), not linked: its
// closure (libidn2, libunistring: ~2 MiB) does not fit the image's 10 MiB
// budget (DESIGN §5), and only this one egressctl option needs it. Where the
// library or its data is missing (the image) the suggestion fails closed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "audit/suggest.h"

namespace egressd::audit {

// Where the list is looked for, in order: each file with libpsl's
// psl_load_file (DAFSA or text), then, with `builtin`, the list compiled
// into libpsl.
struct PslSources {
  std::string library = "libpsl.so.5";
  // Debian's package `publicsuffix`, which libpsl5 depends on.
  std::vector<std::string> files = {"/usr/share/publicsuffix/public_suffix_list.dafsa",
                                    "/usr/share/publicsuffix/public_suffix_list.dat"};
  bool builtin = true;
};

struct LoadedPsl {
  std::unique_ptr<PublicSuffixes> list;  // null if nothing usable was found
  std::string error;                     // why `list` is null: every source tried and what it lacked
};

// The first source whose list knows both sections (ICANN "com", PRIVATE
// "github.io"): a list without its PRIVATE section would let *.github.io
// through. The result owns the library handle and the libpsl context.
LoadedPsl load_public_suffixes(const PslSources& from = {});

}  // namespace egressd::audit
