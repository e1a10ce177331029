"""Measurement for the tools (the benchmark, asynchzp-ab, the GPU check): what one rank records of each optimizer
step, its model-state memory, the record files, and asynchzp-ab's arm inside the user's job. Above the runtime:
it reads the runtime, the runtime never imports it."""
