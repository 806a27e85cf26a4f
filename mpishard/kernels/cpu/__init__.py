"""The CPU kernel set: :mod:`.ops` (the set, cache-blocked NumPy passes), :mod:`.threads`
(the pool its row loops run on) and :mod:`.blas` (the 2-D matrix products)."""
