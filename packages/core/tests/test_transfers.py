"""The transfer record core keeps for graph offload and the KV cache."""

from memfit.transfers import TransferStats


def test_the_record_counts_copies_bytes_and_waits_and_a_copy_is_a_snapshot():
    stats = TransferStats()
    stats.stored(100)
    stats.stored(28)
    stats.prefetched(64)
    stats.waited(0.5)
    snapshot = stats.copy()
    stats.prefetched(1)
    assert (snapshot.stores, snapshot.stored_bytes, snapshot.prefetches, snapshot.prefetched_bytes) == (2, 128, 1, 64)
    assert (snapshot.waits, snapshot.wait_seconds) == (1, 0.5)
    assert (stats.prefetches, stats.prefetched_bytes) == (2, 65)
