"""Benchmark harness: shipped corpus, small GPT model, and training-arm comparison."""
