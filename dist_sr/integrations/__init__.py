"""Where keyed SR plugs into distributed training stacks (FSDP2 here; each stack one module)."""
