"""What the project's tests and benchmarks share (not a user API): local vLLM engines and
weight receivers started as processes on loopback (``vllm_engines``)."""
