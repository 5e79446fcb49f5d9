// What every kernel shares at run time (runtime.cpp).
#pragma once

#include <cstdint>

namespace ls {
// The kernels' thread count (ls_set_threads): each parallel region asks for exactly this
// many, so the count holds whichever thread calls (OpenMP's own setting is per thread).
int32_t threads();
}  // namespace ls
