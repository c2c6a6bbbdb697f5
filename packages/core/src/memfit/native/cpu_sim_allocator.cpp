// cpu-sim's counting CPU allocator.
//
// Installed once as the process's CPU allocator (c10::SetCPUAllocator). While counting is
// enabled it adds every allocation's size to a live-bytes counter, tracks the peak, and throws
// c10::OutOfMemoryError (torch.OutOfMemoryError in Python) past the capacity. Counting at the
// allocator sees what a dispatch-level tracker cannot: the temporaries an operator allocates
// inside its kernel. Allocations made while counting is off, or from a thread that marked
// itself exempt (host-side swap buffers), are not counted, and neither is their free.
//
// Out of memory, the allocator first asks an optional Python handler (memfit-executor's Algorithm
// 3: flush pending releases, passive swap) and retries while the handler says it freed memory: the
// retry happens inside the allocation, so the operator that asked never sees the failure. The
// handler runs with the GIL taken here and no allocator lock held (there is none: counters are
// atomics), so it may free and allocate; a thread already inside the handler is not re-entered.
//
// To test the code paths of devices whose allocator cannot retry, the failure can also be raised
// the way older torch_npu does: a plain c10::Error (RuntimeError in Python) reading "NPU out of
// memory. Tried to allocate ...", instead of c10::OutOfMemoryError (memfit.testing's fake
// accelerator uses it).
//
// While a backend is active, freed blocks of 64 KiB or more are kept for reuse by size, as a
// device's caching allocator keeps them: glibc would return them to the system and page-fault
// them back in (measured: 15,000 faults a step under swapping, a third of the step's time), which
// a real device never does. The cache is emptied when the backend is deactivated.
//
// Each cpu-sim backend is its own device: it counts in its own slot (an "epoch"), so bytes a
// previous backend's program still holds (caches, fixtures, leftovers) never count against the
// next one. Each block carries a 64-byte header (keeps c10's 64-byte alignment) recording its
// size and the slot it was counted in (0: not counted), so the deleter needs no lookup table and
// no lock, and a block freed while its backend is inactive still leaves that backend's count.
//
// Strict cpu-sim poisons every block as it is freed (0xFF bytes: NaN in every float type, -1 in
// every integer type), so whatever reads a block after its owner let go of it -- a copy queued
// before the free, a kernel handed a freed activation -- reads garbage that shows in the results,
// instead of the stale but still correct bytes a freed block usually keeps until it is reused.
// Strict cpu-sim also watches the byte ranges its queued copies read and write: a block freed while
// it overlaps a watched range (freed with a copy still pending on it, with no stream ordering) is
// reported to a Python handler with the copy's id, which says who queued the copy and who freed it.
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kHeader = 64;

struct Header {
  uint64_t nbytes;
  uint64_t counted;
};

constexpr size_t kSlots = 4096;  // backends per process before slots are reused
std::atomic<int64_t> g_counts[kSlots];
std::atomic<int64_t> g_peaks[kSlots];
std::atomic<uint64_t> g_slot{1};       // the active backend's slot (0 is "not counted")
std::atomic<uint64_t> g_next_slot{1};
std::atomic<int64_t> g_capacity{std::numeric_limits<int64_t>::max()};
std::atomic<int64_t> g_num_allocs{0};
std::atomic<int64_t> g_num_ooms{0};
std::atomic<int64_t> g_last_oom_request{0};
std::atomic<bool> g_counting{false};
std::atomic<bool> g_npu_style_errors{false};
std::atomic<bool> g_poison{false};

// Strict cpu-sim's watched ranges: start address -> (end address, copy id).
std::mutex g_watch_lock;
std::multimap<uintptr_t, std::pair<uintptr_t, int64_t>> g_watched;
std::atomic<int64_t> g_watch_count{0};
std::atomic<int64_t> g_next_watch{1};
PyObject* g_hazard_handler = nullptr;  // (copy id) -> None; owned, set under the GIL

