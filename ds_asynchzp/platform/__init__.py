"""What every layer stands on: DeepSpeed's private surface (checked at import), the process groups, the
device's streams and events, and the ledger that counts every collective. It imports nothing of the layers above it (state, comm, scheduler, runtime)."""
