"""Clean-room Pathfinder generator (numpy only), after Linsley et al. 2018 / LRA.

Method (our implementation of the published description, not a port of its code):

* A *contour* is a random walk of short straight *paddles*.  Paddle ``i + 1`` starts a
  gap of ``paddle_margin`` after the end of paddle ``i``, in its own direction, which
  turns from the previous one by a uniform angle in ``[-max_turn_deg, max_turn_deg]``.
  So a contour is a dashed, smoothly bending line.
* Each image has two *target* contours of ``contour_length`` paddles and
  ``num_distractors`` *distractor* contours of ``distractor_length`` paddles.
* A circular marker slot of radius ``marker_radius`` is reserved a gap past each end
  of both target contours (four slots).  Two markers are drawn: for label 1 both ends
  of one target contour, for label 0 one end of each target contour.  The geometry is
  drawn before the label is used, so it has the same distribution in both classes,
  and the four slots are pairwise at least ``seed_distance`` apart in every image.
* Nothing touches: paddles of different contours (and a contour's non-neighbouring
  paddles) keep a centre-line distance of at least ``clearance``, markers at least
  ``marker_radius + clearance``; everything stays ``padding`` inside the window.
  Consecutive paddles of one contour are exactly ``paddle_margin`` < ``clearance``
  apart, so "which paddles continue which" is well defined by geometry alone.
* Drawing happens at ``antialias`` times the resolution and is box-filtered down.

LRA's 32x32 parameters are the defaults: window 32, contour length 14 ("hard",
curv_contour_length_14), paddle length 2, margin 1, thickness 0.5, marker radius 1.5,
antialias 2, seed distance 7, distractor length 14 // 3, 20 // distractor length
distractors.  Easy / intermediate use contour length 6 / 9 (curv_baseline /
curv_contour_length_9).  ``max_turn_deg`` and ``clearance`` are our own parameters
(the original expresses curvature differently).

Determinism: example ``i`` of split ``s`` uses ``np.random.Generator(PCG64(
SeedSequence([seed, crc32(s), i])))`` and nothing else, so it can be regenerated alone.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np

DIFFICULTY_CONTOUR_LENGTH: dict[str, int] = {"easy": 6, "intermediate": 9, "hard": 14}


@dataclasses.dataclass(frozen=True)
class PathfinderParams:
    """Generation parameters (lengths in pixels of the final image)."""

    window_size: int = 32
    contour_length: int = 14
    paddle_length: float = 2.0
    paddle_margin: float = 1.0
    paddle_thickness: float = 0.5
    marker_radius: float = 1.5
    antialias: int = 2
    padding: float = 1.0
    seed_distance: float = 7.0
    distractor_length: int = -1  # -1: contour_length // 3
    num_distractors: int = -1  # -1: 20 // distractor_length
    max_turn_deg: float = 45.0
    clearance: float = 1.25
    max_paddle_retries: int = 8
    max_contour_retries: int = 30
    max_image_retries: int = 200

    def __post_init__(self):
        if self.distractor_length == -1:
            object.__setattr__(self, "distractor_length", max(1, self.contour_length // 3))
        if self.num_distractors == -1:
            object.__setattr__(self, "num_distractors", 20 // self.distractor_length)
        if self.contour_length < 1:
            raise ValueError(
                f"PathfinderParams.contour_length must be >= 1, got {self.contour_length}"
            )
        if not self.paddle_margin < self.clearance:
            raise ValueError(
                "PathfinderParams: paddle_margin must be < clearance so that contours stay "
                f"separable, got paddle_margin={self.paddle_margin}, clearance={self.clearance}"
            )
        if self.antialias < 1:
            raise ValueError(f"PathfinderParams.antialias must be >= 1, got {self.antialias}")
        if self.window_size < 8:
            raise ValueError(f"PathfinderParams.window_size must be >= 8, got {self.window_size}")

    @classmethod
    def for_difficulty(cls, difficulty: str, **overrides) -> PathfinderParams:
        """LRA parameters for 'easy' | 'intermediate' | 'hard'."""
        if difficulty not in DIFFICULTY_CONTOUR_LENGTH:
            raise ValueError(
                f"difficulty must be one of {sorted(DIFFICULTY_CONTOUR_LENGTH)}, got {difficulty!r}"
            )
        return cls(contour_length=DIFFICULTY_CONTOUR_LENGTH[difficulty], **overrides)


@dataclasses.dataclass(frozen=True)
class PathfinderExample:
    """One generated image and the geometry it was drawn from.

    Attributes:
      image: uint8 [window, window] grey image (row = y, column = x).
      label: 1 if both markers sit on the same contour, else 0.
      segments: float32 [num_paddles, 2, 2] every drawn paddle as ((x0, y0), (x1, y1)),
        in pixel units, in no particular contour order.
      markers: float32 [2, 2] the centres of the two drawn markers.
    """

    image: np.ndarray
    label: int
    segments: np.ndarray
    markers: np.ndarray


def example_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The private random stream of one example."""
    ss = np.random.SeedSequence([int(seed), zlib.crc32(split.encode()), int(index)])
    return np.random.Generator(np.random.PCG64(ss))


