"""The offload pass over AOTAutograd's forward and backward graphs: lifetimes, candidates, insertion.

AOTAutograd partitions the joint graph into a forward graph, whose outputs after the user's
are the values saved for backward, and a backward graph, whose first placeholders are those
values, in the same order. The pass:

1. **Lifetime analysis.** Saved values are grouped by the storage they alias (a view and its
   base are one group: offloading a view frees nothing while the base lives). A group is a
   candidate when its storage was made by the forward graph (not a parameter or input), is not
   a user output, is at least ``min_bytes``, has static sizes, and its base covers its storage.
   For each group: producer, last forward use (over every alias), first backward use.
2. **Cost model** (extract §2.3, paper §5.1). A group is kept on the device when the compute
   between its release and its first backward use is shorter than ``kappa`` times its round trip
   (store plus prefetch): the transfer would not hide, or the value is short-lived.
3. **Selection.** Candidates are taken largest first until the predicted device peak (the
   :class:`~memfit_offload.schedule.Program`'s, with just-in-time prefetches) fits the budget;
   without a budget, all candidates.
4. **Ordering** (:mod:`memfit_offload.schedule`): just-in-time or Algorithm 1.
5. **Insertion.** Forward: ``store(base)`` right after the base is produced, ``release(base,
   host)`` after the group's last forward use, and every saved member replaced by the host
   tensor. Backward: ``prefetch(host)`` at the chosen position, ``wait`` right before the first
   reader, and each member rebuilt as an ``as_strided`` view of the prefetched base (same sizes,
   strides and offset: bit-identical reads).

Only cache operators are added; no compute node moves (reordering compute could change the
results of random operators).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from memfit_offload.costs import DeviceSpeed, node_seconds, transfer_seconds
from memfit_offload.ops import PREFETCH, PREFETCH_DEFERRED, RELEASE, STORE, WAIT
from memfit_offload.schedule import Offloaded, Program, just_in_time, refine, select_largest_first, simulate

__all__ = ["Candidate", "OffloadDecision", "analyse", "apply"]


@dataclass(frozen=True)
class Candidate:
    """A storage group saved for backward that may be offloaded.

    Example:
        ```python
        import memfit_offload
        import torch
        from memfit.plugins import get_hooks
        from memfit_offload.costs import DeviceSpeed

        sim = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        speed = DeviceSpeed(flops_per_s=1.8e11, memory_bytes_per_s=2.4e10, op_overhead_s=4e-5)  # fixed, not measured
        with sim.activate():
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            offload = memfit_offload.backend(device_backend=sim, speed=speed)
            compiled = torch.compile(model, backend=offload, dynamic=False)  # static shapes: what the pass offloads
            compiled(torch.randn(64, 256)).square().mean().backward()
        for candidate in offload.decisions[0].candidates:  # what the pass found it could offload
            print(candidate.name, candidate.nbytes, candidate.produced, candidate.last_forward_use,
                  candidate.first_backward_use)  # fmt: skip
        # addmm 262144 6 7 23: the first Linear's output (64 × 1024 float32), made by operator 6, last read in
        # forward by operator 7, read again by operator 23 (positions: forward's operators, then backward's)
        # gelu 262144 7 9 18
        ```
    """

    name: str
    """The base node's name in the forward graph."""
    base: Node
    members: tuple[int, ...]
    """Indices of the saved outputs (into the saved part of the forward's outputs) aliasing it."""
    nbytes: int
    produced: int
    last_forward_use: int
    first_backward_use: int
    """Program positions (forward operators, then backward ones)."""


