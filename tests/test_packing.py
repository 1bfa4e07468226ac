"""Packed documents' starts, positions and boundary targets, by hand, and as Documents sees them."""

import torch

from parallel4d.data.packing import IGNORE, boundary_targets, document_positions, document_starts
from parallel4d.sequence.documents import Documents

EOD = 0


def test_starts_positions_and_targets_of_a_packed_window():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4],    # a cut document, two whole ones
                           [3, 3, 3, 3, 3, 3, 3, 3],    # one document
                           [0, 0, 1, 0, 2, 2, 2, 0]])   # empty documents: each EOD ends one
    targets = torch.roll(tokens, -1, dims=1)
    starts = document_starts(tokens, EOD)
    assert starts.int().tolist() == [[1, 0, 0, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0, 0]]
    assert document_positions(starts).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8)),
                                                   [0, 0, 0, 1, 0, 1, 2, 3]]
    ignored = boundary_targets(tokens, targets, EOD) == IGNORE
    assert ignored.tolist() == (tokens == EOD).tolist()
    assert Documents.from_starts(starts).ids.tolist() == [[1, 1, 1, 2, 2, 2, 2, 3], [1] * 8,
                                                          [1, 2, 3, 3, 4, 4, 4, 4]]
