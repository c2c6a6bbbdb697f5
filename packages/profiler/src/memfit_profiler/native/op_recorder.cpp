// memfit-profiler's native operator recorder: a global at::RecordFunction callback.
//
// Lightweight mode appends one integer token (and a phase) per operator: no Python, no
// allocation beyond amortised vector growth. Detailed mode also records each operator's input
// and output storages, their size, dtype and shape, the device bytes in use after the operator,
// and its self time on the host (its interval less its recorded children's and the callbacks'
// own cost; the device's time on a synchronous device). Python drains the buffers once per
// iteration (take()).
//
// Phases: an operator is BWD while its thread runs an autograd graph task (the engine's
// thread-local graph task id, which also covers gradient accumulation between nodes), OPT while
// Python has flagged an optimizer step, FWD otherwise. A forward operator that directly follows a backward one (no optimizer step in
// between: a loss-scaler skip) marks the start of a new iteration. Operators of other threads that
// run no graph task (a collective library's workers) are not recorded.
//
// Storage identity: rows are keyed by StorageImpl*. The recorder holds a weak reference to every
// storage it has seen during the iteration, which keeps the StorageImpl object (not its data)
// from being freed, so no other storage can reuse the address before take() releases them.
#include <torch/extension.h>

#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <thread>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

enum Mode : int { OFF = 0, LIGHTWEIGHT = 1, DETAILED = 2 };
enum Phase : int8_t { FWD = 0, BWD = 1, OPT = 2 };

struct Row {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak;
  int64_t key;
  int64_t nbytes;
  int8_t dtype;
  std::vector<int64_t> shape;
};

std::atomic<int> g_mode{OFF};
std::atomic<bool> g_optimizer{false};
// The training loop's thread (see record_operator), set where an iteration begins: not by
// set_mode, which memfit also calls around recomputation, from the autograd engine's threads.
std::atomic<std::thread::id> g_program_thread{};
std::mutex g_lock;

// vocabulary (kept across iterations, so tokens are stable for the process)
std::unordered_map<const char*, int32_t> g_token_by_ptr;
std::unordered_map<std::string, int32_t> g_token_by_name;
std::vector<std::string> g_names;

// per-iteration buffers
std::vector<int32_t> g_tokens;
std::vector<int8_t> g_phases;
std::vector<int64_t> g_boundaries;
int8_t g_last_phase = FWD;
// Detailed columns, flat (no allocation per operator). Slot = op index - g_detail_base.
int64_t g_detail_base = -1;
std::vector<int64_t> g_device_bytes;                    // per slot, filled when the operator ends
std::vector<int64_t> g_self_ns;                         // per slot, filled when the operator ends (-1: not timed)
std::vector<int64_t> g_in_offsets{0}, g_in_rows;        // inputs: recorded in slot order at start
std::vector<std::pair<int64_t, int64_t>> g_out;         // (slot, row): ends arrive innermost first
std::vector<Row> g_rows;
std::unordered_map<c10::StorageImpl*, int64_t> g_row_by_storage;
std::vector<int64_t> g_swap_op, g_swap_row;
std::vector<uint8_t> g_swap_in, g_swap_passive;

// device memory source
std::atomic<const std::atomic<int64_t>*> g_counter{nullptr};
c10::DeviceIndex g_mem_device_index = -1;
int g_track_device_type = -1;  // record only tensors on this device type (-1: all)

