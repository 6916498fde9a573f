"""Nystromformer attention (Xiong et al., 2021), O(n m d + m^3) for m landmarks.

With ``Q, K`` scaled by ``d^-1/4`` and landmarks ``Q~, K~ [m, d]`` (segment means of the
queries and keys), softmax attention is approximated by

    out = softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V  (+ conv(V)),

where ``pinv`` is the iterative Moore-Penrose pseudo-inverse of the reference code
(``pinv_iterations`` steps, 6 there) and ``conv`` an optional depthwise convolution of
the values along the sequence, one kernel of ``conv_kernel_size`` taps per head (35 in
the LRA reference configs; 0 disables it).

Landmarks and padding: the sequence is cut into segments of
``s = ceil(n / num_landmarks)`` positions, giving ``m = ceil(n / s) <= num_landmarks``
landmarks (the last segment is padded when s does not divide n, as the public reference
implementations do; segments lying wholly past the end would be empty and are not
made), and each landmark is the mean of the *real* tokens of its segment. A segment
without real tokens gives an empty landmark: its columns of the first two kernels are
masked out and its row of the middle kernel is replaced by the identity row, so it
drops out of the product exactly. Padded keys are masked out of the third kernel and
padded values are zeroed before the convolution, so the *content* of padded positions
never reaches a real query. The *amount* of padding does: the segments are cut from the
padded length n, so appending padding changes ``s`` and moves the segment boundaries,
hence the landmarks and every real token's output (and past ``n > num_landmarks`` it
switches from exact attention to the approximation). Outputs are invariant to padded
content, not to the padded length.
With ``num_landmarks >= n`` every segment would hold one token and the approximation
would equal softmax attention only once the pseudo-inverse converged; softmax attention
(over the real keys) is then computed exactly instead, as the reference implementation
does when the landmarks equal the sequence length (n is the padded length).

``attention_dropout`` is applied to the query-to-landmark weights softmax(Q K~^T).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import (
    HEADS,
    attention_call,
    check_int,
    compute_dtype,
    dropout_weights,
    masked_softmax,
    named,
    project_out,
    project_qkv,
)
from sbm_jax.attention.counting import SOFTMAX, projection_flops, projection_params
from sbm_jax.attention.registry import register

Array = jax.Array


def segment_landmarks(x: Array, mask: Array, num_landmarks: int) -> tuple[Array, Array]:
    """Landmarks as means of the real tokens in ``num_landmarks`` equal segments.

    Args:
      x: [batch, heads, length, d].
      mask: bool [batch, length], True for real tokens.
      num_landmarks: m <= length; segments have ceil(length / m) positions, the tail is
        padded.

    Returns:
      (landmarks [batch, heads, m, d], landmark_mask bool [batch, m]); an empty segment
      gives a zero landmark and False in the mask.
    """
    batch, heads, length, d = x.shape
    segment = -(-length // num_landmarks)
    extra = num_landmarks * segment - length
    x = jnp.where(mask[:, None, :, None], x, 0.0)
    if extra:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, extra)))
    sums = jnp.sum(x.reshape(batch, heads, num_landmarks, segment, d), axis=3)
    counts = jnp.sum(mask.reshape(batch, num_landmarks, segment), axis=-1)
    means = sums / jnp.maximum(counts, 1).astype(x.dtype)[:, None, :, None]
    return means, counts > 0


def iterative_pinv(a: Array, num_iterations: int = 6) -> Array:
    """Moore-Penrose pseudo-inverse of a [..., m, m] by the reference's iteration.

    ``V_0 = A^T / (||A||_1 ||A||_inf)`` (for a row-stochastic A this is the reference's
    ``A^T / max column sum``), then
    ``V <- V (13 I - A V (15 I - A V (7 I - A V))) / 4``, which converges to pinv(A).
    """
    if num_iterations < 0:
        raise ValueError(
            f"model.attention_options.pinv_iterations must be >= 0, got {num_iterations}"
        )
    m = a.shape[-1]
    eye = jnp.eye(m, dtype=a.dtype)
    abs_a = jnp.abs(a)
    norm_1 = jnp.max(jnp.sum(abs_a, axis=-2), axis=-1)
    norm_inf = jnp.max(jnp.sum(abs_a, axis=-1), axis=-1)
    v = jnp.swapaxes(a, -1, -2) / (norm_1 * norm_inf)[..., None, None]

    def step(_: int, v: Array) -> Array:
        av = a @ v
        return 0.25 * v @ (13.0 * eye - av @ (15.0 * eye - av @ (7.0 * eye - av)))

    return jax.lax.fori_loop(0, num_iterations, step, v)


def nystrom_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    num_landmarks: int,
    pinv_iterations: int = 6,
    landmark_weights_fn: Callable[[Array], Array] | None = None,
) -> Array:
    """Nystrom approximation of softmax attention (without the convolution skip).

    Args:
      q, k: [batch, length, heads, d] (unscaled).
      v: [batch, length, heads, dv].
      mask: bool [batch, length], True for real tokens.
      num_landmarks: upper bound on the landmarks; segments have
        ceil(length / num_landmarks) positions and there are ceil(length / segment) of them.
      pinv_iterations: iterations of the pseudo-inverse.
      landmark_weights_fn: optional map applied to softmax(Q K~^T) [B, H, n, m]
        (attention dropout).

    Returns:
      [batch, length, heads, dv].
    """
    length, d = q.shape[1], q.shape[-1]
    segment = -(-length // num_landmarks)
    m = -(-length // segment)  # no segment lies wholly past the end
    scale = d**-0.25
    keep = mask[:, :, None, None]
    q = jnp.swapaxes(jnp.where(keep, q * scale, 0.0), 1, 2)  # [B, H, n, d]
    k = jnp.swapaxes(jnp.where(keep, k * scale, 0.0), 1, 2)
    v = jnp.swapaxes(jnp.where(keep, v, 0.0), 1, 2)
    if length <= num_landmarks:
        # Every token is its own landmark: the approximation would be exact only once the
        # pseudo-inverse converged (rel. error 1e-2 after 6 iterations at n = 128), so
        # compute softmax attention exactly, as the reference code does when the
        # landmarks equal the sequence length. The weights are the query-to-landmark ones.
        weights = masked_softmax(q @ jnp.swapaxes(k, -1, -2), mask[:, None, None, :])
        if landmark_weights_fn is not None:
            weights = landmark_weights_fn(weights)
        return jnp.swapaxes(weights @ v, 1, 2)
    q_land, land_mask = segment_landmarks(q, mask, m)  # [B, H, m, d], [B, m]
    k_land, _ = segment_landmarks(k, mask, m)
    col_mask = land_mask[:, None, None, :]  # [B, 1, 1, m]
    kernel_1 = masked_softmax(q @ jnp.swapaxes(k_land, -1, -2), col_mask)  # [B, H, n, m]
    kernel_2 = masked_softmax(q_land @ jnp.swapaxes(k_land, -1, -2), col_mask)  # [B, H, m, m]
    eye = jnp.eye(m, dtype=kernel_2.dtype)
    kernel_2 = jnp.where(land_mask[:, None, :, None], kernel_2, eye)  # empty rows -> I
    kernel_3 = masked_softmax(q_land @ jnp.swapaxes(k, -1, -2), mask[:, None, None, :])
    if landmark_weights_fn is not None:
        kernel_1 = landmark_weights_fn(kernel_1)
    out = kernel_1 @ (iterative_pinv(kernel_2, pinv_iterations) @ (kernel_3 @ v))
    return jnp.swapaxes(out, 1, 2)


def nystromformer_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head, ``s = ceil(n / L)``, ``m = ceil(n / s)`` landmarks:
    ``scale 2nd``; ``landmarks 2(nd + md)`` (segment sums and means of Q and K);
    ``scores 2nmd + 2m^2 d + 2mnd`` (three kernels); ``softmax 5(nm + m^2 + mn)``;
    ``pinv 4m^2 + I (8 m^3 + 4 m^2)`` (start: abs, row and column sums, divide; I
    iterations of 4 m x m products, ``A V`` once and three products by it or by V, plus 3
    subtractions and the scale 1/4; the scaled identities are constants);
    ``aggregation 2mnd + 2m^2 d + 2nmd`` (right to left); ``conv 2ndK`` (depthwise skip,
    kernel K, 0 when off). When ``n <= L`` the layer computes exact softmax attention:
    ``scale 2nd``; ``scores 2n^2 d``; ``softmax 5n^2``; ``aggregation 2n^2 d``; ``conv``
    (no landmarks, no pseudo-inverse)."""
    segment = -(-n // int(options["num_landmarks"]))
    m = -(-n // segment)
    iters = int(options["pinv_iterations"])
    conv = int(options["conv_kernel_size"])
    if n <= int(options["num_landmarks"]):  # exact softmax attention
        return {
            **projection_flops(n, D, H, d),
            "scale": H * 2.0 * n * d,
            "landmarks": 0.0,
            "scores": H * 2.0 * n * n * d,
            "softmax": H * SOFTMAX * n * n,
            "pinv": 0.0,
            "aggregation": H * 2.0 * n * n * d,
            "conv": H * 2.0 * n * d * conv,
        }
    return {
        **projection_flops(n, D, H, d),
        "scale": H * 2.0 * n * d,
        "landmarks": H * 2.0 * (n * d + m * d),
        "scores": H * (2.0 * n * m * d + 2.0 * m * m * d + 2.0 * m * n * d),
        "softmax": H * SOFTMAX * (n * m + m * m + m * n),
        "pinv": H * (4.0 * m * m + iters * (8.0 * m**3 + 4.0 * m * m)),
        "aggregation": H * (2.0 * m * n * d + 2.0 * m * m * d + 2.0 * n * m * d),
        "conv": H * 2.0 * n * d * conv,
    }


def nystromformer_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections, plus the depthwise value conv (K taps per head)."""
    return projection_params(D, H, d) + H * int(options["conv_kernel_size"])


@register("nystromformer", flops=nystromformer_flops, params=nystromformer_params)
class NystromformerAttention(nn.Module):
    """Nystromformer attention with segment-mean landmarks.

    Options: ``num_landmarks`` (default 256), ``pinv_iterations`` (default 6, as the
    reference), ``conv_kernel_size`` (depthwise value convolution skip, default 35;
    0 disables it).
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    num_landmarks: int = 256
    pinv_iterations: int = 6
    conv_kernel_size: int = 35

    def validate(self) -> None:
        """Raise ValueError naming the bad option (the config check calls it too)."""
        check_int("model.attention_options.num_landmarks", self.num_landmarks)
        check_int("model.attention_options.pinv_iterations", self.pinv_iterations, minimum=0)
        check_int("model.attention_options.conv_kernel_size", self.conv_kernel_size, minimum=0)

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
        """x [B, n, dim], mask [B, n] (True = real) -> [B, n, out_dim]."""
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        self.validate()
        q, k, v = project_qkv(x, self.num_heads, self.head_dim, self.dtype)
        ct = compute_dtype(self.dtype)
        q, k, v = q.astype(ct), k.astype(ct), v.astype(ct)
        out = nystrom_attention(
            q,
            k,
            v,
            mask,
            self.num_landmarks,
            self.pinv_iterations,
            lambda w: dropout_weights(self, w, self.attention_dropout, deterministic),
        )
        if self.conv_kernel_size:
            out = out + self._value_conv(jnp.where(mask[:, :, None, None], v, 0.0))
        return project_out(out, self.out_dim, self.dtype)

    def _value_conv(self, v: Array) -> Array:
        """Depthwise conv along the sequence, one kernel per head: [B, n, H, d] -> same."""
        size = self.conv_kernel_size
        conv = nn.Conv(
            features=self.num_heads,
            kernel_size=(size, 1),
            feature_group_count=self.num_heads,
            padding=(((size - 1) // 2, size // 2), (0, 0)),
            use_bias=False,
            # PyTorch's Conv2d default, as in the reference: U(+-1/sqrt(fan_in)); the
            # kernel [size, 1, 1, H] holds one filter per head (the output channel).
            kernel_init=named(
                nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
                "conv_length",
                "conv_width",
                "conv_in",
                HEADS,
            ),
            dtype=v.dtype,
            name="value_conv",
        )
        # Heads are the channels, (length, head_dim) the spatial dims: [B, n, d, H].
        out = conv(jnp.swapaxes(v, 2, 3))
        return jnp.swapaxes(out, 2, 3)
