"""A dry run of one step on fake ranks, and the planner held to what it measures.

Each case of the matrix runs a real meshlab (or transformers) model through meshlab's own
``parallelize`` on torch's fake process group, 64 to 2,048 ranks, in this process; then
every figure the planner predicts that the dry run can show is held to it: bytes per mesh
axis within 2%, memory by category within 10%, once the differences the reconciliation
names (each a fact of torch's implementation, with its bytes) are applied. Tiny widths:
fake tensors cost no compute, only Python per op. Activations are held at real widths
(``REAL``, and the published layouts at full size) within 5%: at 256 wide the loss's and
the optimizer's temporaries, not the layers, make a step's peak.

A dry run is Python on one core, so a second process takes some of them (``BESIDE``, and
every family of the model matrix) while this one runs the rest: each is a fake world of its
own either way, and a DryRun comes back as the plain data it is.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from meshlab.dry_run.plan import describe, ran
from meshlab.dry_run.run import DryRun, dryrun, plan_for, planner_beside, representative_ranks
from meshlab.plan import HARDWARE, IMPLEMENTATIONS, Layout, ModelShape
from meshlab.plan.reconcile import planner_estimate
from meshlab.plan.report import plan

# four blocks: FSDP's steady state needs a block between the first and the last; widths
# whose rows divide over the shard groups but the padded cases' (FSDP2 pads a dim 0 that
# does not)
TINY = ModelShape(name="tiny", layers=4, hidden=256, heads=8, kv_heads=4, ffn=512,
                  vocab=1024, seq_len=64)
WIDE = dataclasses.replace(TINY, name="tiny-mha", kv_heads=8)  # tp=8 splits its kv heads
MOE = ModelShape(name="tiny-moe", layers=4, hidden=256, heads=8, kv_heads=4, ffn=256,
                 vocab=1024, seq_len=64, experts=8, top_k=2)


def llama() -> Any:
    """transformers' Llama at TINY's widths (built on meta by the dry run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=512, vocab_size=1024, max_position_embeddings=64))


