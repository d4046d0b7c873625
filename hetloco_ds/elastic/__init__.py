"""Elastic mode: each replica is its own DeepSpeed job, and the replicas meet at the outer sync
through torchft (`transport/elastic.py`).

    replica.py    one pipeline job as one replica of a fleet: its identity, the engine's transport
                  (`FleetTransport`, the `ReplicaTransport` the engine and the training loop call),
                  the start gate. `train` imports it.
    launcher.py   `hetloco-ds train --nproc N --elastic`: a whole fleet on one machine. It imports
                  `train`, never the other way.

Identity and data. A fleet has a fixed size N (`hetloco.elastic.max_replicas`); a replica's id is
its index m in 0..N-1, given as `--replica-id m`. A config that names every replica's depth
(`hetloco.replica_stages`) makes replica m a job of replica_stages[m] ranks and N their number
(`config.elastic_replica`); the replicas then meet by outer-sync block (transport/elastic.py). The id is everything that differs between
replicas: replica m trains on data shard m of N (`batches.ReplicaBatches(blocks, m, N)`, the static
run's replica m when N = M), compresses its stage boundaries as the config says for replica m
(`hetloco.subspace.compressed_replicas` / `replica_ratios`), and its payloads are summed in id
order, as the static exchange sums in replica order: the transport sorts members by name, and a
replica's name is its id zero-padded to the width of N - 1. So a fleet without faults reproduces
the static run of the same config bit for bit.

What a replica shares, and what it keeps. At an outer boundary a replica behind the fleet (a
late or restarted one, or one whose attempt the others committed without it) is healed by
torchft with a live peer's copy of what every replica holds alike: each stage's synced
parameters, T_perp, outer momentum and outer-step count (`StageAlgorithm.global_state_dict`),
plus the step counter and the learning-rate schedule. It keeps what is its own: its error
feedback restarts at zero, its AdamW moments and data position stay as they are (a fresh
replica starts its shard at 0; a restarted one resumes its own checkpoint's position). The H
inner steps a replica ran before it was healed are discarded, once.

Agreement beyond the payload header. The payload fingerprint covers the outer-step config and
the parameter shapes. What else must agree - the fleet size (disjoint shards), H, the model's
sizes, the replicas' depths when they are mixed (the blocks) and the basis T_S lives in (the split basis: the smallest subspace of the config's
compressed replicas, `subspace.split_basis`) - is the fleet identity. It seeds the transport's
chain, so a replica with another identity never contributes and falls behind; when it is then
healed, it compares the donor's identity with its own and refuses itself in one line naming
the difference. So a replica may join with another compression ratio than the fleet's config
gave its id as long as the split basis stays the fleet's (its own subspace contains T_S); one
whose ratio would change the split basis is refused.

Where replicas write. `--out OUT` names the fleet's directory; replica m owns OUT/replica-m/, a
complete run directory (record, lock, metrics.jsonl, checkpoints/ with the transport's state,
hf/). Any replica's checkpoint exports the synced model. `--elastic` also writes
OUT/fleet_config.json (the config with max_replicas filled in) and OUT/.hetloco/fleet_secret
(a generated secret, mode 600) so that a replica can be restarted by hand.
"""