# Geometry --------------------------------------------------------------------------------


def _point_segment_distance(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distances from points p [..., 2] to segments (a, b) [..., 2] (broadcast)."""
    ab = b - a
    denom = np.maximum(np.sum(ab * ab, axis=-1), 1e-12)
    t = np.clip(np.sum((p - a) * ab, axis=-1) / denom, 0.0, 1.0)
    closest = a + t[..., None] * ab
    return np.linalg.norm(p - closest, axis=-1)


def _cross(o: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a[..., 0] - o[..., 0]) * (b[..., 1] - o[..., 1]) - (a[..., 1] - o[..., 1]) * (
        b[..., 0] - o[..., 0]
    )


def segment_distances(a: np.ndarray, b: np.ndarray, sa: np.ndarray, sb: np.ndarray) -> np.ndarray:
    """Distances between segments (a, b) [k, 2] and segments (sa, sb) [m, 2] -> [k, m]."""
    a, b = a[:, None], b[:, None]
    sa, sb = sa[None], sb[None]
    d = np.minimum(
        np.minimum(_point_segment_distance(a, sa, sb), _point_segment_distance(b, sa, sb)),
        np.minimum(_point_segment_distance(sa, a, b), _point_segment_distance(sb, a, b)),
    )
    d1 = _cross(sa, sb, a)
    d2 = _cross(sa, sb, b)
    d3 = _cross(a, b, sa)
    d4 = _cross(a, b, sb)
    crossing = (d1 * d2 < 0) & (d3 * d4 < 0)
    return np.where(crossing, 0.0, d)


def _unit(theta: np.ndarray) -> np.ndarray:
    return np.stack([np.cos(theta), np.sin(theta)], axis=-1)


class _Scene:
    """Paddles and marker slots placed so far (all contours together)."""

    def __init__(self, p: PathfinderParams):
        self.p = p
        self.seg_a = np.zeros((0, 2))
        self.seg_b = np.zeros((0, 2))
        self.discs = np.zeros((0, 2))
        # Marker slots keep this distance from each other (so also from every marker).
        self.slot_distance = max(p.seed_distance, 2 * p.marker_radius + p.clearance)

    def _inside(self, pts: np.ndarray, pad: float) -> np.ndarray:
        w = self.p.window_size
        return np.all((pts >= pad) & (pts <= w - pad), axis=-1)

    def _segments_clear(self, a, b, own_a, own_b) -> np.ndarray:
        """Which candidate paddles (a, b) [k, 2] keep their distances -> bool [k]."""
        p = self.p
        ok = self._inside(a, p.padding) & self._inside(b, p.padding)
        others_a = np.concatenate([self.seg_a, own_a])
        others_b = np.concatenate([self.seg_b, own_b])
        if others_a.shape[0]:
            # Only paddles near the candidates can be too close: prefilter with a
            # bounding circle around all candidates.
            centre = 0.5 * (a.mean(axis=0) + b.mean(axis=0))
            reach = np.max(np.linalg.norm(np.concatenate([a, b]) - centre, axis=-1))
            near = _point_segment_distance(centre[None], others_a, others_b) < (reach + p.clearance)
            others_a, others_b = others_a[near], others_b[near]
        if others_a.shape[0]:
            ok &= np.all(segment_distances(a, b, others_a, others_b) >= p.clearance, axis=1)
        if self.discs.shape[0]:
            dd = _point_segment_distance(self.discs[None], a[:, None], b[:, None])
            ok &= np.all(dd >= p.marker_radius + p.clearance, axis=1)
        return ok

    def _disc_clear(self, c: np.ndarray, own_a: np.ndarray, own_b: np.ndarray) -> bool:
        p = self.p
        r = p.marker_radius
        if not self._inside(c[None], p.padding + 0.5 * r)[0]:
            return False
        seg_a = np.concatenate([self.seg_a, own_a])
        seg_b = np.concatenate([self.seg_b, own_b])
        if seg_a.shape[0] and np.any(
            _point_segment_distance(c[None], seg_a, seg_b) < r + p.clearance
        ):
            return False
        if self.discs.shape[0] and np.any(
            np.linalg.norm(self.discs - c[None], axis=-1) < self.slot_distance
        ):
            return False
        return True

    def grow_contour(
        self, rng: np.random.Generator, num_paddles: int, with_markers: bool
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Places one contour; returns (paddles [n, 2, 2], marker slots [0 or 2, 2]) or None.

        The walk starts with one paddle at a random place and direction and then grows
        at both ends in turn (so it stays compact enough to fit the window).  At each
        step `max_paddle_retries` candidate turns are drawn at once and the first that
        keeps every distance is taken; when none does, the walk backs up one paddle
        (at most `num_paddles` times per attempt) before the attempt is abandoned.
        """
        p = self.p
        turn = math.radians(p.max_turn_deg)
        k = p.max_paddle_retries
        w = p.window_size
        empty = np.zeros((0, 2))
        for _ in range(p.max_contour_retries):
            start = rng.uniform(p.padding, w - p.padding, size=2)
            theta0 = rng.uniform(0.0, 2.0 * math.pi)
            end0 = start + p.paddle_length * _unit(np.asarray(theta0))
            if not self._segments_clear(start[None], end0[None], empty, empty)[0]:
                continue
            # Paddles in contour order; each (a, b, theta) points from tail to head.
            walk: list[tuple[np.ndarray, np.ndarray, float]] = [(start, end0, theta0)]
            grown_at_head: list[bool] = []
            blocked = {True: False, False: False}  # per end: no candidate fitted
            backtracks = 0
            gap = p.paddle_margin + p.marker_radius
            discs = empty
            while walk:
                if len(walk) == num_paddles:
                    if not with_markers:
                        break
                    # Both ends need room for a marker slot; an end without room loses
                    # its last paddle and the walk grows elsewhere.
                    sa = np.asarray([s[0] for s in walk])
                    sb = np.asarray([s[1] for s in walk])
                    c0 = sa[0] - gap * _unit(np.asarray(walk[0][2]))
                    c1 = sb[-1] + gap * _unit(np.asarray(walk[-1][2]))
                    tail_ok = self._disc_clear(c0, sa[1:], sb[1:])
                    head_ok = self._disc_clear(c1, sa[:-1], sb[:-1])
                    far_apart = np.linalg.norm(c0 - c1) >= self.slot_distance
                    if tail_ok and head_ok and far_apart:
                        discs = np.stack([c0, c1])
                        break
                    bad_end = (not head_ok) or (tail_ok and not far_apart)
                    if bad_end not in grown_at_head or backtracks >= num_paddles:
                        break
                    backtracks += 1
                    del grown_at_head[len(grown_at_head) - 1 - grown_at_head[::-1].index(bad_end)]
                    if bad_end:
                        walk.pop()
                    else:
                        walk.pop(0)
                    blocked = {True: False, False: False}
                    blocked[bad_end] = True
                    continue
                if blocked[True] and blocked[False]:
                    if backtracks >= num_paddles or not grown_at_head:
                        break
                    backtracks += 1
                    if grown_at_head.pop():
                        walk.pop()
                    else:
                        walk.pop(0)
                    blocked = {True: False, False: False}
                    continue
                at_head = len(walk) % 2 == 1
                if blocked[at_head]:
                    at_head = not at_head
                th = (walk[-1][2] if at_head else walk[0][2]) + rng.uniform(-turn, turn, size=k)
                u = _unit(th)
                if at_head:
                    a = walk[-1][1][None] + p.paddle_margin * u
                    b = a + p.paddle_length * u
                    neighbours = walk[:-1]
                else:
                    b = walk[0][0][None] - p.paddle_margin * u
                    a = b - p.paddle_length * u
                    neighbours = walk[1:]
                own_a = np.asarray([s[0] for s in neighbours]).reshape(-1, 2)
                own_b = np.asarray([s[1] for s in neighbours]).reshape(-1, 2)
                ok = self._segments_clear(a, b, own_a, own_b)
                if ok.any():
                    j = int(np.argmax(ok))
                    paddle = (a[j], b[j], float(th[j]))
                    if at_head:
                        walk.append(paddle)
                    else:
                        walk.insert(0, paddle)
                    grown_at_head.append(at_head)
                else:
                    blocked[at_head] = True
            if len(walk) < num_paddles or (with_markers and discs.shape[0] == 0):
                continue
            sa = np.asarray([s[0] for s in walk])
            sb = np.asarray([s[1] for s in walk])
            self.seg_a = np.concatenate([self.seg_a, sa])
            self.seg_b = np.concatenate([self.seg_b, sb])
            self.discs = np.concatenate([self.discs, discs])
            return np.stack([sa, sb], axis=1), discs
        return None


# Drawing ---------------------------------------------------------------------------------


def render(segments: np.ndarray, markers: np.ndarray, p: PathfinderParams) -> np.ndarray:
    """Draws paddles and markers; returns uint8 [window, window].

    Rendered at `antialias` times the resolution: a fine pixel is ink when its centre
    lies within half the paddle thickness of a paddle (at least half a fine pixel, so
    lines never break up) or within `marker_radius` of a marker centre.  Each output
    pixel is the mean of its `antialias` x `antialias` fine pixels.  Pixel i covers
    the coordinates [i, i + 1).
    """
    s = p.antialias
    size = p.window_size * s
    centres = (np.arange(size) + 0.5) / s
    half_width = max(p.paddle_thickness, 1.0 / s) / 2.0
    fine = np.zeros((size, size), dtype=bool)

    def stamp(lo: np.ndarray, hi: np.ndarray, is_ink) -> None:
        # Fine pixels whose centres lie in the box [lo, hi] (x, y in output units).
        c0 = np.clip(np.floor(lo * s - 0.5).astype(int), 0, size - 1)
        c1 = np.clip(np.ceil(hi * s - 0.5).astype(int), 0, size - 1)
        xs, ys = centres[c0[0] : c1[0] + 1], centres[c0[1] : c1[1] + 1]
        pts = np.stack(np.meshgrid(xs, ys, indexing="xy"), axis=-1)
        fine[c0[1] : c1[1] + 1, c0[0] : c1[0] + 1] |= is_ink(pts)

    for a, b in np.asarray(segments, dtype=np.float64):
        stamp(
            np.minimum(a, b) - half_width,
            np.maximum(a, b) + half_width,
            lambda pts, a=a, b=b: _point_segment_distance(pts, a, b) <= half_width,
        )
    for c in np.asarray(markers, dtype=np.float64):
        stamp(
            c - p.marker_radius,
            c + p.marker_radius,
            lambda pts, c=c: np.linalg.norm(pts - c, axis=-1) <= p.marker_radius,
        )
    coarse = fine.astype(np.float64).reshape(p.window_size, s, p.window_size, s).mean(axis=(1, 3))
    return np.round(coarse * 255.0).astype(np.uint8)


def generate_example(
    rng: np.random.Generator, params: PathfinderParams, label: int
) -> PathfinderExample:
    """Generates one image with the given label (0 or 1).

    Raises:
      RuntimeError: if no image fits after `max_image_retries` (parameters too crowded).
    """
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label}")
    p = params
    for _ in range(p.max_image_retries):
        scene = _Scene(p)
        first = scene.grow_contour(rng, p.contour_length, with_markers=True)
        if first is None:
            continue
        second = scene.grow_contour(rng, p.contour_length, with_markers=True)
        if second is None:
            continue
        slots = np.concatenate([first[1], second[1]])  # A0, A1, B0, B1
        pair = np.linalg.norm(slots[:, None] - slots[None], axis=-1)
        if np.any(pair[np.triu_indices(4, 1)] < p.seed_distance):
            continue
        segments = [first[0], second[0]]
        for _ in range(p.num_distractors):
            distractor = scene.grow_contour(rng, p.distractor_length, with_markers=False)
            if distractor is not None:
                segments.append(distractor[0])
        # Marker choice: always draw the same random numbers, whatever the label.
        which_a, which_b, which_contour = rng.integers(0, 2, size=3)
        if label == 1:
            base = 2 * int(which_contour)
            markers = slots[[base, base + 1]]
        else:
            markers = slots[[int(which_a), 2 + int(which_b)]]
        segs = np.concatenate(segments).astype(np.float32)
        markers = markers.astype(np.float32)
        image = render(segs, markers, p)
        return PathfinderExample(image=image, label=label, segments=segs, markers=markers)
    raise RuntimeError(
        f"Pathfinder: no image fitted in {p.max_image_retries} tries; the parameters are too "
        f"crowded for window_size={p.window_size} (contour_length={p.contour_length}, "
        f"num_distractors={p.num_distractors})"
    )


def generate_split_example(
    params: PathfinderParams, *, seed: int, split: str, index: int
) -> PathfinderExample:
    """Example `index` of `split`: labels alternate 1, 0, 1, ... so classes are balanced."""
    label = 1 - index % 2
    return generate_example(example_rng(seed, split, index), params, label)
