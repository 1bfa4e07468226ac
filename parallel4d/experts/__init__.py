"""Expert parallelism, the fifth axis: a mixture-of-experts layer's experts split over ``ep`` ranks and its
tokens dispatched to them by all-to-all (:mod:`.dispatch`). Imports no other technique."""

from parallel4d.experts.dispatch import (Agreement, Dispatcher, ExpertFn, ExpertParallel, HostCounts, OneRank,
                                         combine, count_per_expert, dispatch_local, sort_by_expert)

__all__ = ["Agreement", "Dispatcher", "ExpertFn", "ExpertParallel", "HostCounts", "OneRank", "combine",
           "count_per_expert", "dispatch_local", "sort_by_expert"]
