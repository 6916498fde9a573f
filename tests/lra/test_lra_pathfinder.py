"""Pathfinder: labels from geometry (not the generator's flag), pixels, balance, release."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from tensorflow_datasets.core.download import DownloadConfig

from lra import builders, pathfinder_generator
from lra.input_pipeline import open_split

HARD = pathfinder_generator.PathfinderParams.for_difficulty("hard")
EASY = pathfinder_generator.PathfinderParams.for_difficulty("easy")
# Linking distance: more than the gap between consecutive paddles of one contour
# (paddle_margin = 1), less than the clearance kept between different contours (1.25).
LINK = 1.1


def _sample_points(segments: np.ndarray, step: float = 0.1) -> np.ndarray:
    """Dense points along every segment: [num_segments, n, 2] (endpoints included)."""
    t = np.linspace(0.0, 1.0, int(round(2.0 / step)) + 1)
    a, b = segments[:, 0], segments[:, 1]
    return a[:, None] + t[None, :, None] * (b - a)[:, None]


def markers_connected(segments: np.ndarray, markers: np.ndarray, radius: float) -> bool:
    """Independent label: are the two markers joined by a chain of nearby paddles?

    Uses only drawn geometry (paddles, marker centres), measured by dense point sampling,
    and union-find; it does not look at the generator's label or contour bookkeeping.
    """
    pts = _sample_points(segments.astype(np.float64))
    n = len(segments)
    parent = list(range(n + 2))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    flat = pts.reshape(-1, 2)
    owner = np.repeat(np.arange(n), pts.shape[1])
    dist = np.linalg.norm(flat[:, None] - flat[None], axis=-1)
    seg_dist = np.full((n, n), np.inf)
    np.minimum.at(
        seg_dist, (owner[:, None].repeat(len(owner), 1), owner[None].repeat(len(owner), 0)), dist
    )
    for i in range(n):
        for j in range(i + 1, n):
            if seg_dist[i, j] <= LINK:
                parent[find(i)] = find(j)
    for m, centre in enumerate(markers.astype(np.float64)):
        d = np.linalg.norm(flat - centre, axis=-1)
        per_seg = np.full(n, np.inf)
        np.minimum.at(per_seg, owner, d)
        for i in np.nonzero(per_seg <= radius + LINK)[0]:
            parent[find(n + m)] = find(int(i))
    # Chains only: in a well-separated scene no paddle has more than two neighbours.
    degrees = (seg_dist <= LINK).sum(axis=1) - 1  # minus the paddle itself
    assert degrees.max() <= 2, "a paddle touches more than two others"
    return find(n) == find(n + 1)


def _check_pixels(ex: pathfinder_generator.PathfinderExample, p) -> None:
    img = ex.image.astype(np.int32)
    for x, y in ex.markers:
        assert img[int(y), int(x)] > 150, "marker centre not bright"
    # Ink within one pixel of every point of every paddle.
    lit = np.argwhere(img > 0) + 0.5  # (row, col) centres
    pts = _sample_points(ex.segments.astype(np.float64)).reshape(-1, 2)[:, ::-1]
    nearest = np.min(np.max(np.abs(pts[:, None] - lit[None]), axis=-1), axis=1)
    assert nearest.max() <= 1.0, "a paddle is not drawn"
    # Nothing is drawn far from the geometry.
    yy, xx = np.mgrid[0 : p.window_size, 0 : p.window_size] + 0.5
    centres = np.stack([xx.ravel(), yy.ravel()], axis=-1)
    pts = _sample_points(ex.segments.astype(np.float64)).reshape(-1, 2)
    d_seg = np.min(np.linalg.norm(centres[:, None] - pts[None], axis=-1), axis=1)
    d_mark = np.min(np.linalg.norm(centres[:, None] - ex.markers[None], axis=-1), axis=1)
    far = (d_seg > 1.5) & (d_mark > p.marker_radius + 1.0)
    assert img.ravel()[far].max(initial=0) == 0


@pytest.mark.parametrize("params, n", [(HARD, 16), (EASY, 10)])
def test_labels_match_geometry_and_classes_balance(params, n):
    labels, independent = [], []
    for i in range(n):
        ex = pathfinder_generator.generate_split_example(params, seed=5, split="t", index=i)
        assert ex.image.shape == (32, 32) and ex.image.dtype == np.uint8
        assert len(ex.segments) >= 2 * params.contour_length
        _check_pixels(ex, params)
        labels.append(ex.label)
        independent.append(int(markers_connected(ex.segments, ex.markers, params.marker_radius)))
    assert independent == labels
    assert sum(independent) == n // 2  # exactly balanced


def test_no_brightness_shortcut():
    # Both classes draw the same contours; only the marker placement differs, so the
    # total ink per image has the same distribution (compare means within 3 std errors).
    ink = {0: [], 1: []}
    for i in range(40):
        ex = pathfinder_generator.generate_split_example(HARD, seed=9, split="s", index=i)
        ink[ex.label].append(float(ex.image.astype(np.float64).sum()))
    a, b = np.asarray(ink[0]), np.asarray(ink[1])
    se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    assert abs(a.mean() - b.mean()) < 3 * se


def test_same_seed_same_bytes():
    a = pathfinder_generator.generate_split_example(HARD, seed=1, split="train", index=7)
    b = pathfinder_generator.generate_split_example(HARD, seed=1, split="train", index=7)
    c = pathfinder_generator.generate_split_example(HARD, seed=2, split="train", index=7)
    assert a.image.tobytes() == b.image.tobytes()
    np.testing.assert_array_equal(a.segments, b.segments)
    assert a.image.tobytes() != c.image.tobytes()


def test_grid_png(tmp_path):
    images = [
        pathfinder_generator.generate_split_example(HARD, seed=0, split="grid", index=i).image
        for i in range(8)
    ]
    grid = np.concatenate(images, axis=1)
    path = tmp_path / "pathfinder_grid.png"
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(path)
    back = np.asarray(Image.open(path))
    assert back.shape == (128, 8 * 128)
    np.testing.assert_array_equal(back[::4, ::4], grid)


def test_invalid_params_are_named():
    with pytest.raises(ValueError, match="difficulty"):
        pathfinder_generator.PathfinderParams.for_difficulty("medium")
    with pytest.raises(ValueError, match="clearance"):
        pathfinder_generator.PathfinderParams(paddle_margin=2.0, clearance=1.5)


def test_generated_builder(tmp_path):
    config = builders.make_config(
        "pathfinder", difficulty="easy", num_train=6, num_validation=2, num_test=2
    )
    builders.make_builder("pathfinder", config, data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    src = open_split(str(tmp_path), "pathfinder", "train", config.name)
    assert len(src) == 6
    by_index = {
        i: pathfinder_generator.generate_split_example(EASY, seed=0, split="train", index=i)
        for i in range(6)
    }
    stored = {src[i]["inputs"].tobytes(): int(src[i]["targets"]) for i in range(6)}
    assert stored == {ex.image.tobytes(): ex.label for ex in by_index.values()}


def _write_release(root, difficulty_dir: str, labels: list[int]) -> list[np.ndarray]:
    base = root / "pathfinder32" / difficulty_dir
    (base / "metadata").mkdir(parents=True)
    (base / "imgs" / "0").mkdir(parents=True)
    rng = np.random.default_rng(0)
    images, lines = [], []
    for i, label in enumerate(labels):
        img = rng.integers(0, 256, size=(32, 32), dtype=np.uint8)
        Image.fromarray(img).save(base / "imgs" / "0" / f"sample_{i}.png")
        images.append(img)
        lines.append(f"imgs/0 sample_{i}.png {i} {label} 1.0 14 2 1\n")
    (base / "metadata" / "0.npy").write_text("".join(lines))
    return images


def test_release_folder(tmp_path):
    labels = [1, 0] * 10
    images = _write_release(tmp_path / "manual", "curv_contour_length_14", labels)
    b = builders.make_builder(
        "pathfinder",
        builders.make_config("pathfinder", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    b.download_and_prepare(
        file_format="array_record",
        download_config=DownloadConfig(manual_dir=str(tmp_path / "manual")),
    )
    expected = {img.tobytes(): lab for img, lab in zip(images, labels, strict=True)}
    sizes = {"train": 16, "validation": 2, "test": 2}
    got = {}
    for split, n in sizes.items():
        src = b.as_data_source(split)
        assert len(src) == n
        got.update({src[i]["inputs"].tobytes(): int(src[i]["targets"]) for i in range(n)})
    assert got == expected


@pytest.mark.parametrize(
    "line, message",
    [
        ("imgs/0 sample_0.png 0\n", "expected >= 4 space-separated fields, got 3"),
        ("imgs/0 sample_0.png 0 x\n", "'x' is not an integer"),
        ("imgs/0 missing.png 0 1\n", "cannot read image"),
    ],
)
def test_release_malformed_metadata(tmp_path, line, message):
    _write_release(tmp_path / "manual", "curv_contour_length_14", [1, 0])
    meta = tmp_path / "manual" / "pathfinder32" / "curv_contour_length_14" / "metadata" / "0.npy"
    with open(meta, "a") as f:
        f.write(line)
    b = builders.make_builder(
        "pathfinder",
        builders.make_config("pathfinder", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    with pytest.raises(builders.MalformedFileError) as err:
        b.download_and_prepare(
            file_format="array_record",
            download_config=DownloadConfig(manual_dir=str(tmp_path / "manual")),
        )
    assert f"{meta}:3: " in str(err.value)
    assert message in str(err.value)


def test_a_release_set_too_small_to_split_is_named(tmp_path):
    _write_release(tmp_path / "manual", "curv_contour_length_14", [1, 0, 1])  # 10% of 3: 0
    b = builders.make_builder(
        "pathfinder",
        builders.make_config("pathfinder", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    with pytest.raises(ValueError, match="3 images are too few for the test split"):
        b.download_and_prepare(
            file_format="array_record",
            download_config=DownloadConfig(manual_dir=str(tmp_path / "manual")),
        )


def test_rgb_release_image_is_an_error_with_its_path(tmp_path):
    """A colour image would have been converted to grey without a word; it is refused."""
    _write_release(tmp_path / "manual", "curv_contour_length_14", [1, 0])
    base = tmp_path / "manual" / "pathfinder32" / "curv_contour_length_14"
    rgb = np.random.default_rng(1).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(base / "imgs" / "0" / "sample_1.png")
    b = builders.make_builder(
        "pathfinder",
        builders.make_config("pathfinder", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    with pytest.raises(builders.MalformedFileError) as err:
        b.download_and_prepare(
            file_format="array_record",
            download_config=DownloadConfig(manual_dir=str(tmp_path / "manual")),
        )
    text = str(err.value)
    assert f"{base / 'metadata' / '0.npy'}:2: " in text
    assert f"image {base / 'imgs' / '0' / 'sample_1.png'} is 'RGB'" in text


def test_release_missing_folder_message(tmp_path):
    (tmp_path / "manual").mkdir()
    b = builders.make_builder(
        "pathfinder",
        builders.make_config("pathfinder", source="release", difficulty="easy"),
        data_dir=str(tmp_path / "data"),
    )
    with pytest.raises(builders.MissingFilesError) as err:
        b.download_and_prepare(
            file_format="array_record",
            download_config=DownloadConfig(manual_dir=str(tmp_path / "manual")),
        )
    text = str(err.value)
    assert "pathfinder32/curv_baseline" in text
    assert builders.LRA_RELEASE_URL in text
    assert "--source=generated" in text