// The ids of watched ranges that [begin, end) overlaps.
std::vector<int64_t> watched_overlapping(uintptr_t begin, uintptr_t end) {
  std::vector<int64_t> ids;
  std::lock_guard<std::mutex> guard(g_watch_lock);
  for (const auto& [start, rest] : g_watched) {
    if (start >= end) break;
    if (rest.first > begin) ids.push_back(rest.second);
  }
  return ids;
}

void report_hazards(const std::vector<int64_t>& ids) {
  if (ids.empty() || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  if (g_hazard_handler == nullptr) return;
  py::object handler = py::reinterpret_borrow<py::object>(g_hazard_handler);
  for (int64_t id : ids) {
    try {
      handler(id);
    } catch (py::error_already_set& e) {
      e.restore();  // a free cannot carry a Python error out: report it as unraisable
      PyErr_WriteUnraisable(g_hazard_handler);
    }
  }
}
thread_local bool t_exempt = false;
thread_local bool t_in_handler = false;
// (request_bytes, attempt) -> bool: retry? Owned reference, changed and read under the GIL only,
// and never released at exit (Python may be finalised by then).
PyObject* g_oom_handler = nullptr;
constexpr int kMaxHandlerAttempts = 256;

// Ask the handler whether to retry an allocation of `n` bytes that failed `attempt` times.
bool ask_handler(int64_t n, int attempt) {
  if (t_in_handler || attempt >= kMaxHandlerAttempts || !Py_IsInitialized()) return false;
  t_in_handler = true;
  bool retry = false;
  {
    py::gil_scoped_acquire gil;
    if (g_oom_handler != nullptr) {
      py::object handler = py::reinterpret_borrow<py::object>(g_oom_handler);
      try {
        retry = handler(n, attempt).cast<bool>();
      } catch (py::error_already_set& e) {
        e.restore();  // an allocation cannot carry a Python error out: report it as unraisable
        PyErr_WriteUnraisable(g_oom_handler);
        retry = false;
      }
    }
  }
  t_in_handler = false;
  return retry;
}

void update_peak(int64_t now) {
  auto& peak_slot = g_peaks[g_slot.load(std::memory_order_relaxed)];
  int64_t peak = peak_slot.load(std::memory_order_relaxed);
  while (now > peak && !peak_slot.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// The caching allocators' format (bytes, KiB, MiB, GiB with two decimals), so one parser reads all.
std::string human(int64_t bytes) {
  char buf[64];
  const double gib = 1024.0 * 1024.0 * 1024.0, mib = 1024.0 * 1024.0, kib = 1024.0;
  if (bytes >= gib) {
    snprintf(buf, sizeof(buf), "%.2f GiB", bytes / gib);
  } else if (bytes >= mib) {
    snprintf(buf, sizeof(buf), "%.2f MiB", bytes / mib);
  } else if (bytes >= kib) {
    snprintf(buf, sizeof(buf), "%.2f KiB", bytes / kib);
  } else {
    snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(bytes));
  }
  return buf;
}

constexpr size_t kCacheMin = 64 * 1024;  // smaller blocks: glibc's bins reuse them without faults
constexpr int64_t kCacheMaxBytes = int64_t(8) << 30;
std::atomic<bool> g_caching{false};
std::atomic<int64_t> g_cached_bytes{0};
std::mutex g_cache_lock;
std::unordered_map<size_t, std::vector<char*>> g_cache;  // whole block size -> free blocks

char* take_cached(size_t total) {
  if (total < kCacheMin || !g_caching.load(std::memory_order_relaxed)) return nullptr;
  std::lock_guard<std::mutex> guard(g_cache_lock);
  auto it = g_cache.find(total);
  if (it == g_cache.end() || it->second.empty()) return nullptr;
  char* base = it->second.back();
  it->second.pop_back();
  g_cached_bytes.fetch_sub(static_cast<int64_t>(total), std::memory_order_relaxed);
  return base;
}

bool keep_cached(char* base, size_t total) {
  if (total < kCacheMin || !g_caching.load(std::memory_order_relaxed)) return false;
  if (g_cached_bytes.load(std::memory_order_relaxed) + static_cast<int64_t>(total) > kCacheMaxBytes) return false;
  std::lock_guard<std::mutex> guard(g_cache_lock);
  g_cache[total].push_back(base);
  g_cached_bytes.fetch_add(static_cast<int64_t>(total), std::memory_order_relaxed);
  return true;
}

int64_t empty_cache() {
  std::lock_guard<std::mutex> guard(g_cache_lock);
  int64_t freed = 0;
  for (auto& [total, blocks] : g_cache) {
    for (char* base : blocks) c10::free_cpu(base);
    freed += static_cast<int64_t>(total * blocks.size());
  }
  g_cache.clear();
  g_cached_bytes.store(0);
  return freed;
}

void delete_block(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  auto* header = reinterpret_cast<Header*>(base);
  if (header->counted) {
    g_counts[header->counted].fetch_sub(static_cast<int64_t>(header->nbytes), std::memory_order_relaxed);
  }
  if (g_watch_count.load(std::memory_order_relaxed) > 0) {
    auto begin = reinterpret_cast<uintptr_t>(data);
    report_hazards(watched_overlapping(begin, begin + header->nbytes));
  }
  if (g_poison.load(std::memory_order_relaxed)) {
    std::memset(data, 0xFF, header->nbytes);
  }
  if (!keep_cached(base, header->nbytes + kHeader)) c10::free_cpu(base);
}

class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const bool count = g_counting.load(std::memory_order_relaxed) && !t_exempt;
    const auto n = static_cast<int64_t>(nbytes);
    const uint64_t slot = g_slot.load(std::memory_order_relaxed);
    auto& current = g_counts[slot];
    if (count) {
      int64_t now = current.fetch_add(n, std::memory_order_relaxed) + n;
      int64_t capacity = g_capacity.load(std::memory_order_relaxed);
      for (int attempt = 0; now > capacity; ++attempt) {
        current.fetch_sub(n, std::memory_order_relaxed);
        g_num_ooms.fetch_add(1, std::memory_order_relaxed);
        g_last_oom_request.store(n, std::memory_order_relaxed);
        if (ask_handler(n, attempt)) {
          now = current.fetch_add(n, std::memory_order_relaxed) + n;
          capacity = g_capacity.load(std::memory_order_relaxed);
          continue;
        }
        TORCH_CHECK(!g_npu_style_errors.load(std::memory_order_relaxed),
                    "NPU out of memory. Tried to allocate ", human(n), " (NPU 0; ", human(capacity),
                    " total capacity; ", human(now - n), " already allocated) [cpu-sim emulating an NPU]");
        TORCH_CHECK_WITH(OutOfMemoryError, false,
                         "cpu-sim out of memory: tried to allocate ", human(n), " (", n, " bytes) with ",
                         human(now - n), " in use of a ", human(capacity), " capacity (", capacity,
                         " bytes). Lower the batch size or sequence length, raise the cpu-sim capacity, "
                         "or run under memfit's swap executor.");
      }
      update_peak(now);
      g_num_allocs.fetch_add(1, std::memory_order_relaxed);
    }
    char* base = take_cached(nbytes + kHeader);
    if (base == nullptr) base = static_cast<char*>(c10::alloc_cpu(nbytes + kHeader));
    auto* header = reinterpret_cast<Header*>(base);
    header->nbytes = nbytes;
    header->counted = count ? slot : 0;
    void* data = base + kHeader;
    return {data, data, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator g_allocator;
bool g_installed = false;

void install() {
  if (!g_installed) {
    // Highest priority, so nothing installed later silently replaces it.
    c10::SetCPUAllocator(&g_allocator, /*priority=*/255);
    g_installed = true;
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memfit cpu-sim counting CPU allocator";
  m.def("install", &install, "Make the counting allocator the process's CPU allocator (idempotent).");
  m.def("is_installed", []() { return g_installed && c10::GetCPUAllocator() == &g_allocator; });
  m.def("set_counting", [](bool on) { return g_counting.exchange(on); }, "Enable or disable counting; returns the previous state.");
  m.def("set_thread_exempt", [](bool on) { bool prev = t_exempt; t_exempt = on; return prev; },
        "Exempt the calling thread's allocations from counting; returns the previous state.");
  m.def("set_capacity", [](int64_t capacity) { g_capacity.store(capacity); });
  m.def("set_caching", [](bool on) { return g_caching.exchange(on); },
        "Keep freed blocks of 64 KiB or more for reuse (while a backend is active); returns the previous state.");
  m.def("empty_cache", &empty_cache, "Free every kept block; returns the bytes freed.");
  m.def("cached_bytes", []() { return g_cached_bytes.load(); });
  m.def("capacity", []() { return g_capacity.load(); });
  m.def("new_slot", []() {
    uint64_t slot = g_next_slot.fetch_add(1) % kSlots;
    if (slot == 0) slot = g_next_slot.fetch_add(1) % kSlots;
    g_counts[slot].store(0);
    g_peaks[slot].store(0);
    return slot;
  }, "A fresh counting slot for a new cpu-sim backend.");
  m.def("set_slot", [](uint64_t slot) { return g_slot.exchange(slot); }, "Count in `slot` from now on; returns the previous.");
  m.def("current", [](uint64_t slot) { return g_counts[slot % kSlots].load(); });
  m.def("peak", [](uint64_t slot) { return g_peaks[slot % kSlots].load(); });
  m.def("reset_peak", [](uint64_t slot) { g_peaks[slot % kSlots].store(g_counts[slot % kSlots].load()); });
  // Lets other native code (memfit-profiler) read live bytes without a Python call per operator.
  m.def("counter_address", [](uint64_t slot) { return reinterpret_cast<int64_t>(&g_counts[slot % kSlots]); });
  m.def("set_oom_handler", [](py::object handler) {
    PyObject* previous = g_oom_handler;
    g_oom_handler = handler.is_none() ? nullptr : handler.inc_ref().ptr();
    Py_XDECREF(previous);
  }, "Call handler(request_bytes, attempt) -> bool on a failed allocation; retry while it returns True. None removes it.");
  // memfit's own copies (the copy stream's worker, the executor's swaps) are not the program's
  // operators: hide them from RecordFunction observers (the profiler) on this thread.
  m.def("set_record_function_enabled", [](bool on) {
    bool previous = at::isRecordFunctionEnabled();
    at::enableRecordFunction(on);
    return previous;
  }, "Enable or disable RecordFunction callbacks on the calling thread; returns the previous state.");
  m.def("set_npu_style_errors", [](bool on) { return g_npu_style_errors.exchange(on); },
        "Raise out-of-memory as a plain RuntimeError worded like older torch_npu; returns the previous setting.");
  m.def("set_poison", [](bool on) { return g_poison.exchange(on); },
        "Fill every freed block with 0xFF bytes (strict cpu-sim); returns the previous setting.");
  m.def("watch", [](int64_t address, int64_t nbytes) {
    const int64_t id = g_next_watch.fetch_add(1);
    std::lock_guard<std::mutex> guard(g_watch_lock);
    g_watched.emplace(static_cast<uintptr_t>(address), std::make_pair(static_cast<uintptr_t>(address + nbytes), id));
    g_watch_count.fetch_add(1);
    return id;
  }, "Watch [address, address + nbytes) (a queued copy's operand); returns the watch's id.");
  m.def("unwatch", [](int64_t id) {
    std::lock_guard<std::mutex> guard(g_watch_lock);
    for (auto it = g_watched.begin(); it != g_watched.end(); ++it) {
      if (it->second.second == id) {
        g_watched.erase(it);
        g_watch_count.fetch_sub(1);
        return true;
      }
    }
    return false;
  }, "Stop watching a range (its copy has run); whether it was watched.");
  m.def("set_hazard_handler", [](py::object handler) {
    PyObject* previous = g_hazard_handler;
    g_hazard_handler = handler.is_none() ? nullptr : handler.inc_ref().ptr();
    Py_XDECREF(previous);
  }, "Call handler(watch_id) when a block overlapping a watched range is freed. None removes it.");
  m.def("num_allocs", []() { return g_num_allocs.load(); });
  m.def("num_ooms", []() { return g_num_ooms.load(); });
  m.def("last_oom_request", []() { return g_last_oom_request.load(); });
}