thread_local bool t_draining = false;  // take() builds tensors: its own operators are not the program's
thread_local std::string t_last_op_in_mode;  // the latest operator seen while a Python dispatch mode was on
thread_local std::string t_redispatch_of;    // set by a "PythonDispatchMode" range: the operator it re-dispatches
// Detailed operators running on this thread (LIFO), recorded (slot >= 0) or not (-1), with their times.
struct Open {
  int64_t slot;
  int64_t entered_ns;   // the enter callback began
  int64_t started_ns;   // the enter callback ended: the operator runs from here
  int64_t children_ns;  // recorded operators inside it, callbacks included
};
thread_local std::vector<Open> t_open;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t device_bytes_now() {
  if (auto* counter = g_counter.load(std::memory_order_relaxed)) {
    return counter->load(std::memory_order_relaxed);
  }
  if (g_mem_device_index >= 0) {
    auto stats = at::accelerator::getDeviceStats(g_mem_device_index);  // the current accelerator's
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
  return -1;
}

// Direct-mapped cache in front of the maps: the hot path is one array probe and one compare.
constexpr size_t kCacheSize = 4096;
struct CacheEntry {
  const char* name = nullptr;
  int32_t token = -1;
};
CacheEntry g_cache[kCacheSize];

int32_t token_for(const char* name) {
  CacheEntry& slot = g_cache[(reinterpret_cast<uintptr_t>(name) >> 4) % kCacheSize];
  // Operator names point into their schema and never move; other ranges may build their name in a
  // temporary, so a pointer hit is confirmed by comparing the text.
  if (slot.name == name && std::strcmp(g_names[slot.token].c_str(), name) == 0) return slot.token;
  auto it = g_token_by_ptr.find(name);
  if (it != g_token_by_ptr.end() && std::strcmp(g_names[it->second].c_str(), name) == 0) {
    slot = {name, it->second};
    return it->second;
  }
  std::string s(name);
  auto jt = g_token_by_name.find(s);
  int32_t token;
  if (jt == g_token_by_name.end()) {
    token = static_cast<int32_t>(g_names.size());
    g_names.push_back(s);
    g_token_by_name.emplace(std::move(s), token);
  } else {
    token = jt->second;
  }
  g_token_by_ptr[name] = token;
  slot = {name, token};
  return token;
}

int64_t row_for(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  auto it = g_row_by_storage.find(impl);
  if (it != g_row_by_storage.end()) {
    Row& row = g_rows[it->second];
    const int64_t nbytes = static_cast<int64_t>(impl->nbytes());
    if (nbytes > row.nbytes) row.nbytes = nbytes;
    return it->second;
  }
  Row row{t.storage().getWeakStorageImpl(), reinterpret_cast<int64_t>(impl), static_cast<int64_t>(impl->nbytes()),
          static_cast<int8_t>(t.scalar_type()), t.sizes().vec()};
  const int64_t index = static_cast<int64_t>(g_rows.size());
  g_rows.push_back(std::move(row));
  g_row_by_storage.emplace(impl, index);
  return index;
}

void collect(const c10::IValue& v, std::vector<int64_t>& out) {
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    if (g_track_device_type >= 0 && static_cast<int>(t.device().type()) != g_track_device_type) return;
    out.push_back(row_for(t));
  };
  if (v.isTensor()) {
    add(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) add(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) add(e.toTensor());
    }
  }
}

