"""The code that runs inside a training step: the DeepSpeed subclasses (engine, hierarchical optimizer and its
mixins), checkpoints, offload, the public entry points, and the observer point tools attach to."""
