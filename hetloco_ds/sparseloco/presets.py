"""Named rule sets of the outer step (config `hetloco.sparseloco.preset`): plain field values,
no torch, so the config reads them without importing the method."""

PRESETS: dict[str, dict] = {
    # The SparseLoCo authors' code (tplr-ai/templar v2.1.3, see sparseloco/outer.py's docstring).
    "templar": dict(chunking="per_dim", topk_rule="fixed", quant_rounding="nearest", quant_std="sample",
                    aggregation="selected_count", norm_clip="median", topk=32, chunk_size=4096,
                    error_decay=0.95, outer_lr=1.0),
    # DiLoCo (Douillard et al. 2023): dense pseudo-gradients, outer Nesterov SGD lr 0.7, momentum 0.9.
    "diloco": dict(aggregation="dense", outer_lr=0.7, outer_momentum=0.9, norm_clip="none"),
    # The paper's eq. (2) as written: the sum of the sparse pseudo-gradients over M, no clip.
    "paper": dict(aggregation="mean", norm_clip="none", chunking="tiles", topk_rule="scaled", quant_rounding="floor",
                  quant_std="population", outer_momentum=0.0),
}
"""Fields a preset sets; fields given explicitly next to a preset win."""
