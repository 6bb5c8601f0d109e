"""The many-worker benchmark on a small skewed pool (virtual time)."""

from tailcut.bench.multi import harder, multi_oracle_s, run_scopes, skewed_pool
from tailcut.config import SimEngineConfig


def test_global_scope_keeps_more_per_second_than_per_worker_scope():
    rows = {r.scope: r for r in run_scopes(workers=3, per_worker=40, max_difficulty=3.0)}
    w, g = rows["worker"], rows["global"]
    assert g.kept_per_s > w.kept_per_s
    assert abs(g.kept - w.kept) <= 3  # the same target, up to per-worker rounding
    for row in rows.values():
        assert row.oracle_s <= row.step_time_s + 1e-9
        assert row.ratio_to_oracle >= 1.0


def test_skewed_pool_scales_difficulty_per_worker():
    pool = skewed_pool(2, 10, 3.0, 1, seed=1)
    base = skewed_pool(1, 20, 1.0, 1, seed=1)
    assert [t.output_tokens for t in pool[:10]] == [t.output_tokens for t in base[:10]]
    assert sum(t.output_tokens for t in pool[10:]) > 2.5 * sum(t.output_tokens for t in base[10:])
    assert harder(base[0], 2.0).tool_s == 2.0 * base[0].tool_s


def test_multi_oracle_keeps_requested_count_per_worker():
    cfg = SimEngineConfig()
    pool = skewed_pool(2, 8, 2.0, 1, seed=0)
    all_s = multi_oracle_s(pool, [0, 8, 16], 16, cfg)
    some_s = multi_oracle_s(pool, [0, 8, 16], [4, 4], cfg)
    assert 0 < some_s <= all_s


def test_bench_cli_compares_scopes_over_workers():
    import json

    from typer.testing import CliRunner

    from tailcut.app.cli import app

    res = CliRunner().invoke(app, ["bench", "--workers", "2", "--requests", "64", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [r["scope"] for r in out["scopes"]] == ["worker", "global"]
    assert out["global_over_worker_kept_per_s"] > 0
