"""FP8 numerics (L1): rowwise-scaled e4m3 products (:mod:`.rowwise`) and the linear whose forward and
both backward products run through them (:mod:`.linear`). No parallelism here: the 2D blocks (L2) and
the models (L3) build on it."""
