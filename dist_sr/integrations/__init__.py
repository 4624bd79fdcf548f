"""Integrations with other people's training frameworks (the top layer, beside ``launch``).

``deepspeed`` and ``fsdp2`` here are the former locations of what now lives in
``dist_sr.engines`` (kept, deprecated, so existing imports work)."""
