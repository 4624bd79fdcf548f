"""The trainer's end of the wire: ``sync`` (``WeightSync``, every trainer rank) with its jobs
(``fleet``: the engines and their states, ``groups``: the transfer groups, ``transfer``: one
attempt at moving the buckets, ``verify``: the digest checks), ``export`` (the working weights as
full HF-named tensors) and ``sparse`` (pairs for the peers' delta syncs)."""
