"""KV transfer over real NIXL (UCX) between two OS processes.

This process is the writer (the prefill side); ``PeerProcess`` holds the target pools. Every
check reads the target's memory back through the child, so a write that landed in the wrong
block, at the wrong offset or in the wrong dtype fails.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from shared.kvcache.layout import KvCacheSpec
from shared.transfer import (AgentMetadata, InMemoryMetadataStore, KVTransferFailed, KvLayoutMismatch, KvTransfer,
                             joint_runs)
from shared.transfer.convert import convert_slab
from kv_transfer_peer import PeerProcess, fill_pool, prefill_blocks
from stack_helpers import require_nixl

require_nixl()

pytestmark = pytest.mark.slow

SPEC = KvCacheSpec(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
NUM_BLOCKS = 64
DEADLINE_S = 20.0
PROMPT = "List three prime numbers and explain why each one is prime. " * 6  # ~90 tokens: 6 blocks

# consecutive and scattered ids on both sides: joint runs (0..3 -> 5..8), (10..12 -> 30..32), (40 -> 50),
# (7 -> 20), (8 -> 22)
LOCAL_IDS = [0, 1, 2, 3, 10, 11, 12, 40, 7, 8]
REMOTE_IDS = [5, 6, 7, 8, 30, 31, 32, 50, 20, 22]


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def peer():
    process = PeerProcess()
    yield process
    process.close()


@pytest.fixture(scope="module")
def writer():
    from shared.transfer.nixl import NixlTransfer

    pool = SPEC.allocate(NUM_BLOCKS, "cpu")
    fill_pool(pool, seed=1)
    transfer = NixlTransfer(_name("writer"), capture_telemetry=True)
    transfer.register_kv_pool(pool, SPEC)
    yield transfer, pool
    transfer.close()


def _target(peer: PeerProcess, writer, spec: KvCacheSpec = SPEC) -> tuple[str, str]:
    """A fresh pool in the child (zeros) added as the writer's peer: (agent name, peer name)."""
    agent = _name("target")
    metadata = AgentMetadata.from_bytes(peer.call("init_pool", agent, spec, NUM_BLOCKS, None))
    return agent, writer[0].add_peer(metadata)


def test_write_moves_runs_into_other_block_ids_and_notifies(peer, writer):
    transfer, pool = writer
    agent, name = _target(peer, writer)
    sent_before = transfer.stats.num_bytes_sent

    handle = transfer.write_blocks(name, LOCAL_IDS, REMOTE_IDS, b"req-1")
    transfer.wait(handle, DEADLINE_S)

    notes = peer.call("wait_notifications", agent, 1, DEADLINE_S)
    assert notes == [(transfer.agent_name, b"req-1", len(LOCAL_IDS) * SPEC.bytes_per_block)]
    assert torch.equal(peer.call("read_blocks", agent, REMOTE_IDS), pool[LOCAL_IDS])
    untouched = [b for b in range(NUM_BLOCKS) if b not in REMOTE_IDS]
    assert not peer.call("read_blocks", agent, untouched).any(), "bytes landed outside the target blocks"
    # one descriptor per joint run, by our count and by NIXL's
    assert handle.num_descriptors == len(joint_runs(LOCAL_IDS, REMOTE_IDS)) == 5
    assert handle.backend_descriptors == 5
    moved = len(LOCAL_IDS) * SPEC.bytes_per_block
    assert handle.num_bytes == moved
    assert transfer.stats.num_bytes_sent - sent_before == moved
    assert peer.call("bytes_received", agent) == moved


def test_a_long_prompt_in_a_fresh_pool_is_one_descriptor(peer, writer):
    transfer, pool = writer
    agent, name = _target(peer, writer)
    handle = transfer.write_blocks(name, list(range(2, 50)), list(range(10, 58)), b"long")
    transfer.wait(handle, DEADLINE_S)
    assert handle.num_descriptors == handle.backend_descriptors == 1
    assert peer.call("wait_notifications", agent, 1, DEADLINE_S)[0][1] == b"long"
    assert torch.equal(peer.call("read_blocks", agent, list(range(10, 58))), pool[2:50])


