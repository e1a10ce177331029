"""The benchmark's models, shared by the tooling and the tests: the byte-level GPT presets (`gpt`), the AutoEP
Mixtral (`mixtral`), and a model by preset name with its element counts as the ledger counts them (`presets`).
Below the benchmark and beside the planner: neither imports the other to reach a model."""