// Shared by both modes: token and phase of an operator, or -1 when it is not recorded.
int64_t record_operator(const at::RecordFunction& fn) {
  // Operators inside an intra-op parallel region are the internals of the operator that opened
  // it, run on worker threads in a schedule-dependent number: not part of the program's sequence.
  if (t_draining || at::in_parallel_region()) return -1;
  const char* name = fn.name();
  // Under a Python dispatch mode (memfit-executor's operator-level OOM retry on CUDA/NPU, or any
  // other) an operator shows up three times: on the way in, as a "PythonDispatchMode" range, and
  // once more when the mode's __torch_dispatch__ calls it. Only the first is the program's: skip
  // the range and the re-dispatch right after it (the same operator name), so the sequence, the
  // phases and every position a plan refers to are the same whether a mode is on or not (the
  // operators a kernel calls inside are recorded either way). Some operators (profiler::) are
  // not observed on the way in or out: then the next event is not a re-dispatch, and is kept.
  if (!t_redispatch_of.empty()) {
    const bool redispatch = t_redispatch_of == name;
    t_redispatch_of.clear();
    if (redispatch) return -1;
  }
  if (std::strcmp(name, "PythonDispatchMode") == 0) {
    t_redispatch_of = t_last_op_in_mode;
    return -1;
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 && std::strstr(name, "::") != nullptr) {
    t_last_op_in_mode.assign(name);  // only while a mode is on: no copy per operator otherwise
  }
  // The autograd engine's own ranges ("autograd::engine::evaluate_function: MulBackward0") wrap
  // the operators of a backward node, and profiler:: operators open and close ranges such as
  // "Optimizer.step#AdamW.step": bookkeeping, not computation. The operators are what we record.
  if (std::strncmp(name, "autograd::engine::", 18) == 0 || std::strncmp(name, "profiler::", 10) == 0) return -1;
  // detach makes an alias: no memory, no compute. Autograd also calls it on its own, through the
  // mode, for every output it saves while a Python dispatch mode is active (TensorImpl's
  // shallow_copy_and_detach): left in, those calls would make the sequence depend on the mode.
  if (std::strcmp(name, "aten::detach") == 0 || std::strcmp(name, "detach") == 0) return -1;
  const bool in_graph_task = torch::autograd::get_current_graph_task_id() >= 0;
  // A thread that neither runs the training loop nor an autograd graph task (the engine's device
  // threads on an accelerator) runs someone else's operators: a collective library's workers (gloo
  // copies its buffers on its own threads while FSDP's backward waits on them), a data loader's.
  // They are not the program's sequence, and their number and order depend on timing; counted as
  // forward operators, one in a backward pass would start a new iteration.
  if (!in_graph_task && std::this_thread::get_id() != g_program_thread.load(std::memory_order_relaxed)) return -1;
  const int8_t phase = g_optimizer.load(std::memory_order_relaxed) ? OPT : (in_graph_task ? BWD : FWD);
  const auto index = static_cast<int64_t>(g_tokens.size());
  if (phase == FWD && g_last_phase == BWD) g_boundaries.push_back(index);
  g_last_phase = phase;
  g_tokens.push_back(token_for(name));
  g_phases.push_back(phase);
  return index;
}

std::unique_ptr<at::ObserverContext> on_enter_lightweight(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> guard(g_lock);
  record_operator(fn);
  return nullptr;
}

std::unique_ptr<at::ObserverContext> on_enter_detailed(const at::RecordFunction& fn) {
  const int64_t entered = now_ns();
  std::lock_guard<std::mutex> guard(g_lock);
  const int64_t index = record_operator(fn);
  if (index < 0) {
    t_open.push_back({-1, entered, now_ns(), 0});
    return nullptr;
  }
  if (g_detail_base < 0) g_detail_base = index;
  const int64_t slot = index - g_detail_base;
  g_device_bytes.resize(static_cast<size_t>(slot + 1), -1);
  g_self_ns.resize(static_cast<size_t>(slot + 1), -1);
  while (static_cast<int64_t>(g_in_offsets.size()) <= slot) g_in_offsets.push_back(g_in_offsets.back());
  for (const c10::IValue& v : fn.inputs()) collect(v, g_in_rows);
  g_in_offsets.push_back(static_cast<int64_t>(g_in_rows.size()));
  t_open.push_back({slot, entered, now_ns(), 0});
  return nullptr;
}

void on_exit_detailed(const at::RecordFunction& fn, at::ObserverContext*) {
  const int64_t ended = now_ns();
  if (t_open.empty()) return;  // started before this callback was installed
  const Open open = t_open.back();
  t_open.pop_back();
  // What the enclosing operator must not count as its own: a recorded operator's whole interval,
  // callbacks included; an unrecorded range (detach, the engine's wrappers) is transparent: only
  // the recorded operators inside it.
  auto give_parent = [&open](int64_t ns) {
    if (!t_open.empty()) t_open.back().children_ns += ns;
  };
  if (open.slot < 0) {
    give_parent(open.children_ns);
    return;
  }
  const int64_t bytes = device_bytes_now();
  {
    std::lock_guard<std::mutex> guard(g_lock);
    if (open.slot < static_cast<int64_t>(g_device_bytes.size())) {  // else drained while it ran
      thread_local std::vector<int64_t> rows;
      rows.clear();
      for (const c10::IValue& v : fn.outputs()) collect(v, rows);
      for (int64_t row : rows) g_out.emplace_back(open.slot, row);
      g_device_bytes[static_cast<size_t>(open.slot)] = bytes;
      g_self_ns[static_cast<size_t>(open.slot)] = std::max<int64_t>(ended - open.started_ns - open.children_ns, 0);
    }
  }
  give_parent(now_ns() - open.entered_ns);
}

