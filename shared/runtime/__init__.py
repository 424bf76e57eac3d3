"""Running the stack's pieces as local processes: embedded nats-server / redis-server, children."""
