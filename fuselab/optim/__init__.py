"""fuselab.optim: optimizers."""
from fuselab.optim.sparse_adamw import SparseAdamW

__all__ = ["SparseAdamW"]
