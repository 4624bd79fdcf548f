"""Starting jobs: the planner behind every entry point (``planner``: ``launch/train.py`` under
python / torchrun / deepspeed, and ``dist-sr train``), Kubernetes manifests (``k8s``), and the
``dist-sr`` command (``cli``). The top layer: nothing in dist_sr imports it."""
