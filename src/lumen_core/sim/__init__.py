"""Discrete-event simulator of a serving cluster with failures, driving the policy objects:
``cost`` (roofline), ``workload`` (traces, Poisson), ``cluster`` (the event loop),
``eventlog`` (policy calls as JSON lines), ``experiments`` and ``plots`` (``lumen sim``)."""
