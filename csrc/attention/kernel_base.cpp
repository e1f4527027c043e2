// Baseline build of the attention kernels (the toolchain's default ISA, e.g. SSE2 on
// x86-64): always available.
// Compiles kernel_impl.h for this ISA; see kernel_api.h for why the kernels are torch-free.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention/kernel_api.h"

#if 1
#pragma GCC push_options
// no target pragma: compiled for the baseline ISA of the toolchain
#define HP_NS isa_base
#define HP_VB 16
#define HP_MR 4
#define HP_NVMAX 2
#include "attention/kernel_impl.h"
#pragma GCC pop_options

namespace hp_attn {
const KernelTable* kernels_base() {
  static const KernelTable table = {"base", HP_NS::fwd_f32, HP_NS::fwd_f64, HP_NS::bwd_f32,
                                    HP_NS::bwd_f64, nullptr, nullptr};
  return &table;
}
}  // namespace hp_attn
#else
namespace hp_attn {
const KernelTable* kernels_base() { return nullptr; }
}  // namespace hp_attn
#endif
