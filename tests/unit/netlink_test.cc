// The pure parts of src/nft/netlink.h: a set element's userdata (the comment
// learned sets carry), built byte for byte as libnftnl builds it for nft(8)
// and parsed back with its bounds. What the kernel does with it is in
// tests/integration/netlink_test.cc.
#include "nft/netlink.h"

#include <doctest/doctest.h>
#include <libnftnl/udata.h>

#include <cstdint>
#include <memory>
#include <string>

using namespace egressd::nft;

namespace {

// What nft 1.0.6 attaches to an element (src/netlink.c): the comment with
// nftnl_udata_put_strz, then the flags.
std::string nft_udata(const std::string& comment, bool open_interval) {
  std::unique_ptr<nftnl_udata_buf, void (*)(const nftnl_udata_buf*)> ud(nftnl_udata_buf_alloc(256),
                                                                        nftnl_udata_buf_free);
  REQUIRE(ud != nullptr);
  if (!comment.empty()) REQUIRE(nftnl_udata_put_strz(ud.get(), NFTNL_UDATA_SET_ELEM_COMMENT, comment.c_str()));
  if (open_interval) REQUIRE(nftnl_udata_put_u32(ud.get(), NFTNL_UDATA_SET_ELEM_FLAGS, NFTNL_SET_ELEM_F_INTERVAL_OPEN));
  return {static_cast<const char*>(nftnl_udata_buf_data(ud.get())), nftnl_udata_buf_len(ud.get())};
}

}  // namespace

TEST_CASE("element userdata is libnftnl's bytes for a comment, the open-interval flag, or both") {
  CHECK(elem_userdata("", false).empty());
  CHECK(elem_userdata("allowed.test", false) == nft_udata("allowed.test", false));
  CHECK(elem_userdata("", true) == nft_udata("", true));
  CHECK(elem_userdata("a.test b.test", true) == nft_udata("a.test b.test", true));
  const std::string longest(kElemCommentMax, 'a');
  CHECK(elem_userdata(longest, false) == nft_udata(longest, false));
}

TEST_CASE("the comment reads back from element userdata; malformed userdata has none") {
  for (const bool open : {false, true}) {
    const std::string ud = elem_userdata("a.test b.test", open);
    CHECK(elem_comment(ud.data(), ud.size()) == "a.test b.test");
  }
  const std::string flags_only = elem_userdata("", true);
  CHECK(elem_comment(flags_only.data(), flags_only.size()).empty());
  CHECK(elem_comment(nullptr, 0).empty());
  // The flags first, then the comment (an order nft does not write) still reads.
  const std::string reversed = flags_only + elem_userdata("x.test", false);
  CHECK(elem_comment(reversed.data(), reversed.size()) == "x.test");
  // Truncated anywhere: nothing read past the end.
  const std::string ud = elem_userdata("allowed.test", false);
  for (std::size_t n = 0; n < ud.size(); ++n) CHECK(elem_comment(ud.data(), n).empty());
  // Not NUL-terminated: no comment, as nft decides.
  std::string bad = ud;
  bad.back() = 'x';
  CHECK(elem_comment(bad.data(), bad.size()).empty());
  // A NUL inside ends it.
  std::string inner = ud;
  inner[2 + 7] = '\0';
  CHECK(elem_comment(inner.data(), inner.size()) == "allowed");
}
