// The library's identity and its thread count.
#include <atomic>

#include "api.h"
#include "runtime.h"
#include "simd.h"

namespace ls {
namespace {
std::atomic<int32_t> g_threads{1};  // set by the engine (--threads)
}  // namespace

int32_t threads() { return g_threads.load(std::memory_order_relaxed); }
}  // namespace ls

extern "C" {
const char* ls_variant() { return ls::kVariant; }
void ls_set_threads(int32_t n) { ls::g_threads.store(n > 0 ? n : 1, std::memory_order_relaxed); }
}