def test_a_repeated_write_is_harmless(peer, writer):
    transfer, pool = writer
    agent, name = _target(peer, writer)
    for _ in range(2):
        transfer.wait(transfer.write_blocks(name, LOCAL_IDS, REMOTE_IDS, b"again"), DEADLINE_S)
    notes = peer.call("wait_notifications", agent, 2, DEADLINE_S)
    assert [n[1] for n in notes] == [b"again", b"again"]
    assert torch.equal(peer.call("read_blocks", agent, REMOTE_IDS), pool[LOCAL_IDS])
    assert peer.call("bytes_received", agent) == 2 * len(LOCAL_IDS) * SPEC.bytes_per_block


def test_unknown_peer_and_bad_block_ids_raise(peer, writer):
    transfer, _ = writer
    _, name = _target(peer, writer)
    with pytest.raises(KVTransferFailed, match="unknown peer"):
        transfer.write_blocks("nobody", [0], [0], b"x")
    with pytest.raises(KVTransferFailed, match="out of range"):
        transfer.write_blocks(name, [0], [NUM_BLOCKS], b"x")
    with pytest.raises(KVTransferFailed, match="repeat"):
        transfer.write_blocks(name, [0, 1], [3, 3], b"x")
    with pytest.raises(KVTransferFailed, match="2 local block ids for 1"):
        transfer.write_blocks(name, [0, 1], [3], b"x")


def test_a_write_to_a_dead_peer_fails(writer):
    transfer, _ = writer
    doomed = PeerProcess()
    try:
        _, name = _target(doomed, writer)
        transfer.wait(transfer.write_blocks(name, [0, 1], [0, 1], b"alive"), DEADLINE_S)
        doomed.kill()
        failed_before = transfer.stats.num_failed
        # UCX knows the peer is gone: the write fails at once, it does not wait out the deadline
        with pytest.raises(KVTransferFailed, match=r"failed to start: NIXL_ERR_REMOTE_DISCONNECT$"):
            transfer.wait(transfer.write_blocks(name, [0, 1], [0, 1], b"dead"), 5.0)
        assert transfer.stats.num_failed == failed_before + 1
    finally:
        doomed.close()
        transfer.remove_peer(name)


def test_a_restarted_peer_under_the_same_name_is_replaced(peer, writer):
    transfer, pool = writer
    agent, name = _target(peer, writer)
    transfer.wait(transfer.write_blocks(name, [1], [1], b"first life"), DEADLINE_S)
    assert peer.call("wait_notifications", agent, 1, DEADLINE_S)[0][1] == b"first life"
    peer.call("close_agent", agent)
    metadata = AgentMetadata.from_bytes(peer.call("init_pool", agent, SPEC, NUM_BLOCKS, None))
    assert transfer.add_peer(metadata) == name
    transfer.wait(transfer.write_blocks(name, [2, 3], [4, 5], b"second life"), DEADLINE_S)
    assert peer.call("wait_notifications", agent, 1, DEADLINE_S)[0][1] == b"second life"
    assert torch.equal(peer.call("read_blocks", agent, [4, 5]), pool[[2, 3]])


def test_dtype_and_block_size_conversion(peer, writer):
    transfer, pool = writer
    remote_spec = KvCacheSpec(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, 32, torch.bfloat16)
    agent, name = _target(peer, writer, remote_spec)
    local_ids, remote_ids = [4, 5, 6, 20, 21], [9, 3, 4]  # 80 tokens -> blocks of 32: 32 + 32 + 16
    handle = transfer.write_blocks(name, local_ids, remote_ids, b"converted")
    transfer.wait(handle, DEADLINE_S)
    assert handle.num_descriptors == 2  # remote runs [9], [3, 4]
    assert peer.call("wait_notifications", agent, 1, DEADLINE_S)[0][1] == b"converted"
    expected = convert_slab(pool[local_ids], SPEC, remote_spec, len(remote_ids))
    got = peer.call("read_blocks", agent, remote_ids)
    assert torch.equal(got, expected)
    # token 70 of the request: local block 21 slot 6; remote block 4 slot 6
    assert torch.equal(got[2, :, :, 6], pool[21, :, :, 6].to(torch.bfloat16))
    assert not got[2, :, :, 16:].any(), "the remote tail past the tokens is zero"


