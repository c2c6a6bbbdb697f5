// memfit-profiler's native operator recorder: a global at::RecordFunction callback.
//
// Lightweight mode appends one integer token (and a phase) per operator: no Python, no
// allocation beyond amortised vector growth. Detailed mode also records each operator's input
// and output storages, their size, dtype and shape, and the device bytes in use after the
// operator. Python drains the buffers once per iteration (take()).
//
// Phases: an operator is BWD while its thread runs an autograd graph task (the engine's
// thread-local graph task id, which also covers gradient accumulation between nodes), OPT while
// Python has flagged an optimizer step, FWD otherwise. A forward operator that directly follows a backward one (no optimizer step in
// between: a loss-scaler skip) marks the start of a new iteration.
//
// Storage identity: rows are keyed by StorageImpl*. The recorder holds a weak reference to every
// storage it has seen during the iteration, which keeps the StorageImpl object (not its data)
// from being freed, so no other storage can reuse the address before take() releases them.
#include <torch/extension.h>

#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <cstring>
#include <cstdint>
#include <mutex>
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

struct OpRecord {
  int64_t device_bytes = -1;
  std::vector<int64_t> inputs;
  std::vector<int64_t> outputs;
};

struct OpContext : public at::ObserverContext {
  explicit OpContext(int64_t i) : index(i) {}
  int64_t index;
};

std::atomic<int> g_mode{OFF};
std::atomic<bool> g_optimizer{false};
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
std::vector<OpRecord> g_ops;                          // detailed only; index = op index - g_detail_base
int64_t g_detail_base = 0;
std::vector<Row> g_rows;
std::unordered_map<c10::StorageImpl*, int64_t> g_row_by_storage;
std::vector<int64_t> g_swap_op, g_swap_row;
std::vector<uint8_t> g_swap_in, g_swap_passive;

// device memory source
std::atomic<const std::atomic<int64_t>*> g_counter{nullptr};
c10::DeviceIndex g_mem_device_index = -1;
int g_track_device_type = -1;  // record only tensors on this device type (-1: all)

thread_local bool t_draining = false;  // take() builds tensors: its own operators are not the program's

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

int32_t token_for(const char* name) {
  // Operator names point into their schema and never move; other ranges may build their name in a
  // temporary, so a pointer hit is confirmed by comparing the text.
  auto it = g_token_by_ptr.find(name);
  if (it != g_token_by_ptr.end() && std::strcmp(g_names[it->second].c_str(), name) == 0) return it->second;
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

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  const int mode = g_mode.load(std::memory_order_relaxed);
  // Operators inside an intra-op parallel region are the internals of the operator that opened
  // it, run on worker threads in a schedule-dependent number: not part of the program's sequence.
  if (mode == OFF || t_draining || at::in_parallel_region()) return nullptr;
  // The autograd engine's own ranges ("autograd::engine::evaluate_function: MulBackward0") wrap
  // the operators of a backward node; the operators are what we record.
  const char* name = fn.name();
  if (std::strncmp(name, "autograd::engine::", 18) == 0) return nullptr;
  const int8_t phase = g_optimizer.load(std::memory_order_relaxed)
                           ? OPT
                           : (torch::autograd::get_current_graph_task_id() >= 0 ? BWD : FWD);
  std::lock_guard<std::mutex> guard(g_lock);
  const auto index = static_cast<int64_t>(g_tokens.size());
  if (phase == FWD && g_last_phase == BWD) g_boundaries.push_back(index);
  g_last_phase = phase;
  g_tokens.push_back(token_for(name));
  g_phases.push_back(phase);
  if (mode != DETAILED) return nullptr;
  if (g_ops.empty() && g_detail_base == 0 && index > 0) g_detail_base = index;
  g_ops.resize(static_cast<size_t>(index - g_detail_base + 1));
  OpRecord& op = g_ops.back();
  for (const c10::IValue& v : fn.inputs()) collect(v, op.inputs);
  return std::make_unique<OpContext>(index);
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) return;
  const int64_t index = static_cast<OpContext*>(ctx)->index;
  const int64_t bytes = device_bytes_now();
  std::lock_guard<std::mutex> guard(g_lock);
  const int64_t slot = index - g_detail_base;
  if (slot < 0 || slot >= static_cast<int64_t>(g_ops.size())) return;  // drained mid-operator
  OpRecord& op = g_ops[static_cast<size_t>(slot)];
  for (const c10::IValue& v : fn.outputs()) collect(v, op.outputs);
  op.device_bytes = bytes;
}

at::CallbackHandle g_handle = 0;
bool g_has_handle = false;

at::Tensor to_tensor_i64(const std::vector<int64_t>& v) {
  return torch::tensor(c10::ArrayRef<int64_t>(v), torch::kInt64);
}

struct Drained {
  std::vector<int32_t> tokens;
  std::vector<int8_t> phases;
  std::vector<int64_t> boundaries;
  int64_t detail_base = 0;
  std::vector<OpRecord> ops;
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
    g_detail_base = 0;
    d.ops.swap(g_ops);
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
  out["detail_base"] = d.detail_base;
  if (!d.ops.empty()) {
    std::vector<int64_t> bytes, in_off{0}, in_val, out_off{0}, out_val;
    for (const OpRecord& op : d.ops) {
      bytes.push_back(op.device_bytes);
      in_val.insert(in_val.end(), op.inputs.begin(), op.inputs.end());
      in_off.push_back(static_cast<int64_t>(in_val.size()));
      out_val.insert(out_val.end(), op.outputs.begin(), op.outputs.end());
      out_off.push_back(static_cast<int64_t>(out_val.size()));
    }
    std::vector<int64_t> keys, nbytes, dtypes, shape_off{0}, shape_val;
    for (const Row& row : d.rows) {
      keys.push_back(row.key);
      nbytes.push_back(row.nbytes);
      dtypes.push_back(row.dtype);
      shape_val.insert(shape_val.end(), row.shape.begin(), row.shape.end());
      shape_off.push_back(static_cast<int64_t>(shape_val.size()));
    }
    out["device_bytes"] = to_tensor_i64(bytes);
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
  m.def("install", []() {
    if (!g_has_handle) {
      g_handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_enter, &on_exit)
                                           .needsInputs(true)
                                           .needsOutputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
      g_has_handle = true;
    }
  });
  m.def("uninstall", []() {
    if (g_has_handle) {
      at::removeCallback(g_handle);
      g_has_handle = false;
    }
    g_mode.store(OFF);
  });
  m.def("set_mode", [](int mode) { g_mode.store(mode); });
  m.def("mode", []() { return g_mode.load(); });
  m.def("set_optimizer_phase", [](bool on) { g_optimizer.store(on); });
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
  m.def("op_count", []() {
    std::lock_guard<std::mutex> guard(g_lock);
    return static_cast<int64_t>(g_tokens.size());
  });
  m.def("record_swap", [](const at::Tensor& t, bool swap_in, bool passive) {
    std::lock_guard<std::mutex> guard(g_lock);
    if (g_mode.load() != DETAILED || g_tokens.empty()) return;
    g_swap_op.push_back(static_cast<int64_t>(g_tokens.size()) - 1 - g_detail_base);
    g_swap_row.push_back(row_for(t));
    g_swap_in.push_back(swap_in);
    g_swap_passive.push_back(passive);
  });
  m.def("names", []() {
    std::lock_guard<std::mutex> guard(g_lock);
    return g_names;
  });
  m.def("take", &take);
}
