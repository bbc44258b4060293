#include "audit/psl.h"

#include <dlfcn.h>
#include <libpsl.h>

namespace egressd::audit {

namespace {

struct DlClose {
  void operator()(void* h) const { dlclose(h); }
};
using Library = std::unique_ptr<void, DlClose>;

// The libpsl functions used, looked up once in the opened library.
struct PslApi {
  decltype(&psl_load_file) load_file = nullptr;
  decltype(&psl_builtin) builtin = nullptr;
  decltype(&psl_free) free = nullptr;
  decltype(&psl_is_public_suffix2) is_public_suffix2 = nullptr;
  decltype(&psl_registrable_domain) registrable_domain = nullptr;
};

template <typename F>
bool lookup(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

// Both sections present, and a plain registrable name is not a suffix.
bool complete(const PslApi& api, const psl_ctx_t* ctx) {
  return api.is_public_suffix2(ctx, "com", PSL_TYPE_ICANN | PSL_TYPE_NO_STAR_RULE) != 0 &&
         api.is_public_suffix2(ctx, "github.io", PSL_TYPE_PRIVATE | PSL_TYPE_NO_STAR_RULE) != 0 &&
         api.is_public_suffix2(ctx, "example.com", PSL_TYPE_ANY) == 0;
}

class LibPsl : public PublicSuffixes {
 public:
  // `owned` is freed with psl_free; the builtin context is libpsl's own.
  LibPsl(Library lib, const PslApi& api, const psl_ctx_t* ctx, bool owned)
      : lib_(std::move(lib)), api_(api), ctx_(ctx), owned_(owned) {}
  ~LibPsl() override {
    if (owned_) api_.free(const_cast<psl_ctx_t*>(ctx_));
  }
  LibPsl(const LibPsl&) = delete;
  LibPsl& operator=(const LibPsl&) = delete;

  bool registrable(const std::string& name) const override {
    // psl_registrable_domain is null for a suffix (either section, the
    // "*" rule included) and for what has no registrable part.
    return api_.is_public_suffix2(ctx_, name.c_str(), PSL_TYPE_ANY) == 0 &&
           api_.registrable_domain(ctx_, name.c_str()) != nullptr;
  }

 private:
  Library lib_;  // declared first: closed after the context is freed
  PslApi api_;
  const psl_ctx_t* ctx_;
  bool owned_;
};

}  // namespace

LoadedPsl load_public_suffixes(const PslSources& from) {
  LoadedPsl out;
  Library lib(dlopen(from.library.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (!lib) {
    const char* e = dlerror();
    out.error = from.library + ": " + (e != nullptr ? e : "cannot be opened");
    return out;
  }
  PslApi api;
  if (!lookup(lib.get(), "psl_load_file", api.load_file) || !lookup(lib.get(), "psl_builtin", api.builtin) ||
      !lookup(lib.get(), "psl_free", api.free) || !lookup(lib.get(), "psl_is_public_suffix2", api.is_public_suffix2) ||
      !lookup(lib.get(), "psl_registrable_domain", api.registrable_domain)) {
    out.error = from.library + ": not libpsl 0.16 or later (a function is missing)";
    return out;
  }
  std::string tried;
  for (const auto& f : from.files) {
    psl_ctx_t* ctx = api.load_file(f.c_str());
    if (ctx == nullptr) {
      tried += (tried.empty() ? "" : "; ") + f + ": cannot be read";
      continue;
    }
    if (!complete(api, ctx)) {
      api.free(ctx);
      tried += (tried.empty() ? "" : "; ") + f + ": incomplete (no com or github.io)";
      continue;
    }
    out.list = std::make_unique<LibPsl>(std::move(lib), api, ctx, true);
    return out;
  }
  if (from.builtin) {
    if (const psl_ctx_t* ctx = api.builtin(); ctx != nullptr && complete(api, ctx)) {
      out.list = std::make_unique<LibPsl>(std::move(lib), api, ctx, false);
      return out;
    }
    tried += (tried.empty() ? "" : "; ") + std::string("libpsl's builtin list: empty or incomplete");
  }
  out.error = tried.empty() ? "no source given" : tried;
  return out;
}

}  // namespace egressd::audit
