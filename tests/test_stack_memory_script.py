"""scripts/stack_memory.py: the temp bytes of layer stacks, and its markdown block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sbm_jax.attention import get_attention
from tests.scripts_testing import load_script


@pytest.fixture(scope="module")
def stack():
    return load_script("stack_memory")


def test_one_layer_stack_is_the_layer_plus_its_residual(stack):
    # The 1-layer stack against the layer compiled on its own (its output plus x, the
    # same loss): the same XLA temp bytes, up to the residual add's one [B, n, D] buffer.
    b, n, h, d = 1, 128, 2, 8
    got = stack.stack_temp_bytes("full", 1, b, n, h, d)
    mod = get_attention("full")(num_heads=h, head_dim=d, out_dim=h * d, implementation="chunked")
    x = jax.random.normal(jax.random.PRNGKey(0), (b, n, h * d))
    mask = jnp.ones((b, n), bool)
    params = mod.init(jax.random.PRNGKey(1), x, mask, deterministic=True)["params"]

    def loss(p, x, g, mask):  # the mask an input, as in the script (not a folded constant)
        return jnp.sum((x + mod.apply({"params": p}, x, mask, deterministic=False)) * g)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, x, mask)
    want = lowered.compile().memory_analysis().temp_size_in_bytes
    assert abs(got - want) <= b * n * h * d * 4, (got, want)


def test_the_block_is_written_between_its_markers_and_the_text_around_kept(stack, tmp_path):
    path = tmp_path / "bench.md"
    path.write_text("# Attention benchmarks\n\nintro\n\n## Other\n\nkept\n")
    stack.write_markdown(path, "table one\n")
    text = path.read_text()
    assert text.index("kept") < text.index(stack.SECTION) < text.index("table one")
    stack.write_markdown(path, "table two\n")
    text = path.read_text()
    assert "table one" not in text and text.count("table two") == 1
    assert text.count(stack.SECTION) == 1 and "intro" in text and "kept" in text


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--layers", "1"], "--layers"),
        (["--kinds", "nope"], "--kinds"),
        (["--cases", "4096"], "--cases"),
        (["--cases", "4096:x"], "--cases"),
        (["--markdown", "/"], "--markdown"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(stack, capsys, argv, field):
    with pytest.raises(SystemExit) as exc:
        stack.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