def mixtral() -> Any:
    """transformers' Mixtral at MOE's widths."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=256, vocab_size=1024, max_position_embeddings=64,
        num_local_experts=8, num_experts_per_tok=2))


MESHLAB = " ".join(f"{k}={int(v)}" for k, v in IMPLEMENTATIONS["meshlab"].items())
MATRIX: dict[str, tuple[ModelShape | Callable[[], Any], str]] = {
    "zero1": (TINY, "dp_shard=64 zero=1 precision=fp32"),
    "zero2": (TINY, "dp_shard=64 zero=2 precision=fp32"),
    "zero3": (TINY, "dp_shard=128 precision=fp32"),
    # gradient accumulation: one reduce-scatter a step, the parameters gathered every micro-step
    "zero2_accum": (TINY, "dp_shard=64 zero=2 m=4 precision=fp32"),
    "hsdp": (TINY, "dp_replicate=4 dp_shard=32 precision=fp32"),
    "tp_sp": (TINY, "dp_shard=32 tp=4 precision=fp32"),
    "tp_no_sp": (TINY, "dp_shard=32 tp=4 sp=0 precision=fp32"),
    "pp_1f1b": (TINY, "pp=2 dp_shard=32 m=4 precision=fp32"),
    "pp_interleaved": (TINY, "pp=2 dp_shard=16 tp=2 schedule=interleaved_1f1b v=2 m=4 "
                             "precision=fp32"),
    "pp_zero2": (TINY, "pp=2 dp_shard=32 zero=2 m=4 precision=fp32"),
    # a pipeline's stages reducing every micro-batch (ParallelPlan.reduce_every_microbatch)
    "pp_zero2_each": (TINY, "pp=2 dp_shard=32 zero=2 m=4 reduce_once=0 precision=fp32"),
    "pp_zero3_each": (TINY, "pp=2 dp_shard=32 zero=3 m=4 reduce_once=0"),
    "cp": (TINY, "dp_shard=32 cp=2 precision=fp32"),
    "cp_ulysses": (TINY, "dp_shard=32 cp=2 precision=fp32 cp_impl=ulysses"),
    "cp_chunked": (TINY, "dp_shard=32 cp=2 precision=fp32 cp_impl=chunked cp_chunks=2"),
    "ep": (MOE, "dp_replicate=4 dp_shard=16 ep=4 precision=fp32"),
    "moe": (MOE, "dp_shard=8 dp_replicate=8 precision=fp32"),
    # FSDP2 pads rows to the shard group: a 256-row weight over 512 ranks, 8 experts over 64
    "padded": (TINY, "dp_shard=512"),
    "padded_experts": (MOE, "dp_shard=64 precision=fp32"),
    # the MoE beside tp (sequence parallel) and a pipeline; autocast's fp32 stream in bf16
    "ep_tp_pp": (MOE, "pp=2 tp=2 dp_shard=8 ep=4 m=2 precision=fp32"),
    "ep_tp_bf16": (MOE, "tp=2 dp_shard=4 ep=4"),
    # transformers' MoE: its experts as grouped_mm, its own TP plan, beside ep and a pipeline
    "transformers_mixtral": (mixtral, "pp=2 tp=2 dp_shard=8 ep=4 m=2"),
    "ac_selective": (TINY, "dp_shard=64 ac=selective precision=fp32"),
    "ac_full": (TINY, "dp_shard=64 ac=full precision=fp32"),
    "offload": (TINY, "dp_shard=64 offload_params=1 precision=fp32"),
    "ddp": (TINY, "dp_shard=64 zero=0 precision=fp32"),
    "bf16": (TINY, "dp_shard=64"),
    "bf16_pp": (TINY, "pp=2 dp_shard=32 m=4"),
    "adafactor": (TINY, "dp_shard=64 optimizer=adafactor"),
    "adamw_bf16": (TINY, "dp_shard=64 optimizer=adamw_bf16"),
    # 8-bit blocks of 256 are one process's only where each shard holds >= 4096 whole ones
    "adamw8bit": (TINY, "dp_shard=4 precision=fp32 optimizer=adamw8bit"),
    # the planner counting meshlab's code (IMPLEMENTATIONS): nothing left to name for it
    "meshlab_zero2": (TINY, "pp=2 dp_shard=8 tp=2 zero=2 m=4 " + MESHLAB),
    "meshlab_zero3": (TINY, "pp=2 dp_shard=8 tp=2 zero=3 m=4 " + MESHLAB),
    "transformers_llama": (llama, "dp_shard=32 tp=2 sp=0 precision=fp32"),
    "2048_ranks": (WIDE, "pp=2 dp_replicate=8 dp_shard=16 tp=8 m=2 precision=fp32"),
}

_runs: dict[str, DryRun] = {}
# the last cases the tests below ask for: the second process has them ready by then
BESIDE = ["transformers_llama", "transformers_mixtral", "2048_ranks"]
_beside: dict[str, Future[Any]] = {}
FAMILY_TEST = "test_every_family_of_the_model_matrix_dry_runs_or_is_refused_naming_why"
PUBLISHED_TEST = "test_published_layouts_agree_with_the_planner_on_every_category"


def run(case: str) -> DryRun:
    """The case's dry run, once per session (a few seconds each)."""
    if case not in _runs:
        _runs[case] = _beside[case].result() if case in _beside else dry_run_case(case)
    return _runs[case]


def dry_run_case(case: str) -> DryRun:
    model, layout = MATRIX[case]
    return dryrun(model, layout, workers=1)


