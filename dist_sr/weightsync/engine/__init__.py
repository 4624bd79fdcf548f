"""The engine's end of the wire: ``receiver`` (``WeightReceiver``, which dist-sr's vLLM backend
and the bare receiver share), the bare receiver's HTTP ``server`` and its command (``cli``)."""
