"""SparseLoCo, one module per job (import them by name; this package imports nothing, so the
config reads `presets` without torch):

    compress.py   per-chunk top-k, quantisation, index packing: one tensor's wire format
    payload.py    one replica's payload: layout by shape, self-checking header, checks of a gathered one
    outer.py      SparseLoCoState: error feedback, the two-phase outer step, where the state lives
    blocks.py     BlockStates: a stage of several outer-sync blocks (mixed depths), a SparseLoCoState each
    aggregate.py  the outer step's rules by name (aggregation, clip, screen, top-k): where a new one goes
    presets.py    the named rule sets of the config's `sparseloco.preset`
    attacks.py    named corruptions of a payload, what the screen is measured and tested against
"""
