"""meshlab.kernels: each Triton kernel against its torch reference, forward and gradients.

The kernels run in Triton's CPU interpreter, each test in a fresh `python -c` process: an
out-of-bounds access there corrupts memory and aborts the process later, which must not take
pytest down (and importing meshlab.kernels sets TRITON_INTERPRET, which must not leak).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import torch
from meshlab.kernels import KERNELS

CPU = torch.device("cpu")
# n = 1, odd, a power of two, and tails that leave most of the last block masked
SHAPES = [(1, 1), (3, 7), (2, 64), (4, 100), (2, 257)]
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def compare(name, args):
    spec = KERNELS[name]
    leaves = [a for a in args if a.requires_grad]
    out, expected = spec.kernel(*args), spec.reference(*args)
    tol = TOL[args[0].dtype]
    where = f"{name} {[tuple(a.shape) for a in args]} {args[0].dtype}"
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=lambda m: f"{where}: {m}")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, grad_out)
    for i, (got, want) in enumerate(zip(grads, torch.autograd.grad(expected, leaves, grad_out))):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m: f"{where} grad {i}: {m}")


def check(name, shapes=SHAPES, dtypes=DTYPES):
    for dtype in dtypes:
        for rows, n in shapes:
            compare(name, KERNELS[name].inputs(rows, n, dtype, CPU))


def as_3d(args, rows=2):
    # (rows * T, n) -> (rows, T, n) leaves that still require grad
    return tuple(a.detach().unflatten(0, (rows, -1)).requires_grad_(a.requires_grad)
                 for a in args)
"""


def run_interpreted(code: str, env: dict[str, str] | None = None) -> str:
    """Run PRELUDE + code in a fresh interpreter-mode Python; fail with its output if it fails."""
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})})
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_rmsnorm_matches_torch_forward_and_backward() -> None:
    run_interpreted("""
        check("rmsnorm")
        x, w = KERNELS["rmsnorm"].inputs(6, 48, torch.float32, CPU)
        compare("rmsnorm", (*as_3d((x,)), w))
        # fp16 activations with an fp32 weight promote to fp32, as the model's RMSNorm does
        compare("rmsnorm", (x.detach().half().requires_grad_(), w))
    """)


def test_softmax_matches_torch_forward_and_backward() -> None:
    run_interpreted("""
        check("softmax")
        compare("softmax", as_3d(KERNELS["softmax"].inputs(6, 100, torch.float32, CPU)))
    """)


def test_swiglu_matches_torch_forward_and_backward() -> None:
    run_interpreted("""
        check("swiglu")
        compare("swiglu", as_3d(KERNELS["swiglu"].inputs(6, 100, torch.float32, CPU)))
    """)


def test_cross_entropy_matches_torch_forward_and_backward() -> None:
    run_interpreted("""
        check("cross_entropy")
        # 40000 > MAX_CHUNK columns: two chunks, most of the second one masked
        check("cross_entropy", shapes=[(2, 40000)])
        logits, target = KERNELS["cross_entropy"].inputs(6, 300, torch.float32, CPU)
        compare("cross_entropy", (*as_3d((logits,)), target.view(2, 3)))
        target[[1, 4]] = -100  # ignored rows leave the mean and the gradient
        compare("cross_entropy", (logits, target))
    """)


def test_cross_entropy_leaves_its_logits_intact() -> None:
    run_interpreted("""
        from meshlab.kernels import cross_entropy
        logits, target = KERNELS["cross_entropy"].inputs(3, 100, torch.float32, CPU)
        before = logits.detach().clone()
        cross_entropy(logits, target).backward()
        assert torch.equal(logits.detach(), before)
    """)


