"""Issue 57 item 4: the compression penalty under each init, from paper_tables row JSONs.

    python bench/init_ablation.py --out bench/results/init_ablation/summary_20m_h200.json \\
        bench/results/init_ablation/20M_h200 \\
        bench/results/size_sweep/one_pass/micro8/20M/paper_tables_t4_g0p0.json \\
        bench/results/size_sweep/one_pass/micro8/20M/paper_tables_p65a11290840_1_g0p0.json

    python bench/init_ablation.py --reference bench/models/tiny_emb0.02.json \\
        --out bench/results/init_ablation/summary_tiny_cpu.json bench/results/init_ablation/tiny_cpu_*.json

Each input (a paper_tables JSON or a folder of them) contributes its finished rows, grouped by the
model they trained (`model`: a preset name or a bench/models/*.json config, which is where the init
differs). Within a group and seed, every compressed row's penalty is against that group's own
uncompressed row as paper_tables pairs them (`Variant.base_key`: PP and Het against SparseLoCo at the
same lr, AdamW-PP and AdamW-Het against AdamW): the init moves the baseline too, so a penalty is
never taken across inits. Written: per row, the final held-out loss, the penalty in % and in nats,
and the penalty at each validation step both rows share (`curve`); `baseline_vs_reference_pct` is
each group's uncompressed loss against the `--reference` group's (the torch init by default);
`over_seeds`, each row's mean, lowest and highest penalty over its seeds; `boundary_probe`, where the
row ran with paper_tables --probe-boundaries, each boundary's dropped and exactly rebuilt shares of the
activation at each validation (the mean over the compressed replicas).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hetloco_ds.sim.rows import Variant  # noqa: E402


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        out += sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
    return out


def _rows(paths: list[str]) -> tuple[dict, set]:
    """{(model, row, seed): (row dict, file)} for every finished row, and the cards they ran on."""
    found, cards = {}, set()
    for f in _files(paths):
        with open(f) as fh:
            d = json.load(fh)
        for r in d.get("rows", []):
            if r.get("status") not in (None, "done") or r.get("val_loss") is None:
                continue
            v = r["variant"]
            row = v["name"].split("@")[0]
            found[(_model(d), row, v["seed"])] = (r, os.path.relpath(os.path.abspath(f), REPO))
            cards.add(d.get("card"))
    return found, cards


def _model(doc: dict) -> str:
    """The run's `model`; a config file outside the checkout (a run made before it was committed) as
    the committed bench/models/ file of its name, where every field that file sets is the run's."""
    model = doc["model"]
    mine = os.path.join(REPO, "bench", "models", os.path.basename(model))
    if os.path.isabs(model) and os.path.exists(mine):
        with open(mine) as fh:
            fields = json.load(fh)
        if all(doc.get("model_config", {}).get(k) == v for k, v in fields.items()):
            return os.path.relpath(mine, REPO)
    return model


def _base_key(r: dict) -> tuple:
    """The uncompressed row a row is measured against, as paper_tables' own table pairs them
    (`Variant.base_key`: 'pp:8' against 'sparseloco', 'adamw-het:8' against 'adamw')."""
    return Variant(**r["variant"]).base_key


def summarize(paths: list[str], reference: str = "20M") -> dict:
    found, cards = _rows(paths)
    bases = {(model, _base_key(r)): (r, f) for (model, _, _), (r, f) in found.items() if not r["variant"].get("compressed")}
    out = []
    for (model, row, seed), (r, f) in sorted(found.items()):
        v = r["variant"]
        if not v.get("compressed") or (model, _base_key(r)) not in bases:
            continue
        b, bf = bases[(model, _base_key(r))]
        bc = {p["step"]: p["loss"] for p in b.get("val_curve") or []}
        curve = [{"step": p["step"], "penalty_pct": 100 * (p["loss"] - bc[p["step"]]) / bc[p["step"]]}
                 for p in r.get("val_curve") or [] if p["step"] in bc]
        ref = bases.get((reference, _base_key(r)))
        out.append({
            "model": model, "row": row, "seed": seed, "ratio": v.get("ratio"), "kind": row.split(":")[0],
            "val_loss": r["val_loss"], "base_row": b["variant"]["name"].split("@")[0], "base_val_loss": b["val_loss"],
            "penalty_pct": 100 * (r["val_loss"] - b["val_loss"]) / b["val_loss"],
            "penalty_nats": r["val_loss"] - b["val_loss"],
            "baseline_vs_reference_pct": (100 * (b["val_loss"] - ref[0]["val_loss"]) / ref[0]["val_loss"]
                                          if ref else None),
            "outer_steps": r.get("outer_steps"), "curve": curve, "files": [f, bf]})
        if r.get("boundary_probe"):
            out[-1]["boundary_probe"] = probe_means(r["boundary_probe"])
    return {"what": "compression penalty per init, each against its own init's uncompressed row (SparseLoCo's; "
                    "AdamW's for the adamw rows)",
            "cards": sorted(c for c in cards if c), "reference": reference, "rows": out, "over_seeds": over_seeds(out)}


def probe_means(curve: list[dict]) -> list[dict]:
    """bench/boundary_probe.py's curve, each boundary's shares as the mean over the compressed replicas
    (those with an exact share)."""
    out = []
    for p in curve:
        pairs = [[(d, e) for d, e in zip(b["dropped"], b["exact"]) if e is not None] for b in p["boundaries"]]
        out.append({"step": p["step"], "dropped": [sum(d for d, _ in x) / len(x) for x in pairs],
                    "exact": [sum(e for _, e in x) / len(x) for x in pairs]})
    return out


def over_seeds(rows: list[dict]) -> list[dict]:
    """Per model and row, the penalty's mean, lowest and highest over the seeds that have it."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["row"]), []).append(r)
    out = []
    for (model, row), mine in sorted(groups.items()):
        p = [r["penalty_pct"] for r in mine]
        out.append({"model": model, "row": row, "seeds": sorted(r["seed"] for r in mine),
                    "penalty_pct_mean": sum(p) / len(p), "penalty_pct_min": min(p), "penalty_pct_max": max(p)})
    return out


def table(s: dict) -> str:
    lines = ["| model (init) | row | val loss | its uncompressed row | penalty | that row vs reference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in s["rows"]:
        ref = "" if r["baseline_vs_reference_pct"] is None else f"{r['baseline_vs_reference_pct']:+.2f}%"
        lines.append(f"| {r['model']} | {r['row']} | {r['val_loss']:.4f} | {r['base_row']} {r['base_val_loss']:.4f} | "
                     f"{r['penalty_pct']:+.2f}% ({r['penalty_nats']:+.3f} nats) | {ref} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="paper_tables JSONs or folders of them")
    p.add_argument("--reference", default="20M", help="the model whose SparseLoCo row the others' are set against")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    s = summarize(args.inputs, args.reference)
    rel = [os.path.relpath(os.path.abspath(x), REPO) for x in args.inputs]
    s["command"] = " ".join(["python bench/init_ablation.py", "--out", os.path.relpath(os.path.abspath(args.out), REPO)]
                            + (["--reference", args.reference] if args.reference != "20M" else []) + rel)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(s, fh, indent=1)
    os.replace(tmp, args.out)
    print(table(s))


if __name__ == "__main__":
    main()
