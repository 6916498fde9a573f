"""Shared pieces of the LRA builders: release-file lookup, strict TSV reading, catalog access."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow_datasets as tfds

LRA_RELEASE_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"


class MissingFilesError(FileNotFoundError):
    """Release files needed by a builder are not where they should be."""


class MalformedFileError(ValueError):
    """A line of a release file cannot be parsed; the message names file and line."""

    def __init__(self, path: str | os.PathLike, line: int, problem: str):
        self.path = os.fspath(path)
        self.line = line
        super().__init__(f"{self.path}:{line}: {problem}")


def locate_release_files(
    task: str,
    manual_dir: str | os.PathLike | None,
    filenames: Sequence[str],
    release_subdir: str,
) -> dict[str, str]:
    """Finds release files in `manual_dir` or in its `lra_release/<release_subdir>` copy.

    Returns:
      {filename: absolute path}.

    Raises:
      MissingFilesError: listing every missing file, where to put it and where to get it.
    """
    manual = os.path.abspath(os.path.expanduser(os.fspath(manual_dir))) if manual_dir else None
    candidates = []
    if manual:
        candidates = [
            manual,
            os.path.join(manual, release_subdir),
            os.path.join(manual, "lra_release", release_subdir),
        ]
    for directory in candidates:
        paths = {name: os.path.join(directory, name) for name in filenames}
        if all(os.path.isfile(p) for p in paths.values()):
            return paths
    where = manual or "<manual_dir> (pass --manual_dir=DIR)"
    found_some = [
        os.path.join(d, n)
        for d in candidates
        for n in filenames
        if os.path.isfile(os.path.join(d, n))
    ]
    lines = [
        f"LRA {task}: release files not found.",
        f"Put these files in {where}:",
        *(f"  {name}" for name in filenames),
        f"(or keep the release layout: {where}/lra_release/{release_subdir}/<file>).",
        f"Get them from the LRA release archive {LRA_RELEASE_URL} "
        f"(tar xzf lra_release.gz; they are in lra_release/{release_subdir}/).",
    ]
    if found_some:
        lines.append("Found only: " + ", ".join(found_some))
    raise MissingFilesError("\n".join(lines))


def iter_tsv(
    path: str | os.PathLike, num_columns: int, *, header: Sequence[str] | None = None
) -> Iterator[tuple[int, list[bytes]]]:
    """Yields (1-based line number, fields as bytes) of a tab-separated file.

    No quoting is interpreted (as the reference pipelines read these files).  A header
    row, if given, must be the first line and is checked and skipped.  A trailing
    carriage return is dropped; blank lines at the end of the file are ignored.

    Raises:
      MalformedFileError: wrong header or column count, naming file and line.
    """
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        line = raw[:-1] if raw.endswith(b"\r") else raw
        fields = line.split(b"\t")
        if number == 1 and header is not None:
            got = [f.decode("utf-8", "replace").strip() for f in fields]
            if got[: len(header)] != list(header) or len(fields) != num_columns:
                raise MalformedFileError(path, number, f"expected header {list(header)}, got {got}")
            continue
        if len(fields) != num_columns:
            raise MalformedFileError(
                path, number, f"expected {num_columns} tab-separated columns, got {len(fields)}"
            )
        yield number, fields


def require_examples(examples: Iterator[Any], path: str | os.PathLike) -> Iterator[Any]:
    """``examples`` (a builder's generator over the rows of ``path``) as they come; a
    file with no example at all (empty, or only its header) raises
    ``MalformedFileError`` naming it. TFDS would stop at the end of the split with
    "No examples were yielded", naming neither the file nor the cause."""
    count = 0
    for example in examples:
        count += 1
        yield example
    if not count:
        raise MalformedFileError(path, 1, "no examples (the file is empty or holds only a header)")


def parse_label(
    raw: bytes, num_classes: int, path: str | os.PathLike, line: int, column: str
) -> int:
    """Parses an integer class label ("1"; "1.0" as the AAN files write it)."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        value = float(text)
    except ValueError:
        raise MalformedFileError(path, line, f"{column} {text!r} is not an integer") from None
    if not value.is_integer():
        raise MalformedFileError(path, line, f"{column} {text!r} is not an integer")
    label = int(value)
    if not 0 <= label < num_classes:
        raise MalformedFileError(path, line, f"{column} {label} is outside 0..{num_classes - 1}")
    return label


def manual_dir_of(dl_manager: tfds.download.DownloadManager) -> str | None:
    """The manual dir path, without TFDS's generic "missing or empty" assertion.

    Our builders check their own files and say exactly which are missing, so they read
    the configured path directly (TFDS 4.9 keeps it in `_manual_dir`).
    """
    path = getattr(dl_manager, "_manual_dir", None)
    return os.fspath(path) if path else None


def open_catalog_split(name: str, split: str, data_dir: str | os.PathLike | None) -> Any:
    """A random-access source of a TFDS catalog dataset split (array_record, no TF needed).

    The dataset is prepared in `data_dir` first if it is not there yet (that step is
    TFDS's own and downloads the public data).
    """
    return tfds.data_source(name, split=split, data_dir=data_dir, download=True)


def catalog_split_generators(
    builder: Any, catalog_name: str, catalog_splits: dict[str, str]
) -> dict[str, Any]:
    """``_split_generators`` of a builder that re-encodes a TFDS catalog dataset.

    Each of our splits maps to a catalog split (slicing allowed, e.g. ``train[:45000]``);
    the catalog is read from the builder's ``_catalog_data_dir`` or its own data dir.
    """
    data_dir = builder._catalog_data_dir or builder._data_dir_root
    return {
        split: builder._generate_examples(
            source=open_catalog_split(catalog_name, catalog_split, data_dir), split=split
        )
        for split, catalog_split in catalog_splits.items()
    }
