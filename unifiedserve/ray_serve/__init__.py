"""unifiedserve on Ray Serve: one replica per node runtime behind one OpenAI-compatible ingress,
with media-affinity routing (``routing.py``, pure; ``router.py``, the Serve request router).

Importing this package does not import Ray; ``app.py`` and ``router.py`` do (``pip install
unifiedserve[ray]``).
"""
