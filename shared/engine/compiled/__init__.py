"""The compiled decode step, in one place: the step itself (``step``: one graph per decode-only
batch, traced through the model, its CPU kernels called from it), its artifacts and their cache key
(``artifacts``), the CUDA-graph variant (``cuda_graph``), and how a worker gets it without stalling
traffic: on a thread of its own (``background``) or in a child process (``child``). A cluster's
store of built steps (NATS Object Store) is the worker's: services/worker/compile_share.py."""
