"""grain pipelines: padding and masks, batching, seeded shuffling, exact resume, and
over-long sequences refused unless truncation is asked for."""

from __future__ import annotations

import numpy as np
import pytest

from lra import input_pipeline, tasks
from tests.lra.conftest import run_in_checkout


def _batches(it, n):
    return [next(it) for _ in range(n)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_tasks_metadata():
    assert tasks.TASKS["listops"].vocab_size == 16 and tasks.TASKS["listops"].num_classes == 10
    assert tasks.TASKS["text"].max_length == 3072 and tasks.TASKS["text"].vocab_size == 257
    assert tasks.TASKS["retrieval"].dual_input
    assert tasks.TASKS["image"].max_length == 1024 and tasks.TASKS["image"].num_classes == 10
    assert tasks.TASKS["pathfinder"].num_classes == 2
    with pytest.raises(ValueError, match="unknown LRA task"):
        tasks.get_task("listop")


def test_train_batches_pad_and_mask(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "train", config)
    lengths = {
        source[i]["inputs"].tobytes(): source[i]["inputs"].shape[0] for i in range(len(source))
    }
    examples = input_pipeline.train_examples(source, task="listops", max_length=64, seed=1)
    ds = input_pipeline.batch_examples(examples, 4)
    batches = [ds[i] for i in range(len(source) // 4)]  # the first epoch's whole batches
    first_epoch = [bytes(examples[i]["inputs"]) for i in range(len(source))]
    assert sorted(first_epoch) == sorted(
        bytes(input_pipeline.pad_tokens(source[i]["inputs"], 64)[0]) for i in range(len(source))
    )  # an epoch holds every example once
    for b in batches:
        assert b["inputs"].shape == (4, 64) and b["inputs"].dtype == np.int32
        assert b["mask"].shape == (4, 64) and b["mask"].dtype == np.bool_
        assert b["targets"].shape == (4,) and b["targets"].dtype == np.int32
        assert b["example_mask"].all()
        for row, m in zip(b["inputs"], b["mask"], strict=True):
            n = int(m.sum())
            assert m[:n].all() and not m[n:].any()  # mask is a prefix
            assert (row[n:] == 0).all() and (row[:n] != 0).all()
            assert lengths[row[:n].tobytes()] == n


def test_truncation_to_max_length(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "validation", config)
    b = next(
        iter(
            input_pipeline.make_dataset(
                source, task="listops", batch_size=2, max_length=8, truncate=True
            )
        )
    )
    assert b["inputs"].shape == (2, 8) and b["mask"].all()
    np.testing.assert_array_equal(b["inputs"][0], source[0]["inputs"][:8])


def test_over_long_sequences_are_refused_and_counted(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "validation", config)
    lengths = [source[i]["inputs"].shape[0] for i in range(len(source))]
    with pytest.raises(input_pipeline.SequenceTooLong, match="longer than max_length=8"):
        next(iter(input_pipeline.make_dataset(source, task="listops", batch_size=2, max_length=8)))
    report = input_pipeline.length_report(source, task="listops", max_length=20)
    assert report.examples == len(lengths) == 11
    assert report.too_long == sum(n > 20 for n in lengths) and report.longest == max(lengths)
    assert input_pipeline.length_report(source, task="listops", max_length=64).too_long == 0
    # Pixel tasks are fixed-length: no scan, every example is 1024 pixels.
    pixels = input_pipeline.length_report([None] * 3, task="image", max_length=512)
    assert (pixels.too_long, pixels.longest) == (3, 1024)


def test_shuffle_is_seeded_and_epochs_differ(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "train", config)

    def first(seed, n):
        examples = input_pipeline.train_examples(source, task="listops", max_length=64, seed=seed)
        return _batches(iter(input_pipeline.batch_examples(examples, 37)), n)

    a, b, c = first(3, 2), first(3, 2), first(4, 2)
    assert _same(a, b)
    assert not _same(a, c)
    # One batch is one full epoch here: both epochs hold the same examples, reordered.
    e0, e1 = a
    assert not np.array_equal(e0["inputs"], e1["inputs"])
    assert sorted(map(bytes, e0["inputs"])) == sorted(map(bytes, e1["inputs"]))


def test_iterator_state_resumes_exactly(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "train", config)
    examples = input_pipeline.train_examples(source, task="listops", max_length=64, seed=7)
    ds = input_pipeline.batch_examples(examples, 5)
    it = iter(ds.to_iter_dataset())
    _batches(it, 9)  # crosses an epoch boundary (7 batches per epoch)
    state = it.get_state()
    expected = _batches(it, 6)
    fresh = iter(ds.to_iter_dataset())
    fresh.set_state(state)
    assert _same(_batches(fresh, 6), expected)
    # The trainer resumes by index: batch s is ds[s].
    assert _same([ds[9 + i] for i in range(6)], expected)


def test_eval_fills_last_batch(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "validation", config)  # 11
    batches = list(input_pipeline.make_dataset(source, task="listops", batch_size=4, max_length=64))
    assert [b["example_mask"].sum() for b in batches] == [4, 4, 3]
    last = batches[-1]
    assert last["inputs"].shape == (4, 64)
    assert not last["mask"][3].any() and last["inputs"][3].sum() == 0
    got = [
        bytes(r[m])
        for b in batches
        for r, m, e in zip(b["inputs"], b["mask"], b["example_mask"], strict=True)
        if e
    ]
    want = [bytes(source[i]["inputs"]) for i in range(len(source))]
    assert got == want  # eval order is file order, every example exactly once


def test_shards_partition_the_data(small_listops_dir):
    data_dir, config = small_listops_dir
    source = input_pipeline.open_split(data_dir, "listops", "validation", config)
    seen = []
    for shard in range(3):
        ds = input_pipeline.make_dataset(
            source,
            task="listops",
            batch_size=1,
            max_length=64,
            shard_index=shard,
            shard_count=3,
        )
        seen += [bytes(b["inputs"][0][b["mask"][0]]) for b in ds]
    assert sorted(seen) == sorted(bytes(source[i]["inputs"]) for i in range(len(source)))


def test_dual_inputs_for_retrieval():
    rng = np.random.default_rng(0)
    source = [
        {
            "inputs0": rng.integers(1, 257, size=rng.integers(1, 30)).astype(np.int32),
            "inputs1": rng.integers(1, 257, size=rng.integers(1, 30)).astype(np.int32),
            "targets": i % 2,
        }
        for i in range(6)
    ]
    b = next(
        iter(input_pipeline.make_dataset(source, task="retrieval", batch_size=3, max_length=32))
    )
    assert set(b) == {"inputs0", "inputs1", "mask0", "mask1", "targets", "example_mask"}
    for i in range(3):
        for k in (0, 1):
            n = source[i][f"inputs{k}"].shape[0]
            np.testing.assert_array_equal(b[f"inputs{k}"][i, :n], source[i][f"inputs{k}"])
            assert b[f"mask{k}"][i].sum() == n
    np.testing.assert_array_equal(b["targets"], [0, 1, 0])


def test_missing_dataset_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m lra.prepare --task=pathfinder"):
        input_pipeline.open_split(str(tmp_path), "pathfinder", "train")


@pytest.mark.parametrize(
    "task, config, flags, needs",
    [
        ("listops", None, "--task=listops --data_dir=D`", None),
        ("listops", "release", "--source=release --manual_dir=DIR`", "lra_release.gz"),
        ("retrieval", None, "--task=retrieval --data_dir=D --manual_dir=DIR`", "lra_release/"),
        ("retrieval", "bytes4000", "--max_length=4000 --manual_dir=DIR`", "tar xzf"),
        (
            "pathfinder",
            "release_easy",
            "--source=release --difficulty=easy --manual_dir=DIR`",
            "lra_release.gz",
        ),
        ("pathfinder", None, "--task=pathfinder --data_dir=D --difficulty=hard`", None),
        ("text", "bytes4096", "--task=text --data_dir=D --max_length=4096`", "'imdb_reviews'"),
        ("image", None, "--task=image --data_dir=D`", "--catalog_data_dir=DIR where cifar10"),
    ],
)
def test_missing_dataset_message_gives_a_command_that_can_work(task, config, flags, needs):
    # The command in the message must be one that prepares that very config: release
    # files named (--manual_dir), the config's options, the network for text and image.
    with pytest.raises(FileNotFoundError) as err:
        input_pipeline.dataset_dir("D", task, config)
    message = str(err.value)
    assert f"{flags} first" in message, message
    assert needs is None or needs in message, message
    if needs is None:
        assert "DIR" not in message and "network" not in message, message


def test_missing_sized_dataset_message_names_its_size_options():
    sized = input_pipeline.prepare_hint("listops", "generated_n2000-200-200_len128-512", "D")
    assert "size options that named 'generated_n2000-200-200_len128-512'" in sized


def test_prepare_reports_an_offline_download_in_one_line():
    # No network here: the download is replaced by the error requests raises offline,
    # and the command must end with one line and exit code 2, not TFDS's traceback.
    code = (
        "import sys, requests\n"
        "from lra import prepare as p\n"
        "def offline(task):\n"
        "    raise requests.exceptions.ConnectionError(\n"
        "        'Max retries exceeded with url: /aclImdb_v1.tar.gz '\n"
        "        '(Caused by NameResolutionError: Failed to resolve ai.stanford.edu)')\n"
        "p.prepare = offline\n"
        "sys.argv = ['prepare', '--task=text']\n"
        "p.console_main()\n"
    )
    proc = run_in_checkout("-c", code)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: --task=text: could not download TFDS 'imdb_reviews'")
    assert "ai.stanford.edu" in line and "needs network access" in line
    assert "--catalog_data_dir=DIR" in line


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size"):
        input_pipeline.make_dataset([], task="listops", batch_size=0)
    with pytest.raises(ValueError, match="shard_index"):
        input_pipeline.make_dataset([], task="listops", batch_size=1, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="batch_size"):
        input_pipeline.batch_examples(
            input_pipeline.train_examples(
                [{"inputs": np.ones(2, np.int32), "targets": 0}],
                task="listops",
                max_length=4,
                seed=0,
            ),
            0,
        )