std::optional<at::CallbackHandle> g_handle;

// One callback per mode: Lightweight asks RecordFunction for nothing, so operators' arguments are
// not boxed for it; only Detailed pays for inputs and outputs.
void switch_mode(int mode) {
  if (g_handle) {
    at::removeCallback(*g_handle);
    g_handle.reset();
  }
  g_mode.store(mode);
  if (mode == LIGHTWEIGHT) {
    g_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_enter_lightweight).scopes({at::RecordScope::FUNCTION}));
  } else if (mode == 3) {  // CALLBACK_FLOOR, for benchmarks: what RecordFunction costs with a callback that does nothing
    g_handle = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> { return nullptr; })
        .scopes({at::RecordScope::FUNCTION}));
  } else if (mode == DETAILED) {
    g_handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_enter_detailed, &on_exit_detailed)
                                         .needsInputs(true)
                                         .needsOutputs(true)
                                         .scopes({at::RecordScope::FUNCTION}));
  }
}

at::Tensor to_tensor_i64(const std::vector<int64_t>& v) {
  return torch::tensor(c10::ArrayRef<int64_t>(v), torch::kInt64);
}

struct Drained {
  std::vector<int32_t> tokens;
  std::vector<int8_t> phases;
  std::vector<int64_t> boundaries;
  int64_t detail_base = -1;
  std::vector<int64_t> device_bytes, self_ns, in_offsets, in_rows;
  std::vector<std::pair<int64_t, int64_t>> out;
  std::vector<Row> rows;
  std::vector<int64_t> swap_op, swap_row;
  std::vector<uint8_t> swap_in, swap_passive;
};

