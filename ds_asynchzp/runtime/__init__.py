"""The code that runs inside a training step: the DeepSpeed subclasses, process groups, public entry points."""
