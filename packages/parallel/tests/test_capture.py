"""One rank of a parallel step captured under the fake process group, checked against counts derived by hand
and against a real cpu-sim run."""

from collections import Counter

import pytest
import torch
from memfit.errors import MemfitError
from memfit.models import LlamaConfig
from memfit_parallel.apply import parallelize
from memfit_parallel.capture import capture_parallel_step
from memfit_parallel.config import ParallelConfig
from memfit_parallel.fakepg import fake_process_group, fake_store
from memfit_parallel.recipe import llama_recipe
from memfit_parallel.schedules import capture_mesh
from memfit_simulator.models import make_optimizer

TINY = LlamaConfig.preset("tiny")
BATCH, SEQ = 8, 128


def capture(config: ParallelConfig, **options):
    """Rank 0 of ``config`` applied by the trainer's ``parallelize`` and stepped as the trainer steps it."""
    recipe = llama_recipe("tiny")
    names, sizes = capture_mesh(config)
    applied = {}

    def setup(mesh, fake):
        applied["model"] = parallelize(recipe, config, mesh=mesh, init=lambda: fake)
        with fake:
            tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ + 1))
        return applied["model"].parts[0], (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def step(net, opt, data):
        inputs, targets = data
        with applied["model"].loss_context():
            recipe.loss_fn(net(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return capture_parallel_step(
        setup, step, mesh_names=names, mesh_sizes=sizes, make_optimizer=lambda params: make_optimizer("adamw", params),
        **options,
    )  # fmt: skip


def block_params(c: LlamaConfig) -> int:
    kv = c.n_kv_heads * c.head_dim
    return 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim + 2 * c.dim


def test_the_fake_process_group_imports_and_refuses_to_nest():
    assert fake_store() is not None
    with fake_process_group(4), pytest.raises(MemfitError, match="already initialised"):
        with fake_process_group(2):
            pass


def test_one_rank_is_the_single_process_step_and_matches_a_real_cpu_sim_run():
    from memfit_simulator import simulate_training
    from memfit_simulator.baselines import measured_peak

    one = capture(ParallelConfig())
    single = simulate_training("tiny", batch=BATCH, seq=SEQ)
    assert one.memory.peak_by_category == single.memory.peak_by_category
    measured = measured_peak("tiny", batch=BATCH, seq=SEQ)
    assert abs(one.memory.peak_bytes - measured) / measured < 0.01
    assert one.collectives == []


def test_fsdp_shards_the_state_and_gathers_each_block_as_derived_by_hand():
    rank = capture(ParallelConfig(dp_shard=2))
    params = TINY.num_parameters()
    assert rank.memory.peak_by_category["parameter"] >= 4 * params // 2  # the shard, plus gathered blocks
    assert rank.memory.peak_by_category["optimizer_state"] == 2 * 4 * params // 2  # AdamW's two states, sharded
    block, root = 4 * block_params(TINY), 4 * (params - TINY.n_layers * block_params(TINY))
    seen = Counter((c.kind, c.dim, c.nbytes) for c in rank.collectives)
    # forward gathers every block; backward re-gathers all but the last (kept unsharded, as TorchTitan);
    # the root (embedding, norm, output) is gathered in both; every unit's gradients are reduce-scattered once
    assert seen == {
        ("all_gather", "dp_shard", block): 2 * TINY.n_layers - 1,
        ("all_gather", "dp_shard", root): 2,
        ("reduce_scatter", "dp_shard", block): TINY.n_layers,
        ("reduce_scatter", "dp_shard", root): 1,
    }
    assert {c.group_size for c in rank.collectives} == {2}


def test_gloos_scratch_buffers_are_one_whole_output_or_input_per_gather_and_scatter():
    """gloo gathers into a flat copy of the whole output and reduce-scatters a clone of the whole input
    (measured on cpu-sim: docs/packages/parallel.md): with ``collective_scratch`` each is a temporary of that size,
    allocated and freed at its collective; without it (NCCL, HCCL) there are none."""
    params = TINY.num_parameters()
    block, root = 4 * block_params(TINY), 4 * (params - TINY.n_layers * block_params(TINY))

    def scratch(rank) -> Counter:
        return Counter(
            s.nbytes for s in rank.step.storages if s.category == "temporary" and s.created == s.freed >= 0
            and rank.step.op_names[s.created].split("::")[0] in ("c10d", "_c10d_functional")
        )  # fmt: skip

    plain, gloo = capture(ParallelConfig(dp_shard=2)), capture(ParallelConfig(dp_shard=2), collective_scratch=True)
    assert scratch(plain) == Counter()
    # the gathers (2 per block but the last, 2 of the root) and the reduce-scatters (one per unit), by hand
    assert scratch(gloo) == Counter({block: 2 * TINY.n_layers - 1 + TINY.n_layers, root: 2 + 1})
    assert gloo.memory.peak_bytes >= plain.memory.peak_bytes
    assert len(gloo.step.op_names) == len(plain.step.op_names)  # nothing else changed


def test_tp_with_sequence_parallelism_issues_four_collectives_per_block_and_pass():
    rank = capture(ParallelConfig(dp_shard=2, tp=2))
    activation = BATCH * SEQ * TINY.dim * 4  # a full (batch, seq, dim) fp32 activation
    seen = Counter((c.kind, c.nbytes) for c in rank.collectives if c.dim == "tp")
    # per block: gather before attention and MLP, reduce-scatter after wo and w2 (forward), the converse backward;
    # plus the embedding (reduce-scatter forward) and the output (gather forward), and their backward
    per_kind = 2 * 2 * TINY.n_layers + 2
    assert seen[("all_gather", activation)] == per_kind and seen[("reduce_scatter", activation)] == per_kind
    # parameters: TP splits every weight but the norms (replicated for SP); FSDP halves what each TP rank holds
    norms = (2 * TINY.n_layers + 1) * TINY.dim
    per_tp_rank = (TINY.num_parameters() - norms) // 2 + norms
    assert rank.memory.peak_by_category["optimizer_state"] == 2 * 4 * per_tp_rank // 2


def test_full_checkpointing_keeps_less_and_its_recomputation_is_flagged_in_backward():
    plain = capture(ParallelConfig(dp_shard=2))
    full = capture(ParallelConfig(dp_shard=2, activation_checkpoint="full"))
    assert full.memory.peak_by_category["activation"] < plain.memory.peak_by_category["activation"] / 3
    assert not plain.recompute.any()
    recomputed = full.recompute.nonzero()[0]
    assert len(recomputed) > 0 and (full.step.phases[recomputed] == 1).all()  # Phase.BWD
    names = Counter(full.step.op_names[i] for i in recomputed)
    # each block's projections run again but the last (w2): non-reentrant checkpointing stops recomputing once it
    # has every saved tensor backward needs, and w2's output is only added to the residual
    assert names["aten::mm"] == 6 * TINY.n_layers


def test_captures_in_a_row_do_not_leak_meshes():
    first = capture(ParallelConfig(dp_shard=2, tp=2))
    again = capture(ParallelConfig(dp_shard=2, tp=2))
    assert first.memory.peak_bytes == again.memory.peak_bytes
