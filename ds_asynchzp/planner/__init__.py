"""`asynchzp-plan`'s arithmetic: plan a cluster before training, from the same formulas, memory model and ``"auto"``
rule the engine uses.

* `arm_formulas`: each arm's bytes, model-state memory and quantization plan per optimizer step (ZeRO-3, hpZ,
  ZeRO++, AsyncHZP and its quantized arms);
* `cluster_plan`: the whole plan of a cluster (`cluster_plan.plan`): the layout ``"auto"`` picks and why, and every
  arm's memory, bytes and communication time;
* `inputs`: the inputs as people write them (``70B``, ``400GB/s``, ``80GB``, a model spec);
* `moe`, `offload`, `sequence_parallel`: AutoEP's experts, optimizer offload, Ulysses sequence parallelism;
* `volume`: cross-node bytes by flow; `time_model`: step time against a node link's rate;
* `cli`: the ``asynchzp-plan`` command.

Below the benchmark: nothing here reads a benchmark's records (``--check`` is `ds_asynchzp.bench.plan_check`).
"""
