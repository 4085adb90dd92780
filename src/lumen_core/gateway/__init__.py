"""Live control plane: gRPC service, worker leases and epochs, recovery coordinator.

``Coordinator`` is the decision path (the same policy objects as the simulator, no I/O);
``GatewayServer`` serves it over gRPC on loopback with a Prometheus endpoint; ``GatewayClient``
is what workers and clients call it with. Protocol: ``lumen.proto`` (stubs: ``make proto``).
"""
