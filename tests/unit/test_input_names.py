"""Which Python functions are the input pipeline's: told by the words of their names."""
from __future__ import annotations

import pytest

from rankscope.analyzer.metrics import DATA_LOADING


@pytest.mark.parametrize("name, loads", [
    ("dataloader.py:_MultiProcessingDataLoaderIter._next_data", True),
    ("fetch.py:_MapDatasetFetcher.fetch", True),
    ("rank.py:load_batch", True),
    ("train.py:loadBatch", True),
    ("collate.py:default_collate", True),
    ("data.py:Tokens.__getitem__", True),
    ("_ops.py:OpOverloadPacket.__call__", False),  # "Overload" is no load
    ("schedules.py:_wait_batch_p2p", False),  # the pipeline schedule waits for the other stage
    ("distributed_c10d.py:batch_isend_irecv", False),
    ("model.py:Net.forward", False),
])
def test_data_loading_is_told_by_the_words_of_a_name(name: str, loads: bool) -> None:
    assert bool(DATA_LOADING.search(name)) is loads
