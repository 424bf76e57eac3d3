"""What a service knows about the cluster, built from the registry and load reports (pure)."""
