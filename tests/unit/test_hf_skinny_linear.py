"""The skinny projection kernel (``engine.hf.skinny_linear``, ``hf/skinny_linear.py``) on the
CPU, under Triton's interpreter: the kernel against the definition in float64, where it
hands the call to ``F.linear``, and end to end: greedy tokens equal ``model.generate``'s
with the kernel running the fused q/k/v and the output projections. (The interpreter
multiplies bfloat16 wrongly: half precision is checked in float16 here.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fakes.hf_runs import fixed_request, hf_greedy, made_up_prompt, run_engine  # noqa: E402
from hf_families import tiny_model  # noqa: E402
from tailcut.engine.hf import HFEngine  # noqa: E402
from tailcut.engine.hf import skinny_linear as kernel  # noqa: E402
from tailcut.engine.hf.fused import FusedProjections  # noqa: E402
from tailcut.engine.hf.triton_runs import kernel_for  # noqa: E402
from tailcut.types import GenerateResult  # noqa: E402

VOCAB = 256
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.float16, 2e-2)], ids=["fp32", "fp16"]
)
@pytest.mark.parametrize(
    ("lead", "k", "n", "bias"),
    [
        ((64,), 896, 1152, True),  # a 0.5B model's fused q/k/v at batch 64
        ((3,), 200, 50, False),  # ragged: rows, columns and features off every block
        ((1,), 130, 16, True),
        ((2, 5), 64, 40, False),  # [batch, seq, features]
    ],
)
def test_the_kernel_is_a_linear_layer(
    dtype: Any, tol: float, lead: tuple[int, ...], k: int, n: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    # the weight a fused group's member views: rows of a wider tensor
    wide = torch.randn(n + 7, k, generator=gen).to(dtype)
    w = wide[3 : 3 + n]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    got = kernel.run(x, w, b)
    assert got.shape == (*lead, n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol * k**0.5, rtol=tol)


def test_calls_the_kernel_cannot_take_go_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[int, ...]] = []
    real = kernel.run

    def counted(x: Any, w: Any, b: Any) -> Any:
        ran.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(kernel, "run", counted)
    w = torch.randn(32, 48)
    for x, takes in [
        (torch.randn(64, 48), True),
        (torch.randn(kernel.MAX_ROWS + 1, 48), False),  # a batch past the kernel's rows
        (torch.randn(4, 48, dtype=torch.float64), False),  # a dtype the kernel has not
        (torch.randn(0, 48), False),
    ]:
        out = kernel.linear(x, w.to(x.dtype), None)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w.to(x.dtype)))
        assert (tuple(x.shape) in ran) is takes
    strided_bias = torch.randn(64)[::2]  # 32 values, every other one of a wider tensor
    x = torch.randn(5, 48)
    torch.testing.assert_close(
        kernel.linear(x, w, strided_bias), torch.nn.functional.linear(x, w, strided_bias)
    )
    assert not kernel.usable(torch.randn(2, 48), torch.randn(kernel.MAX_OUT + 1, 48))
    assert not kernel.usable(torch.randn(2, kernel.MAX_IN + 1), torch.randn(8, kernel.MAX_IN + 1))


def test_the_setting_is_off_by_default_and_named_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert kernel_for("skinny_linear", None, cpu, default=False) is False
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"engine\.hf\.skinny_linear=true needs Triton"):
        run_engine(tiny_model("llama", VOCAB), _greedy([[5, 6]], [2]), slots=1, skinny_linear=True)


def test_the_output_projection_is_a_group_of_its_own_and_given_back() -> None:
    model = tiny_model("qwen2", VOCAB)
    attn = model.model.layers[0].self_attn
    before = {n: p.clone() for n, p in model.named_parameters()}
    fused = FusedProjections(model, skinny=True)
    assert "forward" in vars(attn.o_proj)
    assert sum(len(g.linears) == 1 for g in fused.groups) == len(model.model.layers)
    fused.close()
    assert "forward" not in vars(attn.o_proj)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def _greedy(prompts: list[list[int]], budgets: list[int]) -> Any:
    async def body(engine: HFEngine) -> list[GenerateResult]:
        return list(
            await asyncio.gather(
                *(
                    engine.generate(fixed_request(p, n, "sk", temperature=0.0))
                    for p, n in zip(prompts, budgets, strict=True)
                )
            )
        )

    return body


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # q/k/v without and with biases
def test_greedy_tokens_equal_generate_with_the_kernel(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes: list[tuple[int, int]] = []
    real = kernel.run

    def counted(x: Any, w: Any, b: Any) -> Any:
        shapes.append(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(kernel, "run", counted)
    model = tiny_model(family, VOCAB, initializer_range=0.5)
    prompts = [made_up_prompt(i, n, VOCAB, 37, 11) for i, n in enumerate((3, 11, 5))]
    budgets = [9, 4, 12]
    results = run_engine(
        model, _greedy(prompts, budgets), slots=3, timeout_s=240, max_seq_len=64,
        skinny_linear=True,
    )  # fmt: skip
    attn = model.model.layers[0].self_attn
    hidden = model.config.hidden_size
    qkv = attn.q_proj.out_features + 2 * attn.k_proj.out_features
    # the attention's projections only: the MLP's GEMMs stay cuBLAS's (the kernel is
    # slower on both: linear_bench)
    assert set(shapes) == {(qkv, hidden), (hidden, attn.o_proj.in_features)}
    for p, n, r in zip(prompts, budgets, results, strict=True):
        assert r.output_ids == hf_greedy(model, p, n)


def test_the_benchmark_times_each_projection_against_cublas(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """On the CPU (the interpreter) the benchmark's code runs end to end over a model
    directory's geometry; its timings mean nothing here, its outputs' differences do."""
    from tailcut.bench.linear_bench import BLOCKS, main, run_bench, shapes

    tiny_model("qwen2", VOCAB).config.save_pretrained(tmp_path)
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    hidden, head = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head
    assert shapes(str(tmp_path)) == [
        ("qkv", qkv, hidden, True), ("o", hidden, hidden, False),
        ("gate/up", 2 * cfg.intermediate_size, hidden, False),
        ("down", hidden, cfg.intermediate_size, False),
    ]  # fmt: skip
    rows = run_bench([str(tmp_path)], [3], device="cpu")
    assert [r["projection"] for r in rows] == ["qkv", "o", "gate/up", "down"]
    for r in rows:
        assert len(r["kernel"]) == len(BLOCKS)
        assert all(v["max_abs_diff"] < 1e-3 for v in r["kernel"].values())
        assert r["ratio"] == r["cublas_us"] / min(v["us"] for v in r["kernel"].values())
    main([str(tmp_path), "--rows", "2", "--device", "cpu"])
    assert capsys.readouterr().out.count("ratio") == 4
