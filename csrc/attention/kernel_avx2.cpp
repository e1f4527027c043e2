// AVX2 + FMA build of the attention kernels: 16 ymm registers, 4 x (<=3 vectors)
// register tiles. Only called after a runtime CPU check.
// Compiles kernel_impl.h for this ISA; see kernel_api.h for why the kernels are torch-free.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention/kernel_api.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi2,popcnt")
#define HP_NS isa_avx2
#define HP_VB 32
#define HP_MR 4
#define HP_NVMAX 3
#include "attention/kernel_impl.h"
#pragma GCC pop_options

namespace hp_attn {
const KernelTable* kernels_avx2() {
  static const KernelTable table = {"avx2", HP_NS::fwd_f32, HP_NS::fwd_f64, HP_NS::bwd_f32,
                                    HP_NS::bwd_f64, nullptr, nullptr};
  return &table;
}
}  // namespace hp_attn
#else
namespace hp_attn {
const KernelTable* kernels_avx2() { return nullptr; }
}  // namespace hp_attn
#endif
