"""The simulator (`hetloco-ds simulate`): M replicas x S virtual stages in one process on one device.

The paper measures loss this way. The simulator runs the same stage layers, the same
boundary codec (so compressed replicas see exactly the truncation the real pipeline
applies), the same AdamW + clipping + DeepSpeed LR schedule, the same StageAlgorithm per
(replica, stage) and the same embedding resync as HetlocoEngine, only without processes:
per-step losses match a real multi-process run with the same seeds and data (a test checks).
Bytes are not measured here but computed from the shapes that would cross each link.

    core.py     what both simulators share: layers seeded as the pipeline seeds them, each
                stage's StageAlgorithm and LocalStageLink, link bytes, the outer step of every
                (replica, stage) with its per-sync diagnostics (`outer_step_all`)
    replica.py  `Simulation`: one module set and optimizer per replica (the reference, `--per-replica`)
    batched.py  `BatchedSimulation`: the replicas stacked and run as one batched computation (the default)
    sharded.py  `Shards`: one batched row over G processes, each holding M/G replicas, gathered
                wherever the row couples them (`simulate_variant(shards=G)`)
    rows.py     a sweep's rows (`Variant`, `parse_variants`), `simulate_variant`, the degradation table
    cli.py      `hetloco-ds simulate`

This package imports none of its modules, so importing one loads only what it needs.
"""
