"""Performer attention, FAVOR+ (Choromanski et al., 2021), O(n m d) for m random features.

Queries and keys are scaled by ``d^-1/4`` (so that ``q'.k' = q.k / sqrt(d)``) and mapped
to m positive features with a random matrix ``W [m, d]`` (rows ``w_r``):

* ``kernel="softmax"``: ``phi(x) = (exp(w_r.x - |x|^2 / 2) + eps) / sqrt(m)``, the
  positive random features whose inner products are unbiased for
  ``exp(q.k / sqrt(d))`` (eps = 0), i.e. softmax attention in expectation. For stability
  the exponent is shifted by its maximum over features for each query, and by its
  maximum over the real keys and features for the keys; both shifts cancel in the
  normalisation (exactly when eps = 0).
* ``kernel="relu"``: ``phi(x) = (relu(w_r.x) + eps) / sqrt(m)`` (the generalised kernel
  the LRA reference configs use).

Attention is then ``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``, computed right to left.
Padded keys are zeroed before the feature map and their features after it, so they
never enter either sum. The keys and values may come from another sequence than the
queries (cross-attention): only the keys' sums depend on them.

Random features: ``W`` has orthogonal rows in blocks of d (QR of Gaussian blocks, rows
rescaled by the norms of independent Gaussian vectors) when ``orthogonal=True``, else iid
Gaussian rows; one ``W`` is shared by all heads. With ``redraw=True`` and a ``sample``
rng stream present, a fresh ``W`` is drawn on every call. Otherwise ``W`` is fixed: drawn
from ``feature_seed`` folded with the module's path, so every layer has its own fixed
features that need no storage, are never touched by the optimiser (or weight decay),
and are the same at training, evaluation and after a checkpoint restore. Note that the
trainer's evaluation step passes a ``sample`` stream too (``training/steps.py``, one key
per evaluation batch), so with ``redraw=True`` every evaluation batch gets its own fresh
``W``: evaluation metrics are then averages over feature draws, not the metrics of one
fixed model (``redraw=False`` evaluates with the fixed features). The ``W`` used
in a call is sown to the ``intermediates`` collection as ``features`` when that
collection is mutable.

``attention_dropout`` is not applied: no attention weights are ever formed (as in the
paper and in the LRA reference code).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import (
    check_int,
    check_positive,
    check_real,
    compute_dtype,
    cross_attention_call,
    project_out,
    project_qkv,
)
from sbm_jax.attention.counting import projection_flops, projection_params
from sbm_jax.attention.registry import register

Array = jax.Array

KERNELS = ("relu", "softmax")


def gaussian_random_features(
    key: Array, num_features: int, dim: int, orthogonal: bool = True
) -> Array:
    """Random projection W [num_features, dim] for FAVOR+.

    Each row is marginally N(0, I_dim). With ``orthogonal``, rows within each block of
    ``dim`` consecutive rows are exactly orthogonal (a Haar-random orthogonal matrix per
    block), and each row's length is that of an independent Gaussian vector.
    """
    check_positive("num_features", num_features)
    if not orthogonal:
        return jax.random.normal(key, (num_features, dim))
    key_blocks, key_norms = jax.random.split(key)
    num_blocks = -(-num_features // dim)
    gaussian = jax.random.normal(key_blocks, (num_blocks, dim, dim))
    q, r = jnp.linalg.qr(gaussian)  # q [nb, d, d] with orthonormal columns
    # Fixing the signs by diag(r) makes each q exactly Haar distributed.
    q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
    rows = jnp.swapaxes(q, -1, -2).reshape(num_blocks * dim, dim)[:num_features]
    lengths = jnp.linalg.norm(jax.random.normal(key_norms, (num_features, dim)), axis=-1)
    return rows * lengths[:, None]


def favor_features(
    x: Array,
    features: Array,
    kernel: str,
    *,
    is_query: bool,
    mask: Array | None = None,
    eps: float = 1e-4,
) -> Array:
    """Positive random features phi(x).

    Args:
      x: [batch, length, heads, d], already scaled by d^-1/4 (and zeroed where padded).
      features: W [m, d].
      kernel: "relu" or "softmax".
      is_query: selects the softmax stabiliser (per query, or over all real keys).
      mask: bool [batch, length]; for keys, only real keys set the stabiliser.
      eps: added to each feature before the 1/sqrt(m) scaling.

    Returns:
      [batch, length, heads, m], entries >= eps / sqrt(m).
    """
    if kernel not in KERNELS:
        raise ValueError(f"model.attention_options.kernel must be one of {KERNELS}, got {kernel!r}")
    ratio = 1.0 / math.sqrt(features.shape[0])
    proj = jnp.einsum("bnhd,md->bnhm", x, features.astype(x.dtype))
    if kernel == "relu":
        return ratio * (jax.nn.relu(proj) + eps)
    half_sq_norm = 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)  # [B, n, H, 1]
    if is_query:
        shift = jnp.max(proj, axis=-1, keepdims=True)
    else:
        if mask is not None:
            proj_real = jnp.where(mask[:, :, None, None], proj, -jnp.inf)
        else:
            proj_real = proj
        shift = jnp.max(proj_real, axis=(1, 3), keepdims=True)  # [B, 1, H, 1]
        shift = jnp.where(jnp.isfinite(shift), shift, 0.0)  # no real key at all
    shift = jax.lax.stop_gradient(shift)  # cancels in the normalisation
    return ratio * (jnp.exp(proj - half_sq_norm - shift) + eps)


def favor_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    features: Array,
    kernel: str = "relu",
    eps: float = 1e-4,
) -> Array:
    """FAVOR+ attention with random features ``features`` [m, d].

    Args:
      q: [batch, n, heads, d] (unscaled: the d^-1/4 scaling is applied here).
      k: [batch, m, heads, d], unscaled (m = n when a sequence attends to itself).
      v: [batch, m, heads, dv].
      mask: bool [batch, m], True for real keys.

    Returns:
      [batch, n, heads, dv]; a query whose normaliser is 0 (only possible with
      eps = 0) outputs 0.
    """
    d = q.shape[-1]
    keep = mask[:, :, None, None]
    scale = d**-0.25
    phi_q = favor_features(q * scale, features, kernel, is_query=True, eps=eps)
    k = jnp.where(keep, k * scale, 0.0)  # padded keys never reach an exponential
    phi_k = favor_features(k, features, kernel, is_query=False, mask=mask, eps=eps)
    phi_k = jnp.where(keep, phi_k, 0.0)
    v = jnp.where(keep, v, 0.0)
    kv = jnp.einsum("bnhm,bnhe->bhme", phi_k, v)  # [B, H, m, dv]
    k_sum = jnp.sum(phi_k, axis=1)  # [B, H, m]
    numerator = jnp.einsum("bnhm,bhme->bnhe", phi_q, kv)
    denominator = jnp.einsum("bnhm,bhm->bnh", phi_q, k_sum)[..., None]
    safe = jnp.where(denominator > 0, denominator, 1.0)
    return numerator / safe


def performer_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head, m = ``num_features``: ``scale 2nd``; ``feature_map 2 * 2ndm``
    (x W^T for Q, K) plus, per entry of the 2 nm features, 4 (softmax kernel: -|x|^2/2,
    -shift, exp, +eps, ``*1/sqrt(m)``; 2nd for the norms) or 3 (relu kernel: relu, +eps,
    scale); ``random_features`` (orthogonal: QR ``4/3 d^3`` per block of d rows, once);
    ``kv 2nmd``; ``normaliser nm + 2nm``; ``aggregation 2nmd``; ``divide nd``."""
    m = int(options["num_features"])
    softmax = options["kernel"] == "softmax"
    per_feature = 4.0 if softmax else 3.0
    norms = 2 * 2.0 * n * d if softmax else 0.0
    blocks = -(-m // d)
    random_features = blocks * (4.0 / 3.0) * d**3 if options["orthogonal"] else 0.0
    return {
        **projection_flops(n, D, H, d),
        "scale": H * 2.0 * n * d,
        "feature_map": H * (2 * 2.0 * n * d * m + 2 * per_feature * n * m + norms),
        "random_features": random_features,
        "kv": H * 2.0 * n * m * d,
        "normaliser": H * (n * m + 2.0 * n * m),
        "aggregation": H * 2.0 * n * m * d,
        "divide": H * n * d,
    }


def performer_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections (the random features are not parameters)."""
    return projection_params(D, H, d)


@register("performer", flops=performer_flops, params=performer_params)
class PerformerAttention(nn.Module):
    """FAVOR+ attention (Performer).

    Options: ``num_features`` (m, default 256), ``kernel`` ("relu" as the LRA reference
    configs, or "softmax"), ``redraw`` (fresh features from the ``sample`` stream each
    call when that stream is given), ``orthogonal`` (orthogonal random features),
    ``kernel_epsilon`` (added to every feature), ``feature_seed`` (seed of the fixed
    features).
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    num_features: int = 256
    kernel: str = "relu"
    redraw: bool = True
    orthogonal: bool = True
    kernel_epsilon: float = 1e-4
    feature_seed: int = 0

    def fixed_features_key(self) -> Array:
        """PRNG key of the fixed features: ``feature_seed`` folded with the module path."""
        assert self.scope is not None, "fixed_features_key needs a bound module"
        path = "/".join(str(p) for p in self.scope.path)
        tag = zlib.crc32(path.encode()) & 0x7FFFFFFF
        return jax.random.fold_in(jax.random.key(self.feature_seed), tag)

    def validate(self) -> None:
        """Raise ValueError naming the bad option (the config check calls it too)."""
        check_int("model.attention_options.num_features", self.num_features)
        if self.kernel not in KERNELS:
            raise ValueError(
                f"model.attention_options.kernel must be one of {KERNELS}, got {self.kernel!r}"
            )
        check_real("model.attention_options.kernel_epsilon", self.kernel_epsilon)
        for name in ("redraw", "orthogonal"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"model.attention_options.{name} must be True or False, "
                    f"got {getattr(self, name)!r}"
                )

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        mask: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """x [B, n, dim], mask [B, n] (True = real) -> [B, n, out_dim]; or across two
        sequences, inputs_k / inputs_v [B, m, dim] with a key mask -> [B, n, out_dim]."""
        del deterministic  # features follow `redraw` and the `sample` stream instead
        x, x_k, x_v, mask, _ = cross_attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        self.validate()
        q, k, v = project_qkv(x, self.num_heads, self.head_dim, self.dtype, x_k, x_v)
        if self.redraw and self.has_rng("sample"):
            key = self.make_rng("sample")
        else:
            key = self.fixed_features_key()
        ct = compute_dtype(self.dtype)
        features = gaussian_random_features(
            key, self.num_features, self.head_dim, self.orthogonal
        ).astype(ct)
        self.sow("intermediates", "features", features)
        out = favor_attention(
            q.astype(ct),
            k.astype(ct),
            v.astype(ct),
            mask,
            features,
            self.kernel,
            self.kernel_epsilon,
        )
        return project_out(out, self.out_dim, self.dtype)
