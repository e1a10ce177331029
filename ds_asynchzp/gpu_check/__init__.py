"""`asynchzp-gpu-check`: the checks that need a CUDA GPU, in one command, with a report (`cli.py`)."""
