"""The worker framework: what every engine-running worker shares (settings, warm-up, load reports,
KV events, metrics), the roles one process serves and flips between, and orphaned-request aborts."""
