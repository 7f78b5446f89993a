"""Tensor-parallel ranks given different batches are refused at the first forward, on every
rank of the group alike; the same batch trains as before."""

from __future__ import annotations

import pytest

from meshlab import Cluster, MeshError

BUILD = """
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, parallelize
model = parallelize(Transformer(ModelConfig(n_layers=1)), mesh, ParallelPlan())
def tokens(shard):  # a batch of 4 sequences, this rank's share of 8
    return local_batch(step=0, batch=8, seq=16, vocab=256, **shard)[0]
"""


@pytest.mark.cluster
def test_tp_ranks_fed_by_their_global_rank_are_refused_naming_the_fix(cluster: Cluster) -> None:
    cluster.init_mesh("dp=2 tp=2")
    cluster.run(BUILD)
    # sharded by the data-parallel coordinate: both tp ranks see one batch, and it runs
    cluster.run("model(tokens(dict(rank=mesh['dp'].get_local_rank(), ranks=2)))")
    with pytest.raises(MeshError) as raised:  # by the global rank: two batches per tp group
        cluster.run("model(tokens(dict(rank=rank, ranks=4)))")
    said = str(raised.value)
    assert "4 of 4 ranks failed" in said, said  # every rank of each group: none left waiting
    for group, other in (("[0, 1]", "[1] differ from rank 0"),
                         ("[2, 3]", "[3] differ from rank 2")):
        assert f"tensor-parallel ranks {group} were given different inputs in forward call 2 " \
               f"(ranks {other})" in said
    assert "rank=mesh['dp'].get_local_rank()" in said
    # after its first calls the hook is gone: nothing more is gathered per step
    cluster.run("for _ in range(4):\n    model(tokens(dict(rank=0, ranks=2)))")
    cluster.run("model(tokens(dict(rank=rank, ranks=4)))")
