"""Issue 57 item 4: the compression penalty under each init, from paper_tables row JSONs.

    python bench/init_ablation.py --out bench/results/init_ablation/summary_20m_h200.json \\
        bench/results/init_ablation/20M_h200 \\
        bench/results/size_sweep/one_pass/micro8/20M/paper_tables_t4_g0p0.json \\
        bench/results/size_sweep/one_pass/micro8/20M/paper_tables_p65a11290840_1_g0p0.json

Each input (a paper_tables JSON or a folder of them) contributes its finished rows, grouped by the
model they trained (`model`: a preset name or a bench/models/*.json config, which is where the init
differs). Within a group and seed, every compressed row's penalty is against that group's own
SparseLoCo row at the same lr: the init moves the baseline too, so a penalty is never taken across
inits. Written: per row, the final held-out loss, the penalty in % and in nats, and the penalty at
each validation step both rows share (`curve`); `baseline_vs_reference_pct` is each group's
SparseLoCo loss against the `--reference` group's (the torch init by default).
"""
from __future__ import annotations

import argparse
import glob
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
            found[(d["model"], row, v["seed"])] = (r, os.path.relpath(os.path.abspath(f), REPO))
            cards.add(d.get("card"))
    return found, cards


def summarize(paths: list[str], reference: str = "20M") -> dict:
    found, cards = _rows(paths)
    out = []
    for (model, row, seed), (r, f) in sorted(found.items()):
        v = r["variant"]
        if v["mode"] != "sparseloco" or not v.get("compressed"):
            continue
        base_key = (model, f"sparseloco:lr={v['lr']:g}", seed)
        if base_key not in found:
            continue
        b, bf = found[base_key]
        bc = {p["step"]: p["loss"] for p in b.get("val_curve") or []}
        curve = [{"step": p["step"], "penalty_pct": 100 * (p["loss"] - bc[p["step"]]) / bc[p["step"]]}
                 for p in r.get("val_curve") or [] if p["step"] in bc]
        ref = found.get((reference, f"sparseloco:lr={v['lr']:g}", seed))
        out.append({
            "model": model, "row": row, "seed": seed, "ratio": v.get("ratio"), "kind": row.split(":")[0],
            "val_loss": r["val_loss"], "sparseloco_val_loss": b["val_loss"],
            "penalty_pct": 100 * (r["val_loss"] - b["val_loss"]) / b["val_loss"],
            "penalty_nats": r["val_loss"] - b["val_loss"],
            "baseline_vs_reference_pct": (100 * (b["val_loss"] - ref[0]["val_loss"]) / ref[0]["val_loss"]
                                          if ref else None),
            "outer_steps": r.get("outer_steps"), "curve": curve, "files": [f, bf]})
    return {"what": "compression penalty per init, each against its own init's SparseLoCo row",
            "cards": sorted(c for c in cards if c), "reference": reference, "rows": out}


def table(s: dict) -> str:
    lines = ["| model (init) | row | val loss | its SparseLoCo | penalty | SparseLoCo vs reference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in s["rows"]:
        ref = "" if r["baseline_vs_reference_pct"] is None else f"{r['baseline_vs_reference_pct']:+.2f}%"
        lines.append(f"| {r['model']} | {r['row']} | {r['val_loss']:.4f} | {r['sparseloco_val_loss']:.4f} | "
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
