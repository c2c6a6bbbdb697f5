"""The integer features that identify "the same" tensor across iterations (Chameleon, Appendix A).

Each time an operator uses a tensor, three integers are updated:

* ``op_count`` — how many operators used it;
* ``op_tag`` — the OR of the operators' one-hot codes, over the 32 most frequent operators of
  the profiled iteration (others contribute 0);
* ``op_call_stack`` — ``(stack << 8) + index`` kept to 64 bits: the frequency indices (1..255,
  0 for unknown or rarer) of the last 8 operators that used it.

Matching with integers only is what makes it cheap enough to do for every tensor at run time.
The profiler stores, per tensor, the features as of its **last forward use** (where a swap-out
would be matched); for tensors never used in forward, over all their uses.

Example:
    ```python
    import numpy as np
    from memfit.features import OpVocabulary, update

    vocab = OpVocabulary.from_tokens(np.array([3, 3, 5, 3, 7]))
    features = (0, 0, 0)
    for token in (3, 5):
        features = update(features, vocab, token)
    # features == (2, 0b11, (1 << 8) + 2): used twice, by the 1st and 2nd most frequent ops
    ```
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_K = 32
MAX_INDEX = 255
_MASK64 = (1 << 64) - 1

Features = tuple[int, int, int]
"""(op_count, op_tag, op_call_stack)."""


@dataclass(frozen=True)
class OpVocabulary:
    """Frequency ranks of operator tokens: one-hot codes for the top 32, 8-bit indices for the top 255.

    Example:
        ```python
        import numpy as np
        from memfit.features import OpVocabulary

        tokens = np.array([3, 3, 5, 3, 7, 5])   # the operator tokens of a profiled iteration
        vocab = OpVocabulary.from_tokens(tokens)
        vocab.one_hot                           # {3: 1, 5: 2, 7: 4}: one bit each, most frequent first
        vocab.index                             # {3: 1, 5: 2, 7: 3}: frequency ranks from 1 (0: unknown)
        ```
    """

    one_hot: dict[int, int]
    index: dict[int, int]

    @classmethod
    def from_tokens(cls, tokens: np.ndarray) -> OpVocabulary:
        """Rank operators by how often they occur in ``tokens`` (ties: lower token first)."""
        values, counts = np.unique(np.asarray(tokens), return_counts=True)
        order = np.lexsort((values, -counts))
        ranked = [int(v) for v in values[order]]
        return cls(
            one_hot={tok: 1 << rank for rank, tok in enumerate(ranked[:TOP_K])},
            index={tok: rank + 1 for rank, tok in enumerate(ranked[:MAX_INDEX])},
        )


def update(features: Features, vocab: OpVocabulary, token: int) -> Features:
    """The features after one more use by an operator with ``token``."""
    count, tag, stack = features
    return (
        count + 1,
        tag | vocab.one_hot.get(token, 0),
        ((stack << 8) + vocab.index.get(token, 0)) & _MASK64,
    )


def tensor_features(
    tokens: np.ndarray, phases: np.ndarray, use_ops: np.ndarray, use_tensors: np.ndarray, n_tensors: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features of every tensor as of its last forward use (all uses if it has none).

    Vectorised; gives exactly what folding :func:`update` over each tensor's uses gives.

    Args:
        tokens: operator tokens, one per operator.
        phases: operator phases (0 = forward).
        use_ops: for every use, the operator index, sorted ascending.
        use_tensors: for every use, the tensor row.
        n_tensors: number of tensor rows.

    Returns:
        ``(op_count int32, op_tag uint32, op_call_stack uint64)`` arrays of length ``n_tensors``.
    """
    vocab = OpVocabulary.from_tokens(tokens)
    use_ops = np.asarray(use_ops, dtype=np.int64)
    use_tensors = np.asarray(use_tensors, dtype=np.int64)
    forward = phases[use_ops] == 0
    last_fwd = np.full(n_tensors, -1, dtype=np.int64)
    np.maximum.at(last_fwd, use_tensors[forward], use_ops[forward])
    limit = last_fwd[use_tensors]
    keep = (limit < 0) | (use_ops <= limit)
    ops, rows = use_ops[keep], use_tensors[keep]
    used_tokens = tokens[ops].astype(np.int64)

    lookup_size = int(tokens.max()) + 1 if tokens.size else 1
    one_hot = np.zeros(lookup_size, dtype=np.uint64)
    index = np.zeros(lookup_size, dtype=np.uint64)
    for tok, bit in vocab.one_hot.items():
        one_hot[tok] = bit
    for tok, idx in vocab.index.items():
        index[tok] = idx

    count = np.bincount(rows, minlength=n_tensors).astype(np.int32)
    tag = np.zeros(n_tensors, dtype=np.uint64)
    np.bitwise_or.at(tag, rows, one_hot[used_tokens])
    # The stack holds the last 8 indices, the newest in the low byte: a use that is r uses from
    # the tensor's last one sits at byte r, and uses 8 or more back have been shifted out.
    order = np.argsort(rows, kind="stable")  # uses grouped by tensor, in operator order
    grouped = rows[order]
    ends = np.cumsum(np.bincount(grouped, minlength=n_tensors))
    from_last = ends[grouped] - 1 - np.arange(grouped.size)
    recent = from_last < 8
    stack = np.zeros(n_tensors, dtype=np.uint64)
    shifted = index[used_tokens[order][recent]] << (np.uint64(8) * from_last[recent].astype(np.uint64))
    np.bitwise_or.at(stack, grouped[recent], shifted)
    return count, tag.astype(np.uint32), stack
