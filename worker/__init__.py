"""worker: the model-worker shell both the draft and the target service are built from.

``base`` (the worker around an engine: lifecycle, weights, graphs, the device thread),
``service`` (its gRPC face: lifecycle / status / release RPCs, health, start-up) and
``config`` (``WorkerConfig``). Sits on ``runtime`` and ``core``; knows no service above it.
"""
