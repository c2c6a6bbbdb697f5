"""A live pipeline × data-parallel run that survives killed workers without restarting (one worker process).

``memfit faulttol run`` (:mod:`memfit_faulttol.runner`) starts one process per device with
``python -m memfit_faulttol.live``; each trains its part of the reference Llama over gloo:

* **Layout.** The job's state is a :class:`memfit_faulttol.ClusterState`; every device runs one
  stage slot of its plan: a contiguous range of transformer blocks, plus the embedding on a first
  stage and the final norm + LM head on a last stage. The global batch of a step is cut into
  equal micro-batches, given to the pipelines by the plan's batch distribution (contiguous, in
  pipeline order). A micro-batch's *route* is the device of each stage of its pipeline; a failed
  slot being rerouted is replaced by the live replicas of its stage, round robin.
* **A step** (GPipe order, every rank walking the same global list of operations, blocking
  ``recv`` and non-blocking ``isend``, so it cannot deadlock): every micro-batch's forward along
  its route, then every backward in reverse; the loss of a micro-batch is its mean token
  cross-entropy over the number of micro-batches, so the gradient is the global batch's mean.
  Gradients are then summed, module by module, over the devices holding the module (gathered at
  the first holder in pipeline order, summed in that order, sent back). The **commit point** is
  the all-reduce of the step's loss over every rank: only after it does any rank step AdamW and
  write the micro-batches it trained to its ledger as committed.
* **Detection.** Each worker writes ``hb/<uid>`` (the time) every ``heartbeat_s`` into a shared
  ``FileStore``; a dead peer makes gloo raise on the ranks talking to it (connection closed),
  others hit the process group's ``pg_timeout``. A rank whose step fails discards the step's
  gradients and activations (its ledger lists those micro-batches as discarded), destroys the
  process group, waits ``stale_s`` and takes the devices whose heartbeat is fresh as alive.
* **Recovery** (no restart, parameters and AdamW states stay in memory): the survivors form
  generation ``g + 1`` of the process group on ``PrefixStore(f"gen{g+1}")`` (a store barrier
  first, so the late detectors are waited for), check they agree on the alive set and the
  committed step, and the new rank 0 calls the ``on_fault`` hook with a
  :class:`memfit_faulttol.FaultContext` (``live_copies_only``: there is no checkpoint). The
  first handler that answers decides (memfit-faulttol's built-in one runs
  :meth:`Planner.decide`); the decision is broadcast. Rerouting keeps every weight in place;
  re-parallelisation moves each module a device now needs and lacks — parameters and AdamW
  states, from the sender the restorer chose (Kuhn–Munkres) — and drops the ones it no longer
  needs. Then the failed step is run again, whole: its global batch is trained exactly once.

Everything a test checks is written to the run folder: ``ledger-<uid>.jsonl`` (one line per
micro-batch trained: step, samples, device, route, committed or discarded) and
``report-<uid>.json`` (losses, recoveries with their decisions and times).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from memfit.errors import MemfitError
from memfit.models import LlamaConfig, SyntheticTokens
from memfit.models.llama import Block, RMSNorm, rotary_tables
from memfit.workload import Workload
from torch import nn

from memfit_faulttol.model import ClusterState, Strategy

_FORWARD_TAG, _BACKWARD_TAG, _SYNC_TAG, _MOVE_TAG = 0, 1 << 20, 2 << 20, 3 << 20


@dataclass
class LiveOptions:
    """What a live run trains and how it detects faults (the same on every worker).

    Example:
        ```python
        from memfit.workload import Workload
        from memfit_faulttol.live import LiveOptions

        workload = Workload(model="tiny", batch=8, seq=32, layers=4)
        options = LiveOptions(nproc=4, stages=2, workload=workload, kills={1: 2})   # rank 1 dies in step 2
        options.micro_batch_size, options.model_config().n_layers   # (2, 4): 4 micro-batches of 2, 4 blocks
        options.problems()                                          # []: it can run
        LiveOptions(nproc=4, stages=3).problems()   # ['--stages 3 must divide --nproc 4']
        LiveOptions.from_json(options.to_json()) == options          # True: what every worker reads
        ```
    """

    nproc: int = 4
    stages: int = 2
    workload: Workload = field(default_factory=lambda: Workload(model="tiny", batch=8, seq=32, layers=4))
    """What is trained: a reference Llama preset (its blocks split over the stages), the global batch, the sequence."""
    micro_batches: int = 4
    steps: int = 8
    seed: int = 0
    lr: float = 3e-3
    kills: dict[int, int] = field(default_factory=dict)
    """uid → the step during whose forward pass that worker SIGKILLs itself."""
    pg_timeout_s: float = 5.0
    join_timeout_s: float = 60.0
    heartbeat_s: float = 0.1
    stale_s: float = 1.0
    failure_rate: float = 0.1054
    capacity_bytes: float = 4 * 2**30
    plugins: list[str] = field(default_factory=list)
    """Extra plugins (module names or .py files) registered after the installed ones (their ``on_fault`` goes first)."""

    @property
    def batch(self) -> int:
        """The global batch (:attr:`workload`'s)."""
        return self.workload.batch

    @property
    def seq(self) -> int:
        """Tokens per sequence (:attr:`workload`'s)."""
        return self.workload.seq

    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.micro_batches

    def model_config(self) -> LlamaConfig:
        """The workload's Llama config (its preset with the layers asked for)."""
        return self.workload.llama_config()

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["workload"] = self.workload.model_dump()
        out["kills"] = {str(k): v for k, v in self.kills.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> LiveOptions:
        data = dict(data)
        data["workload"] = Workload.model_validate(data["workload"])
        data["kills"] = {int(k): int(v) for k, v in data.get("kills", {}).items()}
        return cls(**data)

    def problems(self) -> list[str]:
        """Every reason these options cannot run (empty: they can)."""
        out = []
        if self.nproc < 2:
            out.append(f"--nproc must be at least 2 (got {self.nproc})")
        if self.stages < 1 or self.nproc % max(self.stages, 1):
            out.append(f"--stages {self.stages} must divide --nproc {self.nproc}")
        if self.micro_batches < 1 or self.batch % max(self.micro_batches, 1):
            out.append(f"--micro-batches {self.micro_batches} must divide --batch {self.batch}")
        elif self.stages >= 1 and self.micro_batches < self.nproc // self.stages:
            out.append(f"--micro-batches {self.micro_batches} cannot keep {self.nproc // self.stages} pipelines busy")
        if self.steps < 1:
            out.append(f"--steps must be at least 1 (got {self.steps})")
        for uid, step in sorted(self.kills.items()):
            if not 0 <= uid < self.nproc:
                out.append(f"--kill {uid}@{step}: there is no rank {uid} (ranks are 0..{self.nproc - 1})")
            if not 0 <= step < self.steps:
                out.append(f"--kill {uid}@{step}: step {step} is not run (steps are 0..{self.steps - 1})")
        if self.kills and len(self.kills) >= self.nproc:
            out.append("--kill names every rank: nobody would be left to recover")
        if self.pg_timeout_s <= 0 or self.heartbeat_s <= 0 or self.stale_s <= 2 * self.heartbeat_s:
            out.append("timeouts must be positive and --stale-s more than twice --heartbeat-s")
        if self.workload.kind != "preset":
            out.append(f"--model {self.workload.model}: the live trainer trains a reference Llama preset")
            return out
        if self.workload.dtype != "float32" or self.workload.overrides:
            out.append("the live trainer trains a preset as it is, in float32: give no dtype and no overrides")
        try:
            blocks = self.model_config().n_layers
            if self.stages >= 1 and self.stages > blocks:
                out.append(f"--stages {self.stages} exceeds the model's {blocks} blocks")
        except MemfitError as exc:
            out.append(str(exc))
        return out


def module_names(first: int, stop: int, layers: int) -> list[str]:
    """The modules a stage holding blocks ``first .. stop-1`` runs, in model order."""
    return (
        (["embed"] if first == 0 else [])
        + [f"layer{i}" for i in range(first, stop)]
        + (["head"] if stop == layers else [])
    )


def all_module_names(layers: int) -> list[str]:
    """Every module of the model, in model order."""
    return module_names(0, layers, layers)


def held_modules(state: ClusterState, layers: int) -> dict[int, list[str]]:
    """Alive device → the modules its slot of ``state.plan`` holds."""
    return {d: module_names(a, b, layers) for d, (a, b) in state.plan.holding().items() if d in state.alive}


def routes(state: ClusterState) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Per micro-batch (global index order): ``(pipeline, [(device, first, stop) per stage])``.

    Pipeline ``k`` takes the next ``micro_batches`` indices. A failed slot's micro-batches go to
    the live slots holding the same blocks in the other pipelines, round robin.
    """
    plan, failed = state.plan, state.failed_slots
    out = []
    for k, p in enumerate(plan.pipelines):
        turns = {}
        peers = {}  # a failed stage's live replicas, the same for each of its micro-batches
        for s, (a, b) in enumerate(p.ranges()):
            if (k, s) not in failed:
                continue
            peers[s] = [
                q.devices[t]
                for j, q in enumerate(plan.pipelines)
                for t, r in enumerate(q.ranges())
                if r == (a, b) and (j, t) not in failed and q.devices[t] in state.alive
            ]
            if not peers[s]:
                raise MemfitError(f"stage {s} of pipeline {k} has no live replica to reroute to")
        for _ in range(p.micro_batches):
            hops = []
            for s, (a, b) in enumerate(p.ranges()):
                if (k, s) not in failed:
                    hops.append((p.devices[s], a, b))
                    continue
                turn = turns.get(s, 0)
                turns[s] = turn + 1
                hops.append((peers[s][turn % len(peers[s])], a, b))
            out.append((k, hops))
    return out


def sync_holders(state: ClusterState, layers: int) -> dict[str, list[int]]:
    """Module → the alive devices holding it, in pipeline order (the order gradients are summed in)."""
    out: dict[str, list[int]] = {}
    for k, p in enumerate(state.plan.pipelines):
        for s, (a, b) in enumerate(p.ranges()):
            if (k, s) in state.failed_slots or p.devices[s] not in state.alive:
                continue
            for name in module_names(a, b, layers):
                out.setdefault(name, []).append(p.devices[s])
    return out


def module_moves(old: ClusterState, new: ClusterState, layers: int, transfers=()) -> list[tuple[str, int, int]]:
    """``(module, receiver, sender)`` for every module a device of ``new`` needs and does not hold.

    Blocks come from the sender the decision's transfers name (the restorer's choice); the
    embedding and the head, and blocks without a named sender, from the lowest alive holder.

    Raises:
        MemfitError: no survivor holds a module that is needed (it would need a checkpoint).
    """
    held = {d: names for d, names in held_modules(old, layers).items() if d in new.alive}
    named = {(t.receiver, f"layer{t.layer}"): t.sender for t in transfers if t.sender is not None}
    out = []
    for d, names in sorted(held_modules(new, layers).items()):
        for name in names:
            if name in held.get(d, []):
                continue
            holders = sorted(h for h, hs in held.items() if name in hs)
            sender = named.get((d, name))
            if sender is None or sender not in holders:
                if not holders:
                    raise MemfitError(f"no survivor holds {name}: it can only come from a checkpoint")
                sender = holders[0]
            out.append((name, d, sender))
    order = {n: i for i, n in enumerate(all_module_names(layers))}
    return sorted(out, key=lambda m: (order[m[0]], m[1]))


class _Head(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))


def _new_module(name: str, config: LlamaConfig) -> nn.Module:
    if name == "embed":
        return nn.Embedding(config.vocab_size, config.dim)
    if name == "head":
        return _Head(config)
    return Block(config)


def initial_modules(config: LlamaConfig, seed: int, names: list[str]) -> dict[str, nn.Module]:
    """``names`` cut out of ``torch.manual_seed(seed); Llama(config)``: every worker starts from the same weights."""
    from memfit.models import Llama

    torch.manual_seed(seed)
    full = Llama(config)
    out: dict[str, nn.Module] = {}
    for name in names:
        if name == "embed":
            out[name] = full.tok_embeddings
        elif name == "head":
            head = _Head(config)
            head.norm, head.output = full.norm, full.output
            out[name] = head
        else:
            out[name] = full.layers[int(name.removeprefix("layer"))]
    return out


class _Heartbeat(threading.Thread):
    def __init__(self, path: str, uid: int, period_s: float) -> None:
        super().__init__(daemon=True)
        self.store = dist.FileStore(path, -1)
        self.uid, self.period_s = uid, period_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.store.set(f"hb/{self.uid}", repr(time.time()))
            self.stopped.wait(self.period_s)


class StepFailed(Exception):
    """A collective or p2p operation of the step failed: a peer died or timed out."""


class Worker:
    """One device of a live run: its modules, their AdamW states, the shared state and the process group.

    Example:
        ```python
        import tempfile
        from pathlib import Path
        from memfit_faulttol.live import LiveOptions, Worker

        options = LiveOptions(nproc=4, stages=2)   # 4 devices: dp=2 × pp=2 over the tiny Llama's 4 blocks
        with tempfile.TemporaryDirectory() as run_dir:
            worker = Worker(uid=1, options=options, run_dir=Path(run_dir))   # device 1: pipeline 0's last stage
            print(worker.initial_plan)        # dp=2 pp=[2, 2] [2+2×2mb | 2+2×2mb]
            print(sorted(worker.modules))     # ['head', 'layer2', 'layer3']: its blocks, the final norm and LM head
            print(worker.members, worker.rank_of(1))   # [0, 1, 2, 3] 1: the process group it will join
            worker.ledger.close()
        # worker.run() would join the other workers' gloo process group and train, recovering from faults:
        # `python -m memfit_faulttol.live` runs one per device; memfit_faulttol.runner.launch_live starts them all
        ```
    """

    def __init__(self, uid: int, options: LiveOptions, run_dir: Path) -> None:
        from memfit.plugins import get_hooks

        from memfit_faulttol.planner import Planner
        from memfit_faulttol.profile import profile_from_config

        self.uid, self.options, self.run_dir = uid, options, run_dir
        self.config = options.model_config()
        self.layers = self.config.n_layers
        self.store = dist.FileStore(str(run_dir / "store"), -1)
        profile = profile_from_config(
            self.config, seq=options.seq, samples_per_micro_batch=options.micro_batch_size,
            capacity_bytes=options.capacity_bytes,
        )  # fmt: skip
        self.planner = Planner(profile, micro_batches=options.micro_batches)
        self.state = self.planner.initial_state(range(options.nproc), stages=options.stages)
        # Algorithm 1's cache, filled before training as the paper does: a fault only looks plans up
        self.planner.precompute(options.nproc, self.state.plan.dp, options.nproc - 1)
        self.initial_plan = self.state.plan.describe()
        mine = held_modules(self.state, self.layers)[uid]
        self.modules = initial_modules(self.config, options.seed, mine)
        self.optimizers = {n: self._optimizer(m) for n, m in self.modules.items()}
        self.data = SyntheticTokens(self.config.vocab_size, options.seq, options.batch, options.seed)
        self.cos, self.sin = rotary_tables(self.config, options.seq)
        self.hooks = get_hooks()
        for plugin in options.plugins:
            self.hooks.pm.register(_load_plugin(plugin), name=f"live-plugin:{plugin}")
        self.generation = 0
        self.step = 0
        self.losses: list[float] = []
        self.recoveries: list[dict] = []
        self.ledger = open(run_dir / f"ledger-{uid}.jsonl", "a", buffering=1)  # noqa: SIM115 - the run's lifetime
        self.pending: list[dict] = []
        self.heartbeat = _Heartbeat(str(run_dir / "store"), uid, options.heartbeat_s)
        self._warm_up()

    def _optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        # foreach=False: the per-parameter update the single-process reference runs too
        return torch.optim.AdamW(module.parameters(), lr=self.options.lr, foreach=False)

    @staticmethod
    def _warm_up() -> None:
        """Imports that take seconds on a busy machine, done before the clock matters.

        The first AdamW step imports torch._dynamo; the restorer imports scipy.optimize.
        """
        import memfit_faulttol.restorer  # noqa: F401

        p = nn.Parameter(torch.zeros(1))
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p], foreach=False).step()

    # -- process groups ---------------------------------------------------------------------
    @property
    def members(self) -> list[int]:
        return sorted(self.state.alive)

    def rank_of(self, device: int) -> int:
        return self.members.index(device)

    def join(self) -> None:
        """Form generation ``self.generation`` among ``self.members`` (after all of them arrive)."""
        g, members = self.generation, self.members
        self.store.set(f"join/gen{g}/{self.uid}", "1")
        self.store.wait([f"join/gen{g}/{u}" for u in members], timedelta(seconds=self.options.join_timeout_s))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"gen{g}", self.store), rank=self.rank_of(self.uid),
            world_size=len(members), timeout=timedelta(seconds=self.options.pg_timeout_s),
        )  # fmt: skip

    # -- one step ---------------------------------------------------------------------------
    def _stage_forward(self, first: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        h = self.modules["embed"](x) if first == 0 else x
        for i in range(first, stop):
            h = self.modules[f"layer{i}"](h, self.cos, self.sin)
        return self.modules["head"](h) if stop == self.layers else h

    def train_step(self) -> float:
        """One step of the global batch over the current state; raises :class:`StepFailed` on a peer's failure."""
        try:
            return self._train_step()
        except RuntimeError as exc:  # gloo's errors, DistBackendError included
            raise StepFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def _train_step(self) -> float:
        o, step, me = self.options, self.step, self.uid
        inputs, targets = self.data.batch(step)
        mbs, count = o.micro_batch_size, o.micro_batches
        plan = routes(self.state)
        shape = (mbs, o.seq, self.config.dim)
        sends, saved, loss_sum = [], {}, 0.0
        killed = o.kills.get(me) == step
        for mb, (pipeline, hops) in enumerate(plan):
            for s, (device, first, stop) in enumerate(hops):
                if device != me:
                    continue
                if s == 0:
                    x = inputs[mb * mbs : (mb + 1) * mbs]
                else:
                    x = torch.empty(shape)
                    dist.recv(x, src=self.rank_of(hops[s - 1][0]), tag=_FORWARD_TAG + mb)
                    x.requires_grad_(True)
                out = self._stage_forward(first, stop, x)
                if killed:
                    self._die()
                if s + 1 < len(hops):
                    sends.append(dist.isend(out.detach(), dst=self.rank_of(hops[s + 1][0]), tag=_FORWARD_TAG + mb))
                else:
                    y = targets[mb * mbs : (mb + 1) * mbs]
                    loss = F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
                    out = loss / count
                    value = float(loss.detach())
                    loss_sum += value
                    self.pending.append(
                        {"step": step, "mb": mb, "samples": [mb * mbs, (mb + 1) * mbs], "device": me,
                         "pipeline": pipeline, "route": [h[0] for h in hops], "generation": self.generation,
                         "loss": value}
                    )  # fmt: skip
                saved[(mb, s)] = (x, out)
        for mb in reversed(range(len(plan))):
            hops = plan[mb][1]
            for s in reversed(range(len(hops))):
                if hops[s][0] != me:
                    continue
                x, out = saved.pop((mb, s))
                if s + 1 == len(hops):
                    out.backward()
                else:
                    grad = torch.empty(shape)
                    dist.recv(grad, src=self.rank_of(hops[s + 1][0]), tag=_BACKWARD_TAG + mb)
                    out.backward(grad)
                if s > 0:
                    sends.append(dist.isend(x.grad, dst=self.rank_of(hops[s - 1][0]), tag=_BACKWARD_TAG + mb))
        self._sync_gradients()
        for work in sends:
            work.wait()
        # the commit point: a rank steps only once every rank has finished the step
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)
        for optimizer in self.optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for entry in self.pending:
            self.ledger.write(json.dumps({**entry, "committed": True}) + "\n")
        self.pending = []
        self.step += 1
        return float(total) / count

    def _die(self) -> None:
        self.store.set(f"kill/{self.uid}", repr(time.time()))
        print(f"[uid {self.uid}] SIGKILL at step {self.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _sync_gradients(self) -> None:
        """Sum each module's gradient over its holders: gathered at the first, summed in pipeline order, sent back."""
        holders = sync_holders(self.state, self.layers)
        pending = []
        for index, name in enumerate(all_module_names(self.layers)):
            devices = holders.get(name, [])
            if self.uid not in devices or len(devices) == 1:
                continue
            params = list(self.modules[name].parameters())
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            tag = _SYNC_TAG + index
            root = devices[0]
            if self.uid == root:
                for other in devices[1:]:
                    buf = torch.empty_like(flat)
                    dist.recv(buf, src=self.rank_of(other), tag=tag)
                    flat += buf
                pending += [dist.isend(flat, dst=self.rank_of(other), tag=tag) for other in devices[1:]]
            else:
                pending.append(dist.isend(flat.clone(), dst=self.rank_of(root), tag=tag))
                dist.recv(flat, src=self.rank_of(root), tag=tag)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        for work in pending:
            work.wait()

    # -- recovery ---------------------------------------------------------------------------
    def _discard_step(self) -> None:
        for entry in self.pending:
            self.ledger.write(json.dumps({**entry, "committed": False}) + "\n")
        self.pending = []
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def _stored_time(self, key: str) -> float | None:
        # check first: a store's get() waits for a missing key until the store's timeout (minutes)
        if not self.store.check([key]):
            return None
        return float(self.store.get(key).decode())

    def alive_now(self) -> set[int]:
        now = time.time()
        alive = set()
        for u in self.members:
            beat = self._stored_time(f"hb/{u}")
            if beat is not None and now - beat < self.options.stale_s:
                alive.add(u)
        return alive

    def recover(self, reason: str) -> None:
        """Re-form the process group among the survivors, decide and carry out the recovery; then retry the step."""
        from memfit.types import FaultEvent

        from memfit_faulttol.planner import Decision, FaultContext

        detected = time.time()
        self._discard_step()
        dist.destroy_process_group()
        # every heartbeat of a worker dead before ``detected`` is then older than stale_s
        time.sleep(self.options.stale_s + self.options.heartbeat_s)
        alive = self.alive_now() | {self.uid}
        failed = sorted(set(self.members) - alive)
        old = self.state
        self.generation += 1
        self.state = replace(old, alive=frozenset(alive))
        self.join()
        self._check_agreement()
        record = {"generation": self.generation, "step": self.step, "failed": failed, "reason": reason,
                  "detected_at": detected, "members": self.members}  # fmt: skip
        if not failed:  # a slow peer, not a dead one: the same layout again
            self.state = old
            record["decision"] = None
            self.recoveries.append(record)
            retries = [r for r in self.recoveries if r["step"] == self.step and r.get("decision", True) is None]
            if len(retries) > 2:  # the step fails with every worker alive: not a fault this engine can recover
                raise MemfitError(f"step {self.step} failed {len(retries)} times with every worker alive: {reason}")
            return
        payload = [None]
        if self.rank_of(self.uid) == 0:
            context = FaultContext(self.planner, old, self.options.failure_rate, live_copies_only=True)
            event = FaultEvent(kind="node_lost", ranks=tuple(failed), step=self.step, detail=reason, state=context)
            try:
                response = self.hooks.handle_fault(event)
                payload = [self._executable(response, old, failed)]
            except MemfitError as exc:
                payload = [{"error": str(exc)}]
        dist.broadcast_object_list(payload, src=0)
        chosen = payload[0]
        if "error" in chosen:
            raise MemfitError(f"no recovery from the loss of {failed} at step {self.step}: {chosen['error']}")
        decision: Decision = chosen["decision"]
        moves = module_moves(old, decision.state, self.layers, decision.transfers)
        self._move_modules(moves, decision.state)
        self.state = decision.state
        record.update(
            strategy=decision.strategy.value, handler=chosen["handler"], note=chosen["note"],
            plan=decision.plan.describe(), devices=list(decision.plan.devices()),
            failed_slots=sorted(decision.state.failed_slots), candidates=decision.candidates,
            moves=[list(m) for m in moves], decided_at=time.time(),
        )  # fmt: skip
        # a worker killed from outside left no time: the recovery is then timed from the detection
        kills = {u: self._stored_time(f"kill/{u}") for u in failed}
        record["killed_at"] = {u: t for u, t in kills.items() if t is not None}
        self.recoveries.append(record)

    def _executable(self, response, old: ClusterState, failed: list[int]) -> dict:
        """The response as a decision this engine can carry out (reroute or re-parallelise with live copies)."""
        from memfit_faulttol.planner import Decision

        if response is None:
            raise MemfitError("no on_fault handler claimed the fault (is memfit-faulttol's plugin disabled?)")
        decision = response.decision
        if not isinstance(decision, Decision):
            if response.action not in (Strategy.REROUTE.value, Strategy.REPARALLELIZE.value):
                raise MemfitError(f"handler {response.handler} chose {response.action!r}: {response.note}")
            decision = self.planner.decide(
                old, failed, rate_per_device_hour=self.options.failure_rate, live_copies_only=True,
                allow_reroute=response.action == Strategy.REROUTE.value,
                allow_reparallelize=response.action == Strategy.REPARALLELIZE.value,
            )  # fmt: skip
        return {"decision": decision, "handler": response.handler, "note": response.note}

    def _check_agreement(self) -> None:
        mask = sum(1 << u for u in self.members)
        mine = torch.tensor([self.step, mask], dtype=torch.int64)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise MemfitError(
                f"survivors disagree after a fault (committed steps {int(low[0])}..{int(high[0])}, alive masks "
                f"{int(low[1]):b}/{int(high[1]):b}): heartbeat membership is not consensus; restart from a checkpoint"
            )

    def _move_modules(self, moves: list[tuple[str, int, int]], new: ClusterState) -> None:
        """Send / receive each moved module's parameters and AdamW states; drop what the new slot does not hold."""
        order = {n: i for i, n in enumerate(all_module_names(self.layers))}
        work = []
        for name, receiver, sender in moves:
            tag = _MOVE_TAG + order[name] * 64
            if self.uid == sender:
                work += self._send_module(name, receiver, tag)
            elif self.uid == receiver:
                self._receive_module(name, sender, tag)
        for w in work:
            w.wait()
        keep = set(held_modules(new, self.layers).get(self.uid, []))
        for name in list(self.modules):
            if name not in keep:
                del self.modules[name], self.optimizers[name]

    def _state_tensors(self, name: str) -> list[torch.Tensor]:
        optimizer = self.optimizers[name]
        out = []
        for p in self.modules[name].parameters():
            out.append(p.detach())
            state = optimizer.state.get(p)
            if state:
                out += [state["exp_avg"], state["exp_avg_sq"], torch.as_tensor(state["step"], dtype=torch.float32)]
        return out

    def _send_module(self, name: str, receiver: int, tag: int) -> list:
        tensors = self._state_tensors(name)
        has_state = int(len(tensors) > len(list(self.modules[name].parameters())))
        dst = self.rank_of(receiver)
        work = [dist.isend(torch.tensor([has_state]), dst=dst, tag=tag)]
        work += [dist.isend(t.contiguous(), dst=dst, tag=tag + 1 + i) for i, t in enumerate(tensors)]
        return work

    def _receive_module(self, name: str, sender: int, tag: int) -> None:
        src = self.rank_of(sender)
        module = _new_module(name, self.config)
        optimizer = self._optimizer(module)
        flag = torch.zeros(1, dtype=torch.int64)
        dist.recv(flag, src=src, tag=tag)
        i = 1
        for p in module.parameters():
            dist.recv(p.data, src=src, tag=tag + i)
            i += 1
            if int(flag):
                exp_avg, exp_avg_sq, step = torch.empty_like(p), torch.empty_like(p), torch.zeros(())
                for t in (exp_avg, exp_avg_sq, step):
                    dist.recv(t, src=src, tag=tag + i)
                    i += 1
                optimizer.state[p] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        self.modules[name], self.optimizers[name] = module, optimizer

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> dict:
        print(f"[uid {self.uid}] pid {os.getpid()}", flush=True)
        self.heartbeat.start()
        self.join()
        started = time.time()
        recovering: dict | None = None
        while self.step < self.options.steps:
            failure = None
            try:
                loss = self.train_step()
            except StepFailed as exc:
                failure = str(exc)
            if failure is not None:
                # out of the except block: the traceback's frames (pending sends, activations) no
                # longer hold the broken process group, so destroying it closes its sockets now and
                # the peers still blocked on this rank fail at once instead of at their timeout
                gc.collect()
                self.recover(failure)
                recovering = self.recoveries[-1]
                continue
            self.losses.append(loss)
            if recovering is not None:
                recovering["first_step_at"] = time.time()
                kills = recovering.get("killed_at") or {}
                since = min(kills.values()) if kills else recovering["detected_at"]
                recovering["timed_from"] = "kill" if kills else "detection (killed from outside: no kill time)"
                recovering["recovery_s"] = recovering["first_step_at"] - since
                recovering["detected_s"] = recovering["detected_at"] - since
                recovering["decided_s"] = recovering["decided_at"] - since
                recovering = None
            if self.rank_of(self.uid) == 0:
                print(f"[gen {self.generation}] step {self.step - 1}: loss {loss:.6f}", flush=True)
        report = {
            "uid": self.uid, "losses": self.losses, "recoveries": self.recoveries, "seconds": time.time() - started,
            "final_plan": self.state.plan.describe(), "final_devices": list(self.state.plan.devices()),
            "final_failed_slots": sorted(self.state.failed_slots), "final_alive": self.members,
            "initial_plan": self.initial_plan,
        }  # fmt: skip
        (self.run_dir / f"report-{self.uid}.json").write_text(json.dumps(report, indent=1, default=str))
        dist.barrier()
        dist.destroy_process_group()
        self.heartbeat.stopped.set()
        return report


def _load_plugin(spec: str):
    if spec.endswith(".py"):
        path = Path(spec)
        module_spec = importlib.util.spec_from_file_location(f"memfit_live_plugin_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise MemfitError(f"cannot load plugin file {spec}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m memfit_faulttol.live --uid U --run-dir DIR`` (the options are read from DIR/options.json)."""
    parser = argparse.ArgumentParser(prog="python -m memfit_faulttol.live", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    options = LiveOptions.from_json(json.loads((args.run_dir / "options.json").read_text()))
    worker = Worker(args.uid, options, args.run_dir)
    try:
        worker.run()
    except MemfitError as exc:
        print(f"[uid {args.uid}] error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
