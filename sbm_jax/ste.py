"""Straight-through estimators for the sampled mask (paper eq. 9 and the released code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The estimators of ``SBMAttention(ste=...)``: ``"paper"`` (eq. 9, the mask scales the
#: logit), ``"reference"`` (the authors' released code: the mask multiplies the
#: post-softmax weights, rows are renormalised, the cotangent is clipped to [-1, 1]) and
#: ``"pairs"`` (ours, not in the paper: every real pair, sampled or not, gets the
#: first-order change of the loss when flipped; :mod:`sbm_jax.kernels.dense` on the
#: dense path, :mod:`sbm_jax.kernels.pairs` with probe keys on an edge list).
STE_MODES = ("paper", "reference", "pairs")


def check_ste(ste: str, field: str = "ste") -> None:
    """Raise a ValueError naming ``field`` unless ``ste`` is one of :data:`STE_MODES`."""
    if ste not in STE_MODES:
        raise ValueError(f"{field}={ste!r} is not an estimator; choose one of {STE_MODES}")


def straight_through(p: jax.Array) -> jax.Array:
    """Ones in the forward pass; the incoming gradient goes to ``p`` unchanged.

    Used as ``edge_scale=straight_through(p_e)`` on sampled edges, the score of edge
    ``e`` is ``1 * s_e`` in the forward pass while ``dL/dp_e = dL/da_e * s_e``
    (paper eq. 9), where ``a_e = M_e * s_e``.

    Written as ``1 + (p - stop_gradient(p))`` (exactly 1 for finite ``p``) rather than
    as a ``custom_vjp`` returning a constant: under ``vmap`` such a constant output is
    unbatched, so its cotangent arrives summed over the mapped axis and every example
    and head would receive the sum of all their gradients. This form stays batched
    like ``p``.
    """
    return 1.0 + (p - jax.lax.stop_gradient(p))


@jax.custom_vjp
def clip_cotangent(x: jax.Array) -> jax.Array:
    """Identity in the forward pass; the backward pass clips the cotangent to [-1, 1].

    ``clip_cotangent(straight_through(p))`` is the released code's estimator of the
    mask ``M`` (``torch`` ``hardtanh(M * dL/dM)`` with ``M = 1`` on a sampled edge): the
    total cotangent of ``M`` on the edge (attention and density terms together) is
    clipped before it reaches ``p``. The output is ``x`` itself, so under ``vmap`` it is
    batched like ``x`` and every mapped graph keeps its own cotangent.
    """
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -1.0, 1.0),)


clip_cotangent.defvjp(_clip_fwd, _clip_bwd)


def mask_estimator(p: jax.Array, ste: str) -> jax.Array:
    """``M_ste``: 1 in the forward pass, the estimator ``ste`` of the mask backward.

    ``"paper"``: ``straight_through(p)`` (eq. 9); ``"reference"``: the same with its
    cotangent clipped to [-1, 1] (:func:`clip_cotangent`). Edge logits are then
    ``s_e * M_ste`` (paper) or ``s_e + (M_ste - 1)`` (reference, i.e. ``s_e + log M``
    with the derivative ``d logit / dM = 1`` of a mask on the post-softmax weights), see
    :func:`edge_logit_terms`.
    """
    check_ste(ste)
    m = straight_through(p)
    return clip_cotangent(m) if ste == "reference" else m


def edge_logit_terms(m_ste: jax.Array, ste: str) -> dict[str, jax.Array]:
    """Keyword arguments of the edge kernels that put ``M_ste`` on the logits.

    ``"paper"``: ``{"edge_scale": M}`` (logit ``s_e * M_e``, eq. 9: ``dL/dM = dL/da * s``);
    ``"reference"`` and ``"pairs"``: ``{"edge_bias": M - 1}`` (logit ``s_e + M_e - 1``:
    the softmax masked by ``M`` after it and renormalised, ``dL/dM = dL/da``; the pairs
    estimator adds the absent pairs with :func:`sbm_jax.kernels.pairs.with_absent_pairs`).
    """
    check_ste(ste)
    if ste == "paper":
        return {"edge_scale": m_ste}
    return {"edge_bias": m_ste - 1.0}
