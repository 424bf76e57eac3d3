"""The whole stack as local processes: embedded nats-server / redis-server, service children, their
supervisor and restart policy, the fleet the autoscaler resizes, and the TLS of one stack."""
