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
    assert len(source) == 11  # 4 + 4 + 3 over three hosts
    seen, batches = [], []
    for shard in range(3):
        ds = input_pipeline.make_dataset(
            source,
            task="listops",
            batch_size=3,
            max_length=64,
            shard_index=shard,
            shard_count=3,
        )
        shard_batches = list(ds)
        batches.append(len(shard_batches))
        for b in shard_batches:
            seen += [
                bytes(row[m])
                for row, m, e in zip(b["inputs"], b["mask"], b["example_mask"], strict=True)
                if e
            ]
            filler = ~b["example_mask"]
            assert not b["mask"][filler].any() and not b["inputs"][filler].any()
    assert sorted(seen) == sorted(bytes(source[i]["inputs"]) for i in range(len(source)))
    # Every host gets the same number of batches (ceil(4 / 3) = 2), so hosts evaluating
    # in step all stop together; unequal shards used to give the last host one batch.
    assert batches == [2, 2, 2], batches


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


def _prepare_listops(data_dir: str, **sizes: int) -> str:
    from lra import builders

    config = builders.make_config("listops", min_length=10, max_length=60, **sizes)
    builders.make_builder("listops", config, data_dir=data_dir).download_and_prepare(
        file_format="array_record"
    )
    return config.name


def test_a_data_dir_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    # The shell leaves "~" in "--data_dir=~/x" alone: prepare used to write into a folder
    # named "~" under the working directory while training looked in the home folder.
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    name = _prepare_listops("~/tfds", num_train=8, num_validation=2, num_test=2)
    found = input_pipeline.dataset_dir("~/tfds", "listops", name)
    assert found.startswith(str(home / "tfds" / "lra_listops" / name))
    assert not (work / "~").exists()
    assert len(input_pipeline.open_split("~/tfds", "listops", "test", name)) == 2


def test_a_prepared_config_without_a_split_is_named(tmp_path):
    name = _prepare_listops(str(tmp_path), num_train=8, num_validation=0, num_test=2)
    assert len(input_pipeline.open_split(str(tmp_path), "listops", "test", name)) == 2
    with pytest.raises(ValueError) as err:
        input_pipeline.open_split(str(tmp_path), "listops", "validation", name)
    message = str(err.value)
    assert f"dataset in {tmp_path}/lra_listops/{name}/" in message
    assert "has no 'validation' split (it has ['test', 'train'])" in message
    assert "--num_validation=N >= 1" in message


def test_an_unknown_data_config_lists_the_prepared_ones(small_listops_dir):
    data_dir, name = small_listops_dir
    with pytest.raises(FileNotFoundError) as err:
        input_pipeline.dataset_dir(data_dir, "listops", "nope")
    assert f"prepared there: {name} (task.data_config)" in str(err.value)


def test_generated_sizes_of_zero_are_refused_before_any_data_is_written():
    from configs.lra import listops
    from lra import train_task

    config = listops.get_config("full,smoke")
    config.task.source = "generated"
    config.task.generate.num_test = 0
    with pytest.raises(ValueError, match=r"task.generate.num_test=0 must be >= 1"):
        train_task.check_config("listops", config)


def test_a_dataset_another_process_finished_is_used(tmp_path, monkeypatch):
    """Processes of one job sharing data_dir all generate a missing dataset; TFDS's
    final rename fails for all but the first. The loser must use the winner's copy."""
    from lra import builders, train_task

    config = builders.make_config(
        "listops", num_train=8, num_validation=2, num_test=2, min_length=10, max_length=60
    )
    real = builders.make_builder

    class Loser:
        def __init__(self, *args, **kwargs):
            self.winner = real(*args, **kwargs)

        def download_and_prepare(self, **kwargs):
            self.winner.download_and_prepare(**kwargs)  # the other process, first
            raise FileExistsError("Cannot rename incomplete.abc_1.0.0: 1.0.0 exists")

    monkeypatch.setattr(builders, "make_builder", Loser)
    train_task.prepare_generated("listops", config, str(tmp_path))
    assert len(input_pipeline.open_split(str(tmp_path), "listops", "train", config.name)) == 8

    class Broken:  # nothing was written by anyone: the write's own error
        def __init__(self, *args, **kwargs):
            pass

        def download_and_prepare(self, **kwargs):
            raise OSError("disk full")

    monkeypatch.setattr(builders, "make_builder", Broken)
    other = builders.make_config(
        "listops", num_train=9, num_validation=2, num_test=2, min_length=10, max_length=60
    )
    with pytest.raises(OSError, match="disk full"):
        train_task.prepare_generated("listops", other, str(tmp_path))
