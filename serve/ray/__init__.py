"""``kvshare serve --ray``: engine replicas on Ray Serve with workflow affinity.

- :mod:`.replicas`: the engine replicas and the gateway (``start``, ``build_app``,
  ``EngineSpec``, ``RayServeOptions``);
- :mod:`.router`: ``WorkflowAffinityRouter``, consistent hashing with bounded loads that
  keeps every call of a workflow on the replica holding its KV.

Importing this package does not import Ray; the modules do (the ``kvshare[ray]`` extra).
"""
