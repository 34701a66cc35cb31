"""rounds: the round loop's scheduling and its links to the workers.

``scheduler`` (admission, rounds, retirement), ``scheduler_types`` (the requests and events
every caller of the loop sees), ``draft_health`` (the target's link to the draft: failure,
re-attach, address file), ``guards`` (per-item failures of a worker call) and
``worker_clients`` / ``draft_client`` (gRPC clients of the target and draft workers), over the
draft's ``data_plane``. Used by the target service,
which hosts the loop, and by the orchestrator (events, worker clients); it sits below both.
"""
