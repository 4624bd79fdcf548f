"""GRPO with verifiable rewards on top of the precision switch."""
