"""How the layout's collectives are scheduled: background communication threads (each with its own process
group and, on CUDA, its own stream), the work handles the training thread waits on, one issue order per rank, the
agreement that a gradient read starting a collective is every rank's, and the monitor that ends a run whose peer
died. Every thread and stream of the package is created in `context.py`."""
