"""ListOps: generator labels vs an independent evaluator, release TSVs, determinism."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from lra import builders, listops_generator, vocab
from lra.input_pipeline import open_split
from tests.lra.conftest import run_in_checkout


def all_examples(source) -> list:
    return [source[i] for i in range(len(source))]


# The vocabulary is part of the data format: pin every id.
EXPECTED_TOKENS = [
    "<pad>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
    "[MIN", "[MAX", "[MED", "[SM", "]",
]  # fmt: skip


def evaluate_prefix(tokens: list[str]) -> int:
    """Independent evaluator: parse a prefix ListOps token list with an explicit stack."""
    stack: list[list] = []  # frames [operator, args]
    result = None
    for tok in tokens:
        if tok.startswith("["):
            stack.append([tok, []])
            continue
        if tok == "]":
            op, args = stack.pop()
            assert len(args) >= 2, f"operator {op} with {len(args)} arguments"
            if op == "[MIN":
                value = min(args)
            elif op == "[MAX":
                value = max(args)
            elif op == "[MED":
                value = int(np.floor(np.median(np.asarray(args, dtype=np.float64))))
            elif op == "[SM":
                value = int(np.sum(args)) % 10
            else:
                raise AssertionError(f"unknown operator {op}")
        else:
            value = int(tok)
            assert 0 <= value <= 9
        if stack:
            stack[-1][1].append(value)
        else:
            assert result is None, "more than one root"
            result = value
    assert not stack, "unclosed operator"
    assert result is not None
    return result


def tree_depth(tokens: list[str]) -> int:
    depth = best = 0
    for tok in tokens:
        if tok.startswith("["):
            depth += 1
            best = max(best, depth)
        elif tok == "]":
            depth -= 1
        else:
            best = max(best, depth + 1)
    return best


def test_vocabulary_is_fixed():
    assert list(vocab.LISTOPS_TOKENS) == EXPECTED_TOKENS
    assert vocab.LISTOPS_VOCAB_SIZE == 16
    ids = vocab.encode_listops("( ( ( [MAX 2 ) 9 ) ] )")
    np.testing.assert_array_equal(ids, [12, 3, 10, 15])
    assert vocab.decode_listops(ids) == "[MAX 2 9 ]"
    with pytest.raises(ValueError, match="unknown ListOps token"):
        vocab.encode_listops("[MAX 2 X ]")


def test_evaluator_on_hand_examples():
    assert evaluate_prefix("[MED 3 8 ]".split()) == 5
    assert evaluate_prefix("[MIN 4 [SM 3 8 ] 7 ]".split()) == 1
    assert evaluate_prefix("[MED 1 5 2 9 ]".split()) == 3


@pytest.mark.parametrize("max_depth", [10, 4])
def test_generated_labels_match_independent_evaluator(max_depth):
    params = listops_generator.ListOpsParams(min_length=20, max_length=300, max_depth=max_depth)
    examples = list(listops_generator.generate_split(params, seed=3, split="t", num_examples=150))
    labels = []
    for _, ids, label in examples:
        tokens = vocab.decode_listops(ids).split()
        assert params.min_length < len(tokens) < params.max_length
        assert evaluate_prefix(tokens) == label
        assert tree_depth(tokens) <= max_depth
        args = _argument_counts(tokens)
        assert all(2 <= a <= params.max_args for a in args)
        labels.append(label)
    # All ten classes occur; no duplicates.
    assert len(set(labels)) == 10
    assert len({ids.tobytes() for _, ids, _ in examples}) == len(examples)


def _argument_counts(tokens: list[str]) -> list[int]:
    counts, stack = [], []
    for tok in tokens:
        if stack and tok != "]":
            stack[-1] += 1
        if tok.startswith("["):
            stack.append(0)
        elif tok == "]":
            counts.append(stack.pop())
    return counts


def test_operator_probability_matches_reference_rule():
    # With max_depth 2 only the root may be an operator: P(root is an operator) = 0.25.
    params = listops_generator.ListOpsParams(min_length=0, max_length=100, max_depth=2)
    n = 4000
    ops = sum(
        listops_generator.sample_expression(listops_generator.example_rng(0, "p", i), params)[
            0
        ].size
        > 1
        for i in range(n)
    )
    # Accepted trees have length > 0, i.e. all; binomial sd = sqrt(n * .25 * .75) ~ 27.
    assert abs(ops - 0.25 * n) < 5 * np.sqrt(n * 0.25 * 0.75)


def test_same_seed_same_bytes_different_seed_differs():
    params = listops_generator.ListOpsParams(min_length=30, max_length=200)
    a = [
        ids.tobytes()
        for _, ids, _ in listops_generator.generate_split(
            params, seed=1, split="train", num_examples=20
        )
    ]
    b = [
        ids.tobytes()
        for _, ids, _ in listops_generator.generate_split(
            params, seed=1, split="train", num_examples=20
        )
    ]
    c = [
        ids.tobytes()
        for _, ids, _ in listops_generator.generate_split(
            params, seed=2, split="train", num_examples=20
        )
    ]
    assert a == b
    assert a != c


def test_invalid_params_are_named():
    with pytest.raises(ValueError, match="min_length"):
        listops_generator.ListOpsParams(min_length=600, max_length=512)


def test_generated_builder_splits(small_listops_dir):
    data_dir, config = small_listops_dir
    sizes = {"train": 37, "validation": 11, "test": 5}
    seen = {}
    for split, n in sizes.items():
        examples = all_examples(open_split(data_dir, "listops", split, config))
        assert len(examples) == n
        for ex in examples:
            assert ex["inputs"].dtype == np.int32
            assert 10 < ex["inputs"].shape[0] < 60
            assert evaluate_prefix(vocab.decode_listops(ex["inputs"]).split()) == ex["targets"]
        seen[split] = {ex["inputs"].tobytes() for ex in examples}
    assert not seen["train"] & seen["validation"]
    assert not seen["train"] & seen["test"]


def test_no_expression_is_in_two_generated_splits(tmp_path):
    """At short lengths the splits, each drawn on its own stream, share expressions
    (8 of 200 test examples were training ones at 4 < length < 12). The builder
    redraws those; the others are the streams' own draws, unchanged."""
    sizes = {"train": 2000, "validation": 200, "test": 200}
    params = listops_generator.ListOpsParams(min_length=4, max_length=12)
    plain = {
        split: [
            ids.tobytes()
            for _, ids, _ in listops_generator.generate_split(
                params, seed=0, split=split, num_examples=n
            )
        ]
        for split, n in sizes.items()
    }
    assert set(plain["test"]) & set(plain["train"])  # the overlap the builder must remove
    config = builders.make_config(
        "listops",
        num_train=sizes["train"],
        num_validation=sizes["validation"],
        num_test=sizes["test"],
        min_length=4,
        max_length=12,
    )
    builders.make_builder("listops", config, data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    got = {}
    for split, n in sizes.items():
        examples = all_examples(open_split(str(tmp_path), "listops", split, config.name))
        assert len(examples) == n
        for ex in examples:
            assert evaluate_prefix(vocab.decode_listops(ex["inputs"]).split()) == ex["targets"]
        got[split] = [ex["inputs"].tobytes() for ex in examples]
        assert len(set(got[split])) == n
    assert not set(got["train"]) & set(got["validation"])
    assert not set(got["train"]) & set(got["test"])
    assert not set(got["validation"]) & set(got["test"])
    assert got["train"] and sorted(got["train"]) == sorted(plain["train"])
    # Test examples that were not training or validation ones are kept as drawn.
    earlier = set(got["train"]) | set(got["validation"])
    kept = [x for x in plain["test"] if x not in earlier]
    assert set(kept) <= set(got["test"]) and len(kept) < len(plain["test"])
    # Without the builder's cache, the exclusions are regenerated: the same test split.
    exclude = listops_generator.earlier_digests(params, seed=0, sizes=sizes, split="test")
    alone = [
        ids.tobytes()
        for _, ids, _ in listops_generator.generate_split(
            params, seed=0, split="test", num_examples=200, exclude=exclude
        )
    ]
    assert sorted(alone) == sorted(got["test"])


def test_generated_builder_is_reproducible(small_listops_dir, tmp_path):
    data_dir, config_name = small_listops_dir
    config = builders.make_config(
        "listops", num_train=37, num_validation=11, num_test=5, min_length=10, max_length=60
    )
    assert config.name == config_name
    builders.make_builder("listops", config, data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    for split in ("train", "test"):
        first = {
            ex["inputs"].tobytes() + bytes([ex["targets"]])
            for ex in all_examples(open_split(data_dir, "listops", split, config_name))
        }
        again = {
            ex["inputs"].tobytes() + bytes([ex["targets"]])
            for ex in all_examples(open_split(str(tmp_path), "listops", split, config_name))
        }
        assert first == again


def test_release_tsvs(fixtures_dir, tmp_path):
    manual = os.path.join(fixtures_dir, "listops")
    b = builders.make_builder(
        "listops", builders.make_config("listops", source="release"), data_dir=str(tmp_path)
    )
    from tensorflow_datasets.core.download import DownloadConfig

    b.download_and_prepare(
        file_format="array_record", download_config=DownloadConfig(manual_dir=manual)
    )
    counts = {"train": 2, "validation": 1, "test": 2}
    for split, n in counts.items():
        examples = all_examples(b.as_data_source(split))
        assert len(examples) == n
        for ex in examples:
            assert evaluate_prefix(vocab.decode_listops(ex["inputs"]).split()) == ex["targets"]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("[MAX 2 9 ]\t9\textra", "expected 2 tab-separated columns, got 3"),
        ("[MAX 2 9 ]\tnine", "Target 'nine' is not an integer"),
        ("[MAX 2 9 ]\t12", "Target 12 is outside 0..9"),
        ("   \t3", "empty Source"),
        ("[MAX 2 Q ]\t3", "unknown ListOps token 'Q'"),
        ("[MAX 2 9\t9", "1 operator(s) left open at the end (missing ']')"),
        ("] [MAX 2 9 ]\t9", "']' at token 1 closes no operator"),
        ("[MAX 2 9 ] ]\t9", "token ']' at 5 follows the end of the expression"),
        ("[MAX 2 9 ] 4\t9", "token '4' at 5 follows the end of the expression"),
        ("[MAX ]\t9", "the operator closed at token 2 has no arguments"),
        ("( [MAX 2 9 ]\t9", "1 '(' left open at the end"),
        ("[MAX 2 9 ] )\t9", "')' at token 5 closes no '('"),
        # A label that is not the expression's value (by hand: max(2, 9) = 9; the
        # release's bracketed form of [MED 1 5 2 9 ], whose median rounds down to 3).
        ("[MAX 2 9 ]\t4", "Target 4 is not the value of its Source, 9"),
        ("( ( ( ( [MED 1 ) 5 ) 2 ) 9 ) ]\t4", "Target 4 is not the value of its Source, 3"),
    ],
)
def test_malformed_release_line_names_file_and_line(fixtures_dir, tmp_path, bad_line, message):
    manual = tmp_path / "manual"
    shutil.copytree(os.path.join(fixtures_dir, "listops"), manual)
    path = manual / "basic_val.tsv"
    with open(path, "a") as f:
        f.write(bad_line + "\n")
    b = builders.make_builder(
        "listops",
        builders.make_config("listops", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    from tensorflow_datasets.core.download import DownloadConfig

    with pytest.raises(builders.MalformedFileError) as err:
        b.download_and_prepare(
            file_format="array_record", download_config=DownloadConfig(manual_dir=str(manual))
        )
    assert f"{path}:3: " in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize("content", ["", "Source\tTarget\n"])
def test_a_release_file_without_examples_is_named(fixtures_dir, tmp_path, content):
    manual = tmp_path / "manual"
    shutil.copytree(os.path.join(fixtures_dir, "listops"), manual)
    path = manual / "basic_train.tsv"
    path.write_text(content)
    b = builders.make_builder(
        "listops",
        builders.make_config("listops", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    from tensorflow_datasets.core.download import DownloadConfig

    with pytest.raises(builders.MalformedFileError, match="no examples") as err:
        b.download_and_prepare(
            file_format="array_record", download_config=DownloadConfig(manual_dir=str(manual))
        )
    assert str(err.value).startswith(f"{path}:1: ")


def test_missing_release_files_message(tmp_path):
    b = builders.make_builder(
        "listops",
        builders.make_config("listops", source="release"),
        data_dir=str(tmp_path / "data"),
    )
    from tensorflow_datasets.core.download import DownloadConfig

    (tmp_path / "manual").mkdir()
    with pytest.raises(builders.MissingFilesError) as err:
        b.download_and_prepare(
            file_format="array_record",
            download_config=DownloadConfig(manual_dir=str(tmp_path / "manual")),
        )
    text = str(err.value)
    for name in (
        "basic_train.tsv",
        "basic_val.tsv",
        "basic_test.tsv",
        str(tmp_path / "manual"),
        builders.LRA_RELEASE_URL,
        "listops-1000",
    ):
        assert name in text


def _brute_force_count(max_depth: int, max_args: int, max_length: int) -> dict[int, int]:
    """{length: number of distinct trees} by enumerating every tree (small sizes only)."""

    def trees(depth: int) -> list[tuple[str, ...]]:
        out = [(str(d),) for d in range(10)]
        if depth < max_depth:
            children = trees(depth + 1)
            children = [c for c in children if len(c) < max_length]
            for k in range(2, max_args + 1):
                combos = [()]
                for _ in range(k):
                    combos = [
                        a + b for a in combos for b in children if len(a) + len(b) < max_length
                    ]
                for op in vocab.LISTOPS_OPERATORS:
                    out += [(op, *body, "]") for body in combos if len(body) + 2 < max_length]
        return out

    counts: dict[int, int] = {}
    for tree in set(trees(1)):
        counts[len(tree)] = counts.get(len(tree), 0) + 1
    return counts


def test_expression_count_matches_enumeration():
    for depth, args, top in ((3, 2, 11), (2, 4, 8)):  # nested operators; wide operators
        by_length = _brute_force_count(max_depth=depth, max_args=args, max_length=top)
        for low, high in ((0, top), (3, 6), (4, top), (0, 2), (5, 7)):
            params = listops_generator.ListOpsParams(
                min_length=low, max_length=high, max_depth=depth, max_args=args
            )
            expected = sum(n for length, n in by_length.items() if low < length < high)
            assert listops_generator.count_expressions(params) == expected, (depth, low, high)
    # Lengths 3 < n < 5 allow only [OP d d ]: 4 operators x 100 digit pairs.
    lra = listops_generator.ListOpsParams(min_length=3, max_length=5)
    assert listops_generator.count_expressions(lra) == 400


def test_sizes_that_cannot_be_met_fail_fast():
    import time

    start = time.perf_counter()
    params = listops_generator.ListOpsParams(min_length=3, max_length=5)
    with pytest.raises(ValueError, match=r"cannot give 500 distinct examples \(500 train\)"):
        list(listops_generator.generate_split(params, seed=0, split="train", num_examples=500))
    with pytest.raises(ValueError, match="only 400 such expressions exist"):
        builders.make_config("listops", num_train=500, min_length=3, max_length=5)
    assert time.perf_counter() - start < 10.0
    # 400 of the 400 possible can still be drawn (every draw of this shape is accepted
    # after a few rejections), so the bound is exact rather than a guess.
    got = list(listops_generator.generate_split(params, seed=0, split="train", num_examples=400))
    assert len({ids.tobytes() for _, ids, _ in got}) == 400


def test_prepare_command_reports_a_malformed_release_row_in_one_line(fixtures_dir, tmp_path):
    manual = tmp_path / "manual"
    shutil.copytree(os.path.join(fixtures_dir, "listops"), manual)
    with open(manual / "basic_train.tsv", "a") as f:
        f.write("[MAX 2 9\t9\n")
    proc = run_in_checkout(
        "-m",
        "lra.prepare",
        "--task=listops",
        "--source=release",
        f"--manual_dir={manual}",
        f"--data_dir={tmp_path / 'data'}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {manual / 'basic_train.tsv'}:4: 1 operator(s) left open at the end (missing ']')"
    ], proc.stderr[-2000:]


def _listops_config(data_dir: str, **task):
    from sbm_jax.training.cli import load_config_file

    config = load_config_file(
        os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lra", "listops.py")
        + ":full,smoke"
    )
    config.task.data_dir = data_dir
    for key, value in task.items():
        config.task[key] = value
    return config


def test_a_prepared_dataset_named_by_data_config_is_the_one_read(small_listops_dir, capsys):
    """source='generated' with task.data_config naming a dataset lra.prepare made: that
    dataset is read (and said so), nothing else is generated; a name that is not
    prepared is refused by the config check, naming the field and what is there."""
    from lra import input_pipeline, train_task

    data_dir, name = small_listops_dir
    before = input_pipeline.prepared_configs(data_dir, "listops")
    config = _listops_config(data_dir, data_config=name, max_length=64)
    config.model.max_len = 64
    train_task.check_config("listops", config)
    sources = train_task.open_sources("listops", config)
    assert len(sources["train"]) == 37 and len(sources["test"]) == 5  # its sizes
    assert f"task.data_config={name!r}: training on that prepared listops dataset" in (
        capsys.readouterr().out
    )
    assert input_pipeline.prepared_configs(data_dir, "listops") == before
    with pytest.raises(ValueError, match="task.data_config='nope': no prepared LRA 'listops'"):
        train_task.check_config("listops", _listops_config(data_dir, data_config="nope"))
    mock = _listops_config(data_dir, data_config=name, source="mock")
    with pytest.raises(ValueError, match="does not apply to task.source='mock'"):
        train_task.check_config("listops", mock)