def test_apply_kernels_keeps_the_transformers_loss_and_gradients() -> None:
    run_interpreted("""
        from meshlab.kernels import FeedForward, RMSNorm, apply_kernels, cross_entropy
        from meshlab.models import ModelConfig, Transformer
        from meshlab.models.llama import loss_fn

        cfg = ModelConfig()
        plain, fast = Transformer(cfg), apply_kernels(Transformer(cfg))
        assert sum(isinstance(m, RMSNorm) for m in fast.modules()) == 2 * cfg.n_layers + 1
        assert sum(isinstance(m, FeedForward) for m in fast.modules()) == cfg.n_layers
        assert plain.state_dict().keys() == fast.state_dict().keys()
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        want = loss_fn(plain(inputs), targets)
        got = cross_entropy(fast(inputs), targets)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(plain.named_parameters(), fast.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    """)


BAD_INPUTS = {  # case: (call, the start of its error message)
    "weight_shape": ("rmsnorm(torch.randn(2, 64), torch.ones(48))",
                     "weight has shape (48,) but x has shape (2, 64): weight must be (64,)"),
    "bf16_on_cpu": ("softmax(torch.randn(2, 8, dtype=torch.bfloat16))",
                    "x is bfloat16 on CPU"),
    "integer_dtype": ("softmax(torch.arange(8))", "x has dtype torch.int64"),
    "swiglu_shapes": ("swiglu(torch.randn(2, 8), torch.randn(2, 9))",
                      "gate is (2, 8) torch.float32 on cpu but up is (2, 9)"),
    "target_shape": ("cross_entropy(torch.randn(4, 10), torch.zeros(3, dtype=torch.long))",
                     "logits (4, 10) and target (3,) do not fit"),
    "target_range": ("cross_entropy(torch.randn(2, 10), torch.tensor([3, 10]))",
                     "target holds 10, outside 0..9"),
}


@pytest.fixture(scope="module")
def bad_input_errors() -> dict[str, str]:
    """The ValueError message each of BAD_INPUTS raises, all from one subprocess."""
    code = "from meshlab.kernels import cross_entropy, rmsnorm, softmax, swiglu\n"
    for case, (call, _) in BAD_INPUTS.items():
        code += (f"try:\n    {call}\n    print({case!r}, 'no error')\n"
                 f"except ValueError as e:\n    print({case!r}, str(e).replace(chr(10), ' '))\n")
    lines = [line.partition(" ") for line in run_interpreted(code).splitlines()]
    return {case: message for case, _, message in lines}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_a_value_error_naming_it(bad_input_errors: dict[str, str],
                                                  case: str) -> None:
    assert bad_input_errors[case].startswith(BAD_INPUTS[case][1]), bad_input_errors[case]


def test_kernels_compile_for_an_h100_without_a_gpu(tmp_path: Path) -> None:
    # The interpreter skips Triton's type checks and code generation: compile for sm_90 too
    run_interpreted("""
        import importlib
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile

        SCALARS = {"eps": "fp32"}
        for name in KERNELS:
            module = importlib.import_module(f"meshlab.kernels.{name}")
            for kernel in (module._forward, module._backward):
                for dtype in ("fp32", "bf16"):
                    # data in dtype, indices int64, saved statistics fp32, sizes int32
                    signature = {
                        arg: "constexpr" if arg == "BLOCK"
                        else "*i64" if arg == "target_ptr"
                        else "*fp32" if arg in ("rstd_ptr", "dw_ptr", "lse_ptr", "loss_ptr",
                                                "scale_ptr")
                        else f"*{dtype}" if arg.endswith("_ptr")
                        else SCALARS.get(arg, "i32")
                        for arg in kernel.arg_names}
                    block = kernel.arg_names.index("BLOCK")
                    source = ASTSource(kernel, signature, constexprs={(block,): 1024})
                    compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    """, env={"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)})


def test_importing_triton_first_on_cpu_is_refused_with_the_fix() -> None:
    # triton decorates tl.sigmoid & co. at its import: without the interpreter chosen by then,
    # every kernel would fail later with "Cannot call @triton.jit'd outside of the scope..."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "import triton; import meshlab.kernels"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert "ImportError: triton was imported before meshlab.kernels without TRITON_INTERPRET=1" \
        in proc.stderr, proc.stderr
    assert "import meshlab.kernels first" in proc.stderr
