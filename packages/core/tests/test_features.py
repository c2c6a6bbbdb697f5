import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from memfit.features import OpVocabulary, tensor_features, update


def reference(tokens, phases, use_ops, use_tensors, n_tensors):
    """Fold update() over each tensor's uses up to its last forward use: Appendix A, literally."""
    vocab = OpVocabulary.from_tokens(tokens)
    last_fwd = {}
    for op, row in zip(use_ops, use_tensors, strict=True):
        if phases[op] == 0:
            last_fwd[row] = max(last_fwd.get(row, -1), op)
    features = [(0, 0, 0)] * n_tensors
    for op, row in zip(use_ops, use_tensors, strict=True):
        if row in last_fwd and op > last_fwd[row]:
            continue
        features[row] = update(features[row], vocab, int(tokens[op]))
    return features


@st.composite
def uses(draw):
    n_ops = draw(st.integers(1, 60))
    tokens = np.array(draw(st.lists(st.integers(0, 40), min_size=n_ops, max_size=n_ops)), dtype=np.int32)
    phases = np.array(draw(st.lists(st.integers(0, 2), min_size=n_ops, max_size=n_ops)), dtype=np.int8)
    n_tensors = draw(st.integers(1, 12))
    pairs = draw(st.lists(st.tuples(st.integers(0, n_ops - 1), st.integers(0, n_tensors - 1)), max_size=120))
    pairs.sort(key=lambda p: p[0])
    use_ops = np.array([p[0] for p in pairs], dtype=np.int64)
    use_tensors = np.array([p[1] for p in pairs], dtype=np.int64)
    return tokens, phases, use_ops, use_tensors, n_tensors


@given(uses())
@settings(max_examples=200, deadline=None)
def test_vectorised_features_equal_the_appendix_a_fold(case):
    tokens, phases, use_ops, use_tensors, n_tensors = case
    count, tag, stack = tensor_features(tokens, phases, use_ops, use_tensors, n_tensors)
    got = [(int(c), int(t), int(s)) for c, t, s in zip(count, tag, stack, strict=True)]
    assert got == reference(tokens, phases, use_ops, use_tensors, n_tensors)


def test_call_stack_keeps_the_last_eight_operators():
    tokens = np.arange(10, dtype=np.int32)  # every operator distinct: indices 1..10 by token order
    phases = np.zeros(10, dtype=np.int8)
    count, tag, stack = tensor_features(tokens, phases, np.arange(10), np.zeros(10, dtype=np.int64), 1)
    assert count[0] == 10 and tag[0] == (1 << 10) - 1
    assert int(stack[0]) == int.from_bytes(bytes(range(10, 2, -1)), "little")  # indices 3..10, newest lowest
