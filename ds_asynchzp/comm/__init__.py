"""The package's own collectives, with preallocated outputs, and the flows of one step (the other direct callers of
deepspeed.comm are listed in docs/ARCHITECTURE.md, "Layers")."""