@pytest.fixture(scope="module", autouse=True)
def _second_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Starts the dry runs the second process takes: those this session's tests ask for."""
    here = [item for item in request.session.items
            if getattr(item, "module", None) is request.module]
    cases = {item.callspec.params.get("case") for item in here if hasattr(item, "callspec")}
    wanted = [case for case in BESIDE if case in cases]
    families = any(getattr(item, "originalname", "") == FAMILY_TEST for item in here)
    # the planner's pick beside, the published layout here
    published = [item.callspec.params["case"] for item in here
                 if getattr(item, "originalname", "") == PUBLISHED_TEST][-1:]
    if not wanted and not families and not published:
        yield
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        _beside.update({case: pool.submit(dry_run_case, case) for case in wanted})
        if families:
            _beside["families"] = pool.submit(dry_run_families)
        _beside.update({model: pool.submit(dry_run_published, model) for model in published})
        yield
        for future in _beside.values():  # a test stopped early: what has not started
            future.cancel()
    _beside.clear()


@pytest.mark.parametrize("case", list(MATRIX))
def test_the_planner_counts_the_bytes_each_axis_moves(case: str) -> None:
    rows = [r for r in planner_beside(run(case)) if r.what == "bytes"]
    assert rows
    off = {(r.rank, r.name): (r.dry_run, round(r.explained), r.difference) for r in rows
           if r.dry_run and abs(r.explained / r.dry_run - 1) > 0.02}
    assert not off
    missing = {r.name: r.planner for r in rows if not r.dry_run and r.explained > 1024}
    assert not missing


@pytest.mark.parametrize("case", list(MATRIX))
def test_the_planner_counts_the_memory_of_each_category(case: str) -> None:
    rows = [r for r in planner_beside(run(case)) if r.what == "memory"]
    off = {(r.rank, r.name): (r.dry_run, round(r.explained), r.difference) for r in rows
           if r.comparable and r.name != "activations"
           and abs(r.explained - r.dry_run) > 0.10 * max(r.dry_run, 1024)}
    assert not off


# Llama 3 8B's widths, four blocks: a layer's activations make the step's peak
REAL = ModelShape(name="real", layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                  vocab=32000, seq_len=4096)
AT_REAL_WIDTHS = ["zero3", "tp_sp", "tp_no_sp", "ddp", "pp_1f1b", "bf16_pp", "pp_interleaved",
                  "meshlab_zero2", "ac_full"]


@pytest.mark.parametrize("case", AT_REAL_WIDTHS)
def test_activations_with_fused_kernels_match_the_planner_at_real_widths(case: str) -> None:
    """Korthikanti's count with the differences named (torch's sequence parallelism, the
    backward's working set, the loss, the pipeline's buffers) within 5%, and a pipeline
    stage's gradient buffers but one: torch's stage holds one per micro-batch, of which the
    step's peak sees as many as have arrived by then (the reconciliation counts them all)."""
    layout = Layout.parse(MATRIX[case][1])
    split = layout.tp if layout.sequence_parallel else 1
    boundary = REAL.hidden * REAL.seq_len * (4 if layout.precision == "fp32" else 2) / split
    arriving = (layout.microbatches - 1) * boundary if layout.pp > 1 else 0
    rows = [r for r in planner_beside(dryrun(REAL, MATRIX[case][1], workers=1))
            if r.what == "memory" and r.name == "activations"]
    assert rows and all(r.comparable for r in rows)
    off = {r.rank: (r.dry_run, round(r.explained), r.difference) for r in rows
           if abs(r.explained - r.dry_run) > 0.05 * r.dry_run + arriving}
    assert not off


# Llama 3 405B on 16,384 GPUs in its published layout (tp8 pp16 dp128, 16 micro-batches:
# Dubey et al. 2024, Table 4 row 2; ZeRO-2 as FSDP that keeps its parameters gathered, its
# gradients accumulated and reduce-scattered in fp32, section 3.3.2, read as reduced every
# micro-batch into fp32 shards: reduce_once=0), its first, second and last stage; and the
# planner's first choice (layout None: searched), counting meshlab's code, for Llama 3 70B
# on 1,024, its two stages
PUBLISHED = {"llama3-405b": ("llama3-405b", "pp=16 dp=128 tp=8 zero=2 m=16 reduce_once=0",
                             16384),
             "llama3-70b pick": ("llama3-70b", None, 1024)}


