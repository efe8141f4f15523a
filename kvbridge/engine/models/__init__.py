"""Model definitions (one worker's shard of each)."""
