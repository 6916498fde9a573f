"""scripts/cost_floors.py: its stand-in cores reach the layers' code paths and compute what
they claim (checked against numpy), its rows, its markdown block and its bad flags."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import get_attention
from tests.scripts_testing import load_script

B, N, H, D = 1, 32, 2, 8


@pytest.fixture(scope="module")
def floors():
    return load_script("cost_floors")


def _inputs():
    x = jax.random.normal(jax.random.PRNGKey(0), (B, N, H * D))
    return x, jnp.ones((B, N), bool)


def _dense(p, x):  # a head_dense projection by hand: x [B, n, dim] -> [B, n, H, hd]
    return np.einsum("bnc,chd->bnhd", x, np.asarray(p["kernel"])) + np.asarray(p["bias"])


def _out(p, y):  # the output projection by hand: y [B, n, H, hd] -> [B, n, out]
    return np.einsum("bnhd,hdo->bno", y, np.asarray(p["kernel"])) + np.asarray(p["bias"])


def test_stand_in_restores_the_function_even_on_error(floors):
    module = floors.full_module
    before = module.chunked_attention
    with pytest.raises(RuntimeError), floors.stand_in(module, "chunked_attention", len):
        assert module.chunked_attention is len
        raise RuntimeError
    assert module.chunked_attention is before


def test_projections_only_is_the_full_layer_with_v_plus_q_times_k(floors):
    # If the full layer stopped calling full.chunked_attention by that name, the stand-in
    # would not apply and the "projections only" row would measure the whole layer.
    x, mask = _inputs()
    mod = get_attention("full")(num_heads=H, head_dim=D, out_dim=H * D, implementation="chunked")
    params = nn.unbox(mod.init(jax.random.PRNGKey(1), x, mask, deterministic=True)["params"])
    with floors.stand_in(floors.full_module, "chunked_attention", floors.elementwise_core):
        got = mod.apply({"params": params}, x, mask, deterministic=True)
    xs = np.asarray(x, np.float64)
    q, k, v = (_dense(params[name], xs) for name in ("query", "key", "value"))
    want = _out(params["out"], v + q * k)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    real = mod.apply({"params": params}, x, mask, deterministic=True)
    assert not np.allclose(np.asarray(real), want, atol=1e-3)  # the stand-in made the change


def test_sbm_before_any_edge_is_the_layer_with_each_tokens_own_pair(floors):
    # The layer under the stand-in against numpy from its parameters: projections, the
    # per-head membership MLP, Y = sigmoid(MLP(q) C^T), Z likewise, S = softmax(C C^T)
    # over all k*k entries, p_ii = sum_uv Y_iu S_uv Z_iv, out = W_o (v + q p_ii).
    x, mask = _inputs()
    mod = get_attention("sbm")(num_heads=H, head_dim=D, num_clusters=4)
    rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
    params = nn.unbox(mod.init(rngs, x, mask, deterministic=True)["params"])
    with floors.stand_in(floors.sbm_module, "sbm_attention_core", floors.own_pair_core):
        got = mod.apply({"params": params}, x, mask, rngs={"sample": rngs["sample"]})
    xs = np.asarray(x, np.float64)
    q, k, v = (_dense(params[name], xs) for name in ("query", "key", "value"))
    w1, b1, w2, b2, c = (
        np.asarray(params[name], np.float64)
        for name in ("mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2", "clusters")
    )

    def memberships(t):  # [B, n, H, hd] -> [B, n, H, k]
        hidden = np.maximum(np.einsum("bnhd,hde->bnhe", t, w1) + b1, 0.0)
        embed = np.einsum("bnhd,hde->bnhe", hidden, w2) + b2
        return 1.0 / (1.0 + np.exp(-np.einsum("bnhd,hkd->bnhk", embed, c)))

    logits = np.einsum("hkd,hjd->hkj", c, c).reshape(H, -1)
    s = np.exp(logits - logits.max(-1, keepdims=True))
    s = (s / s.sum(-1, keepdims=True)).reshape(c.shape[0], c.shape[1], c.shape[1])
    p_own = np.einsum("bnhu,huv,bnhv->bnh", memberships(q), s, memberships(k))
    want = _out(params["out"], v + q * p_own[..., None])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    real = mod.apply({"params": params}, x, mask, rngs={"sample": rngs["sample"]})
    assert not np.allclose(np.asarray(real), want, atol=1e-3)  # the stand-in made the change


def test_the_four_rows_compile_and_run_with_ratios_to_the_exact_row(floors):
    rows = floors.measure_case(64, 1, 2, 8, 0.05, repeats=1)
    assert [r["label"] for r in rows] == [
        floors.EXACT,
        floors.PROJECTIONS,
        floors.NO_EDGES,
        floors.SBM,
    ]
    assert rows[0]["time_ratio"] == 1.0 and rows[0]["temp_ratio"] == 1.0
    for r in rows:
        assert r["median_s"] > 0 and r["temp_bytes"] > 0
        assert r["temp_ratio"] == pytest.approx(r["temp_bytes"] / rows[0]["temp_bytes"])
    assert "native_scratch_bytes" not in rows[2]  # the stand-in runs no kernel


def test_the_block_is_written_between_its_markers_and_the_text_around_kept(floors, tmp_path):
    path = tmp_path / "bench.md"
    path.write_text("# Attention benchmarks\n\nintro\n\n## Other\n\nkept\n")
    floors.write_markdown(path, "table one\n")
    text = path.read_text()
    assert text.index("kept") < text.index(floors.SECTION) < text.index("table one")
    floors.write_markdown(path, "table two\n")
    text = path.read_text()
    assert "table one" not in text and text.count("table two") == 1
    assert text.count(floors.SECTION) == 1 and "intro" in text and "kept" in text


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--density", "0"], "--density"),
        (["--density", "1.5"], "--density"),
        (["--repeats", "0"], "--repeats"),
        (["--cases", "4096"], "--cases"),
        (["--cases", "0:2"], "--cases"),
        (["--markdown", "/"], "--markdown"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(floors, capsys, argv, field):
    with pytest.raises(SystemExit) as exc:
        floors.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