def published_layout(case: str) -> tuple[str, str, list[int]]:
    model, layout, gpus = PUBLISHED[case]
    best = plan(model, gpus=gpus, top=1).best.layout if layout is None else Layout.parse(layout)
    # the first stage, the second (the busiest of 1F1B's: the most layers in flight) and the
    # last
    return model, layout or describe(best), sorted({0, best.stride("pp"),
                                                    (best.pp - 1) * best.stride("pp")})


def dry_run_published(case: str) -> DryRun:
    model, layout, ranks = published_layout(case)
    return dryrun(model, layout, ranks=ranks, hardware="h100-sxm", workers=1)


@pytest.mark.parametrize("case", list(PUBLISHED))
def test_published_layouts_agree_with_the_planner_on_every_category(case: str) -> None:
    dry = _beside.pop(case).result() if case in _beside else dry_run_published(case)
    rows = [r for r in planner_beside(dry) if r.what == "memory" and r.dry_run]
    assert {r.name for r in rows if r.comparable} >= {"params", "grads", "optimizer",
                                                        "activations", "buffers"}
    off = {(r.rank, r.name): (r.dry_run, round(r.explained), r.difference) for r in rows
           if r.comparable and abs(r.explained / r.dry_run - 1) > 0.05}
    assert not off
    first = {r.name: r.difference for r in rows if r.rank == 0}
    if PUBLISHED[case][1] is None:  # counted as meshlab's code holds it, it fits where it runs
        assert planner_estimate(dry).fits and all(r.fits for r in dry.ranks)
        assert "gathered inputs" not in first["activations"]
        assert "accumulates the stage's unsharded" not in first["buffers"]
        return
    # it trained on 80 GB H100s: both say it fits. meshlab's sequence parallelism re-gathers
    # its inputs as Megatron's does, its tp-split embedding's gradient is its rows, and its
    # stages reduce every micro-batch as Llama 3's FSDP did (ParallelPlan.
    # reduce_every_microbatch; torch's stage, accumulating them unsharded in fp32, held 79.8
    # GiB of 76 usable on the second stage): nothing is left to name
    assert planner_estimate(dry).fits
    assert all(r.fits for r in dry.ranks), {r.rank: r.fits for r in dry.ranks}
    assert "gathered inputs" not in first["activations"]
    assert "unsharded" not in first["buffers"]
    assert "whole vocabulary" not in first["buffers"]


def test_ranks_run_in_as_many_processes_as_finish_them_soonest() -> None:
    from meshlab.dry_run.run import processes_for

    # three probes on two CPUs: time-shared in three, one and a half rounds, not two
    assert [processes_for(jobs, 2) for jobs in range(1, 10)] == [1, 2, 3, 2, 2, 2, 2, 2, 3]
    assert processes_for(3, 1) == 1 and processes_for(16, 4) == 4  # even rounds: one a CPU


def test_each_pipeline_stage_is_a_rank_of_its_own() -> None:
    dry = run("pp_1f1b")
    assert [r.rank for r in dry.ranks] == [0, 32]  # the first rank of each stage
    assert [r.stages for r in dry.ranks] == [[0], [1]]
    assert "embedding" in dry.ranks[0].role and "output" in dry.ranks[1].role
    sends = {r.rank: {t.op: t.calls for t in r.collectives if t.axis == "pp"}
             for r in dry.ranks}
    assert sends[0]["send"] == sends[32]["send"] == 4  # one way each: 4 micro-batches


