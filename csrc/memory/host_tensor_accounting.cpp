// Live and peak bytes of CPU tensor storage: the host analogue of a device allocator's
// memory_allocated / max_memory_allocated.
//
// A CPU rank's resident set also holds the Python process, the loaded libraries and the heap's
// free pages, none of which a CUDA/NPU allocator counts. To report what a device would count,
// the trainer installs a counting allocator for DeviceType::CPU that forwards every allocation
// to the allocator in place before it (the default CPU allocator, with its alignment and
// profiler reporting) and records the requested size of each live block.
//
// Contract:
//   * ``allocate(n)`` returns a DataPtr whose data == context (a "simple" DataPtr, so
//     raw_allocate / raw_deallocate keep working) with this allocator's deleter; the deleter
//     subtracts the block's size and calls the previous allocator's raw deleter.
//   * Blocks allocated before installation keep their own deleter and are never counted;
//     blocks allocated while installed stay counted until freed, even after uninstalling.
//   * Installation needs a previous allocator with a raw deleter (the default one has); else
//     it is refused (returns false) and nothing changes.
//   * Thread safe (one mutex around the size table); the table is never destroyed, so blocks
//     freed during interpreter exit are still handled.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace hyper_parallel {
namespace {

struct Table {
  std::mutex mu;
  std::unordered_map<void*, size_t> sizes;
  int64_t live = 0;
  int64_t peak = 0;
  c10::DeleterFnPtr base_deleter = nullptr;
};

Table& table() {
  static Table* t = new Table();  // intentionally leaked: see the contract above
  return *t;
}

void counted_delete(void* ptr) {
  if (ptr == nullptr) return;
  Table& t = table();
  c10::DeleterFnPtr del;
  {
    std::lock_guard<std::mutex> g(t.mu);
    auto it = t.sizes.find(ptr);
    if (it != t.sizes.end()) {
      t.live -= static_cast<int64_t>(it->second);
      t.sizes.erase(it);
    }
    del = t.base_deleter;
  }
  del(ptr);
}

struct CountingCPUAllocator final : public c10::Allocator {
  c10::Allocator* base = nullptr;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero-size: nothing to count
    TORCH_CHECK(inner.get_context() == data && inner.get_deleter() == table().base_deleter,
                "hyper_parallel host tensor accounting: the previous CPU allocator returned a "
                "non-simple DataPtr; uninstall the accounting (HYPER_PARALLEL_TENSOR_ACCOUNTING=0)");
    {
      Table& t = table();
      std::lock_guard<std::mutex> g(t.mu);
      t.sizes[data] = n;  // may throw: `inner` still owns the block and frees it
      t.live += static_cast<int64_t>(n);
      if (t.live > t.peak) t.peak = t.live;
    }
    const c10::Device device = inner.device();
    inner.release_context();  // ownership moves to the DataPtr returned below
    return {data, data, &counted_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator& counting() {
  static CountingCPUAllocator* a = new CountingCPUAllocator();
  return *a;
}

constexpr uint8_t kPriority = 1;  // above REGISTER_ALLOCATOR's 0 (the default CPU allocator)

bool set_enabled(bool enable) {
  CountingCPUAllocator& a = counting();
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  if (enable) {
    if (current == &a) return true;
    c10::DeleterFnPtr del = current->raw_deleter();
    if (del == nullptr) return false;
    {
      Table& t = table();
      std::lock_guard<std::mutex> g(t.mu);
      // a re-install after an uninstall must forward to the same allocator: blocks still
      // counted were allocated by it
      if (t.base_deleter != nullptr && t.base_deleter != del) return false;
      t.base_deleter = del;
    }
    a.base = current;
    c10::SetAllocator(c10::DeviceType::CPU, &a, kPriority);
    return c10::GetAllocator(c10::DeviceType::CPU) == &a;
  }
  if (current == &a && a.base != nullptr) c10::SetAllocator(c10::DeviceType::CPU, a.base, kPriority);
  return false;
}

bool is_enabled() { return c10::GetAllocator(c10::DeviceType::CPU) == &counting(); }

std::vector<int64_t> tensor_bytes() {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  return {t.live, t.peak};
}

void reset_peak() {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  t.peak = t.live;
}

}  // namespace
}  // namespace hyper_parallel

TORCH_LIBRARY_FRAGMENT(hyper_parallel, m) {
  m.def("host_tensor_accounting(bool enable) -> bool", &hyper_parallel::set_enabled);
  m.def("host_tensor_accounting_enabled() -> bool", &hyper_parallel::is_enabled);
  m.def("host_tensor_bytes() -> int[]", &hyper_parallel::tensor_bytes);
  m.def("host_tensor_reset_peak() -> ()", &hyper_parallel::reset_peak);
}
