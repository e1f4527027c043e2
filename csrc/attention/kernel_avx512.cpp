// AVX-512 (F/DQ/BW/VL) + FMA build of the attention kernels: 32 zmm registers,
// 4 x (<=6 vectors) register tiles. Only called after a runtime CPU check.
// Compiles kernel_impl.h for this ISA; see kernel_api.h for why the kernels are torch-free.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention/kernel_api.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi2,popcnt")
#define HP_NS isa_avx512
#define HP_VB 64
#define HP_MR 4
#define HP_NVMAX 6
#include "attention/kernel_impl.h"
#pragma GCC pop_options

namespace hp_attn {
const KernelTable* kernels_avx512() {
  static const KernelTable table = {"avx512", HP_NS::fwd_f32, HP_NS::fwd_f64, HP_NS::bwd_f32,
                                    HP_NS::bwd_f64, nullptr, nullptr};
  return &table;
}
}  // namespace hp_attn
#else
namespace hp_attn {
const KernelTable* kernels_avx512() { return nullptr; }
}  // namespace hp_attn
#endif
