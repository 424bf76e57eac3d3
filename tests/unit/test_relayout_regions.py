"""Descriptors of a re-laid-out write (shared/transfer/relayout.py ``region_runs``): equal regions,
one per block, merged only where they are contiguous on both the local and the remote side, and
every remote byte still receiving the same local byte."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shared.transfer.relayout import region_runs


def byte_map(rows) -> dict[int, int]:
    """remote address -> local address, byte by byte, of ``[local, remote, bytes]`` rows."""
    return {int(remote) + k: int(local) + k for local, remote, size in rows for k in range(int(size))}


def test_regions_contiguous_on_both_sides_become_one():
    runs = region_runs([1000, 1010, 1020], [5000, 5010, 5020], 10)
    assert runs.tolist() == [[1000, 5000, 30]]


def test_regions_contiguous_on_one_side_only_stay_apart():
    # a staging slab (local contiguous) into blocks at a layer offset (remote every 100 B): one per block
    assert region_runs([0, 10, 20], [100, 200, 300], 10).tolist() == [[0, 100, 10], [10, 200, 10], [20, 300, 10]]
    # the pool's blocks (local every 100 B) into consecutive remote regions: one per block too
    assert region_runs([100, 200, 300], [0, 10, 20], 10).tolist() == [[100, 0, 10], [200, 10, 10], [300, 20, 10]]


def test_runs_break_where_either_side_jumps_and_keep_their_order():
    local = [0, 8, 16, 40, 48, 56]
    remote = [80, 88, 0, 8, 16, 100]
    # 0-1 join; 1-2 the remote jumps; 2-3 the local jumps (the remote goes on); 3-4 join; 4-5 the remote jumps
    assert region_runs(local, remote, 8).tolist() == [[0, 80, 16], [16, 0, 8], [40, 8, 16], [56, 100, 8]]


def test_no_regions_no_descriptors():
    assert region_runs([], [], 64).shape == (0, 3)


def test_mismatched_lists_are_refused():
    with pytest.raises(ValueError):
        region_runs([0, 8], [0], 8)


@pytest.mark.parametrize("seed", range(20))
def test_each_remote_byte_receives_the_same_local_byte(seed):
    rng = random.Random(seed)
    size = rng.choice([4, 16, 64])
    num = rng.randint(1, 30)
    blocks = rng.sample(range(60), num)  # remote block ids, some runs consecutive by chance
    remote = [b * size for b in sorted(blocks)] if rng.random() < 0.5 else [b * size for b in blocks]
    local = [(i + (i // 5) * 3) * size for i in range(num)]  # contiguous in stretches of 5
    runs = region_runs(local, remote, size)
    assert byte_map(runs) == byte_map([(lo, re, size) for lo, re in zip(local, remote)])
    assert int(runs[:, 2].sum()) == num * size
    for (l0, r0, n0), (l1, r1, _) in zip(runs[:-1], runs[1:]):  # adjacent runs could not have merged
        assert not (l0 + n0 == l1 and r0 + n0 == r1)


def test_addresses_above_two_to_the_63_survive():
    base = np.uint64(1 << 63)
    runs = region_runs(np.array([base, base + np.uint64(8)]), np.array([base, base + np.uint64(8)]), 8)
    assert runs.dtype == np.uint64 and runs.tolist() == [[1 << 63, 1 << 63, 16]]
