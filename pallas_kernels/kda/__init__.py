"""Kimi Delta Attention ops: `chunk_kda` (chunked; XLA or Pallas backends) and `recurrent_kda` (oracle)."""
from pallas_kernels.kda.api import (IMPLEMENTATIONS, SEGMENT_RESET, check_inputs, chunk_kda,
                                    recurrent_kda, resolve_implementation, segment_starts)

__all__ = ["IMPLEMENTATIONS", "SEGMENT_RESET", "check_inputs", "chunk_kda", "recurrent_kda",
           "resolve_implementation", "segment_starts"]
