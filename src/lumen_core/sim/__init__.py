"""Discrete-event simulator of a serving cluster with failures, driving the policy objects:
``workload`` (traces, Poisson), ``cluster`` (the event loop), ``experiments``
and ``plots`` (``lumen sim``). The cost model (``lumen_core.cost``) and the event log
(``lumen_core.eventlog``) live beside ``metrics``: the gateway uses them too."""
