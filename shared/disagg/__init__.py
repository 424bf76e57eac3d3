"""KV that a decode worker receives from other workers: remote prefill and prefix fetch.

Pure, with the time passed in (no I/O, no clock of their own): ``incoming`` (the KV writes a
decode worker expects and the blocks it holds until no late write can land; both users below
drive it), ``remote_prefill`` (deciding, reserving blocks, the release window), ``peer_fetch``
(whether to fetch a prefix from a peer, the ask, judging the answer, quarantine, bandwidth) and
``lease`` (the leases on reserved blocks). Not pure: ``prefill_queue``, the prefill worker's pull
from the per-priority JetStream work queues (NATS, through ``shared.bus``)."""

from shared.disagg.remote_prefill import CLOCK_MARGIN_S, QUEUE_STATE_MAX_AGE_S, RemotePrefill, RemotePrefills

__all__ = ["CLOCK_MARGIN_S", "QUEUE_STATE_MAX_AGE_S", "RemotePrefill", "RemotePrefills"]
