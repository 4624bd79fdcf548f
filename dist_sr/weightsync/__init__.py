"""Moving a trainer's working weights to rollout engines, verified: the sync plan (``plan``),
the gloo transport (``transport``), the ``ControlPlane`` protocol an engine is driven through
(``control``), the trainer side (``sync``), the receiving side (``receiver``) and snapshots for
engines that (re)start (``snapshot``)."""
