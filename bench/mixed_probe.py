"""Mixed pipeline depths on 4 GPUs, 178M (micro 8 x 8 at 2048, H = 20, 26 steps, step 12 profiled):
per replica tokens/s, bytes sent per step by link class and outer-step seconds for
hetloco.replica_stages [1, 1, 2] with the 2-stage replica compressed, the same with none compressed,
and [2, 1, 1] with the 2-stage replica (now replica 0) compressed; with each run, the GPUs' compute
processes (nvidia-smi) sampled halfway, so a run sharing a GPU with another's leftovers shows it.
Written when scale.py's mixed runs came out with one S = 1 replica at half the other's speed: an
earlier run's ranks were still on GPUs 1-3 (results/left_over_ranks_h200x4/).

    OUT=DIR bash bench/gpu.sh --gpus 4 --timeout 420 mixed_probe.py      # OUT/probe_mixed.json
"""
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402

VARIANTS = [("m112_c2", {"replica_stages": [1, 1, 2], "subspace": {"compressed_replicas": [2]}}),
            ("m112_none", {"replica_stages": [1, 1, 2], "subspace": {"compressed_replicas": "none"}}),
            ("m211_c0", {"replica_stages": [2, 1, 1], "subspace": {"compressed_replicas": [0]}})]


def sampled(samples: list[str], stop: threading.Event) -> None:
    while not stop.wait(3):
        samples.append(" | ".join(scale.gpu_apps()))


def main() -> None:
    import torch

    out, work = os.environ["OUT"], "/tmp/probe"
    base = scale.deep_update(scale.shapes(False)["config"], {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 8, "pipeline": {"stages": 2},
        "hetloco": {"train": {"seq_len": 2048, "profile_step": 12}}})
    res = {"card": torch.cuda.get_device_name(0), "rows": []}
    for name, over in VARIANTS:
        samples: list[str] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sampled, args=(samples, stop))
        sampler.start()
        row = scale.ours(name, work, 4, scale.deep_update(base, {"hetloco": over}), "178M", 26, 130,
                         stop_after=26 * len(over["replica_stages"]))
        stop.set()
        sampler.join()
        row["smi"] = samples[len(samples) // 2] if samples else ""
        metrics = os.path.join(work, name, "metrics.jsonl")
        if os.path.exists(metrics):
            row["replicas"] = scale.replica_rates(metrics, 20)
        res["rows"].append(row)
        print(name, {k: round(v["tokens_per_s"] or 0) for k, v in row.get("replicas", {}).items()}, row["smi"], flush=True)
        with open(os.path.join(out, "probe_mixed.json"), "w") as f:
            json.dump(res, f, indent=1)
    scale.pack(work, out)


if __name__ == "__main__":
    main()