def test_an_uneven_split_adds_the_last_shard() -> None:
    odd = dataclasses.replace(TINY, vocab=1022)  # tp=4 splits it 256, 256, 255, 255
    assert list(representative_ranks(Layout.parse("pp=2 dp_shard=2 tp=4 m=2"), odd)) == [
        0, 7, 8, 15]
    # FSDP2 pads its shards to one size: no rank holds less
    assert list(representative_ranks(Layout.parse("pp=2 dp_shard=3 m=2"), TINY)) == [0, 3]
    # a model whose shape is not read: its last tp rank too, and no "every rank alike"
    roles = representative_ranks(Layout.parse("dp_shard=2 tp=2"), None)
    assert roles == {0: "every rank but the last of each tp group",
                     3: "the last rank of each tp group, its tp share may differ: the "
                        "model's shape is not read"}


def test_collectives_are_attributed_to_their_mesh_axis() -> None:
    axes = {(t.axis, t.op) for t in run("hsdp").ranks[0].collectives}
    assert axes == {("dp_replicate", "all_reduce"), ("dp_shard", "all_gather"),
                    ("dp_shard", "reduce_scatter")}
    assert {t.axis for t in run("cp").ranks[0].collectives} == {"cp", "dp_shard+cp"}
    assert {t.axis for t in run("ep").ranks[0].collectives} >= {"ep"}
    assert {t.op for t in run("cp_ulysses").ranks[0].collectives if t.axis == "cp"} == {
        "all_to_all"}


def test_the_context_parallel_implementation_and_its_chunks_map_to_the_plan() -> None:
    plan, _ = plan_for(Layout.parse("dp=4 cp=2 cp_impl=chunked cp_chunks=4 cp_offload=1"),
                       seq=64)
    assert (plan.context_parallel, plan.cp_chunks, plan.cp_offload) == ("chunked", 4, True)
    plan, notes = plan_for(Layout.parse("dp=4 cp=2 cp_impl=all_gather"), seq=64)
    assert plan.context_parallel == "meshlab" and any("all_gather" in n for n in notes)


def test_adamw8bit_under_fsdp_shards_is_refused_naming_zero1() -> None:
    with pytest.raises(ValueError, match="data_parallel='zero1'"):
        dryrun(TINY, "dp_shard=16 precision=fp32 optimizer=adamw8bit", workers=1)


def test_the_layout_maps_to_a_plan_and_names_what_it_cannot() -> None:
    plan, notes = plan_for(Layout.parse("pp=2 dp=4 zero=1 ac=full m=4 "
                                        "schedule=interleaved_1f1b v=2"), seq=64)
    assert (plan.data_parallel, plan.activation_checkpoint, plan.microbatches, plan.virtual,
            plan.pipeline_schedule, plan.mixed_precision) == ("zero1", "full", 4, 2,
                                                              "interleaved_1f1b", True)
    plan, notes = plan_for(Layout.parse("dp=4 zero=3 m=2 precision=fp8 shard_unit=weight"),
                           seq=64)
    assert (plan.grad_accum, plan.microbatches) == (2, 1)
    assert any("fp8" in n for n in notes) and any("shard_unit" in n for n in notes)
    plan, notes = plan_for(Layout.parse("dp=4 ep=4"), seq=64)
    assert plan.data_parallel == "none" and any("ep=4" in n for n in notes)
    # FSDP2's reduction every micro-batch is not meshlab's accumulation: it reduces once
    per_microbatch = Layout.parse("dp=4 zero=2 m=4 reduce_once=0")
    plan, notes = plan_for(per_microbatch, seq=64)
    assert plan.grad_accum == 4 and any("reduce_once=0" in n for n in notes)
    assert ran(per_microbatch).reduce_once and ran(Layout.parse("dp=4 m=4")) == Layout.parse(
        "dp=4 m=4")
    # under a pipeline it is the stages' own (ParallelPlan.reduce_every_microbatch), but
    # where a zero-bubble schedule splits the backward: torch's stage reduces once there
    each = Layout.parse("pp=2 dp=4 zero=2 m=4 reduce_once=0")
    plan, notes = plan_for(each, seq=64)
    assert plan.reduce_every_microbatch and not ran(each).reduce_once and not notes
    split = Layout.parse("pp=2 dp=4 zero=2 m=4 reduce_once=0 schedule=zb_h1")
    plan, notes = plan_for(split, seq=64)
    assert not plan.reduce_every_microbatch and ran(split).reduce_once
    assert any("zb_h1" in n and "reduce_once=1" in n for n in notes)


