"""Buffers only, no collectives: the parameter shards and the gradient accumulation shards."""