@dataclass
class OffloadDecision:
    """What the pass decided for one forward/backward pair.

    Example:
        ```python
        import memfit_offload
        import torch
        from memfit.plugins import get_hooks
        from memfit_offload.costs import DeviceSpeed
        from memfit_offload.schedule import simulate

        sim = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        speed = DeviceSpeed(flops_per_s=1.8e11, memory_bytes_per_s=2.4e10, op_overhead_s=4e-5)  # fixed, not measured
        with sim.activate():
            layers = (torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6))
            offload = memfit_offload.backend("8MiB", device_backend=sim, speed=speed)
            compiled = torch.compile(torch.nn.Sequential(*layers), backend=offload, dynamic=False)  # static shapes
            compiled(torch.randn(4096, 64)).sum().backward()
        (decision,) = offload.decisions  # one compiled forward and backward
        print(len(decision.candidates), [c.name for c in decision.chosen])  # 5 ['tanh_2', 'tanh_1', 'tanh']
        print(decision.excluded)  # {'tanh_5': 'aliases a user output', 'tanh_3': 'not needed to fit the budget', ...
        before, after = simulate(decision.program, None), simulate(decision.program, decision.prefetch_at)
        print(before.peak_bytes, after.peak_bytes, after.exposed_s)  # 10667520 7521792 0.0: within 8 MiB, all hidden
        ```
    """

    program: Program
    candidates: tuple[Candidate, ...]
    """Every candidate, offloaded or not."""
    chosen: tuple[Candidate, ...]
    prefetch_at: tuple[int, ...]
    order: str
    excluded: dict[str, str]
    """Saved groups not offloaded, and why."""
    forward_ops: int
    budget_bytes: int | None
    deferred_room_bytes: int | None = None
    """Device bytes the prefetches deferred to the last activation prefetch (optimizer states) may
    take: the budget less the predicted peak from there to the end of backward (``None``: no budget)."""


def _tensor_val(node: Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.size(), *t.stride(), t.storage_offset()))


def _storage_nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _live_bytes(
    graph: torch.fx.Graph, nodes: list[Node], persistent: Iterable[Node] = (), *, inputs_persist: bool = True
) -> np.ndarray:
    """Device bytes live while each of ``nodes`` runs.

    Placeholders count throughout when ``inputs_persist`` (the caller owns them: parameters, the batch), else
    to their last use (backward's saved values are dropped as it consumes them); other storages from their
    producer to their last use (``persistent`` ones: to the end).
    """
    position = {n: i for i, n in enumerate(nodes)}
    groups: dict[StorageWeakRef, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        val = _tensor_val(n)
        if val is not None and n.op != "output" and _static(val):
            groups[StorageWeakRef(val.untyped_storage())].append(n)
    delta = np.zeros(len(nodes) + 1, dtype=np.int64)
    always = 0
    kept = set(persistent)
    for members in groups.values():
        size = _storage_nbytes(_tensor_val(members[0]))
        if members[0].op == "placeholder" and inputs_persist:
            always += size
            continue
        # every input is there when the graph starts
        start = 0 if members[0].op == "placeholder" else min(position.get(m, 0) for m in members)
        end = start
        for m in members:
            for user in m.users:
                end = max(end, position.get(user, len(nodes) - 1))
        if any(m in kept for m in members):
            end = len(nodes) - 1  # saved for backward: lives past the end of the graph
        delta[start] += size
        delta[end + 1] -= size
    return np.cumsum(delta)[: len(nodes)] + always


def analyse(
    fw: GraphModule,
    bw: GraphModule,
    num_fwd_outputs: int,
    *,
    speed: DeviceSpeed,
    min_bytes: int,
    kappa: float,
) -> tuple[list[Node], list[Node], list[Candidate], dict[str, str], np.ndarray, np.ndarray]:
    """Positions, candidates and estimated times/bytes of a forward/backward pair (see the module docs)."""
    fw_nodes = [n for n in fw.graph.nodes if n.op != "output"]
    bw_nodes = [n for n in bw.graph.nodes if n.op != "output"]
    fw_output = fw.graph.output_node()
    outputs = list(fw_output.args[0])
    user_outputs = {n for n in outputs[:num_fwd_outputs] if isinstance(n, Node)}
    saved = outputs[num_fwd_outputs:]
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(fw_nodes)}
    offset = len(fw_nodes)
    bw_position = {n: offset + i for i, n in enumerate(bw_nodes)}

    seconds = np.array([node_seconds(n, speed) for n in fw_nodes] + [node_seconds(n, speed) for n in bw_nodes])
    fw_live = _live_bytes(fw.graph, fw_nodes, persistent=[n for n in saved if isinstance(n, Node)])
    bw_live = _live_bytes(bw.graph, bw_nodes, inputs_persist=False)
    fw_inputs = sum(_storage_nbytes(v) for n in fw_nodes if n.op == "placeholder" and (v := _tensor_val(n)) is not None)
    # backward also holds the forward's inputs (parameters) although its graph may not read them all
    live = np.concatenate([fw_live, bw_live + fw_inputs])

    groups: dict[StorageWeakRef, list[Node]] = defaultdict(list)
    for n in fw_nodes:
        val = _tensor_val(n)
        if val is not None:
            groups[StorageWeakRef(val.untyped_storage())].append(n)
    members_of: dict[StorageWeakRef, list[int]] = defaultdict(list)
    for i, n in enumerate(saved):
        val = _tensor_val(n) if isinstance(n, Node) else None
        if val is not None:
            members_of[StorageWeakRef(val.untyped_storage())].append(i)

    candidates: list[Candidate] = []
    excluded: dict[str, str] = {}
    first_compute_bw = next((bw_position[n] for n in bw_nodes if n.op != "placeholder"), offset + len(bw_nodes))
    for key, member_indices in members_of.items():
        group = groups.get(key, [])
        if not group:
            continue
        base = group[0]
        val = _tensor_val(base)
        if base.op == "placeholder":
            continue  # a parameter or input (or a view of one): offloading it frees nothing
        name = base.name
        if any(n in user_outputs for n in group):
            excluded[name] = "aliases a user output"
            continue
        if not (_static(val) and all(_static(_tensor_val(saved[i])) for i in member_indices)):
            excluded[name] = "dynamic shape"
            continue
        nbytes = _storage_nbytes(val)
        if val.storage_offset() != 0 or val.numel() * val.element_size() != nbytes or not val.is_contiguous():
            excluded[name] = "its base does not cover its storage densely"
            continue
        if nbytes < min_bytes:
            excluded[name] = f"small ({nbytes} B < min_bytes)"
            continue
        last_fw = max([position[base], *(position[u] for n in group for u in n.users if u.op != "output")])
        bw_users = [bw_position[u] for i in member_indices for u in bw_placeholders[i].users if u.op != "output"]
        if not bw_users:
            excluded[name] = "no backward reader"
            continue
        first_bw = min(bw_users)
        if first_bw <= first_compute_bw:
            excluded[name] = "read by the first backward operator"
            continue
        gap = float(seconds[last_fw + 1 : first_bw].sum())
        round_trip = 2 * transfer_seconds(nbytes, speed)
        if gap < kappa * round_trip:
            excluded[name] = (
                f"short-lived: {gap * 1e3:.3f} ms between uses < {kappa} x round trip {round_trip * 1e3:.3f} ms"
            )
            continue
        candidates.append(Candidate(name, base, tuple(member_indices), nbytes, position[base], last_fw, first_bw))
    return fw_nodes, bw_nodes, candidates, excluded, seconds, live


