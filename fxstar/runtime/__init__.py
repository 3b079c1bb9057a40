"""What the rewritten graph runs against: memory tiers, chunk management and the CPU optimizer."""
