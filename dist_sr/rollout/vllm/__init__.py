"""A fleet of ``vllm serve`` engines: the config section (``config``), the HTTP control plane
(``control``), the rollout engine (``engine``) and the engine-side weight-transfer backend and
worker extension (``plugin``, loaded inside vLLM)."""
