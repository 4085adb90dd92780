"""Recovery policies of LUMEN and its baselines: pure, deterministic, driven by events.

Stdlib and numpy only; no I/O, threads, wall clocks or torch. ``sim/`` and ``gateway/`` build
the same classes and feed them the same events (``policy.events``).
"""
