"""fastRG's sampling plan: the rates, the bernoulli bound and the search tables of one
(query set, key set) pair, built in O(nk + k^2) (plus O(nk^2) for ``Y S``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbm_jax._pytree import PyTreeDataclass
from sbm_jax._scopes import PLAN, scoped
from sbm_jax.fastrg.search import ROW_GUIDE_SPAN, _guide_table, weight_cdf

LAWS = ("bernoulli", "poisson")
# Above this row bound on p + delta the bernoulli oversampling factor c = -log(1-q)/q
# exceeds ~5.3 (and diverges at 1): such graphs are drawn densely instead.
BERNOULLI_MAX_BOUND = 0.995


class SamplingPlan(PyTreeDataclass):
    """Everything fastRG needs for one (query set, key set) pair, O(nk + k^2).

    Shapes: ``n`` queries, ``m`` keys, ``k`` clusters, ``K = k + 1`` with the
    exploration cluster.
    """

    y: jax.Array  # [n, K] masked query memberships, last column = q_mask (delta cluster)
    z: jax.Array  # [m, K] masked key memberships, last column = k_mask
    ys: jax.Array  # [n, k] Y S: per-edge probability is ys[i] . z[j, :k]
    # The search tables (None in a plan made with ``tables=False``; see :func:`with_tables`):
    zcdf: jax.Array | None  # [K, m] per-cluster cumulative membership of keys
    zguide: jax.Array | None  # [K, G + 1] int32: first key j with zcdf[v, j] > t * total_v / G
    row_cdf: jax.Array | None  # [n, K] per-row cumulative weights of the key clusters
    row_guide: jax.Array | None  # [n, G' + 1] int32: guide table of row_cdf (ROW_GUIDE_SPAN)
    row_rate: jax.Array  # [n] mean draws of row i: c_i sum_j (p_ij + delta)
    expected_edges: jax.Array  # [] sum of (p + delta) over all pairs
    expected_draws: jax.Array  # [] mean Poisson draw count: sum of c_i (p_ij + delta)
    oversample: jax.Array  # [n] c_i: row i is drawn at rate c_i (p_ij + delta)
    bound: jax.Array  # [] max_i q_i, the largest row bound on p + delta (bernoulli law)
    delta: jax.Array  # [] exploration probability
    q_mask: jax.Array  # [n] bool
    k_mask: jax.Array  # [m] bool


def check_law(law: str, field: str = "law") -> None:
    """Raise a ValueError naming ``field`` unless ``law`` is a known edge law."""
    if law not in LAWS:
        raise ValueError(f"{field}={law!r} is not an edge law; choose one of {LAWS}")


@scoped(PLAN)
def make_plan(
    q_memberships: jax.Array,
    block: jax.Array,
    k_memberships: jax.Array,
    *,
    delta: float | jax.Array = 0.0,
    q_mask: jax.Array | None = None,
    k_mask: jax.Array | None = None,
    law: str = "bernoulli",
    tables: bool = True,
) -> SamplingPlan:
    """Precompute fastRG's CDFs and rates. Costs O(nk + k^2) (plus O(nk^2) for Y S).

    ``tables=False`` leaves out the search tables (``zcdf``, ``zguide``, ``row_cdf``,
    ``row_guide``, four ``[n, K]``-sized arrays): the rates, bound and memberships are
    all that the draw counts and the path choice need, and :func:`with_tables` adds the
    tables later, where the graph is sampled. The layer builds its plans for every
    (example, head) at once but samples the graphs one at a time on CPU, so the tables
    then exist for one graph at a time.
    """
    check_law(law)
    n, k = q_memberships.shape
    m = k_memberships.shape[0]
    f32 = jnp.float32
    q_mask = jnp.ones((n,), bool) if q_mask is None else q_mask.astype(bool)
    k_mask = jnp.ones((m,), bool) if k_mask is None else k_mask.astype(bool)
    yq = q_memberships.astype(f32) * q_mask[:, None]
    zk = k_memberships.astype(f32) * k_mask[:, None]
    block = block.astype(f32)
    delta = jnp.asarray(delta, f32)

    y = jnp.concatenate([yq, q_mask[:, None].astype(f32)], axis=1)
    z = jnp.concatenate([zk, k_mask[:, None].astype(f32)], axis=1)
    ys = yq @ block
    # The draws are discrete: only ys and z (the per-edge probabilities) carry gradients.
    sg = jax.lax.stop_gradient
    if law == "bernoulli":
        # Per-row bound q_i >= max_j (p_ij + delta); oversampling row i by
        # c_i = -log(1 - q_i) / q_i keeps the rate matrix low rank (diag(c) Y S Z^T) and
        # costs extra draws only on the rows whose bound is high.
        row_bound = (row_max_bound(sg(ys), sg(zk)) + sg(delta)) * q_mask * jnp.any(k_mask)
        safe = jnp.clip(row_bound, 1e-6, 1.0 - 1e-7)
        oversample = jnp.where(row_bound > 1e-6, -jnp.log1p(-safe) / safe, 1.0)
        bound = jnp.max(row_bound, initial=0.0)
    else:
        bound = jnp.asarray(0.0, f32)
        oversample = jnp.ones((n,), f32)
    row_total = jnp.sum(_row_weights(ys, z, delta, q_mask), axis=1)
    row_rate = oversample * row_total
    expected = jnp.sum(row_total)

    plan = SamplingPlan(
        y=y,
        z=z,
        ys=ys,
        zcdf=None,
        zguide=None,
        row_cdf=None,
        row_guide=None,
        row_rate=row_rate,
        expected_edges=expected,
        expected_draws=jnp.sum(row_rate),
        oversample=oversample.astype(f32),
        bound=bound.astype(f32),
        delta=delta,
        q_mask=q_mask,
        k_mask=k_mask,
    )
    return with_tables(plan) if tables else plan


def _row_weights(ys: jax.Array, z: jax.Array, delta: jax.Array, q_mask: jax.Array) -> jax.Array:
    """``[n, K]``: row ``i`` draws key cluster ``v`` with weight ``(Y Sbar)_iv sum_j z_jv``
    and, inside it, key ``j`` with weight ``z_jv``: in all, pair ``(i, j)`` gets
    ``(Y Sbar Z^T)_ij = p_ij + delta``. ``Sbar`` is ``S`` with ``delta`` appended on the
    diagonal, so ``Y Sbar = [Y S, q_mask * delta]``: no second ``[n, K] x [K, K]``
    product. The draws are discrete: no gradient flows through the weights."""
    sg = jax.lax.stop_gradient
    f32 = jnp.float32
    y_sbar = jnp.concatenate([sg(ys), (q_mask * sg(delta))[:, None].astype(f32)], axis=1)
    return y_sbar * jnp.sum(sg(z), axis=0)[None, :]


@scoped(PLAN)
def with_tables(plan: SamplingPlan) -> SamplingPlan:
    """``plan`` with its search tables (per-cluster key CDFs, per-row cluster CDFs and
    their guide tables), built if :func:`make_plan` left them out (``tables=False``).

    The row CDFs' totals equal :attr:`SamplingPlan.row_rate` over the oversampling up to
    rounding (sums in another order): each search normalises by its own table's total,
    so the law is that of the weights either way.
    """
    if plan.zcdf is not None and plan.row_cdf is not None:
        return plan
    zcdf = weight_cdf(jax.lax.stop_gradient(plan.z), axis=0).T
    row_cdf = weight_cdf(_row_weights(plan.ys, plan.z, plan.delta, plan.q_mask), axis=1)
    return plan.replace(
        zcdf=zcdf,
        zguide=_guide_table(zcdf),
        row_cdf=row_cdf,
        row_guide=_guide_table(row_cdf, ROW_GUIDE_SPAN),
    )


#: Relative slack on the Cauchy-Schwarz bound, so that float32 rounding of the norms can
#: never put it below a computed ``p_ij`` (both are exact to a few ulps).
_CS_SLACK = 2.0**-16


def row_max_bound(ys: jax.Array, zk: jax.Array) -> jax.Array:
    """``[n]`` upper bound on ``max_j p_ij = max_j ys_i . zk_j`` in O((n + m) k).

    The smaller of two bounds, each exact for nonnegative memberships: the per-cluster
    maximum ``ys_i . max_j zk_j`` (tight when memberships are peaked) and Cauchy-Schwarz
    ``|ys_i| max_j |zk_j|`` (tight when every key's memberships point the same way, as
    they do early in training). Masked keys
    have zero memberships and never raise either bound.
    """
    by_cluster = ys @ jnp.max(zk, axis=0)
    norm_z = jnp.sqrt(jnp.max(jnp.sum(zk * zk, axis=1)))
    by_norm = jnp.sqrt(jnp.sum(ys * ys, axis=1)) * norm_z * (1.0 + _CS_SLACK)
    return jnp.minimum(by_cluster, by_norm)


def draw_row_counts(key: jax.Array, plan: SamplingPlan) -> jax.Array:
    """Draws per query row, ``[n] int32``, independent ``Poisson(plan.row_rate)``.

    Their sum is ``Poisson(plan.expected_draws)``; passing them to :func:`sample_edge_keys`
    saves it the multinomial split of a total.
    """
    return jax.random.poisson(key, plan.row_rate).astype(jnp.int32)


def split_count(key: jax.Array, plan: SamplingPlan, count: jax.Array) -> jax.Array:
    """``count`` draws split over the rows, ``Multinomial(count, row_rate / sum)``, [n]."""
    total = jnp.sum(plan.row_rate)
    uniform = 1.0 / plan.row_rate.size
    probs = jnp.where(total > 0, plan.row_rate / jnp.maximum(total, 1e-30), uniform)
    counts = jax.random.multinomial(key, jnp.asarray(count, jnp.float32), probs)
    return counts.astype(jnp.int32)


def needs_dense(plan: SamplingPlan, law: str) -> jax.Array:
    """True where the bernoulli bound is too close to 1 for oversampling."""
    if law == "bernoulli":
        return plan.bound > BERNOULLI_MAX_BOUND
    return jnp.asarray(False)
