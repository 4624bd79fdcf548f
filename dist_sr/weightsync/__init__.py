"""Moving a trainer's working weights to rollout engines, verified. What both ends of the wire
read: the sync plan (``plan``), the signatures (``auth``), the transports (``transport``: gloo |
nccl, ``ipc``: colocated) and the ``ControlPlane`` protocol an engine is driven through
(``control``). Then one folder per side: ``trainer/`` (what the trainer does), ``engine/`` (what
an engine does) and ``disk/`` (snapshots, and materializing them)."""
