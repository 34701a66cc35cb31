"""specsplit: speculative decoding split into gRPC services (draft, target, orchestrator).

This package holds the command-line interface and the generated protocol
code (``specsplit.v1``); the services live in the top-level packages
``runtime``, ``draft_service``, ``target_service`` and ``orchestrator``.
"""

__version__ = "0.1.0"
