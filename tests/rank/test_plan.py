"""The planning model (meshlab.plan) against hand-computed cases and published numbers.

No cluster, no GPU: plain Python. Every expected value is worked out in the test (or the
comment above it) from the papers' formulas, never by calling the code under test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from meshlab import mesh
from meshlab.mesh import MeshSpec
from meshlab.plan import (
    HARDWARE,
    MODELS,
    Hardware,
    Layout,
    Link,
    ModelShape,
    check,
    estimate,
    hardware,
    load,
    model_shape,
    save,
    search,
)
from meshlab.plan.estimate import ADAMW_BYTES, DDP_BUCKET_BYTES, SIMULATED_ACTIONS, _pipeline
from meshlab.plan.formulas import (
    activation_bytes_per_layer,
    bus_factor,
    collective_seconds,
    ring_steps,
    training_flops_per_token,
    zero_bytes,
)
from meshlab.plan.search import candidates, parse_constraints
from meshlab.schedules import Costs, build

GB = 1e9  # the ZeRO paper's GB is decimal
GIB = 2**30

# A two-layer Llama-style model small enough to count by hand (the tour's meshlab model):
# head_dim = 64 / 4 = 16; K and V are 2 heads x 16 = 32 wide.
#   attention: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 4096 + 2048 + 2048 + 4096 = 12,288
#   SwiGLU:    3 x 64 x 128                                                     = 24,576
#   matmul weights per layer                                                    = 36,864
#   layer: 36,864 + two RMSNorms (2 x 64)                                       = 36,992
#   embedding + output (2 x 256 x 64) + final norm 64                           = 32,832
#   total: 2 x 36,992 + 32,832                                                  = 106,816
TINY = ModelShape(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                  seq_len=64)
TINY_PARAMS = 106_816
TINY_LAYER_MATMUL = 36_864
# The same layers, eight of them, for pipelines of up to 8 stages.
PIPE = dataclasses.replace(TINY, name="pipe", layers=8)

# Round numbers: 1 TFLOP/s bf16 peak at 50% -> 5e11 FLOP/s; 1 GB/s memory; NVLink-like
# 100 GB/s with 5 us hops inside a node of 8, 10 GB/s with 20 us hops between nodes.
TOY = Hardware(name="toy", tflops={"bf16": 1.0, "fp32": 0.5}, matmul_efficiency=0.5,
               memory_gib=1.0, reserved_gib=0.0, memory_bandwidth_gbs=1.0, gpus_per_node=8,
               intra=Link(bandwidth_gbs=100.0, latency_us=5.0),
               inter=Link(bandwidth_gbs=10.0, latency_us=20.0))
# Links so fast that a pipeline hop is ~1e-14 s: the schedules' textbook (free-hop) timing.
FREE_LINKS = dataclasses.replace(TOY, intra=Link(bandwidth_gbs=1e9, latency_us=0.0),
                                 inter=Link(bandwidth_gbs=1e9, latency_us=0.0))

# TOY with memory so fast that every GEMM of TINY is compute-bound (on TOY's 1 GB/s they
# are all memory-bound: reading their matrices takes longer than their math).
COMPUTE_BOUND = dataclasses.replace(TOY, memory_bandwidth_gbs=1e6)
# One micro-batch of TINY (1 sequence of 64 tokens) on one GPU of COMPUTE_BOUND, no
# recompute, flash attention (TOY has no tiles, waves or depth loss: every GEMM at 50%):
#   weight GEMMs per token and layer: forward 2 x 36,864, backward twice that -> 221,184
#   attention: forward 4 s q = 16,384, half of it computed (causal, fused), backward 2.5
#   times (five products to two: the fused kernel recomputes the scores) -> 3.5 x 8,192 =
#   28,672; output projection 6 x 256 x 64 = 98,304 per token
#   per micro-batch: 64 x (2 x (221,184 + 28,672) + 98,304) = 38,273,024 FLOPs at 5e11
#   eager elementwise traffic per token and layer (compute.memory_bound_bytes): two
#   RMSNorms 2 x 23 h = 2,944, RoPE 3 (q + kv) = 3 x 96 = 288, attention I/O 2q + 2kv = 192,
#   residuals 6 h = 384, SwiGLU 5 ffn = 640 -> 4,448 values; forward + backward (x3), 2
#   bytes, 64 tokens, 2 layers -> 3,416,064 bytes; the loss over fp32 logits 3 x 4 x 64 x 256
#   forward, twice that backward -> 589,824 bytes; both at 1e15 B/s
TINY_FLOPS_PER_TOKEN = 2 * (6 * 36_864 + 12 * 64 * 64) + 6 * 256 * 64
TINY_MICROBATCH_S = 38_273_024 / 5e11 + (3_416_064 + 589_824) / 1e15  # t_F + t_B


# -- formulas: ZeRO ----------------------------------------------------------------------


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_bytes_match_the_zero_paper_figure_1(stage: int, expected_gb: float) -> None:
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, Adam (K = 12), N_d = 64; the
    # figure gives three significant digits
    got = zero_bytes(int(7.5e9), dp=64, stage=stage)
    assert float(f"{got['total'] / GB:.3g}") == expected_gb


def test_zero_bytes_shard_one_more_state_per_stage() -> None:
    psi, n = 7_500_000_000, 64
    # stage 0: (2 + 2 + 12) x 7.5e9 = 120 GB
    assert zero_bytes(psi, dp=n, stage=0) == {"params": 15e9, "grads": 15e9,
                                              "optimizer": 90e9, "total": 120e9}
    # stage 1: 2Ψ + 2Ψ + 12Ψ/64 = 30 + 1.40625 = 31.40625 GB
    assert zero_bytes(psi, dp=n, stage=1) == {"params": 15e9, "grads": 15e9,
                                              "optimizer": 1.40625e9, "total": 31.40625e9}
    # stage 2: 2Ψ + (2 + 12)Ψ/64 = 15 + 1.640625 = 16.640625 GB
    assert zero_bytes(psi, dp=n, stage=2) == {"params": 15e9, "grads": 0.234375e9,
                                              "optimizer": 1.40625e9, "total": 16.640625e9}
    # stage 3: 16Ψ/64 = 1.875 GB
    assert zero_bytes(psi, dp=n, stage=3)["total"] == 1.875e9


def test_zero_bytes_take_the_precision_bytes() -> None:
    # fp32 training: 4 + 4 + 8 bytes per parameter; 10 parameters over 2 ranks at stage 3
    got = zero_bytes(10, dp=2, stage=3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert got == {"params": 20.0, "grads": 20.0, "optimizer": 40.0, "total": 80.0}


@pytest.mark.parametrize("kwargs, match", [
    ({"params": 10, "dp": 2, "stage": 4}, r"stage must be one of \(0, 1, 2, 3\), got 4"),
    ({"params": 10, "dp": 0, "stage": 1}, r"dp .* must be >= 1, got 0"),
    ({"params": -1, "dp": 2, "stage": 1}, r"params must be >= 0, got -1"),
])
def test_zero_bytes_reject_bad_input(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zero_bytes(**kwargs)


# -- formulas: activations (Korthikanti et al. 2022, Table 2) ------------------------------

# s = 4, b = 2, h = 8, a = 2, t = 2: s b h = 64 and the attention-score term 5 a s / h = 5.
SMALL = {"seq": 4, "batch": 2, "hidden": 8, "heads": 2}


@pytest.mark.parametrize("tp, sp, recompute, expected", [
    (1, False, "none", 64 * (34 + 5)),              # s b h (34 + 5 a s / h) = 2,496
    (1, True, "none", 64 * (34 + 5)),               # SP changes nothing without TP
    (2, False, "none", 64 * (10 + 24 / 2 + 5 / 2)),  # s b h (10 + 24/t + 5as/(ht)) = 1,568
    (2, True, "none", 64 / 2 * (34 + 5)),           # s b h / t (34 + 5 a s / h) = 1,248
    (1, False, "selective", 64 * 34),               # the 5as/h term recomputed: 2,176
    (2, False, "selective", 64 * (10 + 24 / 2)),    # 1,408
    (2, True, "selective", 64 / 2 * 34),            # 1,088
    (1, False, "full", 2 * 64),                     # only the layer input, 2 s b h: 128
    (2, False, "full", 2 * 64),                     # replicated input: still 128
    (2, True, "full", 2 * 64 / 2),                  # sequence-sharded input: 64
])
def test_activation_bytes_per_layer_follow_korthikanti_table_2(
        tp: int, sp: bool, recompute: str, expected: float) -> None:
    got = activation_bytes_per_layer(**SMALL, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    ({"recompute": "some"}, r"recompute must be one of .*got 'some'"),
    ({"tp": 0}, r"tp .* must be >= 1, got 0"),
    ({"seq": 0}, r"seq must be >= 1, got 0"),
])
def test_activation_bytes_reject_bad_input(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        activation_bytes_per_layer(**{**SMALL, **kwargs})


# -- formulas: FLOPs (PaLM appendix B) ---------------------------------------------------


@pytest.mark.parametrize("recompute, extra", [
    ("none", 0),
    ("selective", 4 * 2 * 4 * 8),            # the attention core again: 4 L H Q T = 256
    ("full", 2 * 100 + 4 * 2 * 4 * 8),       # the whole forward again: 2N + 4 L H Q T = 456
])
def test_training_flops_are_6n_plus_attention_and_recompute_adds_hardware_flops(
        recompute: str, extra: int) -> None:
    # N = 100, L = 2, H Q = 4, T = 8: 6N + 12 L H Q T = 600 + 768 = 1,368
    model, hardware_flops = training_flops_per_token(
        matmul_params=100, layers=2, seq=8, attn_width=4, recompute=recompute)
    assert model == 1368
    assert hardware_flops == 1368 + extra


def test_training_flops_reject_an_unknown_recompute() -> None:
    with pytest.raises(ValueError, match=r"recompute must be one of .*got 'half'"):
        training_flops_per_token(matmul_params=1, layers=1, seq=1, attn_width=1,
                                 recompute="half")


# -- formulas: ring collectives --------------------------------------------------------------


@pytest.mark.parametrize("collective, steps, factor", [
    ("all_reduce", 14, 14 / 8),       # reduce-scatter then all-gather: 2(n-1) hops, 2(n-1)/n
    ("all_gather", 7, 7 / 8),         # (n-1) hops, (n-1)/n of the full buffer
    ("reduce_scatter", 7, 7 / 8),
    ("all_to_all", 7, 7 / 8),
    ("send_recv", 1, 1.0),            # one hop, the whole buffer
])
def test_ring_steps_and_bus_factor_on_8_ranks(collective: str, steps: int,
                                              factor: float) -> None:
    assert ring_steps(collective, 8) == steps
    assert bus_factor(collective, 8) == factor


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter",
                                        "all_to_all"])
def test_a_collective_among_one_rank_is_free(collective: str) -> None:
    assert ring_steps(collective, 1) == 0
    assert bus_factor(collective, 1) == 0.0
    assert collective_seconds(collective, 1, 1e9, latency_s=1.0, bandwidth_bytes_s=1.0) == 0.0


def test_a_send_recv_costs_one_hop_whatever_n() -> None:
    assert ring_steps("send_recv", 1) == 1
    # 5 us + 1e9 B / 1e11 B/s = 0.010005 s
    assert collective_seconds("send_recv", 1, 1e9, latency_s=5e-6,
                              bandwidth_bytes_s=1e11) == pytest.approx(0.010005, rel=1e-12)


@pytest.mark.parametrize("collective, n, nbytes, expected", [
    ("all_reduce", 4, 1e9, 6 * 5e-6 + 2 * 3 / 4 * 1e9 / 1e11),   # 0.01503 s
    ("all_gather", 8, 8e8, 7 * 5e-6 + 7 / 8 * 8e8 / 1e11),       # 0.007035 s
    ("reduce_scatter", 2, 4e8, 1 * 5e-6 + 1 / 2 * 4e8 / 1e11),   # 0.002005 s
    ("all_to_all", 4, 4e8, 3 * 5e-6 + 3 / 4 * 4e8 / 1e11),       # 0.003015 s
])
def test_collective_seconds_is_alpha_beta_of_the_ring(collective: str, n: int, nbytes: float,
                                                      expected: float) -> None:
    got = collective_seconds(collective, n, nbytes, latency_s=5e-6, bandwidth_bytes_s=1e11)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [1, 4])
def test_an_unknown_collective_raises_for_any_group_size(n: int) -> None:
    with pytest.raises(ValueError, match=r"collective must be one of .*got 'broadcast'"):
        collective_seconds("broadcast", n, 1.0, latency_s=0.0, bandwidth_bytes_s=1.0)
    with pytest.raises(ValueError, match=r"got 'broadcast'"):
        bus_factor("broadcast", n)


# -- shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, hand_count, public", [
    # 32 x (q,o 2x4096^2 + k,v 2x4096x1024 + SwiGLU 3x4096x14336 + norms) + 2 x vocab x 4096
    # + final norm = 8,030,261,248; Meta: 8.03B
    ("llama3-8b", 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
     + 2 * 128256 * 4096 + 4096, 8.03e9),
    # 80 x (2x8192^2 + 2x8192x1024 + 3x8192x28672 + 2x8192) + 2x128256x8192 + 8192
    # = 70,553,706,496; Meta: 70.6B
    ("llama3-70b", 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)
     + 2 * 128256 * 8192 + 8192, 70.6e9),
    # 126 x (2x16384^2 + 2x16384x1024 + 3x16384x53248 + 2x16384) + 2x128256x16384 + 16384
    # = 405,853,388,800; Meta: 405.9B (405B)
    ("llama3-405b", 126 * (2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384)
     + 2 * 128256 * 16384 + 16384, 405.9e9),
    # 96 x (4 x 12288^2 + GELU MLP 2 x 12288 x 49152 + norms) + one tied 50257 x 12288 table
    # + 2048 x 12288 learned positions + final norm = 174,591,270,912 (biases not counted)
    ("gpt3-175b", 96 * (4 * 12288**2 + 2 * 12288 * 49152 + 2 * 12288) + 50257 * 12288
     + 2048 * 12288 + 12288, 174.6e9),
])
def test_preset_parameter_counts_match_the_public_numbers(name: str, hand_count: int,
                                                          public: float) -> None:
    shape = MODELS[name]
    assert shape.params == hand_count
    assert shape.params == pytest.approx(public, rel=0.005)


def test_tiny_shape_counts_by_hand() -> None:
    assert TINY.attention_params == 12_288
    assert TINY.expert_params == TINY.ffn_params == 24_576
    assert TINY.layer_params == 36_992
    assert TINY.embedding_params == 32_832
    assert TINY.params == TINY_PARAMS
    # FLOPs count the output projection but not the embedding lookup: 2 x 36,864 + 16,384
    assert TINY.active_matmul_params == 2 * TINY_LAYER_MATMUL + 256 * 64


@pytest.mark.parametrize("config", [{}, {"n_experts": 4, "top_k": 2}],
                         ids=["dense", "moe"])
def test_shape_from_config_counts_the_torch_model(config: dict[str, int]) -> None:
    from meshlab.models import ModelConfig, Transformer

    cfg = ModelConfig(**config)
    model = Transformer(cfg)
    # the real model does not tie its output projection to the embedding
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    shape = ModelShape.from_config(cfg)
    assert not shape.tied_embeddings
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.seq_len == cfg.max_seq_len
    assert model_shape(cfg) == shape


def test_the_meshlab_preset_is_the_default_config() -> None:
    from meshlab.models import ModelConfig

    assert MODELS["meshlab"].params == ModelShape.from_config(ModelConfig()).params
    assert MODELS["meshlab"].params == TINY_PARAMS


@pytest.mark.parametrize("kwargs, match", [
    ({"heads": 3}, r"heads=3 must divide hidden=64"),
    ({"kv_heads": 3}, r"kv_heads=3 must divide heads=4"),
    ({"layers": 0}, r"layers must be >= 1"),
    ({"experts": 4, "top_k": 5}, r"top_k=5 must be in 1..4"),
])
def test_a_shape_that_cannot_exist_raises(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **kwargs)


def test_model_shape_finds_presets_in_any_case_and_names_the_choices() -> None:
    assert model_shape(" Llama3-8B ") is MODELS["llama3-8b"]
    assert model_shape(TINY) is TINY
    with pytest.raises(ValueError, match=r"unknown model 'llama9'.*llama3-8b.*ModelShape"):
        model_shape("llama9")


# -- layout ----------------------------------------------------------------------------------


def test_layout_parse_takes_the_aliases() -> None:
    lay = Layout.parse("pp=2 dp=4 tp=2 zero=1 mbs=2 m=8 ac=full sp=0 v=2 "
                       "schedule=interleaved_1f1b")
    assert lay == Layout(pp=2, dp_shard=4, tp=2, zero=1, micro_batch=2, microbatches=8,
                         recompute="full", sequence_parallel=False, virtual=2,
                         schedule="interleaved_1f1b")
    assert Layout.parse("tp=2,dp=4", precision="fp32") == Layout(tp=2, dp_shard=4,
                                                                  precision="fp32")
    assert Layout.parse("sp=on").sequence_parallel
    assert not Layout.parse("sp=false").sequence_parallel


def test_layout_describe_shows_degrees_above_one_and_the_choices() -> None:
    lay = Layout.parse("pp=2 dp=4 tp=2 zero=1 mbs=2 m=8 ac=full sp=0 v=2 "
                       "schedule=interleaved_1f1b")
    assert lay.describe() == ("pp=2 dp_shard=4 tp=2 zero=1 interleaved_1f1b/v2 mbs=2 m=8 "
                              "ac=full sp=0")
    assert Layout().describe() == "zero=3 mbs=1 m=1"
    assert Layout(pp=4, dp_shard=8, tp=8, zero=1, microbatches=16).describe() == (
        "pp=4 dp_shard=8 tp=8 zero=1 1f1b mbs=1 m=16")


def test_layout_sizes_and_strides() -> None:
    lay = Layout(pp=2, dp_replicate=3, dp_shard=4, cp=5, tp=6, micro_batch=2, microbatches=7)
    assert lay.gpus == 2 * 3 * 4 * 5 * 6 == 720
    assert lay.dp == 3 * 4  # replicas x shards see different sequences; cp ranks do not
    assert lay.shard_group == 4 * 5  # ZeRO shards over dp_shard x cp
    assert lay.global_batch == 2 * 7 * 12 == 168
    # mesh order pp, dp_replicate, dp_shard, cp, tp (outermost first): each axis's stride is
    # the product of the axes inside it
    assert [lay.stride(a) for a in ("tp", "cp", "dp_shard", "dp_replicate", "pp")] == [
        1, 6, 6 * 5, 6 * 5 * 4, 6 * 5 * 4 * 3]


@pytest.mark.parametrize("text, match", [
    ("tp", r"layout 'tp': write NAME=VALUE with NAME one of pp, .*, dp, mbs"),
    ("colour=2", r"layout 'colour=2': write NAME=VALUE"),
    ("tp=two", r"layout 'tp=two': tp takes a whole number"),
    ("tp=2.0", r"tp takes a whole number"),
    ("sp=maybe", r"layout 'sp=maybe': sequence_parallel takes 1/0, true/false"),
    ("tp=0", r"tp must be >= 1, got 0"),
    ("zero=4", r"zero must be one of \(0, 1, 2, 3\), got 4"),
    ("ac=some", r"recompute must be one of none, selective, full, op, got 'some'"),
    ("precision=fp4", r"precision must be one of fp32, bf16, fp8, fp16, got 'fp4'"),
    ("schedule=pipedream", r"schedule must be one of gpipe, 1f1b, .*got 'pipedream'"),
    ("ep=3 dp=4", r"ep=3 must divide dp_shard x cp = 4"),
    ("dp=2 tp=2 dp_shard=4", r"layout 'dp_shard=4': dp_shard given twice in .*keep one"),
])
def test_bad_layouts_raise_naming_the_problem(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Layout.parse(text)


# (mesh text, refused?) worked out from meshlab.mesh's rules: degrees are whole numbers >= 1,
# each named once; ep divides dp_shard x cp and is a multiple of cp
MESH_TEXTS = [
    ("dp=2 tp=2", False),
    ("pp=2 dp_replicate=2 dp_shard=2 cp=2 tp=2", False),
    ("dp_shard=2 cp=2 ep=2", False),  # ep = all of cp
    ("dp_shard=4 cp=2 ep=4", False),  # ep = 2 dp_shard ranks x cp
    ("dp_shard=3 cp=2 ep=3", True),  # 3 divides 6 but is no multiple of cp=2
    ("dp_shard=4 cp=4 ep=2", True),  # ep smaller than cp
    ("cp=2 ep=4", True),  # 4 does not divide dp_shard x cp = 2
    ("ep=3 dp=4", True),
    ("tp=0", True),
    ("tp=2.0", True),
    ("dp=2 dp_shard=2", True),  # one axis given twice (dp means dp_shard)
]


@pytest.mark.parametrize("text, refused", MESH_TEXTS)
def test_the_planner_refuses_exactly_the_meshes_meshlab_mesh_refuses(text: str,
                                                                      refused: bool) -> None:
    def refuses(parse: Any) -> bool:
        try:
            parse(text)
        except ValueError:
            return True
        return False

    assert refuses(MeshSpec.parse) == refused
    assert refuses(Layout.parse) == refused


@pytest.mark.parametrize("degrees", [{"dp_shard": 3, "cp": 2, "ep": 3},
                                     {"dp_shard": 4, "cp": 4, "ep": 2}, {"cp": 2, "ep": 4}])
def test_a_layout_refused_for_its_mesh_gives_the_mesh_s_own_reason(
        degrees: dict[str, int]) -> None:
    with pytest.raises(ValueError) as by_mesh:
        MeshSpec(**degrees)
    with pytest.raises(ValueError) as by_planner:
        Layout(**degrees, zero=1)
    assert str(by_planner.value) == str(by_mesh.value)
    assert f"ep={degrees['ep']} must divide dp_shard x cp" in str(by_planner.value)


def test_a_layout_s_mesh_spec_is_the_mesh_of_its_degrees() -> None:
    lay = Layout.parse("pp=2 dp=4 tp=2 ep=2 zero=1 mbs=2 m=8")
    assert lay.mesh_spec == MeshSpec(pp=2, dp_shard=4, tp=2, ep=2)
    assert lay.gpus == lay.mesh_spec.size == 2 * 4 * 2


def test_layout_degrees_order_and_aliases_come_from_the_mesh() -> None:
    # the degree fields are the mesh's options, in the mesh's order
    names = [f.name for f in dataclasses.fields(Layout)]
    assert names[:len(mesh.OPTIONS)] == list(mesh.OPTIONS)
    for alias, axis in mesh.ALIASES.items():  # dp means dp_shard, as in %mesh init
        assert Layout.parse(f"{alias}=2") == Layout(**{axis: 2})
    # stride: the rank distance between neighbours along an axis, as meshlab.mesh numbers
    # the ranks (rank 0 and the rank one step along that axis only)
    lay = Layout(pp=2, dp_replicate=2, dp_shard=3, cp=2, tp=2)
    coords = mesh.coordinates(lay.mesh_spec)
    for axis in mesh.AXES:
        step = {a: int(a == axis) for a in mesh.AXES}
        assert coords[lay.stride(axis)] == step, axis


def test_stride_names_the_mesh_axes_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match=r"unknown mesh axis 'ep': ask for one of pp, "
                                         r"dp_replicate, dp_shard, cp, tp"):
        Layout().stride("ep")


@pytest.mark.parametrize("model, layout, match", [
    (MODELS["llama3-8b"], Layout(tp=16), r"tp=16 must divide kv_heads=8 of llama3-8b"),
    (MODELS["llama3-8b"], Layout(tp=3), r"tp=3 must divide heads=32"),
    (TINY, Layout(pp=2, virtual=2, schedule="interleaved_1f1b"),
     r"pp=2 x 2 stages per rank = 4 stages, but tiny has 2 layers"),
    (PIPE, Layout(pp=8, schedule="zbv"), r"pp=8 x 2 stages per rank = 16 stages"),
    (PIPE, Layout(pp=2, schedule="zbv", virtual=3), r"zbv places 2 stages per rank"),
    # as meshlab.schedules.build: a schedule without virtual stages does not take virtual=2
    (PIPE, Layout(pp=2, virtual=2), r"1f1b places 1 stage per rank, so virtual=2 does not "
                                    r"apply: leave virtual=1, or use interleaved_1f1b or "
                                    r"looped_bfs"),
    (TINY, Layout(cp=3), r"cp=3: the sequence \(64\) must split into 2 x cp = 6 chunks"),
    (TINY, Layout(dp_shard=2, ep=2), r"ep=2 must divide the experts \(0\) of tiny"),
    (TINY, Layout(schedule="gpipe"), r"a schedule and virtual stages need pp > 1"),
])
def test_check_names_what_the_model_cannot_take(model: ModelShape, layout: Layout,
                                                match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check(model, layout)
    with pytest.raises(ValueError, match=match):
        estimate(model, layout, TOY)


def test_v_shaped_schedules_hold_two_stages_per_rank() -> None:
    assert Layout(pp=2, schedule="zbv").stages_per_rank == 2
    assert Layout(pp=2, schedule="dualpipev", virtual=2).stages_per_rank == 2
    assert Layout(pp=2, schedule="interleaved_1f1b", virtual=4).stages_per_rank == 4
    # virtual=1 (the default) and virtual=2 are the same zbv layout to the estimate
    one = estimate(PIPE, Layout(pp=2, microbatches=8, schedule="zbv"), TOY)
    two = estimate(PIPE, Layout(pp=2, microbatches=8, schedule="zbv", virtual=2), TOY)
    assert one.memory == two.memory and one.step_s == two.step_s


# -- hardware --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_presets_are_valid_and_round_trip_through_toml(name: str,
                                                                tmp_path: Path) -> None:
    hw = HARDWARE[name]
    assert hw.name == name and hw.gpus_per_node >= 1 and hw.usable_bytes > 0
    assert hw.usable_bytes == (hw.memory_gib - hw.reserved_gib) * GIB
    assert hw.flops_per_s("bf16") == hw.tflops["bf16"] * 1e12 * hw.matmul_efficiency
    assert load(save(hw, tmp_path / f"{name}.toml")) == hw


def test_a_measured_profile_round_trips_with_its_collectives(tmp_path: Path) -> None:
    hw = dataclasses.replace(TOY, name='lab "A"', layer_overhead_us=150.0, asynchronous=False,
                             collectives={"all_reduce": Link(bandwidth_gbs=80.5, latency_us=7.0),
                                          "all_to_all": Link(bandwidth_gbs=20.0,
                                                             latency_us=9.5)})
    path = save(hw, tmp_path / "lab.toml")
    assert load(path) == hw
    assert hardware(path) == hw and hardware(str(path)) == hw


def test_hardware_names_are_normalised() -> None:
    assert hardware("H100_SXM") is HARDWARE["h100-sxm"]
    assert hardware(" A100-80GB ") is HARDWARE["a100-80gb"]
    assert hardware(TOY) is TOY
    with pytest.raises(ValueError, match=r"unknown hardware 'tpu-v9': choose one of .*h100-sxm"
                                         r".*\.toml"):
        hardware("tpu-v9")


@pytest.mark.parametrize("text, match", [
    ('colour = "red"\n', r"unknown keys \['colour'\]; a profile has"),
    ("name = \n", r"not valid TOML"),
    ('name = "x"\nmemory_gib = 1.0\n', r"incomplete profile"),
])
def test_load_rejects_bad_profiles_with_a_clear_message(text: str, match: str,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load(path)
    assert str(path) in str(info.value)


def test_load_and_hardware_report_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    with pytest.raises(ValueError, match=r"no hardware profile at .*nowhere\.toml"):
        load(missing)
    with pytest.raises(ValueError, match=r"no hardware profile at"):
        hardware(str(missing))


@pytest.mark.parametrize("change, match", [
    ({"tflops": {"fp16": 1.0}}, r"tflops takes fp32, tf32, bf16, fp8, got \['fp16'\]"),
    ({"matmul_efficiency": 1.5}, r"matmul_efficiency must be in \(0, 1\]"),
    ({"gpus_per_node": 0}, r"gpus_per_node, memory_gib, memory_bandwidth_gbs, .* must be"),
    ({"pcie_gbs": 0}, r"host_memory_bandwidth_gbs and pcie_gbs must be positive"),
    ({"collectives": {"broadcast": Link(bandwidth_gbs=1, latency_us=1)}},
     r"unknown collectives \['broadcast'\]"),
])
def test_an_impossible_hardware_raises(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TOY, **change)
    with pytest.raises(ValueError, match=r"bandwidth_gbs > 0"):
        Link(bandwidth_gbs=0, latency_us=1)


def test_flops_per_s_names_a_missing_dtype() -> None:
    with pytest.raises(ValueError, match=r"a100-80gb has no fp8 peak .*choose another"):
        HARDWARE["a100-80gb"].flops_per_s("fp8")


def test_link_uses_a_measured_collective_inside_a_node_only() -> None:
    measured = Link(bandwidth_gbs=300.0, latency_us=2.0)
    hw = dataclasses.replace(TOY, collectives={"all_reduce": measured})
    assert hw.link("all_reduce", inter_node=False) is measured
    assert hw.link("all_reduce", inter_node=True) is hw.inter
    assert hw.link("all_gather", inter_node=False) is hw.intra


# -- estimate: one GPU, by hand --------------------------------------------------------------


def test_one_gpu_step_is_the_microbatches_one_after_another() -> None:
    e = estimate(TINY, Layout(zero=0, microbatches=4), COMPUTE_BOUND)
    assert e.compute_s == pytest.approx(4 * TINY_MICROBATCH_S, rel=1e-12)
    assert e.pipeline_s == pytest.approx(4 * TINY_MICROBATCH_S, rel=1e-12)
    assert e.bubble_fraction == 0.0 and e.exposed_comm_s == 0.0 and e.collectives == []
    # AdamW streams ADAMW_BYTES per parameter at 1e15 B/s
    assert e.optimizer_s == pytest.approx(TINY_PARAMS * ADAMW_BYTES / 1e15, rel=1e-12)
    assert e.step_s == pytest.approx(e.pipeline_s + e.optimizer_s, rel=1e-12)


def test_one_gpu_memory_by_hand() -> None:
    m = estimate(TINY, Layout(zero=0, microbatches=4), TOY).memory
    # ZeRO-0, bf16: 2 + 2 + 12 bytes for each of the 106,816 parameters
    assert m["params"] == 2 * TINY_PARAMS == 213_632
    assert m["grads"] == 2 * TINY_PARAMS
    assert m["optimizer"] == 12 * TINY_PARAMS == 1_281_792
    # a layer keeps (bytes a token) its norms' inputs 4h, the QKV input 2h, Q, K, V 2q + 4kv,
    # the attention output 2q, the MLP input 2h and SwiGLU's gate, up and product 6 ffn:
    # 256 + 128 + 128 + 128 + 128 + 128 + 768 = 1,664 (flash: no scores, no dropout) ->
    # 106,496 x 2 layers, plus fp32 logits and their gradient, 2 x 4 x 64 tokens x 256
    assert m["activations"] == 1664 * 64 * 2 + 2 * 4 * 64 * 256 == 344_064
    assert m["buffers"] == 2 * DDP_BUCKET_BYTES  # two 25 MiB DDP buckets
    assert m["total"] == pytest.approx(213_632 * 2 + 1_281_792 + 344_064 + 2 * 25 * 2**20)


def test_zero_3_shards_every_state_over_the_data_ranks() -> None:
    m = estimate(TINY, Layout(dp_shard=4, zero=3), TOY).memory
    assert (m["params"], m["grads"], m["optimizer"]) == (
        2 * TINY_PARAMS / 4, 2 * TINY_PARAMS / 4, 12 * TINY_PARAMS / 4)  # 53,408 / 320,448
    # FSDP: one layer gathered and the next prefetched (2 x 2 bytes), its grads (2 bytes)
    assert m["buffers"] == 36_992 * (2 * 2 + 2)


def test_fp32_and_full_recompute_activations_by_hand() -> None:
    bf16 = estimate(TINY, Layout(recompute="full"), TOY).memory["activations"]
    fp32 = estimate(TINY, Layout(recompute="full", precision="fp32"), TOY).memory
    # full recompute keeps each layer's input, 2 s b h = 8,192 bytes in 16 bits, plus the
    # 106,496 bytes of the one layer being recomputed, plus 131,072 of logits
    assert bf16 == 2 * 8192 + 106_496 + 131_072
    # fp32 doubles both activation terms (the logits are fp32 already)
    assert fp32["activations"] == 2 * (2 * 8192 + 106_496) + 131_072
    assert fp32["params"] == 4 * TINY_PARAMS and fp32["optimizer"] == 8 * TINY_PARAMS


def test_an_moe_layer_keeps_its_routed_copies_beside_a_dense_mlp_top_k_as_wide() -> None:
    """Each token's copy for each of its 2 experts and each expert's output the gate
    multiplies: 2 x 2 x 64 x 64 tokens x 2 bytes = 32,768 a layer, the one layer of two
    that is MoE half of it on average; none under full recomputation. meshlab's MoE keeps
    exactly these (tests/rank/test_models.py)."""
    from meshlab.plan.memory import layer_bytes, moe_routed_bytes
    from meshlab.plan.stage import Stage

    moe = dataclasses.replace(TINY, experts=4, top_k=2)
    dense = dataclasses.replace(TINY, ffn=2 * TINY.ffn)  # as wide as top_k experts
    for shape, share in ((moe, 1.0), (dataclasses.replace(moe, dense_layers=1), 0.5)):
        for recompute, kept in (("none", 2 * 2 * 64 * 64 * 2), ("full", 0)):
            lay = Layout(recompute=recompute)
            stage, plain = Stage(shape, lay, TOY), Stage(dense, lay, TOY)
            assert moe_routed_bytes(stage, recompute) == share * kept
            assert layer_bytes(stage, recompute) - layer_bytes(plain, recompute) == \
                share * kept


def test_host_overhead_hides_on_an_asynchronous_device_only() -> None:
    # 1 s of host time per layer: 2 s per micro-batch, far above the ~2 ms of device work
    slow_host = dataclasses.replace(COMPUTE_BOUND, layer_overhead_us=1e6)
    hidden = estimate(TINY, Layout(zero=0, microbatches=2), slow_host)
    assert hidden.pipeline_s == pytest.approx(2 * 2.0, rel=1e-12)
    serial = estimate(TINY, Layout(zero=0, microbatches=2),
                      dataclasses.replace(slow_host, asynchronous=False))
    assert serial.pipeline_s == pytest.approx(2 * (2.0 + TINY_MICROBATCH_S), rel=1e-12)


@pytest.mark.parametrize("layout, seconds_per_layer", [
    (Layout(dp_shard=4, zero=1, microbatches=2), 1.0),  # DDP + sharded optimizer: plain
    (Layout(dp_shard=4, zero=2, microbatches=2), 1.0 + 2.0),  # FSDP2
    (Layout(dp_shard=4, zero=3, microbatches=2), 1.0 + 2.0),
    (Layout(tp=2, zero=0, microbatches=2), 1.0 + 4.0),  # DTensor
    (Layout(tp=2, dp_shard=2, zero=3, microbatches=2), 1.0 + 2.0 + 4.0),
])
def test_fsdp_and_tp_host_costs_apply_to_their_own_layouts(layout: Layout,
                                                            seconds_per_layer: float) -> None:
    # host time far above the device's: each micro-batch costs 2 layers x the host time
    hw = dataclasses.replace(TOY, layer_overhead_us=1e6, fsdp_overhead_us=2e6,
                             tp_overhead_us=4e6)
    e = estimate(TINY, layout, hw)
    critical = sum(c.seconds for c in e.collectives if c.axis == "tp")  # in the layer
    assert e.pipeline_s - critical == pytest.approx(2 * 2 * seconds_per_layer, rel=1e-9)


def test_negative_host_costs_are_rejected() -> None:
    with pytest.raises(ValueError, match="host overheads cannot be negative"):
        dataclasses.replace(TOY, tp_overhead_us=-1.0)


def test_flops_mfu_and_training_time_definitions() -> None:
    e = estimate(TINY, Layout(dp_shard=4, zero=0, microbatches=4), TOY)
    tokens = 4 * 4 * 64  # microbatches x dp x seq
    assert e.tokens_per_step == tokens
    assert e.model_flops == TINY_FLOPS_PER_TOKEN * tokens == 638_976 * 1024
    assert e.hardware_flops == e.model_flops
    assert e.tokens_per_s == tokens / e.step_s
    assert e.tflops_per_gpu == pytest.approx(e.model_flops / e.step_s / 4 / 1e12, rel=1e-12)
    assert e.mfu == pytest.approx(e.tflops_per_gpu / 1.0, rel=1e-12)  # bf16 peak: 1 TFLOP/s
    # no recompute: the hardware's FLOPs are the model's
    assert (e.hw_tflops_per_gpu, e.hfu) == (e.tflops_per_gpu, e.mfu)
    three_days = e.tokens_per_s * 86400 * 3
    assert e.train_days(three_days) == pytest.approx(3.0, rel=1e-12)
    assert e.gpu_hours(three_days) == pytest.approx(3 * 24 * 4, rel=1e-12)


@pytest.mark.parametrize("recompute, extra_per_token", [
    ("selective", 2 * 4 * 64 * 64),                              # 4 L H Q T = 32,768
    ("full", 2 * (2 * TINY_LAYER_MATMUL + 4 * 64 * 64)),        # L (2N + 4 H Q T) = 180,224
])
def test_recompute_adds_hardware_flops_not_model_flops(recompute: str,
                                                       extra_per_token: int) -> None:
    e = estimate(TINY, Layout(recompute=recompute, microbatches=4), TOY)
    tokens = 4 * 64
    assert e.model_flops == TINY_FLOPS_PER_TOKEN * tokens
    assert e.hardware_flops - e.model_flops == extra_per_token * tokens
    assert e.hfu / e.mfu == pytest.approx(e.hardware_flops / e.model_flops, rel=1e-12)


def test_fits_flips_when_memory_shrinks() -> None:
    total = estimate(TINY, Layout(zero=0), TOY).memory["total"]
    roomy = estimate(TINY, Layout(zero=0), dataclasses.replace(TOY, memory_gib=total / GIB * 1.01))
    tight = estimate(TINY, Layout(zero=0), dataclasses.replace(TOY, memory_gib=total / GIB * 0.99))
    assert roomy.fits and roomy.notes == []
    assert not tight.fits and tight.notes and tight.notes[0].startswith("needs ")
    reserved = dataclasses.replace(TOY, memory_gib=total / GIB * 1.01,
                                   reserved_gib=total / GIB * 0.02)
    assert not estimate(TINY, Layout(zero=0), reserved).fits


# -- estimate: collectives -------------------------------------------------------------------


def test_ddp_issues_one_gradient_all_reduce_per_step() -> None:
    e = estimate(TINY, Layout(dp_shard=4, zero=0, microbatches=4), COMPUTE_BOUND)
    (ar,) = e.collectives
    assert (ar.axis, ar.collective, ar.ranks, ar.calls, ar.inter_node) == (
        "dp", "all_reduce", 4, 1, False)
    assert ar.nbytes == 2 * TINY_PARAMS  # bf16 gradients: 213,632 bytes
    # ring of 4 on NVLink: 2(4-1) x 5 us + 2(4-1)/4 x 213,632 / 1e11 = 33.20448 us
    assert ar.seconds == pytest.approx(6 * 5e-6 + 1.5 * 213_632 / 1e11, rel=1e-12)
    # one bucket holds every gradient, so none of the all-reduce hides behind the backward
    assert e.exposed_comm_s == pytest.approx(ar.seconds, rel=1e-12)
    assert e.step_s == pytest.approx(4 * TINY_MICROBATCH_S + ar.seconds + e.optimizer_s,
                                     rel=1e-12)
    assert e.comm_by_axis() == {"dp": ar.seconds}


def test_a_measured_all_reduce_link_replaces_the_node_link() -> None:
    hw = dataclasses.replace(TOY, collectives={"all_reduce": Link(bandwidth_gbs=50.0,
                                                                  latency_us=1.0)})
    (ar,) = estimate(TINY, Layout(dp_shard=4, zero=0), hw).collectives
    assert ar.seconds == pytest.approx(6 * 1e-6 + 1.5 * 213_632 / 5e10, rel=1e-12)


def _bytes_sent(e: Any, axis: str) -> float:
    # what each rank puts on its link per step: calls x buffer x the ring's factor, by hand
    factor = {"all_reduce": 2 * (2 - 1) / 2, "all_gather": (2 - 1) / 2,
              "reduce_scatter": (2 - 1) / 2}
    return sum(c.calls * c.nbytes * factor[c.collective] for c in e.collectives
               if c.axis == axis)


def test_sequence_parallel_moves_the_same_tp_bytes_in_other_collectives() -> None:
    sp = estimate(TINY, Layout(tp=2, zero=0, microbatches=4, sp_regather=False), TOY)
    plain = estimate(TINY, Layout(tp=2, zero=0, microbatches=4, sequence_parallel=False), TOY)
    assert {c.collective for c in sp.collectives if c.axis == "tp"} == {"all_gather",
                                                                        "reduce_scatter"}
    assert {c.collective for c in plain.collectives if c.axis == "tp"} == {"all_reduce"}
    # one activation is 64 tokens x 64 x 2 bytes = 8,192; 2 collectives per layer forward and
    # 2 backward, 2 layers, 4 micro-batches -> 16 calls per kind and direction.
    # SP: (AG + RS) x (fwd + bwd) x 16 x 8,192 x 1/2 = 262,144 bytes;
    # plain: AR x (fwd + bwd) x 16 x 8,192 x 1 = 262,144 bytes
    assert _bytes_sent(sp, "tp") == _bytes_sent(plain, "tp") == 262_144
    # and on 2 ranks the same number of hops: 64 x 1 vs 32 x 2
    assert sp.comm_by_axis()["tp"] == pytest.approx(plain.comm_by_axis()["tp"], rel=1e-12)
    assert sp.comm_by_axis()["tp"] == pytest.approx(64 * (5e-6 + 8192 / 2 / 1e11), rel=1e-12)
    # keeping the inputs as shards (Megatron's, meshlab's default) gathers them again in the
    # backward: 16 more all-gathers of 8,192 x 1/2
    again = estimate(TINY, Layout(tp=2, zero=0, microbatches=4), TOY)
    assert _bytes_sent(again, "tp") == 262_144 + 16 * 8192 / 2
    assert all(not c.overlapped and not c.inter_node for c in sp.collectives)


def test_an_axis_spanning_more_than_a_node_runs_on_the_network() -> None:
    # tp=2 (ranks 1 apart) inside a node; dp_shard=8 (ranks 2 apart) spans 16 ranks: 2 nodes
    e = estimate(TINY, Layout(tp=2, dp_shard=8, zero=3, microbatches=4), TOY)
    assert {c.inter_node for c in e.collectives if c.axis == "tp"} == {False}
    assert {c.inter_node for c in e.collectives if c.axis == "dp_shard"} == {True}
    gather = next(c for c in e.collectives if c.what.endswith("(forward)"))
    # one FSDP unit per layer: (106,816 / tp 2) / 2 layers = 26,704 parameters, 53,408 bytes,
    # gathered for each of 4 micro-batches (ZeRO-3) on the 10 GB/s, 20 us network
    assert (gather.nbytes, gather.calls) == (53_408, 2 * 4)
    assert gather.seconds == pytest.approx(8 * (7 * 20e-6 + 7 / 8 * 53_408 / 1e10), rel=1e-12)


@pytest.mark.parametrize("dp_shard, inter", [(8, False), (16, True)])
def test_a_data_axis_is_inter_node_once_it_outgrows_the_node(dp_shard: int,
                                                             inter: bool) -> None:
    e = estimate(TINY, Layout(dp_shard=dp_shard, zero=3), TOY)
    assert e.collectives and {c.inter_node for c in e.collectives} == {inter}


@pytest.mark.parametrize("pp, dp_shard, inter", [
    (2, 4, False),  # stages on ranks 0-3 and 4-7: one node
    (4, 4, True),   # stages at 0, 4, 8, 12: the hop from stage 1 to 2 crosses nodes
    (2, 8, True),   # stages 8 ranks apart
])
def test_pipeline_hops_leave_the_node_once_the_stages_span_nodes(pp: int, dp_shard: int,
                                                                 inter: bool) -> None:
    e = estimate(PIPE, Layout(pp=pp, dp_shard=dp_shard, zero=0, microbatches=pp), TOY)
    (hop,) = [c for c in e.collectives if c.axis == "pp"]
    assert hop.inter_node is inter


# -- estimate: pipelines ---------------------------------------------------------------------


def test_pipeline_bubble_of_1f1b_and_gpipe_is_the_published_formula() -> None:
    # Narayanan et al. 2021 (PipeDream-Flush): (p-1)/(m+p-1) with free hops; p=4, m=8: 3/11
    for schedule in ("1f1b", "gpipe"):
        e = estimate(PIPE, Layout(pp=4, microbatches=8, schedule=schedule), FREE_LINKS)
        assert e.bubble_fraction == pytest.approx(3 / 11, abs=1e-6)
        assert e.pipeline_s == pytest.approx(e.compute_s * 11 / 8, rel=1e-6)


def test_interleaved_bubble_is_the_published_formula() -> None:
    # Narayanan et al. 2021, section 2.2.2: the bubble shrinks v-fold, (p-1)/(v m + p-1);
    # p=4, m=8, v=2: 3/19
    e = estimate(PIPE, Layout(pp=4, microbatches=8, virtual=2, schedule="interleaved_1f1b"),
                 FREE_LINKS)
    assert e.bubble_fraction == pytest.approx(3 / 19, abs=1e-6)


@pytest.mark.parametrize("t_b", [2.0, 2.03, 2.47])
def test_pipeline_bubble_does_not_depend_on_the_rounding_of_t_b(t_b: float) -> None:
    # the simulation rounds t_B / t_F to 0.1; the time and bubble it reports must not:
    # 1F1B with free hops lasts (m + p - 1)(t_F + t_B) whatever t_B is
    seconds, bubble, inflight = _pipeline("1f1b", 4, 8, 1, 1.0, t_b, 0.0)
    assert seconds == pytest.approx(11 * (1 + t_b), rel=1e-12)
    assert bubble == pytest.approx(3 / 11, rel=1e-12)
    assert inflight == 4
    # the same past the simulated length (600 x 2 ranks > SIMULATED_ACTIONS)
    seconds, bubble, _ = _pipeline("1f1b", 2, 600, 1, 1.0, t_b, 0.0)
    assert seconds == pytest.approx(601 * (1 + t_b), rel=1e-12)
    assert bubble == pytest.approx(1 / 601, rel=1e-9)


def test_interleaved_bubble_from_the_pipeline_model() -> None:
    for p, m, v in ((4, 8, 2), (2, 4, 2), (4, 16, 4)):
        _, bubble, _ = _pipeline("interleaved_1f1b", p, m, v, 1.0, 2.0, 0.0)
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


def test_gpipe_holds_every_microbatch_and_1f1b_holds_p_on_the_first_rank() -> None:
    assert _pipeline("gpipe", 4, 8, 1, 1.0, 2.0, 0.0)[2] == 8
    assert _pipeline("1f1b", 4, 8, 1, 1.0, 2.0, 0.0)[2] == 4
    gpipe = estimate(PIPE, Layout(pp=4, microbatches=8, schedule="gpipe"), FREE_LINKS)
    one_f = estimate(PIPE, Layout(pp=4, microbatches=8), FREE_LINKS)
    # 8 layers / 4 stages = 2 per stage, 106,496 bytes each, + 131,072 of logits
    assert gpipe.memory["activations"] == 106_496 * 2 * 8 + 131_072
    assert one_f.memory["activations"] == 106_496 * 2 * 4 + 131_072


def test_no_pipeline_is_the_microbatches_back_to_back() -> None:
    assert _pipeline("1f1b", 1, 5, 1, 0.25, 0.5, 0.0) == (5 * 0.75, 0.0, 1.0)


# (schedule, ranks, microbatches, virtual): all well past SIMULATED_ACTIONS forwards, each
# full simulation well under a second
LONG = [("1f1b", 2, 300, 1), ("1f1b", 16, 100, 1), ("gpipe", 4, 200, 1),
        ("interleaved_1f1b", 4, 96, 2), ("interleaved_1f1b", 8, 72, 2), ("zb_h1", 8, 100, 1),
        ("looped_bfs", 4, 160, 2), ("zbv", 4, 100, 2), ("dualpipev", 8, 100, 2)]


@pytest.mark.parametrize("schedule, p, m, v", LONG)
@pytest.mark.parametrize("t_f, t_b, hop", [(0.5, 1.0, 0.0), (0.5, 1.0, 0.1), (2.0, 5.2, 0.1)])
def test_long_pipelines_extrapolate_to_the_full_simulation(
        schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, hop: float) -> None:
    assert m * p * v > SIMULATED_ACTIONS  # the model extrapolates this one
    seconds, bubble, inflight = _pipeline(schedule, p, m, v, t_f, t_b, hop)
    full = build(schedule, ranks=p, microbatches=m, virtual=v).simulate(
        Costs(forward=t_f, backward=t_b, comm=hop))
    assert seconds == pytest.approx(full.makespan, rel=1e-6)
    assert bubble == pytest.approx(full.bubble_fraction, abs=1e-6)
    assert inflight == pytest.approx(full.peak_inflight(0), rel=1e-9)


# -- search ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama8b_on_8() -> Any:
    return search(MODELS["llama3-8b"], gpus=8, hardware=HARDWARE["h100-sxm"], global_batch=32,
                  top=None)


def test_search_returns_fitting_layouts_fastest_first(llama8b_on_8: Any) -> None:
    frame = llama8b_on_8
    assert len(frame) > 10
    assert frame["fits"].all()
    assert all(e.fits for e in frame["estimate"])
    speeds = list(frame["tokens_per_s"])
    assert speeds == sorted(speeds, reverse=True)


def test_every_searched_layout_has_the_requested_gpus_and_batch(llama8b_on_8: Any) -> None:
    assert set(llama8b_on_8["gpus"]) == {8} and set(llama8b_on_8["global_batch"]) == {32}
    for e in llama8b_on_8["estimate"]:
        assert e.layout.gpus == 8 and e.layout.global_batch == 32
        check(MODELS["llama3-8b"], e.layout)  # and the model can take it


@pytest.mark.parametrize("constraints, holds", [
    ("tp<=2", lambda lay: lay.tp <= 2),
    ("pp=2", lambda lay: lay.pp == 2),
    ("zero=3", lambda lay: lay.zero == 3),
    ("dp>=8 ac=none", lambda lay: lay.dp_shard >= 8 and lay.recompute == "none"),
])
def test_search_honours_constraints(constraints: str, holds: Any) -> None:
    frame = search(MODELS["llama3-8b"], gpus=16, hardware=HARDWARE["h100-sxm"],
                   global_batch=64, constraints=constraints, top=None)
    assert len(frame) > 0
    assert all(holds(e.layout) for e in frame["estimate"])


def test_search_tries_expert_layouts_only_where_the_mesh_takes_them() -> None:
    # 8 experts and 32k-token sequences: the search varies cp and ep together
    moe = ModelShape(name="moe", layers=4, hidden=256, heads=4, ffn=128, vocab=256,
                     seq_len=32768, experts=8, top_k=2)
    layouts = list(candidates(moe, 16, TOY, global_batch=16))
    with_both = [lay for lay in layouts if lay.ep > 1 and lay.cp > 1]
    assert with_both  # e.g. dp_shard=4 cp=2 ep=4
    # never ep=2 with cp=4 (the mesh refuses ep smaller than cp)
    assert all(lay.ep % lay.cp == 0 and lay.dp_shard * lay.cp % lay.ep == 0
               for lay in with_both)


def test_search_top_keeps_the_fastest(llama8b_on_8: Any) -> None:
    top = search(MODELS["llama3-8b"], gpus=8, hardware=HARDWARE["h100-sxm"], global_batch=32,
                 top=3)
    assert list(top["layout"]) == list(llama8b_on_8["layout"][:3])


def test_parse_constraints_reads_operators_and_aliases() -> None:
    assert parse_constraints("tp<=8 pp=16, dp>=2 mbs<4 ac=full schedule=zbv") == {
        "tp": ("<=", 8), "pp": ("=", 16), "dp_shard": (">=", 2), "micro_batch": ("<", 4),
        "recompute": ("=", "full"), "schedule": ("=", "zbv")}


@pytest.mark.parametrize("text, match", [
    ("tp", r"constraint 'tp': write NAME=VALUE, NAME<=VALUE or NAME>=VALUE"),
    ("colour=2", r"constraint 'colour=2': colour is not searched; choose from pp, "
                 r"dp_replicate, cp, tp, ep"),
    # precision is search's own argument: as a constraint it would be ignored
    ("precision=fp8", r"precision is not searched"),
    ("tp=two", r"constraint 'tp=two': tp takes a whole number"),
    ("tp=>2", r"constraint 'tp=>2': tp takes a whole number"),
    ("ac<=full", r"constraint 'ac<=full': recompute takes = only"),
])
def test_parse_constraints_rejects_what_it_cannot_honour(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_constraints(text)


def test_an_impossible_request_says_how_to_fix_it() -> None:
    with pytest.raises(ValueError, match=r"no layout of llama3-405b on 8 h100-sxm GPUs .*fits "
                                         r"in memory: the smallest, .*, needs \d+\.\d GiB of 76 "
                                         r"GiB usable; add GPUs"):
        search(MODELS["llama3-405b"], gpus=8, hardware=HARDWARE["h100-sxm"], global_batch=8)


@pytest.mark.parametrize("family", ["Llama", "Mixtral", "DeepSeek-V3"])
def test_a_transformers_config_counts_its_model(family: str) -> None:
    """Head width, experts, shared experts, dense first layers and MLA's ranks read from the
    config: the planner counts every parameter of the model built from it (the matrix's
    tiny DeepSeek-V3 has all of them)."""
    import torch

    from tests.rank.families import FAMILIES_SOURCE

    namespace: dict[str, Any] = {}
    exec(FAMILIES_SOURCE, namespace)
    with torch.device("meta"):
        model = namespace["FAMILIES"][family]()
    assert model_shape(model.config).params == sum(p.numel() for p in model.parameters())


def test_published_sizes_from_their_transformers_configs() -> None:
    """Qwen3-32B (Qwen3 technical report, Table 1: 32.8B; 64 heads of 128 on a hidden of
    5,120, which hidden / heads would make 30.5B), Mixtral 8x7B (Jiang et al. 2024: 47B, 13B
    active) and DeepSeek-V3 (its technical report: 671B, 37B activated per token)."""
    transformers = pytest.importorskip("transformers")
    qwen3 = model_shape(transformers.Qwen3Config(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128))
    assert qwen3.head_width == 128 and qwen3.params == pytest.approx(32.8e9, rel=0.005)
    mixtral = model_shape(transformers.MixtralConfig())  # its defaults are 8x7B's
    assert mixtral.params == pytest.approx(46.7e9, rel=0.005)
    assert mixtral.active_matmul_params == pytest.approx(12.9e9, rel=0.02)
    deepseek = model_shape(transformers.DeepseekV3Config())  # V3's own defaults
    assert (deepseek.experts, deepseek.top_k, deepseek.dense_layers) == (256, 8, 3)
    assert deepseek.params == pytest.approx(671e9, rel=0.005)
    # activated: the matmuls one token passes plus its embedding row
    assert deepseek.active_matmul_params + deepseek.hidden == pytest.approx(37e9, rel=0.02)
