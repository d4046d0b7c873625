"""A user's own training script on `hetloco_ds.initialize`, one GPU, as tests/gpu/jobs.py launches it
(torchrun): python api_loop.py PHASE HF_DIR DATA CONFIG WORK.

train   initialize from HF_DIR; 3 steps (H = 2: step 2 syncs); save_checkpoint(tag "mid"), between
        outer steps; step 4 (syncs); save_checkpoint(tag "boundary"); the parameters; save_pretrained;
        the engine's logits of the first held-out batch.
load    a fresh engine: load_checkpoint(tag "mid"), step 4: its loss and parameters; then
        load_checkpoint(tag "boundary"): the parameters and whether the replicas count as synced.
memory  a fresh d = 1024, 6-layer model (HF_DIR's tokenizer), 4 steps under CONFIG: the peak
        allocated bytes and what the engine resolved, for `plan`'s prediction.
Results go to WORK/PHASE.json (and tensors to WORK/PHASE_*.safetensors).
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file


def _params(engine) -> dict[str, torch.Tensor]:
    return {f"p{i:03d}": p.detach().float().cpu().contiguous() for i, p in enumerate(engine.trainable_params())}


def train(engine, loader, hf, work) -> dict:
    from transformers import AutoTokenizer

    from hetloco_ds import data, train as train_mod

    losses = [engine.train_batch().item() for _ in range(3)]
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="mid")
    mid_synced = engine.replicas_synced()
    losses.append(engine.train_batch().item())
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="boundary")
    save_file(_params(engine), os.path.join(work, "train_params.safetensors"))
    synced = engine.replicas_synced()
    engine.save_pretrained(os.path.join(work, "hf_out"), tokenizer=AutoTokenizer.from_pretrained(hf))
    # The engine's logits of the first held-out batch (one stage: the module maps ids to logits).
    args = train_mod.TrainArgs(config=sys.argv[4], model=hf, data=sys.argv[3])
    _, _, _, corpus = train_mod.prepare_inputs(args, 1)
    ids, _ = next(data.validation_batches(corpus.val, engine.micro_batch_size))
    engine.module.eval()
    with torch.no_grad():
        logits = engine.module(ids.to(engine.device)).float().cpu()
    save_file({"ids": ids.contiguous(), "logits": logits.contiguous()}, os.path.join(work, "train_logits.safetensors"))
    return {"losses": losses, "mid_synced": mid_synced, "synced": synced, "position": loader.position,
            "device": str(engine.device), "outer_state_device": engine.hetloco.sparseloco.outer_state_device}


def load(engine, loader, work) -> dict:
    _, client = engine.load_checkpoint(os.path.join(work, "ckpt"), tag="mid")
    restored = {"local_steps": engine.local_steps, "position": client["data_position"],
                "synced_after_mid": engine.replicas_synced()}
    loss4 = engine.train_batch().item()
    save_file(_params(engine), os.path.join(work, "load_params.safetensors"))
    engine.load_checkpoint(os.path.join(work, "ckpt"), tag="boundary")
    save_file(_params(engine), os.path.join(work, "load_boundary_params.safetensors"))
    return {**restored, "loss4": loss4, "synced_after_boundary": engine.replicas_synced(),
            "local_steps_after_boundary": engine.local_steps}


def memory(hf, data_path, config, work) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import hetloco_ds

    # Every allocation from here on, with its Python stack: at the peak, what held the memory.
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    tok = AutoTokenizer.from_pretrained(hf)
    shape = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                 intermediate_size=2816, vocab_size=len(tok), max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    engine, _, _, _ = hetloco_ds.initialize(model=model, config=config, training_data=data_path, tokenizer=hf)
    del model
    losses = [engine.train_batch().item() for _ in range(4)]
    torch.cuda.synchronize()
    try:  # a diagnostic: the job's numbers stand without it
        breakdown = peak_breakdown(torch.cuda.memory._snapshot())
    except Exception as e:  # noqa: BLE001
        breakdown = {"error": f"{type(e).__name__}: {e}"}
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"shape": shape, "losses": losses, "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_breakdown": breakdown,
            "step_casts": bool(engine.step_casts), "schedule": engine.schedule, "micro": engine.micro_batch_size,
            "gas": engine.micro_batches, "seq_len": engine.seq_len,
            "outer_state_device": engine.hetloco.sparseloco.outer_state_device, "compile": engine.hetloco.train.compile,
            "activation_checkpoint_interval": engine.module.activation_checkpoint_interval}


def peak_breakdown(snapshot: dict, top: int = 12) -> dict:
    """The allocator's trace replayed: the moment live bytes peaked, and the blocks alive then grouped by
    the innermost frame of ours, DeepSpeed's, transformers' or torch.optim's code that allocated them
    (what plan's memory rule is checked against, term by term)."""
    events = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    mark = ("hetloco_ds", "deepspeed", "transformers", "torch/optim", "api_loop")

    def where(frames) -> str:
        for f in frames or []:
            name = f.get("filename", "")
            if any(m in name for m in mark):
                return f"{name.split('site-packages/')[-1].split('/work/main/')[-1]}:{f.get('line')} {f.get('name')}"
        return "other"

    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames")))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    groups: dict[str, int] = {}
    for size, key in at_peak.values():
        groups[key] = groups.get(key, 0) + size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"traced_peak": peak, "events": len(events), "blocks_at_peak": len(at_peak),
            "by_site": [[k, v] for k, v in ranked[:top]], "rest": sum(v for _, v in ranked[top:])}


def main() -> None:
    phase, hf, data_path, config, work = sys.argv[1:6]
    import hetloco_ds

    if phase == "memory":
        result = memory(hf, data_path, config, work)
    else:
        engine, _, loader, _ = hetloco_ds.initialize(model=hf, config=config, training_data=data_path)
        result = train(engine, loader, hf, work) if phase == "train" else load(engine, loader, work)
    with open(os.path.join(work, f"{phase}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
