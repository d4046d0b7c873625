"""GPU sanity check of the batched simulator against the per-replica reference, before long runs.

Same config, same seed, same batches: the 20M model, M = 8 x S = 4, one row (het:8 by default),
bf16 autocast, a few inner steps and one outer step. Prints every replica's loss at every step
for both simulators and for the compiled batched one, and exits 1 if a batched run is
non-finite, excludes a replica at its outer step, or its losses differ from the reference by
more than --rtol (bf16 reorders reductions; the CPU test holds them to 1e-5 in fp32).

    OUT=... bash bench/gpu.sh sim_check.py --out $OUT/sim_check.json
    python bench/sim_check.py --cpu-smoke --out /tmp/sim_check.json   # tiny, M = 2 x S = 2, fp32, eager
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(kind: str, args, cfg, run_cfg, hetloco, data):
    from hetloco_ds.sim.replica import Simulation
    from hetloco_ds.sim.batched import BatchedSimulation

    torch.manual_seed(0)
    dev = torch.device(args.device)
    if kind == "per_replica":
        sim = Simulation(run_cfg, hetloco, cfg, args.replicas, args.stages, dev)
    else:
        sim = BatchedSimulation(run_cfg, hetloco, cfg, args.replicas, args.stages, dev, compile=kind == "compiled")
    losses = []
    for ids in data:
        batch = [[(ids[m, a], ids[m, a]) for a in range(args.gas)] for m in range(args.replicas)]
        losses.append(sim.train_step(batch).float().mean(-1).tolist())
    outer = sim.outer_step()
    return losses, outer


def main(argv=None) -> int:
    from hetloco_ds.config import parse_config
    from hetloco_ds.presets import model_config_for
    from hetloco_ds.sim.rows import parse_variants

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="20M")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variant", default="het:8")
    p.add_argument("--rtol", type=float, default=0.02)
    p.add_argument("--kinds", default="per_replica,batched,compiled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--out")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="preset tiny, vocab 256, M 2 x S 2, micro 2, seq 32, 2 steps, per_replica and batched, fp32 "
                        "(where the CPU test holds them to 1e-5)")
    if "--cpu-smoke" in (sys.argv[1:] if argv is None else argv):  # defaults only: explicit flags win
        p.set_defaults(shape="tiny", vocab=256, replicas=2, stages=2, micro=2, seq=32, steps=2,
                       kinds="per_replica,batched", device="cpu", rtol=1e-5)
    args = p.parse_args(argv)
    cfg = model_config_for(args.shape, args.vocab)
    run_cfg = parse_config({
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0, "bf16": {"enabled": args.device == "cuda"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "hetloco": {"sparseloco": {"inner_steps": args.steps}, "train": {"seq_len": args.seq}}})
    hetloco = parse_variants([args.variant], args.replicas, [0])[0].hetloco(run_cfg.hetloco, args.replicas)
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, cfg.vocab_size, (args.replicas, args.gas, args.micro, args.seq), generator=g).to(args.device)
            for _ in range(args.steps)]
    results, ok = {}, True
    for kind in args.kinds.split(","):
        try:
            losses, outer = run(kind, args, cfg, run_cfg, hetloco, data)
            results[kind] = {"losses": losses, "outer": {k: v for k, v in outer.items() if k in ("excluded", "outer_step")}}
        except Exception as err:  # noqa: BLE001 - report and judge
            results[kind] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(kind, json.dumps(results[kind])[:600], flush=True)
    ref = results.get("per_replica", {}).get("losses")
    for kind in ("batched", "compiled"):
        r = results.get(kind)
        if r is None:
            continue
        if "error" in r:
            ok = ok and kind == "compiled"  # a compiler failure leaves the eager path
            continue
        flat = [x for step in r["losses"] for x in step]
        finite = all(x == x and abs(x) != float("inf") for x in flat)
        worst = max(abs(a - b) / abs(b) for sa, sb in zip(r["losses"], ref) for a, b in zip(sa, sb)) if ref else None
        r["finite"], r["max_rel_vs_per_replica"] = finite, worst
        r["ok"] = finite and not r["outer"].get("excluded") and (worst is None or worst <= args.rtol)
        ok = ok and r["ok"]
        print(f"{kind}: finite {finite}, excluded {r['outer'].get('excluded')}, max rel vs per-replica {worst}", flush=True)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "settings": vars(args), "results": results, "ok": ok}, f,
                      indent=1)
    print("sim_check", "OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
