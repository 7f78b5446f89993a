"""Expert parallel composed with what trains beside it, on transformers' MoE models, each
against one process in float64 (the fourth round found each of these silently wrong or
refused for the wrong reason):

- with tensor parallel, TP replaced the parameters after EP had hooked its gradient
  averaging onto them (parameters 2.7e-2 from one process), and the gradient norm summed an
  expert split over tp and ep over tp alone (2.2e-5 with clipping);
- with a pipeline, the stage refused ("no EP plan": a stage is not the causal LM), then each
  micro-batch's backward reduced the accumulated expert gradients again (4e-4);
- with gradient accumulation, the same over micro-steps (0.31 on meshlab's own MoE:
  tests/rank/test_parallel.py).
"""

from __future__ import annotations

import ast

import pytest

from meshlab import Cluster
from tests.rank.families import FAMILIES_SOURCE

pytest.importorskip("transformers", reason="transformers is a test dependency")

CELL = """
import meshlab.mesh
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
_r = compare_with_single_process(FAMILIES[{family!r}], meshlab.mesh.build({mesh!r}),
                                 ParallelPlan({plan}), steps=3, dtype=torch.float64,
                                 optimizer="sgd")
(_r.ok, _r.max_loss_error, _r.max_param_error, _r.worst_param)
"""
CASES = [
    ("Mixtral", "dp=2 tp=2 ep=2", "data_parallel='none', sequence_parallel=False, "
                                  "max_grad_norm=0.5"),
    ("Qwen3-MoE", "pp=2 dp=2 ep=2", "data_parallel='none', pipeline_schedule='1f1b', "
                                    "microbatches=4, max_grad_norm=0.5"),
    ("Mixtral", "dp=4 ep=2", "data_parallel='none', grad_accum=2"),
]


@pytest.mark.cluster
@pytest.mark.parametrize("family, mesh, plan", CASES, ids=["ep-tp-clip", "pp-ep-clip",
                                                           "ep-accum"])
def test_expert_parallel_composed_matches_one_process(cluster: Cluster, family: str,
                                                      mesh: str, plan: str) -> None:
    result = cluster.run(FAMILIES_SOURCE + CELL.format(family=family, mesh=mesh, plan=plan),
                         timeout=120)
    verdicts = {r: ast.literal_eval(o.result or "") for r, o in result.outputs.items()}
    assert all(v[0] for v in verdicts.values()), verdicts