def decide(
    fw: GraphModule,
    bw: GraphModule,
    num_fwd_outputs: int,
    *,
    speed: DeviceSpeed,
    budget_bytes: int | None,
    min_bytes: int,
    order: str,
    kappa: float,
    residency_weight: float,
) -> OffloadDecision:
    """Choose what to offload and where to prefetch it."""
    fw_nodes, bw_nodes, candidates, excluded, seconds, live = analyse(
        fw, bw, num_fwd_outputs, speed=speed, min_bytes=min_bytes, kappa=kappa
    )
    first_compute_bw = len(fw_nodes) + next((i for i, n in enumerate(bw_nodes) if n.op != "placeholder"), len(bw_nodes))

    def program_of(chosen: list[Candidate]) -> Program:
        return Program(
            seconds=seconds,
            live_bytes=live,
            values=tuple(
                Offloaded(c.name, c.nbytes, c.produced, c.last_forward_use, first_compute_bw, c.first_backward_use)
                for c in chosen
            ),
            copy_bytes_per_s=speed.copy_bytes_per_s,
            copy_latency_s=speed.copy_latency_s,
        )

    ranked = sorted(candidates, key=lambda c: (-c.nbytes, c.produced))
    chosen = select_largest_first(ranked, program_of, budget_bytes)
    for c in ranked[len(chosen) :]:
        excluded[c.name] = "not needed to fit the budget"
    chosen.sort(key=lambda c: (c.first_backward_use, c.produced))
    program = program_of(chosen)
    if order == "jit":
        prefetch_at = just_in_time(program)
    elif order == "refined":
        prefetch_at = refine(program, budget_bytes=budget_bytes, residency_weight=residency_weight, kappa=kappa)
    else:
        raise ValueError(f"order must be 'jit' or 'refined', got {order!r}")
    return OffloadDecision(
        program, tuple(candidates), tuple(chosen), prefetch_at, order, excluded, len(fw_nodes), budget_bytes,
        deferred_room(program, prefetch_at, budget_bytes),
    )  # fmt: skip


