"""Pure serving policies: each takes ``now_s`` and observations and returns a decision, no I/O.

The live services (admission, decode, autoscaler) and the simulator call the same functions.
"""
