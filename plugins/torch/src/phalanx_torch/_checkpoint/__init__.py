"""Checkpoint files: shards written and read by every rank, and FSDP's
saves and loads on any world size."""
