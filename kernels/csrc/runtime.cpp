// The library's identity and its thread count.
#include <omp.h>

#include "api.h"
#include "simd.h"

extern "C" {
const char* ls_variant() { return ls::kVariant; }
void ls_set_threads(int32_t n) { omp_set_num_threads(n > 0 ? n : 1); }
}
