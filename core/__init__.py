"""core: what every service shares, the bottom layer.

The wire format (``wire``: tensors, params, the exception -> status map; ``errors``; the
generated protos stay in ``specsplit.v1``), serving plumbing (``serving``, ``request_guard``,
``reflection``, ``startup``, ``tls_hint``), auth (``auth``, ``admin_token``, ``audit``),
metric families (``worker_metrics``), logging and the metrics endpoint (``observability``),
configuration shared by every service and its loading (``config``, ``params``,
``config_loader``) and terminal progress bars (``progress``).

Imports nothing of this project above it (checked by tests/unit/test_layers.py).
"""
