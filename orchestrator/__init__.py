"""The orchestrator: client-facing Generate API, continuous-batching scheduler,
gRPC clients of the draft and target workers, metrics and a Python client.

Modules: ``server`` (servicer, ``create_server``), ``scheduler`` (rounds and
batching, framework- and gRPC-free), ``worker_clients`` (the round driver's
ports over gRPC), ``client`` (``SpecsplitClient``), ``metrics``.
Importing the package imports nothing heavy.
"""
