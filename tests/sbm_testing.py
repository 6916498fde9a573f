"""Shared references of the SBM layer tests: the dense reference on the layer's own graphs
(eq. 9 and the released code's estimator, written out here independently of the layer).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sbm_jax.attention.sbm import forced_edge_keys
from sbm_jax.fastrg import make_plan


def reference_mask_sample(mask):
    """The released code's ``SampleGraphSparseGraph`` on a given mask: the forward pass is
    the (already drawn) binary mask, the backward pass ``hardtanh(M * dL/dM)`` to p."""
    m = jnp.asarray(mask, jnp.float32)

    @jax.custom_vjp
    def sample(p):
        del p
        return m

    sample.defvjp(lambda p: (m, None), lambda _, ct: (jnp.clip(m * ct, -1.0, 1.0),))
    return sample


def reference_attention(q, k, v, p, mask, key_mask):
    """The released code's attention (``attention_sbm.py``, dense branch), in jax:
    softmax over the real keys, times the sampled mask, L1-renormalised (eps 1e-12);
    returns the output and the mask value (for the density, inside the same backward)."""
    graph = reference_mask_sample(mask)(p)
    dot = (q @ k.T) / np.sqrt(q.shape[-1])
    dot = jnp.where(jnp.asarray(key_mask)[None, :], dot, -jnp.inf)
    attn = jax.nn.softmax(dot, axis=-1) * graph
    attn = attn / jnp.maximum(jnp.sum(jnp.abs(attn), axis=-1, keepdims=True), 1e-12)
    return attn @ v, graph


@partial(jax.jit, static_argnames="law")  # one program, not op-by-op compiles
def plans_and_counts(rng, qm, blk, km, mask, *, law, delta):
    """The layer's sampling plans per (example, head) and its Poisson count per query row,
    drawn from ``rng`` as the layer draws them (the first half of ``split(rng)``):
    memberships ``[B, H, L, k]``, block ``[H, k, k]``, padding mask ``[B, L]``."""
    plans = jax.vmap(
        jax.vmap(
            lambda a, s_, c, mk: make_plan(a, s_, c, delta=delta, q_mask=mk, k_mask=mk, law=law),
            in_axes=(0, 0, 0, None),
        ),
        in_axes=(0, None, 0, 0),
    )(qm, blk, km, mask)
    counts = jax.random.poisson(jax.random.split(rng)[0], plans.row_rate).astype(jnp.int32)
    return plans, counts


def same_graphs_dense_loss(
    rng,
    q,
    k,
    v,
    qm,
    blk,
    km,
    g,
    wd,
    *,
    mask,
    law,
    delta,
    capacity,
    dense,
    ste="paper",
    forced=None,
):
    """Independent reference: per (example, head), dense ``p = Qhat S Khat^T`` and dense
    attention on the graph the layer samples (same rng derivation). ``ste="paper"``:
    eq. 9 through ``dense_masked_attention``; ``"reference"``: the released code's
    post-softmax mask with its clipped backward (:func:`reference_attention`).
    ``forced``: ``(self_loops, window)`` of the forced edges; ``mask [B, L]`` the
    padding mask the layer saw. Returns ``(loss, masks)``; ``loss.heads_fn`` gives the
    per-head outputs and densities."""
    from sbm_jax.fastrg import sample_from_plan
    from sbm_jax.kernels.dense import streamed_mask

    length = mask.shape[1]
    self_loops, window = forced if forced is not None else (False, 0)
    half = window // 2 if window > 0 else (0 if self_loops else None)
    batch, heads = q.shape[:2]
    k_sample = jax.random.split(rng)[1]
    keys = jax.random.split(k_sample, (batch, heads))
    plans, counts = plans_and_counts(rng, qm, blk, km, mask, law=law, delta=delta)

    def graph(key, plan, count, q_mask):  # one (example, head): [L, L] bool
        if dense:  # the streamed dense path's mask (sbm_jax.kernels.dense)
            kc = plan.ys.shape[1]
            return streamed_mask(
                key, plan.ys, plan.z[:, :kc], q_mask, q_mask, delta, law=law, forced_half=half
            )
        fk = forced_edge_keys(q_mask, q_mask, self_loops=self_loops, window=window)
        e = sample_from_plan(key, plan, count, capacity=capacity, law=law, forced_keys=fk)
        return jnp.zeros((length, length), bool).at[e.rows, e.cols].max(e.valid)

    masks = np.asarray(
        jax.jit(jax.vmap(jax.vmap(graph, in_axes=(0, 0, 0, None))))(keys, plans, counts, mask)
    )
    return dense_loss_on_masks(masks, g, wd, mask=mask, ste=ste), masks


def streamed_masks(rng, qm, blk, km, mask, *, law, delta, cfg):
    """The ``[B, H, L, L]`` graphs ``impl="streamed"`` (:mod:`sbm_jax.kernels.streamed`,
    settings ``cfg``) draws from ``rng``, rebuilt block by block, and each block's
    choice ``[B, H, blocks]`` (a buffer index; ``len(cfg.capacities)``: dense)."""
    from sbm_jax.fastrg import needs_dense
    from sbm_jax.kernels.dense import default_block_rows, streamed_mask
    from sbm_jax.kernels.streamed import _DENSE_SALT, _blocked_inputs, block_edge_keys

    batch, heads, length = qm.shape[:3]
    bq = cfg.block_rows
    plans, counts = plans_and_counts(rng, qm, blk, km, mask, law=law, delta=delta)
    keys = jax.random.split(jax.random.split(rng)[1], (batch, heads))
    sparse = jax.jit(block_edge_keys, static_argnums=(0, 4))
    dense = jax.jit(
        streamed_mask, static_argnames=("law", "forced_half", "block_rows", "row_offset")
    )
    caps = cfg.capacities
    masks = np.zeros((batch, heads, length, length), bool)
    choices = []
    for b in range(batch):
        for h in range(heads):
            plan = jax.tree.map(lambda a, b=b, h=h: a[b, h], plans)
            key = keys[b, h]
            xs = _blocked_inputs(cfg, plan, counts[b, h], jnp.zeros((length, 1)))
            for blk_i in range(xs["b"].shape[0]):
                x = {name: a[blk_i] for name, a in xs.items()}
                total = int(np.sum(x["counts"]))
                choice = sum(c < total for c in caps)
                if bool(needs_dense(plan, law)) and cfg.dense:
                    choice = len(caps)
                choice = min(choice, len(caps) if cfg.dense else len(caps) - 1)
                choices.append(choice)
                lo, hi = blk_i * bq, min(length, (blk_i + 1) * bq)
                if choice < len(caps):
                    e = np.asarray(sparse(cfg, key, plan, x, caps[choice]))
                    e = e[e < bq * length]
                    masks[b, h, lo + e // length, e % length] = True
                else:
                    kc = plan.ys.shape[1]
                    dkey = jax.random.fold_in(jax.random.fold_in(key, blk_i), _DENSE_SALT)
                    block_mask = dense(
                        dkey, x["ys"], plan.z[:, :kc], x["q_mask"], plan.k_mask, delta,
                        law=law, forced_half=None if cfg.forced_half < 0 else cfg.forced_half,
                        block_rows=default_block_rows(bq, length), row_offset=lo,
                    )  # fmt: skip
                    masks[b, h, lo:hi] = np.asarray(block_mask)[: hi - lo]
    return masks, np.asarray(choices).reshape(batch, heads, -1)


def dense_loss_on_masks(masks, g, wd, *, mask, ste="paper"):
    """The dense reference loss ``sum(out * g) + sum(wd * density)`` on given graphs
    ``masks [B, H, L, L]`` (see :func:`same_graphs_dense_loss`); ``loss.heads_fn`` gives
    the per-head outputs and densities."""
    from sbm_jax.edge_ops import dense_masked_attention

    batch, heads = masks.shape[:2]
    real_mask = np.asarray(mask)  # numpy: the loss below is traced under jit

    def heads_fn(q, k, v, qm, blk, km):  # -> out [B, H, L, d], density [B, H]
        outs, dens = [], []
        for b in range(batch):
            real = np.outer(real_mask[b], real_mask[b])
            for hh in range(heads):
                mq = qm[b, hh] * real_mask[b][:, None]
                mk = km[b, hh] * real_mask[b][:, None]
                p = mq @ blk[hh] @ mk.T
                mask = jnp.asarray(masks[b, hh])
                if ste == "paper":
                    scale = 1.0 + (p - jax.lax.stop_gradient(p))  # eq. 9, per pair
                    out = dense_masked_attention(q[b, hh], k[b, hh], v[b, hh], mask, scale=scale)
                    edges = jnp.sum(jnp.where(mask, scale, 0.0))
                else:
                    out, m_val = reference_attention(
                        q[b, hh], k[b, hh], v[b, hh], p, masks[b, hh], real_mask[b]
                    )
                    edges = jnp.sum(m_val)
                outs.append(out)
                dens.append(edges / real.sum())
        shape = (batch, heads)
        return jnp.stack(outs).reshape(*shape, *outs[0].shape), jnp.stack(dens).reshape(shape)

    def loss(q, k, v, qm, blk, km):
        out, density = heads_fn(q, k, v, qm, blk, km)
        return jnp.sum(out * g) + jnp.sum(wd * density)

    loss.heads_fn = heads_fn
    return loss
