"""What every layer stands on: DeepSpeed's private surface (checked at import), the process groups, and the
device's streams and events. It imports nothing of the layers above it (state, comm, scheduler, runtime)."""