py::dict take() {
  Drained d;
  {
    // Swap the buffers out under the lock; build tensors after releasing it, because building
    // them dispatches operators, whose callbacks take the lock too.
    std::lock_guard<std::mutex> guard(g_lock);
    d.tokens.swap(g_tokens);
    d.phases.swap(g_phases);
    d.boundaries.swap(g_boundaries);
    d.detail_base = g_detail_base;
    g_detail_base = -1;
    d.device_bytes.swap(g_device_bytes);
    d.self_ns.swap(g_self_ns);
    d.in_offsets.swap(g_in_offsets);
    g_in_offsets.assign(1, 0);
    d.in_rows.swap(g_in_rows);
    d.out.swap(g_out);
    d.rows.swap(g_rows);  // the weak references are released when d goes out of scope
    g_row_by_storage.clear();
    d.swap_op.swap(g_swap_op);
    d.swap_row.swap(g_swap_row);
    d.swap_in.swap(g_swap_in);
    d.swap_passive.swap(g_swap_passive);
  }
  struct DrainingGuard {
    DrainingGuard() { t_draining = true; }
    ~DrainingGuard() { t_draining = false; }
  } draining;
  py::dict out;
  out["tokens"] = torch::from_blob(d.tokens.data(), {static_cast<int64_t>(d.tokens.size())}, torch::kInt32).clone();
  out["phases"] = torch::from_blob(d.phases.data(), {static_cast<int64_t>(d.phases.size())}, torch::kInt8).clone();
  out["boundaries"] = to_tensor_i64(d.boundaries);
  out["detail_base"] = std::max<int64_t>(d.detail_base, 0);
  if (!d.device_bytes.empty()) {
    const auto n = static_cast<int64_t>(d.device_bytes.size());
    d.in_offsets.resize(static_cast<size_t>(n + 1), d.in_offsets.back());
    // outputs by slot; within a slot in the order they were returned
    std::stable_sort(d.out.begin(), d.out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<int64_t> out_off(static_cast<size_t>(n + 1), 0), out_val;
    out_val.reserve(d.out.size());
    for (const auto& [slot, row] : d.out) {
      ++out_off[static_cast<size_t>(slot + 1)];
      out_val.push_back(row);
    }
    for (int64_t i = 0; i < n; ++i) out_off[static_cast<size_t>(i + 1)] += out_off[static_cast<size_t>(i)];
    const std::vector<int64_t>& bytes = d.device_bytes;
    const std::vector<int64_t>& in_off = d.in_offsets;
    const std::vector<int64_t>& in_val = d.in_rows;
    std::vector<int64_t> keys, nbytes, dtypes, shape_off{0}, shape_val;
    for (const Row& row : d.rows) {
      keys.push_back(row.key);
      nbytes.push_back(row.nbytes);
      dtypes.push_back(row.dtype);
      shape_val.insert(shape_val.end(), row.shape.begin(), row.shape.end());
      shape_off.push_back(static_cast<int64_t>(shape_val.size()));
    }
    out["device_bytes"] = to_tensor_i64(bytes);
    out["self_ns"] = to_tensor_i64(d.self_ns);
    out["inputs_offsets"] = to_tensor_i64(in_off);
    out["inputs_values"] = to_tensor_i64(in_val);
    out["outputs_offsets"] = to_tensor_i64(out_off);
    out["outputs_values"] = to_tensor_i64(out_val);
    out["storage_keys"] = to_tensor_i64(keys);
    out["nbytes"] = to_tensor_i64(nbytes);
    out["dtypes"] = to_tensor_i64(dtypes);
    out["shape_offsets"] = to_tensor_i64(shape_off);
    out["shape_values"] = to_tensor_i64(shape_val);
    out["swap_op"] = to_tensor_i64(d.swap_op);
    out["swap_row"] = to_tensor_i64(d.swap_row);
    out["swap_in"] = to_tensor_i64(std::vector<int64_t>(d.swap_in.begin(), d.swap_in.end()));
    out["swap_passive"] = to_tensor_i64(std::vector<int64_t>(d.swap_passive.begin(), d.swap_passive.end()));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memfit-profiler native operator recorder";
  m.def("set_mode", &switch_mode, "OFF (0) removes the callback; LIGHTWEIGHT (1) and DETAILED (2) install theirs.");
  m.def("set_optimizer_phase", [](bool on) { g_optimizer.store(on); });
  m.def("set_program_thread", []() { g_program_thread.store(std::this_thread::get_id()); });
  m.def("set_memory_counter", [](int64_t address) {
    g_counter.store(reinterpret_cast<const std::atomic<int64_t>*>(address));
    g_mem_device_index = -1;
  });
  m.def("set_memory_device", [](int index) {
    g_counter.store(nullptr);
    g_mem_device_index = static_cast<c10::DeviceIndex>(index);
  });
  m.def("clear_memory_source", []() {
    g_counter.store(nullptr);
    g_mem_device_index = -1;
  });
  m.def("track_device_type", [](const std::string& device_type) {
    g_track_device_type = device_type.empty() ? -1 : static_cast<int>(c10::Device(device_type).type());
  });
  m.def("record_swap", [](const at::Tensor& t, bool swap_in, bool passive) {
    std::lock_guard<std::mutex> guard(g_lock);
    if (g_mode.load() != DETAILED || g_tokens.empty()) return;
    g_swap_op.push_back(static_cast<int64_t>(g_tokens.size()) - 1 - std::max<int64_t>(g_detail_base, 0));
    g_swap_row.push_back(row_for(t));
    g_swap_in.push_back(swap_in);
    g_swap_passive.push_back(passive);
  });
  // The executor's clock: where the iteration is, read at saved-tensor hooks (not per operator).
  // The context (the latest CONTEXT_OPS tokens, folded) tells apart two saves by the same kind of
  // operator in different surroundings, at no cost per operator.
  m.def("position", []() {
    constexpr int64_t CONTEXT_OPS = 3;
    std::lock_guard<std::mutex> guard(g_lock);
    const auto n = static_cast<int64_t>(g_tokens.size());
    int64_t context = 0;
    for (int64_t k = std::max<int64_t>(0, n - CONTEXT_OPS); k < n; ++k) {
      context = context * 1000003 + g_tokens[static_cast<size_t>(k)] + 1;
    }
    return py::make_tuple(n, n ? g_tokens.back() : -1, context);
  }, "(operators recorded so far in this iteration, token of the latest, context of the latest three)");
  m.def("names", []() {
    std::lock_guard<std::mutex> guard(g_lock);
    return g_names;
  });
  m.def("take", &take);
}