def test_layouts_that_cannot_be_converted_are_named(peer, writer):
    other = KvCacheSpec(SPEC.num_layers, SPEC.num_kv_heads * 2, SPEC.head_dim, 16, torch.float32)
    with pytest.raises(KvLayoutMismatch, match=r"4 heads.*into|2 heads.*4 heads"):
        _target(peer, writer, other)


async def test_metadata_through_nats_kv(peer, writer, bus, nats_url, namespace):
    from shared.transfer import connect_peer
    from shared.protocol.subjects import Subjects
    from shared.transfer.nats_metadata import NatsMetadataStore

    transfer, pool = writer
    agent = _name("nats-target")
    peer.call("init_pool", agent, SPEC, NUM_BLOCKS, None)
    peer.call("publish_nats", agent, nats_url, Subjects(namespace).nixl_bucket, "decode-7")
    store = await NatsMetadataStore.open(bus, Subjects(namespace).nixl_bucket)
    name = await connect_peer(store, "decode-7", transfer, timeout_s=DEADLINE_S)
    assert name == agent
    transfer.wait(transfer.write_blocks(name, [3, 4], [0, 1], b"via-nats"), DEADLINE_S)
    assert peer.call("wait_notifications", agent, 1, DEADLINE_S)[0][1] == b"via-nats"
    assert torch.equal(peer.call("read_blocks", agent, [0, 1]), pool[[3, 4]])
    with pytest.raises(KVTransferFailed, match="no transfer metadata"):
        await connect_peer(store, "decode-unknown", transfer)
    await store.delete("decode-7")
    assert await store.get("decode-7") is None


async def test_in_memory_store_round_trip(writer):
    assert isinstance(writer[0], KvTransfer)
    store = InMemoryMetadataStore()
    metadata = writer[0].local_metadata()
    await store.put("w", metadata.to_bytes())
    assert AgentMetadata.from_bytes(await store.get("w")) == metadata


def test_engine_kv_written_into_another_engine_equals_its_own(smollm2_gguf):
    """Engine A prefills a prompt; NIXL writes those blocks into free blocks of engine B (another
    process, which prefilled the same prompt itself); B's two copies are equal."""
    from shared.engine import EngineConfig, LLMEngine
    from shared.transfer.nixl import NixlTransfer

    peer = PeerProcess()
    writer = NixlTransfer(_name("prefill"))
    try:
        engine = LLMEngine.from_config(EngineConfig(kv_cache_memory=64 << 20, dtype="float32"))
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
        assert len(prompt) > 4 * engine.block_size
        agent = _name("decode")
        metadata_bytes, own_ids = peer.call("init_engine", agent, engine.model, prompt, timeout_s=120)
        local_ids = prefill_blocks(engine, "remote-prefill", prompt)
        writer.register_kv_pool(engine.kv_cache, engine.kv_spec)
        name = writer.add_peer(AgentMetadata.from_bytes(metadata_bytes))
        num_blocks = AgentMetadata.from_bytes(metadata_bytes).num_blocks
        dest_ids = [b for b in range(num_blocks - 1, -1, -2) if b not in own_ids][:len(local_ids)]
        writer.wait(writer.write_blocks(name, local_ids, dest_ids, b"prefilled"), DEADLINE_S)
        assert peer.call("wait_notifications", agent, 1, DEADLINE_S)[0][1] == b"prefilled"
        received = peer.call("read_blocks", agent, dest_ids)
        own = peer.call("read_blocks", agent, own_ids)
        tokens = len(prompt)
        # compare the prompt's token slots only (the last block's tail is unwritten on both)
        flat = lambda t: t.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :tokens]  # noqa: E731
        assert torch.equal(flat(received), flat(own))
        assert flat(own).abs().sum() > 0
    finally:
        writer.close()
        peer.close()


def test_nixl_not_importable_is_a_clear_startup_error(monkeypatch):
    import sys

    from shared.transfer import TransferUnavailable
    from shared.transfer.nixl import NixlTransfer

    monkeypatch.setitem(sys.modules, "nixl_cu12._api", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(TransferUnavailable, match="NIXL is not importable.*remote prefill is unavailable"):
        NixlTransfer("no-nixl")
