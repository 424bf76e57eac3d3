"""Stored responses of ``/v1/responses``: their store in NATS and the items of a conversation."""
