"""The format's versions and constants, and the names of step directories and shard files."""

from __future__ import annotations

import re
import secrets

FORMAT = "aiockpt"
#: The version a checkpoint without distributed tensors is written as: exactly version 1, so
#: readers of version 1 keep reading it.
VERSION = 1
#: The version of a checkpoint with distributed tensors (its ``dtensors`` table and "X" tree
#: nodes), numpy values or torch generators (tree.V2_TAGS); a version-1 reader refuses it by
#: its version.
DTENSOR_VERSION = 2
#: The version of a checkpoint some of whose shard bytes are stored elsewhere than in the
#: shard's own file, or out of order in it (a block table, see blocks.py); a reader of
#: versions 1-2 refuses it by its version.
REFS_VERSION = 3
#: The version every save writes: shard files are named by the attempt that wrote them
#: (:func:`shard_filename`), so no later write can produce a name a manifest refers to; a
#: block may then refer to another file of its own step's directory (a step number reused
#: after a rewind). A reader of versions 1-3 refuses it by its version.
NAMES_VERSION = 4
VERSIONS = (VERSION, DTENSOR_VERSION, REFS_VERSION, NAMES_VERSION)
MANIFEST = "manifest.json"
#: The data section of a shard starts on this boundary, so the slab can be written with O_DIRECT.
ALIGN = 4096
#: A header larger than this is refused before it is read (20k tensors need about 2 MiB).
MAX_HEADER_BYTES = 256 * 1024 * 1024
MAX_NDIM = 64
#: The name of the padding tensor that keeps the first DTensor chunk of a shard aligned when
#: the plain tensors before it end off its item size: a NUL never appears in a key path.
PAD_NAME = "\x00pad"

# re.ASCII: without it \d also matches other scripts' digits, and int() accepts them, so a
# name like "step_" + twelve Arabic-Indic digits would pass as a step directory.
_STEP_DIR = re.compile(r"step_(\d{12})", re.ASCII)
#: A shard file's name: the rank, then (version 4) the tag of the attempt that wrote it.
_SHARD_FILE = re.compile(r"shard_r(\d{5})(?:\.([0-9a-f]{16}))?\.safetensors", re.ASCII)
#: The hex digits of a write's tag: 64 random bits, so two attempts never draw the same one.
TAG_DIGITS = 16


def step_dirname(step: int) -> str:
    """The name of step ``step``'s directory: zero-padded, so names sort as steps do."""
    return f"step_{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a step directory's name, or None when the name is not one."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_filename(rank: int, tag: str | None = None) -> str:
    """The file name of rank ``rank``'s shard as written by the attempt ``tag``
    (:func:`new_tag`); without a tag, the name versions 1 to 3 gave every attempt."""
    if tag is None:
        return f"shard_r{rank:05d}.safetensors"
    return f"shard_r{rank:05d}.{tag}.safetensors"


def new_tag() -> str:
    """A fresh attempt tag: the names a write makes with it are its own, whatever step, rank,
    writer or retry wrote before (a rewound step, a fenced writer, a copy)."""
    return secrets.token_hex(TAG_DIGITS // 2)


def parse_shard_filename(name: str) -> tuple[int, str | None] | None:
    """The rank and tag (None for an untagged name) of a shard file's name, or None when the
    name is not one."""
    m = _SHARD_FILE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align
