"""SparseLoCo: per-chunk top-k compression with error feedback (compress.py) and the outer step (outer.py)."""
from .compress import ChunkLayout, TensorCodec
from .outer import OuterConfig, OuterReport, SparseLoCoState, payload_nbytes

__all__ = ["ChunkLayout", "TensorCodec", "OuterConfig", "OuterReport", "SparseLoCoState",
           "payload_nbytes"]
