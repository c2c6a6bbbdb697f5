// Live device bytes of a torch.accelerator device (CUDA, NPU), read without building a dict.
//
// torch.cuda.memory_allocated() and torch.accelerator.memory_allocated() build the allocator's
// whole statistics dictionary (~100 entries) to return one number: tens of microseconds. The swap
// runtime reads the figure in its saved-tensor hooks (to decide whether to arm the operator-level
// OOM retry), so it needs the number alone: one call into the allocator's device stats, which
// copies a small struct under the allocator's lock, and no Python objects.
#include <torch/extension.h>

#include <ATen/DeviceAccelerator.h>

#include <cstdint>

namespace {

int64_t allocated(int64_t index) {
  const auto stats = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memfit: live bytes of an accelerator device, read cheaply";
  m.def("allocated", &allocated, "Bytes the caching allocator has handed out on device `index` (all pools).");
}
