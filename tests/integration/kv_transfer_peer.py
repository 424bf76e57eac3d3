"""A second OS process holding KV pools and NIXL agents, driven over a pipe by the transfer tests.

``PeerProcess`` starts the child with multiprocessing's spawn context (a fresh interpreter: its own
NIXL agent, UCX context and address space). Each call sends ``(method, args)`` and waits, with a
deadline, for ``("ok", value)`` or ``("err", text)``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import traceback

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor reductions: tensors cross the pipe in shared memory

from shared.kvcache.layout import KvCacheSpec


def fill_pool(pool: torch.Tensor, seed: int) -> None:
    """Distinct, reproducible values in every element (a wrong block or offset cannot match)."""
    gen = torch.Generator().manual_seed(seed)
    pool.copy_(torch.randn(pool.shape, generator=gen, dtype=torch.float32).to(pool.dtype))


class _Child:
    def __init__(self) -> None:
        self.agents: dict = {}
        self.pools: dict[str, torch.Tensor] = {}
        self.notes: dict[str, list] = {}
        self.engine = None

    def init_pool(self, agent_name: str, spec: KvCacheSpec, num_blocks: int, seed: int | None) -> bytes:
        from shared.transfer.nixl import NixlTransfer

        pool = spec.allocate(num_blocks, "cpu")
        if seed is not None:
            fill_pool(pool, seed)
        transfer = NixlTransfer(agent_name)
        transfer.register_kv_pool(pool, spec)
        self.agents[agent_name], self.pools[agent_name], self.notes[agent_name] = transfer, pool, []
        return transfer.local_metadata().to_bytes()

    def close_agent(self, agent_name: str) -> None:
        """A worker going away: its agent and pool are released (a restart may reuse the name)."""
        self.agents.pop(agent_name).close()
        self.pools.pop(agent_name)
        self.notes.pop(agent_name)

    def init_engine(self, agent_name: str, model, prompt: list[int]) -> tuple[bytes, list[int]]:
        """An engine of its own around ``model`` (the parent's weights, shared through torch's
        multiprocessing reductions instead of a second 13 s load), prefill ``prompt`` (its KV stays
        in the returned blocks), register the pool."""
        from shared.engine import EngineConfig, LLMEngine
        from shared.transfer.nixl import NixlTransfer

        engine = LLMEngine(model, EngineConfig(kv_cache_memory=64 << 20))
        self.engine = engine
        block_ids = prefill_blocks(engine, "own", prompt)
        transfer = NixlTransfer(agent_name)
        transfer.register_kv_pool(engine.kv_cache, engine.kv_spec)
        self.agents[agent_name], self.pools[agent_name], self.notes[agent_name] = \
            transfer, engine.kv_cache, []
        return transfer.local_metadata().to_bytes(), block_ids

    def publish_nats(self, agent_name: str, nats_url: str, bucket: str, worker_id: str) -> None:
        from shared.bus import Bus
        from shared.transfer.metadata import publish_metadata
        from shared.transfer.nats_metadata import NatsMetadataStore

        async def run() -> None:
            bus = await Bus.connect(nats_url, f"peer-{worker_id}")
            try:
                await publish_metadata(await NatsMetadataStore.open(bus, bucket), worker_id, self.agents[agent_name])
            finally:
                await bus.close()
        asyncio.run(run())

    def progress(self) -> None:
        """What a worker's loop does between other work: collect notifications (which also drives
        NIXL's progress, so incoming connections are accepted)."""
        for agent_name, transfer in self.agents.items():
            self.notes[agent_name].extend(transfer.get_notifications())

    def wait_notifications(self, agent_name: str, count: int, timeout_s: float) -> list[tuple[str, bytes, int]]:
        """Poll until ``count`` notifications arrived for the agent (since the last call) or the deadline."""
        deadline = time.monotonic() + timeout_s
        notes = self.notes[agent_name]
        while len(notes) < count and time.monotonic() < deadline:
            self.progress()
        taken, notes[:] = notes[:count], notes[count:]
        return [(n.peer, n.message, n.num_bytes) for n in taken]

    def read_blocks(self, agent_name: str, block_ids: list[int]) -> torch.Tensor:
        return self.pools[agent_name][block_ids].clone()

    def bytes_received(self, agent_name: str) -> int:
        return self.agents[agent_name].stats.num_bytes_received


def prefill_blocks(engine, request_id: str, prompt: list[int]) -> list[int]:
    """Step until the prompt is prefilled (its first token sampled); the blocks holding its KV."""
    from shared.engine.request import SamplingParams

    with torch.inference_mode():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while not any(o.request_id == request_id and o.new_token_ids for o in engine.step()):
            pass
    num_blocks = -(-len(prompt) // engine.block_size)
    return engine.reservations.request_block_ids(request_id)[:num_blocks]


def _serve(conn) -> None:
    child = _Child()
    while True:
        while not conn.poll(0.001):
            child.progress()
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            return
        try:
            conn.send(("ok", getattr(child, method)(*args)))
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            conn.send(("err", traceback.format_exc()))


class PeerProcess:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_conn,), daemon=True)
        self.process.start()
        child_conn.close()

    def call(self, method: str, *args, timeout_s: float = 60.0):
        self._conn.send((method, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer process gave no answer to {method} within {timeout_s}s")
        status, value = self._conn.recv()
        if status == "err":
            raise RuntimeError(f"peer process failed in {method}:\n{value}")
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", ()))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
