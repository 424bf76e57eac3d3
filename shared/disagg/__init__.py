"""Disaggregated prefill. Pure, with the time passed in: the decode worker's side (deciding,
reserving blocks, matching KV notifications to waiting requests, the release window:
``remote_prefill``) and the leases on reserved blocks (``lease``). With I/O: the prefill worker's
pull from the per-priority JetStream work queues (``prefill_queue``)."""

from shared.disagg.remote_prefill import CLOCK_MARGIN_S, QUEUE_STATE_MAX_AGE_S, RemotePrefill, RemotePrefills

__all__ = ["CLOCK_MARGIN_S", "QUEUE_STATE_MAX_AGE_S", "RemotePrefill", "RemotePrefills"]
