"""Stored responses of ``/v1/responses`` and conversations: their stores in NATS and the items of a conversation."""
