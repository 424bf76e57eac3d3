"""The decode worker's side of disaggregated prefill, without I/O: deciding, reserving blocks,
matching KV notifications to waiting requests, the release window (``remote_prefill``)."""

from shared.disagg.remote_prefill import CLOCK_MARGIN_S, QUEUE_STATE_MAX_AGE_S, RemotePrefill, RemotePrefills

__all__ = ["CLOCK_MARGIN_S", "QUEUE_STATE_MAX_AGE_S", "RemotePrefill", "RemotePrefills"]
