"""Whether Triton runs its interpreter (``TRITON_INTERPRET=1``: kernels on CPU tensors, how the
backend is tested without a GPU). Read by the backend object and by the launch path."""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
