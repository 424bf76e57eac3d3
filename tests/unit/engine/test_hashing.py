import os
import subprocess
import sys

from shared.kvcache.hashing import ROOT_PARENT, hash_block, hash_blocks, make_namespace

NS = make_namespace("smollm2-135m")


def test_chain_shares_prefix_and_only_full_blocks():
    a = hash_blocks(list(range(40)), 16, NS)
    b = hash_blocks(list(range(32)) + [7] * 8, 16, NS)
    assert len(a) == 2 and a == b  # the 8-token tails are partial blocks: not hashed
    c = hash_blocks([1] + list(range(1, 40)), 16, NS)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash


def test_parent_and_namespace_enter_the_hash():
    tokens = list(range(16))
    assert hash_block(ROOT_PARENT, tokens, NS) != hash_block(1, tokens, NS)
    assert hash_block(ROOT_PARENT, tokens, NS) != hash_block(ROOT_PARENT, tokens, make_namespace("other"))
    assert hash_block(0, tokens, NS) != hash_block(0, tokens, make_namespace("smollm2-135m", cache_salt="t1"))


def test_extending_a_chain_equals_hashing_from_scratch():
    tokens = list(range(100))
    full = hash_blocks(tokens, 16, NS)
    head = hash_blocks(tokens[:48], 16, NS)
    tail = hash_blocks(tokens, 16, NS, parent_hash=head[-1], start_block=3)
    assert head + tail == full
    assert all(0 <= h < 2**63 for h in full)


def test_hash_is_identical_across_processes_with_different_hash_seeds():
    code = ("from shared.kvcache.hashing import hash_blocks, make_namespace;"
            "print(hash_blocks(list(range(64)), 16, make_namespace('m')))")
    outs = set()
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    outs.add(str(hash_blocks(list(range(64)), 16, make_namespace("m"))) + "\n")
    assert len(outs) == 1