def deferred_room(program: Program, prefetch_at: tuple[int, ...], budget_bytes: int | None) -> int | None:
    """What the budget leaves free from the last activation prefetch to the end of backward (see :func:`apply`).

    Prefetches deferred to that point (optimizer states) stay on the device past the graph's end,
    beside everything the rest of backward holds; the program's memory curve does not contain
    them, so without this room they would push the step over a budget the curve fits.
    """
    if budget_bytes is None or not prefetch_at:
        return None
    live = simulate(program, prefetch_at).live_bytes
    return max(0, budget_bytes - int(live[max(prefetch_at) :].max()))


def apply(fw: GraphModule, bw: GraphModule, num_fwd_outputs: int, decision: OffloadDecision) -> None:
    """Insert the cache operators of ``decision`` into the graphs (in place) and recompile them."""
    fw_nodes = [n for n in fw.graph.nodes if n.op != "output"]
    bw_nodes = [n for n in bw.graph.nodes if n.op != "output"]
    offset = len(fw_nodes)
    fw_output = fw.graph.output_node()
    outputs = list(fw_output.args[0])
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]

    for c in decision.chosen:
        base = c.base
        val = _tensor_val(base)
        with fw.graph.inserting_after(base):
            host = fw.graph.call_function(STORE, (base,))
        host.meta["val"] = val
        host.meta["memfit"] = {"kind": "store", "value": c.name}
        last = fw_nodes[c.last_forward_use]
        with fw.graph.inserting_after(last if last is not base else host):
            rel = fw.graph.call_function(RELEASE, (base, host))
        rel.meta["memfit"] = {"kind": "release", "value": c.name}
        for i in c.members:
            outputs[num_fwd_outputs + i] = host
    fw_output.args = (tuple(outputs),) + tuple(fw_output.args[1:])

    # prefetches at the same position go in reader order (the copy stream is FIFO)
    placed = sorted(
        zip(decision.chosen, decision.prefetch_at, strict=True), key=lambda cp: (cp[1], cp[0].first_backward_use)
    )
    last_prefetch = None
    for c, p in placed:
        first_member = bw_placeholders[c.members[0]]
        anchor = bw_nodes[p - offset]
        val = _tensor_val(c.base)
        with bw.graph.inserting_before(anchor):
            fetched = bw.graph.call_function(PREFETCH, (first_member,))
        fetched.meta["val"] = val
        fetched.meta["memfit"] = {"kind": "prefetch", "value": c.name}
        last_prefetch = fetched
        reader = bw_nodes[c.first_backward_use - offset]
        with bw.graph.inserting_before(reader):
            waited = bw.graph.call_function(WAIT, (fetched,))
            waited.meta["memfit"] = {"kind": "wait", "value": c.name}
            for i in c.members:
                placeholder = bw_placeholders[i]
                member_val = _tensor_val(placeholder)
                view = bw.graph.call_function(
                    torch.ops.aten.as_strided.default,
                    (fetched, tuple(member_val.size()), tuple(member_val.stride()), member_val.storage_offset()),
                )
                view.meta["val"] = member_val
                for user in list(placeholder.users):
                    if user is not fetched:
                        user.replace_input_with(placeholder, view)
    if last_prefetch is not None:
        # deferred prefetches (optimizer states) queue behind the activations' on the copy stream
        with bw.graph.inserting_after(last_prefetch):
            bw.graph.call_function(PREFETCH_DEFERRED, (last_prefetch, decision.deferred_room_bytes))
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()


def cache_op_positions(fw: GraphModule, bw: GraphModule) -> dict[str, dict[str, int]]:
    """Per offloaded value, the index of each of its cache operators in the forward-then-backward node order."""
    found: dict[str, dict[str, int]] = defaultdict(dict)
    for i, n in enumerate([*fw.graph.nodes, *bw.graph.nodes]):
        info = n.meta.get("memfit")
        if info is not None:
            found[info["value"]][info["kind"]] = i
    return dict(found)