def test_a_dry_run_travels_as_plain_data() -> None:
    dry = run("zero3")
    assert pickle.loads(pickle.dumps(dry)) == dry
    assert dry.world_size == 128 and dry.family == "meshlab" and dry.batch == 1


def test_a_model_that_does_not_fit_says_so() -> None:
    small = dataclasses.replace(HARDWARE["h100-sxm"], memory_gib=0.01, reserved_gib=0.0)
    dry = dryrun(TINY, "dp_shard=4 precision=fp32", hardware=small, workers=1)
    assert dry.ranks[0].fits is False
    assert any("does not fit" in n and "0.01 GiB" in n for n in dry.notes)


def test_a_layout_whose_product_is_not_the_world_size_gets_the_mesh_error() -> None:
    with pytest.raises(ValueError, match=r"= 8, but the cluster has 6 ranks"):
        dryrun(TINY, "dp_shard=4 tp=2", world_size=6, workers=1)


@pytest.fixture
def real_group(tmp_path: Any) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_real_process_group_is_refused(real_group: None) -> None:
    with pytest.raises(ValueError, match="destroy_process_group"):
        dryrun(TINY, "dp_shard=4", workers=1)


def test_the_rank_side_imports_no_notebook_packages() -> None:
    code = ("import sys, meshlab.dry_run.run, meshlab.dry_run.step, meshlab.dry_run.fake_world, "
            "meshlab.dry_run.fake_peers; "
            "print([m for m in ('IPython', 'ipyparallel', 'pandas', 'altair') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


NO_PP_PLAN = ("GPT-2", "GPT in a cell")  # families with no pipeline split (refused)
MOE_ROUND_FOUR = ["DeepSeek-V3", "Qwen2-MoE", "GPT-OSS", "Jamba", "Llama4"]
MOE_FAMILIES = {"Mixtral", "Qwen3-MoE", "OLMoE", *MOE_ROUND_FOUR}


def dry_run_families() -> dict[str, DryRun | tuple[BaseException, str]]:
    """Each family of the model matrix dry-run, in its order: its DryRun, or what it raised
    and where (the exception as it is where it pickles, else as text)."""
    from tests.rank.families import FAMILIES_SOURCE, ROUND_THREE

    namespace: dict[str, Any] = {}
    exec(FAMILIES_SOURCE, namespace)
    runs: dict[str, DryRun | tuple[BaseException, str]] = {}
    for name in ROUND_THREE + MOE_ROUND_FOUR:
        factory = namespace["FAMILIES"][name]
        plan = None
        if name in NO_PP_PLAN:
            layout = "dp_shard=16 tp=2"
            if name == "GPT in a cell":
                plan = plan_for(Layout.parse(layout + " sp=0"), seq=16)[0]
                plan.tp_plan = namespace["CELL_TP_PLAN"]
        elif name in MOE_FAMILIES:  # experts on their own axis beside tp and a pipeline
            layout = "pp=2 dp_shard=8 tp=2 ep=2 m=2"
        else:
            layout = "pp=2 dp_shard=8 tp=2 m=2"
        try:
            runs[name] = dryrun(factory, layout, seq=16, workers=1, plan=plan)
        except Exception as e:
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:
                e = RuntimeError(f"{type(e).__name__}: {e}")
            runs[name] = (e, traceback.format_exc())
    return runs


def _raise(outcome: DryRun | tuple[BaseException, str]) -> DryRun:
    if isinstance(outcome, tuple):
        raise outcome[0]
    return outcome


def test_every_family_of_the_model_matrix_dry_runs_or_is_refused_naming_why() -> None:
    beside = _beside.get("families")
    runs = beside.result() if beside is not None else dry_run_families()
    for name, outcome in runs.items():
        if name == "Llama4":  # no EP plan in its config
            with pytest.raises(ValueError, match=r"expert parallel \(ep=2\) .* not yet to "
                                                 "Llama4ForCausalLM: build the mesh without ep"):
                _raise(outcome)
            continue
        if isinstance(outcome, tuple):
            outcome[0].add_note(f"dry-running the family {name}:\n{outcome[1]}")
        run = _raise(outcome)
        stages = 1 if name in NO_PP_PLAN else 2
        # a model whose shape is not read (the GPT in a cell): its last tp rank runs too
        assert len(run.ranks) == stages * (2 if run.shape is None else 1), name
        for rank in run.ranks:
            assert rank.memory["total"] > 0 and rank.params > 0, (name, rank)
            assert any(t.axis == "tp" for t in rank.collectives), (name, rank.collectives)
            if name in MOE_FAMILIES:
                assert any(t.axis == "ep" and t.op == "all_to_all" for t in rank.collectives), \
                    (name, rank.collectives)


def test_a_pipeline_without_micro_batches_gets_the_fewest_it_runs_and_says_so() -> None:
    run = dryrun(TINY, "pp=2 dp_shard=2", workers=1)
    assert "microbatches=2" in run.planned, run.planned
    assert any(note.startswith("m not given: m=2") for note in run.notes), run.notes


@pytest.mark.parametrize("shape, layout", [
    (TINY, "pp=2 dp_shard=8 tp=2 schedule=interleaved_1f1b v=2 m=6"),
    (MOE, "pp=2 dp_shard=8 ep=4 zero=2 schedule=gpipe m=5"),
    (dataclasses.replace(TINY, layers=8), "pp=8 dp_shard=2 m=9 precision=fp32"),
], ids=["interleaved-tp-bf16", "ep-gpipe", "1f1b-from-gpipe-shared"])
def test_a_composed_pipeline_step_is_the_whole_step(shape: ModelShape, layout: str) -> None:
    """A pipeline rank runs four micro-batches and composes the schedule's m from them
    (meshlab.dry_run.compose): every byte of every category, peak and axis as when it runs
    all m (a second micro-batch's backward, the first to add into gradients, differs from
    the rest: three were not enough). 1F1B takes no fewer micro-batches than pp ranks: its
    probe is GPipe's; and pp ranks 2-6 of 8, whose stages run the same program, are all
    composed from rank 1's probe."""
    composed = dryrun(shape, layout, workers=1)
    whole = dryrun(shape, layout, workers=1, compose=False)
    for a, b in zip(composed.ranks, whole.ranks, strict=True):
        assert (a.memory, a.peaks, a.raw) == (b.memory, b.peaks, b.raw), a.rank
        assert a.collectives == b.collectives, a.rank
    if "pp=8" in layout:
        assert sum("composed from rank 2's probe" in r.role for r in composed.ranks) == 5



def test_expert_parallel_keeps_one_copy_of_each_local_expert_however_many_ranks_send() -> None:
    """Autocast keeps a 16-bit copy of an expert's weights for each call's backward: each
    local expert runs once on the rows of every source rank, so two local experts hold the
    same activations whether two ranks send them tokens or four (one call per source kept
    four copies: 12.7 MB more here, 352 MiB a layer at Mixtral's widths)."""
    shape = dataclasses.replace(MOE, layers=2, ffn=1024)
    held = [dryrun(dataclasses.replace(shape, experts=2 * ep), f"dp_shard=4 ep={ep}",
                   ranks=[0], workers=1).ranks[0].peaks["activations"] for ep in (2, 4)]
    one_copy = 3 * shape.hidden * shape.ffn * 2
    assert abs(held[0] - held[1]) < one_copy / 8
