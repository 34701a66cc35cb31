"""The target service: the verifier worker (``worker.py``) behind its gRPC servicer (``server.py``).

``create_server(cfg) -> (server, port)`` lives in ``target_service.server``; flags
and config files are parsed only in ``__main__``.
"""
