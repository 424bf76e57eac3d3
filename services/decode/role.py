"""The decode role as a worker process builds it (``services.worker.process``, which imports no role
package: ``tandem decode`` and ``tandem prefill`` hand it this builder and the prefill one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.decode.config import DecodeSettings
from services.worker.role_builder import RoleBuilder, RoleParts

if TYPE_CHECKING:
    from services.decode.service import DecodeWorker


def wants_transfer(settings: DecodeSettings) -> bool:
    """Written into by prefill workers (remote prefill), or lending and fetching prefixes."""
    return settings.remote_prefill or settings.kv_peer_fetch


def build(settings: DecodeSettings, parts: RoleParts) -> DecodeWorker:
    # torch and nats only in the process that serves the role, not when `tandem --help` registers it
    from shared.disagg import RemotePrefills
    from services.decode.fetch import PeerFetcher
    from services.decode.remote import RemotePrefiller
    from services.decode.service import DecodeWorker

    remote = fetcher = None
    if parts.transfer is not None and settings.kv_peer_fetch:
        fetcher = PeerFetcher(engine=parts.engine, transfer=parts.transfer, store=parts.store, bus=parts.bus,
                              subjects=parts.subjects, worker_id=settings.worker_id, model=settings.model,
                              write_timeout_s=settings.kv_write_timeout_s, window_s=settings.kv_fetch_window_s)
    if parts.transfer is not None and settings.remote_prefill:
        prefills = RemotePrefills(
            worker_id=settings.worker_id, model=settings.model, engine=parts.engine,
            config=settings.disagg_config(), timeout_s=settings.remote_prefill_timeout_s,
            write_timeout_s=settings.kv_write_timeout_s, lease_s=settings.prefill_lease_s)
        remote = RemotePrefiller(prefills, bus=parts.bus, registry=parts.registry, transfer=parts.transfer,
                                 subjects=parts.subjects)
    return DecodeWorker(settings, parts.bus, parts.registry, parts.engine, remote, load_seq=parts.load_seq,
                        metrics=parts.metrics, fetcher=fetcher)


DECODE = RoleBuilder(DecodeSettings, wants_transfer, build)
