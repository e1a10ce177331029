"""The only callers of deepspeed.comm: collectives with preallocated outputs, and the flows of one step."""
