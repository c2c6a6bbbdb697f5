"""A finished ``memfit.swap`` session lets go of everything: itself, its profiler, the user's model and its memory."""

import importlib.util
import json
import subprocess
import sys
import textwrap

# Run in a fresh interpreter: one cause of the leak this guards against (PuLP keeping a traceback of
# its first import, made inside a planning call, with every caller's frame) shows only where PuLP
# was not yet imported, and an earlier test in the same worker may have imported it.
SCRIPT = textwrap.dedent(
    """
    import gc, json, weakref
    import memfit
    from memfit.models.training import build_training
    from memfit.plugins import get_hooks

    backend = get_hooks().create_backend("cpu-sim")
    before = backend.memory_allocated()

    def train():
        session = memfit.swap(budget="2.5MiB", backend=backend, capacity="64MiB")  # planner "auto", the default
        with session:
            run = build_training("tiny", batch=4, seq=32, device=backend.device)
            for _ in range(14):
                run.step()
        profiler = weakref.ref(session.profiler) if session.profiler else None
        return weakref.ref(session), profiler, weakref.ref(run.model), session.choice.plans_generated

    session, profiler, model, planned = train()
    gc.collect()
    print(json.dumps({
        "planned": planned,
        "session": session() is not None,
        "profiler": profiler is not None and profiler() is not None,
        "model": model() is not None,
        "before": before,
        "after": backend.memory_allocated(),
    }))
    """
)


def test_a_finished_session_keeps_nothing_alive_and_its_memory_is_freed():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    alive = {k: seen[k] for k in ("session", "profiler", "model")}
    assert alive == {"session": False, "profiler": False, "model": False}
    # the device's own count (cpu-sim's allocator), not the session's: the model, its gradients and
    # optimizer states and every activation are gone
    assert seen["after"] == seen["before"]
    if all(importlib.util.find_spec(m) for m in ("memfit_profiler", "memfit_policies")):
        # with only core beside the executor (its package-alone CI env) nothing plans: the OOM handler alone runs
        assert seen["planned"] > 0, "the run planned nothing: the planners, PuLP among them, never ran"
