"""The service framework: settings every service shares, its `tandem <name>` command built from
its settings class, and a service process's lifecycle (logging, signals, bus, registry, metrics)."""
